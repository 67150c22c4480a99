"""Lowering: one fused group (an fx sub-graph) -> one PointwiseKernel (fusec.ir).

This is where every decision about a kernel is made, so the backends only have to spell it:

* the iteration space: the group's output shape, visited in the memory order of its first output;
* each input's index expression: its Layout (root buffer, shape, strides, offset) broadcast to the
  iteration space, so a transposed, sliced or expanded input costs nothing extra;
* dim merging: two neighbouring dims that are laid out back to back in *every* tensor the kernel
  touches become one dim, so `x + y` over contiguous (64, 1024) tensors is a flat 65536-element
  loop with `offsets` as the only index;
* dtypes: each statement converts its operands to the dtype PyTorch's type promotion picks
  (fusec.ops.compute_dtype) and converts the result to the dtype the value keeps in registers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from fusec import ops
from fusec.record import group_info
from fusec.ir import (Const, Index, Layout, Load, Param, PointwiseKernel, Stmt, Store, TensorMeta,
                      Var)


def lower_pointwise(name: str, sub: fx.GraphModule, in_layouts: list[Layout],
                    out_layouts: list[Layout], root_dtypes: dict[str, torch.dtype]) -> PointwiseKernel:
    """Build the kernel IR for the group `sub`, reading inputs laid out as `in_layouts` and
    writing outputs laid out as `out_layouts` (both in the order of sub's placeholders/outputs)."""
    shape = tuple(group_info(sub).shape)
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    outputs = list(sub.graph.output_node().args[0])
    # horizontally fused kernels: some tensors are walked with their dims permuted
    perms = group_info(sub).perms
    in_layouts = [_permuted(l, perms.get(ph.name)) for ph, l in zip(placeholders, in_layouts)]
    out_layouts = [_permuted(l, perms.get(o.name)) for o, l in zip(outputs, out_layouts)]

    pieces = cat_pieces(sub, placeholders, in_layouts, shape)
    only_pieces = {p.index for p in pieces} - {i for i, ph in enumerate(placeholders)
                                               if any(not is_cat(u) for u in ph.users)}
    # An indexed write (`cache[:, :, pos] = k`, passes/grouping.py): the loop runs over k, and the
    # output is the buffer, seen over k's shape (its strides; the dim written has k's size 1),
    # plus pos * stride, added by the store. The buffer itself is never read.
    writes = {k: ops.indexed_write(o) for k, o in enumerate(outputs) if ops.indexed_write(o) is not None}
    only_pieces |= {placeholders.index(w[0]) for w in writes.values()
                    if all(ops.indexed_write(u) is not None and u.args[0] is w[0] for u in w[0].users)}
    out_layouts = [Layout(l.root, tuple(shape[len(shape) - len(l.shape):]), l.stride, l.offset)
                   if k in writes else l for k, l in enumerate(out_layouts)]
    # A gathered read (`scales[g_idx]`, fusec.ops.gathered_read): its index is read at each
    # position, and its source at the row the index names (Load's `gather`). Both are indexed
    # over the read's output, laid into the space; read only that way, they get no plain load.
    gathers = [(n, g, *gather_layouts(g, placeholders, in_layouts)) for n in sub.graph.nodes
               if (g := ops.gathered_read(n)) is not None]
    only_pieces |= only_gathered(placeholders)
    tensors = [broadcast_strides(l, shape) if i not in only_pieces else (0,) * len(shape)
               for i, l in enumerate(in_layouts)] + \
              [broadcast_strides(l, shape) for l in out_layouts] + \
              [p.strides for p in pieces] + [p.sentinel for p in pieces] + \
              [broadcast_strides(l, shape) for _, _, src, idx, _ in gathers for l in (src, idx)]
    order = loop_order(tensors[len(in_layouts)] if out_layouts else tensors[0], shape)
    loop_shape, loop_strides = coalesce(tuple(shape[d] for d in order),
                                        [tuple(t[d] for d in order) for t in tensors])
    n_in = len(in_layouts)

    params: list[Param] = []
    param = param_list(params, root_dtypes)

    env: dict[fx.Node, Var] = {}
    loads: list[Load] = []
    load_of: dict[tuple, Var] = {}
    n_out = len(out_layouts)
    piece_strides = loop_strides[n_in + n_out:n_in + n_out + len(pieces)]
    sentinels = loop_strides[n_in + n_out + len(pieces):n_in + n_out + 2 * len(pieces)]
    gather_strides = loop_strides[n_in + n_out + 2 * len(pieces):]
    for cat in dict.fromkeys(p.cat for p in pieces):  # each piece read where it lies
        mine = [(p, st, se) for p, st, se in zip(pieces, piece_strides, sentinels) if p.cat is cat]
        other = None
        for piece, strides, sentinel in reversed(mine):
            layout = in_layouts[piece.index]
            storage = root_dtypes[layout.root]
            var = Var(f"v{len(loads)}_{ident(cat.name)}_{piece.position}",
                      ops.register_dtype(storage))
            # (an empty space coalesces to no dim with a stride: nothing is read, any dim does)
            dim = next((k for k, s in enumerate(sentinel) if s), 0)
            loads.append(Load(var, param(layout.root, False), storage,
                              Index(piece.offset, strides), (dim, piece.lo, piece.hi), other))
            other = var
        env[cat] = other
    for i, (ph, layout) in enumerate(zip(placeholders, in_layouts)):
        if i in only_pieces:
            continue
        index = Index(layout.offset, loop_strides[i])
        key = (layout.root, index)
        if key not in load_of:
            storage = root_dtypes[layout.root]
            var = Var(f"v{len(loads)}_{ident(ph.name)}", ops.register_dtype(storage))
            loads.append(Load(var, param(layout.root, False), storage, index))
            load_of[key] = var
        env[ph] = load_of[key]

    for k, (node, gather, src, idx, row_stride) in enumerate(gathers):
        index = Index(idx.offset, gather_strides[2 * k + 1])
        key = (idx.root, index)
        if key not in load_of:
            storage = root_dtypes[idx.root]
            load_of[key] = Var(f"v{len(loads)}_{ident(gather.index.name)}",
                               ops.register_dtype(storage))
            loads.append(Load(load_of[key], param(idx.root, False), storage, index))
        storage = root_dtypes[src.root]
        env[node] = Var(f"v{len(loads)}_{ident(node.name)}", ops.register_dtype(storage))
        loads.append(Load(env[node], param(src.root, False), storage,
                          Index(src.offset, gather_strides[2 * k]),
                          gather=(load_of[key].name, row_stride, gather.size)))

    stmts: list[Stmt] = []
    fused_ops: list[str] = []
    for node in sub.graph.nodes:
        if node.op != "call_function":
            continue
        if node in env:  # a cat (its pieces' loads) or a gathered read (its load)
            fused_ops.append(str(node.target))
            continue
        if ops.indexed_write(node) is not None:  # the store does it (below)
            env[node] = env[node.args[2]]
            fused_ops.append(str(node.target))
            continue
        row, operands = ops.normalize(node)
        out_meta: TensorMeta = node.meta["fusec"]
        values = [o.meta["val"] if isinstance(o, fx.Node) else o for o in operands]
        compute = ops.compute_dtype(row, values, out_meta.dtype)
        operand_dtypes = tuple(torch.bool if row.name == "where" and k == 0 else compute
                               for k in range(len(operands)))
        args = tuple(env[o] if isinstance(o, fx.Node) else Const(o, dt)
                     for o, dt in zip(operands, operand_dtypes))
        var = Var(f"v{len(loads) + len(stmts)}_{ident(node.name)}",
                  ops.register_dtype(out_meta.dtype))
        rounds = needs_rounding(row, values, out_meta.dtype)  # eager rounds every half result
        stmts.append(Stmt(var, row.name, args, operand_dtypes,
                          torch.bool if row.returns_bool else compute,
                          out_meta.dtype if rounds else None, origin=origin_of(node)))
        env[node] = var
        fused_ops.append(str(node.target))

    stores = []
    for k, (out, layout) in enumerate(zip(outputs, out_layouts)):
        index = Index(layout.offset, loop_strides[n_in + k])
        storage = root_dtypes[layout.root]
        scatter = None
        if k in writes:
            buffer, dim, pos, _ = writes[k]
            size, stride = buffer.meta["fusec"].shape[dim], layout.stride[dim]
            scatter = (env[pos].name, stride, size)
        stores.append(Store(param(layout.root, True), env[out], storage, index, scatter))

    return PointwiseKernel(name, loop_shape, shape, params, loads, stmts, stores, fused_ops)


@dataclass(frozen=True)
class Piece:
    """One piece of a concatenation in a kernel: placeholder `index`, the `position`-th piece of
    `cat`, covering positions [lo, hi) of the output along the cat's dim. `strides` and `offset`
    index it over the output's iteration space (offset shifted back by lo along the dim, so
    output position i reads piece element i - lo). `sentinel` has a stride only along the dim:
    coalescing, which merges dims contiguous in every tensor, then keeps the dim a loop dim of
    its own, whose coordinate the kernel compares with lo and hi."""

    cat: fx.Node
    position: int
    index: int
    lo: int
    hi: int
    strides: tuple[int, ...]
    offset: int
    sentinel: tuple[int, ...]


def cat_pieces(sub: fx.GraphModule, placeholders: list, in_layouts: list[Layout],
               shape: tuple[int, ...], cats=None) -> list[Piece]:
    """The pieces of every concatenation in the group, in order (see `Piece`).

    `torch.cat([a, b], dim=-1)` as a kernel: output position i along the dim is a[..., i] for
    i < len(a) and b[..., i - len(a)] after. Each piece is loaded only where it covers the
    position (a masked load), and the pieces' loads are chained, each taking the next one's
    value where it does not read, so one value holds the concatenation, and no copy of it is
    made in memory. `cats`: only these (default: every cat of the group)."""
    pieces = []
    for cat in sub.graph.nodes:
        if not is_cat(cat) or (cats is not None and cat not in cats):
            continue
        # The cat's dim counts in the cat's own rank; the iteration space may have more dims
        # in front (a (N, K) cat multiplied by an (M, 1, K) tensor runs over (M, N, K)).
        rank = len(cat.meta["fusec"].shape)
        own = (cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)) % rank
        dim = own + len(shape) - rank
        sentinel = tuple(1 if d == dim else 0 for d in range(len(shape)))
        lo = 0
        for position, ph in enumerate(cat.args[0]):
            layout = in_layouts[placeholders.index(ph)]
            size = ph.meta["fusec"].shape[own]
            piece_dim = own + len(layout.shape) - rank
            full = Layout(layout.root, tuple(shape[dim] if d == piece_dim else s
                                             for d, s in enumerate(layout.shape)),
                          layout.stride, layout.offset)
            strides = broadcast_strides(full, shape)
            pieces.append(Piece(cat, position, placeholders.index(ph), lo, lo + size, strides,
                                layout.offset - lo * strides[dim], sentinel))
            lo += size
    return pieces


def gather_layouts(gather: ops.Gather, placeholders: list, in_layouts: list[Layout]):
    """(source, index, row stride) of a gathered read: source and index as Layouts over the
    read's output shape. The source's picked dim becomes the index's dims, at stride 0 (the load
    adds the picked row times the row stride: Load's `gather`), and the index gets the source's
    other dims, at stride 0.

        scales (4, 96), g_idx (256,)  ->  source (1, 96) strides (0, 1), index (256, 1) strides (1, 0)
    """
    src = in_layouts[placeholders.index(gather.source)]
    idx = in_layouts[placeholders.index(gather.index)]
    d, n = gather.dim, len(idx.shape)
    lead, tail = src.shape[:d], src.shape[d + 1:]
    source = Layout(src.root, lead + (1,) * n + tail,
                    src.stride[:d] + (0,) * n + src.stride[d + 1:], src.offset)
    index = Layout(idx.root, (1,) * len(lead) + idx.shape + (1,) * len(tail),
                   (0,) * len(lead) + idx.stride + (0,) * len(tail), idx.offset)
    return source, index, src.stride[d]


def only_gathered(placeholders: list) -> set[int]:
    """The placeholders read only as a gathered read's source or index (no plain load)."""
    def gathered(ph: fx.Node) -> bool:
        return bool(ph.users) and all((g := ops.gathered_read(u)) is not None
                                      and any(ph is x for x in (g.source, g.index))
                                      for u in ph.users)
    return {i for i, ph in enumerate(placeholders) if gathered(ph)}


def is_cat(node: fx.Node) -> bool:
    """A concatenation of several pieces (a cat of one is a copy: the op table's row)."""
    return node.op == "call_function" and node.target is torch.ops.aten.cat.default \
        and ops.normalize(node) is None


def needs_rounding(row: ops.Op, values: list, dtype: torch.dtype) -> bool:
    """Does a half-precision result need rounding (eager rounds every op's result)? Not a cast
    from a small integer: int8, uint8 and bool values are exact in float16 and bfloat16, so an
    int8 weight's `.to(torch.bfloat16)` costs nothing in a dequantization prologue. Nor a copy
    of a value of the same dtype (`clone`, `repeat_interleave`'s copy of fp16 scales): every
    half-precision value of a kernel is already rounded where it is made or loaded."""
    if dtype not in ops.FLOAT16_LIKE:
        return False
    return not (row.name in ("to", "copy") and isinstance(values[0], torch.Tensor)
                and values[0].dtype in (torch.int8, torch.uint8, torch.bool, dtype))


def param_list(params: list[Param], root_dtypes: dict):
    """A function that adds a root buffer to the kernel's pointer arguments once, in first-use
    order, and returns its name."""
    def param(root: str, is_output: bool) -> str:
        if all(p.name != root for p in params):
            params.append(Param(root, root_dtypes[root], is_output))
        return root
    return param


def _permuted(layout: Layout, perm) -> Layout:
    if not perm:
        return layout
    return Layout(layout.root, tuple(layout.shape[p] for p in perm),
                  tuple(layout.stride[p] for p in perm), layout.offset)


def ident(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def origin_of(node: fx.Node) -> str:
    args = ", ".join(a.name if isinstance(a, fx.Node) else repr(a) for a in node.args)
    return f"{node.name} = {node.target}({args})"


def broadcast_strides(layout: Layout, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of `layout` seen over iteration space `shape` (right-aligned, broadcast dims 0)."""
    pad = len(shape) - len(layout.shape)
    if pad < 0:
        raise AssertionError(f"layout {layout.shape} is larger than the iteration space {shape}")
    strides = []
    for d, size in enumerate(shape):
        j = d - pad
        if j < 0 or layout.shape[j] == 1:
            strides.append(0)
        elif layout.shape[j] == size:
            strides.append(layout.stride[j])
        else:
            raise AssertionError(f"layout {layout.shape} does not broadcast to {shape}")
    return tuple(strides)


def loop_order(strides: tuple[int, ...], shape: tuple[int, ...]) -> list[int]:
    """Visit dims in the memory order of `strides` (the first output's): largest stride outermost.

    sin(x.t()) keeps eager's transposed output layout, so iterating in that order makes the store
    contiguous (and the load of x too) instead of striding through memory on every step.

    >>> loop_order((1, 64), (64, 32))
    [1, 0]
    """
    return sorted(range(len(shape)), key=lambda d: -strides[d] if shape[d] != 1 else 0)


def coalesce(shape: tuple[int, ...], tensors: list[tuple[int, ...]]):
    """Drop size-1 dims and merge neighbouring dims that are contiguous in every tensor.

    Returns (loop_shape, per-tensor loop strides). The loop shape has at least one dim.

    >>> coalesce((4, 8), [(8, 1), (0, 1)])     # x (4, 8) contiguous, bias (8,) broadcast
    ((4, 8), [(8, 1), (0, 1)])
    >>> coalesce((4, 8), [(8, 1), (8, 1)])
    ((32,), [(1,), (1,)])
    """
    if 0 in shape:
        return (0,), [(0,) for _ in tensors]
    dims = [d for d, size in enumerate(shape) if size != 1]
    sizes: list[int] = []
    strides: list[list[int]] = [[] for _ in tensors]
    for d in dims:
        if sizes and all(t[d] * shape[d] == s[-1] for t, s in zip(tensors, strides)):
            sizes[-1] *= shape[d]
            for t, s in zip(tensors, strides):
                s[-1] = t[d]
            continue
        sizes.append(shape[d])
        for t, s in zip(tensors, strides):
            s.append(t[d])
    if not sizes:
        return (1,), [(0,) for _ in tensors]
    return tuple(sizes), [tuple(s) for s in strides]

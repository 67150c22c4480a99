"""Lowering: one fused group (an fx sub-graph) -> one PointwiseKernel (fusec.ir).

Why this file is long: besides the pointwise lowering (its steps, one helper each), it holds the
index helpers that lower_reduction.py shares (cat pieces, gathered reads, broadcast strides, dim
merging), which the docs and tests name as living here.

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

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.fx as fx

from fusec import ops
from fusec.record import group_info
from fusec.symbolic import hint, is_symbolic, text
from fusec.sizes import equal_if_so, is_one
from fusec.ir import (Const, Index, Layout, Load, Param, PointwiseKernel, Stmt, Store, TensorMeta,
                      Var)


def lower_pointwise(name: str, sub: fx.GraphModule, in_layouts: list[Layout],
                    out_layouts: list[Layout], root_dtypes: dict[str, torch.dtype]) -> PointwiseKernel:
    """Build the kernel IR for the group `sub`, reading inputs laid out as `in_layouts` and
    writing outputs laid out as `out_layouts` (both in the order of sub's placeholders/outputs).
    The steps: what the group reads and writes, the loop and each tensor's strides over it, the
    loads (cat pieces, plain inputs, gathered reads), the statements, the stores."""
    group = _group_tensors(sub, in_layouts, out_layouts)
    loop_shape, strides = _loop_space(group)
    lw = _Lowering(root_dtypes)
    _load_pieces(lw, group, strides)
    _load_inputs(lw, group, strides)
    _load_gathers(lw, group, strides)
    fused_ops = _lower_stmts(lw, sub)
    stores = _stores(lw, group, strides)
    return PointwiseKernel(name, loop_shape, group.shape, lw.params, lw.loads, lw.stmts, stores,
                           fused_ops)


class _Group(NamedTuple):
    """What a pointwise group reads and writes: its space, placeholders and outputs with their
    layouts (permuted where a horizontally fused tensor is walked so), its cats' pieces, its
    indexed writes (by output), its gathered reads, and the placeholders with no plain load."""

    shape: tuple[int, ...]
    placeholders: list[fx.Node]
    outputs: list[fx.Node]
    in_layouts: list[Layout]
    out_layouts: list[Layout]
    pieces: list[Piece]
    writes: dict[int, tuple]
    gathers: list[tuple]  # (node, gather, source layout, index layout, row stride)
    only_pieces: set[int]


def _group_tensors(sub: fx.GraphModule, in_layouts: list[Layout],
                   out_layouts: list[Layout]) -> _Group:
    """The tensors of the group and how each is read or written (see `_Group`)."""
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
    return _Group(shape, placeholders, outputs, in_layouts, out_layouts, pieces, writes, gathers,
                  only_pieces)


class _LoopStrides(NamedTuple):
    """Each tensor's strides over the loop's (merged) dims, by the part of the group it is."""

    inputs: list[tuple[int, ...]]  # by placeholder (all 0 for one with no plain load)
    outputs: list[tuple[int, ...]]
    pieces: list[tuple[int, ...]]
    sentinels: list[tuple[int, ...]]  # by piece: a stride only along the cat's dim
    gathers: list[tuple[int, ...]]  # by gathered read: its source's, then its index's


def _loop_space(group: _Group) -> tuple[tuple[int, ...], _LoopStrides]:
    """The loop: the space's dims in the memory order of the first output (`loop_order`),
    merged where every tensor allows it (`coalesce`), and each tensor's strides over it."""
    shape, in_layouts, out_layouts, pieces = group.shape, group.in_layouts, group.out_layouts, \
        group.pieces
    tensors = [broadcast_strides(l, shape) if i not in group.only_pieces else (0,) * len(shape)
               for i, l in enumerate(in_layouts)] + \
              [broadcast_strides(l, shape) for l in out_layouts] + \
              [p.strides for p in pieces] + [p.sentinel for p in pieces] + \
              [broadcast_strides(l, shape) for _, _, src, idx, _ in group.gathers
               for l in (src, idx)]
    order = loop_order(tensors[len(in_layouts)] if out_layouts else tensors[0], shape)
    loop_shape, loop_strides = coalesce(tuple(shape[d] for d in order),
                                        [tuple(t[d] for d in order) for t in tensors])
    n_in, n_out, n_pieces = len(in_layouts), len(out_layouts), len(pieces)
    at = n_in + n_out
    return loop_shape, _LoopStrides(loop_strides[:n_in], loop_strides[n_in:at],
                                    loop_strides[at:at + n_pieces],
                                    loop_strides[at + n_pieces:at + 2 * n_pieces],
                                    loop_strides[at + 2 * n_pieces:])


@dataclass
class _Lowering:
    """What lowering a pointwise group builds: the kernel's params, loads and statements, and
    the Var that holds each node's value (a Var is numbered by its position in the kernel)."""

    root_dtypes: dict[str, torch.dtype]
    params: list[Param] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    load_of: dict[tuple, Var] = field(default_factory=dict)  # (root, index) -> its load's Var
    env: dict[fx.Node, Var] = field(default_factory=dict)
    stmts: list[Stmt] = field(default_factory=list)

    def __post_init__(self):
        self.param = param_list(self.params, self.root_dtypes)


def _load_pieces(lw: _Lowering, group: _Group, strides: _LoopStrides) -> None:
    """Each cat's pieces, each read where it lies (a masked load), chained from the last piece
    to the first so one Var holds the whole cat (see `cat_pieces`)."""
    for cat in dict.fromkeys(p.cat for p in group.pieces):
        mine = [(p, st, se) for p, st, se in zip(group.pieces, strides.pieces, strides.sentinels)
                if p.cat is cat]
        other = None
        for piece, piece_strides, sentinel in reversed(mine):
            layout = group.in_layouts[piece.index]
            storage = lw.root_dtypes[layout.root]
            var = Var(f"v{len(lw.loads)}_{ident(cat.name)}_{piece.position}",
                      ops.register_dtype(storage))
            # (an empty space coalesces to no dim with a stride: nothing is read, any dim does)
            dim = next((k for k, s in enumerate(sentinel) if s), 0)
            lw.loads.append(Load(var, lw.param(layout.root, False), storage,
                                 Index(piece.offset, piece_strides), (dim, piece.lo, piece.hi),
                                 other))
            other = var
        lw.env[cat] = other


def _load_inputs(lw: _Lowering, group: _Group, strides: _LoopStrides) -> None:
    """A load per placeholder read plainly; two that read the same buffer at the same index
    share one."""
    for i, (ph, layout) in enumerate(zip(group.placeholders, group.in_layouts)):
        if i in group.only_pieces:
            continue
        index = Index(layout.offset, strides.inputs[i])
        key = (layout.root, index)
        if key not in lw.load_of:
            storage = lw.root_dtypes[layout.root]
            var = Var(f"v{len(lw.loads)}_{ident(ph.name)}", ops.register_dtype(storage))
            lw.loads.append(Load(var, lw.param(layout.root, False), storage, index))
            lw.load_of[key] = var
        lw.env[ph] = lw.load_of[key]


def _load_gathers(lw: _Lowering, group: _Group, strides: _LoopStrides) -> None:
    """Each gathered read: its index (once per address), then its source at the row the index
    names."""
    for k, (node, gather, src, idx, row_stride) in enumerate(group.gathers):
        index = Index(idx.offset, strides.gathers[2 * k + 1])
        key = (idx.root, index)
        if key not in lw.load_of:
            storage = lw.root_dtypes[idx.root]
            lw.load_of[key] = Var(f"v{len(lw.loads)}_{ident(gather.index.name)}",
                                  ops.register_dtype(storage))
            lw.loads.append(Load(lw.load_of[key], lw.param(idx.root, False), storage, index))
        storage = lw.root_dtypes[src.root]
        lw.env[node] = Var(f"v{len(lw.loads)}_{ident(node.name)}", ops.register_dtype(storage))
        lw.loads.append(Load(lw.env[node], lw.param(src.root, False), storage,
                             Index(src.offset, strides.gathers[2 * k]),
                             gather=(lw.load_of[key].name, row_stride, gather.size)))


def _lower_stmts(lw: _Lowering, sub: fx.GraphModule) -> list[str]:
    """A Stmt per op of the group, in graph order, with the dtypes PyTorch's promotion picks;
    returns the names of the ATen ops the kernel fuses."""
    fused_ops: list[str] = []
    for node in sub.graph.nodes:
        if node.op != "call_function":
            continue
        if node in lw.env:  # a cat (its pieces' loads) or a gathered read (its load)
            fused_ops.append(str(node.target))
            continue
        if ops.indexed_write(node) is not None:  # the store does it (below)
            lw.env[node] = lw.env[node.args[2]]
            fused_ops.append(str(node.target))
            continue
        row, operands = ops.normalize(node)
        out_meta: TensorMeta = node.meta["fusec"]
        values = [o.meta["val"] if isinstance(o, fx.Node) else o for o in operands]
        compute = ops.compute_dtype(row, values, out_meta.dtype)
        operand_dtypes = tuple(torch.bool if row.name == "where" and k == 0 else compute
                               for k in range(len(operands)))
        args = tuple(lw.env[o] if isinstance(o, fx.Node) else Const(o, dt)
                     for o, dt in zip(operands, operand_dtypes))
        var = Var(f"v{len(lw.loads) + len(lw.stmts)}_{ident(node.name)}",
                  ops.register_dtype(out_meta.dtype))
        rounds = needs_rounding(row, values, out_meta.dtype)  # eager rounds every half result
        lw.stmts.append(Stmt(var, row.name, args, operand_dtypes,
                             torch.bool if row.returns_bool else compute,
                             out_meta.dtype if rounds else None, origin=origin_of(node)))
        lw.env[node] = var
        fused_ops.append(str(node.target))
    return fused_ops


def _stores(lw: _Lowering, group: _Group, strides: _LoopStrides) -> list[Store]:
    """A store per output; an indexed write's adds its position times the written dim's stride."""
    stores = []
    for k, (out, layout) in enumerate(zip(group.outputs, group.out_layouts)):
        index = Index(layout.offset, strides.outputs[k])
        storage = lw.root_dtypes[layout.root]
        scatter = None
        if k in group.writes:
            buffer, dim, pos, _ = group.writes[k]
            size, stride = buffer.meta["fusec"].shape[dim], layout.stride[dim]
            scatter = (lw.env[pos].name, stride, size)
        stores.append(Store(lw.param(layout.root, True), lw.env[out], storage, index, scatter))
    return stores


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
    int8 weight's `.to(torch.bfloat16)` costs nothing in a matmul's prologue. Nor a copy
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
    args = ", ".join(a.name if isinstance(a, fx.Node) else text(a) if is_symbolic(a)
                     else repr(a) for a in node.args)
    return f"{node.name} = {node.target}({args})"


def broadcast_strides(layout: Layout, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of `layout` seen over iteration space `shape` (right-aligned, broadcast dims 0)."""
    pad = len(shape) - len(layout.shape)
    if pad < 0:
        raise AssertionError(f"layout {layout.shape} is larger than the iteration space {shape}")
    strides = []
    for d, size in enumerate(shape):
        j = d - pad
        if j < 0 or is_one(layout.shape[j]):
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
    # (by the traced strides: the order changes how fast, never what is computed: unguarded)
    return sorted(range(len(shape)), key=lambda d: -hint(strides[d]) if not is_one(shape[d]) else 0)


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
    dims = [d for d, size in enumerate(shape) if not is_one(size)]
    sizes: list[int] = []
    strides: list[list[int]] = [[] for _ in tensors]
    for d in dims:
        if sizes and all(equal_if_so(t[d] * shape[d], s[-1]) for t, s in zip(tensors, strides)):
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

"""Lowering a reduction group: one fused reduction (its prologue, the reductions over the same
rows, its epilogue) -> one ReductionKernel (fusec.ir).

The same decisions as lower.py's for pointwise kernels (index expressions, dim merging, dtypes),
plus the reduction's own: which dims are rows and which are reduced (walked in the memory order
of the tensor reduced), which sums can share the pass before theirs (online softmax and online
variance: lower_folds.py), and the loop plan (`plan_loops`, fusec/loop_plan.py): what a row computes
before its loops, in each pass over k and after it, which stores are per element and which per
row, and which costly element value the last phase may keep for the last pass (`keep_choice`).
The backends only spell that plan. The kernel's values (its loads, the group's ops, its stores,
and for each value its level and whether it varies along k) are made in lower_reduction_values.py.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.fx as fx

from fusec.symbolic import hashable, hint
from fusec import ops
from fusec.record import group_info
from fusec.ir import (Index, Keep, Layout, LoopPlan, OnlineVariance, Phase, Reduce, ReductionKernel,
                      Stmt)
from fusec.loop_plan import Stash

from .lower import (Piece, broadcast_strides, is_cat, cat_pieces, coalesce, gather_layouts,
                    only_gathered)
from .lower_folds import online_softmax, online_variance
from .lower_reduction_values import (ReductionValues, load_gathers, load_pieces, lower_ops,
                                     space_of, store_outputs)


# ---- reductions ------------------------------------------------------------------------------

def lower_reduction(name: str, sub: fx.GraphModule, in_layouts: list[Layout],
                    out_layouts: list[Layout], root_dtypes: dict[str, torch.dtype]) -> ReductionKernel:
    """Build the kernel IR for a reduction group (see passes/fuse_reductions.py).

    The reduced shape is permuted so the reduced dims come last: the loop is (rows, k). Each
    tensor gets strides over (row dims..., k dims...): an element tensor broadcast to the reduced
    shape, a row tensor with 0 strides along k. Row dims and k dims are then merged separately.
    The steps: the space, the tensors it indexes, their merged indices, the loads of cat pieces
    and gathered reads, the group's ops (placeholders loaded as they are first read), the stores.
    """
    space = _space(sub, in_layouts)
    tensors = _tensors(sub, space, in_layouts, out_layouts)
    row_shape, k_shape, index_of = _index_tensors(space, tensors, in_layouts, out_layouts)
    values = ReductionValues(space.placeholders, in_layouts, root_dtypes, index_of, len(row_shape))
    load_pieces(values, tensors.pieces, tensors.spaces)
    load_gathers(values, tensors.gathers)
    fused_ops = lower_ops(values, sub)
    stores = store_outputs(values, space.outputs, out_layouts)
    matmul = next((n.meta["fusec_matmul"] for n in sub.graph.nodes if "fusec_matmul" in n.meta), None)
    kernel = ReductionKernel(name, space.shape, space.dims, row_shape, k_shape, values.params,
                             values.loads, values.body, stores, values.varying, values.level,
                             fused_ops, online_softmax(values.body, values.varying), matmul)
    kernel.variances = online_variance(values.body, values.varying, values.level)
    kernel.plan = plan_loops(kernel)
    return kernel


@dataclass(frozen=True)
class _Space:
    """A reduction's iteration space: its shape, the reduced dims (in memory order), the others
    (`outer`: the row dims) and the order the rows are walked in; `perm` lists the rows, then k."""

    shape: tuple[int, ...]
    dims: tuple[int, ...]
    outer: list[int]
    rows_only: tuple[int, ...]  # the shape of the rows alone
    row_order: list[int]
    perm: list[int]
    placeholders: list[fx.Node]
    outputs: list[fx.Node]

    def strides(self, layout: Layout, where: str) -> tuple[int, ...]:
        """A tensor's strides over (row dims..., k dims...), read per row or per element."""
        if where == "rows":
            row_strides = broadcast_strides(layout, self.rows_only)
            return tuple(row_strides[i] for i in self.row_order) + (0,) * len(self.dims)
        full = broadcast_strides(layout, self.shape)
        return tuple(full[d] for d in self.perm)


def _space(sub: fx.GraphModule, in_layouts: list[Layout]) -> _Space:
    """The group's space, its reduced dims and its rows each walked in memory order."""
    group = group_info(sub)
    shape, dims = tuple(group.shape), tuple(group.reduce_dims)
    dims = _memory_order(dims, shape, sub, in_layouts)
    outer = [d for d in range(len(shape)) if d not in dims]
    row_order = _row_order(outer, shape, in_layouts)
    return _Space(shape, dims, outer, tuple(shape[d] for d in outer), row_order,
                  [outer[i] for i in row_order] + list(dims),
                  [n for n in sub.graph.nodes if n.op == "placeholder"],
                  list(sub.graph.output_node().args[0]))


class _Tensors(NamedTuple):
    """Every tensor a reduction kernel indexes, as (kind, number, space, strides) `entries`,
    with the cat pieces and gathered reads the "piece", "sentinel", "gsrc", "gidx" ones name."""

    entries: list[tuple]
    pieces: list[Piece]
    spaces: list[str]  # the space each piece is read in
    gathers: list[tuple]  # (node, gather, source layout, index layout, row stride)


def _tensors(sub: fx.GraphModule, space: _Space, in_layouts: list[Layout],
             out_layouts: list[Layout]) -> _Tensors:
    """The tensors the kernel reads and writes, each in the spaces it is read in: its users
    decide (an input can be read both ways)."""
    tensors: list[tuple] = []  # (kind, index, space, strides)
    placeholders, strides_for = space.placeholders, space.strides
    pieces, spaces = _cat_tensors(sub, space, in_layouts, tensors)
    only_pieces = {p.index for p in pieces} - {i for i, ph in enumerate(placeholders)
                                               if any(not is_cat(u) for u in ph.users)}
    # A gathered read (`scales[g_idx]` in a weight computed from a table): its index and its source,
    # indexed over the read's output (lower.py, `gather_layouts`), in the read's space.
    gathers = [(n, g, *gather_layouts(g, placeholders, in_layouts)) for n in sub.graph.nodes
               if (g := ops.gathered_read(n)) is not None]
    for k, (node, _, src, idx, _) in enumerate(gathers):
        tensors.append(("gsrc", k, space_of(node), strides_for(src, space_of(node))))
        tensors.append(("gidx", k, space_of(node), strides_for(idx, space_of(node))))
    only_pieces |= only_gathered(placeholders)
    for i, (ph, layout) in enumerate(zip(placeholders, in_layouts)):
        if i in only_pieces:
            continue
        reads = {"elem" if ops.reduction(u) is not None else space_of(u)
                 for u in ph.users if u.op == "call_function"}
        for where in sorted(reads or {"elem"}):
            tensors.append(("in", i, where, strides_for(layout, where)))
    for k, (out, layout) in enumerate(zip(space.outputs, out_layouts)):
        tensors.append(("out", k, space_of(out), strides_for(layout, space_of(out))))
    return _Tensors(tensors, pieces, spaces, gathers)


def _cat_tensors(sub: fx.GraphModule, space: _Space, in_layouts: list[Layout],
                 tensors: list[tuple]) -> tuple[list[Piece], list[str]]:
    """The pieces of the group's cats and the space each is read in; adds each piece's entry
    and its sentinel's to `tensors`."""
    placeholders, perm, row_order, dims = space.placeholders, space.perm, space.row_order, space.dims
    # A matmul over weights joined along N (`fusec_pieces`) reads them as pieces of a cat along
    # a row dim: each piece is indexed over the whole space, shifted back by where it starts,
    # and a "sentinel" with a stride only along the cat's dim keeps that dim a loop dim of its
    # own through the merging of dims, so the kernel can compare its coordinate with the bounds.
    # (A cat read per row, joined biases added after the sum, is indexed over the rows alone.)
    cats = [c for c in sub.graph.nodes if is_cat(c)]
    pieces = cat_pieces(sub, placeholders, in_layouts, space.shape,
                        [c for c in cats if space_of(c) == "elem"])
    spaces = ["elem"] * len(pieces)
    for n, piece in enumerate(pieces):
        tensors.append(("piece", n, "elem", tuple(piece.strides[d] for d in perm)))
        tensors.append(("sentinel", n, "elem", tuple(piece.sentinel[d] for d in perm)))
    for piece in cat_pieces(sub, placeholders, in_layouts, space.rows_only,
                            [c for c in cats if space_of(c) == "rows"]):
        tensors.append(("piece", len(pieces), "rows",
                        tuple(piece.strides[i] for i in row_order) + (0,) * len(dims)))
        tensors.append(("sentinel", len(pieces), "rows",
                        tuple(piece.sentinel[i] for i in row_order) + (0,) * len(dims)))
        pieces.append(piece)
        spaces.append("rows")
    return pieces, spaces


def _index_tensors(space: _Space, found: _Tensors, in_layouts: list[Layout],
                   out_layouts: list[Layout]):
    """(row_shape, k_shape, index_of): the row dims and the k dims each merged where every
    tensor allows it (`coalesce`), and each tensor's Index over (row dims..., k dims...)."""
    tensors, pieces, gathers = found.entries, found.pieces, found.gathers
    shape, perm, dims = space.shape, space.perm, space.dims
    n_rows = len(space.outer)
    row_shape, row_strides = coalesce(tuple(shape[d] for d in perm[:n_rows]),
                                      [t[3][:n_rows] for t in tensors])
    k_shape, k_strides = coalesce(tuple(shape[d] for d in dims), [t[3][n_rows:] for t in tensors])
    if k_shape == (0,):
        # An empty reduced dim (sum -> 0, any -> False ...): coalesce gives every tensor 0
        # strides, which would make element tensors look like row values, read once per row
        # (out of bounds: they hold no elements). Keep them varying along k, so they are read
        # only inside the (empty) loop over k, or under the k mask.
        k_strides = [(1,) if any(t[3][n_rows:]) else (0,) for t in tensors]
    offsets = [in_layouts[t[1]].offset if t[0] == "in" else out_layouts[t[1]].offset
               if t[0] == "out" else pieces[t[1]].offset if t[0] == "piece"
               else gathers[t[1]][2].offset if t[0] == "gsrc"
               else gathers[t[1]][3].offset if t[0] == "gidx" else 0 for t in tensors]
    index_of = {(t[0], t[1], t[2]): Index(layout_offset, rs + ks)
                for t, rs, ks, layout_offset in zip(tensors, row_strides, k_strides, offsets)}
    return row_shape, k_shape, index_of


def _memory_order(dims: tuple[int, ...], shape, sub: fx.GraphModule, in_layouts) -> tuple[int, ...]:
    """The reduced dims in the memory order of the tensor being reduced, largest stride first.

    A group norm over a channels-last (N, G, C/G, H*W) view reduces over (C/G, H*W), whose strides
    are (1, C): walked in the graph's order, neighbouring positions of k would be C elements
    apart. Walked as (H*W, C/G), each run of C/G positions is contiguous. Only the order of the
    additions changes. Reductions that return an index (argmax over several dims numbers the
    positions in the graph's order) keep the graph's order.
    """
    if len(dims) < 2 or any(ops.reduction(n) is not None and ops.reduction(n).op.returns_index
                            for n in sub.graph.nodes if n.op == "call_function"):
        return dims
    sizes = hint(shape)  # (the order of the additions changes no result: unguarded)
    for layout in in_layouts:
        pad = len(shape) - len(layout.shape)
        if pad < 0 or any(n not in (1, s) for n, s in zip(hint(layout.shape), sizes[pad:])):
            continue  # a row value, read over the rows only (a (C,) mean of an (N, C, 1, 1) group)
        full = hint(broadcast_strides(layout, shape))
        # an element tensor: it varies along every reduced dim (a dim of length 1, such as the
        # one split_reductions leaves inside a chunk, has no stride to order by)
        if all(full[d] for d in dims if sizes[d] > 1):
            return tuple(sorted(dims, key=lambda d: (-full[d], d)))
    return dims


def _row_order(outer: list[int], shape, in_layouts) -> list[int]:
    """The order to walk the rows in (positions into `outer`): the memory order of the tensor
    being reduced, when one input covers the whole shape, largest stride first.

    The minimum over the depth of a channels-last (N, C, D, H, W) tensor has rows (N, C, H, W)
    and C is the dim whose neighbours sit side by side in memory. Walked in the graph's order
    (H, W innermost), neighbouring rows would be C elements apart and each program would gather
    its rows from scattered addresses (0.23 ms against torch.compile's 0.067 on an H200,
    KernelBench-style 30_conv3d_min_depth_softmax); walked with C innermost, neighbouring rows
    are neighbours in memory. Only which program computes which row changes, not the arithmetic.
    """
    for layout in in_layouts:
        if hashable(tuple(layout.shape)) != hashable(tuple(shape)):
            continue  # a row value, or a broadcast one
        strides = hint(layout.stride)  # (the order of the rows changes no result: unguarded)
        if all(st for st, n in zip(strides, hint(shape)) if n > 1):
            return sorted(range(len(outer)), key=lambda i: -strides[outer[i]])
    return list(range(len(outer)))


def plan_loops(kernel: ReductionKernel) -> LoopPlan:
    """The loop plan of a kernel (see the note on phases in fusec/loop_plan.py).

    Every value has a level: the number of phases that must end before it can be computed
    (`kernel.level`, 0 for loads and for what needs no reduction; a reduction of phase p has
    level p + 1). A row value (one that does not vary along k) is computed once, as soon as its
    level is reached: before the loops (level 0) or when phase level - 1 ends. An element value
    is computed inside each loop that needs it, again in every pass: what phase p's loop
    computes is everything its reductions' operands need, back to loads and row values
    (`values_needed`). For softmax:

        phase 0: amax(x) over k; each k computes x
        phase 1: sum(exp) over k; each k computes x, x - m, exp(x - m)
        last pass: each k computes x, x - m, exp(x - m), exp / s; stores out
    """
    order = [l.var.name for l in kernel.loads] + [item.var.name for item in kernel.body]
    made = {item.var.name: item for item in kernel.body}

    def row_values(level: int) -> tuple[str, ...]:
        return tuple(n for n in order if n not in kernel.varying and not isinstance(made.get(n), Reduce)
                     and kernel.level.get(n, 0) == level)

    reduces = [item for item in kernel.body if isinstance(item, Reduce)]
    by_total = {o.total: o for o in [*kernel.online, *kernel.variances]}
    phases = []
    for p in range(kernel.phases):
        reds = [r for r in reduces if r.phase == p]
        later = [r for r in reduces if r.phase == p + 1]  # all online sums: they may fold in
        folds = tuple(by_total[r.var.name] for r in later) \
            if later and all(r.var.name in by_total for r in later) else ()
        loop = kernel.values_needed({r.operand.name for r in reds} |
                                    {o.value for o in folds if isinstance(o, OnlineVariance)})
        phases.append(Phase(p, tuple(r.var.name for r in reds), tuple(loop), row_values(p + 1),
                            folds))
    elements = tuple(n for n, s in enumerate(kernel.stores) if s.var.name in kernel.varying)
    rows = tuple(n for n, s in enumerate(kernel.stores) if s.var.name not in kernel.varying)
    last = kernel.values_needed({kernel.stores[n].var.name for n in elements})
    plan = LoopPlan(row_values(0), tuple(phases), tuple(last), elements, rows)
    plan = replace(plan, stashes=stash_choice(kernel, plan))
    return replace(plan, keep=keep_choice(kernel, plan))


# Note (keeping an element value in the output): the last pass recomputes the element values
# from the inputs, so softmax's last pass would compute exp(x - max) a second time. When the last
# reduction phase already computes a value that the stores need, and computing it again would
# take a costly op (exp, log, tanh ... anything beyond + - * and compares), that phase also
# writes it into the output row, where the last pass reads it back and overwrites it with the
# result: softmax's last pass becomes out[k] = out[k] / sum. The output must hold the value
# exactly (same dtype as the register, so not a float16 output) and be written by this one
# store at distinct places (no broadcast, no input read from it), and the row must stay in
# cache between the two passes. CPU softmax 512x512 on 2 cores: 0.114 -> 0.085 ms. The CPU
# backends, which walk one row at a time, take it; Triton recomputes (`Keep` in fusec/loop_plan.py).
# The same holds between two phases (`Stash`): a softmax of gelu(x) computes gelu in its max
# pass and again in its sum pass; the max pass writes gelu into the output row, the sum pass
# reads it back (and writes exp(gelu - max) over it, the last phase's Keep). Each phase may
# write one value, chosen in phase order, so what a phase reads back is what the phase before
# it wrote; the last phase's Keep is chosen after them, from what that phase then computes.

CHEAP_OPS = ops.CHEAP_OPS
STASH_MAX_ROW_BYTES = 1 << 20  # 1 MiB: a row that stays in a core's L2 cache; a longer one
# would cost an extra trip to memory (written, read back, written again) to save the op


def _slots(kernel: ReductionKernel, plan: LoopPlan) -> list[int]:
    """The element stores whose place in the output row can hold a value between two loops
    (see the note above): written by this one store at distinct places, read by no load, and a
    row that stays in cache."""
    params = [s.param for s in kernel.stores]
    return [n for n in plan.element_stores
            if params.count(kernel.stores[n].param) == 1 and all(kernel.stores[n].index.strides)
            and all(l.param != kernel.stores[n].param for l in kernel.loads)
            and hint(kernel.k) * kernel.stores[n].dtype.itemsize <= STASH_MAX_ROW_BYTES]  # (speed only)


def _costly(kernel: ReductionKernel):
    """A function that counts the costly statements among some names (see the note above)."""
    made = {item.var.name: item for item in kernel.body}

    def costly(names) -> int:
        return sum(1 for n in names if isinstance(made.get(n), Stmt) and made[n].op not in CHEAP_OPS)
    return costly


def _best_kept(kernel: ReductionKernel, loop, wanted, recompute, slots: list[int]):
    """(value, store, what the later loop computes then) for the value of `loop` that saves the
    later loop the most costly ops when read back instead (`recompute(name)`: that loop's values
    with `name` read back; `wanted`: what it computes now), or None when none saves any."""
    made = {item.var.name: item for item in kernel.body}
    costly, best, gain = _costly(kernel), None, 0
    for name in loop:
        if name not in wanted or not isinstance(made.get(name), Stmt):
            continue
        fits = [n for n in slots if kernel.stores[n].dtype == made[name].var.dtype]
        after = recompute(name)
        saved = costly(wanted) - costly(set(after) - {name})
        if fits and saved > gain:
            best, gain = (name, fits[0], tuple(after)), saved
    return best


def stash_choice(kernel: ReductionKernel, plan: LoopPlan) -> tuple[Stash, ...]:
    """For each phase before the last, in order, the element value it keeps in an output for the
    next phase to read back (see the note above), where one saves that phase a costly op."""
    slots = _slots(kernel, plan) if plan.element_stores else []
    if not slots:
        return ()
    reduces = {item.var.name: item for item in kernel.body if isinstance(item, Reduce)}
    stashes: list[Stash] = []
    loop = plan.phases[0].loop if plan.phases else ()
    for phase, after in zip(plan.phases, plan.phases[1:]):
        targets = {reduces[n].operand.name for n in after.reduces} | \
            {o.value for o in after.folds if isinstance(o, OnlineVariance)}
        best = _best_kept(kernel, loop, after.loop,
                          lambda name: kernel.values_needed(targets, {name}), slots)
        if best is not None:
            stashes.append(Stash(phase.number, *best))
        loop = best[2] if best else after.loop
    return tuple(stashes)


def keep_choice(kernel: ReductionKernel, plan: LoopPlan) -> Keep | None:
    """The element value to keep in an output between the last phase and the last pass, or None
    (see the note above): the value whose reading back saves the most costly ops, among those
    the last phase computes (with what the phase before it stashed read back)."""
    if not plan.phases or not plan.element_stores:
        return None
    elements = {kernel.stores[n].var.name for n in plan.element_stores}
    loop = plan.phase_loop(plan.phases[-1])[0]
    best = _best_kept(kernel, loop, plan.last_pass,
                      lambda name: kernel.values_needed(elements, {name}), _slots(kernel, plan))
    if best is None:
        return None
    value, store, _ = best
    left = tuple(n for n in plan.element_stores if (kernel.stores[n].var.name, n) != (value, store))
    targets = {kernel.stores[n].var.name for n in left}
    return Keep(value, store, tuple(kernel.values_needed(targets, {value})), left)

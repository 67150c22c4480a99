"""Split reductions: a reduction of a few long rows becomes two reductions of many short ones.

A GPU runs a reduction kernel as one program per row (or per block of rows), and a program runs
on one SM. `x.mean(dim=(2, 3, 4))` of a (16, 32, 16, 64, 64) activation has 512 rows of 65536
elements; a channels-last global pool of (32, 64, 128, 128) has 2048 rows, but a column reduction
(passes/fuse_reductions.py, codegen/triton/reduction.py) takes 64 neighbouring rows per program:
32 programs. On a GPU of 132 SMs most of the chip then waits while a few programs stream
megabytes each. A group norm is worse still: 4 groups x 16 images are 64 rows.

The cure is old (torch's own reduction kernels do it inside one launch): cut every row into S
chunks, reduce each chunk in its own program, then reduce the S partial results of each row.
Here it is a rewrite of the graph, so the fusion passes see two ordinary reductions:

    before                                          after (S = 8 chunks along D)
    s = sum(x, [2, 3, 4])      # x (16, 32, 16, 64, 64)
                                                    xs = view(x, [16, 32, 8, 2, 64, 64])
                                                    p  = sum(xs, [3, 4, 5], keepdim=True)
                                                    s  = sum(p, [2, 3, 4, 5])   # (16, 32)

The first reduction has 8x the rows (the chunk index is a row dim) and an eighth of the work per
row; the second adds 8 numbers per row, and the ops that used `s` (mean's division, rstd ...)
become its epilogue. Splitting a dim is always a view, whatever the strides, and the chunk is
taken along the reduced dim with the largest stride, so each chunk is a contiguous slab of the
row. A view of a *computed* value would end its kernel (passes/fuse_pointwise.py: the value is
stored first), so the view is pushed up through the pointwise ops that compute the operand, to
the values they read: `sum(sigmoid(x))` becomes `sum(sigmoid(view(x)))`, and the sigmoid stays
inside the first reduction's kernel. Values that broadcast along the split dim (a per-channel
scale, a row's mean) get a size-1 dim instead.

Rules, each decision kept in `record_of(gm).split_reductions` and shown by `fusec.explain`:

* only on GPU devices (SPLIT_DEVICES): a CPU thread walks rows one by one and every thread is
  busy once there are as many rows as threads;
* a reduction made by a pass that also says how to cut it (`node.meta["fusec_split_rule"]`, a
  function of the node and its ReductionCall that returns the dim, the number of chunks and
  why, or None) is cut as its rule says, whatever its rows: a kernel family that reads each
  chunk with a kernel of its own (extensions/) knows its chunks better than the rules below;
* not a column reduction whose kernel spreads its columns over the GPU itself
  (`fuse_reductions.spread_columns`, said by the pass that made it): it still has programs for
  every SM once there are 2 * FEW_PROGRAMS columns;
* only reductions whose partial results combine with the same reduction: sum, amax, amin (an
  argmax's partial results would need their positions carried along);
* only when the kernel would have fewer programs than the GPU has SMs (FEW_PROGRAMS), each with
  at least LONG_PROGRAM elements: the rule of fuse_reductions.few_long_rows, which made such a
  reduction an extern before this pass existed;
* S is the smallest divisor of the split dim that gives TARGET_PROGRAMS programs, while each
  program keeps at least MIN_CHUNK elements; when even a dim cut into single slices leaves too
  few programs (a 3-D volume of depth 16), the first reduction is split again along the next
  dim, so a row may be added up in three steps;
* a float16/bfloat16 sum keeps its partial sums in float32 and rounds once, after the second
  reduction, as eager's kernel does (rounding each partial would lose bits);
* a variance, the sum of squared deviations from a split mean of the same value, is split with
  the chunks' own means (the note on variance below), so the value is read once, not twice.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from fusec.symbolic import hint, is_symbolic
from fusec import ops
from fusec.record import Decision, record_of

from .fuse_reductions import FEW_PROGRAMS as _FEW_PROGRAMS
from .fuse_reductions import LONG_PROGRAM as _LONG_PROGRAM
from .fuse_reductions import programs_of, spread_columns
from .grouping import meta
from .schedule import fake_mode_of
from .unflatten import Unflattener

aten = torch.ops.aten

SPLIT_DEVICES = ("cuda",)
SPLITTABLE = ("sum", "amax", "amin")
# fuse_reductions.few_long_rows's rule: fewer programs than SMs, each this long
FEW_PROGRAMS = _FEW_PROGRAMS
LONG_PROGRAM = _LONG_PROGRAM
TARGET_PROGRAMS = 4 * FEW_PROGRAMS  # a few programs per SM, so that they balance out
MIN_CHUNK = 4096  # elements per program after the split: less is launch and combine overhead


def split_reductions(gm: fx.GraphModule) -> fx.GraphModule:
    """Split each reduction of few long rows in two (see the module docstring)."""
    decisions = []
    mode = None
    views: dict = {}  # (value, shape) -> its cut view: reductions of one value share it
    splits: dict = {}  # combined node -> (operand, dims, dim cut, chunks, partial): see variance
    todo = list(reversed(gm.graph.nodes))
    while todo:
        node = todo.pop()
        red = None if getattr(node, "_erased", False) else ops.reduction(node)
        if red is None or not str(meta(node).device).startswith(SPLIT_DEVICES):
            continue
        rule = node.meta.get("fusec_split_rule")  # (see the module docstring)
        own = rule(node, red) if rule is not None else None
        if own is not None:
            d, chunks, why = own
            mode = mode or fake_mode_of(gm)
            _split(gm, node, red, d, chunks, mode, views)
            decisions.append(Decision(node.name, True, why))
            continue
        rows, k, per_program, programs = programs_of(node, red)  # (at a family's traced sizes)
        if programs >= FEW_PROGRAMS or per_program * k < LONG_PROGRAM:
            continue
        spread = spread_columns(node, rows, per_program)
        if spread:
            decisions.append(Decision(node.name, False, f"{rows} columns side by side: {spread}"))
            continue
        if red.op.name not in SPLITTABLE:
            decisions.append(Decision(node.name, False, f"{red.op.name}: its partial results "
                                      "do not combine by the same reduction"))
            continue
        plan = choose_split(node, red, rows, k, per_program)
        if plan is None:
            static = [d for d in red.dims if not is_symbolic(meta(red.operand).shape[d])]
            decisions.append(Decision(node.name, False, "no reduced dim divides into chunks of "
                                      f"at least {MIN_CHUNK} elements" if static else
                                      "every reduced size is a symbol: no chunk count divides "
                                      "all the sizes it may take"))
            continue
        d, chunks = plan
        mode = mode or fake_mode_of(gm)
        mean = _deviations_from(node, red, splits, d, chunks)
        key = _value_key(red.operand)  # (before the split erases the operand)
        if mean is not None:
            partial, combined = _split_variance(gm, node, red, mean, splits, mode, views)
        else:
            partial, combined = _split(gm, node, red, d, chunks, mode, views)
            splits[combined] = (key, red.dims, d, chunks, partial)
        for key, (operand, dims, d1, chunks1, sums) in list(splits.items()):
            if sums is node:  # a partial split again: its chunks' sums now come from `combined`
                splits[key] = (operand, dims, d1, chunks1, combined)
        todo.append(partial)  # its rows may still be too few: cut another dim (see above)
        decisions.append(Decision(node.name, True, ("one pass with the chunks' own means "
                                                    "(see variance) " if mean is not None else "") + (
            f"{rows} row(s) of {k} elements ({programs} program(s)) -> {rows * chunks} rows of "
            f"{k // chunks} ({-(-rows * chunks // per_program)} programs), then {rows} row(s) of "
            f"{chunks}: dim {d} of {tuple(meta(red.operand).shape)} cut in {chunks} chunks")))
    record_of(gm).split_reductions = decisions
    if any(taken for _, taken, _ in decisions):
        # `x.sum()` and `x.mean()` read one value; split, their partial sums are two copies of
        # one reduction of one view (the views of values are shared, `views` below)
        _merge_equal_reductions(gm.graph)
        gm.graph.lint()
        gm.recompile()
    return gm


def choose_split(node: fx.Node, red: ops.ReductionCall, rows: int, k: int,
                 per_program: int) -> tuple[int, int] | None:
    """(dim, number of chunks) or None: the reduced dim with the largest stride, cut in the
    fewest chunks that make TARGET_PROGRAMS programs (or as many as MIN_CHUNK allows).

    In a shape family (fusec/dynamic.py) only a reduced dim of a fixed size is cut, so that the
    chunks divide it at every size the program serves; `rows`, `k` and the strides are the
    traced sizes' (fuse_reductions.programs_of), so the choice takes no guard: a batch of 64
    where 16 was traced runs the same cut, with more programs than it needed."""
    m = meta(red.operand)
    candidates = [d for d in red.dims if not is_symbolic(m.shape[d]) and m.shape[d] > 1]
    if not candidates:
        return None
    strides = hint(m.stride)
    d = max(candidates, key=lambda d: (abs(strides[d]), -d))
    best = None
    for chunks in range(2, m.shape[d] + 1):
        if m.shape[d] % chunks:
            continue
        if per_program * (k // chunks) < MIN_CHUNK:
            break
        best = chunks
        if -(-rows * chunks // per_program) >= TARGET_PROGRAMS:
            break
    return None if best is None else (d, best)


def _split(gm: fx.GraphModule, node: fx.Node, red: ops.ReductionCall, d: int, chunks: int,
           mode, views: dict) -> tuple[fx.Node, fx.Node]:
    """Replace `node` by a reduction of chunks and a reduction of their results; return both."""
    graph = gm.graph
    cut = Unflattener(graph, node, mode, views)
    add = cut.add
    operand = cut(red.operand, d, (chunks, meta(red.operand).shape[d] // chunks))
    inner = [r if r < d else r + 1 for r in red.dims]  # d itself -> the dim inside a chunk
    kwargs = dict(node.kwargs)
    dtype = meta(node).dtype
    widen = red.op.name == "sum" and dtype in (torch.float16, torch.bfloat16)
    if widen:
        kwargs["dtype"] = torch.float32
    partial = add(node.target, (operand, inner, True), kwargs, name=f"{node.name}_partial")
    if red.keepdim:  # only the chunk dim d goes: the partial's shape is then the keepdim shape
        combined = add(node.target, (partial, [d], False), name=f"{node.name}_combined")
    else:
        combined = add(node.target, (partial, sorted(inner + [d]), False),
                       name=f"{node.name}_combined")
    if widen:
        combined = add(aten._to_copy.default, (combined,), {"dtype": dtype},
                       name=f"{node.name}_rounded")
    node.replace_all_uses_with(combined)
    graph.erase_node(node)
    cut.finish(red.operand)
    return partial, combined


# Note (variance from the chunks' own means). A variance is two reductions (capture/
# decompositions.py, `_var`): the mean, then the sum of squared deviations from it, so split they
# read the activation twice, and the second pass needs the whole row's mean first. Chan, Golub and
# LeVeque's parallel formula needs no global mean: with each chunk's count n_c, mean m_c and sum
# of squared deviations from its own mean M2_c,
#
#     sum((x - mean)^2) = sum over chunks of (M2_c + n_c * (m_c - mean)^2)
#
# exactly (the cross terms sum to zero). M2_c is a second phase of the kernel that sums the chunk
# (the chunk's mean is one of its row values, as in a layer norm), so the activation is read once
# from memory; two small reductions over the chunks add the M2_c and the corrections. It is as stable as the two-pass
# form (each deviation is taken from a nearby mean) and is how Welford-style variances combine.
def _deviations_from(node: fx.Node, red: ops.ReductionCall, splits: dict, d: int,
                     chunks: int) -> fx.Node | None:
    """The split mean `node` sums squared deviations from, when it is `sum((x - m)^2)` with
    m = sum(x) / n reduced over the same dims and cut the same way, else None."""
    if red.op.name != "sum" or meta(node).dtype not in (torch.float32, torch.float64):
        return None
    sq = red.operand
    if not _call(sq, aten.mul.Tensor) or sq.args[0] is not sq.args[1] or sq.kwargs:
        return None
    dev = sq.args[0]
    if not _call(dev, aten.sub.Tensor) or len(dev.args) != 2 or dev.kwargs:
        return None
    x, mean = dev.args
    if not _call(mean, aten.div.Tensor) or mean.args[0] not in splits:
        return None
    operand, dims, d1, chunks1, partial = splits[mean.args[0]]
    if operand != _value_key(x) or dims != red.dims or (d1, chunks1) != (d, chunks) \
            or getattr(partial, "_erased", False) or not _call(partial, node.target):
        return None
    n = math.prod(meta(x).shape[i] for i in dims)
    return mean if isinstance(mean.args[1], (int, float)) and mean.args[1] == n else None


def _split_variance(gm: fx.GraphModule, node: fx.Node, red: ops.ReductionCall, mean: fx.Node,
                    splits: dict, mode, views: dict) -> tuple[fx.Node, fx.Node]:
    """Replace `node` (sum((x - mean)^2)) by the chunks' M2 and its corrections (see the note)."""
    graph = gm.graph
    _, dims, d, chunks, sums = splits[mean.args[0]]
    x = red.operand.args[0].args[0]  # sum((x - mean)^2)
    cut = Unflattener(graph, node, mode, views)
    add = cut.add
    n_chunk = mean.args[1] // chunks
    chunk_mean = add(aten.div.Tensor, (sums, n_chunk), name=f"{node.name}_chunk_mean")
    dev = add(aten.sub.Tensor, (cut(x, d, (chunks, meta(x).shape[d] // chunks)), chunk_mean),
              name=f"{node.name}_chunk_dev")
    inner = [r if r < d else r + 1 for r in red.dims]
    m2 = add(node.target, (add(aten.mul.Tensor, (dev, dev)), inner, True), dict(node.kwargs),
             name=f"{node.name}_partial")
    shape = list(meta(mean).shape)
    mean_cut = add(aten.view.default, (mean, shape[:d + 1] + [1] + shape[d + 1:]),
                   name=f"{mean.name}_per_chunk")
    # (the chunk means again, for the corrections: shared, the mean would be stored by one
    # kernel for the other, and the two reductions could not share the chunk sums' kernel)
    gap = add(aten.sub.Tensor, (add(aten.div.Tensor, (sums, n_chunk)), mean_cut))
    dims_out = [d] if red.keepdim else sorted(inner + [d])
    # sum(M2_c) + n_c * sum((m_c - mean)^2): two reductions over the chunks (the corrections
    # as an epilogue of M2's kernel would make it wait for the whole row's mean)
    m2_sum = add(node.target, (m2, dims_out, False), name=f"{node.name}_combined")
    gaps = add(node.target, (add(aten.mul.Tensor, (gap, gap)), dims_out, False),
               name=f"{node.name}_between_chunks")
    combined = add(aten.add.Tensor, (m2_sum, add(aten.mul.Tensor, (gaps, n_chunk))),
                   name=f"{node.name}_total")
    node.replace_all_uses_with(combined)
    graph.erase_node(node)
    cut.finish(red.operand)
    return m2, combined


def _value_key(value):
    """What `value` computes, comparable after the node itself is gone: pointwise ops and views
    by their op and arguments, anything else by its node. A cut pushed up through pointwise ops
    makes new copies of them each time (unflatten.py), and a partial split again replaces its
    operand by a cut of it: the variance rule (below) still recognizes the same value."""
    if isinstance(value, (list, tuple)):
        return tuple(_value_key(v) for v in value)
    if isinstance(value, fx.Node) and value.op == "call_function" \
            and ops.classify(value.target) in (ops.POINTWISE, ops.VIEW):
        return (value.target, _value_key(value.args), repr(sorted(value.kwargs.items(), key=str)))
    return value


def _call(node, target) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target


def _merge_equal_reductions(graph: fx.Graph) -> None:
    """Replace each reduction that repeats an earlier one (same op, same arguments) by it.
    Only reductions: a pointwise op that two kernels both compute stays computed twice, since
    sharing it would make one kernel store it for the other."""
    seen: dict = {}
    for node in list(graph.nodes):
        if ops.reduction(node) is None:
            continue
        kwargs = {k: v for k, v in node.kwargs.items() if v is not None
                  and not (k == "dtype" and v == meta(node.args[0]).dtype)}  # a cast to itself
        key = (node.target, node.args, tuple(sorted(kwargs.items(), key=str)))
        try:
            kept = seen.setdefault(_hashable(key), node)
        except TypeError:
            continue
        if kept is not node:
            node.replace_all_uses_with(kept)
            graph.erase_node(node)


def _hashable(value):
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    return value

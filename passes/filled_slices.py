"""filled_slices: a fresh tensor filled slice by slice is a concatenation.

Code that builds a tensor from parts often allocates it first and then assigns each part to a
slice. Unpacking a weight of two 4-bit values a byte, plain torch code often does:

    tmp = torch.empty([2 * step, n], dtype=torch.uint8)
    tmp[:step] = (W_q & 0b11110000) >> 4
    tmp[step:] = W_q & 0b00001111

After functionalization that is `empty`, then for each assignment a `slice` of the tensor so far,
a `copy` of the value into it, and a `slice_scatter` that puts it back: five eager ATen calls,
none of which fusec's kernels compute, so the parts are stored, copied and scattered before
anything reads the result. But when the slices along one dim cover it exactly, each element is
written once and the allocation's own (uninitialized, or zero) values are never read: the result
is the parts side by side, a `cat`:

    before                                          after
    e  = empty([2s, n])
    s1 = slice_scatter(e, copy(slice(e, 0, 0, s), hi), 0, 0, s)
    s2 = slice_scatter(s1, copy(slice(s1, 0, s), lo), 0, s)      s2 = cat([hi, lo], 0)

and a `cat` is read by the kernel that uses it, piece by piece (codegen/lower.py, and
passes/computed_pieces.py when the pieces are computed). A `copy` casts its value to the
tensor's dtype and broadcasts it to the slice's shape; the rewrite keeps both (`_to_copy`,
`expand`) where they change anything.

The pass rewrites a chain of `slice_scatter`s along one dim, with step 1, whose slices tile the
dim with no gap and no overlap, starting from a fresh tensor (`empty`, `zeros`, `full`, ...: a
factory with no tensor inputs) that nothing else reads, each step read only by the next one (and
by the slices that the copies write into). Anything else (a partial fill, a strided slice, a
tensor read between two writes) is left as it is. Each chain is a `Decision` in
`record_of(gm).filled_slices`.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fusec.graphmodule import looks_for
from fusec.record import Decision

from .grouping import new_node, record_decisions, val

aten = torch.ops.aten
FRESH = (aten.empty.memory_format, aten.zeros.default, aten.full.default, aten.ones.default,
         aten.new_empty.default, aten.new_zeros.default, aten.new_full.default,
         aten.new_ones.default, aten.empty_like.default, aten.zeros_like.default,
         aten.full_like.default, aten.ones_like.default)


@looks_for(aten.slice_scatter.default)
def filled_slices(gm: fx.GraphModule) -> fx.GraphModule:
    decisions: list[Decision] = []
    for node in list(gm.graph.nodes):
        if not _is(node, aten.slice_scatter.default) or _is_scatter_input(node):
            continue  # (a chain is taken from its last slice_scatter)
        chain = _chain(node)
        if chain is None:
            continue
        base, steps = chain
        dim = _dim(steps[0])
        size = val(base).shape[dim]
        ranges = sorted((_range(s, size), s) for s in steps)
        covers = [r for r, _ in ranges]
        if covers[0][0] != 0 or covers[-1][1] != size or \
                any(a[1] != b[0] for a, b in zip(covers, covers[1:])):
            decisions.append(Decision(node.name, False, f"the slices along dim {dim} "
                                      f"({', '.join(f'{a}:{b}' for a, b in covers)}) do not "
                                      f"fill its {size} rows exactly once: kept"))
            continue
        pieces = [_piece(gm.graph, s, node) for _, s in ranges]
        with gm.graph.inserting_before(node):
            cat = new_node(gm.graph, aten.cat.default, (pieces, dim),
                           torch.cat([val(p) for p in pieces], dim), node, f"{node.name}_cat")
        node.replace_all_uses_with(cat)
        decisions.append(Decision(cat.name, True, f"{base.target.__name__} filled by "
                                  f"{len(steps)} slice write(s) along dim {dim} that cover it "
                                  "once: the pieces side by side, a cat"))
    return record_decisions(gm, "filled_slices", decisions)


def _chain(last: fx.Node):
    """(the fresh tensor, the slice_scatters from it to `last`, in order) when every step is
    read only by the next one and by slices of it that copies write into; else None."""
    steps, at = [], last
    while _is(at, aten.slice_scatter.default):
        steps.insert(0, at)
        at = at.args[0]
        if not _only_feeds(at, steps[0]):
            return None
    if not (isinstance(at, fx.Node) and at.op == "call_function" and at.target in FRESH
            and not at.all_input_nodes and isinstance(val(at), torch.Tensor)):
        return None
    if len({_dim(s) % val(at).dim() for s in steps}) != 1 or \
            any(len(s.args) > 5 and s.args[5] != 1 for s in steps):
        return None
    return at, steps


def _only_feeds(value, step: fx.Node) -> bool:
    """Whether `value` is read by `step` and otherwise only by slices that nothing reads but a
    copy's destination (the slice an assignment writes into)."""
    if not isinstance(value, fx.Node):
        return False
    for user in value.users:
        if user is step:
            continue
        if not _is(user, aten.slice.Tensor):
            return False
        if any(not (_is(u, aten.copy.default) and u.args[0] is user) for u in user.users):
            return False
    return True


def _is_scatter_input(node: fx.Node) -> bool:
    return any(_is(u, aten.slice_scatter.default) and u.args[0] is node for u in node.users)


def _dim(step: fx.Node) -> int:
    return step.args[2] if len(step.args) > 2 else step.kwargs.get("dim", 0)


def _range(step: fx.Node, size: int) -> tuple[int, int]:
    """The rows [start, end) a slice_scatter writes, as slicing would clamp them."""
    start = step.args[3] if len(step.args) > 3 else step.kwargs.get("start")
    end = step.args[4] if len(step.args) > 4 else step.kwargs.get("end")
    start, end = 0 if start is None else start, size if end is None else end
    start, end = (v + size if v < 0 else v for v in (start, end))
    return max(0, min(start, size)), max(0, min(end, size))


def _piece(graph: fx.Graph, step: fx.Node, before: fx.Node) -> fx.Node:
    """The values a slice_scatter writes: a copy's source, cast and broadcast as copy does."""
    value = step.args[1]
    if not _is(value, aten.copy.default):
        return value
    dst, src = value.args[:2]
    want = val(value)
    out = src
    with graph.inserting_before(before):
        if val(out).dtype != want.dtype:
            out = new_node(graph, aten._to_copy.default, (out,), val(out).to(want.dtype), before,
                           f"{value.name}_cast", {"dtype": want.dtype})
        if tuple(val(out).shape) != tuple(want.shape):
            out = new_node(graph, aten.expand.default, (out, list(want.shape)),
                           val(out).expand(want.shape), before, f"{value.name}_expand")
    return out


def _is(node, target) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target

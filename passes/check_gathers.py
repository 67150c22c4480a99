"""check_gathers: let kernels read rows picked by index values, and check the values once.

A gathered read picks rows of a tensor by the values of another one (fusec.ops.gathered_read):
a token embedding `wte(input_ids)`, a packed weight's per-group scales `scales[g_idx]`. Eager
runs each one as an ATen call that writes the gathered rows to memory, and the next op reads
them back: for such scales and zero points that is two (K, N) tensors, as large as the unpacked
weight, to multiply one vector. A fused kernel instead reads the index value at each position
and then the source's row it names, so the gathered rows are never stored (codegen/lower.py,
Load's `gather`).

One thing eager does that a kernel cannot do well is refuse a bad index: `x[idx]` raises an
IndexError when a value is out of range. A kernel only keeps its reads in bounds (a value out of
range reads some row of the source, never past it), so this pass adds the check as ordinary
graph ops, once per index tensor, next to the index, and one `_assert_async` of all of them:

    before                                      after
    g = _to_copy(g_idx, dtype=int64)            ok = all(logical_and(ge(g_idx, -4), lt(g_idx, 4)))
    s = index(scales, [g])                      _assert_async(ok, "fusec: index out of range ...")
                                                s = index(scales, [g_idx])

Each check is a small reduction kernel (the and-ing of several joins the last one's kernel), and
the program makes one `_assert_async` call: on a CPU it raises at once, on a GPU it is a
device-side assert, as eager's own index kernel has. The pass also drops a
widening cast of the index (`g_idx.long()`: an int32 value is the same position as an int64 one),
so the index is read where it lies rather than copied first. Each rewrite is a `Decision` in
`record_of(gm).check_gathers`.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fusec.symbolic import hashable
from fusec import ops
from fusec.graphmodule import looks_for
from fusec.ir import meta_of
from fusec.record import Decision, record_of
from fusec.runtime.steps import INDEX_CHECK  # (its check raises eager's IndexError there)

from .fold_constants import known_value
from .grouping import meta
from .layout import run_fake, set_meta
from .schedule import fake_mode_of

aten = torch.ops.aten
MESSAGE_MAX = 254  # characters: the most an _assert_async message may have on a GPU
# The check's message opens with INDEX_CHECK ("fusec: index out of range: "), which the program
# raises as eager's IndexError on a CPU (fusec/runtime/steps.py check_index_values), or with
# POSITION_CHECK, an _assert_async's RuntimeError as eager's gather and scatter raise (picks.py).
POSITION_CHECK = "fusec: position out of range: "


@looks_for(*ops.GATHER_TARGETS)
def check_gathers(gm: fx.GraphModule) -> fx.GraphModule:
    """Read each gathered read's index without a widening cast, and check its values once."""
    graph, decisions, checked = gm.graph, [], set()
    # (all values in range, what it checks), by the message's opening: eager's IndexError for
    # x[i], embedding and index_select; its RuntimeError for a gather passes/picks.py rewrote
    checks: dict[str, list[tuple[fx.Node, str]]] = {INDEX_CHECK: [], POSITION_CHECK: []}
    mode = None
    for node in list(graph.nodes):
        gather = ops.gathered_read(node)
        if gather is None:
            continue
        mode = mode or fake_mode_of(gm)
        index = _uncast(gather.index)
        if index is not gather.index:
            _set_index(node, gather, index)
            decisions.append(Decision(node.name, True, f"reads {index.name} as it is: its cast to "
                                      f"{meta(gather.index).dtype} names the same rows"))
        key = (_values_of(index), hashable(gather.lowest), hashable(gather.size))
        if key in checked:
            continue
        known = _constant(gm, index)
        if known is not None and gather.lowest <= known[0] and known[1] < gather.size:
            checked.add(key)
            decisions.append(Decision(node.name, False, f"{index.name} is a constant, "
                                      f"{known[2]}: in [{gather.lowest}, {gather.size}), "
                                      "nothing to check"))
            continue
        checked.add(key)
        what = (f"every value of {index.name} must be in [{gather.lowest}, {gather.size}) "
                f"({node.name} reads rows of {gather.source.name})")
        opening = POSITION_CHECK if node.meta.get("fusec_gather") else INDEX_CHECK
        checks[opening].append((range_check(graph, mode, index, gather.lowest, gather.size, node),
                                what))
        decisions.append(Decision(node.name, True, f"checks {index.name} once: every value in "
                                  f"[{gather.lowest}, {gather.size})"))
    for opening, group in checks.items():
        if group:
            assert_all(graph, mode, group, opening)
    record_of(gm).check_gathers = decisions
    if decisions:
        graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure(impure_random=True))
        graph.lint()
        gm.recompile()
    return gm


# Views that keep every value of their input and add none: a view of a checked index needs no
# check of its own (a slice would check fewer values, and stays its own check).
SAME_VALUES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default,
               aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
               aten.expand.default, aten.permute.default, aten.t.default, aten.transpose.int)


def _values_of(index: fx.Node) -> fx.Node:
    """The node whose values `index` holds: itself, or what a chain of SAME_VALUES views reads
    (BERT's position ids, read by one embedding as they are and by another as a vector)."""
    while index.op == "call_function" and index.target in SAME_VALUES \
            and isinstance(index.args[0], fx.Node):
        index = index.args[0]
    return index


def _uncast(index: fx.Node) -> fx.Node:
    """`g_idx` for `g_idx.long()`: a cast between int32 and int64 that loses nothing."""
    if index.op == "call_function" and index.target is aten._to_copy.default \
            and set(index.kwargs) <= {"dtype"} and len(index.args) == 1 \
            and isinstance(index.args[0], fx.Node) \
            and isinstance(index.args[0].meta.get("fusec"), type(meta(index))) \
            and meta(index.args[0]).dtype == torch.int32 and meta(index).dtype == torch.int64 \
            and meta(index.args[0]).device == meta(index).device:
        return index.args[0]
    return index


def _constant(gm: fx.GraphModule, index: fx.Node):
    """(lowest, highest, what) of an index known while compiling, else None: one filled with one
    number (`torch.zeros(shape, dtype=torch.long)`: the token types a model makes when none are
    given), or a table folded by passes/fold_constants.py (not a tensor the caller hands in: it
    may change between calls)."""
    if index.op == "call_function" and index.target is aten.full.default \
            and isinstance(index.args[1], int) and not isinstance(index.args[1], bool):
        return index.args[1], index.args[1], f"every value {index.args[1]}"
    value = known_value(gm, index)
    if value is not None and value.numel():
        lo, hi = int(value.min()), int(value.max())
        return lo, hi, f"values {lo} to {hi}"
    return None


def _set_index(node: fx.Node, gather: ops.Gather, index: fx.Node) -> None:
    args = list(node.args)
    if node.target is aten.index.Tensor:
        args[1] = [index if i is gather.index else i for i in args[1]]
    elif node.target is aten.embedding.default:
        args[1] = index
    else:
        args[2] = index
    node.args = tuple(args)


def range_check(graph: fx.Graph, mode, index: fx.Node, lowest: int, size: int,
                like: fx.Node) -> fx.Node:
    """ok = all(lowest <= index < size), computed right after the index (also used by
    passes/picks.py for the positions a gather or scatter picks)."""
    with graph.inserting_after(index):
        low = add_call(graph, mode, aten.ge.Scalar, (index, lowest), like)
    with graph.inserting_after(low):
        high = add_call(graph, mode, aten.lt.Scalar, (index, size), like)
    with graph.inserting_after(high):
        both = add_call(graph, mode, aten.logical_and.default, (low, high), like)
    with graph.inserting_after(both):
        return add_call(graph, mode, aten.all.default, (both,), like)


def assert_all(graph: fx.Graph, mode, checks: list, prefix: str) -> None:
    """One `_assert_async` for the whole program, of all its checks (ok, what) and-ed together
    (one call fewer per checked index: a decoding step checks its token and its position). Its
    message is `prefix` and each failing-check's `what`, joined (passes/check_divisors.py uses
    it with its own prefix)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    checks = sorted(checks, key=lambda c: order[c[0]])
    ok = checks[0][0]
    for other, _ in checks[1:]:
        with graph.inserting_after(other):
            ok = add_call(graph, mode, aten.logical_and.default, (ok, other), other)
    with graph.inserting_after(ok):
        message = prefix + "; ".join(what for _, what in checks)
        if len(message) > MESSAGE_MAX:  # (CUDA's _assert_async takes at most 254 characters)
            message = message[:MESSAGE_MAX - 4] + " ..."
        new = graph.call_function(aten._assert_async.msg, (ok, message))
    new.meta.update({k: v for k, v in ok.meta.items() if k not in ("val", "fusec")})
    new.meta["val"], new.meta["fusec"] = None, meta_of(None)


def add_call(graph: fx.Graph, mode, target, args, like: fx.Node, kwargs=None) -> fx.Node:
    """A new call of `target` where the graph inserts now, its fake value run in `mode` and
    its other meta (source lines, stack) taken from `like` (the checks' and picks' new ops)."""
    new = graph.call_function(target, args, kwargs or {})
    set_meta(new, run_fake(mode, new), like)
    return new

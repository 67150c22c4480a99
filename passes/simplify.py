"""Simplify: the same values from fewer transcendental functions.

A fused pointwise kernel after a convolution is often bound by its math, not its memory: each
`exp`, `log1p` or `tanh` is tens of instructions per element. One composition is common enough to
have a name, mish, and is also written out by hand (`x * torch.tanh(F.softplus(x))`):

    tanh(softplus(x)) = tanh(log(1 + e^x)) = ((1 + n)^2 - 1) / ((1 + n)^2 + 1) = n(n + 2) / (n(n + 2) + 2)

with n = e^x: one exp and a division instead of exp, log1p and tanh. torch's softplus (beta 1,
threshold 20) is `where(x > 20, x, log1p(exp(x)))`, and this pass rewrites

    before                                          after
    e = exp(x); l = log1p(e)                        c = clamp_max(x, 20.0); n = exp(c)
    w = where(gt(x, 20), x, l)                      t = n * (n + 2)
    y = tanh(w)                                     y = t / (t + 2)

Above 20 both sides give 1.0 in float32 (and the clamp keeps n(n + 2) finite); NaN stays NaN,
-inf gives 0 as eager does. The result differs from eager's by a few ulp (docs/passes/
simplify.md has the measurement). Only float32 and float64: in half precision eager rounds
after every op of the spelled-out form, and this pass would not. `F.mish` itself is decomposed
the same way at capture (capture/decompositions.py, `mish`), for every float dtype, since eager's
mish kernel rounds once.

The second rule narrows a shift. Unpacking 4-bit weights shifts int32 words by amounts that are
int64 tensors (`qweight[:, :, None] >> torch.arange(0, 32, 4)`), so type promotion makes every
shift a 64-bit one, and then the result is cast straight back to int8. A GPU does 64-bit integer
math in several 32-bit instructions, once per weight in a GEMV's prologue. When every user of
the shift keeps at most 32 bits of it, the same bits come from a 32-bit shift:

    before                                          after
    r = bitwise_right_shift(w_i32, s_i64)           s32 = _to_copy(clamp(s_i64, -1, 32), int32)
    q = _to_copy(r, dtype=int8)                     r = bitwise_right_shift(w_i32, s32)
                                                    q = _to_copy(r, dtype=int8)

For an amount in [0, 32) the int64 result is the int32 one sign-extended; for any other amount
both are the sign bits of w (an amount past the width, or negative, shifts a signed value to
its sign; the clamp keeps a huge int64 amount from wrapping into range when narrowed). The
amounts are usually a row value of the kernel (one per column), so the clamp costs nothing per
weight. Each rewrite is a `Decision` in `record_of(gm).simplify`.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fusec.record import Decision, record_of

from .grouping import meta
from .layout import run_fake, set_meta
from .schedule import fake_mode_of
from .unflatten import erase_dead

aten = torch.ops.aten


def simplify(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite tanh(softplus(x)) as one exp and a division, and narrow 64-bit shifts whose
    users keep 32 bits (see the module docstring)."""
    decisions = []
    graph = gm.graph
    for node in list(graph.nodes):
        x = _tanh_of_softplus(node)
        if x is None:
            continue
        if meta(x).dtype not in (torch.float32, torch.float64):
            decisions.append(Decision(node.name, False, f"{meta(x).dtype}: eager rounds after "
                                      "every op of softplus and tanh"))
            continue
        with graph.inserting_before(node):
            n = graph.call_function(aten.exp.default, (
                graph.call_function(aten.clamp_max.default, (x, 20.0)),))
            t = graph.call_function(aten.mul.Tensor, (
                n, graph.call_function(aten.add.Tensor, (n, 2.0))))
            ratio = graph.call_function(aten.div.Tensor, (
                t, graph.call_function(aten.add.Tensor, (t, 2.0))))
        for new in (n.args[0], n, t.args[1], t, ratio.args[1], ratio):
            new.meta.update({k: node.meta[k] for k in ("val", "fusec") if k in node.meta})
        ratio._rename(f"{node.name}_softplus")
        old = node.args[0]
        node.replace_all_uses_with(ratio)
        graph.erase_node(node)
        erase_dead(graph, old)
        decisions.append(Decision(ratio.name, True, f"tanh(softplus({x.name})) as "
                                  "n(n + 2) / (n(n + 2) + 2), n = exp(x): one exp instead of "
                                  "exp, log1p and tanh"))
    for node in list(graph.nodes):
        if _narrowable_shift(node):
            word, amount = node.args
            with graph.inserting_before(node):
                clamped = graph.call_function(aten.clamp.default, (amount, -1, 32))
                narrow = graph.call_function(aten._to_copy.default, (clamped,),
                                             {"dtype": torch.int32})
                shift = graph.call_function(aten.bitwise_right_shift.Tensor, (word, narrow))
            mode = fake_mode_of(gm)
            for new in (clamped, narrow, shift):
                set_meta(new, run_fake(mode, new), node)
            shift._rename(f"{node.name}_32")
            node.replace_all_uses_with(shift)
            graph.erase_node(node)
            decisions.append(Decision(shift.name, True, f"{word.name} >> {amount.name} in 32 "
                                      "bits: its users keep at most 32 bits of the int64 shift"))
    record_of(gm).simplify = decisions
    if any(t for _, t, _ in decisions):
        graph.lint()
        gm.recompile()
    return gm


NARROW = (torch.int8, torch.uint8, torch.int16, torch.int32)


def _narrowable_shift(node: fx.Node) -> bool:
    """An int64 right shift of an int32 value by an int64 tensor, whose users all cast it to at
    most 32 bits."""
    if not (_is(node, aten.bitwise_right_shift.Tensor) or _is(node, aten.__rshift__.Tensor)) \
            or len(node.args) != 2 or node.kwargs:
        return False
    word, amount = node.args
    if not (isinstance(word, fx.Node) and isinstance(amount, fx.Node)) or not node.users:
        return False
    if (meta(word).dtype, meta(amount).dtype, meta(node).dtype) != (torch.int32, torch.int64,
                                                                    torch.int64):
        return False
    return all(_is(u, aten._to_copy.default) and len(u.args) == 1 and set(u.kwargs) == {"dtype"}
               and u.kwargs["dtype"] in NARROW for u in node.users)


def _tanh_of_softplus(node: fx.Node) -> fx.Node | None:
    """x when node is tanh(where(gt(x, 20), x, log1p(exp(x)))), else None."""
    if node.op != "call_function" or node.target is not aten.tanh.default:
        return None
    where = node.args[0]
    if not _is(where, aten.where.self) or len(where.args) != 3:
        return None
    gt, x, log1p = where.args
    if not (_is(gt, aten.gt.Scalar) and gt.args[0] is x and gt.args[1] == 20
            and _is(log1p, aten.log1p.default) and _is(log1p.args[0], aten.exp.default)
            and log1p.args[0].args[0] is x):
        return None
    return x


def _is(node, target) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target

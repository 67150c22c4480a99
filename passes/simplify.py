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
math in several 32-bit instructions, once per weight in a matmul's prologue. When every user of
the shift keeps at most 32 bits of it, the same bits come from a 32-bit shift:

    before                                          after
    r = bitwise_right_shift(w_i32, s_i64)           s32 = _to_copy(clamp(s_i64, -1, 32), int32)
    q = _to_copy(r, dtype=int8)                     r = bitwise_right_shift(w_i32, s32)
                                                    q = _to_copy(r, dtype=int8)

For an amount in [0, 32) the int64 result is the int32 one sign-extended; for any other amount
both are the sign bits of w (an amount past the width, or negative, shifts a signed value to
its sign; the clamp keeps a huge int64 amount from wrapping into range when narrowed). The
amounts are usually a row value of the kernel (one per column), so the clamp costs nothing per
weight. Both are rules of passes/patterns.py, a pattern and the replacement built for it; each
rewrite is a `Decision` in `record_of(gm).simplify`.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .grouping import meta, record_decisions
from .patterns import Builder, Declined, Match, Op, Rule, Var, looks_for_rules, rewrite

aten = torch.ops.aten


# ---- tanh(softplus(x)) --------------------------------------------------------------------------

def _one_exp(b: Builder, m: Match) -> fx.Node | Declined:
    dtype = meta(m.x).dtype
    if dtype not in (torch.float32, torch.float64):
        return Declined(f"{dtype}: eager rounds after every op of softplus and tanh")
    n = b(aten.exp.default, b(aten.clamp_max.default, m.x, 20.0))
    t = b(aten.mul.Tensor, n, b(aten.add.Tensor, n, 2.0))
    return b(aten.div.Tensor, t, b(aten.add.Tensor, t, 2.0))


X = Var("x")
TANH_OF_SOFTPLUS = Rule(
    "tanh(softplus(x))",
    Op(aten.tanh.default, Op(aten.where.self, Op(aten.gt.Scalar, X, 20), X,
                             Op(aten.log1p.default, Op(aten.exp.default, X)))),
    _one_exp, "tanh(softplus({x})) as n(n + 2) / (n(n + 2) + 2), n = exp(x): one exp instead of "
    "exp, log1p and tanh")


# ---- 64-bit shifts kept in 32 bits ---------------------------------------------------------------

NARROW = (torch.int8, torch.uint8, torch.int16, torch.int32)


def _narrow_shift(b: Builder, m: Match) -> fx.Node:
    """The shift in 32 bits when its users all cast it to at most 32 bits; else itself."""
    node, word, amount = m.shift, m.word, m.amount
    if not (isinstance(word, fx.Node) and isinstance(amount, fx.Node) and node.users):
        return node
    if (meta(word).dtype, meta(amount).dtype, meta(node).dtype) != (torch.int32, torch.int64,
                                                                    torch.int64):
        return node
    if not all(u.target is aten._to_copy.default and len(u.args) == 1
               and set(u.kwargs) == {"dtype"} and u.kwargs["dtype"] in NARROW for u in node.users):
        return node
    clamped = b(aten.clamp.default, amount, -1, 32)
    return b(aten.bitwise_right_shift.Tensor, word, b(aten._to_copy.default, clamped,
                                                      dtype=torch.int32))


SHIFT_IN_32_BITS = Rule(
    "shift in 32 bits",
    Op((aten.bitwise_right_shift.Tensor, aten.__rshift__.Tensor), Var("word"), Var("amount"),
       name="shift"),
    _narrow_shift, "{word} >> {amount} in 32 bits: its users keep at most 32 bits of the int64 "
    "shift")

RULES = [TANH_OF_SOFTPLUS, SHIFT_IN_32_BITS]


@looks_for_rules("RULES")  # (a graph without a tanh or a shift is skipped)
def simplify(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite tanh(softplus(x)) as one exp and a division, and narrow 64-bit shifts whose
    users keep 32 bits (see the module docstring)."""
    return record_decisions(gm, "simplify", rewrite(gm, RULES))

"""Sums that can share a pass over the row with the reduction before them (the loop plan's folds,
fusec/loop_plan.py): found in lowering, on the kernel IR, so each backend only decides whether to
take them.

* `online_softmax`: a sum of exp(v - c) whose shift c is the amax of the same v one phase
  earlier (softmax's denominator): a running max and a rescaled running sum share one pass.
* `online_variance`: a sum of (v - c)^2 whose v is known one phase earlier and whose c is a row
  value known when that phase ends (a variance): per-lane running means share the pass.

Both match their pattern exactly, through plain copies only, in one float dtype with no rounding
to half precision on the way: a folded sum must equal the two-pass one up to rounding on every
row, NaN and infinities included.
"""
from __future__ import annotations

import math

import torch

from fusec.ir import Const, OnlineSoftmax, OnlineVariance, Reduce, Stmt, Var


def plain(item, op: str) -> bool:
    """item is the Stmt `op` computed in one float dtype, with no rounding anywhere."""
    return (isinstance(item, Stmt) and item.op == op and item.round_to is None
            and item.var.dtype.is_floating_point and item.result_dtype == item.var.dtype
            and all(isinstance(o, Var) and o.dtype == item.var.dtype for o in item.operands)
            and all(dt == item.var.dtype for dt in item.operand_dtypes))


def _through_copies(made: dict, var):
    """The value var copies, through plain `to` and `copy` statements."""
    while isinstance(var, Var) and (plain(made.get(var.name), "to") or
                                    plain(made.get(var.name), "copy")):
        var = made[var.name].operands[0]
    return var


def online_softmax(body: list, varying: set[str]) -> list[OnlineSoftmax]:
    """The sums of exp(v - c) that can share a pass with amax(v) (see fusec.ir.OnlineSoftmax).

    Matched exactly, so the one-pass sum equals the two-pass one (up to rounding) on every row,
    including rows with infinities and NaN: the sum's operand is exp(sub(v, c)), through plain
    copies only, every step in one float dtype with no rounding to half precision; the amax of
    the same v runs in the phase just before; and c is that amax, or where(cond, K, amax) with
    a finite constant K (logsumexp's guard for infinite rows).
    """
    made = {item.var.name: item for item in body}

    through_copies = lambda var: _through_copies(made, var)  # noqa: E731

    def finite_constant(o) -> bool:
        item = made.get(o.name) if isinstance(o, Var) else None
        if isinstance(item, Stmt) and item.op == "full" and item.var.dtype == o.dtype:
            o = item.operands[0]
        return isinstance(o, Const) and math.isfinite(o.value)

    found = []
    for total in body:
        if not (isinstance(total, Reduce) and total.op == "sum" and total.round_to is None
                and total.acc_dtype == total.var.dtype):
            continue
        exp = made.get(through_copies(total.operand).name)
        sub = made.get(through_copies(exp.operands[0]).name) if plain(exp, "exp") else None
        if not plain(sub, "sub") or sub.var.dtype != total.acc_dtype:
            continue
        v, shift = through_copies(sub.operands[0]), sub.operands[1]
        if v.name not in varying or shift.name in varying:
            continue
        guard = made.get(shift.name)
        if isinstance(guard, Stmt) and guard.op == "where" and guard.round_to is None \
                and guard.operand_dtypes[1:] == (shift.dtype, shift.dtype) \
                and guard.var.dtype == shift.dtype and finite_constant(guard.operands[1]):
            m = guard.operands[2]
        else:
            m = shift
        peak = made.get(m.name) if isinstance(m, Var) else None
        if (isinstance(peak, Reduce) and peak.op == "amax" and through_copies(peak.operand) == v
                and peak.phase == total.phase - 1 and peak.round_to is None
                and peak.acc_dtype == peak.var.dtype == peak.operand.dtype == total.acc_dtype):
            found.append(OnlineSoftmax(total.var.name, peak.var.name, peak.operand.name,
                                       shift.name))
    return found


def online_variance(body: list, varying: set[str], level: dict) -> list[OnlineVariance]:
    """The sums of (v - c)^2 that can be accumulated in the pass before their own (see
    fusec.ir.OnlineVariance): the sum's operand is mul(d, d) with d = sub(v, c), through plain
    copies, every step in the sum's float dtype (no rounding to half precision: a float16
    variance written out rounds at every element, and one pass would not); v is an element value
    that needs no reduction of the sum's phase or later, c a row value known when the phase
    before ends (a mean; any row value is exact, see the note on OnlineVariance)."""
    made = {item.var.name: item for item in body}

    through_copies = lambda var: _through_copies(made, var)  # noqa: E731

    found = []
    for total in body:
        if not (isinstance(total, Reduce) and total.op == "sum" and total.round_to is None
                and total.phase >= 1 and total.acc_dtype == total.var.dtype
                and total.var.dtype in (torch.float32, torch.float64)):
            continue
        square = made.get(through_copies(total.operand).name)
        if not plain(square, "mul") or square.operands[0] != square.operands[1] \
                or square.var.dtype != total.acc_dtype:
            continue
        sub = made.get(through_copies(square.operands[0]).name)
        if not plain(sub, "sub"):
            continue
        v, shift = sub.operands
        if v.name in varying and shift.name not in varying \
                and level.get(v.name, 0) < total.phase and level.get(shift.name, 0) <= total.phase:
            found.append(OnlineVariance(total.var.name, v.name, shift.name))
    return found

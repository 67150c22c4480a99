"""check_divisors: an integer division by zero raises, as eager's does.

Eager refuses `x // y`, `x % y`, `fmod(x, y)` and `div(x, y, rounding_mode=...)` of integer
tensors when some value of `y` is 0: its CPU kernels check every divisor and raise
`RuntimeError: ZeroDivisionError`. A kernel cannot raise, and dividing an integer by zero is
undefined in C++ and LLVM (on x86 it stops the process), so the backends' kernels divide by a
divisor that is never 0 and the answer at those positions is made up. This pass adds eager's
check as ordinary graph ops, once per divisor tensor, right after the divisor, and one
`_assert_async` of all of them (as passes/check_gathers.py checks indices):

    before                                      after
    d = div.Tensor_mode(x, y, rounding='floor') ok = all(ne(y, 0))
                                                _assert_async(ok, "fusec: ZeroDivisionError ...")
                                                d = div.Tensor_mode(x, y, rounding='floor')

Each check is a small reduction kernel; floating-point division needs none (it gives inf or NaN,
as eager's). A divisor that is a Python number is checked while compiling: 0 is refused at once.
Each check is a `Decision` in `record_of(gm).check_divisors`.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fusec.errors import UnsupportedError
from fusec.graphmodule import looks_for
from fusec.record import Decision, record_of

from .check_gathers import add_call, assert_all
from .schedule import fake_mode_of

aten = torch.ops.aten
INTEGER_DIVISIONS = (aten.div.Tensor_mode, aten.div.Scalar_mode, aten.floor_divide.default,
                     aten.floor_divide.Scalar, aten.remainder.Tensor, aten.remainder.Scalar,
                     aten.fmod.Tensor, aten.fmod.Scalar)


@looks_for(*INTEGER_DIVISIONS)
def check_divisors(gm: fx.GraphModule) -> fx.GraphModule:
    """Check each integer division's divisor once: no value of it is 0."""
    graph, decisions, checked, checks, mode = gm.graph, [], set(), [], None
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in INTEGER_DIVISIONS \
                or not _integral(node):
            continue
        divisor = node.args[1]
        if not isinstance(divisor, fx.Node):
            if _in_dtype(divisor, node) == 0:  # (`x // 2**40` of int32: eager's 0 as well)
                held = "" if divisor == 0 else ", which its integer dtype holds as 0"
                raise UnsupportedError(f"fusec: ZeroDivisionError: {node.name} divides integers "
                                       f"by the number {divisor}{held} (eager raises the same on "
                                       "every call)")
            continue
        if divisor in checked:
            continue
        checked.add(divisor)
        mode = mode or fake_mode_of(gm)
        with graph.inserting_after(divisor):
            nonzero = add_call(graph, mode, aten.ne.Scalar, (divisor, 0), node)
        with graph.inserting_after(nonzero):
            ok = add_call(graph, mode, aten.all.default, (nonzero,), node)
        checks.append((ok, f"{divisor.name}, the divisor of {node.name}"))
        decisions.append(Decision(node.name, True, f"checks {divisor.name} once: no value is 0 "
                                  "(an integer division by zero raises, as eager's)"))
    if checks:
        assert_all(graph, mode, checks,
                   "fusec: ZeroDivisionError: a divisor of an integer division is 0: ")
        graph.lint()
        gm.recompile()
    record_of(gm).check_divisors = decisions
    return gm


def _integral(node: fx.Node) -> bool:
    """The division is of integers (bool included: eager's `True // False` raises too)."""
    info = node.meta.get("fusec")
    dtype = getattr(info, "dtype", None)
    return dtype is not None and not dtype.is_floating_point and not dtype.is_complex


def _in_dtype(number, node: fx.Node):
    """A Python int divisor as the dividend's integer dtype holds it (eager converts it first,
    wrapping: 2**40 is 0 in int32, 256 is 0 in uint8); other numbers as they are."""
    dividend = node.args[0].meta.get("fusec") if isinstance(node.args[0], fx.Node) else None
    dtype = getattr(dividend, "dtype", None)
    if type(number) is not int or dtype is None or dtype.is_floating_point or dtype.is_complex \
            or dtype == torch.bool:
        return number
    info = torch.iinfo(dtype)
    return (number - info.min) % (info.max - info.min + 1) + info.min

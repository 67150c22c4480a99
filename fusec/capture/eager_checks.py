"""Checks eager makes on tensor values that tracing would lose, put into the graph.

Some composite ops check their input's values before they compute: `F.one_hot(labels, n)` raises
"Class values must be non-negative." for a label below 0 and "Class values must be smaller than
num_classes." for one at or above n. Under fake tensors there are no values to check, so ATen's
traced path skips both and becomes `eq(labels.unsqueeze(-1), arange(n))`: a label of 7 with n = 5
gave a row of zeros, a wrong answer where eager raises. `F.binary_cross_entropy` of a probability
outside [0, 1] gave NaN where eager raises "all elements of input should be between 0 and 1".

While fusec traces, `eager_value_checks` catches those calls (a TorchFunctionMode, as
capture/rnn.py does for recurrent layers) and traces each check eager makes as graph ops,
`_assert_async(all(labels >= 0), message)`, before the op itself. The check is a small reduction
that fusion puts into a kernel; on a CPU the assert raises at once with eager's message (prefixed
"fusec: "), on a GPU it is a device-side assert, as eager's CUDA one_hot has.

Some ops also check the Python numbers they are given: `x.masked_fill(mask, 256)` of a uint8 x,
`torch.where(c, int8_x, 300)`, `x.clamp(max=300)`, `torch.full_like(x, 300)` raise "value cannot be
converted to type uint8_t without overflow" (ATen's checked conversion: a signed type takes
[min, max]; an unsigned one [-max, max], a negative wrapping; float32 any finite value up to its
largest, and inf or NaN; float16 and bfloat16 are left alone: eager checks them only for a tensor
of two or more elements). Traced, the number is a literal of the graph that a kernel converts
with a wrap: 256 filled 0s. `refuse_overflowing_scalars` looks at the literals of those ops once,
after tracing, and raises as eager does (add, mul and the other arithmetic convert without a check
in eager too: `u8 + 300` wraps there as well).

The same mode refuses what eager refuses by dtype before any value is read: an in-place op whose
result the tensor cannot hold by kind (`int_x *= float_tensor`: functionalized, the op runs out
of place and a copy casts the result back), a softmax of an int tensor, std of an int one, argmax
of a bool one (`INPLACE`, `REFUSED_DTYPES`: fusec's decompositions would compute them). And it
traces `mask |= other` as `mask.bitwise_or_(other)`: functionalization cannot trace aten::__ior__.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

from fusec.errors import UnsupportedError

F = torch.nn.functional


def _one_hot_checks(labels, num_classes=-1):
    """Eager's value checks of `F.one_hot(labels, num_classes)`, traced as asserts."""
    if not isinstance(labels, torch.Tensor) or labels.numel() == 0:
        return  # (eager checks nothing in an empty tensor either)
    torch._assert_async(torch.all(labels >= 0), "fusec: one_hot: Class values must be non-negative.")
    if not isinstance(num_classes, int) or num_classes != -1:
        torch._assert_async(torch.all(labels < num_classes),
                            "fusec: one_hot: Class values must be smaller than num_classes.")


def _binary_cross_entropy_checks(input, *args, **kwargs):
    """Eager's check of `F.binary_cross_entropy`'s probabilities (a NaN fails it too)."""
    if isinstance(input, torch.Tensor) and input.numel():
        torch._assert_async(torch.all((input >= 0) & (input <= 1)), "fusec: binary_cross_entropy: "
                            "all elements of input should be between 0 and 1")


aten = torch.ops.aten

# op -> the positions (ints) and keywords (strs) of the numbers it converts to its result's dtype
# with ATen's overflow check
CHECKED_NUMBERS = {
    aten.scalar_tensor.default: (0,), aten.full.default: (1,), aten.full_like.default: (1,),
    aten.new_full.default: (2,), aten.fill.Scalar: (1,), aten.masked_fill.Scalar: (2,),
    aten.index_fill.int_Scalar: (3,), aten.clamp.default: (1, 2, "min", "max"),
    aten.clamp_min.default: (1,), aten.clamp_max.default: (1,), aten.pow.Tensor_Scalar: (),
}


def _negative_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value < 0


def overflows(value, dtype: torch.dtype) -> bool:
    """Whether ATen's checked conversion of the Python number `value` to `dtype` raises."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or dtype == torch.bool \
            or dtype.is_complex or value != value or value in (float("inf"), float("-inf")):
        return False
    if dtype.is_floating_point:  # (float16 and bfloat16: eager's check depends on the size)
        return dtype == torch.float32 and abs(value) > torch.finfo(dtype).max
    info = torch.iinfo(dtype)
    if info.min == 0:  # (unsigned: a negative number wraps, down to -max)
        return value > info.max or value < -info.max
    return value > info.max or value < info.min


def refuse_overflowing_scalars(gm):
    """gm, or the UnsupportedError for a number one of its ops cannot convert to its result's
    dtype, which eager raises too (see the module's docstring)."""
    for node in gm.graph.nodes:
        where = CHECKED_NUMBERS.get(node.target) if node.op == "call_function" else None
        out = node.meta.get("val") if where is not None else None
        if not isinstance(out, torch.Tensor):
            continue
        values = [node.args[i] if isinstance(i, int) and i < len(node.args) else node.kwargs.get(i)
                  for i in where]
        if node.target is aten.pow.Tensor_Scalar and _negative_int(node.args[1]) \
                and not out.dtype.is_floating_point and not out.dtype.is_complex:
            raise UnsupportedError("fusec: Integers to negative integer powers are not allowed "
                                   f"(pow of {out.dtype} by {node.args[1]}): eager PyTorch raises "
                                   "this too; raise a float to it (`x.float() ** -1`)")
        for value in values:
            if overflows(value, out.dtype):
                name = node.target.__name__.split(".")[0]
                raise UnsupportedError(
                    f"fusec: value {value} cannot be converted to type "
                    f"{str(out.dtype).replace('torch.', '')} without overflow ({name}): eager "
                    "PyTorch raises this too; use a number the tensor's dtype holds")
    return gm


# In-place arithmetic: eager computes in the operands' promoted dtype and refuses to write a
# result its output cannot hold by kind (`int_x *= float_tensor`: "result type Float can't be cast
# to the desired output type Long"). Functionalized, the op is out of place and a copy casts the
# result back: 2.5 * 3 was stored as 7. (name, whether it divides: int / int is float)
INPLACE = {getattr(torch.Tensor, name): name in ("div_", "true_divide_", "__itruediv__")
           for name in ("add_", "sub_", "mul_", "div_", "true_divide_", "floor_divide_",
                        "remainder_", "fmod_", "pow_", "copysign_", "atan2_", "hypot_",
                        "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                        "__imod__", "__ipow__")}


def _inplace_checks(func, args, kwargs):
    """Eager's check that an in-place op's result dtype can be written into its first operand."""
    if len(args) < 2 or not isinstance(args[0], torch.Tensor) \
            or not isinstance(args[1], (torch.Tensor, int, float, bool)) \
            or (func in (torch.Tensor.div_,) and kwargs.get("rounding_mode") is not None):
        return
    self, result = args[0], torch.result_type(args[0], args[1])
    if INPLACE[func] and not (result.is_floating_point or result.is_complex):
        result = torch.get_default_dtype()
    if not torch.can_cast(result, self.dtype):
        raise UnsupportedError(
            f"fusec: result type {_name(result)} can't be cast to the desired output type "
            f"{_name(self.dtype)} ({func.__name__}): eager PyTorch raises this too; cast the "
            "operand first or compute out of place")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# `mask |= other` calls Tensor.__ior__, whose ATen op (`aten::__ior__`) functionalization cannot
# trace ("Found a custom (non-ATen) operator whose output has alias annotations"): the capture
# failed. Traced as the in-place op it is, `mask.bitwise_or_(other)`.
BITWISE_INPLACE = {torch.Tensor.__ior__: torch.Tensor.bitwise_or_,
                   torch.Tensor.__iand__: torch.Tensor.bitwise_and_,
                   torch.Tensor.__ixor__: torch.Tensor.bitwise_xor_,
                   torch.Tensor.__ilshift__: torch.Tensor.bitwise_left_shift_,
                   torch.Tensor.__irshift__: torch.Tensor.bitwise_right_shift_}

def _floating(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


# Ops whose kernels eager has for some dtypes only, where fusec's decomposition would compute
# anything: a softmax of an int tensor gave 0s ("softmax_lastdim_kernel_impl" not implemented for
# 'Long' in eager). (funcs, the input dtypes eager refuses, eager's words)
REFUSED_DTYPES = [
    ((F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, torch.Tensor.softmax,
      torch.Tensor.log_softmax), lambda d: not _floating(d), "softmax of a {} tensor is not "
     "implemented (pass dtype=torch.float32)"),
    ((torch.std, torch.var, torch.std_mean, torch.var_mean, torch.Tensor.std, torch.Tensor.var),
     lambda d: not _floating(d), "std and var only support floating point and complex dtypes, "
     "not {}"),
    ((torch.argmax, torch.argmin, torch.Tensor.argmax, torch.Tensor.argmin),
     lambda d: d == torch.bool, "argmax() and argmin() do not support {} input"),
]
REFUSED = {func: (refuses, words) for funcs, refuses, words in REFUSED_DTYPES for func in funcs}


def _dtype_checks(func, args, kwargs):
    refuses, words = REFUSED[func]
    if args and isinstance(args[0], torch.Tensor) and refuses(args[0].dtype) \
            and not any(isinstance(a, torch.dtype) for a in (*args, *kwargs.values())):
        raise UnsupportedError(f"fusec: {words.format(_name(args[0].dtype))} (eager PyTorch "
                               f"raises this too: {func.__name__})")


# func -> a function of the same arguments that traces eager's checks of them
CHECKS = {F.one_hot: _one_hot_checks, F.binary_cross_entropy: _binary_cross_entropy_checks}


class _EagerValueChecks(TorchFunctionMode):
    """See `eager_value_checks`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        check = CHECKS.get(func)
        if check is not None:
            check(*args, **kwargs)
        elif func in INPLACE:
            _inplace_checks(func, args, kwargs)
        elif func in REFUSED:
            _dtype_checks(func, args, kwargs)
        func = BITWISE_INPLACE.get(func, func)
        return func(*args, **kwargs)


@contextlib.contextmanager
def eager_value_checks():
    """While tracing, each op in `CHECKS` first traces the checks eager makes of its values."""
    with _EagerValueChecks():
        yield

"""The op table: one row per operation fusec can compile into a kernel.

Why this file is long: it is the one op table ("adding an op is one row plus a test":
docs/ops.md, "Adding an op"). Its rows and the ATen mapping below them are read together;
split, a reader would look for an op in several places.

Every backend reads the same rows. A row says what kind of op it is, how PyTorch promotes its
operand dtypes, and how to spell it in each backend, as a format string over its operands
(`{0}`, `{1}`, ...). The operands arrive already converted to the row's *compute dtype*, so an
expression never worries about type promotion; Python decided that before rendering.

    Op("sin", triton="tl.sin({0})", cpp="std::sin({0})", llvm="call {T} @sin{m}({T} {0})",
       promote=INT_TO_FLOAT)

The LLVM spelling is one or more LLVM instructions (one per line; `{t0}`, `{t1}` name the
results of the earlier lines, the last line is the op's value). LLVM has no overloading, so
`{T}` is the LLVM type the op computes in (`float`, `i32`), `{S}` its intrinsic suffix (`f32`),
`{m}` the C library's suffix (`sinf` vs `sin`) and `{D}` fusec's short dtype name (`u8`, which
LLVM cannot tell from `i8`). Where the instruction depends on the kind of type, the spelling has
one section per kind: `"f: fadd {T} {0}, {1} || i: add {T} {0}, {1}"` (f float, s signed int,
u unsigned int, b bool, i any integer or bool). codegen/llvm/__init__.py documents the details.

Longer expressions live as helper functions next to the backend (`codegen/triton/helpers.py`,
`codegen/cpp/templates/cpp_prelude.h`), so a generated kernel calls `fusec_gelu(x)` rather than
repeating a formula. The helpers have the same names in both backends.

The second half of this file maps ATen operators (what torch.fx captures) onto rows. Several
ATen overloads map onto one row (`add.Tensor`, `add.Scalar`), and a few carry extra arguments that
pick a different row (`gelu(approximate="tanh")` is the `gelu_tanh` row). Anything not mapped here
and not a view runs as an *extern*: an eager ATen call between kernels.

Note (adding an op): add one `Op` row with a spelling for every backend, one line in `ATEN`, and a
case in tests/test_ops.py. tests/test_ops.py fails if a backend lacks a spelling another one has.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch._prims_common import elementwise_dtypes
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as PROMOTE

from fusec.sizes import same_shape, same_size

aten = torch.ops.aten

POINTWISE = "pointwise"
VIEW = "view"
EXTERN = "extern"

BACKENDS = ("triton", "cpp", "llvm")


@dataclass(frozen=True)
class Op:
    """One row of the table.

    promote: how PyTorch picks the dtype the op computes in (torch._prims_common's kinds):
        DEFAULT (add: int+float -> float), INT_TO_FLOAT (sin of an int -> float),
        ALWAYS_BOOL (comparisons). None means "compute in the output dtype" (casts, fills).
    promote_from: which operands take part in promotion (where's condition does not).
    returns_bool: the expression yields a boolean, whatever the compute dtype.
    """

    name: str
    triton: str
    cpp: str
    llvm: str = ""
    promote: PROMOTE | None = PROMOTE.DEFAULT
    promote_from: tuple[int, ...] | None = None
    returns_bool: bool = False
    kind: str = POINTWISE

    def spelling(self, backend: str) -> str:
        return getattr(self, backend)


D, F, B = PROMOTE.DEFAULT, PROMOTE.INT_TO_FLOAT, PROMOTE.ALWAYS_BOOL

# LLVM spellings shared by several rows. max/min propagate NaN as fusec_maximum does.
_LL_MAX = ("f: fcmp uno {T} {0}, {0}\nfcmp ogt {T} {0}, {1}\nor i1 {t0}, {t1}\n"
           "select i1 {t2}, {T} {0}, {T} {1}"
           " || s: call {T} @llvm.smax.{S}({T} {0}, {T} {1})"
           " || u,b: call {T} @llvm.umax.{S}({T} {0}, {T} {1})")
_LL_MIN = _LL_MAX.replace("ogt", "olt").replace("max", "min")
_LL_SIGMOID = "call {T} @fusec_sigmoid.{D}({T} {0})"  # llvm_prelude.ll.j2, as the C++ prelude

_ROWS = [
    # arithmetic
    Op("add", "{0} + {1}", "{0} + {1}",
       llvm='f: fadd {T} {0}, {1} || i: add {T} {0}, {1}'),
    Op("add_alpha", "{0} + {1} * {2}", "{0} + {1} * {2}",
       llvm='f: fmul {T} {1}, {2}\nfadd {T} {0}, {t0} || i: mul {T} {1}, {2}\nadd {T} {0}, {t0}'),
    Op("sub", "{0} - {1}", "{0} - {1}",
       llvm='f: fsub {T} {0}, {1} || i: sub {T} {0}, {1}'),
    Op("sub_alpha", "{0} - {1} * {2}", "{0} - {1} * {2}",
       llvm='f: fmul {T} {1}, {2}\nfsub {T} {0}, {t0} || i: mul {T} {1}, {2}\nsub {T} {0}, {t0}'),
    Op("mul", "{0} * {1}", "{0} * {1}",
       llvm='f: fmul {T} {0}, {1} || i: mul {T} {0}, {1}'),
    Op("truediv", "fusec_div({0}, {1})", "{0} / {1}", promote=F,
       llvm='fdiv {T} {0}, {1}'),
    Op("floordiv", "fusec_floordiv({0}, {1})", "fusec_floordiv({0}, {1})",
       llvm='f,s,u: call {T} @fusec_floordiv.{D}({T} {0}, {T} {1}) || b: select i1 {1}, i1 {0}, i1 {0}'),
    Op("truncdiv", "fusec_truncdiv({0}, {1})", "fusec_truncdiv({0}, {1})",
       llvm='f: fdiv {T} {0}, {1}\ncall {T} @llvm.trunc.{S}({T} {t0}) || s,u: call {T} @fusec_truncdiv.{D}({T} {0}, {T} {1}) || b: select i1 {1}, i1 {0}, i1 {0}'),
    Op("neg", "-{0}", "-{0}",
       llvm='f: fneg {T} {0} || i: sub {T} 0, {0}'),
    Op("abs", "fusec_abs({0})", "fusec_abs({0})",
       llvm='f: call {T} @llvm.fabs.{S}({T} {0}) || s: call {T} @llvm.abs.{S}({T} {0}, i1 false) || u,b: {0}'),
    Op("reciprocal", "fusec_div(1.0, {0})", "1 / {0}", promote=F,
       llvm='fdiv {T} 1.0, {0}'),
    # x ** 2 and x ** 3 as eager's PowKernel computes them: (x * x) and (x * x) * x
    Op("square", "({0} * {0})", "({0} * {0})", promote=F,
       llvm='fmul {T} {0}, {0}'),
    Op("cube", "({0} * {0} * {0})", "({0} * {0} * {0})", promote=F,
       llvm='fmul {T} {0}, {0}\nfmul {T} {t0}, {0}'),
    Op("pow", "fusec_pow({0}, {1})", "fusec_pow({0}, {1})",
       llvm='f: call {T} @pow{m}({T} {0}, {T} {1}) || s,u: call {T} @fusec_pow.{D}({T} {0}, {T} {1}) || b: select i1 {1}, i1 {0}, i1 true'),
    Op("maximum", "fusec_maximum({0}, {1})", "fusec_maximum({0}, {1})",
       llvm=_LL_MAX),
    Op("minimum", "fusec_minimum({0}, {1})", "fusec_minimum({0}, {1})",
       llvm=_LL_MIN),
    Op("clamp", "fusec_minimum(fusec_maximum({0}, {1}), {2})",
       "fusec_minimum(fusec_maximum({0}, {1}), {2})",
       llvm='f: fcmp uno {T} {0}, {0}\nfcmp ogt {T} {0}, {1}\nor i1 {t0}, {t1}\nselect i1 {t2}, {T} {0}, {T} {1}\nfcmp uno {T} {t3}, {t3}\nfcmp olt {T} {t3}, {2}\nor i1 {t4}, {t5}\nselect i1 {t6}, {T} {t3}, {T} {2} || s: call {T} @llvm.smax.{S}({T} {0}, {T} {1})\ncall {T} @llvm.smin.{S}({T} {t0}, {T} {2}) || u,b: call {T} @llvm.umax.{S}({T} {0}, {T} {1})\ncall {T} @llvm.umin.{S}({T} {t0}, {T} {2})'),
    Op("clamp_min", "fusec_maximum({0}, {1})", "fusec_maximum({0}, {1})",
       llvm=_LL_MAX),
    Op("clamp_max", "fusec_minimum({0}, {1})", "fusec_minimum({0}, {1})",
       llvm=_LL_MIN),
    Op("where", "tl.where({0}, {1}, {2})", "fusec_select({0}, {1}, {2})", promote_from=(1, 2),
       llvm='select i1 {0}, {T} {1}, {T} {2}'),
    # transcendental functions (integers become floats first)
    Op("exp", "fusec_exp({0})", "fusec_exp({0})", promote=F,
       llvm='call {T} @fusec_exp.{D}({T} {0})'),  # float: inline (llvm_prelude.ll.j2)
    Op("exp2", "tl.exp2({0})", "std::exp2({0})", promote=F,
       llvm='call {T} @exp2{m}({T} {0})'),
    Op("expm1", "fusec_expm1({0})", "fusec_expm1({0})", promote=F,
       llvm='call {T} @expm1{m}({T} {0})'),
    Op("log", "tl.log({0})", "fusec_log({0})", promote=F,
       llvm='call {T} @log{m}({T} {0})'),
    Op("log2", "tl.log2({0})", "fusec_log2({0})", promote=F,
       llvm='call {T} @log2{m}({T} {0})'),
    Op("log1p", "fusec_log1p({0})", "fusec_log1p({0})", promote=F,
       llvm='call {T} @fusec_log1p.{D}({T} {0})'),  # float: inline (llvm_prelude.ll.j2)
    Op("sqrt", "fusec_sqrt({0})", "std::sqrt({0})", promote=F,
       llvm='call {T} @llvm.sqrt.{S}({T} {0})'),
    Op("rsqrt", "fusec_rsqrt({0})", "fusec_rsqrt({0})", promote=F,
       llvm='call {T} @llvm.sqrt.{S}({T} {0})\nfdiv {T} 1.0, {t0}'),
    Op("sin", "tl.sin({0})", "fusec_sin({0})", promote=F,
       llvm='call {T} @sin{m}({T} {0})'),
    Op("cos", "tl.cos({0})", "fusec_cos({0})", promote=F,
       llvm='call {T} @cos{m}({T} {0})'),
    Op("tan", "fusec_tan({0})", "fusec_tan({0})", promote=F,
       llvm='call {T} @tan{m}({T} {0})'),
    Op("tanh", "fusec_tanh({0})", "fusec_tanh({0})", promote=F,
       llvm='call {T} @fusec_tanh.{D}({T} {0})'),
    Op("erf", "tl.erf({0})", "fusec_erf({0})", promote=F,
       llvm='call {T} @fusec_erf.{D}({T} {0})'),
    Op("sigmoid", "fusec_sigmoid({0})", "fusec_sigmoid({0})", promote=F,
       llvm=_LL_SIGMOID),
    Op("silu", "{0} * fusec_sigmoid({0})", "{0} * fusec_sigmoid({0})", promote=F,
       llvm=_LL_SIGMOID + "\nfmul {T} {0}, {t0}"),
    Op("relu", "fusec_relu({0})", "fusec_relu({0})",
       llvm='f: fcmp olt {T} {0}, 0.0\nselect i1 {t0}, {T} 0.0, {T} {0} || s: icmp slt {T} {0}, 0\nselect i1 {t0}, {T} 0, {T} {0} || u,b: {0}'),
    Op("gelu", "fusec_gelu({0})", "fusec_gelu({0})", promote=F,
       llvm='call {T} @fusec_gelu.{D}({T} {0})'),
    Op("gelu_tanh", "fusec_gelu_tanh({0})", "fusec_gelu_tanh({0})", promote=F,
       llvm='call {T} @fusec_gelu_tanh.{D}({T} {0})'),
    Op("floor", "fusec_floor({0})", "fusec_floor({0})",
       llvm='f: call {T} @llvm.floor.{S}({T} {0}) || i: {0}'),
    Op("ceil", "fusec_ceil({0})", "fusec_ceil({0})",
       llvm='f: call {T} @llvm.ceil.{S}({T} {0}) || i: {0}'),
    Op("trunc", "fusec_trunc({0})", "fusec_trunc({0})",
       llvm='f: call {T} @llvm.trunc.{S}({T} {0}) || i: {0}'),
    # comparisons and logic produce bool
    Op("eq", "{0} == {1}", "{0} == {1}", promote=B, returns_bool=True,
       llvm='f: fcmp oeq {T} {0}, {1} || i: icmp eq {T} {0}, {1}'),
    Op("ne", "{0} != {1}", "{0} != {1}", promote=B, returns_bool=True,
       llvm='f: fcmp une {T} {0}, {1} || i: icmp ne {T} {0}, {1}'),
    Op("lt", "{0} < {1}", "{0} < {1}", promote=B, returns_bool=True,
       llvm='f: fcmp olt {T} {0}, {1} || s: icmp slt {T} {0}, {1} || u,b: icmp ult {T} {0}, {1}'),
    Op("le", "{0} <= {1}", "{0} <= {1}", promote=B, returns_bool=True,
       llvm='f: fcmp ole {T} {0}, {1} || s: icmp sle {T} {0}, {1} || u,b: icmp ule {T} {0}, {1}'),
    Op("gt", "{0} > {1}", "{0} > {1}", promote=B, returns_bool=True,
       llvm='f: fcmp ogt {T} {0}, {1} || s: icmp sgt {T} {0}, {1} || u,b: icmp ugt {T} {0}, {1}'),
    Op("ge", "{0} >= {1}", "{0} >= {1}", promote=B, returns_bool=True,
       llvm='f: fcmp oge {T} {0}, {1} || s: icmp sge {T} {0}, {1} || u,b: icmp uge {T} {0}, {1}'),
    Op("isnan", "{0} != {0}", "{0} != {0}", promote=B, returns_bool=True,
       llvm='f: fcmp uno {T} {0}, {0} || i: icmp ne {T} {0}, {0}'),
    Op("logical_and", "({0} != 0) & ({1} != 0)", "({0} != 0) && ({1} != 0)",
       promote=B, returns_bool=True,
       llvm='f: fcmp une {T} {0}, 0.0\nfcmp une {T} {1}, 0.0\nand i1 {t0}, {t1} || i: icmp ne {T} {0}, 0\nicmp ne {T} {1}, 0\nand i1 {t0}, {t1}'),
    Op("logical_or", "({0} != 0) | ({1} != 0)", "({0} != 0) || ({1} != 0)",
       promote=B, returns_bool=True,
       llvm='f: fcmp une {T} {0}, 0.0\nfcmp une {T} {1}, 0.0\nor i1 {t0}, {t1} || i: icmp ne {T} {0}, 0\nicmp ne {T} {1}, 0\nor i1 {t0}, {t1}'),
    Op("logical_xor", "({0} != 0) ^ ({1} != 0)", "({0} != 0) != ({1} != 0)",
       promote=B, returns_bool=True,
       llvm='f: fcmp une {T} {0}, 0.0\nfcmp une {T} {1}, 0.0\nxor i1 {t0}, {t1} || i: icmp ne {T} {0}, 0\nicmp ne {T} {1}, 0\nxor i1 {t0}, {t1}'),
    Op("logical_not", "{0} == 0", "{0} == 0", promote=B, returns_bool=True,
       llvm='f: fcmp oeq {T} {0}, 0.0 || i: icmp eq {T} {0}, 0'),
    Op("bitwise_and", "{0} & {1}", "{0} & {1}",
       llvm='and {T} {0}, {1}'),
    Op("bitwise_or", "{0} | {1}", "{0} | {1}",
       llvm='or {T} {0}, {1}'),
    Op("bitwise_xor", "{0} ^ {1}", "{0} ^ {1}",
       llvm='xor {T} {0}, {1}'),
    Op("bitwise_not", "fusec_bitwise_not({0})", "fusec_bitwise_not({0})",
       llvm='xor {T} {0}, -1'),
    # shifts, as torch defines them for every shift amount: a << b is 0 when b < 0 or b >= the
    # bit width; a >> b is then a >> (width - 1) for signed a (its sign everywhere) and 0 for
    # unsigned a. (C, LLVM and Triton leave those shifts undefined.) `{W}` is the bit width.
    # Unpacking two 4-bit weights from a byte is `w & 0x0F` and `w >> 4`.
    Op("lshift", "fusec_lshift({0}, {1})", "fusec_lshift({0}, {1})",
       llvm='i: icmp ult {T} {1}, {W}\nselect i1 {t0}, {T} {1}, {T} 0\nshl {T} {0}, {t1}\n'
            'select i1 {t0}, {T} {t2}, {T} 0'),
    Op("rshift", "fusec_rshift({0}, {1})", "fusec_rshift({0}, {1})",
       llvm='u: icmp ult {T} {1}, {W}\nselect i1 {t0}, {T} {1}, {T} 0\nlshr {T} {0}, {t1}\n'
            'select i1 {t0}, {T} {t2}, {T} 0'
            ' || s: icmp ult {T} {1}, {W}\nselect i1 {t0}, {T} {1}, {T} {W1}\nashr {T} {0}, {t1}'),
    # data movement: a cast is an identity computed in the target dtype
    Op("to", "{0}", "{0}", promote=None,
       llvm='{0}'),
    Op("copy", "{0}", "{0}", promote=None,
       llvm='{0}'),
    Op("full", "{0}", "{0}", promote=None,
       llvm='{0}'),
]

OPS: dict[str, Op] = {op.name: op for op in _ROWS}


# ---------------------------------------------------------------------------------------------
# ATen -> table. Each entry turns (args, kwargs) of an ATen call into (row name, operands), where
# an operand is an fx Node (a tensor) or a Python number. It returns None when this particular
# call cannot be a kernel (an unusual keyword), so the node runs as an extern instead.

Normalizer = Callable[[tuple, dict], "tuple[str, list[Any]] | None"]


def _plain(name: str, arity: int) -> Normalizer:
    return lambda args, kwargs: None if kwargs else (name, list(args[:arity]))


def _is_bool(operand) -> bool:
    if hasattr(operand, "meta"):  # an fx Node
        val = operand.meta.get("val")
        return isinstance(val, torch.Tensor) and val.dtype == torch.bool
    return isinstance(operand, bool)


def _with_alpha(name: str) -> Normalizer:
    def norm(args, kwargs):
        alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
        if set(kwargs) - {"alpha"}:
            return None
        if name == "add" and _is_bool(args[0]) and _is_bool(args[1]):
            # bool + bool is `or` in torch; Triton's int1 wraps (True + True == False)
            return ("logical_or", list(args[:2])) if alpha else ("copy", [args[0]])
        return (name, list(args[:2])) if alpha == 1 else (name + "_alpha", [*args[:2], alpha])
    return norm


def _rsub(args, kwargs):
    alpha = kwargs.get("alpha", 1)
    return ("sub", [args[1], args[0]]) if alpha == 1 else ("sub_alpha", [args[1], args[0], alpha])


def _div_mode(args, kwargs):
    mode = kwargs.get("rounding_mode", args[2] if len(args) > 2 else None)
    return {None: "truediv", "floor": "floordiv", "trunc": "truncdiv"}[mode], list(args[:2])


# Eager computes x ** 0.5, x ** -0.5 and x ** -1 with sqrt, rsqrt and reciprocal kernels (ATen's
# PowKernel), which differ from pow at the edges: (-inf) ** 0.5 is inf, sqrt(-inf) is NaN; and
# x ** 2, x ** 3 as products (x * x, x * x * x), which also cost a few multiplies instead of a
# pow call: GPT-2's tanh-GELU cubes every activation, and with libdevice's pow its kernel was
# compute-bound. Its CPU kernel for float16 is the exception: that one calls pow.
_POW_SPECIAL = {0.5: "sqrt", -0.5: "rsqrt", -1.0: "reciprocal", 2.0: "square", 3.0: "cube"}


def _pow_scalar(args, kwargs):
    if kwargs:
        return None
    base, exponent = args[:2]
    special = None if isinstance(exponent, bool) else _POW_SPECIAL.get(exponent)
    val = base.meta.get("val") if hasattr(base, "meta") else None
    if special in ("square", "cube") and not (isinstance(val, torch.Tensor)
                                              and val.dtype.is_floating_point):
        special = None  # integer powers stay exact, wrapping as torch's do (fusec_pow)
    if isinstance(val, torch.Tensor) and val.dtype == torch.float16 and val.device.type == "cpu" \
            and special != "reciprocal":
        special = None
    return (special, [base]) if special else ("pow", [base, exponent])


def _gelu(args, kwargs):
    approximate = kwargs.get("approximate", args[1] if len(args) > 1 else "none")
    return ("gelu" if approximate == "none" else "gelu_tanh"), [args[0]]


def _clamp(args, kwargs):
    lo = kwargs.get("min", args[1] if len(args) > 1 else None)
    hi = kwargs.get("max", args[2] if len(args) > 2 else None)
    if lo is None and hi is None:
        return "copy", [args[0]]
    if hi is None:
        return "clamp_min", [args[0], lo]
    if lo is None:
        return "clamp_max", [args[0], hi]
    return "clamp", [args[0], lo, hi]


_COPY_KWARGS = {"dtype", "layout", "device", "pin_memory", "memory_format", "non_blocking"}


def _to_copy(args, kwargs):
    # Only a dtype change (or a plain copy) on the same device is a kernel; moving between devices
    # is an extern. The lowering checks the device through node metadata.
    if set(kwargs) - _COPY_KWARGS or kwargs.get("layout") not in (None, torch.strided):
        return None
    return "to", [args[0]]


def _full(args, kwargs):
    return "full", [args[1]]


def _full_like(args, kwargs):
    return "full", [args[1]]


def _const(value):
    return lambda args, kwargs: ("full", [value])


def _cat(args, kwargs):
    # cat of a single tensor is a copy; real concatenation is not pointwise (an extern for now).
    tensors = args[0]
    return ("copy", [tensors[0]]) if len(tensors) == 1 else None


ATEN: dict[Any, Normalizer] = {
    aten.add.Tensor: _with_alpha("add"), aten.add.Scalar: _with_alpha("add"),
    aten.sub.Tensor: _with_alpha("sub"), aten.sub.Scalar: _with_alpha("sub"),
    aten.rsub.Tensor: _rsub, aten.rsub.Scalar: _rsub,
    aten.mul.Tensor: _plain("mul", 2), aten.mul.Scalar: _plain("mul", 2),
    aten.div.Tensor: _plain("truediv", 2), aten.div.Scalar: _plain("truediv", 2),
    aten.true_divide.Tensor: _plain("truediv", 2),
    aten.div.Tensor_mode: _div_mode, aten.div.Scalar_mode: _div_mode,
    aten.floor_divide.default: _plain("floordiv", 2),
    aten.neg.default: _plain("neg", 1), aten.abs.default: _plain("abs", 1),
    aten.reciprocal.default: _plain("reciprocal", 1),
    aten.pow.Tensor_Scalar: _pow_scalar, aten.pow.Tensor_Tensor: _plain("pow", 2),
    aten.pow.Scalar: _plain("pow", 2),
    aten.maximum.default: _plain("maximum", 2), aten.minimum.default: _plain("minimum", 2),
    aten.clamp.default: _clamp, aten.clamp.Tensor: _clamp,
    aten.clamp_min.default: lambda a, k: ("clamp_min", list(a[:2])),
    aten.clamp_max.default: lambda a, k: ("clamp_max", list(a[:2])),
    aten.where.self: _plain("where", 3), aten.where.ScalarSelf: _plain("where", 3),
    aten.where.ScalarOther: _plain("where", 3), aten.where.Scalar: _plain("where", 3),
    aten.exp.default: _plain("exp", 1), aten.exp2.default: _plain("exp2", 1),
    aten.expm1.default: _plain("expm1", 1),
    aten.log.default: _plain("log", 1), aten.log2.default: _plain("log2", 1),
    aten.log1p.default: _plain("log1p", 1),
    aten.sqrt.default: _plain("sqrt", 1), aten.rsqrt.default: _plain("rsqrt", 1),
    aten.sin.default: _plain("sin", 1), aten.cos.default: _plain("cos", 1),
    aten.tan.default: _plain("tan", 1), aten.tanh.default: _plain("tanh", 1),
    aten.erf.default: _plain("erf", 1), aten.sigmoid.default: _plain("sigmoid", 1),
    aten.silu.default: _plain("silu", 1), aten.relu.default: _plain("relu", 1),
    aten.gelu.default: _gelu,
    aten.floor.default: _plain("floor", 1), aten.ceil.default: _plain("ceil", 1),
    aten.trunc.default: _plain("trunc", 1), aten.isnan.default: _plain("isnan", 1),
    aten.logical_not.default: _plain("logical_not", 1),
    aten.logical_and.default: _plain("logical_and", 2),
    aten.logical_or.default: _plain("logical_or", 2),
    aten.logical_xor.default: _plain("logical_xor", 2),
    aten.bitwise_not.default: _plain("bitwise_not", 1),
    aten._to_copy.default: _to_copy, aten.clone.default: lambda a, k: ("copy", [a[0]]),
    aten.lift_fresh_copy.default: _plain("copy", 1),
    aten.cat.default: _cat,
    aten.full.default: _full, aten.full_like.default: _full_like,
    aten.zeros_like.default: _const(0), aten.ones_like.default: _const(1),
    aten.fill.Scalar: _full_like, aten.scalar_tensor.default: lambda a, k: ("full", [a[0]]),
}

for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    ATEN[getattr(aten, _name).Tensor] = _plain(_name, 2)
    ATEN[getattr(aten, _name).Scalar] = _plain(_name, 2)
for _name in ("bitwise_and", "bitwise_or", "bitwise_xor"):
    ATEN[getattr(aten, _name).Tensor] = _plain(_name, 2)
    ATEN[getattr(aten, _name).Scalar] = _plain(_name, 2)
for _name, _row in (("lshift", "lshift"), ("rshift", "rshift")):
    ATEN[getattr(aten, f"__{_name}__").Tensor] = _plain(_row, 2)
    ATEN[getattr(aten, f"__{_name}__").Scalar] = _plain(_row, 2)
for _name, _row in (("bitwise_left_shift", "lshift"), ("bitwise_right_shift", "rshift")):
    ATEN[getattr(aten, _name).Tensor] = _plain(_row, 2)
    ATEN[getattr(aten, _name).Tensor_Scalar] = _plain(_row, 2)
    ATEN[getattr(aten, _name).Scalar_Tensor] = _plain(_row, 2)

# Python's operator module shows up when graphs index into tuples.
GETITEM = operator.getitem


def classify(target) -> str:
    """POINTWISE or REDUCTION if a kernel can compute it, VIEW if it only reinterprets memory,
    else EXTERN (an eager ATen call)."""
    if target in ATEN:
        return POINTWISE
    if target in ATEN_REDUCTIONS:
        return REDUCTION
    if isinstance(target, torch._ops.OpOverload) and is_view(target):
        return VIEW
    return EXTERN


# Devices where a kernel writes an indexed row of a buffer (`cache[:, :, pos] = k`) itself: see
# `indexed_write`. Eager's out-of-range position is an error there too only asynchronously (a
# device-side assert); on a CPU, where eager raises an IndexError, the write stays eager's.
INDEXED_WRITE_DEVICES = ("cuda",)


def indexed_write(node):
    """(buffer, dim, position, values) when `node` writes one position of an input buffer in
    place, as a static KV cache is written at each decoding step:

        index_put_(k_cache, [None, None, pos], k)     # k_cache[:, :, pos] = k, pos of one element

    Then a pointwise kernel can do it: it loops over the values (k's shape) and stores each at
    the buffer's address with `pos * stride` added along the dim, read from `pos` in the kernel
    (codegen/lower.py, fusec.ir.Store's `scatter`), so the kernel that computes k writes the cache itself.
    None for anything else (several positions, accumulate=True, broadcast values ...)."""
    if node.op != "call_function" or node.target is not torch.ops.aten.index_put_.default:
        return None
    buffer, indices, values = node.args[:3]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    if accumulate or not hasattr(buffer, 'op') or buffer.op != "placeholder" \
            or not hasattr(values, 'op'):
        return None
    at = [d for d, i in enumerate(indices) if i is not None]
    if len(at) != 1 or not hasattr(indices[at[0]], 'op'):
        return None
    dim, pos = at[0], indices[at[0]]
    b, v, p = (n.meta.get("fusec") for n in (buffer, values, pos))
    if not all(hasattr(m, "shape") and hasattr(m, "device") for m in (b, v, p)) \
            or not str(b.device).startswith(INDEXED_WRITE_DEVICES):
        return None
    want = tuple(1 if d == dim else s for d, s in enumerate(b.shape))
    lead = len(want) - len(v.shape)  # (`cache[:, :, pos] = k` may give k without its leading 1s)
    if not same_shape(p.shape, (1,)) or p.dtype not in (torch.int64, torch.int32) or lead < 0 \
            or not same_shape((1,) * lead + tuple(v.shape), want) or v.dtype != b.dtype \
            or v.device != b.device or any(same_size(n, 0) for n in b.shape):
        return None
    return buffer, dim, pos, values


@dataclass(frozen=True)
class Gather:
    """A gathered read, `out = source[..., index, ...]`: see `gathered_read`.

    dim: the source dim the index values pick along; lowest: the smallest index value allowed
    (-size where a negative value counts from the end, as `x[idx]` does; 0 for embedding and
    index_select, which refuse negative values)."""

    source: Any  # fx.Node
    dim: int
    index: Any  # fx.Node
    lowest: int
    size: int


GATHER_TARGETS = (torch.ops.aten.index.Tensor, torch.ops.aten.embedding.default,
                  torch.ops.aten.index_select.default)


def gathered_read(node) -> Gather | None:
    """A Gather when `node` reads rows of a tensor picked by a tensor of integer positions:

        scales[g_idx]                  index.Tensor(scales, [g_idx])       per-group scales
        wte(input_ids)                 embedding(weight, input_ids)        a token embedding
        x.index_select(1, idx)         index_select(x, 1, idx)
        x[:, idx]                      index.Tensor(x, [None, idx])

    The output is the source with its `dim` replaced by the index's shape. A kernel computes it
    by reading the index value at each position and then the source at that row (codegen/lower.py,
    fusec.ir.Load's `gather`), so the gathered rows are never stored. None for anything else
    (several index tensors, boolean masks, a source with no rows ...)."""
    if getattr(node, "op", None) != "call_function" or node.target not in GATHER_TARGETS:
        return None
    args = node.args
    if node.target is torch.ops.aten.index.Tensor:
        source, indices = args[0], list(args[1])
        at = [d for d, i in enumerate(indices) if i is not None]
        if len(at) != 1:
            return None
        dim, index, lowest = at[0], indices[at[0]], -1
    elif node.target is torch.ops.aten.embedding.default:
        source, index, dim, lowest = args[0], args[1], 0, 0
    else:
        source, dim, index, lowest = args[0], args[1], args[2], 0
    if not (hasattr(source, "op") and hasattr(index, "op")):
        return None
    s, i, out = (getattr(n, "meta", {}).get("fusec") for n in (source, index, node))
    if not all(hasattr(m, "shape") and hasattr(m, "device") for m in (s, i, out)):
        return None
    rank = len(s.shape)
    if rank == 0 or not -rank <= dim < rank:
        return None
    dim %= rank
    if i.dtype not in (torch.int32, torch.int64) or s.shape[dim] == 0 or 0 in out.shape \
            or s.device != i.device or out.dtype != s.dtype \
            or (node.target is torch.ops.aten.embedding.default and rank != 2) \
            or (node.target is torch.ops.aten.index_select.default and len(i.shape) != 1):
        return None
    size = s.shape[dim]
    return Gather(source, dim, index, lowest * size, size)


def is_multi_view(target) -> bool:
    """True for ATen ops returning a list of views of their input (split, unbind)."""
    schema = getattr(target, "_schema", None)
    if schema is None or len(schema.returns) != 1 or not schema.arguments:
        return False
    arg = schema.arguments[0].alias_info
    return (str(schema.returns[0].type) == "List[Tensor]" and arg is not None
            and "*" in arg.after_set and not arg.is_write)


def is_view(target) -> bool:
    """True for ATen ops whose output aliases their first input (permute, expand, slice, ...)."""
    schema = target._schema
    if not schema.returns or len(schema.returns) != 1:
        return False
    ret = schema.returns[0].alias_info
    arg = schema.arguments[0].alias_info if schema.arguments else None
    return bool(ret and arg and not ret.is_write and ret.before_set == arg.before_set)


# Ops of a few instructions per element, next to the transcendental ones (exp, erf, tanh...)
# that take tens: computing one of these twice, or in a loop that vectorizes worse, costs little
# (codegen/lower_reduction.py's keep_choice, passes/move_permutes.py).
CHEAP_OPS = {"add", "add_alpha", "sub", "sub_alpha", "mul", "neg", "abs", "to", "copy", "full",
             "where", "maximum", "minimum", "relu", "eq", "ne", "lt", "le", "gt", "ge",
             "logical_not", "logical_and", "logical_or", "logical_xor", "bitwise_not",
             "bitwise_and", "bitwise_or", "bitwise_xor", "lshift", "rshift"}


def is_cheap(node) -> bool:
    """node is an op of CHEAP_OPS (or a plain copy, such as clone) for the kernels."""
    row = normalize(node)
    return row is not None and row[0].name in CHEAP_OPS


def normalize(node) -> tuple[Op, list[Any]] | None:
    """The table row and operand list for an fx node, or None if it cannot be a kernel."""
    fn = ATEN.get(node.target)
    if fn is None or not kernel_dtypes(node):
        return None
    result = fn(tuple(node.args), dict(node.kwargs))
    if result is None:
        return None
    name, operands = result
    return OPS[name], operands


# ---------------------------------------------------------------------------------------------
# Dtypes: the storage dtype of a buffer vs. the dtype a value lives in inside a kernel.

FLOAT16_LIKE = (torch.float16, torch.bfloat16)

SUPPORTED_DTYPES = (
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
)


def kernel_dtypes(node) -> bool:
    """True when every tensor the node reads and makes has a dtype kernels compute in (complex
    values, float8 and the unsigned 16-64 bit types run as eager's ops). Nodes without metadata
    (a graph not annotated yet) are not refused here."""
    metas = [node.meta.get("fusec")] + [a.meta.get("fusec") for a in node.all_input_nodes]
    return all(m.dtype in SUPPORTED_DTYPES for m in metas
               if m is not None and hasattr(m, "dtype") and isinstance(m.dtype, torch.dtype))


def register_dtype(dtype: torch.dtype) -> torch.dtype:
    """Inside a kernel, half-precision values live in float32 registers (eager's "opmath"):
    each op computes in float32 and its result is rounded through the half dtype, as eager
    rounds every op's output; loads widen, stores narrow."""
    return torch.float32 if dtype in FLOAT16_LIKE else dtype


def compute_dtype(op: Op, operand_values: list[Any], out_dtype: torch.dtype) -> torch.dtype:
    """The dtype `op` computes in, exactly as PyTorch's type promotion decides it."""

    if op.promote is None:
        return register_dtype(out_dtype)
    picked = operand_values if op.promote_from is None else [operand_values[i] for i in op.promote_from]
    compute, _ = elementwise_dtypes(*picked, type_promotion_kind=op.promote)
    return register_dtype(compute)


# ---------------------------------------------------------------------------------------------
# Reductions. A reduction folds the reduced dims of its input into one value per row. Each row
# says how to start (the identity of the combine), how to combine two partial results, and how a
# whole block of values is reduced at once in Triton. Mean, var, std, softmax, layer_norm ...
# are decompositions into these (fusec/capture/decompositions.py).

REDUCTION = "reduction"


@dataclass(frozen=True)
class ReductionOp:
    """init: identity of the combine, per dtype kind ("float", "int", "bool").
    combine: expression merging a running accumulator with a new value (valid C++ and Triton).
    triton_block: Triton expression reducing a [rows, block] tile along axis 1.
    returns_index: argmax/argmin produce an int64 position, not a value."""

    name: str
    init: Callable[[torch.dtype], Any]
    combine: str
    triton_block: str
    returns_index: bool = False
    kind: str = REDUCTION


def _lowest(dtype):
    return -math.inf if dtype.is_floating_point else (False if dtype == torch.bool
                                                      else torch.iinfo(dtype).min)


def _highest(dtype):
    return math.inf if dtype.is_floating_point else (True if dtype == torch.bool
                                                     else torch.iinfo(dtype).max)


import math  # noqa: E402

REDUCTIONS: dict[str, ReductionOp] = {r.name: r for r in [
    ReductionOp("sum", lambda dt: 0, "{acc} + {x}", "tl.sum({x}, 1)"),
    ReductionOp("prod", lambda dt: 1, "{acc} * {x}", "fusec_reduce_prod({x})"),
    ReductionOp("amax", _lowest, "fusec_maximum({acc}, {x})", "fusec_reduce_max({x})"),
    ReductionOp("amin", _highest, "fusec_minimum({acc}, {x})", "fusec_reduce_min({x})"),
    ReductionOp("any", lambda dt: False, "{acc} | {x}", "tl.max({x}.to(tl.int8), 1) != 0"),
    ReductionOp("all", lambda dt: True, "{acc} & {x}", "tl.min({x}.to(tl.int8), 1) != 0"),
    ReductionOp("argmax", _lowest, "", "fusec_reduce_argmax({x}, {k})", returns_index=True),
    ReductionOp("argmin", _highest, "", "fusec_reduce_argmin({x}, {k})", returns_index=True),
]}


@dataclass(frozen=True)
class ReductionCall:
    """A reduction node in normal form: reduce `operand` over `dims` (sorted, non-negative)."""

    op: ReductionOp
    operand: Any
    dims: tuple[int, ...]
    keepdim: bool


def _all_dims(rank, dim):
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return tuple(range(rank))
    if isinstance(dim, int):
        dim = [dim]
    return tuple(sorted({d % max(rank, 1) for d in dim})) if rank else ()


def _reduction(name: str, dim_pos: int = 1, keep_pos: int = 2):
    def norm(node):
        args, kwargs = node.args, node.kwargs
        x = args[0]
        rank = len(x.meta["fusec"].shape)
        dim = kwargs.get("dim", args[dim_pos] if len(args) > dim_pos else None)
        keepdim = kwargs.get("keepdim", args[keep_pos] if len(args) > keep_pos else False)
        # argmax/argmin without a dim: the position in the flattened tensor, which is the
        # position along k when every dim is reduced (k runs over the dims in logical order)
        return ReductionCall(REDUCTIONS[name], x, _all_dims(rank, dim), bool(keepdim))
    return norm


ATEN_REDUCTIONS: dict[Any, Callable] = {
    aten.sum.dim_IntList: _reduction("sum"), aten.prod.dim_int: _reduction("prod"),
    aten.amax.default: _reduction("amax"), aten.amin.default: _reduction("amin"),
    aten.argmax.default: _reduction("argmax"), aten.argmin.default: _reduction("argmin"),
    aten.any.dim: _reduction("any"), aten.all.dim: _reduction("all"),
    aten.any.default: _reduction("any", 9, 9), aten.all.default: _reduction("all", 9, 9),
    aten.prod.default: _reduction("prod", 9, 9),
}


def reduction(node) -> ReductionCall | None:
    """The reduction a node performs in normal form, or None if it is not a reduction."""
    fn = ATEN_REDUCTIONS.get(node.target) if node.op == "call_function" else None
    return fn(node) if fn is not None and kernel_dtypes(node) else None

"""Triton helper functions the op table refers to (same names as codegen/cpp/templates/cpp_prelude.h).

Why this file is long: it is the Triton half of one helper library (its C++ half is
cpp_prelude.h): kernels import it as one module by name, and a helper is found next to its twins.

Each is a small `@triton.jit` function that generated kernels import. Branches on
`x.dtype.is_floating()` are decided when the kernel is compiled, not at run time, so an integer
kernel contains only the integer path.

Note (libdevice under the interpreter): on a GPU, Triton's compiler swaps
`triton.language.extra.libdevice` for the CUDA/HIP one. Under TRITON_INTERPRET=1 its functions
are empty stubs that return None (triton-lang/triton#8825, in 3.6 and 3.9), so there `libdevice`
below names `_InterpreterLibdevice`, numpy versions with the GPU's typing rules (fp32/fp64 only,
no promotion, a Python float counts as fp32), so a call that would fail to compile on a GPU fails
on the CPU too. The GPU code path is untouched.
"""
import os

import numpy as np
import triton
import triton.language as tl
from triton.language.extra import libdevice


# On a GPU, Triton's own bfloat16 casts are one instruction each and exact (cvt.rn.bf16.f32
# rounds to nearest even, as eager does). Triton's interpreter truncates instead, and flushes
# bfloat16 subnormals when widening, so there the casts below are done with bit operations (as
# the C++ prelude does). The choice is a constexpr: a GPU kernel contains only the native cast.
# (The bit version costs ~10 integer ops per cast: in a bf16 softmax with four rounding steps
# per element that was ~2x the kernel's time on an H200.)
NATIVE_CASTS = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def fusec_f32_to_bf16(x):
    # float32 -> bfloat16, rounding to nearest even; NaN stays a quiet NaN
    if NATIVE_CASTS:
        out = x.to(tl.bfloat16)
    else:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)
        out = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return out


@triton.jit
def fusec_bf16_to_f32(x):
    # exact, subnormals included
    if NATIVE_CASTS:
        out = x.to(tl.float32)
    else:
        out = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return out


@triton.jit
def fusec_small_int_to_f32(x):
    # An 8- or 16-bit integer as float32 without the integer-to-float instruction, which runs at a
    # quarter of the FP32 rate on NVIDIA GPUs (16 per clock per SM on an H100/H200): a matmul of
    # few rows that widens every int8 weight spent as long converting as streaming. The trick:
    # the float whose bits are 0x4B000000 is 2**23, and its low 23 mantissa bits count ones, so an
    # integer v in [0, 2**23) added to those bits gives exactly 2**23 + v; subtracting 2**23
    # leaves v.
    # A signed v is first shifted into [0, 65536) by 32768. One integer add and one float
    # subtraction, both at full rate, and exact for every value.
    if x.dtype.is_int_signed():
        biased = x.to(tl.int32) + 0x4B008000  # bits of 2**23 + 32768 + v
        out = biased.to(tl.float32, bitcast=True) - 8421376.0  # 2**23 + 32768
    else:
        biased = x.to(tl.int32) + 0x4B000000  # bits of 2**23 + v
        out = biased.to(tl.float32, bitcast=True) - 8388608.0  # 2**23
    return out


@triton.jit
def fusec_dot_bf16(x, w):
    # x @ w.T on tensor cores, for float32 tiles that hold bf16 numbers (exact in bf16, so the
    # products are exact in the float32 accumulator). The interpreter's tl.dot does not read bf16
    # tiles as numbers, so there the same exact products come from a float32 dot.
    if NATIVE_CASTS:
        out = tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
    else:
        out = tl.dot(x, tl.trans(w), input_precision="ieee")
    return out


@triton.jit
def fusec_dot_bf16_acc(a, b, acc):
    # acc + a @ b on tensor cores, for bf16 tiles a [P, K] and b [K, Q] and a float32 acc. The
    # interpreter's tl.dot does not read bf16 tiles as numbers (see fusec_dot_bf16), so there the
    # tiles are widened to float32 first: the same exact products.
    if NATIVE_CASTS:
        out = tl.dot(a, b, acc)
    else:
        out = tl.dot(fusec_bf16_to_f32(a), fusec_bf16_to_f32(b), acc, input_precision="ieee")
    return out


@triton.jit
def fusec_maximum(a, b):
    # torch.maximum propagates NaN from either side; tl.maximum does not by default.
    return tl.where((a > b) | (a != a), a, b)


@triton.jit
def fusec_minimum(a, b):
    return tl.where((a < b) | (a != a), a, b)


@triton.jit
def fusec_relu(x):
    return tl.where(x < 0, tl.zeros_like(x), x)


@triton.jit
def fusec_abs(x):
    if x.dtype.is_floating():
        return tl.abs(x)
    elif x.dtype.is_int_unsigned():
        return x
    else:
        return tl.where(x < 0, 0 - x, x)


@triton.jit
def fusec_exp(x):
    # tl.exp of fp32 is exp2.approx(x * log2(e)) on NVIDIA GPUs: near exp's overflow it is ~50x
    # further from the true value than eager (1e-5 relative); libdevice's expf is within 2 ulp.
    return libdevice.exp(x)


@triton.jit
def fusec_exp_shift(x, m):
    # exp(x - m) for x <= m, as the online softmax rescales its sums (see the note in
    # codegen/triton/__init__.py). x == m gives exp(0) = 1 even when both are infinite, where x - m would
    # be inf - inf = NaN: a lane that has seen only -inf counts its values, and a row's +inf max
    # counts once. A NaN still gives NaN.
    return fusec_exp(tl.where(x == m, 0.0, x - m))


@triton.jit
def fusec_div(a, b):
    # a / b rounded to nearest, as IEEE 754 and eager's CUDA kernels round it. Triton's `/` on
    # float32 is PTX div.full.f32, up to 2 ulp off (an exact quotient such as 4.6875 / 0.9375
    # can come out 1 ulp above 5.0), and a training step's optimizer turns such ulps into
    # different parameters; tl.div_rn is div.rn.f32. Other dtypes: `/` already rounds so.
    q = a / b
    if q.dtype == tl.float32:
        q = tl.div_rn(a, b)
    return q


@triton.jit
def fusec_sigmoid(x):
    return fusec_div(1.0, 1.0 + tl.exp(-x))


@triton.jit
def fusec_sqrt(x):
    # tl.sqrt_rn (correctly rounded, as torch) only takes fp32; fp64 sqrt is always rounded
    if x.dtype == tl.float64:
        return tl.sqrt(x)
    else:
        return tl.sqrt_rn(x)


@triton.jit
def fusec_rsqrt(x):
    return fusec_div(1.0, fusec_sqrt(x))


@triton.jit
def fusec_tan(x):
    return libdevice.tan(x)


@triton.jit
def fusec_tanh(x):
    return libdevice.tanh(x)


@triton.jit
def fusec_log1p(x):
    return libdevice.log1p(x)


@triton.jit
def fusec_expm1(x):
    return libdevice.expm1(x)


@triton.jit
def fusec_gelu(x):
    return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))


@triton.jit
def fusec_gelu_tanh(x):
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + libdevice.tanh(inner))


@triton.jit
def fusec_floor(x):
    if x.dtype.is_floating():
        return libdevice.floor(x)
    else:
        return x


@triton.jit
def fusec_ceil(x):
    if x.dtype.is_floating():
        return libdevice.ceil(x)
    else:
        return x


@triton.jit
def fusec_trunc(x):
    if x.dtype.is_floating():
        return libdevice.trunc(x)
    else:
        return x


@triton.jit
def fusec_lshift(a, b):
    # torch: a << b is 0 when b is negative or not less than the bit width
    bits: tl.constexpr = a.dtype.primitive_bitwidth
    inside = (b >= 0) & (b < bits)
    return tl.where(inside, a << tl.where(inside, b, 0), 0).to(a.dtype)


@triton.jit
def fusec_rshift(a, b):
    # torch: past the bit width, a signed value shifts to its sign (a >> (bits - 1)), an
    # unsigned one to 0; `w >> 4` on a byte is the high one of two packed 4-bit values
    bits: tl.constexpr = a.dtype.primitive_bitwidth
    inside = (b >= 0) & (b < bits)
    if a.dtype.is_int_signed():
        return a >> tl.where(inside, b, bits - 1).to(a.dtype)
    else:
        return tl.where(inside, a >> tl.where(inside, b, 0).to(a.dtype), 0).to(a.dtype)


@triton.jit
def fusec_bitwise_not(x):
    if x.dtype == tl.int1:
        return x == 0
    elif x.dtype == tl.uint8:
        return x ^ 255  # ~x on uint8 fails in Triton 3.6's interpreter (it builds -1 as uint8)
    else:
        return ~x


@triton.jit
def _tensors(a, b):
    # A float constant arrives as a bare Python float (`2.0 // x`, `2 ** x`), which has no dtype
    # (on a GPU it is a constexpr): where(True, ...) makes both operands tensors of their common
    # dtype, which is already the statement's compute dtype.
    return tl.where(True, a, b), tl.where(True, b, a)


@triton.jit
def fusec_floordiv(a, b):
    """Division rounding toward -inf, as Python's // and torch's rounding_mode='floor'."""
    a, b = _tensors(a, b)
    if a.dtype.is_floating():
        mod = libdevice.fmod(a, b)
        div = (a - mod) / b
        div = tl.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1.0, div)
        fl = libdevice.floor(div)
        fl = tl.where(div - fl > 0.5, fl + 1.0, fl)
        fl = tl.where(div == 0, libdevice.copysign(tl.zeros_like(div), a / b), fl)
        return tl.where(b == 0, a / b, fl)
    else:
        safe_b = tl.where(b == 0, 1, b)
        q = _c_div(a, safe_b)
        r = a - q * safe_b
        q = tl.where((r != 0) & ((r < 0) != (safe_b < 0)), q - 1, q)
        return tl.where(b == 0, 0, q)


@triton.jit
def fusec_truncdiv(a, b):
    a, b = _tensors(a, b)
    if a.dtype.is_floating():
        return libdevice.trunc(a / b)
    else:
        safe_b = tl.where(b == 0, 1, b)
        return tl.where(b == 0, 0, _c_div(a, safe_b))


@triton.jit
def _c_div(a, b):
    # Integer division rounding toward zero (C semantics), whatever `//` does on this Triton.
    # (q + 1 and q - 1 keep q's dtype; tl.where(c, 1, -1) would be int32 and widen an int8 q.)
    q = a // b
    r = a - q * b
    fix = (r != 0) & ((r < 0) != (a < 0))
    return tl.where(fix & ((a < 0) != (b < 0)), q + 1, tl.where(fix, q - 1, q))


@triton.jit
def fusec_pow(base, exp):
    base, exp = _tensors(base, exp)
    if base.dtype.is_floating():
        return libdevice.pow(base, exp)
    else:
        # exact integer power by repeated squaring (wraps like torch); negative exponents give
        # 1 for base 1, +-1 for base -1 and 0 otherwise, as torch does
        result = tl.full(base.shape, 1, base.dtype)
        b = base
        e = exp
        for _ in tl.static_range(64):
            result = tl.where((e & 1) != 0, result * b, result)
            b = b * b
            e = e >> 1
        if base.dtype.is_int_signed():
            odd = (exp & 1) != 0
            neg = tl.where(base == 1, 1, tl.where(base == -1, tl.where(odd, -1, 1), 0))
            result = tl.where(exp < 0, neg.to(base.dtype), result)
        return result


# ---- libdevice under TRITON_INTERPRET=1 (see the note at the top) ------------------------------

class _InterpreterLibdevice:
    """The libdevice functions the helpers above use, computed with numpy on the interpreter's
    arrays. Only installed under TRITON_INTERPRET=1."""

    _UNARY = {"exp": np.exp, "tan": np.tan, "tanh": np.tanh, "log1p": np.log1p, "expm1": np.expm1,
              "floor": np.floor, "ceil": np.ceil, "trunc": np.trunc}
    _BINARY = {"pow": np.power, "fmod": np.fmod, "copysign": np.copysign}

    def __getattr__(self, name):
        fn = self._UNARY.get(name) or self._BINARY.get(name)
        if fn is None:
            raise AttributeError(f"fusec: libdevice.{name} has no interpreter version in "
                                 "codegen/triton/helpers.py; add it to _InterpreterLibdevice")
        return lambda *args: _interpreter_call(name, fn, args)


def _interpreter_call(name, fn, args):
    from triton.runtime.interpreter import TensorHandle

    types = [a.dtype.scalar if isinstance(a, tl.tensor) else
             (tl.float32 if isinstance(a, float) else tl.int32) for a in args]
    if len(set(types)) != 1 or types[0] not in (tl.float32, tl.float64):
        raise TypeError(f"libdevice.{name}{tuple(str(t) for t in types)}: libdevice has only "
                        "fp32 and fp64 versions and does not promote; a GPU compile fails here too")
    ref = next(a for a in args if isinstance(a, tl.tensor))
    np_dtype = np.float32 if types[0] == tl.float32 else np.float64
    data = np.broadcast_arrays(*[a.handle.data if isinstance(a, tl.tensor) else
                                 np.asarray(a, dtype=np_dtype) for a in args])
    with np.errstate(all="ignore"):
        out = fn(*data).astype(np_dtype)
    shapes = [tuple(a.shape) for a in args if isinstance(a, tl.tensor) and a.type.is_block()]
    ty = tl.block_type(types[0], list(np.broadcast_shapes(*shapes))) if shapes else types[0]
    return tl.tensor(TensorHandle(out, types[0]), ty)


if os.environ.get("TRITON_INTERPRET") == "1":
    libdevice = _InterpreterLibdevice()  # noqa: F811


# ---- reductions over axis 1 of a [rows, block] tile (see codegen/triton/templates/triton_reduction.py.j2)

@triton.jit
def _mul(a, b):
    return a * b


@triton.jit
def fusec_reduce_prod(x):
    return tl.reduce(x, 1, _mul)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _min_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def fusec_reduce_max(x):
    # torch.amax returns NaN for a row holding a NaN; tl.max does not promise to. One reduction
    # whose combine propagates NaN (a single max.NaN instruction on recent GPUs).
    if x.dtype.is_floating():
        return tl.reduce(x, 1, _max_nan)
    else:
        return tl.max(x, 1)


@triton.jit
def fusec_reduce_min(x):
    if x.dtype.is_floating():
        return tl.reduce(x, 1, _min_nan)
    else:
        return tl.min(x, 1)


@triton.jit
def _first_position(x, ks, m):
    # the first position holding the row's extreme m; a NaN counts as beyond every number (torch)
    big = 2147483647
    first = tl.min(tl.where(x == m, ks, big), 1)
    if x.dtype.is_floating():
        first_nan = tl.min(tl.where(x != x, ks, big), 1)
        first = tl.where(first_nan < big, first_nan, first)
    return first


@triton.jit
def fusec_reduce_argmax(x, ks):
    return _first_position(x, ks, tl.max(x, 1)[:, None])


@triton.jit
def fusec_reduce_argmin(x, ks):
    return _first_position(x, ks, tl.min(x, 1)[:, None])


# Looped argmax/argmin (rows longer than one block): every lane of the [rows, RBLOCK] accumulator
# keeps the best value it has seen and the first position where it saw it (-1: nothing yet);
# at the end the lanes are combined. A NaN beats every number, and the first NaN stays.

@triton.jit
def fusec_arg_update(acc, acc_at, x, ks, mask, IS_MAX: tl.constexpr):
    if IS_MAX:
        better = x > acc
    else:
        better = x < acc
    if x.dtype.is_floating():
        better = better | ((x != x) & (acc == acc))
    take = mask & ((acc_at < 0) | better)
    return tl.where(take, x, acc), tl.where(take, ks, acc_at)


@triton.jit
def fusec_arg_finish(acc, acc_at, IS_MAX: tl.constexpr):
    big = 2147483647
    seen = acc_at >= 0
    if IS_MAX:
        m = tl.max(acc, 1)[:, None]
    else:
        m = tl.min(acc, 1)[:, None]
    first = tl.min(tl.where(seen & (acc == m), acc_at, big), 1)
    if acc.dtype.is_floating():
        first_nan = tl.min(tl.where(seen & (acc != acc), acc_at, big), 1)
        first = tl.where(first_nan < big, first_nan, first)
    return first

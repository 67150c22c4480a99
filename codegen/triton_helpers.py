"""Triton helper functions the op table refers to (same names as codegen/templates/cpp_prelude.h).

Each is a small `@triton.jit` function that generated kernels import. Branches on
`x.dtype.is_floating()` are decided when the kernel is compiled, not at run time, so an integer
kernel contains only the integer path.
"""
import triton
import triton.language as tl
from triton.language.extra import libdevice


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
def fusec_sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def fusec_rsqrt(x):
    return 1.0 / tl.sqrt_rn(x)


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
def fusec_bitwise_not(x):
    if x.dtype == tl.int1:
        return x == 0
    else:
        return ~x


@triton.jit
def fusec_floordiv(a, b):
    """Division rounding toward -inf, as Python's // and torch's rounding_mode='floor'."""
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
    if a.dtype.is_floating():
        return libdevice.trunc(a / b)
    else:
        safe_b = tl.where(b == 0, 1, b)
        return tl.where(b == 0, 0, _c_div(a, safe_b))


@triton.jit
def _c_div(a, b):
    # Integer division rounding toward zero (C semantics), whatever `//` does on this Triton.
    q = a // b
    r = a - q * b
    return tl.where((r != 0) & ((r < 0) != (a < 0)), q + tl.where((a < 0) != (b < 0), 1, -1), q)


@triton.jit
def fusec_pow(base, exp):
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

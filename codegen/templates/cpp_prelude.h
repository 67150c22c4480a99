// ---- fusec C++ prelude: helpers the op table refers to (same names as codegen/triton_helpers.py)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

// Vector math: glibc's libmvec has SIMD versions of the C math functions, but <math.h> only
// announces them under -ffast-math. Announcing them here lets `#pragma omp simd` loops call e.g.
// _ZGVdN8v_sinf (8 sines at once) instead of sinf 8 times; results stay within 4 ulp.
// fusec defines FUSEC_LIBMVEC (and links -lmvec) only where the library exists.
#ifdef FUSEC_LIBMVEC
#define FUSEC_SIMD_MATH(name) \
    _Pragma("omp declare simd notinbranch") extern "C" float name##f(float); \
    _Pragma("omp declare simd notinbranch") extern "C" double name(double);
FUSEC_SIMD_MATH(sin) FUSEC_SIMD_MATH(cos) FUSEC_SIMD_MATH(tan) FUSEC_SIMD_MATH(exp)
FUSEC_SIMD_MATH(exp2) FUSEC_SIMD_MATH(expm1) FUSEC_SIMD_MATH(log) FUSEC_SIMD_MATH(log2)
FUSEC_SIMD_MATH(log1p) FUSEC_SIMD_MATH(tanh) FUSEC_SIMD_MATH(erf)
_Pragma("omp declare simd notinbranch") extern "C" float powf(float, float);
_Pragma("omp declare simd notinbranch") extern "C" double pow(double, double);
#undef FUSEC_SIMD_MATH
#endif

// bfloat16 is stored as the top 16 bits of a float32; convert with round-to-nearest-even.
static inline float fusec_bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16; float f; std::memcpy(&f, &bits, 4); return f;
}
static inline uint16_t fusec_f32_to_bf16(float f) {
    uint32_t bits; std::memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);  // quiet NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}
static inline float fusec_round_bf16(float f) { return fusec_bf16_to_f32(fusec_f32_to_bf16(f)); }
static inline float fusec_round_f16(float f) { return (float)(_Float16)f; }

// Division that rounds like torch: floor division matches Python's `//`.
template <typename T> static inline T fusec_floordiv(T a, T b) {
    if constexpr (std::is_floating_point_v<T>) {
        if (b == 0) return a / b;
        T mod = std::fmod(a, b);
        T div = (a - mod) / b;
        if (mod != 0 && ((b < 0) != (mod < 0))) div -= 1;
        if (div == 0) return std::copysign(T(0), a / b);
        T floordiv = std::floor(div);
        if (div - floordiv > T(0.5)) floordiv += 1;
        return floordiv;
    } else if constexpr (std::is_same_v<T, bool>) {
        return a;
    } else {
        if (b == 0) return 0;  // eager raises ZeroDivisionError on CPU; a kernel cannot raise
        if constexpr (std::is_signed_v<T>) {
            if (b == -1) return (T)(0 - (std::make_unsigned_t<T>)a);  // no INT_MIN / -1 trap
            T q = a / b;
            if ((a % b != 0) && ((a < 0) != (b < 0))) q -= 1;
            return q;
        } else {
            return a / b;
        }
    }
}
template <typename T> static inline T fusec_truncdiv(T a, T b) {
    if constexpr (std::is_floating_point_v<T>) {
        return std::trunc(a / b);
    } else if constexpr (std::is_same_v<T, bool>) {
        return a;
    } else {
        if (b == 0) return 0;
        if constexpr (std::is_signed_v<T>) {
            if (b == -1) return (T)(0 - (std::make_unsigned_t<T>)a);
        }
        return a / b;
    }
}

template <typename T> static inline T fusec_abs(T x) {
    if constexpr (std::is_floating_point_v<T>) return std::fabs(x);
    else if constexpr (std::is_unsigned_v<T> || std::is_same_v<T, bool>) return x;
    else return (T)(x < 0 ? (T)(0 - (std::make_unsigned_t<T>)x) : x);
}

// NaN-propagating max/min, as torch.maximum/minimum and clamp.
template <typename T> static inline T fusec_maximum(T a, T b) { return (a != a || a > b) ? a : b; }
template <typename T> static inline T fusec_minimum(T a, T b) { return (a != a || a < b) ? a : b; }
template <typename T> static inline T fusec_relu(T x) { return x < 0 ? T(0) : x; }

template <typename T> static inline T fusec_sigmoid(T x) { return T(1) / (T(1) + std::exp(-x)); }
template <typename T> static inline T fusec_rsqrt(T x) { return T(1) / std::sqrt(x); }
template <typename T> static inline T fusec_gelu(T x) {
    return T(0.5) * x * (T(1) + std::erf(x * T(0.70710678118654752440)));
}
template <typename T> static inline T fusec_gelu_tanh(T x) {
    const T k = T(0.79788456080286535588);  // sqrt(2 / pi)
    return T(0.5) * x * (T(1) + std::tanh(k * (x + T(0.044715) * x * x * x)));
}
template <typename T> static inline T fusec_floor(T x) {
    if constexpr (std::is_floating_point_v<T>) return std::floor(x); else return x;
}
template <typename T> static inline T fusec_ceil(T x) {
    if constexpr (std::is_floating_point_v<T>) return std::ceil(x); else return x;
}
template <typename T> static inline T fusec_trunc(T x) {
    if constexpr (std::is_floating_point_v<T>) return std::trunc(x); else return x;
}
template <typename T> static inline T fusec_bitwise_not(T x) {
    if constexpr (std::is_same_v<T, bool>) return !x; else return (T)~x;
}

// pow: floats use the C library; integers use exact repeated squaring with wraparound, and a
// negative exponent gives what torch gives (1 for base 1, +-1 for base -1, else 0).
template <typename T> static inline T fusec_pow(T base, T exp) {
    if constexpr (std::is_floating_point_v<T>) {
        return std::pow(base, exp);
    } else if constexpr (std::is_same_v<T, bool>) {
        return exp ? base : true;
    } else {
        if constexpr (std::is_signed_v<T>) {
            if (exp < 0) {
                if (base == 1) return 1;
                if (base == -1) return (exp & 1) ? T(-1) : T(1);
                return 0;
            }
        }
        using U = std::make_unsigned_t<T>;
        U result = 1, b = (U)base;
        auto e = (std::make_unsigned_t<T>)exp;
        while (e) { if (e & 1) result *= b; b *= b; e >>= 1; }
        return (T)result;
    }
}
// ---- end of prelude

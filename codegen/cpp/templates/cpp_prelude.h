// ---- fusec C++ prelude: helpers the op table refers to (same names as codegen/triton/helpers.py)
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

// Eager's float32 math: eager's CPU kernels compute exp, expm1, log, log2, log1p, sin, cos and
// tan within 1 ulp (SLEEF's 1-ulp vector functions or MKL's), and libmvec's float versions are up
// to 4 ulp off (expf 2.5, logf 3.8, tanf 2.9 over the float32 range: tests/test_math_accuracy.py,
// docs/ops.md); in a long chain those errors add up to several times eager's. torch links SLEEF
// into libtorch_cpu and exports it under the vector ABI names gcc calls
// (`_ZGVeN16v_Sleef_logf_u10`: 16 logs at once with AVX-512, `_ZGVdN8v_...` 8 with AVX2). So
// where fusec links torch's library (FUSEC_SLEEF, codegen/cpp/__init__.py math_flags) and the target has
// AVX2, fusec_log(float) and the others are SLEEF's: declared `omp declare simd`, a vectorized
// loop calls the vector versions, and the scalar symbol (which torch does not export) is defined
// here as one lane of the 8-wide call, so a loop's remainder gets the same answers as its vector
// body. A short loop may be vectorized 4 lanes at a time (the SSE variant, `_ZGVbN4v_...`),
// which torch does not export either: it is half of the 8-wide call. Doubles and the other
// targets use the C library (libmvec where it is linked). exp, log1p, tanh and erf are fusec's
// own (below).
#if defined(FUSEC_SLEEF) && defined(__AVX2__) && defined(__x86_64__)
#include <immintrin.h>
#define FUSEC_SLEEF_DECLARE(name) \
    extern "C" { \
    _Pragma("omp declare simd notinbranch") float Sleef_##name##f_u10(float); \
    __m256 _ZGVdN8v_Sleef_##name##f_u10(__m256); \
    __attribute__((visibility("hidden"))) float fusec_sleef1_##name(float) \
        __asm__("Sleef_" #name "f_u10"); \
    float fusec_sleef1_##name(float x) { \
        return _mm256_cvtss_f32(_ZGVdN8v_Sleef_##name##f_u10(_mm256_set1_ps(x))); } \
    __attribute__((visibility("hidden"))) __m128 fusec_sleef4_##name(__m128) \
        __asm__("_ZGVbN4v_Sleef_" #name "f_u10"); \
    __m128 fusec_sleef4_##name(__m128 x) { \
        return _mm256_castps256_ps128(_ZGVdN8v_Sleef_##name##f_u10( \
            _mm256_insertf128_ps(_mm256_setzero_ps(), x, 0))); } \
    }
FUSEC_SLEEF_DECLARE(expm1) FUSEC_SLEEF_DECLARE(log)
FUSEC_SLEEF_DECLARE(log2) FUSEC_SLEEF_DECLARE(sin)
FUSEC_SLEEF_DECLARE(cos) FUSEC_SLEEF_DECLARE(tan)
#undef FUSEC_SLEEF_DECLARE
#define FUSEC_FLOAT_MATH(name, x) Sleef_##name##f_u10(x)
#else
#define FUSEC_FLOAT_MATH(name, x) std::name(x)
#endif
static inline float fusec_expm1(float x) { return FUSEC_FLOAT_MATH(expm1, x); }
static inline double fusec_expm1(double x) { return std::expm1(x); }
static inline float fusec_log(float x) { return FUSEC_FLOAT_MATH(log, x); }
static inline double fusec_log(double x) { return std::log(x); }
static inline float fusec_log2(float x) { return FUSEC_FLOAT_MATH(log2, x); }
static inline double fusec_log2(double x) { return std::log2(x); }
static inline float fusec_sin(float x) { return FUSEC_FLOAT_MATH(sin, x); }
static inline double fusec_sin(double x) { return std::sin(x); }
static inline float fusec_cos(float x) { return FUSEC_FLOAT_MATH(cos, x); }
static inline double fusec_cos(double x) { return std::cos(x); }
static inline float fusec_tan(float x) { return FUSEC_FLOAT_MATH(tan, x); }
static inline double fusec_tan(double x) { return std::tan(x); }
#undef FUSEC_FLOAT_MATH

// float32 tanh and erf, computed in float: 16 lanes to an AVX-512 register (double gets 8), from
// plain arithmetic (no library call), with selects instead of branches, so a loop over them
// vectorizes on every x86-64 level. Eager gets both from MKL/SLEEF within 1 ulp; libmvec's float
// versions are 1.4 (tanh) and 4 (erf) ulp off, and SLEEF's 1-ulp erf took 10x eager's time.
// Within 1 ulp needs care in float: every float step rounds by up to half an ulp, as the last one
// does, so the steps whose errors would reach the answer at full size are arranged so they do not
// (a small correction added last, errors scaled down by a factor < 1, or a rounding error kept as
// a second float). tests/test_math_accuracy.py measures them; docs/ops.md gives the results.
// The polynomials are weighted minimax fits (Lawson's iteration at 600 Chebyshev nodes, references
// from mpmath at 30 digits), their coefficients rounded to float one at a time from the constant
// term up, the rest refitted after each; each comment gives the fit's largest error. The tables
// are doubles holding float values: the LLVM prelude reads them from here (llvm/ir.py
// prelude_tables), and static_asserts check that each value is a float's.

// FUSEC_FMAF(a, b, c) = a * b + c in one rounding where the CPU has fused multiply-add, else two:
// the results differ in the last bit between such targets (the LLVM prelude's fmuladd does the same).
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
#define FUSEC_FMAF(a, b, c) __builtin_fmaf(a, b, c)
#else
#define FUSEC_FMAF(a, b, c) ((a) * (b) + (c))
#endif
template <int N> constexpr bool fusec_floats(const double (&c)[N]) {
    for (int i = 0; i < N; ++i) if ((double)(float)c[i] != c[i]) return false;
    return true;
}
// c[0] x^(N-1) + ... + c[N-1] in float, by Horner's rule (unrolled: a loop inside a vectorized
// loop would not be)
template <int N> static inline float fusec_horner_f32(float x, const double (&c)[N]) {
    float p = (float)c[0];
#pragma GCC unroll 16
    for (int i = 1; i < N; ++i) p = FUSEC_FMAF(p, x, (float)c[i]);
    return p;
}
static inline float fusec_bits_f32(uint32_t bits) { float f; std::memcpy(&f, &bits, 4); return f; }

// e^r - 1 for |r| <= ln2/2 (and a little more): r + r^2 Q(r), Q of degree 4 (absolute error
// 3.4e-9 e^r). Both functions below compute e^y as 2^k (1 + this), with y = k ln2 + r.
static inline float fusec_expm1_q(float r) {
    static constexpr double Q[] = {0x1.6a4b82p-10, 0x1.123e58p-7, 0x1.5558bap-5, 0x1.55548cp-3,
        0x1.fffffcp-2};
    static_assert(fusec_floats(Q));
    return fusec_horner_f32(r, Q);
}
static inline float fusec_expm1_reduced(float r) { return FUSEC_FMAF(r * r, fusec_expm1_q(r), r); }

// A bool read from memory, as the byte it is stored in (0 or 1, as torch stores bools). gcc 12
// does not vectorize a loop that loads a `bool` next to float loads ("no vectype for stmt" on the
// float load): a batch norm backward's inside-out k loop, where(le, 0, grad) summed over 32
// channels, ran one value at a time, 3-4x the LLVM backend's time. Read as an unsigned char (a
// char type may alias any object) the same loop is vectorized.
static inline bool fusec_bool(const bool& b) { return reinterpret_cast<const unsigned char&>(b) != 0; }

// c ? a : b for any arithmetic type, as bit masks (the op table's `where`, and the selects below).
// The same gcc 12 limit as fusec_select_bits above, for floats: a float `?:` that gcc cannot turn
// into a min/max (NaNs forbid it) stays a branch in a loop that also calls torch's SLEEF exp, and
// the loop is not vectorized: softplus's where(x > 20, x, log1p(exp(x))) and clamp-then-exp ran
// one value at a time, 1.5-6x eager's time (KernelBench-style 12_, 23_, 38_ on one thread).
template <typename T> static inline T fusec_select(bool c, T a, T b) {
    if constexpr (std::is_same_v<T, bool>) {
        return (c && a) || (!c && b);
    } else {
        using U = std::conditional_t<sizeof(T) == 8, uint64_t, std::conditional_t<sizeof(T) == 4,
                  uint32_t, std::conditional_t<sizeof(T) == 2, uint16_t, uint8_t>>>;
        static_assert(sizeof(U) == sizeof(T));
        U x, y;
        std::memcpy(&x, &a, sizeof(T));
        std::memcpy(&y, &b, sizeof(T));
        const U all = U(0) - U(c);  // all ones where c holds
        const U r = (x & all) | (y & U(~all));
        T out;
        std::memcpy(&out, &r, sizeof(T));
        return out;
    }
}

// tanh in float (a = |x|; the sign is put back at the end, so tanh(-0) = -0):
//   a < 1: a + a w, w = a^2 P(a^2), P of degree 6 (relative error 4.7e-9); |w| < 0.24, so w's
//     own rounding errors reach the answer a quarter of their size.
//   above: 1 - 2 / (e^2a + 1), with e^2a = 2^k (1 + p) (fusec_expm1_reduced; 2a - k ln2 by
//     Cody and Waite's two-part ln2, whose first product and difference are exact), and
//     e^2a + 1 = 2^k p + (2^k + 1) in one rounding (one FMA). The quotient is <= 0.24 next to an
//     answer >= 0.76, so the rounding errors of the sum and of the division reach the answer a
//     quarter of their size, and only the last subtraction's counts in full.
//   From 9.5 on, a is clamped: tanh rounds to 1 from 9.01 on.
// Cost, not only accuracy: every step runs for every value (both sides, then a select), and a
// loop of these is bound by its vector instructions (two per cycle), so the side above spends
// one division and no correction terms: the small side was widened to a < 1 (two more FMAs)
// so that the quotient stays small enough for that.
static inline float fusec_tanh(float x) {
    static constexpr double P[] = {-0x1.77d222p-12, 0x1.2da1e0p-9, -0x1.04606ap-7, 0x1.6009c0p-6,
        -0x1.b9623cp-5, 0x1.110be4p-3, -0x1.55553cp-2};
    static_assert(fusec_floats(P));
    const float a = std::fabs(x);
    const float z = a * a;
    const float small = FUSEC_FMAF(a, z * fusec_horner_f32(z, P), a);
    // NaN fails `a >= 9.5` and stays NaN (the answer is NaN, from `small`)
    const float t = 2.0f * fusec_select(a >= 9.5f, 9.5f, a);
    const float shift = 0x1.8p23f;  // adding it rounds to an integer, kept in the low bits
    const float k_shifted = FUSEC_FMAF(t, 0x1.715476p0f, shift);
    const float k = k_shifted - shift;  // round(t / ln2): 0 <= k <= 27
    uint32_t k_bits; std::memcpy(&k_bits, &k_shifted, 4);
    const float p = fusec_expm1_reduced(FUSEC_FMAF(-k, 0x1.7f7d1cp-20f, FUSEC_FMAF(-k, 0x1.62e4p-1f, t)));
    const float two_k = fusec_bits_f32(0x3f800000u + (k_bits << 23));  // 2^k: k moved to the exponent
    const float large = 1.0f - 2.0f / FUSEC_FMAF(two_k, p, two_k + 1.0f);
    return std::copysign(fusec_select(a >= 1.0f, large, small), x);
}
static inline double fusec_tanh(double x) { return std::tanh(x); }

// erf in float (a = |x|, the sign put back at the end):
//   a < 1: a + a w, w = S(a^2) = erf(a) / a - 1, S of degree 7 (relative error 9.5e-10).
//   above: 1 - e^-a^2 R(a), R(a) = erfc(a) e^(a^2), smooth, of degree 12 in a - 2.4609375
//     (relative error 1.6e-8). Every error of this side reaches the answer times erfc(a) <= 0.16,
//     the rounding of a^2 too (e^-a^2 is then off by a^2's rounding error, relatively).
//     From 3.921875 on, a is clamped: erf rounds to 1 from 3.919 on.
static inline float fusec_erf(float x) {
    static constexpr double S[] = {-0x1.217f0ap-19, 0x1.6981f6p-14, -0x1.a99294p-11,
        0x1.5482a0p-8, -0x1.b8044ap-6, 0x1.ce2d74p-4, -0x1.812740p-2, 0x1.06eba8p-3};
    static constexpr double R[] = {0x1.1f122cp-23, -0x1.d0fba6p-22, 0x1.fa2038p-21,
        -0x1.271b7cp-18, 0x1.305326p-16, -0x1.0dc0d6p-14, 0x1.dc350cp-13, -0x1.9b879ap-11,
        0x1.56d888p-9, -0x1.1333b0p-7, 0x1.a852acp-6, -0x1.38a8ccp-4, 0x1.b5c216p-3};
    static_assert(fusec_floats(S) && fusec_floats(R));
    const float a = std::fabs(x);
    const float small = FUSEC_FMAF(a, fusec_horner_f32(a * a, S), a);
    const float b = fusec_select(a < 3.921875f, a, 3.921875f);
    const float z = b * b;
    const float shift = 0x1.8p23f;
    const float k_shifted = FUSEC_FMAF(-z, 0x1.715476p0f, shift);
    const float k = k_shifted - shift;  // round(-z / ln2): -22 <= k <= 0
    uint32_t k_bits; std::memcpy(&k_bits, &k_shifted, 4);
    const float p = fusec_expm1_reduced(FUSEC_FMAF(-k, 0x1.7f7d1cp-20f, FUSEC_FMAF(-k, 0x1.62e4p-1f, -z)));
    const float r = fusec_horner_f32(b - 2.4609375f, R);
    const float erfc = FUSEC_FMAF(p, r, r) * fusec_bits_f32(0x3f800000u + (k_bits << 23));  // * 2^k
    // NaN fails the test, and `small` passes it on
    return std::copysign(fusec_select(a >= 1.0f, 1.0f - erfc, small), x);
}
static inline double fusec_erf(double x) { return std::erf(x); }

// e^y in float for the places where it is added to 1 or scales something next to 1 (sigmoid's
// 1 / (1 + e^-x), gelu's 1 - e^-z^2 R): as exact as fusec_tanh's e^2a (2^k (1 + p), within
// 1 ulp) down to e^-86; below that y is clamped to -86 (the answer is then e^-86, which vanishes
// next to 1 all the same), and from 88.72 on the answer overflows to inf as e^y does. Inline,
// with no library call: a loop of these is bound by its vector instructions, and torch's SLEEF
// exp (a call per vector, with its own range checks) took a third more of them.
// y = k ln2 + r; the scale 2^k is applied as 2^(k-1) times 2 (1 + p), so that k = 128 (just
// below the overflow) still has a float for its scale.
static inline float fusec_exp_unit(float y) {
    // NaN fails both tests and stays NaN. Selects, not std::min/max: gcc 12 keeps their `?:` a
    // branch in a loop that also calls torch's SLEEF (softmax's exp), and leaves the loop scalar.
    const float high = fusec_select(89.0f < y, 89.0f, y);
    const float c = fusec_select(high < -86.0f, -86.0f, high);
    const float shift = 0x1.8p23f;
    const float k_shifted = FUSEC_FMAF(c, 0x1.715476p0f, shift);
    const float k = k_shifted - shift;  // round(c / ln2): -124 <= k <= 128
    uint32_t k_bits; std::memcpy(&k_bits, &k_shifted, 4);
    const float p = fusec_expm1_reduced(FUSEC_FMAF(-k, 0x1.7f7d1cp-20f, FUSEC_FMAF(-k, 0x1.62e4p-1f, c)));
    return FUSEC_FMAF(p, 2.0f, 2.0f) * fusec_bits_f32(0x3f000000u + (k_bits << 23));
}

// e^x in float over the whole range, inline (no call: SLEEF's, one per vector of values, spilled
// the loop's registers around it, and gcc 12 left some loops with such a call scalar): e^x =
// 2^k (1 + p) with x = k ln2 + r, as fusec_exp_unit, but with every answer eager's kind:
//   x is clamped to [-104, 89] first (a NaN fails both tests and stays NaN): e^-104 is below
//     half the smallest subnormal (so 0) and e^89 above the largest float (so inf);
//   2^k (-150 <= k <= 128) is applied as two powers of two, 2^(k - k/2) and 2^(k/2), each a
//     normal float: (1 + p) 2^(k - k/2) = p s + s in one rounding (an FMA) is the answer's only
//     rounding in the normal range; the second product is exact there, and it is the one that
//     rounds a subnormal answer (once, to its ulp) or overflows to inf.
static inline float fusec_exp_f32(float x) {
    const float high = fusec_select(89.0f < x, 89.0f, x);
    const float c = fusec_select(high < -104.0f, -104.0f, high);
    const float shift = 0x1.8p23f;
    const float k_shifted = FUSEC_FMAF(c, 0x1.715476p0f, shift);
    const float k = k_shifted - shift;  // round(c / ln2): -150 <= k <= 128
    uint32_t k_bits; std::memcpy(&k_bits, &k_shifted, 4);
    const int32_t ki = (int32_t)k_bits - 0x4b400000;  // k as an integer
    const int32_t half_k = ki >> 1;
    // x - k ln2 = r_high + r_low: r_high exact (ln2's first part has 15 bits, k at most 8), so
    // the polynomial's answer and r_low, both small, are all that round before the FMA
    const float r_high = FUSEC_FMAF(-k, 0x1.62e4p-1f, c);
    const float r_low = -k * 0x1.7f7d1cp-20f;
    const float r = r_high + r_low;
    const float p = r_high + FUSEC_FMAF(r * r, fusec_expm1_q(r), r_low);
    const float s = fusec_bits_f32((uint32_t)(ki - half_k + 127) << 23);
    return FUSEC_FMAF(p, s, s) * fusec_bits_f32((uint32_t)(half_k + 127) << 23);
}
static inline float fusec_exp(float x) { return fusec_exp_f32(x); }
static inline double fusec_exp(double x) { return std::exp(x); }

// log(1 + x) in float, inline (softplus's log1p(e^x) was two calls into SLEEF): with
// u = 1 + x rounded to 2^e m, m in [3/4, 3/2), log1p(x) = e ln2 + log1p(f) with
// f = (1 + x) 2^-e - 1, computed from x itself (not from u, whose rounding error would need a
// correction term): x 2^-e + (2^-e - 1) in one FMA is exact for e <= 24 (both terms exact, and
// the sum, inside [-1/4, 1/2], a multiple of x 2^-e's ulp: m from 3/4, not sqrt(1/2), is what
// keeps x >= 1/2 where e = 1); above, f is m - 1 and u's rounding error is below 2^-24 of an
// answer >= 16. log1p(f) = f + f^2 P(f), P of degree 8 (weighted minimax, error 4.9e-9 of the
// answer). The answer is summed so that only the last addition
// rounds at its size: e ln2's first part plus f is split into its rounded sum and that sum's
// exact error (Fast2Sum: |e ln2| >= 0.69 > |f| unless e = 0, when the error is 0), and the small
// terms are added to the error first. Edges as eager: -1 gives -inf, below -1 NaN, +inf inf,
// NaN NaN, and +-0 and |x| < 2^-26 (subnormals too) give x itself.
static inline float fusec_log1p_f32(float x) {
    static constexpr double P[] = {-0x1.71e354p-5, 0x1.acf4bap-4, -0x1.0d98f2p-3, 0x1.28807ap-3,
        -0x1.54ed96p-3, 0x1.99699ep-3, -0x1.00004ap-2, 0x1.5555a4p-2, -0x1p-1};
    static_assert(fusec_floats(P));
    const float u = 1.0f + x;
    uint32_t u_bits; std::memcpy(&u_bits, &u, 4);
    const int32_t iu = (int32_t)(u_bits - 0x3f400000u);
    const int32_t e = iu >> 23;  // u = 2^e m
    const float scale = fusec_bits_f32(0x3f800000u - ((uint32_t)e << 23));  // 2^-e (e <= 126)
    const float f_exact = FUSEC_FMAF(x, scale, scale - 1.0f);
    const float f_large = fusec_bits_f32((uint32_t)(iu & 0x7fffff) + 0x3f400000u) - 1.0f;
    const float f = fusec_select(e > 24, f_large, f_exact);
    const float ef = (float)e;
    const float hi = ef * 0x1.62e4p-1f;  // exact: ln2's first part has 15 bits, e at most 8
    const float t = hi + f;
    const float t_error = (hi - t) + f;  // t + t_error = hi + f exactly
    const float f2 = f * f;
    const float f2_error = FUSEC_FMAF(f, f, -f2);  // f^2 - f2, exact with FMA (else 0)
    const float p = fusec_horner_f32(f, P);
    const float lo = FUSEC_FMAF(ef, 0x1.7f7d1cp-20f, FUSEC_FMAF(f2, p, FUSEC_FMAF(f2_error, p, t_error)));
    const float r = t + lo;
    const float inf = std::numeric_limits<float>::infinity();
    const float below = fusec_select(x == -1.0f, -inf, std::numeric_limits<float>::quiet_NaN());
    const float r1 = fusec_select(x <= -1.0f, below, r);
    // x itself for +inf, NaN (both fail x < inf) and tiny x (its log1p rounds to x)
    return fusec_select(x < inf && std::fabs(x) >= 0x1p-26f, r1, x);
}
static inline float fusec_log1p(float x) { return fusec_log1p_f32(x); }
static inline double fusec_log1p(double x) { return std::log1p(x); }

// float gelu: eager's CPU kernel computes erf with Abramowitz & Stegun's formula 7.1.26
// (|error| < 1.5e-7 next to 1 + erf, which is all gelu needs) from one exp and one division,
// its polynomial by FMAs, and so does this (libmvec's exact erff took 1.7x eager's time for a
// gelu), with fusec_exp_unit for the exp: erf(z) = 1 - t A(t) e^-z^2, t = 1 / (1 + 0.3275911 z).
// erf(|x| / sqrt 2):
static inline float fusec_gelu_erf_f32(float x) {
    static constexpr double A[] = {0x1.0fb844p+0, -0x1.7401c6p+0, 0x1.6be1c6p+0, -0x1.23531cp-2,
        0x1.04f20cp-2};
    static_assert(fusec_floats(A));
    const float z = std::fabs(x * 0x1.6a09e6p-1f);  // |x| / sqrt(2)
    const float t = 1.0f / FUSEC_FMAF(0x1.4f740ap-2f, z, 1.0f);
    return FUSEC_FMAF(-(fusec_horner_f32(t, A) * t), fusec_exp_unit(-(z * z)), 1.0f);
}
// Two kernels differ at the edges, and eager runs one or the other depending on the CPU
// (codegen/cpu_plan.py, Note: eager's gelu depends on the CPU; a kernel calls the one this
// machine's eager runs: codegen/cpp/text.py render_stmt). ATen's: x/2 + x/2 * erf in one fma, so
// gelu(+inf) is inf, nothing below FLT_MAX overflows, and gelu(-0.0) is +0.0.
static inline float fusec_gelu_f32(float x) {
    const float half_x = x * 0.5f;
    return FUSEC_FMAF(half_x, std::copysign(fusec_gelu_erf_f32(x), x), half_x);
}
// oneDNN's (where torch runs its AVX512 kernels): x * (1 + erf) first, so x above FLT_MAX / 2
// overflows to inf, and gelu(+inf) is NaN (as are gelu(-inf) and gelu(NaN)).
static inline float fusec_gelu_onednn_f32(float x) {
    const float gelu = x * (1.0f + std::copysign(fusec_gelu_erf_f32(x), x)) * 0.5f;
    return fusec_select(x == std::numeric_limits<float>::infinity(),
                        std::numeric_limits<float>::quiet_NaN(), gelu);
}

// The row a gathered read takes (`scales[g_idx]`): a negative index counts from the end, as in
// eager, and the row is kept inside the source's n rows, so no read ever leaves the buffer (the
// compiled program checks the index values and raises eager's error: passes/check_gathers.py).
static inline int64_t fusec_row(int64_t index, int64_t n) {
    const int64_t row = index < 0 ? index + n : index;
    return row < 0 ? 0 : (row >= n ? n - 1 : row);
}

// Note (vectorized half precision): float16 and bfloat16 values live in memory as their 16 bits
// (uint16_t) and in registers as float. Every conversion between the two is written below with
// integer and float operations that have packed forms on every x86-64 level (SSE2's 32-bit
// shifts, adds, compares and blends; AVX2's and AVX-512's wider ones): each case is computed and
// the answer selected, with no branch. So a `#pragma omp simd` loop that loads, rounds or stores
// half values converts 4, 8 or 16 of them per instruction. The compiler's own half type is not
// used: gcc 12 converts `_Float16` one value at a time (vcvtsh2ss, or a libgcc call without
// AVX512-FP16) and then leaves the whole loop scalar, which held float16 chains at 0.13x eager's
// speed. The answers are torch's bit for bit, NaNs included (those of torch's vectorized
// conversions, which every tensor longer than a few elements takes): tests/test_half_bits.py
// and tests/test_half_vectorized.py check them, and the latter the packed instructions too.
// codegen/llvm/templates/llvm_prelude.ll.j2 spells the same steps in LLVM IR.
// c ? a : b as bit masks. gcc 12 keeps a `?:` of two integers as a branch when the loop also
// calls a vector function it does not know (torch's SLEEF exp, above), and a loop with a branch is
// not vectorized: the float16 sigmoid chain stayed scalar on AVX2 and AVX-512 that way.
static inline int32_t fusec_select_bits(bool c, int32_t a, int32_t b) {
    const int32_t all = -(int32_t)c;  // all ones where c holds
    return (a & all) | (b & ~all);
}
static inline uint32_t fusec_float_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }
static inline float fusec_bits_float(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }

// bfloat16 is the top half of a float32: widening is a shift.
static inline float fusec_bf16_to_f32(uint16_t v) { return fusec_bits_float((uint32_t)v << 16); }
// float32 -> bfloat16 to nearest even: add 0x7fff plus the lowest kept bit, keep the top 16 bits
// (a carry into the exponent is right, and the largest floats round up to infinity). A NaN
// becomes 0xffff, as in torch's AVX2 and AVX-512 conversions: its all-ones mask is ORed in before
// the top half is kept (one vpternlogd with AVX-512; the select of fusec_select_bits took two
// more instructions per rounding, and a bfloat16 `sigmoid(x * 2 + 1) * x` 1.2-1.3x the time).
static inline uint32_t fusec_bf16_rounded_bits(float f) {
    const uint32_t nan = (uint32_t)(-(int32_t)(f != f));  // all ones for a NaN
    return ((fusec_float_bits(f) + 0x7fffu + ((fusec_float_bits(f) >> 16) & 1u)) | nan) & 0xffff0000u;
}
static inline uint16_t fusec_f32_to_bf16(float f) { return (uint16_t)(fusec_bf16_rounded_bits(f) >> 16); }
static inline float fusec_round_bf16(float f) { return fusec_bits_float(fusec_bf16_rounded_bits(f)); }

// float16 -> float32 (IEEE half: 1 sign, 5 exponent, 10 mantissa bits), as vcvtph2ps does it:
//   normal:     move exponent and mantissa up 13 bits, re-bias the exponent by 127 - 15 = 112
//   inf/NaN:    exponent all ones; a NaN keeps its payload and is made quiet
//   subnormal:  the mantissa counts steps of 2^-24 (an integer below 1024: converted exactly)
// Integers are signed where either sign would do: SSE2 compares signed 32-bit integers only.
static inline float fusec_f16_to_f32(uint16_t h) {
    const int32_t em = h & 0x7fff, moved = em << 13;
    const int32_t normal = moved + 0x38000000;
    const int32_t special = moved | 0x7f800000 | fusec_select_bits(em > 0x7c00, 0x400000, 0);
    const int32_t tiny = (int32_t)fusec_float_bits((float)em * 5.9604644775390625e-08f);
    const int32_t magnitude =
        fusec_select_bits(em < 0x400, tiny, fusec_select_bits(em >= 0x7c00, special, normal));
    return fusec_bits_float((uint32_t)magnitude | ((uint32_t)(h & 0x8000) << 16));
}
// float32 -> float16 as vcvtps2ph rounds (to nearest even), from |f|'s bits a (below 2^31):
//   normal:     add 0xfff plus the lowest kept bit, drop 13 mantissa bits
//   too large:  |f| >= 65520 (halfway above the largest half, 65504) rounds to infinity
//   subnormal:  |f| < 2^-14: adding 0.5, whose ulp is 2^-24 (a half subnormal's step), makes the
//               float addition itself round to the nearest step
//   NaN:        quiet, with the top 10 bits of its payload
// fusec_round_f16 is fusec_f16_to_f32(fusec_f32_to_f16(f)) in one step (eager rounds every
// float16 result; a fused chain does it in registers): the same cases, kept as float bits.
static inline uint16_t fusec_f32_to_f16(float f) {
    const uint32_t bits = fusec_float_bits(f);
    const int32_t a = (int32_t)(bits & 0x7fffffffu);
    const int32_t normal = (a - 0x38000000 + 0xfff + ((a >> 13) & 1)) >> 13;  // re-biased
    const int32_t tiny = (int32_t)fusec_float_bits(fusec_bits_float(a) + 0.5f) - 0x3f000000;
    const int32_t big = fusec_select_bits(a > 0x7f800000, 0x7e00 | ((a >> 13) & 0x3ff), 0x7c00);
    const int32_t magnitude =
        fusec_select_bits(a < 0x38800000, tiny, fusec_select_bits(a < 0x477ff000, normal, big));
    return (uint16_t)((uint32_t)magnitude | ((bits >> 16) & 0x8000u));
}
static inline float fusec_round_f16(float f) {
    const uint32_t bits = fusec_float_bits(f);
    const int32_t a = (int32_t)(bits & 0x7fffffffu);
    const int32_t normal = (a + 0xfff + ((a >> 13) & 1)) & ~0x1fff;
    const int32_t tiny = (int32_t)fusec_float_bits((fusec_bits_float(a) + 0.5f) - 0.5f);
    const int32_t big = fusec_select_bits(a > 0x7f800000, (a | 0x400000) & ~0x1fff, 0x7f800000);
    const int32_t magnitude =
        fusec_select_bits(a < 0x38800000, tiny, fusec_select_bits(a < 0x477ff000, normal, big));
    return fusec_bits_float((uint32_t)magnitude | (bits & 0x80000000u));
}

// A block of n float16 values converted by the CPU (Note: float16 blocks, codegen/cpp/half_blocks.py):
// F16C's vcvtph2ps/vcvtps2ph, 16 at a time with AVX-512 and 8 with AVX2 (rounding to nearest
// even, NaN payloads as torch's, which uses the same instructions); the last few, and CPUs
// without F16C, by the integer functions above, which give the same bits.
#if defined(__F16C__) && defined(__x86_64__)
#include <immintrin.h>
#endif
#define FUSEC_BLOCK 256
static inline void fusec_f16_to_f32_block(const uint16_t* in, float* out, int64_t n) {
    int64_t k = 0;
#if defined(__AVX512F__)
    for (; k + 16 <= n; k += 16)
        _mm512_storeu_ps(out + k, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(in + k))));
#endif
#if defined(__F16C__) && defined(__x86_64__)
    for (; k + 8 <= n; k += 8)
        _mm256_storeu_ps(out + k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(in + k))));
#endif
    for (; k < n; ++k) out[k] = fusec_f16_to_f32(in[k]);
}
static inline void fusec_f32_to_f16_block(const float* in, uint16_t* out, int64_t n) {
    int64_t k = 0;
#if defined(__AVX512F__)
    for (; k + 16 <= n; k += 16)
        _mm256_storeu_si256((__m256i*)(out + k),
                            _mm512_cvtps_ph(_mm512_loadu_ps(in + k), _MM_FROUND_TO_NEAREST_INT));
#endif
#if defined(__F16C__) && defined(__x86_64__)
    for (; k + 8 <= n; k += 8)
        _mm_storeu_si128((__m128i*)(out + k),
                         _mm256_cvtps_ph(_mm256_loadu_ps(in + k), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; k < n; ++k) out[k] = fusec_f32_to_f16(in[k]);
}
static inline void fusec_round_f16_block(float* values, int64_t n) {
    int64_t k = 0;
#if defined(__AVX512F__)
    for (; k + 16 <= n; k += 16)
        _mm512_storeu_ps(values + k, _mm512_cvtph_ps(
            _mm512_cvtps_ph(_mm512_loadu_ps(values + k), _MM_FROUND_TO_NEAREST_INT)));
#endif
#if defined(__F16C__) && defined(__x86_64__)
    for (; k + 8 <= n; k += 8)
        _mm256_storeu_ps(values + k, _mm256_cvtph_ps(
            _mm256_cvtps_ph(_mm256_loadu_ps(values + k), _MM_FROUND_TO_NEAREST_INT)));
#endif
    for (; k < n; ++k) values[k] = fusec_round_f16(values[k]);
}

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

// NaN-propagating max/min, as torch.maximum/minimum and clamp (a NaN a is kept; a NaN b loses
// every comparison and is kept), as two selects.
template <typename T> static inline T fusec_maximum(T a, T b) {
    return fusec_select(a != a, a, fusec_select(a > b, a, b));
}
template <typename T> static inline T fusec_minimum(T a, T b) {
    return fusec_select(a != a, a, fusec_select(a < b, a, b));
}
template <typename T> static inline T fusec_relu(T x) { return fusec_select(x < 0, T(0), x); }

template <typename T> static inline T fusec_sigmoid(T x) { return T(1) / (T(1) + fusec_exp(-x)); }
// float: with fusec_exp_unit (1 + e^-x is where it is exact; x below -88.72 gives 0, as eager)
template <> inline float fusec_sigmoid<float>(float x) { return 1.0f / (1.0f + fusec_exp_unit(-x)); }
template <typename T> static inline T fusec_rsqrt(T x) { return T(1) / std::sqrt(x); }
template <typename T> static inline T fusec_gelu(T x) {
    return T(0.5) * x * (T(1) + std::erf(x * T(0.70710678118654752440)));
}
// float gelu: fusec_gelu_f32 (above), eager's formula; fusec_gelu_onednn: oneDNN's edges
template <> inline float fusec_gelu<float>(float x) { return fusec_gelu_f32(x); }
template <typename T> static inline T fusec_gelu_onednn(T x) { return fusec_gelu(x); }
template <> inline float fusec_gelu_onednn<float>(float x) { return fusec_gelu_onednn_f32(x); }
template <typename T> static inline T fusec_gelu_tanh(T x) {
    const T k = T(0.79788456080286535588);  // sqrt(2 / pi)
    return T(0.5) * x * (T(1) + fusec_tanh(k * (x + T(0.044715) * x * x * x)));
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
// shifts as torch defines them for every amount (C++ leaves b < 0 or b >= width undefined):
// a << b is then 0; a >> b is a's sign for signed a, 0 for unsigned a
template <typename T> static inline T fusec_lshift(T a, T b) {
    constexpr int bits = sizeof(T) * 8;
    if (b < 0 || b >= (T)bits) return 0;
    return (T)((std::make_unsigned_t<T>)a << b);
}
template <typename T> static inline T fusec_rshift(T a, T b) {
    constexpr int bits = sizeof(T) * 8;
    if (b < 0 || b >= (T)bits) return std::is_signed_v<T> ? (T)(a < 0 ? -1 : 0) : (T)0;
    return (T)(a >> b);
}
template <typename T> static inline T fusec_bitwise_not(T x) {
    if constexpr (std::is_same_v<T, bool>) return !x; else return (T)~x;
}

// pow: floats use the C library; integers use exact repeated squaring with wraparound, and a
// negative exponent gives what torch gives (1 for base 1, +-1 for base -1, else 0).
template <typename T> static inline T fusec_pow(T base, T exp) {
    if constexpr (std::is_floating_point_v<T>) {
        // C's pow, also where gcc's vectorizer spells pow(x, 0.5) as sqrt(x), which answers -0
        // for -0 and NaN for -inf (pow: +0 and +inf). Eager's float16 x ** 0.5 is pow's
        // (fusec/ops.py _pow_scalar); the other dtypes' are sqrt rows, never this.
        const T r = std::pow(base, exp);
        const bool root = exp == T(0.5);
        return (root && base == -std::numeric_limits<T>::infinity()) ? std::numeric_limits<T>::infinity()
                                                                    : ((root && base == T(0)) ? T(0) : r);
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

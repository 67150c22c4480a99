"""How close the CPU backends' float32 math is to the exact answer, over the whole float32 range.

Each function is computed by eager, the C++ backend and the LLVM backend on one million float32
values: every 4096th bit pattern of all 2^32 (positive and negative, subnormals, the largest
finite values; NaNs dropped), plus the special values. The error of each answer is measured in
units in the last place (ulp) of float32 against float64's answer, unrounded (a correctly rounded
result is 0.5 ulp away at most). The bounds asserted here are the ones docs/ops.md states.

The bound is eager's: max(1 ulp, eager's error on the same inputs), for every function. expm1,
log, log2, sin, cos and tan call torch's own SLEEF (codegen/cpu_plan.py, Note: eager's vector
math) where torch exports it; elsewhere they come from glibc's libmvec, whose bounds (measured)
are the ones asserted then. exp, log1p, tanh and erf are fusec's own, computed in float
(cpp_prelude.h, the same steps in llvm_prelude.ll.j2), on every machine; exp2 is libmvec's, within
1 ulp. tanh's and erf's largest errors sit between 0.5 and 4 (where the answers near 1 are made
from e^x): test_tanh_erf_densely measures every 4th float there; test_exp_densely and
test_log1p_densely measure exp and log1p over their whole ranges and at their thresholds; and the
two backends must agree bit for bit on all four.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fusec
from fusec.codegen import cpp
from fusec.codegen.cpp import text as cpp_text
from fusec.codegen.llvm import ir as llvm_ir
from fusec.codegen.cpu_plan import eager_gelu_multiplies_first

FUNCTIONS = {
    "exp": torch.exp, "exp2": torch.exp2, "expm1": torch.expm1, "log": torch.log,
    "log2": torch.log2, "log1p": torch.log1p, "sin": torch.sin, "cos": torch.cos,
    "tan": torch.tan, "tanh": torch.tanh, "erf": torch.erf,
}
SLEEF = {"expm1", "log", "log2", "sin", "cos", "tan"}
# libmvec's functions where SLEEF is not linked: the largest error measured on these inputs
LIBMVEC_BOUND = {"expm1": 2.2, "log": 3.9, "log2": 1.9, "sin": 1.7,
                 "cos": 1.9, "tan": 2.9}

SPECIAL = [math.inf, -math.inf, math.nan, 0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38, -1.1754942e-38,
           3.4028235e38, -3.4028235e38, 88.72283, 88.72284, -87.33655, -103.97208, -104.0, 1.0,
           -1.0, 0.5, 2.0, 1e-30, -1e-30, 20.0, -20.0, 1e10, -1e10]


def whole_range(count: int = 1 << 20) -> torch.Tensor:
    """Every (2^32 / count)-th float32 bit pattern, NaNs dropped, then the special values."""
    bits = torch.arange(0, 1 << 32, (1 << 32) // count, dtype=torch.int64)
    bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)
    x = bits.view(torch.float32)
    return torch.cat([x[~torch.isnan(x)], torch.tensor(SPECIAL)]).contiguous()


def ulp_error(y: torch.Tensor, x: torch.Tensor, f) -> float:
    """max |y - f(x) in float64| in float32 ulps of the exact answer, over the finite answers
    (an exact answer beyond float32's range is compared by the non-finite checks instead)."""
    ref = f(x.double())
    ok = torch.isfinite(ref) & torch.isfinite(y) & (ref.abs() <= 3.4028234663852886e38)
    ulp = torch.pow(2.0, torch.floor(torch.log2(ref.abs().clamp(min=2.0 ** -126))) - 23)
    err = torch.where(ok, (y.double() - ref).abs() / ulp, torch.zeros_like(ref))
    return err.max().item()


def all_functions(x):
    return tuple(f(x) for f in FUNCTIONS.values())


@pytest.fixture(scope="module")
def results():
    """Each function's answers, per backend, on the whole-range inputs: one kernel each."""
    x = whole_range()
    out = {"eager": dict(zip(FUNCTIONS, all_functions(x)))}
    for backend in ("cpp", "llvm"):
        compiled = fusec.compile(all_functions, backend=backend)
        out[backend] = dict(zip(FUNCTIONS, compiled(x)))
        assert {k.backend for k in compiled.kernels} == {backend}
    return x, out


def sleef_linked() -> bool:
    return "-DFUSEC_SLEEF" in cpp.math_flags() and llvm_ir.sleef_library() is not None


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_ulp_error_over_the_float32_range(results, backend, name):
    x, out = results
    f = FUNCTIONS[name]
    eager = ulp_error(out["eager"][name], x, f)
    ours = ulp_error(out[backend][name], x, f)
    bound = max(1.0, eager)
    if name in SLEEF and not sleef_linked():
        bound = LIBMVEC_BOUND[name]  # glibc's libmvec, not eager's: docs/ops.md
    assert ours <= bound, f"{backend} {name}: {ours:.3f} ulp, bound {bound} (eager {eager:.3f})"


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_non_finite_zero_and_subnormal_answers_match_eager(results, backend):
    """NaN where eager gives NaN, the same infinities, zeros with eager's sign, and no answer
    flushed to zero (or to a subnormal) where eager's is not. Where eager flushes and fusec
    does not, fusec's answer must be the exact one rounded (eager's SLEEF log1p gives 0 for
    +-1e-45, whose log1p rounds to itself)."""
    x, out = results
    for name in FUNCTIONS:
        want, got = out["eager"][name], out[backend][name]
        assert torch.equal(torch.isnan(got), torch.isnan(want)), (backend, name, "NaN")
        inf = torch.isinf(want) | torch.isinf(got)
        assert torch.equal(got[inf], want[inf]), (backend, name, "inf")
        rounded = FUNCTIONS[name](x.double()).float()
        flushed = (want == 0) & (got != 0)
        assert torch.equal(got[flushed], rounded[flushed]), (backend, name, "eager flushed")
        zero = ((want == 0) | (got == 0)) & ~flushed
        assert torch.equal(got[zero], want[zero]), (backend, name, "zero")
        assert torch.equal(torch.signbit(got[zero]), torch.signbit(want[zero])), (backend, name)


EDGES = torch.tensor([math.inf, -math.inf, math.nan, -0.0, 0.0, 1e-45, -1e-45, 3.4e38, -3.4e38,
                      1.7e38, 1.71e38, 10.0, -10.0, 0.5, -20.0])


def gelu(x):
    return F.gelu(x)


def gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


# Eager's float32 gelu depends on the CPU (codegen/cpu_plan.py, Note: eager's gelu depends on the
# CPU): oneDNN's on AVX-512 (gelu(+inf) NaN, overflow above FLT_MAX / 2, gelu(-0.0) = -0.0),
# ATen's fma form elsewhere (gelu(+inf) = inf, no overflow, gelu(-0.0) = +0.0). Both CPU backends
# follow this machine's; `gelu_form` below builds each form on any machine.
MULTIPLIES_FIRST = eager_gelu_multiplies_first()


def same(got, want):
    return torch.equal(torch.isnan(got), torch.isnan(want)) and \
        torch.equal(torch.signbit(got[~torch.isnan(got)]), torch.signbit(want[~torch.isnan(want)])) \
        and torch.allclose(got, want, rtol=2e-6, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
@pytest.mark.parametrize("fn", [gelu, gelu_tanh])
def test_gelu_edges_as_eager(backend, fn):
    """gelu's edges are those of the kernel eager runs on this CPU (+inf, overflow above
    FLT_MAX / 2, -0.0); the tanh form gives inf at +inf on every CPU. fusec gives the same."""
    want = fn(EDGES)
    compiled = fusec.compile(fn, backend=backend)
    got = compiled(EDGES)
    assert [k.backend for k in compiled.kernels] == [backend]  # (no fallback to the other)
    assert same(got, want), (got.tolist(), want.tolist())


def edges_of(form_multiplies_first: bool, got: torch.Tensor) -> None:
    """Check `got` = gelu(EDGES) has the edges of one form of eager's kernel."""
    if form_multiplies_first:  # oneDNN's
        assert math.isnan(got[0]) and got[9] < math.inf and got[10] == math.inf
        assert torch.signbit(got[3])
    else:  # ATen's fma of x/2 with erf
        assert got[0] == math.inf and got[7] == pytest.approx(3.4e38) and got[10] < math.inf
        assert not torch.signbit(got[3])
    assert math.isnan(got[1]) and math.isnan(got[2]) and got[11] == pytest.approx(10.0)


def oneDNN_kernel() -> bool:
    return True


def aten_kernel() -> bool:
    return False


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
@pytest.mark.parametrize("multiplies_first", [True, False], ids=["onednn", "aten"])
def test_gelu_builds_either_eager_kernel(monkeypatch, backend, multiplies_first):
    """Each CPU backend builds both forms of gelu's edges, whichever this CPU's eager runs: the
    choice is in each kernel's source (so in every cache's key).
    The two forms differ only at the edges."""
    # (named functions: a saved program's key names a replaced helper, fingerprint.settings)
    choice = oneDNN_kernel if multiplies_first else aten_kernel
    monkeypatch.setattr(cpp_text, "eager_gelu_multiplies_first", choice)
    monkeypatch.setattr(llvm_ir, "eager_gelu_multiplies_first", choice)
    compiled = fusec.compile(gelu, backend=backend)
    got = compiled(EDGES)
    assert [k.backend for k in compiled.kernels] == [backend]
    edges_of(multiplies_first, got)
    inside = torch.ones(len(EDGES), dtype=torch.bool)
    inside[[0, 7, 10]] = False  # (and the sign of a zero answer: -0.0 and below -10)
    assert torch.allclose(got[inside], gelu(EDGES)[inside], rtol=2e-6, atol=0, equal_nan=True)
    if multiplies_first == MULTIPLIES_FIRST:
        assert same(got, gelu(EDGES))


@pytest.mark.parametrize("fn", [gelu, gelu_tanh])
def test_gelu_edges_triton(fn):
    """The Triton backend's reference is CUDA's eager kernel, x * normcdf(x): gelu(+inf) is inf
    there, x/2 comes first (no overflow below FLT_MAX), and a zero answer has x's sign (-0.0 for
    -0.0, -1e-45 and -20). Every other value matches CPU eager."""
    got = fusec.compile(fn, backend="triton")(EDGES)
    want = fn(EDGES)
    if fn is gelu:
        assert got[0] == math.inf and got[7] == pytest.approx(3.4e38)
        assert torch.equal(torch.signbit(got[got == 0]), torch.signbit(EDGES[got == 0]))
        keep = torch.ones(len(EDGES), dtype=torch.bool)
        keep[[0, 7, 10]] = False
        assert torch.allclose(got[keep], want[keep], rtol=2e-6, atol=0, equal_nan=True)
        return
    assert same(got, want), (got.tolist(), want.tolist())


@pytest.mark.parametrize("backend", ["cpp", "llvm", "triton"])
@pytest.mark.parametrize("dtype", [torch.int8, torch.int32])
def test_integer_mean_raises_as_eager(backend, dtype):
    x = torch.arange(6, dtype=dtype)
    with pytest.raises(RuntimeError) as eager:
        x.mean()
    with pytest.raises(fusec.FusecError, match=r"mean\(\): could not infer output dtype") as ours:
        fusec.compile(lambda t: t.mean() * 2, backend=backend)(x)
    assert str(eager.value) in str(ours.value)
    # with a floating dtype= it is allowed, in eager and here
    f = fusec.compile(lambda t: t.mean(dim=0, dtype=torch.float32), backend=backend)
    torch.testing.assert_close(f(x), x.mean(dim=0, dtype=torch.float32))


def chain(x):
    """20 ops alternating exp, log, tanh and sin, kept inside their comfortable ranges."""
    for _ in range(4):
        x = torch.log(torch.exp(torch.sin(x)) + 1.5)
        x = torch.tanh(x) * 2.0
    return x


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_long_chain_error_within_eagers(backend):
    x = torch.linspace(-6.0, 6.0, 4099)
    ref = chain(x.double())
    eager_err = (chain(x).double() - ref).abs().max().item()
    ours = (fusec.compile(chain, backend=backend)(x).double() - ref).abs().max().item()
    tolerance = 1.3e-6 * ref.abs().max().item()  # float32's rtol, torch.testing's
    assert ours <= eager_err + tolerance, (ours, eager_err)


OWN = {"tanh": torch.tanh, "erf": torch.erf}


@pytest.mark.parametrize("name", ["exp", "log1p", *OWN])
def test_own_functions_same_bits_on_both_backends(results, name):
    """fusec_exp_f32, fusec_log1p_f32, fusec_tanh and fusec_erf are the same float steps in
    cpp_prelude.h and llvm_prelude.ll.j2."""
    _, out = results
    assert torch.equal(out["cpp"][name].view(torch.int32), out["llvm"][name].view(torch.int32))


@pytest.mark.parametrize("name", list(OWN))
def test_tanh_erf_densely(name):
    """Every 4th float32 in [0.5, 4), both signs: where the largest errors are (an exhaustive run
    over all positive floats found the same maxima, docs/ops.md). Within 1 ulp where the CPU has
    FMA, as eager (tanh's largest error is 0.92 ulp, at 0.906, erf's 0.98); the bound on a CPU
    without FMA is the measured one (docs/ops.md)."""
    bits = torch.arange(0x3F000000, 0x40800000, 4, dtype=torch.int32)
    x = torch.cat([bits.view(torch.float32), -bits.view(torch.float32)])
    f = OWN[name]
    bound = 1.0 if host_has_fma() else {"tanh": 1.1, "erf": 1.35}[name]
    for backend in ("cpp", "llvm"):
        ours = ulp_error(fusec.compile(f, backend=backend)(x), x, f)
        assert ours <= bound, f"{backend} {name}: {ours:.3f} ulp, bound {bound}"


def _around(value: float, n: int) -> torch.Tensor:
    """The 2n + 1 float32 values nearest `value` (n either side)."""
    bits = torch.tensor([value]).view(torch.int32).item()
    return torch.arange(bits - n, bits + n + 1, dtype=torch.int32).view(torch.float32)


def _walk(start: float, stop: float, step: int) -> torch.Tensor:
    """Every `step`-th float32 from `start` to `stop` (start < 0 <= stop), in bit order."""
    low = torch.tensor([start]).view(torch.int32).item()  # negative: bits count down to -0
    high = torch.tensor([stop]).view(torch.int32).item()
    negative = torch.arange(low, -(1 << 31) - 1, -step, dtype=torch.int64)
    positive = torch.arange(0, high + 1, step, dtype=torch.int64)
    return torch.cat([negative, positive]).to(torch.int32).view(torch.float32)


# e^x's thresholds: the largest finite answer (88.72283...), the smallest normal one (-87.33654),
# the smallest subnormal one (-103.27893) and the last that does not round to 0 (-103.97207)
EXP_EDGES = [88.72283935546875, -87.33654475, -103.27893, -103.97208]


def test_exp_densely():
    """Every 256th float32 from -110 to 95 (8.7 million values: every answer e^x has, from 0
    through the subnormals to inf), the 4097 floats around each threshold and the 2049
    smallest of each sign (inputs 0 and subnormal), both backends,
    the same bits on both. An exhaustive run over every float32 in [-110, 95] (the prelude's
    function in a loop, compiled by gcc) found 0.876 ulp at most with FMA and 0.898 without
    (docs/ops.md); every infinity and zero is where eager has it, and a subnormal answer is
    within the same bound in units of the subnormals' step (eager's too: 0.5)."""
    tiny = torch.arange(0, 2049, dtype=torch.int32).view(torch.float32)  # 0 and the subnormals
    x = torch.cat([_walk(-110.0, 95.0, 256), *(_around(v, 2048) for v in EXP_EDGES), tiny, -tiny])
    assert x.min() == -110.0 and x.max() <= 95.0
    want = torch.exp(x)
    got = {b: fusec.compile(torch.exp, backend=b)(x) for b in ("cpp", "llvm")}
    assert torch.equal(got["cpp"].view(torch.int32), got["llvm"].view(torch.int32))
    ours = got["cpp"]
    assert torch.equal(torch.isinf(ours), torch.isinf(want))
    assert torch.equal(ours == 0, want == 0)
    finite = torch.isfinite(ours) & (ours != 0)
    assert ulp_error(ours[finite], x[finite], torch.exp) <= 0.9


SPECIALS = torch.tensor([math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-40, -1e-40,
                         3.4e38, -3.4e38, 89.0, -104.0, -1.0, -1.5, 1.0, -0.5])


@pytest.mark.parametrize("fn", [torch.exp, torch.log1p], ids=["exp", "log1p"])
def test_exp_log1p_specials_as_eager(fn):
    """NaN, +-inf, +-0 (with their signs), subnormal inputs, the largest floats, e^x's clamp
    points, log1p's -1 (-inf) and below (NaN): eager's answers, the rest within 1e-7."""
    want = fn(SPECIALS)
    for backend in ("cpp", "llvm"):
        got = fusec.compile(fn, backend=backend)(SPECIALS)
        assert same(got, want), (backend, got.tolist(), want.tolist())
        exact = torch.isinf(want) | (want == 0)
        assert torch.equal(got[exact], want[exact]), (backend, got.tolist(), want.tolist())


# log1p's seams: just above -1, the polynomial's ends (u = 1 + x at 3/4 and 3/2: f = -1/4 and
# 1/2, where the largest errors are), e = 24 to 25 (f taken from u), the largest floats
LOG1P_EDGES = [-0.99999994, -0.25, 0.5, -0.625, 2.0, 25165823.0, 3.4028235e38, 1.490116e-08]


def test_log1p_densely():
    """Every 256th float32 above -1 (12.6 million values) and the 4097 floats around each
    seam, both backends, the same bits on both. An exhaustive run over every float32 above -1
    (the prelude's function in a loop, compiled by gcc) found 0.875 ulp at most with FMA and
    0.992 without (docs/ops.md); eager's SLEEF log1p is 1.0."""
    x = torch.cat([_walk(-0.99999994, 3.4028235e38, 256),
                   *(_around(v, 2048) for v in LOG1P_EDGES)])
    x = x[(x > -1) & torch.isfinite(x)]
    got = {b: fusec.compile(torch.log1p, backend=b)(x) for b in ("cpp", "llvm")}
    assert torch.equal(got["cpp"].view(torch.int32), got["llvm"].view(torch.int32))
    bound = 0.9 if host_has_fma() else 1.0
    assert ulp_error(got["cpp"], x, torch.log1p) <= bound


def host_has_fma() -> bool:
    try:
        with open("/proc/cpuinfo") as info:
            return " fma " in info.read(1 << 16)
    except OSError:
        return False


def gelu_error(y: torch.Tensor, x: torch.Tensor) -> float:
    """max |y - gelu(x)| / (1 + |gelu(x)|), against float64's gelu: absolute near 0, where gelu's
    answer is the difference of two numbers near x / 2, relative further out."""
    ref = F.gelu(x.double())
    return ((y.double() - ref).abs() / (1 + ref.abs())).max().item()


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_sigmoid_and_gelu_through_exp_unit(results, backend):
    """float32 sigmoid and gelu take their e^y from fusec_exp_unit (cpp_prelude.h: inline, y
    clamped to [-86, 89], where the answer meets 1 anyway): as accurate as eager's over the whole
    range (sigmoid in ulps where its answer is a normal float, gelu next to 1 + |gelu|), the same
    bits on both backends, and the edges (+-inf, NaN, -0, overflow of e^-x) as eager."""
    x, _ = results
    normal = x[x.abs() < 88]
    compiled = fusec.compile(torch.sigmoid, backend=backend)
    ours = ulp_error(compiled(normal), normal, torch.sigmoid)
    assert ours <= max(1.0, ulp_error(torch.sigmoid(normal), normal, torch.sigmoid)), ours
    moderate = x[x.abs() < 1e4]
    assert gelu_error(fusec.compile(gelu, backend=backend)(moderate), moderate) <= \
        max(3e-7, gelu_error(gelu(moderate), moderate))
    for fn in (torch.sigmoid, gelu):
        got, want = fusec.compile(fn, backend=backend)(EDGES), fn(EDGES)
        assert same(got, want), (fn, got.tolist(), want.tolist())
        other = fusec.compile(fn, backend="llvm" if backend == "cpp" else "cpp")(x)
        assert torch.equal(fusec.compile(fn, backend=backend)(x).view(torch.int32),
                           other.view(torch.int32)), fn
    tails = torch.tensor([-88.0, -88.7, -89.0, -100.0, 86.0, 87.0, 100.0])
    torch.testing.assert_close(compiled(tails), torch.sigmoid(tails), rtol=2e-7, atol=0)

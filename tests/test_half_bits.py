"""float16 and bfloat16 conversions, bit for bit, on the CPU backends.

The LLVM backend converts half-precision values with integer bit operations (the Note on half
precision in codegen/llvm/__init__.py); the C++ backend with its prelude. Rounding bugs hide in corners
(subnormals, the halfway points, the largest finite values, NaN), so these tests do not sample:
every one of the 65536 bit patterns of each 16-bit type is widened, and every value that matters
for narrowing is narrowed - each half value, each midpoint between neighbours (and just either
side of it), plus random float32 bit patterns from all over the range.
"""
import pytest
import torch

import fusec

from conftest import CPU_BACKENDS

HALVES = [torch.float16, torch.bfloat16]
# "cpp-bits": the C++ backend with its integer float16 conversions, which compilers without a
# half type use (cpp_prelude.h); here gcc has _Float16, so -DFUSEC_NO_FLOAT16 asks for them
BACKENDS = [*CPU_BACKENDS, "cpp-bits"]


@pytest.fixture
def compiled(monkeypatch):
    def compile(fn, backend):
        if backend == "cpp-bits":
            from fusec.codegen import cpp
            monkeypatch.setattr(cpp, "FLAGS", [*cpp.FLAGS, "-DFUSEC_NO_FLOAT16"])
            backend = "cpp"
        return fusec.compile(fn, backend=backend)
    return compile


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bit patterns, except that any NaN matches any NaN (torch's own NaN payloads differ
    between its scalar and vectorized paths)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), "NaN where eager has none (or the reverse)"
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[want.element_size()]
    g, w = got[~nan].view(bits), want[~nan].view(bits)
    bad = (g != w).nonzero().flatten()
    assert bad.numel() == 0, (f"{bad.numel()} values differ, first: input #{bad[0].item()} "
                              f"got {got[~nan][bad[0]].item()!r} want {want[~nan][bad[0]].item()!r}")


def _every_pattern(half: torch.dtype) -> torch.Tensor:
    return torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(half)


def _narrowing_inputs(half: torch.dtype) -> torch.Tensor:
    """float32 values whose rounding to `half` is worth checking."""
    exact = _every_pattern(half).to(torch.float32)
    finite = exact[torch.isfinite(exact)].sort().values.unique()
    lo, hi = finite[:-1].double(), finite[1:].double()
    mid = ((lo + hi) / 2).float()  # exactly representable in float32 (a half has fewer bits)
    bits = mid.view(torch.int32)
    g = torch.Generator().manual_seed(0)
    noise = torch.randint(-2 ** 31, 2 ** 31 - 1, (200_000,), generator=g, dtype=torch.int64)
    specials = torch.tensor([0.0, -0.0, 65504.0, 65519.996, 65520.0, 65536.0, 3.4e38, -3.4e38,
                             float("inf"), float("-inf"), float("nan"), 2.0 ** -24, 2.0 ** -25,
                             2.0 ** -25 * 1.0000001, 2.0 ** -14, 2.0 ** -14 * 0.99999, 1e-45])
    return torch.cat([exact, mid, (bits - 1).view(torch.float32), (bits + 1).view(torch.float32),
                      noise.to(torch.int32).view(torch.float32), specials])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("half", HALVES, ids=str)
def test_widen_every_pattern(backend, half, compiled):
    x = _every_pattern(half)
    fn = lambda x: (x.to(torch.float32), x.to(torch.float64))  # noqa: E731
    got = compiled(fn, backend)(x)
    for g, w in zip(got, fn(x)):
        _same_bits(g, w)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("half", HALVES, ids=str)
def test_narrow_rounds_to_nearest_even(backend, half, compiled):
    x = _narrowing_inputs(half)
    fn = lambda x: (x.to(half), x.double().to(half))  # noqa: E731
    got = compiled(fn, backend)(x)
    for g, w in zip(got, fn(x)):
        _same_bits(g, w)


@pytest.mark.parametrize("backend", BACKENDS)
def test_half_to_half_goes_through_float(backend, compiled):
    x16, xb = _every_pattern(torch.float16), _every_pattern(torch.bfloat16)
    fn = lambda a, b: (a.to(torch.bfloat16), b.to(torch.float16))  # noqa: E731
    got = compiled(fn, backend)(x16, xb)
    for g, w in zip(got, fn(x16, xb)):
        _same_bits(g, w)

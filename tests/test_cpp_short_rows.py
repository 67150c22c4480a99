"""Reductions of a few values per row on the C++ backend (pool windows), rows run in SIMD lanes.

With passes/pooling.py switched on for the CPU, `max_pool2d(x, 2)` is an amax over the last dims
of a view: thousands of rows of K = 4 (8 for a 3-D pool), neighbouring rows 2 elements apart.
codegen/cpp/reduction.py (note "short rows") runs LANES such rows side by side, one per lane, with
the k loop unrolled inside. Checked here: eager's answers (NaN in a max pool, infinities, odd
sizes whose last row or column the pool drops, float16/bfloat16, 3-D pools, a contiguous short
row), that the kernel takes the lanes form, and that gcc vectorizes the lane loop on x86-64,
x86-64-v3 and x86-64-v4 (its own report, read by tests/gcc_vector_report.py). docs/backends/cpp.md,
"Short rows in SIMD lanes", describes the kernel.
"""

import pytest
import torch
import torch.nn.functional as F

import fusec
from conftest import assert_matches, values_with_specials
from fusec.codegen import cpp
from gcc_vector_report import LEVELS, NEEDS_CPP, X86, compile_report


pytestmark = pytest.mark.usefixtures("pools_here")  # (conftest.py)


CASES = {
    "avg_sigmoid": (lambda x: torch.sigmoid(F.avg_pool2d(x, 2)), 4),
    "tanh_max": (lambda x: F.max_pool2d(torch.tanh(x) * 2, 2), 4),
    "max_clamp": (lambda x: torch.clamp(F.max_pool2d(x, 2), -1, 1), 4),
    "max3d": (lambda x: F.max_pool3d(x, 2), 5),
    "avg3d": (lambda x: F.avg_pool3d(x * 3, 2) + 1, 5),
    "short_inner_sum": (lambda x: x.sum(-1), 4),  # contiguous short rows
}


def _shape(ndim, odd=False):
    return (2, 3, 33, 35) if ndim == 4 and odd else (2, 3, 32, 34) if ndim == 4 else \
        ((2, 3, 5, 33, 35) if odd else (2, 3, 4, 32, 34))


def _source(cf) -> str:
    return "\n".join(k.source for k in cf.kernels)


@pytest.mark.parametrize("odd", [False, True], ids=["even", "odd"])
@pytest.mark.parametrize("name", list(CASES))
def test_float32_matches_eager_and_runs_in_lanes(name, odd):
    fn, ndim = CASES[name]
    x = values_with_specials(*_shape(ndim, odd), special=True)
    if name == "short_inner_sum":
        x = values_with_specials(2, 3, 40, 4)
    cf = assert_matches(fn, x, backend="cpp")
    assert "LANES" in _source(cf), _source(cf)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("name", ["avg_sigmoid", "tanh_max", "max3d"])
def test_other_float_dtypes_match_eager(name, dtype):
    fn, ndim = CASES[name]
    assert_matches(fn, values_with_specials(*_shape(ndim, True), dtype=dtype, special=True), backend="cpp")


def test_non_contiguous_input():
    x = values_with_specials(2, 34, 32, 3).permute(0, 3, 1, 2)  # channels last
    assert_matches(CASES["tanh_max"][0], x, backend="cpp")
    assert_matches(CASES["avg_sigmoid"][0], values_with_specials(2, 3, 40, 40)[:, :, 3:37, 1:35], backend="cpp")


@X86
@NEEDS_CPP
@pytest.mark.parametrize("target", LEVELS)
@pytest.mark.parametrize("name", ["avg_sigmoid", "tanh_max", "max3d", "avg3d"])
def test_lane_loop_is_vectorized_for(name, target, tmp_path):
    fn, ndim = CASES[name]
    kernels = fusec.explain(fn, values_with_specials(*_shape(ndim)), backend="cpp").compiled.kernels
    sources = [cpp.render(k.ir) for k in kernels]
    (source,) = [s for s in sources if "LANES" in s]
    report = compile_report(source, target, tmp_path)
    lines = report.lines
    first = next(n for n, t in enumerate(lines) if t.strip() == "#pragma omp simd") + 1
    # the lane loop runs to the block loop's end (the template does not indent its body, so its
    # closing brace is not found by indentation as simd_loops finds others)
    last = len(lines) - 2
    assert report.vectorized(first, last), "\n".join(report.said(first, last)) + "\n" + source


@pytest.mark.parametrize("shape", [(2, 3, 4, 16, 16), (2, 3, 4, 8, 8), (2, 3, 4, 8, 13)],
                         ids=lambda s: "x".join(map(str, s)))
def test_fewer_rows_side_by_side_than_lanes(shape):
    """8, 4 or 6 rows side by side: fewer lanes, a power of two (constant when every block is full)."""
    cf = assert_matches(CASES["max3d"][0], values_with_specials(*shape, special=True), backend="cpp")
    assert "LANES" in _source(cf), _source(cf)

"""Short rows (pool windows) in SIMD lanes on both CPU backends, the LLVM one included.

A 2 x 2 pool is an amax or a mean over rows of K = 4 values (8 for a 3-D pool), neighbouring rows
2 elements apart (passes/pooling.py). codegen/cpu_plan.py decides, for both backends alike
(`short_row_lanes`, Note: short rows in lanes), that LANES such rows run side by side, one per
SIMD lane; the C++ backend spells it as its lanes of rows, the LLVM backend as its inside-out
blocks (llvm/columns.py) with every k step of a row inside the one lane loop. Checked here:
eager's answers on both backends (NaN and infinities, odd sizes whose last row or column the pool
drops, non-contiguous inputs, other float dtypes, a last block cut short), that the LLVM kernel
takes that form, and that LLVM's vectorizer leaves no scalar load in it when every block is full.
"""
import re

import pytest
import torch
import torch.nn.functional as F

import fusec
from conftest import assert_matches, values_with_specials


BACKENDS = ["cpp", "llvm"]


pytestmark = pytest.mark.usefixtures("pools_here")  # (conftest.py)


def _values(*shape, dtype=torch.float32, special=True):
    return values_with_specials(*shape, dtype=dtype, special=special)


CASES = {
    "tanh_max": (lambda x: F.max_pool2d(torch.tanh(x) * 1.5 + 0.1, 2), 4),
    "avg_sigmoid": (lambda x: torch.sigmoid(F.avg_pool2d(x, 2)), 4),
    "max_clamp_mean": (lambda x: torch.tanh(torch.clamp(F.max_pool2d(x, 2), -1, 1)).mean((2, 3)), 4),
    "max3d": (lambda x: F.max_pool3d(x, 2), 5),
    "avg3d": (lambda x: F.avg_pool3d(x * 3, 2) + 1, 5),
    "min_window": (lambda x: -F.max_pool2d(-x, 2), 4),
    "softmax_of_4": (lambda x: torch.softmax(x, -1), 4),  # several phases, contiguous rows of 4
    "argmax_of_4": (lambda x: x.argmax(-1), 4),
}
SHAPES = {4: {"even": (2, 3, 32, 32), "odd": (2, 3, 33, 35)},
          5: {"even": (2, 3, 4, 32, 32), "odd": (2, 3, 5, 17, 19)}}


def _input(name, size):
    fn, ndim = CASES[name]
    if name in ("softmax_of_4", "argmax_of_4"):
        return fn, _values(3, 5, 37 if size == "odd" else 32, 4, special=name != "argmax_of_4")
    return fn, _values(*SHAPES[ndim][size])


def _llvm_short(cf) -> list[str]:
    return [k.source for k in cf.kernels if "short rows: every k step" in k.source]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("size", ["even", "odd"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_eager(name, size, backend):
    fn, x = _input(name, size)
    cf = assert_matches(fn, x, backend=backend)
    if backend == "llvm" and name != "argmax_of_4":
        assert _llvm_short(cf), "\n".join(k.source for k in cf.kernels)


@pytest.mark.parametrize("backend", BACKENDS)
def test_argmax_of_short_rows_with_nan_and_ties(backend):
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0], [float("nan"), 1.0, float("nan"), 0.0],
                      [0.0, 0.0, 0.0, 0.0], [-1.0, float("inf"), 2.0, float("inf")]] * 5)
    assert_matches(lambda x: x.argmax(-1), x.view(5, 4, 4), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs(backend):
    x = _values(2, 34, 32, 3).permute(0, 3, 1, 2)  # channels last
    assert_matches(CASES["tanh_max"][0], x, backend=backend)
    assert_matches(CASES["avg_sigmoid"][0], _values(2, 3, 40, 40)[:, :, 3:37, 1:35], backend=backend)
    assert_matches(CASES["max3d"][0], _values(2, 3, 6, 20, 18)[:, :, 1:5, ::2, 1:], backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_other_float_dtypes(dtype, backend):
    for name in ("tanh_max", "avg_sigmoid", "max3d"):
        fn, x = _input(name, "odd")
        assert_matches(fn, x.to(dtype), backend=backend)


@pytest.mark.parametrize("shape", [(2, 3, 4, 16, 16), (2, 3, 4, 8, 8), (2, 3, 4, 8, 13)],
                         ids=lambda s: "x".join(map(str, s)))
def test_llvm_fewer_rows_side_by_side_than_lanes(shape):
    """8, 4 or 6 rows side by side: a power of two lanes, the last block cut where it is not full."""
    cf = assert_matches(CASES["max3d"][0], _values(*shape), backend="llvm")
    (source,) = _llvm_short(cf)
    lanes = {16: 8, 8: 4, 13: 4}[shape[-1]]  # output columns 8, 4, 6
    assert f"block of up to {lanes} rows" in source, source
    assert ("every block is full" in source) == (shape[-1] != 13), source


@pytest.mark.parametrize("name", ["tanh_max", "avg_sigmoid", "max3d", "avg3d"])
def test_llvm_lane_loops_are_vectorized_without_a_scalar_epilogue(name):
    """Every block full (16 rows side by side): LLVM's optimized IR of the kernel loads only
    vectors. With the k loop outside the lane loop, a 2-wide window's value was a strided load
    with a gap, which LLVM vectorized with a scalar epilogue running half of each block."""
    fn, ndim = CASES[name]
    shape = {4: (2, 3, 32, 32), 5: (2, 3, 4, 32, 32)}[ndim]
    e = fusec.explain(fn, _values(*shape, special=False), backend="llvm")
    (k,) = [i for i, k in enumerate(e.compiled.kernels) if "short rows" in k.source]
    opt = e.optimized_ir(k)
    assert re.search(r"load <\d+ x float>", opt), opt
    assert not re.search(r"= load float, ptr", opt), opt

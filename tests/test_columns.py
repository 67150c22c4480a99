"""Reductions with their loops turned inside out on both CPU backends (codegen/cpp/columns.py,
llvm/columns.py; the decision is cpu_plan.column_blocks): rows that lie side by side in memory,
each row's values far apart (`x.sum(0)`, a mean over the middle dim, softmax over dim 0, GPTQ's
words read column by column), reduced with the k loop outside and a block of rows in the SIMD
lanes.

Every case is compared with eager and a float64 reference (conftest.assert_matches) on the C++
and LLVM backends: odd shapes, a ragged last block, long blocked sums, several phases, an index
reduction, NaN and infinities, views with offsets, non-contiguous rows (which keep the generic
kernel), row math fused after the reduction, and empty tensors."""
import pytest
import torch

from conftest import assert_matches
from fusec.codegen import cpu_plan

CASES = {
    "sum0": (lambda x: (x * 2).sum(0), (300, 70)),
    "mean1": (lambda x: x.mean(1), (3, 130, 20)),
    "amax0": (lambda x: torch.amax(x, 0), (65, 9)),
    "argmax0": (lambda x: torch.argmax(x, 0), (97, 70)),
    "argmin1": (lambda x: torch.argmin(x, 1), (2, 33, 17)),
    "softmax0": (lambda x: torch.softmax(x, 0), (129, 40)),
    "log_softmax1": (lambda x: torch.log_softmax(x, 1), (2, 40, 3, 11)),
    "logsumexp0": (lambda x: torch.logsumexp(x, 0), (77, 24)),
    "var0": (lambda x: torch.var(x, 0), (200, 33)),
    "center1": (lambda x: x - x.mean(1, keepdim=True), (4, 66, 10)),
    "sum01": (lambda x: x.sum((0, 1)), (5, 31, 64)),
    "norm0": (lambda x: torch.linalg.vector_norm(x, dim=0), (150, 16)),
}


def special(*shape, dtype=torch.float32, nan=True):
    x = torch.randn(*shape) * 4
    flat = x.view(-1)
    if nan:
        for i, v in enumerate([float("nan"), float("inf"), -float("inf"), 30.0]):
            flat[(i * 131 + 5) % flat.numel()] = v
    return x.to(dtype)


def columns(cf) -> bool:
    return any("COLUMNS" in k.source or "llvm_reduction_columns" in k.source for k in cf.kernels)


def across_rows(cf) -> bool:
    """Inside out, or cpp/reduction.py's lanes of rows (one short k loop run in each lane): both
    vectorize across neighbouring rows; neither copies a row first."""
    return all("gathered" not in k.source for k in cf.kernels) and \
        (columns(cf) or any("LANES" in k.source for k in cf.kernels))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_columns_match_eager(case, dtype, backend):
    fn, shape = CASES[case]
    cf = assert_matches(fn, special(*shape, dtype=dtype, nan=False), backend=backend)
    assert all(k.backend == backend for k in cf.kernels)
    assert (columns(cf) if backend == "llvm" else across_rows(cf)), "\n".join(k.source for k in cf.kernels)


@pytest.mark.parametrize("case", ["sum0", "argmax0", "softmax0", "var0", "amax0"])
@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_columns_with_nan_and_infinities(case, backend):
    fn, shape = CASES[case]
    assert_matches(fn, special(*shape), backend=backend)


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_long_float_sum_is_as_accurate_as_eager(backend):
    """K = 20000 values of one sign per row: one lane adds them one after another, in blocks of
    COLUMN_SUM_BLOCK; the error against float64 stays within eager's (assert_matches)."""
    x = torch.rand(20000, 24) + 0.5
    cf = assert_matches(lambda x: x.sum(0), x, backend=backend)
    if backend == "cpp":
        assert f"blocks of {cpu_plan.COLUMN_SUM_BLOCK}" in cf.kernels[0].source


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_integer_sums_are_exact(backend):
    x = torch.randint(-1000, 1000, (513, 37), dtype=torch.int32)
    cf = assert_matches(lambda x: x.sum(0), x, backend=backend)
    assert across_rows(cf)
    b = torch.rand(300, 40) > 0.3
    assert_matches(lambda b: (b.any(0), b.all(0), b.sum(0)), b, backend=backend)


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_views_with_offsets_and_strided_rows(backend):
    base = torch.randn(400, 150)  # K > 256: a blocked float sum, which lanes of rows leave
    cf = assert_matches(lambda x: x.sum(0), base[7:, 11:140], backend=backend)  # offset, stride 150
    assert columns(cf)
    # rows two elements apart: not side by side, so the generic kernel keeps them
    cf = assert_matches(lambda x: x.sum(0), base[:, ::2], backend=backend)
    assert not columns(cf)
    # the last dim is the one reduced: rows are contiguous runs, the generic kernel
    cf = assert_matches(lambda x: x.sum(1), base, backend=backend)
    assert not columns(cf)


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
@pytest.mark.parametrize("shape", [(0, 16), (16, 0), (5, 0, 9)])
def test_empty(shape, backend):
    assert_matches(lambda x: x.sum(0) + 1, torch.randn(*shape), backend=backend)


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_short_last_dim_keeps_the_generic_kernel(backend):
    """Fewer than MIN_LAST rows side by side fill too few lanes."""
    cf = assert_matches(lambda x: x.sum(0), torch.randn(300, cpu_plan.MIN_LAST - 1), backend=backend)
    assert not columns(cf)


def test_a_kernel_reads_its_row_values_back_in_each_lane_loop():
    """Softmax over dim 0: the max of phase 0 is kept per lane for phase 1 and the last pass."""
    cf = assert_matches(lambda x: torch.softmax(x * 3, 0), torch.randn(100, 72), backend="cpp")
    text = cf.kernels[0].source
    assert "_l[COLUMNS];" in text and "_l[lane];" in text
    cf = assert_matches(lambda x: torch.softmax(x * 3, 0), torch.randn(100, 72), backend="llvm")
    text = cf.kernels[0].source
    assert "alloca [64 x float]" in text and "llvm_reduction_columns" in text


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
@pytest.mark.parametrize("fn", [
    lambda x: torch.log_softmax(x, 0),
    lambda x: torch.tanh(torch.amin(x, dim=1, keepdim=True)) * x,
    lambda x: torch.rsqrt(torch.var(x, 0) + 1e-5),
], ids=["log_softmax0", "tanh_amin_times_x", "rsqrt_var"])
def test_row_math_fuses_into_the_reduction(fn, backend):
    """Row math (the log of a sum, a tanh of a minimum) after a reduction across rows side by side
    runs in the lanes too, so it stays in the reduction's kernel (passes/fuse_reductions.py, note
    "row math across a strided axis")."""
    cf = assert_matches(fn, special(3, 300, 40, nan=False), backend=backend, kernels=1)
    assert across_rows(cf)


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
@pytest.mark.parametrize("g_idx", [False, True])
def test_gptq_words_read_in_columns(g_idx, backend):
    """GPTQ's (K / 8, N) words at one activation row on the CPU: the GEMV reads each word row in
    order, a block of output columns in the lanes (examples/gptq_linear.py)."""
    from fusec.examples.gptq_linear import GPTQLinear
    torch.manual_seed(0)
    layer = GPTQLinear(torch.randn(512, 96, dtype=torch.float16) / 16, 64, g_idx=g_idx)
    x = torch.randn(1, 512, dtype=torch.float16)
    cf = assert_matches(layer, x, backend=backend)
    gemv = [k for k in cf.kernels if "gemv" in k.name]
    assert gemv and columns(cf) and all(k.backend == backend for k in cf.kernels)


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
@pytest.mark.parametrize("op", [torch.argmax, torch.argmin], ids=["argmax", "argmin"])
def test_index_reductions_pick_what_eager_picks(op, backend):
    """Ties keep the first position, a NaN anywhere wins (its first position), a column of
    infinities picks position 0: column by column, each case in its own lane."""
    x = torch.randn(90, 24)
    x[:, 0] = -float("inf")
    x[:, 1] = float("inf")
    x[10, 2] = x[50, 2] = 100.0       # a tie of maxima
    x[10, 3] = x[50, 3] = -100.0      # ... and of minima
    x[70, 4] = float("nan")           # a NaN after the extremes
    x[0, 5] = float("nan")            # a NaN first
    x[5, 6] = x[6, 6] = float("nan")  # two NaNs
    x[:, 7] = 0.0                     # all equal
    cf = assert_matches(lambda x: op(x, 0), x, backend=backend)
    assert columns(cf)
    ints = torch.randint(-3, 3, (300, 17), dtype=torch.int32)  # many ties
    assert_matches(lambda x: op(x, 0), ints, backend=backend)

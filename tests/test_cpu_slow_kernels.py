"""CPU kernels that used to be slower than the eager ops they replace (issue 14), and stay correct
after the fixes (codegen/cpp/__init__.py):

* `-fno-math-errno`: exp/log1p/tanh under a select (softplus, mish) are vectorized with libmvec;
* tiles for transposed reads: a pointwise kernel with an input read across cache lines in the
  inner loop walks ROW_TILE x CHUNK tiles and copies that input's part of a row first;
* short rows: a (rows, 8) space whose buffers are flat or one row broadcast over the rows is
  looped as flat runs of many rows, the broadcast row repeated into a small array;
* rows reduced across a strided axis (softmax over NCHW channels): the row is copied into a
  contiguous array, reduced there, and scattered back.

Every case is compared with eager (and a float64 reference) on every backend, with odd shapes,
NaN, infinities and empty tensors; the C++ source (or the built library) is checked for the
decision."""
import subprocess

import pytest
import torch
import torch.nn.functional as F

from conftest import TRITON_DEVICE, assert_matches
from fusec.codegen import cpp


def source(cf) -> str:
    return "\n".join(k.source for k in cf.kernels)


def special(*shape, dtype=torch.float32, device="cpu"):
    x = torch.randn(*shape, device=device) * 8
    flat = x.view(-1)
    for i, v in enumerate([float("nan"), float("inf"), -float("inf"), 30.0, -30.0, 89.0, -104.0]):
        if i < flat.numel():
            flat[i * 7 % flat.numel()] = v
    return x.to(dtype)


@pytest.mark.parametrize("fn", [
    lambda x: F.mish(F.mish(x)),
    lambda x: x * torch.tanh(F.softplus(x)),
    lambda x: torch.log1p(torch.exp(-x.abs())) / (1 + x.abs()),
    lambda x: F.softplus(x * torch.sigmoid(x)),
], ids=["mish_mish", "mish_spelled_out", "exp_log1p", "silu_softplus"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_selected_math_matches_eager(target, fn, dtype):
    backend, device = target
    assert_matches(fn, special(3, 5, 67, dtype=dtype, device=device), backend=backend, kernels=1)


def test_mish_calls_no_exp_function():
    """The mish kernel (one exp and a division, capture/decompositions.py) calls no exp function:
    float32 exp is the prelude's inline fusec_exp_f32 (tests/test_exp_vectorized.py checks that
    such loops are vectorized on every x86-64 level, with no call)."""
    import fusec
    cf = fusec.compile(lambda x: F.mish(x), backend="cpp")
    cf(torch.randn(4096))
    lib = cpp.build(cf.kernels[0].source, cf.kernels[0].name)
    symbols = subprocess.run(["nm", "-D", str(lib)], capture_output=True, text=True).stdout
    assert "expf" not in symbols, symbols  # nor SLEEF's _ZGV..._Sleef_expf_u10


def strided(x, y):
    return torch.tanh(x.t()) * y[:, ::2] + 1.0


@pytest.mark.parametrize("n,m", [(64, 64), (37, 53), (1, 40), (40, 1), (0, 5), (130, 17)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32], ids=str)
def test_transposed_read_is_tiled(target, n, m, dtype):
    backend, device = target
    x = special(m, n, device=device).to(dtype) if dtype.is_floating_point else \
        torch.randint(-50, 50, (m, n), device=device, dtype=dtype)
    y = special(n, 2 * m, device=device).to(dtype) if dtype.is_floating_point else \
        torch.randint(-50, 50, (n, 2 * m), device=device, dtype=dtype)
    f = strided if dtype.is_floating_point else (lambda x, y: x.t() * y[:, ::2] + 1)
    cf = assert_matches(f, x, y, backend=backend)
    if backend == "cpp" and n >= 2 and m >= 16:
        assert "ROW_TILE = 16" in source(cf) and "_tile[CHUNK]" in source(cf)


def test_contiguous_reads_are_not_tiled():
    cf = assert_matches(lambda x, y: torch.sin(x) + y, torch.randn(64, 64), torch.randn(64),
                        backend="cpp", kernels=1)
    assert "ROW_TILE = 1;" in source(cf) and "_tile" not in source(cf)


SHORT_ROWS = {
    # the demo's example: uint8 neg wraps, broadcast over the rows, maximum
    "maximum_neg": (lambda a, b: torch.maximum(b, torch.neg(a)), lambda r, n: [(1, n), (r, n)]),
    "bias_row": (lambda a, b: torch.tanh(b) * a + 1, lambda r, n: [(n,), (r, n)]),
    "scalar_and_row": (lambda a, b, c: (b - a) * c, lambda r, n: [(1, 1), (r, n), (n,)]),
    "three_dims": (lambda a, b: torch.where(b > 0, b, a), lambda r, n: [(1, 1, n), (3, r, n)]),
}


def _short_inputs(shapes, dtype, device):
    if dtype.is_floating_point:
        return [special(*shape, dtype=dtype, device=device) for shape in shapes]
    return [torch.randint(0, 256 if dtype == torch.uint8 else 100, shape, dtype=dtype, device=device)
            for shape in shapes]


@pytest.mark.parametrize("case", sorted(SHORT_ROWS))
@pytest.mark.parametrize("rows,inner", [(8390, 8), (3, 5), (1031, 1), (2, 15), (0, 8), (700, 16)])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.float32, torch.float16,
                                   torch.bfloat16, torch.float64], ids=str)
def test_short_rows_match_eager(target, case, rows, inner, dtype):
    """Rows shorter than a vector (fewer than 16 positions) over buffers that are flat or a row
    broadcast over the rows: on the C++ backend the loop is flat runs of rows (Note: short rows,
    codegen/cpu_plan.py), and every backend matches eager, odd sizes and NaN included."""
    backend, device = target
    fn, shapes = SHORT_ROWS[case]
    cf = assert_matches(fn, *_short_inputs(shapes(rows, inner), dtype, device), backend=backend,
                        kernels=1 if rows else None)
    if backend == "cpp" and rows >= 2 and 2 <= inner < 16:  # (rows of 1 coalesce into one row)
        assert "cpp_short_rows.cpp.j2" in source(cf) and "_rep[TILE]" in source(cf), source(cf)
    elif backend == "cpp" and inner >= 16:
        assert "cpp_short_rows" not in source(cf)


@pytest.mark.parametrize("fn,shapes", [
    (lambda a, b: a.t() + b, [(8, 300), (300, 8)]),            # a transposed read: tiles
    (lambda a, b: a[:, ::2] * b, [(300, 16), (300, 8)]),        # a strided row: row by row
    (lambda a, b: a + b, [(300, 1), (300, 8)]),                 # a column broadcast
    (lambda a: a.expand(4, 300, 8).sin(), [(300, 8)]),          # broadcast over outer rows only
], ids=["transposed", "strided_row", "column", "outer_broadcast"])
def test_short_rows_that_are_not_flat_keep_the_row_loop(fn, shapes):
    cf = assert_matches(fn, *[special(*shape) for shape in shapes], backend="cpp", kernels=1)
    assert "cpp_short_rows" not in source(cf)


def test_short_rows_with_an_offset_view():
    """A flat view that starts inside its buffer (a slice along the first dim) keeps its offset."""
    x, row = special(50, 6), special(1, 6)
    cf = assert_matches(lambda x, r: torch.maximum(x[7:40], r) * 2, x, row, backend="cpp", kernels=1)
    assert "cpp_short_rows" in source(cf) and "42 + base + f" in source(cf)


@pytest.mark.parametrize("fn", [
    lambda x: torch.softmax(x, dim=1),
    lambda x: torch.tanh(torch.tanh(torch.amin(x, dim=1, keepdim=True))),
    lambda x: torch.relu(torch.logsumexp(x, dim=1, keepdim=True)),
    lambda x: x - x.mean(dim=1, keepdim=True),
    lambda x: torch.argmax(x, dim=1),
    lambda x: x.sum(dim=(0, 1)),
    lambda x: torch.log_softmax(x, dim=0),
], ids=["softmax", "amin_tanh", "logsumexp", "center", "argmax", "sum01", "log_softmax0"])
@pytest.mark.parametrize("shape", [(2, 16, 8, 8), (3, 5, 7, 9), (2, 3, 0, 4), (1, 40, 1, 17)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_reductions_across_channels(target, fn, shape, dtype):
    backend, device = target
    assert_matches(fn, special(*shape, dtype=dtype, device=device), backend=backend)


def test_channel_softmax_gathers_the_row():
    """40 channels: too long to unroll three loops. With 8 or more rows side by side (W >= 8)
    the loops are turned inside out (codegen/cpp/columns.py); with rows two elements apart (a
    strided view), each row is copied into an array."""
    cf = assert_matches(lambda x: torch.softmax(x, dim=1), torch.randn(2, 40, 8, 8),
                        backend="cpp", kernels=1)
    assert "COLUMNS" in source(cf) and "gathered" not in source(cf)
    cf = assert_matches(lambda x: torch.softmax(x, dim=1), torch.randn(2, 40, 8, 16)[..., ::2],
                        backend="cpp", kernels=1)
    text = source(cf)
    assert "row, gathered" in text and "scattered at the end" in text and "LANES" not in text
    assert "COLUMNS" not in text
    last_dim = assert_matches(lambda x: torch.softmax(x, dim=-1), torch.randn(2, 16, 8, 8),
                              backend="cpp", kernels=1)
    assert "gathered" not in source(last_dim) and "LANES" not in source(last_dim)


@pytest.mark.parametrize("fn,channels", [
    (lambda x: torch.amax(x * 2, dim=1), 40),          # one k loop
    (lambda x: torch.softmax(x, dim=1), 16),           # three short loops
    (lambda x: torch.sigmoid(torch.softmax(x, dim=1)), 8),
], ids=["amax", "softmax16", "softmax8_sigmoid"])
def test_channel_reductions_run_inside_out(fn, channels):
    """Short channel reductions too: the k loop outside, a block of rows in the SIMD lanes
    (codegen/cpp/columns.py), whose loops gcc vectorizes on every x86-64 level
    (tests/test_cpp_columns_vector.py), not 16 rows with the k loops inside each lane."""
    cf = assert_matches(fn, special(2, channels, 5, 24), backend="cpp", kernels=1)
    assert "constexpr int64_t COLUMNS = 64;" in source(cf) and "gathered" not in source(cf)
    assert "LANES" not in source(cf)


def test_row_math_across_channels_is_its_own_kernel():
    """tanh of a channel minimum, with W read two elements apart: two kernels on the CPU, and
    explain says why. Contiguous, the rows lie side by side and their tanh runs in the SIMD lanes
    of the reduction's kernel (codegen/cpu_plan.py, Note: rows side by side): one kernel."""
    import fusec
    f = lambda x: torch.tanh(torch.amin(x, dim=1, keepdim=True))  # noqa: E731
    x = torch.randn(2, 16, 32, 64)[..., ::2]
    assert_matches(f, x, backend="cpp", kernels=2)
    assert "would run once per row in scalar code" in str(fusec.explain(f, x, backend="cpp"))
    assert_matches(f, torch.randn(2, 16, 4, 8)[..., ::2], backend="cpp", kernels=1)  # 32 rows
    for backend in ("cpp", "llvm"):
        assert_matches(f, torch.randn(2, 16, 32, 32), backend=backend, kernels=1)
    # Triton kernels compute blocks of rows: one kernel there (also under the interpreter)
    assert_matches(f, x.to(TRITON_DEVICE), backend="triton", kernels=1)


def test_channel_softmax_of_a_non_contiguous_input(target):
    backend, device = target
    x = special(2, 8, 16, 6, device=device).permute(0, 2, 3, 1)  # (2, 16, 6, 8), channels-last-ish
    assert_matches(lambda x: torch.softmax(x, dim=1), x, backend=backend)


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_attention_is_eagers_flash_kernel(causal):
    """F.scaled_dot_product_attention on the CPU runs eager's own kernel as an extern step, not
    math attention (two matmuls around a softmax: 1.5-3x slower on the CPU)."""
    import fusec

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal) * 2.0
    q, k, v = (torch.randn(2, 3, 17, 8) for _ in range(3))
    for backend in ("cpp", "llvm"):
        cf = assert_matches(f, q, k, v, backend=backend, kernels=1)
        text = cf.source()
        assert "aten._scaled_dot_product_flash_attention_for_cpu" in text and "bmm" not in text
    assert "_scaled_dot_product_flash_attention_for_cpu" in str(fusec.explain(f, q, k, v, backend="cpp"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_tanh_of_softplus_is_one_exp(target, dtype):
    """x * tanh(softplus(x)) written out (KernelBench-style 12_): passes/simplify.py makes it one
    exp and a division, within a few ulp of eager on NaN, infinities, overflow and underflow."""
    import fusec
    backend, device = target
    x = special(3, 5, 67, dtype=dtype, device=device)
    fn = lambda x: x * torch.tanh(F.softplus(x))  # noqa: E731
    cf = assert_matches(fn, x, backend=backend, kernels=1)
    ops = cf.kernels[0].ops
    assert "aten.exp.default" in ops and "aten.tanh.default" not in ops \
        and "aten.log1p.default" not in ops, ops
    d = fusec.explain(fn, x, backend=backend).to_dict()
    (change,) = [c for c in d["passes"] if c["after"] == "simplify"]
    assert any(": rewritten: tanh(softplus(x))" in line for line in change["details"]), change
    # other thresholds and betas, and half precision, keep torch's form
    assert_matches(lambda x: torch.tanh(F.softplus(x, beta=2)), x, backend=backend)
    half = assert_matches(fn, x.to(torch.bfloat16), backend=backend)
    assert any("aten.tanh.default" in k.ops for k in half.kernels)

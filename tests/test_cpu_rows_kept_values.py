"""Values computed once on the CPU backends: a reduction's costly element value kept between its
passes, and a pointwise kernel's per-row values computed before its inner loop.

A softmax of gelu(x) reduces gelu(x) twice (its max, then its sum of exp(gelu - max)). The loop
plan's `Stash` (fusec/loop_plan.py, chosen by codegen/lower_reduction.py's `stash_choice`) has
the max pass write gelu(x) into the output row and the sum pass read it back, so gelu runs once
per element (KernelBench-style 43_gemm_gelu_softmax); the sum pass then keeps exp for the last
pass (`Keep`), as before. An eval batch norm over NCHW reads its per-channel statistics with an
inner stride of 0: cpu_plan.row_values finds them and what is computed from them alone
(rsqrt(var + eps)), and both CPU backends compute those once per row (Note: values per row).
Checked here: eager's answers on both backends (odd sizes, NaN and infinities, empty rows,
float16 and bfloat16, several outputs, the inside-out and short-row forms), and the emitted code:
one gelu per element, rsqrt before the inner loop.
"""
import re

import pytest
import torch
import torch.nn.functional as F

import fusec
from conftest import assert_matches, values_with_specials
from fusec.codegen import cpp
from gcc_vector_report import LEVELS, NEEDS_CPP, X86, compile_report

BACKENDS = ["cpp", "llvm"]


def _values(*shape, dtype=torch.float32, special=True):
    return values_with_specials(*shape, dtype=dtype, special=special)


def _ir(cf):
    """The kernel IR of each reduction kernel the program compiled."""
    return [k.ir for k in cf.kernels if getattr(k, "ir", None) is not None
            and getattr(k.ir, "plan", None) is not None]


# ---- a costly value kept between the passes of a reduction -----------------------------------

STASH_CASES = {
    "softmax_gelu": lambda x: torch.softmax(F.gelu(x), dim=-1),
    "log_softmax_gelu": lambda x: torch.log_softmax(F.gelu(x), dim=-1),
    "softmax_tanh_gelu": lambda x: torch.softmax(F.gelu(torch.tanh(x) * 3, approximate="tanh"), -1),
    "layer_norm_gelu": lambda x: F.layer_norm(F.gelu(x), (x.shape[-1],)),
    "softmax_gelu_dim0": lambda x: torch.softmax(F.gelu(x), dim=0),  # strided along k
    "softmax_gelu_and_gelu": lambda x: (torch.softmax(F.gelu(x), -1), F.gelu(x)),
    "logsumexp_exp": lambda x: torch.exp(x) - torch.logsumexp(torch.exp(x), -1, keepdim=True),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(STASH_CASES))
def test_stash_matches_eager(name, backend):
    assert_matches(STASH_CASES[name], _values(37, 129), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(1, 300), (33, 5), (0, 16), (16, 0)], ids=str)
def test_stash_sizes(shape, backend):
    """One row, rows shorter than a vector, no rows, empty rows."""
    x = _values(*shape, special=0 not in shape)
    assert_matches(STASH_CASES["softmax_gelu"], x, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stash_half_precision(dtype, backend):
    """A half-precision output cannot hold a float value exactly: no stash, the same answers."""
    cf = assert_matches(STASH_CASES["softmax_gelu"], _values(19, 260, dtype=dtype), backend=backend)
    assert all(not k.plan.stashes for k in _ir(cf))


@pytest.mark.parametrize("backend", BACKENDS)
def test_stash_channels(backend):
    """A softmax over NCHW channels: rows side by side, the loops turned inside out."""
    assert_matches(lambda x: torch.softmax(F.gelu(x), dim=1), _values(2, 16, 9, 11), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_stash_short_rows(backend):
    """Rows of 4 values (the short-row lanes form) with a stash."""
    assert_matches(lambda x: torch.softmax(F.gelu(x), -1), _values(3, 5, 37, 4), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_stash_strided_rows(backend):
    """Rows read 20 elements apart along k (a row copy in C++), neighbouring rows 4 apart."""
    x = _values(4, 200, 20)[:, :, ::4]
    assert_matches(lambda x: torch.softmax(F.gelu(x), 1), x, backend=backend)


def test_stash_plan():
    """The plan of softmax(gelu(x)): phase 0 stashes gelu for phase 1, which reads it back and
    computes no gelu; the last phase keeps exp for the last pass."""
    cf = fusec.compile(STASH_CASES["softmax_gelu"], backend="cpp")
    cf(_values(37, 129))
    (kernel,) = _ir(cf)
    made = {item.var.name: item for item in kernel.body}
    (stash,) = kernel.plan.stashes
    assert stash.phase == 0 and made[stash.value].op.startswith("gelu")
    assert [n for n in stash.loop if getattr(made.get(n), "op", "").startswith("gelu")] == [stash.value]
    assert made[kernel.plan.keep.value].op.startswith("exp")
    assert "stash: phase 0 also writes" in str(kernel)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gelu_once_per_element(backend):
    """43_gemm_gelu_softmax's fused kernel computes gelu once: in the max pass."""
    lin = torch.nn.Linear(32, 96)
    x = torch.randn(16, 32)
    cf = assert_matches(lambda x: torch.softmax(F.gelu(lin(x)), dim=1), x, backend=backend)
    (source,) = [k.source for k in cf.kernels if "softmax" in k.name or "amax" in k.name]
    if backend == "cpp":
        # (fusec_gelu or fusec_gelu_onednn: the edges of the gelu eager runs on this CPU)
        assert len(re.findall(r"fusec_gelu(?:_onednn)?\(", source)) == 1, source
        assert source.count("fusec_exp(") == 1, source
    else:
        body = source[source.index("define void"):]
        assert len(re.findall(r"call \S+ @fusec_gelu", body)) == 1, body
    assert "stashed" in source


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_stashed_value_kept_is_not_stored_again(backend):
    """A group norm of gelu (35_convT2d_gelu_groupnorm): the mean pass stashes gelu(x) in the
    output row; the variance pass, the last before the last pass, reads it back and keeps the same
    value in the same place for the last pass, where it already is: no second store of it."""
    gn = torch.nn.GroupNorm(4, 8)
    cf = assert_matches(lambda x: gn(F.gelu(x)), torch.randn(2, 8, 5, 7), backend=backend)
    (kernel,) = _ir(cf)
    plan = kernel.plan
    assert plan.keep is not None and not plan.keep_stored_again(), str(kernel)
    (source,) = [k.source for k in cf.kernels]
    assert "stashed for phase 1" in source and "kept for the last pass" not in source, source


# ---- values per row in pointwise kernels --------------------------------------------------------

def batch_norm_tanh(x, mean, var, w, b):
    return torch.tanh(F.batch_norm(x, mean, var, w, b, training=False, eps=1e-5))


def _stats(c, dtype=torch.float32):
    torch.manual_seed(1)
    return (torch.randn(c).to(dtype), (torch.rand(c) + 0.1).to(dtype), torch.randn(c).to(dtype),
            torch.randn(c).to(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(3, 7, 9, 13), (1, 5, 1, 1), (2, 3, 0, 4)],
                         ids=lambda s: "x".join(map(str, s)))
def test_batch_norm_matches_eager(shape, backend):
    x = _values(*shape, special=0 not in shape)
    assert_matches(batch_norm_tanh, x, *_stats(shape[1]), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_batch_norm_half_precision(dtype, backend):
    x = _values(2, 6, 9, 17, dtype=dtype)
    assert_matches(batch_norm_tanh, x, *_stats(6, dtype), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_norm_nan_statistics(backend):
    """A NaN variance or an infinite mean poisons its channel only. (An infinite weight does
    not compare: eager computes x * (w * rstd) + (b - mean * w * rstd), which is NaN wherever
    x * inf meets -inf, where the graph's (x - mean) * rstd * w is not.)"""
    mean, var, w, b = _stats(5)
    var[1], mean[4] = float("nan"), -float("inf")
    assert_matches(batch_norm_tanh, _values(2, 5, 7, 9), mean, var, w, b, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_row_chains(backend):
    """Per-row values computed from several per-row inputs, a per-row constant chain, and a
    broadcast along the inner dim of a 2-D kernel."""
    def f(x, s, t):
        return x * torch.exp(s * 0.5 + t) - torch.sqrt(t.abs() + 1)
    x = _values(11, 37)
    s, t = torch.randn(11, 1), torch.randn(11, 1)
    assert_matches(f, x, s, t, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rsqrt_before_inner_loop(backend):
    """The batch norm's rsqrt(var + eps) runs once per channel, before the inner loop."""
    cf = assert_matches(batch_norm_tanh, _values(3, 7, 9, 13), *_stats(7), backend=backend)
    (source,) = [k.source for k in cf.kernels if "rsqrt" in k.name]
    assert "values per row" in source
    if backend == "cpp":
        assert source.index("fusec_rsqrt(") < source.index("#pragma omp simd"), source
    else:
        body = source[source.index("define void"):]
        assert body.index("@llvm.sqrt") < body.index("\ninner:"), body


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_row_dynamic(backend):
    """A program compiled for every batch size hoists the same values."""
    cf = fusec.compile(batch_norm_tanh, backend=backend, dynamic=True)
    stats = _stats(8)
    for n in (3, 1, 4):
        xs = _values(n, 8, 5, 7)
        torch.testing.assert_close(cf(xs, *stats), batch_norm_tanh(xs, *stats), equal_nan=True)
    assert any("values per row" in k.source for k in cf.kernels)


@X86
@NEEDS_CPP
@pytest.mark.parametrize("target", LEVELS)
def test_cpp_stash_loops_vectorized_for(target, tmp_path):
    """gcc's own report: every simd loop of softmax(gelu(x)) is vectorized, the max pass with its
    stash store and the sum pass with its read back, on x86-64, x86-64-v3 and x86-64-v4."""
    kernels = fusec.explain(STASH_CASES["softmax_gelu"], _values(37, 129, special=False),
                            backend="cpp").compiled.kernels
    (source,) = [cpp.render(k.ir) for k in kernels if "stashed" in k.source]
    report = compile_report(source, target, tmp_path)
    lines = report.lines
    loops = []  # (first, last) line of each simd loop, reductions' included
    for n, text in enumerate(lines):
        if text.strip().startswith("#pragma omp simd"):
            indent = lines[n + 1][:len(lines[n + 1]) - len(lines[n + 1].lstrip())]
            loops.append((n + 1, next(m for m in range(n + 1, len(lines)) if lines[m] == indent + "}")))
    scalar = [f"lines {a + 1}-{b + 1}:\n    " + "\n    ".join(report.said(a, b))
              for a, b in loops if not report.vectorized(a, b)]
    assert len(loops) == 3 and not scalar, f"{len(loops)} loops\n" + "\n".join(scalar) + "\n" + source

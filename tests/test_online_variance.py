"""Online variance in the looped Triton reduction template (codegen/triton/reduction.py, the note
on online variance; fusec.ir.OnlineVariance).

A variance is sum((v - c)^2) with c the mean: a reduction whose operand needs another reduction,
so a looped kernel read the row twice before its last pass. Lowering now records such sums
(`ReductionKernel.variances`, codegen/lower_reduction.py) and the loop plan folds them into the
pass before (`Phase.folds`): each lane keeps Welford's running count, mean and squared deviations,
moved to c once c is known. Layer norm, group norm, instance norm, batch norm's statistics and
`var` read their row once (plus the pass that stores). Every case runs through the looped
template (forced, chunks of 16) and is compared with eager, float64-referenced, with NaN and
infinities, large offsets (where a one-pass sum of squares would cancel), odd sizes and half
precision inputs.
"""
import pytest
import torch
import torch.nn.functional as F

import fusec
import fusec.codegen.triton.reduction as triton_backend
from conftest import TRITON_DEVICE, assert_matches

LOOP = "for k_start in range(0, n_k, RBLOCK)"


@pytest.fixture
def looped(monkeypatch):
    monkeypatch.setattr(triton_backend, "PERSISTENT_MAX_K", 0)
    monkeypatch.setattr(triton_backend, "LOOP_RBLOCK", 16)


def _randn(shape, dtype=torch.float32, seed=0, scale=1.0, offset=0.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale + offset).to(dtype).to(TRITON_DEVICE)


FNS = {
    "layer_norm": lambda x: F.layer_norm(x, x.shape[-1:]),
    "var": lambda x: x.var(-1),
    "var_mean": lambda x: torch.var_mean(x, -1, correction=0),
    "std_keepdim": lambda x: x.std(-1, keepdim=True),
    "group_norm": lambda x: F.group_norm(x.view(x.shape[0], 4, -1), 2),
    "instance_norm": lambda x: F.instance_norm(x.view(x.shape[0], 2, -1)),
    "batch_norm_train": lambda x: F.batch_norm(x.view(x.shape[0], 4, -1), None, None, training=True),
}


@pytest.mark.parametrize("name", list(FNS))
def test_one_pass_for_mean_and_variance(looped, name):
    x = _randn((6, 100), scale=3.0, offset=2.0)
    cf = assert_matches(FNS[name], x, backend="triton")
    kernels = [k for k in cf.kernels if k.ir is not None and getattr(k.ir, "variances", None)]
    assert kernels, [k.name for k in cf.kernels]
    for k in kernels:
        assert "online variance" in k.source
        stores_elements = bool(k.ir.plan.element_stores)
        # the statistics in one pass, then (only if elements are stored) the pass that stores
        assert k.source.count(LOOP) == 1 + stores_elements, k.source


@pytest.mark.parametrize("offset", [0.0, 1e4])
@pytest.mark.parametrize("n", [1, 17, 100, 257])
def test_matches_eager_with_odd_lengths_and_large_offsets(looped, n, offset):
    """Rows of 1 (a single element: variance 0 or NaN with Bessel's correction, as eager), of
    lengths that leave a ragged last chunk, and values far from 0: the deviations are taken from
    per-lane means, so nothing cancels."""
    x = _randn((5, n), scale=2.0, offset=offset)
    for name in ("var", "var_mean", "std_keepdim") + (("layer_norm",) if offset == 0 else ()):
        # (a layer norm of values near 10000 differs from eager's by the order its mean is
        # summed in, the same with the fold or without: its output is x - mean)
        assert_matches(FNS[name], x, backend="triton")


def test_nan_and_infinities(looped):
    x = _randn((4, 60))
    x[0, 5] = float("nan")
    x[1, 59] = float("inf")
    x[2, 0] = -float("inf")
    for name in ("layer_norm", "var", "group_norm"):
        assert_matches(FNS[name], x, backend="triton")
    # finite, but its square overflows in float32: the variance is inf, as eager's. (A layer norm
    # of that row is 0 here and in eager on a CPU, NaN in eager on a GPU: eager disagrees with
    # itself; benchmarks/diagnostics/variance_kernels.py shows it row by row.)
    x[3, 30] = 1e30
    assert_matches(FNS["var"], x, backend="triton")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_dtypes(looped, dtype):
    """Half precision norms compute in float32 (upcast at capture): online. A variance written
    out in half precision rounds every element as eager does: not online, two passes."""
    x = _randn((4, 90), dtype, scale=2.0, offset=1.0)
    cf = assert_matches(FNS["layer_norm"], x, backend="triton", kernels=1)
    assert "online variance" in cf.kernels[0].source

    def written_out(x):
        d = x - x.mean(-1, keepdim=True)
        return (d * d).sum(-1)

    cf = assert_matches(written_out, x, backend="triton", kernels=1)
    assert ("online variance" in cf.kernels[0].source) == (dtype == torch.float64)


def test_any_shift_is_exact(looped):
    """c need not be the mean: sum((x - c)^2) for c = the row's max is a sum of non-negative
    terms per lane, moved from the lane's mean to c."""
    x = _randn((5, 70), scale=2.0)

    def fn(x):
        d = x - x.amax(-1, keepdim=True)
        return (d * d).sum(-1)

    cf = assert_matches(fn, x, backend="triton", kernels=1)
    assert "online variance" in cf.kernels[0].source and cf.kernels[0].source.count(LOOP) == 1


def test_not_a_square_is_not_folded(looped):
    x = _randn((5, 70))
    for fn in (lambda x: ((x - x.mean(-1, keepdim=True)) * x).sum(-1),          # not d * d
               lambda x: (x - x.mean(-1, keepdim=True)).abs().sum(-1),          # not a square
               lambda x: ((x - x.mean(-1, keepdim=True)) ** 3).sum(-1)):
        cf = assert_matches(fn, x, backend="triton", kernels=1)
        assert cf.kernels[0].ir.variances == []
        assert "online variance" not in cf.kernels[0].source


def test_the_fold_can_be_turned_off(looped, monkeypatch):
    """With the folds hidden from the backend the same kernel reads the row once more."""
    x = _randn((3, 50))
    cf = assert_matches(FNS["var"], x, backend="triton", kernels=1)
    assert cf.kernels[0].source.count(LOOP) == 1
    monkeypatch.setattr(triton_backend, "ONLINE_SOFTMAX", False)
    cf = assert_matches(FNS["var"], x, backend="triton", kernels=1)
    assert cf.kernels[0].source.count(LOOP) == 2


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_cpu_backends_keep_their_two_passes_and_match(backend):
    """The CPU backends walk one row at a time (it stays in cache): they do not fold."""
    x = _randn((6, 100), scale=3.0, offset=2.0).cpu()
    for name in ("layer_norm", "group_norm"):
        assert_matches(FNS[name], x, backend=backend)


def test_a_column_reduction_folds_too():
    """An instance norm of a channels-last activation: the rows (channels) lie side by side, so
    the kernel walks [64 rows, 64 k] tiles (the note on column reductions), and its variance
    folds into the mean's pass there as well. NaN in one channel stays in that channel."""
    x = _randn((2, 64, 12, 12), scale=2.0, offset=3.0).to(memory_format=torch.channels_last)
    x[1, 5, 3, 4] = float("nan")
    cf = assert_matches(lambda x: F.instance_norm(x), x, backend="triton")
    (stats,) = [k for k in cf.kernels if k.ir is not None and getattr(k.ir, "variances", None)]
    assert "looping over the row in chunks of 64" in stats.source
    assert "online variance" in stats.source and stats.source.count(LOOP) <= 2

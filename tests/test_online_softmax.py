"""Online softmax in the looped Triton reduction template.

A looped kernel (rows longer than codegen.triton.PERSISTENT_MAX_K) makes one pass over the row
per reduction phase. Softmax's max and its sum of exp(x - max) are two phases, but each lane can
keep a running max and a running sum rescaled whenever the max grows, so lowering records such
pairs (`ReductionKernel.online`, codegen/lower_reduction.py) and, in the kernel's loop plan, which
phases can fold into the pass before them (`Phase.folds`, `LoopPlan.passes`); the Triton backend
folds them (`codegen.triton.reduction.ONLINE_SOFTMAX`): softmax reads its row twice instead of
three times, logsumexp once instead of twice. Layer norm's variance (a sum whose operand needs the mean)
folds by another rule (online variance, tests/test_online_variance.py).

Under Triton's interpreter long rows are slow, so the `looped` fixture lowers the threshold: every
row is looped, over chunks of RBLOCK = 16, so short rows still take several iterations. The same
cases also run through the persistent template (the default for short rows). Every result is
compared with eager (float64-referenced, NaN in the same places) by `assert_matches`.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fusec
import fusec.codegen.triton.reduction as triton_backend
from conftest import TRITON_DEVICE, assert_matches

LOOP = "for k_start in range(0, n_k, RBLOCK)"


@pytest.fixture(params=["looped", "persistent"])
def path(request, monkeypatch):
    """Run a test through the looped template (forced, in chunks of 16) or the persistent one."""
    if request.param == "looped":
        monkeypatch.setattr(triton_backend, "PERSISTENT_MAX_K", 0)
        monkeypatch.setattr(triton_backend, "LOOP_RBLOCK", 16)
    return request.param


@pytest.fixture
def looped(monkeypatch):
    monkeypatch.setattr(triton_backend, "PERSISTENT_MAX_K", 0)
    monkeypatch.setattr(triton_backend, "LOOP_RBLOCK", 16)


def _randn(shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype).to(TRITON_DEVICE)


FNS = {
    "softmax": lambda x: torch.softmax(x, -1),
    "log_softmax": lambda x: torch.log_softmax(x, -1),
    "logsumexp": lambda x: torch.logsumexp(x, -1),
    "layer_norm": lambda x: F.layer_norm(x, x.shape[-1:]),
}
# passes over each row in the looped template: (with online softmax, as two-pass reductions)
PASSES = {"softmax": 2, "log_softmax": 2, "logsumexp": 1, "layer_norm": 2}  # layer norm: online variance


def _passes(cf) -> int:
    return cf.kernels[0].source.count(LOOP)


def looped_passes(ir) -> list[tuple[int, list]]:
    """The passes a looped kernel makes before its store pass, as (first phase, the online sums
    folded into that pass), read from the kernel's loop plan."""
    return [(phases[0].number, list(phases[0].folds) if len(phases) > 1 else [])
            for phases in ir.plan.passes(online=triton_backend.ONLINE_SOFTMAX)]


# ---- the decision ------------------------------------------------------------------------------

def _ir(fn, x):
    cf = fusec.compile(fn, backend="triton")
    cf(x)
    assert len(cf.kernels) == 1
    return cf.kernels[0].ir


@pytest.mark.parametrize("name", ["softmax", "log_softmax", "logsumexp"])
def test_lowering_finds_the_pair(name):
    ir = _ir(FNS[name], _randn((2, 20)))
    [pair] = ir.online
    made = {item.var.name: item for item in ir.body}
    assert made[pair.total].op == "sum" and made[pair.peak].op == "amax"
    assert made[pair.peak].phase + 1 == made[pair.total].phase
    # softmax subtracts the max itself; logsumexp subtracts where(|max| == inf, 0, max)
    assert (pair.shift == pair.peak) == (name != "logsumexp")
    assert looped_passes(ir) == [(0, [pair])]


@pytest.mark.parametrize("fn", [
    lambda x: F.layer_norm(x, (20,)),  # the variance's operand needs the mean: no max
    lambda x: x.var(-1),               # (its sum folds as an online variance instead)
    lambda x: torch.exp(x).sum(-1),  # no shift
    lambda x: torch.exp(x - x.mean(-1, keepdim=True)).sum(-1),  # shifted by a mean, not a max
    lambda x: torch.exp(x - x.amin(-1, keepdim=True)).sum(-1),
    lambda x: torch.exp(2 * (x - x.amax(-1, keepdim=True))).sum(-1),  # not exp(x - max)
    lambda x: torch.exp(x - x.amax(-1, keepdim=True) - 1).sum(-1),
    lambda x: torch.exp(x.sin() - x.amax(-1, keepdim=True)).sum(-1),  # max of another value
], ids=["layer_norm", "var", "exp_sum", "mean_shift", "amin_shift", "scaled", "offset", "other"])
def test_other_reductions_are_not_online(fn):
    ir = _ir(fn, _randn((2, 20)))
    assert ir.online == []
    assert all(type(o).__name__ != "OnlineSoftmax" for _, online in looped_passes(ir) for o in online)


def test_half_precision_steps_are_not_online():
    """Written out on float16, x - max and exp round to float16 at every element as eager's
    do; a one-pass sum cannot reproduce those roundings, so the kernel keeps two passes."""
    fn = lambda x: torch.exp(x - x.amax(-1, keepdim=True)).sum(-1)  # noqa: E731
    assert _ir(fn, _randn((2, 20), torch.float16)).online == []
    # torch's softmax on float16 computes in float32: online
    assert len(_ir(FNS["softmax"], _randn((2, 20), torch.float16)).online) == 1


# ---- end to end, both templates ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(FNS))
def test_matches_eager(path, name, dtype):
    x = _randn((5, 100), dtype) * 3
    cf = assert_matches(FNS[name], x, backend="triton", kernels=1)
    # float16/bfloat16 logsumexp rounds x - max and exp to half at every element, as eager
    # does: not online (see test_half_precision_steps_are_not_online), two passes
    online = path == "looped" and name != "layer_norm" and not (name == "logsumexp"
                                                                and dtype != torch.float32)
    assert ("online softmax" in cf.kernels[0].source) == online
    if path == "persistent":
        assert _passes(cf) == 0
    else:
        assert _passes(cf) == (PASSES[name] if online or name == "layer_norm" else 2)


def test_online_makes_fewer_passes(monkeypatch, looped):
    """The same softmax kernel with the pairs hidden from the backend: one pass more."""
    x = _randn((3, 50))
    cf = assert_matches(FNS["softmax"], x, backend="triton", kernels=1)
    assert _passes(cf) == 2
    monkeypatch.setattr(triton_backend, "ONLINE_SOFTMAX", False)
    cf = assert_matches(FNS["softmax"], x, backend="triton", kernels=1)
    assert _passes(cf) == 3


@pytest.mark.parametrize("k", [1, 2, 15, 16, 17, 37, 100, 129])
@pytest.mark.parametrize("name", ["softmax", "log_softmax", "logsumexp"])
def test_row_lengths(path, name, k):
    """Rows of length 1, shorter than a chunk, exactly one chunk, and not a power of two."""
    x = _randn((3, k), seed=k) * 4
    assert_matches(FNS[name], x, backend="triton", kernels=1)


def _special_rows(k: int) -> torch.Tensor:
    """One row per case the rescaling must get right, as eager does."""
    inf, nan = math.inf, math.nan
    x = _randn((10, k), seed=1) * 5
    x[1, :k // 2] = -inf  # -inf in the first chunks: the running max starts at -inf
    x[2, 3::5] = -inf  # -inf scattered
    x[3] = -inf  # all -inf: softmax NaN, logsumexp -inf
    x[4, k - 2] = inf  # +inf late in the row: softmax NaN, logsumexp inf
    x[5, 0] = nan  # NaN first: propagates
    x[6, k - 1] = nan  # NaN last
    x[7] = torch.arange(k, dtype=torch.float32) * 3.0  # the max grows at every step
    x[8] = -1000.0 - torch.arange(k, dtype=torch.float32)  # exp(x) underflows, exp(x - max) not
    x[9, k // 3] = 80.0  # a large max: exp(max) would overflow
    return x


@pytest.mark.parametrize("name", ["softmax", "log_softmax", "logsumexp"])
def test_infinities_and_nan(path, name):
    x = _special_rows(45)
    cf = assert_matches(FNS[name], x, backend="triton", kernels=1)
    assert ("online softmax" in cf.kernels[0].source) == (path == "looped")


def test_infinities_and_nan_half(path):
    x = _special_rows(45).to(torch.float16)
    assert_matches(lambda x: (torch.softmax(x, -1), torch.log_softmax(x, -1)), x,
                   backend="triton", kernels=1)


def test_float64(path):
    x = _special_rows(40).double()
    assert_matches(lambda x: (torch.softmax(x, -1), torch.logsumexp(x, -1)), x,
                   backend="triton", kernels=1)


def test_max_and_sum_of_exp_written_out(looped):
    """The pattern is matched on the kernel IR, not on torch.softmax: written by hand too, and
    with the max and the sum both returned (the sum is exactly eager's, not rescaled wrongly)."""
    def fn(x):
        m = x.amax(-1, keepdim=True)
        s = torch.exp(x - m).sum(-1, keepdim=True)
        return m, s, torch.exp(x - m) / s
    x = _special_rows(33)
    cf = assert_matches(fn, x, backend="triton", kernels=1)
    assert _passes(cf) == 2


# ---- kernels that hold more than one reduction -------------------------------------------------

def test_shares_the_pass_with_other_reductions(looped):
    """amax, sum and argmax of x in phase 0 and softmax's sum in phase 1: one online pass."""
    x = _special_rows(40)
    cf = assert_matches(lambda x: (torch.softmax(x, -1), x.sum(-1), x.argmax(-1)), x,
                        backend="triton", kernels=1)
    assert _passes(cf) == 2


def test_two_sums_share_one_max(looped):
    """softmax and logsumexp of one x: one max (cse), two online sums over the same pass."""
    x = _special_rows(40)
    cf = assert_matches(lambda x: (torch.softmax(x, -1), torch.logsumexp(x, -1, keepdim=True)), x,
                        backend="triton", kernels=1)
    assert len(cf.kernels[0].ir.online) == 2
    assert _passes(cf) == 2


def test_softmax_and_a_variance_fold_into_one_pass(looped):
    """Phase 1 holds softmax's sum and a variance's sum of squares: both fold into phase 0's
    pass (online softmax and online variance, tests/test_online_variance.py), then the pass that
    stores the softmax."""
    x = _randn((4, 50)) + 1
    cf = assert_matches(lambda x: (torch.softmax(x, -1), x.var(-1)), x, backend="triton",
                        kernels=1)
    assert len(cf.kernels[0].ir.online) == 1 and len(cf.kernels[0].ir.variances) == 1
    [(phase, folds)] = looped_passes(cf.kernels[0].ir)
    assert phase == 0 and sorted(type(o).__name__ for o in folds) == ["OnlineSoftmax",
                                                                        "OnlineVariance"]
    assert _passes(cf) == 2


def test_softmax_after_a_reduction(looped):
    """Softmax of x - mean: the max is in phase 1 and its sum in phase 2, folded together."""
    x = _randn((4, 50))
    fn = lambda x: torch.softmax(x - x.mean(-1, keepdim=True), -1)  # noqa: E731
    cf = assert_matches(fn, x, backend="triton", kernels=1)
    assert [(p, len(o)) for p, o in looped_passes(cf.kernels[0].ir)] == [(0, 0), (1, 1)]
    assert _passes(cf) == 3


@pytest.mark.parametrize("dim", [0, 1, (0, 2)], ids=str)
def test_other_dims(path, dim):
    """Rows that are not contiguous along k: the loads are strided, the online sum is the same."""
    x = _randn((6, 20, 7))
    fn = (lambda x: torch.logsumexp(x, dim)) if isinstance(dim, tuple) else \
        (lambda x: (torch.softmax(x, dim), torch.log_softmax(x, dim)))
    assert_matches(fn, x, backend="triton", kernels=1)


def test_long_rows_use_it_by_default():
    """Without the fixture: a row longer than PERSISTENT_MAX_K takes the looped template and the
    online pass (chunks of LOOP_RBLOCK)."""
    k = triton_backend.PERSISTENT_MAX_K + 100
    x = _randn((2, k)) + 1.0
    x[0, k - 50] = 40.0  # the max sits in the last chunk
    cf = assert_matches(FNS["softmax"], x, backend="triton", kernels=1)
    assert _passes(cf) == 2
    assert "2 pass(es) over each row (online softmax" in cf.kernels[0].source


# ---- random rows -------------------------------------------------------------------------------

SPECIAL = [math.inf, -math.inf, math.nan, 60.0, -60.0]


# Under Triton's interpreter a case costs its programs times their loop iterations (a 33x35x22
# tensor reduced whole in chunks of 4 is 6,000 iterations, the cost of dozens of other cases). So a
# tensor holds at most NUMEL elements, and the chunk length is drawn from those that cover the
# reduced length in at most MAX_CHUNKS chunks (a row of 40 still takes 20 chunks of 2).
NUMEL = 2048
MAX_CHUNKS = 64


@st.composite
def rows(draw):
    """A tensor of rank 1-3 (dims 1-40, at most NUMEL elements) with a few special values, a dim
    (or dims) to reduce, an op, and the looped template's chunk length (at most MAX_CHUNKS
    chunks a row)."""
    rank = draw(st.integers(1, 3))
    shape = ()
    for _ in range(rank):  # each dim 1-40, fewer where the ones before leave less room
        shape += (draw(st.integers(1, min(40, NUMEL // math.prod(shape)))),)
    x = _randn(shape, seed=draw(st.integers(0, 1000))) * draw(st.sampled_from([1.0, 10.0]))
    flat = x.view(-1)
    for _ in range(draw(st.integers(0, 4))):
        flat[draw(st.integers(0, flat.numel() - 1))] = draw(st.sampled_from(SPECIAL))
    if draw(st.booleans()):  # a whole row of -inf (or +inf)
        flat[:shape[-1]] = draw(st.sampled_from([-math.inf, math.inf]))
    name = draw(st.sampled_from(["softmax", "log_softmax", "logsumexp"]))
    if name == "logsumexp":
        dims = tuple(sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1))))
    else:
        dims = draw(st.integers(-rank, rank - 1))
    dtype = draw(st.sampled_from([torch.float32] * 3 + [torch.float16, torch.bfloat16]))
    reduced = math.prod(shape[d] for d in (dims if isinstance(dims, tuple) else (dims,)))
    rblock = draw(st.sampled_from([b for b in (2, 4, 16, 64) if reduced <= MAX_CHUNKS * b]))
    return x.to(dtype), name, dims, rblock


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows())
def test_random_rows(case):
    x, name, dims, rblock = case
    fn = {"softmax": lambda x: torch.softmax(x, dims),
          "log_softmax": lambda x: torch.log_softmax(x, dims),
          "logsumexp": lambda x: torch.logsumexp(x, dims)}[name]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_backend, "PERSISTENT_MAX_K", 0)
        patch.setattr(triton_backend, "LOOP_RBLOCK", rblock)
        assert_matches(fn, x, backend="triton", kernels=1)

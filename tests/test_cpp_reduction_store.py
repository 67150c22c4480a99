"""C++ reductions: an element value that the last reduction phase computes is kept in the output
row and read back by the last pass instead of being computed again (see the note above
`keep_choice` in codegen/lower_reduction.py): softmax computes exp(x - max) once, not twice.

Every case is compared with eager (float64-referenced, NaN in the same places).
"""
import math

import pytest
import torch
import torch.nn.functional as F

import fusec.codegen.lower_reduction as lowering
from conftest import assert_matches

KEPT = "// kept for the last pass"


def _randn(shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype)


def _special_rows(k: int) -> torch.Tensor:
    x = _randn((8, k), seed=1) * 5
    x[1, :k // 2] = -math.inf
    x[2] = -math.inf  # all -inf: NaN, as eager
    x[3, k - 2] = math.inf
    x[4, 0] = math.nan
    x[5] = torch.arange(k, dtype=torch.float32)
    x[6] = -1000.0
    return x


def _last_pass(source: str) -> str:
    return source[source.index("// last pass"):]


def test_softmax_computes_exp_once():
    x = _special_rows(300)
    cf = assert_matches(lambda x: torch.softmax(x, -1), x, backend="cpp", kernels=1)
    source = cf.kernels[0].source
    assert source.count(KEPT) == 1
    assert source.count("fusec_exp(") == 1
    last = _last_pass(source)
    assert "x_ptr" not in last and "div_ptr[out0_base + q0] = v" in last


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("k", [1, 7, 256, 257, 1000])
def test_softmax_rows(dtype, k):
    """Rows of length 1 (no loop over k at all), short, one sum block (256) and past it (the
    blocked float sum)."""
    x = _special_rows(k).to(dtype) if k >= 3 else _randn((4, k), dtype)
    cf = assert_matches(lambda x: torch.softmax(x, -1), x, backend="cpp", kernels=1)
    assert (KEPT in cf.kernels[0].source) == (k > 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_output_is_not_used_to_keep_float32_values(dtype):
    """A float16 output cannot hold the float32 exp exactly: it is computed again."""
    x = _special_rows(100).to(dtype)
    cf = assert_matches(lambda x: torch.softmax(x, -1), x, backend="cpp", kernels=1)
    assert KEPT not in cf.kernels[0].source


@pytest.mark.parametrize("dim", [0, 1, 2], ids=str)
def test_strided_output(dim):
    """The output row is not contiguous along k: kept at the same strided places."""
    x = _randn((5, 30, 7)) * 3
    cf = assert_matches(lambda x: torch.softmax(x, dim), x, backend="cpp", kernels=1)
    assert KEPT in cf.kernels[0].source


def test_other_costly_values():
    """Not only exp: a sigmoid normalized by its row sum keeps the sigmoid."""
    x = _randn((16, 100))
    cf = assert_matches(lambda x: torch.sigmoid(x) / torch.sigmoid(x).sum(-1, keepdim=True), x,
                        backend="cpp", kernels=1)
    assert KEPT in cf.kernels[0].source
    assert _last_pass(cf.kernels[0].source).count("fusec_sigmoid") == 0


@pytest.mark.parametrize("fn", [
    lambda x: torch.log_softmax(x, -1),  # the last pass needs x - max only: nothing costly
    lambda x: F.layer_norm(x, (100,)),
    lambda x: x - x.mean(-1, keepdim=True),  # no value in the last phase's loop is stored
], ids=["log_softmax", "layer_norm", "center"])
def test_nothing_worth_keeping(fn):
    x = _randn((16, 100))
    cf = assert_matches(fn, x, backend="cpp", kernels=1)
    assert KEPT not in cf.kernels[0].source


def test_several_outputs():
    """The exp values are an output themselves, next to softmax, the max and the sum."""
    def fn(x):
        m = x.amax(-1, keepdim=True)
        e = torch.exp(x - m)
        s = e.sum(-1, keepdim=True)
        return e, e / s, m, s
    x = _special_rows(50)
    cf = assert_matches(fn, x, backend="cpp", kernels=1)
    assert cf.kernels[0].source.count(KEPT) == 1


def test_an_output_stored_by_the_last_phase_needs_no_last_pass():
    """exp(x - max) is itself the only element output: stored where it is computed, once."""
    def fn(x):
        m = x.amax(-1, keepdim=True)
        e = torch.exp(x - m)
        return e, e.sum(-1)
    x = _special_rows(50)
    cf = assert_matches(fn, x, backend="cpp", kernels=1)
    source = cf.kernels[0].source
    assert "// the output, stored once: no last pass" in source and "// last pass" not in source


def test_softmax_with_other_reductions():
    x = _special_rows(60)
    assert_matches(lambda x: (torch.softmax(x, -1), x.argmax(-1), x.var(-1), x.amin(-1)), x,
                   backend="cpp", kernels=1)


def test_long_rows_are_recomputed(monkeypatch):
    """A row longer than STASH_MAX_ROW_BYTES would not stay in cache: computed again."""
    monkeypatch.setattr(lowering, "STASH_MAX_ROW_BYTES", 4 * 64)
    x = _randn((3, 65))
    cf = assert_matches(lambda x: torch.softmax(x, -1), x, backend="cpp", kernels=1)
    assert KEPT not in cf.kernels[0].source
    x = _randn((3, 64))
    cf = assert_matches(lambda x: torch.softmax(x, -1), x, backend="cpp", kernels=1)
    assert KEPT in cf.kernels[0].source


@pytest.mark.parametrize("op", ["amax", "amin"])
def test_max_min_with_nan(op):
    """amax/amin keep an int NaN flag (a bool one vectorizes ~9x slower): NaN still wins."""
    x = _special_rows(500)
    x[7, 300] = math.nan
    assert_matches(lambda x: getattr(x, op)(-1), x, backend="cpp", kernels=1)

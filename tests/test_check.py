"""`check=True` (fusec/check.py) on every kind of output and on programs that draw random numbers.

Each test is a repro from a first-hour session: check=True crashed on a non-tensor output
(`'float' object has no attribute 'shape'`) and failed every train-mode dropout with a mismatch
that did not say the cause was random numbers.
"""
import math
import warnings

import pytest
import torch
from torch import nn

import fusec
from fusec import check


@pytest.mark.parametrize("backend", ["cpp", "llvm", "triton"])
def test_outputs_that_are_not_tensors(backend):
    x = torch.randn(4)
    out = fusec.compile(lambda x: (x.sin() * 2, 0.5), check=True, backend=backend)(x)
    torch.testing.assert_close(out[0], x.sin() * 2)
    assert out[1] == 0.5

    def pytree(x):
        return {"a": x.cos(), "n": 3, "none": None, "shape": x.shape, "name": "cos",
                "nan": math.nan, "nested": [x + 1, (2, 3.5)]}
    got = fusec.compile(pytree, check=True, backend=backend)(x)
    want = pytree(x)
    assert got.keys() == want.keys() and got["shape"] == want["shape"]
    assert got["n"] == 3 and got["none"] is None and math.isnan(got["nan"])
    torch.testing.assert_close(got["nested"][0], want["nested"][0])


def test_plain_values_are_compared_by_value():
    assert check.compare_leaf(3, 3, None) is None
    assert check.compare_leaf(math.nan, math.nan, None) is None
    assert check.compare_leaf(None, None, None) is None
    assert check.compare_leaf(torch.Size([2]), torch.Size([2]), None) is None
    assert check.compare_leaf(3, 3.0, None) == "3 where eager returns 3.0"  # int is not float
    assert "where eager returns a Tensor" in check.compare_leaf(1.0, torch.ones(1), None)


@pytest.mark.parametrize("backend", ["cpp", "llvm", "triton"])
def test_dropout_is_compared_under_eagers_random_state(backend):
    """Train-mode dropout: eager runs from the random state the compiled call started from, so
    the masks agree and the output is really compared; the generator ends where it would have
    without check=True."""
    x = torch.randn(200)
    drop = nn.Dropout(0.5).train()
    cf = fusec.compile(drop, check=True, backend=backend)
    plain = fusec.compile(nn.Dropout(0.5).train(), backend=backend)
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # compared, not skipped: nothing to say
        y = cf(x)
    after_checked = torch.rand(3)
    torch.manual_seed(1)
    y_plain = plain(x)
    after_plain = torch.rand(3)
    torch.testing.assert_close(y, y_plain)  # the same mask as without the check
    torch.testing.assert_close(after_checked, after_plain)  # and the same stream afterwards
    torch.manual_seed(1)
    torch.testing.assert_close(y, drop(x))  # eager's, from the same seed


def test_an_output_drawn_differently_is_named_and_not_judged(monkeypatch):
    """A program whose random numbers cannot agree with eager's (here: eager's own draw is made
    to differ) gets a warning naming the output and the op, not a MismatchError; the outputs
    that do not depend on random numbers are still judged."""
    def f(x):
        return torch.rand_like(x) + x, x * 2

    cf = fusec.compile(f, check=True, backend="cpp")
    x = torch.randn(8)
    real_set = check._set_rng_state
    calls = []

    def shifted(state):  # the first restore (before eager runs) lands on another state
        calls.append(1)
        real_set(state)
        if len(calls) == 1:
            torch.rand(1)
    monkeypatch.setattr(check, "_set_rng_state", shifted)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        cf(x)  # no MismatchError: output 1 (x * 2) was judged and passed
    said = [str(w.message) for w in said if issubclass(w.category, fusec.FusecWarning)]
    assert len(said) == 1 and "did not compare output 0" in said[0]
    assert "aten.rand_like.default" in said[0]
    (index, op), = check.random_ops(cf.last.captured.gm).items()
    assert index == 0 and op.startswith("aten.rand_like.default at test_check.py:")
    assert op.endswith("(return torch.rand_like(x) + x, x * 2)")  # the user's line


def test_a_wrong_result_still_fails():
    """The pytree path did not loosen the check: a kernel made wrong on purpose is caught."""
    cf = fusec.compile(lambda x: (x.sin() * 2, "label"), check=True, backend="cpp")
    x = torch.randn(16)
    cf(x)
    compiled = cf.last
    wrong = [t + 1 if isinstance(t, torch.Tensor) else t for t in [x.sin() * 2, "label"]]
    with pytest.raises(fusec.MismatchError, match="output 0"):
        check.check_outputs(cf, compiled, (x,), {}, wrong)
    with pytest.raises(fusec.MismatchError, match="'other' where eager returns 'label'"):
        check.check_outputs(cf, compiled, (x,), {}, [x.sin() * 2, "other"])

"""Arguments that are not tensors, as people pass them: a config object or dataclass of settings,
a slice, a plain object. A trace reads such an argument once and bakes what it read into the
program, so a program is kept under the argument's *settings* (fusec/fastpath.py,
`argument_key`): a setting changed between calls compiles again, an equal object reuses the
program, and arguments Python cannot hash (Python 3.11's slices, a dataclass) work at all.
(Before: a config changed in place ran the old value, a wrong answer; a slice or a dataclass
raised `TypeError: unhashable type`.)"""
from __future__ import annotations

import dataclasses
import types

import pytest
import torch

import fusec

BACKENDS = ["cpp", "llvm"]


@dataclasses.dataclass
class Settings:
    scale: float
    shift: float = 0.0
    act: str = "relu"


class Plain:
    def __init__(self, scale):
        self.scale = scale
        self.inner = types.SimpleNamespace(eps=1e-5)


def apply(x, cfg):
    y = x * cfg.scale + cfg.shift
    return torch.relu(y) if cfg.act == "relu" else torch.tanh(y)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dataclass_of_settings_changed_in_place_compiles_again(backend):
    x = torch.randn(4, 6)
    f = fusec.compile(apply, backend=backend)
    cfg = Settings(2.0)
    torch.testing.assert_close(f(x, cfg), apply(x, cfg))
    cfg.scale, cfg.act = 3.0, "tanh"  # the same object, changed: a new program
    torch.testing.assert_close(f(x, cfg), apply(x, cfg))
    assert f.compiles == 2
    torch.testing.assert_close(f(x, Settings(3.0, act="tanh")), apply(x, cfg))  # equal: reused
    assert f.compiles == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_plain_object_and_its_nested_settings(backend):
    x = torch.randn(5)
    f = fusec.compile(lambda x, o: x * o.scale + o.inner.eps, backend=backend)
    obj = Plain(2.0)
    torch.testing.assert_close(f(x, obj), x * 2.0 + 1e-5)
    obj.scale = 4.0
    torch.testing.assert_close(f(x, obj), x * 4.0 + 1e-5)
    obj.inner.eps = 0.5  # nested: seen too
    torch.testing.assert_close(f(x, obj), x * 4.0 + 0.5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_slices_as_arguments(backend):
    x = torch.randn(7, 3)
    f = fusec.compile(lambda x, s: x[s] * 2, backend=backend)
    for s in (slice(1, 3), slice(0, 7, 2), slice(2, None)):
        torch.testing.assert_close(f(x, s), x[s] * 2)
    assert f.compiles == 3


def test_a_dataclass_holding_a_tensor_still_gives_eagers_answer():
    """One that holds a tensor cannot be baked: a graph break (TorchDynamo opens it)."""
    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        scale: float

    f = fusec.compile(lambda b: b.x * b.scale, backend="cpp")
    b = Batch(torch.randn(3), 2.0)
    with pytest.warns(fusec.GraphBreakWarning):
        torch.testing.assert_close(f(b), b.x * 2.0)
    b.x, b.scale = torch.randn(3), 5.0
    torch.testing.assert_close(f(b), b.x * 5.0)

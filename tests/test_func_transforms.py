"""A compiled function called inside torch.func's transforms (vmap, grad, jacrev, jvp, and
per-sample gradients through functional_call) gives the transform's answer: such a call runs
eagerly, said once in a FusecWarning (fusec/api.py `_transformed`). Before, each crashed inside
the compiled program ("Cannot access data pointer of Tensor that doesn't have storage", a fake
tensor assertion)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fusec


def f(x):
    return torch.sin(x) * x.sum()


@pytest.mark.parametrize("transform", ["vmap", "grad", "jacrev", "jvp", "vmap_grad"])
def test_transforms_of_a_compiled_function(transform):
    x = torch.randn(5, 3)
    cf = fusec.compile(f, backend="cpp")
    cf(x[0])  # compiled and run outside any transform first
    run = {
        "vmap": lambda g: torch.func.vmap(g)(x),
        "grad": lambda g: torch.func.grad(lambda v: g(v).sum())(x[0]),
        "jacrev": lambda g: torch.func.jacrev(g)(x[0]),
        "jvp": lambda g: torch.func.jvp(g, (x[0],), (torch.ones(3),))[1],
        "vmap_grad": lambda g: torch.func.vmap(torch.func.grad(lambda v: g(v).sum()))(x),
    }[transform]
    with pytest.warns(fusec.FusecWarning, match="inside a torch.func transform"):
        got = run(cf)
    torch.testing.assert_close(got, run(f))
    torch.testing.assert_close(cf(x[1]), f(x[1]))  # outside again: the compiled program


def test_per_sample_gradients_of_a_compiled_module():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    cm = fusec.compile(model, backend="cpp")
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(6, 4)

    def loss(module, p, xi):
        return torch.func.functional_call(module, p, (xi[None],)).square().sum()

    want = torch.func.vmap(torch.func.grad(lambda p, xi: loss(model, p, xi)), (None, 0))(params, x)
    with pytest.warns(fusec.FusecWarning):
        got = torch.func.vmap(torch.func.grad(lambda p, xi: loss(cm, p, xi)), (None, 0))(
            {f"_orig_mod.{k}": v for k, v in params.items()}, x)
    for k in want:
        torch.testing.assert_close(got[f"_orig_mod.{k}"], want[k])

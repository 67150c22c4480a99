"""`fusec.compile(opt.step)`: SGD, Adam and AdamW (foreach and not) through fusec, 10 steps.

An optimizer keeps its state in Python objects, created at its first step; fusec hands the step
to TorchDynamo from the start (fusec/api.py `_optimizer_step`) and compiles the graphs it finds.
The parameters after 10 steps equal those of the same step run by Dynamo with eager ATen
kernels (`backend="aot_eager"`), to float32 rounding, and eager's to the distance that
torch.compile's own graph of the step already has from eager (Adam's: about 4e-5 after 10 steps
at lr 0.05; its compiled form computes the bias corrections differently).
"""
import functools

import pytest
import torch
from torch import nn

import fusec

OPTIMIZERS = {"SGD": (torch.optim.SGD, dict(momentum=0.9)), "Adam": (torch.optim.Adam, {}),
              "AdamW": (torch.optim.AdamW, dict(weight_decay=0.1))}


def train(name: str, foreach: bool, how: str, steps: int = 10):
    """The parameters after `steps` steps; `how`: "eager", "aot_eager" (torch.compile with
    eager kernels) or a fusec backend."""
    cls, kw = OPTIMIZERS[name]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = cls(model.parameters(), lr=0.05, foreach=foreach, **kw)
    if how == "eager":
        step = opt.step
    elif how == "aot_eager":
        step = torch.compile(opt.step, backend="aot_eager")
    else:
        step = fusec.compile(opt.step, backend=how)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(5, 8, generator=gen)).pow(2).sum().backward()
        step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], step


@functools.lru_cache(maxsize=None)
def reference(name: str, foreach: bool):
    return train(name, foreach, "eager")[0], train(name, foreach, "aot_eager")[0]


# every optimizer, foreach and not, on the C++ backend; on the LLVM and Triton backends every
# optimizer too, and each of them with foreach and without (the kernels differ by backend, the
# graphs Dynamo finds do not)
CASES = [(name, foreach, "cpp") for name in OPTIMIZERS for foreach in (False, True)] + \
    [("SGD", False, "llvm"), ("Adam", True, "llvm"), ("AdamW", False, "llvm"),
     ("AdamW", True, "llvm"),
     ("SGD", True, "triton"), ("Adam", False, "triton"), ("AdamW", True, "triton")]


@pytest.mark.parametrize("name, foreach, backend", CASES)
def test_optimizer_step_matches_eager(name, foreach, backend):
    eager, dynamo = reference(name, foreach)
    got, step = train(name, foreach, backend)
    for g, d, e in zip(got, dynamo, eager):
        torch.testing.assert_close(g, d, rtol=1e-5, atol=1e-6)  # the same graph, fused
        torch.testing.assert_close(g, e, rtol=0, atol=1e-4)  # torch.compile's own distance
    assert step.breaks.regions.last_call, "fusec compiled the graphs Dynamo found"
    if not foreach:  # (foreach ops run as eager `_foreach_*` calls between kernels, for now)
        assert step.kernels and {k.backend for k in step.kernels} == {backend}


def test_no_graph_break_warning_and_explain_shows_regions(recwarn):
    cls, kw = OPTIMIZERS["AdamW"]
    model = nn.Linear(4, 2)
    opt = cls(model.parameters(), lr=0.1, **kw)
    model(torch.randn(3, 4)).sum().backward()
    step = fusec.compile(opt.step, backend="cpp")
    step()
    assert not [w for w in recwarn if issubclass(w.category, fusec.GraphBreakWarning)]
    assert "optimizer step" in step.breaks.cause.reason

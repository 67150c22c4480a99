"""Autocast switched between calls. A program traced under autocast holds its casts (the matmuls
in bfloat16, a layer norm in float32); one traced outside it, run under it, had its matmuls cast
by autocast at run time and fed bfloat16 results to kernels that read float32: garbage or NaN,
with no error. The autocast state is part of a call's key and of every fast path's checks
(fusec/fastpath.py, `autocast_state`)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fusec

BACKENDS = ["cpp", "llvm"]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_inference_with_autocast_switched_between_calls(backend):
    model = _model()
    cm = fusec.compile(model, backend=backend)
    x = torch.randn(4, 16)
    with torch.no_grad():
        for on in (False, True, False, True, True):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
                got, want = cm(x), model(x)
            assert got.dtype == want.dtype == (torch.bfloat16 if on else torch.float32)
            torch.testing.assert_close(got, want)
    assert cm._compiled.compiles == 2
    assert "autocast_state() != AUTOCAST" in cm._compiled._fast.source  # (under autocast)


def test_training_with_autocast_switched_between_steps():
    model = _model()
    ref = copy.deepcopy(model)
    cm = fusec.compile(model, backend="cpp")
    x = torch.randn(4, 16)
    for on in (False, True, False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
            loss, want = cm(x).float().square().mean(), ref(x).float().square().mean()
        loss.backward()
        want.backward()
        torch.testing.assert_close(loss, want)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-3)
            p.grad = q.grad = None

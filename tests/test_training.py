"""Training: forward and backward both compiled (AOT Autograd), gradients match eager."""
import copy

import pytest
import torch

import fusec
from conftest import CPU_BACKENDS, TRITON_DEVICE


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 16))


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("backend", ["cpp", "llvm", "triton"])
def test_gradients_match_eager(backend):
    device = "cpu" if backend in CPU_BACKENDS else TRITON_DEVICE
    model = mlp().to(device)
    ref = copy.deepcopy(model)
    x = torch.randn(8, 16, device=device)
    compiled = fusec.compile(model, backend=backend)
    loss = (compiled(x) ** 2).mean()
    loss.backward()
    ref_loss = (ref(x) ** 2).mean()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads(model), grads(ref)):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
    names = [k.name for k in compiled.kernels]
    assert any("sum" in n for n in names), names  # the backward has reductions (bias grads)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_optimizer_steps_follow_eager(backend):
    model = mlp()
    ref = copy.deepcopy(model)
    compiled = fusec.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x = torch.randn(8, 16)
    for _ in range(5):
        for m, o in ((compiled, opt), (ref, ref_opt)):
            o.zero_grad()
            (m(x) ** 2).mean().backward()
            o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_torch_compile_backend_inference_and_training():
    model = mlp()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="fusec")
    x = torch.randn(8, 16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), ref(x), rtol=1e-5, atol=1e-6)
    (compiled(x) ** 2).mean().backward()
    (ref(x) ** 2).mean().backward()
    for g, r in zip(grads(model), grads(ref)):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)

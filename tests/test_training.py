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


def train_step_matches(model, ref, x, backend):
    """One step of mean(out ** 2) through fusec on `model` and eagerly on its copy `ref`: the
    same loss and gradients. Returns the compiled model."""
    compiled = fusec.compile(model, backend=backend)
    loss = (compiled(x) ** 2).mean()
    loss.backward()
    ref_loss = (ref(x) ** 2).mean()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads(model), grads(ref)):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
    return compiled


@pytest.mark.parametrize("backend", ["cpp", "llvm", "triton"])
def test_gradients_match_eager(backend):
    device = "cpu" if backend in CPU_BACKENDS else TRITON_DEVICE
    model = mlp().to(device)
    ref = copy.deepcopy(model)
    x = torch.randn(8, 16, device=device)
    compiled = train_step_matches(model, ref, x, backend)
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


@pytest.mark.parametrize("backend", ["cpp", "llvm", "triton"])
def test_batch_norm_over_one_pixel_trains(backend):
    """A BatchNorm in training whose input is (N, C, 1, 1), as the last stage of a small-image
    MobileViT is: a reduction group of shape (N, C, 1, 1) reads the (C,) statistics as row values,
    which the reduced dims' memory order (codegen/lower_reduction.py) must not take for an element
    tensor. It crashed lowering ("layout (8,) does not broadcast to (2, 8, 1, 1)")."""
    device = "cpu" if backend in CPU_BACKENDS else TRITON_DEVICE
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8),
                                torch.nn.SiLU()).to(device).train()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 3, 3, 3, device=device)
    train_step_matches(model, ref, x, backend)
    for name in ("running_mean", "running_var"):  # the statistics update as eager's do
        torch.testing.assert_close(getattr(model[1], name), getattr(ref[1], name))


@pytest.mark.parametrize("mode", ["trunc", "floor"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_gradients_of_rounding_division_are_zero(backend, mode):
    """Eager's gradient of a rounding division is zero for both arguments; fusec's backward kernel
    (zeros for `a`, their sum for `b`, one reduction kernel) returned uninitialized memory for `a`
    (benchmarks/opinfo_sweep.py --grad found it)."""
    f = lambda a, b: torch.div(a, b, rounding_mode=mode) * 3  # noqa: E731
    a, b = torch.randn(5, 7, requires_grad=True), torch.tensor(0.7, requires_grad=True)
    out = fusec.compile(f, backend=backend)(a, b)
    out.sum().backward()
    torch.testing.assert_close(out, f(a, b))
    assert torch.equal(a.grad, torch.zeros_like(a)) and torch.equal(b.grad, torch.zeros_like(b))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_ops_with_side_effects_in_a_training_graph(backend):
    """AOT Autograd wraps an op with a side effect (linalg.inv's singular-matrix check) in the
    higher-order op `with_effects`; the schedule runs it as an extern, so gradients match and a
    singular matrix raises eager's error (the schedule crashed on it)."""
    f = lambda x: torch.linalg.inv(x) * 2  # noqa: E731
    a = torch.randn(5, 5)
    x = (a @ a.T + 5 * torch.eye(5)).requires_grad_(True)
    ref = x.detach().clone().requires_grad_(True)
    out = fusec.compile(f, backend=backend)(x)
    out.sum().backward()
    f(ref).sum().backward()
    torch.testing.assert_close(out, f(ref))
    torch.testing.assert_close(x.grad, ref.grad)
    with pytest.raises(torch.linalg.LinAlgError, match="could not be completed"):
        fusec.compile(f, backend=backend)(torch.zeros(3, 3, requires_grad=True))

"""Custom `torch.autograd.Function`s inside a compiled program (capture/tracing.py,
`autograd_functions_inlined`).

torch refuses them inside the functionalize transform that capture traces in: the old style
(`forward(ctx, ...)`) for want of `setup_context`, the new style for want of a functionalize rule.
With gradients off, fusec traces their `forward` itself. These check, against eager, on every
backend: both styles, a Function that updates its input in place (`mark_dirty`), one with
default and non-tensor arguments, and the same modules trained (AOT autograd's path, which runs
the Function's own backward).
"""
import pytest
import torch

import fusec
from conftest import assert_matches


class OldGelu(torch.autograd.Function):
    """BLOOM's way: forward(ctx, x), a hand-written backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        if ctx.needs_input_grad[0]:  # read by some Functions: False when nothing needs a gradient
            ctx.note = "grad"
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        return g * (0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t))


class NewSilu(torch.autograd.Function):
    """The new way: forward without ctx, setup_context apart; a default and a float argument."""

    @staticmethod
    def forward(x, beta=1.702, shift=0.0):
        return x * torch.sigmoid(beta * x) + shift

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.beta = inputs[1] if len(inputs) > 1 else 1.702

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(ctx.beta * x)
        return g * (s + ctx.beta * x * s * (1 - s)), None, None


class DoubleInPlace(torch.autograd.Function):
    """Updates its input in place and says so (mark_dirty); an integer output it marks
    non-differentiable."""

    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        count = (x > 0).sum()
        ctx.mark_non_differentiable(count)
        return x, count

    @staticmethod
    def backward(ctx, g, _):
        return g * 2


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(24, 24)

    def forward(self, x):
        h = OldGelu.apply(self.fc(x))
        return NewSilu.apply(h, 1.5, 0.25) + NewSilu.apply(h) * 0.5


@pytest.mark.parametrize("shape", [(5, 24), (2, 3, 24), (0, 24)])
def test_both_styles_are_traced_and_fused(target, shape):
    backend, device = target
    torch.manual_seed(0)
    model = Block().to(device)
    x = torch.randn(shape, device=device)
    with torch.no_grad():
        compiled = assert_matches(model, x, backend=backend)
    if shape[0]:
        # the Functions' ops are in fused kernels, not left to eager: no op of a Function's
        # forward (tanh, sigmoid) is outside them
        fused = " ".join(op for k in compiled.kernels for op in k.ops)
        assert "tanh" in fused and "sigmoid" in fused, fused


def test_functions_with_nan_and_odd_layout(target):
    backend, device = target
    x = torch.randn(7, 24, device=device).t()  # not contiguous
    x[3, 2] = float("nan")

    def f(x):
        return OldGelu.apply(x) - NewSilu.apply(x, 0.5)

    with torch.no_grad():
        assert_matches(f, x, backend=backend)


def test_in_place_function_updates_the_callers_tensor(target):
    backend, device = target

    def f(x):
        y, count = DoubleInPlace.apply(x)
        return y + 1, count

    x = torch.randn(6, 5, device=device)
    want_x = x.clone()
    with torch.no_grad():
        want = f(want_x)
        got = fusec.compile(f, backend=backend)(x)
    torch.testing.assert_close(x, want_x)  # the input was doubled in place, as eager does
    torch.testing.assert_close(got[0], want[0])
    assert got[1].item() == want[1].item()


def test_training_uses_the_functions_own_backward():
    torch.manual_seed(0)
    model = Block()
    compiled = fusec.compile(model, backend="cpp")
    x = torch.randn(4, 24)
    compiled(x).square().sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).square().sum().backward()
    for g, w in zip(got, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(g, w)


def test_the_patch_is_gone_after_capture():
    before = torch.autograd.Function.__dict__["apply"]
    with torch.no_grad():
        fusec.compile(lambda x: OldGelu.apply(x), backend="cpp")(torch.randn(3))
    assert torch.autograd.Function.__dict__["apply"] is before
    # outside a capture, torch's own apply: it still refuses the old style in a transform
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.vmap(OldGelu.apply)(torch.randn(2, 3))

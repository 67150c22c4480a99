"""passes/training_layout.py: a CNN trained through fusec runs its convolutions channels-last in
the forward *and* the backward (the joint graph rewritten before AOT Autograd's partitioner),
with eager's losses, gradients and gradient strides, on both CPU backends; FUSEC_TRAIN_LAYOUT=0
keeps eager's layout."""
import pytest
import torch
from torch import nn

import fusec
from fusec.passes.training_layout import training_layout

CL = torch.channels_last


class Block(nn.Module):
    """A small bottleneck: a 7 x 7 stem with stride 2, 1 x 1 and 3 x 3 convolutions with batch
    norm and ReLU, a strided shortcut, pooling and a linear head (resnet's shapes, scaled down)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 7, 2, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(8, 4, 1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                                  nn.Conv2d(4, 4, 3, 2, 1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                                  nn.Conv2d(4, 16, 1, bias=False), nn.BatchNorm2d(16))
        self.shortcut = nn.Sequential(nn.Conv2d(8, 16, 1, 2, bias=False), nn.BatchNorm2d(16))
        self.head = nn.Linear(16, 5)

    def forward(self, x, labels):
        h = self.stem(x)
        h = torch.relu(self.body(h) + self.shortcut(h))
        return nn.functional.cross_entropy(self.head(h.mean((2, 3))), labels)


def _conv_inputs(part) -> list:
    """The 4-D tensors the convolutions (and their backward) of a program read, as fake values."""
    gm = part.last.captured.gm
    return [a.meta["val"] for n in gm.graph.nodes if n.op == "call_function"
            and n.target in (torch.ops.aten.convolution.default,
                             torch.ops.aten.convolution_backward.default)
            for a in n.args[:3] if isinstance(a, torch.fx.Node) and a.meta["val"].dim() == 4]


def _train(backend, monkeypatch, layout: str):
    monkeypatch.setenv("FUSEC_TRAIN_LAYOUT", layout)
    model, ref = Block(), Block()
    compiled = fusec.compile(model, backend=backend)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, labels = torch.randn(2, 3, 16, 16, generator=gen), torch.randint(0, 5, (2,), generator=gen)
        losses = [compiled(x, labels), ref(x, labels)]
        for loss, opt in zip(losses, opts):
            loss.backward()
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
            assert p.grad.is_contiguous() == q.grad.is_contiguous()  # eager's layout for .grad
            # (a size-1 dim's stride may differ, as under torch.compile: the same memory order)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return compiled._compiled.train_parts


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_convolutions_train_channels_last_forward_and_backward(backend, monkeypatch):
    parts = _train(backend, monkeypatch, "1")
    for part in parts:  # forward and backward
        inputs = _conv_inputs(part)
        assert inputs and all(v.is_contiguous(memory_format=CL) for v in inputs), \
            [v.stride() for v in inputs]


def test_off_keeps_eager_layout(monkeypatch):
    (backward,) = [p for p in _train("cpp", monkeypatch, "0")[1:]]
    inputs = _conv_inputs(backward)
    assert any(not v.is_contiguous(memory_format=CL) for v in inputs)


def test_a_graph_without_convolutions_is_left_alone():
    gm = torch.fx.symbolic_trace(lambda x: x.relu())
    code = gm.code
    assert training_layout(gm).code == code


class Patches(nn.Module):
    """ViT's patch embedding: one convolution (kernel = stride = 4), its output flattened."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Conv2d(3, 8, 4, 4)
        self.head = nn.Linear(8 * 16, 5)

    def forward(self, x):
        return self.head(self.embed(x).flatten(1)).square().mean()


def test_a_lone_convolution_keeps_eager_layout():
    """One convolution pays a conversion on each side for one faster call: left as it is."""
    model, ref = Patches(), Patches()
    x = torch.randn(2, 3, 16, 16)
    compiled = fusec.compile(model, backend="cpp")
    compiled(x).backward()
    ref(x).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    (conv_input, *_) = _conv_inputs(compiled._compiled.train_parts[0])
    assert not conv_input.is_contiguous(memory_format=CL)

"""passes/conv1x1_mm.py: channels-last 1 x 1 convolutions of a training program (stride 1 or more,
with a bias or not) become matrix multiplies in the forward and the backward, with eager's
values; on its own pattern, and in a CNN trained through fusec on both CPU backends, with eager's
losses and gradients. FUSEC_TRAIN_CONV1X1_MM=0 keeps the convolutions."""
import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import fusec
from fusec.passes.conv1x1_mm import conv1x1_mm

aten = torch.ops.aten
CL = torch.channels_last


def _joint_like(stride: int, bias: bool, h: int):
    """A graph with one 1 x 1 convolution and its backward, traced with fake tensors (as AOT
    Autograd's joint graph is: every node's example value carries its strides)."""
    def f(x, w, b, g):
        out = aten.convolution.default(x, w, b, [stride, stride], [0, 0], [1, 1], False, [0, 0], 1)
        gi, gw, gb = aten.convolution_backward.default(
            g, x, w, [5] if bias else None, [stride, stride], [0, 0], [1, 1], False, [0, 0], 1,
            [True, True, bias])
        return (out, gi, gw, gb) if bias else (out, gi, gw)
    torch.manual_seed(0)
    ho = (h - 1) // stride + 1
    inputs = (torch.randn(2, 3, h, h).to(memory_format=CL), torch.randn(5, 3, 1, 1),
              torch.randn(5) if bias else None, torch.randn(2, 5, ho, ho).to(memory_format=CL))
    return make_fx(f, tracing_mode="fake")(*inputs), f, inputs


@pytest.mark.parametrize("stride,bias,h", [(1, False, 6), (1, True, 5), (2, False, 8),
                                           (2, True, 7), (3, False, 7)])
def test_pattern_becomes_matrix_multiplies_with_eager_values(stride, bias, h):
    gm, f, inputs = _joint_like(stride, bias, h)
    assert conv1x1_mm(gm)
    gm.recompile()
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert aten.convolution.default not in targets
    assert aten.convolution_backward.default not in targets and aten.mm.default in targets
    # against float64 eager (the same ATen calls on doubles): eager's own float32
    # convolution_backward on this project's AVX2 CPU gave a weight gradient 4.6 off for
    # (2, False, 8) inside pytest (right in a plain process), where the rewritten graph is right
    wide = [t.double() if t is not None else None for t in inputs]
    for got, want in zip(gm(*inputs), f(*wide)):
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    assert gm(*inputs)[0].is_contiguous(memory_format=CL)  # the convolution's own layout


def test_other_convolutions_are_left_alone():
    def f(x, w3, w1):
        a = aten.convolution.default(x, w3, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
        b = aten.convolution.default(x, w1, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)  # padded
        c = aten.convolution.default(x.contiguous(), w1, None, [1, 1], [0, 0], [1, 1], False,
                                     [0, 0], 1)  # not channels-last: the rows are not a view
        return a, b, c
    x = torch.randn(2, 4, 5, 5).to(memory_format=CL)
    gm = make_fx(f, tracing_mode="fake")(x, torch.randn(4, 4, 3, 3), torch.randn(4, 4, 1, 1))
    assert not conv1x1_mm(gm)


class Bottleneck(nn.Module):
    """1 x 1 convolutions with and without bias, a strided 1 x 1 shortcut over an odd size (7:
    the last stride runs past the edge), between a 3 x 3 stem and a linear head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(8, 4, 1), nn.ReLU(), nn.Conv2d(4, 4, 3, 2, 1),
                                  nn.ReLU(), nn.Conv2d(4, 16, 1, bias=False), nn.BatchNorm2d(16))
        self.shortcut = nn.Conv2d(8, 16, 1, 2, bias=False)
        self.head = nn.Linear(16, 5)

    def forward(self, x, labels):
        h = self.stem(x)
        h = torch.relu(self.body(h) + self.shortcut(h))
        return nn.functional.cross_entropy(self.head(h.mean((2, 3))), labels)


def _train(backend, monkeypatch, on: str):
    monkeypatch.setenv("FUSEC_TRAIN_CONV1X1_MM", on)
    model, ref = Bottleneck(), Bottleneck()
    compiled = fusec.compile(model, backend=backend)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, labels = torch.randn(2, 3, 7, 7, generator=gen), torch.randint(0, 5, (2,), generator=gen)
        losses = [compiled(x, labels), ref(x, labels)]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
            assert p.grad.is_contiguous() == q.grad.is_contiguous()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return compiled._compiled.train_parts


def _ops(part) -> set:
    return {n.target for n in part.last.captured.gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_cnn_trains_with_eager_values(backend, monkeypatch):
    forward, backward = _train(backend, monkeypatch, "1")
    assert aten.mm.default in _ops(forward) and aten.mm.default in _ops(backward)
    convs = [n for n in forward.last.captured.gm.graph.nodes
             if n.target is aten.convolution.default]
    assert [tuple(n.args[1].meta["val"].shape[2:]) for n in convs] == [(3, 3), (3, 3)]


def test_off_keeps_the_convolutions(monkeypatch):
    forward, _ = _train("cpp", monkeypatch, "0")
    convs = [n for n in forward.last.captured.gm.graph.nodes
             if n.target is aten.convolution.default]
    assert len(convs) == 5

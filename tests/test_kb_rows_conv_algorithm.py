"""passes/conv_algorithm.py: a small NCHW 2-D convolution on the CPU may run as ATen's im2col
path (`_slow_conv2d_forward`) where it is faster than oneDNN (KernelBench-style 8_, 9_, 15_ ...).

FUSEC_CONV_ALGORITHM=im2col rewrites every convolution that qualifies without timing it, so the
numerics can be checked against eager whatever the machine's timings: odd sizes, strides and
paddings, no bias, batch 1, NaN in the input, an epilogue fused after it. The convolutions that
do not qualify (channels-last input, groups, dilation, 1 x 1, float64, large) stay convolutions;
unset, the pass changes nothing; `auto` times both and matches eager either way."""
import pytest
import torch

from conftest import assert_matches
from fusec.runtime.steps import ExternStep

aten = torch.ops.aten


def externs(cf) -> list[str]:
    steps = getattr(cf, "_compiled", cf).last.program.steps
    return [str(s.target) for s in steps if isinstance(s, ExternStep)]


def conv_then(conv, epilogue=torch.relu):
    def f(x):
        return epilogue(conv(x))
    return f


CASES = {  # conv, input shape
    "odd": (lambda: torch.nn.Conv2d(3, 5, 3, padding=1), (2, 3, 9, 70)),
    "stride2_pad02": (lambda: torch.nn.Conv2d(4, 6, (3, 5), stride=2, padding=(0, 2)), (1, 4, 17, 13)),
    "no_bias": (lambda: torch.nn.Conv2d(8, 16, 3, padding=1, bias=False), (2, 8, 32, 32)),
    "kb_8": (lambda: torch.nn.Conv2d(8, 16, 3, padding=1), (2, 8, 32, 32)),
}


@pytest.mark.parametrize("backend", ["llvm", "cpp"])
@pytest.mark.parametrize("case", CASES)
def test_im2col_matches_eager(case, backend, monkeypatch):
    monkeypatch.setenv("FUSEC_CONV_ALGORITHM", "im2col")
    make, shape = CASES[case]
    torch.manual_seed(0)
    conv = make().eval()
    x = torch.randn(*shape)
    x[0, 0, 1, 2] = float("nan")
    with torch.no_grad():
        cf = assert_matches(conv_then(conv, lambda y: torch.nn.functional.hardswish(y).relu()), x,
                            backend=backend)
    assert externs(cf) == ["aten._slow_conv2d_forward.default"]


@pytest.mark.parametrize("why,make,x", [
    ("channels-last input", lambda: torch.nn.Conv2d(8, 16, 3, padding=1),
     torch.randn(2, 8, 16, 16).contiguous(memory_format=torch.channels_last)),
    ("groups", lambda: torch.nn.Conv2d(8, 16, 3, padding=1, groups=2), torch.randn(2, 8, 16, 16)),
    ("dilation", lambda: torch.nn.Conv2d(8, 16, 3, dilation=2), torch.randn(2, 8, 16, 16)),
    ("1x1", lambda: torch.nn.Conv2d(8, 16, 1), torch.randn(2, 8, 16, 16)),
    ("float64", lambda: torch.nn.Conv2d(8, 16, 3).double(), torch.randn(2, 8, 16, 16).double()),
    ("large", lambda: torch.nn.Conv2d(64, 64, 3, padding=1), torch.randn(2, 64, 64, 64)),
    ("conv3d", lambda: torch.nn.Conv3d(4, 8, 3, padding=1), torch.randn(2, 4, 8, 16, 16)),
])
def test_convolutions_that_do_not_qualify_stay_convolutions(why, make, x, monkeypatch):
    monkeypatch.setenv("FUSEC_CONV_ALGORITHM", "im2col")
    conv = make().eval()
    with torch.no_grad():
        cf = assert_matches(conv_then(conv), x, backend="llvm")
    assert externs(cf) == ["aten.convolution.default"], why


def test_off_by_default(monkeypatch):
    monkeypatch.delenv("FUSEC_CONV_ALGORITHM", raising=False)
    conv = torch.nn.Conv2d(8, 16, 3, padding=1).eval()
    with torch.no_grad():
        cf = assert_matches(conv_then(conv), torch.randn(2, 8, 32, 32), backend="llvm")
    assert externs(cf) == ["aten.convolution.default"]


def test_auto_times_both_and_matches_eager(monkeypatch):
    monkeypatch.setenv("FUSEC_CONV_ALGORITHM", "auto")
    conv = torch.nn.Conv2d(8, 16, 3, padding=1).eval()
    with torch.no_grad():
        cf = assert_matches(conv_then(conv, torch.tanh), torch.randn(2, 8, 32, 32), backend="llvm")
    (target,) = externs(cf)
    assert target in ("aten.convolution.default", "aten._slow_conv2d_forward.default")
    gm = getattr(cf, "_compiled", cf).last.gm
    rewritten = [n for n in gm.graph.nodes if n.target is aten._slow_conv2d_forward.default]
    assert all("im2col" in n.meta["conv_algorithm"] for n in rewritten)

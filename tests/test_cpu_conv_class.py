"""The small-convolution class on the CPU: a convolution followed by pointwise ops or a norm.

KernelBench level 2 at CPU sizes (a conv2d of a few channels into 64 at 30 x 30) was slower than
eager in four shapes: conv + HardSwish + ReLU, conv + divide + LeakyReLU, conv + eval batch norm
+ scale, conv + instance norm + divide. Each was three kernels where eager runs one convolution
and one pointwise op: the layout pass priced the conversion back to eager's NCHW output as free
(it fuses into the epilogue), chose channels-last and added two conversion kernels before the
convolution, and the epilogue then stored its values a channel apart (passes/layout_plan.py,
Note: a fused conversion is not free). These tests hold the structure that fixed it, on both CPU
backends, for odd shapes, batches of 1 and 3 and a non-contiguous input: eager's results, the
convolution as eager's one extern call, every op after it in one kernel, no layout conversion,
and threads only where the kernel's work pays for them (codegen/cpu_plan.py, Note: threads for
small kernels).
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import assert_matches
from fusec.codegen.cpu_plan import PARALLEL_WORK, thread_choice, work_bytes
from fusec.frontend import capture
from fusec.passes import run_pipeline
from fusec.passes.layout_plan import Conversion, conversion_cost
from fusec.record import record_of
from fusec.runtime.steps import ExternStep, KernelStep

aten = torch.ops.aten
BACKENDS = ["cpp", "llvm"]


class ConvHardswishRelu(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3)

    def forward(self, x):
        return torch.relu(F.hardswish(self.conv(x)))


class ConvDivLeakyRelu(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3)

    def forward(self, x):
        return F.leaky_relu(self.conv(x) / 2.0, negative_slope=0.01)


class ConvBatchNormScale(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3)
        self.bn = nn.BatchNorm2d(cout)
        with torch.no_grad():  # running statistics that are not the identity
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        return self.bn(self.conv(x)) * 2.0


class ConvInstanceNormDiv(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3)
        self.norm = nn.InstanceNorm2d(cout)

    def forward(self, x):
        return self.norm(self.conv(x)) / 2.0


CLASSES = [ConvHardswishRelu, ConvDivLeakyRelu, ConvBatchNormScale, ConvInstanceNormDiv]


def model_and_input(cls, batch, cin=8, cout=64, hw=(31, 29), transposed=False):
    """The class at KernelBench-like CPU sizes (odd spatial sizes); `transposed`: the input is a
    non-contiguous view (H and W swapped in its strides), as a caller may pass one."""
    torch.manual_seed(0)
    model = cls(cin, cout).eval()
    if transposed:
        x = torch.randn(batch, cin, hw[1], hw[0]).transpose(2, 3)
        assert not x.is_contiguous()
    else:
        x = torch.randn(batch, cin, *hw)
    return model, x


def steps_of(cf):
    steps = getattr(cf, "_compiled", cf).last.program.steps  # (a module's: its _compiled)
    return ([s for s in steps if isinstance(s, KernelStep)],
            [s for s in steps if isinstance(s, ExternStep)])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("batch,transposed", [(1, False), (3, False), (3, True)])
def test_the_class_is_one_convolution_and_one_kernel(backend, cls, batch, transposed):
    model, x = model_and_input(cls, batch, transposed=transposed)
    with torch.no_grad():
        cf = assert_matches(model, x, backend=backend, kernels=1)
    kernels, externs = steps_of(cf)
    assert [str(e.target) for e in externs] == ["aten.convolution.default"]
    (kernel,) = kernels
    assert not any("copy" in op or "clone" in op for op in cf.kernels[0].ops), cf.kernels[0].ops
    # the kernel's threads follow its work, and its first line says so (fusec explain shows it);
    # batch 1 is 8 x 64 x 29 x 27 float32 values in and out: well under PARALLEL_WORK
    parallel, why = thread_choice(cf.kernels[0].ir)
    assert why in cf.kernels[0].source.splitlines()[0]
    assert parallel == (work_bytes(cf.kernels[0].ir) >= PARALLEL_WORK)
    if batch == 1:
        assert not parallel and why.startswith("threads: 1 (")
    if backend == "cpp":  # (a kernel on one thread has no OpenMP region at all)
        assert ("if(true)" if parallel else "// one thread (Note: no parallel region") \
            in cf.kernels[0].source
    else:
        assert f".parallel = constant i1 {str(parallel).lower()}" in cf.kernels[0].source


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_the_layout_pass_keeps_eager_layout_and_says_why(cls):
    """The plan is priced and refused: the conversions (two passes of their own before the
    convolution, and the epilogue's out-of-order stores after it) cost more than oneDNN's
    channels-last kernel would gain at this size."""
    model, x = model_and_input(cls, 3)
    gm, _ = run_pipeline(capture(model, (x,)).gm)
    plan = record_of(gm).layout
    assert plan.choice == "unchanged" and "more than" in plan.reason, plan.reason
    assert plan.cost_s > plan.gain_s > 0
    assert not any(n.op == "call_function" and n.target is aten.clone.default
                   for n in gm.graph.nodes)


def test_a_fused_conversion_costs_its_stores_on_a_cpu_only():
    """The priced difference that decides the class (Note: a fused conversion is not free)."""
    fused_cpu = Conversion("y_eager_layout", "y", "contiguous", 1 << 20, True, "output", "cpu")
    fused_gpu = Conversion("y_eager_layout", "y", "contiguous", 1 << 20, True, "output", "cuda:0")
    own_cpu = Conversion("x_channels_last", "x", "channels_last", 1 << 20, False, "input", "cpu")
    assert conversion_cost(fused_gpu) == 0.0
    assert 0.0 < conversion_cost(fused_cpu) < conversion_cost(own_cpu)


def test_a_large_convolution_still_runs_channels_last_on_a_cpu():
    """Pricing the fused conversion does not switch channels-last off where it pays: a 3 x 3
    conv of 64 -> 128 channels at 32 x 32, batch 8, gains more than its conversions cost."""
    if not (torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available()):
        pytest.skip("oneDNN is not available: no channels-last gain is assumed")
    model, x = model_and_input(ConvHardswishRelu, 8, cin=64, cout=128, hw=(32, 32))
    gm, _ = run_pipeline(capture(model, (x,)).gm)
    plan = record_of(gm).layout
    assert plan.choice == "channels_last", plan.reason
    assert any(c.free and conversion_cost(c) > 0 for c in plan.conversions)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_kernel_with_enough_work_runs_on_all_threads(backend):
    """The other side of the thread rule: 1M float32 positions of one exp are 24 MiB of work."""
    x = torch.randn(1 << 20)
    cf = assert_matches(lambda a: torch.exp(a) * 2, x, backend=backend, kernels=1)
    parallel, why = thread_choice(cf.kernels[0].ir)
    assert parallel and why.startswith("threads: all (") and why in cf.kernels[0].source
    small = assert_matches(lambda a: torch.exp(a) * 2, torch.randn(1000), backend=backend)
    assert not thread_choice(small.kernels[0].ir)[0]
    assert PARALLEL_WORK > 1000 * (4 + 4 + 16)

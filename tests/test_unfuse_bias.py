"""unfuse_bias: addmm(bias, x, w) -> mm(x, w) + bias, only where a kernel takes the add."""
import pytest
import torch
import torch.nn.functional as F

from conftest import assert_matches
from fusec.demo import load_example
from fusec.frontend import capture
from fusec.passes import PIPELINE, run_pipeline
from fusec.record import record_of

aten = torch.ops.aten


def rewrites(fn, *inputs):
    # the core's passes only, without the registered small_matmul, which would turn the small-M
    # "half" case (a weight cast to bf16 inside the program) into a GEMV kernel: these tests are
    # about what unfuse_bias leaves
    gm, _ = run_pipeline(capture(fn, inputs).gm, PIPELINE)
    return record_of(gm).unfuse_bias, gm


def linear_gelu(x, w, b):
    return F.gelu(F.linear(x, w, b))


def test_linear_then_gelu_takes_the_bias_into_the_gelu_kernel(target):
    backend, device = target
    x, w, b = (torch.randn(5, 24, device=device), torch.randn(40, 24, device=device),
               torch.randn(40, device=device))
    done, gm = rewrites(linear_gelu, x, w, b)
    assert len(done) == 1
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.addmm.default not in targets and aten.mm.default in targets
    cf = assert_matches(linear_gelu, x, w, b, backend=backend, kernels=1)
    (kernel,) = cf.kernels
    assert kernel.name == "fused_add_gelu_0"


def test_gelu_mlp_keeps_three_kernels_and_two_matmuls(target):
    backend, device = target
    ex = load_example("gelu_mlp").example(batch=6, dim=32, device=device)
    done, gm = rewrites(ex.fn, *ex.inputs)
    assert len(done) == 2
    with torch.no_grad():
        cf = assert_matches(ex.fn, *ex.inputs, backend=backend, kernels=3)
    names = [k.name for k in cf.kernels]
    assert names[1].startswith("fused_add_gelu") and names[2].startswith("fused_add_add"), names
    externs = [n for n in gm.graph.nodes if n.target is aten.mm.default]
    assert len(externs) == 2


def test_a_3d_input_goes_through_the_view(target):
    """F.linear on (B, T, C) is view -> addmm -> view: the add still reaches the relu."""
    backend, device = target
    x = torch.randn(2, 3, 8, device=device)
    w, b = torch.randn(16, 8, device=device), torch.randn(16, device=device)

    def f(x, w, b):
        return torch.relu(F.linear(x, w, b)) * 2
    done, gm = rewrites(f, x, w, b)
    assert len(done) == 1
    # the add sits after the view back to (2, 3, 16), so it fuses with relu and mul
    cf = assert_matches(f, x, w, b, backend=backend, kernels=1)
    assert cf.kernels[0].name == "fused_add_relu_mul_0"


def test_a_transposed_input(target):
    backend, device = target
    x = torch.randn(8, 5, device=device).t()  # (5, 8), non-contiguous
    w, b = torch.randn(16, 8, device=device), torch.randn(16, device=device)
    done, _ = rewrites(linear_gelu, x, w, b)
    assert len(done) == 1
    assert_matches(linear_gelu, x, w, b, backend=backend)


@pytest.mark.parametrize("case", ["output", "reduction", "half", "beta", "matrix_c"])
def test_left_alone(case):
    x, w, b = torch.randn(4, 8), torch.randn(16, 8), torch.randn(16)
    fn = {
        "output": lambda x, w, b: F.linear(x, w, b),  # nothing would take the add
        "reduction": lambda x, w, b: torch.softmax(F.linear(x, w, b), -1),
        "half": lambda x, w, b: F.gelu(F.linear(x.bfloat16(), w.bfloat16(), b.bfloat16())),
        "beta": lambda x, w, b: torch.relu(torch.addmm(b, x, w.t(), beta=0.5)),
        "matrix_c": lambda x, w, b: torch.relu(torch.addmm(b.expand(4, 16) * 1.0, x, w.t())),
    }[case]
    done, gm = rewrites(fn, x, w, b)
    assert done == []
    assert any(n.target is aten.addmm.default for n in gm.graph.nodes)
    torch.testing.assert_close(run(gm, x, w, b), fn(x, w, b))


def run(gm, *inputs):
    import fusec
    out = fusec.compile(gm, backend="cpp")(*inputs)
    return out[0] if isinstance(out, (tuple, list)) else out


def test_nan_and_inf_in_the_bias_propagate(target):
    backend, device = target
    x, w = torch.randn(3, 4, device=device), torch.randn(5, 4, device=device)
    b = torch.tensor([0.0, float("nan"), float("inf"), -float("inf"), 1.0], device=device)

    def f(x, w, b):
        return torch.relu(F.linear(x, w, b)) - 1
    assert len(rewrites(f, x, w, b)[0]) == 1
    assert_matches(f, x, w, b, backend=backend)


# ---- convolutions: on CUDA, the bias joins the next kernel ---------------------------------------

def conv_relu(conv):
    return lambda x: torch.relu(conv(x))


@pytest.mark.parametrize("make", [
    lambda: torch.nn.Conv2d(6, 10, 3, padding=1),
    lambda: torch.nn.Conv2d(6, 6, 3, groups=6),  # depthwise: torch's own kernel adds the bias
    lambda: torch.nn.ConvTranspose2d(6, 10, 3, stride=2),
    lambda: torch.nn.Conv3d(4, 8, 3),
    lambda: torch.nn.Conv1d(6, 10, 5),
], ids=["conv2d", "depthwise", "transposed", "conv3d", "conv1d"])
def test_conv_bias_moves_into_the_next_kernel_on_cuda_only(target, make):
    backend, device = target
    conv = make().to(device).eval()
    shape = {torch.nn.Conv3d: (2, 4, 6, 7, 5), torch.nn.Conv1d: (3, 6, 17)}.get(type(conv), (2, 6, 9, 11))
    x = torch.randn(*shape, device=device)
    x[0, 0, 1] = float("nan")
    fn = conv_relu(conv)
    with torch.no_grad():
        done, gm = rewrites(fn, x)
        cf = assert_matches(fn, x, backend=backend)
    convs = [n for n in gm.graph.nodes if n.target is aten.convolution.default]
    if device == "cuda":  # the add is the first op of the relu's kernel
        assert len(done) == 1 and convs[0].args[2] is None
        assert any(k.name.startswith("fused_add_relu") for k in cf.kernels)
    else:  # oneDNN adds the bias inside the convolution on the CPU
        assert done == [] and convs[0].args[2] is not None


def test_conv_bias_stays_in_half_precision(target):
    backend, device = target
    if device != "cuda":
        pytest.skip("the rewrite is CUDA-only; the CPU case is test_conv_bias_moves_into_the_next_kernel_on_cuda_only")
    conv = torch.nn.Conv2d(6, 10, 3).to(device, torch.float16)
    x = torch.randn(2, 6, 9, 11, device=device, dtype=torch.float16)
    with torch.no_grad():
        done, _ = rewrites(conv_relu(conv), x)
    assert done == []

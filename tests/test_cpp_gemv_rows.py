"""codegen/cpp_gemv_rows.py: a C++ GEMV with a few activation rows computes each weight value once.

For 2 <= M <= 8 activation rows, one loop over k computes what depends on the weight alone (an
int8 weight widened to float, a product q * s) once, and adds its product with every activation
row into that row's running sum. Every case is compared with eager against a float64 product: the
fused error may exceed eager's by at most the bf16 rounding of the largest output. What the
kernel does not cover keeps the generic reduction loop, with the same results.
"""
import pytest
import torch
import torch.nn.functional as F

import fusec

BF16 = torch.bfloat16
KEPT = "cpp_gemv_rows.cpp.j2"  # in the kernel's source


class Int8Linear(torch.nn.Module):
    """W8A16: int8 weight, per-channel bf16 scale, optional bias and activation."""

    def __init__(self, n, k, bias=False, act=None, seed=0, transposed=False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        self.register_buffer("q", q.t().contiguous().t() if transposed else q)
        self.register_buffer("scale", (torch.rand(n, generator=g) / 64).to(BF16))
        self.register_buffer("bias", torch.randn(n, generator=g).to(BF16) if bias else None)
        self.act = act

    def forward(self, x):
        y = F.linear(x, self.q.to(x.dtype)) * self.scale
        if self.bias is not None:
            y = y + self.bias
        return {"gelu": F.gelu, "relu": torch.relu, None: lambda v: v}[self.act](y)

    def reference(self, x):
        y = F.linear(x.double(), self.q.double()) * self.scale.double()
        if self.bias is not None:
            y = y + self.bias.double()
        return {"gelu": F.gelu, "relu": torch.relu, None: lambda v: v}[self.act](y)


def rand(*shape, seed=0, dtype=BF16):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def check(fn, x, ref, kept, backend="cpp"):
    cf = fusec.compile(fn, backend=backend)
    with torch.no_grad():
        got, eager = cf(x), fn(x)
    assert len(cf.kernels) == 1, [k.name for k in cf.kernels]
    assert (KEPT in cf.kernels[0].source) == kept, cf.kernels[0].source[:1500]
    assert got.shape == eager.shape and got.dtype == eager.dtype
    ok = torch.isfinite(ref)
    assert torch.equal(got[~ok].double().nan_to_num(), eager[~ok].double().nan_to_num())
    if ok.any():
        fused_err = (got.double() - ref)[ok].abs().max().item()
        eager_err = (eager.double() - ref)[ok].abs().max().item()
        assert fused_err <= eager_err + 2 ** -8 * ref[ok].abs().max().item(), (fused_err, eager_err)
    return cf


@pytest.mark.parametrize("m", [2, 3, 4, 7, 8])
def test_int8_linear_with_a_few_rows(m):
    layer = Int8Linear(40, 300, seed=m)
    x = rand(m, 300, seed=m)
    cf = check(layer, x, layer.reference(x), kept=True)
    src = cf.kernels[0].source
    assert f"acc_m{m - 1}" in src and f"acc_m{m}" not in src  # one running sum per row
    assert src.count("static_cast<float>(v0_p_q)") == 1  # the weight converted once


def test_one_row_keeps_the_generic_loop():
    layer = Int8Linear(24, 200)
    x = rand(1, 200, seed=1)
    check(layer, x, layer.reference(x), kept=False)


@pytest.mark.parametrize("k", [1, 7, 256, 257, 1000])
def test_odd_lengths_of_k_and_the_blocks(k):
    layer = Int8Linear(12, k, seed=k)
    x = rand(4, k, seed=k)
    check(layer, x, layer.reference(x), kept=k > 1)  # K = 1: no loop over k at all


def test_bias_and_gelu_epilogue():
    layer = Int8Linear(33, 512, bias=True, act="gelu", seed=3)
    x = rand(5, 512, seed=4)
    check(layer, x, layer.reference(x), kept=True)


def test_a_weight_computed_in_several_steps():
    """Per-weight scales: the kept value is the bf16-rounded product q * s, computed once."""
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-8, 8, (48, 384), generator=g, dtype=torch.int8)
    s = (torch.rand(48, 384, generator=g) + 0.5).to(BF16)
    x = rand(4, 384, seed=6)
    fn = lambda v: F.linear(v, q.to(BF16) * s)  # noqa: E731
    check(fn, x, F.linear(x.double(), (q.to(BF16) * s).double()), kept=True)


def test_a_float32_weight_in_a_sum_of_products():
    w = rand(48, 384, seed=5, dtype=torch.float32)
    x = rand(4, 384, seed=6, dtype=torch.float32)
    fn = lambda v: (v[:, None, :] * w[None]).sum(-1)  # noqa: E731  (a GEMV written as a sum)
    check(fn, x, (x.double()[:, None, :] * w.double()[None]).sum(-1), kept=True)


def test_no_shared_value_keeps_the_generic_loop():
    """A sum over k of x alone, broadcast over n: nothing depends on the weight rows alone."""
    x = rand(4, 384, seed=7, dtype=torch.float32)
    fn = lambda v: (v[:, None, :] * torch.ones(1, 12, 1)).sum(-1)  # noqa: E731
    check(fn, x, (x.double()[:, None, :] * torch.ones(1, 12, 1, dtype=torch.float64)).sum(-1), kept=False)


def test_non_contiguous_activations_and_a_transposed_weight():
    layer = Int8Linear(20, 256, seed=7, transposed=True)
    x = rand(256, 3, seed=8).t()  # (3, 256), strides (1, 3)
    check(layer, x, layer.reference(x), kept=False)  # the weight's k stride: gathered, generic
    layer = Int8Linear(20, 256, seed=7)
    check(layer, x, layer.reference(x), kept=True)


def test_nan_and_infinity():
    layer = Int8Linear(16, 128, seed=9)
    layer.scale[3] = float("nan")
    layer.scale[5] = float("inf")
    x = rand(3, 128, seed=10)
    x[1, 40] = float("nan")
    x[2, 7] = float("inf")
    check(layer, x, layer.reference(x), kept=True)


def test_empty_weight_rows():
    layer = Int8Linear(0, 64)
    x = rand(4, 64, seed=11)
    cf = fusec.compile(layer, backend="cpp")
    with torch.no_grad():
        assert cf(x).shape == (4, 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_other_activation_dtypes(dtype):
    """The sum is float32 (double for float64 activations), and so are the kept weights."""
    layer = Int8Linear(24, 640, bias=True, seed=14)
    layer.scale, layer.bias = layer.scale.to(dtype), layer.bias.to(dtype)
    x = rand(4, 640, seed=15, dtype=dtype)
    cf = check(layer, x, layer.reference(x), kept=True)
    assert ("double acc" in cf.kernels[0].source) == (dtype == torch.float64)

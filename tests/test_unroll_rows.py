"""codegen/unroll_rows.py: a GEMV's few activation rows unrolled into its kernel (C++ and LLVM).

For 2 <= M <= 8 activation rows the rewritten kernel's rows are the weight rows alone: what
depends on the activation row gets one copy per row, what depends on the weight alone (an int8
weight widened to float, a product q * s) stays one value, computed once. Checked on the IR
itself, and end to end on both CPU backends against eager and a float64 product: the fused error
may exceed eager's by at most the bf16 rounding of the largest output.
"""
import pytest
import torch
import torch.nn.functional as F

import fusec
from fusec.codegen.unroll_rows import unroll_rows
from fusec.ir import Reduce
from test_cpp_int4 import cpu_layer

BF16 = torch.bfloat16
UNROLLED = "codegen/unroll_rows.py"  # in an unrolled kernel's source


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


def check(fn, x, ref, unrolled, backend):
    cf = fusec.compile(fn, backend=backend)
    with torch.no_grad():
        got, eager = cf(x), fn(x)
    assert len(cf.kernels) == 1, [k.name for k in cf.kernels]
    assert (UNROLLED in cf.kernels[0].source) == unrolled, cf.kernels[0].source[:1500]
    assert got.shape == eager.shape and got.dtype == eager.dtype
    ok = torch.isfinite(ref)
    assert torch.equal(got[~ok].double().nan_to_num(), eager[~ok].double().nan_to_num())
    if ok.any():
        fused_err = (got.double() - ref)[ok].abs().max().item()
        eager_err = (eager.double() - ref)[ok].abs().max().item()
        assert fused_err <= eager_err + 2 ** -8 * ref[ok].abs().max().item(), (fused_err, eager_err)
    return cf


BACKENDS = ["cpp", "llvm"]


def kernel_ir(fn, x):
    (k,) = fusec.explain(fn, x, backend="llvm").compiled.kernels
    return k.ir


@pytest.mark.parametrize("m", [2, 4, 8])
def test_the_rewritten_kernel(m):
    layer = Int8Linear(24, 256, bias=True, seed=m)
    ir = kernel_ir(layer, rand(m, 256, seed=m))
    out = unroll_rows(ir)
    assert out.row_shape == (24,) and out.k_shape == ir.k_shape
    assert len([i for i in out.body if isinstance(i, Reduce)]) == m  # one sum per activation row
    assert len([l for l in out.loads if l.param == "p_q"]) == 1  # the weight: loaded once
    assert len([l for l in out.loads if l.param == "x"]) == m
    assert len(out.stores) == m and {s.index.offset for s in out.stores} == {24 * i for i in range(m)}
    assert out.plan.phases[0].reduces == tuple(r.var.name for r in out.body if isinstance(r, Reduce))


def test_what_it_leaves_alone():
    layer = Int8Linear(24, 256)
    assert unroll_rows(kernel_ir(layer, rand(1, 256))) is None  # one activation row
    x = rand(4, 256, dtype=torch.float32)
    assert unroll_rows(kernel_ir(lambda v: v.sum(-1), x)) is None  # no weight at all


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", [2, 3, 4, 7, 8])
def test_int8_linear_with_a_few_rows(m, backend):
    layer = Int8Linear(40, 300, bias=True, act="gelu", seed=m)
    x = rand(m, 300, seed=m)
    cf = check(layer, x, layer.reference(x), True, backend)
    src = cf.kernels[0].source
    assert f"_m{m - 1}" in src and f"_m{m} " not in src  # one copy per activation row
    if backend == "cpp":
        assert src.count("static_cast<float>(v0_p_q)") == 1  # the weight converted once


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_row_keeps_the_generic_loop(backend):
    layer = Int8Linear(24, 200)
    x = rand(1, 200, seed=1)
    check(layer, x, layer.reference(x), False, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k", [1, 7, 256, 1025, 3000])
def test_odd_lengths_of_k_and_the_blocks(k, backend):
    layer = Int8Linear(12, k, seed=k)
    x = rand(4, k, seed=k)
    check(layer, x, layer.reference(x), k > 1, backend)  # K = 1: no loop over k at all


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_weight_computed_in_several_steps(backend):
    """Per-weight scales: the bf16-rounded product q * s, computed once per weight."""
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-8, 8, (48, 384), generator=g, dtype=torch.int8)
    s = (torch.rand(48, 384, generator=g) + 0.5).to(BF16)
    x = rand(4, 384, seed=6)
    fn = lambda v: F.linear(v, q.to(BF16) * s)  # noqa: E731
    check(fn, x, F.linear(x.double(), (q.to(BF16) * s).double()), True, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_float32_weight_in_a_sum_of_products(backend):
    w = rand(48, 384, seed=5, dtype=torch.float32)
    x = rand(4, 384, seed=6, dtype=torch.float32)
    # A GEMV written as a sum (passes/canonicalize.py makes it x @ relu(w).t(); the weight is
    # computed, so small_matmul makes it a GEMV, whose rows are unrolled: a stored weight would
    # take the library's matmul, as x @ w.t() does)
    fn = lambda v: (v[:, None, :] * w.relu()[None]).sum(-1)  # noqa: E731
    check(fn, x, (x.double()[:, None, :] * w.double().relu()[None]).sum(-1), True, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_activations_and_a_transposed_weight(backend):
    x = rand(256, 3, seed=8).t()  # (3, 256), strides (1, 3)
    for transposed in (True, False):
        layer = Int8Linear(20, 256, seed=7, transposed=transposed)
        cf = fusec.compile(layer, backend=backend)
        with torch.no_grad():
            got, eager, ref = cf(x), layer(x), layer.reference(x)
        assert (got.double() - ref).abs().max() <= (eager.double() - ref).abs().max() + 2 ** -8 * ref.abs().max()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_other_dtypes_nan_and_infinity(dtype, backend):
    """The sums are float32 (double for float64 activations)."""
    layer = Int8Linear(24, 640, bias=True, seed=14)
    layer.scale, layer.bias = layer.scale.to(dtype), layer.bias.to(dtype)
    layer.scale[3] = float("nan")
    layer.scale[5] = float("inf")
    x = rand(3, 640, seed=15, dtype=dtype)
    x[1, 40] = float("nan")
    check(layer, x, layer.reference(x), True, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_weight_rows(backend):
    layer = Int8Linear(0, 64)
    x = rand(4, 64, seed=11)
    cf = fusec.compile(layer, backend=backend)
    with torch.no_grad():
        assert cf(x).shape == (4, 0)


@pytest.mark.parametrize("m", [2, 4])
def test_packed_int4(m):
    """LLVM unrolls it; the C++ backend's table kernel (cpp_int4.py) takes it first."""
    layer = cpu_layer(24, 256, 32)
    x = rand(m, 256, seed=9)
    for backend in BACKENDS:
        cf = fusec.compile(layer, backend=backend)
        with torch.no_grad():
            got, eager = cf(x), layer(x)
            ref = F.linear(x.double(), layer.weight(BF16).double())
        assert len(cf.kernels) == 1
        assert (UNROLLED in cf.kernels[0].source) == (backend == "llvm")
        fused_err, eager_err = (got.double() - ref).abs().max(), (eager.double() - ref).abs().max()
        assert fused_err <= eager_err + 2 ** -8 * ref.abs().max()

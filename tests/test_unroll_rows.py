"""codegen/unroll_rows.py: a GEMV's few activation rows unrolled into its kernel (LLVM backend).

The rewritten kernel's rows are the weight rows alone; what depends on the activation row gets
one copy per row, what depends on the weight alone stays one value. Checked on the IR itself and
end to end against eager and a float64 product (tests/test_cpp_gemv_rows.py's bound).
"""
import pytest
import torch

import fusec
from fusec.codegen.unroll_rows import unroll_rows
from fusec.ir import Reduce
from test_cpp_gemv_rows import BF16, Int8Linear, check, rand
from test_cpp_int4 import cpu_layer


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


@pytest.mark.parametrize("m", [2, 3, 4, 8])
def test_int8_linear_on_llvm(m):
    layer = Int8Linear(40, 300, bias=True, act="gelu", seed=m)
    x = rand(m, 300, seed=m)
    cf = check(layer, x, layer.reference(x), kept=False, backend="llvm")
    assert "codegen/unroll_rows.py" in cf.kernels[0].source and "_m1" in cf.kernels[0].source


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_other_dtypes_nan_and_strided_activations(dtype):
    layer = Int8Linear(24, 640, bias=True, seed=14)
    layer.scale, layer.bias = layer.scale.to(dtype), layer.bias.to(dtype)
    layer.scale[3] = float("nan")
    x = rand(640, 4, seed=15, dtype=dtype).t()  # strided rows
    x[1, 7] = float("inf")
    check(layer, x, layer.reference(x), kept=False, backend="llvm")


@pytest.mark.parametrize("m", [2, 4])
def test_packed_int4_on_llvm(m):
    import torch.nn.functional as F
    layer = cpu_layer(24, 256, 32)
    x = rand(m, 256, seed=9)
    cf = fusec.compile(layer, backend="llvm")
    with torch.no_grad():
        got, eager = cf(x), layer(x)
        ref = F.linear(x.double(), layer.weight(BF16).double())
    assert len(cf.kernels) == 1
    fused_err, eager_err = (got.double() - ref).abs().max(), (eager.double() - ref).abs().max()
    assert fused_err <= eager_err + 2 ** -8 * ref.abs().max()

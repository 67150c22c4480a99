"""extensions/quant_gemv/cpp_int4.py: the C++ packed-int4 GEMV looks each group's sixteen weights up in a table.

The table holds `(q - zero) * scale` for q = 0..15, each step rounded to bf16 as eager rounds it,
so the weights are eager's bit for bit: one-hot activations read them back one by one. Around
that, every case is compared with eager against a float64 product (test_int4_words.py's
bound), and what the table does not cover keeps the generic reduction loop.
"""
import pytest
import torch
import torch.nn.functional as F

import fusec
from fusec.extensions.quant_gemv.cpp_int4 import MAX_GROUP_BYTES
from test_int4_words import Int4

BF16 = torch.bfloat16
TABLE = "lut[16]"  # in the table kernel's source


def cpu_layer(*args, **kwargs):
    return Int4(*args, **kwargs).to("cpu")


def rand(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(BF16)


def check(layer, x, table=True):
    cf = fusec.compile(layer, backend="cpp")
    act = {"relu": torch.relu, "gelu": F.gelu, None: lambda v: v}[layer.act]
    with torch.no_grad():
        got, eager = cf(x), layer(x)
        w = layer.weight(BF16).double()
        ref = act(F.linear(x.double(), w, None if layer.bias is None else layer.bias.double()))
    assert len(cf.kernels) == 1, [k.name for k in cf.kernels]
    assert (TABLE in cf.kernels[0].source) == table, cf.kernels[0].source[:2000]
    ok = torch.isfinite(ref)
    assert torch.equal(got[~ok].double().nan_to_num(), eager[~ok].double().nan_to_num())
    fused_err = (got.double() - ref)[ok].abs().max().item()
    eager_err = (eager.double() - ref)[ok].abs().max().item()
    assert fused_err <= eager_err + 2 ** -8 * ref[ok].abs().max().item(), (fused_err, eager_err)
    return cf


@pytest.mark.parametrize("zero", ["tensor", "const", "none"])
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("group", [32, 128])
def test_the_table_kernel_matches_eager(zero, m, group):
    check(cpu_layer(24, 256, group, zero=zero), rand(m, 256))


def test_the_example_layer_and_its_epilogue():
    check(cpu_layer(40, 512, 128, bias=True, act="gelu"), rand(1, 512, seed=3))


@pytest.mark.parametrize("zero", ["tensor", "const", "none"])
def test_the_tables_hold_eagers_weights_bit_for_bit(zero):
    """One-hot activations: out[m, n] = W[n, k] exactly, for every K position."""
    k, n = 64, 24
    layer = cpu_layer(n, k, 16, zero=zero, seed=11)
    layer.scale[0, 0] = 3e-39  # a subnormal scale
    layer.scale[2, 1] = -0.5  # a negative one (its -0.0 weights sum to +0.0, as eager's would)
    layer.zero[1, 1] = -0.0
    cf = fusec.compile(layer, backend="cpp")
    eye = torch.eye(k, dtype=BF16)
    with torch.no_grad():
        want = layer.weight(BF16).t()
        got = torch.cat([cf(eye[i:i + 4]) for i in range(0, k, 4)])
    assert TABLE in cf.kernels[0].source
    assert torch.equal(got.float(), want.float())  # bit for bit, but for the sign of a zero


def test_nan_and_infinity_in_scales_and_activations():
    layer = cpu_layer(16, 128, 32, seed=5)
    layer.scale[3, 2] = float("nan")
    layer.scale[5, 0] = float("inf")
    x = rand(2, 128, seed=6)
    x[1, 40] = float("nan")
    check(layer, x)


def test_long_groups_keep_the_generic_loop():
    group = 4 * MAX_GROUP_BYTES  # 2 * MAX_GROUP_BYTES packed bytes: longer than a summed block
    check(cpu_layer(8, 2 * group, group), rand(1, 2 * group), table=False)


@pytest.mark.parametrize("shape", ["batch_of_rows", "transposed"])
def test_rows_of_a_batch_and_activations_read_with_strides(shape):
    """x of shape (2, 2, K) (four rows of one GEMV) and x transposed in memory (stride 3)."""
    x = rand(2, 2, 256, seed=8) if shape == "batch_of_rows" else rand(256, 3, seed=8).t()
    layer = cpu_layer(24, 256, 32, seed=9)
    cf = fusec.compile(layer, backend="cpp")
    with torch.no_grad():
        got, want = cf(x), layer(x)
    assert len(cf.kernels) == 1 and TABLE in cf.kernels[0].source
    ref = F.linear(x.double(), layer.weight(BF16).double())
    assert (got.double() - ref).abs().max() <= (want.double() - ref).abs().max() + 2 ** -8 * ref.abs().max()


def test_tables_for_scales_and_zero_points_from_all_over_the_range():
    """The table's two roundings are done on all sixteen entries at once (fusec_round_bf16_v16,
    cpp_prelude.h). Random bf16 bit patterns as scales and zero points (NaN, infinities,
    subnormals, products that overflow), read back by one-hot activations: NaN where eager's
    product has NaN (a row with an infinite weight is NaN everywhere, 0 * inf, in both), and
    elsewhere each weight as eager dequantizes it, bit for bit. (Eager's bf16 matmul itself
    flushes subnormal results to zero; the weights are compared with eager's dequantization.)"""
    k, n = 64, 256
    layer = cpu_layer(n, k, 32, seed=13)
    g = torch.Generator().manual_seed(14)
    for t in (layer.scale, layer.zero):
        t.copy_(torch.randint(-2 ** 15, 2 ** 15, t.shape, generator=g, dtype=torch.int32)
                .to(torch.int16).view(BF16))
    cf = fusec.compile(layer, backend="cpp")
    eye = torch.eye(k, dtype=BF16)
    with torch.no_grad():
        got = torch.cat([cf(eye[i:i + 4]) for i in range(0, k, 4)])
        nan = torch.isnan(torch.cat([layer(eye[i:i + 4]) for i in range(0, k, 4)]))
        weights = layer.weight(BF16).t()
    assert TABLE in cf.kernels[0].source and "fusec_round_bf16_v16" in cf.kernels[0].source
    assert torch.equal(torch.isnan(got), nan)
    assert nan.float().mean() < 0.5  # most rows are finite, and compared value for value
    assert torch.equal(got[~nan].float(), weights[~nan].float())  # (but for the sign of a zero)

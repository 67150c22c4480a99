"""GPTQ-style GEMVs at M = 1 (int4 words packed along K, N contiguous) cut along K
(passes/split_reductions.py, extensions/quant_gemv/packed_chunks.py) and each chunk read by the K-packed kernel
(extensions/quant_gemv/int4_k_words.py, extensions/quant_gemv/triton_gemv_int4_k_words.py).

The cut is made on GPUs only (SPLIT_DEVICES); here it is switched on for the CPU too, so that the
Triton kernel runs under the interpreter. Every result is compared with eager and with a float64
product of the exactly dequantized weight: the fast form does not round each weight to half
precision, so it must be at least as close to float64 as eager. Inputs that the fast form cannot
compute as eager does (shift amounts out of order, zero points whose q - zero is not exact, a
scale whose weights overflow, infinities and NaNs) must take the exact path.
"""
import importlib

import pytest
import torch

import fusec
import test_int4_columns as columns
from conftest import TRITON_DEVICE, assert_matches
from fusec.check import compare
from fusec.extensions.quant_gemv.int4_k_words import match_int4_k_words
from test_int4_columns import closer_than_eager, gen, record, run, split_here  # noqa: F401

gptq = importlib.import_module("fusec.examples.gptq_linear")
split_module = importlib.import_module("fusec.passes.split_reductions")
F16, BF16 = torch.float16, torch.bfloat16
DEV = TRITON_DEVICE
TEMPLATE = "triton_gemv_int4_k_words.py.j2"
IN_ORDER = [0, 4, 8, 12, 16, 20, 24, 28]


def chunk_kernel(cf):
    return columns.chunk_kernel(cf, TEMPLATE)


def gptq_layer(k, n, group, dtype=F16, seed=0):
    torch.manual_seed(seed)
    return gptq.GPTQLinear(torch.randn(k, n, dtype=dtype) / k ** 0.5, group).to(DEV)


def reference(layer, x):
    return x.cpu().double() @ layer.dequantized().cpu()


@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_gptq_at_one_row_is_cut_along_k_and_read_by_the_k_words_kernel(dtype, group):
    k, n = 512, 192
    layer = gptq_layer(k, n, group, dtype)
    x = torch.randn(1, k, generator=gen(1)).to(dtype).to(DEV)
    cf, got, eager = run(layer, x)
    closer_than_eager(got, eager, reference(layer, x))
    g = chunk_kernel(cf)
    # the chunk kernel reads the words; the zero points are unpacked first; a second kernel adds
    # the chunks up
    assert sum("p_qweight" in kk.source for kk in cf.kernels) == 1 and len(cf.kernels) == 3
    chunks = k // max(group, importlib.import_module("fusec.extensions.quant_gemv.packed_chunks").K_WORDS_CHUNK)
    columns.cut_as_said(cf, g, layer, x, chunks,
                        "a GEMV of int4 words packed along K (N contiguous) at M = 1")


def test_the_fast_form_is_taken_and_closer_to_float64_than_eager():
    """Half-precision rounding of each weight is what eager does and the fast form does not:
    their results differ, and the fast form's error is the smaller (fp16, many rows)."""
    layer = gptq_layer(1024, 256, 128)
    x = torch.randn(1, 1024, generator=gen(2)).to(F16).to(DEV)
    _, got, eager = run(layer, x)
    want = reference(layer, x)
    assert not torch.equal(got, eager)
    assert (got.cpu().double() - want).pow(2).mean() < (eager.cpu().double() - want).pow(2).mean()


def test_columns_that_do_not_fill_the_last_program_and_a_strided_input():
    layer = gptq_layer(256, 200, 64)  # 200 columns: the second program has 72 of its 128
    x = torch.randn(1, 512, generator=gen(3)).to(F16).to(DEV)[:, ::2]
    cf, got, eager = run(layer, x)
    chunk_kernel(cf)
    closer_than_eager(got, eager, reference(layer, x))


def test_one_token_of_one_sequence():
    layer = gptq_layer(256, 64, 128, BF16)
    x = torch.randn(1, 1, 256, generator=gen(4)).to(BF16).to(DEV)
    cf, got, eager = run(layer, x)
    chunk_kernel(cf)
    assert got.shape == eager.shape == (1, 1, 64)
    closer_than_eager(got, eager, reference(layer, x))


def test_gptq_unpacked_in_int32_takes_the_same_kernel():
    """test_refine_views.py's form: no narrowing to int8, q - zero in int32, then
    `.to(x.dtype)` before the scale."""
    from test_refine_views import SHIFTS, gptq as gptq_int32
    k, n, group = 512, 64, 64
    g = gen(18)
    q = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    zeros = torch.randint(0, 16, (k // group, n), generator=g, dtype=torch.int32)
    scales = (torch.rand(k // group, n, generator=g) / 40 + 1e-3).to(BF16)
    qweight, qzeros = gptq.pack_along(q, 0), gptq.pack_along(zeros, 1)
    x = torch.randn(1, k, generator=gen(19)).to(BF16)
    args = [t.to(DEV) for t in (x, qweight, qzeros, scales, SHIFTS)]
    cf = fusec.compile(gptq_int32, backend="triton")
    got, eager = cf(*args), gptq_int32(*args)
    chunk_kernel(cf)
    w = (q - zeros.repeat_interleave(group, 0)).double() * scales.double().repeat_interleave(group, 0)
    closer_than_eager(got, eager, x.double() @ w)


def test_a_computed_activation_is_computed_in_the_chunk_kernel():
    columns.computed_activation(gptq_layer(256, 128, 64, BF16), TEMPLATE)


def test_check_true_accepts_the_fast_form():
    """fusec.compile(check=True) compares with a float64 run of the captured graph, where the
    scales are float64 too: the fast form, closer to it than eager, passes."""
    layer = gptq_layer(512, 128, 128)
    x = torch.randn(1, 512, generator=gen(13)).to(F16).to(DEV)
    run(layer, x, check=True)


# ---- zero points and scales read through g_idx (AutoGPTQ's torch path) ---------------------------

def g_idx_layer(k, n, group, in_order):
    from test_check_gathers import ActOrderQuantLinear
    layer = ActOrderQuantLinear(k, n, group)
    if in_order:  # a checkpoint quantized in order: g_idx[k] = k // G
        layer.g_idx = (torch.arange(k) // group).int()
    return layer.to(DEV)


def g_idx_reference(layer, x):
    g = layer.g_idx.long().cpu()
    return x.cpu().double() @ (layer.scales.cpu().double()[g] * (layer.q - layer.z[g]).double())


@pytest.mark.parametrize("group", [32, 128])
def test_scales_read_through_g_idx_in_order_take_the_fast_form(group):
    layer = g_idx_layer(1024, 192, group, in_order=True)
    x = torch.randn(1, 1024, generator=gen(20)).to(F16).to(DEV)
    cf, got, eager = run(layer, x)
    assert "grouped" in chunk_kernel(cf).source
    (d,) = [d for d in record(cf).split_reductions if d.taken]
    assert "groups read through an index" in d.why
    want = g_idx_reference(layer, x)
    closer_than_eager(got, eager, want)
    assert (got.cpu().double() - want).pow(2).mean() < (eager.cpu().double() - want).pow(2).mean()


def test_the_example_read_through_g_idx_is_the_same_kernel():
    torch.manual_seed(0)
    layer = gptq.GPTQLinear(torch.randn(512, 128, dtype=BF16) / 23, 64, g_idx=True).to(DEV)
    x = torch.randn(1, 1, 512, generator=gen(23)).to(BF16).to(DEV)
    cf, got, eager = run(layer, x)
    assert "grouped" in chunk_kernel(cf).source
    closer_than_eager(got, eager, reference(layer, x))


def test_scales_read_through_g_idx_in_act_order_take_the_exact_path():
    """With act order every group's rows are spread over K: each chunk's check of g_idx fails
    and it computes eager's weights, read through g_idx, weight by weight."""
    layer = g_idx_layer(1024, 64, 128, in_order=False)
    x = torch.randn(1, 1024, generator=gen(21)).to(F16).to(DEV)
    cf, got, eager = run(layer, x)
    chunk_kernel(cf)
    g = layer.g_idx.long().cpu()
    with torch.no_grad():
        w = (layer.scales.cpu()[g] * (layer.q.to(torch.int8) - layer.z.to(torch.int8)[g])).double()
    assert compare(got.cpu(), eager.cpu(), x.cpu().double() @ w) is None


def test_one_group_out_of_order_takes_the_exact_path_in_its_chunk_alone():
    layer = g_idx_layer(1024, 64, 128, in_order=True)
    layer.g_idx[130], layer.g_idx[600] = layer.g_idx[600].clone(), layer.g_idx[130].clone()
    x = torch.randn(1, 1024, generator=gen(22)).to(F16).to(DEV)
    cf, got, eager = run(layer, x)
    chunk_kernel(cf)
    closer_than_eager(got, eager, g_idx_reference(layer, x))


# ---- the exact path ------------------------------------------------------------------------------

class Unpacked(torch.nn.Module):
    """GPTQ's unpacking with its pieces given: int32 zero points per (group, column) and the shift
    amount of each nibble of a word, so that a test can put values in them that the fast form
    cannot take."""

    def __init__(self, k, n, group, shifts, zeros=None, dtype=F16):
        super().__init__()
        g = gen(7)
        self.group = group
        self.q = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
        amounts = torch.tensor(shifts, dtype=torch.int32)
        self.register_buffer("qweight", (self.q.view(k // 8, 8, n) << amounts[None, :, None])
                             .sum(1, dtype=torch.int32))
        self.register_buffer("amounts", amounts)
        self.register_buffer("scales", (torch.rand(k // group, n, generator=g) / 50).to(dtype))
        self.register_buffer("zeros", torch.randint(0, 16, (k // group, n), generator=g,
                                                    dtype=torch.int32) if zeros is None else zeros)

    def weight(self):
        k, n = self.qweight.shape[0] * 8, self.qweight.shape[1]
        w = (self.qweight[:, None, :] >> self.amounts[None, :, None]) & 15
        w = (w.reshape(k // self.group, self.group, n) - self.zeros[:, None, :]).to(self.scales.dtype)
        return (w * self.scales[:, None, :]).reshape(k, n)

    def forward(self, x):
        return x @ self.weight()


def exact_against_eager(layer, x):
    return columns.exact_against_eager(layer, x, TEMPLATE)


def test_zero_points_given_as_int32_take_the_fast_form():
    layer = Unpacked(256, 64, 64, IN_ORDER).to(DEV)
    x = torch.randn(1, 256, generator=gen(8)).to(F16).to(DEV)
    cf, got, eager = run(layer, x)
    chunk_kernel(cf)
    w = (layer.q - layer.zeros.cpu().repeat_interleave(64, 0)).double() \
        * layer.scales.cpu().double().repeat_interleave(64, 0)
    closer_than_eager(got, eager, x.cpu().double() @ w)
    assert not torch.equal(got, eager)  # (the fast form, not the exact path)


def test_shift_amounts_out_of_order_take_the_exact_path():
    # rows 8i .. 8i + 7 in the nibbles in reverse: the fast form assumes row 8i + t in nibble t
    layer = Unpacked(256, 64, 64, IN_ORDER[::-1]).to(DEV)
    exact_against_eager(layer, torch.randn(1, 256, generator=gen(9)).to(F16).to(DEV))


def test_a_zero_point_whose_differences_bf16_rounds_takes_the_exact_path():
    zeros = torch.full((4, 64), -300, dtype=torch.int32)  # q + 300: 301 is not a bf16 number
    layer = Unpacked(256, 64, 64, IN_ORDER, zeros=zeros, dtype=BF16).to(DEV)
    # activations +1, -1, ...: the zero point's share cancels, so that what is left, sum of
    # +-(q + 300) rounded as eager rounds it, differs from the exact q's by far more than a
    # rounding of the result
    x = torch.tensor([[1.0, -1.0] * 128], dtype=BF16).to(DEV)
    got, eager = exact_against_eager(layer, x)
    assert torch.isfinite(got).all()


def test_a_scale_whose_fp16_weights_overflow_gives_eagers_infinities():
    """Only the program whose group has the scale takes the exact path (its chunk of K); the
    other chunks' partial sums stay the fast form's."""
    layer = Unpacked(256, 64, 64, IN_ORDER).to(DEV)
    layer.scales[1, 5] = 6000.0  # 15 * 6000 > 65504: eager's weight is inf
    layer.zeros[1, 5] = 0
    x = torch.randn(1, 256, generator=gen(11)).to(F16).to(DEV)
    cf, got, eager = run(layer, x)
    assert not torch.isfinite(eager[0, 5])
    assert torch.equal(got.isinf(), eager.isinf()) and torch.equal(got.isnan(), eager.isnan())
    w = (layer.q - layer.zeros.cpu().repeat_interleave(64, 0)).double() \
        * layer.scales.cpu().double().repeat_interleave(64, 0)
    finite = torch.isfinite(eager[0]).cpu()
    closer_than_eager(got[:, finite], eager[:, finite], (x.cpu().double() @ w)[:, finite])


@pytest.mark.parametrize("where", ["scale", "activation"])
def test_nan_and_inf_come_out_where_eagers_do(where):
    columns.nan_and_inf(gptq_layer(256, 64, 64), where)


# ---- what is not cut, or not read by the K-packed kernel ----------------------------------------

def test_more_than_one_row_is_not_cut():
    layer = gptq_layer(256, 64, 64)
    x = torch.randn(2, 256, generator=gen(14)).to(F16).to(DEV)
    cf, got, eager = run(layer, x)
    assert not any(TEMPLATE in k.source for k in cf.kernels)
    assert not any(d.taken for d in record(cf).split_reductions)
    closer_than_eager(got, eager, reference(layer, x))


def test_the_environment_switch_keeps_one_gemv(monkeypatch):
    monkeypatch.setenv("FUSEC_INT4_COLUMNS", "0")
    layer = gptq_layer(256, 64, 64)
    x = torch.randn(1, 256, generator=gen(15)).to(F16).to(DEV)
    with torch.no_grad():
        cf = assert_matches(layer, x, backend="triton", kernels=2)
    assert not any(TEMPLATE in k.source for k in cf.kernels)


class FloatZeros(Unpacked):
    """The zero point subtracted after the conversion to half precision: not an integer
    subtraction the kernel knows."""

    def weight(self):
        k, n = self.qweight.shape[0] * 8, self.qweight.shape[1]
        w = ((self.qweight[:, None, :] >> self.amounts[None, :, None]) & 15).to(self.scales.dtype)
        w = w.reshape(k // self.group, self.group, n) - self.zeros[:, None, :].to(self.scales.dtype)
        return (w * self.scales[:, None, :]).reshape(k, n)


def test_a_form_the_k_words_kernel_does_not_know_is_cut_and_still_right():
    layer = FloatZeros(256, 64, 64, IN_ORDER).to(DEV)
    x = torch.randn(1, 256, generator=gen(16)).to(F16).to(DEV)
    with torch.no_grad():
        cf = assert_matches(layer, x, backend="triton")
    assert any(d.taken for d in record(cf).split_reductions)
    assert not any(TEMPLATE in k.source for k in cf.kernels)
    reasons = [match_int4_k_words(k.ir)[1] for k in cf.kernels if "dequant_gemv" in k.name]
    assert reasons and all("zero point" in why or "nibble" in why for why in reasons), reasons
    # and the kernel that renders the chunk instead says why
    assert any(f"Not the K-packed int4 kernel (extensions/quant_gemv/int4_k_words.py): {reasons[0]}"
               in k.source for k in cf.kernels)

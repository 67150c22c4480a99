"""AWQ-style GEMVs at M = 1 cut along K (passes/split_reductions.py, by extensions/quant_gemv/packed_chunks.py's packed_along_n) and each
chunk read by the column kernel (extensions/quant_gemv/int4_columns.py, extensions/quant_gemv/triton_gemv_int4_columns.py).

The cut is made on GPUs only (SPLIT_DEVICES); here it is switched on for the CPU too, so that
the Triton kernel runs under the interpreter. Every result is compared with eager and with a
float64 product of the exactly dequantized weight: the fast form does not round each weight to
half precision, so it must be at least as close to float64 as eager. Inputs that the fast form
cannot compute as eager does (a wrapping zero point, a scale whose weights would overflow, shift
amounts that are not one column a nibble, infinities and NaNs) must take the exact path.
"""
import importlib
import re

import pytest
import torch

import fusec
from conftest import TRITON_DEVICE, assert_matches
from fusec.check import compare
from fusec.extensions.quant_gemv.int4_columns import match_int4_columns
from fusec.record import record_of

awq = importlib.import_module("fusec.examples.awq_linear")
split_module = importlib.import_module("fusec.passes.split_reductions")
F16, BF16 = torch.float16, torch.bfloat16
DEV = TRITON_DEVICE
TEMPLATE = "triton_gemv_int4_columns.py.j2"


@pytest.fixture(autouse=True)
def split_here(monkeypatch):
    monkeypatch.setattr(split_module, "SPLIT_DEVICES", ("cpu", "cuda"))


def record(cf):
    return record_of((cf._compiled if hasattr(cf, "_compiled") else cf).last.gm)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def chunk_kernel(cf, template=TEMPLATE):
    (k,) = [k for k in cf.kernels if template in k.source]
    return k


def run(layer, x, **kw):
    cf = fusec.compile(layer, backend="triton", **kw)
    with torch.no_grad():
        return cf, cf(x), layer(x)


def closer_than_eager(got, eager, want):
    """At least as close to the float64 product as eager, up to a unit in the last place."""
    ulp = torch.finfo(got.dtype).eps * want.abs().max().item()
    err = (got.cpu().double() - want).abs().max().item()
    assert err <= (eager.cpu().double() - want).abs().max().item() + ulp, err


def awq_layer(k, n, group, dtype=F16, seed=0):
    torch.manual_seed(seed)
    return awq.AWQLinear(torch.randn(k, n, dtype=dtype) / k ** 0.5, group).to(DEV)


@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_awq_at_one_row_is_cut_along_k_and_read_by_the_column_kernel(dtype, group):
    k, n = 512, 192
    layer = awq_layer(k, n, group, dtype)
    x = torch.randn(1, k, generator=gen(1)).to(dtype).to(DEV)
    cf, got, eager = run(layer, x)
    closer_than_eager(got, eager, x.cpu().double() @ layer.dequantized().cpu())
    g = chunk_kernel(cf)
    # the chunk kernel reads the words; a second kernel adds the chunks up
    assert sum("qweight" in kk.source for kk in cf.kernels) == 1
    cut_as_said(cf, g, layer, x, k // max(group, 128), "a GEMV of a weight packed along N at M = 1")


def cut_as_said(cf, g, layer, x, chunks, decision):
    """The chunk kernel `g` and the split's decision (in `explain` too) say how K was cut."""
    k = x.shape[-1]
    assert f"K is cut in {chunks} chunks of {k // chunks} rows" in g.source
    assert "this is where the int4 nibbles are unpacked" in g.source
    (d,) = [d for d in record(cf).split_reductions if d.taken]
    assert f"cut in {chunks} chunks of {k // chunks} (whole groups)" in d.why
    assert decision in str(fusec.explain(layer, x, backend="triton"))


def test_the_fast_form_is_taken_and_closer_to_float64_than_eager():
    """Half-precision rounding of each weight is what eager does and the fast form does not:
    their results differ, and the fast form's error is the smaller (fp16, many rows)."""
    layer = awq_layer(1024, 256, 128)
    x = torch.randn(1, 1024, generator=gen(2)).to(F16).to(DEV)
    _, got, eager = run(layer, x)
    want = x.cpu().double() @ layer.dequantized().cpu()
    assert not torch.equal(got, eager)
    assert (got.cpu().double() - want).pow(2).mean() < (eager.cpu().double() - want).pow(2).mean()


def test_word_columns_that_do_not_fill_the_last_program_and_a_strided_input():
    layer = awq_layer(256, 320, 64)  # 40 words a row: the second program has 8 of its 32 lanes
    x = torch.randn(1, 512, generator=gen(3)).to(F16).to(DEV)[:, ::2]
    cf, got, eager = run(layer, x)
    chunk_kernel(cf)
    closer_than_eager(got, eager, x.cpu().double() @ layer.dequantized().cpu())


def test_one_token_of_one_sequence():
    layer = awq_layer(256, 64, 128, BF16)
    x = torch.randn(1, 1, 256, generator=gen(4)).to(BF16).to(DEV)
    cf, got, eager = run(layer, x)
    chunk_kernel(cf)
    assert got.shape == eager.shape == (1, 1, 64)
    closer_than_eager(got, eager, x.cpu().double() @ layer.dequantized().cpu())


class NormThen(torch.nn.Module):
    """An RMS norm whose output is the GEMV's activation: computed in the chunk kernel from the
    norm's loads (the activation side may be any values the same for every column)."""

    def __init__(self, lin, k):
        super().__init__()
        self.lin = lin
        self.w = torch.nn.Parameter(torch.rand(k, generator=gen(5)).to(BF16) + 0.5)

    def forward(self, h):
        hf = h.float()
        x = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(h.dtype) * self.w
        return self.lin(x)


def computed_activation(lin, template=TEMPLATE):
    """NormThen's chunk kernel computes the norm's scaling, from h, per row (its sum of squares is
    a kernel before)."""
    m = NormThen(lin, 256).to(DEV)
    h = torch.randn(1, 256, generator=gen(6)).to(BF16).to(DEV)
    with torch.no_grad():
        cf = assert_matches(m, h, backend="triton")
    g = chunk_kernel(cf, template)
    assert "h_ptr" in g.source and any("rsqrt" in o for o in g.ops)


def test_a_computed_activation_is_computed_in_the_chunk_kernel():
    computed_activation(awq_layer(256, 128, 64, BF16))


def test_a_constant_zero_point_and_a_bias():
    """Eight nibbles a word in natural order, `(q & 15) - 8`, and addmm's bias: the bias is added
    by the kernel that adds the chunks up."""
    from test_constant_gathers import NPacked
    layer = NPacked(512, 64, 64).to(DEV)  # 8 groups of 64: 4 chunks of 128 rows
    x = torch.randn(1, 512, generator=gen(17)).to(F16).to(DEV)
    with torch.no_grad():
        cf = assert_matches(layer, x, backend="triton", kernels=2)
    assert "the zero point is a constant" in chunk_kernel(cf).source
    (combine,) = [k for k in cf.kernels if TEMPLATE not in k.source]
    assert "p_bias" in combine.source


# ---- the exact path ------------------------------------------------------------------------------

class Unpacked(torch.nn.Module):
    """AWQ's unpacking with its pieces given: int8 zero points per (group, column) and the shift
    amount of each column of a word, so that a test can put values in them that the fast form
    cannot take."""

    def __init__(self, k, n, group, shifts, zeros=None, dtype=F16):
        super().__init__()
        g = gen(7)
        self.group = group
        q = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
        amounts = torch.tensor(shifts, dtype=torch.int32)
        self.register_buffer("qweight", (q.view(k, n // 8, 8) << amounts).sum(-1, dtype=torch.int32))
        self.register_buffer("amounts", amounts)
        self.register_buffer("scales", (torch.rand(k // group, n, generator=g) / 50).to(dtype))
        self.register_buffer("zeros", torch.randint(0, 16, (k // group, n), generator=g,
                                                    dtype=torch.int8) if zeros is None else zeros)

    def weight(self):
        w = (self.qweight[:, :, None] >> self.amounts).to(torch.int8)
        w = torch.bitwise_and(w.view(self.qweight.shape[0], -1), 15)
        return (w - self.zeros.repeat_interleave(self.group, 0)) * self.scales.repeat_interleave(self.group, 0)

    def forward(self, x):
        return x @ self.weight()


NATURAL = [0, 4, 8, 12, 16, 20, 24, 28]


def exact_against_eager(layer, x, template=TEMPLATE):
    """The exact path: as close as eager to x times eager's own weight (each step rounded as
    eager's ops round it) in float64."""
    cf, got, eager = run(layer, x)
    chunk_kernel(cf, template)
    with torch.no_grad():
        w = layer.weight().cpu().double()
    assert compare(got.cpu(), eager.cpu(), x.cpu().double() @ w) is None
    return got, eager


def test_shift_amounts_in_natural_order_take_the_fast_form():
    layer = Unpacked(256, 64, 64, NATURAL).to(DEV)
    x = torch.randn(1, 256, generator=gen(8)).to(F16).to(DEV)
    _, got, eager = run(layer, x)
    w = (layer.qweight[:, :, None].cpu() >> torch.tensor(NATURAL)) & 15
    w = (w.view(256, 64).double() - layer.zeros.cpu().double().repeat_interleave(64, 0)) \
        * layer.scales.cpu().double().repeat_interleave(64, 0)
    closer_than_eager(got, eager, x.cpu().double() @ w)


def test_shift_amounts_that_are_not_one_column_a_nibble_take_the_exact_path():
    # column 7 shifted by 26 reads bits 26..29: half of one nibble and half of another
    layer = Unpacked(256, 64, 64, [0, 4, 8, 12, 16, 20, 24, 26]).to(DEV)
    exact_against_eager(layer, torch.randn(1, 256, generator=gen(9)).to(F16).to(DEV))


def test_a_zero_point_below_minus_112_wraps_in_int8_as_in_eager():
    zeros = torch.full((4, 64), -120, dtype=torch.int8)  # 15 - (-120) = 135 wraps to -121
    layer = Unpacked(256, 64, 64, NATURAL, zeros=zeros).to(DEV)
    got, eager = exact_against_eager(layer, torch.randn(1, 256, generator=gen(10)).to(F16).to(DEV))
    assert torch.isfinite(got).all()


def test_a_scale_whose_fp16_weights_overflow_gives_eagers_infinities():
    """Only the program whose group has the scale takes the exact path (its chunk of K); the
    other chunks' partial sums stay the fast form's."""
    layer = Unpacked(256, 64, 64, NATURAL).to(DEV)
    layer.scales[1, 5] = 6000.0  # 15 * 6000 > 65504: eager's weight is inf
    x = torch.randn(1, 256, generator=gen(11)).to(F16).to(DEV)
    cf, got, eager = run(layer, x)
    assert not torch.isfinite(eager[0, 5])
    assert torch.equal(got.isinf(), eager.isinf()) and torch.equal(got.isnan(), eager.isnan())
    w = (layer.qweight[:, :, None].cpu() >> torch.tensor(NATURAL)) & 15
    w = (w.view(256, 64).double() - layer.zeros.cpu().double().repeat_interleave(64, 0)) \
        * layer.scales.cpu().double().repeat_interleave(64, 0)
    finite = torch.isfinite(eager[0]).cpu()
    closer_than_eager(got[:, finite], eager[:, finite], (x.cpu().double() @ w)[:, finite])


def nan_and_inf(layer, where):
    """A NaN scale or an infinite activation: NaN and inf come out where eager's do."""
    x = torch.randn(1, 256, generator=gen(12)).to(F16).to(DEV)
    if where == "scale":
        layer.scales[2, 9] = float("nan")
    else:
        x[0, 17] = float("inf")
    cf, got, eager = run(layer, x)
    assert torch.equal(got.isnan(), eager.isnan()) and torch.equal(got.isinf(), eager.isinf())
    assert got.isnan().any() or got.isinf().any()


@pytest.mark.parametrize("where", ["scale", "activation"])
def test_nan_and_inf_come_out_where_eagers_do(where):
    nan_and_inf(awq_layer(256, 64, 64), where)


def test_check_true_accepts_the_fast_form():
    """fusec.compile(check=True) compares with a float64 run of the captured graph, where the
    scales are float64 too: the fast form, closer to it than eager, passes."""
    layer = awq_layer(512, 128, 128)
    x = torch.randn(1, 512, generator=gen(13)).to(F16).to(DEV)
    run(layer, x, check=True)


# ---- what is not cut, or not read by the column kernel ------------------------------------------

def test_more_than_one_row_is_not_cut():
    layer = awq_layer(256, 64, 64)
    x = torch.randn(2, 256, generator=gen(14)).to(F16).to(DEV)
    cf, got, eager = run(layer, x)
    assert not any(TEMPLATE in k.source for k in cf.kernels)
    assert not any(d.taken for d in record(cf).split_reductions)


def test_the_environment_switch_keeps_one_gemv(monkeypatch):
    monkeypatch.setenv("FUSEC_INT4_COLUMNS", "0")
    layer = awq_layer(256, 64, 64)
    x = torch.randn(1, 256, generator=gen(15)).to(F16).to(DEV)
    with torch.no_grad():
        cf = assert_matches(layer, x, backend="triton", kernels=3)
    assert not any(TEMPLATE in k.source for k in cf.kernels)


class Int32Zeros(Unpacked):
    """The zero point subtracted in int32: not the int8 form the kernel checks for wrapping."""

    def forward(self, x):
        w = (self.qweight[:, :, None] >> self.amounts).to(torch.int32)
        w = torch.bitwise_and(w.view(self.qweight.shape[0], -1), 15)
        w = (w - self.zeros.to(torch.int32).repeat_interleave(self.group, 0)) \
            * self.scales.repeat_interleave(self.group, 0)
        return x @ w


def test_a_form_the_column_kernel_does_not_know_is_cut_and_still_right():
    layer = Int32Zeros(256, 64, 64, NATURAL).to(DEV)
    x = torch.randn(1, 256, generator=gen(16)).to(F16).to(DEV)
    with torch.no_grad():
        cf = assert_matches(layer, x, backend="triton")
    assert not any(TEMPLATE in k.source for k in cf.kernels)
    reasons = [match_int4_columns(k.ir)[1] for k in cf.kernels if "dequant_gemv" in k.name]
    assert reasons and all(re.search(r"int8|nibble", why) for why in reasons), reasons
    # and the kernel that renders the chunk instead says why
    assert any(f"Not the column-packed int4 kernel (extensions/quant_gemv/int4_columns.py): {reasons[0]}"
               in k.source for k in cf.kernels)

"""extensions/quant_gemv/int4_words.py + extensions/quant_gemv/triton_gemv_int4.py and triton_gemv_int4_groups.py: the
packed-int4 GEMVs that read the weight as 32-bit words. With one activation row (M = 1) the group
kernel takes it (zero point and scale once per group, exact up to float32 rounding); with 2-4 rows
in groups smaller than 128 weights the word kernel (each weight dequantized and rounded to bf16 as
eager does); 2-16 rows in groups of 128 or more go to tensor cores (test_int4_mma.py).

Every case compiles an int4 linear with backend="triton" (under the interpreter on a CPU), checks
which kernel was generated (the word kernel says so in its source), and compares with eager
against a float64 product of eager's dequantized bf16 weight: the fused error may not exceed
eager's by more than a bf16 rounding (as test_small_matmul.py does). One-hot activations
read single weights back exactly, so they check the dequantization bit for bit, nibble by nibble.
Cases the word kernel does not cover must fall back to the byte-per-lane GEMV, and still match.
"""
import dataclasses
import importlib
import re

import pytest
import torch
import torch.nn.functional as F

import fusec
from fusec.extensions.quant_gemv import triton_gemv_int4_groups as int4_groups
from conftest import GPU, TRITON_DEVICE
from fusec.extensions.quant_gemv.int4_words import match_int4_words

int4_linear = importlib.import_module("fusec.examples.int4_linear")

pytestmark = pytest.mark.triton  # (all of them: selected by gpu_session.sh's -k triton)
BF16 = torch.bfloat16
DEV = TRITON_DEVICE
WORDS = "extensions/quant_gemv/templates/triton_gemv_int4.py.j2"  # in the word kernel's docstring
GROUPS = "extensions/quant_gemv/templates/triton_gemv_int4_groups.py.j2"  # in the group kernel's
MMA = "extensions/quant_gemv/templates/triton_gemv_int4_mma.py.j2"  # the tensor-core kernel's (M = 2-16)
BYTES = "extensions/quant_gemv/templates/triton_gemv.py.j2"


class Int4(torch.nn.Module):
    """An int4 linear with the variants a quantizer may write: zero point a per-group tensor
    ("tensor"), a constant ("const", 8) or none ("none"); `swap`: the high nibble holds the even
    weight (the opposite packing order); then bias and an activation."""

    def __init__(self, n, k, group, zero="tensor", bias=False, act=None, swap=False, seed=0,
                 dtype=BF16):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.n, self.k, self.group = n, k, group
        self.zero_kind, self.act, self.swap = zero, act, swap
        self.register_buffer("packed", torch.randint(0, 256, (n, k // 2), generator=g,
                                                     dtype=torch.uint8).to(DEV))
        self.register_buffer("scale", (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3)
                             .to(dtype).to(DEV))
        # zero points that are not integers: each step's bf16 rounding matters
        self.register_buffer("zero", (torch.rand(n, k // group, generator=g) * 15).to(dtype)
                             .to(DEV))
        self.register_buffer("bias", torch.randn(n, generator=g).to(dtype).to(DEV) if bias
                             else None)

    def weight(self, dtype):
        p = self.packed.view(self.n, self.k // self.group, self.group // 2)
        lo, hi = p & 0x0F, p >> 4
        if self.swap:
            lo, hi = hi, lo
        lo, hi = lo.to(dtype), hi.to(dtype)
        s = self.scale[..., None]
        if self.zero_kind == "tensor":
            lo, hi = lo - self.zero[..., None], hi - self.zero[..., None]
        elif self.zero_kind == "const":
            lo, hi = lo - 8, hi - 8
        return torch.stack([lo * s, hi * s], dim=-1).view(self.n, self.k)

    def forward(self, x):
        y = F.linear(x, self.weight(x.dtype), self.bias)
        return {"relu": torch.relu, "gelu": F.gelu, None: lambda v: v}[self.act](y)


def rand(*shape, seed=0, dtype=BF16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(DEV)


def check(layer, x, path=WORDS, kernels=1):
    """Compile `layer`, check which GEMV it became, and compare with eager against float64."""
    cf = fusec.compile(layer, backend="triton")
    act = {"relu": torch.relu, "gelu": F.gelu, None: lambda v: v}[getattr(layer, "act", None)]
    with torch.no_grad():
        got = cf(x)
        eager = layer(x)
        w = layer.weight(x.dtype).double()
        ref = act(F.linear(x.double(), w, None if layer.bias is None else layer.bias.double()))
    assert len(cf.kernels) == kernels, [k.name for k in cf.kernels]
    source = gemv(cf).source
    assert path in source, source[:1500]
    assert got.dtype == eager.dtype and got.shape == eager.shape
    ok = torch.isfinite(ref)  # NaN and infinity: where eager has them, and the same
    assert torch.equal(got[~ok].double().nan_to_num(), eager[~ok].double().nan_to_num())
    fused_err = (got.double() - ref)[ok].abs().max().item()
    eager_err = (eager.double() - ref)[ok].abs().max().item()
    bound = eager_err + 2 ** -8 * ref[ok].abs().max().item()
    assert fused_err <= bound, (fused_err, eager_err)
    return cf


def gemv(cf):
    (kernel,) = [k for k in cf.kernels if "gemv" in k.name]
    return kernel


# ---- the word path ---------------------------------------------------------------------------

@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_linear_reads_words(m, group):
    layer = Int4(37, 256, group)  # odd N: a masked last block of columns
    # 2-4 rows in groups of 128: the tensor-core kernel (test_int4_mma.py)
    path = GROUPS if m == 1 else MMA if group >= 128 else WORDS
    cf = check(layer, rand(m, 256, seed=m), path=path)
    assert "eight per 32-bit word" in cf.kernels[0].source or path == MMA


def test_the_example_layer_reads_words():
    ex = int4_linear.example(m=1, k=256, n=48, group=64, device=DEV)
    check(ex.fn, *ex.inputs, path=GROUPS)


@pytest.mark.parametrize("zero", ["const", "none"])
@pytest.mark.parametrize("m", [1, 3])
def test_constant_or_absent_zero_point(zero, m):
    cf = check(Int4(24, 128, 32, zero=zero), rand(m, 128, seed=5), path=GROUPS if m == 1 else WORDS)
    assert "zneg2 = tl.full(" in cf.kernels[0].source


@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_bias_and_activation_epilogue(act):
    check(Int4(40, 192, 64, bias=True, act=act), rand(2, 192, seed=3))


def test_k_tail_and_groups_across_chunks():
    # 40 words per row in chunks of 64: a masked tail; a group of 96 weights is 12 words, which
    # no chunk holds whole: each word loads its group's values
    check(Int4(16, 320, 64), rand(2, 320, seed=4))
    cf = check(Int4(16, 384, 96), rand(2, 384, seed=6))
    assert "(ws // 12)" in cf.kernels[0].source
    # one row: the group kernel, whose lanes take 4 words each (12 = 3 lanes per group), and
    # whose last chunk is partly past the end of a row (48 words in chunks of 64)
    check(Int4(16, 320, 64), rand(1, 320, seed=4), path=GROUPS)
    cf = check(Int4(16, 384, 96), rand(1, 384, seed=6), path=GROUPS)
    assert "// 12  # the lanes' groups" in cf.kernels[0].source and "WPL=4" in cf.kernels[0].source


def test_several_chunks_with_prefetch(monkeypatch):
    check(Int4(8, 4096, 128), rand(1, 4096, seed=7), path=GROUPS)
    check(Int4(8, 4096, 128), rand(2, 4096, seed=7), path=MMA)
    monkeypatch.setenv("FUSEC_INT4_MMA", "0")  # the word kernel's chunks
    check(Int4(8, 4096, 128), rand(2, 4096, seed=7))


def test_non_contiguous_activations():
    layer = Int4(24, 128, 32)
    wide = rand(2, 256, seed=8)
    check(layer, wide[:, ::2])  # stride 2 along K
    check(layer, rand(128, 3, seed=9).t())  # (3, 128) with strides (1, 3)
    check(layer, wide[:, 64:192])  # a window of a longer row
    check(layer, wide[:1, ::2], path=GROUPS)  # one row: the group kernel
    check(layer, wide[1:, 64:192], path=GROUPS)


def test_nan_and_inf_in_the_activations():
    x = rand(3, 128, seed=10)
    x[0, 5] = float("nan")
    x[2, 17] = float("inf")
    check(Int4(16, 128, 32), x)


@pytest.mark.parametrize("zero", ["tensor", "const", "none"])
@pytest.mark.parametrize("where", ["inf", "-inf and inf", "nan", "overflow"])
@pytest.mark.parametrize("path", [GROUPS, MMA])
def test_infinities_or_overflow_take_the_exact_way(where, zero, path):
    """The kernels that do not round each weight as eager does can make a sum that is not finite
    where eager's is, or a NaN where eager has an infinity. The group kernel (one row) subtracts
    (128 + zero) * sum(x) at the end: an infinity in x makes it inf - inf = NaN, and x near the
    float32 limit overflows (128 + q) * x. The tensor-core kernel (2-16 rows) multiplies the scale
    into the sums: with a tiny scale, sum x (q - zero) overflows where eager's sum of
    x * ((q - zero) * scale) does not. Such a program computes its rows again with eager's
    arithmetic: infinities, NaNs and values as eager's. (24 columns: the group kernel's masked
    form; test_the_paired_form_takes_the_exact_way_too checks the other.)"""
    check_exact_way(where, zero, path, 24)


@pytest.mark.parametrize("zero", ["tensor", "none"])
@pytest.mark.parametrize("where", ["inf", "-inf and inf", "nan", "overflow"])
def test_the_paired_form_takes_the_exact_way_too(where, zero, monkeypatch):
    """The paired form (the high nibbles read unmasked, from 4 rows per program on: N > 4224)
    carries a constant times the activations in its sums besides: the same non-finite cases.
    Here switched on from 2 rows, so that 24 columns take it (saved programs off: their
    fingerprint does not see a module constant)."""
    paired_from_two_rows(monkeypatch)
    check_exact_way(where, zero, GROUPS, 24, paired=True)


def paired_from_two_rows(monkeypatch):
    """The paired form from 2 rows per program (it pays from 4, N > 4224 columns: thousands of
    programs under the interpreter), so that a few dozen columns take it. Saved programs off:
    their fingerprint does not see a module constant."""
    monkeypatch.setattr(int4_groups, "PAIRED_FROM_ROWS", 2)
    monkeypatch.setenv("FUSEC_SAVED_PROGRAMS", "0")


def check_exact_way(where, zero, path, n, paired=False):
    rows, k, group = (1, 256, 32) if path == GROUPS else (4, 512, 128)
    layer = Int4(n, k, group, zero=zero, seed=12)
    x = rand(rows, k, seed=13)
    if where == "inf":
        x[rows - 1, 5] = float("inf")
    elif where == "-inf and inf":
        x[0, 9], x[0, 10] = float("-inf"), float("inf")
    elif where == "nan":
        x[0, 7] = float("nan")
    elif path == GROUPS:
        x = (x * 2e36).to(BF16)
        x[0, 3] = 3e38  # (128 + q) * x overflows float32
    else:
        layer.scale.fill_(1e-30)
        x = (x * 1e36).to(BF16)
        x[rows - 1, 3] = 3e38  # sum x (q - zero) passes the float32 limit; times 1e-30 it would not
    cf = fusec.compile(layer, backend="triton")
    with torch.no_grad():
        got, want = cf(x), layer(x)
    assert path in cf.kernels[0].source
    assert ("x4 * (1.0 / 65536)" in cf.kernels[0].source) == paired
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    assert torch.equal(got[got.isinf()], want[want.isinf()])
    fin = want.isfinite()
    if fin.any():  # the exact way: eager's own arithmetic, so its values up to the sum's order
        ref = F.linear(x.double(), layer.weight(BF16).double())[fin]
        err = (got[fin].double() - ref).abs().max().item()
        assert err <= (want[fin].double() - ref).abs().max().item() + 2 ** -8 * ref.abs().max().item()


@pytest.mark.parametrize("n, k, paired", [(64, 1024, False), (64, 512, True)])
def test_one_row_is_closer_to_float64_than_eager(n, k, paired, monkeypatch):
    """The group kernel does not round each dequantized weight to bf16: against a float64
    product of the exact dequantization (q - zero) * scale its error is only the output's
    bf16 rounding, smaller than eager's (which rounds every weight first). Both forms: the high
    nibbles masked (2 rows per program) and read unmasked (from 4 rows, N > 4224; here switched
    on from 2 rows, so that 64 columns take it under the interpreter)."""
    if paired:
        paired_from_two_rows(monkeypatch)
    layer = Int4(n, k, 128, seed=14)
    x = rand(1, k, seed=15)
    cf = fusec.compile(layer, backend="triton")
    p = layer.packed.view(n, k // 128, 64).double()
    q = torch.stack([p.remainder(16), p.div(16, rounding_mode="floor")], -1).view(n, k // 128, 128)
    w = ((q - layer.zero.double()[..., None]) * layer.scale.double()[..., None]).view(n, k)
    with torch.no_grad():
        got, want = cf(x), layer(x)
    assert GROUPS in cf.kernels[0].source
    assert ("x4 * (1.0 / 65536)" in cf.kernels[0].source) == paired
    # the masked form says why: a refusal has a reason
    assert ("2 rows per program; the unmasked (paired) form pays from 4 on" in
            cf.kernels[0].source) == (not paired)
    exact = x.double() @ w.t()
    rounding = (exact.to(BF16).double() - exact).abs()  # the output's own rounding
    assert ((got.double() - exact).abs() <= rounding * 1.01 + 1e-30).float().mean() > 0.99
    assert (got.double() - exact).abs().sum() < (want.double() - exact).abs().sum()


@pytest.mark.parametrize("zero", ["tensor", "const", "none"])
@pytest.mark.parametrize("path, k, group, rows", [(WORDS, 64, 16, 4), (MMA, 256, 128, 8)])
def test_dequantized_weights_are_eagers_bit_for_bit(zero, path, k, group, rows):
    """One-hot activations: out[m, n] = W[n, k] exactly (one bf16 product, float32 sum of
    zeros, rounded to bf16 once), for every K position: every nibble of every word and group.
    The tensor-core kernel applies the scale to the float32 sum, rounded once at the store:
    round(scale * round(q - zero)), which is eager's two roundings."""
    n = 24
    layer = Int4(n, k, group, zero=zero, seed=11)
    layer.scale[0, 0] = 3e-39  # a subnormal scale: its products round as eager's
    layer.zero[1, 1] = -0.0
    cf = fusec.compile(layer, backend="triton")
    eye = torch.eye(k, dtype=BF16, device=DEV)
    with torch.no_grad():
        want = layer.weight(BF16).t()
        got = torch.cat([cf(eye[i:i + rows]) for i in range(0, k, rows)])
    assert path in cf.kernels[0].source
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("offset", [1, 4, 16])
@pytest.mark.parametrize("path, k, group, rows", [(WORDS, 128, 32, 2), (MMA, 256, 128, 3)])
def test_packed_weight_at_any_offset(offset, path, k, group, rows):
    """A packed weight that starts inside a larger buffer: word loads only where aligned, else
    each word joined from its bytes."""
    layer = Int4(16, k, group)
    big = torch.zeros(layer.packed.numel() + 16, dtype=torch.uint8, device=DEV)
    big[offset:offset + layer.packed.numel()] = layer.packed.flatten()
    layer.packed = big[offset:offset + layer.packed.numel()].view(16, k // 2)
    cf = check(layer, rand(rows, k, seed=16), path=path)
    if path == WORDS:
        with torch.no_grad():  # the word kernel is eager's arithmetic: equal
            assert torch.equal(cf(rand(2, 128)), layer(rand(2, 128)))
        # one row: the group kernel, with the same byte-joining loads
        check(layer, rand(1, 128, seed=16), path=GROUPS)


@pytest.mark.parametrize("offset", [0, 1, 2, 8])
def test_group_kernel_activations_at_any_offset(offset):
    """The group kernel reads x two bf16 numbers to a 32-bit word where x is contiguous along K
    and its pointer is 16-byte aligned (offsets 0 and 8 here), else one number at a time (1 and
    2: the launch looks at the pointer and picks that kernel). All four agree with eager."""
    layer = Int4(24, 256, 32)
    wide = rand(1, 512, seed=21)
    x = wide[:, offset:offset + 256]
    cf = check(layer, x, path=GROUPS)
    assert "if X_PAIRS:" in cf.kernels[0].source
    with torch.no_grad():  # a second call at another alignment goes back through the JIT
        other = wide[:, offset + 2:offset + 258]
        want = layer(other)
        ref = F.linear(other.double(), layer.weight(BF16).double())
        err = (cf(other).double() - ref).abs().max().item()
    assert err <= (want.double() - ref).abs().max().item() + 2 ** -8 * ref.abs().max().item()


def test_group_kernel_rows_per_program():
    """Fewest rows that keep the grid in one wave of 16 one-warp programs per SM (2112 on 132
    SMs), 4 where even 8 would not (Llama-70B's 28672 columns), and the widest lanes that a
    group's words allow."""
    assert int4_groups.group_blocks(4096, 512, 16) == (2, 32, 4)
    assert int4_groups.group_blocks(8192, 1024, 16) == (4, 32, 4)
    assert int4_groups.group_blocks(11008, 512, 16) == (8, 32, 4)
    assert int4_groups.group_blocks(28672, 1024, 16) == (4, 32, 4)
    assert int4_groups.group_blocks(4096, 16, 2) == (2, 8, 2)  # groups of 16, 128 weights a row


@pytest.mark.parametrize("group", [8, 16])
def test_group_kernel_with_one_or_two_words_a_group(group):
    """Groups of 8 and 16 weights are 1 and 2 words: a lane holds that many words of a row (WPL),
    and the K loop takes them apart one, two or four at a time (`by_word`)."""
    cf = check(Int4(24, 256, group, seed=24), rand(1, 256, seed=25), path=GROUPS)
    assert f"WPL={group // 8}" in cf.kernels[0].source


@pytest.mark.parametrize("n", [8, 24])
def test_staggered_start_goes_round_every_chunk(n, monkeypatch):
    """Rows of many chunks (24 and more; here from 1, saved programs off) are walked from a chunk
    of each program's own, round to the one before it: every chunk is still added once."""
    monkeypatch.setattr(int4_groups, "STAGGER_FROM_CHUNKS", 1)
    monkeypatch.setenv("FUSEC_SAVED_PROGRAMS", "0")
    layer = Int4(n, 4096, 128, seed=22)  # 512 words a row: 4 chunks of 128
    cf = check(layer, rand(1, 4096, seed=23), path=GROUPS)
    assert "first = (pid % (n_words // BLOCK_W)) * BLOCK_W" in cf.kernels[0].source
    monkeypatch.setattr(int4_groups, "STAGGER_FROM_CHUNKS", 24)
    cf = check(layer, rand(1, 4096, seed=23), path=GROUPS)
    assert "first = 0" in cf.kernels[0].source


def words_read(layer, x, monkeypatch, path):
    """How many times the kernel loads each 32-bit word of the packed weight, [N, K / 8], and the
    kernel's source. The loads are seen through the interpreter: every tl.load comes to
    InterpreterBuilder.create_masked_load with its addresses and mask."""
    from triton.runtime import interpreter

    seen = []
    load = interpreter.InterpreterBuilder.create_masked_load

    def counted(self, ptrs, mask, *args):
        seen.append(ptrs.data[mask.data].astype("int64").ravel())
        return load(self, ptrs, mask, *args)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", counted)
    source = gemv(check(layer, x, path=path)).source
    start, n_words = layer.packed.data_ptr(), layer.packed.numel() // 4
    counts = torch.zeros(n_words, dtype=torch.int64)
    for a in seen:
        a = torch.from_numpy(a)
        a = (a[(a >= start) & (a < start + 4 * n_words)] - start) // 4
        counts += torch.bincount(a, minlength=n_words)
    return counts.view(layer.n, -1), source


@pytest.mark.skipif(GPU, reason="counts the interpreter's loads; on a GPU the kernels are the "
                    "same, and the question is how many bytes they read, which Nsight Compute answers")
@pytest.mark.parametrize("path, stagger", [(GROUPS, False), (GROUPS, True), (WORDS, False)])
def test_each_word_of_the_weight_is_read_once(path, stagger, monkeypatch):
    """The K loop loads the next chunk's words without a mask. On the last trip there is no next
    chunk: the loop then loads the chunk it has just multiplied again (in the L2 cache), not the
    row's first one, which is long evicted and would come from memory a second time (1/chunks of
    the weight read twice: a few percent of the int4 GEMV's time on an H200). So each word is read
    once, and a program's last chunk of each row twice."""
    monkeypatch.setenv("FUSEC_SAVED_PROGRAMS", "0")
    monkeypatch.setattr(int4_groups, "STAGGER_FROM_CHUNKS", 1 if stagger else 24)
    if path == WORDS:
        monkeypatch.setenv("FUSEC_INT4_GROUPS", "0")
    layer = Int4(8, 4096, 128, seed=26)  # 512 words a row: 4 chunks of 128 in the group kernel
    counts, source = words_read(layer, rand(1, 4096, seed=27), monkeypatch, path)
    assert counts.min() == 1 and counts.max() == 2, counts
    twice = counts == 2
    chunk = int(twice[0].sum())  # one chunk of the row: its words, in a run
    assert 0 < chunk < counts.shape[1] // 2 and (twice.sum(dim=1) == chunk).all(), counts
    chunks = counts.shape[1] // chunk
    rows = int(re.search(r"(?:ROWS|BLOCK_N)=(\d+)", source).group(1))  # a program's rows
    for r, row in enumerate(twice):
        (at,) = torch.nonzero(row)[:1, 0].tolist()
        assert at % chunk == 0 and row[at:at + chunk].all(), row
        # the program's last chunk: the row's last, or where staggered (program pid starts at
        # chunk pid % chunks and goes round), the one before its first
        last = (r // rows - 1) % chunks if stagger else chunks - 1
        assert at == last * chunk, (r, at, last)


def test_source_is_the_kernel_that_runs_after_a_switch_changes(monkeypatch):
    """A kernel's source is rendered when first read, by a generator that reads FUSEC_*
    switches then: switching the paired form off after the build must not show a kernel that
    does not run. The built text is shown instead, and says why."""
    paired_from_two_rows(monkeypatch)
    cf = check(Int4(24, 128, 32), rand(1, 128), path=GROUPS)  # (reads cf.kernels[0].source)
    same = fusec.compile(Int4(24, 128, 32), backend="triton")
    with torch.no_grad():
        same(rand(1, 128))
    monkeypatch.setenv("FUSEC_INT4_PAIRED", "0")
    shown = same.kernels[0].source  # first read: after the switch
    assert shown.startswith("# fusec: the generator renders this kernel differently now")
    assert "x4 * (1.0 / 65536)" in shown  # the paired form, which is what runs
    assert shown.split("\n", 1)[1] == same.kernels[0].canonical
    assert cf.kernels[0].source.startswith('"""')  # read before the switch: its own names


def test_group_kernel_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("FUSEC_INT4_GROUPS", "0")
    cf = check(Int4(24, 128, 32), rand(1, 128))  # the word kernel, and it says why
    assert "FUSEC_INT4_GROUPS=0: the group kernel is switched off" in cf.kernels[0].source


def test_paired_form_switched_off_by_the_environment(monkeypatch):
    paired_from_two_rows(monkeypatch)
    monkeypatch.setenv("FUSEC_INT4_PAIRED", "0")  # enough rows per program, yet the masked form
    cf = check(Int4(24, 128, 32), rand(1, 128), path=GROUPS)
    assert "x4 * (1.0 / 65536)" not in cf.kernels[0].source
    assert "FUSEC_INT4_PAIRED=0 switches the unmasked (paired) form off" in cf.kernels[0].source


def test_word_kernel_says_why_not_the_group_kernel():
    cf = check(Int4(24, 128, 32), rand(3, 128))
    assert "Not the group kernel" in cf.kernels[0].source and "M = 3" in cf.kernels[0].source


# ---- what falls back to the byte-per-lane GEMV -----------------------------------------------

def reason(layer, x) -> str:
    """Why the word path declined (it is also in the byte kernel's docstring)."""
    kernel = gemv(check(layer, x, path=BYTES))
    why = match_int4_words(kernel.ir)[1]
    assert why in kernel.source
    return why


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("FUSEC_INT4_WORDS", "0")
    assert "FUSEC_INT4_WORDS=0" in reason(Int4(24, 128, 32), rand(1, 128))


def test_groups_that_are_not_whole_words():
    assert "not whole 32-bit words" in reason(Int4(24, 64, 4), rand(1, 64))
    assert "not whole 32-bit words" in reason(Int4(24, 36, 12), rand(1, 36))  # K % 8 != 0


def test_float16_keeps_the_byte_path():
    layer = Int4(24, 128, 32, dtype=torch.float16)
    assert "not a bf16 activation" in reason(layer, rand(1, 128, dtype=torch.float16))


def test_opposite_packing_order_keeps_the_byte_path():
    assert "x[2j], x[2j + 1]" in reason(Int4(24, 128, 32, swap=True), rand(1, 128))


def test_packed_weight_rows_not_whole_words():
    layer = Int4(16, 128, 32)
    wide = torch.zeros(16, 66, dtype=torch.uint8, device=DEV)  # rows of 66 bytes
    wide[:, :64] = layer.packed
    layer.packed = wide[:, :64]
    assert "4-byte boundaries" in reason(layer, rand(1, 128))


def test_packed_weight_transposed_in_memory():
    layer = Int4(16, 128, 32)
    layer.packed = layer.packed.t().contiguous().t()  # (16, 64) with strides (1, 16)
    assert "not contiguous along K" in reason(layer, rand(2, 128))


def test_more_rows_than_the_word_kernel_takes():
    assert "M = 8 rows" in reason(Int4(24, 128, 32), rand(8, 128))


def test_a_zero_point_computed_by_another_kernel_is_read_from_its_buffer():
    class F32Zero(Int4):  # a float32 zero point rounded to bf16 in the graph (its own kernel)
        def weight(self, dtype):
            z = self.zero
            self.zero = self.zero.float().to(dtype) + 0
            try:
                return super().weight(dtype)
            finally:
                self.zero = z
    check(F32Zero(24, 128, 32), rand(1, 128), kernels=2, path=GROUPS)
    check(F32Zero(24, 128, 32), rand(2, 128), kernels=2)


def test_the_match_checks_every_rounding_step():
    """The word kernel's arithmetic is eager's only for bf16 rounding after the subtraction and
    after the multiplication: the same kernel IR with either rounding taken out is declined."""
    cf = check(Int4(24, 128, 32), rand(1, 128), path=GROUPS)
    ir = gemv(cf).ir
    assert match_int4_words(ir)[0] is not None
    for op in ("sub", "mul"):
        body = [dataclasses.replace(s, round_to=None) if getattr(s, "op", "") == op
                and s.round_to is not None else s for s in ir.body]
        found, why = match_int4_words(dataclasses.replace(ir, body=body))
        assert found is None and "not rounded as a bf16 dequantization is" in why, why

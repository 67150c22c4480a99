"""Gathers by an index known while compiling (passes/constant_gathers.py), and weights packed
along N (AWQ: extensions/quant_gemv/refine_views.py cuts N, the GEMVs take columns in several dims). Every
backend, against eager and a float64 reference."""
import importlib
import re

import pytest
import torch

import fusec
from conftest import GPU, assert_matches
from fusec.record import record_of

awq = importlib.import_module("fusec.examples.awq_linear")
small_matmul = importlib.import_module("fusec.extensions.quant_gemv.small_matmul")  # the module
F16, BF16 = torch.float16, torch.bfloat16


def gen(seed):
    return torch.Generator().manual_seed(seed)


def record(cf):
    return record_of((cf._compiled if hasattr(cf, "_compiled") else cf).last.gm)


def gemv(cf):
    """The kernel that reads the packed weight (on a GPU at M = 1, the chunks' kernel of
    extensions/quant_gemv/tests/test_int4_columns.py; a second kernel adds the chunks up)."""
    (k,) = [k for k in cf.kernels if "gemv" in k.name and "qweight" in k.source]
    return k


def split(device, m) -> bool:
    """Whether the GEMV is cut along K (passes/split_reductions.py, packed_along_n)."""
    return device == "cuda" and m == 1


def reference(layer, x):
    """x @ W in float64, W dequantized by bit masks (AWQLinear.dequantized, not its forward)."""
    return x.cpu().double() @ layer.dequantized().cpu()


# ---- AWQ: one GEMV reads the packed words ----------------------------------------------------

@pytest.mark.parametrize("m", [1, 4])
def test_awq_linear_is_one_gemv_over_the_packed_words(target, m):
    backend, device = target
    ex = awq.example(m=m, k=256, n=96, group=32, device=device)
    layer, (x,) = ex.fn, ex.inputs
    kernels = 4 if split(device, m) else 3  # and a kernel that adds the chunks up
    with torch.no_grad():
        cf = assert_matches(layer, x, backend=backend, kernels=kernels)
        got, want = cf(x).cpu().double(), reference(layer, x)
        eager = layer(x).cpu().double()
    # as accurate as eager against float64 (both round the weight to fp16 the same way)
    assert (got - want).abs().max() <= (eager - want).abs().max() + 1e-3
    g = gemv(cf)
    assert "qweight" in g.source and not any("index" in o for k in cf.kernels for o in k.ops)
    if backend in ("cpp", "llvm") and m > 1:  # the rows unrolled: each word unpacked once
        assert f"_m{m - 1}" in g.source
    # nothing weight-sized is stored: only the GEMV reads qweight; the other two kernels unpack
    # the (K/G, N) zero points
    others = [k for k in cf.kernels if k is not g]
    assert not any("qweight" in k.source for k in others) and "qzeros" in others[0].source
    moved = [d for d in record(cf).constant_gathers if d.taken]
    assert len(moved) == 2 and all("each block of 8" in d.why for d in moved)
    text = str(fusec.explain(layer, x, backend=backend))
    assert "gather(s) by a constant index moved onto constants" in text
    assert text.splitlines()[0].endswith(f"{kernels} kernel(s), 0 extern call(s)")


def test_the_triton_gemv_names_its_columns_in_parts(monkeypatch):
    monkeypatch.setenv("FUSEC_INT4_COLUMNS", "0")  # on a GPU, M = 1 would be cut along K
    ex = awq.example(m=1, k=128, n=64, group=32, device="cuda" if GPU else "cpu")
    cf = fusec.compile(ex.fn, backend="triton")
    with torch.no_grad():
        cf(*ex.inputs)
    src = gemv(cf).source
    assert "This is a GEMV" in src and "the output columns as (8, 8)" in src
    assert "n0 = (n // 8)" in src and "n1 = n % 8" in src


@pytest.mark.parametrize("dtype", [F16, BF16, torch.float32])
def test_awq_dtypes(target, dtype):
    backend, device = target
    ex = awq.example(m=2, k=64, n=40, group=16, device=device, dtype=dtype)
    with torch.no_grad():
        assert_matches(ex.fn, *ex.inputs, backend=backend, kernels=3)


def test_awq_on_a_batch_of_sequences_and_a_non_contiguous_input(target):
    """x (B, T, K) as a transposed view: the rows of the GEMV are B * T."""
    backend, device = target
    ex = awq.example(m=1, k=64, n=24, group=32, device=device)
    x = torch.randn(64, 3, 2, generator=gen(0)).to(F16).to(device).permute(2, 1, 0)
    with torch.no_grad():
        assert_matches(ex.fn, x, backend=backend)


def test_nan_scales_propagate(target):
    backend, device = target
    ex = awq.example(m=1, k=64, n=16, group=32, device=device)
    ex.fn.scales[1, 3] = float("nan")
    with torch.no_grad():
        cf = assert_matches(ex.fn, *ex.inputs, backend=backend)
        assert torch.isnan(cf(*ex.inputs)[0, 3])


def test_an_empty_batch(target):
    backend, device = target
    ex = awq.example(m=1, k=64, n=16, group=32, device=device)
    with torch.no_grad():
        assert_matches(ex.fn, torch.zeros(0, 64, dtype=F16, device=device), backend=backend)


# ---- weights packed along N in natural order: the columns in parts, no gather ------------------

class NPacked(torch.nn.Module):
    """Eight nibbles per int32 along N, column 8j + i in bits 4i.. (a natural order), with a
    bias: the GEMV's columns are (N/8, 8) and its bias is viewed that way too."""

    def __init__(self, k, n, group, dtype=F16):
        super().__init__()
        g = gen(7)
        self.group = group
        shifts = torch.arange(0, 32, 4, dtype=torch.int32)
        self.q = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
        self.register_buffer("qweight", (self.q.view(k, n // 8, 8) << shifts).sum(-1, dtype=torch.int32))
        self.register_buffer("scales", (torch.rand(k // group, n, generator=g) / 50).to(dtype))
        self.register_buffer("bias", torch.randn(n, generator=g).to(dtype))

    def forward(self, x):
        shifts = torch.arange(0, 32, 4, device=x.device)
        w = (self.qweight[:, :, None] >> shifts).to(torch.int8).view(self.qweight.shape[0], -1)
        w = (torch.bitwise_and(w, 15) - 8) * self.scales.repeat_interleave(self.group, dim=0)
        return torch.addmm(self.bias, x, w)


@pytest.mark.parametrize("m", [1, 3])
def test_a_weight_packed_along_n_is_one_kernel(target, m):
    backend, device = target
    layer = NPacked(96, 24, 32).to(device)
    x = torch.randn(m, 96, generator=gen(8)).to(F16).to(device)
    with torch.no_grad():
        cf = assert_matches(layer, x, backend=backend, kernels=1)  # (K = 96: one chunk, not cut)
    assert "qweight" in gemv(cf).source
    (taken,) = record(cf).extensions["small_matmul"]
    assert taken.taken and "computing it as (3, 32) x (3, 8)" in taken.why


# ---- the pass itself ---------------------------------------------------------------------------

def test_a_permutation_of_the_whole_dim_moves_onto_a_constant(target):
    """(x[:, None] * table)[:, perm]: x broadcasts along dim 1, the table is a constant, so the
    gather becomes the table gathered once while compiling."""
    backend, device = target
    perm = [3, 0, 4, 1, 2]

    def f(x):
        table = torch.arange(5, device=x.device, dtype=x.dtype) * 1.5 + 1
        return (x[:, None] * table)[:, torch.tensor(perm, device=x.device)]

    x = torch.randn(6, generator=gen(1)).to(device)
    cf = assert_matches(f, x, backend=backend, kernels=1)
    (d,) = record(cf).constant_gathers
    assert d.taken and "the whole dim" in d.why


def test_a_gather_of_an_input_stays_a_gathered_read(target):
    """x[:, perm] of a program input reaches no constant: nothing moves, the kernel reads x's
    rows by the index (passes/check_gathers.py), and a constant index in range needs no check."""
    backend, device = target

    def f(x):
        return x[:, torch.tensor([2, 0, 1, 3], device=x.device)].sin()

    x = torch.randn(5, 4, generator=gen(2)).to(device)
    cf = assert_matches(f, x, backend=backend, kernels=1)
    (d,) = record(cf).constant_gathers
    assert not d.taken and "stays" in d.why
    (check,) = record(cf).check_gathers
    assert not check.taken and "is a constant, values 0 to 3" in check.why


def test_negative_constant_positions_count_from_the_end(target):
    backend, device = target

    def f(x):
        table = torch.arange(4, device=x.device, dtype=x.dtype)
        return (x[:, None] + table)[:, torch.tensor([-1, 0, -3, 1], device=x.device)]

    x = torch.randn(3, generator=gen(3)).to(device)
    cf = assert_matches(f, x, backend=backend)
    assert [d.taken for d in record(cf).constant_gathers] == [True]


def test_an_index_with_repeats_or_too_few_values_is_kept(target):
    backend, device = target

    def f(x):
        table = torch.arange(4, device=x.device, dtype=x.dtype)
        return (x[:, None] + table)[:, torch.tensor([0, 0, 1], device=x.device)]

    x = torch.randn(3, generator=gen(4)).to(device)
    cf = assert_matches(f, x, backend=backend)
    assert [d.taken for d in record(cf).constant_gathers] == [False]


def test_a_constant_index_out_of_range_still_raises(target):
    backend, device = target
    if device != "cpu":
        pytest.skip("a device-side assert: tests/test_check_gathers.py checks it in a subprocess")

    def f(x):
        return x[:, torch.tensor([0, 5], device=x.device)] * 2

    cf = fusec.compile(f, backend=backend)
    with pytest.raises(IndexError, match="fusec: index out of range"):
        cf(torch.randn(3, 4))


def test_an_index_the_caller_holds_is_not_trusted(target):
    """A tensor the function reaches (a closure's) may change between calls: it is read per
    call, never gathered while compiling."""
    backend, device = target
    perm = torch.tensor([1, 0, 2], device=device)

    def f(x):
        table = torch.arange(3, device=x.device, dtype=x.dtype)
        return (x[:, None] * table)[:, perm]

    x = torch.randn(4, generator=gen(5)).to(device)
    cf = fusec.compile(f, backend=backend)
    torch.testing.assert_close(cf(x), f(x))
    perm.copy_(torch.tensor([2, 1, 0], device=device))
    torch.testing.assert_close(cf(x), f(x))
    assert not any(d.taken for d in record(cf).constant_gathers)


# ---- the shifts in 32 bits (passes/simplify.py) --------------------------------------------------

@pytest.mark.parametrize("amounts", [[0, 4, 28, 31], [32, 40, 63, 64], [-1, -5, 2 ** 40, 7]])
def test_an_int64_shift_narrowed_to_int8_is_done_in_32_bits(target, amounts):
    """int32 >> int64 amounts, cast to int8: computed as a 32-bit shift. Amounts past 31 or
    negative give the sign bits, as the 64-bit shift does (2**40 must not wrap to 0)."""
    backend, device = target
    words = torch.tensor([[0x12345678, -0x7654321, -1, 0x7FFFFFFF]], dtype=torch.int32)
    s = torch.tensor(amounts, dtype=torch.int64)

    def f(w, s):
        return (w[:, :, None] >> s).to(torch.int8), (w[:, :, None] >> s).to(torch.int16) + 1

    cf = assert_matches(f, words.to(device), s.to(device), backend=backend)
    (d,) = [d for d in record(cf).simplify if d.taken]
    assert "in 32 bits" in d.why
    # (the shift's word is no longer widened first: Triton's was fusec_rshift(w.to(tl.int64), s))
    assert not any(re.search(r"fusec_rshift\([^,]*to\(tl\.int64\)", k.source) for k in cf.kernels)


def test_a_shift_whose_int64_result_is_kept_stays_64_bit(target):
    backend, device = target
    w = torch.tensor([-0x7654321, 5], dtype=torch.int32)
    s = torch.tensor([3, 40], dtype=torch.int64)
    cf = assert_matches(lambda w, s: (w >> s) * 3, w.to(device), s.to(device), backend=backend)
    assert not any(d.taken for d in record(cf).simplify)


# ---- more rows than the split-column GEMV takes --------------------------------------------------

def test_awq_at_eight_rows_is_dequantized_once_for_the_library_matmul(target, monkeypatch):
    """M = 8 > SPLIT_COLUMNS_MAX_M on a GPU (here made to apply to the CPU too): the weight is
    written once, by one kernel computing it in the fine shape (no copies of repeated scales),
    and the library multiplies."""
    backend, device = target
    monkeypatch.setattr(small_matmul, "SPLIT_COLUMNS_LIMITED", ("cpu", "cuda"))
    ex = awq.example(m=8, k=128, n=64, group=32, device=device)
    with torch.no_grad():
        cf = assert_matches(ex.fn, *ex.inputs, backend=backend, kernels=3)
    (d,) = record(cf).extensions["small_matmul"]
    assert not d.taken and d.why.startswith("a weight packed along N") and "M = 8 > 4" in d.why
    assert sum("qweight" in k.source for k in cf.kernels) == 1
    assert not any(k.name.startswith("fused_copy") for k in cf.kernels)


def test_awq_at_eight_rows_on_a_cpu_keeps_the_gemv():
    ex = awq.example(m=8, k=128, n=64, group=32)
    with torch.no_grad():
        cf = assert_matches(ex.fn, *ex.inputs, backend="cpp", kernels=3)
    assert gemv(cf) and record(cf).extensions["small_matmul"][0].taken

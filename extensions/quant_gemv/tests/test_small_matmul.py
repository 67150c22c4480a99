"""passes/small_matmul.py: small-M matmuls with a dequantized weight become one GEMV kernel.

Every case runs on every backend (cpp, llvm, triton; Triton under its interpreter without a GPU),
checks the kernel count, and compares with eager against a float64 reference: the fused error may
not exceed eager's by more than the dtype's tolerance (the root conftest.py, fusec.check.compare).
"""
import importlib
import re

import pytest
import torch
import torch.nn.functional as F

import fusec
from conftest import TRITON_DEVICE, assert_matches
from fusec.record import record_of

int8_linear = importlib.import_module("fusec.examples.int8_linear")
int4_linear = importlib.import_module("fusec.examples.int4_linear")

BF16 = torch.bfloat16


def steps_of(cf):
    last = cf._compiled.last if hasattr(cf, "_compiled") else cf.last
    return record_of(last.gm).schedule


def externs(cf):
    return [s.name for s in steps_of(cf) if s.kind == "extern"]


def rand(*shape, dtype=BF16, device="cpu", seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(device)


def int8_weight(n, k, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8).to(device)


# ---- W8A16: int8 weight, per-channel scale ---------------------------------------------------

def w8_scale(x, w, s):
    return F.linear(x, w.to(x.dtype)) * s


def w8_bias_gelu(x, w, s, b):
    return F.gelu(F.linear(x, w.to(x.dtype)) * s + b)


def w8_silu_residual(x, w, s, r):
    return r + F.silu(F.linear(x, w.to(x.dtype) * s[:, None]))


def w8_addmm(x, w, s, b):  # the bias inside the linear: aten.addmm
    return F.linear(x, w.to(x.dtype) * s[:, None], b)


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("fn", [w8_scale, w8_bias_gelu, w8_addmm], ids=lambda f: f.__name__)
def test_int8_linear_is_one_kernel(target, m, fn):
    backend, device = target
    k, n = 67, 37  # odd sizes: masks along K and N
    x = rand(m, k, device=device)
    w = int8_weight(n, k, device)
    s = rand(n, device=device, seed=2, scale=0.02).abs()
    b = rand(n, device=device, seed=3)
    args = (x, w, s) if fn is w8_scale else (x, w, s, b)
    cf = assert_matches(fn, *args, backend=backend, kernels=1)
    assert externs(cf) == []
    assert "gemv" in cf.kernels[0].name


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64], ids=str)
def test_int8_linear_other_dtypes_and_residual(target, dtype):
    backend, device = target
    if backend == "triton" and dtype == torch.float64 and device == "cuda":
        pytest.skip("float64 GEMV on a GPU: covered on CPU")
    m, k, n = 3, 40, 24
    x = rand(m, k, dtype=dtype, device=device)
    w = int8_weight(n, k, device)
    s = rand(n, dtype=dtype, device=device, seed=2, scale=0.05)
    r = rand(m, n, dtype=dtype, device=device, seed=4)
    assert_matches(w8_silu_residual, x, w, s, r, backend=backend, kernels=1)


def test_non_contiguous_activations_and_3d_input(target):
    backend, device = target
    k, n = 48, 20
    w = int8_weight(n, k, device)
    s = rand(n, device=device, seed=2, scale=0.02)
    xt = rand(k, 2, device=device).t()  # (2, k) with strides (1, 2)
    assert_matches(w8_scale, xt, w, s, backend=backend, kernels=1)
    x3 = rand(1, 3, k, device=device)  # (B, T, K): F.linear views it as (3, K)
    cf = assert_matches(w8_scale, x3, w, s, backend=backend, kernels=1)
    assert externs(cf) == []


def test_x_at_weight_kn_layout(target):
    # x @ W with W stored (K, N): the sum runs over dim 1 of (M, K, N)
    backend, device = target
    x = rand(2, 33, device=device)
    w = int8_weight(33, 19, device)
    s = rand(19, device=device, seed=2, scale=0.05)
    assert_matches(lambda x, w, s: (x @ w.to(x.dtype)) * s, x, w, s, backend=backend, kernels=1)


def test_nan_and_inf_propagate(target):
    backend, device = target
    x = rand(2, 32, device=device)
    x[0, 5] = float("nan")
    x[1, 7] = float("inf")
    w = int8_weight(16, 32, device)
    w[3, 7] = 0  # inf * 0 = nan in column 3 of row 1, as in eager
    s = rand(16, device=device, seed=2, scale=0.05)
    assert_matches(w8_scale, x, w, s, backend=backend, kernels=1)


# ---- W4A16: packed nibbles, per-group scale and zero point ------------------------------------

@pytest.mark.parametrize("m", [1, 4])
def test_int4_linear_is_one_kernel(target, m):
    backend, device = target
    ex = int4_linear.example(m=m, k=96, n=37, group=32, device=device)
    cf = assert_matches(ex.fn, *ex.inputs, backend=backend, kernels=1)
    assert externs(cf) == []
    assert cf.kernels[0].name.startswith("fused_dequant_gemv")


def block_of(cf) -> int:
    """The block length of the C++ kernel's float sum (0: one loop over the row)."""
    found = re.search(r"k_block \+= (\d+)", cf.kernels[0].source)
    return int(found.group(1)) if found else 0


@pytest.mark.parametrize("k", [3000, 5000, 20000])
def test_cpp_int8_gemv_sums_in_blocks_four_times_a_float_sums(k):
    """codegen/cpu_plan.py: gcc gives a loop that reads int8 four times a float loop's lanes, so
    the C++ int8 GEMV sums in blocks four times as long (each lane still adds as many values a
    block) and adds its lanes up a quarter as often; a bf16 sum's blocks are twice as long. All of
    them stay as accurate as eager against float64 (assert_matches), blocked or not."""
    x = rand(1, k, seed=4)
    w = int8_weight(37, k, "cpu", seed=5)
    s = rand(37, seed=6, scale=0.02).abs()
    cf = assert_matches(w8_scale, x, w, s, backend="cpp", kernels=1)
    assert "gemv" in cf.kernels[0].name
    assert block_of(cf) == (0 if k <= 4096 else 4096)
    v = rand(3, k, dtype=torch.float32, seed=7)
    assert block_of(assert_matches(lambda t: t.sum(-1), v, backend="cpp")) == 1024
    assert block_of(assert_matches(lambda t: t.sum(-1), v.to(BF16), backend="cpp")) == 2048


def test_int4_pack_unpack_round_trip():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 16, (5, 7), generator=g, dtype=torch.uint8)
    b = torch.randint(0, 16, (5, 7), generator=g, dtype=torch.uint8)
    lo, hi = int4_linear.unpack_uint4(int4_linear.pack_uint4(a, b))
    assert torch.equal(lo, a) and torch.equal(hi, b)


def test_int4_with_bias_and_epilogue(target):
    backend, device = target
    ex = int4_linear.example(m=2, k=64, n=24, group=16, device=device)
    layer = ex.fn
    b = rand(24, device=device, seed=5)
    assert_matches(lambda x: torch.relu(layer(x) + b), *ex.inputs, backend=backend, kernels=1)


def test_int4_is_accurate_against_float64(target):
    """Fused error against a float64 evaluation of the same dequantized weight: no worse than
    eager's (compare() would fail otherwise), and here strictly within a bf16 rounding."""
    backend, device = target
    ex = int4_linear.example(m=4, k=256, n=48, group=64, device=device)
    layer, (x,) = ex.fn, ex.inputs
    cf = fusec.compile(layer, backend=backend)
    with torch.no_grad():
        got = cf(x).double()
        eager = layer(x).double()
        ref = F.linear(x.double(), layer.weight(BF16).double())
    fused_err = (got - ref).abs().max().item()
    eager_err = (eager - ref).abs().max().item()
    assert fused_err <= eager_err + 2 ** -8 * ref.abs().max().item(), (fused_err, eager_err)


# ---- M > 1 on Triton: tensor-core dots ----------------------------------------------------------

def test_triton_gemv_uses_tensor_cores_from_two_rows_on_exact_bf16_products(monkeypatch):
    # M = 1: lane-by-lane products; M = 4 with bf16 activations and int8 weights: tl.dot of bf16
    # tiles (exact, see dot_terms); float32 activations are not bf16 numbers: lanes again.
    # (Packed int4 at M <= 4 is read as 32-bit words instead, test_int4_words.py; switched
    # off here to test the byte path's dots.)
    monkeypatch.setenv("FUSEC_INT4_WORDS", "0")
    backend, device = "triton", TRITON_DEVICE
    k, n = 67, 37
    w = int8_weight(n, k, device)
    s = rand(n, device=device, seed=2, scale=0.02).abs()
    for m, dtype, dot in [(1, BF16, False), (4, BF16, True), (4, torch.float32, False)]:
        x = rand(m, k, dtype=dtype, device=device)
        cf = assert_matches(w8_scale, x, w, s.to(dtype), backend=backend, kernels=1)
        assert ("fusec_dot_bf16(" in cf.kernels[0].source) == dot, (m, dtype)
    ex = int4_linear.example(m=3, k=96, n=37, group=32, device=device)
    cf = assert_matches(ex.fn, *ex.inputs, backend=backend, kernels=1)
    assert cf.kernels[0].source.count("acc += fusec_dot_bf16(") == 2  # low and high nibbles


class Bf16Computed(torch.nn.Module):
    """A plain bf16 weight made a computed one (`w + 0`), so that small_matmul writes a GEMV."""

    def __init__(self, w):
        super().__init__()
        self.register_buffer("w", w)

    def forward(self, x):
        return F.linear(x, self.w + 0)


@pytest.mark.parametrize("k", [256, 264, 1000], ids=lambda k: f"K{k}")
def test_triton_gemv_loop_masks_pairs_and_prefetch(k, monkeypatch):
    """The Triton GEMV's K loop (extensions/quant_gemv/triton_gemv.py): no K mask when BLOCK_K divides K; the
    activations of a packed byte's two nibbles loaded as pairs and split in registers; the M = 1
    kernel prefetching the next chunk, except for a plain int8 weight. Each still matches eager,
    whole chunks or not. (The byte path for packed int4: the word path, which would take these
    shapes, is switched off; test_int4_words.py tests it.)"""
    monkeypatch.setenv("FUSEC_INT4_WORDS", "0")
    backend, device = "triton", TRITON_DEVICE
    int4_k = k if k % 8 == 0 else 256
    for m in (1, 3):
        x = rand(m, k, device=device)
        w = int8_weight(24, k, device)
        s = rand(24, device=device, seed=2, scale=0.02).abs()
        src8 = assert_matches(w8_scale, x, w, s, backend=backend, kernels=1).kernels[0].source
        layer = Bf16Computed(rand(24, k, device=device, seed=4, scale=0.1))
        src16 = assert_matches(layer, x, backend=backend, kernels=1).kernels[0].source
        ex = int4_linear.example(m=m, k=int4_k, n=24, group=int4_k // 4, device=device)
        src4 = assert_matches(ex.fn, *ex.inputs, backend=backend, kernels=1).kernels[0].source
        for src, kk in ((src8, k), (src16, k), (src4, int4_k // 2)):
            block_k = int(re.search(r"BLOCK_K=(\d+)", src).group(1))
            assert ("k_mask" in src) == (kk % block_k != 0), (m, k, block_k)
        assert "tl.split(" in src4 and "tl.split(" not in src8
        assert ("_next = tl.load(" in src4) == ("_next = tl.load(" in src16) == (m == 1)
        assert "_next = tl.load(" not in src8
        # a weight read once is loaded with evict_first in the M = 1 kernel
        assert ('eviction_policy="evict_first"' in src8) == (m == 1)


def test_sixteen_rows_are_a_gemv_on_a_gpu_and_a_library_matmul_on_a_cpu(target):
    backend, device = target
    x = rand(16, 64, device=device)
    w = int8_weight(48, 64, device)
    s = rand(48, device=device, seed=2, scale=0.05)
    cf = assert_matches(w8_scale, x, w, s, backend=backend)
    assert externs(cf) == ([] if device == "cuda" else ["aten.mm.default"])


# ---- what stays a library matmul -------------------------------------------------------------

def test_large_m_keeps_the_library_matmul(target):
    backend, device = target
    x = rand(64, 32, device=device)
    w = int8_weight(16, 32, device)
    s = rand(16, device=device, seed=2, scale=0.05)
    cf = assert_matches(w8_scale, x, w, s, backend=backend)
    assert externs(cf) == ["aten.mm.default"]
    decisions = dict((name, (taken, why)) for name, taken, why in
                     record_of((cf._compiled.last if hasattr(cf, "_compiled")
                                         else cf.last).gm).extensions["small_matmul"])
    taken, why = decisions["mm"]
    assert not taken and "M = 64" in why


def test_plain_weight_keeps_the_library_matmul():
    lin = torch.nn.Linear(32, 16)
    x = torch.randn(1, 32)
    with torch.no_grad():
        cf = assert_matches(lin, x, backend="cpp")
    assert externs(cf) == ["aten.addmm.default"]


@pytest.mark.parametrize("bias", [False, True])
def test_stored_bf16_weight_at_one_row_is_a_gemv_where_measured_faster(monkeypatch, bias):
    """On a GPU (STORED_GEMV_DEVICES) a stored bf16 weight at M = 1 becomes the GEMV, with the
    bias and what follows as its epilogue; here the device list is widened to test it on the CPU
    with the Triton interpreter. At M = 2 the library keeps it."""
    sm = importlib.import_module("fusec.extensions.quant_gemv.small_matmul")
    monkeypatch.setattr(sm, "STORED_GEMV_DEVICES", ("cuda", TRITON_DEVICE))
    lin = torch.nn.Linear(96, 40, bias=bias).to(BF16).to(TRITON_DEVICE)
    fn = lambda x: F.silu(lin(x))  # noqa: E731
    with torch.no_grad():
        cf = assert_matches(fn, rand(1, 96, device=TRITON_DEVICE), backend="triton", kernels=1)
        assert "gemv" in cf.kernels[0].name and externs(cf) == []
        cf2 = assert_matches(fn, rand(2, 96, device=TRITON_DEVICE), backend="triton")
        assert externs(cf2)


def test_explain_states_the_decision_and_the_kernel_reads_like_a_gemv():
    # (the Triton kernel on the device Triton runs on here: a GPU, or the CPU under the interpreter)
    ex = int4_linear.example(m=1, k=64, n=16, group=32, device=TRITON_DEVICE)
    with torch.no_grad():
        text = str(fusec.explain(ex.fn, *ex.inputs, backend="triton"))
    assert "graph after small_matmul" in text
    sm = importlib.import_module("fusec.extensions.quant_gemv.small_matmul")
    small = sm.SMALL_M_GPU if TRITON_DEVICE == "cuda" else sm.SMALL_M  # (16 on a GPU, 8 on CPUs)
    assert f"mm: GEMV: M = 1 <= {small}" in text and "packed nibbles unpacked" in text
    assert "This is a GEMV" in text
    assert "this is where the int4 nibbles are unpacked" in text
    ex = int4_linear.example(m=1, k=64, n=16, group=32)
    x = torch.randn(64, 64, dtype=BF16)
    with torch.no_grad():
        text = str(fusec.explain(ex.fn, x, backend="cpp"))
    assert "library matmul: M = 64 rows > 8" in text


def test_int8_example_runs(target):
    backend, device = target
    ex = int8_linear.example(m=1, k=128, n=40, device=device)
    with torch.no_grad():
        assert_matches(ex.fn, *ex.inputs, backend=backend, kernels=1)


def test_addmm_with_a_matrix_bias_and_a_view_after(target):
    backend, device = target
    x, w = rand(4, 24, device=device), int8_weight(8, 24, device)
    c = rand(4, 8, device=device, seed=6)

    def f(x, w, c):
        return torch.relu(torch.addmm(c, x, w.to(x.dtype).t()).view(2, 2, 8))
    cf = assert_matches(f, x, w, c, backend=backend)
    assert externs(cf) == []


def test_linear_on_a_batch_of_sequences_with_bias(target):
    backend, device = target
    x, w = rand(2, 3, 24, device=device), int8_weight(8, 24, device)
    b = rand(8, device=device, seed=6)
    cf = assert_matches(lambda x, w, b: F.silu(F.linear(x, w.to(x.dtype), b)), x, w, b,
                        backend=backend, kernels=1)
    assert externs(cf) == []


def test_empty_batch_keeps_the_library_matmul(target):
    backend, device = target
    x, w = rand(0, 16, device=device), int8_weight(8, 16, device)
    s = rand(8, device=device, seed=2, scale=0.05)
    cf = assert_matches(w8_scale, x, w, s, backend=backend)
    assert externs(cf) == ["aten.mm.default"]


@pytest.mark.parametrize("backend,fmt", [("cpp", "int8"), ("cpp", "int4"), ("llvm", "int4"),
                                         ("cpp", "awq"), ("cpp", "gptq"), ("cpp", "gptq_g_idx")])
def test_llama_decode_generates_eager_tokens(backend, fmt):
    llama = importlib.import_module("fusec.examples.llama_decode")
    cfg = dict(llama.TINY, layers=1, max_seq=16)
    model = llama.Llama(cfg, fmt).eval()
    eager = llama.generate(model, model, [1, 2, 3], 6)
    cf = fusec.compile(model, backend=backend)
    assert llama.generate(cf, model, [1, 2, 3], 6) == eager
    names = [k.name for k in cf.kernels]
    assert sum("gemv" in n for n in names) >= 6, names  # q, k, v, o, w1, w3, w2, lm_head
    # every linear is a GEMV; the attention products (bmm with the KV cache) stay library calls
    assert not {"aten.mm.default", "aten.addmm.default"} & set(externs(cf))

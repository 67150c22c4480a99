"""passes/refine_views.py: dequantizations written by others reshape computed tensors on the way
(GPTQ's eight nibbles per int32, repeat_interleave'd scales, HQQ's halves); the small-M matmul
still becomes one GEMV that reads the packed weight, on every backend, as accurate as eager.
"""
import pytest
import torch

import fusec
from conftest import assert_matches
from fusec.record import record_of
from fusec.extensions.quant_gemv import refine_views

BF16 = torch.bfloat16
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def packed_along_k(k, n, seed=0):
    """Random 4-bit values q (K, N) and the int32 (K/8, N) that holds them, eight along K per
    word, nibble i in bits 4i..4i+3 (GPTQ's qweight)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    return q, (q.view(k // 8, 8, n) << SHIFTS[None, :, None]).sum(1, dtype=torch.int32)


def group_params(groups, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    scales = (torch.rand(groups, n, generator=g) / 40 + 0.001).to(BF16)
    zeros = torch.randint(0, 16, (groups, n), generator=g, dtype=torch.int32)
    return scales, zeros


def gptq(x, qweight, qzeros, scales, shifts):
    """GPTQ's packing unpacked in plain torch, as AutoGPTQ's torch path does but without its
    g_idx gather (`scales[g_idx]`, which fusec leaves to eager): zero points packed along N too."""
    k, n, groups = qweight.shape[0] * 8, qweight.shape[1], scales.shape[0]
    w = torch.bitwise_and(torch.bitwise_right_shift(qweight.unsqueeze(1), shifts[None, :, None]), 15)
    w = w.reshape(groups, k // groups, n)
    z = torch.bitwise_and(torch.bitwise_right_shift(qzeros.unsqueeze(2), shifts[None, None, :]), 15)
    z = z.reshape(groups, 1, n)
    w = (w - z).to(x.dtype) * scales.unsqueeze(1)
    return x @ w.reshape(k, n)


def repeated_scales(x, qweight, zeros, scales, shifts):
    """Per-group scales and zeros spread over K with repeat_interleave, the weight (K, N) from
    a reshape of the unpacked (K/8, 8, N)."""
    k, n, groups = qweight.shape[0] * 8, qweight.shape[1], scales.shape[0]
    w = ((qweight[:, None, :] >> shifts[None, :, None]) & 15).reshape(k, n)
    s = scales.repeat_interleave(k // groups, dim=0)
    z = zeros.repeat_interleave(k // groups, dim=0)
    return x @ ((w - z).to(x.dtype) * s)


def linear_of_grouped_rows(x, wq, zero, scale):
    """HQQ-style: uint8 (N/2, K) holding two rows per byte, the rows of the weight taken apart
    with a cat, then (w - zero) * scale per group of G values of the flattened weight."""
    n, k = wq.shape[0] * 2, wq.shape[1]
    w = torch.cat([(wq & 0xF0) >> 4, wq & 0x0F], dim=0)
    group = n * k // zero.shape[0]
    w = (w.reshape(-1, group).to(x.dtype) - zero) * scale
    return torch.matmul(x, w.reshape(n, k).t())


def gemv_kernel(cf):
    (gemv,) = [kk for kk in cf.kernels if "gemv" in kk.name]
    return gemv


def decision(cf):
    """small_matmul's one decision for the last call of a compiled function."""
    last = cf._compiled.last if hasattr(cf, "_compiled") else cf.last
    (d,) = record_of(last.gm).extensions["small_matmul"]
    return d


@pytest.mark.parametrize("m", [1, 4])
def test_gptq_weight_is_read_packed_by_one_gemv(target, m):
    backend, device = target
    k, n, groups = 256, 64, 2
    q, qweight = packed_along_k(k, n)
    scales, zeros = group_params(groups, n)
    qzeros = (zeros.view(groups, n // 8, 8) << SHIFTS[None, None, :]).sum(2, dtype=torch.int32)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(BF16)
    args = [t.to(device) for t in (x, qweight, qzeros, scales, SHIFTS)]
    # the dequantization written out, to be sure the function computes what it says
    want = ((q.view(groups, k // groups, n) - zeros[:, None]).to(BF16) * scales[:, None]).reshape(k, n)
    assert torch.equal(gptq(x, qweight, qzeros, scales, SHIFTS), x @ want)
    # two kernels: the zero points unpacked (groups x N, small), and the GEMV, which reads the
    # packed words themselves: no kernel writes a weight-sized tensor (at one row on a GPU, the
    # GEMV's K is cut in chunks and a third kernel adds them up: test_int4_k_words.py)
    split = device == "cuda" and m == 1
    cf = assert_matches(gptq, *args, backend=backend, kernels=3 if split else 2)
    (gemv,) = [kk for kk in cf.kernels if "qweight" in kk.source]
    assert "dequant_gemv" in gemv.name


def test_repeat_interleaved_scales_fold_into_the_gemv(target):
    backend, device = target
    k, n, groups = 512, 96, 8
    _, qweight = packed_along_k(k, n, seed=3)
    scales, zeros = group_params(groups, n, seed=4)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(5)).to(BF16)
    args = [t.to(device) for t in (x, qweight, zeros, scales, SHIFTS)]
    assert_matches(repeated_scales, *args, backend=backend, kernels=1)


def test_non_contiguous_activations(target):
    backend, device = target
    k, n, groups = 256, 64, 4
    _, qweight = packed_along_k(k, n, seed=6)
    scales, zeros = group_params(groups, n, seed=7)
    x = torch.randn(k, 3, generator=torch.Generator().manual_seed(8)).to(BF16).t()
    args = [t.to(device) for t in (x, qweight, zeros, scales, SHIFTS)]
    assert_matches(repeated_scales, *args, backend=backend)


def test_rows_taken_apart_by_a_cat_still_avoid_the_bf16_copy(target):
    """The cat along N is computed (one byte per weight); the dequantization after it, grouped
    across rows and columns, goes into the GEMV instead of a bf16 copy of the weight."""
    backend, device = target
    n, k, group = 64, 128, 32
    g = torch.Generator().manual_seed(9)
    wq = torch.randint(0, 256, (n // 2, k), generator=g, dtype=torch.uint8)
    zero = (torch.rand(n * k // group, 1, generator=g) * 15).to(BF16)
    scale = (torch.rand(n * k // group, 1, generator=g) / 40).to(BF16)
    x = torch.randn(1, k, generator=g).to(BF16)
    args = [t.to(device) for t in (x, wq, zero, scale)]
    cf = assert_matches(linear_of_grouped_rows, *args, backend=backend)
    gemv = gemv_kernel(cf)
    assert "zero" in gemv.source and "scale" in gemv.source


def test_explain_says_how_the_weight_was_split():
    k, n, groups = 512, 96, 8
    _, qweight = packed_along_k(k, n)
    scales, zeros = group_params(groups, n)
    x = torch.randn(1, k).to(BF16)
    cf = fusec.compile(repeated_scales, backend="cpp")
    cf(x, qweight, zeros, scales, SHIFTS)
    d = decision(cf)
    assert d.taken and "(8, 8, 8) x 96" in d.why and "refine_views" in d.why
    assert "refine_views" in str(fusec.explain(repeated_scales, x, qweight, zeros, scales, SHIFTS,
                                               backend="cpp"))


def test_shapes_that_do_not_nest_are_left_alone(target):
    """(6, 8, N) and (8, 6, N) cut K after 8 and after 6: no shape refines both, so the
    dequantized weight is computed as before (stored, then read by the GEMV), and correct."""
    backend, device = target
    k, n = 48, 32
    _, qweight = packed_along_k(k, n, seed=10)

    def regrouped(x, qweight, shifts):
        w = (qweight[:, None, :] >> shifts[None, :, None]) & 15  # (6, 8, N)
        w = w.reshape(8, 6, n).to(x.dtype) * 0.5                   # (8, 6, N)
        return x @ w.reshape(k, n)

    x = torch.randn(1, k, generator=torch.Generator().manual_seed(11)).to(BF16)
    args = [t.to(device) for t in (x, qweight, SHIFTS)]
    cf = assert_matches(regrouped, *args, backend=backend)
    assert "refine_views" not in decision(cf).why


def test_cuts_nest_into_the_finest_shape():
    # (K/8, 8, N) and (groups, G, N) with K = 512, G = 128, N = 96: cut after N, 8N, 128N
    cuts = refine_views._cuts((64, 8, 96)) | refine_views._cuts((4, 128, 96))
    assert refine_views._fine_shape(cuts) == [4, 16, 8, 96]
    assert refine_views._fine_shape(refine_views._cuts((6, 8, 5)) | refine_views._cuts((8, 6, 5))) is None


def test_n_contiguous_weights_get_a_tile_of_neighbouring_columns():
    """GPTQ's words (and x @ W with W (K, N)) are stored N-contiguous: 64 bytes of each K row of
    the tile, 8 KB of weight a tile, no more columns per program than keep 132 SMs busy (measured
    on an H200, extensions/quant_gemv/triton_gemv.py)."""
    from fusec.extensions.quant_gemv.triton_gemv import gemv_blocks_n_major, n_contiguous
    from fusec.ir import Index
    assert gemv_blocks_n_major(1, 8192, 8192, weight_bytes=4) == (1, 16, 128, 4)
    assert gemv_blocks_n_major(1, 8192, 8192, weight_bytes=1) == (1, 32, 256, 4)
    assert gemv_blocks_n_major(4, 8192, 8192, weight_bytes=4) == (4, 32, 64, 4)  # M rows share a tile
    assert gemv_blocks_n_major(1, 1024, 4096, weight_bytes=1)[1] == 4  # 256 programs, not 16
    # (K/G, G/8, 8) x N words: n's stride 1 < the smallest K stride (N); an (N, K) weight is not
    assert n_contiguous(Index(0, (1, 16 * 64, 64, 0)), 1)
    assert not n_contiguous(Index(0, (256, 1)), 1)


def test_a_gemv_of_many_neighbouring_columns_is_not_few_long_rows():
    """At M = 1 a GEMV over an N-contiguous weight looks like a column reduction (64 adjacent
    rows per program: 128 programs for N = 8192); its kernel takes fewer columns per program, so
    neither split_reductions nor fuse_reductions' few-long-rows rule may touch it."""
    import torch.fx as fx
    from fusec.passes.fuse_reductions import spread_columns
    node = fx.Graph().placeholder("gemv")
    assert not spread_columns(node, 8192, 64)
    node.meta.update(gemv_sum().meta)  # what small_matmul says of a GEMV's sum
    assert "spreads them over the GPU itself" in spread_columns(node, 8192, 64)
    assert not spread_columns(node, 8192, 1)  # an (N, K) weight: one row per program already
    assert not spread_columns(node, 200, 64)  # too few columns to spread


def gemv_sum():
    """The sum small_matmul writes for `x @ dequant(w).t()` at M = 1 (K = 64, N = 32)."""
    from fusec.frontend import capture
    from fusec.passes import pipeline, run_pipeline
    x, w = torch.randn(1, 64), torch.randint(-8, 8, (32, 64), dtype=torch.int8)
    upto = [p for p in pipeline() if p.__name__ in ("dce", "small_matmul")]
    gm, _ = run_pipeline(capture(lambda x, w: x @ w.float().t(), (x, w)).gm, upto)
    (node,) = [n for n in gm.graph.nodes if "fusec_matmul" in n.meta]
    return node

"""extensions/quant_gemv/triton_gemv_int4_mma.py: the packed-int4 GEMV for 2 to 16 activation rows on tensor
cores, K split over several programs and their float32 partial sums added by a second kernel.

Every case compiles an int4 linear with backend="triton" (under the interpreter on a CPU, where
tl.dot runs in float32 on the same exact bf16 values), checks that the tensor-core kernel was
generated, and compares with eager against a float64 product (test_int4_words.py's
`check`: the fused error may not exceed eager's by more than a bf16 rounding). The scale is
applied to float32 sums, not rounded into each weight, so one-hot activations still read every
weight back exactly as eager has it. Those tests, and infinities and overflow, are in
test_int4_words.py, parametrized over the kernels (test_dequantized_weights_are_eagers_bit_for_bit,
test_packed_weight_at_any_offset, test_infinities_or_overflow_take_the_exact_way).
"""
import itertools

import pytest
import torch
import torch.nn.functional as F

import fusec
from conftest import GPU, TRITON_DEVICE
from fusec.extensions.quant_gemv import triton_gemv_int4_mma as mma
from test_int4_words import BYTES, MMA, WORDS, Int4, check, rand

pytestmark = pytest.mark.triton  # (all of them: selected by gpu_session.sh's -k triton)
BF16 = torch.bfloat16
DEV = TRITON_DEVICE


@pytest.mark.parametrize("m", [2, 5, 8])
@pytest.mark.parametrize("group", [128, 256])
def test_int4_linear_on_tensor_cores(m, group):
    cf = check(Int4(37, 512, group), rand(m, 512, seed=m), path=MMA)  # odd N: masked columns
    source = cf.kernels[0].source
    assert "_finish" in source and "fusec_dot_bf16_acc" in source
    assert f"M = {m} rows" in source


@pytest.mark.parametrize("zero", ["const", "none"])
def test_constant_or_absent_zero_point(zero):
    cf = check(Int4(24, 256, 128, zero=zero), rand(3, 256, seed=5), path=MMA)
    assert "zneg2 = tl.full(" in cf.kernels[0].source


@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_bias_and_activation_epilogue(act):
    check(Int4(40, 256, 128, bias=True, act=act), rand(4, 256, seed=3), path=MMA)


def test_uneven_shares_of_k(monkeypatch):
    """8 chunks of 128 weights in 3 shares (3 + 3 + 2): the last program's loop is shorter,
    and the finishing kernel adds three partial sums per output."""
    monkeypatch.setattr(mma, "FEW_ROWS_TARGET", 3)  # (6 rows: few, up to FEW_ROWS)
    cf = check(Int4(16, 1024, 128), rand(6, 1024, seed=4), path=MMA)
    assert "SPLIT = 3 shares of K (3 chunk(s)" in cf.kernels[0].source


def test_one_share_when_there_are_programs_enough(monkeypatch):
    monkeypatch.setattr(mma, "FEW_ROWS_TARGET", 1)
    cf = check(Int4(48, 512, 128), rand(5, 512, seed=7), path=MMA)
    assert "SPLIT = 1 shares of K (4 chunk(s)" in cf.kernels[0].source


def test_non_contiguous_activations():
    layer = Int4(24, 256, 128)
    wide = rand(3, 512, seed=8)
    check(layer, wide[:, ::2], path=MMA)  # stride 2 along K
    check(layer, rand(256, 3, seed=9).t(), path=MMA)  # (3, 256) with strides (1, 3)
    check(layer, wide[:, 128:384], path=MMA)  # a window of a longer row


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("FUSEC_INT4_MMA", "0")
    cf = check(Int4(24, 256, 128), rand(3, 256))  # up to 4 rows: the word kernel, and why
    assert "FUSEC_INT4_MMA=0: the tensor-core kernel is switched off" in cf.kernels[0].source
    check(Int4(24, 256, 128), rand(6, 256), path=BYTES)  # more: the byte kernel


def test_small_groups_keep_the_word_kernel_and_say_why():
    cf = check(Int4(24, 256, 64), rand(3, 256), path=WORDS)
    assert "groups of 64 weights: the tensor-core kernel needs chunks of 128" in cf.kernels[0].source
    cf = check(Int4(24, 256, 64), rand(6, 256), path=BYTES)  # more rows: the byte kernel, and why
    assert "M = 6 rows > 4" in cf.kernels[0].source and "groups of 64 weights" in cf.kernels[0].source


def test_older_gpus_keep_the_word_kernel():
    ok, why = mma.tensor_core_arch(75)
    assert not ok and "sm_75 has no bf16 tensor cores" in why
    assert mma.tensor_core_arch(80)[0] and mma.tensor_core_arch(90)[0]


def test_blocks_cover_k_and_n():
    for (n, words), m in itertools.product(
            [(8192, 1024), (4096, 1376), (11008, 512), (37, 64), (16, 16)], [2, 8, 9, 16]):
        block_n, warps, split, per, stages = mma.mma_blocks(m, n, words)
        assert block_n == (64 if m <= mma.FEW_ROWS else 128) or n < 4096
        chunks = words // mma.CHUNK_WORDS
        assert (split - 1) * per < chunks <= split * per  # every chunk in one share, none empty
        assert warps * 16 == block_n or block_n == 16


@pytest.mark.skipif(not GPU, reason="CUDA graphs and the launcher's fast path need a GPU (and "
                                      "real Triton: not TRITON_INTERPRET=1)")
@pytest.mark.parametrize("graphs", [True, False])
def test_two_kernels_under_a_cuda_graph_and_the_fast_launch(graphs):
    """On a GPU the launch takes its partial sums from PyTorch's allocator and starts two
    kernels: captured in a CUDA graph (the buffer recorded with it), or launched call after call
    through the bound fast path. New activations in the same buffer give new results."""
    layer = Int4(4096, 4096, 128, bias=True, act="relu")
    x = rand(16, 4096, seed=21)
    cf = fusec.compile(layer, cuda_graphs=graphs)
    with torch.no_grad():
        for seed in (21, 22, 23):
            x.copy_(rand(16, 4096, seed=seed))
            got, want = cf(x), layer(x)
            ref = torch.relu(F.linear(x.double(), layer.weight(BF16).double(), layer.bias.double()))
            err = (got.double() - ref).abs().max().item()
            assert err <= (want.double() - ref).abs().max().item() + 2 ** -8 * ref.abs().max().item()
    assert MMA in cf.kernels[0].source


def test_a_batched_decode_step_of_the_llama_example():
    """Four sequences of the Llama example's int4 decode step (benchmarks/decode.py --batch):
    every linear multiplies 4 activation rows, in groups of 128, so each is the tensor-core
    kernel; the logits are eager's up to rounding, and the greedy tokens of a few steps are."""
    import importlib
    llama = importlib.import_module("fusec.examples.llama_decode")
    cfg = dict(llama.TINY, dim=256, hidden=256, heads=4, kv_heads=2, layers=1, group=128, batch=4)
    model = llama.Llama(cfg, "int4", device=DEV).eval()
    tok, pos = torch.tensor([3, 10, 17, 24], device=DEV), torch.tensor([0], device=DEV)
    cf = fusec.compile(model, backend="triton")
    with torch.no_grad():
        got, want = cf(tok, pos), model(tok, pos)
    gemvs = [k for k in cf.kernels if "gemv" in k.name]
    assert gemvs and all(MMA in k.source for k in gemvs), [k.name for k in cf.kernels]
    torch.testing.assert_close(got, want, rtol=0, atol=2 ** -6 * want.abs().max().item())
    assert torch.equal(got.argmax(-1), want.argmax(-1))


class Residual(Int4):
    """The int4 linear, then a residual added and the sum scaled: an epilogue that reads a
    second (M, N) tensor, strided (a transposed view)."""

    def forward(self, x, r):
        return (F.linear(x, self.weight(x.dtype)) + r.t()) * 0.5


@pytest.mark.parametrize("n", [1, 3, 130])
def test_residual_epilogue_and_narrow_layers(n):
    layer = Residual(n, 256, 128)
    x, r = rand(5, 256, seed=30), rand(n, 5, seed=31)
    cf = fusec.compile(layer, backend="triton")
    with torch.no_grad():
        got, want = cf(x, r), layer(x, r)
        ref = (F.linear(x.double(), layer.weight(BF16).double()) + r.double().t()) * 0.5
    # (one output column: a weight that does not vary along N keeps the byte kernel, and says so)
    assert any((MMA if n > 1 else BYTES) in k.source for k in cf.kernels), cf.kernels[0].source[:900]
    err = (got.double() - ref).abs().max().item()
    assert err <= (want.double() - ref).abs().max().item() + 2 ** -8 * ref.abs().max().item()


def test_its_cpu_work_counts_as_three_launches():
    """The CUDA-graph rule (fusec/runtime/cuda_graphs.py, cpu_estimate) counts what one call of
    this step costs the CPU: two kernel launches and a torch.empty of the partial sums, three
    launches' worth, where a plain kernel step counts one."""
    from fusec.runtime.cuda_graphs import LAUNCH_US, cpu_estimate
    cf = check(Int4(32, 256, 128), rand(4, 256, seed=9), path=MMA)
    program = getattr(cf, "_compiled", cf).last.program
    launches, externs, us = cpu_estimate(program)
    assert (launches, externs, us) == (3, 0, 3 * LAUNCH_US)


@pytest.mark.skipif(not GPU, reason="CUDA graphs need a GPU (and real Triton)")
def test_a_row_of_tensor_core_layers_is_one_cuda_graph():
    """Eight int4 layers at M = 16, each feeding the next: step by step their CPU work (two
    launches and an allocation each) is longer than their GPU time, so fusec replays them as one
    CUDA graph (measured faster on an H100: 0.0390 ms a layer as one graph, 0.0452 step by
    step), with eager's results."""
    # (8192 x 8192: a GPU floor of ~95 us, above 8 launches' 40 us, below 8 x 3 launches' 120)
    layers = torch.nn.Sequential(*[Int4(8192, 8192, 128, seed=30 + i) for i in range(8)])
    x = rand(16, 8192, seed=31)
    cf = fusec.compile(layers)
    with torch.no_grad():
        for _ in range(3):
            got = cf(x)
        want = layers(x)
    last = getattr(cf, "_compiled", cf).last
    assert last.graph_blocker is None and last.runner is not None, last.graph_blocker
    # (eight layers, each output rounded to bf16 in both: their differences add up)
    rel = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert rel < 3e-2, rel

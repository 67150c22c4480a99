"""passes/pad_matmul.py: big misaligned matmuls are padded to the library's alignment on a GPU.

The pass acts on CUDA only (PAD_DEVICES); on the CPU backends the tests widen PAD_DEVICES and
lower MIN_FLOPS, so the rewrite itself (pads, slices, the contiguous copy) is checked against
eager on every backend, with odd sizes, a transposed weight, NaN and half precision.
"""
import importlib

import pytest
import torch

import fusec
from conftest import assert_matches
from fusec.frontend import capture
from fusec.passes import pipeline, run_pipeline
from fusec.record import record_of

pm = importlib.import_module("fusec.passes.pad_matmul")
aten = torch.ops.aten


@pytest.fixture
def everywhere(monkeypatch):
    monkeypatch.setattr(pm, "PAD_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(pm, "MIN_FLOPS", 0)


def decisions(fn, *inputs):
    """The pass's decisions, and the graph right after it (before fusion groups its nodes)."""
    passes = pipeline()  # (with the registered passes before it)
    upto = passes[:passes.index(pm.pad_matmul) + 1]
    gm, _ = run_pipeline(capture(fn, inputs).gm, upto)
    return record_of(gm).pad_matmul, gm


def lm_head(h, w):  # GPT-2's: hidden @ wte.T, the vocabulary odd
    return (h @ w.t()).float()


@pytest.mark.parametrize("m,k,n", [(6, 16, 37), (5, 12, 16), (8, 16, 16), (3, 9, 11)])
def test_padded_products_match_eager(target, everywhere, m, k, n):
    backend, device = target
    g = torch.Generator().manual_seed(0)
    h = torch.randn(m, k, generator=g).to(device)
    w = torch.randn(n, k, generator=g).to(device)
    h[1, 2] = float("nan")
    taken, gm = decisions(lm_head, h, w)
    (name, padded, why), = taken
    assert padded == bool(m % 4 or k % 4 or n % 4), why
    cf = assert_matches(lm_head, h, w, backend=backend)
    out = cf(h, w)
    assert out.is_contiguous() and out.shape == (m, n)
    if k % 4 or n % 4:  # the weight is padded under its transpose: the library sees the same layout
        pads = [n for n in gm.graph.nodes if n.target is aten.constant_pad_nd.default]
        assert pads and any(u.target is aten.permute.default for p in pads for u in p.users)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_aligns_to_eight(target, everywhere, dtype):
    backend, device = target
    h = torch.randn(4, 24, device=device).to(dtype)
    w = torch.randn(21, 24, device=device).to(dtype)
    (taken,) = decisions(lm_head, h, w)[0]
    assert taken[1] and "N 21 -> 24" in taken[2] and "8 elements" in taken[2]
    assert_matches(lm_head, h, w, backend=backend)


def test_cpu_and_small_products_are_left_alone():
    h, w = torch.randn(6, 16), torch.randn(37, 16)
    (taken,) = decisions(lm_head, h, w)[0]
    assert not taken[1] and "on cpu" in taken[2]


def test_explain_says_what_was_padded(everywhere):
    h, w = torch.randn(6, 16), torch.randn(37, 16)
    text = str(fusec.explain(lm_head, h, w, backend="cpp"))
    assert "padded 1 misaligned matmul(s)" in text and "N 37 -> 40" in text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU case: CUDA only")
def test_gpt2_sized_head_is_padded_on_cuda():
    h = torch.randn(512, 768, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(50257, 768, device="cuda", dtype=torch.bfloat16)
    (taken,) = decisions(lm_head, h, w)[0]
    assert taken[1] and "N 50257 -> 50264" in taken[2]
    assert_matches(lm_head, h, w, backend="triton")

"""Greedy decoding of a fitted model (examples/llama_fit.py): fusec's tokens are eager's for 64
steps, on every backend and weight format.

With random weights the best two logits are near ties, and a test of many greedy steps would
test luck. The fitted model's next tokens win by a margin (at least 4 in logit), so any
difference here is a wrong result, not rounding. The fitting itself is tested first: its causal
forward must be the decode step's function, or the fit would train another model.
"""
import pytest
import torch

import fusec
from conftest import TRITON_DEVICE
from fusec.examples.llama_decode import TINY, Llama, generate
from fusec.examples.llama_fit import PASSAGE, decode_text, encode, fitted, sequence_logits

STEPS = 64
TEXT = PASSAGE[:8 + STEPS]
TOKENS = encode(TEXT)
PROMPT = TOKENS[:8]


@pytest.fixture(scope="module")
def bf16_fit():
    return fitted(dict(TINY), "bf16", text=TEXT)


def test_the_fitting_forward_is_the_decode_step():
    """sequence_logits (all positions at once, a causal mask) equals the decode step's logits at
    every position (one token at a time over the KV cache), in float32."""
    cfg = dict(TINY, max_seq=24)
    model = Llama(cfg, "bf16", dtype=torch.float32).eval()
    ids = torch.tensor(TOKENS[:20])
    params = {n: p.detach() for n, p in model.named_parameters()}
    with torch.no_grad():
        whole = sequence_logits(model, params, ids)
        model.reset()
        steps = torch.cat([model(ids[i:i + 1], torch.tensor([i])) for i in range(len(ids))])
    torch.testing.assert_close(whole, steps, rtol=1e-4, atol=1e-4)


def test_the_fitted_model_continues_the_passage(bf16_fit):
    model, report = bf16_fit
    assert report["margin"] >= 4.0, report
    eager = generate(model, model, PROMPT, STEPS)
    assert decode_text(PROMPT + eager) == TEXT


@pytest.mark.parametrize("backend,fmt", [
    ("cpp", "bf16"), ("cpp", "int8"), ("cpp", "int4"), ("cpp", "awq"),
    ("llvm", "bf16"), ("llvm", "int8"), ("llvm", "int4"), ("llvm", "awq"),
    ("triton", "bf16")])  # (the interpreter takes minutes over 64 steps of int4 kernels)
def test_fusec_decodes_eager_tokens_for_64_steps(backend, fmt):
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    model, _ = fitted(dict(TINY), fmt, device=device, text=TEXT)
    eager = generate(model, model, PROMPT, STEPS)
    cf = fusec.compile(model, backend=backend)
    assert generate(cf, model, PROMPT, STEPS) == eager
    if fmt != "bf16":  # the quantized linears ran as fusec's GEMVs (bf16 ones may stay mm calls)
        assert any("gemv" in k.name for k in cf.kernels), [k.name for k in cf.kernels]

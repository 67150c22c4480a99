"""Why a compiler's greedy tokens can differ from eager's, and a model whose tokens should not.

examples/llama_decode.py has random weights. Its next-token logits are a random projection of a
random hidden state, so the best two logits are usually close: after benchmarks/decode.py's
prompt, at Llama-2-7B widths, they differ by 0.031, about two bf16 steps at their size. Any
compiler that adds the same numbers in another order (a fused kernel, another GEMV, another
cuBLAS algorithm) moves each logit by about that much and so, now and then, picks the other
token; from then on the two sequences differ. This is rounding, not a wrong result, and it says
nothing about the compiler: torch.compile's tokens differ from eager's in the same way
(docs/performance.md, decode). A trained model is different: its next token usually wins by several units of
logit, far more than rounding moves it, so every correct compiler decodes the same text.

This example makes such a model without downloading one. `fit` trains the decode model's weights
on one passage (in float32, a few hundred Adam steps over the whole passage at once: a causal
forward of the same layers, `sequence_logits`), until every next token of the passage wins by
`margin`. The fitted model, run one token at a time over its KV cache as usual, then continues
the passage's first tokens with the rest of it, and fusec must do the same, token for token.
`with_format` quantizes a fitted bf16 model's linears to int8 or int4 afterwards.

    python examples/llama_fit.py     # fits the tiny model, decodes with eager and fusec
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fusec.demo import Example
from fusec.examples.llama_decode import TINY, Linear, Llama, generate, make_linear, rotate_half

PASSAGE = ("fusec captures a model's graph with torch.fx, fuses pointwise and reduction ops, and "
           "emits Triton and C++ kernels that it checks against eager PyTorch.")


def encode(text: str) -> list[int]:
    """Token ids: the text's bytes (every config's vocabulary has at least 256 tokens)."""
    return list(text.encode())


def decode_text(tokens: list[int]) -> str:
    return bytes(t for t in tokens if t < 256).decode(errors="replace")


def rms(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def sequence_logits(model: Llama, p: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """Logits at every position of `tokens` (T,), all positions at once, with the weights `p`
    (float32 copies of model's named parameters). The same layers as Llama.forward's decode step:
    there each position attends to the cached keys of the positions before it, here a causal
    mask does that; the norms' weights are ones and stay so."""
    cfg = model.cfg
    t, heads, kv_heads = len(tokens), cfg["heads"], cfg["kv_heads"]
    hd = cfg["dim"] // heads
    cos, sin = model.cos[:t].float(), model.sin[:t].float()  # (T, head_dim)
    h = p["embed"][tokens]
    for i in range(cfg["layers"]):
        def lin(name, x):
            return x @ p[f"layers.{i}.{name}.weight"].T
        x = rms(h)
        q = lin("wq", x).view(t, heads, hd).transpose(0, 1)  # (heads, T, head_dim)
        k = lin("wk", x).view(t, kv_heads, hd).transpose(0, 1)
        v = lin("wv", x).view(t, kv_heads, hd).transpose(0, 1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        # grouped-query attention: query head j reads key/value head j // (heads / kv_heads)
        k, v = (a.repeat_interleave(heads // kv_heads, dim=0) for a in (k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + lin("wo", attn.transpose(0, 1).reshape(t, -1))
        x = rms(h)
        h = h + lin("w2", F.silu(lin("w1", x)) * lin("w3", x))
    return rms(h) @ p["lm_head.weight"].T


def fit(model: Llama, tokens: list[int], margin: float = 4.0, max_steps: int = 600,
        lr: float = 1e-3) -> dict:
    """Train a bf16 Llama's weights (in place) until each token of `tokens` after the first is
    its predecessors' best next token by at least `margin` in logit, as the bf16 model computes
    it. Returns {"steps", "loss", "margin"}: Adam steps taken, the last loss, the smallest margin."""
    names = [n for n, _ in model.named_parameters() if not n.endswith("norm.weight")]
    params = dict(model.named_parameters())
    p = {n: params[n].detach().float().clone().requires_grad_() for n in names}
    ids = torch.tensor(tokens, device=model.embed.device)
    target = ids[1:]
    opt = torch.optim.Adam(list(p.values()), lr=lr)

    def smallest_margin(logits):
        best = logits.gather(1, target[:, None])[:, 0]
        rest = logits.scatter(1, target[:, None], float("-inf")).amax(1)
        return (best - rest).min().item()

    step, loss = 0, float("nan")
    for step in range(1, max_steps + 1):
        logits = sequence_logits(model, p, ids)[:-1]
        loss_t = F.cross_entropy(logits, target)
        opt.zero_grad()
        loss_t.backward()
        opt.step()
        loss = loss_t.item()
        if step % 20 == 0 or step == max_steps:
            with torch.no_grad():  # the margin of the weights as bf16 rounds them
                q = {n: v.to(torch.bfloat16).float() for n, v in p.items()}
                if smallest_margin(sequence_logits(model, q, ids)[:-1]) >= margin:
                    break
    with torch.no_grad():
        for n, v in p.items():
            params[n].copy_(v.to(params[n].dtype))
        got = smallest_margin(sequence_logits(model, {n: v.float() for n, v in params.items()},
                                              ids)[:-1])
    return {"steps": step, "loss": loss, "margin": got}


def with_format(model: Llama, fmt: str) -> Llama:
    """The fitted bf16 model with every linear layer in `fmt` ("bf16", "int8", "int4"): the same
    quantization as Llama(cfg, fmt) applies to random weights. Modifies and returns `model`."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Linear):
                setattr(module, name, make_linear(child.weight.data, fmt, model.cfg["group"]))
    return model


def fitted(cfg: dict, fmt: str = "bf16", device: str = "cpu", text: str = PASSAGE,
           **fit_options) -> tuple[Llama, dict]:
    """A Llama of config `cfg` fitted to `text`, then quantized to `fmt`; and fit's report."""
    cfg = dict(cfg, max_seq=max(cfg["max_seq"], len(encode(text))))
    model = Llama(cfg, "bf16", device=device)
    report = fit(model, encode(text), **fit_options)
    return with_format(model, fmt).eval(), report


def example(fmt: str = "bf16", device: str = "cpu", **sizes) -> Example:
    """One decode step of the tiny Llama fitted to the passage (`fusec explain` on this file)."""
    model, _ = fitted(dict(TINY, **sizes), fmt, device=device)
    tok = torch.tensor(encode(PASSAGE)[:1], device=device)
    return Example("llama_fit", model, (tok, torch.tensor([0], device=device)),
                   f"one decode step of a {model.cfg['layers']}-layer Llama fitted to a passage, "
                   f"{fmt} weights")


if __name__ == "__main__":
    import fusec
    tokens = encode(PASSAGE)
    prompt, steps = tokens[:8], len(tokens) - 8
    for fmt in ("bf16", "int8", "int4"):
        model, report = fitted(dict(TINY), fmt)
        eager = generate(model, model, prompt, steps)
        fused = generate(fusec.compile(model), model, prompt, steps)
        print(f"{fmt}: fitted in {report['steps']} steps (smallest margin {report['margin']:.2f})")
        print(f"  eager: {decode_text(prompt + eager)!r}")
        print(f"  fusec: {decode_text(prompt + fused)!r}  {'same' if fused == eager else 'DIFFERENT'}")

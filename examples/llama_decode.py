"""A small Llama-style model decoding one token at a time, with bf16, int8, packed int4, AWQ or GPTQ weights.

Plain torch, random weights: RMSNorm, rotary position embeddings, grouped-query attention (fewer
key/value heads than query heads) over a *static* KV cache (a buffer of max_seq positions written
in place at `pos`, so every step has the same shapes), and a SwiGLU MLP. One decode step reads
every weight once for one token: its time is the weight bytes over the memory bandwidth, which is
why int8 (examples/int8_linear.py) and int4 (examples/int4_linear.py) weights pay off here, if
each quantized linear is one kernel that reads the quantized bytes (extensions/quant_gemv/small_matmul.py).
"awq" stores each weight as AWQ checkpoints do (examples/awq_linear.py: eight nibbles along N per
int32, unpacked in plain torch), "gptq" as GPTQ checkpoints do (examples/gptq_linear.py: eight
nibbles along K per int32, the words N-contiguous), "gptq_g_idx" the same read through g_idx as
AutoGPTQ's torch path reads it.

`generate` runs a prompt and then greedy decoding, one compiled step per token;
benchmarks/decode.py times it (tokens/s) against eager and torch.compile.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fusec.demo import Example, run_example
from fusec.examples.awq_linear import AWQLinear
from fusec.examples.gptq_linear import GPTQLinear
from fusec.examples.int4_linear import Int4Linear
from fusec.examples.int8_linear import Int8Linear


class Linear(torch.nn.Module):
    """A plain bf16 linear layer without bias (the baseline weight format)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x):
        return F.linear(x, self.weight)


def make_linear(weight: torch.Tensor, fmt: str, group: int) -> torch.nn.Module:
    if fmt == "bf16":
        return Linear(weight)
    if fmt == "int8":
        return Int8Linear(weight)
    if fmt == "int4":
        return Int4Linear(weight, group)
    if fmt == "awq":  # AWQ's layout: eight nibbles along N per int32, x @ W with W (K, N)
        return AWQLinear(weight.t().contiguous(), group)
    if fmt in ("gptq", "gptq_g_idx"):  # GPTQ's layout: eight nibbles along K per int32, x @ W
        # with W (K, N); gptq_g_idx reads zero points and scales through g_idx, as AutoGPTQ does
        return GPTQLinear(weight.t().contiguous(), group, g_idx=fmt == "gptq_g_idx")
    raise ValueError(f"weight format {fmt!r}: use 'bf16', 'int8', 'int4', 'awq', 'gptq' or 'gptq_g_idx'")


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight.to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Block(torch.nn.Module):
    def __init__(self, cfg: dict, fmt: str, gen: torch.Generator, dtype, device):
        super().__init__()
        dim, heads, kv_heads, hidden = cfg["dim"], cfg["heads"], cfg["kv_heads"], cfg["hidden"]
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads

        def w(n, k):
            return (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(dtype).to(device)
        g = cfg["group"]
        self.wq = make_linear(w(dim, dim), fmt, g)
        self.wk = make_linear(w(kv_heads * self.head_dim, dim), fmt, g)
        self.wv = make_linear(w(kv_heads * self.head_dim, dim), fmt, g)
        self.wo = make_linear(w(dim, dim), fmt, g)
        self.w1 = make_linear(w(hidden, dim), fmt, g)
        self.w3 = make_linear(w(hidden, dim), fmt, g)
        self.w2 = make_linear(w(dim, hidden), fmt, cfg["group"])
        self.attn_norm, self.mlp_norm = RMSNorm(dim).to(device), RMSNorm(dim).to(device)
        shape = (cfg["batch"], kv_heads, cfg["max_seq"], self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device))

    def forward(self, h, pos, cos, sin, mask):
        b = h.shape[0]
        x = self.attn_norm(h)
        q = self.wq(x).view(b, self.heads, 1, self.head_dim)
        k = self.wk(x).view(b, self.kv_heads, 1, self.head_dim)
        v = self.wv(x).view(b, self.kv_heads, 1, self.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        self.k_cache.index_copy_(2, pos, k)  # the static KV cache: write this position
        self.v_cache.index_copy_(2, pos, v)
        # grouped-query attention: the query heads of a group share one key/value head
        group = self.heads // self.kv_heads
        qg = q.view(b, self.kv_heads, group, self.head_dim)
        scores = (qg @ self.k_cache.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~mask, float("-inf"))  # positions after pos are empty
        attn = torch.softmax(scores.float(), dim=-1).to(h.dtype) @ self.v_cache
        h = h + self.wo(attn.reshape(b, -1))
        x = self.mlp_norm(h)
        return h + self.w2(F.silu(self.w1(x)) * self.w3(x))

    def prefill(self, h, pos, cos, sin, mask):
        """A prompt of T tokens at once: h (B, T, dim) at positions `pos` (T,), each query seeing
        the cache up to its own position (`mask` (T, max_seq)). T is a prompt's length, a new
        one on almost every request: the size a shape family keeps a symbol (docs/dynamic.md)."""
        b, t = h.shape[0], h.shape[1]
        x = self.attn_norm(h)
        q = self.wq(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        group = self.heads // self.kv_heads
        qg = q.reshape(b, self.kv_heads, group * t, self.head_dim)
        scores = (qg @ self.k_cache.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores.view(b, self.kv_heads, group, t, -1).masked_fill(~mask, float("-inf"))
        attn = torch.softmax(scores.float(), dim=-1).to(h.dtype).view(b, self.kv_heads, group * t, -1)
        attn = (attn @ self.v_cache).view(b, self.heads, t, self.head_dim)
        h = h + self.wo(attn.transpose(1, 2).reshape(b, t, -1))
        x = self.mlp_norm(h)
        return h + self.w2(F.silu(self.w1(x)) * self.w3(x))


class Prefill(torch.nn.Module):
    """forward(tokens (B, T) int64) -> logits (B, vocab) of the prompt's last position, after
    writing the prompt's keys and values into `model`'s cache (positions 0 .. T-1); decoding then
    goes on with `model` itself from position T."""

    def __init__(self, model: "Llama"):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        m = self.model
        t = tokens.shape[1]
        pos = m.positions[:t]
        h = F.embedding(tokens, m.embed)
        cos, sin = m.cos[:t].view(1, 1, t, -1), m.sin[:t].view(1, 1, t, -1)
        mask = (m.positions.view(1, -1) <= pos.view(-1, 1)).view(1, 1, 1, t, -1)
        for layer in m.layers:
            h = layer.prefill(h, pos, cos, sin, mask)
        return m.lm_head(m.norm(h[:, -1])).float()


class Llama(torch.nn.Module):
    """forward(token (B,) int64, pos (1,) int64) -> logits (B, vocab) for that one position."""

    def __init__(self, cfg: dict, fmt: str = "bf16", dtype=torch.bfloat16, device="cpu", seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.cfg = cfg
        dim, vocab = cfg["dim"], cfg["vocab"]
        self.embed = torch.nn.Parameter((torch.randn(vocab, dim, generator=gen)).to(dtype).to(device),
                                        requires_grad=False)
        self.layers = torch.nn.ModuleList(Block(cfg, fmt, gen, dtype, device)
                                          for _ in range(cfg["layers"]))
        self.norm = RMSNorm(dim).to(device)
        self.lm_head = make_linear((torch.randn(vocab, dim, generator=gen) / math.sqrt(dim))
                                   .to(dtype).to(device), fmt, cfg["group"])
        hd = dim // cfg["heads"]
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        ang = torch.outer(torch.arange(cfg["max_seq"], dtype=torch.float64), inv)
        ang = torch.cat([ang, ang], dim=-1)
        self.register_buffer("cos", ang.cos().to(dtype).to(device))
        self.register_buffer("sin", ang.sin().to(dtype).to(device))
        self.register_buffer("positions", torch.arange(cfg["max_seq"], device=device))

    def forward(self, token, pos):
        h = F.embedding(token, self.embed)
        cos, sin = self.cos[pos].view(1, 1, 1, -1), self.sin[pos].view(1, 1, 1, -1)
        mask = (self.positions <= pos).view(1, 1, 1, -1)
        for layer in self.layers:
            h = layer(h, pos, cos, sin, mask)
        return self.lm_head(self.norm(h)).float()

    def reset(self):
        for layer in self.layers:
            layer.k_cache.zero_()
            layer.v_cache.zero_()


TINY = dict(dim=64, heads=4, kv_heads=2, hidden=160, layers=2, vocab=256, max_seq=32, group=32,
            batch=1)
# Llama-2-7B's layer shapes (4096 wide, 11008 hidden, 32 heads; here 8 key/value heads), fewer layers
REAL = dict(dim=4096, heads=32, kv_heads=8, hidden=11008, layers=4, vocab=32000, max_seq=256,
            group=128, batch=1)


def generate(step, model: Llama, prompt: list[int], steps: int) -> list[int]:
    """Feed the prompt one token at a time, then greedily decode `steps` tokens with `step`
    (the model itself, or a compiled version of it). Returns the generated tokens."""
    device = model.embed.device
    model.reset()
    out, token = [], None
    with torch.no_grad():
        for i in range(len(prompt) + steps - 1):
            tok = torch.tensor([prompt[i] if i < len(prompt) else token], device=device)
            logits = step(tok, torch.tensor([i], device=device))
            token = int(logits[0].argmax())
            if i >= len(prompt) - 1:
                out.append(token)
    return out


def example(fmt: str = "int8", device: str = "cpu", **sizes) -> Example:
    cfg = dict(TINY, **sizes)
    model = Llama(cfg, fmt, device=device).eval()
    tok = torch.tensor([3], device=device)
    pos = torch.tensor([0], device=device)
    return Example("llama_decode", model, (tok, pos),
                   f"one decode step of a {cfg['layers']}-layer Llama with {fmt} weights")


SMALL = dict()


if __name__ == "__main__":
    import fusec
    for fmt in ("bf16", "int8", "int4"):
        model = Llama(TINY, fmt).eval()
        eager = generate(model, model, [1, 2, 3, 4], 16)
        fused = generate(fusec.compile(model), model, [1, 2, 3, 4], 16)
        print(f"{fmt}: eager {eager}\n      fusec {fused}  {'same' if eager == fused else 'DIFFERENT'}")

"""A nanoGPT-style transformer block: causal self-attention written out (matmul, masked_fill,
softmax, matmul) and an MLP, each behind a LayerNorm and a residual. Matmuls are extern calls; the
pointwise and reduction work between two matmuls fuses into at most one kernel.

`variant="sdpa"` uses torch's scaled_dot_product_attention instead of the explicit attention.
"""
import math

import torch
import torch.nn.functional as F

from fusec.demo import Example, run_example


class Block(torch.nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, sdpa: bool = False):
        super().__init__()
        self.n_head, self.sdpa = n_head, sdpa
        self.ln_1 = torch.nn.LayerNorm(n_embd)
        self.c_attn = torch.nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = torch.nn.Linear(n_embd, n_embd)
        self.ln_2 = torch.nn.LayerNorm(n_embd)
        self.c_fc = torch.nn.Linear(n_embd, 4 * n_embd)
        self.mlp_proj = torch.nn.Linear(4 * n_embd, n_embd)
        mask = torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size)
        self.register_buffer("bias", mask)

    def attn(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


def example(batch: int = 2, seq: int = 64, n_embd: int = 128, n_head: int = 4,
            device: str = "cpu", dtype: torch.dtype = torch.float32, variant: str = "explicit"):
    torch.manual_seed(0)
    model = Block(n_embd, n_head, seq, sdpa=variant == "sdpa").to(device=device, dtype=dtype).eval()
    x = torch.randn(batch, seq, n_embd, device=device, dtype=dtype)
    return Example(f"gpt2_block[{variant}]", model, (x,),
                   "a transformer block: fused kernels between extern matmuls")


SMALL = dict(batch=1, seq=16, n_embd=32, n_head=2)  # `fusec ... --small`: sizes for quick looks and tests

if __name__ == "__main__":
    with torch.no_grad():
        run_example(example())
        run_example(example(variant="sdpa"), show_source=False)

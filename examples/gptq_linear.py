"""GPTQ's 4-bit weights: eight nibbles along K in each int32, the words N-contiguous, unpacked in
plain torch.

Checkpoints quantized with GPTQ store a linear layer's (K, N) weight as
  * qweight (K / 8, N) int32: word [i, n] holds rows 8i .. 8i + 7 of column n, row 8i + t in
    bits 4t .. 4t + 3,
  * qzeros (K / G, N / 8) int32: one 4-bit zero point per group of G rows of K and column, eight
    columns to a word (along N, unlike the weight),
  * scales (K / G, N): one scale per group and column.
The plain-torch dequantization (what a model runs without GPTQ's own CUDA kernels: AutoGPTQ's
torch path for weights quantized in order) shifts the nibbles out of each word, narrows them to
int8, and subtracts and scales per group:

    w = ((qweight[:, None, :] >> [0, 4, ..., 28]).to(int8) & 15).view(K / G, G, N)
    z = ((qzeros[:, :, None] >> [0, 4, ..., 28]).to(int8) & 15).view(K / G, 1, N)
    y = x @ (scales[:, None, :] * (w - z)).view(K, N)

fusec turns this into one GEMV over the packed words: extensions/quant_gemv/refine_views.py computes the weight
as (K/G, G/8, 8, N) so that no reshape is left, and extensions/quant_gemv/small_matmul.py makes the product a
reduction over K with the unpacking as its prologue. On a GPU at one activation row,
passes/split_reductions.py cuts K into chunks of whole groups, each read by a kernel that
applies zero point and scale once per group (extensions/quant_gemv/triton_gemv_int4_k_words.py), and a small
kernel adds the chunks up. The zero points (a (K/G, N) tensor, 1/G of the weight) are unpacked
by a small kernel first. `python examples/gptq_linear.py` prints the bytes moved and GB/s.
"""
import torch

from fusec.demo import Example
from fusec.examples.awq_linear import quantize_along_k

SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble t of a word sits at bits 4t .. 4t + 3


def pack_along(q: torch.Tensor, dim: int) -> torch.Tensor:
    """Values 0..15 -> int32 words of eight, packed along `dim` (0: rows, GPTQ's qweight; 1:
    columns, its qzeros), value t of a word in nibble t."""
    q = q.to(torch.int32)
    shifts = SHIFTS.to(q.device)
    if dim == 0:
        return (q.view(-1, 8, q.shape[1]) << shifts[None, :, None]).sum(1, dtype=torch.int32)
    return (q.view(q.shape[0], -1, 8) << shifts).sum(2, dtype=torch.int32)


def quantize_gptq(w: torch.Tensor, group: int):
    """Per-group quantization of w (K, N) along K (examples/awq_linear.py's quantize_along_k:
    rounding to nearest, not GPTQ's error-correcting search; the layout is what matters here),
    packed as GPTQ packs: qweight (K / 8, N), qzeros (K / G, N / 8) int32 and scales (K / G, N)."""
    q, zero, scale = quantize_along_k(w, group)
    return pack_along(q, 0), pack_along(zero, 1), scale


class GPTQLinear(torch.nn.Module):
    """y = x @ W with W (K, N) stored in GPTQ's packed format, dequantized in plain torch.

    `g_idx=True` dequantizes as AutoGPTQ's current torch path does: each row k of the weight takes
    the zero point and scale of group g_idx[k] (`scales[g_idx]`), which checkpoints store for act
    order (rows quantized in another order); here g_idx[k] = k // G, a checkpoint quantized in
    order. fusec reads both forms packed (its kernel checks g_idx per group when it runs)."""

    def __init__(self, weight_kn: torch.Tensor, group: int = 128, g_idx: bool = False):
        super().__init__()
        self.k, self.n = weight_kn.shape
        self.group = group
        qweight, qzeros, scales = quantize_gptq(weight_kn, group)
        self.register_buffer("qweight", qweight)
        self.register_buffer("qzeros", qzeros)
        self.register_buffer("scales", scales)
        self.register_buffer("wf", SHIFTS.to(weight_kn.device))
        self.register_buffer("g_idx", (torch.arange(self.k, device=weight_kn.device) // group)
                             .int() if g_idx else None)

    def forward(self, x):
        groups = self.k // self.group
        zeros = torch.bitwise_right_shift(self.qzeros.unsqueeze(2).expand(-1, -1, 8),
                                          self.wf.view(1, 1, 8)).to(torch.int8)
        zeros = torch.bitwise_and(zeros, 15)
        weight = torch.bitwise_right_shift(self.qweight.unsqueeze(1).expand(-1, 8, -1),
                                           self.wf.view(1, 8, 1)).to(torch.int8)
        weight = torch.bitwise_and(weight, 15)
        if self.g_idx is not None:
            g = self.g_idx.long()
            zeros = zeros.reshape(groups, self.n)
            weight = self.scales[g] * (weight.reshape(self.k, self.n) - zeros[g])
            return torch.matmul(x, weight)
        weight = weight.reshape(groups, self.group, self.n)
        weight = self.scales.reshape(groups, 1, self.n) * (weight - zeros.reshape(groups, 1, self.n))
        return torch.matmul(x, weight.reshape(self.k, self.n))

    def dequantized(self) -> torch.Tensor:
        """W (K, N) in float64, from the packed tensors by another route than `forward` (masks
        on the words, stacked): the reference the tests and benchmarks compare with."""
        def nibbles(words, dim):
            return torch.stack([(words >> (4 * t)) & 15 for t in range(8)], dim + 1).flatten(dim, dim + 1)
        g = self.group
        zeros = nibbles(self.qzeros, 1).double().repeat_interleave(g, 0)
        return (nibbles(self.qweight, 0).double() - zeros) * self.scales.double().repeat_interleave(g, 0)


def example(m: int = 1, k: int = 4096, n: int = 4096, group: int = 128, device: str = "cpu",
            dtype: torch.dtype = torch.float16) -> Example:
    torch.manual_seed(0)
    weight = torch.randn(k, n, dtype=dtype, device=device) / k ** 0.5
    layer = GPTQLinear(weight, group).to(device)
    x = torch.randn(m, k, dtype=dtype, device=device)
    # the zero points unpacked (one kernel, (K/G, N)), and the GEMV; on a GPU at M = 1 the GEMV
    # is cut along K: its chunks, then their sum
    return Example("gptq_linear", layer, (x,),
                   f"GPTQ W4A16 linear, M = {m}: the packed words read once by one GEMV",
                   expect_kernels=3 if device == "cuda" and m == 1 else 2)


SMALL = dict(k=256, n=192, group=32)


if __name__ == "__main__":
    from fusec.examples.int8_linear import main
    main(example, lambda layer: 4 * (layer.qweight.numel() + layer.qzeros.numel())
         + 2 * layer.scales.numel())

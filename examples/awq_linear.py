"""AWQ's 4-bit weights: eight nibbles along N in each int32, unpacked in plain torch.

Checkpoints quantized with AWQ store a linear layer's (K, N) weight as
  * qweight (K, N / 8) int32: each word holds the 4-bit weights of eight neighbouring output
    columns, in the interleaved order 0 2 4 6 1 3 5 7 (column 8j + 2 sits in bits 4..7),
  * qzeros (K / G, N / 8) int32: one 4-bit zero point per group of G rows of K, packed the same way,
  * scales (K / G, N): one scale per group and column.
The plain-torch dequantization (what a model runs without AWQ's own CUDA kernels) shifts all
eight nibbles out of each word, puts the columns back in order with a gather by a table of
positions, and subtracts and scales per group:

    w = (qweight[:, :, None] >> [0, 4, ..., 28]).view(K, N)[:, order] & 15
    w = (w - zeros.repeat_interleave(G, 0)) * scales.repeat_interleave(G, 0)
    y = x @ w

fusec turns this into one GEMV kernel that reads the packed words once: passes/constant_gathers.py
moves the reordering onto the shift amounts (the table is a constant), extensions/quant_gemv/refine_views.py
computes the weight as (K/G, G, N/8, 8) so that no reshape is left, and extensions/quant_gemv/small_matmul.py makes
the product a reduction over K with the unpacking as its prologue. Only the zero points (a
(K/G, N) tensor, 1/G of the weight) are unpacked by two small kernels first.
`python examples/awq_linear.py` prints the bytes moved and GB/s.
"""
import torch

from fusec.demo import Example

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # the column whose nibble sits at bits 4i..4i+3 of a word
AWQ_UNDO = [0, 4, 1, 5, 2, 6, 3, 7]  # the nibble that holds column i


def pack_awq(q: torch.Tensor) -> torch.Tensor:
    """(R, N) values 0..15 -> (R, N / 8) int32, eight columns per word in AWQ's order."""
    r, n = q.shape
    cols = q.to(torch.int32).view(r, n // 8, 8)[:, :, AWQ_ORDER]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=q.device)
    return (cols << shifts).sum(-1, dtype=torch.int32)


def quantize_along_k(w: torch.Tensor, group: int):
    """Asymmetric per-group quantization of w (K, N) along K (rounding to nearest):
    q = round(w / scale) + zero in 0..15. Returns q (K, N), zero (K / G, N) and scale (K / G, N)
    in w's dtype."""
    k, n = w.shape
    g = w.float().view(k // group, group, n)
    lo, hi = g.amin(1), g.amax(1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = (torch.round(g / scale[:, None]) + zero[:, None]).clamp(0, 15).view(k, n)
    return q, zero, scale.to(w.dtype)


def quantize_awq(w: torch.Tensor, group: int):
    """quantize_along_k, packed as AWQ packs: qweight (K, N / 8), qzeros (K / G, N / 8) int32 and
    scales (K / G, N)."""
    q, zero, scale = quantize_along_k(w, group)
    return pack_awq(q), pack_awq(zero), scale


class AWQLinear(torch.nn.Module):
    """y = x @ W with W (K, N) stored in AWQ's packed format, dequantized in plain torch."""

    def __init__(self, weight_kn: torch.Tensor, group: int = 128):
        super().__init__()
        self.k, self.n = weight_kn.shape
        self.group = group
        qweight, qzeros, scales = quantize_awq(weight_kn, group)
        self.register_buffer("qweight", qweight)
        self.register_buffer("qzeros", qzeros)
        self.register_buffer("scales", scales)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """(R, N / 8) words -> (R, N) nibbles 0..15, columns in order."""
        shifts = torch.arange(0, 32, 4, device=packed.device)
        nibbles = torch.bitwise_right_shift(packed[:, :, None], shifts[None, None, :]).to(torch.int8)
        nibbles = nibbles.view(packed.shape[0], -1)
        order = torch.arange(nibbles.shape[-1], dtype=torch.int32, device=packed.device)
        order = order.view(-1, 8)[:, AWQ_UNDO].view(-1)
        return torch.bitwise_and(nibbles[:, order], 15)

    def weight(self) -> torch.Tensor:
        zeros = self.unpack(self.qzeros).repeat_interleave(self.group, dim=0)
        scales = self.scales.repeat_interleave(self.group, dim=0)
        return (self.unpack(self.qweight) - zeros) * scales

    def forward(self, x):
        return torch.matmul(x, self.weight())

    def dequantized(self) -> torch.Tensor:
        """W (K, N) in float64, from the packed tensors by another route than `weight` (bit masks
        on the words, the order undone by indexing): the reference the benchmarks compare with."""
        def nibbles(words):
            cols = torch.stack([(words >> (4 * i)) & 15 for i in range(8)], -1)
            return cols[:, :, AWQ_UNDO].reshape(words.shape[0], -1).double()
        g = self.group
        zeros = nibbles(self.qzeros).repeat_interleave(g, 0)
        return (nibbles(self.qweight) - zeros) * self.scales.double().repeat_interleave(g, 0)


def example(m: int = 1, k: int = 4096, n: int = 4096, group: int = 128, device: str = "cpu",
            dtype: torch.dtype = torch.float16) -> Example:
    torch.manual_seed(0)
    weight = torch.randn(k, n, dtype=dtype, device=device) / k ** 0.5
    layer = AWQLinear(weight, group).to(device)
    x = torch.randn(m, k, dtype=dtype, device=device)
    # the GEMV, and the zero points unpacked (a shift kernel and a mask kernel, (K/G, N))
    return Example("awq_linear", layer, (x,),
                   f"AWQ W4A16 linear, M = {m}: the packed words read once by one GEMV",
                   expect_kernels=3)


SMALL = dict(k=256, n=192, group=32)


if __name__ == "__main__":
    from fusec.examples.int8_linear import main
    main(example, lambda layer: 4 * (layer.qweight.numel() + layer.qzeros.numel())
         + 2 * layer.scales.numel())

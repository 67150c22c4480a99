"""Packed int4 weights (W4A16): two 4-bit weights per byte, one scale and zero point per group of
G weights along K, computed in plain torch, then multiplied as a linear layer.

Packing is the trick from the crash course this project grew from: `(a & 0x0F) | ((b & 0x0F) << 4)`
puts two 4-bit values in one byte, and `p & 0x0F`, `p >> 4` take them out again. Here each byte
holds the weights of columns 2j (low nibble) and 2j + 1 (high nibble), so unpacking is
`torch.stack([lo, hi], -1).view(N, K)`. Dequantization is `(q - zero) * scale` per group, written
on the packed bytes viewed as (N, K / G, G / 2) so that the group's scale broadcasts.

fusec sees that the matmul's weight is computed from packed bytes and turns the small-M product
into one GEMV kernel (extensions/quant_gemv/small_matmul.py): it reads each packed byte once, unpacks both nibbles
in registers, dequantizes them and multiplies them by the matching activations, a quarter of the
bytes of a bf16 weight. `python examples/int4_linear.py` prints the bytes moved and GB/s.
"""
import torch
import torch.nn.functional as F

from fusec.demo import Example


def pack_uint4(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two uint8 tensors of values 0..15 -> one byte each: a in the low nibble, b in the high."""
    return (a & 0x0F) | ((b & 0x0F) << 4)


def unpack_uint4(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of pack_uint4: (low nibble, high nibble)."""
    return p & 0x0F, p >> 4


def quantize_int4(w: torch.Tensor, group: int):
    """Asymmetric per-group quantization of w (N, K): q = round(w / scale) + zero, q in 0..15.
    Returns the packed bytes (N, K / 2) uint8 and scale, zero (N, K / group)."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(0, 15).to(torch.uint8)
    q = q.view(n, k)
    return pack_uint4(q[:, 0::2], q[:, 1::2]), scale.to(w.dtype), zero.to(w.dtype)


class Int4Linear(torch.nn.Module):
    """y = x @ dequant(packed).T (+ bias), dequant = (nibble - zero) * scale per group."""

    def __init__(self, weight: torch.Tensor, group: int = 128, bias: torch.Tensor | None = None):
        super().__init__()
        self.n, self.k = weight.shape
        self.group = group
        packed, scale, zero = quantize_int4(weight, group)
        self.register_buffer("packed", packed)
        self.register_buffer("scale", scale)
        self.register_buffer("zero", zero)
        self.register_buffer("bias", bias)

    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        p = self.packed.view(self.n, self.k // self.group, self.group // 2)
        lo, hi = unpack_uint4(p)
        zero, scale = self.zero[..., None].to(dtype), self.scale[..., None].to(dtype)
        lo = (lo.to(dtype) - zero) * scale
        hi = (hi.to(dtype) - zero) * scale
        return torch.stack([lo, hi], dim=-1).view(self.n, self.k)

    def forward(self, x):
        return F.linear(x, self.weight(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


def example(m: int = 1, k: int = 4096, n: int = 4096, group: int = 128, device: str = "cpu",
            dtype: torch.dtype = torch.bfloat16) -> Example:
    torch.manual_seed(0)
    weight = torch.randn(n, k, dtype=dtype, device=device) / k ** 0.5
    layer = Int4Linear(weight, group).to(device)
    x = torch.randn(m, k, dtype=dtype, device=device)
    return Example("int4_linear", layer, (x,),
                   f"W4A16 linear, M = {m}: packed nibbles unpacked and dequantized in registers",
                   expect_kernels=1)


SMALL = dict(k=256, n=192, group=32)


if __name__ == "__main__":
    from fusec.examples.int8_linear import main
    main(example, lambda layer: layer.packed.numel() + 2 * (layer.scale.numel() + layer.zero.numel()))

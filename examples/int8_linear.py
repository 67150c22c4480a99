"""Weight-only int8 quantization (W8A16): a linear layer whose weight is stored as int8 with one
bfloat16 scale per output channel, computed as `F.linear(x, w.to(bf16)) * scale`.

Decoding one token multiplies one activation row by the whole weight, so the time is the
weight's bytes over the memory bandwidth, and int8 halves those bytes against bf16. Eager PyTorch
(and a compiler that keeps the library matmul) first writes a bf16 copy of the weight, then reads
it again: slower than not quantizing at all. fusec rewrites the small-M matmul as a GEMV
reduction (extensions/quant_gemv/small_matmul.py): one kernel reads the int8 weight once, converts it in
registers (the prologue), sums over K and multiplies by the scale (the epilogue).

`python examples/int8_linear.py` prints the bytes each version moves and the bandwidth it reached.
"""
import torch
import torch.nn.functional as F

import fusec
from fusec.demo import Example, run_example
from fusec.timing import median_ms


def quantize_int8(w: torch.Tensor):
    """Symmetric per-output-channel quantization: w ~= q * scale[:, None], q in [-127, 127]."""
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(torch.nn.Module):
    """y = (x @ q.T) * scale + bias, with q int8 (N, K) and scale (N,)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        q, scale = quantize_int8(weight.float())
        self.register_buffer("q", q)
        self.register_buffer("scale", scale.to(weight.dtype))
        self.register_buffer("bias", bias)

    def forward(self, x):
        y = F.linear(x, self.q.to(x.dtype)) * self.scale
        return y if self.bias is None else y + self.bias


def example(m: int = 1, k: int = 4096, n: int = 4096, device: str = "cpu",
            dtype: torch.dtype = torch.bfloat16) -> Example:
    torch.manual_seed(0)
    weight = torch.randn(n, k, dtype=dtype, device=device) / k ** 0.5
    layer = Int8Linear(weight, torch.randn(n, dtype=dtype, device=device)).to(device)
    x = torch.randn(m, k, dtype=dtype, device=device)
    return Example("int8_linear", layer, (x,),
                   f"W8A16 linear, M = {m}: int8 weight read once, dequantized in registers",
                   expect_kernels=1)


SMALL = dict(k=256, n=192)


def bandwidth_table(ex: Example, baseline_weight: torch.Tensor, weight_bytes: int) -> None:
    """Time eager, fusec and a plain 16-bit linear (the baseline), print weight bytes per second."""
    (x,) = ex.inputs
    device = str(x.device)
    fused = fusec.compile(ex.fn)
    with torch.no_grad():
        fused(x)
        base = str(baseline_weight.dtype).replace("torch.", "")
        rows = [(f"{base} F.linear (baseline)", baseline_weight.numel() * baseline_weight.element_size(),
                 median_ms(F.linear, x, baseline_weight, device=device)),
                (f"{ex.name} eager", weight_bytes, median_ms(ex.fn, x, device=device)),
                (f"{ex.name} fusec", weight_bytes, median_ms(fused, x, device=device))]
    print(f"{'':28s} {'weight bytes':>14s} {'ms':>9s} {'GB/s':>9s}")
    for name, nbytes, ms in rows:
        print(f"{name:28s} {nbytes:14,d} {ms:9.4f} {nbytes / ms / 1e6:9.1f}")


def main(example_fn, weight_bytes) -> None:
    """`python examples/<quantized layer>.py`: the layer at K = N = 8192 on a GPU (2048 on a
    CPU), run and explained, then timed against a bf16 linear; weight_bytes(layer) is what it
    has to read."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = 8192 if device == "cuda" else 2048
    ex = example_fn(k=size, n=size, device=device)
    with torch.no_grad():
        run_example(ex, show_source=False)
        bandwidth_table(ex, torch.randn(size, size, dtype=ex.inputs[0].dtype, device=device),
                        weight_bytes(ex.fn))


if __name__ == "__main__":
    main(example, lambda layer: layer.q.numel() + layer.scale.numel() * 2)

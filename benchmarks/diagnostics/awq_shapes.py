"""AWQ's packed layer (examples/awq_linear.py) at decode shapes: eager, torch.compile and fusec.

    python benchmarks/diagnostics/awq_shapes.py [--shapes 8192x8192,...] [--m 1,4,8,16]
                                                [--no-compile] [--source DIR]

AWQ packs eight 4-bit weights along N in each int32; fusec compiles its plain-torch unpacking
into one GEMV whose output columns are (N/8, 8) (passes/constant_gathers.py, refine_views.py),
up to SPLIT_COLUMNS_MAX_M rows on a GPU (passes/small_matmul.py), and dequantizes once for the
library matmul above that. Each row gives, for one K x N layer (fp16, group 128) and M rows, the
median time (fusec.timing.median_ms: do_bench on CUDA) and the bytes the layer must read (packed
words, zero points, scales) per second, with fusec's kernels and its largest error against
eager. `--source DIR` writes the GEMV of the first shape, M = 1, to DIR. The numbers behind
SPLIT_COLUMNS_MAX_M are this script's (docs/gpu.md, docs/passes/constant_gathers.md).
"""
from __future__ import annotations

import argparse
import os

import torch

import fusec
from fusec.examples.awq_linear import AWQLinear
from fusec.timing import median_ms


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="8192x8192,4096x11008,11008x4096,4096x4096")
    p.add_argument("--m", default="1,4,8,16")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--source")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for i, shape in enumerate(args.shapes.split(",")):
        k, n = (int(v) for v in shape.split("x"))
        torch.manual_seed(0)
        layer = AWQLinear(torch.randn(k, n, device=device, dtype=torch.float16) / k ** 0.5,
                          128).to(device)
        nbytes = sum(b.numel() * b.element_size() for b in layer.buffers())
        fused = fusec.compile(layer)
        compiled = None if args.no_compile or device != "cuda" else torch.compile(layer)
        for m in [int(v) for v in args.m.split(",")]:
            x = torch.randn(m, k, device=device, dtype=torch.float16)
            with torch.no_grad():
                err = (fused(x).float() - layer(x).float()).abs().max().item()
                times = {"eager": median_ms(layer, x, device=device),
                         "fusec": median_ms(fused, x, device=device)}
                if compiled is not None:
                    compiled(x)
                    times["torch.compile"] = median_ms(compiled, x, device=device)
            print(f"awq {k}x{n} M={m:<2d} " + "  ".join(
                f"{name} {ms:.4f} ms ({nbytes / ms / 1e9:.2f} TB/s)" for name, ms in times.items())
                + f"  |err| {err:.3g}  kernels {[kk.name for kk in fused.kernels]}", flush=True)
            if args.source and i == 0 and m == 1:
                for kk in fused.kernels:
                    with open(os.path.join(args.source, f"{kk.name}.txt"), "w") as f:
                        f.write(kk.source)


if __name__ == "__main__":
    main()

"""The bf16 GEMV (M = 1, a stored weight) at a decode step's own shapes, block by block, on a GPU.

    python benchmarks/diagnostics/gemv_decode_shapes.py [--configs 8x512x4,...] [--shapes 4096x4096,...]

benchmarks/decode.py's bf16 step is Llama-2-7B's layer shapes (examples/llama_decode.py, REAL):
per layer the query and output projections (4096 x 4096), the key and value projections
(1024 x 4096, 8 key/value heads), gate and up (11008 x 4096), down (4096 x 11008), and once the
logits (32000 x 4096). extensions/quant_gemv/triton_gemv.py picks the GEMV's blocks from its shape
(`gemv_blocks`: for a 16-bit weight one output column of 4096 per program with 8 warps, chosen
from this script's third run, on an H100; 2 x 1024 x 4 warps before, from its first run on an
H200; 8 x 512 before that). Each row here forces one (BLOCK_N, BLOCK_K, num_warps) on
`F.linear(x, w)` compiled by fusec (saved programs off, so every config is compiled afresh) and
prints weight bytes per second, beside cuBLAS's F.linear on the same shape (do_bench medians).
"""
from __future__ import annotations

import argparse
import os

os.environ["FUSEC_SAVED_PROGRAMS"] = "0"  # a saved program would ignore the forced blocks

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fusec  # noqa: E402
import fusec.extensions.quant_gemv.triton_gemv as tr  # noqa: E402
from fusec.timing import median_ms  # noqa: E402

SHAPES = [(4096, 4096), (1024, 4096), (11008, 4096), (4096, 11008), (32000, 4096)]
# (6144 x 4096 and 22016 x 4096 are the joined q/k/v and gate/up: passes/sibling_gemvs.py)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="0,8x512x4,4x1024x4,4x512x4,2x1024x4,16x256x4,8x512x8,"
                   "16x512x8,8x1024x8,4x1024x2,2x2048x4", help="BLOCK_NxBLOCK_KxWARPS (0: fusec's own)")
    p.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES),
                   help="NxK weight shapes, e.g. 4096x4096,6144x4096,22016x4096")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU")
    default = tr.gemv_blocks
    for n, k in (tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")):
        torch.manual_seed(0)
        w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        nbytes = w.numel() * 2
        ms = median_ms(F.linear, x, w, device="cuda")
        print(f"{n} x {k}: cuBLAS {ms * 1e3:7.2f} us {nbytes / ms / 1e9:.3f} TB/s; fusec's pick "
              f"{default(1, n, k, weight_bytes=2)}", flush=True)
        want = F.linear(x.double(), w.double())
        for spec in args.configs.split(","):
            if spec == "0":
                tr.gemv_blocks = default
                label = "fusec's own"
            else:
                bn, bk, warps = (int(v) for v in spec.split("x"))
                tr.gemv_blocks = lambda m, nn, kk, weight_bytes=1, c=(1, bn, bk, warps): c
                label = spec
            cf = fusec.compile(lambda v: F.linear(v, w))
            with torch.no_grad():
                got = cf(x)
                ms = median_ms(cf, x, device="cuda")
            err = (got.double() - want).abs().max().item()
            print(f"  {label:12s} {ms * 1e3:7.2f} us {nbytes / ms / 1e9:.3f} TB/s  |err| {err:.3g}",
                  flush=True)
        tr.gemv_blocks = default


if __name__ == "__main__":
    main()

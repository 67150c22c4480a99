"""The generated tensor-core int4 GEMV (extensions/quant_gemv/triton_gemv_int4_mma.py) with other block sizes.

    python extensions/quant_gemv/diagnostics/int4_mma_blocks.py [--k 8192] [--n 8192] [--m 2,4,8,16]
                                                     [--configs 128x8x396x1,64x4x396x1,...]

Each config is BLOCK_N x WARPS x TARGET_PROGRAMS x STAGES: the generated kernel's `mma_blocks`
is replaced by one that returns it, the layer is compiled again (a new source, so a new kernel)
and timed beside cuBLAS's bf16 F.linear of the same shape, fusec's word kernel
(FUSEC_INT4_MMA=0, M <= 4) and the kernel as chosen. The measurements behind `mma_blocks`
(extensions/quant_gemv/docs/small_matmul.md). Without a GPU each config is compiled for sm_90 and its main loop summarized.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

# a config replaces a function, which the saved program's fingerprint does not see: no saved
# programs (fusec/runtime/fast_start/saved.py), so that each compile renders its kernel again
os.environ["FUSEC_SAVED_PROGRAMS"] = "0"

import fusec  # noqa: E402 (first: on a machine without a GPU it switches Triton's interpreter on)
from fusec.extensions.quant_gemv import triton_gemv_int4_mma as mma  # noqa: E402
from fusec.examples.int4_linear import Int4Linear  # noqa: E402
from fusec.timing import median_ms  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))


def blocks_of(spec: str):
    """`mma_blocks` for one config: BLOCK_N x WARPS x TARGET_PROGRAMS x STAGES."""
    block_n, warps, target, stages = (int(v) for v in spec.split("x"))

    def blocks(m: int, n: int, words: int):
        chunks = words // mma.CHUNK_WORDS
        split = max(1, min(chunks, -(-target // -(-n // block_n))))
        per = -(-chunks // split)
        return block_n, warps, -(-chunks // per), per, stages
    return blocks


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--m", default="2,4,8,16")
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--configs", default="128x8x396x1,128x8x528x1,128x8x264x1,128x4x396x1,"
                   "64x4x396x1,64x4x528x1,128x8x396x2,64x4x396x2,256x8x396x1")
    args = p.parse_args()
    gpu = torch.cuda.is_available()
    dev = "cuda" if gpu else "cpu"
    torch.manual_seed(0)
    w = (torch.randn(args.n, args.k, device=dev) / args.k ** 0.5).to(torch.bfloat16)
    layer = Int4Linear(w, args.group).to(dev)
    nbytes = sum(b.numel() * b.element_size() for b in layer.buffers())
    chosen = mma.mma_blocks
    for m in (int(v) for v in args.m.split(",")):
        x = torch.randn(m, args.k, device=dev, dtype=torch.bfloat16)
        if not gpu:  # offline: the main loop of each config for sm_90
            from int4_sass import loop_body
            for spec in args.configs.split(","):
                mma.mma_blocks = blocks_of(spec)
                e = fusec.explain(layer, x, backend="triton")
                [k] = [k for k in e.kernels if "gemv" in k.name]
                sass = e.assembly(k.name, "sm_90")
                print(f"M={m} {spec:14s} {sass.splitlines()[0]}, main loop "
                      f"{len(loop_body(sass))} instructions", flush=True)
            mma.mma_blocks = chosen
            continue
        with torch.no_grad():
            ref = F.linear(x.double(), layer.weight(torch.bfloat16).double())
            ms = median_ms(lambda v: F.linear(v, w), x, device=dev)
            print(f"M={m:<3d} cuBLAS bf16 F.linear          {ms:.4f} ms {w.numel() * 2 / ms / 1e9:.3f} "
                  "TB/s (of bf16 bytes)", flush=True)
            runs = [("as chosen", chosen, {}), ("FUSEC_INT4_MMA=0", chosen, {"FUSEC_INT4_MMA": "0"})]
            runs += [(spec, blocks_of(spec), {}) for spec in args.configs.split(",")]
            for label, blocks, env in runs:
                mma.mma_blocks = blocks
                os.environ.update(env)
                try:
                    cf = fusec.compile(layer)
                    got = cf(x)
                    ms = median_ms(cf, x, device=dev)
                except Exception as err:  # noqa: BLE001 (a config Triton refuses: say so, go on)
                    print(f"M={m:<3d} {label:30s} failed: {type(err).__name__}: {str(err)[:200]}")
                    continue
                finally:
                    mma.mma_blocks = chosen
                    for key in env:
                        os.environ.pop(key)
                err = (got.double() - ref).abs().max().item()
                names = [k.name for k in cf.kernels]
                print(f"M={m:<3d} {label:30s} {ms:.4f} ms {nbytes / ms / 1e9:.3f} TB/s  |err| {err:.3g}"
                      f"  {names}", flush=True)


if __name__ == "__main__":
    main()

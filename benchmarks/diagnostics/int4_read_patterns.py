"""How fast can anything read a packed int4 weight, and does the way a GEMV reads it matter?

    python benchmarks/diagnostics/int4_read_patterns.py [--k 8192] [--n 8192] [--group 128]

The int4 GEMV at M = 1 reads 35.7 MB (K = N = 8192: the packed weight, its scales and zero
points) in about 20 us. At that size a fixed cost weighs: a kernel that only reads a buffer, as
fast as it comes and with nothing else to do, is timed here at a quarter, half and all of a
134 MB buffer (do_bench medians, whose L2 flush before each call leaves dirty lines to write
back), so that the fixed part and the streaming rate can be told apart; then the packed weight
alone, with several blocks. Then the weight read the way the GEMVs read it, with no arithmetic:
ROWS rows per program of WARPS warps, each warp its own slice of K, each lane 16 bytes per load,
the lanes of a row RUN consecutive words per trip, with and without the activations' loads of the
tensor-core kernels (int4_mma_m1.py). Results: docs/gpu.md, 2026-11-26 (second evening).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import fusec  # noqa: F401 (first: on a machine without a GPU it switches Triton's interpreter on)
import triton
import triton.language as tl
from fusec.timing import median_ms

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from int4_linear import Int4Linear  # noqa: E402
from speed_of_light import read_ms  # noqa: E402


@triton.jit
def pattern_read(p_packed_ptr, out_ptr, n_words: tl.constexpr, ROWS: tl.constexpr,
                 WARPS: tl.constexpr, RUN: tl.constexpr, X: tl.constexpr, x_ptr):
    # the weight read as the GEMVs read it, with no arithmetic: a program of WARPS warps owns ROWS
    # rows; a lane reads 4 words (16 bytes); the lanes of a row read RUN consecutive words per
    # trip; warp v takes its own slice of K. X: also the activations' 4 loads per chunk.
    T: tl.constexpr = 32 * WARPS
    LPR: tl.constexpr = RUN // 4  # lanes per row
    RPW: tl.constexpr = 32 // LPR  # rows per load instruction of a warp
    pid = tl.program_id(axis=0)
    t = tl.arange(0, T)
    warp = t // 32
    lane = t % 32
    per_warp: tl.constexpr = n_words // WARPS
    wp = p_packed_ptr.to(tl.pointer_type(tl.int32))
    xp = x_ptr.to(tl.pointer_type(tl.int32))
    acc = tl.zeros([T, 4], dtype=tl.int32)
    for w0 in range(0, per_warp, RUN):
        for r in tl.static_range(ROWS // RPW):
            row = pid * ROWS + r * RPW + lane // LPR
            at = (row * n_words + warp * per_warp + w0 + 4 * (lane % LPR))[:, None] + tl.arange(0, 4)[None, :]
            acc ^= tl.load(wp + at, eviction_policy="evict_first")
        if X:
            for j in tl.static_range(4):
                acc ^= tl.load(xp + ((warp * per_warp + w0 + 4 * (lane % 4) + j) * 4)[:, None] + tl.arange(0, 4)[None, :])
    tl.store(out_ptr + pid * T * 4 + t[:, None] * 4 + tl.arange(0, 4)[None, :], acc)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--group", type=int, default=128)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("int4_read_patterns.py times memory reads: it needs a GPU")
        return
    dev = "cuda"
    k, n = args.k, args.n
    n_words = k // 8
    torch.manual_seed(0)
    layer = Int4Linear(torch.randn(n, k, dtype=torch.bfloat16) / 64, args.group).to(dev)
    x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
    print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
    big = layer.weight(torch.bfloat16).view(torch.int32).view(-1)  # 134 MB at 8192 x 8192
    for size in (big.numel() // 4, big.numel() // 2, big.numel()):
        ms = read_ms(big[:size])
        print(f"read only {size * 4 / 1e6:.0f} MB: {ms:.4f} ms {size * 4 / ms / 1e9:.3f} TB/s",
              flush=True)
    for block, steps, warps in [(1024, 1, 4), (2048, 1, 4), (4096, 1, 8), (2048, 2, 4),
                                (4096, 2, 8), (8192, 1, 8), (1024, 4, 4), (512, 1, 2)]:
        ms = read_ms(layer.packed, block, steps, warps)
        print(f"read only {block}x{steps} words, {warps} warps: {ms:.4f} ms "
              f"{layer.packed.numel() / ms / 1e9:.3f} TB/s (packed bytes only)", flush=True)
    for rows, warps, run, xx in [(16, 4, 16, False), (16, 4, 16, True), (16, 4, 32, False), (16, 4, 32, True),
                                 (16, 4, 64, False), (16, 4, 128, False), (4, 1, 128, False),
                                 (4, 1, 128, True), (16, 1, 16, False), (32, 4, 16, False),
                                 (16, 8, 16, False), (8, 4, 16, False)]:
        sink = torch.empty(n // rows * warps * 32 * 4, dtype=torch.int32, device=dev)
        call = lambda: pattern_read[(n // rows,)](  # noqa: E731
            layer.packed, sink, n_words, rows, warps, run, xx, x, num_warps=warps)
        ms = median_ms(call, device=dev)
        print(f"pattern read: {rows} rows x {warps} warps, runs of {run} words"
              f"{' + activations' if xx else ''}: {ms:.4f} ms "
              f"{layer.packed.numel() / ms / 1e9:.3f} TB/s (packed bytes only)", flush=True)


if __name__ == "__main__":
    main()

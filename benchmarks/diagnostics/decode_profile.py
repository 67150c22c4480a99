"""Where a decode step's GPU time goes: fusec against torch.compile, kernel by kernel.

    python benchmarks/diagnostics/decode_profile.py [--format bf16] [--layers 4] [--steps 20] [--top 15] [--systems fusec,torch.compile]

benchmarks/decode.py gives tokens/s; this script says why they differ. It runs the same Llama
decode step (examples/llama_decode.py, real widths) through fusec and through torch.compile
(default mode: the kernels reduce-overhead replays, without its CUDA graph) for `--steps` steps
under torch.profiler, and prints, for each, the GPU time per step and the kernels that take most
of it (summed over the steps, divided by the step count). Both run without CUDA graphs here so
that every kernel shows up in the trace; the graph only removes launch gaps, which the "GPU busy"
line next to "wall" makes visible.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import fusec
from fusec.examples.llama_decode import REAL, Llama


def per_step_kernels(fn, steps: int, device: str):
    tok = torch.tensor([3], device=device)
    positions = [torch.tensor([8 + i], device=device) for i in range(steps + 3)]
    with torch.no_grad():
        for i in range(3):
            fn(tok, positions[i])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for i in range(steps):
                fn(tok, positions[3 + i])
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / steps
    rows = [(e.key, e.device_time_total / steps / 1e3, e.count // steps)
            for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    return wall * 1e3, sum(r[1] for r in rows), rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--format", default="bf16")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--systems", default="fusec,torch.compile")
    args = p.parse_args()
    cfg = dict(REAL, layers=args.layers)
    model = Llama(cfg, args.format, device="cuda").eval()
    makers = {"fusec": lambda: fusec.compile(model, cuda_graphs=False),
              "torch.compile": lambda: torch.compile(model)}
    systems = {name: makers[name]() for name in args.systems.split(",")}
    for name, fn in systems.items():
        model.reset()
        wall, busy, rows = per_step_kernels(fn, args.steps, "cuda")
        print(f"\n== {name} ({args.format}, {args.layers} layers): wall {wall:.3f} ms/step, "
              f"GPU busy {busy:.3f} ms/step, {sum(r[2] for r in rows)} kernels/step")
        for key, ms, count in rows[:args.top]:
            print(f"  {ms:8.4f} ms  x{count:<3d} {key[:100]}")


if __name__ == "__main__":
    main()

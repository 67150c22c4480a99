"""Rows per program and where the programs start: fusec's int4 group kernel, config by config.

    python benchmarks/diagnostics/int4_group_blocks.py --k 28672 --n 8192 --configs auto,4x32x4n,4x32x4s

extensions/quant_gemv/triton_gemv_int4_groups.py picks ROWS x LANES x WPL by a rule (`group_blocks`) and starts
each program at a chunk of its own from STAGGER_FROM_CHUNKS chunks a row. Both were measured, and
both depend on the GPU's memory more than on anything the kernel can see. This script compiles
the same int4 layer (examples/int4_linear.py) once per config through fusec.compile, with the
rule replaced, checks each against a float64 product beside eager, then times them in rounds, one
config after another in every round, so that a slow moment of the GPU hits them all alike; it
prints each config's median and every round's TB/s (packed weight, scales and zero points).

A config is `auto` (the rules as they are) or ROWSxLANESxWPL with `s` (staggered start) or `n`
(not) after it. Saved programs are off here: the replaced rules are not in their fingerprint.
Without a GPU, only the error check runs (under the interpreter, on a small layer).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

import fusec  # first: on a machine without a GPU it switches Triton's interpreter on
from fusec.extensions.quant_gemv import triton_gemv_int4_groups as groups
from fusec.timing import median_ms

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from int4_linear import Int4Linear  # noqa: E402
from int4_offset import errors  # noqa: E402


def compiled(layer, x, config: str):
    """fusec.compile(layer) with group_blocks and STAGGER_FROM_CHUNKS set by `config`, and its
    output for x: the program is compiled at that first call, before the module's rules are put
    back."""
    rule, stagger = groups.group_blocks, groups.STAGGER_FROM_CHUNKS
    if config != "auto":
        blocks = tuple(int(v) for v in config.rstrip("sn").split("x"))
        groups.group_blocks = lambda n, words, group_words: blocks
        groups.STAGGER_FROM_CHUNKS = 0 if config.endswith("s") else 10 ** 9
    try:
        cf = fusec.compile(layer, backend="triton")  # (on a CPU: under the interpreter)
        return cf, cf(x)
    finally:
        groups.group_blocks, groups.STAGGER_FROM_CHUNKS = rule, stagger


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--configs", default="auto,4x32x4n,4x32x4s,2x32x4n,8x32x4n")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    os.environ["FUSEC_SAVED_PROGRAMS"] = "0"
    gpu = torch.cuda.is_available()
    dev = "cuda" if gpu else "cpu"
    k, n = (args.k, args.n) if gpu else (2048, 64)
    torch.manual_seed(0)
    layer = Int4Linear(torch.randn(n, k, dtype=torch.bfloat16) / 64, args.group).to(dev)
    x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
    nbytes = sum(b.numel() * b.element_size() for b in layer.buffers())
    calls = {}
    with torch.no_grad():
        for config in args.configs.split(","):
            cf, out = compiled(layer, x, config)
            e, eager_e = errors(layer, x, out[0])
            calls[config] = cf
            print(f"{config:12s} |out - exact| {e:.3g} (eager {eager_e:.3g})", flush=True)
        if not gpu:
            return
        times = {c: [] for c in calls}
        for _ in range(args.rounds):
            for config, cf in calls.items():
                times[config].append(median_ms(cf, x, device=dev))
    for config, ts in times.items():
        ms = statistics.median(ts)
        print(f"K={k} N={n} {config:12s} {ms:.4f} ms {nbytes / ms / 1e9:.3f} TB/s   rounds: "
              + " ".join(f"{nbytes / t / 1e9:.3f}" for t in ts), flush=True)


if __name__ == "__main__":
    main()

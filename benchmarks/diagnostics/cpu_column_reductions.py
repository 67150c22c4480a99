"""Reductions across rows that lie side by side, on this CPU: eager, torch.compile and fusec's two
CPU backends, side by side in one process.

    python benchmarks/diagnostics/cpu_column_reductions.py [--only sum0,softmax_channels]

A reduction over a dimension that is not the last (`x.sum(0)`, a mean over the sequence of
(B, S, D) activations, a softmax over NCHW channels, GPTQ's words read column by column) reads
each row's values far apart, while neighbouring rows sit next to each other. The C++ backend
turns such loops inside out (codegen/cpp/columns.py): the k loop outside, a block of rows in
the SIMD lanes. The LLVM backend walks one row at a time. Times are fusec.timing.median_ms (ms);
the ratio is against eager.
"""
from __future__ import annotations

import argparse

import torch

import fusec
from fusec.timing import median_ms

CASES = {
    "sum0 4096x4096": (lambda x: (x * 2).sum(0), (4096, 4096)),
    "mean1 8x512x768": (lambda x: x.mean(1), (8, 512, 768)),
    "softmax_channels 8x64x32x32": (lambda x: torch.softmax(x, 1), (8, 64, 32, 32)),
    "var0 2048x1024": (lambda x: torch.var(x, 0), (2048, 1024)),
    "argmax0 2048x1024": (lambda x: torch.argmax(x, 0), (2048, 1024)),
    "log_softmax0 1024x1024": (lambda x: torch.log_softmax(x, 0), (1024, 1024)),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="", help="comma-separated name prefixes")
    p.add_argument("--backends", default="cpp,llvm")
    args = p.parse_args()
    systems = ["torch.compile"] + args.backends.split(",")
    print(f"{'case':28s} {'eager ms':>9s} " + " ".join(f"{s:>16s}" for s in systems))
    for name, (fn, shape) in CASES.items():
        if args.only and not any(name.startswith(o) for o in args.only.split(",")):
            continue
        torch.manual_seed(0)
        x = torch.randn(*shape)
        with torch.no_grad():
            eager = median_ms(fn, x)
            cells = []
            for system in systems:
                compiled = torch.compile(fn) if system == "torch.compile" \
                    else fusec.compile(fn, backend=system, check=True)
                compiled(x)  # compiles (and, for fusec, checks against eager once)
                if system != "torch.compile":
                    compiled = fusec.compile(fn, backend=system)
                    compiled(x)
                ms = median_ms(compiled, x)
                cells.append(f"{ms:8.3f} ({eager / ms:4.2f}x)")
        print(f"{name:28s} {eager:9.3f} " + " ".join(f"{c:>16s}" for c in cells), flush=True)


if __name__ == "__main__":
    main()

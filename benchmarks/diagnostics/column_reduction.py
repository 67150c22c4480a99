"""Column reductions on a GPU: which tile shape streams a channels-last reduction fastest.

    python benchmarks/diagnostics/column_reduction.py [--problems 33,5,7,20] [--variants 64x64x4,...]

A column reduction (a global mean or an instance norm's statistics on a channels-last activation:
the rows, one per channel, lie side by side in memory) is walked in [XBLOCK, RBLOCK] tiles of
XBLOCK neighbouring rows (codegen/triton_reduction.py, the note on column reductions). On an H100
fusec's streamed about 2.2 TB/s where Inductor's reached 2.9 (KernelBench-style 33_, 5_, 7_;
docs/gpu.md). For each variant XBLOCKxRBLOCKxWARPS this compiles the problems afresh with that
tile for every column reduction and prints fusec's do_bench median next to torch.compile's, all
in one process, so the fastest tile can replace COLUMN_XBLOCK / COLUMN_RBLOCK.
"""
from __future__ import annotations

import argparse

import torch

import fusec
import fusec.codegen.triton_reduction as triton_backend
from fusec.timing import median_ms
from problem_profile import load  # benchmarks/diagnostics/: a problem by its number

BLOCKS = triton_backend.reduction_blocks


def column_tile(xblock: int, rblock: int, warps: int):
    """reduction_blocks with this tile for column reductions, the default for the others."""
    def blocks(rows, k, column=False):
        if column and rows >= xblock and k > rblock:
            return False, xblock, rblock, warps
        return BLOCKS(rows, k, column)
    return blocks


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--problems", default="33,5,7,20")
    p.add_argument("--variants", default="64x64x4,64x32x4,32x64x4,128x32x8,64x64x8,16x128x4,128x16x4")
    p.add_argument("--device", default="cuda")
    p.add_argument("--scale", default="gpu")
    args = p.parse_args()
    variants = [tuple(int(v) for v in s.split("x")) for s in args.variants.split(",")]
    print("problem | torch.compile | " + " | ".join(f"{x}x{r}x{w}" for x, r, w in variants) + " (ms)")
    for number in args.problems.split(","):
        name, build = load(number)
        torch.manual_seed(0)
        model, inputs = build(args.scale)
        model, inputs = model.to(args.device), [t.to(args.device) for t in inputs]
        row = [name]
        with torch.no_grad():
            if args.device == "cuda":
                compiled = torch.compile(model)
                compiled(*inputs)
                row.append(f"{median_ms(compiled, *inputs, device=args.device):.3f}")
            else:
                row.append("-")
            want = model(*inputs)
            for xblock, rblock, warps in variants:
                triton_backend.reduction_blocks = column_tile(xblock, rblock, warps)
                cf = fusec.compile(model, backend="triton")
                torch.testing.assert_close(cf(*inputs), want, rtol=1e-2, atol=1e-2)  # as kernelbench.py (TF32 convs)
                row.append(f"{median_ms(cf, *inputs, device=args.device):.3f}")
            triton_backend.reduction_blocks = BLOCKS
        print(" | ".join(row), flush=True)
        torch._dynamo.reset()


if __name__ == "__main__":
    main()

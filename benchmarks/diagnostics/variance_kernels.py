"""Online variance on a GPU: warps per program, and agreement with eager on special values.

    python benchmarks/diagnostics/variance_kernels.py [--warps 4,8,16] [--problems 7,24,27,28]

The looped Triton reductions fold a variance into the pass of its mean (codegen/triton/reduction.py,
the note on online variance), with three more accumulators per lane. For each value in --warps
this compiles the KernelBench-style problems afresh with every reduction kernel's num_warps at
least that (each compile renders its kernels again; the source names num_warps) and prints
fusec's do_bench median next to torch.compile's, in one process. Then it compares layer norm,
var and group norm with eager row by row on rows holding NaN, +-inf and a value whose square
overflows, forcing the looped template, and prints where NaN appears on either side.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import fusec
import fusec.codegen.triton.reduction as triton_backend
from fusec.timing import median_ms
from problem_profile import load  # benchmarks/diagnostics/: a problem by its number



def special_rows() -> None:
    triton_backend.PERSISTENT_MAX_K, triton_backend.LOOP_RBLOCK = 0, 16
    x = torch.randn(5, 60, device="cuda")
    x[0, 5], x[1, 59], x[2, 0], x[3, 30] = float("nan"), float("inf"), -float("inf"), 1e30
    fns = {"layer_norm": lambda x: F.layer_norm(x, (60,)), "var": lambda x: x.var(-1),
           "group_norm": lambda x: F.group_norm(x.view(5, 4, 15), 2).view(5, 60)}
    for name, fn in fns.items():
        got, want = fusec.compile(fn)(x), fn(x)
        for row in range(5):
            g, w = got[row], want[row]
            print(f"{name:10s} row {row}: fusec NaN {int(torch.isnan(g).sum()):3d} inf "
                  f"{int(torch.isinf(g).sum()):3d} | eager NaN {int(torch.isnan(w).sum()):3d} inf "
                  f"{int(torch.isinf(w).sum()):3d} | first {g.flatten()[0].item():.4g} vs "
                  f"{w.flatten()[0].item():.4g}")
    triton_backend.PERSISTENT_MAX_K, triton_backend.LOOP_RBLOCK = 8192, 2048


BLOCKS = triton_backend.reduction_blocks


def _at_least(warps: int):
    def blocks(rows, k, column=False):
        persistent, xblock, rblock, num_warps = BLOCKS(rows, k, column)
        return persistent, xblock, rblock, max(num_warps, warps)
    return blocks


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--warps", default="4,8,16")
    p.add_argument("--problems", default="7,24,27,28")
    args = p.parse_args()
    warps = [int(w) for w in args.warps.split(",")]
    for number in args.problems.split(","):
        name, build = load(number)
        torch.manual_seed(0)
        model, inputs = build("gpu")
        model, inputs = model.cuda().eval(), [t.cuda() for t in inputs]
        with torch.no_grad():
            compiled = torch.compile(model)
            compiled(*inputs)
            row = [f"{name}: torch.compile {median_ms(compiled, *inputs, device='cuda'):.3f}"]
            for w in warps:
                triton_backend.reduction_blocks = _at_least(w)
                cf = fusec.compile(model)
                cf(*inputs)
                row.append(f"fusec {w} warps {median_ms(cf, *inputs, device='cuda'):.3f}")
        triton_backend.reduction_blocks = BLOCKS
        print(" | ".join(row) + " ms", flush=True)
        torch._dynamo.reset()
    special_rows()


if __name__ == "__main__":
    main()

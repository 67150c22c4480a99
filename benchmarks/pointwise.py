"""Pointwise workloads: eager vs torch.compile vs fusec, side by side in one run.

    python benchmarks/pointwise.py                 # on the GPU if there is one, else the CPU
    python benchmarks/pointwise.py --json out.json

Rows (the project's GPU targets): sin x4 on 64M float32 elements; sin x4 * 2 + 1 on 64M; a 20-op chain on
1k elements (launch-bound). Memory-bound rows are medians of triton.testing.do_bench on CUDA;
the launch-bound row is wall-clock time per call, host overhead included (fusec.timing). The bandwidth
floor is the bytes a perfect kernel must move (inputs read once, outputs written once) divided by
the copy bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fusec  # noqa: E402
from fusec.timing import copy_bandwidth, median_ms, wall_ms  # noqa: E402


def sin4(x):
    return torch.sin(torch.sin(torch.sin(torch.sin(x))))


def sin4_affine(x):
    return torch.sin(torch.sin(torch.sin(torch.sin(x)))) * 2 + 1


def chain20(x):
    for i in range(10):
        x = torch.sin(x) * 1.01 if i % 2 else torch.cos(x) + 0.5
    return x


def run(device: str, big: int) -> list[dict]:
    bw = copy_bandwidth(device, big)
    rows = []
    workloads = [("sin4", sin4, big, 2), ("sin4*2+1", sin4_affine, big, 2),
                 ("chain20 (launch-bound)", chain20, 1024, None)]
    for name, fn, n, tensors_moved in workloads:
        x = torch.randn(n, device=device)
        fused = fusec.compile(fn)
        with torch.no_grad():
            want = fn(x)
            got = fused(x)
            err = (got - want).abs().max().item()
            compiled = torch.compile(fn)
            compiled(x)
            # launch-bound rows are timed by wall clock (host overhead is the cost being measured)
            timer = median_ms if tensors_moved else wall_ms
            row = {
                "workload": f"{name}, {n} f32",
                "timer": "do_bench median" if tensors_moved else "wall clock per call",
                "eager_ms": timer(fn, x, device=device),
                "torch_compile_ms": timer(compiled, x, device=device),
                "fusec_ms": timer(fused, x, device=device),
                "fusec_kernels": len(fused.kernels),
                "max_abs_err": err,
            }
            if device == "cuda" and n == 1024:
                ro = torch.compile(fn, mode="reduce-overhead")
                for _ in range(3):
                    ro(x)
                row["reduce_overhead_ms"] = timer(ro, x, device=device)
        if tensors_moved:
            row["floor_ms"] = tensors_moved * n * 4 / bw
        rows.append(row)
    return rows


def print_table(rows: list[dict], device: str) -> None:
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"\n{name}, torch {torch.__version__}, medians in ms")
    head = ["workload", "eager", "torch.compile", "reduce-overhead", "fusec", "floor",
            "fusec/compile", "fusec/floor", "kernels"]
    print(" | ".join(head))
    for r in rows:
        def f(key):
            return f"{r[key]:.4f}" if key in r else "-"
        ratio = r["fusec_ms"] / r["torch_compile_ms"]
        floor = f"{r['fusec_ms'] / r['floor_ms']:.2f}" if "floor_ms" in r else "-"
        print(" | ".join([r["workload"], f("eager_ms"), f("torch_compile_ms"),
                          f("reduce_overhead_ms"), f("fusec_ms"), f("floor_ms"),
                          f"{ratio:.2f}", floor, str(r["fusec_kernels"])]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--size", type=int, default=None, help="elements of the big rows")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    big = args.size or (64 * 2**20 if device == "cuda" else 2**22)
    rows = run(device, big)
    print_table(rows, device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

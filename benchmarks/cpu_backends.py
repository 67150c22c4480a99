"""The two CPU backends side by side: C++/OpenMP (gcc) vs LLVM IR (llvmlite), in one run.

    python benchmarks/cpu_backends.py              # all rows
    python benchmarks/cpu_backends.py --json out.json

For every workload it reports, per backend:
* cold compile time per kernel: the build step alone (gcc -O3 ... -> .so, or llvmlite parse +
  O3 + object code), with an empty cache directory, median over the workload's kernels and
  `--repeat` fresh caches (the backends take turns, one fresh cache each per repeat);
* run time per call, and eager's and torch.compile's: the median of 5 rounds in which the four
  take turns (warm cache), so that a slow spell of a shared machine lands on all of them (timed
  one after the other, eager's row once read 0.5-0.85x for fusec's half-precision chains that
  took turns with eager at 1.1-1.3x).

Issue 6's targets: LLVM compile time per kernel at least 10x lower than the C++ backend's cold
compile; LLVM run time within 1.2x of the C++ backend on the pointwise chain and softmax.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

import fusec
from fusec.runtime.build import codegen as backend_module
from fusec.timing import median_ms, wall_ms


def chain20(x):
    for i in range(10):
        x = torch.sin(x) * 1.01 if i % 2 else torch.cos(x) + 0.5
    return x


def sin4(x):
    return torch.sin(torch.sin(torch.sin(torch.sin(x))))


def sin10(x):
    for _ in range(10):
        x = torch.sin(x)
    return x


def gated(x):
    return torch.sigmoid(x * 2 + 1) * x


def gelu_chain(x):
    return torch.nn.functional.gelu(x * 1.5 + 0.1) * torch.tanh(x)


def softmax(x):
    return torch.softmax(x, dim=-1)


def layernorm(x, w, b):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], w, b)


WORKLOADS = [
    ("chain20, 1k f32 (launch-bound)", chain20, lambda: (torch.randn(1024),), wall_ms),
    ("chain20, 1M f32", chain20, lambda: (torch.randn(1 << 20),), median_ms),
    ("sin4, 4M f32", sin4, lambda: (torch.randn(4 << 20),), median_ms),
    # a chain of math calls: cut into a loop per call (Note: blocks for chains of math calls)
    ("sin10, 1M f32", sin10, lambda: (torch.randn(1 << 20),), median_ms),
    ("sin10, 1M f16", sin10, lambda: (torch.randn(1 << 20, dtype=torch.float16),), median_ms),
    ("sin10, 1M bf16", sin10, lambda: (torch.randn(1 << 20, dtype=torch.bfloat16),), median_ms),
    # half precision: computed in float inside the kernel, rounded where eager rounds each op
    ("gated, 4M f16", gated, lambda: (torch.randn(4 << 20, dtype=torch.float16),), median_ms),
    ("gated, 4M bf16", gated, lambda: (torch.randn(4 << 20, dtype=torch.bfloat16),), median_ms),
    ("gated, 4M f32", gated, lambda: (torch.randn(4 << 20),), median_ms),
    ("gelu_chain, 4M f16", gelu_chain, lambda: (torch.randn(4 << 20, dtype=torch.float16),),
     median_ms),
    ("gelu_chain, 4M bf16", gelu_chain, lambda: (torch.randn(4 << 20, dtype=torch.bfloat16),),
     median_ms),
    ("gelu_chain, 4M f32", gelu_chain, lambda: (torch.randn(4 << 20),), median_ms),
    ("chain20, 1M f16", chain20, lambda: (torch.randn(1 << 20, dtype=torch.float16),), median_ms),
    ("chain20, 1M bf16", chain20, lambda: (torch.randn(1 << 20, dtype=torch.bfloat16),),
     median_ms),
    ("softmax 512x512 f32", softmax, lambda: (torch.randn(512, 512),), median_ms),
    ("softmax 4096x1024 f32", softmax, lambda: (torch.randn(4096, 1024),), median_ms),
    ("layernorm 4096x1024 f32", layernorm,
     lambda: (torch.randn(4096, 1024), torch.randn(1024), torch.randn(1024)), median_ms),
]


def cold_build_seconds(fn, inputs, backends: tuple[str, ...], repeat: int) -> dict[str, list[float]]:
    """Seconds each kernel's build step takes with an empty cache, per backend (one list entry
    per kernel per repeat). The backends take turns within each repeat, as in the run-time
    rounds: a slow spell of this shared machine then lands on both, not on one."""
    modules = {b: backend_module(b) for b in backends}
    times: dict[str, list[float]] = {b: [] for b in backends}
    real = {b: m.build for b, m in modules.items()}

    def timed(backend):
        def build(source, name):
            t = time.perf_counter()
            try:
                return real[backend](source, name)
            finally:
                times[backend].append(time.perf_counter() - t)
        return build

    saved = os.environ.get("FUSEC_CACHE_DIR")
    for b, m in modules.items():
        m.build = timed(b)
    try:
        for _ in range(repeat):
            for b in backends:
                with tempfile.TemporaryDirectory() as d:
                    os.environ["FUSEC_CACHE_DIR"] = d
                    fusec.compile(fn, backend=b)(*inputs)
    finally:
        for b, m in modules.items():
            m.build = real[b]
        if saved is None:
            os.environ.pop("FUSEC_CACHE_DIR", None)
        else:
            os.environ["FUSEC_CACHE_DIR"] = saved
    return times


ROUNDS = 5


def run(repeat: int) -> list[dict]:
    rows = []
    for name, fn, make, timer in WORKLOADS:
        inputs = make()
        row = {"workload": name, "timer": "wall clock" if timer is wall_ms else "median"}
        with torch.no_grad():
            compiled = torch.compile(fn)
            compiled(*inputs)
            systems = {"eager": fn, "torch_compile": compiled}
            builds = cold_build_seconds(fn, inputs, ("cpp", "llvm"), repeat)
            for backend in ("cpp", "llvm"):
                row[f"{backend}_build_ms"] = statistics.median(builds[backend]) * 1e3
                cf = systems[backend] = fusec.compile(fn, backend=backend)
                got = cf(*inputs)
                row[f"{backend}_kernels"] = len(cf.kernels)
                row[f"{backend}_err"] = (got - fn(*inputs)).abs().max().item()
            # every system takes turns, ROUNDS times: a slow spell of a shared machine then
            # lands on all of them instead of on whichever ran during it; the median round counts
            times = {name: [] for name in systems}
            for _ in range(ROUNDS):
                for name, system in systems.items():
                    times[name].append(timer(system, *inputs))
            for name, ts in times.items():
                row[f"{name}_ms"] = statistics.median(ts)
        row["build_speedup"] = row["cpp_build_ms"] / row["llvm_build_ms"]
        row["run_ratio"] = row["llvm_ms"] / row["cpp_ms"]
        rows.append(row)
        print(f"  {name}: cpp {row['cpp_ms']:.4f} ms, llvm {row['llvm_ms']:.4f} ms, build "
              f"{row['cpp_build_ms']:.0f} vs {row['llvm_build_ms']:.1f} ms", flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title=f"CPU backends ({os.cpu_count()} cores, torch {torch.__version__}), "
                        "medians in ms")
    for col in ("workload", "eager", "torch.compile", "cpp", "llvm", "llvm/cpp",
                "cpp build/kernel", "llvm build/kernel", "build speedup", "max err (cpp, llvm)"):
        table.add_column(col, justify="left" if col == "workload" else "right")
    for r in rows:
        table.add_row(r["workload"], f"{r['eager_ms']:.4f}", f"{r['torch_compile_ms']:.4f}",
                      f"{r['cpp_ms']:.4f}", f"{r['llvm_ms']:.4f}", f"{r['run_ratio']:.2f}x",
                      f"{r['cpp_build_ms']:.0f}", f"{r['llvm_build_ms']:.1f}",
                      f"{r['build_speedup']:.0f}x", f"{r['cpp_err']:.1e}, {r['llvm_err']:.1e}")
    Console(width=200).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--repeat", type=int, default=3, help="fresh caches per cold build")
    parser.add_argument("--only", help="run workloads whose name contains this")
    args = parser.parse_args()
    global WORKLOADS
    if args.only:
        WORKLOADS = [w for w in WORKLOADS if args.only in w[0]]
    rows = run(args.repeat)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

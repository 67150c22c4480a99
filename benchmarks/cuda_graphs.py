"""Where a CUDA-graphed call's time and memory go: fusec against torch.compile, kernel by kernel.

    python benchmarks/cuda_graphs.py [--json out.json] [--only gelu_mlp,gpt2_block]

For the model rows of benchmarks/models.py (the GELU MLP in f32, the GPT-2 block in f32 and
bf16) this times, in one process: eager, torch.compile (default and mode="reduce-overhead"),
fusec with CUDA graphs ("auto") and without (cuda_graphs=False). Each is timed two ways,
do_bench's median (device time between events, host work hidden behind its cache flush) and
wall-clock time per call (host work included), and its peak memory is measured: the most
allocated at once during one warm call, above what the inputs and weights take, counting what a
compiled program keeps between calls (pools, CUDA-graph memory), each system in a fresh process
after the once-per-process cuBLAS workspaces are allocated. Then one warm call of each variant
runs under torch.profiler, and the GPU kernels it launched are listed with their times: the
answer to "why is it slower" is usually in that list (a copy in, a clone out, a different GEMM
kernel). CUDA only.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fusec  # noqa: E402
from fusec.demo import load_example  # noqa: E402
from fusec.timing import median_ms, wall_ms  # noqa: E402
from models import peak_mb, warm_capture_stream_workspace  # noqa: E402


def workloads():
    yield "gelu_mlp f32", load_example("gelu_mlp").example(batch=64, dim=1024, device="cuda")
    gpt = load_example("gpt2_block")
    dims = dict(batch=8, seq=256, n_embd=768, n_head=12)
    yield "gpt2_block f32", gpt.example(device="cuda", **dims)
    yield "gpt2_block bf16", gpt.example(device="cuda", dtype=torch.bfloat16, **dims)


def variants(fn):
    return {"eager": lambda: fn,
            "torch.compile": lambda: torch.compile(fn),
            "reduce-overhead": lambda: torch.compile(fn, mode="reduce-overhead"),
            "fusec": lambda: fusec.compile(fn),
            "fusec no graphs": lambda: fusec.compile(fn, cuda_graphs=False)}


def kernels_of_one_call(fn, inputs) -> list[tuple[str, float]]:
    """(kernel name, microseconds) for every GPU activity of one warm call."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        fn(*inputs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*inputs)
        torch.cuda.synchronize()
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out.append((e.name, e.device_time))
    return out


def peak_in_fresh_process(workload: str, variant: str) -> float:
    """Peak MB (benchmarks/models.py's peak_mb) of one variant, measured in a new process: in this
    one, torch.compile's CUDA-graph trees keep every earlier graph's memory pool alive, which
    would hide a later variant's pool in the baseline. The one-per-process cuBLAS workspaces (the
    default stream's, fusec's capture stream's) are allocated before the baseline."""
    import subprocess
    out = subprocess.run([sys.executable, __file__, "--peak", workload, variant],
                         capture_output=True, text=True)
    try:
        return float(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        print(out.stdout[-2000:], out.stderr[-2000:])
        return float("nan")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="also write the numbers here")
    p.add_argument("--only", help="comma-separated workload names (gelu_mlp, gpt2_block)")
    p.add_argument("--peak", nargs=2, metavar=("WORKLOAD", "VARIANT"),
                   help="only print the peak MB of one variant (used in a fresh process)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_graphs.py measures CUDA graphs: it needs a GPU")
        return 0
    if args.peak:
        ex = dict(workloads())[args.peak[0]]
        a = torch.randn(64, 64, device="cuda")
        a @ a  # the default stream's cuBLAS workspace, which every system's first matmul pays
        warm_capture_stream_workspace()  # and fusec's capture stream's: once per process
        with torch.no_grad():
            print(peak_mb(variants(ex.fn)[args.peak[1]], ex.inputs))
        return 0
    only = set(args.only.split(",")) if args.only else None
    rows = []
    with torch.no_grad():
        for name, ex in workloads():
            if only and name.split()[0] not in only:
                continue
            want = ex.fn(*ex.inputs)
            for label, make in variants(ex.fn).items():
                fn = make()
                got = fn(*ex.inputs)
                err = (got.double() - want.double()).abs().max().item()
                row = {"workload": name, "variant": label, "max_abs_err": err,
                       "do_bench_ms": median_ms(fn, *ex.inputs, device="cuda"),
                       "wall_ms": wall_ms(fn, *ex.inputs, device="cuda"),
                       "kernels": kernels_of_one_call(fn, ex.inputs)}
                if label.startswith("fusec"):
                    last = fn._compiled.last if hasattr(fn, "_compiled") else fn.last
                    row["graph_blocker"] = last.graph_blocker
                    mem = last.program.memory
                    row["pool_mb"] = (mem.pool_bytes if mem is not None else 0) / 2**20
                del fn
                row["peak_mb"] = peak_in_fresh_process(name, label)
                rows.append(row)
                print(f"{name} | {label} | do_bench {row['do_bench_ms']:.4f} ms | wall "
                      f"{row['wall_ms']:.4f} ms | peak {row['peak_mb']:.1f} MB | "
                      f"{len(row['kernels'])} GPU activities | err {err:.2g}"
                      + (f" | blocker {row['graph_blocker']!r} pool {row['pool_mb']:.1f} MB"
                         if "pool_mb" in row else ""), flush=True)
    for row in rows:
        if row["variant"] in ("fusec", "reduce-overhead"):
            print(f"\n{row['workload']} / {row['variant']}: GPU activities of one call")
            total = Counter()
            for kname, us in row["kernels"]:
                total[kname[:90]] += us
            for kname, us in total.most_common(14):
                print(f"  {us:8.2f} us  {kname}")
            print(f"  {sum(total.values()):8.2f} us  total")
    print("\nworkload | variant | do_bench ms | wall ms | peak MB | GPU activities per call")
    for row in rows:
        # torch.compile's CUDA-graph trees free memory that was allocated before they started
        # (64 MB on an H200: the size of the two cuBLAS workspaces allocated first), which drops
        # memory below the baseline this measure starts from: no number for it, then
        peak = f"{row['peak_mb']:.1f}" if row["peak_mb"] >= 0 else "n/a (below baseline)"
        print(f"{row['workload']} | {row['variant']} | {row['do_bench_ms']:.4f} | "
              f"{row['wall_ms']:.4f} | {peak} | {len(row['kernels'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

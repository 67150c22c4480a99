"""When does one CUDA graph pay? Each problem timed with fusec's graph forced on and forced off.

    python benchmarks/diagnostics/graph_choice.py [7 33 27 ...] [--dtype float32]

fusec replays a program as one CUDA graph only where its launches' CPU time exceeds the GPU's own
time plus the graph's input and output copies (fusec/runtime/cuda_graphs.py, the note on when a
graph does not pay). For every problem (benchmarks/problems/, "gpu" scale) this prints the
model's numbers (launches, bytes copied, the floor under the GPU time), what it chose, and the
measured time per call both ways: do_bench (GPU time between events, launches mostly hidden) and
wall clock (back-to-back calls, what a loop of calls sees). A row whose faster way (by wall clock)
is not the one chosen is marked `<-- wrong`. `steps CPU us` is what the model estimates: the CPU
time of one call step by step, measured by queueing a few calls without waiting for the GPU.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

import fusec
from fusec import api
from fusec.runtime import COPY_BYTES_PER_US, EXTERN_US, LAUNCH_US
from fusec.runtime.cuda_graphs import _bytes, cpu_estimate, gpu_floor_us
from fusec.timing import median_ms, wall_ms
from problem_profile import load  # benchmarks/diagnostics/: a problem by its number

PROBLEMS = Path(__file__).resolve().parents[1] / "problems"


def forced_graph(model, inputs):
    """fusec's compiled model with its program replayed as a CUDA graph whatever the model says."""
    cf = fusec.compile(model)
    cf(*inputs)
    inner = getattr(cf, "_compiled", cf)
    last = inner.last
    if last.graph_blocker is not None and not last.graph_blocker.startswith("its "):
        return None, last  # blocked for correctness (writes an input, draws random numbers...)
    last.graph_blocker, last.runner = None, None
    inner._fast_paths.clear()
    inner._fast = api.no_fast_path
    for _ in range(3):
        cf(*inputs)  # warm up, capture, replay
    assert last.runner is not None
    return cf, last


def queued_cpu_us(fn, inputs, launches: int) -> float:
    """CPU microseconds per call of `fn`, calls queued back to back without waiting for the GPU
    (few enough that the launch queue does not fill up and make the CPU wait)."""
    import time
    calls = max(3, min(20, 400 // max(launches, 1)))
    for _ in range(3):
        fn(*inputs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(*inputs)
    cpu = (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    return cpu * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("problems", nargs="*")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graph_choice.py times CUDA graphs: it needs a GPU")
    numbers = args.problems or sorted((f.name.split("_")[0] for f in PROBLEMS.glob("[0-9]*_*.py")),
                                      key=int)
    dtype = getattr(torch, args.dtype)
    print("problem | launches | ATen calls | model CPU us | steps CPU us | copied MB | copy us | "
          "GPU floor us | chosen | graph ms (bench) | steps ms (bench) | graph ms (wall) | "
          "steps ms (wall)")
    for number in numbers:
        name, build = load(number)
        torch.manual_seed(0)
        model, inputs = build("gpu")
        model = model.to("cuda", dtype).eval()
        inputs = [t.to("cuda", dtype) if t.is_floating_point() else t.to("cuda") for t in inputs]
        with torch.no_grad():
            steps = fusec.compile(model)
            steps(*inputs)
            chosen = getattr(steps, "_compiled", steps).last
            blocker = chosen.graph_blocker
            graph, last = forced_graph(model, inputs)
            program = last.program
            kernels, externs, model_cpu = cpu_estimate(program)
            copied = sum(t.numel() * t.element_size() for t in inputs) + sum(
                _bytes(n) for n in last.gm.graph.output_node().all_input_nodes)
            getattr(steps, "_compiled", steps).cuda_graphs = False  # step by step, always
            cpu_us = queued_cpu_us(steps, inputs, kernels + externs)
            times = []
            for timer in (median_ms, wall_ms):
                for fn in (graph, steps):
                    times.append(timer(fn, *inputs, device="cuda") if fn is not None else float("nan"))
        way = "graph" if blocker is None else "steps"
        best = "graph" if times[2] < times[3] else "steps"
        print(f"{name} | {kernels} | {externs} | {model_cpu:.0f} | {cpu_us:.0f} | {copied / 1e6:.1f} | {copied / COPY_BYTES_PER_US:.0f} | "
              f"{gpu_floor_us(program, last.gm):.0f} | {way} | "
              + " | ".join(f"{t:.3f}" for t in times)
              + (" <-- wrong" if graph is not None and way != best else ""), flush=True)
    print(f"(a graph is chosen where Triton launches x {LAUNCH_US:.0f} us + ATen calls x "
          f"{EXTERN_US:.0f} us > GPU floor + copy)")


if __name__ == "__main__":
    main()

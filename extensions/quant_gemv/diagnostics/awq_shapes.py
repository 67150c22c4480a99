"""AWQ's packed layer (examples/awq_linear.py) at decode shapes: eager, torch.compile and fusec.

    python extensions/quant_gemv/diagnostics/awq_shapes.py [--shapes 8192x8192,...] [--m 1,4,8,16]
                                                [--no-compile] [--source DIR] [--format gptq]
                                                [--forms] [--graph] [--one-graph]

AWQ packs eight 4-bit weights along N in each int32; fusec compiles its plain-torch unpacking
into one GEMV whose output columns are (N/8, 8) (passes/constant_gathers.py, extensions/quant_gemv/refine_views.py),
up to SPLIT_COLUMNS_MAX_M rows on a GPU (extensions/quant_gemv/small_matmul.py), and dequantizes once for the
library matmul above that. Each row gives, for one K x N layer (fp16, group 128) and M rows, the
median time (fusec.timing.median_ms: do_bench on CUDA) and the bytes the layer must read (packed
words, zero points, scales) per second, with fusec's kernels and its largest error against
eager. `--source DIR` writes the GEMV of the first shape, M = 1, to DIR. The numbers behind
SPLIT_COLUMNS_MAX_M are this script's (docs/passes/constant_gathers.md).

At M = 1 on a GPU the GEMV is cut along K into chunks of whole groups (passes/split_reductions.py,
extensions/quant_gemv/triton_gemv_int4_columns.py). `--forms` also times the one-GEMV form
(`FUSEC_INT4_COLUMNS=0`) in the same process, and `--graph` times both inside a CUDA graph: ten
calls captured and replayed, per call, which leaves out the launches a single call pays for
(a decode step is replayed that way). torch.compile is compiled once per shape and row count;
from dynamo's ninth compile in a process (its recompile limit) it runs eagerly, so time many
shapes with few `--m` values.
"""
from __future__ import annotations

import argparse
import os
from unittest import mock

import torch

import fusec
from fusec.examples.awq_linear import AWQLinear
from fusec.examples.gptq_linear import GPTQLinear
from fusec.timing import median_ms


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="8192x8192,4096x11008,11008x4096,4096x4096")
    p.add_argument("--m", default="1,4,8,16")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--source")
    p.add_argument("--forms", action="store_true", help="also the one-GEMV form (FUSEC_INT4_COLUMNS=0)")
    p.add_argument("--graph", action="store_true", help="fusec's forms timed inside a CUDA graph")
    p.add_argument("--one-graph", action="store_true",
                   help="fusec's forms timed as one call captured in a CUDA graph (do_bench)")
    p.add_argument("--format", choices=["awq", "gptq"], default="awq")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for i, shape in enumerate(args.shapes.split(",")):
        k, n = (int(v) for v in shape.split("x"))
        torch.manual_seed(0)
        cls = AWQLinear if args.format == "awq" else GPTQLinear
        layer = cls(torch.randn(k, n, device=device, dtype=torch.float16) / k ** 0.5,
                    128).to(device)
        nbytes = sum(b.numel() * b.element_size() for b in layer.buffers())
        fused = fusec.compile(layer)
        forms = {"fusec": (fused, fusec.compile(layer, cuda_graphs=False))}
        if args.forms:
            forms["one GEMV"] = (one_gemv(layer), one_gemv(layer, cuda_graphs=False))
        compiled = None if args.no_compile or device != "cuda" else torch.compile(layer)
        for m in [int(v) for v in args.m.split(",")]:
            x = torch.randn(m, k, device=device, dtype=torch.float16)
            with torch.no_grad():
                err = (fused(x).float() - layer(x).float()).abs().max().item()
                times = {"eager": median_ms(layer, x, device=device)}
                for name, (fn, graphable) in forms.items():
                    times[name] = median_ms(fn, x, device=device)
                    if args.graph and device == "cuda":  # (fusec's own graphs off inside ours)
                        times[f"{name} in a graph"] = in_a_graph(graphable, x)
                    if args.one_graph and device == "cuda":
                        times[f"{name} as one graph"] = in_a_graph(graphable, x, calls=1,
                                                                  flushed=True)
                if compiled is not None:
                    compiled(x)
                    times["torch.compile"] = median_ms(compiled, x, device=device)
            print(f"{args.format} {k}x{n} M={m:<2d} " + "  ".join(
                f"{name} {ms:.4f} ms ({nbytes / ms / 1e9:.2f} TB/s)" for name, ms in times.items())
                + f"  |err| {err:.3g}  kernels {[kk.name for kk in fused.kernels]}", flush=True)
            if args.source and i == 0 and m == 1:
                for kk in fused.kernels:
                    with open(os.path.join(args.source, f"{kk.name}.txt"), "w") as f:
                        f.write(kk.source)


def one_gemv(layer, **kwargs):
    """fusec's one-GEMV form of the layer: every call runs with the cut along K switched off, so
    that each new input signature compiles that way."""
    cf = fusec.compile(layer, **kwargs)

    def call(x):
        with mock.patch.dict(os.environ, {"FUSEC_INT4_COLUMNS": "0"}):
            return cf(x)
    return call


def in_a_graph(fn, x, calls: int = 10, flushed: bool = False) -> float:
    """Milliseconds per call of `fn(x)`, `calls` calls captured as one CUDA graph and replayed
    (median of 20 replays; with `flushed`, do_bench's median, the L2 flushed before each)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(x)
    if flushed:
        return median_ms(graph.replay, device="cuda") / calls
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    main()

"""Reductions and models: eager vs torch.compile vs fusec, side by side in one run.

    python benchmarks/models.py [--json out.json] [--only softmax,layernorm]

Rows (the project's GPU targets): softmax 4096x4096 f32, layernorm 8192x4096 f32 (memory-bound: the
bandwidth floor is the bytes read and written once over the copy bandwidth measured in the same
run), the GELU MLP 64x1024 f32, and the GPT-2 block 8x256x768 in f32 and bf16. Every row also
checks fusec's output against eager. Medians of triton.testing.do_bench on CUDA.

On CUDA, the MLP and GPT-2 rows also time torch.compile(mode="reduce-overhead") (CUDA graphs,
like fusec's replay). Peak memory is measured by benchmarks/cuda_graphs.py, one system per fresh
process (in one process, CUDA-graph pools and cuBLAS workspaces of earlier rows blur it).
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
from fusec.demo import load_example  # noqa: E402
from fusec.timing import copy_bandwidth, median_ms  # noqa: E402


def workloads(device: str, small: bool):
    scale = 8 if small else 1
    sm = load_example("softmax").example(rows=4096 // scale, cols=4096 // scale, device=device)
    ln = load_example("layernorm").example(rows=8192 // scale, cols=4096 // scale, device=device)
    yield "softmax", sm, sum(t.numel() * t.element_size() for t in sm.inputs) * 2
    yield "layernorm", ln, ln.inputs[0].numel() * 4 * 2
    yield "gelu_mlp f32", load_example("gelu_mlp").example(batch=64, dim=1024 // scale,
                                                           device=device), None
    gpt = load_example("gpt2_block")
    dims = dict(batch=8, seq=256, n_embd=768, n_head=12) if not small else {}
    yield "gpt2_block f32", gpt.example(device=device, **dims), None
    if device == "cuda":
        yield "gpt2_block bf16", gpt.example(device=device, dtype=torch.bfloat16, **dims), None


def warm_capture_stream_workspace(device: str = "cuda") -> float:
    """Run one matmul on the side stream fusec captures CUDA graphs on, and return the MB that
    allocated: cuBLAS's workspace for that stream. It is paid once per process (every fusec
    graph shares the stream), like the default stream's workspace that every system's first
    matmul pays; allocating both before measuring leaves each system's own memory in the peaks."""
    from fusec.runtime import capture_stream
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    a = torch.randn(64, 64, device=device)
    stream = capture_stream(torch.device(device))
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        b = a @ a
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    del a, b
    return (torch.cuda.memory_allocated() - before) / 2**20


def peak_mb(make, inputs) -> float:
    """Peak CUDA memory (MB) of one warm call of make()(*inputs), above the memory in use before
    make() built it: the program's own persistent buffers count, the inputs do not."""
    import gc
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    fn = make()
    for _ in range(3):
        out = fn(*inputs)
        del out
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = fn(*inputs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out, fn
    gc.collect()
    return peak / 2**20


def run(device: str, only: set | None, small: bool) -> list[dict]:
    bw = copy_bandwidth(device)
    rows = []
    for name, ex, nbytes in workloads(device, small):
        if only and name.split()[0] not in only:
            continue
        with torch.no_grad():
            fused = fusec.compile(ex.fn)
            got = fused(*ex.inputs)
            want = ex.fn(*ex.inputs)
            err = (got.double() - want.double()).abs().max().item()
            compiled = torch.compile(ex.fn)
            compiled(*ex.inputs)
            row = {"workload": f"{name} {tuple(ex.inputs[0].shape)}",
                   "eager_ms": median_ms(ex.fn, *ex.inputs, device=device),
                   "torch_compile_ms": median_ms(compiled, *ex.inputs, device=device),
                   "fusec_ms": median_ms(fused, *ex.inputs, device=device),
                   "fusec_kernels": len(fused.kernels), "max_abs_err": err}
            if device == "cuda" and nbytes is None:  # the model rows
                ro = torch.compile(ex.fn, mode="reduce-overhead")
                for _ in range(3):
                    ro(*ex.inputs)
                row["reduce_overhead_ms"] = median_ms(ro, *ex.inputs, device=device)
                del ro, compiled, fused
        if nbytes:
            row["floor_ms"] = nbytes / bw
        rows.append(row)
        print(row, flush=True)
    return rows


def print_table(rows, device):
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"\n{name}, torch {torch.__version__}, medians in ms")
    print("workload | eager | torch.compile | fusec | floor | fusec/compile | fusec/floor | kernels | max err")
    for r in rows:
        floor = f"{r['floor_ms']:.4f}" if "floor_ms" in r else "-"
        ratio = f"{r['fusec_ms'] / r['floor_ms']:.2f}" if "floor_ms" in r else "-"
        print(f"{r['workload']} | {r['eager_ms']:.4f} | {r['torch_compile_ms']:.4f} | "
              f"{r['fusec_ms']:.4f} | {floor} | {r['fusec_ms'] / r['torch_compile_ms']:.2f} | "
              f"{ratio} | {r['fusec_kernels']} | {r['max_abs_err']:.2g}")
    extra = [r for r in rows if "reduce_overhead_ms" in r]
    if extra:
        print("\nworkload | reduce-overhead ms | fusec ms | fusec/reduce-overhead")
        for r in extra:
            print(f"{r['workload']} | {r['reduce_overhead_ms']:.4f} | {r['fusec_ms']:.4f} | "
                  f"{r['fusec_ms'] / r['reduce_overhead_ms']:.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json")
    parser.add_argument("--only", help="comma-separated workload names")
    parser.add_argument("--small", action="store_true", help="CPU-sized shapes")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = run(device, set(args.only.split(",")) if args.only else None,
               args.small or device == "cpu")
    print_table(rows, device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How much of a decode-size layer's do_bench time is do_bench's own L2 flush?

    python benchmarks/diagnostics/l2_flush.py [--k 8192] [--layers 8]

`triton.testing.do_bench` empties the L2 before every call by writing zeros over a 256 MB buffer.
That leaves the L2 full of dirty lines, and their write-back to memory shares the bandwidth with
the reads of the kernel being timed: at decode sizes (a GEMV reads 35-134 MB in 15-50 us) that is
a good part of what is measured. A decode step does not start from such an L2, and it runs its
layers one after another, each finding its own weight cold.

For bf16 `F.linear` (cuBLAS), fusec's int8 and int4 layers (examples/int8_linear.py,
examples/int4_linear.py) and a bare read of the int4 layer's bytes (benchmarks/speed_of_light.py),
at M = 1 and K = N, this times one layer and `--layers` layers applied one after another (time per
layer), each call after one of three flushes: zeros written over 256 MB (do_bench's), 256 MB read
(the same lines evicted clean), or none. TB/s of each layer's bytes; one process, side by side.
docs/gpu.md (2026-11-27) has the numbers. Needs a GPU.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parents[1] / "examples")]
import fusec  # noqa: E402
from int4_linear import Int4Linear  # noqa: E402
from int8_linear import Int8Linear  # noqa: E402
from quant_linear import Bf16Linear, InARow, weight_bytes  # noqa: E402
from speed_of_light import read_only  # noqa: E402

BLOCK = 4096  # words per program of the bare read


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("l2_flush.py times L2 flushes on a GPU: it needs one")
    k, n_layers = args.k, args.layers
    flush_buffer = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")

    def read(buffer):
        sink = torch.empty(buffer.numel() // BLOCK + 1, dtype=torch.int32, device="cuda")
        return lambda: read_only[(sink.numel(),)](buffer, sink, buffer.numel(), BLOCK, 1,
                                                  num_warps=8)
    flushes = {"zero flush": flush_buffer.zero_, "read flush": read(flush_buffer),
               "no flush": lambda: None}

    torch.manual_seed(0)
    weights = [(torch.randn(k, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
               for _ in range(n_layers)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    kinds = {"bf16 F.linear (cuBLAS)": [Bf16Linear(w) for w in weights],
             "int8 fusec": [Int8Linear(w).cuda() for w in weights],
             "int4 fusec": [Int4Linear(w, 128).cuda() for w in weights]}
    with torch.no_grad():
        for name, layers in kinds.items():
            nbytes = weight_bytes(layers[0])
            fused = "fusec" in name
            one = fusec.compile(layers[0]) if fused else layers[0]
            row = fusec.compile(InARow(layers)) if fused else InARow(layers)
            report(name, nbytes, {"one, do_bench": do_bench(lambda: one(x), return_mode="median")}
                   | {f"one, {f}": timed(lambda: one(x), fl) for f, fl in flushes.items()}
                   | {f"{n_layers} in a row, {f}": timed(lambda: row(x), fl) / n_layers
                      for f, fl in flushes.items()})
        buffers = [torch.empty(weight_bytes(kinds["int4 fusec"][0]) // 4, dtype=torch.int32,
                               device="cuda") for _ in range(n_layers)]
        reads = [read(b) for b in buffers]
        report("bare read of the int4 layer's bytes", buffers[0].numel() * 4,
               {f"one, {f}": timed(reads[0], fl) for f, fl in flushes.items()}
               | {f"{n_layers} in a row, {f}": timed(lambda: [r() for r in reads], fl) / n_layers
                  for f, fl in flushes.items()})


def timed(fn, flush, reps: int = 200) -> float:
    """Median ms of fn() between two events, each call after `flush`."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    for start, end in zip(starts, ends):
        flush()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def report(name: str, nbytes: int, times: dict) -> None:
    print(f"{name} ({nbytes / 1e6:.1f} MB a layer), TB/s:", flush=True)
    for label, ms in times.items():
        print(f"    {label:28s} {ms:8.4f} ms  {nbytes / ms / 1e9:6.3f}", flush=True)


if __name__ == "__main__":
    main()

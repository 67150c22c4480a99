"""The quantized linears on this CPU: int8 and packed int4, one and four activation rows, both CPU backends.

    python benchmarks/diagnostics/cpu_quant_linear.py [--sizes 2048,4096] [--rows 1,4]

For each weight format, size (K = N) and M, times eager and fusec's C++ and LLVM kernels side
by side (fusec.timing.median_ms), with examples/int8_linear.py's and examples/int4_linear.py's
layers. With FUSEC_INT4_WORDS=0 in the environment the int4 layer keeps the generic reduction
loop instead of the C++ table kernel (codegen/cpp_int4.py), so two runs compare them.
"""
from __future__ import annotations

import argparse

import torch

import fusec
from fusec.examples.int4_linear import Int4Linear
from fusec.examples.int8_linear import example as int8_example
from fusec.timing import median_ms


def layers(fmt: str, size: int, m: int):
    torch.manual_seed(0)
    if fmt == "int8":
        ex = int8_example(m=m, k=size, n=size)
        return ex.fn, ex.inputs[0]
    layer = Int4Linear(torch.randn(size, size, dtype=torch.bfloat16) / 64)
    return layer, torch.randn(m, size, dtype=torch.bfloat16)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="2048,4096")
    p.add_argument("--rows", default="1,4")
    p.add_argument("--formats", default="int8,int4")
    args = p.parse_args()
    print(f"{'format':6s} {'K = N':>6s} {'M':>2s} {'eager ms':>9s} {'C++ ms':>14s} {'LLVM ms':>14s}")
    for fmt in args.formats.split(","):
        for size in (int(s) for s in args.sizes.split(",")):
            for m in (int(r) for r in args.rows.split(",")):
                layer, x = layers(fmt, size, m)
                with torch.no_grad():
                    eager = median_ms(layer, x)
                    times = {}
                    for backend in ("cpp", "llvm"):
                        compiled = fusec.compile(layer, backend=backend)
                        compiled(x)
                        times[backend] = median_ms(compiled, x)
                cells = [f"{times[b]:7.3f} ({eager / times[b]:4.2f}x)" for b in ("cpp", "llvm")]
                print(f"{fmt:6s} {size:6d} {m:2d} {eager:9.3f} {cells[0]:>14s} {cells[1]:>14s}",
                      flush=True)


if __name__ == "__main__":
    main()

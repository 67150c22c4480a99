"""The quantized linears on this CPU: int8, packed int4, GPTQ and AWQ, one and four activation
rows, both CPU backends.

    python extensions/quant_gemv/diagnostics/cpu_quant_linear.py [--sizes 2048,4096] [--rows 1,4]
        [--formats int8,int4,gptq,awq] [--compile]

For each weight format, size (K = N) and M, times eager and fusec's C++ and LLVM kernels side
by side (fusec.timing.median_ms), with examples/int8_linear.py's, int4_linear.py's,
gptq_linear.py's and awq_linear.py's layers; `--compile` adds torch.compile (Inductor's CPU
backend) on the same layer. With FUSEC_INT4_WORDS=0 in the environment the int4 layer keeps the generic reduction
loop instead of the C++ table kernel (extensions/quant_gemv/cpp_int4.py), so two runs compare them.
"""
from __future__ import annotations

import argparse

import torch

import fusec
from fusec.examples.int4_linear import Int4Linear
from fusec.examples.awq_linear import example as awq_example
from fusec.examples.gptq_linear import example as gptq_example
from fusec.examples.int8_linear import example as int8_example
from fusec.timing import median_ms


EXAMPLES = {"int8": int8_example, "gptq": gptq_example, "awq": awq_example}


def layers(fmt: str, size: int, m: int):
    torch.manual_seed(0)
    if fmt in EXAMPLES:
        ex = EXAMPLES[fmt](m=m, k=size, n=size)
        return ex.fn, ex.inputs[0]
    layer = Int4Linear(torch.randn(size, size, dtype=torch.bfloat16) / 64)
    return layer, torch.randn(m, size, dtype=torch.bfloat16)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="2048,4096")
    p.add_argument("--rows", default="1,4")
    p.add_argument("--formats", default="int8,int4,gptq,awq")
    p.add_argument("--compile", action="store_true", help="also time torch.compile")
    args = p.parse_args()
    systems = ["cpp", "llvm"] + (["torch.compile"] if args.compile else [])
    print(f"{'format':6s} {'K = N':>6s} {'M':>2s} {'eager ms':>9s} {'C++ ms':>14s} {'LLVM ms':>14s}"
          + (f" {'torch.compile':>14s}" if args.compile else ""))
    for fmt in args.formats.split(","):
        for size in (int(s) for s in args.sizes.split(",")):
            for m in (int(r) for r in args.rows.split(",")):
                layer, x = layers(fmt, size, m)
                with torch.no_grad():
                    eager = median_ms(layer, x)
                    times = {}
                    for system in systems:
                        compiled = torch.compile(layer) if system == "torch.compile" \
                            else fusec.compile(layer, backend=system)
                        compiled(x)
                        times[system] = median_ms(compiled, x)
                cells = [f"{times[b]:7.3f} ({eager / times[b]:4.2f}x)" for b in systems]
                print(f"{fmt:6s} {size:6d} {m:2d} {eager:9.3f} "
                      + " ".join(f"{c:>14s}" for c in cells), flush=True)


if __name__ == "__main__":
    main()

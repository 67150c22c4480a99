"""What the GPU runs for fusec's int4 word GEMV: registers, spills and the loop's SASS, per variant.

    python extensions/quant_gemv/diagnostics/int4_sass.py [--k 8192] [--n 8192] [--out DIR] [--arch 90]

int4_words_variants.py times edits of the generated kernel; this script looks at the machine code
of the same edits, so a timing can be explained by an instruction count. For each variant it
prints the registers per thread and spilled bytes (Triton's compiled kernel), how many warps of
the kernel fit on one SM by registers, and the instructions of the kernel's K loop (the body
between the loop's label and its backward branch, as `cuobjdump -sass` prints it), counted by
opcode. Each instruction in the loop body runs once per thread per chunk of BLOCK_W words, so
dividing by the weights one thread handles in a chunk gives instructions per weight: the number
that says whether the loop is bound by issuing instructions rather than by memory.

With --out, each variant's full SASS is written there as <variant>.sass.

No GPU is needed. On a machine without one (or with --arch), each variant is compiled for the
named architecture (90: H100/H200) by Triton's own compiler, ptxas and cuobjdump, which ship with
Triton (fusec/codegen/triton/target.py, what `fusec kernels --asm` uses), rendered with the PTX
dequantization a GPU would get. On the H200 this
gave the same registers and loop as the kernel compiled there, so
instruction counts can be compared between GPU sessions; timings still need the GPU.
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

import torch

import fusec  # first: on a machine without a GPU it switches Triton's interpreter on
import triton
from fusec.codegen import triton as triton_codegen
from fusec.codegen.triton import target as triton_target

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fusec.examples.int4_linear import Int4Linear  # noqa: E402
from int4_words_variants import variants, load  # noqa: E402

SHOWN = ["as generated", "no dequant", "2 FMAs", "factored, f32", "prefetch x, zero, scale",
         "x by 8 loads, no splits", "groups gathered per word", "unrolled + prefetch + factored"]
LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
BRANCH = re.compile(r"BRA(?:\.\w+)?\s+`?\(?\.?L?_?x?_?(0x[0-9a-f]+|\w+)")


def sass(cubin: bytes) -> str:
    """The kernel's SASS (cuobjdump, as Triton ships it)."""
    return triton_target.cuobjdump(cubin, "-sass")


def loop_body(text: str) -> list[str]:
    """Opcodes of the largest loop: the instructions from a backward branch's target to it."""
    instrs = []  # (address, opcode, operands)
    for m in LINE.finditer(text):
        instrs.append((int(m.group(1), 16), m.group(3), m.group(4)))
    best: list[str] = []
    for i, (addr, op, rest) in enumerate(instrs):
        if not op.startswith("BRA"):
            continue
        target = re.search(r"0x([0-9a-f]+)", rest)
        if target is None:
            continue
        to = int(target.group(1), 16)
        if to >= addr:
            continue  # a forward branch
        body = [o for a, o, _ in instrs if to <= a <= addr]
        if len(body) > len(best):
            best = body
    return best


def loop_summary(done: dict, weights_per_thread: float, top: int = 8) -> str:
    """One line for a kernel compiled offline (triton_target.compile_for): registers, spills, the
    loop's instruction count, per weight a thread handles in one trip, and its commonest opcodes."""
    loop = [op.split(".")[0] for op in loop_body(done["sass"])]
    common = ", ".join(f"{o} {c}" for o, c in collections.Counter(loop).most_common(top))
    return (f"sm_90, {done['regs']} registers, {done['spills']} bytes spilled, loop {len(loop)} "
            f"instructions ({len(loop) / weights_per_thread:.2f} per weight): {common}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--out", default=None, help="write each variant's SASS here")
    p.add_argument("--variants", default=";".join(SHOWN), help="variant names, ';' between")
    p.add_argument("--arch", type=int, default=None,
                   help="compile for sm_<arch> without launching (default: 90 without a GPU)")
    args = p.parse_args()
    gpu = torch.cuda.is_available() and args.arch is None
    device = "cuda" if gpu else "cpu"
    torch.manual_seed(0)
    layer = Int4Linear(torch.randn(args.n, args.k, dtype=torch.bfloat16) / 64).to(device)
    x = torch.randn(1, args.k, dtype=torch.bfloat16, device=device)
    if gpu:
        cf = fusec.compile(layer)
        with torch.no_grad():
            cf(x)
        [kernel] = cf.kernels
    else:  # rendered as for that GPU: with the PTX dequantization (extensions/quant_gemv/triton_gemv_int4.py)
        [kernel] = fusec.explain(layer, x, backend="triton").kernels
    source = kernel.source if gpu else triton_codegen.render(kernel.ir, arch=args.arch or 90)
    print(f"Triton {triton.__version__}, " + (torch.cuda.get_device_name() if gpu else
                                             f"compiled for sm_{args.arch or 90} (no GPU)"))
    params = re.search(r"def launch\((.*?)\):", source).group(1).split(", ")
    block_n = int(re.search(r"BLOCK_N=(\d+)", source).group(1))
    block_w = int(re.search(r"BLOCK_W=(\d+)", source).group(1))
    warps = int(re.search(r"num_warps=(\d+)", source).group(1))
    per_thread = block_n * block_w * 8 / (32 * warps)  # weights one thread handles per chunk
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    every = variants(source, args.n)
    for i, label in enumerate(args.variants.split(";")):
        out = torch.empty(1, args.n, dtype=torch.bfloat16, device=device)
        tensors = [getattr(layer, a[2:]) if a.startswith("p_") else x if a == "x" else out
                   for a in params]
        if gpu:
            compiled = load(every[label], f"sass_variant_{i}").launch(*tensors)
            text = sass(compiled.asm["cubin"])
            regs, spills = compiled.n_regs, compiled.n_spills
        else:
            done = triton_target.compile_for(every[label], kernel.name,
                                             [str(t.dtype).removeprefix("torch.") for t in tensors],
                                             args.arch or 90)
            text, regs, spills = done["sass"], done["regs"], done["spills"]
        if out_dir:
            (out_dir / (re.sub(r"\W+", "_", label) + ".sass")).write_text(text)
        body = loop_body(text)
        chunks = 1
        if not body:  # an unrolled loop: the whole kernel, over all its chunks
            body = [m.group(3) for m in LINE.finditer(text)]
            chunks = -(-args.k // 8 // block_w)
        # registers are given out in steps of 8 per thread, and whole blocks fit on an SM
        fit = min(64, 65536 // (-(-regs // 8) * 8 * 32) // warps * warps) if regs else "?"
        counts = collections.Counter(op.split(".")[0] for op in body)
        top = ", ".join(f"{op} {n}" for op, n in counts.most_common(14))
        print(f"{label}: {regs} registers, {spills} bytes spilled; warps per SM by registers: {fit}")
        print(f"  loop body {len(body)} instructions, {len(body) / per_thread / chunks:.2f} per weight "
              f"({per_thread:.0f} weights per thread per chunk): {top}", flush=True)


if __name__ == "__main__":
    main()

"""What the GPU runs for fusec's int4 word GEMV: registers, spills and the loop's SASS, per variant.

    python benchmarks/diagnostics/int4_sass.py [--k 8192] [--n 8192] [--out DIR]

int4_words_variants.py times edits of the generated kernel; this script looks at the machine code
of the same edits, so a timing can be explained by an instruction count. For each variant it
prints the registers per thread and spilled bytes (Triton's compiled kernel), how many warps of
the kernel fit on one SM by registers, and the instructions of the kernel's K loop (the body
between the loop's label and its backward branch, as `cuobjdump -sass` prints it), counted by
opcode. Each instruction in the loop body runs once per thread per chunk of BLOCK_W words, so
dividing by the weights one thread handles in a chunk gives instructions per weight: the number
that says whether the loop is bound by issuing instructions rather than by memory.

With --out, each variant's full SASS is written there as <variant>.sass.
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import fusec

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from int4_linear import Int4Linear  # noqa: E402
from int4_words_variants import variants, load  # noqa: E402

SHOWN = ["as generated", "no dequant", "2 FMAs", "factored, f32", "prefetch x, zero, scale",
         "x by 8 loads, no splits", "groups gathered per word", "unrolled + prefetch + factored"]
LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
BRANCH = re.compile(r"BRA(?:\.\w+)?\s+`?\(?\.?L?_?x?_?(0x[0-9a-f]+|\w+)")


def sass(cubin: bytes) -> str:
    """The kernel's SASS, from the cuobjdump that Triton ships (or one on PATH)."""
    try:
        from triton import knobs
        tool = knobs.nvidia.cuobjdump.path
    except Exception:  # noqa: BLE001 (an older Triton: its own tool, else PATH)
        tool = "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout


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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--out", default=None, help="write each variant's SASS here")
    p.add_argument("--variants", default=",".join(SHOWN), help="comma-separated variant names")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU: it compiles generated Triton kernels for it")
    torch.manual_seed(0)
    layer = Int4Linear(torch.randn(args.n, args.k, dtype=torch.bfloat16) / 64).cuda()
    x = torch.randn(1, args.k, dtype=torch.bfloat16, device="cuda")
    cf = fusec.compile(layer)
    with torch.no_grad():
        cf(x)
    [kernel] = cf.kernels
    source = kernel.source
    params = re.search(r"def launch\((.*?)\):", source).group(1).split(", ")
    block_n = int(re.search(r"BLOCK_N=(\d+)", source).group(1))
    block_w = int(re.search(r"BLOCK_W=(\d+)", source).group(1))
    warps = int(re.search(r"num_warps=(\d+)", source).group(1))
    per_thread = block_n * block_w * 8 / (32 * warps)  # weights one thread handles per chunk
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    every = variants(source, args.n)
    for i, label in enumerate(args.variants.split(",")):
        module = load(every[label], f"sass_variant_{i}")
        out = torch.empty(1, args.n, dtype=torch.bfloat16, device="cuda")
        tensors = [getattr(layer, a[2:]) if a.startswith("p_") else x if a == "x" else out
                   for a in params]
        compiled = module.launch(*tensors)
        text = sass(compiled.asm["cubin"])
        if out_dir:
            (out_dir / (re.sub(r"\W+", "_", label) + ".sass")).write_text(text)
        body = loop_body(text)
        chunks = 1
        if not body:  # an unrolled loop: the whole kernel, over all its chunks
            body = [m.group(3) for m in LINE.finditer(text)]
            chunks = -(-args.k // 8 // block_w)
        regs = getattr(compiled, "n_regs", 0)
        fit = min(64, 65536 // max(regs * 32, 1) // warps * warps) if regs else "?"
        counts = collections.Counter(op.split(".")[0] for op in body)
        top = ", ".join(f"{op} {n}" for op, n in counts.most_common(14))
        print(f"{label}: {regs} registers, {getattr(compiled, 'n_spills', '?')} spilled; "
              f"warps per SM by registers: {fit}")
        print(f"  loop body {len(body)} instructions, {len(body) / per_thread / chunks:.2f} per weight "
              f"({per_thread:.0f} weights per thread per chunk): {top}", flush=True)


if __name__ == "__main__":
    main()

"""Where fusec's generated int4 word GEMV loses time: its own source, timed with one thing changed.

    python benchmarks/diagnostics/int4_words_variants.py [--k 8192] [--n 8192] [--m 1]

fusec compiles a packed-int4 linear (examples/int4_linear.py, group 128, bf16 activations) to
one Triton GEMV that reads the weight as 32-bit words (codegen/triton_gemv_int4.py). This script
takes that kernel's generated module, edits its text, and times each edit on the same tensors
(bytes of packed weight, scales and zero points per second, as quant_linear.py counts them; do_bench medians):

* `as generated`;
* `2 FMAs`: the dequantization without the exact `q = (128 + q) - 128` step (wrong values for a
  fractional zero point: timing only), as benchmarks/diagnostics/int4_gemv_words.py's PAIRS kernel;
* `no dequant`: the bf16 pairs multiplied as they come (timing only);
* `stages 1`: num_stages=1 at launch;
* block sizes: BLOCK_N x BLOCK_W (words) x warps.

Timing-only variants print their error against eager, so nobody mistakes them for a fix.
"""
from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import fusec
from fusec.timing import median_ms

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from int4_linear import Int4Linear  # noqa: E402


def variants(source: str, n: int) -> dict[str, str]:
    out = {"as generated": source}
    out["2 FMAs"] = source.replace(' " fma.rn.bf16x2 r_q, $1, r_one, r_m128;\\n"', "").replace(
        "fma.rn.bf16x2 r_d, r_q, r_one, $2", "fma.rn.bf16x2 r_d, $1, r_one, $2")
    out["no dequant"] = re.sub(r"dequant_pairs\((.*), zneg2, s2\)\n", r"\1\n", source)
    out["stages 1"] = source.replace("num_stages=3", "num_stages=1")
    out["x .to(float32)"] = source.replace("fusec_bf16_to_f32(x8)", "x8.to(tl.float32)")
    out["x by 8 loads, no splits"] = _x_by_eight_loads(source)
    for bn, bw, warps in [(8, 256, 8), (4, 256, 4), (8, 128, 4), (16, 128, 8), (4, 512, 8),
                          (16, 256, 8), (2, 512, 4), (8, 64, 4), (16, 64, 4), (32, 64, 8),
                          (4, 128, 2), (8, 128, 2)]:
        out[f"{bn} x {bw} x {warps}"] = _blocks(source, n, bn, bw, warps)
    return out


def _blocks(source: str, n: int, bn: int, bw: int, warps: int) -> str:
    text = re.sub(r"BLOCK_N=\d+", f"BLOCK_N={bn}", source)
    text = re.sub(r"BLOCK_W=\d+", f"BLOCK_W={bw}", text)
    text = re.sub(r"num_warps=\d+", f"num_warps={warps}", text)
    return re.sub(rf"triton.cdiv\({n}, \d+\)", f"triton.cdiv({n}, {bn})", text)


def _x_by_eight_loads(source: str) -> str:
    """The eight activations of each word as eight strided [BLOCK_W] loads instead of one
    [BLOCK_W, 8] load taken apart by tl.split (M = 1 kernels only)."""
    out, skipping = [], False
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith("x8 = tl.load("):
            skipping = True
            out += [f"        x{t} = fusec_bf16_to_f32(tl.load(x_ptr + (w_start + "
                    f"tl.arange(0, BLOCK_W)) * 8 + {t}))[None, None, :]" for t in range(8)]
            continue
        if skipping:
            if stripped.startswith("x7 = x7[None, None, :]"):
                skipping = False
            continue
        out.append(line)
    return "\n".join(out) + "\n"


def load(text: str, name: str):
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--m", type=int, default=1)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU: it times generated Triton kernels")
    torch.manual_seed(0)
    layer = Int4Linear(torch.randn(args.n, args.k, dtype=torch.bfloat16) / 64).cuda()
    x = torch.randn(args.m, args.k, dtype=torch.bfloat16, device="cuda")
    cf = fusec.compile(layer)
    with torch.no_grad():
        want = layer(x)
        cf(x)
    [kernel] = cf.kernels
    source = kernel.source
    params = re.search(r"def launch\((.*?)\):", source).group(1).split(", ")
    packed_bytes = sum(b.numel() * b.element_size() for b in layer.buffers())  # as quant_linear.py
    print(f"{kernel.name}: M={args.m} N={args.n} K={args.k}; launch({', '.join(params)})")
    for i, (label, text) in enumerate(variants(source, args.n).items()):
        module = load(text, f"variant_{i}")
        out = torch.empty(args.m, args.n, dtype=torch.bfloat16, device="cuda")
        tensors = [getattr(layer, a[2:]) if a.startswith("p_") else x if a == "x" else out
                   for a in params]
        try:  # timed as fusec runs it: the compiled kernel bound to its grid (module.bind)
            run = module.bind(module.launch(*tensors))
            ms = median_ms(run, *tensors, device="cuda")
        except Exception as err:  # noqa: BLE001 (a variant Triton refuses: say so, go on)
            print(f"{label:24s} failed: {type(err).__name__}: {str(err)[:120]}")
            continue
        err = (out.float() - want.float()).abs().max().item()
        print(f"{label:24s} {ms:8.4f} ms {packed_bytes / ms / 1e9:6.3f} TB/s  |out - eager| {err:.3g}",
              flush=True)
    w = layer.weight(torch.bfloat16)  # the same weight as bf16: 4x the bytes
    print(f"bf16 F.linear (cuBLAS)   {median_ms(F.linear, x, w, device='cuda'):8.4f} ms "
          f"({w.numel() * 2 / 1e6:.0f} MB of bf16 weight)")


if __name__ == "__main__":
    main()

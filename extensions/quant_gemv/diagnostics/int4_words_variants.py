"""Where fusec's generated int4 word GEMV loses time: its own source, timed with one thing changed.

    python extensions/quant_gemv/diagnostics/int4_words_variants.py [--k 8192] [--n 8192] [--m 1]

fusec compiles a packed-int4 linear (examples/int4_linear.py, group 128, bf16 activations) to
one Triton GEMV that reads the weight as 32-bit words (extensions/quant_gemv/triton_gemv_int4.py). This script
takes that kernel's generated module, edits its text, and times each edit on the same tensors
(bytes of packed weight, scales and zero points per second, as quant_linear.py counts them; do_bench medians):

* `as generated`;
* `2 FMAs`: the dequantization without the exact `q = (128 + q) - 128` step (wrong values for a
  fractional zero point: timing only), as extensions/quant_gemv/diagnostics/int4_gemv_words.py's PAIRS kernel;
* `no dequant`: the bf16 pairs multiplied as they come (timing only);
* `groups gathered per word`: each word lane loads its group's zero point and scale itself;
* `stages 1`: num_stages=1 at launch;
* `factored`: scale and zero point applied once per word, in float32 (more accurate than eager,
  but not eager's bf16 rounding of each weight: its error against eager is printed);
* `prefetch x, zero, scale`: the next chunk's activations, zero points and scales loaded at the
  top of the loop, as the words are; `unrolled`: the K loop as `tl.static_range`; and their mixes;
* block sizes: BLOCK_N x BLOCK_W (words) x warps;
* `maxnreg R`: at most R registers per thread (Triton's launch option). Nsight Compute on an H200
  found the generated kernel at 80 registers, 6 programs of 4 warps per SM (792 at once), so its
  1024 programs ran as one full wave and a partial wave of 233 (2026-11-26, evening); 64
  registers fit 8 programs per SM, and 1024 programs in one wave.

Timing-only variants print their error against eager, so nobody mistakes them for a fix.
"""
from __future__ import annotations

import argparse
import importlib.util
import re
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import fusec
from fusec.examples.int4_linear import Int4Linear
from fusec.timing import median_ms


def variants(source: str, n: int) -> dict[str, str]:
    out = {"as generated": source}
    out["2 FMAs"] = source.replace(' " fma.rn.bf16x2 r_q, $1, r_one, r_m128;\\n"', "").replace(
        "fma.rn.bf16x2 r_d, r_q, r_one, $2", "fma.rn.bf16x2 r_d, $1, r_one, $2")
    out["no dequant"] = re.sub(r"dequant_pairs\((.*), zneg2, s2\)\n", r"\1\n", source)
    out["stages 1"] = source.replace("num_stages=3", "num_stages=1")
    out["x .to(float32)"] = source.replace("fusec_bf16_to_f32(x8)", "x8.to(tl.float32)")
    out["x by 8 loads, no splits"] = _x_by_eight_loads(source)
    out["factored, f32"] = _factored(source)
    out["groups gathered per word"] = _gathered_groups(source)
    out["prefetch x, zero, scale"] = _prefetch_all(source)
    out["unrolled"] = _unrolled(source)
    out["unrolled + prefetch"] = _unrolled(_prefetch_all(source))
    out["unrolled + prefetch + factored"] = _unrolled(_prefetch_all(_factored(source)))
    for bn, bw, warps in [(4, 128, 4), (16, 128, 4), (8, 64, 4), (16, 64, 4), (8, 256, 8)]:
        out[f"prefetch {bn} x {bw} x {warps}"] = _blocks(_prefetch_all(source), n, bn, bw, warps)
        out[f"unrolled + prefetch {bn} x {bw} x {warps}"] = _blocks(
            _unrolled(_prefetch_all(source)), n, bn, bw, warps)
    for bn, bw, warps in [(4, 128, 4), (16, 128, 4), (16, 128, 8), (8, 64, 4), (16, 64, 4),
                          (32, 64, 8), (8, 256, 8), (4, 256, 4), (8, 128, 8), (8, 128, 2)]:
        out[f"all three {bn} x {bw} x {warps}"] = _blocks(
            _unrolled(_prefetch_all(_factored(source))), n, bn, bw, warps)
    for parts, bn, bw, warps in [(2, 8, 128, 4), (4, 8, 128, 4), (2, 16, 128, 4), (4, 16, 128, 4),
                                 (2, 16, 64, 4), (4, 32, 64, 4)]:
        out[f"all three, K split {parts}, {bn} x {bw} x {warps}"] = _split_k(_blocks(
            _unrolled(_prefetch_all(_factored(source))), n, bn, bw, warps), parts)
    for bn, bw, warps in [(8, 256, 8), (4, 256, 4), (8, 128, 4), (16, 128, 8), (4, 512, 8),
                          (16, 256, 8), (2, 512, 4), (8, 64, 4), (16, 64, 4), (32, 64, 8),
                          (4, 128, 2), (8, 128, 2)]:
        out[f"{bn} x {bw} x {warps}"] = _blocks(source, n, bn, bw, warps)
    for regs in (64, 72, 56):
        out[f"maxnreg {regs}"] = _maxnreg(source, regs)
        out[f"unrolled, maxnreg {regs}"] = _maxnreg(_unrolled(source), regs)
    for bn, bw, warps, regs in [(4, 128, 4, 64), (16, 128, 8, 64), (8, 128, 2, 64), (16, 64, 4, 64),
                                (8, 256, 8, 64), (4, 256, 4, 64)]:
        out[f"{bn} x {bw} x {warps}, maxnreg {regs}"] = _maxnreg(_blocks(source, n, bn, bw, warps), regs)
    return out


def _maxnreg(source: str, regs: int) -> str:
    """At most `regs` registers per thread (more programs per SM; ptxas may spill)."""
    return source.replace("enable_fp_fusion=True)", f"enable_fp_fusion=True, maxnreg={regs})")


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


def _factored(source: str) -> str:
    """Scale and zero point applied per word, not per weight: each word lane sums
    (128 + q_t) * x_t over its eight nibbles in float32, then adds
    s * (that - (128 + zero) * sum(x_t)). One multiply-add per weight and none of the bf16
    rounding steps: more accurate than eager's (q - z) * s in bf16, and not eager's rounding
    (timing, and its error printed)."""
    lines = source.splitlines()
    start = next(i for i, l in enumerate(lines) if "w2 = dequant_pairs(nibble_pairs(words)" in l)
    end = max(i for i, l in enumerate(lines) if l.strip().startswith("acc += ") and "x7" in l)
    pad = " " * 8
    body = []
    for t in range(4):
        shifted = "words" if t == 0 else f"(words >> {4 * t})"
        body.append(f"{pad}p = ({shifted} & 0x000F000F) | 0x43004300")
        op = "inner = " if t == 0 else "inner += "
        body.append(f"{pad}{op}(p << 16).to(tl.float32, bitcast=True) * x{t} + "
                    f"(p & -65536).to(tl.float32, bitcast=True) * x{t + 4}")
    body += [f"{pad}xs = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))",
             f"{pad}s_f = (s2 << 16).to(tl.float32, bitcast=True)",
             f"{pad}zp_f = 128.0 - (zneg2 << 16).to(tl.float32, bitcast=True)",
             f"{pad}acc += s_f * (inner - zp_f * xs)"]
    return "\n".join(lines[:start] + body + lines[end + 1:]) + "\n"


def _gathered_groups(source: str) -> str:
    """Each word lane loads its own group's zero point and scale (eight neighbouring lanes read
    the same address, which the cache serves once), instead of one load per group spread over
    its lanes by broadcast_to and reshape."""
    out = []
    for line in source.splitlines():
        m = re.match(r"(\s+)(zneg2|s2) = tl\.reshape\(tl\.broadcast_to\(\(bf16x2\(tl\.load\("
                     r"(p_\w+_ptr) \+ n \* (\d+) \+ gs\), (True|False)\)\)", line)
        if m:
            pad, var, ptr, row, neg = m.groups()
            per = re.search(r"gs = w_start // (\d+)", source).group(1)
            line = (f"{pad}{var} = bf16x2(tl.load({ptr} + n * {row} + (w_start + "
                    f"tl.arange(0, BLOCK_W)[None, None, :]) // {per}), {neg})")
        out.append(line)
    return "\n".join(out) + "\n"


def _prefetch_all(source: str) -> str:
    """The next chunk's activations, zero points and scales loaded at the top of each iteration,
    as the words already are, so that no load's latency waits inside the loop."""
    x_load = re.search(r"x8 = (tl\.load\(x_ptr \+ \(\(w_start \+ .*\))\n", source).group(1)
    z_load = re.search(r"tl\.load\(p_zero_ptr \+ [^)]*gs\)", source).group(0)
    s_load = re.search(r"tl\.load\(p_scale_ptr \+ [^)]*gs\)", source).group(0)
    gs_line = re.search(r"\n(        gs = w_start // (\d+) .*)\n", source)
    first = ["    gs_n = 0 + " + gs_line.group(1).split("+ ", 1)[1],
             "    z_next = " + z_load.replace("gs)", "gs_n)"),
             "    s_next = " + s_load.replace("gs)", "gs_n)"),
             "    x_next = " + x_load.replace("w_start", "0")]
    body = ["        w_nx = tl.where(w_start + BLOCK_W < n_words, w_start + BLOCK_W, 0)",
            "        gs_n = w_nx // " + gs_line.group(2) + " + " + gs_line.group(1).split("+ ", 1)[1],
            "        z_cur = z_next", "        s_cur = s_next", "        x_cur = x_next",
            "        z_next = " + z_load.replace("gs)", "gs_n)"),
            "        s_next = " + s_load.replace("gs)", "gs_n)"),
            "        x_next = " + x_load.replace("w_start", "w_nx")]
    text = source.replace(gs_line.group(1), "\n".join(body))
    text = text.replace(z_load, "z_cur").replace(s_load, "s_cur")
    text = text.replace("x8 = " + x_load, "x8 = x_cur")
    return text.replace("    for w_start in range(", "\n".join(first) + "\n    for w_start in range(", 1)


def _split_k(source: str, parts: int) -> str:
    """K cut into `parts` slices, one program per (columns, slice): `parts` times the programs,
    each with 1/parts of the loop. The slices' sums are not combined (every slice stores its
    own over the same outputs): timing only, for the bandwidth such a grid could reach."""
    text = source.replace("    pid = tl.program_id(axis=0)\n", "    pid = tl.program_id(axis=0)\n"
                          f"    kofs = tl.program_id(axis=1) * (n_words // {parts})\n", 1)
    text = text.replace("    ws = tl.arange(0, BLOCK_W)[None, None, :]",
                        "    ws = kofs + tl.arange(0, BLOCK_W)[None, None, :]", 1)
    text = text.replace("    gs_n = 0 + ", "    gs_n = kofs // 16 + ", 1)
    text = text.replace("    x_next = tl.load(x_ptr + ((0 + ", "    x_next = tl.load(x_ptr + ((kofs + ", 1)
    text = text.replace("    for w_start in tl.static_range(0, n_words, BLOCK_W):\n",
                        f"    for w_step in tl.static_range(0, n_words // {parts}, BLOCK_W):\n"
                        "        w_start = kofs + w_step\n", 1)
    text = re.sub(r"grid = \((triton\.cdiv\(\d+, \d+\)),\)", rf"grid = (\1, {parts})", text)
    return re.sub(r"compiled\[\((triton\.cdiv\(\d+, \d+\)), 1, 1\)\]",
                  rf"compiled[(\1, {parts}, 1)]", text)


def _unrolled(source: str) -> str:
    """The K loop unrolled (tl.static_range): every chunk's loads can be issued early."""
    return source.replace("for w_start in range(", "for w_start in tl.static_range(")


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
    p.add_argument("--only", default="", help="comma-separated substrings of the variants to time")
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
    wanted = [w for w in args.only.split(",") if w]
    for i, (label, text) in enumerate(variants(source, args.n).items()):
        if wanted and label != "as generated" and not any(w in label for w in wanted):
            continue
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

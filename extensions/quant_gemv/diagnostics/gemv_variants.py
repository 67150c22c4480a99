"""What limits the GEMV kernel: the same generated kernel with one thing changed at a time, on a GPU.

    python extensions/quant_gemv/diagnostics/gemv_variants.py [--cases int4:1,int8:1,int8:16,bf16:1]

For each case (weight format : M rows, K = N = 8192) it compiles the layer with fusec, then again
with the generated GEMV's text edited (extensions/quant_gemv/triton_gemv.py's output, before it is built) or
with other block sizes, and prints the median time (do_bench, L2 flushed) and the weight bytes
streamed per second. The edits are experiments, not fusec's output:

* `noround`: drop the bf16 rounding of the intermediate dequantization steps (eager rounds
  `(q - z) * s` twice in bf16; this variant computes it in float32): how much the rounding costs;
* `intround`: round to bf16 with integer instructions in float32 registers instead of a
  float-to-bf16 conversion and back;
* `noprefetch`: without the lane version's hand-written prefetch (GEMV_PREFETCH);
* `nopairs`: the activations of a packed int4 byte's two nibbles loaded as two strided loads
  instead of one load of pairs (GEMV_PAIRS);
* `cg`, `evict`: the weight's loads with `cache_modifier=".cg"` (not kept in L1) or
  `eviction_policy="evict_first"`: a streamed weight is read once;
* `nogroups`, an ablation with wrong results: the per-group scale and zero point replaced by a
  constant, to time what repeating them over their group's lanes costs;
* `bf16` weights: `F.linear(x, w + 0)`, a computed plain weight, so that small_matmul makes the
  GEMV that it leaves to cuBLAS for a stored bf16 weight: fusec's kernel against cuBLAS's.
"""
from __future__ import annotations

import argparse
import re

import torch
import torch.nn.functional as F

import fusec
import fusec.extensions.quant_gemv.triton_gemv as tg
import fusec.codegen.triton.reduction as trd
from fusec.examples.int4_linear import Int4Linear
from fusec.examples.int8_linear import Int8Linear
from fusec.timing import median_ms

ROUND = "fusec_bf16_to_f32(fusec_f32_to_bf16("

# jit helpers appended to an edited kernel's module (the variant text calls them)
HELPERS = '''

@triton.jit
def v_ident(x):
    return x


@triton.jit
def v_round_bf16(x):
    # round a float32 to the nearest bf16 (ties to even), kept in float32 registers: integer
    # add, and, shift; a NaN stays itself
    bits = x.to(tl.uint32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, r.to(tl.float32, bitcast=True))
'''


def edit(src: str, variant: str) -> str:
    parts = set(variant.split("+"))
    if "nogroups" in parts:  # an ablation (wrong results): per-group values as a constant
        src = re.sub(r"^(\s*)(v\w+) = tl\.reshape\(tl\.broadcast_to\(.*$",
                     r"\1\2 = tl.full([1, 1, BLOCK_K], 0.5, tl.float32)", src, flags=re.M)
    if "noround" in parts:
        src = src.replace(ROUND, "v_ident(v_ident(")
    if "intround" in parts:
        src = src.replace(ROUND, "v_ident(v_round_bf16(")
    if parts & {"cg", "evict"}:  # the weight's loads (address along n): streamed, read once
        hint = ', cache_modifier=".cg"' if "cg" in parts else ', eviction_policy="evict_first"'
        src = re.sub(r"(tl\.load\(\w+_ptr \+ [^\n]*?n \* \d+ \+ [^\n]*?)\)(\)?)$",
                     lambda mt: mt.group(1) + hint + ")" + (mt.group(2) or ""), src, flags=re.M)
    if parts & {"noround", "intround"}:
        head, sep, rest = src.partition("\n\n@triton.jit")
        src = head + HELPERS + sep + rest
    return src


class Bf16Linear(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.register_buffer("w", w)

    def forward(self, x):
        return F.linear(x, self.w + 0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="int4:1,int8:1,int8:16,int4:16,bf16:1")
    p.add_argument("--variants", default="base,noprefetch,nopairs,noprefetch+nopairs,noround,"
                   "nogroups,noround+nogroups,cg,evict")
    p.add_argument("--blocks", action="store_true", help="also other block sizes")
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--device", default="cuda", help="cpu: check the edits under TRITON_INTERPRET=1")
    args = p.parse_args()
    torch.manual_seed(0)
    k, n, dev = args.k, args.n, args.device
    w = (torch.randn(n, k, device=dev) / k ** 0.5).to(torch.bfloat16)
    layers = {"int8": Int8Linear(w).to(dev), "int4": Int4Linear(w, 128).to(dev),
              "bf16": Bf16Linear(w).to(dev)}
    render = trd.render_gemv
    default_blocks, default_dot = tg.gemv_blocks, tg.gemv_dot_blocks
    for case in args.cases.split(","):
        fmt, m = case.split(":")
        m = int(m)
        layer = layers[fmt]
        nb = sum(b.numel() * b.element_size() for b in layer.buffers())
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = F.linear(x, w)
        eager_ms = median_ms(lambda: F.linear(x, w), device=dev)
        print(f"\n{fmt} M={m}: cuBLAS bf16 linear {eager_ms:.4f} ms "
              f"({2 * n * k / eager_ms / 1e9:.2f} TB/s of bf16 weight)", flush=True)
        if m == 1:
            blocks = [None, (1, 8, 512, 4), (1, 8, 1024, 4), (1, 16, 512, 8), (1, 4, 1024, 4),
                      (1, 16, 256, 4), (1, 8, 256, 4), (1, 4, 512, 4)]
        else:
            blocks = [None, (16, 32, 256, 4, 3), (16, 64, 256, 4, 3), (16, 32, 512, 4, 3),
                      (16, 64, 128, 4, 4), (16, 32, 256, 4, 5), (16, 64, 256, 8, 3),
                      (16, 128, 128, 4, 3)]
        variants = args.variants.split(",")
        for variant in variants:
            if ("pairs" in variant or "groups" in variant or "round" in variant) and fmt != "int4" \
                    or "prefetch" in variant and m > 1:
                continue
            for b in blocks:
                if b is not None and (variant not in ("base", "noprefetch") or not args.blocks):
                    continue
                if b is not None and fmt == "int4":
                    b = b[:2] + (b[2] // 2,) + b[3:]  # BLOCK_K counts packed bytes
                tg.gemv_blocks, tg.gemv_dot_blocks = default_blocks, default_dot
                if b is not None and m == 1:
                    tg.gemv_blocks = lambda mm, nn, kk, weight_bytes=1, c=b: c
                elif b is not None:
                    tg.gemv_dot_blocks = lambda mm, nn, kk, t=1, c=b: c
                trd.render_gemv = lambda kernel, v=variant: edit(render(kernel), v)
                tg.GEMV_PREFETCH = "noprefetch" not in variant
                tg.GEMV_PAIRS = "nopairs" not in variant
                try:
                    cf = fusec.compile(layer, backend="triton")
                    with torch.no_grad():
                        out = cf(x)
                        ms = median_ms(cf, x, device=dev)
                    err = (out.float() - ref.float()).abs().max().item()
                    print(f"  {variant:18s} {str(b or 'default'):24s} {ms:.4f} ms "
                          f"{nb / ms / 1e9:.3f} TB/s  max|out - bf16 ref| {err:.3g}", flush=True)
                except Exception as e:  # an experiment that does not compile: say so, go on
                    print(f"  {variant:18s} {str(b or 'default'):24s} failed: "
                          f"{type(e).__name__}: {str(e)[:200]}", flush=True)
    trd.render_gemv = render
    tg.gemv_blocks, tg.gemv_dot_blocks = default_blocks, default_dot


if __name__ == "__main__":
    main()

"""Where the packed-int4 GEMV's time goes: hand-written kernels that read the weight as 32-bit words.

    python extensions/quant_gemv/diagnostics/int4_gemv_words.py [--k 8192] [--n 8192] [--blocks 8x128x4,...]

fusec's int4 GEMV (extensions/quant_gemv/triton_gemv.py) loads the packed weight byte by byte and dequantizes
each nibble in float32. It streams about 0.95 TB/s on an H200, against 2.66 for an int8 weight,
and ablations of its rounding and of its per-group values did not move it. These kernels are
experiments (not fusec's output) that read the same weight as int32 words (eight nibbles each)
and try cheaper ways to turn nibbles into numbers:

* `floor_u8`, `floor_i32`: only load the packed bytes and add them up as integers: what the load
  alone streams with each word size (the ceiling for everything below);
* `f32`: per nibble `(w >> 4t) & 0xF | 0x4B000000` read as a float is 2**23 + q, so one float
  subtraction of 2**23 + z gives q - z exactly; times the scale in float32 (exact: at most 12
  significant bits), rounded once to bf16 as eager's `(q - z) * s` is, then one FMA;
* `bf16`: two nibbles at once, `(w >> 4t) & 0x000F000F | 0x43004300` is a pair of bf16 numbers
  128 + q (0x4300 is 128.0); the halves are taken apart and Triton's bf16 arithmetic does
  `(v - (128 + z)) * s`;
* `asm`: the same pair kept packed, `fma.rn.bf16x2` (PTX, sm_80+) computes both nibbles'
  `(v - (128 + z))` and then `* s` with one instruction each, as eager's two bf16 roundings.

Every variant is checked against eager's output (max |difference| printed; the weight that
eager uses is bf16, so exact variants agree up to the float32 summation order).
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from fusec.codegen.triton.helpers import fusec_bf16_to_f32, fusec_f32_to_bf16
from fusec.examples.int4_linear import Int4Linear
from fusec.timing import median_ms


@triton.jit
def floor_kernel(p_ptr, out_ptr, KB: tl.constexpr, WORDS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_W: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    if WORDS:
        base = p_ptr.to(tl.pointer_type(tl.int32))
        row = KB // 4
    else:
        base = p_ptr
        row = KB
    acc = tl.zeros([BLOCK_N, BLOCK_W], tl.int32)
    for k0 in range(0, row, BLOCK_W):
        js = k0 + tl.arange(0, BLOCK_W)[None, :]
        w = tl.load(base + n * row + js, eviction_policy="evict_first")
        acc += w.to(tl.int32)
    tl.store(out_ptr + pid * BLOCK_N + tl.arange(0, BLOCK_N), tl.sum(acc, 1).to(tl.float32).to(tl.bfloat16))


@triton.jit
def _pair_math(pair, z2, s2, ASM: tl.constexpr):
    """(v - (128 + z)) * s on two bf16 numbers packed in an int32; returns the packed result."""
    if ASM:
        out = tl.inline_asm_elementwise(
            "{ .reg .b32 d; .reg .b32 one; .reg .b32 mz;\n"
            "  mov.b32 one, 0x3F803F80;\n"        # (1.0, 1.0)
            "  mov.b32 mz, 0x80008000;\n"         # (-0.0, -0.0)
            "  fma.rn.bf16x2 d, $1, one, $2;\n"   # v - (128 + z): $2 holds -(128 + z)
            "  fma.rn.bf16x2 $0, d, $3, mz; }",    # * s
            "=r,r,r,r", [pair, z2, s2], dtype=tl.int32, is_pure=True, pack=1)
    else:
        lo = pair.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        hi = (pair >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        zl = z2.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        sl = s2.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        lo = (lo + zl) * sl
        hi = (hi + zl) * sl
        out = lo.to(tl.uint16, bitcast=True).to(tl.int32) | (hi.to(tl.uint16, bitcast=True).to(tl.int32) << 16)
    return out


@triton.jit
def words_kernel(p_ptr, z_ptr, s_ptr, x_ptr, out_ptr, KB: tl.constexpr, GROUP: tl.constexpr,
                 MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    # MODE 0: float32 per nibble; 1: bf16 pairs with Triton's bf16 arithmetic; 2: bf16x2 PTX
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    words = p_ptr.to(tl.pointer_type(tl.int32))
    row: tl.constexpr = KB // 4          # int32 words per weight row
    groups: tl.constexpr = KB * 2 // GROUP
    wpg: tl.constexpr = GROUP // 8       # words per group
    acc = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
    js = tl.arange(0, BLOCK_W)[None, :]
    w_next = tl.load(words + n * row + js, eviction_policy="evict_first")
    for k0 in range(0, row, BLOCK_W):
        w = w_next
        has_next = k0 + BLOCK_W < row
        w_next = tl.load(words + n * row + js + BLOCK_W, mask=has_next, eviction_policy="evict_first")
        g = n * groups + js // wpg
        z = tl.load(z_ptr + g)
        s = tl.load(s_ptr + g)
        if MODE == 0:
            zf = z.to(tl.float32) + 8388608.0    # 2**23 + z, exact
            sf = s.to(tl.float32)
            for t in tl.static_range(8):
                q = ((w >> (4 * t)) & 0xF) | 0x4B000000
                d = (q.to(tl.float32, bitcast=True) - zf) * sf
                xv = tl.load(x_ptr + js * 8 + t).to(tl.float32)
                acc += fusec_bf16_to_f32(fusec_f32_to_bf16(d)) * xv
        else:
            zb = (z + 128.0).to(tl.bfloat16)     # 128 + z: exact in bf16 for z in 0..15
            zbits = (-zb).to(tl.uint16, bitcast=True).to(tl.int32)
            sbits = s.to(tl.uint16, bitcast=True).to(tl.int32)
            z2 = zbits | (zbits << 16)
            s2 = sbits | (sbits << 16)
            for t in tl.static_range(4):
                pair = ((w >> (4 * t)) & 0x000F000F) | 0x43004300
                r = _pair_math(pair, z2, s2, MODE == 2)
                lo = (r << 16).to(tl.float32, bitcast=True)
                hi = (r & -65536).to(tl.float32, bitcast=True)
                acc += lo * tl.load(x_ptr + js * 8 + t).to(tl.float32)
                acc += hi * tl.load(x_ptr + js * 8 + t + 4).to(tl.float32)
        js += BLOCK_W
    out = tl.sum(acc, 1)
    tl.store(out_ptr + pid * BLOCK_N + tl.arange(0, BLOCK_N), out.to(tl.bfloat16))


@triton.jit
def bytes_kernel(p_ptr, z_ptr, s_ptr, x_ptr, out_ptr, KB: tl.constexpr, GROUP: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, R: tl.constexpr,
                 XONE: tl.constexpr, DQ: tl.constexpr, GATHER: tl.constexpr):
    # fusec's layout (one packed byte per lane, x as pairs), with knobs: R bytes summed in the
    # thread before the partial sums (R = 1: fusec's); XONE: activations replaced by 1 (an
    # ablation); DQ 0: no dequantization (an ablation), 1: eager's (q - z) * s rounded to bf16;
    # GATHER: each byte loads its group's scale (a cached gather) instead of one load per group
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    groups: tl.constexpr = KB * 2 // GROUP
    gb: tl.constexpr = GROUP // 2        # packed bytes per group
    acc = tl.zeros([BLOCK_N, BLOCK_K // R], tl.float32)
    ks = tl.arange(0, BLOCK_K)[None, :]
    w_next = tl.load(p_ptr + n * KB + ks, eviction_policy="evict_first")
    for k0 in range(0, KB, BLOCK_K):
        w = w_next
        w_next = tl.load(p_ptr + n * KB + ks + BLOCK_K, mask=k0 + BLOCK_K < KB,
                         eviction_policy="evict_first")
        if GATHER:
            z = tl.load(z_ptr + n * groups + ks // gb).to(tl.float32)
            s = tl.load(s_ptr + n * groups + ks // gb).to(tl.float32)
        else:
            gs = k0 // gb + tl.arange(0, BLOCK_K // gb)[None, :]
            z = tl.reshape(tl.broadcast_to(tl.load(z_ptr + n * groups + gs).to(tl.float32)[:, :, None],
                                           [BLOCK_N, BLOCK_K // gb, gb]), [BLOCK_N, BLOCK_K])
            s = tl.reshape(tl.broadcast_to(tl.load(s_ptr + n * groups + gs).to(tl.float32)[:, :, None],
                                           [BLOCK_N, BLOCK_K // gb, gb]), [BLOCK_N, BLOCK_K])
        lo = ((w & 15).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        hi = ((w >> 4).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        if DQ:
            lo = fusec_bf16_to_f32(fusec_f32_to_bf16((lo - z) * s))
            hi = fusec_bf16_to_f32(fusec_f32_to_bf16((hi - z) * s))
        if XONE:
            prod = lo + hi
        else:
            xp = tl.load(x_ptr + (ks * 2)[:, :, None] + tl.arange(0, 2)[None, None, :])
            x0, x1 = tl.split(xp)
            prod = lo * x0.to(tl.float32) + hi * x1.to(tl.float32)
        if R > 1:
            prod = tl.sum(tl.reshape(prod, [BLOCK_N, BLOCK_K // R, R]), axis=2)
        acc += prod
        ks += BLOCK_K
    tl.store(out_ptr + pid * BLOCK_N + tl.arange(0, BLOCK_N), tl.sum(acc, 1).to(tl.bfloat16))


@triton.jit
def _nib(w, t: tl.constexpr, z, s, DQ: tl.constexpr):
    """Nibble t of each word as a float (2**23 + q, minus 2**23 + z when dequantizing)."""
    q = (((w >> (4 * t)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    if DQ:
        q = fusec_bf16_to_f32(fusec_f32_to_bf16((q - z) * s))
    return q


@triton.jit
def words2_kernel(p_ptr, z_ptr, s_ptr, x_ptr, out_ptr, KB: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, XONE: tl.constexpr,
                  DQ: tl.constexpr, TREE: tl.constexpr, PAIRS: tl.constexpr):
    # the weight as int32 words (eight nibbles each: word j holds k = 8j .. 8j + 7, nibble t at
    # bits 4t), unpacked with 32-bit shifts and masks; a word's eight activations are one
    # 16-byte load, taken apart in registers by three splits; per-group values loaded once per
    # group and repeated over its words
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    words = p_ptr.to(tl.pointer_type(tl.int32))
    row: tl.constexpr = KB // 4
    groups: tl.constexpr = KB * 2 // GROUP
    wpg: tl.constexpr = GROUP // 8
    acc = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
    js = tl.arange(0, BLOCK_W)
    w_next = tl.load(words + n * row + js[None, :], eviction_policy="evict_first")
    for k0 in range(0, row, BLOCK_W):
        w = w_next
        w_next = tl.load(words + n * row + js[None, :] + BLOCK_W, mask=k0 + BLOCK_W < row,
                         eviction_policy="evict_first")
        z = 0.0
        s = 1.0
        if DQ and not PAIRS:
            gs = k0 // wpg + tl.arange(0, BLOCK_W // wpg)[None, :]
            z = tl.reshape(tl.broadcast_to(tl.load(z_ptr + n * groups + gs).to(tl.float32)[:, :, None],
                                           [BLOCK_N, BLOCK_W // wpg, wpg]), [BLOCK_N, BLOCK_W])
            s = tl.reshape(tl.broadcast_to(tl.load(s_ptr + n * groups + gs).to(tl.float32)[:, :, None],
                                           [BLOCK_N, BLOCK_W // wpg, wpg]), [BLOCK_N, BLOCK_W])
            z = z + 8388608.0
        if not XONE:
            x8 = tl.load(x_ptr + js[:, None] * 8 + tl.arange(0, 8)[None, :]).to(tl.float32)
            x8 = tl.reshape(x8, [BLOCK_W, 2, 2, 2])
            xa, xb = tl.split(x8)                 # t = 4a + 2b + c: c = 0 / 1
            x00, x01 = tl.split(xa)               # (a, b, c = 0)
            x10, x11 = tl.split(xb)
            x0, x4 = tl.split(x00)                # c = 0, b = 0: t = 0, 4
            x2, x6 = tl.split(x01)                # c = 0, b = 1: t = 2, 6
            x1, x5 = tl.split(x10)
            x3, x7 = tl.split(x11)
        if PAIRS:  # two nibbles per 32-bit register as bf16x2, dequantized by two fma.rn.bf16x2
            gs = k0 // wpg + tl.arange(0, BLOCK_W // wpg)[None, :]
            zg = (tl.load(z_ptr + n * groups + gs).to(tl.float32) + 128.0).to(tl.bfloat16)
            zbits = (-zg).to(tl.uint16, bitcast=True).to(tl.int32)
            sbits = tl.load(s_ptr + n * groups + gs).to(tl.uint16, bitcast=True).to(tl.int32)
            z2 = tl.reshape(tl.broadcast_to((zbits | (zbits << 16))[:, :, None],
                                            [BLOCK_N, BLOCK_W // wpg, wpg]), [BLOCK_N, BLOCK_W])
            s2 = tl.reshape(tl.broadcast_to((sbits | (sbits << 16))[:, :, None],
                                            [BLOCK_N, BLOCK_W // wpg, wpg]), [BLOCK_N, BLOCK_W])
            for t in tl.static_range(4):
                r = _pair_math(((w >> (4 * t)) & 0x000F000F) | 0x43004300, z2, s2, True)
                lo = (r << 16).to(tl.float32, bitcast=True)
                hi = (r & -65536).to(tl.float32, bitcast=True)
                xl = x0 if t == 0 else x1 if t == 1 else x2 if t == 2 else x3
                xh = x4 if t == 0 else x5 if t == 1 else x6 if t == 2 else x7
                acc += lo * xl[None, :] + hi * xh[None, :]
        elif TREE:  # the eight products added as a tree: no chain of eight dependent adds
            p0 = _nib(w, 0, z, s, DQ) * x0[None, :] + _nib(w, 1, z, s, DQ) * x1[None, :]
            p1 = _nib(w, 2, z, s, DQ) * x2[None, :] + _nib(w, 3, z, s, DQ) * x3[None, :]
            p2 = _nib(w, 4, z, s, DQ) * x4[None, :] + _nib(w, 5, z, s, DQ) * x5[None, :]
            p3 = _nib(w, 6, z, s, DQ) * x6[None, :] + _nib(w, 7, z, s, DQ) * x7[None, :]
            acc += (p0 + p1) + (p2 + p3)
        else:
            for t in tl.static_range(8):
                d = _nib(w, t, z, s, DQ)
                if XONE:
                    acc += d
                else:
                    xt = x0 if t == 0 else x1 if t == 1 else x2 if t == 2 else x3 if t == 3 else \
                        x4 if t == 4 else x5 if t == 5 else x6 if t == 6 else x7
                    acc += d * xt[None, :]
        js += BLOCK_W
    tl.store(out_ptr + pid * BLOCK_N + tl.arange(0, BLOCK_N), tl.sum(acc, 1).to(tl.bfloat16))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--blocks", default="8x128x4,8x64x4,16x64x4,4x128x4,8x256x8,16x128x8,4x256x4")
    p.add_argument("--modes", default="floor_u8,floor_i32,f32,bf16,asm")
    p.add_argument("--words2", default="", help="words2_kernel configs BNxBWxWARPSxXONExDQxTREExPAIRS,...")
    p.add_argument("--bytes", default="", help="bytes_kernel configs BNxBKxWARPSxRxXONExDQxGATHER,...")
    args = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    k, n = args.k, args.n
    w = (torch.randn(n, k, device=dev) / k ** 0.5).to(torch.bfloat16)
    layer = Int4Linear(w, args.group).to(dev)
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    nbytes = sum(b.numel() * b.element_size() for b in layer.buffers())
    with torch.no_grad():
        eager = layer(x).float()
        ref = torch.nn.functional.linear(x.double(), layer.weight(torch.bfloat16).double())[0]
    ref_ms = median_ms(lambda: torch.nn.functional.linear(x, w), device=dev)
    print(f"K = {k}, N = {n}, group {args.group}; {nbytes / 1e6:.1f} MB of packed weight, scales "
          f"and zero points. cuBLAS bf16 linear: {ref_ms:.4f} ms ({2 * n * k / ref_ms / 1e9:.2f} TB/s "
          "of its bf16 weight)", flush=True)
    try:
        import fusec
        cf = fusec.compile(layer, backend="triton")
        with torch.no_grad():
            cf(x)
            ms = median_ms(cf, x, device=dev)
        print(f"  {'fusec (bytes)':12s} {'':12s} {ms:.4f} ms {nbytes / ms / 1e9:.3f} TB/s", flush=True)
    except Exception as e:  # a diagnostic: say so and go on
        print(f"  fusec failed: {type(e).__name__}: {e}")
    out = torch.empty(n, device=dev, dtype=torch.bfloat16)

    def show(label, call, check):
        try:
            call()
            ms = median_ms(call, device=dev)
            err = "" if not check else \
                f"max|out - ref| {(out.double() - ref).abs().max().item():.3g} (eager " \
                f"{(eager[0].double() - ref).abs().max().item():.3g})"
            print(f"  {label:24s} {ms:.4f} ms {nbytes / ms / 1e9:.3f} TB/s  {err}", flush=True)
        except Exception as e:  # an experiment that does not compile: say so, go on
            print(f"  {label:24s} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)

    for spec in [b for b in args.words2.split(",") if b]:
        bn, bw, warps, xone, dq, tree, pairs = (int(v) for v in spec.split("x"))
        show(f"words2 {spec}", lambda: words2_kernel[(n // bn,)](
            layer.packed, layer.zero, layer.scale, x, out, k // 2, args.group, bn, bw, xone, dq,
            tree, pairs, num_warps=warps), not xone and dq)
    for spec in [b for b in args.bytes.split(",") if b]:
        bn, bk, warps, r, xone, dq, gather = (int(v) for v in spec.split("x"))
        show(f"bytes {spec}", lambda: bytes_kernel[(n // bn,)](
            layer.packed, layer.zero, layer.scale, x, out, k // 2, args.group, bn, bk, r, xone, dq,
            gather, num_warps=warps), not xone and dq)
    for mode in [m for m in args.modes.split(",") if m]:
        for spec in args.blocks.split(","):
            bn, bw, warps = (int(v) for v in spec.split("x"))
            grid = (n // bn,)
            if mode.startswith("floor"):
                call = lambda: floor_kernel[grid](layer.packed, out, k // 2, mode == "floor_i32",
                                                  bn, bw if mode == "floor_i32" else bw * 4,
                                                  num_warps=warps)
            else:
                code = {"f32": 0, "bf16": 1, "asm": 2}[mode]
                call = lambda: words_kernel[grid](layer.packed, layer.zero, layer.scale, x, out,
                                                  k // 2, args.group, code, bn, bw, num_warps=warps)
            try:
                call()
                ms = median_ms(call, device=dev)
                err = "" if mode.startswith("floor") else \
                    f"max|out - ref| {(out.double() - ref).abs().max().item():.3g} (eager " \
                    f"{(eager[0].double() - ref).abs().max().item():.3g})"
                print(f"  {mode:12s} {spec:12s} {ms:.4f} ms {nbytes / ms / 1e9:.3f} TB/s  {err}",
                      flush=True)
            except Exception as e:  # an experiment that does not compile: say so, go on
                print(f"  {mode:12s} {spec:12s} failed: {type(e).__name__}: {str(e)[:300]}",
                      flush=True)


if __name__ == "__main__":
    main()

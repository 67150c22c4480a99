"""The packed-int4 GEMV at M = 1 on tensor cores, with K shuffled freely: an experiment.

    python extensions/quant_gemv/diagnostics/int4_mma_m1.py [--k 8192] [--n 8192] [--configs 4x2,d4x4,s4x,...]
                                                  [--debug]

fusec's group kernel (extensions/quant_gemv/triton_gemv_int4_groups.py) spends about 4 instructions per
weight on CUDA cores: unpacking, widening, one FMA each. A tensor core multiplies 16 x 16
bf16 weights by 16 x 8 activations in one `mma.sync.m16n8k16` per warp: eight weights per
thread in one instruction. At M = 1 only one of the 8 activation columns is needed; the
tensor cores have that to spare, and the instructions are what was thought to count.

The trick that makes it cheap is that a dot product does not care in which order K is added up.
`mma.sync` wants lane 4g + c to hold the weights of rows g and g + 8 at k-slots 2c, 2c + 1,
2c + 8, 2c + 9, and the activations of column g at the same k-slots. Any K index may sit in any
k-slot, so long as the weight and its activation sit in the same one. So lane c of every row
group takes a packed 32-bit word w of its rows (eight nibbles, K indices 8w .. 8w + 7):
`(w >> 4t) & 0x000F000F | 0x43004300` holds nibbles t and t + 4 as the bf16 numbers 128 + q,
which is already an A register (k-slots 2c and 2c + 1); the activations of the same K indices,
paired the same way by one `prmt` each, are the B registers. Two `mma`s take the word's eight
nibbles. Every lane supplies the activations of its own words, and the lanes of one c load the
same ones, so all eight columns of the result are equal: each lane ends with the sums of its
rows g and g + 8. Per group `sum x (q - z) s = s * (sum (128 + q) x - (128 + z) sum x)`, and
`sum x` is one more `mma` with an A of ones. About 2.2 instructions per weight.

Three kernels, 16 rows per program of WARPS warps, warp v adding up its own slice of K:
  WxS    (`mma_gemv`) S chunks of 16 words per trip, the next trip's words in flight;
         `i`: the warps take turns along K instead of slices,
  dWxD   (`mma_gemv_deep`) one chunk per trip, the next D trips' words in flight; `x`: the
         next trip's activations too,
  sW     (`mma_gemv_shfl`) each trip loads 4 rows x 128 bytes per instruction (lane l: row
         4i + l / 8) and moves the words to the lanes mma.sync wants by `shfl.sync` inside
         the asm; `x`: the activations loaded once per trip and shuffled too.

Why this file is long: the three kernels and their helpers are kept side by side, so that one
run times them all beside fusec's kernel.

The `mma` is inline PTX, whose lanes are the hardware's, so every tensor is one element per
thread ([32 * WARPS] or [32 * WARPS, 4]: a layout with one way to lay it out, on Triton 3.6 and
3.9 alike) and each asm also returns %tid.x: a program whose elements did not land on the
threads it assumes writes NaN (a [WARPS, 32, 4] tile did, on Triton 3.6, which ordered the
warps' dimension before the lanes'). With a GPU each config is timed beside fusec's kernel and
cuBLAS's bf16 linear, with its error against a float64 product; without one, each is compiled
for sm_90 (registers and loop instructions). Every config was correct and none was faster than
the group kernel on an H200: the instructions were not what bounded it.
"""
from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import fusec  # first: on a machine without a GPU it switches Triton's interpreter on
import triton
import triton.language as tl
from fusec.codegen.triton import target as triton_target
from fusec.codegen.triton.helpers import fusec_bf16_to_f32, fusec_f32_to_bf16
from fusec.timing import median_ms

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fusec.examples.int4_linear import Int4Linear  # noqa: E402
from int4_offset import errors  # noqa: E402 (the error against a float64 product)
from int4_sass import loop_summary  # noqa: E402

MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"


def word_mma_asm(tiles: int) -> tuple[str, str]:
    """PTX for one word column: per tile, rows g and g + 8's words -> their sums (128 + q) x over
    the word's eight nibbles (added over the 4 lanes of a row group), then sum x, then %tid.x.
    Operands: outputs 2 * tiles + 2, then inputs 2 * tiles words and the 4 activation registers."""
    n_out = 2 * tiles + 2
    words = [f"${n_out + i}" for i in range(2 * tiles)]
    x = [f"${n_out + 2 * tiles + i}" for i in range(4)]
    lines = [".reg .b32 m, c128, one, a0, a1, a2, a3, b0, b1, s0, s1;",
             ".reg .f32 zf, f0, f1, f2, f3;",
             ".reg .f32 " + ", ".join(f"e{t}_{i}" for t in range(tiles) for i in range(4)) + ";",
             "mov.b32 m, 0x000F000F;", "mov.b32 c128, 0x43004300;", "mov.b32 one, 0x3F803F80;",
             "mov.f32 zf, 0f00000000;"]
    for half in range(2):  # nibbles (0, 4) and (1, 5), then (2, 6) and (3, 7)
        lines += [f"prmt.b32 b0, {x[half]}, {x[half + 2]}, 0x5410;",
                  f"prmt.b32 b1, {x[half]}, {x[half + 2]}, 0x7632;"]
        for t in range(tiles):
            wg, wg8 = words[2 * t], words[2 * t + 1]
            for reg_lo, reg_hi, shift in (("a0", "a1", 8 * half), ("a2", "a3", 8 * half + 4)):
                if shift:
                    lines += [f"shr.u32 s0, {wg}, {shift};", f"shr.u32 s1, {wg8}, {shift};"]
                    lo, hi = "s0", "s1"
                else:
                    lo, hi = wg, wg8
                lines += [f"lop3.b32 {reg_lo}, {lo}, m, c128, 0xEA;",
                          f"lop3.b32 {reg_hi}, {hi}, m, c128, 0xEA;"]
            acc = ", ".join(f"e{t}_{i}" for i in range(4))
            c_in = "zf, zf, zf, zf" if half == 0 else acc
            lines.append(f"{MMA} {{{acc}}}, {{a0, a1, a2, a3}}, {{b0, b1}}, {{{c_in}}};")
        c_in = "zf, zf, zf, zf" if half == 0 else "f0, f1, f2, f3"
        lines.append(f"{MMA} {{f0, f1, f2, f3}}, {{one, one, one, one}}, {{b0, b1}}, {{{c_in}}};")
    for t in range(tiles):
        lines += [f"mov.b32 ${2 * t}, e{t}_0;", f"mov.b32 ${2 * t + 1}, e{t}_2;"]
    lines += [f"mov.b32 ${2 * tiles}, f0;", f"mov.u32 ${2 * tiles + 1}, %tid.x;"]
    constraints = ",".join(["=r"] * n_out + ["r"] * (2 * tiles + 4))
    return "{\n" + "\n".join(" " + line for line in lines) + "\n}", constraints


ASM1, CON1 = (tl.constexpr(v) for v in word_mma_asm(1))


def shfl_mma_asm(x_shuffled: bool) -> tuple[str, str]:
    """PTX for one word column of mma_gemv_shfl: the words of rows g and g + 8 fetched from the
    lanes that loaded them (two shuffles each, the right one picked by g >= 4), then as
    word_mma_asm. Outputs: the sums of rows g and g + 8, sum x, %tid.x. Inputs: this lane's
    v0..v3 (its loaded rows' word j), the source lane, g >= 4, then the activations: the lane's
    own 4 registers (x_shuffled: of word `lane` of the trip, fetched from the lane given next)."""
    lines = [".reg .b32 m, c128, one, a0, a1, a2, a3, b0, b1, s0, s1, u0, u1, u2, u3, wg, wg8;",
             ".reg .b32 x0, x1, x2, x3;", ".reg .pred hi;",
             ".reg .f32 zf, f0, f1, f2, f3, e0, e1, e2, e3;",
             "mov.b32 m, 0x000F000F;", "mov.b32 c128, 0x43004300;", "mov.b32 one, 0x3F803F80;",
             "mov.f32 zf, 0f00000000;",
             "shfl.sync.idx.b32 u0, $4, $8, 0x1f, 0xffffffff;",
             "shfl.sync.idx.b32 u1, $5, $8, 0x1f, 0xffffffff;",
             "shfl.sync.idx.b32 u2, $6, $8, 0x1f, 0xffffffff;",
             "shfl.sync.idx.b32 u3, $7, $8, 0x1f, 0xffffffff;",
             "setp.ne.u32 hi, $9, 0;",
             "selp.b32 wg, u1, u0, hi;", "selp.b32 wg8, u3, u2, hi;"]
    if x_shuffled:
        lines += [f"shfl.sync.idx.b32 x{i}, ${10 + i}, $14, 0x1f, 0xffffffff;" for i in range(4)]
    else:
        lines += [f"mov.b32 x{i}, ${10 + i};" for i in range(4)]
    for half in range(2):
        lines += [f"prmt.b32 b0, x{half}, x{half + 2}, 0x5410;",
                  f"prmt.b32 b1, x{half}, x{half + 2}, 0x7632;"]
        for reg_lo, reg_hi, shift in (("a0", "a1", 8 * half), ("a2", "a3", 8 * half + 4)):
            if shift:
                lines += [f"shr.u32 s0, wg, {shift};", f"shr.u32 s1, wg8, {shift};"]
                lo, hi = "s0", "s1"
            else:
                lo, hi = "wg", "wg8"
            lines += [f"lop3.b32 {reg_lo}, {lo}, m, c128, 0xEA;",
                      f"lop3.b32 {reg_hi}, {hi}, m, c128, 0xEA;"]
        c_in = "zf, zf, zf, zf" if half == 0 else "e0, e1, e2, e3"
        lines.append(f"{MMA} {{e0, e1, e2, e3}}, {{a0, a1, a2, a3}}, {{b0, b1}}, {{{c_in}}};")
        c_in = "zf, zf, zf, zf" if half == 0 else "f0, f1, f2, f3"
        lines.append(f"{MMA} {{f0, f1, f2, f3}}, {{one, one, one, one}}, {{b0, b1}}, {{{c_in}}};")
    lines += ["mov.b32 $0, e0;", "mov.b32 $1, e2;", "mov.b32 $2, f0;", "mov.u32 $3, %tid.x;"]
    constraints = ",".join(["=r"] * 4 + ["r"] * (6 + (5 if x_shuffled else 4)))
    return "{\n" + "\n".join(" " + line for line in lines) + "\n}", constraints


ASM_XL, CON_XL = (tl.constexpr(v) for v in shfl_mma_asm(False))
ASM_XS, CON_XS = (tl.constexpr(v) for v in shfl_mma_asm(True))


@triton.jit
def shfl_word(v0, v1, v2, v3, src, hi, x0, x1, x2, x3, xsrc, XS: tl.constexpr):
    if XS:
        return tl.inline_asm_elementwise(ASM_XS, CON_XS, [v0, v1, v2, v3, src, hi, x0, x1, x2, x3, xsrc],
                                         dtype=(tl.int32,) * 4, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(ASM_XL, CON_XL, [v0, v1, v2, v3, src, hi, x0, x1, x2, x3],
                                         dtype=(tl.int32,) * 4, is_pure=True, pack=1)


@triton.jit
def shfl_chunk(V0, V1, V2, V3, src, hi, xp, x_word, X0, X1, X2, X3, xsrc_base, c,
               XS: tl.constexpr):
    # chunk s of a trip: for each word j, the rows' words fetched by shuffles (src: the lanes
    # holding this chunk's words), the activations loaded (x_word + j) or shuffled (lane xsrc)
    v00, v01, v02, v03 = split4(V0)
    v10, v11, v12, v13 = split4(V1)
    v20, v21, v22, v23 = split4(V2)
    v30, v31, v32, v33 = split4(V3)
    da = tl.zeros(src.shape, dtype=tl.float32)
    da8 = tl.zeros(src.shape, dtype=tl.float32)
    xs = tl.zeros(src.shape, dtype=tl.float32)
    tid = tl.zeros(src.shape, dtype=tl.int32)
    for j in tl.static_range(4):
        if XS:
            x0, x1, x2, x3 = X0, X1, X2, X3
        else:
            xw = tl.load(xp + ((x_word + j) * 4)[:, None] + tl.arange(0, 4)[None, :])
            x0, x1, x2, x3 = split4(xw)
        xsrc = xsrc_base + 4 * c + j
        if j == 0:
            r = shfl_word(v00, v10, v20, v30, src, hi, x0, x1, x2, x3, xsrc, XS)
        elif j == 1:
            r = shfl_word(v01, v11, v21, v31, src, hi, x0, x1, x2, x3, xsrc, XS)
        elif j == 2:
            r = shfl_word(v02, v12, v22, v32, src, hi, x0, x1, x2, x3, xsrc, XS)
        else:
            r = shfl_word(v03, v13, v23, v33, src, hi, x0, x1, x2, x3, xsrc, XS)
        da += r[0].to(tl.float32, bitcast=True)
        da8 += r[1].to(tl.float32, bitcast=True)
        xs += r[2].to(tl.float32, bitcast=True)
        tid = r[3]
    return da, da8, xs, tid


@triton.jit
def mma_gemv_shfl(p_packed_ptr, p_zero_ptr, p_scale_ptr, x_ptr, out_ptr, n_words: tl.constexpr,
                  GROUP_W: tl.constexpr, WARPS: tl.constexpr, XS: tl.constexpr):
    # 16 rows per program; a trip is 32 words (two chunks) of each row, loaded as 4 instructions
    # of 4 rows x 128 bytes (lane l: row 4i + l / 8, words 4 (l % 8) ..), then moved by shuffles
    # to the lanes mma.sync wants them in
    T: tl.constexpr = 32 * WARPS
    pid = tl.program_id(axis=0)
    n_groups: tl.constexpr = n_words // GROUP_W
    per_warp: tl.constexpr = n_words // WARPS
    t, warp, lane, g, c, row = thread_roles(pid, WARPS)  # row: the mma rows g and g + 8
    hi = (g >= 4).to(tl.int32)
    start = warp * per_warp
    # the loads: instruction i, lane l: row 4i + l // 8, words 4 (l % 8) .. + 3 of the trip
    at = ((pid * 16 + lane // 8) * n_words + start + 4 * (lane % 8))[:, None] + tl.arange(0, 4)[None, :]
    src0 = (g % 4) * 8 + c  # the lane holding chunk 0's words of rows g, g + 8 (chunk 1: + 4)
    wp = p_packed_ptr.to(tl.pointer_type(tl.int32))
    xp = x_ptr.to(tl.pointer_type(tl.int32))
    acc = tl.zeros([T], dtype=tl.float32)
    acc8 = tl.zeros([T], dtype=tl.float32)
    tid_seen = tl.zeros([T], dtype=tl.int32)
    n0 = tl.load(wp + at, eviction_policy="evict_first")
    n1 = tl.load(wp + at + 4 * n_words, eviction_policy="evict_first")
    n2 = tl.load(wp + at + 8 * n_words, eviction_policy="evict_first")
    n3 = tl.load(wp + at + 12 * n_words, eviction_policy="evict_first")
    for w0 in range(0, per_warp, 32):
        V0, V1, V2, V3 = n0, n1, n2, n3
        nxt = tl.where(w0 + 32 < per_warp, w0 + 32, 0)
        n0 = tl.load(wp + at + nxt, eviction_policy="evict_first")
        n1 = tl.load(wp + at + 4 * n_words + nxt, eviction_policy="evict_first")
        n2 = tl.load(wp + at + 8 * n_words + nxt, eviction_policy="evict_first")
        n3 = tl.load(wp + at + 12 * n_words + nxt, eviction_policy="evict_first")
        if XS:  # lane l: the activations of the trip's word l
            X0, X1, X2, X3 = split4(tl.load(xp + ((start + w0 + lane) * 4)[:, None] + tl.arange(0, 4)[None, :]))
        else:
            X0, X1, X2, X3 = V0, V0, V0, V0
        da, da8, xs, tid_seen = shfl_chunk(V0, V1, V2, V3, src0, hi, xp, start + w0 + 4 * c,
                                           X0, X1, X2, X3, 0, c, XS)
        acc, acc8 = group_scaled(acc, acc8, da, da8, xs, row, (start + w0) // GROUP_W,
                                 p_zero_ptr, p_scale_ptr, n_groups)
        da, da8, xs, tid_seen = shfl_chunk(V0, V1, V2, V3, src0 + 4, hi, xp, start + w0 + 16 + 4 * c,
                                           X0, X1, X2, X3, 16, c, XS)
        acc, acc8 = group_scaled(acc, acc8, da, da8, xs, row, (start + w0 + 16) // GROUP_W,
                                 p_zero_ptr, p_scale_ptr, n_groups)
    store_rows(acc, acc8, tid_seen, t, out_ptr, pid, WARPS)


@triton.jit
def word_mma(wa, wa8, x0, x1, x2, x3):
    # rows g and g + 8's words and the activations of those words -> (sum (128 + q) x of row g,
    # of row g + 8, sum x, %tid.x), each as int32 bits
    return tl.inline_asm_elementwise(ASM1, CON1, [wa, wa8, x0, x1, x2, x3],
                                     dtype=(tl.int32,) * 4, is_pure=True, pack=1)


@triton.jit
def thread_roles(pid, WARPS: tl.constexpr):
    # a program's threads as [32 * WARPS] tensors, element t on thread t: its warp and lane, the
    # lane's row group g and k-slot group c (lane = 4g + c), and g's weight row in this program
    t = tl.arange(0, 32 * WARPS)
    warp = t // 32
    lane = t % 32
    g = lane // 4
    return t, warp, lane, g, lane % 4, pid * 16 + g


@triton.jit
def store_rows(acc, acc8, tid_seen, t, out_ptr, pid, WARPS: tl.constexpr):
    # every lane c of a row group holds the same sums: lane c = 0's, the warps' K slices added;
    # NaN where an element was not on the thread its index says (tid_seen: the asm's %tid.x)
    lanes_ok = tl.min((tid_seen == t).to(tl.int32), axis=0)
    first_c = tl.arange(0, 32) % 4 == 0
    sum_a = tl.sum(tl.reshape(tl.where(first_c, tl.sum(tl.reshape(acc, [WARPS, 32]), axis=0), 0.0), [8, 4]), axis=1)
    sum_a8 = tl.sum(tl.reshape(tl.where(first_c, tl.sum(tl.reshape(acc8, [WARPS, 32]), axis=0), 0.0), [8, 4]), axis=1)
    sums = tl.reshape(tl.permute(tl.join(sum_a, sum_a8), (1, 0)), [16])  # rows 0-7, then 8-15
    if lanes_ok == 0:
        sums = sums + float("nan")
    tl.store(out_ptr + pid * 16 + tl.arange(0, 16), fusec_f32_to_bf16(sums))


@triton.jit
def split4(v):
    # v[T, 4] -> v[:, 0], v[:, 1], v[:, 2], v[:, 3] (in registers: a thread holds all 4)
    v = tl.reshape(v, [v.shape[0], 2, 2])
    even, odd = tl.split(v)
    v0, v2 = tl.split(even)
    v1, v3 = tl.split(odd)
    return v0, v1, v2, v3


@triton.jit
def chunk_sums(wa, wa8, x_word, xp):
    # one chunk of 16 words of rows g and g + 8; wa, wa8: [T, 4], lane c's words x_word .. + 3
    xw0, xw1, xw2, xw3 = load_x(xp, x_word)
    return chunk_sums_x(wa, wa8, xw0, xw1, xw2, xw3)


@triton.jit
def group_scaled(acc, acc8, da, da8, xs, row, grp, p_zero_ptr, p_scale_ptr, n_groups: tl.constexpr):
    z = fusec_bf16_to_f32(tl.load(p_zero_ptr + row * n_groups + grp)) + 128.0
    sc = fusec_bf16_to_f32(tl.load(p_scale_ptr + row * n_groups + grp))
    z8 = fusec_bf16_to_f32(tl.load(p_zero_ptr + (row + 8) * n_groups + grp)) + 128.0
    sc8 = fusec_bf16_to_f32(tl.load(p_scale_ptr + (row + 8) * n_groups + grp))
    return acc + sc * (da - z * xs), acc8 + sc8 * (da8 - z8 * xs)


@triton.jit
def mma_gemv(p_packed_ptr, p_zero_ptr, p_scale_ptr, x_ptr, out_ptr, n_words: tl.constexpr,
             GROUP_W: tl.constexpr, WARPS: tl.constexpr, S: tl.constexpr, ILV: tl.constexpr = False,
             dbg_ptr=None):
    T: tl.constexpr = 32 * WARPS
    pid = tl.program_id(axis=0)
    n_groups: tl.constexpr = n_words // GROUP_W
    # warp v adds up its own slice of K (per_warp words), or with ILV takes every WARPS-th trip
    per_warp: tl.constexpr = n_words if ILV else n_words // WARPS
    STEP: tl.constexpr = 16 * S * WARPS if ILV else 16 * S
    t, warp, lane, g, c, row = thread_roles(pid, WARPS)  # row: the mma rows g and g + 8
    start = warp * 16 * S if ILV else warp * per_warp  # [T]: the warp's first word
    first = start + 4 * c  # [T]: lane c's first word
    at = (row * n_words + first)[:, None] + tl.arange(0, 4)[None, :]  # [T, 4]
    wp = p_packed_ptr.to(tl.pointer_type(tl.int32))
    xp = x_ptr.to(tl.pointer_type(tl.int32))  # activations as int32: two bf16 each
    acc = tl.zeros([T], dtype=tl.float32)
    acc8 = tl.zeros([T], dtype=tl.float32)
    tid_seen = tl.zeros([T], dtype=tl.int32)
    na = tl.load(wp + at, eviction_policy="evict_first")
    na8 = tl.load(wp + at + 8 * n_words, eviction_policy="evict_first")
    if S == 2:
        nb = tl.load(wp + at + 16, eviction_policy="evict_first")
        nb8 = tl.load(wp + at + 8 * n_words + 16, eviction_policy="evict_first")
    for w0 in range(0, per_warp, STEP):
        wa, wa8 = na, na8  # this trip's chunks; the next trip's are loaded now, in flight meanwhile
        nxt = tl.where(w0 + STEP < per_warp, w0 + STEP, 0)
        na = tl.load(wp + at + nxt, eviction_policy="evict_first")
        na8 = tl.load(wp + at + 8 * n_words + nxt, eviction_policy="evict_first")
        if S == 2:
            wb, wb8 = nb, nb8
            nb = tl.load(wp + at + 16 + nxt, eviction_policy="evict_first")
            nb8 = tl.load(wp + at + 8 * n_words + 16 + nxt, eviction_policy="evict_first")
        da, da8, xs, tid_seen = chunk_sums(wa, wa8, first + w0, xp)
        acc, acc8 = group_scaled(acc, acc8, da, da8, xs, row, (start + w0) // GROUP_W,
                                 p_zero_ptr, p_scale_ptr, n_groups)
        if S == 2:
            da, da8, xs, tid_seen = chunk_sums(wb, wb8, first + w0 + 16, xp)
            acc, acc8 = group_scaled(acc, acc8, da, da8, xs, row,
                                     (start + w0 + 16) // GROUP_W,
                                     p_zero_ptr, p_scale_ptr, n_groups)
    if dbg_ptr is not None:
        tl.store(dbg_ptr + 2 * (pid * T + t), tid_seen)
        tl.store(dbg_ptr + 2 * (pid * T + t) + 1, t)
    store_rows(acc, acc8, tid_seen, t, out_ptr, pid, WARPS)


@triton.jit
def chunk_sums_x(wa, wa8, xw0, xw1, xw2, xw3):
    # chunk_sums with the chunk's activations already loaded: xw_j [T, 4] for word j
    wa0, wa1, wa2, wa3 = split4(wa)
    wa80, wa81, wa82, wa83 = split4(wa8)
    x0, x1, x2, x3 = split4(xw0)
    r = word_mma(wa0, wa80, x0, x1, x2, x3)
    da = r[0].to(tl.float32, bitcast=True)
    da8 = r[1].to(tl.float32, bitcast=True)
    xs = r[2].to(tl.float32, bitcast=True)
    x0, x1, x2, x3 = split4(xw1)
    r = word_mma(wa1, wa81, x0, x1, x2, x3)
    da += r[0].to(tl.float32, bitcast=True)
    da8 += r[1].to(tl.float32, bitcast=True)
    xs += r[2].to(tl.float32, bitcast=True)
    x0, x1, x2, x3 = split4(xw2)
    r = word_mma(wa2, wa82, x0, x1, x2, x3)
    da += r[0].to(tl.float32, bitcast=True)
    da8 += r[1].to(tl.float32, bitcast=True)
    xs += r[2].to(tl.float32, bitcast=True)
    x0, x1, x2, x3 = split4(xw3)
    r = word_mma(wa3, wa83, x0, x1, x2, x3)
    da += r[0].to(tl.float32, bitcast=True)
    da8 += r[1].to(tl.float32, bitcast=True)
    xs += r[2].to(tl.float32, bitcast=True)
    return da, da8, xs, r[3]


@triton.jit
def load_x(xp, x_word):
    at = (x_word * 4)[:, None] + tl.arange(0, 4)[None, :]
    return tl.load(xp + at), tl.load(xp + at + 4), tl.load(xp + at + 8), tl.load(xp + at + 12)


@triton.jit
def mma_gemv_deep(p_packed_ptr, p_zero_ptr, p_scale_ptr, x_ptr, out_ptr, n_words: tl.constexpr,
                  GROUP_W: tl.constexpr, WARPS: tl.constexpr, DEPTH: tl.constexpr,
                  XPF: tl.constexpr):
    # one chunk per trip, the weights of the next DEPTH trips in flight (and with XPF the next
    # trip's activations): more bytes in flight per SM
    T: tl.constexpr = 32 * WARPS
    pid = tl.program_id(axis=0)
    n_groups: tl.constexpr = n_words // GROUP_W
    per_warp: tl.constexpr = n_words // WARPS
    t, warp, lane, g, c, row = thread_roles(pid, WARPS)  # row: the mma rows g and g + 8
    start = warp * per_warp
    first = start + 4 * c
    at = (row * n_words + first)[:, None] + tl.arange(0, 4)[None, :]  # [T, 4]
    at8 = at + 8 * n_words
    wp = p_packed_ptr.to(tl.pointer_type(tl.int32))
    xp = x_ptr.to(tl.pointer_type(tl.int32))
    acc = tl.zeros([T], dtype=tl.float32)
    acc8 = tl.zeros([T], dtype=tl.float32)
    tid_seen = tl.zeros([T], dtype=tl.int32)
    b1 = tl.load(wp + at, eviction_policy="evict_first")
    b1_8 = tl.load(wp + at8, eviction_policy="evict_first")
    if DEPTH >= 2:
        b2 = tl.load(wp + at + 16, eviction_policy="evict_first")
        b2_8 = tl.load(wp + at8 + 16, eviction_policy="evict_first")
    if DEPTH >= 3:
        b3 = tl.load(wp + at + 32, eviction_policy="evict_first")
        b3_8 = tl.load(wp + at8 + 32, eviction_policy="evict_first")
    if DEPTH >= 4:
        b4 = tl.load(wp + at + 48, eviction_policy="evict_first")
        b4_8 = tl.load(wp + at8 + 48, eviction_policy="evict_first")
    if XPF:
        x0n, x1n, x2n, x3n = load_x(xp, first)
    for w0 in range(0, per_warp, 16):
        wa, wa8 = b1, b1_8
        nxt = w0 + 16 * DEPTH
        nxt = tl.where(nxt < per_warp, nxt, 0)
        if DEPTH == 1:
            b1 = tl.load(wp + at + nxt, eviction_policy="evict_first")
            b1_8 = tl.load(wp + at8 + nxt, eviction_policy="evict_first")
        elif DEPTH == 2:
            b1, b1_8 = b2, b2_8
            b2 = tl.load(wp + at + nxt, eviction_policy="evict_first")
            b2_8 = tl.load(wp + at8 + nxt, eviction_policy="evict_first")
        elif DEPTH == 3:
            b1, b1_8 = b2, b2_8
            b2, b2_8 = b3, b3_8
            b3 = tl.load(wp + at + nxt, eviction_policy="evict_first")
            b3_8 = tl.load(wp + at8 + nxt, eviction_policy="evict_first")
        else:
            b1, b1_8 = b2, b2_8
            b2, b2_8 = b3, b3_8
            b3, b3_8 = b4, b4_8
            b4 = tl.load(wp + at + nxt, eviction_policy="evict_first")
            b4_8 = tl.load(wp + at8 + nxt, eviction_policy="evict_first")
        if XPF:
            xw0, xw1, xw2, xw3 = x0n, x1n, x2n, x3n
            x0n, x1n, x2n, x3n = load_x(xp, first + tl.where(w0 + 16 < per_warp, w0 + 16, 0))
        else:
            xw0, xw1, xw2, xw3 = load_x(xp, first + w0)
        da, da8, xs, tid_seen = chunk_sums_x(wa, wa8, xw0, xw1, xw2, xw3)
        acc, acc8 = group_scaled(acc, acc8, da, da8, xs, row, (start + w0) // GROUP_W,
                                 p_zero_ptr, p_scale_ptr, n_groups)
    store_rows(acc, acc8, tid_seen, t, out_ptr, pid, WARPS)


def module_text(n_words: int, group_w: int, n: int, warps: int, chunks: int, ilv: bool = False,
                deep: bool = False, xpf: bool = False, shfl: bool = False) -> str:
    """This file's kernels with a launch() for one config, as a module triton_target compiles."""
    here = inspect.getsource(sys.modules[__name__])
    kernels = here[here.index("MMA = "):here.index("\ndef module_text")]
    return ("import triton\nimport triton.language as tl\nfrom fusec.codegen.triton.helpers "
            "import fusec_bf16_to_f32, fusec_f32_to_bf16\n\n\n" + kernels +
            f"\ndef launch(p_packed, p_zero, p_scale, x, out):\n"
            + (f"    return mma_gemv_shfl[({n // 16},)](p_packed, p_zero, p_scale, x, out, "
               f"{n_words}, {group_w}, {warps}, {xpf}, num_warps={warps})\n" if shfl else
               f"    return mma_gemv_deep[({n // 16},)](p_packed, p_zero, p_scale, x, out, "
               f"{n_words}, {group_w}, {warps}, {chunks}, {xpf}, num_warps={warps})\n" if deep else
               f"    return mma_gemv[({n // 16},)](p_packed, p_zero, p_scale, x, out, "
               f"{n_words}, {group_w}, {warps}, {chunks}, {ilv}, num_warps={warps})\n"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--configs", default="4x2,4x2i,8x1i,d4x1,d4x4,d4x2x,s4,s4x,s8x",
                   help="WxS[i] (mma_gemv), dWxD[x] (mma_gemv_deep), sW[x] (mma_gemv_shfl); "
                        "see the docstring")
    p.add_argument("--debug", action="store_true", help="print the lanes' %%tid.x against the expected")
    args = p.parse_args()
    gpu = torch.cuda.is_available()
    dev = "cuda" if gpu else "cpu"
    k, n = args.k, args.n
    n_words, group_w = k // 8, args.group // 8
    torch.manual_seed(0)
    layer = Int4Linear(torch.randn(n, k, dtype=torch.bfloat16) / 64, args.group).to(dev)
    x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
    nbytes = sum(b.numel() * b.element_size() for b in layer.buffers())
    out = torch.empty(n, dtype=torch.bfloat16, device=dev)
    if gpu:
        print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
        w16 = layer.weight(torch.bfloat16)
        ms = median_ms(lambda x: F.linear(x, w16), x, device=dev)
        print(f"cuBLAS bf16 F.linear        {ms:.4f} ms {w16.numel() * 2 / ms / 1e9:.3f} TB/s",
              flush=True)
        with torch.no_grad():
            cf = fusec.compile(layer)
            got = cf(x)[0]
            ms = median_ms(cf, x, device=dev)
            e, eager_e = errors(layer, x, got)
        print(f"fusec's kernel              {ms:.4f} ms {nbytes / ms / 1e9:.3f} TB/s  "
              f"|out - exact| {e:.3g} (eager {eager_e:.3g})", flush=True)
    if gpu and args.debug:
        dbg = torch.zeros(n // 16 * 4 * 32 * 2, dtype=torch.int32, device=dev)
        mma_gemv[(n // 16,)](layer.packed, layer.zero, layer.scale, x, out, n_words, group_w, 4, 2,
                             True, dbg, num_warps=4)
        d = dbg.view(-1, 2)
        bad = (d[:, 0] != d[:, 1]).nonzero()[:, 0]
        print("debug: mismatches", bad.numel(), "first", [d[i].tolist() for i in bad[:8]],
              "error", errors(layer, x, out), flush=True)
    for spec in args.configs.split(","):
        shfl = spec.startswith("s")
        deep = spec.startswith("d")
        ilv = spec.endswith("i")
        xpf = spec.endswith("x") and deep
        if shfl:  # sW or sWx: the shuffling kernel, x: activations shuffled too
            warps, chunks, xpf = int(spec[1:].rstrip("x")), 2, spec.endswith("x")
        else:
            warps, chunks = (int(v) for v in spec.lstrip("d").rstrip("ix").split("x")[:2])
        if n_words % (16 * (1 if deep else chunks) * warps) or group_w % 16 or n % 16:
            print(f"{spec}: does not tile K = {k}, N = {n}, group {args.group}")
            continue
        if not gpu:
            try:
                done = triton_target.compile_for(
                    module_text(n_words, group_w, n, warps, chunks, ilv, deep, xpf, shfl),
                    "mma_gemv_shfl" if shfl else "mma_gemv_deep" if deep else "mma_gemv",
                    ["uint8", "bfloat16", "bfloat16", "bfloat16", "bfloat16"], 90)
                per_trip = (1 if deep else chunks) * 16 * 16 * 8 / 32  # weights a thread handles
                print(f"{spec:6s} " + loop_summary(done, per_trip, top=10), flush=True)
            except Exception as err:  # noqa: BLE001
                print(f"{spec}: failed: {str(err)[:2000]}", flush=True)
            continue
        if shfl:
            call = lambda: mma_gemv_shfl[(n // 16,)](  # noqa: E731
                layer.packed, layer.zero, layer.scale, x, out, n_words, group_w, warps, xpf,
                num_warps=warps)
        elif deep:
            call = lambda: mma_gemv_deep[(n // 16,)](  # noqa: E731
                layer.packed, layer.zero, layer.scale, x, out, n_words, group_w, warps, chunks,
                xpf, num_warps=warps)
        else:
            call = lambda: mma_gemv[(n // 16,)](  # noqa: E731
                layer.packed, layer.zero, layer.scale, x, out, n_words, group_w, warps, chunks, ilv,
                num_warps=warps)
        try:
            out.fill_(0)
            call()
            e, eager_e = errors(layer, x, out)
            ms = median_ms(call, device=dev)
            e2, _ = errors(layer, x, out)
        except Exception as err:  # noqa: BLE001 (an experiment Triton refuses: say so, go on)
            print(f"{spec}: failed: {type(err).__name__}: {str(err)[:300]}", flush=True)
            continue
        print(f"{spec:6s}  {ms:.4f} ms {nbytes / ms / 1e9:.3f} TB/s  |out - exact| {e:.3g} / "
              f"after timing {e2:.3g} (eager {eager_e:.3g})", flush=True)


if __name__ == "__main__":
    main()

"""A packed-int4 GEMV that dequantizes once per group, not once per weight: a hand-written experiment.

    python extensions/quant_gemv/diagnostics/int4_offset.py [--k 8192] [--n 8192] [--configs 4x128x4x4,...]

fusec's int4 word GEMV rounds every dequantized weight `(q - zero) * scale` to bf16, as eager
does, which costs three bf16x2 steps per pair of nibbles and a widening of each to float32: about
six instructions per weight in its K loop, which is bound by the instructions it issues (measured on an
H200). The sum can be taken apart instead. Within one group the scale s and zero point z are
the same, so

    sum_k x_k (q_k - z) s  =  s * (sum_k (128 + q_k) x_k  -  (128 + z) * sum_k x_k)

and `128 + q` is what the unpacking already makes: `(word >> 4t) & 0x000F000F | 0x43004300` holds
nibbles t and t + 4 as the bf16 numbers 128 + q. Its high half read as a float32 (`& 0xFFFF0000`)
is exactly 128 + q, and so is its low half moved up (`<< 16`). So per weight: half a lop3, one
widening, one FMA; per group and row: one subtraction and one FMA. Every product is exact in
float32 and the sums are float32 sums, so the result is closer to a float64 product than eager's
(which rounds every weight to bf16 first); it is not eager's bit for bit. Subtracting
(128 + z) * sum x at the end of each chunk loses about 7 of float32's 24 bits to cancellation,
still 2^-17 relative, far below bf16's 2^-8.

The tile is [LANES, WPL, ROWS]: a lane holds WPL neighbouring words of
ROWS rows, loads the 8 * WPL activations of those words once and uses them for every row, and all
of a lane's words lie in one group.

With a GPU, each config (ROWSxLANESxWARPSxWPL) is timed beside fusec's own kernel (bytes of
packed weight, scales and zero points per second, do_bench medians) and its error against a
float64 product is printed beside eager's. Without one, each is run under the interpreter on a
small layer (the same error check) and compiled for sm_90 (registers and loop instructions).
"""
from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import torch

import fusec  # first: on a machine without a GPU it switches Triton's interpreter on
import triton
import triton.language as tl
from fusec.codegen.triton import target as triton_target
from fusec.codegen.triton.helpers import fusec_bf16_to_f32, fusec_f32_to_bf16
from fusec.timing import median_ms

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fusec.examples.int4_linear import Int4Linear  # noqa: E402
from int4_sass import loop_summary  # noqa: E402


@triton.jit
def nibble_pairs(w, ASM: tl.constexpr):
    # (w & 0x000F000F) | 0x43004300: nibbles t and t + 4 as the bf16 numbers 128 + q
    if ASM:  # one lop3 with both constants in registers (ptxas alone emits two)
        return tl.inline_asm_elementwise(
            "{\n .reg .b32 r_mask, r_128;\n mov.b32 r_mask, 0x000F000F;\n"
            " mov.b32 r_128, 0x43004300;\n lop3.b32 $0, $1, r_mask, r_128, 0xEA;\n}",
            "=r,r", [w], dtype=tl.int32, is_pure=True, pack=1)
    else:
        return (w & 0x000F000F) | 0x43004300


@triton.jit
def eight(x8):
    # x8[..., a, b, c] = x[8w + 4a + 2b + c] taken apart in registers, x_t = x[8w + t]: each
    # tl.split halves the last dimension (of size 2)
    x_even, x_odd = tl.split(x8)
    x_even0, x_even1 = tl.split(x_even)
    x_odd0, x_odd1 = tl.split(x_odd)
    x0, x4 = tl.split(x_even0)
    x2, x6 = tl.split(x_even1)
    x1, x5 = tl.split(x_odd0)
    x3, x7 = tl.split(x_odd1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def load_w(ptrs, CG: tl.constexpr):
    # the streamed weight words: evict_first, or with CG past L1 (".cg": cached in L2 only)
    if CG:
        return tl.load(ptrs, cache_modifier=".cg")  # (ptxas refuses .cg with an eviction hint)
    else:
        return tl.load(ptrs, eviction_policy="evict_first")


@triton.jit
def load_x(ptrs, XL: tl.constexpr):
    # the activations, read by every program: with XL kept (evict_last)
    if XL:
        return tl.load(ptrs, eviction_policy="evict_last")
    else:
        return tl.load(ptrs)


@triton.jit
def offset_gemv(p_packed_ptr, p_zero_ptr, p_scale_ptr, x_ptr, out_ptr, n_words: tl.constexpr,
                GROUP_W: tl.constexpr, ROWS: tl.constexpr, LANES: tl.constexpr,
                WPL: tl.constexpr, ASM: tl.constexpr, PAIRED: tl.constexpr,
                PREFETCH: tl.constexpr, UNROLL: tl.constexpr, SPLIT: tl.constexpr = 1,
                DEEP: tl.constexpr = False, CG: tl.constexpr = False, XL: tl.constexpr = False):
    BLOCK_W: tl.constexpr = WPL * LANES  # words per chunk of each row
    pid = tl.program_id(axis=0)
    # SPLIT > 1 (timing only): program (pid, k) adds up the k-th of SPLIT slices of K, and every
    # slice stores its partial sums to the same place (not combined: the traffic, not the result)
    k_first = tl.program_id(axis=1) * (n_words // SPLIT)
    n = pid * ROWS + tl.arange(0, ROWS)[None, None, :]
    w4 = WPL * tl.arange(0, LANES)[:, None] + tl.arange(0, WPL)[None, :]  # [LANES, WPL] words
    ws = w4[:, :, None]
    acc = tl.zeros([LANES, ROWS], dtype=tl.float32)
    wp = p_packed_ptr.to(tl.pointer_type(tl.int32))
    n_groups: tl.constexpr = n_words // GROUP_W
    rows = pid * ROWS + tl.arange(0, ROWS)[None, :]
    lane_w = WPL * tl.arange(0, LANES)[:, None]
    x_lanes = (w4 * 8)[:, :, None] + tl.arange(0, 8)[None, None, :]
    ws = ws + k_first
    lane_w = lane_w + k_first
    x_lanes = x_lanes + k_first * 8
    words_next = load_w(wp + n * n_words + ws, CG)
    if DEEP:  # two chunks ahead: the one after next in flight too
        words_after = tl.load(wp + n * n_words + ws + tl.where(BLOCK_W < n_words // SPLIT, BLOCK_W, 0),
                              eviction_policy="evict_first")
    if PREFETCH:  # the next chunk's zero points, scales and activations too
        z_next = tl.load(p_zero_ptr + rows * n_groups + lane_w // GROUP_W)
        s_next = tl.load(p_scale_ptr + rows * n_groups + lane_w // GROUP_W)
        x_next = tl.load(x_ptr + x_lanes)
    for w_start in tl.range(0, n_words // SPLIT, BLOCK_W, loop_unroll_factor=UNROLL):
        words = words_next  # the next chunk's words are in flight while this one is multiplied
        w_next = tl.where(w_start + BLOCK_W < n_words // SPLIT, w_start + BLOCK_W, 0)
        if DEEP:
            w_after = tl.where(w_start + 2 * BLOCK_W < n_words // SPLIT, w_start + 2 * BLOCK_W, 0)
            words_next = words_after
            words_after = tl.load(wp + n * n_words + ws + w_after, eviction_policy="evict_first")
        else:
            words_next = load_w(wp + n * n_words + ws + w_next, CG)
        # a lane's WPL words lie in one group: its zero point and scale per row
        if PREFETCH:
            z = fusec_bf16_to_f32(z_next)
            s = fusec_bf16_to_f32(s_next)
            x8 = fusec_bf16_to_f32(x_next)
            g = (w_next + lane_w) // GROUP_W
            z_next = tl.load(p_zero_ptr + rows * n_groups + g)
            s_next = tl.load(p_scale_ptr + rows * n_groups + g)
            x_next = tl.load(x_ptr + x_lanes + w_next * 8)
        else:
            g = (w_start + lane_w) // GROUP_W
            z = fusec_bf16_to_f32(tl.load(p_zero_ptr + rows * n_groups + g))
            s = fusec_bf16_to_f32(tl.load(p_scale_ptr + rows * n_groups + g))
            x8 = fusec_bf16_to_f32(load_x(x_ptr + x_lanes + w_start * 8, XL))
        xsum = tl.sum(tl.sum(x8, axis=2), axis=1)  # [LANES]: the lane's activations, added
        x8 = tl.reshape(x8, [LANES, WPL, 2, 2, 2])  # x8[..., a, b, c]: x[8w + 4a + 2b + c]
        x0, x1, x2, x3, x4, x5, x6, x7 = eight(x8)
        if PAIRED:
            # the high half's float carries the low half below its last bf16 bit: as a float32,
            # pair = 128 + q_hi + (0x4300 + q_lo) / 65536. Multiplying the low nibble's
            # 128 + q_lo by x_lo - x_hi / 65536 instead of x_lo takes (128 + q_lo) x_hi / 65536
            # back out, so that only (0x4300 - 128) / 65536 * x_hi is left over: a constant
            # times the activations, subtracted with the zero point below. No mask for the high
            # half: one lop3 and one shift per pair of weights.
            y0 = x0 - x4 * (1.0 / 65536)
            y1 = x1 - x5 * (1.0 / 65536)
            y2 = x2 - x6 * (1.0 / 65536)
            y3 = x3 - x7 * (1.0 / 65536)
            pair = nibble_pairs(words, ASM)
            part = pair.to(tl.float32, bitcast=True) * x4[:, :, None]
            part += (pair << 16).to(tl.float32, bitcast=True) * y0[:, :, None]
            pair = nibble_pairs(words >> 4, ASM)
            part += pair.to(tl.float32, bitcast=True) * x5[:, :, None]
            part += (pair << 16).to(tl.float32, bitcast=True) * y1[:, :, None]
            pair = nibble_pairs(words >> 8, ASM)
            part += pair.to(tl.float32, bitcast=True) * x6[:, :, None]
            part += (pair << 16).to(tl.float32, bitcast=True) * y2[:, :, None]
            pair = nibble_pairs(words >> 12, ASM)
            part += pair.to(tl.float32, bitcast=True) * x7[:, :, None]
            part += (pair << 16).to(tl.float32, bitcast=True) * y3[:, :, None]
            xhi = tl.sum((x4 + x5) + (x6 + x7), axis=1)  # [LANES]
            base = 128.0 * xsum + (17024.0 / 65536) * xhi
            acc += s * (tl.sum(part, axis=1) - base[:, None] - z * xsum[:, None])
        else:
            # sum over the chunk of (128 + q) * x, one FMA per weight
            pair = nibble_pairs(words, ASM)
            part = (pair << 16).to(tl.float32, bitcast=True) * x0[:, :, None]
            part += (pair & -65536).to(tl.float32, bitcast=True) * x4[:, :, None]
            pair = nibble_pairs(words >> 4, ASM)
            part += (pair << 16).to(tl.float32, bitcast=True) * x1[:, :, None]
            part += (pair & -65536).to(tl.float32, bitcast=True) * x5[:, :, None]
            pair = nibble_pairs(words >> 8, ASM)
            part += (pair << 16).to(tl.float32, bitcast=True) * x2[:, :, None]
            part += (pair & -65536).to(tl.float32, bitcast=True) * x6[:, :, None]
            pair = nibble_pairs(words >> 12, ASM)
            part += (pair << 16).to(tl.float32, bitcast=True) * x3[:, :, None]
            part += (pair & -65536).to(tl.float32, bitcast=True) * x7[:, :, None]
            # the group's zero point and scale, once per lane and row
            acc += s * (tl.sum(part, axis=1) - (z + 128.0) * xsum[:, None])
    sums = tl.sum(acc, axis=0)
    tl.store(out_ptr + pid * ROWS + tl.arange(0, ROWS), fusec_f32_to_bf16(sums))


def module_text(n_words: int, group_w: int, n: int, rows: int, lanes: int, warps: int,
                wpl: int, paired: bool, prefetch: bool, unroll: int, split: int = 1,
                deep: bool = False) -> str:
    """This file's kernels with a launch() for one config, as a module triton_target compiles."""
    here = inspect.getsource(sys.modules[__name__])
    kernels = here[here.index("@triton.jit\ndef nibble_pairs"):here.index("\ndef module_text")]
    return ("import triton\nimport triton.language as tl\nfrom fusec.codegen.triton.helpers "
            "import fusec_bf16_to_f32, fusec_f32_to_bf16\n\n\n" + kernels +
            f"\ndef launch(p_packed, p_zero, p_scale, x, out):\n"
            f"    return offset_gemv[({n // rows}, {split})](p_packed, p_zero, p_scale, x, out, "
            f"{n_words}, {group_w}, {rows}, {lanes}, {wpl}, True, {paired}, {prefetch}, {unroll}, {split}, {deep}, num_warps={warps}, "
            "enable_fp_fusion=True)\n")


def errors(layer, x, got) -> tuple[float, float]:
    """(|got - exact|, |eager - exact|) max over the outputs, exact = a float64 product of the
    dequantized weight as eager rounds it... no: of the exact dequantization (q - z) * s."""
    p = layer.packed.view(layer.n, layer.k // layer.group, layer.group // 2).double()
    lo, hi = torch.remainder(p, 16), torch.div(p, 16, rounding_mode="floor")
    z, s = layer.zero[..., None].double(), layer.scale[..., None].double()
    w = torch.stack([(lo - z) * s, (hi - z) * s], dim=-1).view(layer.n, layer.k)
    exact = (x.double() @ w.T)[0]
    eager = layer(x)[0].double()
    return (got.double() - exact).abs().max().item(), (eager - exact).abs().max().item()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--configs", default="4x128x4x4,2x128x4x4,4x64x2x4,8x64x4x4,4x128x4x2,"
                   "4x256x8x2,8x128x8x2,2x256x4x4", help="ROWSxLANESxWARPSxWPL[p][f][d][uU][sS],...; p: the paired form, f: prefetch, "
                        "d: words two chunks ahead, c: words past L1 (.cg), l: activations evict_last, "
                        "uU: unroll U, sS: split K in S (timing only)")
    args = p.parse_args()
    gpu = torch.cuda.is_available()
    dev = "cuda" if gpu else "cpu"
    k, n = (args.k, args.n) if gpu else (4096, 64)
    n_words, group_w = k // 8, args.group // 8
    torch.manual_seed(0)
    layer = Int4Linear(torch.randn(n, k, dtype=torch.bfloat16) / 64, args.group).to(dev)
    x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
    nbytes = sum(b.numel() * b.element_size() for b in layer.buffers())
    out = torch.empty(n, dtype=torch.bfloat16, device=dev)
    if gpu:
        with torch.no_grad():
            cf = fusec.compile(layer)
            got = cf(x)[0]
            ms = median_ms(cf, x, device=dev)
            e, eager_e = errors(layer, x, got)
        print(f"fusec's kernel            {ms:.4f} ms {nbytes / ms / 1e9:.3f} TB/s  "
              f"|out - exact| {e:.3g} (eager {eager_e:.3g})", flush=True)
    for spec in args.configs.split(","):
        spec, _, split = spec.partition("s")
        split = int(split or 1)
        paired, prefetch = "p" in spec.split("x")[3], "f" in spec.split("x")[3]
        deep = "d" in spec.split("x")[3]
        cg, xl = "c" in spec.split("x")[3], "l" in spec.split("x")[3]
        unroll = int(spec.split("u")[1]) if "u" in spec else 1
        rows, lanes, warps, wpl = (int(v.rstrip("pfdcl")) for v in spec.split("u")[0].split("x"))
        if n_words % (wpl * lanes * split) or group_w % wpl or n % rows:
            print(f"{spec}: does not tile K = {k}, N = {n}, group {args.group}")
            continue
        call = lambda: offset_gemv[(n // rows, split)](  # noqa: E731
            layer.packed, layer.zero, layer.scale, x, out, n_words, group_w, rows, lanes, wpl, gpu, paired, prefetch, unroll,
            split, deep, cg, xl, num_warps=warps, enable_fp_fusion=True)
        try:
            call()
            ms = median_ms(call, device=dev) if gpu else float("nan")
        except Exception as err:  # noqa: BLE001 (an experiment Triton refuses: say so, go on)
            print(f"{spec}: failed: {type(err).__name__}: {str(err)[:200]}", flush=True)
            continue
        e, eager_e = errors(layer, x, out)
        spec += f"s{split}" if split > 1 else ""
        line = f"{spec:14s}  {ms:.4f} ms {nbytes / ms / 1e9:.3f} TB/s  |out - exact| {e:.3g} " \
               f"(eager {eager_e:.3g})"
        if not gpu:
            done = triton_target.compile_for(
                module_text(args.k // 8, group_w, args.n, rows, lanes, warps, wpl, paired, prefetch, unroll, split, deep), "offset_gemv",
                ["uint8", "bfloat16", "bfloat16", "bfloat16", "bfloat16"], 90)
            line += "\n    " + loop_summary(done, rows * wpl * lanes * 8 / (32 * warps), top=10)
        print(line, flush=True)


if __name__ == "__main__":
    main()

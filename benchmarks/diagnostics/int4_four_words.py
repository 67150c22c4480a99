"""A packed-int4 GEMV whose activations never go through shared memory: a hand-written experiment.

    python benchmarks/diagnostics/int4_four_words.py [--k 8192] [--n 8192] [--configs 2x128x4,...]

fusec's int4 word GEMV (extensions/quant_gemv/templates/triton_gemv_int4.py.j2) loads its weight tile
[rows, words] with four neighbouring words per thread, and its activations as one 16-byte load
of a word's eight per thread. The two layouts differ, and every warp needs the whole chunk's
activations, so on an H200 each chunk paid eight conversions through shared memory (8 STSM,
8 LDS, 16 barriers per thread; docs/gpu.md, 2026-11-26, afternoon).

Here the tile is three-dimensional, [LANES, 4, ROWS]: lane i holds words 4i .. 4i + 3 (one
16-byte load per row) and the 32 activations of those words (four 16-byte loads). Triton gives
both the same thread layout, so the loop has no shared memory and no barrier (Triton 3.6, the
GPU host's: 64 registers, 393 loop instructions for 64 weights at 2x128x4; Triton 3.9 lays the
activations out otherwise and converts them through shared memory again). It pays instead to
widen 32 activations per thread per chunk, work the generated kernel shares across warps. The
dequantization is the generated kernel's: one `lop3` per pair of nibbles and three `fma.rn.bf16x2`
steps, rounded as eager rounds `(q - zero) * scale`.

With a GPU, each config (ROWSxLANESxWARPS) is timed beside fusec's own kernel (bytes of packed
weight, scales and zero points per second, do_bench medians) and checked against eager. Without
one, each is compiled for sm_90 (fusec/codegen/triton_target.py) and its registers and loop
instructions are printed, to compare with benchmarks/diagnostics/int4_sass.py's.
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
from fusec.codegen import triton_target
from fusec.codegen.triton_helpers import fusec_bf16_to_f32, fusec_f32_to_bf16
from fusec.timing import median_ms

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from int4_linear import Int4Linear  # noqa: E402
from int4_sass import loop_summary  # noqa: E402


@triton.jit
def nibble_pairs(w):
    # (w & 0x000F000F) | 0x43004300 in one lop3: nibbles t and t + 4 as the bf16 numbers 128 + q
    return tl.inline_asm_elementwise(
        "{\n .reg .b32 r_mask, r_128;\n mov.b32 r_mask, 0x000F000F;\n mov.b32 r_128, 0x43004300;\n"
        " lop3.b32 $0, $1, r_mask, r_128, 0xEA;\n}",
        "=r,r", [w], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def dequant_pairs(pair, zneg2, s2):
    # (q - zero) * scale for both halves, each step rounded to bf16 as eager rounds it
    return tl.inline_asm_elementwise(
        "{\n .reg .b32 r_one, r_m128, r_mz, r_q, r_d;\n mov.b32 r_one, 0x3F803F80;\n"
        " mov.b32 r_m128, 0xC300C300;\n mov.b32 r_mz, 0x80008000;\n"
        " fma.rn.bf16x2 r_q, $1, r_one, r_m128;\n fma.rn.bf16x2 r_d, r_q, r_one, $2;\n"
        " fma.rn.bf16x2 $0, r_d, $3, r_mz;\n}",
        "=r,r,r,r", [pair, zneg2, s2], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def bf16x2(v, NEGATE: tl.constexpr):
    bits = v.to(tl.uint16, bitcast=True).to(tl.int32)
    if NEGATE:
        bits = bits ^ 0x8000
    return bits | (bits << 16)


@triton.jit
def four_words_gemv(p_packed_ptr, p_zero_ptr, p_scale_ptr, x_ptr, out_ptr, n_words: tl.constexpr,
                    GROUP_W: tl.constexpr, ROWS: tl.constexpr, LANES: tl.constexpr):
    BLOCK_W: tl.constexpr = 4 * LANES  # words per chunk of each row
    pid = tl.program_id(axis=0)
    n = pid * ROWS + tl.arange(0, ROWS)[None, None, :]
    w4 = 4 * tl.arange(0, LANES)[:, None] + tl.arange(0, 4)[None, :]  # [LANES, 4] word index
    ws = w4[:, :, None]
    acc = tl.zeros([LANES, 4, ROWS], dtype=tl.float32)
    wp = p_packed_ptr.to(tl.pointer_type(tl.int32))
    words_next = tl.load(wp + n * n_words + ws, eviction_policy="evict_first")
    for w_start in range(0, n_words, BLOCK_W):
        words = words_next  # the next chunk's words are in flight while this one is multiplied
        w_next = tl.where(w_start + BLOCK_W < n_words, w_start + BLOCK_W, 0)
        words_next = tl.load(wp + n * n_words + ws + w_next, eviction_policy="evict_first")
        g = (w_start + 4 * tl.arange(0, LANES)[:, None, None]) // GROUP_W  # a lane's four: one group
        zneg2 = bf16x2(tl.load(p_zero_ptr + n * (n_words // GROUP_W) + g), True)
        s2 = bf16x2(tl.load(p_scale_ptr + n * (n_words // GROUP_W) + g), False)
        x8 = tl.load(x_ptr + ((w_start + w4) * 8)[:, :, None] + tl.arange(0, 8)[None, None, :])
        x8 = tl.reshape(fusec_bf16_to_f32(x8), [LANES, 4, 2, 2, 2])  # x8[..., a, b, c]: x[8w + 4a + 2b + c]
        x_even, x_odd = tl.split(x8)
        x_even0, x_even1 = tl.split(x_even)
        x_odd0, x_odd1 = tl.split(x_odd)
        x0, x4 = tl.split(x_even0)
        x2, x6 = tl.split(x_even1)
        x1, x5 = tl.split(x_odd0)
        x3, x7 = tl.split(x_odd1)
        w2 = dequant_pairs(nibble_pairs(words), zneg2, s2)
        acc += (w2 << 16).to(tl.float32, bitcast=True) * x0[:, :, None]
        acc += (w2 & -65536).to(tl.float32, bitcast=True) * x4[:, :, None]
        w2 = dequant_pairs(nibble_pairs(words >> 4), zneg2, s2)
        acc += (w2 << 16).to(tl.float32, bitcast=True) * x1[:, :, None]
        acc += (w2 & -65536).to(tl.float32, bitcast=True) * x5[:, :, None]
        w2 = dequant_pairs(nibble_pairs(words >> 8), zneg2, s2)
        acc += (w2 << 16).to(tl.float32, bitcast=True) * x2[:, :, None]
        acc += (w2 & -65536).to(tl.float32, bitcast=True) * x6[:, :, None]
        w2 = dequant_pairs(nibble_pairs(words >> 12), zneg2, s2)
        acc += (w2 << 16).to(tl.float32, bitcast=True) * x3[:, :, None]
        acc += (w2 & -65536).to(tl.float32, bitcast=True) * x7[:, :, None]
    sums = tl.sum(tl.sum(acc, axis=1), axis=0)
    tl.store(out_ptr + pid * ROWS + tl.arange(0, ROWS), fusec_f32_to_bf16(sums))


def module_text(n_words: int, group_w: int, n: int, rows: int, lanes: int, warps: int) -> str:
    """This file's kernel with a launch() for one config, as a module triton_target compiles."""
    here = inspect.getsource(sys.modules[__name__])
    kernels = here[here.index("@triton.jit\ndef nibble_pairs"):here.index("\ndef module_text")]
    return ("import triton\nimport triton.language as tl\nfrom fusec.codegen.triton_helpers "
            "import fusec_bf16_to_f32, fusec_f32_to_bf16\n\n\n" + kernels +
            f"\ndef launch(p_packed, p_zero, p_scale, x, out):\n"
            f"    return four_words_gemv[({n // rows},)](p_packed, p_zero, p_scale, x, out, "
            f"{n_words}, {group_w}, {rows}, {lanes}, num_warps={warps}, "
            "enable_fp_fusion=True)\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--configs", default="2x128x4,4x128x4,2x64x2,4x64x2,1x128x4,2x256x8",
                   help="ROWSxLANESxWARPS,...")
    args = p.parse_args()
    gpu = torch.cuda.is_available()
    dev = "cuda" if gpu else "cpu"
    n_words, group_w = args.k // 8, args.group // 8
    torch.manual_seed(0)
    layer = Int4Linear(torch.randn(args.n, args.k, dtype=torch.bfloat16) / 64, args.group).to(dev)
    x = torch.randn(1, args.k, dtype=torch.bfloat16, device=dev)
    nbytes = sum(b.numel() * b.element_size() for b in layer.buffers())
    out = torch.empty(args.n, dtype=torch.bfloat16, device=dev)
    if gpu:
        with torch.no_grad():
            want = layer(x)[0].float()
            cf = fusec.compile(layer)
            cf(x)
            ms = median_ms(cf, x, device=dev)
        print(f"fusec's kernel            {ms:.4f} ms {nbytes / ms / 1e9:.3f} TB/s", flush=True)
    for spec in args.configs.split(","):
        rows, lanes, warps = (int(v) for v in spec.split("x"))
        if n_words % (4 * lanes) or group_w % 4 or args.n % rows:
            print(f"{spec}: does not tile K = {args.k}, N = {args.n}, group {args.group}")
            continue
        if not gpu:
            done = triton_target.compile_for(module_text(n_words, group_w, args.n, rows, lanes, warps),
                                             "four_words_gemv", ["uint8", "bfloat16", "bfloat16",
                                                                 "bfloat16", "bfloat16"], 90)
            # one thread's weights per chunk
            print(f"{spec}: {loop_summary(done, rows * 4 * lanes * 8 / (32 * warps), top=10)}",
                  flush=True)
            continue
        call = lambda: four_words_gemv[(args.n // rows,)](  # noqa: E731
            layer.packed, layer.zero, layer.scale, x, out, n_words, group_w, rows, lanes,
            num_warps=warps, enable_fp_fusion=True)
        try:
            call()
            ms = median_ms(call, device=dev)
        except Exception as err:  # noqa: BLE001 (an experiment Triton refuses: say so, go on)
            print(f"{spec}: failed: {type(err).__name__}: {str(err)[:200]}", flush=True)
            continue
        error = (out.float() - want).abs().max().item()
        print(f"{spec:24s}  {ms:.4f} ms {nbytes / ms / 1e9:.3f} TB/s  |out - eager| {error:.3g}",
              flush=True)


if __name__ == "__main__":
    main()

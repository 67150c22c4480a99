"""A packed-int4 GEMV on tensor cores with split K: a hand-written experiment.

    python benchmarks/diagnostics/int4_mma.py [--k 8192] [--n 8192] [--m 1,4,16] [--configs 64x16x4x4,...]

fusec's int4 word GEMV spends about six instructions per weight on CUDA cores: unpacking, eager's
two bf16 roundings of (q - zero) * scale, widening to float32 and one FMA
(docs/gpu.md, 2026-11-26). Here the product goes to the tensor cores instead, as
out^T = W @ x^T: the dequantized weight tile [BLOCK_N, BLOCK_W] is wgmma's A operand, which on
Hopper may stay in registers, and the activations (M rows padded to 16) are its B operand. The
weights are not reordered: for nibble t of every word, W_t[n, w] = weight 8w + t of row n is
multiplied by x_t[w, m] = x[m, 8w + t], eight dots per chunk of words. Triton computes the
unpacking in the dot operand's own layout, where a thread holds the words of two neighbouring
K lanes, so one prmt + shift + lop3 gives the bf16 pair (128 + q of word w, 128 + q of word w + 1),
and three bf16x2 FMAs dequantize it exactly as eager rounds (Triton 3.6, sm_90, offline: about
3.9 instructions per weight, against 6 for the generated kernel).

BLOCK_N rows per program leave few programs (8192 / 64 = 128), so K is split: SPLIT programs
share a row block, each writes its float32 partial sums, and the last to finish (an atomic
counter per row block) adds them up in a fixed order and stores the bf16 result, then resets
the counter for the next call.

A config ending in `g` uses the group form instead (int4_offset.py's algebra, here on tensor
cores): a chunk within one group multiplies `q - zero` (eager's first rounding: two bf16x2 FMAs
per pair, no scale), and the scale is applied once per row and chunk to the float32 sums.

With a GPU each config (BLOCK_N x BLOCK_W x WARPS x SPLIT) is timed beside fusec's kernel and
checked against eager's output; without one, each is compiled for sm_90 and its registers and loop
instructions are printed.
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
from fusec.timing import median_ms

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from int4_linear import Int4Linear  # noqa: E402
from int4_sass import loop_summary  # noqa: E402


@triton.jit
def pair_nibbles(words, T: tl.constexpr):
    # words of two neighbouring K lanes a, b -> bf16x2 (128 + nibble T of a, 128 + nibble T of b):
    # prmt takes the two low (T < 4) or high 16-bit halves side by side, the shift brings nibble
    # T % 4 of each half down, lop3 keeps it and ORs in the bf16 128.0 (0x4300) of each half
    sh = tl.full(words.shape, 4 * (T % 4), tl.int32)
    if T < 4:
        return tl.inline_asm_elementwise(
            "{\n .reg .b32 r_u;\n prmt.b32 r_u, $1, $2, 0x5410;\n shr.b32 r_u, r_u, $3;\n"
            " lop3.b32 $0, r_u, 0x000F000F, 0x43004300, 0xEA;\n}",
            "=r,r,r,r,r", [words, sh], dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise(
            "{\n .reg .b32 r_u;\n prmt.b32 r_u, $1, $2, 0x7632;\n shr.b32 r_u, r_u, $3;\n"
            " lop3.b32 $0, r_u, 0x000F000F, 0x43004300, 0xEA;\n}",
            "=r,r,r,r,r", [words, sh], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def dequant(pair, zneg, s):
    # (q - zero) * scale on bf16 pairs, each step rounded to bf16 as eager rounds it
    return tl.inline_asm_elementwise(
        "{\n .reg .b32 r_one, r_m128, r_mz, r_q, r_d;\n mov.b32 r_one, 0x3F803F80;\n"
        " mov.b32 r_m128, 0xC300C300;\n mov.b32 r_mz, 0x80008000;\n"
        " fma.rn.bf16x2 r_q, $1, r_one, r_m128;\n fma.rn.bf16x2 r_d, r_q, r_one, $2;\n"
        " fma.rn.bf16x2 $0, r_d, $3, r_mz;\n}",
        "=r,r,r,r", [pair, zneg, s], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def minus_zero(pair, zneg):
    # q - zero on bf16 pairs: (128 + q) - 128 = q exactly, then + (-zero) rounded as eager's
    return tl.inline_asm_elementwise(
        "{\n .reg .b32 r_one, r_m128, r_q;\n mov.b32 r_one, 0x3F803F80;\n"
        " mov.b32 r_m128, 0xC300C300;\n"
        " fma.rn.bf16x2 r_q, $1, r_one, r_m128;\n fma.rn.bf16x2 $0, r_q, r_one, $2;\n}",
        "=r,r,r", [pair, zneg], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def int4_mma_gemv(p_ptr, z_ptr, s_ptr, x_ptr, out_ptr, part_ptr, count_ptr, M,
                  N: tl.constexpr, n_words: tl.constexpr, GROUP_W: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_M: tl.constexpr,
                  SPLIT: tl.constexpr, GROUPS: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    K: tl.constexpr = 8 * n_words
    PER_SPLIT: tl.constexpr = n_words // SPLIT
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    w = tl.arange(0, BLOCK_W)[None, :]
    mm = tl.arange(0, BLOCK_M)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    wp = p_ptr.to(tl.pointer_type(tl.int32))
    for w0 in range(pid_k * PER_SPLIT, (pid_k + 1) * PER_SPLIT, BLOCK_W):
        words = tl.load(wp + n * n_words + w0 + w, eviction_policy="evict_first")
        kk = 8 * (w0 + tl.arange(0, BLOCK_W))[:, None]
        if GROUPS:
            # the chunk lies in one group: its weights' q - zero (eager's first rounding) on the
            # tensor cores, and the scale once per row and chunk, in float32
            g1 = w0 // GROUP_W
            zneg1 = -tl.load(z_ptr + n * (n_words // GROUP_W) + g1)  # [BLOCK_N, 1]
            sf = tl.load(s_ptr + n * (n_words // GROUP_W) + g1).to(tl.float32)
            d = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for t in tl.static_range(8):
                xt = tl.load(x_ptr + mm * K + kk + t, mask=mm < M, other=0.0)
                d = tl.dot(minus_zero(pair_nibbles(words, t), zneg1), xt, d)
            acc += sf * d
        else:
            g = (w0 + w) // GROUP_W
            zneg = -tl.load(z_ptr + n * (n_words // GROUP_W) + g)
            s = tl.load(s_ptr + n * (n_words // GROUP_W) + g)
            for t in tl.static_range(8):
                wt = dequant(pair_nibbles(words, t), zneg, s)
                xt = tl.load(x_ptr + mm * K + kk + t, mask=mm < M, other=0.0)
                acc = tl.dot(wt, xt, acc)
    if SPLIT == 1:
        tl.store(out_ptr + mm * N + n, acc.to(tl.bfloat16), mask=mm < M)
    else:
        tl.store(part_ptr + (pid_k * M + mm) * N + n, acc, mask=mm < M)
        tl.debug_barrier()  # every thread's partial sums are written before the count goes up
        done = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if done == SPLIT - 1:  # the last of the row block's programs adds the partials up
            total = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for j in range(SPLIT):
                total += tl.load(part_ptr + (j * M + mm) * N + n, mask=mm < M, other=0.0,
                                 cache_modifier=".cg")
            tl.store(out_ptr + mm * N + n, total.to(tl.bfloat16), mask=mm < M)
            tl.atomic_xchg(count_ptr + pid_n, 0)


def module_text(m, n_words, group_w, n, bn, bw, warps, split, groups=False) -> str:
    here = inspect.getsource(sys.modules[__name__])
    kernels = here[here.index("@triton.jit\ndef pair_nibbles"):here.index("\ndef module_text")]
    return ("import triton\nimport triton.language as tl\n\n\n" + kernels +
            f"\ndef launch(p, z, s, x, out, part, count):\n"
            f"    return int4_mma_gemv[({n // bn}, {split})](p, z, s, x, out, part, count, {m}, {n}, "
            f"{n_words}, {group_w}, {bn}, {bw}, 16, {split}, {groups}, num_warps={warps}, "
            "num_stages=1)\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--m", default="1")
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--configs", default="64x16x4x4,64x16x4x8,64x32x4x4,64x32x4x8,128x16x8x4,"
                   "128x16x8x8,128x32x8x8,128x16x4x8,64x16x4x16,128x16x8x16",
                   help="BLOCK_NxBLOCK_WxWARPSxSPLIT[g],...; g: the group form (int4_offset.py's "
                        "algebra: no per-weight dequantization, BLOCK_W within a group)")
    args = p.parse_args()
    gpu = torch.cuda.is_available()
    dev = "cuda" if gpu else "cpu"
    n_words, group_w = args.k // 8, args.group // 8
    torch.manual_seed(0)
    layer = Int4Linear(torch.randn(args.n, args.k, dtype=torch.bfloat16) / 64, args.group).to(dev)
    nbytes = sum(b.numel() * b.element_size() for b in layer.buffers())
    for m in (int(v) for v in args.m.split(",")):
        x = torch.randn(m, args.k, dtype=torch.bfloat16, device=dev)
        out = torch.empty(m, args.n, dtype=torch.bfloat16, device=dev)
        count = torch.zeros(args.n, dtype=torch.int32, device=dev)
        if gpu:
            with torch.no_grad():
                want = layer(x).float()
                ref = (x.double() @ layer.weight(torch.bfloat16).double().t()).float()
                cf = fusec.compile(layer)
                got = cf(x).float()
                ms = median_ms(cf, x, device=dev)
            print(f"M={m} fusec's kernel              {ms:.4f} ms {nbytes / ms / 1e9:.3f} TB/s  "
                  f"|err| fusec {(got - ref).abs().max().item():.3g} eager "
                  f"{(want - ref).abs().max().item():.3g}", flush=True)
        for spec in args.configs.split(","):
            groups = spec.endswith("g")
            bn, bw, warps, split = (int(v) for v in spec.rstrip("g").split("x"))
            if n_words % (bw * split) or args.n % bn or group_w % bw and bw % group_w or \
                    groups and group_w % bw:
                print(f"{spec}: does not tile K = {args.k}, N = {args.n}, group {args.group}")
                continue
            if not gpu:
                done = triton_target.compile_for(
                    module_text(m, n_words, group_w, args.n, bn, bw, warps, split, groups),
                    "int4_mma_gemv",
                    ["uint8", "bfloat16", "bfloat16", "bfloat16", "bfloat16", "float32", "int32"], 90)
                print(f"{spec}: {loop_summary(done, bn * bw * 8 / (32 * warps))}", flush=True)
                continue
            part = torch.empty(split, m, args.n, dtype=torch.float32, device=dev)
            call = lambda: int4_mma_gemv[(args.n // bn, split)](  # noqa: E731
                layer.packed, layer.zero, layer.scale, x, out, part, count, m, args.n, n_words,
                group_w, bn, bw, 16, split, groups, num_warps=warps, num_stages=1)
            try:
                call()
                torch.cuda.synchronize()
                error = (out.float() - ref).abs().max().item()
                ms = median_ms(call, device=dev)
                again = (out.float() - ref).abs().max().item()
            except Exception as err:  # noqa: BLE001 (an experiment Triton refuses: say so, go on)
                print(f"{spec}: failed: {type(err).__name__}: {str(err)[:300]}", flush=True)
                continue
            print(f"M={m} {spec:24s}  {ms:.4f} ms {nbytes / ms / 1e9:.3f} TB/s  |err| {error:.3g} "
                  f"(after timing {again:.3g})", flush=True)


if __name__ == "__main__":
    main()

"""The packed-int4 group GEMV with its words brought in by the TMA: a hand-written experiment.

    python extensions/quant_gemv/diagnostics/int4_tma.py [--k 8192] [--n 8192] [--configs 4x1x3,...]

fusec's int4 group kernel (extensions/quant_gemv/triton_gemv_int4_groups.py) loads its words with ordinary
16-byte loads into registers, one chunk ahead: the bytes in flight live in registers, so more of
them means fewer programs per SM (two chunks ahead was slower, int4_offset.py's `d`). On an H100
or H200 the Tensor Memory Accelerator copies a tile from global to shared memory on its own,
started by one instruction and waited for on a barrier; Triton issues it for a tensor descriptor's
`load` and, in a loop given `num_stages`, keeps that many tiles in flight in shared memory. So the
bytes in flight cost shared memory, not registers, and no load instructions per lane.

Here the paired form of the group kernel (the template's steps 2-4) reads its words that way:
a program owns ROWS rows and loads a [ROWS, LANES * WPL] tile of words per chunk through the
descriptor, STAGES chunks in flight; the activations, zero points and scales are loaded as before.
Each config ROWSxWARPSxSTAGES is timed beside fusec's own kernel, with its error against a float64
product beside eager's; `read` rows time the same descriptor loads with no arithmetic. Without a
GPU, it prints what Triton 3.6 makes of it for sm_90 (TMA copies, barriers, registers).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

import fusec  # first: on a machine without a GPU it switches Triton's interpreter on
import triton
import triton.language as tl
from fusec.codegen.triton.helpers import fusec_bf16_to_f32, fusec_f32_to_bf16
from fusec.timing import median_ms

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fusec.examples.int4_linear import Int4Linear  # noqa: E402
from int4_offset import eight, errors, nibble_pairs  # noqa: E402 (the same unpacking)

LANES, WPL = 32, 4


@triton.jit
def tma_gemv(w_desc, p_zero_ptr, p_scale_ptr, x_ptr, out_ptr, n_words: tl.constexpr,
             GROUP_W: tl.constexpr, ROWS: tl.constexpr, LANES: tl.constexpr, WPL: tl.constexpr,
             STAGES: tl.constexpr, ASM: tl.constexpr):
    BLOCK_W: tl.constexpr = WPL * LANES  # words per chunk of each row
    n_groups: tl.constexpr = n_words // GROUP_W
    pid = tl.program_id(axis=0)
    rows = pid * ROWS + tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    lane_w = WPL * tl.arange(0, LANES)[None, :]  # [1, LANES]: a lane's first word
    w4 = lane_w[:, :, None] + tl.arange(0, WPL)[None, None, :]  # [1, LANES, WPL]
    x_lanes = (w4 * 8)[:, :, :, None] + tl.arange(0, 8)[None, None, None, :]  # [1, LANES, WPL, 8]
    acc = tl.zeros([ROWS, LANES], dtype=tl.float32)
    for w_start in tl.range(0, n_words, BLOCK_W, num_stages=STAGES):
        # the chunk's words, [ROWS, BLOCK_W], copied to shared memory by the TMA
        words = tl.reshape(w_desc.load([pid * ROWS, w_start]), [ROWS, LANES, WPL])
        g = (w_start + lane_w) // GROUP_W  # [1, LANES]: the lanes' groups
        z = fusec_bf16_to_f32(tl.load(p_zero_ptr + rows * n_groups + g))  # [ROWS, LANES]
        s = fusec_bf16_to_f32(tl.load(p_scale_ptr + rows * n_groups + g))
        x8 = fusec_bf16_to_f32(tl.load(x_ptr + x_lanes + w_start * 8))  # [1, LANES, WPL, 8]
        xsum = tl.sum(tl.sum(x8, axis=3), axis=2)  # [1, LANES]
        x8 = tl.reshape(x8, [1, LANES, WPL, 2, 2, 2])  # x8[..., a, b, c]: x[8w + 4a + 2b + c]
        x0, x1, x2, x3, x4, x5, x6, x7 = eight(x8)
        # the paired form (templates/triton_gemv_int4_groups.py.j2, steps 2-4)
        pair = nibble_pairs(words, ASM)
        part = pair.to(tl.float32, bitcast=True) * x4
        part += (pair << 16).to(tl.float32, bitcast=True) * (x0 - x4 * (1.0 / 65536))
        pair = nibble_pairs(words >> 4, ASM)
        part += pair.to(tl.float32, bitcast=True) * x5
        part += (pair << 16).to(tl.float32, bitcast=True) * (x1 - x5 * (1.0 / 65536))
        pair = nibble_pairs(words >> 8, ASM)
        part += pair.to(tl.float32, bitcast=True) * x6
        part += (pair << 16).to(tl.float32, bitcast=True) * (x2 - x6 * (1.0 / 65536))
        pair = nibble_pairs(words >> 12, ASM)
        part += pair.to(tl.float32, bitcast=True) * x7
        part += (pair << 16).to(tl.float32, bitcast=True) * (x3 - x7 * (1.0 / 65536))
        x_hi = tl.sum((x4 + x5) + (x6 + x7), axis=2)  # [1, LANES]
        left_over = 128.0 * xsum + (17024.0 / 65536) * x_hi
        acc += s * (tl.sum(part, axis=2) - left_over - z * xsum)
    sums = tl.sum(acc, axis=1)
    tl.store(out_ptr + pid * ROWS + tl.arange(0, ROWS), fusec_f32_to_bf16(sums))


@triton.jit
def tma_read(w_desc, out_ptr, n_words: tl.constexpr, ROWS: tl.constexpr, BLOCK_W: tl.constexpr,
             STAGES: tl.constexpr):
    # the same tiles through the same descriptor, with no arithmetic: xor them together
    pid = tl.program_id(axis=0)
    acc = tl.zeros([ROWS, BLOCK_W], dtype=tl.int32)
    for w_start in tl.range(0, n_words, BLOCK_W, num_stages=STAGES):
        acc ^= w_desc.load([pid * ROWS, w_start])
    tl.store(out_ptr + pid * ROWS + tl.arange(0, ROWS), tl.sum(acc, axis=1))


def descriptor(layer, rows: int):
    from triton.tools.tensor_descriptor import TensorDescriptor
    words = layer.packed.view(torch.int32)  # [N, K / 8]
    return TensorDescriptor(words, list(words.shape), list(words.stride()), [rows, LANES * WPL])


def offline(n_words: int, group_w: int, rows: int, warps: int, stages: int) -> str:
    """What Triton makes of tma_gemv for sm_90, without a GPU: TMA copies, barriers, registers."""
    import os
    os.environ["TRITON_INTERPRET"] = "0"
    from triton.backends.compiler import GPUTarget
    sig = {"w_desc": f"tensordesc<i32[{rows}, {LANES * WPL}]>", "p_zero_ptr": "*bf16",
           "p_scale_ptr": "*bf16", "x_ptr": "*bf16", "out_ptr": "*bf16"}
    const = dict(n_words=n_words, GROUP_W=group_w, ROWS=rows, LANES=LANES, WPL=WPL,
                 STAGES=stages, ASM=True)
    sig.update({k: "constexpr" for k in const})
    src = triton.compiler.ASTSource(fn=tma_gemv, signature=sig, constexprs=const,
                                    attrs={(i,): [["tt.divisibility", 16]] for i in range(1, 5)})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    from fusec.codegen.triton.target import cuobjdump
    regs = re.search(r"REG:(\d+)", cuobjdump(c.asm["cubin"], "-res-usage")).group(1)
    ttgir = c.asm["ttgir"]
    Path("/tmp/int4_tma.ttgir").write_text(ttgir)
    Path("/tmp/int4_tma.ptx").write_text(c.asm["ptx"])
    return (f"registers {regs}, shared {c.metadata.shared} B, "
            f"TMA copies {ttgir.count('async_tma_copy_global_to_local')}, "
            f"barrier waits {ttgir.count('wait_barrier')}, "
            f"layout changes {ttgir.count('convert_layout')}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--configs", default="4x1x2,4x1x3,4x1x4,8x1x3,8x2x3,16x4x3,16x4x4",
                   help="ROWSxWARPSxSTAGES,... ('read' in front: descriptor loads only)")
    args = p.parse_args()
    gpu = torch.cuda.is_available()
    n_words, group_w = args.k // 8, args.group // 8
    if not gpu:
        for spec in args.configs.split(","):
            rows, warps, stages = (int(v) for v in spec.removeprefix("read").split("x"))
            print(f"{spec:10s} sm_90: {offline(n_words, group_w, rows, warps, stages)}", flush=True)
        return
    torch.manual_seed(0)
    k, n = args.k, args.n
    layer = Int4Linear(torch.randn(n, k, dtype=torch.bfloat16) / 64, args.group).cuda()
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    nbytes = sum(b.numel() * b.element_size() for b in layer.buffers())
    out = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        cf = fusec.compile(layer)
        got = cf(x)[0]
        ms = median_ms(cf, x, device="cuda")
        e, eager_e = errors(layer, x, got)
    print(f"fusec's kernel  {ms:.4f} ms {nbytes / ms / 1e9:.3f} TB/s  |out - exact| {e:.3g} "
          f"(eager {eager_e:.3g})", flush=True)
    for spec in args.configs.split(","):
        read = spec.startswith("read")
        rows, warps, stages = (int(v) for v in spec.removeprefix("read").split("x"))
        desc = descriptor(layer, rows)
        if read:
            sink = torch.empty(n, dtype=torch.int32, device="cuda")
            call = lambda: tma_read[(n // rows,)](desc, sink, n_words, rows, LANES * WPL,  # noqa: E731
                                                  stages, num_warps=warps)
        else:
            call = lambda: tma_gemv[(n // rows,)](  # noqa: E731
                desc, layer.zero, layer.scale, x, out, n_words, group_w, rows, LANES, WPL,
                stages, True, num_warps=warps, enable_fp_fusion=True)
        try:
            call()
            ms = median_ms(call, device="cuda")
        except Exception as err:  # noqa: BLE001 (a config Triton refuses: say so, go on)
            print(f"{spec}: failed: {type(err).__name__}: {str(err)[:300]}", flush=True)
            continue
        line = f"{spec:10s}  {ms:.4f} ms {nbytes / ms / 1e9:.3f} TB/s"
        if not read:
            e, eager_e = errors(layer, x, out)
            line += f"  |out - exact| {e:.3g} (eager {eager_e:.3g})"
        print(line, flush=True)


if __name__ == "__main__":
    main()

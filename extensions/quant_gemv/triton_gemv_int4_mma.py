"""Triton GEMV for 2 to 16 activation rows times a packed-int4 weight, on tensor cores, K split.

With one activation row the group kernel (extensions/quant_gemv/triton_gemv_int4_groups.py) multiplies on CUDA
cores: one FMA per weight. With M rows that is M FMAs per weight, and at M = 16 (a batch of 16
sequences decoding together) the CUDA cores, not the memory, set the pace: the byte kernel's
tensor-core dots took 0.061-0.065 ms at K = N = 8192 on an H100, where cuBLAS multiplies a plain
bf16 weight, four times the bytes, in 0.060. This kernel
(templates/triton_gemv_int4_mma.py.j2) reads the weight as 32-bit words, makes q - zero of each
weight in registers (eager's first bf16 rounding, two packed bf16 steps per pair of nibbles), and
gives the products to the tensor cores, with the scale applied once per group and row to the
float32 sums, as the group kernel does.

A tensor-core tile covers BLOCK_N output columns, so N / BLOCK_N programs are too few to keep the
memory busy (64 for N = 8192). K is therefore split: SPLIT programs share a block of columns, each
adds up its share of K and writes float32 partial sums, and a second, small kernel adds the SPLIT
partial sums of each output in a fixed order (the same result every run) and runs the epilogue.
The partial sums live in a buffer the launch takes from PyTorch's caching allocator, as an extern
matmul's output does; inside a CUDA graph its address is recorded with the graph.

Where it is used (`mma_fit`): 2 <= M <= 16 on a GPU with bf16 tensor cores (sm_80 and newer) or
under the interpreter, when a group holds whole chunks of 16 words (groups of 128, 256 ...
weights). Otherwise the word kernel (M <= 4) or the byte kernel keeps it, and says why.
"""
from __future__ import annotations

import os

from fusec import env
from fusec.runtime.fast_start.pdl import pdl
from fusec.codegen.triton.text import helpers_in, ops_summary, current_arch
from fusec.ir import Load, Reduce

from .int4_words import Int4Words
from .render import render_template
from .triton_gemv import SMS
from .triton_gemv_int4 import as_int32, bf16_bits, needs_int64, pair_math, row_code

MMA_MIN_M = 2
MMA_MAX_M = 16  # tl.dot's smallest tile side: the M rows are padded to 16
CHUNK_WORDS = 16  # words per row per dot chunk: 128 weights, tl.dot's K = 16 per nibble
# Programs to aim for when splitting K: about 3 per SM of 128 columns, or with up to 8 rows 8 per
# SM of 64 columns. Measured on an H100 (diagnostics/int4_mma_blocks.py,
# docs/small_matmul.md): at M = 16, K = N = 8192, 128 x 8 warps x 396 programs 0.0424-0.0428 ms, 64 x 4 x
# 1056 0.0459-0.0463, without a split 0.095 and slower; at M = 2-8 64 x 4
# x 1056 was 1-10% faster than 128 x 8 x 396 at each of 8192 x 8192, 4096 x 11008, 11008 x 4096
# and 4096 x 4096, and at M = 16 1-8% slower.
TARGET_PROGRAMS = 3 * SMS
FEW_ROWS, FEW_ROWS_TARGET = 8, 8 * SMS
FINISH_BLOCK_N = 64  # output columns per program of the kernel that adds the partial sums
# Not done: loading chunk i + 1's words by hand before multiplying chunk i (as the M = 1 kernels
# do) made it slower on an H100, 0.0427 -> 0.0559 ms at M = 16, and so did Triton's own
# pipelining, num_stages 2-3.


def mma_enabled() -> bool:
    return env.flag("FUSEC_INT4_MMA", True)


def tensor_core_arch(arch: int | None) -> tuple[bool, str]:
    """(has bf16 tensor cores, why not): for sm_<arch>, or the GPU this process compiles for."""
    if arch is None and os.environ.get("TRITON_INTERPRET") == "1":
        return True, ""  # (its tl.dot multiplies in float32, the same exact products)
    arch = current_arch() if arch is None else arch
    if arch is None:
        return False, "no CUDA GPU: the tensor-core kernel is written for NVIDIA's"
    if arch < 80:
        return False, f"sm_{arch} has no bf16 tensor cores (sm_80 and newer do)"
    return True, ""


def mma_fit(kernel, words: Int4Words, arch: int | None = None) -> tuple[bool, str]:
    """(fits, why): whether this int4 GEMV takes the tensor-core kernel, or why not."""
    if not mma_enabled():
        return False, "FUSEC_INT4_MMA=0: the tensor-core kernel is switched off"
    m = kernel.row_shape[0] if len(kernel.row_shape) == 2 else 1
    if not MMA_MIN_M <= m <= MMA_MAX_M:
        return False, f"M = {m}: the tensor-core kernel takes {MMA_MIN_M} to {MMA_MAX_M} rows"
    wpg = words.group // 8
    if wpg % CHUNK_WORDS:
        return False, (f"groups of {words.group} weights: the tensor-core kernel needs chunks of "
                       f"{8 * CHUNK_WORDS} weights within one group")
    ok, why = tensor_core_arch(arch)
    if not ok:
        return False, why
    return True, (f"M = {m} rows ({MMA_MIN_M} to {MMA_MAX_M}): too many products per weight for "
                  "CUDA cores, so tensor-core dots, in groups of whole 128-weight chunks")


def mma_blocks(m: int, n: int, words: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, num_warps, SPLIT, chunks per split, num_stages): 128 columns per program for
    wide layers (a warp per 16 columns), fewer for narrow ones, and 64 for up to FEW_ROWS rows;
    K split into SPLIT shares of whole chunks so that there are about TARGET_PROGRAMS programs
    (FEW_ROWS_TARGET for few rows)."""
    few = m <= FEW_ROWS
    block_n = 128 if n >= 4096 and not few else 64 if n >= 1024 else 32 if n >= 64 else 16
    chunks = words // CHUNK_WORDS
    programs = -(-n // block_n)
    split = max(1, min(chunks, -(-(FEW_ROWS_TARGET if few else TARGET_PROGRAMS) // programs)))
    per = -(-chunks // split)
    return block_n, max(1, block_n // 16), -(-chunks // per), per, 1


def render_gemv_mma(kernel, words: Int4Words, arch: int | None = None, why: str = "") -> str:
    (r,) = [i for i in kernel.body if isinstance(i, Reduce)]
    m, n = kernel.row_shape
    n_rows = 2
    wpg = words.group // 8  # words per group
    block_n, num_warps, split, per, stages = mma_blocks(m, n, words.words)
    asm, pair_note = pair_math(arch)
    overhang = n % block_n != 0

    def address(offset: int, terms: list[str]) -> str:
        return " + ".join(([str(offset)] if offset else []) + terms) or "0"

    def n_term(idx, name: str) -> list[str]:
        st = idx.strides[1]
        return [] if not st else [name if st == 1 else f"{name} * {st}"]

    # the packed weight as word indices (int4_words checked that its rows are whole words):
    # a [BLOCK_N, CHUNK] tile, one row of words per output column
    p = words.packed.index
    word = address(p.offset // 4, [f"n * {p.strides[1] // 4}", "(w_start + w)"])
    n_mask = "(n < N)" if overhang else "0"

    def group_load(g: Load) -> str:
        """The chunk's group value of each column, [BLOCK_N, 1]."""
        st = g.index.strides[n_rows]
        terms = n_term(g.index, "n") + ["g" if st == 1 else f"g * {st}"]
        other = ", mask=n < N, other=0.0" if overhang else ""
        return f"tl.load({g.param}_ptr + {address(g.index.offset, terms)}{other})"

    group = [f"g = w_start // {wpg}  # the chunk's group ({wpg} words each)"]
    if isinstance(words.zero, Load):
        group.append(f"zneg2 = bf16x2({group_load(words.zero)}, True)")
    else:
        bits = bf16_bits(-words.zero)
        group.append(f"zneg2 = tl.full([1, 1], {as_int32(bits | bits << 16)}, tl.int32)  "
                     f"# -{words.zero} as bf16 bits, twice")
    scale = group_load(words.scale)
    fast = group + [f"s = fusec_bf16_to_f32({scale})"]
    exact = group + [f"s2 = bf16x2({scale}, False)"]

    # the activations of nibble t of the chunk's words, x[m, 8w + t], as a [CHUNK, BLOCK_M] tile
    x = words.x_lo.index
    step = words.x_step
    st_m = x.strides[0]

    def x_load(t: str) -> str:
        lanes = f"(8 * (w_start + xw) + {t}) * {step}" if step != 1 else f"8 * (w_start + xw) + {t}"
        terms = [lanes] + ([f"m * {st_m}" if st_m != 1 else "m"] if st_m else [])
        return f"tl.load({words.x_lo.param}_ptr + {address(x.offset, terms)}, mask=m < M, other=0.0)"

    def rows(idx):
        terms = []
        for axis, st in zip(["m", "n"], idx.strides[:n_rows]):
            if st:
                terms.append(axis if st == 1 else f"{axis} * {st}")
        return terms, ["m_mask", "n_mask"]

    row_lines, epilogue, stores, helpers = row_code(kernel, r, rows, address)
    big = needs_int64(kernel)
    helpers |= helpers_in(row_lines + fast + exact + epilogue + stores)
    helpers |= {"fusec_bf16_to_f32", "fusec_dot_bf16_acc"} | \
        (set() if asm else {"fusec_f32_to_bf16"})
    return render_template(
        "triton_gemv_int4_mma.py.j2", words_3d=False, name=kernel.name, summary=ops_summary(kernel), m=m, n=n,
        k=2 * kernel.k, group=words.group, words=words.words, block_n=block_n,
        num_warps=num_warps, split=split, per=per, stages=stages, chunk=CHUNK_WORDS,
        finish_n=FINISH_BLOCK_N, programs=-(-n // block_n) * split, asm=asm, pair_note=pair_note,
        helpers=sorted(helpers), packed=words.packed.param,
        params=[f"{q.name}_ptr" for q in kernel.params], args=[q.name for q in kernel.params],
        n_start="pid_n.to(tl.int64) * BLOCK_N" if big else "pid_n * BLOCK_N",
        row_start="pid.to(tl.int64) * BLOCK_N" if big else "pid * BLOCK_N",
        row_lines=row_lines, group_lines=fast, exact_group_lines=exact, word=word,
        n_mask=n_mask, masked=overhang, x_lo=x_load("t"), x_hi=x_load("t + 4"), epilogue=epilogue, stores=stores,
        why=why, pdl=pdl(arch))

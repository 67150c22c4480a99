"""Triton GEMV: a small-M matmul with its dequantization prologue (extensions/quant_gemv/small_matmul.py) as one
kernel that streams the weight once: the block sizes (`gemv_blocks`, `gemv_blocks_n_major`,
`gemv_dot_blocks`), when tensor-core dots of bf16 tiles are exact (`dot_terms`), and the
renderer (`render_gemv`, templates/triton_gemv.py.j2). triton/reduction.py hands a reduction
here when `gemv_fits`.

Why this file is long: each of the three tile shapes (K lanes, N-major, tensor-core dots) keeps
the measurements that chose it beside its code, and the renderer needs all three.
"""
from __future__ import annotations

import math
import re
from typing import NamedTuple

import torch

from fusec.runtime.fast_start.pdl import pdl
from fusec.codegen.triton.text import (TL, helpers_in, max_address, render_stmt, ops_summary,
                                       convert, gather_offset, piece_mask)
from fusec.ir import Const, Index, Reduce, Stmt, short_dtype as short

from .int4_words import match_int4_words
from .render import render_template


# ---- GEMV: a small-M matmul with its dequantization prologue (extensions/quant_gemv/small_matmul.py) --------
#
# Note (GEMV kernels): the generic reduction template gives each row of the output, here each
# (m, n) pair, its own pass over K, so with M rows the weight is streamed M times. A GEMV keeps
# all M rows of a block of output columns in one program instead: the weight tile is loaded (and
# dequantized) once and multiplied by every activation row while it sits in registers. The
# kernel IR is the same ReductionKernel; only the walk differs, so the CPU backends (which
# already read a row's K elements contiguously) keep their reduction templates.

GEMV_MAX_M = 16  # activation rows kept in registers; extensions/quant_gemv/small_matmul.py stays below this
GEMV_TILE = 8192  # f32 partial sums per program, [BLOCK_M, BLOCK_N, BLOCK_K]: 64 per thread
GEMV_WEIGHT_TILE = 4096  # weight elements per program per iteration, [BLOCK_N, BLOCK_K]


def rows_and_epilogue(kernel, r, lines) -> tuple:
    """The loop plan's one phase (a kernel of one sum over K), the lines of the row values
    computed before the K loop, and the epilogue after it, which starts from the finished sum
    `sums` (rounded as the reduction `r` says). `lines(name)` spells one value."""
    [phase] = kernel.plan.phases
    row_lines = [t for name in kernel.plan.before for t in lines(name)]
    epilogue = [t for name in phase.ready for t in lines(name)]
    value = convert("sums", r.acc_dtype, r.var.dtype)
    if r.round_to is not None:
        value = convert(convert(value, r.var.dtype, r.round_to), r.round_to, r.var.dtype)
    epilogue.insert(0, f"{r.var.name} = {value}  # {r.origin}")
    return phase, row_lines, epilogue


def gemv_fits(kernel) -> bool:
    """A GEMV-shaped reduction: one sum over K, rows (M, N) or (N,) with M small, no element
    values stored (those need the generic walk)."""
    reds = [i for i in kernel.body if isinstance(i, Reduce)]
    # rows (N,) or (M, N); or the output columns in several dims (kernel.matmul_rows: a weight
    # packed along N), each column's coordinates then computed from its position n
    rows_fit = (1 <= len(kernel.row_shape) <= 2 and
                (len(kernel.row_shape) == 1 or kernel.row_shape[0] <= GEMV_MAX_M)) or \
        (kernel.split_columns and kernel.matmul_rows[0] <= GEMV_MAX_M
         and not any(l.other is not None for l in kernel.loads))
    return (kernel.matmul is not None and len(reds) == 1 and reds[0].op == "sum" and rows_fit
            and kernel.k > 0 and kernel.rows > 0 and not kernel.plan.element_stores)


SMS = 132  # streaming multiprocessors of an H100/H200: the grid should cover each at least twice


def gemv_blocks(m: int, n: int, k: int, weight_bytes: int = 1) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps). All M rows in one block; 4 warps. Output columns
    per program: 8 at M = 1, fewer as M grows (the partial sums are M x BLOCK_N x BLOCK_K
    registers), and fewer for narrow layers so that there are about 2 programs per SM (a
    1024-wide key/value projection gets 2 columns per program, 512 programs, rather than 64
    programs that leave half the GPU idle). BLOCK_K: a 4096-element weight tile per iteration
    within the partial-sum budget. Chosen with `benchmarks/quant_linear.py --sweep` (8 x 512 x 4
    warps streamed int8 weights fastest at M = 1; 32 columns per program was the slowest).

    A 16-bit weight (a stored bf16/fp16 one, `weight_bytes` 2) at M = 1 takes one column per
    program, a whole 4096-element row chunk per iteration, and 8 warps (16 elements, two 16-byte
    loads per thread; fewer warps for a shorter K): at every shape of a Llama decode step it
    streamed faster than two columns per program (`benchmarks/decode.py`; current numbers in
    docs/performance.md)."""
    block_m = 1 << max(m - 1, 0).bit_length()
    block_n = min(8 if block_m == 1 else max(2, 16 // block_m),
                  1 << max(n // (2 * SMS), 1).bit_length() - 1)
    block_k = min(max(16, GEMV_WEIGHT_TILE // block_n), max(16, GEMV_TILE // (block_m * block_n)),
                  max(16, 1 << max(k - 1, 0).bit_length()))
    num_warps = 4
    if block_m == 1 and weight_bytes == 2:
        block_n, block_k = 1, min(4096, max(16, 1 << max(k - 1, 0).bit_length()))
        num_warps = max(1, min(8, block_k // 512))
    return block_m, block_n, block_k, num_warps


def n_contiguous(idx: Index, n_rows: int, n_dims: int = 1) -> bool:
    """Whether a weight load's neighbouring columns (n) lie closer in memory than its neighbouring
    K elements: x @ W with W stored (K, N), or GPTQ's qweight (K/8, N) (extensions/quant_gemv/refine_views.py).
    With the columns in several dims (AWQ's words, (N/8, 8)), the closest of them counts."""
    st_n = min([abs(s) for s in idx.strides[n_rows - n_dims:n_rows] if s], default=0)
    st_k = [abs(s) for s in idx.strides[n_rows:] if s]
    return bool(st_n) and bool(st_k) and st_n < min(st_k)


# A weight stored N-contiguous (gemv_blocks_n_major): bytes of each K row of the tile, and bytes
# of weight loaded per tile
N_MAJOR_LINE = 64
N_MAJOR_TILE_BYTES = 8192


def gemv_blocks_n_major(m: int, n: int, k: int, weight_bytes: float = 1) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for a weight stored with N contiguous. The tile is
    turned round: many columns per program, N_MAJOR_LINE bytes of each K row (16 columns of int32
    words, 64 of int8), at most N / SMS of them so that the grid still covers the GPU, and
    N_MAJOR_TILE_BYTES of weight per iteration (also within the partial-sum budget).

    The tile sizes were the fastest of `benchmarks/quant_linear.py --sweep` for GPTQ's packed
    (K/8, N) int32 words (extensions/quant_gemv/refine_views.py) and for an int8 (K, N) weight (32 x 256 int32
    words spill registers). At M > 1 (the partial sums then
    cap BLOCK_K), twice the columns: GPTQ's words at M = 4 0.101 ms with 32 x 64 against 0.124
    with 16 x 128 (torch.compile 0.099). The blocks of `gemv_blocks`
    (8 x 512) read 8 neighbouring elements of each of 512 rows, a quarter line each: 0.016 TB/s
    for GPTQ's words. At M > 1 a plain (K, N) weight keeps the tensor-core dots (int8 at M = 4:
    0.75 TB/s against 0.47 with these blocks), but one whose K is cut in several dims (GPTQ's,
    extensions/quant_gemv/refine_views.py) takes these blocks: its dots' operand tiles asked Triton for more
    shared memory than an SM has (313 KB at M = 4, K = N = 8192), and the launch failed."""
    block_m = 1 << max(m - 1, 0).bit_length()
    spread = 1 << max(n // SMS, 1).bit_length() - 1
    line = N_MAJOR_LINE * (2 if block_m > 1 else 1)  # M > 1: each tile serves M rows, take more columns
    block_n = max(2, min(max(1, int(line // weight_bytes)), spread, 1 << max(n - 1, 0).bit_length()))
    block_k = min(max(16, int(N_MAJOR_TILE_BYTES // (weight_bytes * block_n))),
                  max(16, GEMV_TILE // (block_m * block_n)), max(16, 1 << max(k - 1, 0).bit_length()))
    return block_m, block_n, block_k, 4


def gemv_dot_blocks(m: int, n: int, k: int, terms: int = 1) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the tensor-core GEMV (M > 1).
    tl.dot needs every dim >= 16, so the M rows are padded to 16 (the padding rows cost tensor-core
    time, which a weight-streaming kernel has plenty of). A 32 x 256 weight tile per iteration:
    BLOCK_K counts stored elements, so a packed int4 byte (two dots, `terms` = 2) gets 128. 16
    columns per program when 32 would leave SMs idle. The fastest of `benchmarks/quant_linear.py
    --sweep` at M = 4 and 16 (docs/performance.md has the current numbers)."""
    block_m = max(16, 1 << max(m - 1, 0).bit_length())
    block_n = 64 if n >= 58 * SMS else 32 if n >= 32 * SMS else 16
    block_k = max(16, min(256 // terms, 1 << max(k - 1, 0).bit_length()))
    return block_m, block_n, block_k, 8 if terms > 1 and block_n == 64 else 4, 3


GEMV_STAGES = 3  # software-pipelining depth of the lane version's K loop (Triton's default)
# The lane version's loads do not feed a tl.dot, and Triton does not pipeline them (GEMV_STAGES
# changed nothing): the kernel prefetches by hand, loading chunk i + 1 before multiplying chunk i.
# That speeds up bf16 and packed int4 weights and slows a plain int8 one (one byte, nothing to
# unpack), which is streamed without it (diagnostics/gemv_variants.py compares them).
# The weight's loads carry eviction_policy="evict_first": it is read once.
GEMV_PREFETCH = True
GEMV_PAIRS = True  # neighbouring activations loaded as pairs (paired_loads)
GEMV_DOT_MIN_M = 2  # from this many rows on, tensor-core dots (benchmarks/quant_linear.py --sweep)
BF16_EXACT_INTS = (torch.int8, torch.uint8)  # every value of these is a bf16 number


def paired_loads(loads, n_rows: int) -> dict[str, str]:
    """{first: second} for two loads of neighbouring elements, x[2j] and x[2j + 1] (the activations
    of a packed int4 weight's low and high nibbles): one load of the pairs, split in registers,
    reads them with wide loads instead of two loads of every other element."""
    pairs = {}
    for a in loads if GEMV_PAIRS else []:
        for b in loads:
            ka = a.index.strides[n_rows:]
            if (a.param == b.param and a.dtype == b.dtype and a.index.strides == b.index.strides
                    and a.gather is None and b.gather is None
                    and b.index.offset == a.index.offset + 1 and ka and ka[-1] == 2
                    and a.var.name not in pairs.values() and b.var.name not in pairs):
                pairs[a.var.name] = b.var.name
    return pairs


def dot_terms(kernel, operand: str, producers: dict, axes_of_rows: str) -> list[tuple[str, str]] | None:
    """The reduction's operand as a sum of products x * w, with x varying along (m, k) only and
    w along (n, k) only, both exactly bf16 numbers: then a tensor-core dot of bf16 tiles with a
    float32 accumulator computes exactly the products the lanes version adds (bf16 x bf16 fits
    a float32 mantissa), in another order. None when the operand has another form.
    `axes_of_rows`: the axis of each row dim, "mn", or "mnn" for columns in two dims."""
    axes_of: dict[str, frozenset] = {}
    n_rows = len(axes_of_rows)

    def axes(name: str) -> frozenset:
        if name not in axes_of:
            item = producers[name]
            if isinstance(item, Stmt):
                out = frozenset().union(*[axes(o.name) for o in item.operands
                                          if not isinstance(o, Const)])
            else:
                st = item.index.strides
                out = frozenset(ax for ax, s in zip(axes_of_rows, st[:n_rows]) if s)
                out |= {"k"} if any(st[n_rows:]) else frozenset()
                out |= axes(item.gather[0]) if item.gather else frozenset()
            axes_of[name] = out
        return axes_of[name]

    def exact(name: str) -> bool:
        item = producers[name]
        if not isinstance(item, Stmt):
            return item.dtype == torch.bfloat16 or item.dtype in BF16_EXACT_INTS
        if item.round_to == torch.bfloat16 or item.var.dtype in (torch.bfloat16, *BF16_EXACT_INTS):
            return True
        return item.op in ("to", "copy") and not isinstance(item.operands[0], Const) \
            and exact(item.operands[0].name)

    def terms(name: str):
        item = producers[name]
        if not isinstance(item, Stmt) or any(isinstance(o, Const) for o in item.operands):
            return None
        if item.op == "add":
            a, b = (terms(o.name) for o in item.operands)
            return None if a is None or b is None else a + b
        if item.op != "mul":
            return None
        a, b = (o.name for o in item.operands)
        x_axes = frozenset("mk") if "m" in axes_of_rows else frozenset("k")
        if axes(b) <= x_axes and "n" in axes(a):
            a, b = b, a
        if not (axes(a) <= x_axes and axes(b) <= frozenset("nk") and exact(a) and exact(b)):
            return None
        return [(a, b)]

    return terms(operand)


def k_terms(strides: tuple[int, ...], k_shape: tuple[int, ...]) -> list[str]:
    """Address terms along K. A tensor whose K dims are back to back in memory (the packed
    weight, viewed as (K/G, G/2) groups) is addressed by the flat `ks` itself, so Triton sees
    consecutive addresses and emits wide vector loads; others (a per-group scale) by coordinates.
    """
    whole = all(strides[d] == strides[d + 1] * k_shape[d + 1] for d in range(len(k_shape) - 1))
    if whole and strides[-1]:
        return ["ks" if strides[-1] == 1 else f"ks * {strides[-1]}"]
    return [f"k{d}" if st == 1 else f"k{d} * {st}" for d, st in enumerate(strides) if st]


def big_addresses(kernel) -> bool:
    """Whether some address of the kernel needs 64 bits."""
    return max([kernel.numel] + [max_address(a.index, kernel.row_shape + kernel.k_shape)
                                 for a in [*kernel.loads, *kernel.stores]]) >= 2 ** 31 - 1


def column_coords(cols: tuple, block_n: int, words: bool, big: bool) -> list[str]:
    """The lines that give each of a program's output columns its coordinates, when the columns
    are several dims (a weight packed along N, `ReductionKernel.matmul_rows`): n0, n1, ...

    AWQ's columns are (N/8, 8): the 8 columns of an int32 word share it. Loaded per column, every
    word would be loaded 8 times, 8 load instructions where one does. With `words`, the program's
    BLOCK_N / 8 words get coordinates of their own, `nw`: each is loaded once and repeated over
    its 8 columns in registers (the `is_word` loads of `_Gemv`); with the 32-bit shifts of
    passes/simplify.py, a smaller AWQ layer gets faster, a large one stays bound by arithmetic."""
    lines = [f"# the output columns as ({', '.join(map(str, cols))}): each column's coordinates"]
    for d in range(len(cols)):
        below = math.prod(cols[d + 1:])
        lines.append(f"n{d} = " + (f"(n // {below})" if below > 1 else "n")
                     + (f" % {cols[d]}" if d else ""))
    if words:
        pid = "pid.to(tl.int64)" if big else "pid"
        lines += [f"# the words: each holds {cols[-1]} neighbouring columns, loaded once",
                  f"nw = {pid} * (BLOCK_N // {cols[-1]}) + tl.arange(0, BLOCK_N // {cols[-1]})"
                  "[None, :, None]", f"nw_mask = nw < {cols[0]}"]
    return lines


def render_gemv(kernel, why_not_words: str = "", arch: int | None = None) -> str:  # (why not words)
    """The GEMV kernel's source (templates/triton_gemv.py.j2): the plan (`_Gemv`), the row
    values and epilogue, the K loop's lines, the tensor-core dots, the stores."""
    g = _Gemv(kernel)
    r = g.r
    phase, row_lines, epilogue = rows_and_epilogue(kernel, r, g.lines)
    if len(g.cols) > 1:
        row_lines = column_coords(g.cols, g.block_n, any(g.is_word(l) for l in kernel.loads),
                                  big_addresses(kernel)) + row_lines
    loop = _loop_lines(g, phase)
    operand = convert(r.operand.name, r.operand.dtype, r.acc_dtype)
    dot_lines = _dot_lines(g)
    stores = _store_lines(g)
    # the weight: what varies along n and k but not m
    weights = sorted({short(l.dtype) for l in kernel.loads if g.is_weight(l)})
    big = big_addresses(kernel)
    programs = -(-g.n // g.block_n)
    helpers = g.helpers | helpers_in(row_lines + loop.first + loop.lines + epilogue + stores)
    return render_template(
        "triton_gemv.py.j2", name=kernel.name, summary=ops_summary(kernel), m=g.m, n=g.n,
        k=kernel.k, block_m=g.block_m, block_n=g.block_n, block_k=g.block_k,
        num_warps=g.num_warps, programs=programs, num_stages=g.num_stages, dot_lines=dot_lines,
        weight_dtypes=", ".join(weights) or "as stored",
        unpack_note=(" (unpacking the int4 nibbles byte by byte, not as 32-bit words: "
                     f"{why_not_words or match_int4_words(kernel)[1]})") if loop.unpack else "",
        acc_dtype=short(r.acc_dtype), acc_tl=TL[r.acc_dtype],
        n_start="pid.to(tl.int64) * BLOCK_N" if big else "pid * BLOCK_N",
        helpers=sorted(helpers), params=[f"{p.name}_ptr" for p in kernel.params],
        args=[p.name for p in kernel.params], row_lines=row_lines,
        loop_lines=loop.lines, first_lines=loop.first, rotate_lines=loop.rotate,
        even_k=g.even_k, operand=operand, epilogue=epilogue, stores=stores, pdl=pdl(arch))


class _Gemv:
    """One GEMV kernel's plan, read off its ReductionKernel: M and N (N perhaps in several dims,
    `cols`), the names of the row axes, the streamed weight, tensor-core dots or not, the block
    sizes; and how each value of a chunk of K is loaded (`load`). `helpers` gathers the Triton
    helper functions the lines call."""

    def __init__(self, kernel):
        self.kernel = kernel
        (self.r,) = [i for i in kernel.body if isinstance(i, Reduce)]
        if kernel.split_columns:  # the output columns in several dims (a weight packed along N)
            m, cols = kernel.matmul_rows
            two, n = len(kernel.row_shape) > len(cols), math.prod(cols)
        else:
            two = len(kernel.row_shape) == 2
            m, n = (kernel.row_shape if two else (1, kernel.row_shape[0]))
            cols = (n,)
        self.m, self.n, self.cols, self.two = m, n, cols, two
        self.producers = {l.var.name: l for l in kernel.loads}
        self.producers.update((item.var.name, item) for item in kernel.body)
        self.n_rows = len(kernel.row_shape)
        # the axis of each row dim: m, n, or the parts of n (n0 = n // 8, n1 = n % 8 for (N/8, 8))
        n_axes = ["n"] if len(cols) == 1 else [f"n{d}" for d in range(len(cols))]
        self.row_axes = (["m"] if two else []) + n_axes
        self.weight_bytes = {self.column_bytes(l) for l in kernel.loads if self.is_weight(l)}
        self.dot = self._blocks()
        # K a multiple of BLOCK_K: every chunk is whole, and no lane needs a mask along K
        self.even_k = kernel.k % self.block_k == 0
        self.group = kernel.k_shape[-1] if len(kernel.k_shape) == 2 else 0
        self.pairs = paired_loads(kernel.loads, self.n_rows)
        # Sibling weights (extensions/quant_gemv/sibling_gemvs.py) are pieces of a cat along n. The first piece's
        # load reads them all: each column's address is picked from the piece that holds it, so the
        # kernel issues one load per chunk, as for one weight (three masked loads were slower).
        self.later_pieces = {l.other.name for l in kernel.loads if l.other is not None}
        self.helpers: set = set()

    def _blocks(self) -> list[tuple[str, str]] | None:
        """Choose the tile shape and its block sizes (set on self); returns the dot terms when
        the products run as tensor-core dots, else None."""
        kernel, m, n, cols = self.kernel, self.m, self.n, self.cols
        n_rows, weight_bytes = self.n_rows, self.weight_bytes
        n_major = any(self.is_weight(l) and n_contiguous(l.index, n_rows, len(cols))
                      for l in kernel.loads)
        # M > 1: the products as tensor-core dots, when the operand is a sum of exact bf16 products
        # (not for a weight stored N-contiguous with K cut in several dims: see gemv_blocks_n_major)
        dot = dot_terms(kernel, self.r.operand.name, self.producers,
                        "".join(a[0] for a in self.row_axes)) \
            if self.two and m >= GEMV_DOT_MIN_M and not (n_major and len(kernel.k_shape) > 1) else None
        if dot:
            block_m, block_n, block_k, num_warps, num_stages = gemv_dot_blocks(m, n, kernel.k, len(dot))
        elif n_major:
            (block_m, block_n, block_k, num_warps), num_stages = gemv_blocks_n_major(
                m, n, kernel.k, weight_bytes=max(weight_bytes, default=1)), GEMV_STAGES
        else:
            (block_m, block_n, block_k, num_warps), num_stages = gemv_blocks(
                m, n, kernel.k, weight_bytes=max(weight_bytes, default=1)), GEMV_STAGES
        self.block_m, self.block_n, self.block_k = block_m, block_n, block_k
        self.num_warps, self.num_stages = num_warps, num_stages
        return dot

    def along_n(self, idx: Index) -> bool:
        return any(idx.strides[self.n_rows - len(self.cols):self.n_rows])

    def is_weight(self, l) -> bool:
        """The streamed operand: it varies along n (and k) but not along m."""
        return (l.var.name in self.kernel.varying and self.along_n(l.index)
                and not (self.two and l.index.strides[0]))

    def column_bytes(self, l) -> float:
        """Bytes of the weight per output column: an int32 word holding eight columns' nibbles
        is half a byte per column."""
        st = l.index.strides[self.n_rows - len(self.cols):self.n_rows]
        return l.dtype.itemsize * math.prod(c for c, s in zip(self.cols, st) if s) / self.n

    def k_coords(self, sfx: str = "") -> list[str]:
        """The chunk's coordinates in each dim of K, from its flat positions `ks`."""
        k_shape = self.kernel.k_shape
        out = []
        for d in range(len(k_shape)):
            below = math.prod(k_shape[d + 1:])
            expr = f"ks{sfx}" if below == 1 else f"(ks{sfx} // {below})"
            out.append(f"k{d}{sfx} = {expr}" + ("" if d == 0 else f" % {k_shape[d]}"))
        return out

    def index(self, idx: Index, sfx: str = "", axes=None) -> tuple[str, list[str]]:
        """The address and masks of a load or store; sfx "_next": the next chunk's (prefetch),
        whose last mask is the scalar `has_next`. `axes`: other names for the row axes (a
        word load's `nw`)."""
        n_rows = self.n_rows
        terms, masks = [], []
        for axis, st in zip(axes or self.row_axes, idx.strides[:n_rows]):
            if st:
                terms.append(axis if st == 1 else f"{axis} * {st}")
                mask = "nw_mask" if axis == "nw" else f"{axis[0]}_mask"
                masks += [] if mask in masks else [mask]
        kterms = [re.sub(r"\b(ks|k\d+)\b", rf"\g<1>{sfx}", t)
                  for t in k_terms(idx.strides[n_rows:], self.kernel.k_shape)]
        if kterms and not self.even_k:
            masks.append(f"k_mask{sfx}")
        if sfx and kterms:
            masks.append("has_next")
        terms += kterms
        if not terms:
            terms = ["tl.zeros([1, 1, 1], tl.int32)"]  # one element, the same for every lane
        addr = " + ".join(([str(idx.offset)] if idx.offset else []) + terms)
        return addr, masks

    def per_group(self, idx: Index) -> bool:
        """A value constant within each group of K (a per-group scale or zero point: it varies
        along the group dim k0 only), when the chunk holds whole groups."""
        ks_ = idx.strides[self.n_rows:]
        return bool(self.group > 1 and len(ks_) == 2 and ks_[0] and not ks_[1]
                    and self.block_k % self.group == 0)

    def is_word(self, l) -> bool:
        """A load of words that each hold several neighbouring columns (AWQ's int32 of eight
        nibbles): it varies along the outer column dim, not the inner one."""
        cols, n_rows = self.cols, self.n_rows
        return (len(cols) == 2 and self.block_n % cols[-1] == 0 and l.gather is None and l.other is None
                and not l.index.strides[n_rows - 1] and bool(l.index.strides[n_rows - 2]))

    def load(self, l, sfx: str = ""):
        """(raw name, the tl.load of one chunk, finish): finish(e) is the lines that make the
        kernel's value(s) from the loaded e (convert to float, repeat a group's value over its
        lanes, split a pair). Apart so that a prefetched chunk is converted only when it is used.
        None for the second of a pair (loaded with the first)."""
        if l.var.name in self.pairs.values() or l.var.name in self.later_pieces:
            return None
        if l.var.name in self.kernel.varying and self.per_group(l.index):
            return self._group_load(l, sfx)
        if self.is_word(l):
            return self._word_load(l, sfx)
        return self._plain_load(l, sfx)

    def _group_load(self, l, sfx: str):
        """A per-group value: one load per group of the chunk, each value then repeated over
        its group's lanes."""
        name, as_float, group = l.var.name, self._as_float(l), self.group
        addr, mask = self.group_address(l, sfx)
        lead = ["BLOCK_M" if self.two and l.index.strides[0] else "1",
                "BLOCK_N" if self.along_n(l.index) else "1"]
        return name + "_raw", f"tl.load({l.param}_ptr + {addr}" + (
            f", mask={' & '.join(mask)})" if mask else ")"), lambda e: [
            f"{name} = tl.reshape(tl.broadcast_to(({as_float(e)})[:, :, :, None], "
            f"[{lead[0]}, {lead[1]}, BLOCK_K // {group}, {group}]), "
            f"[{lead[0]}, {lead[1]}, BLOCK_K])"]

    def _word_load(self, l, sfx: str):
        """A word holding several columns: one load per word, repeated over the columns it
        holds in registers."""
        name, as_float, cols, n_rows = l.var.name, self._as_float(l), self.cols, self.n_rows
        addr, mask = self.index(l.index, sfx, axes=self.row_axes[:-2] + ["nw", "n1"])
        lead = ["BLOCK_M" if self.two and l.index.strides[0] else "1",
                "BLOCK_K" if any(l.index.strides[n_rows:]) else "1"]
        hint = ', eviction_policy="evict_first"' if not self.dot and any(l.index.strides[n_rows:]) else ""
        return name + "_raw", f"tl.load({l.param}_ptr + {addr}" + (
            f", mask={' & '.join(mask)}" if mask else "") + hint + ")", lambda e: [
            f"{name} = tl.reshape(tl.broadcast_to(({as_float(e)})[:, :, None, :], "
            f"[{lead[0]}, BLOCK_N // {cols[-1]}, {cols[-1]}, {lead[1]}]), "
            f"[{lead[0]}, BLOCK_N, {lead[1]}])"]

    def _plain_load(self, l, sfx: str):
        """Any other load: gathered, picked from sibling pieces, a pair of neighbours, or one
        value per lane."""
        name, as_float = l.var.name, self._as_float(l)
        addr, mask = self.index(l.index, sfx)
        if l.gather is not None:  # a gathered read: the row its index value names
            addr = f"{addr} + {gather_offset(l)}"
        if l.other is not None:
            chain = [l]
            while chain[-1].other is not None:
                chain.append(self.producers[chain[-1].other.name])
            addr = f"{chain[-1].param}_ptr + {self.index(chain[-1].index, sfx)[0]}"
            for p in reversed(chain[:-1]):
                addr = (f"tl.where({piece_mask(p, self.kernel.row_shape, self.row_axes)}, "
                        f"{p.param}_ptr + {self.index(p.index, sfx)[0]}, {addr})")
        if l.var.name in self.pairs:
            # two neighbours (x[2j], x[2j + 1]): one load of the pairs, split in registers
            other = self.pairs[name]
            lanes = [t for t in mask if t != "has_next"]
            mask = ([f"({' & '.join(lanes)})[:, :, :, None]"] if lanes else []) + mask[len(lanes):]
            return name + "_pair", (f"tl.load({l.param}_ptr + ({addr})[:, :, :, None] + "
                                    "tl.arange(0, 2)[None, None, None, :]"
                                    + (f", mask={' & '.join(mask)})" if mask else ")")), lambda e: [
                f"{name}, {other} = tl.split({e})"] + [
                f"{v} = {as_float(v)}" for v in (name, other) if l.dtype != l.var.dtype]
        hint = ""
        if not self.dot and self.is_weight(l) and any(l.index.strides[self.n_rows:]):
            # the weight is read once: ask the cache to evict it first, keeping the activations
            hint = ', eviction_policy="evict_first"'
        return name + "_raw", f"tl.load({'' if l.other else l.param + '_ptr + '}{addr}" + (
            f", mask={' & '.join(mask)}" if mask else "") + hint + ")", lambda e: [
            f"{name} = {as_float(e)}"]

    @staticmethod
    def _as_float(l):
        """e converted from the load's stored dtype to the kernel's (nothing if the same)."""
        return lambda e: convert(e, l.dtype, l.var.dtype) if l.dtype != l.var.dtype else e

    def group_address(self, l, sfx: str = "") -> tuple[str, list[str]]:
        """The address and masks of a per-group load: one per group of the chunk."""
        n_rows = self.n_rows
        terms, masks = [], [] if self.even_k else [f"g_mask{sfx}"]
        for axis, st in zip(self.row_axes, l.index.strides[:n_rows]):
            if st:
                terms.append(axis if st == 1 else f"{axis} * {st}")
                masks += [] if f"{axis[0]}_mask" in masks else [f"{axis[0]}_mask"]
        if sfx:
            masks.append("has_next")
        st = l.index.strides[n_rows]
        terms.append(f"gs{sfx}" if st == 1 else f"gs{sfx} * {st}")
        addr = " + ".join(([str(l.index.offset)] if l.index.offset else []) + terms)
        return addr, masks

    def lines(self, name: str) -> list[str]:
        """The lines that compute one value: a statement, or a load of one chunk."""
        item = self.producers[name]
        if isinstance(item, Stmt):
            return [render_stmt(item, self.helpers, block="[1, 1, 1]")]
        got = self.load(item)
        return [] if got is None else got[2](got[1])

    def chunk_loads(self, loads: list[str], sfx: str = "", start: str = "k_start",
                    raw: bool = False) -> list[str]:
        """The lines that load one chunk of K: its coordinates, its groups, its values (raw: the
        loaded values as they are stored, into `<name>_raw<sfx>`, for a prefetch)."""
        got = [g for g in (self.load(self.producers[n], sfx) for n in loads) if g is not None]
        body = ([f"{g[0]}{sfx} = {g[1]}" for g in got] if raw
                else [t for g in got for t in g[2](g[1])])
        out = [c for c in self.k_coords(sfx) if re.search(rf"\b{c.split(' ')[0]}\b", "\n".join(body))]
        if any(f"gs{sfx}" in t for t in body):
            group = self.group
            out += [f"gs{sfx} = {start} // {group} + tl.arange(0, BLOCK_K // {group})[None, None, :]"]
            out += [] if self.even_k else [f"g_mask{sfx} = gs{sfx} < {self.kernel.k_shape[0]}"]
        return out + body


class _Loop(NamedTuple):
    """The K loop's lines: `first` (chunk 0's loads, before the loop, when prefetching), the
    loop body `lines`, `rotate` (the next chunk's values become this one's), and whether the
    prologue unpacks int4 nibbles."""
    first: list[str]
    lines: list[str]
    rotate: list[str]
    unpack: bool


def _loop_lines(g: _Gemv, phase) -> _Loop:
    """The K loop: load a chunk of each value the products need, dequantize the weight tile,
    multiply; with the prefetch, the next chunk's loads issued before this chunk's math."""
    kernel, producers, dot = g.kernel, g.producers, g.dot
    # the tensor-core form multiplies the activation and the weight tiles itself: what they need
    needed = kernel.values_needed({name for pair in dot for name in pair}) if dot else phase.loop
    loads = [n for n in needed if not isinstance(producers[n], Stmt)]
    stmts = [n for n in needed if isinstance(producers[n], Stmt)]
    loop_lines = ["# load this chunk of K: each value with the extent it varies along"]
    loop_lines += g.chunk_loads(loads)
    if any(l.startswith("gs =") for l in loop_lines):
        loop_lines.insert(0, f"# the groups of {g.group} along K in this chunk: their scales and "
                          "zero points are loaded once each")
    unpack = any(producers[n].op in ("rshift", "bitwise_and") for n in stmts)
    compute = ["# prologue: dequantize the weight tile in registers, then multiply"]
    if unpack:
        compute.append("# (this is where the int4 nibbles are unpacked: a shift brings each "
                       "4-bit weight to the bottom of its byte or word, & 0x0F keeps it)")
    compute += [t for n in stmts for t in g.lines(n)]
    # the weight's stored element size: a plain int8 weight streamed slower with the prefetch
    # (not with a gathered read: its row comes from a value loaded in the same chunk)
    prefetch = GEMV_PREFETCH and not dot and (unpack or min(g.weight_bytes, default=2) >= 2) \
        and not any(l.gather for l in kernel.loads)
    first, rotate = [], []
    if prefetch:
        # chunk 0 before the loop; in the loop, the next chunk's loads first, then this chunk's
        # math on the values loaded one iteration earlier, converted only now
        got = [t for t in (g.load(producers[n]) for n in loads) if t is not None]
        first = g.chunk_loads(loads, start="0", raw=True)
        loop_lines = ["# prefetch: issue the next chunk's loads now, so that they are in flight "
                      "while this chunk is multiplied", "has_next = k_start + BLOCK_K < n_k",
                      "ks_next = ks + BLOCK_K"] + ([] if g.even_k else ["k_mask_next = ks_next < n_k"])
        loop_lines += g.chunk_loads(loads, "_next", "(k_start + BLOCK_K)", raw=True)
        loop_lines += ["# this chunk's values, loaded one iteration earlier"]
        loop_lines += [t for got_ in got for t in got_[2](got_[0])]
        rotate = [f"{v} = {v}_next" for v in ["ks", *(got_[0] for got_ in got)]]
    return _Loop(first, loop_lines + compute, rotate, unpack)


def _dot_lines(g: _Gemv) -> list[str]:
    """The tensor-core form: each product term's activation and weight tiles as bf16 dots
    added into the accumulator (none without dots)."""
    dot_lines = []
    for i, (x, w) in enumerate(g.dot or []):
        if not g.even_k:  # the lanes past K's end: zeros, so that they add nothing
            x, w = f"tl.where(k_mask, {x}, 0.0)", f"tl.where(k_mask, {w}, 0.0)"
        dot_lines += [
            f"x_tile{i} = tl.reshape(tl.broadcast_to({x}, [BLOCK_M, 1, BLOCK_K]), [BLOCK_M, BLOCK_K])",
            f"w_tile{i} = tl.reshape(tl.broadcast_to({w}, [1, BLOCK_N, BLOCK_K]), [BLOCK_N, BLOCK_K])",
            f"acc += fusec_dot_bf16(x_tile{i}, w_tile{i})"]
    g.helpers |= {"fusec_dot_bf16"} if g.dot else set()
    return dot_lines


def _store_lines(g: _Gemv) -> list[str]:
    """The output stores, each converted to its stored dtype and masked at the edges."""
    stores = []
    for s in g.kernel.stores:
        addr, mask = g.index(s.index)
        stores.append(f"tl.store({s.param}_ptr + {addr}, {convert(s.var.name, s.var.dtype, s.dtype)}"
                      + (f", mask={' & '.join(mask)})" if mask else ")"))
    return stores

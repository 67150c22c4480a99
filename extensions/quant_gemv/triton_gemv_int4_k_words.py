"""Triton GEMV chunk for int4 weights packed eight to a word along K with N contiguous (GPTQ's
layout), one activation row, dequantized once per group (extensions/quant_gemv/int4_k_words.py recognises it).

The generic GEMV (extensions/quant_gemv/triton_gemv.py, `gemv_blocks_n_major`) dequantized each of these
weights with the IR's own statements (shift, mask, subtract, convert, multiply, round, widen) and
read GPTQ's words at 0.57 TB/s on an H200 at K = N = 8192. This kernel takes the
sum apart per group as the packed-int4 group kernel does (extensions/quant_gemv/triton_gemv_int4_groups.py):
a word's eight nibbles are eight rows of K of one column, so per word it is four unpacking steps
and eight FMAs into that column's sum, and the zero point and scale come once per group. Its lanes
lie along N, COLUMNS_PER_LANE neighbouring columns each, so a warp reads 32 x 16 contiguous bytes
of every word row; a program takes one chunk of K (passes/split_reductions.py cuts it, and a
second kernel adds the chunks' partial sums), so that there are programs for every SM.
"""
from __future__ import annotations

import torch

from fusec.runtime.fast_start.pdl import pdl
from fusec.codegen.triton.text import helpers_in, max_address, render_stmt, ops_summary, convert, gather_offset
from fusec.ir import Load, Reduce, Stmt

from .int4_k_words import Int4KWords
from .render import render_template
from .triton_gemv_int4 import pair_math
from .triton_gemv_int4_columns import computed_lines, strided

COLUMNS_PER_LANE = 4  # neighbouring columns of a lane: one 16-byte load per word row
ROWS_PER_STEP = 4  # word rows loaded a step (32 rows of K), and as many prefetched


def k_words_fit(kernel, kw: Int4KWords) -> tuple[bool, str]:
    """(fits, why): whether the chunk kernel renders this GEMV chunk."""
    shape = kernel.row_shape + kernel.k_shape
    if max([max_address(a.index, shape) for a in [*kernel.loads, *kernel.stores]]) >= 2 ** 31 - 1:
        return False, "addresses past 2^31 elements (the chunk kernel computes them in 32 bits)"
    return True, ""


def render_gemv_k_words(kernel, kw: Int4KWords, arch: int | None = None) -> str:
    (r,) = [i for i in kernel.body if isinstance(i, Reduce)]
    rows = kw.group // 8  # word rows per group
    step = max(d for d in (1, 2, 4, 8) if d <= ROWS_PER_STEP and rows % d == 0)
    npl = COLUMNS_PER_LANE
    wn = min(32 * npl, max(npl, 1 << max(kw.n - 1, 0).bit_length()))
    lanes = wn // npl
    n_k = len(kernel.k_shape)

    def at(load, chunk: str, n: str, gi: str, kr: str, t: str) -> str:
        """`load`'s address from its strides over (chunk, column, [group of the chunk,] word row
        of the group, nibble)."""
        return strided(load, [chunk, n] + ([gi, kr] if n_k == 3 else [f"{gi} * {rows} + {kr}"]) + [t])

    producers = {l.var.name: l for l in kernel.loads}
    producers.update((item.var.name, item) for item in kernel.body)
    helpers: set = set()
    ragged = kw.n % wn != 0
    n_mask = "mask=nmask, other=0, " if ragged else ""
    words_mask = "mask=nmask[None, :], other=0, " if ragged else ""

    def computed(names, block: str, coords: tuple) -> list[str]:
        return computed_lines(names, producers, helpers, block, lambda l: at(l, *coords))

    def group_value(load: Load | int | None) -> str:
        if not isinstance(load, Load):
            return f"tl.full([WN], {float(load or 0)!r}, tl.float32)  # the zero point is a constant"
        # (read through g_idx: the row of the group this is, which `grouped` checks)
        row = f" + (chunk * {kw.groups} + gi) * {load.gather[1]}" if load.gather else ""
        value = f"tl.load({at(load, 'chunk', 'n', 'gi', '0', '0')}{row}, {n_mask}eviction_policy='evict_last')"
        return convert(value, load.dtype, torch.float32)

    # the activations of nibble t of the step's word rows, [R, 1]: loaded, or computed from loads
    # that are the same for every column
    x_lines = computed(kw.x, "[R, 1]", ("chunk", "0", "gi", "(kr + tl.arange(0, R))[:, None]", "t"))
    # the exact path: every load as a [WN] tile of one row of K, then the IR's statements
    exact_loads = []
    for load in sorted(kernel.loads, key=lambda l: l.gather is not None):  # (index values first)
        where = at(load, "chunk", "n", "gi", "kr", "t")
        if load.gather is not None:
            where += f" + {gather_offset(load)}"
        value = f"tl.load({where} + lane0, mask=nmask, other=0)" if ragged \
            else f"tl.load({where} + lane0)"
        exact_loads.append(f"{load.var.name} = {convert(value, load.dtype, load.var.dtype)}")
    exact_lines = [render_stmt(s, helpers, block="[WN]") for s in kernel.body if isinstance(s, Stmt)]
    # g_idx of the group's rows, [G / 8, 8], when zero point and scale are read through it
    g_idx = kw.g_idx and "tl.load(%s)" % at(kw.g_idx, "chunk", "0", "gi", f"tl.arange(0, {rows})[:, None]",
                                          "tl.arange(0, 8)[None, :]")
    (store,) = kernel.stores
    shift_lines = computed(kw.shifts, "[8]", ("0", "0", "0", "0", "t8"))
    lines = exact_loads + exact_lines + shift_lines + x_lines
    asm = pair_math(arch)[0]  # nibble_pairs as one PTX lop3 (int4_helpers.j2)
    helpers |= helpers_in(lines) | ({"fusec_bf16_to_f32"} | (set() if asm else {"fusec_f32_to_bf16"}))
    params = [f"{q.name}_ptr" for q in kernel.params]
    words = kw.words
    return render_template(
        "triton_gemv_int4_k_words.py.j2", name=kernel.name, summary=ops_summary(kernel),
        group=kw.group, groups=kw.groups, chunks=kw.chunks, n=kw.n, wn=wn, npl=npl, lanes=lanes,
        r=step, rows=rows, half=str(kw.half).replace("torch.", ""),
        half_max=torch.finfo(kw.half).max, asm=asm, words_3d=False, programs=-(-kw.n // wn) * kw.chunks, pdl=pdl(arch),
        helpers=sorted(helpers), params=params, args=[q.name for q in kernel.params],
        shift_lines=shift_lines, shift=kw.shifts[-1],
        words_at=lambda kc: at(words, "chunk", "n[None, :]", "0", kc, "0"),
        words_mask=words_mask, n_mask=n_mask, x_lines=x_lines, x_var=kw.x_var,
        zero=group_value(kw.zero), scale=group_value(kw.scale),
        exact_loads=exact_loads, exact_lines=exact_lines, product=r.operand.name,
        store_at=at(store, "chunk", "n", "0", "0", "0"), g_idx=g_idx)

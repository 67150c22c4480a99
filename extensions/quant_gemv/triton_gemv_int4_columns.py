"""Triton GEMV chunk for int4 weights packed eight to a word along N (AWQ's layout), one
activation row, dequantized once per group (extensions/quant_gemv/int4_columns.py recognises it).

The generic GEMV (extensions/quant_gemv/triton_gemv.py) dequantized each of these weights with the IR's own
statements: shift, narrow, mask, subtract, multiply, round, widen, about 18 SASS instructions per
weight on sm_90, and 0.40-0.47 TB/s on an H200 at K = N = 8192. This kernel takes
the sum apart per group as the packed-int4 group kernel does (extensions/quant_gemv/triton_gemv_int4_groups.py):
about 3 instructions per weight. Its lanes lie along N, one word column each, so a warp reads 128
contiguous bytes of every row of K; a program takes one chunk of K (passes/split_reductions.py
cuts it, and a second kernel adds the chunks' partial sums), so that there are programs for
every SM.

Measured on an H200, M = 1 (a hand-written prototype of this kernel and the partials' sum):
2.2-3.2x faster than the generic GEMV at K = N = 8192 and the Llama-7B shapes, and about even
at 4096 x 4096 (a layer that small is mostly launch and the second kernel;
docs/passes/split_reductions.md has the generated kernel's times). Of the
blocks tried, one warp of 32 word columns and 8 rows a step, one group per chunk, was the fastest
at every size but the smallest (64 word columns, 16 rows a step, two groups a chunk: 4-22% slower).
"""
from __future__ import annotations

import math

import torch

from fusec.runtime.fast_start.pdl import pdl
from fusec.codegen.triton.text import helpers_in, max_address, render_stmt, ops_summary, convert
from fusec.ir import Load, Reduce, Stmt

from .int4_columns import Int4Columns
from .render import render_template

WORD_COLUMNS = 32  # one word column per lane of the one-warp program
ROWS_PER_STEP = 8  # rows of K loaded a step: 8 words a lane in flight, and 8 more prefetched


def columns_fit(kernel, cols: Int4Columns) -> tuple[bool, str]:
    """(fits, why): whether the chunk kernel renders this GEMV chunk."""
    shape = kernel.row_shape + kernel.k_shape
    if max([max_address(a.index, shape) for a in [*kernel.loads, *kernel.stores]]) >= 2 ** 31 - 1:
        return False, "addresses past 2^31 elements (the chunk kernel computes them in 32 bits)"
    if cols.group % 2:
        return False, (f"groups of {cols.group} rows: the kernel steps through a group 2 to 8 "
                       "rows at a time")
    return True, ""


def strided(load, names: list[str]) -> str:
    """`load`'s address from its strides, dim by dim, over the coordinates `names`
    (expressions)."""
    terms = [str(load.index.offset)] if load.index.offset else []
    for name, st in zip(names, load.index.strides):
        if st:
            name = f"({name})" if " " in name else name
            terms.append(name if st == 1 else f"{name} * {st}")
    return f"{load.param}_ptr + " + (" + ".join(terms) or "0")


def computed_lines(names, producers: dict, helpers: set, block: str, address) -> list[str]:
    """Lines computing `names` (loads and statements, in order) as `block` tiles, each load at
    `address(load)`."""
    out = []
    for name in names:
        item = producers[name]
        if isinstance(item, Stmt):
            out.append(render_stmt(item, helpers, block=block))
        else:
            value = convert(f"tl.load({address(item)})", item.dtype, item.var.dtype)
            out.append(f"{name} = {value}")
    return out


def render_gemv_columns(kernel, cols: Int4Columns, arch: int | None = None) -> str:
    (r,) = [i for i in kernel.body if isinstance(i, Reduce)]
    step = math.gcd(ROWS_PER_STEP, cols.group)
    wj = min(WORD_COLUMNS, 1 << max(cols.nw - 1, 0).bit_length())
    ragged = cols.nw % wj != 0
    n_k = len(kernel.k_shape)

    def at(load, chunk: str, j: str, t: str, gi: str, kk: str) -> str:
        """`load`'s address from its strides over (chunk, word column, column of the word,
        [group of the chunk,] row of the group)."""
        return strided(load, [chunk, j, t] + ([gi, kk] if n_k == 2 else [kk]))

    def rows_of_k(name: str, load: Load) -> str:
        """The address of `load` at rows `name + rows` of K (the chunk's offset is in `name`)."""
        st = load.index.strides[-1]
        terms = ([str(load.index.offset)] if load.index.offset else []) + [
            f"({name} + rows)[:, None]" + ("" if st == 1 else f" * {st}")]
        return " + ".join(terms)

    producers = {l.var.name: l for l in kernel.loads}
    producers.update((item.var.name, item) for item in kernel.body)
    helpers: set = set()
    words = cols.words
    word_mask = "mask=jmask[None, :], other=0, " if ragged else ""

    def words_at(k: str) -> str:
        return f"{words.param}_ptr + {rows_of_k(k, words)} + j[None, :]"

    def computed(names, block: str, coords: tuple) -> list[str]:
        return computed_lines(names, producers, helpers, block, lambda l: at(l, *coords))

    # the activations of the step's R rows, [R, 1]: loaded, or computed from loads that are the
    # same for every column (`r + rows`: the rows within the group)
    x_lines = computed(cols.x, "[R, 1]", ("chunk", "0", "0", "gi", "(r + rows)[:, None]" if n_k == 2
                                          else f"(gi * {cols.group} + r + rows)[:, None]"))

    def group_value(load: Load | int | None, i: int) -> str:
        if not isinstance(load, Load):
            return f"tl.full([WJ], {float(load or 0)!r}, tl.float32)  # the zero point is a constant"
        value = f"tl.load({at(load, 'chunk', 'j', f'c{i}', 'gi', '0')}, mask=jmask, other=0)"
        return convert(value, load.dtype, torch.float32)

    # the exact path: every load as a [WJ, 8] tile of one row of K, then the IR's statements
    exact_loads = []
    for load in kernel.loads:
        where = at(load, 'chunk', 'jj', 't', 'gi', 'kk' if n_k == 2 else f'gi * {cols.group} + kk')
        value = f"tl.load({where} + tile, mask=tile_mask, other=0)"  # (+ tile: a [WJ, 8] address)
        exact_loads.append(f"{load.var.name} = {convert(value, load.dtype, load.var.dtype)}")
    exact_lines = [render_stmt(s, helpers, block="[WJ, 8]") for s in kernel.body if isinstance(s, Stmt)]

    (store,) = kernel.stores
    store_at = at(store, "chunk", "j[:, None]", "t", "0", "0")
    # the shift amounts, once per program: an [8] tile of the column's amount
    shift_lines = computed(cols.shifts, "[8]", ("0", "0", "t8", "0", "0"))
    lines = exact_loads + exact_lines + shift_lines + x_lines
    helpers |= helpers_in(lines)
    params = [f"{q.name}_ptr" for q in kernel.params]
    return render_template(
        "triton_gemv_int4_columns.py.j2", name=kernel.name, summary=ops_summary(kernel),
        group=cols.group, groups=cols.groups, chunks=cols.chunks, nw=cols.nw, wj=wj, r=step,
        half=str(cols.half).replace("torch.", ""), half_max=torch.finfo(cols.half).max,
        programs=-(-cols.nw // wj) * cols.chunks, pdl=pdl(arch), helpers=sorted(helpers),
        params=params, args_ptr=params, args=[q.name for q in kernel.params],
        shift_lines=shift_lines, shift=cols.shifts[-1], words_at=words_at, word_mask=word_mask,
        x_lines=x_lines, x_var=cols.x_var,
        zero_at=lambda i: group_value(cols.zero, i), scale_at=lambda i: group_value(cols.scale, i),
        exact_loads=exact_loads, exact_lines=exact_lines, product=r.operand.name,
        store_at=store_at)

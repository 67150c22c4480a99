"""The C++ backend's pointwise renderers: a kernel over an iteration space as one loop nest.

`render_pointwise` writes the row-by-row loop (row blocks and chunks across threads, a simd loop
over a chunk, half precision in blocks: cpp/half_blocks.py); `render_short_rows` the loop for
spaces of many short rows (cpu_plan.py `short_rows`). cpp/__init__.py `render` picks one;
cpp/reduction.py renders reductions, cpp/text.py spells the IR's statements.
"""
from __future__ import annotations

import math

from fusec import ops
from fusec.ir import Index, PointwiseKernel
from fusec.symbolic import hint, is_symbolic

from . import half_blocks, pieces as cat_pieces
from .text import (CTYPE, load_value, store_value, render_stmt, convert, gather_offset,
                   host_has_f16c, params, plus, row_coords, size, size_kw, sizes_line, times)
from ..cpu_plan import CHUNK, TILE_STRIDE, at_most, heading, row_values, thread_condition
from ..render import render_template


# Note (tiles for transposed reads): the loop order follows the first output's layout, so an input
# laid out the other way (x.t() next to a row-major y) is read with a large stride on every inner
# step: each element a different cache line, and by the time the next row wants the neighbouring
# element that line is long gone. Cutting the iteration into ROW_TILE x TILE_CHUNK tiles keeps the
# lines one tile touches (TILE_CHUNK of them per strided input) in L1 while ROW_TILE rows use them.
ROW_TILE, TILE_CHUNK = 16, 64



def render_pointwise(kernel: PointwiseKernel) -> str:
    """The row-by-row loop: (row block, chunk) tiles across threads, a simd loop over a chunk.
    How it is cut (CHUNK, ROW_TILE) changes only the speed: with sizes that are arguments, the
    traced sizes decide (Note: sizes as arguments in C++, cpp/text.py)."""
    shape = kernel.shape
    rows, inner = math.prod(shape[:-1]), shape[-1]
    # (CHUNK stays a number where the row's length is an argument: tiles copy CHUNK values)
    chunk = CHUNK if is_symbolic(inner) else inner if hint(rows) >= 64 or inner <= CHUNK else CHUNK
    outer_dims = len(shape) - 1
    strided = sorted({l.param for l in kernel.loads if abs(hint(l.index.strides[-1])) >= TILE_STRIDE
                      and l.gather is None})
    row_tile = 1
    pieces = any(l.valid for l in kernel.loads)  # a cat's loads are conditional: no tiles
    if strided and hint(rows) >= 2 and hint(inner) >= 2 and not pieces:
        row_tile, chunk = at_most(ROW_TILE, rows), at_most(TILE_CHUNK, inner)

    row_setup = row_coords(shape)

    def index(idx: Index, label: str) -> str:
        base = [size(idx.offset)] if idx.offset else []
        base += [f"c{d} * {size(s)}" for d, s in enumerate(idx.strides[:-1]) if s]
        if base:
            row_setup.append(f"const int64_t {label}_base = {' + '.join(base)};")
        inner_term = times("i", idx.strides[-1])
        terms = ([f"{label}_base"] if base else []) + ([inner_term] if inner_term else [])
        return " + ".join(terms) or "0"

    body: list[str] = []
    gathers: list[str] = []
    reads, writes = [], []  # (for half_blocks: the same reads and writes, a block at a time)
    per_row = row_values(kernel, strided if row_tile > 1 else ())  # (Note: values per row)
    hoisted: list[str] = []  # their lines: once per row, before the inner loop
    for load in kernel.loads:
        at = index(load.index, load.var.name)
        ptr = f"{load.param}_ptr[{at}]"
        if load.gather is not None:  # a gathered read: the row its index value names
            ptr = f"{load.param}_ptr[{at} + {gather_offset(load)}]"
        elif row_tile > 1 and load.param in strided:
            # gcc will not vectorize a loop with a load this strided: copy the tile's part of
            # the row into a small contiguous array first, then the main loop reads that
            tile = f"{load.var.name}_tile"
            gathers += [f"{CTYPE[load.dtype]} {tile}[CHUNK];",
                        f"for (int64_t i = start; i < end; ++i) {tile}[i - start] = {ptr};"]
            ptr = f"{tile}[i - start]"
        value = convert(load_value(ptr, load.dtype), ops.register_dtype(load.dtype), load.var.dtype)
        if load.valid is not None:  # a piece of a cat: read only inside its range (ir.Load)
            dim, lo, hi = load.valid
            at = f"c{dim}" if dim < outer_dims else "i"
            inside = " && ".join(([f"{at} >= {size(lo)}"] if lo > 0 else [])
                                 + ([f"{at} < {size(hi)}"] if hi < shape[dim] else [])) or "true"
            other = load.other.name if load.other is not None else f"{CTYPE[load.var.dtype]}(0)"
            value = f"({inside}) ? {value} : {other}"
        reads.append((load, ptr, value))
        (hoisted if load.var.name in per_row else body).append(
            f"const {CTYPE[load.var.dtype]} {load.var.name} = {value};")
    for s in kernel.stmts:
        (hoisted if s.var.name in per_row else body).append(render_stmt(s))
    for k, store in enumerate(kernel.stores):
        target = f"{store.param}_ptr[{index(store.index, f'out{k}')}]"
        writes.append((store, target))
        body.append(f"{target} = {store_value(store.var, store.dtype)};")
    # blocks, cut at float16 roundings or at a chain's math calls (cpp/half_blocks.py)
    cut = half_blocks.cut_reason(kernel, row_tile, host_has_f16c())
    blocks = half_blocks.block_loop(kernel, reads, writes) if cut else []
    # a cat along the inner dim: its reads first, in a loop of their own (cpp/pieces.py)
    if cat_reads := [] if blocks else cat_pieces.inner_pieces(kernel, per_row):
        body, chunk = cat_pieces.pieces_first(cat_reads, body, gathers, chunk)
    if hoisted and not blocks:  # (blocks compute everything a block at a time, from `reads`)
        row_setup += ["// the same at every position of the row: once per row (Note: values per row)",
                      *hoisted]

    return render_template(
        "cpp_pointwise.cpp.j2",
        name=kernel.name, summary=heading(kernel), sizes=sizes_line(kernel), const=size_kw(kernel),
        source_shape=kernel.source_shape, numel=kernel.numel, rows=size(rows), inner=size(inner),
        chunk=max(chunk, 1), parallel=thread_condition(kernel), row_tile=row_tile,
        tile_reason=f"{', '.join(strided)} step(s) across cache lines in the inner loop: each "
                    f"tile reuses the lines it loads for {row_tile} rows (Note: tiles for transposed reads)",
        params=params(kernel), row_setup=row_setup, gathers=gathers, body=body, blocks=blocks,
        cut=cut)


def render_short_rows(kernel: PointwiseKernel, tile_rows: int) -> str:
    """Short rows looped as flat runs of `tile_rows` rows (Note: short rows, cpu_plan.py): a flat
    buffer is read at `base + f`, a broadcast row from its copy repeated over the run."""
    inner = kernel.shape[-1]  # (a number: cpu_plan.short_rows declines a row length that is not)
    repeats, body = [], []
    for load in kernel.loads:
        offset, step = load.index.offset, load.index.strides[-1]
        if any(load.index.strides[:-1]):  # flat
            ptr = f"{load.param}_ptr[{plus(offset, 'base + f')}]"
        else:  # the same row for every row: repeated once per thread, then read flat
            rep, ctype = f"{load.var.name}_rep", CTYPE[load.dtype]
            unit = not is_symbolic(step) and step == 1
            at = plus(offset, "f % INNER" if unit else times("(f % INNER)", step)) or "0"
            repeats += [f"{ctype} {rep}[TILE];",
                        f"for (int64_t f = 0; f < TILE; ++f) {rep}[f] = {load.param}_ptr[{at}];"]
            ptr = f"{rep}[f]"
        value = convert(load_value(ptr, load.dtype), ops.register_dtype(load.dtype), load.var.dtype)
        body.append(f"const {CTYPE[load.var.dtype]} {load.var.name} = {value};")
    body += [render_stmt(s) for s in kernel.stmts]
    body += [f"{store.param}_ptr[{plus(store.index.offset, 'base + f')}] = "
             f"{store_value(store.var, store.dtype)};" for store in kernel.stores]
    return render_template(
        "cpp_short_rows.cpp.j2", name=kernel.name, summary=heading(kernel),
        sizes=sizes_line(kernel), const=size_kw(kernel),
        source_shape=kernel.source_shape, numel=kernel.numel,
        rows=size(math.prod(kernel.shape[:-1])),
        inner=inner, tile_rows=tile_rows, parallel=thread_condition(kernel),
        params=params(kernel), repeats=repeats, body=body)

"""C++ reductions: a ReductionKernel as one OpenMP-parallel loop over rows, one loop over k per
reduction phase inside it, then a last loop that recomputes and stores the element values.

The loop plan (what each loop computes, what is ready after it, which value is kept between the
last phase and the last pass) is the kernel IR's (`kernel.plan`, fusec/loop_plan.py); cpu_plan.py
adds what both CPU backends decide alike (threads, blocked sums). This file spells it, with the
cache-minded notes below: rows reduced across a strided axis are copied into a stack array
first, and neighbouring rows run in SIMD lanes when the row is short.

Why this file is long: it is the whole C++ spelling of a reduction, the row walk (lanes of rows,
row copies), each phase's loop (long float sums blocked) and the last pass, each note next to the
code it decides; the phase's loop (`phase_section` and its helpers) could stand alone next.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fusec import ops
from fusec.ir import Index, Reduce
from fusec.symbolic import hint, is_symbolic

from . import columns as cpp_columns
from .text import (CTYPE, load_value, store_value, render_stmt, convert, gather_offset, literal,
                   params, size, size_kw, sizes_line, times)
from ..cpu_plan import (LANES, SHORT_ROW_MIN_LAST, TILE_STRIDE, column_blocks, column_sum_block,
                        cpp_sum_block, heading, short_row_k, short_row_lanes, sum_block,
                        thread_condition)
from ..render import render_template
from ..unroll_rows import unrolled_or_same

REDUCTION_TILE_MAX = 4096  # longest row copied into an array on the stack (Note: rows reduced ...)


# ---- reductions ------------------------------------------------------------------------------

def render_reduction(kernel, notes: list[str] = ()) -> str:
    """One OpenMP-parallel loop over rows; inside, one loop over k per reduction phase, then a
    last loop that recomputes and stores the element values (softmax's division, say). A matmul's
    few activation rows are first unrolled into one loop (unroll_rows.py). `notes`: what the
    kernel families declined and why (codegen/families.py), for the kernel's header."""
    # (a number of activation rows that is an argument is not unrolled: one copy per row needs
    # the number when compiling, and a guard on it would serve only a few batch sizes)
    kernel, note = (kernel, "") if is_symbolic(kernel.row_shape[:1]) else unrolled_or_same(kernel)
    return assemble(kernel, reduction_lines(kernel), "\n".join(n for n in (note, *notes) if n))


@dataclass
class ReductionLines:
    """A reduction kernel's C++ lines before a template puts them together (`reduction_lines`).
    A kernel family may assemble them its own way (a table kernel for packed 4-bit weights)."""

    row_lines: list[str]  # once per row: coordinates, bases, row values, row copies
    k_coords: list[str]  # one k step's coordinates
    lines: dict[str, str]  # each load's and statement's line, by the value it defines
    producers: dict  # value name -> the Load or IR statement that makes it
    sections: list[dict]  # one per loop over the row: the phases, then the last pass
    row_stores: list[str]  # stores of values computed once per row
    scatters: list[str]  # row copies written back at the end of a row
    lanes: int  # LANES when neighbouring rows run in SIMD lanes (note "lanes of rows"), else 0
    columns: int  # rows per block when the loops are turned inside out (cpp/columns.py), else 0


def assemble(kernel, parts: ReductionLines, note: str) -> str:
    """The kernel's source: `parts` in the row-by-row template, or the inside-out one."""
    common = dict(name=kernel.name, summary=heading(kernel), sizes=sizes_line(kernel),
                  const=size_kw(kernel), source_shape=kernel.source_shape,
                  reduce_dims=kernel.reduce_dims, rows=size(kernel.rows), k=size(kernel.k),
                  parallel=thread_condition(kernel), params=params(kernel), unrolled=note)
    if parts.columns:
        arrays, sections, stores = cpp_columns.inside_out(kernel, parts.row_lines, parts.k_coords,
                                                          parts.sections, parts.row_stores,
                                                          parts.producers)
        return render_template(
            "cpp_reduction_columns.cpp.j2", **common,
            columns=parts.columns, last=size(kernel.row_shape[-1]),
            full_blocks=cpp_columns.full_blocks(kernel, parts.columns),
            arrays=arrays, sections=sections, stores=stores)
    return render_template(
        "cpp_reduction.cpp.j2", **common, lanes=parts.lanes,
        full_lanes=bool(parts.lanes) and not is_symbolic(kernel.row_shape[-1])
        and kernel.row_shape[-1] % parts.lanes == 0,
        last=size(kernel.row_shape[-1]) if kernel.row_shape else 1,
        row_lines=parts.row_lines, sections=parts.sections,
        row_stores=parts.row_stores + parts.scatters)


def reduction_lines(kernel, allow_columns: bool = True) -> ReductionLines:
    """The C++ lines of the reduction `kernel`: what runs once per row, and one section per loop
    over the row (`phase_section`, then the last pass). `allow_columns`: whether rows that lie
    side by side may have their loops turned inside out (cpp/columns.py).
    The steps: how the rows are walked (`_Rows`), each value's line, the row values that need no
    reduction, one section per phase, then the stores and the last pass."""
    rows = _Rows(kernel, allow_columns)
    lines, producers = _value_lines(kernel, rows)
    plan = kernel.plan
    rows.row_lines += [lines[n] for n in plan.before]  # row values needing no reduction: once per row
    sections = [phase_section(kernel, phase, phase is plan.phases[-1], lines, producers,
                              rows.k_coords, rows.target, rows.lanes, rows.columns)
                for phase in plan.phases]
    row_stores, last_pass = _stores_and_last_pass(kernel, rows, lines, producers)
    if last_pass is not None:
        sections.append(last_pass)
    return ReductionLines(rows.row_lines, rows.k_coords, lines, producers, sections, row_stores,
                          rows.scatters, rows.lanes, rows.columns)


class _Rows:
    """How a reduction kernel walks its rows in C++ (one at a time, LANES side by side, or in
    blocks with the loops inside out: `lanes`, `columns`), and the lines that run once per row:
    coordinates, each access's `_base` (written when first asked for), row copies."""

    def __init__(self, kernel, allow_columns: bool):
        self.kernel = kernel
        self.n_rows = n_rows = len(kernel.row_shape)
        self.row_lines = _coords("c", "row", kernel.row_shape)
        self.k_coords = _coords("q", "k", kernel.k_shape)
        # rows side by side with their values far apart: the loops turned inside out (cpp/columns.py),
        # the k loop outside and a block of rows in the SIMD lanes; lanes of rows only where a
        # kernel family asks for no columns (Note: lanes of rows)
        self.columns = column_blocks(kernel) if allow_columns else 0
        if self.columns:  # (a block no wider than the rows side by side: cpp/columns.py)
            self.columns = cpp_columns.block_width(kernel, self.columns)
        self.lanes = 0 if self.columns else lane_blocks(kernel, self.k_strided)
        if self.lanes or self.columns:
            # Note (lanes of rows): see lane_blocks. The row's coordinates come from the block and
            # the lane, so every address is linear in the lane and gcc vectorizes across lanes.
            self.row_lines = _coords("c", "outer", kernel.row_shape[:-1])
            self.row_lines.append(f"const int64_t c{n_rows - 1} = lane0 + lane;")
        self.gather_k = " ".join(self.k_coords)
        self.scatters: list[str] = []  # row copies written back at the end of a row
        self.store_targets: dict[int, str] = {}

    def index(self, idx: Index, label: str) -> str:
        """An access's address inside the k loop; its row part becomes a `_base` row line."""
        kernel, n_rows = self.kernel, self.n_rows
        base = ([size(idx.offset)] if idx.offset else []) + \
            [f"c{d} * {size(s)}" for d, s in enumerate(idx.strides[:n_rows]) if s]
        if base:
            self.row_lines.append(f"const int64_t {label}_base = {' + '.join(base)};")
        kterms = [times(f"q{d}", s) for d, s in enumerate(idx.strides[n_rows:]) if s]
        if len(kernel.k_shape) > 1 and flat_k(idx.strides[n_rows:], kernel.k_shape):
            # contiguous over all of k (group norm's (C/G, H*W)): the address is k itself;
            # gcc cannot see that q0 * 1024 + q1 is k again and would gather element by element
            kterms = [times("k", idx.strides[-1])]
        return " + ".join(([f"{label}_base"] if base else []) + kterms) or "0"

    # Note (rows reduced across a strided axis): softmax over the channels of an NCHW tensor
    # reduces K values that lie H*W elements apart. Read in place, every k step is a new cache
    # line and gcc will not vectorize the row's loops (exp, say). Such an access is copied
    # between memory and a small contiguous array once per row (the rows next to each other share
    # those cache lines, so the copies hit L1); the row's phases then run on the array, vectorized.
    def k_strided(self, idx: Index) -> bool:
        """Whether an access steps across cache lines along k (note above; a stride that is an
        argument is judged at its traced size: the answer changes only the speed)."""
        ks = [abs(hint(s)) for s in idx.strides[self.n_rows:] if s]
        return bool(ks) and min(ks) >= TILE_STRIDE

    def strided_k(self, idx: Index) -> bool:
        """Whether an access is copied to or from a row array (note above). Not where K is an
        argument: the copy is an array of K values on the stack, whose length must be a number
        no larger than REDUCTION_TILE_MAX (a guard on it would serve only short rows)."""
        return not self.lanes and not self.columns and self.k_strided(idx) \
            and not is_symbolic(self.kernel.k) and self.kernel.k <= REDUCTION_TILE_MAX

    def target(self, n: int) -> str:
        """Store n's address, its `_base` row line written once (a row copy's element when the
        store is strided along k: the copy is scattered at the end of the row)."""
        if n not in self.store_targets:
            s = self.kernel.stores[n]
            self.store_targets[n] = f"{s.param}_ptr[{self.index(s.index, f'out{n}')}]"
            if self.strided_k(s.index):
                tile = f"out{n}_tile"
                self.row_lines.append(f"{CTYPE[s.dtype]} {tile}[K];  // {s.param}'s row, scattered at the end")
                self.scatters.append(f"for (int64_t k = 0; k < K; ++k) {{ {self.gather_k} "
                                     f"{self.store_targets[n]} = {tile}[k]; }}")
                self.store_targets[n] = f"{tile}[k]"
        return self.store_targets[n]


def _value_lines(kernel, rows: _Rows) -> tuple[dict[str, str], dict]:
    """Each load's and statement's line, by the value it defines, and the Load or IR item that
    makes each value. A load strided along k reads the row's copy, gathered once per row."""
    lines: dict[str, str] = {}
    for l in kernel.loads:
        at = rows.index(l.index, l.var.name)
        ptr = f"{l.param}_ptr[{at}]"
        if l.gather is not None:  # a gathered read: the row its index value names
            ptr = f"{l.param}_ptr[{at} + {gather_offset(l)}]"
        elif rows.strided_k(l.index):
            tile = f"{l.var.name}_tile"
            rows.row_lines.append(f"{CTYPE[l.dtype]} {tile}[K];  // {l.param}'s row, gathered")
            rows.row_lines.append(f"for (int64_t k = 0; k < K; ++k) {{ {rows.gather_k} {tile}[k] = {ptr}; }}")
            ptr = f"{tile}[k]"
        lines[l.var.name] = (f"const {CTYPE[l.var.dtype]} {l.var.name} = "
                             f"{convert(load_value(ptr, l.dtype), ops.register_dtype(l.dtype), l.var.dtype)};")
    producers = {l.var.name: l for l in kernel.loads}
    for item in kernel.body:
        producers[item.var.name] = item
        if not isinstance(item, Reduce):
            lines[item.var.name] = render_stmt(item)
    return lines, producers


def _stores_and_last_pass(kernel, rows: _Rows, lines: dict, producers: dict):
    """(row stores, last pass or None): the stores of row values, and the loop that recomputes
    the element values and stores them (reading back the value the last phase kept, if any)."""
    plan, keep = kernel.plan, kernel.plan.keep
    last_stores = keep.stores if keep else plan.element_stores  # (the kept output is stored)
    elem_stores, row_stores = [], []
    for n, s in enumerate(kernel.stores):  # in store order, as their `_base` lines come
        if n in last_stores or n in plan.row_stores:
            text = f"{rows.target(n)} = {store_value(s.var, s.dtype)};"
            (elem_stores if n in last_stores else row_stores).append(text)
    if not elem_stores:  # (none left when the last phase stored the only element output)
        return row_stores, None
    values = [lines[n] for n in plan.last_pass]
    comment = "last pass: element values, stored"
    if keep:
        values = [f"const {CTYPE[producers[n].var.dtype]} {n} = {rows.target(keep.store)};"
                  if n == keep.value else lines[n] for n in keep.last_pass]
        comment += f" ({keep.value} read back from where the last phase kept it)"
    body = list(rows.k_coords) + values + elem_stores
    return row_stores, {"comment": comment, "before": [],
                        "pragma": f"#pragma GCC unroll {LANES_UNROLL_K}" if rows.lanes
                        else "#pragma omp simd", "body": body, "after": [], "kblock": 0,
                        "block_before": [], "block_after": []}


def phase_section(kernel, phase, last: bool, lines: dict, producers: dict, k_coords: list,
                  target, lanes: int, columns: int) -> dict:
    """The loop over a row for one phase of the loop plan: its accumulators (`before`), the
    k loop's lines (`body`) with the pragma that vectorizes it, and the row values ready after
    it (`after`). `target(n)` is store n's address (the kept output is stored in the last phase).
    The steps: the loop's values, each reduction's accumulator, update and result, the row
    values ready after it, long float sums blocked, and the pragma.
    """
    plan, keep = kernel.plan, kernel.plan.keep
    reds = [producers[n] for n in phase.reduces]
    names, given = plan.phase_loop(phase)  # (a value the phase before stashed is read back)
    values = [f"const {CTYPE[producers[n].var.dtype]} {n} = {target(given[n])};  // stashed by "
              f"phase {phase.number - 1}" if n in given else lines[n] for n in names]
    loop = _PhaseLines([], list(k_coords) + values, [])
    maxmin = _maxmin(reds)
    stash = plan.stash_of(phase.number)
    if stash:
        loop.body.append(f"{target(stash.store)} = {stash.value};  // stashed for phase "
                         f"{phase.number + 1}")
    if keep and last and plan.keep_stored_again():
        why = "kept for the last pass" if keep.stores else "the output, stored once: no last pass"
        loop.body.append(f"{target(keep.store)} = {keep.value};  // {why}")
    for r in reds:
        if ops.REDUCTIONS[r.op].returns_index:
            _index_reduce(loop, r, columns, _int32_positions(kernel, r))
        else:
            _value_reduce(loop, r, maxmin, columns, lanes)
    loop.after += [lines[n] for n in phase.ready]
    kblock, blocked, block_before, block_after = _blocked_sums(kernel, reds, columns, loop)
    pragma = _phase_pragma(kernel, reds, lanes, blocked, kblock)
    return {"comment": f"phase {phase.number}: " + ", ".join(r.op for r in reds),
            "before": loop.before, "pragma": pragma, "body": loop.body, "after": loop.after,
            "kblock": kblock, "block_before": block_before, "block_after": block_after,
            "defines": cpp_columns.defines(phase, producers) if columns else []}


@dataclass
class _PhaseLines:
    """One phase's loop as it is built: accumulators set before it, the k loop's body, and the
    row values computed after it."""

    before: list[str]
    body: list[str]
    after: list[str]


def _maxmin(reds) -> bool:
    """Whether every reduction of a phase is a plain max or min (not of bools)."""
    return bool(reds) and all(r.op in ("amax", "amin") and r.acc_dtype != torch.bool
                              for r in reds)


def _int32_positions(kernel, r) -> bool:
    """Whether an index reduction's running position may be an int32_t: its values are at
    most 4 bytes wide and K is a number below 2**31 (see `_index_reduce`)."""
    return ops.register_dtype(r.operand.dtype).itemsize <= 4 and not is_symbolic(kernel.k) \
        and kernel.k < 2 ** 31


def _index_reduce(loop: _PhaseLines, r, columns: int, int32_at: bool = False) -> None:
    """An argmax or argmin: the running best value and where it was seen; a NaN wins, and a
    tie keeps the first position, as in eager."""
    red = ops.REDUCTIONS[r.op]
    acc = f"acc_{r.var.name}"
    x = convert(r.operand.name, r.operand.dtype, r.operand.dtype)
    cmp = ">" if r.op == "argmax" else "<"
    loop.before.append(f"{CTYPE[r.operand.dtype]} {acc} = "
                       f"{literal(red.init(r.operand.dtype), r.operand.dtype)};")
    nan = f"({x} != {x})" if r.operand.dtype.is_floating_point else "false"
    at = f"{acc}_at"
    if columns:
        # selects, not a branch, so the lane loop is vectorized: the running best moves on
        # a strictly better value (a tie keeps the first) or on the first NaN, which then
        # stays (nothing compares better than it, and it is no longer a number to replace).
        # Inside out (cpp/columns.py) the position is as wide as the values where K allows:
        # then the compares' masks select it directly, and gcc 12 vectorizes the loop on
        # baseline x86-64 (SSE2 has no 64-bit integer compare and no narrowing of masks)
        position = "int32_t" if int32_at else "int64_t"
        loop.before.append(f"{position} {acc}_at = 0;")
        take = f"take_{r.var.name}"
        better = f"({x} {cmp} {acc})"
        if r.operand.dtype.is_floating_point:
            better = f"{better} | ({nan} & ({acc} == {acc}))"
        k = "(int32_t)k" if int32_at else "k"
        loop.body += [f"const bool {take} = {better};",
                      f"{acc} = {take} ? {x} : {acc};",
                      f"{acc}_at = {take} ? {k} : {acc}_at;"]
        at = f"(int64_t){acc}_at" if int32_at else at
    else:
        loop.before.append(f"int64_t {acc}_at = 0;")
        loop.before.append(f"bool {acc}_seen = false;")
        loop.body.append(f"if (!({acc} != {acc}) && (!{acc}_seen || {x} {cmp} {acc} || "
                         f"{nan})) {{ {acc} = {x}; {acc}_at = k; {acc}_seen = true; }}")
    loop.after.append(f"const int64_t {r.var.name} = {at};  // {r.origin}")


def _value_reduce(loop: _PhaseLines, r, maxmin: bool, columns: int = 0, lanes: int = 0) -> None:
    """A reduction to a value: its accumulator, its update at each k (for a phase of plain
    max/min, a select the compiler vectorizes; else the op table's combine), its result. With
    rows in `lanes`, the selects are fusec_select's bit masks: a float `?:` in a lane loop that
    also calls SLEEF's exp stays a branch under gcc 12, and the lane loop scalar (cpp_prelude.h,
    fusec_select: a softmax before a max pool, KernelBench-style 25_)."""
    red = ops.REDUCTIONS[r.op]
    acc = f"acc_{r.var.name}"
    x = convert(r.operand.name, r.operand.dtype, r.acc_dtype)
    loop.before.append(f"{CTYPE[r.acc_dtype]} {acc} = {literal(red.init(r.acc_dtype), r.acc_dtype)};")
    if maxmin and columns and r.acc_dtype.is_floating_point:
        # inside out, each lane's accumulator is an array entry (cpp/columns.py): a NaN is taken
        # like a larger value and then kept (nothing compares above it), so no NaN flag is needed;
        # an int flag beside double lanes is a vector of another width, and gcc 12 then leaves
        # the loop scalar on baseline x86-64 (SSE2)
        cmp = ">" if r.op == "amax" else "<"
        loop.body.append(f"{acc} = (({x} {cmp} {acc}) | ({x} != {x})) ? {x} : {acc};")
        value = convert(acc, r.acc_dtype, r.var.dtype)
    elif maxmin:
        # a plain max/min the compiler vectorizes, plus a flag for NaN (which torch's
        # amax propagates and a compare-and-select would skip)
        cmp = ">" if r.op == "amax" else "<"
        select = "fusec_select({}, {}, {})" if lanes else "({}) ? {} : {}"
        loop.body.append(f"{acc} = " + select.format(f"{x} {cmp} {acc}", x, acc) + ";")
        value = convert(acc, r.acc_dtype, r.var.dtype)
        if r.acc_dtype.is_floating_point:
            # an int, not a bool: gcc vectorizes a bool |-reduction ~9x slower
            loop.before.append(f"int {acc}_nan = 0;")
            loop.body.append(f"{acc}_nan |= ({x} != {x});")
            nan = f"std::numeric_limits<{CTYPE[r.acc_dtype]}>::quiet_NaN()"
            value = "(" + select.format(f"{acc}_nan", nan, value) + ")"
    else:
        loop.body.append(f"{acc} = {red.combine.format(acc=acc, x=x)};")
        value = convert(acc, r.acc_dtype, r.var.dtype)
    if r.round_to is not None:
        value = f"fusec_round_{'f16' if r.round_to == torch.float16 else 'bf16'}({value})"
    loop.after.append(f"const {CTYPE[r.var.dtype]} {r.var.name} = {value};  // {r.origin}")


def _blocked_sums(kernel, reds, columns: int, loop: _PhaseLines):
    """(kblock, blocked sums, lines before and after each block): a phase's long float sums
    summed in blocks of kblock values (note below); kblock 0 when none is blocked."""
    # Note (long float sums): adding K values one after another into one float loses
    # ~K ulps; eager sums in a cascade and loses ~log K. A long float sum is blocked: each
    # block of ~sqrt(K) values is summed on its own (vectorized), and the block sums are
    # added up in double, so the error grows like sqrt(K) ulps of a block sum.
    n_rows = len(kernel.row_shape)
    blocked = [r for r in reds if r.op == "sum" and r.acc_dtype.is_floating_point]
    narrowest = min((l.dtype.itemsize for l in kernel.loads if any(l.index.strides[n_rows:])),
                    default=4)  # bytes of the narrowest value the k loop reads
    kblock = 0 if not blocked else column_sum_block(kernel) if columns \
        else cpp_sum_block(kernel.k, narrowest)
    block_before, block_after = [], []
    if kblock:
        for r in blocked:
            acc = f"acc_{r.var.name}"
            loop.before.append(f"double {acc}_total = 0.0;")
            block_before.append(f"{CTYPE[r.acc_dtype]} {acc}_blk = {literal(0, r.acc_dtype)};")
            block_after.append(f"{acc}_total += {acc}_blk;")
            loop.after.insert(0, f"{acc} = static_cast<{CTYPE[r.acc_dtype]}>({acc}_total);")
            loop.body = [b.replace(f"{acc} = {acc} + ", f"{acc}_blk = {acc}_blk + ")
                         for b in loop.body]
    return kblock, blocked, block_before, block_after


def _phase_pragma(kernel, reds, lanes: int, blocked, kblock: int) -> str:
    """The pragma that vectorizes a phase's k loop: an OpenMP simd reduction over its
    accumulators where they allow one, or full unrolling when rows run in lanes."""
    pragma = ""
    if lanes:  # vectorized across the lanes instead: the k loop runs inside each lane
        pragma = f"#pragma GCC unroll {LANES_UNROLL_K}" \
            if not is_symbolic(kernel.k) and kernel.k <= LANES_UNROLL_K else ""
    elif _maxmin(reds):
        clauses = [f"reduction({'max' if r.op == 'amax' else 'min'}:acc_{r.var.name})"
                   for r in reds]
        flags = [f"acc_{r.var.name}_nan" for r in reds if r.acc_dtype.is_floating_point]
        clauses += [f"reduction(|:{', '.join(flags)})"] if flags else []
        pragma = "#pragma omp simd " + " ".join(clauses)
    simd = all(ops.REDUCTIONS[r.op].name in ("sum", "prod") and r.acc_dtype != torch.bool
               for r in reds)
    if simd and reds and not lanes:
        op = "+" if ops.REDUCTIONS[reds[0].op].name == "sum" else "*"
        if all(ops.REDUCTIONS[r.op].name == ops.REDUCTIONS[reds[0].op].name for r in reds):
            names = ["acc_" + r.var.name + ("_blk" if r in blocked and kblock else "") for r in reds]
            pragma = f"#pragma omp simd reduction({op}:{', '.join(names)})"
    return pragma



# Note (lanes of rows): a reduction across a strided axis (softmax or a minimum over the channels
# of NCHW: K values H*W apart, for every one of N*H*W rows) has short rows lying side by side:
# row r+1's values sit right next to row r's. Vectorizing along a row gathers; vectorizing across
# rows does not: LANES neighbouring rows are computed together, one per SIMD lane, and each k step
# loads LANES contiguous values. gcc vectorizes such an outer loop (`omp simd` on the row loop)
# when the row runs a single inner k loop (one-phase kernels without a last pass: amax/amin/sum/
# mean over channels, with any pointwise prologue and row epilogue), or when its k loops are short
# enough (K <= LANES_UNROLL_K) to be unrolled away (softmax over 16 channels); other rows use the
# row copies of the note "rows reduced across a strided axis". Only where a kernel family asks for
# no columns (`allow_columns=False`): else such rows are turned inside out (cpp/columns.py), whose
# loops gcc 12 vectorizes on every x86-64 level, where it left this outer loop scalar with AVX2
# and AVX-512 when it held several k loops (a softmax) and on every level for a max with its NaN flag.
LANES_UNROLL_K = 16  # rows this short are unrolled completely, so several k loops are fine


def lane_blocks(kernel, k_strided) -> int:
    """LANES when the kernel computes LANES neighbouring rows at once (note above; fewer for
    short rows with fewer side by side), else 0. Sizes that are arguments: the last row dim is
    judged at its traced size (the last block is cut at the row's end), and a K that is one is
    never short enough to unroll."""
    short = short_row_k(kernel)
    if not kernel.row_shape or not kernel.k or hint(kernel.row_shape[-1]) < (
            SHORT_ROW_MIN_LAST if short else 8):
        return 0
    plan = kernel.plan
    several = len(plan.phases) != 1 or bool(plan.element_stores)
    if several and (is_symbolic(kernel.k) or kernel.k > LANES_UNROLL_K):
        return 0  # several k loops (phases, a last pass) that gcc cannot unroll away
    reds = [i for i in kernel.body if isinstance(i, Reduce)]
    if several and any(phase.ready for phase in plan.phases[:-1]):
        return 0  # row math between phases (logsumexp's guard on the max): gcc keeps it a branch
    if any(ops.REDUCTIONS[r.op].returns_index for r in reds):
        return 0
    if any(r.op == "sum" and r.acc_dtype.is_floating_point for r in reds) and sum_block(kernel.k):
        return 0  # a long float sum: one lane would add its K values one after another
    if short:
        # Note (short rows in lanes, codegen/cpu_plan.py): a few values per row (a pool's
        # window), the rows' values interleaved or a stride apart: the k loop is unrolled away
        # and the rows run in the lanes, each load's lanes SHORT_ROW_STRIDE or fewer apart
        return short_row_lanes(kernel)
    n_rows = len(kernel.row_shape)
    accesses = [l.index for l in kernel.loads] + [s.index for s in kernel.stores]
    if any(idx.strides[n_rows - 1] not in (0, 1) for idx in accesses):
        return 0
    if not any(k_strided(l.index) and l.index.strides[n_rows - 1] == 1 for l in kernel.loads):
        return 0
    return LANES


def flat_k(strides, shape) -> bool:
    """Whether an access walks the k dims as one flat run: each dim's stride is the next one's
    times its size (then the address is k times the last stride)."""
    return strides[-1] != 0 and all(strides[d] == strides[d + 1] * shape[d + 1]
                                    for d in range(len(shape) - 1))


def _coords(prefix: str, var: str, shape) -> list[str]:
    """Row-major coordinates of the flat position `var` over `shape`.

    Positions are never negative, and saying so (dividing as uint64_t) matters inside a
    vectorized loop: a signed k / 1024 must round toward zero for negative k, so gcc emits a
    division sequence and cannot see that q0 * 1024 + q1 is k again; unsigned, it is a shift and
    a mask, and a contiguous load stays contiguous (group norm's rows: 4x faster)."""
    out = []
    for d in range(len(shape)):
        below = math.prod(shape[d + 1:])
        expr = var if below == 1 else f"(uint64_t){var} / {_unsigned(below)}"
        if d:
            expr = f"({expr}) % {_unsigned(shape[d])}" if below != 1 \
                else f"(uint64_t){var} % {_unsigned(shape[d])}"
        out.append(f"const int64_t {prefix}{d} = {expr};")
    return out


def _unsigned(n) -> str:
    """A size as an unsigned C++ operand: `1024u`, or `(uint64_t)x_size0` for one that is an argument."""
    return f"(uint64_t){size(n)}" if is_symbolic(n) else f"{n}u"

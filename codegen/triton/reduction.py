"""Triton reductions: a ReductionKernel as one program per block of rows, persistent (the row in
registers) or looped over chunks of the row, one loop per pass of the kernel's loop plan
(fusec/loop_plan.py), with online softmax-style updates where the plan lets a phase fold into the
one before it (`looped_pass`), and column reductions for rows that lie side by side. A kernel
that a kernel family takes (codegen/families.py) never gets here; the notes of those that
declined it go into its header.
"""
from __future__ import annotations

import math
import re

import torch

from fusec import ops
from fusec.ir import Index, OnlineSoftmax, OnlineVariance, Reduce
from fusec.runtime.fast_start.pdl import pdl
from fusec.symbolic import hint, is_symbolic, py_expr

from ..render import render_template
from .text import (TL, helpers_in, max_address, render_stmt, ops_summary, convert, gather_offset,
                   literal, size, same, needs_int64, size_arguments)


# ---- reductions ------------------------------------------------------------------------------

PERSISTENT_MAX_K = 8192  # rows up to this long stay in registers; longer ones are looped over
LOOP_RBLOCK = 2048
# looped kernels take the loop plan's folds (fusec/loop_plan.py, Phase.folds): a phase of sums of
# exp(x - max) shares the pass of its max (see the note on online softmax below), a phase of sums
# of squared deviations shares the pass before it (the note on online variance)
ONLINE_SOFTMAX = True


# Note (column reductions): a channels-last tensor reduced over its pixels (a global average pool,
# batch-norm statistics) has its rows (channels) next to each other in memory and each row's
# elements C apart. One row per program would read one float out of every 32-byte sector it
# fetches; instead a program takes COLUMN_XBLOCK neighbouring rows and walks k in steps of
# COLUMN_RBLOCK, so every load of the [XBLOCK, RBLOCK] tile reads XBLOCK consecutive floats.
COLUMN_XBLOCK = 64
COLUMN_RBLOCK = 64


def is_column_reduction(kernel) -> bool:
    """True when every load that varies along k is contiguous across rows and strided along k."""
    n_rows = len(kernel.row_shape)
    # (strides compared as expressions, without a guard: both forms are right for every size)
    varying = [l.index.strides for l in kernel.loads
               if any(not same(st, 0) for st in l.index.strides[n_rows:])]
    return bool(varying) and n_rows > 0 and all(
        same(st[n_rows - 1], 1) and not same(st[-1], 0) and not same(st[-1], 1) for st in varying)


def reduction_blocks(rows: int, k: int, column: bool = False,
                     k_fixed: bool = True) -> tuple[bool, int, int, int]:
    """(persistent, XBLOCK, RBLOCK, num_warps): a whole short row per program when it fits,
    several rows per program when rows are short, 2048-wide chunks for long rows; a warp per
    1024 elements of the tile (32 per thread: on an H200, 4 warps ran a 4096-wide softmax 2-4%
    faster than 8 or 16, and a 4096-wide layer norm 1% faster). L2 eviction hints (evict_first
    for rows read once, evict_last for a weight every row reads) made that layer norm 1.5%
    slower there, so there are none.

    `rows` and `k` are the traced sizes where they are symbols (fusec/symbolic.py, `hint`);
    `k_fixed` is False when k is a symbol. A row in registers holds at most RBLOCK elements, right only
    for k up to RBLOCK, so such a k loops over the row (in chunks of its traced size's power of
    two, at most 2048): every k takes the same kernel, and no guard narrows the shape family."""
    persistent = k_fixed and k <= PERSISTENT_MAX_K
    if column and rows >= COLUMN_XBLOCK and k > COLUMN_RBLOCK:
        # see the note on column reductions above
        return False, COLUMN_XBLOCK, COLUMN_RBLOCK, 4
    rblock = max(1 << max(k - 1, 0).bit_length(), 2)
    if not persistent:
        rblock = LOOP_RBLOCK if k_fixed else min(rblock, LOOP_RBLOCK)
    xblock = max(1, min(4096 // rblock, 1 << max(rows - 1, 0).bit_length()))
    num_warps = max(1, min(16, (xblock * rblock) // 1024))
    return persistent, xblock, rblock, num_warps


def render_reduction(kernel, arch: int | None = None, notes: list[str] = ()) -> str:
    """The reduction `kernel` as one Triton kernel: a block of XBLOCK rows per program, each row
    in registers (persistent) or walked in RBLOCK chunks, one loop per pass of the loop plan.
    `notes`: what the kernel families declined and why (codegen/families.py), for the header.
    The steps: the block sizes, each value's line, the stores, the loops over the row, the
    header's note, and the template that puts them together."""
    persistent, xblock, rblock, num_warps = reduction_blocks(
        hint(kernel.rows), hint(kernel.k), is_column_reduction(kernel), not is_symbolic(kernel.k))
    spell = _Lines(kernel)
    stores_elem, stores_row = _store_lines(spell)
    row_lines = _coords("r", "rows", kernel.row_shape)
    passes = None
    if persistent:
        loops = [_persistent_loop(spell, stores_elem + stores_row)]
    else:
        row_lines += [spell.line(n) for n in kernel.plan.before]
        passes = kernel.plan.passes(online=ONLINE_SOFTMAX)  # the phases each loop over the row covers
        loops = _looped_loops(spell, passes, stores_elem, stores_row)
    note = _passes_note(loops, passes, notes)
    helpers = helpers_in(row_lines + [l for sec in loops for part in ("before", "body", "after")
                                       for l in sec[part]])
    big = needs_int64([kernel.numel] + [max_address(a.index, kernel.row_shape + kernel.k_shape)
                                        for a in [*kernel.loads, *kernel.stores]])
    return render_template(
        "triton_reduction.py.j2", name=kernel.name, summary=ops_summary(kernel),
        source_shape=kernel.source_shape, reduce_dims=kernel.reduce_dims, rows=kernel.rows,
        k=kernel.k, rows_text=py_expr(kernel.rows),
        xblock=xblock, rblock=rblock, num_warps=num_warps, persistent=persistent,
        helpers=sorted(helpers), params=[f"{p.name}_ptr" for p in kernel.params],
        args=[p.name for p in kernel.params], passes=note,
        row_start="pid.to(tl.int64) * XBLOCK" if big else "pid * XBLOCK",
        row_lines=row_lines, sections=loops, pdl=pdl(arch),
        **size_arguments(kernel, [("n_rows", kernel.rows, False), ("n_k", kernel.k, True)]))


def _coords(prefix: str, var: str, shape) -> list[str]:
    """Row-major coordinates (`prefix`0, `prefix`1, ...) of the flat position `var` over `shape`."""
    out = []
    for d in range(len(shape)):
        below = math.prod(shape[d + 1:])
        expr = var if same(below, 1) else f"({var} // {size(below)})"
        out.append(f"{prefix}{d} = {expr}" + ("" if d == 0 else f" % {size(shape[d])}"))
    return out


class _Lines:
    """A reduction kernel's values spelled in Triton: each load's line, the load or body item
    that makes each value (`producers`), and the fusec_* helpers the lines call."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.n_rows = len(kernel.row_shape)
        self.helpers: set = set()
        self.load_lines = {}
        for l in kernel.loads:
            addr, mask = self.index(l.index)
            if l.gather is not None:  # a gathered read: the row its index value names
                addr = f"{addr} + {gather_offset(l)}"
            value = f"tl.load({l.param}_ptr + {addr}, mask={mask})"
            if l.dtype != l.var.dtype:
                value = convert(value, l.dtype, l.var.dtype)
            self.load_lines[l.var.name] = f"{l.var.name} = {value}"
        self.producers = {l.var.name: ("load", l) for l in kernel.loads}
        for item in kernel.body:
            self.producers[item.var.name] = ("body", item)

    def index(self, idx: Index) -> tuple[str, str]:
        """(address expression, mask) for an index over (row dims..., k dims...)."""
        n_rows = self.n_rows
        terms = [f"r{d}" if same(s, 1) else f"r{d} * {size(s)}"
                 for d, s in enumerate(idx.strides[:n_rows]) if not same(s, 0)]
        kterms = [f"k{d}" if same(s, 1) else f"k{d} * {size(s)}"
                  for d, s in enumerate(idx.strides[n_rows:]) if not same(s, 0)]
        mask = "mask" if terms and kterms else ("k_mask" if kterms else "row_mask")
        terms = terms + kterms or ["tl.zeros_like(rows)"]
        return " + ".join(([size(idx.offset)] if not same(idx.offset, 0) else []) + terms), mask

    def line(self, name: str) -> str:
        """The line that computes value `name` (a load or a statement)."""
        kind, item = self.producers[name]
        if kind == "load":
            return self.load_lines[name]
        return render_stmt(item, self.helpers, block="[1, 1]")

    def reduce_block(self, r: Reduce, operand: str) -> str:
        """A reduction of a whole row held in the block: masked lanes count as its init."""
        red = ops.REDUCTIONS[r.op]
        init = literal(red.init(r.acc_dtype), r.acc_dtype)
        masked = f"tl.where(mask, {convert(operand, r.operand.dtype, r.acc_dtype)}, {init})"
        if red.returns_index:
            expr = red.triton_block.format(x=masked, k="ks")
        else:
            expr = red.triton_block.format(x=masked)
        self.helpers.update(re.findall(r"\bfusec_\w+", expr))
        out = convert(f"({expr})", torch.int64 if red.returns_index else r.acc_dtype, r.var.dtype)
        if r.round_to is not None:
            out = convert(convert(out, r.var.dtype, r.round_to), r.round_to, r.var.dtype)
        return f"({out})[:, None]"

    def k_setup(self, start: str) -> list[str]:
        """The lines that start a block of k: its positions, masks and coordinates."""
        return [f"ks = {start}tl.arange(0, RBLOCK)[None, :]", "k_mask = ks < n_k",
                "mask = row_mask & k_mask", *_coords("k", "ks", self.kernel.k_shape)]


def _store_lines(spell: _Lines) -> tuple[list[str], list[str]]:
    """The stores, split into those of element values and those of row values."""
    stores_elem, stores_row = [], []
    for n, s in enumerate(spell.kernel.stores):
        addr, mask = spell.index(s.index)
        text = f"tl.store({s.param}_ptr + {addr}, {convert(s.var.name, s.var.dtype, s.dtype)}, mask={mask})"
        (stores_elem if n in spell.kernel.plan.element_stores else stores_row).append(text)
    return stores_elem, stores_row


def _persistent_loop(spell: _Lines, stores: list[str]) -> dict:
    """The whole row at hand: every value in program order, no passes, then the stores."""
    kernel = spell.kernel
    body = list(spell.k_setup(""))
    for name in [l.var.name for l in kernel.loads] + [item.var.name for item in kernel.body]:
        kind, item = spell.producers[name]
        body.append(reduce_line(item, spell.reduce_block) if isinstance(item, Reduce)
                    else spell.line(name))
    return {"comment": "The whole row fits in one block: load it once, reduce, finish.",
            "before": [], "header": "", "body": body + stores, "after": []}


def _looped_loops(spell: _Lines, passes, stores_elem: list[str], stores_row: list[str]) -> list:
    """A looped kernel's loops: one per pass of the plan, a last pass that recomputes and
    stores the element values, and the row values' stores after them."""
    loops = [looped_pass(phases, spell.producers, spell.line, spell.k_setup, spell.helpers)
             for phases in passes]
    if stores_elem:
        body = list(spell.k_setup("k_start + ")) + [spell.line(n) for n in spell.kernel.plan.last_pass] \
            + stores_elem
        loops.append({"comment": "Last pass: recompute the element values and store them.",
                      "before": [], "header": "for k_start in range(0, n_k, RBLOCK):",
                      "body": body, "after": []})
    if stores_row:
        loops.append({"comment": "", "before": stores_row, "header": "", "body": [], "after": []})
    return loops


def _passes_note(loops: list, passes, notes) -> str:
    """The header's note: how many passes a looped kernel makes over each row (and which
    phases share one), then what the kernel families declined. `passes`: None if persistent."""
    note = ""
    if passes is not None:
        folded = [o for phases in passes if len(phases) > 1 for o in phases[0].folds]
        shared = (["online softmax: the max and the sum of exponentials share one"]
                  if any(isinstance(o, OnlineSoftmax) for o in folded) else []) + \
            (["online variance: the mean and the squared deviations share one"]
             if any(isinstance(o, OnlineVariance) for o in folded) else [])
        note = (f"{sum(bool(sec['header']) for sec in loops)} pass(es) over each row"
                + (" (" + "; ".join(shared) + ")." if shared else "."))
    for declined in notes:  # a kernel family's near miss (codegen/families.py)
        note = (note + "\n" if note else "") + declined
    return note


def looped_pass(phases, producers: dict, line, k_setup, helpers: set) -> dict:
    """One loop over the row of a looped kernel, covering one phase of the loop plan, or two
    when the next phase's sums of exp(x - max) ride along (`LoopPlan.passes`, online softmax):
    its accumulators before the loop, its body, and the row values computed after it."""
    first, folds = phases[0], (phases[0].folds if len(phases) > 1 else ())
    online = [o for o in folds if isinstance(o, OnlineSoftmax)]
    variances = [o for o in folds if isinstance(o, OnlineVariance)]
    reds = [producers[n][1] for n in first.reduces]
    peaks: dict[str, list] = {}  # amax -> the online sums that share its running max
    for o in online:
        peaks.setdefault(o.peak, []).append(o)
    before, body, after = [], list(k_setup("k_start + ")), []
    for r in reds:
        red = ops.REDUCTIONS[r.op]
        init = literal(red.init(r.acc_dtype), r.acc_dtype).replace("[1]", "[XBLOCK, RBLOCK]")
        if not init.startswith("tl.full"):
            init = f"tl.full([XBLOCK, RBLOCK], {init}, {TL[r.acc_dtype]})"
        before.append(f"acc_{r.var.name} = {init}")
        if red.returns_index:  # each lane keeps its best value and where it saw it
            before.append(f"acc_{r.var.name}_at = tl.full([XBLOCK, RBLOCK], -1, tl.int32)")
        for o in peaks.get(r.var.name, []):
            before.append(f"acc_{o.total} = tl.full([XBLOCK, RBLOCK], 0.0, {TL[r.acc_dtype]})"
                          f"  # sum of exp(x - running max), per lane")
    for o in variances:
        dtype = TL[producers[o.total][1].acc_dtype]
        before += [f"acc_{o.total}_n = tl.full([1, RBLOCK], 0.0, {dtype})  # the same in every row"]
        before += [f"acc_{o.total}_{part} = tl.full([XBLOCK, RBLOCK], 0.0, {dtype})"
                   for part in ("shift", "mean", "m2")]
    body += [line(n) for n in first.loop]
    for o in variances:
        body += welford_update(o)
    for r in reds:
        red = ops.REDUCTIONS[r.op]
        x = convert(r.operand.name, r.operand.dtype, r.acc_dtype)
        if red.returns_index:
            acc = f"acc_{r.var.name}"
            helpers.update(["fusec_arg_update", "fusec_arg_finish"])
            body.append(f"{acc}, {acc}_at = fusec_arg_update({acc}, {acc}_at, {x}, ks, mask, "
                        f"{r.op == 'argmax'})")
            after.append(f"{r.var.name} = " + convert(
                f"fusec_arg_finish({acc}, {acc}_at, {r.op == 'argmax'})", torch.int32,
                r.var.dtype) + "[:, None]  # " + r.origin)
            continue
        combine = red.combine.format(acc=f"acc_{r.var.name}", x=x)
        helpers.update(re.findall(r"\bfusec_\w+", combine))
        if r.var.name in peaks:
            body += online_update(r, x, combine, peaks[r.var.name])
        else:
            body.append(f"acc_{r.var.name} = tl.where(mask, {combine}, acc_{r.var.name})")
        block = red.triton_block.format(x=f"acc_{r.var.name}")
        helpers.update(re.findall(r"\bfusec_\w+", block))
        value = convert(f"({block})", r.acc_dtype, r.var.dtype)
        if r.round_to is not None:
            value = convert(convert(value, r.var.dtype, r.round_to), r.round_to, r.var.dtype)
        after.append(f"{r.var.name} = ({value})[:, None]  # " + r.origin)
    # row values that became computable after this pass (a merged pass ends two phases)
    after += [line(n) for n in first.ready]
    if online:
        after += online_finish(online, producers)
    if variances:
        after += welford_finish(variances, producers)
    if folds:
        after += [line(n) for n in phases[1].ready]
    names = ", ".join(r.op for r in reds)
    comment = f"Phase {first.number}: one pass over the row for {names}."
    if folds:
        comment = (f"Phases {first.number} and {first.number + 1} in one pass over the row: {names}, "
                   "and " + ", ".join([f"the sum of exp(x - {o.peak}) (online softmax)" for o in online]
                                      + [f"the sum of ({o.value} - {o.shift})^2 (online variance)"
                                         for o in variances]) + ".")
    return {"comment": comment, "before": before,
            "header": "for k_start in range(0, n_k, RBLOCK):", "body": body, "after": after}


# Note (online softmax): each lane of the [XBLOCK, RBLOCK] tile keeps its running max m and the
# sum s of exp(x - m) over the values it has seen. When a new value raises the max to m', the old
# sum is rescaled, s' = s * exp(m - m') + exp(x - m'), so max and sum come out of one pass over
# the row. At the end the lanes are combined the same way: M = max over lanes, S = sum over lanes
# of s * exp(m - M). fusec_exp_shift(x, m) is exp(x - m) except that x == m gives 1 even when
# both are infinite: a lane whose values are all -inf counts them (instead of turning NaN from
# -inf - -inf), and a +inf max counts as one term of 1. S is then moved to the shift c that the
# program subtracts, S * exp(M - c): exactly 1 when c is the max, and NaN when the max is
# infinite (exp(inf - inf)), which is what the two-pass sum of exp(x - M) gives; logsumexp's
# c = where(|M| == inf, 0, M) gets 0 for an all -inf row and inf for a row holding +inf, as eager.
# NaN propagates through fusec_maximum into m and from there into s.

def online_update(peak, x: str, combine: str, online: list) -> list[str]:
    """Loop body lines: raise the running max `acc_<peak>` and rescale the sums that share it."""
    acc, new = f"acc_{peak.var.name}", f"max_{peak.var.name}"
    lines = ["# online softmax: where a lane's max grows, rescale the sum it kept against the old one",
             f"{new} = tl.where(mask, {combine}, {acc})"]
    for o in online:
        total = f"acc_{o.total}"
        lines += [f"{total} = {total} * fusec_exp_shift({acc}, {new})",
                  f"{total} = {total} + tl.where(mask, fusec_exp_shift({x}, {new}), 0.0)"]
    return lines + [f"{acc} = {new}"]


def online_finish(online: list, producers: dict) -> list[str]:
    """Lines after the loop: each online sum's lanes rescaled to the row's max, added up, and
    moved from the max to the program's shift (see the note above)."""
    lines = []
    for o in online:
        lines.append(f"# every lane's sum rescaled to the row's max {o.peak} and added up, then times")
        if o.shift == o.peak:
            lines.append(f"# exp({o.peak} - {o.peak}): 1, or NaN for an infinite max as in exp(x - max)")
        else:
            lines.append(f"# exp({o.peak} - {o.shift}): the program subtracts {o.shift}, not the max")
        lines.append(f"{o.total} = tl.sum(acc_{o.total} * fusec_exp_shift(acc_{o.peak}, {o.peak}), 1)"
                     f"[:, None] * fusec_exp({o.peak} - {o.shift})  # {producers[o.total][1].origin}")
    return lines


# Note (online variance): a variance is sum((v - c)^2) with c the mean, known only after a pass
# over the row; read again, the row may have left the cache (on an H100, a group norm's statistics
# over 64 rows of 512K floats took twice as long as one read). Instead each lane of the tile keeps
# Welford's running count n (one per column of the tile: every row has its k-th element), mean m
# and sum s of squared deviations from m, updated per element:
# m' = m + (y - m) / n', s' = s + (y - m)(y - m'). After the pass, when c is known, the lanes'
# sums are moved from their own means to c and added up: sum((v - c)^2) = s + n (m - c)^2 per
# lane. Every term is >= 0 (no cancellation). The three accumulators per lane (shift, mean,
# squared deviations) do not call for more warps: on an H100, KernelBench-style 7_, 24_ and 27_
# ran fastest with the 4 warps of the plain kernel (8 and 16: 1-4% slower; 28_ 2% faster with 8;
# benchmarks/diagnostics/variance_kernels.py). Nor did taking 1 / n' once per column and
# multiplying: the instance norms (column reductions) measured slower with it (7_ 0.363 ms against
# 0.320-0.339 with the division per element). y is v minus the first value the lane saw (its
# shift h): far from 0 (a row of 10000 + noise) a running mean would round at 10000's ulp on every
# step, while y and c - h are differences of nearby floats, exact, of the size of the noise. A
# NaN or infinite v makes m and s NaN, as the two-pass sum is; a lane that saw no element adds 0.

def welford_update(o) -> list[str]:
    """Loop body lines: one Welford step for every lane that holds an element of the row."""
    acc, y = f"acc_{o.total}", f"({o.value} - acc_{o.total}_shift)"
    return ["# online variance: per lane, a running count, mean and squared deviations (Welford)",
            f"{acc}_shift = tl.where(mask & ({acc}_n == 0), {o.value}, {acc}_shift)",
            f"{acc}_n = {acc}_n + tl.where(k_mask, 1.0, 0.0)",
            f"delta_{o.total} = tl.where(mask, {y} - {acc}_mean, 0.0)",
            f"{acc}_mean = {acc}_mean + delta_{o.total} / tl.maximum({acc}_n, 1.0)",
            f"{acc}_m2 = {acc}_m2 + delta_{o.total} * tl.where(mask, {y} - {acc}_mean, 0.0)"]


def welford_finish(variances: list, producers: dict) -> list[str]:
    """Lines after the loop: each lane's squared deviations moved to the shift c, added up."""
    lines = []
    for o in variances:
        acc = f"acc_{o.total}"
        lines += [f"# every lane's squared deviations from its own mean, moved to {o.shift} and added up",
                  f"dev_{o.total} = ({acc}_shift - {o.shift}) + {acc}_mean",
                  f"{o.total} = tl.sum(tl.where({acc}_n > 0, {acc}_m2 + {acc}_n * dev_{o.total} * "
                  f"dev_{o.total}, 0.0), 1)[:, None]  # {producers[o.total][1].origin}"]
    return lines


def reduce_line(r, reduce_block) -> str:
    return f"{r.var.name} = {reduce_block(r, r.operand.name)}  # {r.origin}"

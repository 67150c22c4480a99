"""A pointwise kernel's chain of math calls in blocks: a loop per call (LLVM backend).

Note (blocks for chains of math calls) in codegen/cpp/half_blocks.py says why: in one loop, a
chain of opaque vector math calls (`sin(cos(sin(x)))`, each SLEEF's or libmvec's) runs at the
calls' latency, since each position waits for its previous call and the next position's chain is
beyond the CPU's out-of-order window; in a loop per call over a block of positions, the calls of
one loop are independent and overlap. The rule is the C++ backend's (`chained_calls`,
CHAIN_CALLS), so both backends cut the same kernels. The IR, for each tile's range [start, end):

    blk:    b = start, start + BLOCK, ...; n = min(BLOCK, end - b)
    seg1:   for j in [0, n): read the inputs at b + j, the ops up to the first call
            (that call included), each value a later loop needs into its array
    seg2:   for j in [0, n): the values it needs from their arrays (an input: read again at
            b + j, as cheap as an array), the ops up to the next call
    ...
    segS:   for j in [0, n): the last ops, the writes at b + j

Each array is an `alloca` of BLOCK values in the entry block (a few KiB: the block stays in L1),
and each segment is a plain counted loop, which the loop vectorizer widens as it does the one
loop. float16 needs nothing more: its conversions are already F16C's (llvm/ir.py, Note: half
precision), inline in every loop. Values the same for a whole row (Note: values per row) stay in
the tile block, computed once, and every loop reads them from there.
"""
from __future__ import annotations

from fusec.ir import PointwiseKernel

from ..cpp import half_blocks
from ..cpp.half_blocks import CALLS, chained_calls
from .ir import TYPE, Emitter, emit_load, emit_stmt, emit_store

BLOCK = 256  # positions a block holds (the C++ prelude's FUSEC_BLOCK)


def cut_reason(kernel: PointwiseKernel) -> str | None:
    """Why `kernel` runs in blocks (its comment says so), or None for the one loop."""
    if any(l.valid is not None or l.gather is not None for l in kernel.loads):
        return None  # (a gathered read's position is another load's value: one loop reads both)
    calls = chained_calls(kernel)
    if calls < half_blocks.CHAIN_CALLS:  # (read at each call: one rule for both backends)
        return None
    return f"{calls} math calls in a chain: a loop per call, whose calls overlap (Note: blocks " \
           "for chains of math calls, codegen/cpp/half_blocks.py)"


def segments_of(kernel: PointwiseKernel, per_row: set[str]) -> list[list]:
    """The statements cut after each call (per-row ones left out); the last may be empty."""
    segments: list[list] = [[]]
    for s in kernel.stmts:
        if s.var.name in per_row:
            continue
        segments[-1].append(s)
        if s.op in CALLS:
            segments.append([])
    return segments


def block_loops(kernel: PointwiseKernel, e: Emitter, index, per_row: set[str],
                row_values: dict[str, str]) -> tuple[list[str], list[str]]:
    """(the entry block's allocas, the lines that replace the one inner loop). `index(e, idx,
    label, position)` gives an access's element offset at `position`; `row_values` holds the
    per-row values the tile block computed. The lines start in the tile block (they branch to
    the first loop) and end with a branch to `%tile.done`.

    Why this function is long: it writes the loops in order, each reading what the loops before
    it stored (which values live in arrays, which loop made each one), as half_blocks.block_loop
    does for the C++ backend."""
    segments = segments_of(kernel, per_row)
    # a load is read again (and widened) in each loop that uses it: no array for it
    loads = {l.var.name: l for l in kernel.loads if l.var.name not in per_row}
    made_in: dict[str, int] = {}
    for n, seg in enumerate(segments, start=1):
        made_in.update({s.var.name: n for s in seg})
    used_late = {o.name for n, seg in enumerate(segments, start=1) for s in seg for o in s.operands
                 if hasattr(o, "name") and made_in.get(o.name, n) < n}
    used_late |= {st.var.name for st in kernel.stores if made_in.get(st.var.name, len(segments))
                  < len(segments)}
    dtypes = {v.name: v.dtype for v in [l.var for l in kernel.loads] + [s.var for s in kernel.stmts]}
    allocas = [f"%{name}.blk = alloca [{BLOCK} x {TYPE[dtypes[name]]}], align 64"
               for name in sorted(used_late)]

    lines = e.lines
    lines += ["br label %blk", "", "blk:                                          "
              f"; for each block of {BLOCK} positions in [start, end)",
              "%b = phi i64 [ %start, %tile ], [ %b.next, %blk.done ]",
              f"%b.full = add nuw nsw i64 %b, {BLOCK}",
              "%b.end = call i64 @llvm.umin.i64(i64 %b.full, i64 %end)",
              "%n = sub nuw nsw i64 %b.end, %b", "br label %seg1"]
    last = len(segments)
    for n, seg in enumerate(segments, start=1):
        lines += ["", f"seg{n}:                                        ; for j in [0, n)"
                  + (f": up to call {n}" if n < last else ": the rest"),
                  f"%j{n} = phi i64 [ 0, %{'blk' if n == 1 else f'seg{n - 1}'} ], "
                  f"[ %j{n}.next, %seg{n} ]"]
        position = f"%i{n}"
        reads = sorted({o.name for s in seg for o in s.operands if getattr(o, "name", None)
                        in loads} | ({st.var.name for st in kernel.stores
                                      if st.var.name in loads} if n == last else set()))
        if reads or (n == last and kernel.stores):
            lines.append(f"{position} = add nuw nsw i64 %b, %j{n}")
        values = dict(row_values)
        needed = {o.name for s in seg for o in s.operands if hasattr(o, "name")
                  and o.name in made_in and made_in[o.name] < n}
        if n == last:
            needed |= {st.var.name for st in kernel.stores
                       if st.var.name in made_in and made_in[st.var.name] < n}
        for name in sorted(needed):  # from the arrays of the loops before
            at = e.emit(f"getelementptr inbounds {TYPE[dtypes[name]]}, ptr %{name}.blk, i64 %j{n}",
                        name + ".at")
            values[name] = e.emit(f"load {TYPE[dtypes[name]]}, ptr {at}", name + ".back")
        for name in reads:
            load = loads[name]
            emit_load(e, load.param, load.dtype, index(e, load.index, name, position), load.var,
                      values)
        for s in seg:
            emit_stmt(e, s, values)
        made_here = [name for name in sorted(used_late) if made_in[name] == n]
        for name in made_here:  # into arrays, for the loops after
            at = e.emit(f"getelementptr inbounds {TYPE[dtypes[name]]}, ptr %{name}.blk, i64 %j{n}",
                        name + ".at")
            lines.append(f"store {TYPE[dtypes[name]]} {values[name]}, ptr {at}")
        if n == last:
            for k, store in enumerate(kernel.stores):
                emit_store(e, store.param, store.dtype, index(e, store.index, f"out{k}", position),
                           store.var, values)
        lines += [f"%j{n}.next = add nuw nsw i64 %j{n}, 1",
                  f"%seg{n}.more = icmp slt i64 %j{n}.next, %n",
                  f"br i1 %seg{n}.more, label %seg{n}, label %"
                  + (f"seg{n + 1}" if n < last else "blk.done")]
    lines += ["", "blk.done:", f"%b.next = add nuw nsw i64 %b, {BLOCK}",
              "%b.more = icmp slt i64 %b.next, %end",
              "br i1 %b.more, label %blk, label %tile.done"]
    return allocas, lines

"""LLVM reductions turned inside out: the k loop outside, a block of neighbouring rows inside.

The same layout as the C++ backend's codegen/cpp/columns.py (whose docstring tells why; the
decision is cpu_plan.column_blocks, Note: rows side by side), spelled in LLVM IR. The generic
LLVM reduction (llvm/reduction.py) carries each accumulator in a phi node through the k loop of
one row. Here a block of up to COLUMNS rows shares each k loop, so every loop-carried value is
an array with one entry per row of the block (an `alloca [COLUMNS x T]` in the entry block), and
each k step runs a loop over the block's rows:

    block:                     for each block of rows (threads take ranges of blocks)
      phase0.init:             acc[lane] = init, for each lane
      phase0.k:                for k in [0, K):
        phase0.body:             for lane in [0, lanes): load acc[lane], fold x[k, lane0 + lane]
                                 into it, store it back
      phase0.after:            for each lane: the result, kept in an array for later loops
      ...                      (more phases, the last pass, the row stores: the same shape)

The loop over lanes is a single basic block whose addresses are linear in the lane and whose
arrays are private to the function: LLVM's loop vectorizer turns it into vector loads, math and
stores, as gcc does for the C++ kernel's `#pragma omp simd` loop. The row's coordinates and its
values that need no reduction are recomputed at the top of each lane loop (a few integer
operations); a value kept from an earlier phase is loaded from its array there. A bool is kept
as a byte (i8): an array of i1 is not something the vectorizer handles well.
"""
from __future__ import annotations

from typing import NamedTuple

from fusec.ir import Index, Stmt

from math import prod

from fusec.symbolic import hint

from ..cpu_plan import column_sum_block, heading, thread_choice, work_per_call
from .compiler import Target
from .sizes import launch_functions
from .ir import (TYPE, Emitter, new_counter, finish, kernel_params, convert, coords, emit_load,
                      emit_stmt, emit_store, gather_row, index_sum, is_float)
from .reduction import Accumulator


def render_columns(kernel, columns: int, note: str, target: Target | None = None,
                   short: bool = False) -> str:
    """The kernel as LLVM IR with its loops turned inside out (module docstring): each phase's
    lane loops, then the last pass and the row stores, each a loop over the block's rows.
    `short`: rows of a few values (Note: short rows in lanes, codegen/cpu_plan.py), whose k
    steps are written out one after another inside a single lane loop (see `_Block.k_steps`)."""
    block = _Block(kernel, columns, new_counter(), short)
    plan = kernel.plan
    kept: list[str] = []  # the names kept in arrays by the phases so far
    sections, all_lines = [], list(block.top.lines)
    for phase in plan.phases:
        section, lines, defined = _phase_section(block, phase, kept)
        sections.append(section)
        all_lines += lines
        kept = kept + defined
    store = _store_section(block, kept)
    if store is not None:
        sections.append(store[0])
        all_lines += store[1]
    stores = None
    if plan.row_stores:
        rows = _Lanes(block, "row.stores", kept)
        for n in plan.row_stores:
            rows.store(n)
        stores = rows.section()
        all_lines += rows.e.lines
    last = block.last
    blocks = (last + columns - 1) // columns  # (rounded up; no sign to fix up)
    tiles = prod(kernel.row_shape[:-1]) * blocks
    code = dict(last=block.top.size(last), blocks=block.top.size(blocks),
                full=isinstance(last, int) and last % columns == 0)
    return finish(
        "llvm_reduction_columns.ll.j2", all_lines, target, block.counter,
        launch_functions(kernel, tiles, work_per_call(kernel)), name=kernel.name,
        summary=heading(kernel), source_shape=kernel.source_shape,
        reduce_dims=kernel.reduce_dims, rows=kernel.rows, k=kernel.k, tiles=tiles,
        parallel=str(hint(tiles) > 1 and thread_choice(kernel)[0]).lower(),
        params=kernel_params(kernel), columns=columns, last=last, blocks=blocks, code=code,
        allocas=[f"%{name} = alloca [{columns} x {t}], align 64" for name, t in block.arrays.items()],
        top=block.top.lines, sections=sections, stores=stores, unrolled=note)


class _Block:
    """What every lane loop of a block of rows shares: the kernel, the block's width (`columns`),
    the SSA counter, the load or statement that defines each name, the arrays with one entry per
    lane (allocas in the entry block), and the coordinates of the rows' outer dims (computed once
    per block, in `top`)."""

    def __init__(self, kernel, columns: int, counter, short: bool = False):
        self.kernel, self.columns, self.counter = kernel, columns, counter
        self.short = short
        self.n_rows = len(kernel.row_shape)
        self.last = kernel.row_shape[-1]
        self.producers = {l.var.name: l for l in kernel.loads}
        for item in kernel.body:
            self.producers[item.var.name] = item
        self.arrays: dict[str, str] = {}  # array name -> element type
        self.top = Emitter(counter)
        self.outer = coords(self.top, "%outer", kernel.row_shape[:-1], "c") if self.n_rows > 1 else []

    def array(self, name: str, t: str) -> None:
        """Declare an array of `columns` values of type t (a bool kept as a byte)."""
        self.arrays[name] = "i8" if t == "i1" else t

    def slot(self, e: Emitter, name: str, lane: str) -> str:
        return e.emit(f"getelementptr inbounds [{self.columns} x {self.arrays[name]}], ptr %{name}, "
                      f"i64 0, i64 {lane}", name + ".at")

    def read(self, e: Emitter, name: str, t: str, lane: str) -> str:
        value = e.emit(f"load {self.arrays[name]}, ptr {self.slot(e, name, lane)}", name)
        return e.emit(f"trunc i8 {value} to i1", name) if t == "i1" else value

    def write(self, e: Emitter, name: str, t: str, value: str, lane: str) -> None:
        if t == "i1":
            value = e.emit(f"zext i1 {value} to i8", name)
        e.lines.append(f"store {self.arrays[name]} {value}, ptr {self.slot(e, name, lane)}")

    def k_coords(self, e: Emitter, sid: str) -> list[str]:
        """The coordinates of section sid's k loop variable in the reduced dims."""
        k = f"%{sid}.k"
        return coords(e, k, self.kernel.k_shape, f"{sid}.q") if len(self.kernel.k_shape) > 1 else [k]

    def k_steps(self, e: Emitter, sid: str) -> list[tuple[str, list[str]]]:
        """(k, its coordinates) for each k step one lane loop runs: the k loop's variable, or
        for short rows every k as a constant. Short rows run all their k steps in one lane loop
        (each lane folds its row's K values in turn), so the loads of neighbouring k steps lie
        in the same loop: a 2-wide window's two values are one interleaved load of both,
        where a k loop around the lane loop made each a strided load with a gap, which LLVM
        vectorizes only with a scalar epilogue (half the lanes of a 16-row block)."""
        if not self.short:
            return [(f"%{sid}.k", self.k_coords(e, sid))]
        shape = self.kernel.k_shape
        return [(str(k), [str(k // prod(shape[d + 1:]) % shape[d]) for d in range(len(shape))])
                for k in range(self.kernel.k)]


class _Lanes:
    """One loop over the block's rows: its emitter, its lane, the row's coordinates, bases and
    values (recomputed at its top), and the values kept from earlier phases."""

    def __init__(self, block: _Block, lid: str, kept: list[str], row_values: bool = True):
        self.block = block
        self.id = lid
        self.e = Emitter(block.counter, suffix="." + lid)
        self.lane = f"%{lid}.lane"
        self.bases: dict[str, str] = {}
        self.local: dict[str, str] = {}
        self.c = block.outer + [self.e.named("c_last", f"add nuw nsw i64 %lane0, {self.lane}")]
        if row_values:
            for name in block.kernel.plan.before:  # row values needing no reduction
                item = block.producers[name]
                if isinstance(item, Stmt):
                    emit_stmt(self.e, item, self.local)
                else:  # a load that does not vary along k (a per-row scale, say)
                    emit_load(self.e, item.param, item.dtype,
                              self.gathered(item, self.base(item.index, name)), item.var,
                              self.local)
        for name in kept:
            self.local[name] = block.read(self.e, f"{name}.l", TYPE[block.producers[name].var.dtype],
                                          self.lane)

    def base(self, idx: Index, label: str) -> str:
        if label not in self.bases:
            self.bases[label] = index_sum(self.e, list(zip(self.c, idx.strides[:self.block.n_rows])),
                                          idx.offset, label + ".base")
        return self.bases[label]

    def at(self, idx: Index, label: str, q: list[str]) -> str:
        b = self.base(idx, label)
        kidx = index_sum(self.e, list(zip(q, idx.strides[self.block.n_rows:])), 0, label + ".k")
        if b == "0" or kidx == "0":
            return kidx if b == "0" else b
        return self.e.emit(f"add nsw i64 {b}, {kidx}", label + ".idx")

    def gathered(self, load, idx: str) -> str:
        if load.gather is None:
            return idx
        row = gather_row(self.e, load, self.block.producers[load.gather[0]].var.dtype, self.local)
        return self.e.emit(f"add nsw i64 {idx}, {row}", load.var.name + ".at")

    def elements(self, names: list[str], q: list[str], given: dict[str, int] | None = None):
        """Element values at k coordinates q; one in `given` is read back from the output
        where the phase before kept it (the plan's `keep` or a stash)."""
        for name in names:
            item = self.block.producers[name]
            if given and name in given:
                s = self.block.kernel.stores[given[name]]
                emit_load(self.e, s.param, s.dtype, self.at(s.index, f"out{given[name]}", q),
                          item.var, self.local)
            elif isinstance(item, Stmt):
                emit_stmt(self.e, item, self.local)
            else:
                emit_load(self.e, item.param, item.dtype,
                          self.gathered(item, self.at(item.index, name, q)), item.var,
                          self.local)

    def store(self, n: int, q: list[str] | None = None, var=None) -> None:
        """Store number n (of `var`, default the store's own value) at k coordinates q, or
        at the row's own address for a row output."""
        s = self.block.kernel.stores[n]
        idx = self.at(s.index, f"out{n}", q) if q is not None else self.base(s.index, f"out{n}")
        emit_store(self.e, s.param, s.dtype, idx, var or s.var, self.local)

    def section(self) -> dict:
        return {"id": self.id, "lines": self.e.lines}


class _Phase(NamedTuple):
    """One phase's reductions: its section id, its accumulators, and those float sums that are
    added up in blocks of `kblock` k steps, each block's sum then added into a double total
    (`blocked`; empty when kblock is 0)."""
    sid: str
    accs: list[Accumulator]
    blocked: list[Accumulator]
    kblock: int


def _phase_section(block: _Block, phase, kept: list[str]) -> tuple[dict, list[str], list[str]]:
    """One phase of the loop plan as lane loops: the accumulators' initial values, the k loop
    (each step a lane loop folding in one element per row), the results. Returns the template's
    section, its lines, and the names it keeps in arrays for the loops after it."""
    kernel = block.kernel
    accs = [Accumulator(block.producers[n], in_lanes=True) for n in phase.reduces]
    blocked = [a for a in accs if a.r.op == "sum" and is_float(a.dtype)]
    kblock = column_sum_block(kernel) if blocked else 0
    p = _Phase(f"phase{phase.number}", accs, blocked if kblock else [], kblock)
    for a in accs:
        for state, t, _ in a.states():
            block.array(state, t)
        if a in p.blocked:
            block.array(a.name + ".total", "double")
    init = _init_lanes(block, p)
    block_init, block_after = _block_lanes(block, p)
    kc = Emitter(block.counter)
    steps = block.k_steps(kc, p.sid)
    body = _body_lanes(block, p, phase, kept, steps)
    after, defined = _after_lanes(block, p, phase, kept)
    section = dict(
        id=p.sid, comment=f"phase {phase.number}: " + ", ".join(a.r.op for a in accs),
        init=init.section(), kblock=kblock if blocked else 0,
        block_init=block_init.section(), block_after=block_after.section(),
        k_lines=kc.lines, body=body.section(), after=after.section(), k=kc.size(kernel.k),
        k_steps=block.short)
    lines = init.e.lines + block_init.e.lines + block_after.e.lines + kc.lines + \
        body.e.lines + after.e.lines
    return section, lines, defined


def _init_lanes(block: _Block, p: _Phase) -> _Lanes:
    """Before the k loop: each accumulator's initial value, and a blocked sum's total of 0."""
    init = _Lanes(block, f"{p.sid}.init", [], row_values=False)
    for a in p.accs:
        for state, t, value in a.states():
            if a not in p.blocked:
                block.write(init.e, state, t, value, init.lane)
        if a in p.blocked:
            block.write(init.e, a.name + ".total", "double", "0.0", init.lane)
    return init


def _block_lanes(block: _Block, p: _Phase) -> tuple[_Lanes, _Lanes]:
    """Around each block of k steps, for the blocked sums: a fresh start of the block's sum,
    and after the block its sum added into the double total."""
    block_init = _Lanes(block, f"{p.sid}.block.init", [], row_values=False)
    block_after = _Lanes(block, f"{p.sid}.block.after", [], row_values=False)
    for a in p.blocked:
        t = TYPE[a.dtype]
        block.write(block_init.e, a.name, t, a.states()[0][2], block_init.lane)
        value = block.read(block_after.e, a.name, t, block_after.lane)
        if t != "double":
            value = block_after.e.emit(f"fpext {t} {value} to double", a.name)
        total = block.read(block_after.e, a.name + ".total", "double", block_after.lane)
        total = block_after.e.emit(f"fadd double {total}, {value}", a.name + ".total")
        block.write(block_after.e, a.name + ".total", "double", total, block_after.lane)
    return block_init, block_after


def _body_lanes(block: _Block, p: _Phase, phase, kept: list[str],
                steps: list[tuple[str, list[str]]]) -> _Lanes:
    """The k steps of one lane loop (one, or a short row's all: `_Block.k_steps`): the element
    values the phase reads, the kept value's store (the plan's `keep`, in the last phase), and
    each accumulator's fold, read from its arrays before the first and written back after
    the last."""
    plan, keep = block.kernel.plan, block.kernel.plan.keep
    body = _Lanes(block, f"{p.sid}.body", kept)
    cur = {a.name: {state: block.read(body.e, state, t, body.lane) for state, t, _ in a.states()}
           for a in p.accs}
    names, given = plan.phase_loop(phase)  # (a value the phase before stashed is read back)
    stash = plan.stash_of(phase.number)
    for k, q in steps:
        body.elements(names, q, given)
        if stash:  # keep it where the next phase reads it
            body.e.lines.append(f"; {stash.value}: stashed for phase {phase.number + 1}")
            body.store(stash.store, q, block.producers[stash.value].var)
        if keep and phase is plan.phases[-1] and plan.keep_stored_again():  # (for the last pass)
            body.e.lines.append(f"; {keep.value}: " + ("kept for the last pass" if keep.stores
                                                       else "the output, stored once"))
            body.store(keep.store, q, block.producers[keep.value].var)
        for a in p.accs:
            x = body.local[a.r.operand.name]
            x = convert(body.e, x, a.r.operand.dtype, a.dtype, a.name)
            cur[a.name] = a.fold(body.e, x, cur[a.name], k)
    for a in p.accs:
        for state, t, _ in a.states():
            block.write(body.e, state, t, cur[a.name][state], body.lane)
    return body


def _after_lanes(block: _Block, p: _Phase, phase, kept: list[str]) -> tuple[_Lanes, list[str]]:
    """After the k loop: each reduction's result (a blocked sum's from its total), the row
    values ready after them, all kept in arrays for later loops. Returns the lanes and the
    names they define."""
    after = _Lanes(block, f"{p.sid}.after", kept)
    for a in p.accs:
        final = {state: block.read(after.e, state, t, after.lane) for state, t, _ in a.states()}
        if a in p.blocked:
            t = TYPE[a.dtype]
            total = block.read(after.e, a.name + ".total", "double", after.lane)
            final[a.name] = total if t == "double" else \
                after.e.emit(f"fptrunc double {total} to {t}", a.name)
        after.local[a.r.var.name] = a.result(after.e, final)
    for name in phase.ready:
        item = block.producers[name]
        if isinstance(item, Stmt):
            emit_stmt(after.e, item, after.local)
        else:
            emit_load(after.e, item.param, item.dtype,
                      after.gathered(item, after.base(item.index, name)), item.var, after.local)
    defined = [a.r.var.name for a in p.accs] + list(phase.ready)
    for name in defined:
        t = TYPE[block.producers[name].var.dtype]
        block.array(f"{name}.l", t)
        block.write(after.e, f"{name}.l", t, after.local[name], after.lane)
    return after, defined


def _store_section(block: _Block, kept: list[str]) -> tuple[dict, list[str]] | None:
    """The last pass: element values recomputed at each k and stored (None when there are no
    element stores). Returns the template's section and its lines."""
    kernel = block.kernel
    plan, keep = kernel.plan, kernel.plan.keep
    elem = keep.stores if keep else plan.element_stores
    if not elem:
        return None
    sid = "store"
    kc = Emitter(block.counter)
    body = _Lanes(block, f"{sid}.body", kept)
    given = {keep.value: keep.store} if keep else None
    for _, q in block.k_steps(kc, sid):
        body.elements(keep.last_pass if keep else plan.last_pass, q, given)
        for n in elem:
            body.store(n, q)
    comment = "last pass: element values, stored"
    if keep:
        comment += f" ({keep.value} read back from where the last phase kept it)"
    section = dict(id=sid, comment=comment, init=None, kblock=0, block_init=None,
                   block_after=None, k_lines=kc.lines, body=body.section(), after=None,
                   k=kc.size(kernel.k), k_steps=block.short)
    return section, kc.lines + body.e.lines

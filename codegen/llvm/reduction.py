"""LLVM reductions: a ReductionKernel as LLVM IR text, one function over a range of rows.

Each row runs one loop over k per phase of the kernel's loop plan (`kernel.plan`,
fusec/loop_plan.py: what each loop computes and what follows it is decided in lowering), with an
`Accumulator` per reduction (sum, prod, amax, argmax, ... and Welford-free blocked float sums, as
the C++ backend blocks them: cpu_plan.py), then a last loop that recomputes and stores the
element values.
"""
from __future__ import annotations

import math

from fusec import ops
from fusec.ir import Index, Reduce, Stmt
from fusec.symbolic import is_symbolic

from ..cpu_plan import heading, sum_block, thread_choice, work_per_call
from .compiler import Target
from .sizes import known, launch_functions
from ..unroll_rows import unrolled_or_same

from .ir import (Emitter, SUFFIX, TYPE, new_counter, finish, kernel_params, convert, coords, emit_load, gather_row,
                      emit_stmt, emit_store, index_sum, is_float, kind,
                      literal, round_half)


# ---- reductions --------------------------------------------------------------------------------

NO_NAN = str(2**63 - 1)  # argmax's "no NaN seen yet": larger than any position


class Accumulator:
    """How one Reduce carries its running value through a loop over k: its phi states, the
    instructions that fold in one element, and the final value after the loop."""

    def __init__(self, r: Reduce, in_lanes: bool = False):
        self.r = r
        self.red = ops.REDUCTIONS[r.op]
        self.name = f"acc_{r.var.name}"
        self.dtype = r.operand.dtype if self.red.returns_index else r.acc_dtype
        self.in_lanes = in_lanes  # rows in the lanes of a block (llvm/columns.py): `fold`

    def states(self) -> list[tuple[str, str, str]]:
        """(name, type, initial value) of each loop-carried value."""
        t = TYPE[self.dtype]
        init = literal(self.red.init(self.dtype), self.dtype)
        if self.red.returns_index:  # the running max (or min), and where it is
            states = [(self.name, t, init), (self.name + ".at", "i64", "0")]
            if is_float(self.dtype):  # ... and where the first NaN is
                states.append((self.name + ".nan.at", "i64", NO_NAN))
            return states
        if self.nan_flag:
            return [(self.name, t, init), (self.name + ".nan", "i1", "false")]
        return [(self.name, t, init)]

    @property
    def nan_flag(self) -> bool:
        """Float max/min keep "saw a NaN" apart from the running value (see fold), not in lanes."""
        return self.r.op in ("amax", "amin") and kind(self.dtype) == "f" and not self.in_lanes

    def extreme(self, e: Emitter, acc: str, x: str) -> str:
        """The running max (amax, argmax) or min of acc and x: one instruction. For floats it is
        `maxnum` that may assume no NaN (`nnan`: a NaN element makes the result poison, i.e.
        garbage) and ignore the sign of zero (`nsz`), so it is one vmaxps. torch's max is NaN if
        any element is; llvm.maximum says exactly that, but x86 has no such instruction, and its
        expansion (a NaN test, a signed-zero fix-up, blends) took twice the time of the C++
        kernel. So the callers track NaN beside it, and `result` never reads the garbage."""
        t, d, big = TYPE[self.dtype], self.dtype, self.r.op in ("amax", "argmax")
        fn = {"f": "maxnum" if big else "minnum", "s": "smax" if big else "smin",
              "u": "umax" if big else "umin", "b": "umax" if big else "umin"}[kind(d)]
        flags = "nnan nsz " if is_float(d) else ""
        return e.emit(f"call {flags}{t} @llvm.{fn}.{SUFFIX[d]}({t} {acc}, {t} {x})", self.name)

    def sticky_extreme(self, e: Emitter, acc: str, x: str) -> str:
        """The running float max (min) of rows in lanes (llvm/columns.py), NaN included, as the
        C++ backend's: x replaces acc when larger (smaller) or NaN; a NaN acc stays. (A second
        array of NaN flags beside `extreme`, loaded and stored each k step, doubled the time.)"""
        t = TYPE[self.dtype]
        better = e.emit(f"fcmp {'ogt' if self.r.op == 'amax' else 'olt'} {t} {x}, {acc}", self.name)
        is_nan = e.emit(f"fcmp uno {t} {x}, {x}", self.name + ".nan")
        take = e.emit(f"or i1 {better}, {is_nan}", self.name)
        return e.emit(f"select i1 {take}, {t} {x}, {t} {acc}", self.name)

    def fold(self, e: Emitter, x: str, cur: dict[str, str], k: str) -> dict[str, str]:
        """Instructions folding element x into the current states; returns the next states."""
        t, d, acc = TYPE[self.dtype], self.dtype, cur[self.name]
        op, n = self.r.op, self.name
        if self.red.returns_index:
            # argmax: the running max and beside it the position where it last grew. From one
            # element to the next the chain is a max and a select; a compare-or-and-select
            # chain that also tracked NaN made it 4x slower than gcc's branches.
            k_ = kind(d)
            cmp = "fcmp o" if k_ == "f" else ("icmp s" if k_ == "s" else "icmp u")
            cmp += "gt" if op == "argmax" else "lt"
            better = e.emit(f"{cmp} {t} {x}, {acc}", n)  # strictly: a tie keeps the first
            nxt = {n: self.extreme(e, acc, x),
                   n + ".at": e.emit(f"select i1 {better}, i64 {k}, i64 {cur[n + '.at']}", n)}
            if k_ == "f":  # the first NaN wins: the smallest k of a NaN element (none: NO_NAN)
                is_nan = e.emit(f"fcmp uno {t} {x}, {x}", n + ".nan")
                k_nan = e.emit(f"select i1 {is_nan}, i64 {k}, i64 {NO_NAN}", n + ".nan")
                nxt[n + ".nan.at"] = e.emit(f"call i64 @llvm.smin.i64(i64 {cur[n + '.nan.at']}, "
                                            f"i64 {k_nan})", n + ".nan")
            return nxt
        if op in ("amax", "amin"):
            if self.in_lanes and kind(d) == "f":
                return {n: self.sticky_extreme(e, acc, x)}
            if not self.nan_flag:
                return {n: self.extreme(e, acc, x)}
            # ... and beside it, whether a NaN went by: the vectorizer knows both as reductions
            is_nan = e.emit(f"fcmp uno {t} {x}, {x}", n + ".nan")
            return {n: self.extreme(e, acc, x),
                    n + ".nan": e.emit(f"or i1 {cur[n + '.nan']}, {is_nan}", n + ".nan")}
        k_ = kind(d)
        if op == "sum":
            rhs = f"fadd reassoc {t} {acc}, {x}" if k_ == "f" else \
                (f"or i1 {acc}, {x}" if k_ == "b" else f"add {t} {acc}, {x}")
        elif op == "prod":
            rhs = f"fmul reassoc {t} {acc}, {x}" if k_ == "f" else \
                (f"and i1 {acc}, {x}" if k_ == "b" else f"mul {t} {acc}, {x}")
        elif op == "any":
            rhs = f"or i1 {acc}, {x}"
        elif op == "all":
            rhs = f"and i1 {acc}, {x}"
        else:
            raise NotImplementedError(f"fusec: the llvm backend has no reduction {op!r}")
        return {n: e.emit(rhs, n)}

    def result(self, e: Emitter, final: dict[str, str]) -> str:
        r = self.r
        if self.red.returns_index:
            if not is_float(self.dtype):
                return final[self.name + ".at"]
            # a NaN wins; then the running max may be poison, but it is not the one picked
            nan_at = final[self.name + ".nan.at"]
            saw_nan = e.emit(f"icmp slt i64 {nan_at}, {NO_NAN}", self.name)
            return e.emit(f"select i1 {saw_nan}, i64 {nan_at}, i64 {final[self.name + '.at']}",
                          self.name)
        value = final[self.name]
        if self.nan_flag:
            t = TYPE[self.dtype]
            value = e.emit(f"select i1 {final[self.name + '.nan']}, {t} "
                           f"{literal(math.nan, self.dtype)}, {t} {value}", self.name)
        value = convert(e, value, self.dtype, r.var.dtype, r.var.name)
        return round_half(e, value, r.round_to, r.var.name)


# How many vectors a reduction loop works on per trip (LLVM's "interleave count"; it would pick 4
# for these loops by itself). One, like gcc's loops in the C++ backend. A loop that calls a
# vector math function (softmax's exp) gains nothing from more: the call clobbers every vector
# register, so four running sums are four spills and reloads around every call, and in
# side-by-side runs one was as fast or faster on softmax. It also means a quarter of the loop
# body for LLVM's instruction selection and register allocation: 20-30% less compile time.
REDUCTION_INTERLEAVE = 1


def render_reduction(kernel, target: Target | None = None) -> str:
    """One function over a range of rows; inside a row, one loop over k per reduction phase,
    then a last loop that recomputes and stores the element values (softmax's division, say).
    Python decides everything here (which values each loop needs, the accumulators and their
    phi nodes, blocking of long float sums); the template only lays out the blocks."""
    if not is_symbolic(kernel.row_shape[:1]):  # (a fixed number of rows to unroll)
        kernel, note = unrolled_or_same(kernel)  # a matmul's few activation rows: one loop
    else:
        note = ""
    row = _Row(kernel, new_counter())
    plan, k = kernel.plan, kernel.k
    for name in plan.before:  # row values needing no reduction: once per row, before the loops
        row.row_value(row.top, name)
    sections, all_lines = [], []
    for phase in plan.phases:
        section, lines = _phase_section(row, phase, last=phase is plan.phases[-1])
        sections.append(section)
        all_lines += lines
    store = _store_section(row)
    if store is not None:
        sections.append(store)
        all_lines += store["body"]
    row_stores = Emitter(row.counter)
    for n in plan.row_stores:
        s = kernel.stores[n]
        emit_store(row_stores, s.param, s.dtype, row.base(s.index, f"out{n}"), s.var, row.values)
    all_lines = row.top.lines + all_lines + row_stores.lines
    return finish("llvm_reduction.ll.j2", all_lines, target, row.counter,
                   launch_functions(kernel, kernel.rows, work_per_call(kernel)), name=kernel.name,
                   summary=heading(kernel),
                   source_shape=kernel.source_shape, reduce_dims=kernel.reduce_dims,
                   rows=kernel.rows, k=k, code=dict(k=row.top.size(k)),
                   parallel=str(thread_choice(kernel)[0]).lower(),
                   params=kernel_params(kernel), row_lines=row.top.lines, sections=sections,
                   row_stores=row_stores.lines, unrolled=note)


class _Row:
    """What every loop of one row shares: the row's coordinates and element bases (computed once,
    at the top of the row), its row values (visible everywhere after their definition), and the
    load or statement that defines each name."""

    def __init__(self, kernel, counter):
        self.kernel = kernel
        self.counter = counter
        self.n_rows = len(kernel.row_shape)
        self.top = Emitter(counter)
        self.c = coords(self.top, "%row.i", kernel.row_shape, "c")
        self.values: dict[str, str] = {}
        self.bases: dict[str, str] = {}
        self.producers = {l.var.name: l for l in kernel.loads}
        for item in kernel.body:
            self.producers[item.var.name] = item

    def base(self, idx: Index, label: str) -> str:
        """The row's part of an element index, emitted once at the top of the row."""
        if label not in self.bases:
            self.bases[label] = index_sum(self.top, list(zip(self.c, idx.strides[:self.n_rows])),
                                          idx.offset, label + ".base")
        return self.bases[label]

    def out_index(self, e: Emitter, n: int, q: list[str]) -> str:
        """The element index of store number n at k coordinates q."""
        s = self.kernel.stores[n]
        b = self.base(s.index, f"out{n}")
        kidx = index_sum(e, list(zip(q, s.index.strides[self.n_rows:])), 0, f"out{n}.k")
        return kidx if b == "0" else (b if kidx == "0" else e.emit(f"add nsw i64 {b}, {kidx}", f"out{n}.idx"))

    def elements(self, e: Emitter, names: list[str], local: dict[str, str], k: str, sid: str,
                 given: dict[str, int] | None = None):
        """Recompute element values inside the loop of section `sid`; a value in `given` is read
        back from the output (store number) where the phase before kept it (the plan's `keep`
        or a stash)."""
        kernel, n_rows = self.kernel, self.n_rows
        q = coords(e, k, kernel.k_shape, f"{sid}.q") if len(kernel.k_shape) > 1 else [k]
        for name in names:
            item = self.producers[name]
            if given and name in given:
                s = kernel.stores[given[name]]
                emit_load(e, s.param, s.dtype, self.out_index(e, given[name], q), item.var, local)
            elif isinstance(item, Stmt):
                emit_stmt(e, item, local)
            else:
                b = self.base(item.index, name)
                kidx = index_sum(e, list(zip(q, item.index.strides[n_rows:])), 0, name + ".k")
                idx = kidx if b == "0" else (b if kidx == "0" else e.emit(f"add nsw i64 {b}, {kidx}", name + ".idx"))
                emit_load(e, item.param, item.dtype, self.gathered(e, item, idx, local), item.var, local)
        return q

    def row_value(self, e: Emitter, name: str) -> None:
        """A value that does not vary along k, into the row values."""
        item = self.producers[name]
        if isinstance(item, Stmt):
            emit_stmt(e, item, self.values)
        else:  # a load that does not vary along k (a per-row scale, say)
            emit_load(e, item.param, item.dtype,
                      self.gathered(e, item, self.base(item.index, name), self.values),
                      item.var, self.values)

    def gathered(self, e: Emitter, load, idx: str, local: dict[str, str]) -> str:
        """idx, plus the row a gathered read's index value names (fusec.ir.Load's `gather`)."""
        if load.gather is None:
            return idx
        pos = load.gather[0]
        row = gather_row(e, load, self.producers[pos].var.dtype, {**self.values, **local})
        return e.emit(f"add nsw i64 {idx}, {row}", load.var.name + ".at")


class _PhaseCode:
    """The instructions of one phase's blocks, which the template lays out: the loop body, the
    phi nodes at its top, for a blocked float sum the phis and the adds around each block of k,
    and what follows the loop (the results)."""

    def __init__(self, sid: str, kblock: int, blocked: list[Accumulator], counter):
        self.sid, self.kblock, self.blocked = sid, kblock, blocked
        self.before, self.phis, self.block_phis, self.block_after, self.after = \
            (Emitter(counter) for _ in range(5))
        self.body = Emitter(counter, suffix="." + sid)


def _phase_section(row: _Row, phase, last: bool) -> tuple[dict, list[str]]:
    """One phase of the loop plan: its loop over k (when K > 0), then the reductions' results
    and the row values ready after them. Returns the template's section and its lines."""
    k = row.kernel.k
    sid = f"phase{phase.number}"
    reds = [Accumulator(row.producers[n]) for n in phase.reduces]
    blocked = [a for a in reds if a.r.op == "sum" and is_float(a.dtype)]
    kblock = sum_block(k) if blocked and k else 0
    code = _PhaseCode(sid, kblock, blocked, row.counter)
    if k:
        finals = _phase_loop(row, code, phase, reds, last)
    else:  # no elements: each reduction's initial value
        finals = {a.name: {state: init for state, _, init in a.states()} for a in reds}
    for a in reds:
        row.values[a.r.var.name] = a.result(code.after, finals[a.name])
    for name in phase.ready:
        row.row_value(code.after, name)
    # where a block ends: K a multiple of the block gives every block the same constant
    # trip count, so the vectorizer needs no remainder loop (less code, faster to compile)
    block_end = [f"%{sid}.k.end = add i64 %{sid}.kb, {kblock}"] \
        if kblock and known(k) is not None and k % kblock == 0 \
        else [f"%{sid}.kb.end = add i64 %{sid}.kb, {kblock}",
              f"%{sid}.k.end = call i64 @llvm.umin.i64(i64 %{sid}.kb.end, i64 {code.after.size(k)})"]
    sec = dict(id=sid, comment=f"phase {phase.number}: " + ", ".join(a.r.op for a in reds),
               before=code.before.lines, phis=code.phis.lines, body=code.body.lines,
               after=code.after.lines, kblock=kblock, block_phis=code.block_phis.lines,
               block_after=code.block_after.lines, loop=bool(k), block_end=block_end,
               interleave=REDUCTION_INTERLEAVE)
    return sec, code.body.lines + code.after.lines + code.phis.lines


def _phase_loop(row: _Row, code: _PhaseCode, phase, reds: list[Accumulator],
                last: bool) -> dict[str, dict[str, str]]:
    """The loop body: the element values the phase reads, the kept value's store (the plan's
    `keep`, in the last phase), and each reduction's fold into its phi states. Returns each
    accumulator's states after the loop."""
    plan, sid, body = row.kernel.plan, code.sid, code.body
    keep, stash = plan.keep, plan.stash_of(phase.number)
    kvar = f"%{sid}.k"
    local = dict(row.values)
    names, given = plan.phase_loop(phase)  # (a value the phase before stashed is read back)
    q = row.elements(body, names, local, kvar, sid, given)
    if stash:  # keep it where the next phase reads it
        s = row.kernel.stores[stash.store]
        body.lines.append(f"; {stash.value}: stashed for phase {phase.number + 1}")
        emit_store(body, s.param, s.dtype, row.out_index(body, stash.store, q),
                   row.producers[stash.value].var, local)
    if keep and last and plan.keep_stored_again():  # keep it where the last pass reads it
        s = row.kernel.stores[keep.store]
        body.lines.append(f"; {keep.value}: " + ("kept for the last pass" if keep.stores
                                                 else "the output, stored once: no last pass"))
        emit_store(body, s.param, s.dtype, row.out_index(body, keep.store, q),
                   row.producers[keep.value].var, local)
    finals: dict[str, dict[str, str]] = {}
    for a in reds:
        x = local[a.r.operand.name]
        x = convert(body, x, a.r.operand.dtype, a.dtype, a.name)
        nxt = a.fold(body, x, {state: f"%{state}" for state, _, _ in a.states()}, kvar)
        _carry(code, a, nxt)
        if code.kblock and a in code.blocked:
            finals[a.name] = _block_total(code, a, nxt)
        else:
            finals[a.name] = nxt
    return finals


def _carry(code: _PhaseCode, a: Accumulator, nxt: dict[str, str]) -> None:
    """The phi nodes that carry a's states around the k loop. With blocks of k, a blocked sum
    starts at 0 in every block; any other state is carried across the blocks too."""
    sid, kblock = code.sid, code.kblock
    loop_id, entry = f"{sid}.loop", (f"{sid}.block" if kblock else sid)
    for state, t, init in a.states():
        if kblock and a in code.blocked:  # a block sum starts at 0 in every block
            code.phis.lines.append(f"%{state} = phi {t} [ {init}, %{entry} ], "
                                   f"[ {nxt[state]}, %{loop_id} ]")
        elif kblock:  # carried across blocks too
            code.block_phis.lines.append(f"%{state}.outer = phi {t} [ {init}, %{sid} ], "
                                         f"[ {nxt[state]}, %{sid}.block.done ]")
            code.phis.lines.append(f"%{state} = phi {t} [ %{state}.outer, %{entry} ], "
                                   f"[ {nxt[state]}, %{loop_id} ]")
        else:
            code.phis.lines.append(f"%{state} = phi {t} [ {init}, %{entry} ], "
                                   f"[ {nxt[state]}, %{loop_id} ]")


def _block_total(code: _PhaseCode, a: Accumulator, nxt: dict[str, str]) -> dict[str, str]:
    """A blocked float sum: each block's sum added into a double total after the block; the
    final value is the total, narrowed back to the sum's type after the loop."""
    sid, t = code.sid, TYPE[a.dtype]
    total = f"%{a.name}.total"
    code.block_phis.lines.append(f"{total} = phi double [ 0.0, %{sid} ], "
                                 f"[ {total}.next, %{sid}.block.done ]")
    if t == "double":
        code.block_after.lines.append(f"{total}.next = fadd double {total}, {nxt[a.name]}")
    else:
        code.block_after.lines.append(f"%{a.name}.wide = fpext {t} {nxt[a.name]} to double")
        code.block_after.lines.append(f"{total}.next = fadd double {total}, %{a.name}.wide")
    final = f"{total}.next" if t == "double" else \
        code.after.emit(f"fptrunc double {total}.next to {t}", a.name)
    return {a.name: final}


def _store_section(row: _Row) -> dict | None:
    """The last pass: element values recomputed and stored (None when there are none, or K is
    0). The kept value, if it is itself the output, is already stored."""
    kernel = row.kernel
    plan, keep = kernel.plan, kernel.plan.keep
    elem = keep.stores if keep else plan.element_stores
    if not (elem and kernel.k):
        return None
    sid = "store"
    body = Emitter(row.counter, suffix="." + sid)
    local = dict(row.values)
    given = {keep.value: keep.store} if keep else None
    q = row.elements(body, keep.last_pass if keep else plan.last_pass, local, f"%{sid}.k",
                     sid, given)
    for n in elem:
        s = kernel.stores[n]
        emit_store(body, s.param, s.dtype, row.out_index(body, n, q), s.var, local)
    comment = "last pass: element values, stored"
    if keep:
        comment += f" ({keep.value} read back from where the last phase kept it)"
    return dict(id=sid, comment=comment, before=[], phis=[], body=body.lines, after=[], kblock=0,
                block_phis=[], block_after=[], loop=True, interleave=REDUCTION_INTERLEAVE)

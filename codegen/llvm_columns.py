"""LLVM reductions turned inside out: the k loop outside, a block of neighbouring rows inside.

The same layout as the C++ backend's codegen/cpp_columns.py (whose docstring tells why; the
decision is cpu_plan.column_blocks, Note: rows side by side), spelled in LLVM IR. The generic
LLVM reduction (llvm_reduction.py) carries each accumulator in a phi node through the k loop of
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

from fusec.ir import Index, Stmt

from .cpu_plan import PARALLEL_THRESHOLD, column_sum_block, summary
from .llvm_build import Target
from .llvm_ir import (TYPE, Emitter, new_counter, finish, kernel_params, convert, coords, emit_load,
                      emit_stmt, emit_store, gather_row, index_sum, is_float)
from .llvm_reduction import Accumulator


def render_columns(kernel, columns: int, note: str, target: Target | None = None) -> str:
    """The kernel as LLVM IR with its loops turned inside out (module docstring)."""
    counter = new_counter()
    n_rows = len(kernel.row_shape)
    last = kernel.row_shape[-1]
    blocks = -(-last // columns)
    producers = {l.var.name: l for l in kernel.loads}
    for item in kernel.body:
        producers[item.var.name] = item
    plan, keep = kernel.plan, kernel.plan.keep
    arrays: dict[str, str] = {}  # array name -> element type (allocas in the entry block)
    top = Emitter(counter)  # once per block: the coordinates of the rows' outer dims
    outer = coords(top, "%outer", kernel.row_shape[:-1], "c") if n_rows > 1 else []

    def array(name: str, t: str) -> None:
        arrays[name] = "i8" if t == "i1" else t

    def slot(e: Emitter, name: str, lane: str) -> str:
        return e.emit(f"getelementptr inbounds [{columns} x {arrays[name]}], ptr %{name}, "
                      f"i64 0, i64 {lane}", name + ".at")

    def read(e: Emitter, name: str, t: str, lane: str) -> str:
        value = e.emit(f"load {arrays[name]}, ptr {slot(e, name, lane)}", name)
        return e.emit(f"trunc i8 {value} to i1", name) if t == "i1" else value

    def write(e: Emitter, name: str, t: str, value: str, lane: str) -> None:
        if t == "i1":
            value = e.emit(f"zext i1 {value} to i8", name)
        e.lines.append(f"store {arrays[name]} {value}, ptr {slot(e, name, lane)}")

    class Lanes:
        """One loop over the block's rows: its emitter, its lane, the row's coordinates, bases and
        values (recomputed at its top), and the values kept from earlier phases."""

        def __init__(self, lid: str, kept: list[str], row_values: bool = True):
            self.id = lid
            self.e = Emitter(counter, suffix="." + lid)
            self.lane = f"%{lid}.lane"
            self.bases: dict[str, str] = {}
            self.local: dict[str, str] = {}
            self.c = outer + [self.e.named("c_last", f"add nuw nsw i64 %lane0, {self.lane}")]
            if row_values:
                for name in plan.before:  # row values needing no reduction
                    item = producers[name]
                    if isinstance(item, Stmt):
                        emit_stmt(self.e, item, self.local)
                    else:  # a load that does not vary along k (a per-row scale, say)
                        emit_load(self.e, item.param, item.dtype,
                                  self.gathered(item, self.base(item.index, name)), item.var,
                                  self.local)
            for name in kept:
                self.local[name] = read(self.e, f"{name}.l", TYPE[producers[name].var.dtype],
                                        self.lane)

        def base(self, idx: Index, label: str) -> str:
            if label not in self.bases:
                self.bases[label] = index_sum(self.e, list(zip(self.c, idx.strides[:n_rows])),
                                              idx.offset, label + ".base")
            return self.bases[label]

        def at(self, idx: Index, label: str, q: list[str]) -> str:
            b = self.base(idx, label)
            kidx = index_sum(self.e, list(zip(q, idx.strides[n_rows:])), 0, label + ".k")
            if b == "0" or kidx == "0":
                return kidx if b == "0" else b
            return self.e.emit(f"add nsw i64 {b}, {kidx}", label + ".idx")

        def gathered(self, load, idx: str) -> str:
            if load.gather is None:
                return idx
            row = gather_row(self.e, load, producers[load.gather[0]].var.dtype, self.local)
            return self.e.emit(f"add nsw i64 {idx}, {row}", load.var.name + ".at")

        def elements(self, names: list[str], q: list[str], given: dict[str, int] | None = None):
            """Element values at k coordinates q; one in `given` is read back from the output
            where the last phase kept it (the plan's `keep`)."""
            for name in names:
                item = producers[name]
                if given and name in given:
                    s = kernel.stores[given[name]]
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
            s = kernel.stores[n]
            idx = self.at(s.index, f"out{n}", q) if q is not None else self.base(s.index, f"out{n}")
            emit_store(self.e, s.param, s.dtype, idx, var or s.var, self.local)

        def section(self) -> dict:
            return {"id": self.id, "lines": self.e.lines}

    def k_coords(e: Emitter, sid: str) -> list[str]:
        k = f"%{sid}.k"
        return coords(e, k, kernel.k_shape, f"{sid}.q") if len(kernel.k_shape) > 1 else [k]

    kept: list[str] = []
    sections, all_lines = [], list(top.lines)
    for phase in plan.phases:
        sid = f"phase{phase.number}"
        accs = [Accumulator(producers[n]) for n in phase.reduces]
        blocked = [a for a in accs if a.r.op == "sum" and is_float(a.dtype)]
        kblock = column_sum_block(kernel) if blocked else 0
        for a in accs:
            for state, t, _ in a.states():
                array(state, t)
            if a in blocked and kblock:
                array(a.name + ".total", "double")
        init = Lanes(f"{sid}.init", [], row_values=False)
        for a in accs:
            for state, t, value in a.states():
                if not (kblock and a in blocked):
                    write(init.e, state, t, value, init.lane)
            if kblock and a in blocked:
                write(init.e, a.name + ".total", "double", "0.0", init.lane)
        block_init = Lanes(f"{sid}.block.init", [], row_values=False)
        block_after = Lanes(f"{sid}.block.after", [], row_values=False)
        for a in (blocked if kblock else []):
            t = TYPE[a.dtype]
            write(block_init.e, a.name, t, a.states()[0][2], block_init.lane)
            value = read(block_after.e, a.name, t, block_after.lane)
            if t != "double":
                value = block_after.e.emit(f"fpext {t} {value} to double", a.name)
            total = read(block_after.e, a.name + ".total", "double", block_after.lane)
            total = block_after.e.emit(f"fadd double {total}, {value}", a.name + ".total")
            write(block_after.e, a.name + ".total", "double", total, block_after.lane)
        kc = Emitter(counter)
        q = k_coords(kc, sid)
        body = Lanes(f"{sid}.body", kept)
        body.elements(phase.loop, q)
        if keep and phase is plan.phases[-1]:  # keep it where the last pass reads it
            body.e.lines.append(f"; {keep.value}: " + ("kept for the last pass" if keep.stores
                                                       else "the output, stored once"))
            body.store(keep.store, q, producers[keep.value].var)
        for a in accs:
            cur = {state: read(body.e, state, t, body.lane) for state, t, _ in a.states()}
            x = body.local[a.r.operand.name]
            x = convert(body.e, x, a.r.operand.dtype, a.dtype, a.name)
            nxt = a.fold(body.e, x, cur, f"%{sid}.k")
            for state, t, _ in a.states():
                write(body.e, state, t, nxt[state], body.lane)
        after = Lanes(f"{sid}.after", kept)
        for a in accs:
            final = {state: read(after.e, state, t, after.lane) for state, t, _ in a.states()}
            if kblock and a in blocked:
                t = TYPE[a.dtype]
                total = read(after.e, a.name + ".total", "double", after.lane)
                final[a.name] = total if t == "double" else \
                    after.e.emit(f"fptrunc double {total} to {t}", a.name)
            after.local[a.r.var.name] = a.result(after.e, final)
        for name in phase.ready:
            item = producers[name]
            if isinstance(item, Stmt):
                emit_stmt(after.e, item, after.local)
            else:
                emit_load(after.e, item.param, item.dtype,
                          after.gathered(item, after.base(item.index, name)), item.var, after.local)
        defined = [a.r.var.name for a in accs] + list(phase.ready)
        for name in defined:
            t = TYPE[producers[name].var.dtype]
            array(f"{name}.l", t)
            write(after.e, f"{name}.l", t, after.local[name], after.lane)
        kept = kept + defined
        sections.append(dict(
            id=sid, comment=f"phase {phase.number}: " + ", ".join(a.r.op for a in accs),
            init=init.section(), kblock=kblock if blocked else 0,
            block_init=block_init.section(), block_after=block_after.section(),
            k_lines=kc.lines, body=body.section(), after=after.section(), k=kernel.k))
        all_lines += init.e.lines + block_init.e.lines + block_after.e.lines + kc.lines + \
            body.e.lines + after.e.lines

    elem = keep.stores if keep else plan.element_stores
    if elem:
        sid = "store"
        kc = Emitter(counter)
        q = k_coords(kc, sid)
        body = Lanes(f"{sid}.body", kept)
        given = {keep.value: keep.store} if keep else None
        body.elements(keep.last_pass if keep else plan.last_pass, q, given)
        for n in elem:
            body.store(n, q)
        comment = "last pass: element values, stored"
        if keep:
            comment += f" ({keep.value} read back from where the last phase kept it)"
        sections.append(dict(id=sid, comment=comment, init=None, kblock=0, block_init=None,
                             block_after=None, k_lines=kc.lines, body=body.section(), after=None,
                             k=kernel.k))
        all_lines += kc.lines + body.e.lines
    stores = None
    if plan.row_stores:
        rows = Lanes("row.stores", kept)
        for n in plan.row_stores:
            rows.store(n)
        stores = rows.section()
        all_lines += rows.e.lines
    tiles = (kernel.rows // last) * blocks
    return finish(
        "llvm_reduction_columns.ll.j2", all_lines, target, name=kernel.name,
        summary=summary(kernel), source_shape=kernel.source_shape,
        reduce_dims=kernel.reduce_dims, rows=kernel.rows, k=kernel.k, tiles=tiles,
        parallel=str(tiles > 1 and kernel.rows * kernel.k >= PARALLEL_THRESHOLD).lower(),
        params=kernel_params(kernel), columns=columns, last=last, blocks=blocks,
        allocas=[f"%{name} = alloca [{columns} x {t}], align 64" for name, t in arrays.items()],
        top=top.lines, sections=sections, stores=stores, unrolled=note)

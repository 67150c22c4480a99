"""The memory plan: where every intermediate buffer lives, decided once per program.

The schedule (passes/schedule.py) lists the steps and the root buffers each reads and writes.
After lowering, the driver (fusec/driver.py) plans memory over that list, in two parts:

1. `plan_inplace`: which kernel outputs can be written over an input that dies in the same
   kernel (see "Note (writing over a dying input)" below). It needs the kernels' index
   expressions, so it runs on the lowered kernel IR;
2. `plan_memory`: every other intermediate buffer a kernel writes gets an offset in one pool,
   reusing the bytes of buffers whose last reader has run. The outputs chosen in 1 take no bytes.

        step 1  kernel writes a (4 KB)     pool: a @ 0
        step 2  kernel reads a, writes b   pool: a @ 0, b @ 4096
        step 3  kernel reads b, writes c   pool: c @ 0 (a is dead), b @ 4096

Both results go into the Compilation record (fusec/record.py: `memory`, `inplace`); the program
(fusec/runtime/program.py) carves its buffers out of one pool by them.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fusec.codegen import backends
from fusec.ir import Layout, TensorMeta
from fusec.symbolic import hint
from fusec.record import MemoryPlan, Placement, Step, layout_of, owns_buffer, record_of

ALIGN = 64  # bytes: every planned buffer starts on a cache line (and a 16-byte vector boundary)


def plan_memory(gm: fx.GraphModule, steps: list[Step] | None = None,
                skip=frozenset()) -> MemoryPlan:
    """Assign every intermediate kernel output an offset in one pool, reusing memory by liveness.

    1. a buffer is live from the step that writes it to the last step that reads it (through any
       view of it: views fold into indices, so their reader reads the root);
    2. buffers are placed in the order they are written; each takes the lowest offset where it
       overlaps no buffer still live at that time (first fit in the address space).
    Buffers in `skip` get no place: they are written over another buffer (see plan_inplace).
    `steps` defaults to the graph's schedule (`record_of(gm).schedule`).
    """
    steps = record_of(gm).schedule if steps is None else steps
    by_name = {n.name: n for n in gm.graph.nodes}
    escaped = _escaped(gm)
    first, last = {}, {}
    for i, step in enumerate(steps):
        for name in step.reads:
            last[name] = i
        if step.kind == "kernel":
            for name in step.writes:
                first.setdefault(name, i)
                last.setdefault(name, i)
    names = [name for name in sorted(first, key=first.__getitem__)
             if name not in escaped and name not in skip]
    buffers = [(_nbytes(by_name[name].meta["fusec"]), first[name], last[name])
               for name in names]
    offsets, pool_bytes = first_fit(buffers)
    plan = MemoryPlan(pool_bytes=pool_bytes)
    for name, (nbytes, start, end), offset in zip(names, buffers, offsets):
        if nbytes:
            plan.placements[name] = Placement(name, offset, nbytes, start, end)
            plan.naive_bytes += _align(nbytes)
    return plan


def first_fit(buffers: list[tuple[int, int, int]]) -> tuple[list[int], int]:
    """Offsets in one pool for buffers given as (bytes, first step, last step), in the order they
    are written, and the pool's size: each buffer takes the lowest offset where it overlaps no
    buffer still live at its first step (one whose last step is not before it). An empty buffer
    gets offset 0 and takes no room.

    plan_memory runs it once at the sizes a program was compiled for; a shape family's program
    (fusec/runtime/family_pool.py) runs it again at each new size it keeps buffers for."""
    offsets, live, pool_bytes = [], [], 0
    for nbytes, start, end in buffers:
        if nbytes == 0:
            offsets.append(0)
            continue
        live = [p for p in live if p[3] >= start]  # buffers whose last use has passed are free
        offset = 0
        for placed_at, placed_bytes, _, _ in sorted(live):
            if offset + nbytes <= placed_at:
                break
            offset = max(offset, _align(placed_at + placed_bytes))
        live.append((offset, nbytes, start, end))
        offsets.append(offset)
        pool_bytes = max(pool_bytes, _align(offset + nbytes))
    return offsets, pool_bytes


def _escaped(gm: fx.GraphModule) -> set[str]:
    """Root buffers that must outlive the call or that something else aliases: the program's
    outputs, and the arguments of an extern that returns a view of them."""
    escaped = {layout_of(a).root for a in gm.graph.output_node().all_input_nodes
               if layout_of(a) is not None}
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) \
                and owns_buffer(n) \
                and any(r.alias_info is not None for r in n.target._schema.returns):
            escaped |= {layout_of(a).root for a in n.all_input_nodes if layout_of(a) is not None}
    return escaped


# Note (writing over a dying input): softmax over attention scores reads a (B, H, T, T) buffer
# that bmm just allocated and that nothing reads afterwards, and writes a buffer of the same size:
# for a moment both are live, 2 x 12.6 MB in a bf16 GPT-2 block. When a kernel's output has the
# same shape, strides and dtype as such an input, and the kernel reads each element of the input
# exactly where it writes the same element of the output (same index), the output can simply be
# written over the input: every element is read before it is overwritten, by the same program
# instance. torch.compile's Inductor does the same ("inplace" buffer reuse).
#
# Only extern results qualify: ATen allocated them for this call, so nobody else holds them
# (program inputs belong to the caller; pool buffers are planned already). Only the Triton
# backend does it: its pointers make no promise that two of them never alias, while the C++ and
# LLVM kernels declare every pointer `__restrict__`/`noalias`, and the C++ reductions keep values
# in their output between passes (the loop plan's `keep`), which an input in the same memory
# would not survive. CPU memory is rarely what limits a CPU program anyway.

def plan_inplace(gm: fx.GraphModule, irs: dict, backend: str) -> dict[str, str]:
    """Kernel output -> the extern result it is written over (see the note above).

    `irs` maps each kernel step's name to its kernel IR (fusec/ir.py): whether an element is read
    where it is written is a fact of the lowered kernel's indices, not of the graph."""
    # an indexed write (`cache[:, :, pos] = k`) is written over its buffer on every backend
    chosen: dict[str, str] = {s.param: s.param for ir in irs.values() for s in ir.stores
                              if getattr(s, "scatter", None) is not None}
    if not backends.get(backend).writes_over_dying_inputs:
        return chosen
    steps = record_of(gm).schedule
    by_name = {n.name: n for n in gm.graph.nodes}
    escaped = _escaped(gm)
    last: dict[str, int] = {}
    for i, step in enumerate(steps):
        for name in step.reads:
            last[name] = i
    fresh = {s.node for s in steps if s.kind == "extern" and s.writes == [s.node]
             and owns_buffer(by_name[s.node])}
    for i, step in enumerate(steps):
        if step.kind != "kernel":
            continue
        ir = irs[step.name]
        space = ir.shape if hasattr(ir, "shape") else ir.row_shape + ir.k_shape
        for store in ir.stores:
            if any(st == 0 and n > 1 for st, n in zip(store.index.strides, space)):
                continue  # a broadcast store (a row result): several positions, one address
            out = layout_of(by_name[store.param])
            for name in dict.fromkeys(l.param for l in ir.loads):
                if name not in fresh or name in escaped or last.get(name) != i \
                        or name in chosen.values():
                    continue
                loads = [l for l in ir.loads if l.param == name]
                src = layout_of(by_name[name])
                # the same bytes: equal spans, and every element read where it is written
                if _span(src) == _span(out) and src.offset == out.offset == 0 \
                        and by_name[name].meta["fusec"].dtype == store.dtype \
                        and all(l.index == store.index and l.dtype == store.dtype for l in loads) \
                        and sum(st.param == store.param for st in ir.stores) == 1:
                    chosen[store.param] = name
                    break
    return chosen


def _span(layout: Layout) -> int:
    """How many elements a layout's memory spans, from its first element to its last."""
    if any(n == 0 for n in layout.shape):
        return 0
    return 1 + sum((n - 1) * abs(st) for n, st in zip(layout.shape, layout.stride))


def _nbytes(m: TensorMeta) -> int:
    """The bytes a buffer spans; a shape family's at the sizes it was traced with (its program
    plans again at each call's sizes: fusec/runtime/family_pool.py)."""
    return span_bytes(hint(tuple(m.shape)), hint(tuple(m.stride)), m.dtype)


def span_bytes(shape, stride, dtype: torch.dtype) -> int:
    """The bytes from a tensor's first element to its last, 0 if it has none."""
    if any(s == 0 for s in shape):
        return 0
    span = 1 + sum((size - 1) * abs(st) for size, st in zip(shape, stride))
    return span * torch.empty((), dtype=dtype).element_size()


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN

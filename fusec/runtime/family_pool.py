"""A shape family's pool: a program's intermediate buffers carved out of one allocation per size.

A static program keeps its intermediate buffers in one pool, planned once (passes/memory.py) and
carved once (Program._bind_pool): a call allocates nothing but its outputs. A shape family's
program learns its buffers' sizes only from a call. So it plans per size: the first call at a
size runs the same first-fit plan (`first_fit`) over that size's byte counts, allocates one pool
and carves every buffer's view out of it; a later call at that size gets the same views back from
a dict. The straight-line program (fusec/runtime/writer.py) starts with

    _v = _pool_views.get(x_size0)   # this size's intermediate buffers, if kept
    if _v is None:
        _v = _pool.carve(x_size0, (((x_size0, 64), (64, 1)), ...),
                         ((1, (64, x_size0), (1, 64), 0),), ())
    _pool.in_use = _v               # (a CUDA graph captured now keeps them)
    s3, s5, s8, s9 = _v             # s9: a view of s5 (an extern's input), kept with the pool

The views of those buffers that the program hands to extern ops (`s9`: the transpose of `s5`
a matmul reads, `pooled_views`) are carved with them, once per size, as a static program makes
them once (fusec/runtime/writer.py `_emit_view`): a training step's backward makes dozens.

A tensor that depends on the sizes alone (the position ids `arange(0, seq_len)` of a language
model, `made_per_size`) is made with them too, once per size, where a static program has it as a
constant (passes/fold_constants.py).

Why: a model's forward has a dozen such buffers or more, allocating each on every call is Python
time that counts at short prompts (docs/performance.md, "Shape families on the CPU"), and a server
calls a model many times at each batch size. The pools of
the last KEEP sizes are kept, the oldest dropped first, so 500 prompt lengths keep at most KEEP
pools alive (a CUDA graph captured at a size keeps that size's: fusec/runtime/cuda_graphs.py). A
program keeping a pool runs one call at a time (fusec/runtime/threads.py), as a static one does.
"""
from __future__ import annotations

import torch

from fusec.passes.memory import first_fit, span_bytes

KEEP = 4  # sizes whose pools are kept


class FamilyPool:
    """The pools of a shape family's program, one per size, for its planned buffers.

    `buffers`: (dtype, first step, last step) of each planned buffer, in the order the program
    writes them; `carve` takes each one's (shape, stride) at a call's sizes, in the same order."""

    def __init__(self, device: str, buffers: list[tuple[torch.dtype, int, int]]):
        self.device = torch.device(device)
        self.buffers = list(buffers)
        self.kept: dict = {}  # sizes -> the views of that size's pool, oldest first
        self.in_use: tuple = ()  # the views the running (or last) call took

    def __repr__(self) -> str:
        return (f"FamilyPool({str(self.device)!r}, {self.buffers!r})")

    def carve(self, key, layouts: tuple, views: tuple = (),
              more: tuple = ()) -> tuple[torch.Tensor, ...]:
        """Plan, allocate and carve the pool for the sizes `key`; keep it; return its views:
        one per buffer (`layouts`), then one per `views` entry, (k, shape, stride, offset): a
        view of the k-th view returned, at that offset from its own; then the tensors `more`
        (`made_per_size`'s, computed for these sizes), kept with them."""
        sized = [(span_bytes(shape, stride, dtype), first, last)
                 for (shape, stride), (dtype, first, last) in zip(layouts, self.buffers)]
        offsets, nbytes = first_fit(sized)
        pool = torch.empty(max(nbytes, 64), dtype=torch.uint8, device=self.device)
        typed: dict = {}  # the pool seen as each dtype (its size is a multiple of 64 bytes)
        made = []
        for (shape, stride), (dtype, _, _), offset in zip(layouts, self.buffers, offsets):
            if dtype not in typed:
                typed[dtype] = pool.view(dtype)
            made.append(typed[dtype].as_strided(shape, stride,
                                                offset // typed[dtype].element_size()))
        for k, shape, stride, offset in views:
            made.append(made[k].as_strided(shape, stride, made[k].storage_offset() + offset))
        if len(self.kept) >= KEEP:
            self.kept.pop(next(iter(self.kept)))
        self.kept[key] = made = (*made, *more)
        return made


def pooled_views(steps: list, pooled: set, outputs: set) -> list:
    """The ViewSteps among `steps` whose root is one of the `pooled` slots (a family's buffers in
    its pool) or such a view, and which are not program outputs (a caller may keep an output
    past the next call): the views `carve` makes once per size."""
    from fusec.runtime.steps import ViewStep
    found, kept = [], set(pooled)
    for step in steps:
        if isinstance(step, ViewStep) and step.root in kept and step.out_slot not in outputs:
            found.append(step)
            kept.add(step.out_slot)
    return found


# ATen factories whose result depends on their arguments alone (no random numbers, no memory
# that is not fresh): a shape family's program may make one once per size (`made_per_size`).
FACTORIES = {torch.ops.aten.arange.default, torch.ops.aten.arange.start,
             torch.ops.aten.arange.start_step}


def made_per_size(steps: list, outputs: set, reads) -> list:
    """The extern steps among `steps` that a shape family's pool makes once per size: calls of
    FACTORIES on sizes and constants only (no slot among their arguments: `reads(step)`, the
    slots a step reads, is empty), whose result is not a program output and is read by kernels
    only (which never keep it, nor write over it: a kernel written over a dying extern result,
    passes/memory.py `plan_inplace`, is left out)."""
    from fusec.runtime.steps import ExternStep, KernelStep
    over = {w.inplace for step in steps if isinstance(step, KernelStep) for w in step.writes}
    read_by: dict = {}
    for step in steps:
        for slot in reads(step):
            read_by.setdefault(slot, []).append(step)
    return [step for step in steps if isinstance(step, ExternStep) and step.target in FACTORIES
            and step.out_slot not in outputs and step.out_slot not in over and not reads(step)
            and all(isinstance(r, KernelStep) for r in read_by.get(step.out_slot, ()))]

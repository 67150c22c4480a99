"""A shape family's pool: a program's intermediate buffers carved out of one allocation per size.

A static program keeps its intermediate buffers in one pool, planned once (passes/memory.py) and
carved once (Program._bind_pool): a call allocates nothing but its outputs. A shape family's
program learns its buffers' sizes only from a call. So it plans per size: the first call at a
size runs the same first-fit plan (`first_fit`) over that size's byte counts, allocates one pool
and carves every buffer's view out of it; a later call at that size gets the same views back from
a dict. The straight-line program (fusec/runtime/writer.py) starts with

    _v = _pool_views.get(x_size0)   # this size's intermediate buffers, if kept
    if _v is None:
        _v = _pool.carve(x_size0, (((x_size0, 64), (64, 1)), ...))
    _pool.in_use = _v               # (a CUDA graph captured now keeps them)
    s3, s5, s8 = _v

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

    def carve(self, key, layouts: tuple) -> tuple[torch.Tensor, ...]:
        """Plan, allocate and carve the pool for the sizes `key`; keep it; return its views."""
        sized = [(span_bytes(shape, stride, dtype), first, last)
                 for (shape, stride), (dtype, first, last) in zip(layouts, self.buffers)]
        offsets, nbytes = first_fit(sized)
        pool = torch.empty(max(nbytes, 64), dtype=torch.uint8, device=self.device)
        typed: dict = {}  # the pool seen as each dtype (its size is a multiple of 64 bytes)
        views = []
        for (shape, stride), (dtype, _, _), offset in zip(layouts, self.buffers, offsets):
            if dtype not in typed:
                typed[dtype] = pool.view(dtype)
            views.append(typed[dtype].as_strided(shape, stride,
                                                 offset // typed[dtype].element_size()))
        if len(self.kept) >= KEEP:
            self.kept.pop(next(iter(self.kept)))
        self.kept[key] = views = tuple(views)
        return views

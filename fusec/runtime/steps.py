"""Steps: what a compiled program is made of, each a callable over a list of buffer slots.

A step reads and writes `env[slot]`: `KernelStep` launches one fused kernel into outputs it
allocates (or carves out of the program's pool), `ExternStep` calls one ATen op eagerly and
settles its result into the planned strides, `ViewStep` makes a view a tensor, `GetItemStep`
picks one output of an op with several. `Program` (program.py) holds a list of them; the
straight-line writer (writer.py) spells each one out as a line of Python.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from fusec.ir import Layout


@dataclass(frozen=True)
class SlotRef:
    slot: int


@dataclass
class OutputBuffer:
    slot: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    offset: int | None = None  # bytes into the program's pool (memory plan), or None: allocate
    nbytes: int = 0
    inplace: int | None = None  # the slot whose buffer this output is written over, if any
    live: tuple[int, int] | None = None  # a shape family's planned buffer: (first, last) step


class KernelStep:
    def __init__(self, name: str, launcher: Callable, reads: list[int], writes: list[OutputBuffer],
                 device: str, numel: int, sizes: tuple = ()):
        self.name, self.launcher, self.reads, self.writes = name, launcher, reads, writes
        self.sizes = sizes  # the size symbols it takes after its pointers (fusec/symbolic.py)
        self.device = torch.device(device)
        self.numel = numel

        self.planned: dict[int, torch.Tensor] = {}  # slot -> its view into the pool

    def bind_pool(self, pool: torch.Tensor) -> None:
        """Carve this kernel's planned outputs out of the program's pool, once."""
        for w in self.writes:
            if w.offset is not None:
                piece = pool[w.offset:w.offset + w.nbytes].view(w.dtype)
                self.planned[w.slot] = piece.as_strided(w.shape, w.stride, piece.storage_offset())

    def __call__(self, env: list) -> None:
        outs = []
        for w in self.writes:
            t = self.planned.get(w.slot)
            if w.inplace is not None:  # the input's memory, seen with this output's shape
                src = env[w.inplace]
                t = src.as_strided(w.shape, w.stride, src.storage_offset())
            if t is None:
                t = torch.empty_strided(w.shape, w.stride, dtype=w.dtype, device=self.device)
            env[w.slot] = t
            outs.append(t)
        if self.numel:
            self.launcher(*[env[r] for r in self.reads], *outs)

    def __repr__(self) -> str:
        return f"KernelStep({self.name})"


aten = torch.ops.aten

# Note (externs that copy a whole storage). ATen's functional `copy` and the `*_scatter` ops
# start from a copy of their first argument made by `clone_preserve_strides`. That helper
# copies the argument's *whole storage*, so that the copy keeps the argument's strides and
# storage offset. In eager code the argument owns its storage, and that costs nothing extra.
# In a fusec program an intermediate value is a view of the program's pool, which holds every
# intermediate buffer. torchvision's Swin builds its attention mask with nine `slice_scatter`s
# per block, and each one copied the whole 106 MB pool: 135 copies, 7.3 of 11.7 ms a call on an
# H200. Such an argument is copied alone first (`own_storage`).
CLONES_WHOLE_STORAGE = frozenset({aten.copy.default, aten.slice_scatter.default,
                                  aten.select_scatter.default, aten.diagonal_scatter.default,
                                  aten.as_strided_scatter.default})


def own_storage(t):
    """`t`, or a copy of `t` alone when `t` is a view into a larger storage (see the note on
    externs that copy a whole storage)."""
    if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > t.numel() * t.element_size():
        return t.clone()
    return t


class ExternStep:
    """An eager ATen call (or one of the functions below). Its tensor result is put in the layout
    the schedule planned for it."""

    def __init__(self, target, args, kwargs, out_slot: int, planned: Layout | None):
        if target is torch.ops.aten._assert_async.msg and str(args[1]).startswith(INDEX_CHECK):
            target = check_index_values
        self.target, self.args, self.kwargs = target, args, kwargs
        self.out_slot, self.planned = out_slot, planned
        self.name = target.__name__ if target is check_index_values else str(target)

    def __call__(self, env: list) -> None:
        def fetch(a):
            return env[a.slot] if isinstance(a, SlotRef) else a
        args = fx.node.map_aggregate(self.args, fetch)
        kwargs = fx.node.map_aggregate(self.kwargs, fetch)
        if self.target in CLONES_WHOLE_STORAGE and args:
            args = (own_storage(args[0]), *args[1:])
        out = self.target(*args, **kwargs)
        env[self.out_slot] = out if self.planned is None else self.settle(out)

    def settle(self, out):
        return settle(out, self.planned)

    def __repr__(self) -> str:
        return f"ExternStep({self.name})"


INDEX_CHECK = "fusec: index out of range: "  # how passes/check_gathers.py's check's message opens


def check_index_values(ok: torch.Tensor, message: str) -> None:
    """The check passes/check_gathers.py adds of gathered reads' index values (`ok`: all in
    range), refusing a bad one as eager does: an IndexError on a CPU (`x[i]`, `embedding` and
    `index_select` raise one; `_assert_async` would raise a RuntimeError), a device-side assert
    on a GPU (as eager's CUDA index kernels)."""
    if ok.device.type != "cpu":
        torch._assert_async(ok, message)
    elif not bool(ok):
        raise IndexError(message)


def settle(out, planned: Layout):
    """`out` in the strides the schedule planned for it (a copy only when ATen chose others)."""
    return settle_as(out, planned.shape, planned.stride)


def settle_as(out, shape: tuple, stride: tuple):
    """`settle` to a shape and strides given as tuples: a shape family's program computes them
    from each call's sizes, without making a Layout."""
    if isinstance(out, torch.Tensor) and tuple(out.stride()) != stride and out.numel() > 1 \
            and any(n != 1 and a != b for n, a, b in zip(out.shape, out.stride(), stride)):
        # (strides that differ only where a dim has size 1 address the same elements: no copy)
        out = torch.empty_strided(shape, stride, dtype=out.dtype, device=out.device).copy_(out)
    return out


# Note (a view made per call, cheaply). A program makes views of its values for extern calls
# (`mm(x, w.t())`) and writes a kernel's output over a buffer it reads for the last time, seen
# with the output's shape. `base.as_strided(shape, stride, base.storage_offset() + k)` makes
# such a view, and does more than a program needs: it parses an optional offset, records the view
# for autograd (its `_base`, a shared version counter) and, spelled that way, reads the offset
# with one more Python call. Inside a program autograd is off (a training program runs inside
# AOT Autograd's autograd.Function) and the view never leaves it, so torch.compile's output code
# uses `torch._C._dynamo.guards._reinterpret_tensor`: a new tensor over the same storage, its
# offset `base`'s plus an increment, nothing recorded, and cheaper to call (docs/training.md,
# the BERT step's views). `reinterpret_tensor` is that function where this torch has it, and
# `view_at` below, the same view through `as_strided`, where it does not. A program's outputs
# stay `as_strided` views, as eager's: a caller's in-place write through an output that views an
# input counts on the input's version, which autograd checks (and `_base` is the input). The one
# exception is torch.compile's too: an output that is the only way out of a buffer a kernel
# allocated on this call (a training forward's saved activations, often) is reinterpreted, as
# nothing else shares that buffer (writer.py, `_hidden_buffers`).


def view_at(base, shape, stride, offset=0):
    """`base`'s memory seen with `shape` and `stride`, starting `offset` elements after `base`
    starts: what `reinterpret_tensor(base, shape, stride, offset)` makes, through `as_strided`
    (see the note on a view made per call)."""
    return base.as_strided(shape, stride, base.storage_offset() + offset)


reinterpret_tensor = getattr(getattr(getattr(torch._C, "_dynamo", None), "guards", None),
                             "_reinterpret_tensor", None) or view_at


class ViewStep:
    """Materialize a view as a tensor (only for extern calls and program outputs)."""

    def __init__(self, root: int, layout: Layout, out_slot: int):
        self.root, self.layout, self.out_slot = root, layout, out_slot

    def __call__(self, env: list) -> None:
        base = env[self.root]
        env[self.out_slot] = base.as_strided(self.layout.shape, self.layout.stride,
                                             base.storage_offset() + self.layout.offset)

    def __repr__(self) -> str:
        return f"ViewStep(slot {self.root} as {self.layout.shape}/{self.layout.stride}+{self.layout.offset})"


class GetItemStep:
    """One output of a multi-output extern. A tensor output is settled into the layout the
    schedule planned from the op's fake value: a library may lay it out otherwise (an LSTM's
    batch-first output is a transposed view of a sequence-first buffer), and kernels read it
    through the planned strides."""

    def __init__(self, src: int, index: int, out_slot: int, planned: Layout | None = None):
        self.src, self.index, self.out_slot, self.planned = src, index, out_slot, planned

    def __call__(self, env: list) -> None:
        out = env[self.src][self.index]
        env[self.out_slot] = out if self.planned is None else settle(out, self.planned)

    def __repr__(self) -> str:
        return f"GetItemStep(slot {self.src}[{self.index}])"

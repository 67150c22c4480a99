"""Pointwise loops in the order of a transposed read: NCHW -> NHWC with a few channels.

The loop order of a pointwise kernel follows its first output's layout, and its inner loop runs
along the output's last dim. A conversion to channels-last, `x.contiguous(memory_format=
torch.channels_last)` of an NCHW tensor (the layout pass inserts one before a channels-last
convolution), has a last dim of C values (3, 8 or 16 channels) that the input holds H*W apart:
each row is C strided reads, gathered one by one into a small tile (Note: tiles for transposed
reads, cpp/__init__.py), and the row's loop is too short to pay for its own overhead. On one
thread of the 2-core Xeon, (2, 8, 32, 32) took 17.9 us where eager took 11.2 and the LLVM
backend (whose vectorizer gathers) 5.4; (2, 3, 64, 64) took 55.8, eager 17.1, LLVM 12.9.

`read_order(kernel)` swaps the last two loop dims of such a kernel: the inner loop then runs
along W, where the input is contiguous (one vector load per step), and the stores move by C
elements, which gcc writes as interleaved (or scattered) stores. It is a relabelling of the
iteration space, so every index keeps its meaning; only the kernel's `shape` and the order of
each index's last two strides change. It applies when the last dim is short (2 to SHORT_ROW - 1
positions, known when compiling), the dim before it is at least SHORT_ROW long, some read moves
by 1 along that dim and by at least TILE_STRIDE along the last, and no read is contiguous along
the last dim while it moves along the one before (the swap would make it strided; a per-channel
bias, the same C values for every row, becomes one value per row). Reads of a cat's pieces and gathers keep their
order (their conditions name a loop dim). Swapped, the same copies took 8.1 us ((2, 8, 32, 32))
and 10.5 ((2, 3, 64, 64)); with 16 channels each store of the swapped loop lands on its own cache
line, and (2, 16, 32, 32) took 40.8 us swapped against 23.3 in the tiles, so 16 stays as it was.
"""
from __future__ import annotations

from dataclasses import replace

from fusec.ir import Index, PointwiseKernel
from fusec.symbolic import is_symbolic

from ..cpu_plan import SHORT_ROW, TILE_STRIDE


def read_order(kernel: PointwiseKernel) -> PointwiseKernel:
    """The kernel with its last two loop dims swapped where that reads contiguously (module
    docstring); else the kernel itself."""
    shape = kernel.shape
    if len(shape) < 2 or is_symbolic(shape[-1]) or is_symbolic(shape[-2]):
        return kernel
    if not 2 <= shape[-1] < SHORT_ROW or shape[-2] < SHORT_ROW:
        return kernel
    loads = kernel.loads
    if any(l.valid is not None or l.gather is not None for l in loads):
        return kernel
    if any(is_symbolic(s) for x in [*loads, *kernel.stores] for s in x.index.strides[-2:]):
        return kernel
    if any(l.index.strides[-1] == 1 and l.index.strides[-2] != 0 for l in loads):
        return kernel  # a read contiguous along the row: the swap would make it strided
    if not any(l.index.strides[-2] == 1 and abs(l.index.strides[-1]) >= TILE_STRIDE for l in loads):
        return kernel  # no transposed read to make contiguous

    def swapped(idx: Index) -> Index:
        s = idx.strides
        return Index(idx.offset, (*s[:-2], s[-1], s[-2]))

    return replace(kernel, shape=(*shape[:-2], shape[-1], shape[-2]),
                   loads=[replace(l, index=swapped(l.index)) for l in loads],
                   stores=[replace(s, index=swapped(s.index)) for s in kernel.stores])

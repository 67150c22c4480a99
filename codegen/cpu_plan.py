"""Decisions the two CPU backends (cpp.py, llvm.py) make alike, so that both spell the same plan.

How many elements make threads pay off (`PARALLEL_THRESHOLD`), how long an inner chunk is
(`CHUNK`), how a long float sum is blocked (`sum_block`), and the one-line summary each kernel's
source opens with. Decided here, once; each backend only writes it in its language. (Which loop
of a reduction computes what, and which value it keeps in its output for the last pass, is the
kernel IR's loop plan: fusec/loop_plan.py, decided in codegen/lower_reduction.py.)
"""
from __future__ import annotations

import math

from fusec.ir import PointwiseKernel


PARALLEL_THRESHOLD = 1 << 15  # below this many elements, threads cost more than they save
CHUNK = 8192
TILE_STRIDE = 16  # an inner stride of this many elements or more puts each step on a new line


def summary(kernel: PointwiseKernel) -> str:
    names = [op.replace("aten.", "").split(".")[0] for op in kernel.ops]
    return f"fuses {len(names)} ATen op(s): {', '.join(names)}"


SUM_BLOCK_MIN = 256


def sum_block(k: int) -> int:
    """Block length for a float sum over k values (0: no blocking): about sqrt(k), so the
    values summed in a row, per block and across blocks, both stay near sqrt(k)."""
    if k <= SUM_BLOCK_MIN:
        return 0
    return max(SUM_BLOCK_MIN, 1 << math.isqrt(k - 1).bit_length())

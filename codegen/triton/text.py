"""Triton spelling of the kernel IR: Triton dtypes, block sizes, literals of an exact dtype,
conversions as torch does them (bfloat16 through exact bit-level helpers), and statements from
the op table's `triton` column. The Triton renderers (__init__.py for pointwise kernels,
triton/reduction.py, and those of the kernel families: codegen/families.py) write through these.
"""
from __future__ import annotations

import math
import os
import re

import torch

from fusec import ops
from fusec.ir import Const, Index, PointwiseKernel, Stmt


def current_arch() -> int | None:
    """The sm_<arch> number of the NVIDIA GPU this process compiles for; None under the
    interpreter, without a CUDA GPU, or on another vendor's."""
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available() \
            or torch.version.hip:
        return None
    major, minor = torch.cuda.get_device_capability()
    return 10 * major + minor


TL = {
    torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32",
    torch.float64: "tl.float64", torch.int8: "tl.int8", torch.uint8: "tl.uint8",
    torch.int16: "tl.int16", torch.int32: "tl.int32", torch.int64: "tl.int64", torch.bool: "tl.int1",
}
MAX_BLOCK = 1024


def block_size(numel: int, itemsizes: tuple[int, ...] = ()) -> tuple[int, int]:
    """(BLOCK_SIZE, num_warps): 1024 lanes for large tensors, fewer for tiny ones so most lanes
    do useful work. Each thread takes 8 consecutive elements (4 warps for 1024 lanes: wide
    vector loads), unless the kernel's loads and stores have elements of different widths
    (`itemsizes`, in bytes): then each thread takes one 16-byte vector of the widest (4 float32
    beside bfloat16: 8 warps for 1024 lanes).

    Note: one layout for mixed widths. Triton lays out each load and store by its own width, so
    a kernel that reads bfloat16 and writes float32 holds its values in two layouts and converts
    between them. Triton 3.6 fails to compile some such kernels on sm_90 ("operand #1 does not
    dominate this use", `PassManager::run failed`): GPT-2's gelu_new in a bf16 training step,
    one bfloat16 input and five outputs, four of them float32. With each thread holding one
    vector of the widest type, every access fits one layout, and there is nothing to convert."""
    block = min(MAX_BLOCK, max(128, 1 << max(numel - 1, 0).bit_length()))
    if len(set(itemsizes)) > 1:
        per_thread = max(16 // max(itemsizes), 1)
        return block, min(max(block // (32 * per_thread), 1), 8)
    return block, 4 if block >= 512 else (2 if block >= 256 else 1)


def literal(value, dtype: torch.dtype) -> str:
    """A constant of exactly `dtype` (bare literals would be typed int32/float32 by Triton)."""
    if dtype == torch.bool:
        return f"tl.full([1], {1 if value else 0}, tl.int1)"
    if dtype.is_floating_point:
        value = float(value)
        text = f'float("{value}")' if math.isnan(value) or math.isinf(value) else repr(value)
        return text if dtype == torch.float32 else f"tl.full([1], {text}, {TL[dtype]})"
    value = torch.tensor(value).to(dtype).item()
    return f"tl.full([1], {value}, {TL[dtype]})"


SMALL_INTS = (torch.int8, torch.uint8, torch.int16)  # exact in float32 through the bit trick


def convert(expr: str, src: torch.dtype, dst: torch.dtype) -> str:
    if src == dst:
        return expr
    # bfloat16 through exact bit-level helpers: the interpreter's own casts truncate
    if dst == torch.bfloat16:
        return f"fusec_f32_to_bf16({convert(expr, src, torch.float32)})"
    if src == torch.bfloat16:
        return convert(f"fusec_bf16_to_f32({expr})", torch.float32, dst)
    if dst == torch.bool:
        return f"({expr} != 0)"
    if src in SMALL_INTS and dst == torch.float32:
        return f"fusec_small_int_to_f32({expr})"  # exact, and 4x the rate of a cast on a GPU
    if src.is_floating_point and not dst.is_floating_point and dst != torch.int64:
        return f"{expr}.to(tl.int64).to({TL[dst]})"
    return f"{expr}.to({TL[dst]})"


def _operand(o, dtype) -> str:
    if isinstance(o, Const):
        return literal(o.value, dtype)
    return convert(o.name, o.dtype, dtype)


def render_stmt(s: Stmt, helpers: set, block: str = "[BLOCK_SIZE]") -> str:
    row = ops.OPS[s.op]
    args = [_operand(o, dt) for o, dt in zip(s.operands, s.operand_dtypes)]
    if s.op == "full":
        expr = f"tl.full({block}, {args[0]}, {TL[s.result_dtype]})" if not args[0].startswith(
            "tl.full") else args[0].replace("[1]", block)
    else:
        expr = row.triton.format(*args)
    helpers.update(re.findall(r"\bfusec_\w+", expr))
    if s.result_dtype != s.var.dtype:
        expr = convert(f"({expr})", s.result_dtype, s.var.dtype)
    if s.round_to is not None:
        expr = convert(convert(f"({expr})", s.var.dtype, s.round_to), s.round_to, s.var.dtype)
    return f"{s.var.name} = {expr}  # {s.origin}"


def helpers_in(lines: list[str]) -> set[str]:
    """The fusec_* helpers a kernel's lines call: the module imports exactly those."""
    return {name for line in lines for name in re.findall(r"\bfusec_\w+", line)}


def max_address(index: Index, shape: tuple[int, ...]) -> int:
    """The largest element offset an index reaches: decides between 32- and 64-bit arithmetic."""
    return abs(index.offset) + sum((size - 1) * abs(st) for size, st in zip(shape, index.strides))


def ops_summary(kernel: PointwiseKernel) -> str:
    names = [op.replace("aten.", "").split(".")[0] for op in kernel.ops]
    return f"fuses {len(names)} ATen op(s): {', '.join(names)}"


def piece_mask(load, shape, axes=None) -> str | None:
    """Where a piece of a cat is read: its range along the loop dim (fusec.ir.Load.valid), whose
    coordinate is `i<dim>` in a pointwise kernel and `axes[dim]` (`n`) in a kernel that names
    its row axes (a kernel family's matmul of few rows)."""
    if load.valid is None:
        return None
    dim, lo, hi = load.valid
    at = axes[dim] if axes else f"i{dim}"
    tests = ([f"({at} >= {lo})"] if lo > 0 else []) + ([f"({at} < {hi})"] if hi < shape[dim] else [])
    return " & ".join(tests) or f"({at} >= 0)"  # (a piece that covers the whole dim)


def gather_offset(load, position: str | None = None) -> str:
    """The offset of a gathered read's row (fusec.ir.Load's `gather`), as one expression: the
    index value `position` (default: the load's position var), counted from the end where
    negative, kept inside the source (passes/check_gathers.py reports a value out of range),
    times the row's stride, in 64 bits where the source is that large."""
    pos, stride, size = load.gather
    pos = position or pos
    row = f"tl.minimum(tl.maximum(tl.where({pos} < 0, {pos} + {size}, {pos}), 0), {size - 1})"
    if stride * size >= 2 ** 31:
        row += ".to(tl.int64)"
    return row if stride == 1 else f"{row} * {stride}"

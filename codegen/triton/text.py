"""Triton spelling of the kernel IR: Triton dtypes, block sizes, literals of an exact dtype,
conversions as torch does them (bfloat16 through exact bit-level helpers), and statements from
the op table's `triton` column. The Triton renderers (__init__.py for pointwise kernels,
triton/reduction.py, and those of the kernel families: codegen/families.py) write through these.
"""
from __future__ import annotations

import functools
import math
import os
import re
import weakref

import torch

from fusec import ops
from fusec.ir import Const, Index, PointwiseKernel, Stmt
from fusec.symbolic import (hashable, hint, is_symbolic, named, py_expr, shape_env_of, size_names,
                            size_params)


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
    """A constant of exactly `dtype` (bare literals would be typed int32/float32 by Triton). A
    size in a shape family's program (`x / x.shape[-1]`: passes/inline_sizes.py) is an expression
    of the kernel's size arguments, converted to `dtype` where the kernel runs."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)) and \
            value.node.expr.free_symbols:
        return f"tl.full([1], {_printer().doprint(named(value))}, {TL[dtype]})"
    if dtype == torch.bool:
        return f"tl.full([1], {1 if value else 0}, tl.int1)"
    if dtype.is_floating_point:
        value = float(value)
        text = f'float("{value}")' if math.isnan(value) or math.isinf(value) else repr(value)
        return text if dtype == torch.float32 else f"tl.full([1], {text}, {TL[dtype]})"
    value = torch.tensor(value).to(dtype).item()
    return f"tl.full([1], {value}, {TL[dtype]})"


@functools.cache
def _printer():
    """Python's spelling of a size expression (torch's PythonPrinter), except that an int made
    float is the int itself: Triton's arithmetic makes it a float where it meets one (`1.0 / x_size0`),
    and `literal` converts the result to its dtype. (Made when first needed: it imports sympy.)"""
    from torch.utils._sympy.printers import PythonPrinter

    class TritonPrinter(PythonPrinter):
        def _print_ToFloat(self, expr):
            return f"({self._print(expr.args[0])})"

    return TritonPrinter()


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


# ---- sizes that may be symbols (Note: sizes as symbols in kernels, fusec/symbolic.py) --------------
#
# Note: Triton kernels for a shape family. A size that is a symbol (`x_size0`) is an argument of the
# kernel, after its pointers, and every size the kernel text needs is spelled from the symbols
# (`offsets // x_size0`, `i0 * (64*x_size0)`). Block sizes and warps are constexprs, so they come from the
# sizes the program was traced with (`hint`): any block is right for every size, since masks
# switch off the lanes past the end. The renderers choose the simpler of two forms that are both
# right (no mask term, `offsets` for a contiguous index) by comparing expressions as text
# (`same`), which adds no guard: a size that merely happens to equal another gets the general
# form. Only a choice that decides what the code computes compares the SymInt itself (a guard):
# 32-bit positions (`needs_int64`). The module's `launch` computes its grid per call from the
# sizes, and the kernel takes nothing else that depends on them (its element and row counts are
# computed inside it), so Triton's specialization of the size arguments (== 1, a multiple of 16)
# is all that one compiled kernel assumes (fusec/runtime/fast_start/triton_launch.py).

def size(x) -> str:
    """A size (int or SymInt) as kernel text: an int as itself, a symbol by its name, anything
    more in parentheses (`(64*x_size0)`), so that it can stand in any expression."""
    text = py_expr(x)
    if not is_symbolic(x) or x.node.expr.is_Symbol:
        return text
    return f"({text})"


def same(a, b) -> bool:
    """Whether two sizes are the same expression (`x_size0` and `x_size0`, 64 and 64), without a guard:
    False for `x_size0` and 64 even when the traced x_size0 was 64."""
    return hashable(a) == hashable(b)


def cdiv(n, block: int, ceil: str = "triton.cdiv") -> str:
    """ceil(n / block) as text: a number when n is one, else `ceil(n, block)`."""
    if not is_symbolic(n):
        return str(-(-hint(n) // block))
    return f"{ceil}({py_expr(n)}, {block})"


def may_be_less(a, b) -> bool:
    """a < b for two ints; for sizes that are symbols, whether they differ as expressions (no
    guard): for a test that may be left out where it always holds, and is right either way."""
    if is_symbolic(a) or is_symbolic(b):
        return not same(a, b)
    return a < b


def needs_int64(values) -> bool:
    """Whether any of `values` (element counts and offsets) may reach 2**31 - 1, so that positions
    must be computed in 64 bits. This decides what the kernel computes, so a symbolic value is
    compared as a SymInt: the guard (`64*x_size0 < 2147483647`) keeps the 32-bit kernel for the sizes
    below, and a call past it compiles again."""
    return any(v >= 2 ** 31 - 1 for v in values)


def flat_strides(shape) -> tuple:
    """The strides of a contiguous tensor of `shape` (ir.contiguous_strides without comparing
    sizes: a symbol is never 0)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step = step * (n if is_symbolic(n) or n > 0 else 1)
    return tuple(reversed(strides))


def is_flat(index: Index, shape) -> bool:
    """Index.is_flat, compared as expressions (no guard)."""
    return same(index.offset, 0) and same(index.strides, flat_strides(shape))


def kernel_sizes(kernel) -> list[str]:
    """fusec.symbolic.size_params(kernel), worked out once per kernel object, and only after a
    quick look for any SymInt at all (a static kernel's IR has none: the full walk would add
    half a render's time to each)."""
    known = _SIZES.get(id(kernel))
    if known is not None and known[0]() is kernel:
        return known[1]
    sizes = size_params(kernel) if _first_symint(kernel) is not None else []
    try:
        _SIZES[id(kernel)] = (weakref.ref(kernel, lambda _, key=id(kernel): _SIZES.pop(key, None)),
                              sizes)
    except TypeError:  # (an object that takes no weak reference: not remembered)
        pass
    return sizes


_SIZES: dict[int, tuple] = {}  # id(kernel) -> (weak reference to it, its size arguments)


def size_arguments(kernel, counts: list[tuple[str, object, bool]]) -> dict:
    """The template's words for the kernel's integer arguments. `counts`: (name, value, whether
    it is a tl.constexpr) for the counts the kernel reads (`n_elements`, `n_rows`, `n_k`). Without
    symbols the kernel takes them as arguments, as always. With symbols it takes the sizes
    (`size_params`) instead and computes each count that depends on them (`n_rows = 3*x_size0`)
    first thing: then its integer arguments are the sizes alone, and Triton's specialization of
    them is all a compiled kernel assumes (Note: Triton kernels for a shape family)."""
    sizes = kernel_sizes(kernel)
    if not sizes:
        return dict(sizes=[], size_lines=[], ahead_params="*dtypes",
                    count_params=[n + (": tl.constexpr" if cx else "") for n, v, cx in counts],
                    count_args=[py_expr(v) for n, v, cx in counts])
    fixed = [(n, v) for n, v, cx in counts if cx and not is_symbolic(v)]  # constexprs still
    # compile_ahead's sizes: each of the kind Triton specializes the traced size as (a multiple
    # of 16 or not), so that compiling ahead makes the kernel the first launch most likely needs
    traced = traced_sizes(kernel)
    kinds = [f"{s}={16 if traced.get(s, 1) % 16 == 0 else 17}" for s in sizes]
    return dict(sizes=sizes,
                size_lines=[f"{n} = {py_expr(v)}" for n, v, cx in counts if (n, v) not in fixed],
                count_params=sizes + [f"{n}: tl.constexpr" for n, v in fixed],
                count_args=sizes + [py_expr(v) for n, v in fixed],
                ahead_params="*dtypes, " + ", ".join(kinds))


def traced_sizes(kernel) -> dict[str, int]:
    """{size argument's name (`x_size0`, as `kernel_sizes` gives): the size it was traced with}
    for the symbols of `kernel` (no guard)."""
    env = shape_env_of(_first_symint(kernel))
    if env is None:
        return {}
    values = getattr(env, "backed_var_to_val", None) or env.var_to_val  # (renamed in torch 2.12)
    names = size_names(env)
    return {names.get(s, str(s)): int(v) for s, v in values.items()}


def _first_symint(obj, _leaves=(int, float, str, bool, type(None), torch.dtype)):
    """The first SymInt with a symbol inside `obj` (the kernel IR's objects, tuples, lists,
    dicts), or None."""
    if isinstance(obj, _leaves):
        return None
    if isinstance(obj, torch.SymInt):
        return obj if is_symbolic(obj) else None
    if isinstance(obj, (torch.SymFloat, torch.SymBool)):
        return obj if obj.node.expr.free_symbols else None
    if isinstance(obj, (tuple, list, set, frozenset)):
        items = obj
    elif isinstance(obj, dict):
        items = obj.values()
    else:
        items = getattr(obj, "__dict__", {}).values()
    for item in items:
        found = _first_symint(item)
        if found is not None:
            return found
    return None


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
    tests = ([f"({at} >= {size(lo)})"] if may_be_less(0, lo) else []) + \
        ([f"({at} < {size(hi)})"] if may_be_less(hi, shape[dim]) else [])
    return " & ".join(tests) or f"({at} >= 0)"  # (a piece that covers the whole dim)


def gather_offset(load, position: str | None = None) -> str:
    """The offset of a gathered read's row (fusec.ir.Load's `gather`), as one expression: the
    index value `position` (default: the load's position var), counted from the end where
    negative, kept inside the source (passes/check_gathers.py reports a value out of range),
    times the row's stride, in 64 bits where the source is that large."""
    pos, stride, n = load.gather
    pos = position or pos
    row = f"tl.minimum(tl.maximum(tl.where({pos} < 0, {pos} + {size(n)}, {pos}), 0), {size(n - 1)})"
    if stride * n >= 2 ** 31:  # (a guard where it is a symbol: it decides what is computed)
        row += ".to(tl.int64)"
    return row if same(stride, 1) else f"{row} * {size(stride)}"

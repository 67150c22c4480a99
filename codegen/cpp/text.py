"""C++ spelling of the kernel IR: C types, literals, conversions as torch does them, statements
from the op table's `cpp` column, half-precision loads and stores, and the prelude of helpers.
Both C++ renderers (__init__.py for pointwise kernels, reduction.py) write through these.
"""
from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

from fusec import ops
from fusec.ir import Const, Stmt, Var


TEMPLATES = Path(__file__).parent / "templates"

CTYPE = {
    torch.float16: "uint16_t", torch.bfloat16: "uint16_t", torch.float32: "float",
    torch.float64: "double", torch.int8: "int8_t", torch.uint8: "uint8_t",
    torch.int16: "int16_t", torch.int32: "int32_t", torch.int64: "int64_t", torch.bool: "bool",
}



# ---- rendering ---------------------------------------------------------------------------------

def gather_offset(load) -> str:
    """The offset of a gathered read's row (fusec.ir.Load's `gather`): the index value, counted
    from the end where negative and kept inside the source (fusec_row, cpp_prelude.h;
    passes/check_gathers.py reports a value out of range), times the row's stride."""
    pos, stride, size = load.gather
    return f"fusec_row({pos}, {size})" + ("" if stride == 1 else f" * {stride}")


def literal(value, dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "true" if value else "false"
    if dtype.is_floating_point:
        value = float(value)
        ctype = "double" if dtype == torch.float64 else "float"
        if math.isnan(value):
            return f"std::numeric_limits<{ctype}>::quiet_NaN()"
        if math.isinf(value):
            sign = "-" if value < 0 else ""
            return f"({sign}std::numeric_limits<{ctype}>::infinity())"
        return f"{ctype}({value!r})"
    value = torch.tensor(value).to(dtype).item()  # wrap like torch: -1 as uint8 is 255
    if dtype == torch.int64 and value == -(2 ** 63):
        return "std::numeric_limits<int64_t>::min()"
    return f"{CTYPE[dtype]}({value})"


def convert(expr: str, src: torch.dtype, dst: torch.dtype) -> str:
    """C++ for `expr` (of dtype src) converted to dst the way torch's `.to(dst)` does."""
    if src == dst:
        return expr
    if dst == torch.bool:
        return f"({expr} != 0)"
    if src.is_floating_point and not dst.is_floating_point and dst != torch.int64:
        return f"static_cast<{CTYPE[dst]}>(static_cast<int64_t>({expr}))"
    return f"static_cast<{CTYPE[dst]}>({expr})"


def _operand(o, dtype) -> str:
    if isinstance(o, Const):
        return literal(o.value, dtype)
    return convert(o.name, o.dtype, dtype)


def render_stmt(s: Stmt, round_f16: bool = True) -> str:
    """`const T v = expr;` for statement s, rounded as eager rounds its result; with
    round_f16=False a float16 rounding is left to the caller (cpp/half_blocks.py)."""
    row = ops.OPS[s.op]
    args = [_operand(o, dt) for o, dt in zip(s.operands, s.operand_dtypes)]
    expr = row.cpp.format(*args)
    expr = convert(f"({expr})", s.result_dtype, s.var.dtype)
    if s.round_to == torch.float16 and round_f16:
        expr = f"fusec_round_f16({expr})"
    elif s.round_to == torch.bfloat16:
        expr = f"fusec_round_bf16({expr})"
    return f"const {CTYPE[s.var.dtype]} {s.var.name} = {expr};  // {s.origin}"


def load_value(ptr_expr: str, storage: torch.dtype) -> str:
    if storage == torch.float16:
        return f"fusec_f16_to_f32({ptr_expr})"
    if storage == torch.bfloat16:
        return f"fusec_bf16_to_f32({ptr_expr})"
    return ptr_expr


def store_value(var: Var, storage: torch.dtype) -> str:
    if storage == torch.float16:
        return f"fusec_f32_to_f16({var.name})"
    if storage == torch.bfloat16:
        return f"fusec_f32_to_bf16({var.name})"
    return convert(var.name, var.dtype, storage)



@functools.lru_cache(maxsize=None)
def prelude() -> str:
    return (TEMPLATES / "cpp_prelude.h").read_text()

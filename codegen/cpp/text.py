"""C++ spelling of the kernel IR: C types, literals, conversions as torch does them, statements
from the op table's `cpp` column, half-precision loads and stores, and the prelude of helpers.
Both C++ renderers (__init__.py for pointwise kernels, reduction.py) write through these.
"""
from __future__ import annotations

import functools
import math
import platform
from pathlib import Path

import torch

from fusec import ops
from fusec.ir import Const, Stmt, Var
from fusec.symbolic import c_expr, is_symbolic, named, size_params
from fusec.codegen.cpu_plan import eager_gelu_multiplies_first


TEMPLATES = Path(__file__).parent / "templates"

CTYPE = {
    torch.float16: "uint16_t", torch.bfloat16: "uint16_t", torch.float32: "float",
    torch.float64: "double", torch.int8: "int8_t", torch.uint8: "uint8_t",
    torch.int16: "int16_t", torch.int32: "int32_t", torch.int64: "int64_t", torch.bool: "bool",
}



# ---- sizes -------------------------------------------------------------------------------------
#
# Note (sizes as arguments in C++): a kernel compiled for a shape family (fusec/symbolic.py, Note:
# sizes as symbols in kernels) takes each symbol as an `int64_t` argument after its pointers,
# named as the symbol (`int64_t x_size0`), and every size, stride and offset of its IR is an int or
# an expression over those names (`64L*x_size0`). The kernel's named sizes (ROWS, INNER, K, ...) are
# then `const` values computed from the arguments instead of `constexpr` numbers; what must be a
# number when compiling (an array's length, a block length, an unroll count) is decided from the
# traced size (`fusec.symbolic.hint`) only where every other size computes the same answer, and
# each renderer says where it declines instead. A kernel without symbols is spelled as before.

def size(x) -> str:
    """A size, stride or offset (an int, or a SymInt of a shape family) as a C++ operand: an int
    as itself, a symbol as its name, an expression over symbols in parentheses (it goes into
    products and sums: `c0 * (3L + x_size0)`)."""
    if not is_symbolic(x):
        return str(int(x))
    text = c_expr(x)
    return text if x.node.expr.is_Symbol else f"({text})"


def kernel_sizes(kernel) -> list[str]:
    """fusec.symbolic.size_params(kernel), worked out once per kernel object: it walks the whole
    IR (about a millisecond for a layer norm), and a render asks several times."""
    names = kernel.__dict__.get("_cpp_size_params")
    if names is None:
        names = kernel.__dict__["_cpp_size_params"] = size_params(kernel)
    return names


def size_kw(kernel) -> str:
    """`constexpr` for the named sizes of a kernel with none but numbers, `const` for one that
    takes sizes as arguments (Note: sizes as arguments in C++)."""
    return "const" if kernel_sizes(kernel) else "constexpr"


def size_args(kernel) -> list[str]:
    """The kernel's size parameters, after its pointers (Note: sizes as arguments in C++)."""
    return [f"int64_t {name}" for name in kernel_sizes(kernel)]


def params(kernel) -> list[str]:
    """The kernel's parameters: a pointer per buffer (inputs const), then its sizes."""
    return [f"{'' if p.is_output else 'const '}{CTYPE[p.dtype]}* __restrict__ {p.name}_ptr"
            for p in kernel.params] + size_args(kernel)


def times(var: str, stride) -> str:
    """`var` times a stride, spelled short: nothing for 0, `var` for 1."""
    if is_symbolic(stride):
        return f"{var} * {size(stride)}"
    return {0: "", 1: var}.get(stride, f"{var} * {stride}")


def plus(offset, term: str) -> str:
    """`offset + term`, without a 0 offset (or an empty term)."""
    return " + ".join(t for t in (size(offset) if offset else "", term) if t)


def sizes_line(kernel) -> str:
    """A comment naming the kernel's size arguments and the input size each one is
    (`x_size0 is x.size(0)`: fusec.symbolic.name_sizes), or "" for a kernel without them."""
    names = kernel_sizes(kernel)
    if not names:
        return ""
    said = ", ".join(size_source(n) for n in names)
    return f"Sizes are arguments (one compile for every size of them): {said}."


def size_source(name: str) -> str:
    """`x_size0` -> `x_size0 is x.size(0)`; a name of another form as it is."""
    import re
    m = re.fullmatch(r"(\w+)_(size|stride)(\d+)", name)
    return f"{name} is {m[1]}.{m[2]}({m[3]})" if m else name


# c_expr spells a floor division as c10's (torch's C++ headers); a kernel includes no torch
# header, so one that divides gets the same function (it floors, as Python's // does).
FLOOR_DIV = ("namespace c10 {  // a floor division of sizes, as torch's C++ printer spells it\n"
             "inline int64_t div_floor_integer(int64_t a, int64_t b) {\n"
             "    const int64_t q = a / b;\n"
             "    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;\n"
             "}\n"
             "}  // namespace c10\n")


def with_size_helpers(source: str) -> str:
    """`source` with the helpers its size expressions call defined after the prelude's include."""
    if "c10::div_floor_integer" not in source:
        return source
    marker = '#include "cpp_prelude.h"'
    head, sep, tail = source.partition(marker)
    line_end = tail.index("\n") + 1
    return head + sep + tail[:line_end] + FLOOR_DIV + tail[line_end:]


# ---- rendering ---------------------------------------------------------------------------------

def gather_offset(load) -> str:
    """The offset of a gathered read's row (fusec.ir.Load's `gather`): the index value, counted
    from the end where negative and kept inside the source (fusec_row, cpp_prelude.h;
    passes/check_gathers.py reports a value out of range), times the row's stride."""
    pos, stride, n = load.gather
    unit = not is_symbolic(stride) and stride == 1
    return f"fusec_row({pos}, {size(n)})" + ("" if unit else f" * {size(stride)}")


def literal(value, dtype: torch.dtype) -> str:
    if isinstance(value, (torch.SymInt, torch.SymFloat)) and value.node.expr.free_symbols:
        # a value computed from sizes (a mean's divisor n, 1 / n): its expression, converted
        from torch.utils._sympy.printers import CppPrinter
        ctype = CTYPE[dtype] if not dtype.is_floating_point else \
            "double" if dtype == torch.float64 else "float"
        return f"static_cast<{ctype}>({CppPrinter().doprint(named(value))})"
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
    spelling = row.cpp
    if s.op == "gelu" and eager_gelu_multiplies_first():  # (the kernel eager runs on this CPU:
        spelling = "fusec_gelu_onednn({0})"  # codegen/cpu_plan.py, Note: eager's gelu depends ...)
    expr = spelling.format(*args)
    expr = convert(f"({expr})", s.result_dtype, s.var.dtype)
    if s.round_to == torch.float16 and round_f16:
        expr = f"fusec_round_f16({expr})"
    elif s.round_to == torch.bfloat16:
        expr = f"fusec_round_bf16({expr})"
    return f"const {CTYPE[s.var.dtype]} {s.var.name} = {expr};  // {s.origin}"


def load_value(ptr_expr: str, storage: torch.dtype) -> str:
    if storage == torch.bool:  # read as its byte (cpp_prelude.h fusec_bool: why)
        return f"fusec_bool({ptr_expr})"
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


def row_coords(shape: tuple[int, ...]) -> list[str]:
    """The coordinates (c0, c1, ...) of `row` along the outer dims (all but the last), row-major:
    each a division of what the dims before it left over."""
    row_setup: list[str] = []
    outer_dims = len(shape) - 1
    rem = "row"
    for d in range(outer_dims):
        below = size(math.prod(shape[d + 1:-1]))
        row_setup.append(f"const int64_t c{d} = {rem} / {below};" if d < outer_dims - 1
                         else f"const int64_t c{d} = {rem};")
        if d < outer_dims - 1:
            row_setup.append(f"const int64_t r{d} = {rem} % {below};")
            rem = f"r{d}"
    return row_setup


# ---- the CPU the kernels are built for -----------------------------------------------------------

@functools.lru_cache(maxsize=None)
def host_cpu() -> str:
    """What -march=native compiles for: a library built on one CPU may not run on another."""
    fields = [platform.machine()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features", "CPU part")):
                    fields.append(line.strip())
                if len(fields) >= 4:
                    break
    except OSError:
        fields.append(platform.processor())
    return "\n".join(fields)


@functools.lru_cache(maxsize=None)
def host_has_f16c() -> bool:
    """Whether this CPU converts float16 in hardware (kernels are built with -march=native)."""
    flags = next((line for line in host_cpu().splitlines() if line.startswith("flags")), "")
    return "f16c" in flags.split()

"""A GEMV with a few activation rows on a CPU: each weight value computed once for all the rows.

A linear with M activation rows (decoding a few tokens, a small batch) is a reduction over K
with rows (m, n): out[m, n] = sum_k x[m, k] * W[n, k], where W may itself be computed, an int8
weight widened to float (examples/int8_linear.py), say. The generic C++ reduction
(cpp_reduction.py) computes each row (m, n) on its own, so it loads and converts the weight row
n once for every m. At M = 4 that made the int8 linear of K = N = 2048 2.1x slower than eager on
this project's CPU (0.94 ms against 0.46; `python benchmarks/diagnostics/cpu_quant_linear.py`),
while at M = 1 it was 1.7x faster.

Everything the loop computes from inputs that do not depend on m (their stride along m is 0:
the weight and its conversions) is the same for every activation row. This kernel
(codegen/templates/cpp_gemv_rows.cpp.j2) computes one weight row's dot products with all M
activation rows in one loop over k, with one running sum per row:

    for (k ...) {
        const float w = static_cast<float>(q[n * K + k]);   // once
        acc_m0 = acc_m0 + x[0 * K + k] * w;                 // one line per activation row
        acc_m1 = acc_m1 + x[1 * K + k] * w;
        ...
    }

The activation rows' lines are the generic kernel's, renamed per row (`v2_x` becomes `v2_x_m1`,
and the row's coordinates and bases likewise). M running sums are also M independent chains of
additions, where one sum waits on the previous addition at every step. Each sum is the generic
kernel's: float32 (double for float64) in blocks of k (cpu_plan.cpp_sum_block), the blocks
added in double.

Measured (K = N = 2048, M = 4, int8): the generic loop 0.94 ms; the weight computed once per
block into an array, then one loop per activation row, 0.63 ms with blocks of 256 and 0.39 ms
with blocks of 1024; one loop with four running sums, 0.33 ms.

It is used for 2 <= M <= MAX_M, one sum and nothing else per row, when the loop computes
something from the weight that the rows share. Packed-int4 weights have their own table kernel
(cpp_int4.py), which also computes each weight once for all rows.
"""
from __future__ import annotations

import re

import torch

from fusec.ir import Const, Load, Reduce

from .cpp_text import CTYPE, convert
from .cpu_plan import PARALLEL_THRESHOLD, TILE_STRIDE, cpp_sum_block, summary
from .render import render_template

MAX_M = 8  # activation rows, one running sum each (passes/small_matmul.py sends at most 8 on a CPU)
_DEFINED = re.compile(r"\bconst\s+[\w:]+\s+(\w+)\s*=")


def match(kernel, lanes: int) -> frozenset[str] | None:
    """The loop's values that do not depend on m (shared by the activation rows) when this
    kernel can compute the reduction; None keeps the generic kernel."""
    plan = kernel.plan
    if lanes or kernel.k < 1 or len(kernel.row_shape) != 2 or not 2 <= kernel.row_shape[0] <= MAX_M \
            or kernel.row_shape[1] < 2 or len(plan.phases) != 1 or plan.element_stores or plan.keep:
        return None
    reds = [i for i in kernel.body if isinstance(i, Reduce)]
    if len(reds) != 1 or reds[0].op != "sum" or not reds[0].acc_dtype.is_floating_point:
        return None
    n_rows = len(kernel.row_shape)
    for load in kernel.loads:
        ks = [abs(s) for s in load.index.strides[n_rows:] if s]
        if load.valid is not None or (ks and min(ks) >= TILE_STRIDE):
            return None  # a piece of a cat, or a row the generic kernel gathers first
    loop = plan.phases[0].loop
    by_name = {l.var.name: l for l in kernel.loads} | {i.var.name: i for i in kernel.body}
    same: set[str] = set()
    for name in loop:
        item = by_name[name]
        if isinstance(item, Load):
            if item.index.strides[0] == 0 and any(item.index.strides[n_rows:]):
                same.add(name)
        elif all(isinstance(o, Const) or o.name in same for o in item.operands):
            same.add(name)
    if not same or len(same) == len(loop):
        return None  # nothing the activation rows share, or nothing that depends on m
    return frozenset(same)


def _renamed(line: str, names: set[str], suffix: str) -> str:
    """`line` with every identifier in `names` given `suffix` (whole words only)."""
    if not names:
        return line
    pattern = r"\b(" + "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True)) + r")\b"
    return re.sub(pattern, lambda mo: mo.group(1) + suffix, line)


def _needed(row_lines: list[str], uses: list[str]) -> list[str]:
    """The row lines that the lines `uses` read, directly or through other row lines."""
    words = set(re.findall(r"\w+", " ".join(uses)))
    kept = []
    for line in reversed(row_lines):
        defined = _DEFINED.search(line)
        if defined is None or defined.group(1) in words:
            kept.append(line)
            words |= set(re.findall(r"\w+", line.split("//")[0]))
    return kept[::-1]


def render(kernel, same: frozenset[str], row_lines: list, k_coords: list, lines: dict,
           stores: list) -> str:
    """The kernel, from the generic reduction's lines (cpp_reduction.py): the row's coordinates
    and values, the loop's values, the epilogue and the stores."""
    (r,) = [i for i in kernel.body if isinstance(i, Reduce)]
    phase = kernel.plan.phases[0]
    m, n = kernel.row_shape
    # what the row lines define (coordinates, bases, row values): each activation row its own
    row_names = {"row"} | {mo.group(1) for line in row_lines for mo in _DEFINED.finditer(line)}
    varying = {name for name in phase.loop if name not in same} | row_names
    shared = [lines[name] for name in phase.loop if name in same]
    rows, body = [], list(shared)
    for i in range(m):
        suffix = f"_m{i}"
        mine = [_renamed(lines[name], varying, suffix) for name in phase.loop if name not in same]
        operand = _renamed(convert(r.operand.name, r.operand.dtype, r.acc_dtype), varying, suffix)
        mine.append(f"acc{suffix} = acc{suffix} + {operand};")
        rows += [f"// activation row {i}"] + _needed(
            [f"const int64_t row{suffix} = {i} * N + n;"] +
            [_renamed(line, row_names, suffix) for line in row_lines], mine)
        body += [f"// activation row {i}"] + mine
    acc = CTYPE[r.acc_dtype]  # float, or double for a float64 sum
    value = convert(f"static_cast<{acc}>(total[m])", r.acc_dtype, r.var.dtype)
    if r.round_to is not None:
        value = f"fusec_round_{'f16' if r.round_to == torch.float16 else 'bf16'}({value})"
    return render_template(
        "cpp_gemv_rows.cpp.j2", name=kernel.name, summary=summary(kernel), m=m, n=n, k=kernel.k,
        kb=cpp_sum_block(kernel.k) or kernel.k, threshold=PARALLEL_THRESHOLD,
        params=[f"{'' if p.is_output else 'const '}{CTYPE[p.dtype]}* __restrict__ {p.name}_ptr"
                for p in kernel.params],
        row_lines=row_lines, weight_rows=_needed(["const int64_t row = n;"] + row_lines, shared),
        rows=rows, k_coords=k_coords, body=body, acc=acc,
        accs=[f"acc_m{i}" for i in range(m)], shared=", ".join(n for n in phase.loop if n in same),
        result=f"const {CTYPE[r.var.dtype]} {r.var.name} = {value};  // {r.origin}",
        epilogue=[lines[name] for name in phase.ready], stores=stores)

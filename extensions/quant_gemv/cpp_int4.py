"""The packed-int4 GEMV on a CPU: each group's sixteen weights, computed once, then looked up.

A packed-int4 linear (examples/int4_linear.py) dequantizes every nibble q of a group as
`(q - zero) * scale`, rounding to bfloat16 after the subtraction and after the multiplication,
as eager's bf16 arithmetic does. The generic C++ reduction (cpp/reduction.py) spells those steps
for every weight: four roundings per packed byte, each a handful of integer operations. On this
project's 2-core AMD EPYC that made the K = N = 2048 layer 2.4x slower than eager at M = 1
(4.9 ms against 2.0; `python examples/int4_linear.py`) and 10x slower at M = 4.

But a nibble has only sixteen values, and a group shares its zero point and scale. So this kernel
(extensions/quant_gemv/templates/cpp_gemv_int4.cpp.j2) walks each weight row a group at a time:

    float lut[16];   // lut[q] = (q - zero) * scale, each step rounded to bf16, as eager rounds it
    for (int q = 0; q < 16; ++q) lut[q] = fusec_round_bf16(fusec_round_bf16(q - zero) * scale);

(with gcc the sixteen entries as one vector, rounded all at once: fusec_round_bf16_v16)

then looks the group's weights up, `lut[p & 15]` and `lut[p >> 4]` for each byte p, into two
small arrays (with gcc sixteen at a time: `__builtin_shuffle` of the table as one vector, a
`vpermps` on AVX-512), and takes one dot product per activation row from them. The weights are the generic
kernel's, bit for bit: 32 roundings per group instead of four per byte (a group of 128 weights
has 64 bytes), no per-weight gathers of the zero point and scale, and each weight row
dequantized once for all M activation rows (the generic kernel's rows are (m, n) pairs, and it
dequantized the weight M times). A group's products are summed in float32 and the group sums
in double (cpp/reduction.py, note "long float sums"), so a group is at most MAX_GROUP_BYTES
bytes; longer ones keep the generic loop.

The pattern is extensions/quant_gemv/int4_words.py's (the Triton word kernel's): the same strict checks, so
anything else keeps the generic kernel. Never wrong, rarely slow.
"""
from __future__ import annotations

import re

import torch

from fusec import ops
from fusec.codegen.cpp.text import CTYPE, load_value, convert, literal
from fusec.codegen.cpu_plan import PARALLEL_THRESHOLD, TILE_STRIDE, summary
from fusec.ir import Load, Reduce

from .int4_words import Int4Words, match_int4_words
from .render import render_template

MAX_GROUP_BYTES = 256  # a group's packed bytes: one block of the blocked float sum at most


def match(kernel, lanes: int) -> Int4Words | None:
    """The packed-int4 form of this reduction kernel, when the table kernel can compute it."""
    plan = kernel.plan
    if lanes or len(kernel.k_shape) != 2 or kernel.k_shape[1] > MAX_GROUP_BYTES \
            or len(plan.phases) != 1 or plan.element_stores or plan.keep:
        return None
    n_rows = len(kernel.row_shape)
    for load in kernel.loads:  # a load the generic kernel copies row by row: not here
        ks = [abs(s) for s in load.index.strides[n_rows:] if s]
        if ks and min(ks) >= TILE_STRIDE:
            return None
    words, _ = match_int4_words(kernel)
    return words


def render(kernel, words: Int4Words, row_lines: list, k_coords: list, lines: dict,
           stores: list) -> str:
    """The table kernel, from the generic reduction's lines (cpp/reduction.py): the row's
    coordinates and values, the loop's loads and products, the epilogue and the stores."""
    (r,) = [i for i in kernel.body if isinstance(i, Reduce)]
    phase = kernel.plan.phases[0]
    m, n = kernel.row_shape if len(kernel.row_shape) == 2 else (1, kernel.row_shape[0])
    packed = words.packed.var.name
    skip = set(words.dequant) | {packed, words.scale.var.name} | \
        ({words.zero.var.name} if isinstance(words.zero, Load) else set())
    body = []
    for name in phase.loop:
        if name in (words.w_lo, words.w_hi):
            which = "w_lo" if name == words.w_lo else "w_hi"
            body.append(f"const float {name} = {which}[k - k_block];  // (q - zero) * scale")
        elif name not in skip:
            body.append(lines[name])
    value = convert("static_cast<float>(total[m])", r.acc_dtype, r.var.dtype)
    if r.round_to is not None:
        value = f"fusec_round_{'f16' if r.round_to == torch.float16 else 'bf16'}({value})"
    return render_template(
        "cpp_gemv_int4.cpp.j2", name=kernel.name, summary=summary(kernel), m=m, n=n,
        kb=kernel.k, gb=kernel.k_shape[1], threshold=PARALLEL_THRESHOLD,
        params=[f"{'' if p.is_output else 'const '}{CTYPE[p.dtype]}* __restrict__ {p.name}_ptr"
                for p in kernel.params],
        row_lines=row_lines, k_coords=k_coords, table=table_lines(words, kernel),
        packed=packed, packed_line=lines[packed], body=body, shuffle=kernel.k_shape[1] % 16 == 0,
        packed_at=re.sub(r"\bk\b", "(k_block + j + t)", lines[packed].split(" = ", 1)[1].rstrip(";")),
        operand=convert(r.operand.name, r.operand.dtype, r.acc_dtype),
        result=f"const {CTYPE[r.var.dtype]} {r.var.name} = {value};  // {r.origin}",
        epilogue=[lines[name] for name in phase.ready], stores=stores)


def table_lines(words: Int4Words, kernel) -> list[str]:
    """The group's zero point and scale (the template computes its table lut[16] from them)."""
    half = kernel.k_shape[1]  # packed bytes per group
    n_rows = len(kernel.row_shape)

    def group_value(g: Load, label: str) -> str:
        terms = [f"{g.var.name}_base"] if g.index.offset or any(g.index.strides[:n_rows]) else []
        st = g.index.strides[n_rows]
        terms.append("lut_g" if st == 1 else f"lut_g * {st}")
        ptr = f"{g.param}_ptr[{' + '.join(terms)}]"
        value = convert(load_value(ptr, g.dtype), ops.register_dtype(g.dtype), g.var.dtype)
        return f"const {CTYPE[g.var.dtype]} {label} = {value};"

    out = [f"const int64_t lut_g = k_block / {half};  // the group"]
    if isinstance(words.zero, Load):
        out.append(group_value(words.zero, "lut_zero"))
    else:
        out.append(f"const float lut_zero = {literal(words.zero, torch.float32)};")
    out.append(group_value(words.scale, "lut_scale"))
    return out

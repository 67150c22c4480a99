"""A GEMV with a few activation rows on a CPU: the weight's values computed once per weight row.

A linear with M activation rows (decoding a few tokens, a small batch) is a reduction over K
with rows (m, n): out[m, n] = sum_k x[m, k] * W[n, k], where W may itself be computed, an int8
weight widened to float (examples/int8_linear.py), say. The generic C++ reduction
(cpp_reduction.py) computes each row (m, n) on its own, so it loads and converts the weight row
n once for every m. At M = 4 that made the int8 linear of K = N = 2048 2.1x slower than eager on
this project's CPU (0.94 ms against 0.46; `python benchmarks/diagnostics/cpu_quant_linear.py`),
while at M = 1 it was 1.7x faster.

Everything the loop computes from inputs that do not depend on m (their stride along m is 0:
the weight, its conversions, a per-channel scale) is the same for every activation row. This
kernel (codegen/templates/cpp_gemv_rows.cpp.j2) walks each weight row one block of k at a time:

    float w[KB];                                   // the block's weight values, once
    for (k ...) w[k - k_block] = static_cast<float>(q[n * K + k]);
    for (m = 0; m < M; ++m)                        // then one dot product per activation row
        for (k ...) acc += x[m * K + k] * w[k - k_block];

Each block's products are summed in float32 (vectorized: one partial sum per SIMD lane), and
the block sums in double, in the generic kernel's blocks (cpu_plan.cpp_sum_block: at least 1024
values, because gcc adds a block's lanes up one by one at its end; with blocks of 256 that took
about half of this kernel's time at M = 4).

It is used for 2 <= M <= MAX_M, one sum and nothing else per row, when what is kept is more than
a plain load of a float32 weight (copying that would save nothing). Packed-int4 weights have
their own table kernel (cpp_int4.py), which does the same per group.
"""
from __future__ import annotations

import torch

from fusec import ops
from fusec.ir import Const, Load, Reduce

from .cpp_text import CTYPE, convert
from .cpu_plan import PARALLEL_THRESHOLD, TILE_STRIDE, cpp_sum_block, summary
from .render import render_template

MAX_M = 16  # activation rows at most (passes/small_matmul.py sends at most 8 on a CPU)
MAX_BLOCK = 4096  # longest block kept on the stack, per kept value


def block(k: int) -> int:
    """Values per block of the float sum (see the module's docstring)."""
    return cpp_sum_block(k) or k


def match(kernel, lanes: int) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(what is kept, what does not depend on m) when this kernel can compute the reduction,
    names of the loop's values in program order; None keeps the generic kernel."""
    plan = kernel.plan
    if lanes or kernel.k < 1 or len(kernel.row_shape) != 2 or not 2 <= kernel.row_shape[0] <= MAX_M \
            or kernel.row_shape[1] < 2 or len(plan.phases) != 1 or plan.element_stores or plan.keep:
        return None
    reds = [i for i in kernel.body if isinstance(i, Reduce)]
    if len(reds) != 1 or reds[0].op != "sum" or not reds[0].acc_dtype.is_floating_point:
        return None
    if block(kernel.k) > MAX_BLOCK:
        return None
    n_rows = len(kernel.row_shape)
    for load in kernel.loads:
        ks = [abs(s) for s in load.index.strides[n_rows:] if s]
        if load.valid is not None or (ks and min(ks) >= TILE_STRIDE):
            return None  # a piece of a cat, or a row the generic kernel gathers first
    loop = plan.phases[0].loop
    by_name = {l.var.name: l for l in kernel.loads} | {i.var.name: i for i in kernel.body}
    same: set[str] = set()  # the loop's values that do not depend on m
    for name in loop:
        item = by_name[name]
        if isinstance(item, Load):
            if item.index.strides[0] == 0 and any(item.index.strides[n_rows:]):
                same.add(name)
        elif all(isinstance(o, Const) or o.name in same for o in item.operands):
            same.add(name)
    reads = {o.name for name in loop if name not in same and not isinstance(by_name[name], Load)
             for o in by_name[name].operands if not isinstance(o, Const)}
    kept = tuple(n for n in loop if n in same and (n in reads or n == reds[0].operand.name))
    if not kept or any(reds[0].operand.name == n for n in kept) and len(kept) == len(loop):
        return None  # nothing the activation rows share (or nothing that depends on m at all)
    if all(isinstance(by_name[n], Load) and by_name[n].dtype == by_name[n].var.dtype == torch.float32
           for n in kept):
        return None  # a float32 weight read as is: keeping it would only copy it
    return kept, tuple(n for n in loop if n in same)


def render(kernel, shared, row_lines: list, k_coords: list, lines: dict, stores: list) -> str:
    """The kernel, from the generic reduction's lines (cpp_reduction.py): the row's coordinates
    and values, the loop's values, the epilogue and the stores."""
    kept, same = shared
    (r,) = [i for i in kernel.body if isinstance(i, Reduce)]
    by_name = {l.var.name: l for l in kernel.loads} | {i.var.name: i for i in kernel.body}
    phase = kernel.plan.phases[0]
    m, n = kernel.row_shape
    arrays = [f"{CTYPE[by_name[name].var.dtype]} kept_{name}[KB];" for name in kept]
    shared_loop = [lines[name] for name in phase.loop if name in same] + \
        [f"kept_{name}[k - k_block] = {name};" for name in kept]
    body = [f"const {CTYPE[by_name[name].var.dtype]} {name} = kept_{name}[k - k_block];"
            if name in kept else lines[name] for name in phase.loop if name not in same or name in kept]
    acc = CTYPE[r.acc_dtype]  # float, or double for a float64 sum
    value = convert(f"static_cast<{acc}>(total[m])", r.acc_dtype, r.var.dtype)
    if r.round_to is not None:
        value = f"fusec_round_{'f16' if r.round_to == torch.float16 else 'bf16'}({value})"
    return render_template(
        "cpp_gemv_rows.cpp.j2", name=kernel.name, summary=summary(kernel), m=m, n=n, k=kernel.k,
        kb=block(kernel.k), threshold=PARALLEL_THRESHOLD,
        params=[f"{'' if p.is_output else 'const '}{CTYPE[p.dtype]}* __restrict__ {p.name}_ptr"
                for p in kernel.params],
        row_lines=row_lines, k_coords=k_coords, arrays=arrays, shared=shared_loop, body=body,
        kept=", ".join(kept), acc=acc, operand=convert(r.operand.name, r.operand.dtype, r.acc_dtype),
        result=f"const {CTYPE[r.var.dtype]} {r.var.name} = {value};  // {r.origin}",
        epilogue=[lines[name] for name in phase.ready], stores=stores)

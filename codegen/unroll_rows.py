"""A matmul's few activation rows unrolled into its kernel (kernel IR to kernel IR, for the LLVM
and C++ backends).

A linear with M activation rows is a reduction with rows (m, n): out[m, n] = sum_k x[m, k] *
W[n, k]. Computed row by row, each weight row is loaded, and computed when the weight is
computed (unpacked from bytes and scaled, say), M times. `unroll_rows` rewrites the kernel so
that its rows are n alone and each row does the work of all M (m, n) rows:

    before: rows (m, n)   loads x[m, k], q[n, k]    w = f(q)    s = sum(x * w)     store out[m, n]
    after:  rows (n)      loads x[0, k] .. x[M-1, k], q[n, k]
                          w = f(q)                  (once: it does not depend on m)
                          s_m0 = sum(x_m0 * w) ... s_m3 = sum(x_m3 * w)
                          store out[0, n] .. out[M-1, n]

Every value that depends on m (a load with a stride along m, and everything computed from one)
gets one copy per activation row, named `<name>_m<i>`, whose loads and stores start i strides
further; what does not depend on m stays one value. The loop plan is made again for the new
kernel (codegen/lower_reduction.plan_loops), so the backend spells it like any reduction with
M sums in one loop: each weight value computed once, and M independent chains of additions.
The sums are the same sums, in the same blocks. Both CPU backends call it before they spell a
reduction (after the kernel families, codegen/families.py, have declined it).

Why: with a few rows, the weight's loads and the work on them are shared by every row; on this
project's CPU it cut an 8-bit linear's time at M = 4 by 30-65%, to below eager's.
"""
from __future__ import annotations

from dataclasses import replace
from math import prod

from fusec.ir import Const, Index, Reduce, ReductionKernel, Store, Var

from .lower_reduction import plan_loops

MAX_M = 8  # activation rows unrolled at most


def unrolled_or_same(kernel: ReductionKernel) -> tuple[ReductionKernel, str]:
    """(the kernel to spell, the line its source opens with after its summary): the unrolled
    kernel and a sentence saying so, or the kernel itself and ""."""
    out = unroll_rows(kernel)
    if out is None:
        return kernel, ""
    return out, (f"A matmul with {kernel.row_shape[0]} activation rows, unrolled into each row "
                 "(codegen/unroll_rows.py): a row is one weight row, whose values are computed "
                 "once, with one sum per activation row (`_m0`, `_m1`, ...).")


def unroll_rows(kernel: ReductionKernel) -> ReductionKernel | None:
    """The kernel with its M (2..MAX_M) activation rows unrolled (see above), or None when it is
    not a matmul-like sum whose loop computes something from the weight alone."""
    plan = kernel.plan
    # rows (m, n), or (m, n0, n1) for a weight packed along N (ReductionKernel.matmul_rows)
    split = kernel.split_columns and len(kernel.row_shape) == 1 + len(kernel.matmul_rows[1])
    if not (len(kernel.row_shape) == 2 or split) or not 2 <= kernel.row_shape[0] <= MAX_M \
            or kernel.k < 1 or prod(kernel.row_shape[1:]) < 2 or len(plan.phases) != 1 \
            or plan.element_stores \
            or plan.keep or kernel.online or kernel.variances:
        return None
    reds = [i for i in kernel.body if isinstance(i, Reduce)]
    if len(reds) != 1 or reds[0].op != "sum" or not reds[0].acc_dtype.is_floating_point:
        return None
    if any(load.valid is not None for load in kernel.loads):
        return None  # pieces of a cat: their validity is a loop dim, not kept apart here
    m = kernel.row_shape[0]
    by_m = {l.var.name for l in kernel.loads if l.index.strides[0] != 0}  # depends on m
    if any(load.gather is not None and load.gather[0] in by_m for load in kernel.loads):
        return None  # a gathered read whose row depends on m: each row would need its own
    for item in kernel.body:
        operands = (item.operand,) if isinstance(item, Reduce) else item.operands
        if any(isinstance(o, Var) and o.name in by_m for o in operands):
            by_m.add(item.var.name)
    loop = plan.phases[0].loop
    if all(name in by_m for name in loop) or not any(name in by_m for name in loop):
        return None  # nothing shared by the rows, or nothing that depends on m

    def var(v, i: int):
        return Var(f"{v.name}_m{i}", v.dtype) if isinstance(v, Var) and v.name in by_m else v

    def at(index: Index, i: int) -> Index:  # activation row i's part of an index
        return Index(index.offset + i * index.strides[0], index.strides[1:])

    loads, body, stores = [], [], []
    for load in kernel.loads:
        copies = range(m) if load.var.name in by_m else (0,)
        loads += [replace(load, var=var(load.var, i), index=at(load.index, i)) for i in copies]
    for item in kernel.body:
        copies = range(m) if item.var.name in by_m else (None,)
        for i in copies:
            if i is None:
                body.append(item)
            elif isinstance(item, Reduce):
                body.append(replace(item, var=var(item.var, i), operand=var(item.operand, i)))
            else:
                body.append(replace(item, var=var(item.var, i),
                                    operands=tuple(o if isinstance(o, Const) else var(o, i)
                                                   for o in item.operands)))
    for store in kernel.stores:  # every activation row's output (a store along m is M stores)
        copies = range(m) if store.index.strides[0] != 0 or store.var.name in by_m else (0,)
        stores += [Store(store.param, var(store.var, i), store.dtype, at(store.index, i))
                   for i in copies]
    names = lambda name: [f"{name}_m{i}" for i in range(m)] if name in by_m else [name]  # noqa: E731
    out = replace(kernel, row_shape=kernel.row_shape[1:], loads=loads, body=body, stores=stores,
                  varying={n for name in kernel.varying for n in names(name)},
                  level={n: lv for name, lv in kernel.level.items() for n in names(name)},
                  online=[], variances=[], matmul=None, plan=None)
    out.plan = plan_loops(out)
    return out

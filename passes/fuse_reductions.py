"""Reduction fusion: a reduction, the pointwise work feeding it and the work using its result,
as one kernel.

A reduction folds some dims of its input (the *reduced* dims) into one value per *row* (each
position of the remaining dims). Softmax over the last dim, after decomposition, reads:

    amax = amax(x, [-1], keepdim=True)      # reduction: one max per row
    sub  = x - amax                          # pointwise over (rows, k): an epilogue of amax ...
    exp  = exp(sub)                          # ... and a prologue of sum
    sum  = sum(exp, [-1], keepdim=True)      # reduction over the same rows
    div  = exp / sum                         # epilogue: broadcast back over the row

Eager runs five kernels and reads a row five times. fusec runs one kernel per block of rows:
load the row once, reduce, compute, reduce again, divide, store. The kernel template decides
nothing; this pass decides which nodes share the kernel:

    before (after fuse_pointwise)                  after
    amax = amax(x)                                 fused_amax_sub_exp_sum_div_0 = self.fused_...(x)
    fused_sub_exp_0 = self.fused_sub_exp_0(x, amax)    div = fused_amax_sub_exp_sum_div_0[0]
    sum = sum(exp)
    fused_div_1 = self.fused_div_1(exp, sum)

Every reduction group has a *key*: the shape it reduces and the reduced dims, e.g.
((4096, 4096), (1,)). A merge (along a data edge, of two reductions reading the same input, or,
once neither is left, of independent reductions with equal keys: `merge_siblings`) is legal when

1. the groups' keys agree (reductions over the same rows with the same reduced dims);
2. every node fits the key's loop: an *element* node has a shape that broadcasts to the reduced
   shape; a *row* node is constant along the reduced dims (keepdim shapes, like amax above); a
   value stored for outside users is a whole element tensor or a whole row tensor, never a
   partial broadcast (which the loop would store many times over);
3. a reduction without keepdim (`x.sum(-1)`, shape (rows,)) feeds only row computations: its
   shape no longer lines up with the input's dims, so broadcasting it back needs a view
   (`unsqueeze`), which stays outside; and a row computation reads no element value (with
   x (3, 3) and s (3,), `x.sum(-1) + s.sin()`: sin(s) also fits the element loop, where it
   would be computed per k, not per row);
4. it creates no cycle (as in fuse_pointwise).

It starts from the pointwise groups fuse_pointwise formed (inlined back into the graph) and keeps
merging until nothing changes. Refusals are added to `record_of(gm).refusals` with reasons.
"""
from __future__ import annotations

import torch.fx as fx

from fusec.symbolic import hashable, hint
from fusec.sizes import same_shape
from fusec import ops
from fusec.codegen import backends
from fusec.codegen.cpu_plan import MIN_LAST
from fusec.record import Decision, Refusal, record_of

from .grouping import (Group, gathered_from, broadcasts_to, creates_cycle, effect_edges, indexed_write,
                       inline_groups, is_cat, meta, op_name, outline)


def fuse_reductions(gm: fx.GraphModule) -> fx.GraphModule:
    refusals = list(record_of(gm).refusals)
    gm, prior = inline_groups(gm)
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    effects = effect_edges(graph)

    group_of: dict[fx.Node, Group] = {}
    for g in prior:
        for n in g.nodes:
            group_of[n] = g
    for node in graph.nodes:
        red = ops.reduction(node)
        if red is None:
            continue
        reason = few_long_rows(node, red)
        if reason:  # torch's own reduction kernel, an extern step
            refusals.append(Refusal(red.operand.name, node.name, reason))
            continue
        group_of[node] = Group([node], reduction_key(node, red))
    if not any(g.key for g in group_of.values()):
        return _finish(gm, group_of, order, effects, refusals)

    seen_refusals = set()
    # the backend compile_graph builds for (absent when a pass runs on its own: then a CPU
    # device means a CPU backend); only C++/LLVM kernels walk one row at a time
    backend = record_of(gm).backend
    rows_one_by_one = backends.get(backend).rows_one_by_one if backend else None

    def try_merge(a: Group, b: Group, producer: fx.Node, consumer: fx.Node) -> bool:
        reason = why_not_fuse(a, b, order, effects, rows_one_by_one)
        if reason:
            key = (producer.name, consumer.name)
            if key not in seen_refusals:
                seen_refusals.add(key)
                refusals.append(Refusal(producer.name, consumer.name, reason))
            return False
        merged = Group(sorted(a.nodes + b.nodes, key=order.__getitem__), a.key or b.key)
        for n in merged.nodes:
            group_of[n] = merged
        return True

    decisions = []
    changed = True
    while changed:
        changed = False
        for node in graph.nodes:
            if node not in group_of:
                continue
            # along data edges: prologues into a reduction, epilogues out of it
            for producer in node.all_input_nodes:
                a, b = group_of.get(producer), group_of[node]
                if a is None or a is b or (a.key is None and b.key is None):
                    continue
                changed |= try_merge(a, b, producer, node)
            # sibling reductions reading the same value: one pass over the rows for both
            red = group_of[node]
            if red.key is not None and ops.reduction(node) is not None:
                operand = ops.reduction(node).operand
                for other in operand.users:
                    g = group_of.get(other)
                    if g is not None and g is not group_of[node] and same_key(g.key, group_of[node].key):
                        changed |= try_merge(group_of[node], g, node, other)
        if not changed:
            changed = merge_siblings(graph, group_of, try_merge, decisions)
    record_of(gm).fuse_reductions = decisions
    return _finish(gm, group_of, order, effects, refusals)


def same_key(a, b) -> bool:
    """Whether two groups' reduction keys (iteration shape, reduced dims) are the same. In a
    shape family the shapes hold symbols: they are compared as expressions, so `(s0, 64)` and
    `(64, 64)` differ without a guard (comparing the SymInts would guard `s0 != 64` and narrow
    the family for a fusion that was never going to apply to every size)."""
    return hashable(a) == hashable(b)


def merge_siblings(graph: fx.Graph, group_of: dict, try_merge, decisions: list) -> bool:
    """Merge independent reductions with equal keys that read different values; True if any did.

    A norm's backward ends with two column sums over the same rows, the gradients of its weight
    and bias: `sum(dy * xhat, [0])` and `sum(dy, [0])`. No data flows between them and they
    read different values, so neither the data edges nor the same-operand rule above join them;
    yet they walk the same rows with the same reduced dims, so one loop over the rows computes
    both, and a value both read (dy) is loaded once. The merge obeys the same legality checks
    as every other (`why_not_fuse`: no cycle, same device, ...); taken ones are recorded in
    `record_of(gm).fuse_reductions`, refused ones with the other refusals. A matmul computed as a
    sum (node meta "fusec_matmul", set by a kernel family's graph rewrite) is left alone: a family
    matches a kernel that holds one such sum, so two siblings keep a kernel each."""
    reductions = [n for n in graph.nodes if n in group_of and group_of[n].key is not None
                  and ops.reduction(n) is not None and "fusec_matmul" not in n.meta]
    for i, node in enumerate(reductions):
        for other in reductions[i + 1:]:
            a, b = group_of[node], group_of[other]
            if a is b or not same_key(a.key, b.key):
                continue
            if try_merge(a, b, node, other):
                decisions.append(Decision(
                    f"{node.name}, {other.name}", True,
                    f"independent reductions of {a.key[0]} over dims {a.key[1]}: one loop over "
                    "the rows computes both"))
                return True
    return False


def _finish(gm, group_of, order, effects, refusals):
    groups = list({id(g): g for g in group_of.values()}.values())
    names = {n.name: g for n, g in group_of.items()}
    # a refusal fuse_pointwise recorded is void if both ends share a kernel now
    refusals = [r for r in refusals
                if names.get(r.producer) is None or names.get(r.producer) is not names.get(r.consumer)]
    for g in groups:
        if g.key is not None:
            for n in g.nodes:
                n.meta["fusec_space"] = space(n, g.key, set(g.nodes))
    gm = outline(gm, groups, order, effects, refusals)
    record_of(gm).refusals = refusals
    return gm


# Devices whose reductions are refused by `few_long_rows`: GPUs, where a program per row leaves
# most of the chip idle when there are few rows (a CPU thread walks rows one by one anyway).
FEW_ROWS_DEVICES = ("cuda",)
FEW_PROGRAMS = 132  # below this many programs (the SMs of an H100/H200) ...
LONG_PROGRAM = 1 << 16  # ... of at least this many elements each, torch's reduction wins
COLUMN_ROWS = 64  # rows per program of a Triton column reduction (codegen/triton/reduction.py, COLUMN_XBLOCK)


def programs_of(node: fx.Node, red: ops.ReductionCall) -> tuple[int, int, int, int]:
    """(rows, k, rows per program, programs) of a reduction as a Triton kernel would run it:
    one program per row, or COLUMN_ROWS adjacent rows per program for a column reduction
    (rows side by side in memory, each row's elements strided), with the strides the layout
    pass chose."""
    shape, strides = meta(red.operand).shape, meta(red.operand).stride  # after the layout pass
    shape, strides = hint(shape), hint(strides)  # (a heuristic: a family's at its traced sizes)
    k = rows = 1
    for d, size in enumerate(shape):
        if d in red.dims:
            k *= size
        else:
            rows *= size
    kept = [strides[d] for d, size in enumerate(shape) if d not in red.dims and size > 1]
    reduced = [strides[d] for d in red.dims if shape[d] > 1]
    column = bool(kept and reduced) and min(kept) == 1 and min(reduced) > 1
    per_program = COLUMN_ROWS if column and rows >= COLUMN_ROWS else 1
    return rows, k, per_program, -(-rows // per_program)


def few_long_rows(node: fx.Node, red: ops.ReductionCall) -> str | None:
    """Why this reduction should stay torch's own kernel, or None.

    fusec's reduction kernels give each row (or a block of rows) its own program, which walks
    the row's k elements in a loop. `sigmoid(conv(x)).sum(dim=(1, 2, 3))` on a batch of 32
    images has 32 rows of a million elements: 32 programs on a GPU of 132 SMs, each streaming
    4 MB alone, 4x slower than eager (measured on an H100). The same happens to a
    global average pool over a channels-last tensor: 2048 (image, channel) rows, but a column
    reduction takes 64 adjacent channels per program, so 32 programs again. The split_reductions
    pass splits such rows in two reductions first; what reaches this pass still looking like
    that is a reduction it could not split (argmax, a row of a prime length ...), and it runs as
    an extern (eager's kernel, which splits rows across blocks) with its prologue as a
    pointwise kernel: the same work as eager, never slower."""
    if not str(meta(node).device).startswith(FEW_ROWS_DEVICES):
        return None
    rows, k, per_program, programs = programs_of(node, red)
    if programs < FEW_PROGRAMS and per_program * k >= LONG_PROGRAM and \
            not spread_columns(node, rows, per_program):
        what = (f"{rows} row(s) of {k} elements" if per_program == 1 else
                f"{rows} rows of {k} elements, {per_program} adjacent rows per program (a column "
                f"reduction)")
        return (f"few long rows: {what} would be {programs} program(s) on a GPU of "
                f"{FEW_PROGRAMS} SMs; torch's reduction splits each row across blocks (kept as an "
                f"extern: split_reductions could not split it)")
    return None


def spread_columns(node: fx.Node, rows: int, per_program: int) -> str | None:
    """Why a column reduction (`programs_of`) has no few long rows, or None. The pass that made
    `node` may say that its kernel takes only as many neighbouring columns per program as keep
    every SM busy, and why (`node.meta["fusec_spreads_columns"]`, a kernel family's): then it has
    programs enough once there are 2 * FEW_PROGRAMS columns, and neither split_reductions nor
    few_long_rows touches it."""
    why = node.meta.get("fusec_spreads_columns")
    return why if why and per_program > 1 and rows >= 2 * FEW_PROGRAMS else None


def reduction_key(node: fx.Node, red: ops.ReductionCall) -> tuple:
    """(shape reduced, reduced dims): reductions with equal keys walk the same rows."""
    return (tuple(meta(red.operand).shape), red.dims)


def rows_shape(key: tuple) -> tuple[int, ...]:
    shape, dims = key
    return tuple(s for d, s in enumerate(shape) if d not in dims)


def keep_shape(key: tuple) -> tuple[int, ...]:
    shape, dims = key
    return tuple(1 if d in dims else s for d, s in enumerate(shape))


def leading(key: tuple) -> bool:
    """Reduced dims 0..n-1: then a result without keepdim still lines up with the input."""
    return key[1] == tuple(range(len(key[1])))


def space(node: fx.Node, key: tuple, inside: set) -> str:
    """"rows" for values derived from a reduction without keepdim (shape = the rows), else
    "elem" (shape broadcasts to the reduced input; a "row" value is elem-space, constant in k)."""
    if leading(key):
        return "elem"
    red = ops.reduction(node)
    if red is not None:
        return "elem" if red.keepdim else "rows"
    if node.meta.get("fusec_pieces") and node.users and all(
            u in inside and any(a is not node and a in inside and space(a, key, inside) == "rows"
                                for a in u.all_input_nodes) for u in node.users):
        return "rows"  # pieces read per row (biases joined along the rows): with the sums
    if any(a in inside and space(a, key, inside) == "rows" for a in node.all_input_nodes):
        return "rows"
    return "elem"


def why_not_fuse(a: Group, b: Group, order: dict, effects: dict,
                 rows_one_by_one: bool | None = None) -> str | None:
    if a.key is not None and b.key is not None and not same_key(a.key, b.key):
        return (f"different reductions: {a.key[0]} over dims {a.key[1]} vs {b.key[0]} over dims "
                f"{b.key[1]}")
    key = a.key or b.key
    if a.perms or b.perms:
        return "one side is a horizontally fused kernel (several iteration orders in one loop)"
    if any(indexed_write(n) is not None for n in (*a.nodes, *b.nodes)):
        return "one side writes one position of a buffer (an indexed write): a pointwise kernel's"
    gathered = gathered_from(a, b)
    if gathered:
        return gathered
    if any(is_cat(n) and not n.meta.get("fusec_pieces") for n in (*a.nodes, *b.nodes)):
        # (except tensors read where they lie as pieces along a reduction's rows, `fusec_pieces`)
        return "one side concatenates (torch.cat): only a pointwise kernel reads pieces"
    if meta(a.nodes[0]).device != meta(b.nodes[0]).device:
        return "different devices"
    inside = set(a.nodes) | set(b.nodes)
    shape = key[0]
    for n in inside:
        red = ops.reduction(n)
        if red is not None:
            continue
        m = meta(n).shape
        where = space(n, key, inside)
        if where == "rows":
            if not broadcasts_to(m, rows_shape(key)):
                return f"{n.name} {m} does not fit the rows {rows_shape(key)} of the reduction"
            if any(u in inside and space(u, key, inside) == "elem" for u in n.users):
                return (f"{n.name} is a reduction result without keepdim; broadcasting it back "
                        "over the reduced dims needs a view, which stays outside the kernel")
            elem_in = [a for a in n.all_input_nodes if a in inside and space(a, key, inside) == "elem"]
            if elem_in:
                # e.g. x.sum(-1) + s.sin() with x (3, 3) and s (3,): sin(s) fits the element
                # loop as well (s broadcast along k), and would be read there, one k at a time
                return (f"{n.name} computes one value per row but reads {elem_in[0].name}, which "
                        "the kernel computes per element")
            continue
        if not broadcasts_to(m, shape):
            return f"different iteration space {m} vs the reduction's {shape}"
        stored = any(u not in inside for u in n.users)
        padded = (1,) * (len(shape) - len(m)) + tuple(m)
        if stored and not (same_shape(padded, shape) or same_shape(padded, keep_shape(key))):
            return (f"{n.name} {m} is used outside and is neither a whole element tensor "
                    f"{shape} nor a whole row tensor {keep_shape(key)}")
    slow = scalar_row_math(inside, key) if rows_one_by_one is not False else None
    if slow:
        return slow
    if creates_cycle(a, b, order, effects):
        return "would create a cycle (a path between them leaves through another node)"
    return None


# Note (row math across a strided axis on the CPU): a C++/LLVM reduction kernel walks one row at a
# time, so a value computed once per row (tanh of a row's minimum, say) is computed in scalar
# code, one libm call per row. When the reduced axis is not the innermost one (the channels of an
# NCHW tensor: thousands of short rows), that is thousands of scalar calls where eager, or a
# pointwise kernel over the row results, runs the same math 8 lanes at a time. Such row math stays
# out of the reduction kernel on the CPU and becomes its own (vectorized) kernel. Triton kernels
# (on a GPU, or under the interpreter) compute a block of rows at once and are not affected, and
# neither are CPU kernels whose innermost dim is a row dim of at least MIN_LAST contiguous rows:
# both CPU backends turn those loops inside out (codegen/cpu_plan.py, Note: rows side by side),
# with the rows of a block in SIMD lanes, so their row math is vectorized too (log_softmax over
# dim 0 of 1024 x 1024 floats: one kernel, not a reduction and a pointwise kernel after it).
CHEAP_ROW_OPS = {"add", "sub", "mul", "neg", "abs", "relu", "maximum", "minimum", "clamp", "where",
                 "eq", "ne", "lt", "le", "gt", "ge", "copy", "to", "full", "truediv", "div",
                 "squeeze", "unsqueeze", "view", "expand", "permute"}
SCALAR_ROWS_MIN = 256  # fewer rows than this: a separate kernel costs more than the scalar math


def rows_side_by_side(operand, shape, dims) -> bool:
    """Whether the row dims end in a run of at least MIN_LAST rows next to each other in memory
    (strides 1, then the run's size so far, ...): the CPU kernel computes them in SIMD lanes."""
    run, expected = 1, 1
    for d in reversed([d for d in range(len(shape)) if d not in dims]):
        if shape[d] == 1:
            continue
        if operand.stride[d] != expected:
            break
        run *= shape[d]
        expected *= shape[d]
    return run >= MIN_LAST


def scalar_row_math(inside: set, key: tuple) -> str | None:
    """Why a CPU reduction kernel should not take this row math (see the note above), or None."""
    shape, dims = key
    reds = [n for n in inside if ops.reduction(n) is not None]
    if not reds or meta(reds[0]).device != "cpu" or not shape or not dims:
        return None
    operand = meta(ops.reduction(reds[0]).operand)
    # (a heuristic: a shape family's sizes decide by the size they were traced with, unguarded)
    strides, sizes = hint(operand.stride), hint(shape)
    inner = min(range(len(shape)), key=lambda d: (abs(strides[d]) if sizes[d] > 1 else 1 << 62))
    rows = 1
    for d, size in enumerate(sizes):
        rows *= size if d not in dims else 1
    if inner in dims or rows < SCALAR_ROWS_MIN or rows_side_by_side(operand, shape, dims):
        return None
    keep = keep_shape(key)
    for n in sorted(inside, key=lambda n: n.name):
        name = op_name(n)
        if ops.reduction(n) is not None or name.split("_")[0] in CHEAP_ROW_OPS \
                or name.startswith(("logical_", "bitwise_")):
            continue
        m = meta(n).shape
        padded = (1,) * (len(shape) - len(m)) + tuple(m)
        per_row = space(n, key, inside) == "rows" or (len(padded) == len(shape) and all(
            padded[d] == 1 for d in dims) and broadcasts_to(m, keep))
        if per_row and any(ops.reduction(a) is not None or a in inside for a in n.all_input_nodes):
            return (f"{n.name} ({name}) would run once per row in scalar code: the reduction "
                    f"crosses a strided axis ({rows} rows), so it runs faster as its own vectorized "
                    "kernel on the CPU (note: row math across a strided axis)")
    return None

"""Where a packed-int4 GEMV of one activation row is cut along K: the GEMV's split rule.

Two 4-bit layouts are read along N, so that a program which took all of K for its columns
would own so many columns that most of the GPU would wait:

* AWQ's words, eight output columns to an int32 along N (`packed_along_n`): refine_views
  computes the weight as (K/G, G, N/8, 8), a sum over two dims whose output columns are (N/8, 8);
* GPTQ's words, eight rows of K to an int32, stored N-contiguous (`packed_along_k`): the weight
  is (K/G, G/8, 8, N), a sum over three dims; or, in AutoGPTQ's torch path, (K/8, 8, N) with the
  zero points and scales read through g_idx (`scales[g_idx]`), the groups then the tables' rows.

Each layout's rule returns (dim, chunks, layout, kernel): the reduced dim to cut (the groups', of
the largest stride) and into how many chunks of whole groups; or None. `split_rule` is what
small_matmul.py hangs on the GEMV's sum (`node.meta["fusec_split_rule"]`): the core's
passes/split_reductions.py asks it first, cuts the sum as it says and keeps its reason. Their
kernels are triton_gemv_int4_columns.py and triton_gemv_int4_k_words.py (here), which check when
they run what the graph cannot promise (the shift amounts, the zero points' range, g_idx).
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from fusec import env, ops

from fusec.passes.grouping import meta

aten = torch.ops.aten


# A GEMV whose weight is packed along N (AWQ: eight 4-bit columns to an int32 word) at M = 1.
# Its words are read along N, a warp's 32 lanes on 32 neighbouring words of a row of K (128
# bytes), so a program that took all of K would own 256 columns: 32 programs for N = 8192. Cut
# K instead, into chunks of whole groups of at least PACKED_CHUNK rows: K = N = 8192 with groups
# of 128 is 64 chunks x 32 programs. The chunks' partial sums (64 x N floats, 6% of the packed
# weight's bytes) are added up by a second, small kernel. 128 rows measured fastest on an H200
# (the prototype of extensions/quant_gemv/triton_gemv_int4_columns.py, K = N = 8192: 256 rows
# took 1.25x its time, 512 rows 1.9x).
PACKED_CHUNK = 128


def split_rule(node: fx.Node, red: ops.ReductionCall) -> tuple | None:
    """(dim, chunks, why) for split_reductions when the GEMV's sum `node` is one of the layouts
    above at M = 1; None for every other reduction (the core's rules then apply)."""
    packed = packed_along_n(node, red) or packed_along_k(node, red)
    if packed is None:
        return None
    d, chunks, layout, kernel = packed
    k = math.prod(meta(red.operand).shape[r] for r in red.dims)
    return d, chunks, (f"a GEMV of {layout} at M = 1: K = {k} cut in {chunks} chunks of "
                       f"{k // chunks} (whole groups), each chunk's partial sums by one kernel "
                       f"({kernel}), then added up")


def packed_along_n(node: fx.Node, red: ops.ReductionCall) -> tuple | None:
    """(dim, chunks, layout, kernel) for the sum of a GEMV (extensions/quant_gemv/small_matmul.py) of one
    activation row whose output columns are computed in parts (a weight packed along N,
    extensions/quant_gemv/refine_views.py) and whose K is cut in groups (the dim of the largest stride, K / G,
    and the group, G); None for every other reduction."""
    gemv = node.meta.get("fusec_matmul")
    if not _one_row_gemv(gemv, red) or len(red.dims) != 2:
        return None
    m = meta(red.operand)
    kept = [size for d, size in enumerate(m.shape) if d not in red.dims and size > 1]
    if len(kept) < 2 or math.prod(kept) != gemv["n"]:
        return None
    return _chunks_of_groups(red, PACKED_CHUNK, "a weight packed along N",
                             "extensions/quant_gemv/triton_gemv_int4_columns.py")


# GPTQ's int4 words (K / 8, N) int32, packed along K, N contiguous, at M = 1: refine_views
# computes the weight as (K / G, G / 8, 8, N), a sum over three dims. Read along N as well (a
# program of 128 columns), so K is cut the same way (extensions/quant_gemv/triton_gemv_int4_k_words.py). On an
# H200 (one CUDA graph, do_bench), K = N = 8192, chunks of 128 rows were the fastest, 2.6x the
# one GEMV (docs/passes/split_reductions.md).
K_WORDS_CHUNK = 128


def packed_along_k(node: fx.Node, red: ops.ReductionCall) -> tuple | None:
    """(dim, chunks, layout, kernel) for the sum of a GEMV of one activation row over int4
    words packed along K and stored N-contiguous (see K_WORDS_CHUNK); None for every other
    reduction."""
    gemv = node.meta.get("fusec_matmul")
    if not _one_row_gemv(gemv, red) or len(red.dims) not in (2, 3):
        return None
    m = meta(red.operand)
    kept = [d for d, size in enumerate(m.shape) if d not in red.dims and size > 1]
    nibble = max(red.dims)
    if [m.shape[d] for d in kept] != [gemv["n"]] or m.shape[nibble] != 8 \
            or not _words_along_k(red.operand, nibble - len(m.shape), kept[0] - len(m.shape)):
        return None
    layout, kernel = "int4 words packed along K (N contiguous)", "extensions/quant_gemv/triton_gemv_int4_k_words.py"
    if len(red.dims) == 3:
        return _chunks_of_groups(red, K_WORDS_CHUNK, layout, kernel)
    # (K / 8, 8): the groups are rows of tables read through g_idx (AutoGPTQ's torch path,
    # `scales[g_idx]`), G = K / their rows; the kernel checks g_idx per group when it runs
    k, words = 8 * m.shape[min(red.dims)], m.shape[min(red.dims)]
    groups = {meta(g.source).shape[g.dim] for g in _gathers(red.operand)}
    if len(groups) != 1 or k % next(iter(groups)) or (k // next(iter(groups))) % 8:
        return None
    unit = k // next(iter(groups)) // 8  # word rows per group
    per_chunk = next((c for c in range(unit, words + 1, unit)
                      if words % c == 0 and 8 * c >= K_WORDS_CHUNK), words)
    return None if words // per_chunk < 2 else (min(red.dims), words // per_chunk, layout
                                                + ", groups read through an index", kernel)


def _gathers(value: fx.Node) -> list:
    """The gathered reads (ops.gathered_read) that `value` computes from through pointwise ops."""
    found, stack, seen = [], [value], set()
    while stack:
        v = stack.pop()
        if not isinstance(v, fx.Node) or v in seen or v.op != "call_function":
            continue
        seen.add(v)
        gather = ops.gathered_read(v)
        if gather is not None:
            found.append(gather)
        elif ops.classify(v.target) == ops.POINTWISE:
            stack += [a for a in v.args if isinstance(a, fx.Node)]
    return found


def _one_row_gemv(gemv: dict | None, red: ops.ReductionCall) -> bool:
    return bool(gemv) and gemv["m"] == 1 and red.op.name == "sum" \
        and env.flag("FUSEC_INT4_COLUMNS", True)


def _words_along_k(value: fx.Node, nibble: int, n: int) -> bool:
    """Whether `value` is computed (through pointwise ops) from int32 words shifted right, the
    words the same for the eight positions of dim `nibble` and contiguous along dim `n` (both
    counted from the end, as broadcasting aligns shapes)."""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if not isinstance(v, fx.Node) or v in seen or v.op != "call_function" \
                or ops.classify(v.target) != ops.POINTWISE:
            continue
        seen.add(v)
        if v.target in (aten.bitwise_right_shift.Tensor, aten.__rshift__.Tensor) \
                and isinstance(v.args[0], fx.Node) and meta(v.args[0]).dtype == torch.int32:
            w = meta(v.args[0])
            return len(w.shape) >= -min(nibble, n) and w.stride[n] == 1 \
                and 0 in (w.shape[nibble] - 1, w.stride[nibble])
        stack += [a for a in v.args if isinstance(a, fx.Node)]
    return False


def _chunks_of_groups(red: ops.ReductionCall, rows: int, layout: str, kernel: str) -> tuple | None:
    """(dim, chunks, layout, kernel): K cut along its groups (the reduced dim of the largest
    stride, K / G) in chunks of whole groups of at least `rows` rows; None if that leaves one."""
    m = meta(red.operand)
    d = max(red.dims, key=lambda d: (abs(m.stride[d]), -d))
    groups, group = m.shape[d], math.prod(m.shape[r] for r in red.dims) // m.shape[d]
    per_chunk = next((c for c in range(1, groups + 1)
                      if groups % c == 0 and c * group >= rows), groups)
    return None if groups // per_chunk < 2 else (d, groups // per_chunk, layout, kernel)

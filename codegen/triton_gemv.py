"""Triton GEMV: a small-M matmul with its dequantization prologue (passes/small_matmul.py) as one
kernel that streams the weight once: the block sizes (`gemv_blocks`, `gemv_dot_blocks`), when
tensor-core dots of bf16 tiles are exact (`dot_terms`), and the renderer (`render_gemv`,
templates/triton_gemv.py.j2). triton_reduction.py hands a reduction here when `gemv_fits`.
"""
from __future__ import annotations

import math
import re

import torch

from fusec.ir import Const, Index, Reduce, Stmt, short_dtype as short

from .render import render_template
from .triton_text import TL, _helpers_in, _max_address, _stmt, _summary, convert


# ---- GEMV: a small-M matmul with its dequantization prologue (passes/small_matmul.py) --------
#
# Note (GEMV kernels): the generic reduction template gives each row of the output, here each
# (m, n) pair, its own pass over K, so with M rows the weight is streamed M times. A GEMV keeps
# all M rows of a block of output columns in one program instead: the weight tile is loaded (and
# dequantized) once and multiplied by every activation row while it sits in registers. The
# kernel IR is the same ReductionKernel; only the walk differs, so the CPU backends (which
# already read a row's K elements contiguously) keep their reduction templates.

GEMV_MAX_M = 16  # activation rows kept in registers; passes/small_matmul.py stays below this
GEMV_TILE = 8192  # f32 partial sums per program, [BLOCK_M, BLOCK_N, BLOCK_K]: 64 per thread
GEMV_WEIGHT_TILE = 4096  # weight elements per program per iteration, [BLOCK_N, BLOCK_K]


def gemv_fits(kernel) -> bool:
    """A GEMV-shaped reduction: one sum over K, rows (M, N) or (N,) with M small, no element
    values stored (those need the generic walk)."""
    reds = [i for i in kernel.body if isinstance(i, Reduce)]
    return (kernel.gemv is not None and len(reds) == 1 and reds[0].op == "sum"
            and 1 <= len(kernel.row_shape) <= 2 and kernel.k > 0 and kernel.rows > 0
            and (len(kernel.row_shape) == 1 or kernel.row_shape[0] <= GEMV_MAX_M)
            and not kernel.plan.element_stores)


SMS = 132  # streaming multiprocessors of an H100/H200: the grid should cover each at least twice


def gemv_blocks(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps). All M rows in one block; 4 warps. Output columns
    per program: 8 at M = 1, fewer as M grows (the partial sums are M x BLOCK_N x BLOCK_K
    registers), and fewer for narrow layers so that there are about 2 programs per SM (a
    1024-wide key/value projection gets 2 columns per program, 512 programs, rather than 64
    programs that leave half the GPU idle). BLOCK_K: a 4096-element weight tile per iteration
    within the partial-sum budget. Chosen from `benchmarks/quant_linear.py --sweep` on an H100
    (docs/gpu.md): at M = 1, K = N = 8192, 8 x 512 x 4 warps streamed int8 weights at 1.65 TB/s,
    16 x 1024 x 8 warps at 1.47 and 32 columns at under 1.0."""
    block_m = 1 << max(m - 1, 0).bit_length()
    block_n = min(8 if block_m == 1 else max(2, 16 // block_m),
                  1 << max(n // (2 * SMS), 1).bit_length() - 1)
    block_k = min(max(16, GEMV_WEIGHT_TILE // block_n), max(16, GEMV_TILE // (block_m * block_n)),
                  max(16, 1 << max(k - 1, 0).bit_length()))
    num_warps = 4
    return block_m, block_n, block_k, num_warps


def gemv_dot_blocks(m: int, n: int, k: int, terms: int = 1) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the tensor-core GEMV (M > 1).
    tl.dot needs every dim >= 16, so the M rows are padded to 16 (the padding rows cost tensor-core
    time, which a weight-streaming kernel has plenty of). A 32 x 256 weight tile per iteration:
    BLOCK_K counts stored elements, so a packed int4 byte (two dots, `terms` = 2) gets 128. 16
    columns per program when 32 would leave SMs idle. From `benchmarks/quant_linear.py --sweep`
    on an H200 (docs/gpu.md), K = N = 8192: int8 at M = 4 and 16 streamed 1.39 TB/s with 32 x 256
    (16 x 256: 1.04, 64 x 128: 1.16-1.20), packed int4 0.30-0.45 with 32 or 64 x 128."""
    block_m = max(16, 1 << max(m - 1, 0).bit_length())
    block_n = 32 if n >= 32 * SMS else 16
    block_k = max(16, min(256 // terms, 1 << max(k - 1, 0).bit_length()))
    return block_m, block_n, block_k, 4, 3


GEMV_STAGES = 3  # software-pipelining depth of the lane version's K loop (Triton's default)
GEMV_DOT_MIN_M = 2  # from this many rows on, tensor-core dots (benchmarks/quant_linear.py --sweep)
BF16_EXACT_INTS = (torch.int8, torch.uint8)  # every value of these is a bf16 number


def dot_terms(kernel, operand: str, producers: dict, n_rows: int) -> list[tuple[str, str]] | None:
    """The reduction's operand as a sum of products x * w, with x varying along (m, k) only and
    w along (n, k) only, both exactly bf16 numbers: then a tensor-core dot of bf16 tiles with a
    float32 accumulator computes exactly the products the lanes version adds (bf16 x bf16 fits
    a float32 mantissa), in another order. None when the operand has another form."""
    axes_of: dict[str, frozenset] = {}

    def axes(name: str) -> frozenset:
        if name not in axes_of:
            item = producers[name]
            if isinstance(item, Stmt):
                out = frozenset().union(*[axes(o.name) for o in item.operands
                                          if not isinstance(o, Const)])
            else:
                st = item.index.strides
                out = frozenset(ax for ax, s in zip("mn"[2 - n_rows:], st[:n_rows]) if s)
                out |= {"k"} if any(st[n_rows:]) else frozenset()
            axes_of[name] = out
        return axes_of[name]

    def exact(name: str) -> bool:
        item = producers[name]
        if not isinstance(item, Stmt):
            return item.dtype == torch.bfloat16 or item.dtype in BF16_EXACT_INTS
        if item.round_to == torch.bfloat16 or item.var.dtype in (torch.bfloat16, *BF16_EXACT_INTS):
            return True
        return item.op in ("to", "copy") and not isinstance(item.operands[0], Const) \
            and exact(item.operands[0].name)

    def terms(name: str):
        item = producers[name]
        if not isinstance(item, Stmt) or any(isinstance(o, Const) for o in item.operands):
            return None
        if item.op == "add":
            a, b = (terms(o.name) for o in item.operands)
            return None if a is None or b is None else a + b
        if item.op != "mul":
            return None
        a, b = (o.name for o in item.operands)
        x_axes = frozenset("mk") if n_rows == 2 else frozenset("k")
        if axes(b) <= x_axes and "n" in axes(a):
            a, b = b, a
        if not (axes(a) <= x_axes and axes(b) <= frozenset("nk") and exact(a) and exact(b)):
            return None
        return [(a, b)]

    return terms(operand)


def k_terms(strides: tuple[int, ...], k_shape: tuple[int, ...]) -> list[str]:
    """Address terms along K. A tensor whose K dims are back to back in memory (the packed
    weight, viewed as (K/G, G/2) groups) is addressed by the flat `ks` itself, so Triton sees
    consecutive addresses and emits wide vector loads; others (a per-group scale) by coordinates.
    """
    whole = all(strides[d] == strides[d + 1] * k_shape[d + 1] for d in range(len(k_shape) - 1))
    if whole and strides[-1]:
        return ["ks" if strides[-1] == 1 else f"ks * {strides[-1]}"]
    return [f"k{d}" if st == 1 else f"k{d} * {st}" for d, st in enumerate(strides) if st]


def render_gemv(kernel) -> str:
    (r,) = [i for i in kernel.body if isinstance(i, Reduce)]
    two = len(kernel.row_shape) == 2
    m, n = (kernel.row_shape if two else (1, kernel.row_shape[0]))
    producers = {l.var.name: l for l in kernel.loads}
    producers.update((item.var.name, item) for item in kernel.body)
    # M > 1: the products as tensor-core dots, when the operand is a sum of exact bf16 products
    dot = dot_terms(kernel, r.operand.name, producers, 2) if two and m >= GEMV_DOT_MIN_M else None
    if dot:
        block_m, block_n, block_k, num_warps, num_stages = gemv_dot_blocks(m, n, kernel.k, len(dot))
    else:
        (block_m, block_n, block_k, num_warps), num_stages = gemv_blocks(m, n, kernel.k), GEMV_STAGES
    n_rows = len(kernel.row_shape)
    row_axes = ["m", "n"] if two else ["n"]
    k_coords = []
    for d in range(len(kernel.k_shape)):
        below = math.prod(kernel.k_shape[d + 1:])
        expr = "ks" if below == 1 else f"(ks // {below})"
        k_coords.append(f"k{d} = {expr}" + ("" if d == 0 else f" % {kernel.k_shape[d]}"))

    def index(idx: Index) -> tuple[str, str | None]:
        terms, masks = [], []
        for axis, st in zip(row_axes, idx.strides[:n_rows]):
            if st:
                terms.append(axis if st == 1 else f"{axis} * {st}")
                masks.append(f"{axis}_mask")
        kterms = k_terms(idx.strides[n_rows:], kernel.k_shape)
        if kterms:
            masks.append("k_mask")
        terms += kterms
        if not terms:
            terms = ["tl.zeros([1, 1, 1], tl.int32)"]  # one element, the same for every lane
        addr = " + ".join(([str(idx.offset)] if idx.offset else []) + terms)
        return addr, (" & ".join(masks) or None)

    group = kernel.k_shape[-1] if len(kernel.k_shape) == 2 else 0

    def per_group(idx: Index) -> bool:
        """A value constant within each group of K (a per-group scale or zero point: it varies
        along the group dim k0 only), when the chunk holds whole groups."""
        ks_ = idx.strides[n_rows:]
        return bool(group > 1 and len(ks_) == 2 and ks_[0] and not ks_[1]
                    and block_k % group == 0)

    def load_line(l) -> str:
        if l.var.name in kernel.varying and per_group(l.index):
            return group_load_lines(l)
        addr, mask = index(l.index)
        value = f"tl.load({l.param}_ptr + {addr}" + (f", mask={mask})" if mask else ")")
        if l.dtype != l.var.dtype:
            value = convert(value, l.dtype, l.var.dtype)
        return f"{l.var.name} = {value}"

    def group_load_lines(l) -> str:
        # one load per group of the chunk, then each value repeated over its group's lanes
        terms, masks = [], ["g_mask"]
        for axis, st in zip(row_axes, l.index.strides[:n_rows]):
            if st:
                terms.append(axis if st == 1 else f"{axis} * {st}")
                masks.append(f"{axis}_mask")
        st = l.index.strides[n_rows]
        terms.append("gs" if st == 1 else f"gs * {st}")
        addr = " + ".join(([str(l.index.offset)] if l.index.offset else []) + terms)
        value = f"tl.load({l.param}_ptr + {addr}, mask={' & '.join(masks)})"
        if l.dtype != l.var.dtype:
            value = convert(value, l.dtype, l.var.dtype)
        lead = ["BLOCK_M" if two and l.index.strides[0] else "1",
                "BLOCK_N" if l.index.strides[n_rows - 1] else "1"]
        return (f"{l.var.name} = tl.reshape(tl.broadcast_to(({value})[:, :, :, None], "
                f"[{lead[0]}, {lead[1]}, BLOCK_K // {group}, {group}]), "
                f"[{lead[0]}, {lead[1]}, BLOCK_K])")

    helpers: set = set()

    def line(name: str) -> str:
        item = producers[name]
        if isinstance(item, Stmt):
            return _stmt(item, helpers, block="[1, 1, 1]")
        return load_line(item)

    # the loop plan's one phase (gemv_fits): row values before it, and after it the epilogue
    [phase] = kernel.plan.phases
    row_lines = [line(name) for name in kernel.plan.before]
    epilogue = [line(name) for name in phase.ready]
    value = convert("sums", r.acc_dtype, r.var.dtype)
    if r.round_to is not None:
        value = convert(convert(value, r.var.dtype, r.round_to), r.round_to, r.var.dtype)
    epilogue.insert(0, f"{r.var.name} = {value}  # {r.origin}")

    # the tensor-core form multiplies the activation and the weight tiles itself: what they need
    needed = kernel.values_needed({name for pair in dot for name in pair}) if dot else phase.loop
    loop_lines = ["# load this chunk of K: each value with the extent it varies along"]
    loop_lines += [line(n) for n in needed if not isinstance(producers[n], Stmt)]
    stmts = [n for n in needed if isinstance(producers[n], Stmt)]
    unpack = any(producers[n].op in ("rshift", "bitwise_and") for n in stmts)
    loop_lines.append("# prologue: dequantize the weight tile in registers, then multiply")
    if unpack:
        loop_lines.append("# (this is where the int4 nibbles are unpacked: w & 0x0F is the low "
                          "4-bit weight of each byte, w >> 4 the high one)")
    loop_lines += [line(n) for n in stmts]
    operand = convert(r.operand.name, r.operand.dtype, r.acc_dtype)
    dot_lines = []
    for i, (x, w) in enumerate(dot or []):
        dot_lines += [
            f"x_tile{i} = tl.reshape(tl.broadcast_to(tl.where(k_mask, {x}, 0.0), "
            f"[BLOCK_M, 1, BLOCK_K]), [BLOCK_M, BLOCK_K])",
            f"w_tile{i} = tl.reshape(tl.broadcast_to(tl.where(k_mask, {w}, 0.0), "
            f"[1, BLOCK_N, BLOCK_K]), [BLOCK_N, BLOCK_K])",
            f"acc += fusec_dot_bf16(x_tile{i}, w_tile{i})"]
    helpers |= {"fusec_dot_bf16"} if dot else set()

    stores = []
    for s in kernel.stores:
        addr, mask = index(s.index)
        stores.append(f"tl.store({s.param}_ptr + {addr}, {convert(s.var.name, s.var.dtype, s.dtype)}"
                      + (f", mask={mask})" if mask else ")"))
    # the weight: what varies along n and k but not m
    weights = sorted({short(l.dtype) for l in kernel.loads if l.var.name in kernel.varying
                      and l.index.strides[n_rows - 1] and not (two and l.index.strides[0])})
    big = max([kernel.numel] + [_max_address(a.index, kernel.row_shape + kernel.k_shape)
                                for a in [*kernel.loads, *kernel.stores]]) >= 2 ** 31 - 1
    group_lines = []
    if any("gs" in line for line in loop_lines):
        group_lines = [f"# the groups of {group} along K in this chunk: their scales and zero points "
                       f"are loaded once each",
                       f"gs = k_start // {group} + tl.arange(0, BLOCK_K // {group})[None, None, :]",
                       f"g_mask = gs < {kernel.k_shape[0]}"]
    programs = -(-n // block_n)
    helpers |= _helpers_in(row_lines + loop_lines + epilogue + stores)
    return render_template(
        "triton_gemv.py.j2", name=kernel.name, summary=_summary(kernel), m=m, n=n, k=kernel.k,
        block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps, programs=programs,
        num_stages=num_stages, dot_lines=dot_lines,
        weight_dtypes=", ".join(weights) or "as stored",
        unpack_note=" (unpacking the int4 nibbles)" if unpack else "",
        acc_dtype=short(r.acc_dtype), acc_tl=TL[r.acc_dtype],
        n_start="pid.to(tl.int64) * BLOCK_N" if big else "pid * BLOCK_N",
        helpers=sorted(helpers), params=[f"{p.name}_ptr" for p in kernel.params],
        args=[p.name for p in kernel.params], row_lines=row_lines,
        loop_lines=[c for c in k_coords if re.search(rf"\b{c.split(' ')[0]}\b", "\n".join(
            row_lines + loop_lines + epilogue + stores))] + group_lines + loop_lines,
        operand=operand, epilogue=epilogue, stores=stores)

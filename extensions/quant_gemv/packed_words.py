"""Is this GEMV of 2 to 16 rows an int4 weight packed eight nibbles to an int32 word, along K
(GPTQ) or along N (AWQ), that the tensor-core kernel can multiply (triton_gemv_packed_mma.py)?

Both formats dequantize a weight the same way, w = round_half((q - zero) * scale) with
q = (word >> shift) & 15 (examples/gptq_linear.py, examples/awq_linear.py); only where a word's
eight nibbles go differs, and that is a parameter here, `along`:

    along "k" (GPTQ)   rows (M, N) x k ([groups,] G/8, 8)   word [i, n] holds rows 8i + t of
                                                           column n, t = 0..7 the last K dim
    along "n" (AWQ)    rows (M, N/8, 8) x k ([groups,] G)  word [k, j] holds columns 8j + c of
                                                           row k, c = 0..7 the last row dim

The walk down the dequantization is int4_columns.py's `dequant_chain` (the M = 1 chunk matchers
share it); this module checks what the tensor-core kernel needs on top: the activation is a plain
half-precision load, every load varies as its format says (the strides below), a group holds
whole chunks of K, the K loop computes nothing else, and what follows the sum reads nothing
along K (it becomes the epilogue of the kernel that adds the partial sums). The shift amounts,
zero points and scales are read when the kernel runs: it checks there that the shifts put one
row (or column) in each nibble and that q - zero and the weights are exact, and computes its
share the exact way, eager's statements weight by weight, when they are not.

GPTQ's zero points and scales may also be read through g_idx (`scales[g_idx]`, AutoGPTQ's torch
path): K is then (word rows, 8) and the groups are the tables' rows; the kernel checks per chunk
that g_idx names the chunk's group (`_g_idx`).

The packed-bytes int4 form (two nibbles a byte, a bf16 zero point subtracted in bf16) is
int4_words.py's: its rounding differs, and so does its kernel (triton_gemv_int4_mma.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fusec.codegen.triton.text import max_address
from fusec.ir import Load, Reduce, Stmt

from .int4_columns import INTS, Chain, chain_values, dequant_chain, match_chunk, require

HALF = (torch.float16, torch.bfloat16)
F32 = torch.float32
MIN_M, MAX_M = 2, 16  # tl.dot's smallest tile side is 16: the rows are padded to it


@dataclass(frozen=True)
class PackedWords:
    """What the tensor-core kernel reads, with each load's strides over the coordinates of its
    format (`along`): "k": (m, n, group, word row of the group, nibble); "n": (m, word column,
    column of the word, group, row of the group)."""

    along: str  # "k" (GPTQ: eight rows of K a word) or "n" (AWQ: eight columns a word)
    chain: Chain  # the dequantization, x * round_half((q - zero) * scale)
    words: Load
    shifts: tuple[str, ...]  # the loads and statements computing the shift amounts, in order
    zero: Load | int | None  # per (group, column), a constant, or none
    scale: Load  # per (group, column)
    x: Load  # the activations, half precision
    half: torch.dtype  # the activations', scales' and dequantized weight's dtype
    m: int
    n: int  # output columns
    k: int
    group: int  # rows of K per group
    weight_side: tuple[str, ...]  # the loads and statements that compute a weight, in order
    strides: dict  # load name -> its strides over the format's five coordinates
    g_idx: Load | None = None  # the group of each row of K, when zero and scale are read through it


def match_packed_words(kernel) -> tuple[PackedWords | None, str]:
    """(pattern, why): a GEMV of 2 to 16 rows over int4 words packed along K or N, or None and
    why not."""
    rows = kernel.matmul_rows
    if rows is None:
        return None, "not a GEMV"
    m, cols = rows
    if not MIN_M <= m <= MAX_M or len(kernel.row_shape) != 1 + len(cols):
        return None, f"M = {m}: the tensor-core kernel takes {MIN_M} to {MAX_M} rows"
    if cols == (kernel.row_shape[-1],) and kernel.k_shape[-1:] == (8,):
        along = "k"
    elif len(cols) == 2 and cols[1] == 8:
        along = "n"
    else:
        return None, "neither eight rows of K (GPTQ) nor eight columns (AWQ) a word"
    found = "int4 words packed along " + ("K (GPTQ)" if along == "k" else "N (AWQ)")
    return match_chunk(kernel, lambda kern, r, producers: _match(kern, r, producers, along),
                       found, gathers=True)


def _match(kernel, r: Reduce, producers, along: str) -> PackedWords:
    c = dequant_chain(r, producers, INTS)
    require(all(l.gather is None or l in (c.scale, c.zero) for l in kernel.loads),
            "a gathered read other than the zero points' and the scales'")
    g_idx = _g_idx(c, producers, along)
    x = producers.get(_through(producers, c.x))
    half = c.mul.round_to
    require(isinstance(x, Load) and x.dtype == half == c.scale.dtype,
            f"the activation {c.x} is not a {half} load like the scales (a computed one stays in "
            "the general GEMV)")
    m = kernel.row_shape[0]
    if along == "k":
        n = kernel.row_shape[1]
        *groups, rows, _ = kernel.k_shape
        require(len(groups) <= 1, "K is not (groups, word rows, 8 nibbles)")
        group = 8 * rows
        k = 8 * rows * (groups[0] if groups else 1)
        if g_idx is not None:  # K is (word rows, 8): the groups are the tables' rows
            require(not groups and k % c.scale.gather[2] == 0 and k // c.scale.gather[2] % 8 == 0,
                    f"{c.scale.gather[2]} groups do not cut K = {k} into groups of whole words")
            group = k // c.scale.gather[2]
            rows = group // 8

        def coords(l: Load) -> tuple:  # (m, n, group, word row, nibble)
            st = tuple(l.index.strides)
            return st if groups else st[:2] + (rows * st[2],) + st[2:]
    else:
        _, nw, _ = kernel.row_shape
        n = 8 * nw
        *groups, group = kernel.k_shape
        require(len(groups) <= 1, "K is not (groups, rows of a group)")
        k = group * (groups[0] if groups else 1)

        def coords(l: Load) -> tuple:  # (m, word column, column of the word, group, row)
            st = tuple(l.index.strides)
            return st if groups else st[:3] + (group * st[3],) + st[3:]
    shifts = tuple(kernel.values_needed([c.shift.operands[1].name], only_varying=False))
    weight_side = _weight_side(kernel, c, shifts)
    strides = {l.var.name: coords(l) for l in kernel.loads if l.var.name in weight_side}
    strides[x.var.name] = coords(x)
    _layouts(c, x, shifts, producers, strides, along, group)
    _only_the_product(kernel, r, c, x, weight_side)
    chunk = 128 if along == "k" else 16
    require(group % chunk == 0, f"groups of {group} rows: the tensor-core kernel needs whole "
            f"chunks of {chunk} rows of K in a group")
    if g_idx is not None:
        require(strides[g_idx.var.name] == (0, 0, 8 * rows, 8, 1),
                "the group index g_idx is not one value per row of K")
    shape = kernel.row_shape + kernel.k_shape
    require(max(max_address(a.index, shape) for a in [*kernel.loads, *kernel.stores]) < 2 ** 31 - 1,
            "addresses past 2^31 elements (the tensor-core kernel computes them in 32 bits)")
    return PackedWords(along, c, c.words, shifts, c.zero, c.scale, x, half, m, n, k, group,
                       weight_side, strides, g_idx)


def _g_idx(c: Chain, producers, along: str) -> Load | None:
    """The group index that zero points and scales are read through (AutoGPTQ's torch path,
    `scales[g_idx]`, examples/gptq_linear.py), or None when they are read per group. The kernel
    assumes g_idx[k] = k // G (a checkpoint quantized in order) and checks it per chunk when it
    runs; a chunk where it does not hold (act order) takes the exact way, which reads through
    g_idx as eager does."""
    tables = [c.scale] + ([c.zero] if isinstance(c.zero, Load) else [])
    if all(t.gather is None for t in tables):
        return None
    require(along == "k", "zero points or scales read through an index with words packed along N")
    pos = c.scale.gather[0] if c.scale.gather else None
    require(all(t.gather is not None and t.gather[0] == pos for t in tables),
            "zero points and scales not both read through one group index")
    g_idx = producers.get(pos)
    require(isinstance(g_idx, Load) and g_idx.dtype in (torch.int32, torch.int64)
            and g_idx.gather is None and g_idx.valid is None,
            "the zero points and scales are not read through a loaded group index")
    require(len({t.gather[2] for t in tables}) == 1, "zero points and scales of other group counts")
    return g_idx


def _through(producers, name: str) -> str:
    """Past exact conversions of a half-precision load to float32."""
    item = producers.get(name)
    while isinstance(item, Stmt) and item.op in ("to", "copy") and item.round_to is None \
            and item.var.dtype == F32 and item.operands[0].dtype in HALF + (F32,):
        name = item.operands[0].name
        item = producers.get(name)
    return name


def _weight_side(kernel, c: Chain, shifts: tuple) -> tuple[str, ...]:
    """The names that compute the rounded weight, in program order (loads first)."""
    made = chain_values(kernel, c) | set(shifts)
    made |= {c.scale.gather[0]} if c.scale.gather else set()
    needed = set(kernel.values_needed([c.weight], only_varying=False))
    require(needed <= made | {c.weight}, "the weight is computed from more than its words, "
            "shift amounts, zero points and scales")
    return tuple(name for name in kernel.values_needed([c.weight], only_varying=False))


def _layouts(c: Chain, x: Load, shifts, producers, strides: dict, along: str, group: int) -> None:
    """Each load varies as the format says: the strides over the five coordinates."""
    words = strides[c.words.var.name]
    groups_of = [c.scale] + ([c.zero] if isinstance(c.zero, Load) else [])
    xs = strides[x.var.name]
    if along == "k":  # (m, n, group, word row, nibble)
        rows = group // 8
        require(words[0] == 0 and words[1] != 0 and words[3] != 0 and words[4] == 0
                and words[2] == rows * words[3], "the packed weight is not (K / 8, N) words")
        for g in groups_of:
            st = strides[g.var.name]
            require(st[0] == 0 and st[1] != 0 and st[3:] == (0, 0) and not (g.gather and st[2]),
                    f"{g.var.name} is not one value per (group, column)")
        require(xs[1] == 0 and xs[4] != 0 and xs[3] == 8 * xs[4] and xs[2] == rows * xs[3],
                "the activations are not one row of K for every column")
    else:  # (m, word column, column of the word, group, row)
        require(words[0] == 0 and words[1] != 0 and words[2] == 0 and words[4] != 0
                and words[3] == group * words[4], "the packed weight is not (K, N / 8) words")
        for g in groups_of:
            st = strides[g.var.name]
            require(st[0] == 0 and st[2] != 0 and st[1] == 8 * st[2] and st[4] == 0,
                    f"{g.var.name} is not one value per (group, column)")
        require(xs[1:3] == (0, 0) and xs[4] != 0 and xs[3] == group * xs[4],
                "the activations are not one row of K for every column")
    along_nibbles = 4 if along == "k" else 2  # the coordinate that names a word's nibble
    for name in shifts:
        item = producers[name]
        require(not item.var.dtype.is_floating_point, f"the shift amount {name} is a float")
        require(isinstance(item, Stmt) or not any(
            s for d, s in enumerate(strides[name]) if d != along_nibbles),
                f"the shift amounts ({name}) do not vary along the nibbles of a word only")


def _only_the_product(kernel, r: Reduce, c: Chain, x: Load, weight_side) -> None:
    """The K loop computes the product of x and the weight and nothing else; what follows the
    sum reads nothing along K."""
    producers = {l.var.name: l for l in kernel.loads}
    producers.update((item.var.name, item) for item in kernel.body)
    allowed = set(weight_side) | {r.operand.name, c.x, x.var.name}
    allowed |= {n for n in producers if isinstance(producers[n], Stmt) and _through(producers, n)
                in (x.var.name, c.weight)}  # (the widened activation and weight)
    loop = set(kernel.plan.phases[0].loop) if len(kernel.plan.phases) == 1 else None
    require(loop is not None, "more than one pass over K")
    extra = sorted(loop - allowed)
    require(not extra, f"the K loop computes more than the int4 product: {', '.join(extra)}")
    n_rows = len(kernel.row_shape)
    for name in (*kernel.plan.before, *kernel.plan.phases[0].ready):
        item = producers[name]
        require(not isinstance(item, Load) or (item.valid is None and item.gather is None
                and not any(item.index.strides[n_rows:])),
                f"the epilogue reads {name} along K or in pieces")

"""Is this reduction one K chunk of a GPTQ-style GEMV: int4 weights packed eight to an int32 word
along K, the words stored with N contiguous, dequantized per group as `(q - zero) * scale`, for
one activation row?

GPTQ checkpoints store a linear layer's (K, N) weight as `qweight` (K/8, N) int32: word [i, n]
holds rows 8i .. 8i + 7 of column n, row 8i + t in bits 4t .. 4t + 3. Their plain-torch
dequantization (AutoGPTQ's torch path, examples/gptq_linear.py) shifts each nibble out, keeps 4
bits, subtracts the group's zero point (unpacked from `qzeros` by a small kernel of its own) and
multiplies by the group's scale. After extensions/quant_gemv/refine_views.py and extensions/quant_gemv/small_matmul.py the
product is a GEMV whose K is (K/G, G/8, 8); on a GPU passes/split_reductions.py cuts it into
chunks of whole groups. One chunk's kernel IR (`print(cf.kernels[i].ir)`) reads:

    rows (S, N) x k (C, G/8, 8)                   chunk s, column n; group, word row, nibble
    load  x  = x[...]        f16/bf16             per k: the same for every column
                                                  (or computed from such loads: a norm's output)
    load  w  = qweight[...]  i32                  one word per (word row, column)
    load  sh = shifts[...]   i32                  per nibble t: where row 8i + t sits in the word
    load  z  = zeros[...]    int                  per (group, column)
    load  s  = scales[...]   f16/bf16             per (group, column)
    q = (w >> sh) & 15 (in int32, or narrowed to int8 first);  d = q - z
    wt = d * s (rounded to half precision, eager's dequantized weight)
    partial = sum over k of x * wt  (float32)

`match_int4_k_words` recognises that form (the zero point may also be a constant, or absent) and
returns what the kernel (extensions/quant_gemv/triton_gemv_int4_k_words.py) needs, or None and why not; then the
generic reduction kernel renders the chunk, correct and slower. The walk down the dequantization
is shared with AWQ's matcher (extensions/quant_gemv/int4_columns.py, `dequant_chain`); only the layouts differ.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fusec.ir import Load, Reduce, Stmt

from .int4_columns import INTS, require, dequant_chain, match_chunk, only_the_product

F32 = torch.float32


@dataclass(frozen=True)
class Int4KWords:
    """What the K-packed kernel reads, and its sizes: S chunks of C groups of G rows of K, N
    columns."""

    words: Load  # the packed weight, int32, one word per (word row, column)
    shifts: tuple[str, ...]  # the loads and statements that compute the shift amounts, in order
    # (per nibble of a word; the last is the int32 amount)
    zero: Load | int | None  # an integer per (group, column), a constant, or None
    scale: Load  # half precision per (group, column)
    x: tuple[str, ...]  # the loads and statements that compute the activation, in order
    x_var: str  # the activation as a float32, the product's other factor
    chunks: int  # S
    n: int  # N
    groups: int  # C: groups per chunk
    group: int  # G: rows of K per group
    half: torch.dtype  # the dtype the dequantized weight is rounded to
    g_idx: Load | None = None  # the group of each row of K, when zero and scale are read through it


def match_int4_k_words(kernel) -> tuple[Int4KWords | None, str]:
    """(pattern, why): the K-packed int4 form of one K chunk of a GEMV, or None and why not."""
    if len(kernel.row_shape) != 2:
        return None, "the rows are not (chunks, columns)"
    if len(kernel.k_shape) not in (2, 3) or kernel.k_shape[-1] != 8:
        return None, "K is not (groups,) word rows x the 8 nibbles of a word"
    return match_chunk(kernel, _match, "int4 words packed along K, N contiguous: one chunk of K, "
                       "dequantized once per group", gathers=True)


def chunk_of_k_words(kernel) -> bool:
    """Whether the kernel looks like a chunk of a GEMV over int4 words packed along K (rows
    (chunks, columns), K ending in the 8 nibbles of a word, an int32 load that differs from chunk
    to chunk and column to column), whether or not `match_int4_k_words` takes it: one that it
    declines is rendered by the generic reduction kernel, whose docstring then says why."""
    return (kernel.matmul is not None and len(kernel.row_shape) == 2
            and len(kernel.k_shape) in (2, 3) and kernel.k_shape[-1] == 8
            and any(l.dtype == torch.int32 and l.index.strides[0] and l.index.strides[1]
                    for l in kernel.loads))


def _match(kernel, r: Reduce, producers) -> Int4KWords:
    chunks, n = kernel.row_shape
    c = dequant_chain(r, producers, INTS)
    if c.scale.gather is not None:
        return _match_through_g_idx(kernel, r, producers, c)
    if len(kernel.k_shape) == 2:
        groups, (rows, _) = 1, kernel.k_shape
    else:
        groups, rows, _ = kernel.k_shape
    group = 8 * rows
    require(all(l.gather is None for l in kernel.loads), "a gathered read other than the scales'")

    def strides(l: Load) -> tuple[int, int, int, int, int]:
        """(chunk, column, group, word row, nibble); with one group per chunk the group's stride
        is made up from the word row's (G / 8 rows further on)."""
        st = l.index.strides
        return (st[0], st[1], rows * st[2], st[2], st[3]) if groups == 1 else tuple(st)

    shift_values, x_values = _checked_rest(kernel, r, producers, c, strides)
    require(strides(c.words) == (groups * group // 8 * n, 1, group // 8 * n, n, 0),
             "the packed weight is not (K / 8, N) words, N contiguous")
    for g in (c.scale,) + ((c.zero,) if isinstance(c.zero, Load) else ()):
        st = strides(g)
        per_group = st[0] if groups == 1 else st[2]
        require(st[1] != 0 and per_group != 0 and st[3:] == (0, 0) and st[0] == groups * per_group,
                 f"{g.var.name} is not one value per (group, column)")
    return Int4KWords(c.words, shift_values, c.zero, c.scale, x_values, c.x, chunks, n, groups,
                      group, c.mul.round_to)


def _checked_rest(kernel, r: Reduce, producers, c, strides) -> tuple[tuple, tuple]:
    """(shift values, activation values): the names computing the shift amounts and the
    activation, after checking that they vary as the kernel needs, that the kernel computes
    nothing else, and that it stores the chunk's float32 sums alone."""
    # the shift amounts: loaded, or computed from loads, varying along the nibbles only
    shift_values = tuple(kernel.values_needed([c.shift.operands[1].name], only_varying=False))
    for name in shift_values:
        item = producers[name]
        require(not item.var.dtype.is_floating_point and (
            isinstance(item, Stmt) or not any(strides(item)[:4])),
                 "the shift amounts do not vary along the nibbles of a word only")
    # the activation: loaded, or computed (a norm's scaling, SwiGLU's product ...) from values
    # that are the same for every column
    x_values = tuple(kernel.values_needed([c.x], only_varying=False))
    for name in x_values:
        item = producers[name]
        require(not isinstance(item, Reduce) and (isinstance(item, Stmt) or item.index.strides[1] == 0),
                 f"the activation ({c.x}) depends on the output column")
    only_the_product(kernel, r, c, shift_values + x_values)
    return shift_values, x_values


def _match_through_g_idx(kernel, r: Reduce, producers, c) -> Int4KWords:
    """AutoGPTQ's torch path reads zero point and scale of row k through g_idx[k]
    (`scales[g_idx]`): K is (word rows, 8 nibbles), and the groups are the tables' rows,
    G = K / their number. The kernel assumes g_idx[k] = k // G (checkpoints quantized in order)
    and checks it per group when it runs; a chunk where it does not hold (act order) takes the
    exact path, which reads through g_idx as eager does."""
    chunks, n = kernel.row_shape
    require(len(kernel.k_shape) == 2, "K is not (word rows, 8 nibbles) with groups read through an index")
    words, _ = kernel.k_shape
    pos, _, size = c.scale.gather
    g_idx = producers.get(pos)
    require(isinstance(g_idx, Load) and g_idx.dtype in (torch.int32, torch.int64)
             and g_idx.gather is None and tuple(g_idx.index.strides) == (8 * words, 0, 8, 1),
             "the scales are not read through one loaded group index per row of K")
    k = chunks * words * 8
    group = k // size
    require(k % size == 0 and group % 8 == 0 and (8 * words) % group == 0
             and (group // 8) & (group // 8 - 1) == 0,
             f"{size} groups do not cut K = {k} into chunks of whole groups of a power of two "
             "times 8 rows")

    def strides(l: Load) -> tuple:
        st = l.index.strides
        return (st[0], st[1], group // 8 * st[2], st[2], st[3])

    shift_values, x_values = _checked_rest(kernel, r, producers, c, strides)
    require(tuple(c.words.index.strides) == (words * n, 1, n, 0),
             "the packed weight is not (K / 8, N) words, N contiguous")
    tables = (c.scale,) + ((c.zero,) if isinstance(c.zero, Load) else ())
    require(all(l.gather is None or l in tables for l in kernel.loads),
             "a gathered read other than the zero points' and the scales'")
    for g in tables:
        require(g.gather is not None and g.gather[0] == pos and g.index.strides[0] == 0
                 and g.index.strides[1] != 0 and tuple(g.index.strides[2:]) == (0, 0),
                 f"{g.var.name} is not one value per (group, column) read through g_idx")
    return Int4KWords(c.words, shift_values, c.zero, c.scale, x_values, c.x, chunks, n,
                      8 * words // group, group, c.mul.round_to, g_idx)

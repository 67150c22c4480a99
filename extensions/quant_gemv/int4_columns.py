"""Is this reduction one K chunk of an AWQ-style GEMV: int4 weights packed eight to an int32
word along N, dequantized per group as `(q - zero) * scale`, for one activation row?

AWQ's plain-torch dequantization (examples/awq_linear.py, and AutoAWQ's own torch path) shifts
each nibble out of its word, keeps 4 bits, subtracts an int8 zero point and multiplies by a
half-precision scale. After passes/constant_gathers.py, extensions/quant_gemv/refine_views.py and
extensions/quant_gemv/small_matmul.py it is a GEMV whose output columns are (N/8, 8), and on a GPU
passes/split_reductions.py cuts its K into chunks of whole groups (a partial sum per chunk,
added up by a second, small kernel). One chunk's kernel IR (`print(cf.kernels[i].ir)`) reads:

    rows (S, N/8, 8) x k (G,)                     chunk s, word column j, column t of the word
    load  x  = x[...]       f16                   the chunk's activations, the same for every column
                                                  (or computed from such loads: a norm's output)
    load  w  = qweight[...] i32                   one word per (k, j): eight columns' nibbles
    load  sh = shifts[...]  i32                   per t: where column t's nibble sits in the word
                                                  (or computed from such loads)
    load  z  = zeros[...]   i8                    per (group, column)
    load  s  = scales[...]  f16                   per (group, column)
    q = to_i8(w >> sh) & 15;  d = q - z (int8);  wt = d * s (rounded to f16)
    partial = sum over k of x * wt  (float32)

`match_int4_columns` recognises exactly that form (the zero point may also be a constant, or
absent) and
returns what the kernel (extensions/quant_gemv/triton_gemv_int4_columns.py) needs, or None and why not; then
the generic reduction kernel renders the chunk, correct and slower. The shift amounts are read
when the kernel runs (they are a folded constant, but a kernel IR holds no values); the kernel
itself checks that they put one column in each nibble, and computes its chunk the exact way
when they do not.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fusec.ir import Const, Load, Reduce, Stmt

HALF = (torch.float16, torch.bfloat16)
F32 = torch.float32


@dataclass(frozen=True)
class Int4Columns:
    """What the column-packed kernel reads, and its sizes: S chunks, NW words per K row (8
    columns each), C groups of G rows per chunk."""

    words: Load  # the packed weight, int32, one word per (k, word column)
    shifts: tuple[str, ...]  # the loads and statements that compute the shift amounts, in order
    # (per column of a word; the last is the int32 amount)
    zero: Load | int | None  # int8 per (group, column), a constant, or None (no zero point)
    scale: Load  # half precision per (group, column)
    x: tuple[str, ...]  # the loads and statements that compute the activation, in order
    x_var: str  # the activation as a float32, the product's other factor
    chunks: int  # S
    nw: int  # words per K row: N / 8
    groups: int  # C: groups per chunk
    group: int  # G: rows of K per group
    half: torch.dtype  # the dtype the dequantized weight is rounded to


class _NoMatch(Exception):
    """Why the kernel is not a packed-int4 chunk's form (the message is the reason shown)."""


def require(ok: bool, why: str) -> None:
    if not ok:
        raise _NoMatch(why)


def match_int4_columns(kernel) -> tuple[Int4Columns | None, str]:
    """(pattern, why): the column-packed int4 form of one K chunk of a GEMV, or None and why."""
    if len(kernel.row_shape) != 3 or kernel.row_shape[2] != 8:
        return None, "the rows are not (chunks, words, 8 columns of a word)"
    if len(kernel.k_shape) not in (1, 2):
        return None, "K is not (groups,) rows of one group"
    return match_chunk(kernel, _match,
                       "int4 words packed along N: one chunk of K, dequantized once per group")


def match_chunk(kernel, match, found: str, gathers: bool = False):
    """(match(kernel, its sum, its producers), found), or (None, why not): the checks every
    packed-int4 chunk matcher starts with (one float32 sum, no piecewise reads, and no gathered
    ones unless `gathers`)."""
    reds = [i for i in kernel.body if isinstance(i, Reduce)]
    if len(reds) != 1 or reds[0].op != "sum" or reds[0].acc_dtype != F32:
        return None, "not one float32 sum"
    if any((l.gather is not None and not gathers) or l.valid is not None for l in kernel.loads):
        return None, "a gathered or piecewise read"
    producers = {l.var.name: l for l in kernel.loads}
    producers.update((item.var.name, item) for item in kernel.body)
    try:
        return match(kernel, reds[0], producers), found
    except _NoMatch as e:
        return None, str(e)


def _stmt(producers, name: str, ops: tuple) -> Stmt:
    item = producers.get(name)
    require(isinstance(item, Stmt) and item.op in ops,
             f"{name} is not {' or '.join(ops)} where the column-packed int4 form has one")
    return item


def _through(producers, name: str) -> str:
    """Past copies and widening conversions to float32 (exact for the values they take)."""
    while isinstance(producers.get(name), Stmt) and producers[name].op in ("to", "copy"):
        s = producers[name]
        src = s.operands[0]
        if isinstance(src, Const) or s.round_to is not None or s.var.dtype != F32:
            break
        if not (src.dtype == F32 or src.dtype in HALF):
            break
        name = src.name
    return name


def _weight_side(producers, name: str) -> bool:
    """Whether `name` is computed from a shifted int32 word (the dequantized weight's side)."""
    stack, seen = [name], set()
    while stack:
        item = producers.get(stack.pop())
        if item is None or item.var.name in seen:
            continue
        seen.add(item.var.name)
        if isinstance(item, Stmt):
            if item.op == "rshift":
                return True
            stack += [o.name for o in item.operands if not isinstance(o, Const)]
    return False


def _load(producers, name: str, dtypes: tuple, what: str) -> Load:
    item = producers.get(name)
    require(isinstance(item, Load) and item.dtype in dtypes, f"{what} ({name}) is not a "
             f"{' or '.join(str(d).replace('torch.', '') for d in dtypes)} load")
    return item


@dataclass(frozen=True)
class Chain:
    """The dequantization under a GEMV's product, x * round_half((q - zero) * scale) with
    q = narrow(word >> shift) & 15: the names and items the matchers read off it."""

    x: str  # the activation's factor of the product
    weight: str  # the rounded weight's factor (before widenings)
    mul: Stmt  # (q - zero) * scale, rounded to half precision
    scale: Load
    d: Stmt  # q - zero (or q itself, with no zero point)
    zero: Load | int | None
    sub_dtype: torch.dtype | None  # the integer dtype of q - zero
    mask: Stmt
    narrow: Stmt | None  # the shifted word narrowed (AWQ's int8), or None
    shift: Stmt
    words: Load


INTS = (torch.int8, torch.int16, torch.int32)


def dequant_chain(r: Reduce, producers, narrow_to: tuple = INTS) -> Chain:
    """Walk from the sum's product down to the packed words (see `Chain`); _NoMatch says where the
    form differs. `narrow_to`: the integer dtypes q and q - zero may be computed in."""
    prod = _stmt(producers, r.operand.name, ("mul",))
    require(prod.var.dtype == F32 and prod.round_to is None
             and not any(isinstance(o, Const) for o in prod.operands), "the product is not float32")
    a, b = (o.name for o in prod.operands)
    if _weight_side(producers, a) and not _weight_side(producers, b):
        a, b = b, a
    b = _through(producers, b)
    mul = _stmt(producers, b, ("mul",))
    require(mul.round_to in HALF and mul.var.dtype == F32,
             f"{b} is not rounded to half precision as eager's dequantized weight is")
    d_name, s_name = (o.name if not isinstance(o, Const) else "" for o in mul.operands)
    if isinstance(producers.get(_through(producers, d_name)), Load):
        d_name, s_name = s_name, d_name
    scale = _load(producers, _through(producers, s_name), (mul.round_to,), "the scale")
    d_name = _widened(producers, d_name)
    d = _stmt(producers, d_name, ("sub", "bitwise_and"))
    zero = None
    if d.op == "sub":
        q, z = d.operands
        require(d.var.dtype in narrow_to and not isinstance(q, Const),
                 f"{d_name} does not subtract a zero point from the nibble in "
                 f"{' or '.join(str(t).replace('torch.', '') for t in narrow_to)}")
        if isinstance(z, Const):
            require(float(z.value) == int(z.value) and -112 <= int(z.value) <= 127,
                     f"the zero point {z.value} is not an int8 number of at least -112")
            zero = int(z.value)
        else:
            z_name = z.name
            z_item = producers.get(z_name)
            if isinstance(z_item, Stmt) and z_item.op == "copy" and not isinstance(
                    z_item.operands[0], Const):
                z_name = z_item.operands[0].name
            zero = _load(producers, z_name, narrow_to, "the zero point")
        mask = _stmt(producers, q.name, ("bitwise_and",))
    else:
        mask = d
    require(mask.var.dtype in narrow_to and isinstance(mask.operands[1], Const)
             and mask.operands[1].value == 15 and not isinstance(mask.operands[0], Const),
             f"{mask.var.name} is not a nibble & 15")
    narrow = producers.get(mask.operands[0].name)
    if isinstance(narrow, Stmt) and narrow.op == "to":
        require(narrow.var.dtype in narrow_to and not isinstance(narrow.operands[0], Const),
                 f"{narrow.var.name} does not narrow the shifted word to an integer")
        shift_name = narrow.operands[0].name
    else:
        narrow, shift_name = None, mask.operands[0].name
    shift = _stmt(producers, shift_name, ("rshift",))
    require(shift.var.dtype == torch.int32 and not any(isinstance(o, Const)
                                                        for o in shift.operands),
             f"{shift.var.name} is not an int32 word shifted by per-column amounts")
    words = _load(producers, shift.operands[0].name, (torch.int32,), "the packed weight")
    return Chain(a, b, mul, scale, d, zero, d.var.dtype if d.op == "sub" else None, mask, narrow,
                 shift, words)


def only_the_product(kernel, r: Reduce, c: Chain, names: tuple) -> None:
    """_NoMatch unless the kernel computes nothing but the chain, the sum's product and `names`
    (shift amounts, activation), and stores the chunk's float32 sums alone."""
    made = chain_values(kernel, c) | {r.operand.name, *names}
    rest = [i.var.name for i in kernel.body if not isinstance(i, Reduce) and i.var.name not in made]
    require(not rest, f"the kernel computes more than the int4 product: {', '.join(rest)}")
    (store,) = kernel.stores if len(kernel.stores) == 1 else (None,)
    require(store is not None and store.var.name == r.var.name and store.scatter is None
             and store.dtype == F32, "the chunk's sum is not stored alone, in float32")


def _widened(producers, name: str) -> str:
    """Past one conversion of an integer to float32 (`(q - zero).to(x.dtype)`): exact for the
    values the kernels take the fast way (|q - zero| <= 127, checked when they run)."""
    item = producers.get(name)
    if isinstance(item, Stmt) and item.op == "to" and item.var.dtype == F32 \
            and not isinstance(item.operands[0], Const) and item.operands[0].dtype in INTS:
        return item.operands[0].name
    return name


def chain_values(kernel, c: Chain) -> set[str]:
    """The names the chain computes (with the copies and widenings on its way)."""
    producers = {l.var.name: l for l in kernel.loads}
    producers.update((item.var.name, item) for item in kernel.body)
    made = {c.weight, c.d.var.name, c.mask.var.name, c.shift.var.name, c.words.var.name,
            c.scale.var.name} | ({c.narrow.var.name} if c.narrow is not None else set())
    made |= {n for n in producers if isinstance(producers[n], Stmt) and producers[n].op in
             ("to", "copy") and (_through(producers, n) in made or _widened(producers, n) in made)}
    if isinstance(c.zero, Load):
        made |= {c.zero.var.name}
    if c.d.op == "sub":
        made |= {o.name for o in c.d.operands if not isinstance(o, Const)}
    return made


def _match(kernel, r: Reduce, producers) -> Int4Columns:
    chunks, nw, _ = kernel.row_shape
    groups, group = (1, kernel.k_shape[0]) if len(kernel.k_shape) == 1 else kernel.k_shape
    c = dequant_chain(r, producers, (torch.int8,))
    require(c.narrow is not None, f"{c.mask.var.name} is not an int8 nibble of a narrowed word")
    a, words, scale, zero, shift = c.x, c.words, c.scale, c.zero, c.shift
    # the shift amounts: loaded, or computed from loads (a folded constant clamped and narrowed)
    shift_values = tuple(kernel.values_needed([shift.operands[1].name], only_varying=False))
    for name in shift_values:
        item = producers[name]
        require(not item.var.dtype.is_floating_point and (isinstance(item, Stmt) or (
            item.index.strides[:2] == (0, 0) and not any(item.index.strides[3:]))),
                 "the shift amounts do not vary along the word's columns only")
    # the activation: loaded, or computed (a norm's scaling, SwiGLU's product ...) from values
    # that are the same for every column
    x_values = tuple(kernel.values_needed([a], only_varying=False))
    for name in x_values:
        item = producers[name]
        require(not isinstance(item, Reduce) and (isinstance(item, Stmt) or (
            item.index.strides[1:3] == (0, 0))),
                 f"the activation ({a}) depends on the output column")
    only_the_product(kernel, r, c, shift_values + x_values)
    # the layouts: strides over (chunk, word, column of the word, [group,] row of the group);
    # with one group per chunk the group's stride is made up from the row's (G rows further on)
    def k_st(l: Load) -> tuple[int, int]:
        st = l.index.strides[3:]
        return (group * st[0], st[0]) if groups == 1 else st
    require(words.index.strides[1] == 1 and words.index.strides[2] == 0
             and k_st(words) == (group * nw, nw) and words.index.strides[0] == groups * group * nw,
             "the packed weight is not (K, N / 8) words, one row of words per K")
    for g in (scale,) + ((zero,) if isinstance(zero, Load) else ()):
        st = g.index.strides
        per_group = st[0] // groups if groups == 1 else k_st(g)[0]
        require(st[3:][-1] == 0 and st[2] != 0 and st[1] == 8 * st[2] and per_group != 0
                 and st[0] == groups * per_group,
                 f"{g.var.name} is not one value per (group, column)")
    return Int4Columns(words, shift_values, zero, scale, x_values, a, chunks, nw, groups, group,
                       c.mul.round_to)

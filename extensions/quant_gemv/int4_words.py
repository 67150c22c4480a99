"""Is this GEMV a packed-int4 linear that the Triton backend can read as 32-bit words (and the
C++ backend dequantize through a table per group, extensions/quant_gemv/cpp_int4.py)?

passes/small_matmul.py turns a small-M linear whose weight is unpacked from bytes (two 4-bit
values per byte, `p & 0x0F` and `p >> 4`) and dequantized per group as `(q - zero) * scale` into
one reduction over the packed bytes. Its kernel IR (printed by `print(cf.kernels[0].ir)`) reads:

    load  v0 = packed[...]  u8                        the packed bytes, one per K lane
    load  z  = zero[...]    bf16                      per group: constant along the group's lanes
    load  s  = scale[...]   bf16
    load  x0 = x[offset=0, strides=(.., 2)]  bf16     the activations of the low nibbles (x[2j])
    load  x1 = x[offset=1, strides=(.., 2)]  bf16     ... and of the high ones (x[2j + 1])
    lo  = bitwise_and(v0, 15)       hi  = rshift(v0, 4)
    wlo = mul(sub(to(lo), z), s)    whi = mul(sub(to(hi), z), s)     each step rounded to bf16
    acc = sum(x0 * wlo + x1 * whi) over k

`match_int4_words` recognises exactly that form, and the alignment it needs (a row of the packed
weight is whole 32-bit words, a group covers whole words), and returns the values the word
kernel (extensions/quant_gemv/triton_gemv_int4.py) reads; or None and why not, in which case the byte-per-lane
GEMV (extensions/quant_gemv/triton_gemv.py) renders the kernel as before. The checks are strict on purpose:
the word kernel computes each dequantized weight with its own arithmetic, which equals eager's
only for this form (bf16 rounding after the subtraction and after the multiplication, bf16
scales and zero points), so anything else keeps the generic path. Never wrong, rarely slow.

The zero point may also be a constant (`(q - 8) * s`) or absent (`q * s`).
`FUSEC_INT4_WORDS=0` in the environment switches the word path off (the decision is made here,
when a kernel is rendered), so that one run can time the byte path against it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fusec import env
from fusec.ir import Const, Load, Reduce, Stmt

# Activation rows the word kernel multiplies lane by lane. Above this the tensor-core GEMV
# (extensions/quant_gemv/triton_gemv.py, gemv_dot_blocks) multiplies the rows; not measured on a GPU yet:
# `FUSEC_INT4_WORDS=0 python benchmarks/quant_linear.py` gives the other side.
INT4_WORDS_MAX_M = 4

BF16 = torch.bfloat16
F32 = torch.float32


@dataclass(frozen=True)
class Int4Words:
    """What the word kernel reads: the packed weight, the per-group scale and zero point (a
    load, or a constant zero), the activations of the low and high nibbles, and the sizes."""

    packed: Load
    scale: Load
    zero: Load | float  # a per-group load, or a constant (0.0 when the pattern has none)
    x_lo: Load  # x[2j]: multiplies the low nibble of byte j
    x_hi: Load  # x[2j + 1]: multiplies the high nibble
    group: int  # weights per group (nibbles)
    words: int  # 32-bit words per weight row (K / 8)
    x_step: int  # x's stride along K, in elements
    values: frozenset  # every name the K loop computes
    w_lo: str = ""  # the dequantized weights (q - zero) * scale of the low and high nibbles
    w_hi: str = ""
    dequant: frozenset = frozenset()  # the names that compute them from the bytes


def words_enabled() -> bool:
    return env.flag("FUSEC_INT4_WORDS", True)


def match_int4_words(kernel, max_m: int = INT4_WORDS_MAX_M) -> tuple[Int4Words | None, str]:
    """(pattern, why): the packed-int4 form of a GEMV reduction, or None and the reason. `max_m`:
    the most activation rows the caller's kernels multiply (the Triton backend's tensor-core
    kernel takes up to 16, extensions/quant_gemv/triton_gemv_int4_mma.py)."""
    if not words_enabled():
        return None, "FUSEC_INT4_WORDS=0: the word path is switched off"
    if kernel.split_columns:
        return None, ("the output columns are computed in parts (a weight packed along N): "
                      "the word kernels pack along K")
    m = kernel.row_shape[0] if len(kernel.row_shape) == 2 else 1
    if m > max_m:
        return None, (f"M = {m} rows > {max_m}: the rows are multiplied by "
                      "tensor-core dots instead")
    if any(l.gather is not None for l in kernel.loads):
        return None, "a gathered read (its rows picked by index values) in the dequantization"
    reds = [i for i in kernel.body if isinstance(i, Reduce)]
    if len(reds) != 1:
        return None, f"{len(reds)} reductions, not one sum"
    (r,) = reds
    if r.acc_dtype != F32:
        return None, f"the sum accumulates in {r.acc_dtype}, not float32"
    producers = {l.var.name: l for l in kernel.loads}
    producers.update((item.var.name, item) for item in kernel.body)
    try:
        found = _match(kernel, r, producers)
    except _NoMatch as e:
        return None, str(e)
    return found, "packed uint4 weight read as 32-bit words"


class _NoMatch(Exception):
    """Why the kernel is not the packed-int4 form (the message is the reason shown)."""


def _require(ok: bool, why: str) -> None:
    if not ok:
        raise _NoMatch(why)


def _stmt(producers, name: str, op: str | tuple) -> Stmt:
    item = producers.get(name)
    ops = (op,) if isinstance(op, str) else op
    _require(isinstance(item, Stmt) and item.op in ops,
             f"{name} is not {' or '.join(ops)} where the int4 form has one")
    return item


def _vars(s: Stmt) -> list[str]:
    _require(not any(isinstance(o, Const) for o in s.operands), f"{s.var.name} has a constant")
    return [o.name for o in s.operands]


def _f32(s: Stmt, rounded: bool) -> None:
    """A float32 step: rounded to bf16 after it (as eager's bf16 op) exactly when `rounded`."""
    _require(s.var.dtype == F32 and all(d == F32 for d in s.operand_dtypes)
             and s.round_to == (BF16 if rounded else None),
             f"{s.var.name} = {s.op}(...) is not rounded as a bf16 dequantization is")


def _copies(producers, name: str, seen: list) -> str:
    """Through float32 copies (`to`) of a value that is already a bf16 number (their names
    are added to `seen`)."""
    while isinstance(producers.get(name), Stmt) and producers[name].op in ("to", "copy"):
        s = producers[name]
        _require(s.var.dtype == F32 and s.round_to in (None, BF16) and s.operand_dtypes == (F32,)
                 and not isinstance(s.operands[0], Const) and s.operands[0].dtype == F32,
                 f"{s.var.name} converts to {s.var.dtype}")
        seen.append(name)
        name = s.operands[0].name
    return name


def _match(kernel, r, producers) -> Int4Words:
    n_rows = len(kernel.row_shape)
    _require(len(kernel.k_shape) == 2, "the weight is not read in groups (no per-group scale)")
    groups, half = kernel.k_shape  # half: packed bytes per group
    _require(half % 4 == 0, f"a group of {2 * half} weights is not whole 32-bit words (8 nibbles)")
    add = _stmt(producers, r.operand.name, "add")
    _f32(add, rounded=False)
    copies: list[str] = []
    (x0, w0, nib0, d0), (x1, w1, nib1, d1) = [_term(producers, n, copies) for n in _vars(add)]
    if nib0 == "hi":
        (x0, w0, nib0, d0), (x1, w1, nib1, d1) = (x1, w1, nib1, d1), (x0, w0, nib0, d0)
    _require((nib0, nib1) == ("lo", "hi"), "the two products do not take one nibble each")
    packed, scale, zero, made = w0
    _require((packed, scale, zero) == w1[:3],
             "the two nibbles are not dequantized from the same bytes, scale and zero point")
    values = {r.operand.name, *_vars(add), *copies, *made, *w1[3], x0.var.name, x1.var.name}
    values |= {l.var.name for l in (packed, scale) + ((zero,) if isinstance(zero, Load) else ())}
    _require(values >= set(kernel.plan.phases[0].loop),
             "the K loop computes more than the packed-int4 product")
    _packed_layout(packed, n_rows, half)
    for g in (scale, zero):
        if isinstance(g, Load):
            _per_group(g, n_rows, kernel.varying)
    step = _activation_pair(x0, x1, n_rows, half)
    for name in (*kernel.plan.before, *kernel.plan.phases[0].ready):
        item = producers[name]
        _require(not isinstance(item, Load) or (item.valid is None and not any(
            item.index.strides[n_rows:])), f"the epilogue reads {name} along K or in pieces")
    return Int4Words(packed, scale, zero, x0, x1, 2 * half, kernel.k // 4, step,
                     frozenset(values), d0, d1, frozenset(w0[3] | w1[3]))


def _term(producers, name: str, copies: list):
    """One product x * w: (x's load, (packed, scale, zero, names) of w, which nibble, w)."""
    prod = _stmt(producers, name, "mul")
    _f32(prod, rounded=False)
    a, b = (_copies(producers, o, copies) for o in _vars(prod))
    if isinstance(producers.get(a), Stmt):
        a, b = b, a
    x = producers.get(a)
    _require(isinstance(x, Load) and x.dtype == BF16 and x.var.dtype == F32 and x.valid is None,
             f"{a} is not a bf16 activation loaded from memory")
    weight = _dequant(producers, b)
    return x, weight[:4], weight[4], b


def _dequant(producers, name: str):
    """w = (to(nibble) - zero) * scale, each step rounded to bf16; or to(nibble) * scale."""
    mul = _stmt(producers, name, "mul")
    _f32(mul, rounded=True)
    a, b = _vars(mul)
    if isinstance(producers.get(a), Load):
        a, b = b, a
    scale = producers.get(b)
    _require(isinstance(scale, Load) and scale.dtype == BF16,
             f"the scale {b} is not a bf16 value loaded per group")
    first = _stmt(producers, a, ("sub", "to"))
    made = [name, a]
    zero: Load | float = 0.0
    if first.op == "sub":
        _f32(first, rounded=True)
        q, z = first.operands
        _require(not isinstance(q, Const), f"{a} subtracts the nibble from a constant")
        if isinstance(z, Const):
            value = float(z.value)
            _require(torch.tensor(value, dtype=F32).to(BF16).item() == value,
                     f"the zero point {value} is not a bf16 number")
            zero = value
        else:
            zero = producers.get(z.name)
            _require(isinstance(zero, Load) and zero.dtype == BF16,
                     f"the zero point {z.name} is not a bf16 value loaded per group")
        first = _stmt(producers, q.name, "to")
        made.append(q.name)
    src = first.operands[0]
    _require(first.var.dtype == F32 and first.round_to in (None, BF16)
             and not isinstance(src, Const) and src.dtype == torch.uint8,
             f"{first.var.name} does not convert a uint8 nibble to float32")
    packed, nibble, unpack = _nibble(producers, src.name)
    return packed, scale, zero, frozenset(made + unpack), nibble


def _nibble(producers, name: str):
    """(packed load, "lo" or "hi", names): `p & 15` is the low nibble, `p >> 4` (or
    `(p >> 4) & 15`) the high one, of a uint8 load p."""
    s = _stmt(producers, name, ("bitwise_and", "rshift"))
    names = [name]
    kind = "hi" if s.op == "rshift" else "lo"
    const = s.operands[1]
    _require(isinstance(const, Const) and const.value == (4 if kind == "hi" else 15)
             and not isinstance(s.operands[0], Const), f"{name} is not p & 15 or p >> 4")
    src = s.operands[0].name
    inner = producers.get(src)
    if kind == "lo" and isinstance(inner, Stmt) and inner.op == "rshift":
        return _nibble_hi(producers, src, names)
    packed = producers.get(src)
    _require(isinstance(packed, Load) and packed.dtype == torch.uint8 and packed.valid is None,
             f"the nibbles of {name} do not come from uint8 bytes in memory")
    return packed, kind, names


def _nibble_hi(producers, name: str, names: list):
    packed, kind, more = _nibble(producers, name)
    _require(kind == "hi", f"{name} is not p >> 4")
    return packed, "hi", names + more


def _packed_layout(p: Load, n_rows: int, half: int) -> None:
    """The packed bytes: along n only (not m), each row's bytes back to back in K, and every
    row starting on a 4-byte boundary, so that a row is a run of whole 32-bit words."""
    st = p.index.strides
    _require(not (n_rows == 2 and st[0]) and st[n_rows - 1] != 0,
             "the packed weight does not vary along N only")
    _require(st[n_rows:] == (half, 1), "the packed bytes of a row are not contiguous along K")
    _require(st[n_rows - 1] % 4 == 0 and p.index.offset % 4 == 0,
             "the packed weight's rows do not start on 4-byte boundaries")


def _per_group(g: Load, n_rows: int, varying) -> None:
    st = g.index.strides
    _require(g.var.name in varying and st[n_rows + 1] == 0 and st[n_rows] != 0
             and not (n_rows == 2 and st[0]) and g.valid is None,
             f"{g.var.name} is not one value per (column, group)")


def _activation_pair(x0: Load, x1: Load, n_rows: int, half: int) -> int:
    """x0 = x[2j] and x1 = x[2j + 1]: one tensor, constant along n, whole along K. Returns x's
    stride along K (in elements)."""
    st = x0.index.strides
    step = st[-1] // 2
    _require(x0.param == x1.param and st == x1.index.strides and st[-1] % 2 == 0 and step > 0
             and x1.index.offset == x0.index.offset + step,
             "the activations of the two nibbles are not neighbours x[2j], x[2j + 1]")
    _require(st[n_rows - 1] == 0 and st[n_rows] == half * st[-1],
             "the activations are not one row of K elements for all columns")
    return step

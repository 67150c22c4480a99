"""Triton GEMV for 2 to 16 activation rows times an int4 weight packed eight nibbles to an int32
word, along K (GPTQ) or along N (AWQ), on tensor cores, K split over several programs.

The packed-bytes int4 layer has its tensor-core kernel (triton_gemv_int4_mma.py); GPTQ's and
AWQ's words reached only the generic GEMV above one row, which dequantizes every weight with the
IR's own statements and multiplies on CUDA cores. This kernel (templates/triton_gemv_packed_mma.py.j2)
does what the int4 one does, with the word's layout as a parameter (packed_words.py, `along`):
a chunk's words are unpacked two nibbles at a time into q - zero, exact, in registers, given to
the tensor cores with the activations, and the group's scale is applied to the float32 sums.
Along K a nibble is a row of K (eight dots, one per row of a word, against eight activation
tiles); along N it is a column (eight dots against one activation tile, each into its column's
sums). The shares of K and the kernel that adds their partial sums are the int4 kernel's
(`mma_blocks`, the finishing kernel and its epilogue).

Where it is used (`packed_mma_fit`): 2 <= M <= 16 on a GPU with tensor cores for the activations'
dtype (sm_80 and newer) or under the interpreter, groups of whole chunks (128 rows along K, 16
along N). Otherwise the generic GEMV keeps it, and says why.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from fusec import env
from fusec.runtime.fast_start.pdl import pdl
from fusec.codegen.triton.text import convert, gather_offset, helpers_in, ops_summary, render_stmt
from fusec.ir import Load, Reduce, Stmt

from .packed_words import PackedWords, match_packed_words
from .render import render_template
from .triton_gemv_int4 import pair_math, row_code
from .triton_gemv import SMS
from .triton_gemv_int4_mma import (CHUNK_WORDS, FEW_ROWS, FINISH_BLOCK_N, mma_blocks,
                                   tensor_core_arch)

# Along N: rows of K per chunk (a tl.dot's K side), the largest of these that divides a group.
CHUNK_ROWS = (128, 64, 32, 16)
# The blocks the sweep of docs/performance.md ("GPTQ and AWQ words on tensor cores") chose:
# along K the int4 kernel's (mma_blocks), K in shares for about 6 programs per SM up to
# FEW_ROWS rows; along N 16 word columns a program of 4 warps, a word's nibbles p and p + 4
# joined as neighbouring columns, about 3 programs per SM at every M.
FEW_ROWS_K_TARGET = 6 * SMS
COLUMN_WORDS, COLUMN_TARGET = 16, 3 * SMS
MAGIC = {torch.bfloat16: (128.0, 0x4300, 0x3F80, "bf16"), torch.float16: (1024.0, 0x6400, 0x3C00, "f16")}


def packed_mma_enabled() -> bool:
    return env.flag("FUSEC_INT4_MMA", True)


def packed_mma_fit(kernel, pw: PackedWords, arch: int | None = None) -> tuple[bool, str]:
    """(fits, why): whether this GEMV takes the tensor-core kernel, or why not."""
    if not packed_mma_enabled():
        return False, "FUSEC_INT4_MMA=0: the tensor-core kernel is switched off"
    ok, why = tensor_core_arch(arch)
    if not ok:
        return False, why
    fmt = "GPTQ-style words (packed along K)" if pw.along == "k" else \
        "AWQ-style words (packed along N)"
    return True, (f"M = {pw.m} rows of {fmt}: too many products per weight for CUDA cores, so "
                  "tensor-core dots, the weight unpacked in registers and scaled once per group")


def k_shares(chunks: int, programs: int, target: int) -> tuple[int, int]:
    """(SPLIT, chunks per share): K cut into shares of whole chunks so that `programs` column
    programs times SPLIT come to about `target` programs."""
    split = max(1, min(chunks, -(-target // programs)))
    per = -(-chunks // split)
    return -(-chunks // per), per


def render_gemv_packed_mma(kernel, pw: PackedWords, arch: int | None = None, why: str = "") -> str:
    """The kernel's source: its blocks, the lines that read the shift amounts and compute a
    weight the exact way, the activation tile, and the finishing kernel's epilogue."""
    (r,) = [i for i in kernel.body if isinstance(i, Reduce)]
    along_k = pw.along == "k"
    native, pair_note = pair_math(arch)
    magic, magic_bits, one_bits, ptx = MAGIC[pw.half]
    half = str(pw.half).replace("torch.", "")
    b = _blocks(pw)
    helpers: set = set()
    shift_lines, exact_lines = _weight_lines(kernel, pw, helpers)
    weight = pw.chain.weight
    x_load = _x_load(pw, native)
    words_at = at(pw, pw.words, ["0", "n", "0", "w_start + w", "0"] if along_k
                  else ["0", "j", "0", "0", "k_start + r"])
    # (the word row's coordinate runs across groups: the group's stride is G/8 word rows',
    # which packed_words._layouts checks)
    row_lines, epilogue, stores, more = row_code(kernel, r, lambda idx: _out_rows(pw, idx),
                                                 _address)
    helpers |= more | helpers_in(row_lines + epilogue + stores + exact_lines + shift_lines + [x_load])
    return render_template(
        "triton_gemv_packed_mma.py.j2", name=kernel.name, summary=ops_summary(kernel),
        format="GPTQ does" if along_k else "AWQ does", along_k=along_k, m=pw.m, n=pw.n, k=pw.k,
        group=pw.group, half=half, ptx=ptx, magic=magic, magic2=hex(magic_bits | magic_bits << 16),
        one2=hex(one_bits | one_bits << 16), half_max=torch.finfo(pw.half).max, native=native,
        pair_note="one packed FMA per two weights" if native else pair_note,
        block_n=b.block_n, num_warps=b.num_warps, split=b.split, per=b.per, chunk=b.chunk,
        stages=b.stages, right=b.right, joined=b.joined and b.right,
        chunk_k=b.chunk_k, finish_n=FINISH_BLOCK_N, programs=-(-pw.n // b.block_n) * b.split,
        column_programs=b.column_programs, why=why, pdl=pdl(arch), helpers=sorted(helpers),
        params=[f"{q.name}_ptr" for q in kernel.params], args=[q.name for q in kernel.params],
        first_arg=kernel.params[0].name, nib="t" if along_k else "c", shift_lines=shift_lines,
        shift=pw.shifts[-1], exact_lines=exact_lines,
        exact_weight=f"{weight}.to(tl.{half})" if native else weight, x_load=x_load,
        words_at=words_at, zero_at=lambda cols, col: _group_value(pw, pw.zero, cols, col),
        scale_at=lambda cols, col: _group_value(pw, pw.scale, cols, col),
        row_lines=row_lines, epilogue=epilogue, stores=stores,
        g_idx_at=pw.g_idx and at(pw, pw.g_idx, ["0", "0", "0", "w_start + gw", "t8[None, :]"]))


class _Blocks(NamedTuple):
    block_n: int  # output columns per program
    num_warps: int
    split: int  # shares of K
    per: int  # chunks per share
    chunk: int  # a chunk: word rows (along K) or rows of K (along N)
    chunk_k: int  # rows of K per chunk
    column_programs: str  # the grid's first dim, as the launch spells it
    stages: int = 1  # Triton's software pipelining of the chunk loop (num_stages)
    right: bool = False  # the weight tiles as the dots' right operands (see the template)
    joined: bool = False  # right operands: a word's nibbles p and p + 4 as neighbours (in K, or in N)


def _blocks(pw: PackedWords) -> _Blocks:
    """Along K the int4 tensor-core kernel's blocks (mma_blocks, 16 words a chunk; with up to
    FEW_ROWS rows FEW_ROWS_K_TARGET programs); along N COLUMN_WORDS word columns a program, the
    nibble pairs joined, a chunk the largest of CHUNK_ROWS that divides a group."""
    if pw.along == "k":
        block_n, num_warps, split, per, _ = mma_blocks(pw.m, pw.n, pw.k // 8)
        if pw.m <= FEW_ROWS:
            split, per = k_shares(pw.k // 8 // CHUNK_WORDS, -(-pw.n // block_n), FEW_ROWS_K_TARGET)
        return _Blocks(block_n, num_warps, split, per, CHUNK_WORDS, 8 * CHUNK_WORDS,
                       f"triton.cdiv({pw.n}, {block_n})")
    chunk = max(c for c in CHUNK_ROWS if pw.group % c == 0)
    programs = -(-(pw.n // 8) // COLUMN_WORDS)
    split, per = k_shares(pw.k // chunk, programs, COLUMN_TARGET)
    return _Blocks(8 * COLUMN_WORDS, 4, split, per, chunk, chunk,
                   f"triton.cdiv({pw.n // 8}, {COLUMN_WORDS})", right=True, joined=True)


def at(pw: PackedWords, load: Load, coords: list[str]) -> str:
    """`load`'s address from its strides over the format's five coordinates (expressions)."""
    terms = [str(load.index.offset)] if load.index.offset else []
    for name, st in zip(coords, pw.strides[load.var.name]):
        if st and name != "0":
            name = f"({name})" if " " in name else name
            terms.append(name if st == 1 else f"{name} * {st}")
    return f"{load.param}_ptr + " + (" + ".join(terms) or "0")


def _group_value(pw: PackedWords, g: Load | int | None, cols: str, col: str) -> str:
    """A group value (zero point or scale) of the chunk's group as a float32, [BLOCK_N, 1] along
    K, [BLOCK_N / 8, 1] of column `col` of each word along N."""
    if not isinstance(g, Load):
        return f"tl.full([1, 1], {float(g or 0)!r}, tl.float32)  # a constant"
    coords = ["0", cols, "g", "0", "0"] if pw.along == "k" else ["0", "j", col, "g", "0"]
    row = f" + g * {g.gather[1]}" if g.gather else ""  # (read through g_idx: the group's row)
    return convert(f"tl.load({at(pw, g, coords)}{row}, mask=cmask, other=0)", g.dtype,
                   torch.float32)


def _weight_lines(kernel, pw: PackedWords, helpers: set) -> tuple[list[str], list[str]]:
    """(shift lines, exact lines): the shift amounts as an [8] tile over the nibble coordinate
    (t8 or c8); and eager's statements computing a weight tile at the exact way's coordinates
    (word rows ww and nibble t along K; word columns j, column c and rows kk along N)."""
    producers = {l.var.name: l for l in kernel.loads}
    producers.update((item.var.name, item) for item in kernel.body)
    nib_coords = ["0", "0", "0", "0", "t8"] if pw.along == "k" else ["0", "0", "c8", "0", "0"]
    rows = pw.group // 8
    exact_coords = (["0", "n", f"ww // {rows}", f"ww % {rows}", "t"] if pw.along == "k"
                    else ["0", "j", "c", f"kk // {pw.group}", f"kk % {pw.group}"])
    shift_lines, exact_lines = [], []
    def order(name):  # loads first, those read through an index value after it, then statements
        item = producers[name]
        return 2 if isinstance(item, Stmt) else 1 if item.gather is not None else 0
    for name in sorted(pw.weight_side, key=order):
        item = producers[name]
        if isinstance(item, Stmt):
            if name in pw.shifts:
                shift_lines.append(render_stmt(item, helpers, block="[8]"))
            exact_lines.append(render_stmt(item, helpers, block="[1, 1]"))
            continue
        if name in pw.shifts:
            value = convert(f"tl.load({at(pw, item, nib_coords)})", item.dtype, item.var.dtype)
            shift_lines.append(f"{name} = {value}")
        masked = pw.strides[name][1] != 0  # (along the columns: the tile may overhang N)
        where = at(pw, item, exact_coords) + (f" + {gather_offset(item)}" if item.gather else "")
        value = f"tl.load({where}{', mask=cmask, other=0' if masked else ''})"
        exact_lines.append(f"{name} = {convert(value, item.dtype, item.var.dtype)}")
    return shift_lines, exact_lines


def _x_load(pw: PackedWords, native: bool) -> str:
    """The activations of the rows of K given (`rows`), [CHUNK, BLOCK_M]: half precision for
    the tensor cores, float32 under the interpreter."""
    xs = pw.strides[pw.x.var.name]
    x_step, x_m = xs[4], xs[0]
    terms = [str(pw.x.index.offset)] if pw.x.index.offset else []
    terms.append("rows" if x_step == 1 else f"rows * {x_step}")
    terms += [] if not x_m else ["m" if x_m == 1 else f"m * {x_m}"]
    value = f"tl.load({pw.x.param}_ptr + {' + '.join(terms)}, mask=m < M, other=0.0)"
    return value if native else convert(value, pw.half, torch.float32)


def _address(offset: int, terms: list[str]) -> str:
    return " + ".join(([str(offset)] if offset else []) + terms) or "0"


def _out_rows(pw: PackedWords, idx) -> tuple[list[str], list[str]]:
    """The finishing kernel's (m, n) as the IR's row coordinates: (m, n) along K; (m, word
    column, column of the word) along N, n = 8j + c."""
    st = idx.strides[:2 if pw.along == "k" else 3]
    terms = ["m" if st[0] == 1 else f"m * {st[0]}"] if st[0] else []
    if pw.along == "k":
        cols = [("n", st[1])]
    elif st[1] == 8 * st[2]:
        cols = [("n", st[2])]
    else:
        cols = [("(n // 8)", st[1]), ("(n % 8)", st[2])]
    terms += [c if s == 1 else f"{c} * {s}" for c, s in cols if s]
    return terms, ["m_mask", "n_mask"]


def render_packed_or_gemv(kernel, arch: int | None = None) -> str:
    """A GEMV that is not the packed-bytes int4 form: the tensor-core kernel for int4 words
    (packed_words.py), or the generic GEMV, told why not where the weight is unpacked from int32
    words at 2 to 16 rows."""
    from .int4_words import match_int4_words
    from .triton_gemv import render_gemv
    pw, why = match_packed_words(kernel)
    if pw is not None:
        fits, why = packed_mma_fit(kernel, pw, arch)
        if fits:
            return render_gemv_packed_mma(kernel, pw, arch, why)
    rows = kernel.matmul_rows
    words = any(isinstance(s, Stmt) and s.op == "rshift" and s.operands[0].dtype == torch.int32
                for s in kernel.body)
    if words and rows is not None and rows[0] >= 2:
        return render_gemv(kernel, f"{match_int4_words(kernel)[1]}; and not the tensor-core "
                           f"kernel for int4 words (packed_words.py): {why}", arch)
    return render_gemv(kernel, arch=arch)

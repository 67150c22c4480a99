"""Triton GEMV for a packed-int4 weight read as 32-bit words (extensions/quant_gemv/int4_words.py recognises it).

The byte-per-lane GEMV (extensions/quant_gemv/triton_gemv.py) gives every packed byte its own lane and turns
each nibble into a float32 on its own: a shift or a mask, an integer-to-float trick, a
subtraction and a multiplication, each rounded to bf16: bound by its instructions, it read the
packed bytes at well under half the speed they load at. This kernel gives each
lane a 32-bit word, eight nibbles, and does the dequantization two nibbles at a time:

    pair = (word >> 4t) & 0x000F000F | 0x43004300     nibbles t and t + 4 as two bf16 numbers,
                                                      128 + q each (0x4300 is 128.0)
    w    = dequant_pairs(pair, -zero, scale)          (q - zero) * scale for both halves

`dequant_pairs` is three packed bf16 FMAs (PTX `fma.rn.bf16x2`) on GPUs that have them (sm_80
and newer) and the same three steps in float32 elsewhere (the interpreter, older GPUs, other
vendors): decided here, when the kernel is rendered, and visible in its source. Each step rounds
once to bf16, as eager's bf16 ops do, so the dequantized weights are eager's bit for bit; the
products are accumulated in float32. `diagnostics/int4_gemv_words.py` holds the
hand-written kernel this one follows (1.35 TB/s on an H200 with two FMAs for an integer zero
point; the third here makes any bf16 zero point exact).
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

from fusec.runtime.fast_start.pdl import pdl
from fusec.codegen.triton.text import (helpers_in, max_address, render_stmt, ops_summary, convert,
                                       current_arch)
from fusec.ir import Index, Load, Reduce, Stmt

from .int4_words import Int4Words
from .render import render_template
from .triton_gemv import SMS, rows_and_epilogue

# Word lanes per program per iteration and partial sums per program: the hand-written kernel's
# best configuration at M = 1 was 8 columns x 256 words x 8 warps (`PAIRS` in the template).
WORD_TILE = 2048
WORD_ACC = 4096
WORD_CHUNK = 128  # words per row per iteration


def gemv_word_blocks(m: int, n: int, words: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_W, num_warps). All M rows in one block; 8 output columns per
    program, fewer for narrow layers so that there are about 2 programs per SM (as gemv_blocks);
    BLOCK_W: 128 words (1024 weights), fewer when M rows of partial sums would not fit WORD_ACC.
    Measured on an H200 at M = 1, K = N = 8192 (diagnostics/int4_words_variants.py):
    8 x 128 words x 4 warps 1.34-1.38 TB/s, 8 x 256 x 8 1.28-1.32, 16 x 64 x 4 1.35, 4 x 128 x 2
    1.33, 16 x 128 x 8 1.15, 16 x 256 x 8 0.91."""
    block_m = 1 << max(m - 1, 0).bit_length()
    block_n = min(8, 1 << max(n // (2 * SMS), 1).bit_length() - 1)
    block_w = min(WORD_CHUNK, WORD_TILE // block_n, WORD_ACC // (block_m * block_n),
                  1 << max(words - 1, 0).bit_length())
    return block_m, block_n, max(block_w, 1), 8 if block_n * block_w >= 2048 else 4


def pair_math(arch: int | None = None) -> tuple[bool, str]:
    """(asm, why): whether dequant_pairs is the PTX bf16x2 version, decided at render time for
    the GPU this process compiles for, or for sm_<arch> when given (codegen/triton/target.py)."""
    arch = current_arch() if arch is None else arch
    if arch is None:
        if os.environ.get("TRITON_INTERPRET") == "1":
            return False, "in float32: the interpreter runs no PTX"
        return False, "in float32: no CUDA GPU for PTX bf16x2 FMAs"
    if arch < 80:
        return False, f"in float32: sm_{arch} has no bf16x2 FMA (sm_80 and newer do)"
    return True, "three packed bf16 FMAs, PTX fma.rn.bf16x2"


def bf16_bits(value: float) -> int:
    """The 16 bits of `value` as a bf16 number."""
    return torch.tensor(value, dtype=torch.bfloat16).view(torch.int16).item() & 0xFFFF


def as_int32(value: int) -> int:
    """A 32-bit pattern as the signed int32 Triton reads a literal as."""
    return value - (1 << 32) if value >= 1 << 31 else value


def needs_int64(kernel) -> bool:
    """Whether an address of the kernel can pass 2^31 - 1 elements (then pid * BLOCK is int64)."""
    return max([kernel.numel * 2] + [max_address(a.index, kernel.row_shape + kernel.k_shape)
                                     for a in [*kernel.loads, *kernel.stores]]) >= 2 ** 31 - 1


def row_code(kernel, r, rows, address) -> tuple[list[str], list[str], list[str], set]:
    """(row lines, epilogue, stores, helpers) of an int4 GEMV: the values computed per output
    column before the K loop, everything after the sum, and the stores; the generic GEMV's
    lines, with a kernel's own `rows(index)` -> (terms, masks) and `address(offset, terms)`."""
    producers = {l.var.name: l for l in kernel.loads}
    producers.update((item.var.name, item) for item in kernel.body)
    helpers: set = set()

    def mask(masks: list[str]) -> str:
        return f", mask={' & '.join(masks)}" if masks else ""

    def lines(name: str) -> list[str]:
        item = producers[name]
        if isinstance(item, Stmt):
            return [render_stmt(item, helpers, block="[1, 1, 1]")]
        terms, masks = rows(item.index)
        if not terms:
            terms = ["tl.zeros([1, 1, 1], tl.int32)"]  # one element, the same for every lane
        value = f"tl.load({item.param}_ptr + {address(item.index.offset, terms)}{mask(masks)})"
        return [f"{name} = {convert(value, item.dtype, item.var.dtype)}"]

    _, row_lines, epilogue = rows_and_epilogue(kernel, r, lines)
    stores = []
    for s in kernel.stores:
        terms, masks = rows(s.index)
        stores.append(f"tl.store({s.param}_ptr + {address(s.index.offset, terms)}, "
                      f"{convert(s.var.name, s.var.dtype, s.dtype)}{mask(masks)})")
    return row_lines, epilogue, stores, helpers


def render_gemv_words(kernel, words: Int4Words, arch: int | None = None,
                      why_words: str = "") -> str:
    """The word kernel's source (templates/triton_gemv_int4.py.j2): the plan (`_WordPlan`),
    where the packed words are, each word's -zero and scale, the activations, the row code."""
    (r,) = [i for i in kernel.body if isinstance(i, Reduce)]
    plan = _WordPlan(kernel, words)
    asm, pair_note = pair_math(arch)
    w = _word_index(plan, words)
    before, loop = _group_value_lines(plan, words)
    x_flat, x_load = _x_load(plan, words)
    row_lines, epilogue, stores, helpers = row_code(kernel, r, plan.rows, _address)
    big = needs_int64(kernel)
    helpers |= helpers_in(row_lines + before + loop + epilogue + stores)
    helpers |= {"fusec_bf16_to_f32"} | (set() if asm else {"fusec_f32_to_bf16"})
    return render_template(
        "triton_gemv_int4.py.j2", name=kernel.name, summary=ops_summary(kernel), m=plan.m,
        n=plan.n, k=2 * kernel.k, group=words.group, words=words.words, block_m=plan.block_m,
        block_n=plan.block_n, block_w=plan.block_w, num_warps=plan.num_warps,
        programs=-(-plan.n // plan.block_n), asm=asm,
        pair_note=pair_note, helpers=sorted(helpers), packed=words.packed.param,
        params=[f"{p.name}_ptr" for p in kernel.params], args=[p.name for p in kernel.params],
        n_start="pid.to(tl.int64) * BLOCK_N" if big else "pid * BLOCK_N", even=plan.even,
        row_lines=row_lines, before_loop=before, loop_lines=loop, word=w.word,
        word_mask=w.mask, word_mask_next=w.mask_next, masked=bool(w.lanes), wrap=w.wrap,
        x_flat=x_flat, x_load=x_load,
        x_rows="BLOCK_M" if plan.two and words.x_lo.index.strides[0] else "1",
        epilogue=epilogue, stores=stores, why_words=why_words, pdl=pdl(arch))


class _WordPlan:
    """The word kernel's shape: M and N, the blocks (BLOCK_M rows, BLOCK_N columns, BLOCK_W
    words of K per chunk), whether the words fill whole chunks (`even`), the words per group
    (`wpg`), and which row axes overhang their blocks."""

    def __init__(self, kernel, words: Int4Words):
        self.kernel = kernel
        self.two = len(kernel.row_shape) == 2
        self.m, self.n = kernel.row_shape if self.two else (1, kernel.row_shape[0])
        self.n_rows = len(kernel.row_shape)
        self.row_axes = ["m", "n"] if self.two else ["n"]
        self.block_m, self.block_n, self.block_w, self.num_warps = \
            gemv_word_blocks(self.m, self.n, words.words)
        self.even = words.words % self.block_w == 0
        self.wpg = words.group // 8  # words per group
        # a row axis needs a mask only where its blocks overhang it (N = 8192 in blocks of 8 never
        # does): the masks of the word loads cost the M = 1 kernel 7% (int4_words_variants.py)
        self.overhang = {"m": self.m % self.block_m != 0, "n": self.n % self.block_n != 0}

    def rows(self, idx: Index) -> tuple[list[str], list[str]]:
        """The row terms of an address and their masks."""
        terms, masks = [], []
        for axis, st in zip(self.row_axes, idx.strides[:self.n_rows]):
            if st:
                terms.append(axis if st == 1 else f"{axis} * {st}")
                masks += [f"{axis}_mask"] if self.overhang[axis] else []
        return terms, masks


def _address(offset: int, terms: list[str]) -> str:
    """offset + terms as one expression ("0" for none)."""
    return " + ".join(([str(offset)] if offset else []) + terms) or "0"


def _mask(masks: list[str]) -> str:
    """A tl.load's mask argument for these masks (nothing for none)."""
    return f", mask={' & '.join(masks)}" if masks else ""


class _WordIndex(NamedTuple):
    """Where a chunk's packed words are: their index (`word`), the masks of its lanes
    (`lanes`, joined in `mask`), whether it wraps (no mask at all), the next chunk's mask."""
    word: str
    lanes: list[str]
    mask: str
    wrap: bool
    mask_next: str


def _word_index(plan: _WordPlan, words: Int4Words) -> _WordIndex:
    """The packed weight, as word indices: its byte offsets over 4 (int4_words checked that
    they are whole words), and the masks of this chunk and the next."""
    p = words.packed.index
    _, p_masks = plan.rows(p)
    word = _address(p.offset // 4, [f"n * {p.strides[plan.n_rows - 1] // 4}", "ws"])
    lanes = p_masks + ([] if plan.even else ["w_mask"])
    word_mask = " & ".join(lanes) or "0"  # ("0": MASKED is off, the mask is not read)
    # the next chunk's words: those before the row's end (in an even row, whole chunks; with
    # no mask at all, the chunk after the last is the row's first again: read, never used)
    wrap = plan.even and not p_masks
    word_mask_next = "0" if wrap else " & ".join(
        p_masks + ["(w_start + BLOCK_W < n_words)" if plan.even else "(ws + BLOCK_W < n_words)"])
    return _WordIndex(word, lanes, word_mask, wrap, word_mask_next)


def _group_lines(plan: _WordPlan, g: Load, out: str, negate: bool) -> list[str]:
    """`out` = a per-group value of each word, as bf16x2 bits: loaded once per group and
    repeated over the group's words when the chunk holds whole groups, else per word."""
    terms, masks = plan.rows(g.index)
    st = g.index.strides[plan.n_rows]
    even, wpg = plan.even, plan.wpg
    if plan.block_w % wpg == 0:
        masks += [] if even else [f"(gs < {plan.kernel.k_shape[0]})"]  # groups past the end
        addr = _address(g.index.offset, terms + [f"gs * {st}" if st != 1 else "gs"])
        loaded = f"bf16x2(tl.load({g.param}_ptr + {addr}{_mask(masks)}), {negate})"
        return [f"{out} = tl.reshape(tl.broadcast_to(({loaded})[:, :, :, None], "
                f"[1, BLOCK_N, BLOCK_W // {wpg}, {wpg}]), [1, BLOCK_N, BLOCK_W])"]
    addr = _address(g.index.offset, terms + [f"(ws // {wpg})" + (f" * {st}" if st != 1 else "")])
    masks += [] if even else ["w_mask"]
    return [f"{out} = bf16x2(tl.load({g.param}_ptr + {addr}{_mask(masks)}), {negate})"]


def _group_value_lines(plan: _WordPlan, words: Int4Words) -> tuple[list[str], list[str]]:
    """(before the loop, in the loop): each word's -zero and scale as bf16 bits; a constant
    zero point is set once before the loop."""
    wpg = plan.wpg
    before, loop = [], []
    if plan.block_w % wpg == 0 and any(isinstance(v, Load) for v in (words.zero, words.scale)):
        loop.append(f"# the groups of this chunk ({wpg} word(s) each): their zero points and "
                    "scales, loaded once each")
        loop.append(f"gs = w_start // {wpg} + tl.arange(0, BLOCK_W // {wpg})[None, None, :]")
    loop.append("# per word: -zero and scale as bf16 bits, the same in both halves of an int32")
    if isinstance(words.zero, Load):
        loop += _group_lines(plan, words.zero, "zneg2", True)
    else:
        bits = bf16_bits(-words.zero)
        before.append(f"# the zero point is the constant {words.zero}: -zero as bf16 bits, twice")
        before.append(f"zneg2 = tl.full([1, 1, 1], {as_int32(bits | bits << 16)}, tl.int32)")
    loop += _group_lines(plan, words.scale, "s2", False)
    return before, loop


def _x_load(plan: _WordPlan, words: Int4Words) -> tuple[bool, str]:
    """(flat, the activations' load): eight neighbours per word, x[8w + i] at x's stride along
    K; flat: one activation row, loaded and split in 2-D."""
    even = plan.even
    x = words.x_lo.index
    x_terms, x_masks = plan.rows(x)
    step = words.x_step
    lanes8 = f"(ws * {8 * step})[:, :, :, None] + (tl.arange(0, 8) * {step})[None, None, None, :]" \
        if step != 1 else "(ws * 8)[:, :, :, None] + tl.arange(0, 8)[None, None, None, :]"
    x_rows = [f"({' + '.join(x_terms)})[:, :, :, None]"] if x_terms else []
    x_addr = _address(x.offset, x_rows + [lanes8])
    x_mask = [f"{t}[:, :, :, None]" for t in x_masks + ([] if even else ["w_mask"])]
    x_load = f"{words.x_lo.param}_ptr + {x_addr}{_mask(x_mask)}"
    x_flat = not x_terms and not x_masks  # one activation row: loaded and split in 2-D
    if x_flat:  # a [BLOCK_W, 8] tile; a 6-D one cost the M = 1 kernel 18% (int4_words_variants.py)
        wv = "(w_start + tl.arange(0, BLOCK_W))"
        lanes8 = f"({wv} * {8 * step})[:, None] + (tl.arange(0, 8) * {step})[None, :]" \
            if step != 1 else f"({wv} * 8)[:, None] + tl.arange(0, 8)[None, :]"
        x_load = f"{words.x_lo.param}_ptr + {_address(x.offset, [lanes8])}" + (
            "" if even else f", mask=({wv} < n_words)[:, None]")
    return x_flat, x_load

"""Triton GEMV for one activation row times a packed-int4 weight, dequantized once per group.

extensions/quant_gemv/triton_gemv_int4.py's word kernel dequantizes every weight, `(q - zero) * scale` rounded
to bf16 as eager does, in three packed bf16 steps and a widening per pair of nibbles: about six
instructions per weight in its K loop, which on an H100/H200 is bound by the instructions it
issues. This kernel takes the sum
apart instead (templates/triton_gemv_int4_groups.py.j2 shows the algebra): per weight half an
unpacking step, one widening and one FMA, and the zero point and scale once per group. It is
closer to a float64 product than eager's kernel, not equal to it bit for bit, and it computes a
program's rows again the exact way when a sum is not finite (an infinity or NaN among the
activations, or an overflow of the fast form), so infinities and NaNs come where eager's do.

Its tile is [LANES, WPL, ROWS] (diagnostics/int4_offset.py, where it was measured):
a lane holds WPL neighbouring words of ROWS rows, and the activations of those words, widened
once for every row. One warp per program. It is used at M = 1 when a lane's WPL words fit in one
group; everything else keeps the word kernel (`groups_fit` says why).
"""
from __future__ import annotations

import math
from typing import NamedTuple

from fusec import env
from fusec.runtime.fast_start.pdl import pdl
from fusec.codegen.triton.text import helpers_in, ops_summary
from fusec.ir import Load, Reduce

from .int4_words import Int4Words
from .render import render_template
from .triton_gemv import SMS
from .triton_gemv_int4 import as_int32, bf16_bits, needs_int64, pair_math, row_code

# ROWS x LANES x WARPS x WPL = 4 x 32 x 1 x 4 was the fastest at M = 1, K = N = 8192
# (diagnostics/int4_offset.py compares the tiles); other widths want other ROWS. At
# about 96 registers an SM holds 16 of these one-warp programs, so ROWS is the fewest rows (at
# least 2) that keep the grid within one wave of 16 programs per SM.
LANES = 32
WPL = 4
PROGRAMS_PER_SM = 16


def groups_enabled() -> bool:
    return env.flag("FUSEC_INT4_GROUPS", True)


# The paired form (the template's steps 2-4) saves a mask per pair of weights and row, and costs
# four FMAs and four adds per word of activations, shared by the ROWS rows: a gain from 4 rows on.
# Measured side by side on an H200 at M = 1 (quant_linear.py --int4-paths, TB/s, paired / masked):
# K = N = 8192 (4 rows) 1.845 / 1.673; K = 4096, N = 11008 (8 rows) 1.547 / 1.518; N = 4096
# (2 rows): K = 4096 0.834 / 0.836, K = 11008 1.202 / 1.291.
PAIRED_FROM_ROWS = 4

# Programs start at their own chunk of K (the template's `first`) where a row has at least this
# many chunks: on an H200 the longest rows (Llama-70B's down projection, 28 chunks) gained and
# shorter ones lost. Why is the memory's channel mapping, which is not documented: the threshold
# is a measurement, to be measured again on another GPU.
STAGGER_FROM_CHUNKS = 24


# Registers per thread. An SM has 65536, so PROGRAMS_PER_SM one-warp programs fit at 128 each.
# With the zero point applied last (the template's step 4), ptxas gives the 4-row tile 168 and
# only 12 fit: N = 8192 (2048 programs) no longer runs in one wave. Capped at 128 (Triton's
# `maxnreg`) it needs no spills (tests/test_triton_target.py checks for sm_90), and was the
# fastest of the three (zero point first, last, last and capped). The other tiles keep ptxas's
# choice: the 2-row tile takes 80-96 registers anyway (a cap made it slower), and the 8-row tile
# spills at 128.
def max_registers(rows: int, wpl: int) -> int | None:
    """Triton's maxnreg for the group kernel's tile, or None to leave it to ptxas."""
    return 65536 // (32 * PROGRAMS_PER_SM) if (rows, wpl) == (4, 4) else None


def paired_form(rows: int) -> tuple[bool, str]:
    """(paired, why not): whether the group kernel reads the high nibble of each pair without its
    mask, with at least PAIRED_FROM_ROWS rows per program, unless FUSEC_INT4_PAIRED=0."""
    if not env.flag("FUSEC_INT4_PAIRED", True):
        return False, "FUSEC_INT4_PAIRED=0 switches the unmasked (paired) form off"
    if rows < PAIRED_FROM_ROWS:
        return False, (f"{rows} rows per program; the unmasked (paired) form pays from "
                       f"{PAIRED_FROM_ROWS} on")
    return True, ""


def groups_fit(kernel, words: Int4Words) -> tuple[bool, str]:
    """(fits, why): whether this int4 GEMV takes the group kernel, or why it keeps the word one."""
    if not groups_enabled():
        return False, "FUSEC_INT4_GROUPS=0: the group kernel is switched off"
    m = kernel.row_shape[0] if len(kernel.row_shape) == 2 else 1
    if m != 1:
        return False, (f"M = {m}: the group kernel multiplies one activation row (each row would "
                       "need its own sums of activations)")
    return True, "one activation row: zero point and scale applied once per group"


def group_blocks(n: int, words: int, group_words: int) -> tuple[int, int, int]:
    """(ROWS, LANES, WPL): ROWS columns per program, 2 to 8, the fewest that keep N / ROWS
    programs within one wave, or 4 where even 8 would not (N > 8 waves of programs); WPL words per
    lane, as many as divide a group's words (up to 4, so that a lane's words share one zero point
    and scale); LANES at most 32, fewer when a row has fewer words (small layers under the
    interpreter)."""
    wave = PROGRAMS_PER_SM * SMS
    rows = min(8, max(2, 1 << max(-(-n // wave) - 1, 0).bit_length()))
    if n > 8 * wave:
        rows = 4
    wpl = math.gcd(WPL, group_words)
    lanes = min(LANES, 1 << max(-(-words // wpl) - 1, 0).bit_length())
    return rows, lanes, wpl


def render_gemv_groups(kernel, words: Int4Words, arch: int | None = None) -> str:
    """The group kernel's source (templates/triton_gemv_int4_groups.py.j2): the plan
    (`_GroupPlan`), where the packed words are, the group values (both forms), the
    activations, the row code."""
    (r,) = [i for i in kernel.body if isinstance(i, Reduce)]
    plan = _GroupPlan(kernel, words)
    n, rows, lanes, wpl, even = plan.n, plan.rows, plan.lanes, plan.wpl, plan.even
    asm, pair_note = pair_math(arch)
    paired, masked_why = paired_form(rows)
    w = _word_index(plan, words)
    fast, exact = _group_value_lines(plan, words)
    x = _x_loads(plan, words)
    # each word of a lane apart, and its activations: the low nibbles' are adjusted (y) when paired
    low = "y" if paired else "x"
    apart = [line for t in range(4, 8) for line in by_word(f"x{t}", f"x{t}_{{}}", "[LANES]", wpl)]
    apart += [line for t in range(4)
              for line in by_word(f"{low}{t}", f"{low}{t}_{{}}", "[LANES]", wpl)]
    row_lines, epilogue, stores, helpers = row_code(kernel, r, plan.rows_of, _address)
    big = needs_int64(kernel)
    helpers |= helpers_in(row_lines + fast + exact + epilogue + stores)
    helpers |= {"fusec_bf16_to_f32"} | (set() if asm else {"fusec_f32_to_bf16"})
    return render_template(
        "triton_gemv_int4_groups.py.j2", name=kernel.name, summary=ops_summary(kernel), n=n,
        k=2 * kernel.k, group=words.group, words=words.words, rows=rows, lanes=lanes, wpl=wpl,
        programs=-(-n // rows), asm=asm, pair_note=pair_note, helpers=sorted(helpers),
        packed=words.packed.param, params=[f"{q.name}_ptr" for q in kernel.params],
        args=[q.name for q in kernel.params],
        n_start="pid.to(tl.int64) * ROWS" if big else "pid * ROWS", even=even,
        row_lines=row_lines, group_lines=fast, exact_group_lines=exact,
        word=w.word, word_mask=w.mask, word_mask_next=w.mask_next, word_mask_at=w.mask_at,
        masked=bool(w.n_masks) or not even, wrap=w.wrap, x_load=x.load, epilogue=epilogue,
        stores=stores, pdl=pdl(arch), paired=paired, masked_why=masked_why,
        stagger=w.wrap and words.words >= STAGGER_FROM_CHUNKS * lanes * wpl,
        n_chunks=max(words.words // (lanes * wpl), 1),
        row_bytes=words.packed.index.strides[plan.n_rows - 1], x_pairs=x.pairs,
        x_pair_load=x.pair_load, x_param=words.x_lo.param, x_apart=apart,
        max_registers=max_registers(rows, wpl),
        words_apart=by_word("tl.permute(words, (0, 2, 1))", "w{}", "[LANES, ROWS]", wpl))


class _GroupPlan:
    """The group kernel's shape: N, ROWS output columns per program, LANES lanes of WPL words
    each (group_blocks), the words per group (`wpg`), whether the words fill whole chunks
    (`even`) and whether the rows overhang N (`overhang`: then they need masks)."""

    def __init__(self, kernel, words: Int4Words):
        self.two = len(kernel.row_shape) == 2
        self.n = kernel.row_shape[-1]
        self.n_rows = len(kernel.row_shape)
        self.wpg = words.group // 8  # words per group
        self.rows, self.lanes, self.wpl = group_blocks(self.n, words.words, self.wpg)
        self.even = words.words % (self.lanes * self.wpl) == 0
        self.overhang = self.n % self.rows != 0

    def n_term(self, idx, name: str) -> list[str]:
        """The address term along N (none if the value does not vary along N)."""
        st = idx.strides[self.n_rows - 1]
        return [] if not st else [name if st == 1 else f"{name} * {st}"]

    def rows_of(self, idx):
        """The row terms of an address and their masks (for row_code)."""
        terms, masks = [], []
        for axis, st in zip(["m", "n"] if self.two else ["n"], idx.strides[:self.n_rows]):
            if st:
                terms.append(axis if st == 1 else f"{axis} * {st}")
                masks += ["n_mask"] if axis == "n" and self.overhang else []
        return terms, masks


def _address(offset: int, terms: list[str]) -> str:
    """offset + terms as one expression ("0" for none)."""
    return " + ".join(([str(offset)] if offset else []) + terms) or "0"


def _joined(masks: list[str]) -> str:
    """Masks joined into one condition."""
    return " & ".join(masks) or "0"  # ("0": MASKED is off, the mask is not read)


class _WordIndex(NamedTuple):
    """Where a lane's packed words are (`word`), the rows' masks, and the masks of this chunk,
    the next, and a word at an offset; `wrap`: no mask at all."""
    word: str
    n_masks: list[str]
    mask: str
    wrap: bool
    mask_next: str
    mask_at: str


def _word_index(plan: _GroupPlan, words: Int4Words) -> _WordIndex:
    """The packed weight as word indices (int4_words checked that its rows are whole words)."""
    p = words.packed.index
    word = _address(p.offset // 4, [f"n3 * {p.strides[plan.n_rows - 1] // 4}", "ws"])
    n_masks = ["(n3 < N)"] if plan.overhang else []
    word_mask = _joined(n_masks + ([] if plan.even else ["(ws < n_words)"]))
    wrap = plan.even and not plan.overhang
    word_mask_next = _joined(n_masks + ["(ws + w_start + BLOCK_W < n_words)"])
    word_mask_at = _joined(n_masks + ([] if plan.even else ["(ws + w_start < n_words)"]))
    return _WordIndex(word, n_masks, word_mask, wrap, word_mask_next, word_mask_at)


def _group_load(plan: _GroupPlan, g: Load, tile: str) -> str:
    """One group value per lane and row: [LANES, ROWS] ("2") or [LANES, 1, ROWS] ("3")."""
    cols, lane = ("n2", "g") if tile == "2" else ("n3", "g[:, :, None]")
    st = g.index.strides[plan.n_rows]
    terms = plan.n_term(g.index, cols) + [lane if st == 1 else f"{lane} * {st}"]
    masks = ([f"({cols} < N)"] if plan.overhang else []) + (
        [] if plan.even else ["lane_mask" if tile == "2" else "lane_mask[:, :, None]"])
    other = f", mask={' & '.join(masks)}, other=0.0" if masks else ""
    return f"tl.load({g.param}_ptr + {_address(g.index.offset, terms)}{other})"


def _group_value_lines(plan: _GroupPlan, words: Int4Words) -> tuple[list[str], list[str]]:
    """(fast, exact): the lanes' groups and their zero point and scale, as float32 values
    (the fast form) and as bf16x2 bits (the exact form)."""
    group = f"g = (w_start + lane_w) // {plan.wpg}  # the lanes' groups, [LANES, 1]"
    lane_mask = [] if plan.even else ["lane_mask = w_start + lane_w < n_words"]
    fast = [group] + lane_mask
    exact = [group] + lane_mask
    if isinstance(words.zero, Load):
        fast.append(f"z = fusec_bf16_to_f32({_group_load(plan, words.zero, '2')})")
        exact.append(f"zneg2 = bf16x2({_group_load(plan, words.zero, '3')}, True)")
    else:
        fast.append(f"z = {float(words.zero)!r}  # the zero point is a constant")
        bits = bf16_bits(-words.zero)
        exact.append(f"zneg2 = tl.full([1, 1, 1], {as_int32(bits | bits << 16)}, tl.int32)  "
                     f"# -{words.zero} as bf16 bits, twice")
    fast.append(f"s = fusec_bf16_to_f32({_group_load(plan, words.scale, '2')})")
    exact.append(f"s2 = bf16x2({_group_load(plan, words.scale, '3')}, False)")
    return fast, exact


class _XLoads(NamedTuple):
    """The activations' loads: one element per lane (`load`), or, when `pairs`, as 32-bit
    words of two activations each (`pair_load`)."""
    load: str
    pairs: bool
    pair_load: str


def _x_loads(plan: _GroupPlan, words: Int4Words) -> _XLoads:
    """The activations of a lane's words: x[8w + t] at x's stride along K."""
    even = plan.even
    x = words.x_lo.index
    step = words.x_step
    lanes8 = (f"((w_start + w) * {8 * step})[:, :, None] + (tl.arange(0, 8) * {step})"
              "[None, None, :]") if step != 1 else \
        "((w_start + w) * 8)[:, :, None] + tl.arange(0, 8)[None, None, :]"
    x_load = f"{words.x_lo.param}_ptr + {_address(x.offset, [lanes8])}" + (
        "" if even else ", mask=lane_mask[:, :, None], other=0.0")
    # ... or, where x is contiguous along K and starts on an even element, as 32-bit words that
    # each hold two activations (X_PAIRS, when x's pointer is 16-byte aligned at the launch)
    x_pairs = step == 1 and x.offset % 2 == 0
    lanes4 = "((w_start + w) * 4)[:, :, None] + tl.arange(0, 4)[None, None, :]"
    x_pair_load = f"{words.x_lo.param}_ptr.to(tl.pointer_type(tl.int32)) + " \
        f"{_address(x.offset // 2, [lanes4])}" + (
            "" if even else ", mask=lane_mask[:, :, None], other=0")
    return _XLoads(x_load, x_pairs, x_pair_load)


def by_word(tile: str, name: str, shape: str, wpl: int) -> list[str]:
    """Lines that take `tile`, whose last dimension is a lane's WPL words, apart into one tensor
    per word, `name`.format(j), of `shape`: the K loop then adds a row's products up word after
    word in one sum, instead of a sum per word added up at the end (WPL - 1 additions fewer per
    row). tl.split halves a last dimension of 2, so 4 words take a reshape and three splits;
    all of it stays in each lane's registers."""
    if wpl == 1:
        return [f"{name.format(0)} = tl.reshape({tile}, {shape})"]
    if wpl == 2:
        return [f"{name.format(0)}, {name.format(1)} = tl.split({tile})"]
    assert wpl == 4, wpl
    two = shape[:-1] + ", 2, 2]"
    return [f"{name.format('02')}, {name.format('13')} = tl.split(tl.reshape({tile}, {two}))",
            f"{name.format(0)}, {name.format(2)} = tl.split({name.format('02')})",
            f"{name.format(1)}, {name.format(3)} = tl.split({name.format('13')})"]


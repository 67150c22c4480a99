"""C++ reductions turned inside out: the k loop outside, a block of neighbouring rows inside.

A reduction whose rows lie side by side in memory and whose values lie far apart: the sum over
dim 0 of a (K, N) matrix (`x.sum(0)`: row n's values are x[0, n], x[1, n], ... N elements
apart), a mean over the sequence of (B, S, D) activations, a softmax over the 40 channels of an
NCHW tensor, or a weight's packed words (K / 8, N) read column by column by a matrix-vector
product. The generic kernel (cpp/reduction.py) walks one row at a time, so each k step of a row
is a new cache line; it copies the row into an array first (Note: rows reduced across a strided
axis), which is a gather of K scattered values per row. `(x * 2).sum(0)` at 4096 x 4096 float
took 64 ms that way on this project's 2-core EPYC, against eager's 27 and torch.compile's 6.7.

Turned inside out, the same reduction reads memory in order:

    for each block of COLUMNS neighbouring rows:        (OpenMP: blocks across threads)
        acc[lane] = 0 for each row of the block          (one accumulator per row, an array)
        for k in 0 .. K:
            for lane in 0 .. COLUMNS:                    (#pragma omp simd: vectorized)
                acc[lane] += f(x[k, lane0 + lane])       (COLUMNS contiguous values per k)
        out[lane0 + lane] = acc[lane]

Each k step loads the block's COLUMNS values in one or a few vector loads, and the rows of a
block are the SIMD lanes. The same `(x * 2).sum(0)` took 2.6-3.1 ms in a hand-written C++ test
of this loop order (and 63 ms for one row at a time, with or without the row copy). It is the
"lanes of rows" idea of cpp/reduction.py with the two loops swapped: there each lane runs the
whole k loop inside a vectorized row loop, which gcc manages only for one short k loop; here
every loop over k is an ordinary loop with a vectorized row loop inside it, so any number of
phases, a last pass and blocked float sums are fine.

When to turn a kernel inside out is decided in cpu_plan.py (`column_blocks`), alike for the
LLVM backend (llvm/columns.py). What changes from the generic kernel's lines is mechanical, and
this file does it:
  * every accumulator (`acc_...`) is an array with one entry per lane (`acc_v2[lane]`);
  * a row value computed after one phase and read by a later one (softmax's max, then its sum)
    is kept in an array too (`v3_l[lane]`), and read back at the top of each later lane loop;
  * the row's coordinates and its values that need no reduction are recomputed at the top of
    each lane loop (a few integer operations, linear in the lane);
  * a long float sum is blocked as before (Note: long float sums), with blocks of
    COLUMN_SUM_BLOCK = 64 values (cpu_plan.py): each lane adds a block's values one after
    another, so short blocks keep its rounding error near the vectorized kernel's (which adds
    64-128 per lane and block), and ending a block costs one vector addition into doubles;
  * a float max or min takes a NaN like a larger value and then keeps it (cpp/reduction.py,
    `_value_reduce`), so a lane needs no NaN flag beside its accumulator.

Every lane loop is an innermost loop of one block's rows with nothing in it that stops gcc's
vectorizer (no branch, no call without a SIMD version, every array and pointer moving by one
element per lane, all values of one width or widened by the vector conversions of the prelude),
so gcc 12 vectorizes each one with the target's widest vectors on baseline x86-64 (SSE2),
x86-64-v3 (AVX2) and x86-64-v4 (AVX-512); a loop that only fills or copies an array may become a
memset or memcpy instead. tests/test_cpp_columns_vector.py reads gcc's own report for each.
Each lane loop is preceded by a comment line that says what it does for the block's rows.

This kernel also serves the short rows that cpp/reduction.py once ran as "lanes of rows" (a k
loop inside a vectorized loop over 16 rows: softmax over 8-16 channels): gcc 12 vectorized that
outer loop only for SSE2 when it held several k loops, and left it scalar with AVX2 and AVX-512.
"""
from __future__ import annotations

import re

from fusec.ir import Reduce
from fusec.symbolic import is_symbolic

from .text import CTYPE

_DECLARATION = re.compile(r"^(?P<type>[\w:<> ]+?) (?P<name>acc_\w+) = (?P<init>.+);$")
_ACCUMULATOR = re.compile(r"\b(acc_\w+)\b")


def lane_loop(lines: list[str], head: list[str], what: str = "") -> list[str]:
    """One vectorized loop over the block's rows: `head` (the row's coordinates and kept values)
    then `lines`, each accumulator read and written as its lane's entry; `what` is the comment
    line above it (the loop inside k has its comment in the template)."""
    out = [f"// {what}"] if what else []
    out += ["#pragma omp simd", "for (int64_t lane = 0; lane < lanes; ++lane) {"]
    out += ["    " + line for line in head]
    out += ["    " + _ACCUMULATOR.sub(r"\1[lane]", line) for line in lines]
    return out + ["}"]


def inside_out(kernel, row_lines: list[str], k_coords: list[str], sections: list[dict],
               row_stores: list[str], producers: dict) -> tuple[list[str], list[dict], list[str]]:
    """The generic kernel's sections (cpp/reduction.py) as lane loops: (arrays declared once per
    block, sections with their lines in lane loops, the row stores' lane loop)."""
    fixed = [line for line in row_lines if _same_for_every_row(line)]
    row_lines = [line for line in row_lines if line not in fixed]
    arrays: list[str] = ["// read once per block: the same value for every row"] + fixed if fixed else []
    kept: dict[str, str] = {}  # row values of earlier phases, read back in the lane loops that use them
    out = []

    def head(lines: list[str]) -> list[str]:  # a lane loop's first lines: where its row is, kept values
        return row_lines + [line for name, line in kept.items() if _uses(lines, name)]
    for n, section in enumerate(sections):

        def declared(lines):
            inits = []
            for line in lines:
                d = _DECLARATION.match(line)
                if d is None:
                    raise ValueError(f"fusec: not an accumulator declaration: {line!r}")
                arrays.append(f"{d['type']} {d['name']}[COLUMNS];")
                inits.append(f"{d['name']} = {d['init']};")
            return inits
        body = section["body"][len(k_coords):] if section["body"][:len(k_coords)] == k_coords \
            else section["body"]
        ready = []
        later = [line for later in sections[n + 1:] for part in _PARTS for line in later[part]]
        later += row_stores
        defines = [name for name in section.get("defines", []) if _uses(later, name)]
        for name in defines:
            ctype = CTYPE[producers[name].var.dtype]
            arrays.append(f"{ctype} {name}_l[COLUMNS];")
            ready.append(f"{name}_l[lane] = {name};")
        init = declared(section["before"])
        kept_after = " (kept for the loops below)" if ready else ""
        out.append({
            "comment": section["comment"],
            "init": lane_loop(init, [], "each row of the block: its accumulators start") if init else [],
            "kblock": section["kblock"],
            "block_init": lane_loop(declared(section["block_before"]), [],
                                    "each row of the block: a new block sum starts")
            if section["block_before"] else [],
            "k_coords": [line for line in k_coords],
            "body": lane_loop(body, head(body)),
            "block_after": lane_loop(section["block_after"], [],
                                     "each row of the block: the block sum into its double total")
            if section["block_after"] else [],
            "after": lane_loop(section["after"] + ready, head(section["after"]),
                               "each row of the block: its results of this phase" + kept_after)
            if section["after"] or ready else [],
        })
        kept.update({name: f"const {CTYPE[producers[name].var.dtype]} {name} = {name}_l[lane];"
                     for name in defines})
    stores = lane_loop(row_stores, head(row_stores), "each row of the block: its outputs") \
        if row_stores else []
    return arrays, out, stores


_DEFINITION = re.compile(r"^const [\w:<> ]+ \w+ = (?P<value>.+);$")
_NAMES = re.compile(r"\b(?:v\d+_\w+|[cq]\d+|lane\w*|outer|k)\b")


def _same_for_every_row(line: str) -> bool:
    """Whether a row line reads only elements at fixed places (`scale_ptr[0]`, a 0-d tensor's
    value) and no other value: then it is read once per block, outside the lane loops. Read in
    each lane loop, such a load kept gcc 12 from vectorizing the loop ("no vectype for stmt",
    "latch block not empty"): a batch norm backward's last pass over 64 channels, whose
    where(le, scalar, grad) reads a 0-d tensor, ran one value at a time."""
    d = _DEFINITION.match(line)
    if d is None or "_ptr[" not in d["value"]:
        return False
    value = d["value"]
    if any(not index.isdigit() for index in re.findall(r"_ptr\[([^\]]*)\]", value)):
        return False
    return _NAMES.search(value) is None


_PARTS = ("before", "block_before", "body", "block_after", "after")  # a section's lines


def _uses(lines: list[str], name: str) -> bool:
    """Whether any of `lines` reads the value `name`: only those a later loop reads are kept in
    an array (a kept bool beside double lanes is a vector of another width, which gcc 12 does
    not vectorize on baseline x86-64), and a lane loop reads back only the ones it uses."""
    word = re.compile(rf"\b{re.escape(name)}\b")
    return any(word.search(line) for line in lines)


def block_width(kernel, columns: int) -> int:
    """Rows per block: `columns` (cpu_plan.COLUMNS), or the number of rows
    side by side where that is a number below it: then the one block is full, and every lane
    loop runs a count gcc knows when compiling (`full_blocks`) instead of a short runtime count
    it splits into a vector part and a remainder at every k step."""
    last = kernel.row_shape[-1]
    if is_symbolic(last) or last >= columns:
        return columns
    return int(last)


def full_blocks(kernel, columns: int) -> bool:
    """Whether every block of rows is full (the row count side by side is a number that COLUMNS
    divides): then each lane loop runs exactly COLUMNS times, a count gcc knows when compiling."""
    last = kernel.row_shape[-1]
    return not is_symbolic(last) and last % columns == 0


def defines(phase, producers) -> list[str]:
    """The row values a phase computes after its k loop (its reductions' results and the row
    math ready then): kept in arrays for the phases, last pass and stores after it."""
    reds = [n for n in phase.reduces if isinstance(producers[n], Reduce)]
    return reds + list(phase.ready)

"""A cat along the inner dim, read in a loop of its own before the main loop (C++ pointwise).

A cat's pieces are conditional reads (fusec.ir.Load.valid): each position of the output row
reads the piece whose range holds it, and the chain of selects picks that value:

    const float v0 = (i >= 8) ? x_ptr[v0_base + i] : float(0);
    const float v1 = (i < 8) ? x_ptr[v1_base + i] : v0;

gcc vectorizes such a read as a masked load. In a loop that does nothing else that is enough, but
next to the rest of a fused body it goes badly: with a call to a vector math function in the same
loop (rotary embedding's cos and sin of a cat) gcc 12 gives up ("control flow in loop"), and
with plain arithmetic (rotary's `x * cos + rotate_half(x) * sin`) the masked loads and the loop
versions gcc makes around them cost several times the same loop without the cat.

Note (cat pieces in their own loop). Where every piece is cut along the inner dim, the chain is
computed first, in a simd loop of its own over the chunk, into a small array per piece value
(`v1_piece[CHUNK]`); the main loop then reads each value from its array at `i - start`, a plain
contiguous load. The small loop holds only loads and selects, which gcc vectorizes, and the main
loop has no condition left. A piece along an outer dim is the same for a whole row and costs
nothing: it stays where it is.
"""
from __future__ import annotations

from fusec.ir import PointwiseKernel

from .text import CTYPE

# The longest chunk whose piece arrays live on the stack (float32: 8 KiB per piece value); a
# longer chunk (cpu_plan.CHUNK is 8192) is cut to this, which changes only the speed.
MAX_CHUNK = 2048


def inner_pieces(kernel: PointwiseKernel, per_row: set | dict = ()) -> list:
    """The kernel's cat pieces, when all of them are cut along the inner dim, read plainly (no
    gathered read), none computed once per row (`per_row`: Note: values per row), and each
    falls back on zero or on another of them; else []."""
    inner = len(kernel.shape) - 1
    pieces = [l for l in kernel.loads if l.valid is not None]
    if not pieces or any(l.valid[0] != inner or l.gather is not None or l.var.name in per_row
                         for l in pieces):
        return []
    names = {l.var.name for l in pieces}
    if any(l.other is not None and l.other.name not in names for l in pieces):
        return []
    return pieces


def pieces_first(pieces: list, body: list[str], setup: list[str], chunk: int) -> tuple[list, int]:
    """Move the pieces' definitions out of the main loop's `body` into a loop of their own,
    appended to `setup` (the lines the template puts before the main loop, once per row); the
    body reads each piece value from its array instead. Returns the new body and the chunk.

    The definitions keep their order (the kernel reads a piece's fallback before the piece)."""
    heads = {f"const {CTYPE[l.var.dtype]} {l.var.name} = ": l for l in pieces}
    moved, kept = [], []
    for line in body:
        load = next((l for head, l in heads.items() if line.startswith(head)), None)
        if load is None:
            kept.append(line)
            continue
        moved.append(line)
        kept.append(f"const {CTYPE[load.var.dtype]} {load.var.name} = {load.var.name}_piece[i - start];")
    if len(moved) != len(pieces):  # (not the lines this module expects: leave the body as it is)
        return body, chunk
    setup += ["// the cat's conditional reads first, in a loop of their own (Note: cat pieces in "
              "their own loop, codegen/cpp/pieces.py)",
              *[f"{CTYPE[l.var.dtype]} {l.var.name}_piece[CHUNK];" for l in pieces],
              "#pragma omp simd", "for (int64_t i = start; i < end; ++i) {",
              *[f"    {line}" for line in moved],
              *[f"    {l.var.name}_piece[i - start] = {l.var.name};" for l in pieces], "}"]
    return kept, min(chunk, MAX_CHUNK)

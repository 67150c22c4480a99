"""The quantized-GEMV kernel family: which of its kernels takes a reduction, if any.

A linear of a few activation rows (M <= 16) reduces each output (m, n) over K, reading the whole
weight once per call: it is bound by the weight's bytes, and the general reduction kernel (one
row per program, triton/reduction.py) reads the weight once per activation row. The family's
kernels read it once for all rows, and for int4 weights unpack the nibbles of a 32-bit word at
once. This module is the family's door (fusec/codegen/families.py; registered by
fusec/__init__.py): it tries, in order,

    a chunk of a GPTQ-style weight packed along K   triton_gemv_int4_k_words.py
    a GEMV (`gemv_fits`):                            `render_int4_or_gemv` below
    a chunk of an AWQ-style weight packed along N   triton_gemv_int4_columns.py

and declines anything else, with a note for the general kernel's header where a kernel of the
family's form was ruled out by its sizes (each matcher says why). On the C++ backend the family
has one kernel, a packed-int4 GEMV that dequantizes a group's sixteen values once and looks its
weights up (`render_cpp`, cpp_int4.py).
"""
from __future__ import annotations

from fusec.codegen.families import Declined
from fusec.ir import ReductionKernel

from .int4_columns import match_int4_columns
from .int4_k_words import chunk_of_k_words, match_int4_k_words
from .int4_words import match_int4_words

# The words this family names itself by: its kernels (GEMV), the formats it serves (int4, AWQ,
# GPTQ, HQQ) and what is done to them (quantized, dequantized). The core uses none of them, in
# code or prose (tests/test_architecture.py); int8 is a plain dtype and stays the core's.
NAMES = ("gemv", "int4", "awq", "gptq", "hqq", "quant", "dequant")

# Each backend's kernels are imported by its renderer, when it is first asked: a program on the
# CPU never loads the Triton GEMV kernels, and one on the GPU never loads the C++ table kernel.


def render_triton(kernel, arch: int | None = None) -> str | Declined:
    """The family's Triton kernel for the reduction `kernel` (for GPU `arch`), or Declined."""
    if not isinstance(kernel, ReductionKernel):
        return Declined()  # (a GEMV is a reduction over K)
    from .triton_gemv import gemv_fits
    from .triton_gemv_int4_columns import columns_fit, render_gemv_columns
    from .triton_gemv_int4_k_words import k_words_fit, render_gemv_k_words
    k_words, why_not_k_words = match_int4_k_words(kernel)  # one chunk of a GPTQ-style GEMV
    if k_words is not None:
        fits, why_not_k_words = k_words_fit(kernel, k_words)
        if fits:
            return render_gemv_k_words(kernel, k_words, arch)
    k_chunk = k_words is not None or chunk_of_k_words(kernel)  # declined: said below why
    if gemv_fits(kernel) and not k_chunk:
        return render_int4_or_gemv(kernel, arch)
    cols, why_not_columns = match_int4_columns(kernel)  # one chunk of an AWQ-style GEMV
    if cols is not None:
        fits, why_not_columns = columns_fit(kernel, cols)
        if fits:
            return render_gemv_columns(kernel, cols, arch)
    notes = []
    if len(kernel.row_shape) == 3 and kernel.row_shape[2] == 8:  # a chunk of a GEMV packed along N?
        notes.append(f"Not the column-packed int4 kernel (extensions/quant_gemv/int4_columns.py): {why_not_columns}.")
    if k_chunk:
        notes.append(f"Not the K-packed int4 kernel (extensions/quant_gemv/int4_k_words.py): {why_not_k_words}.")
    return Declined(notes)


def render_int4_or_gemv(kernel, arch: int | None = None) -> str:
    """A GEMV: a packed-int4 weight read as words goes to the group kernel (M = 1), the
    tensor-core kernel (M = 2-16) or the word kernel (M <= 4), each told why not the one before;
    everything else to the byte-per-lane GEMV (whose docstring says why not words)."""
    from .triton_gemv import render_gemv
    from .triton_gemv_int4 import render_gemv_words
    from .triton_gemv_int4_groups import groups_fit, render_gemv_groups
    from .triton_gemv_int4_mma import MMA_MAX_M, mma_fit, render_gemv_mma
    words, _ = match_int4_words(kernel, MMA_MAX_M)
    if words is None:  # int4 words packed along K or N (GPTQ, AWQ): tensor cores at M = 2-16
        from .triton_gemv_packed_mma import render_packed_or_gemv
        return render_packed_or_gemv(kernel, arch)
    fits, why = groups_fit(kernel, words)
    if fits:
        return render_gemv_groups(kernel, words, arch)
    fits, why_not = mma_fit(kernel, words, arch)
    if fits:
        return render_gemv_mma(kernel, words, arch, why_not)
    if match_int4_words(kernel)[0] is not None:  # M <= INT4_WORDS_MAX_M
        return render_gemv_words(kernel, words, arch, f"{why}; {why_not}")
    return render_gemv(kernel, f"{match_int4_words(kernel)[1]}; {why_not}", arch)


def render_cpp(kernel, arch=None) -> str | Declined:
    """The int4 table kernel (cpp_int4.py) for a packed-int4 GEMV on the C++ backend, assembled
    from the general reduction's lines (cpp_reduction.reduction_lines, with the plain row loops);
    or Declined."""
    if not isinstance(kernel, ReductionKernel):
        return Declined()
    from fusec.codegen.cpp import reduction as cpp_reduction
    from . import cpp_int4
    words = cpp_int4.match(kernel, 0)
    if words is None:
        return Declined()
    parts = cpp_reduction.reduction_lines(kernel, allow_columns=False)
    if parts.lanes:  # its rows run in SIMD lanes instead: the general loops, as they came
        return cpp_reduction.assemble(kernel, parts, "")
    return cpp_int4.render(kernel, words, parts.row_lines, parts.k_coords, parts.lines,
                           parts.row_stores)

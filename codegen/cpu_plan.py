"""Decisions the two CPU backends (cpp/, llvm/) make alike, so that both spell the same plan.

How many elements make threads pay off (`PARALLEL_THRESHOLD`), how long an inner chunk is
(`CHUNK`), how a long float sum is blocked (`sum_block`), the one-line summary each kernel's
source opens with, and which vector math they call (`SLEEF`). Decided here, once; each backend
only writes it in its language. (Which loop of a reduction computes what, and which value it
keeps in its output for the last pass, is the kernel IR's loop plan: fusec/loop_plan.py, decided
in codegen/lower_reduction.py.)
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
import platform

import torch

from fusec.ir import PointwiseKernel, Var, contiguous_strides
from fusec.symbolic import c_expr, hint, is_symbolic


PARALLEL_THRESHOLD = 1 << 15  # below this many elements, threads cost more than they save
CHUNK = 8192

# Note (threads for small kernels): an OpenMP parallel region costs the time it takes to wake
# the other threads (the C++ backend's sleep at once when idle: cpp/_load_library) and to wait
# for the last one at the end. On an idle 2-core machine that is a few microseconds; on a busy
# one a woken thread may wait for a core, and the region for it: on this project's 2-core Xeon
# under load, relu(hardswish(x)) over 32768 floats took 10-13 us on one thread and 0.1-8 ms on
# two. So a kernel runs on one thread unless its work, counted in bytes, reaches PARALLEL_WORK:
# the bytes it loads and stores per position (its dtypes' sizes), plus COSTLY_OP bytes for each
# transcendental function it computes per position (one exp costs a float32 vector lane about
# what moving 16 bytes does), times its positions. 512 KiB is 20-25 us of work on one core, where
# one thread wake-up stops mattering. `thread_choice(kernel)` decides; both CPU backends ask it and
# print its reason at the top of each kernel ("threads: 1 (225 KiB of work)"), so `fusec
# explain` shows it.
PARALLEL_WORK = 512 * 1024
COSTLY_OP = 16
COSTLY = {"exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sin", "cos", "tan", "tanh",
          "sinh", "cosh", "asin", "acos", "atan", "atan2", "asinh", "acosh", "atanh", "erf",
          "erfc", "erfinv", "sigmoid", "pow", "gelu", "gelu_tanh", "silu", "mish", "softplus",
          "lgamma", "digamma", "fmod", "remainder"}


def work_bytes(kernel) -> int:
    """The kernel's work per call in bytes (Note: threads for small kernels): the distinct
    elements it loads (a broadcast row counts once) and the ones it stores, plus COSTLY_OP for
    each transcendental statement per position. A reduction counts its rows x k positions once
    (its later passes re-read what is then in cache)."""
    positions = kernel.numel
    shape = kernel.shape if isinstance(kernel, PointwiseKernel) \
        else tuple(kernel.row_shape) + tuple(kernel.k_shape)

    def distinct(load) -> int:  # a broadcast (stride 0) re-reads what is in cache
        if len(load.index.strides) != len(shape):
            return positions
        return math.prod(n for n, s in zip(shape, load.index.strides) if s)
    loaded = sum(load.dtype.itemsize * distinct(load) for load in kernel.loads)
    stored = sum(store.dtype.itemsize for store in kernel.stores) * positions
    stmts = getattr(kernel, "stmts", None) or getattr(kernel, "body", ())
    costly = sum(1 for s in stmts if str(getattr(s, "op", "")).split(".")[0] in COSTLY)
    return loaded + stored + COSTLY_OP * costly * positions


def _amount(work: int) -> str:
    return f"{work / 1024:.0f} KiB" if work < 1 << 20 else f"{work / (1 << 20):.1f} MiB"


def thread_choice(kernel) -> tuple[bool, str]:
    """(run on several threads?, why) for one CPU kernel (Note: threads for small kernels). For a
    kernel whose work depends on sizes that are arguments, the answer at the traced size and a
    reason that says the kernel chooses per call (`work_per_call`)."""
    if getattr(kernel, "row_shape", None) is not None and not is_symbolic(kernel.rows) \
            and kernel.rows <= 1:
        return False, "threads: 1 (one row)"  # a reduction's threads split its rows
    work = hint(work_bytes(kernel))  # a heuristic: the traced size decides, unguarded
    if work_per_call(kernel) is not None:
        return work >= PARALLEL_WORK, (f"threads: chosen per call (all from {_amount(PARALLEL_WORK)}"
                                       f" of work; {_amount(work)} at the traced size)")
    if work < PARALLEL_WORK:
        return False, f"threads: 1 ({_amount(work)} of work)"
    return True, f"threads: all ({_amount(work)} of work)"


def work_per_call(kernel):
    """The kernel's work in bytes as a SymInt when it depends on sizes that are arguments (then
    the kernel decides on threads at each call, comparing it with PARALLEL_WORK), else None."""
    if getattr(kernel, "row_shape", None) is not None and not is_symbolic(kernel.rows) \
            and kernel.rows <= 1:
        return None  # one row: one thread at every size
    work = work_bytes(kernel)
    return work if is_symbolic(work) else None


# Note (no parallel region for a serial kernel): where the condition is `false`, the C++ templates
# write no `#pragma omp parallel` at all: under one, even `if(false)`, gcc moves the loop into an
# outlined function that gets the pointers through a struct, without __restrict__, and adds alias
# checks and loop versions that cost a training step's small kernels more than their work.
def thread_condition(kernel) -> str:
    """The C/C++ condition under which the kernel runs on several threads: `true` or `false` when
    its sizes are numbers (thread_choice), else a comparison of its work at this call's sizes with
    PARALLEL_WORK (Note: threads for small kernels), in terms of its size arguments."""
    work = work_per_call(kernel)
    if work is None:
        return str(thread_choice(kernel)[0]).lower()
    return f"{c_expr(work)} >= {PARALLEL_WORK}"


# Note (values per row): a pointwise kernel is looped as rows of INNER contiguous positions. A
# value that depends only on the row is the same at every position of it: a load whose inner
# stride is 0 (an eval batch norm's per-channel mean, variance, weight and bias over an NCHW
# tensor), and whatever is computed from such values alone (its rsqrt(var + eps)). Both CPU
# backends compute these once per row, before the inner loop, instead of once per position
# (`row_values`), so the source shows that rsqrt runs once per channel. A compiler's own
# loop-invariant code motion may hoist them too; gcc did not always (docs/backends/cpp.md).


def row_values(kernel: PointwiseKernel, skip=()) -> set[str]:
    """The loads and statements of a pointwise kernel that depend only on its row (Note: values
    per row): loads with inner stride 0 (not a cat's piece, not a gathered read, not of a buffer
    in `skip`: one the backend reads some other way), and statements all of whose operands are
    such values or constants."""
    if len(kernel.shape) < 2:
        return set()  # one row: nothing to gain
    found = {l.var.name for l in kernel.loads if not is_symbolic(l.index.strides[-1])
             and l.index.strides[-1] == 0 and l.valid is None and l.gather is None
             and l.param not in skip}
    for s in kernel.stmts:
        if all(o.name in found for o in s.operands if isinstance(o, Var)):
            found.add(s.var.name)
    return found


TILE_STRIDE = 16  # an inner stride of this many elements or more puts each step on a new line


def at_most(most: int, n) -> int:
    """min(most, n) for a size n that is a number; `most` for one that is a size argument (a
    tile longer than a call's rows is cut at their end, so every size is right)."""
    return most if is_symbolic(n) else min(most, n)


# Note (short rows): a loop over one row of a (rows, inner) space vectorizes only when the row
# is at least a vector register long. A (8390, 8) uint8 space looped row by row ran 8 positions
# at a time, scalar, at 2 bytes per nanosecond. When every buffer is read either in the
# iteration order itself (flat: position f of the space is element offset + f) or as one row
# repeated for every row (broadcast: its outer strides are 0), TILE_ROWS rows are one flat run
# of positions instead, and each broadcast row is copied TILE_ROWS times, once per thread, into
# a small array that the run reads flat too. The same kernel then ran 12 times faster.
SHORT_ROW = 16  # a row shorter than this many positions fills no vector of most types
SHORT_TILE = 1024  # positions per flat run


def short_rows(kernel: PointwiseKernel) -> int:
    """Rows per flat run when the kernel's rows are short and every buffer is flat or a
    broadcast row (see Note: short rows); 0 when the row-by-row loop is the plan."""
    shape = kernel.shape
    if len(shape) < 2 or is_symbolic(shape[-1]):
        # a row whose length is an argument is never short here: the repeated rows are arrays
        # of TILE_ROWS x INNER values, a length known when compiling (Note: sizes as arguments
        # in C++, codegen/cpp/text.py), and a guard on it would serve only short rows
        return 0
    if not 1 <= shape[-1] < SHORT_ROW or hint(math.prod(shape[:-1])) < 2:
        return 0  # (one row is looped as well either way: the traced rows decide, unguarded)
    flat = contiguous_strides(shape)
    for load in kernel.loads:
        if load.valid is not None or load.gather is not None \
                or (load.index.strides != flat and any(load.index.strides[:-1])):
            return 0
    if any(store.index.strides != flat for store in kernel.stores):
        return 0
    # (rows that are an argument: runs of SHORT_TILE positions, the last one cut at the end of
    # the space, so every number of rows is right)
    return max(1, at_most(SHORT_TILE // shape[-1], math.prod(shape[:-1])))


def summary(kernel: PointwiseKernel) -> str:
    names = [op.replace("aten.", "").split(".")[0] for op in kernel.ops]
    return f"fuses {len(names)} ATen op(s): {', '.join(names)}"


def heading(kernel) -> str:
    """The first line of a CPU kernel's source after its name: what it fuses and on how many
    threads it runs, and why (Note: threads for small kernels)."""
    return f"{summary(kernel)}; {thread_choice(kernel)[1]}"


SUM_BLOCK_MIN = 256


def sum_block(k: int) -> int:
    """Block length for a float sum over k values (0: no blocking): about sqrt(k), so the
    values summed in a row, per block and across blocks, both stay near sqrt(k). A k that is a
    size argument is blocked at every size (a later call may sum a million values): blocks as
    long as the traced k asks for, and at least SUM_BLOCK_MIN."""
    if is_symbolic(k):
        return sum_block(max(hint(k), SUM_BLOCK_MIN + 1))
    if k <= SUM_BLOCK_MIN:
        return 0
    return max(SUM_BLOCK_MIN, 1 << math.isqrt(k - 1).bit_length())



# Note (a vectorized sum's last step in gcc): gcc vectorizes a float sum (`omp simd
# reduction(+:acc)`) with one partial sum per SIMD lane, and at the end of the loop adds the
# lanes up one after another: 16 scalar additions for a float loop on AVX-512, 64 when the loop
# also reads int8 (64 lanes wide). Blocked, that happens once per block: an int8 matrix-vector
# product of K = N = 2048 spent about half its time there with blocks of 256 (0.25 ms; 0.13 with
# one block per row). The C++ kernels' blocks are therefore at least CPP_SUM_BLOCK_MIN values
# long: that product took 0.16 ms, float sums over rows of 1024-4096 gained 5-10%. Each lane
# still adds at most CPP_SUM_BLOCK_MIN / 4 values per block (SSE's four float lanes; 64 on
# AVX-512), and the blocks are added in double. LLVM adds its lanes up as a tree, so its kernels
# keep sum_block.
# gcc's lanes come from the loop's narrowest type: a loop that reads int8 has four times a float
# loop's lanes (16 with SSE, 64 with AVX-512), one that reads bf16 twice. At four (two) times the
# block length each of their lanes adds as many values per block as a float loop's, so their
# blocks are at least that long, and the lanes' last step comes a quarter (half) as often: the
# int8 matrix-vector product at K = N = 4096 took 1.19 ms on one thread with blocks of 1024
# (four a row), 0.82 with one loop over the row, as now (docs/backends/cpp.md).
CPP_SUM_BLOCK_MIN = 1024


def cpp_sum_block(k: int, narrowest: int = 4) -> int:
    """The C++ kernels' block for a float sum over k values, in a loop whose narrowest load is
    `narrowest` bytes wide (see the note above; 0: none)."""
    least = CPP_SUM_BLOCK_MIN * max(1, 4 // narrowest)
    if is_symbolic(k):  # blocked at every size, as sum_block does
        return max(sum_block(k), least)
    return 0 if k <= least else max(sum_block(k), least)


# Note (rows side by side): a reduction whose neighbouring rows lie next to each other in memory
# and whose row values lie far apart (`x.sum(0)`, softmax over NCHW channels) is best computed
# with its loops turned inside out: the k loop outside, a block of COLUMNS rows in the SIMD
# lanes inside, so each k step reads COLUMNS contiguous values (codegen/cpp/columns.py explains
# it, llvm/columns.py spells it in LLVM IR). One lane adds a long float sum's values one after
# another, so it adds COLUMN_SUM_BLOCK of them in float and each block's sum in double. Only the
# reads decide: a store may move by more than one element from a row to the next (a layer norm
# over NCHW channels written out channels-last, ConvNeXt's `norm(x.permute(0, 2, 3, 1))`). Walked
# row by row, such a kernel gathers every row's values from far apart to store them side by side;
# inside out it reads side by side and stores far apart, and its math runs in the lanes: on one
# thread of the 2-core Xeon, the layer norm of KernelBench-style 19_ (2048 rows of 16 channels)
# took 49 us row by row in C++ (22 in LLVM) and 18 inside out in both.
COLUMNS = 64  # rows per block: 4-8 vectors of float accumulators, a few hundred bytes of arrays
COLUMN_SUM_BLOCK = 64  # values one lane adds in float before its block sum goes into a double
MIN_LAST = 8  # a last row dim shorter than this fills too few lanes to pay off


def column_blocks(kernel) -> int:
    """COLUMNS when the kernel's rows lie side by side (every read moves by 0 or 1 element
    from a row to the next; a store may move by any amount) and some read of a row's values
    moves along k too, so that the values of one row lie at least a row of rows apart: the
    loops are best turned inside out (Note: rows side by side). Else 0."""
    # (a heuristic: a last row dim that is an argument is judged at its traced size; the
    # blocks' last one is cut at the end of the row, so every size is right)
    if not kernel.row_shape or hint(kernel.row_shape[-1]) < MIN_LAST or not kernel.k:
        return 0
    n_rows = len(kernel.row_shape)
    if any(l.index.strides[n_rows - 1] not in (0, 1) for l in kernel.loads):
        return 0  # some read is not contiguous across neighbouring rows
    if not any(l.index.strides[n_rows - 1] == 1 and any(l.index.strides[n_rows:])
               for l in kernel.loads):
        return 0  # no read moves both across rows and along k: nothing to gain
    return COLUMNS


# Note (short rows in lanes): a reduction of K <= SHORT_ROW_K values per row known when compiling
# (a 2x2 or 2x2x2 pool written as a view and an amax/mean, passes/pooling.py) walked row by row
# spends its time on each row's overhead, with a k loop too short to vectorize. When the rows'
# last row dim moves every access by a few elements (0 to SHORT_ROW_STRIDE: 2 for a 2-wide
# window), LANES neighbouring rows run side by side instead, one per SIMD lane, each k step a
# load whose lanes lie that many elements apart (strided or interleaved loads), the short k loop
# unrolled. Both CPU backends take this plan: the C++ one with its lanes of rows
# (cpp/reduction.py), the LLVM one with its inside-out blocks of LANES rows (llvm/columns.py),
# where the same rows walked one at a time took 3-7x the C++ kernel's time.
SHORT_ROW_K = 16
SHORT_ROW_STRIDE = 4
SHORT_ROW_MIN_LAST = 4  # fewer rows side by side fill too few lanes
LANES = 16


def short_row_k(kernel) -> bool:
    """Whether the kernel's rows are short and of a size known when compiling (Note: short rows
    in lanes)."""
    return not is_symbolic(kernel.k) and 1 < kernel.k <= SHORT_ROW_K


def short_row_lanes(kernel) -> int:
    """How many neighbouring short rows run side by side in SIMD lanes (Note: short rows in
    lanes): LANES when at least LANES rows lie side by side, else the largest power of two that
    fits (a 3-D pool's 8 output columns: 8), so the lane count is a constant; 0 when the rows
    are not short, too few lie side by side, or some access moves too far from a row to the
    next. A last row dim that is an argument is judged at its traced size (the last block is cut
    at the row's end, so every size is right)."""
    if not kernel.row_shape or not short_row_k(kernel):
        return 0
    last = hint(kernel.row_shape[-1])
    if last < SHORT_ROW_MIN_LAST:
        return 0
    n_rows = len(kernel.row_shape)
    accesses = [l.index for l in kernel.loads] + [s.index for s in kernel.stores]
    if any(idx.strides[n_rows - 1] not in range(SHORT_ROW_STRIDE + 1) for idx in accesses):
        return 0
    return LANES if last >= LANES else 1 << (last.bit_length() - 1)


def column_sum_block(kernel) -> int:
    """Block length of a long float sum in this layout (Note: rows side by side)."""
    return COLUMN_SUM_BLOCK if is_symbolic(kernel.k) or kernel.k > COLUMN_SUM_BLOCK else 0


# Note (eager's vector math): for float32, eager's CPU kernels compute exp, expm1, log, log2 and
# log1p with SLEEF's 1.0-ulp functions (`Sleef_logf16_u10`), which torch links into libtorch_cpu
# and exports under the same vector ABI names as libmvec (`_ZGVeN16v_Sleef_logf_u10`). libmvec's
# are up to 4 ulp off (expf 2.5, logf 3.8 over the float32 range: tests/test_math_accuracy.py,
# docs/ops.md), and in a long chain those errors add up to several times eager's. So a vectorized
# float32 call to expm1, log or log2 goes to torch's own SLEEF where it is loaded, at eager's cost
# for the same function; a loop's scalar remainder calls one lane of the same vector function in
# C++ (cpp_prelude.h) and libm in LLVM (glibc's scalar ones are within 1 ulp). sin, cos and tan
# too (eager has them from MKL, within 1 ulp; libmvec's are 1.6-2.9 ulp off; SLEEF's cost
# 1.5-2.5x eager's time). exp, log1p, tanh and erf are fusec's own, computed in float within
# 1 ulp and inline, so that a loop calling them has no call at all (`fusec_exp`, `fusec_log1p`,
# `fusec_tanh`, `fusec_erf` in cpp_prelude.h and llvm_prelude.ll.j2; tests/test_exp_vectorized.py):
# SLEEF's erf took 10x. Both CPU backends call the same functions: cpp/__init__.py links them
# (`math_flags`), cpp_prelude.h declares them (`FUSEC_SLEEF_DECLARE`), llvm/ir.py declares them
# (`vector_variant`).
SLEEF = {"expm1", "log", "log2", "sin", "cos", "tan"}


@functools.lru_cache(maxsize=None)
def sleef_symbols_in(path: str) -> bool:
    """True when the library at `path` (libtorch_cpu) exports SLEEF's float32 functions under
    their vector ABI names, 8 and 16 lanes (x86-64 builds of torch do; others may not)."""
    if platform.machine() not in ("x86_64", "AMD64") or not os.path.exists(path):
        return False
    try:
        lib = ctypes.CDLL(path)  # already in the process: this only finds it
    except OSError:
        return False
    return all(hasattr(lib, f"_ZGV{v}_Sleef_{f}f_u10") for f in SLEEF for v in ("dN8v", "eN16v"))


# Note (eager's gelu depends on the CPU): eager's float32 gelu, x/2 (1 + erf(x / sqrt 2)), is not
# one kernel. Where torch runs its AVX512 kernels it is oneDNN's, which multiplies x by (1 + erf)
# first: x above FLT_MAX / 2 overflows to inf, gelu(+inf) is NaN and gelu(-0.0) stays -0.0. Elsewhere (AVX2, the default
# kernels, other CPUs) it is ATen's own vectorized kernel, one fma of x/2 with erf: gelu(+inf) is
# inf, nothing overflows below FLT_MAX, and gelu(-0.0) is -0.0 / 2 + -0.0 / 2 * -0.0 = +0.0. The
# answers agree everywhere else. Both CPU backends compute erf the same way for either and take the
# edges of the kernel eager runs on this machine (cpp_prelude.h fusec_gelu_f32 or
# fusec_gelu_onednn_f32, chosen by cpp/text.py render_stmt; the same two in llvm_prelude.ll.j2):
# torch's capability decides (it respects ATEN_CPU_CAPABILITY, so it is part of a saved program's
# key, runtime/fast_start/fingerprint.py), and the choice is in each kernel's source, so a kernel
# cached under one is never reused under the other. tests/test_math_accuracy.py builds both.
def eager_gelu_multiplies_first() -> bool:
    """True where eager's float32 gelu is oneDNN's, x * (1 + erf) first (Note: eager's gelu
    depends on the CPU); False where it is ATen's fma of x/2 with erf."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")

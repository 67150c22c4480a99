"""Pointwise kernels in blocks of positions, a loop per step: float16 kernels, so that the CPU's
own instructions do the conversions, and chains of math calls, so that the calls overlap.

Note (float16 blocks): eager rounds every float16 result to float16, and so does a fused kernel
(`fusec_round_f16` after each op: codegen/cpp/text.py). x86 CPUs with F16C (every one with AVX2)
convert 8 or 16 values per instruction (vcvtps2ph, vcvtph2ps), but gcc 12 never vectorizes a
conversion written in C++ (`_Float16` stays one value at a time), and the integer spelling of a
rounding (cpp_prelude.h), though vectorized, costs 20-odd instructions per vector: four of them
made `sigmoid(x * 2 + 1) * x` 6x slower than eager. So on such a CPU a kernel that rounds to
float16 runs its inner loop a block of FUSEC_BLOCK (256, cpp_prelude.h) positions at a time,
cut at every rounding:

    for each block of the chunk:
        (loop: gather a strided input's bits) -> fusec_f16_to_f32_block  (F16C)
        loop: the ops up to a rounding        -> fusec_round_f16_block   (F16C)
        loop: the ops up to the next one      -> fusec_round_f16_block
        ...   (the last loop also writes the outputs that are not float16)
                                              -> fusec_f32_to_f16_block  (F16C)
        (loop: scatter a strided output's bits)

Every loop is a plain `#pragma omp simd` loop over the block, and every value that one loop
hands to a later one lives in a small array (1 KiB of floats: the block stays in L1); an input
that is not float16 is read again from memory by each loop that uses it. The answers
are the same bits: the block helpers are the hardware's conversions, which are torch's.
Kernels this does not fit (a cat's conditional reads, gathered reads, tiles for transposed
reads) keep the one-loop form with the integer conversions, and so do reductions for now.

Note (blocks for chains of math calls): the same blocks, cut after each call of an opaque vector
math function (CALLS: SLEEF's or libmvec's sin, cos, log, ...), serve any dtype. In one loop,
`sin(cos(sin(x)))` makes every position wait for its previous call's answer, and a call is some
60 instructions the compiler cannot see into: the CPU's out-of-order window holds about one
call, so it cannot start the next position's chain while this one runs, and the loop runs at
the calls' latency. Cut into a loop per call over a block of positions, each loop's calls are
independent of each other and overlap: the calls' throughput. The rule, `chained_calls`: a kernel
whose longest dependent chain holds CHAIN_CALLS or more such calls runs in blocks; one call (or
calls side by side) keeps the one loop, where the calls of neighbouring positions already
overlap. Both backends follow it (the LLVM one in codegen/llvm/blocks.py).
"""
from __future__ import annotations

import re

import torch

from fusec.ir import PointwiseKernel

from .text import CTYPE, render_stmt, store_value

# The ops each backend computes with a call it cannot inline (SLEEF's or libmvec's vector math);
# exp, log1p, tanh, erf and sigmoid are fusec's own inline code (cpp_prelude.h, llvm_prelude.ll.j2).
CALLS = frozenset({"sin", "cos", "tan", "log", "log2", "expm1", "exp2"})
# How many calls in one dependent chain make blocks pay (Note: blocks for chains of math calls)
CHAIN_CALLS = 2


def chained_calls(kernel: PointwiseKernel) -> int:
    """The most CALLS on one path from the kernel's loads to a value (each waiting for the last)."""
    depth: dict[str, int] = {}
    for s in kernel.stmts:
        before = max((depth.get(o.name, 0) for o in s.operands if hasattr(o, "name")), default=0)
        depth[s.var.name] = before + (s.op in CALLS and s.var.dtype.is_floating_point)
    return max(depth.values(), default=0)


def cut_reason(kernel: PointwiseKernel, row_tile: int, f16c: bool) -> str | None:
    """Why `kernel` runs in blocks (the kernel's comment says it), or None for the one loop:
    float16 roundings on a CPU with F16C (Note: float16 blocks; `f16c`: whether the CPU the kernel
    is built for converts float16 in hardware, codegen/cpp/text.py `host_has_f16c`), or a
    chain of math calls (Note: blocks for chains of math calls)."""
    if row_tile > 1 or any(l.valid is not None or l.gather is not None for l in kernel.loads):
        return None  # (a gathered read's position is another load's value: one loop reads both)
    halves = [l.var for l in kernel.loads if l.dtype == torch.float16] + \
             [s.var for s in kernel.stores if s.dtype == torch.float16]
    rounds = any(s.round_to == torch.float16 for s in kernel.stmts)
    if (halves or rounds) and not (f16c and all(v.dtype == torch.float32 for v in halves)):
        return None
    calls = chained_calls(kernel)
    half = "float16: a loop per rounding, F16C converting between them (Note: float16 blocks)"
    if calls >= CHAIN_CALLS:
        return (f"{half}; " if rounds else "") + f"{calls} math calls in a chain: a loop per " \
            "call, whose calls overlap (Note: blocks for chains of math calls)"
    return half if rounds else None


def block_loop(kernel: PointwiseKernel, reads: list[tuple], writes: list[tuple]) -> list[str]:
    """The lines that replace the one inner loop. `reads` holds (load, element, value) for each
    load: the element it reads and its value in registers (C++ in terms of `i`); `writes` holds
    (store, target) for each store. A float16 read or write goes through a block array and F16C;
    any other is read from memory in each loop that uses it, and written by the last loop.

    Why this function is long: it writes one block loop in order, segment by segment (the
    statements up to each cut, the values each segment hands the next through a block buffer,
    the hardware conversions between them), and each step reads what the step before decided;
    cut apart, the pieces would pass that state around."""
    # segments: the statements up to and including each float16 rounding (and, for a chain of
    # math calls, each call), then the rest (the last loop, which also writes the outputs)
    at_calls = chained_calls(kernel) >= CHAIN_CALLS
    segments: list[list] = [[]]
    for s in kernel.stmts:
        segments[-1].append(s)
        if s.round_to == torch.float16 or (at_calls and s.op in CALLS):
            segments.append([])
    last = len(segments)
    value_of = {l.var.name: value for l, _, value in reads if l.dtype != torch.float16}
    made_in = {l.var.name: 0 for l in kernel.loads if l.var.name not in value_of}
    for n, seg in enumerate(segments, start=1):
        made_in.update({s.var.name: n for s in seg})
    used_in: dict[str, set[int]] = {}
    for n, seg in enumerate(segments, start=1):
        for s in seg:
            for o in s.operands:
                if hasattr(o, "name") and o.name in made_in:
                    used_in.setdefault(o.name, set()).add(n)
    for st in kernel.stores:  # (float16: converted after the last loop)
        if st.var.name in made_in:
            used_in.setdefault(st.var.name, set()).add(last + (st.dtype == torch.float16))
    ctype = {v.name: CTYPE[v.dtype] for v in [l.var for l in kernel.loads] + [s.var for s in kernel.stmts]}
    # a value gets an array when a later loop reads it, or a block rounding works on it
    kept = {name for name, where in used_in.items() if any(n > made_in[name] for n in where)}
    kept |= {seg[-1].var.name for seg in segments if seg and seg[-1].round_to == torch.float16}

    lines = ["for (int64_t b = start; b < end; b += FUSEC_BLOCK) {",
             "    const int64_t n = std::min<int64_t>(FUSEC_BLOCK, end - b);"]
    lines += [f"    {ctype[name]} {name}_b[FUSEC_BLOCK];" for name in sorted(kept)]
    half_reads = [(l, at) for l, at, _ in reads if l.dtype == torch.float16]
    half_writes = [(k, st, at) for k, (st, at) in enumerate(writes) if st.dtype == torch.float16]

    def contiguous(access, at: str) -> str | None:
        """`&ptr[... b ...]`, the block's first element, where the block is contiguous in memory
        (converted in place); None where its elements must be gathered into an array first."""
        if access.index.strides[-1] != 1:
            return None
        return "&" + re.sub(r"\bi\b", "b", at)

    bits = {l.var.name: contiguous(l, at) or f"{l.var.name}_bits" for l, at in half_reads}
    out_bits = {k: contiguous(st, at) or f"out{k}_bits" for k, st, at in half_writes}
    lines += [f"    uint16_t {name}_bits[FUSEC_BLOCK];" for name, where in bits.items()
              if where == f"{name}_bits"]
    lines += [f"    uint16_t out{k}_bits[FUSEC_BLOCK];" for k, where in out_bits.items()
              if where == f"out{k}_bits"]

    def loop(body: list[str]) -> list[str]:
        position = ["const int64_t i = b + j;"] if any(re.search(r"\bi\b", l) for l in body) else []
        return ["    #pragma omp simd", "    for (int64_t j = 0; j < n; ++j) {"] + \
            [f"        {line}" for line in position + body] + ["    }"]

    def reload(names) -> list[str]:
        """Each value a loop needs from before it: from its array, or read from memory."""
        return [f"const {ctype[v]} {v} = {value_of[v]};" if v in value_of
                else f"const {ctype[v]} {v} = {v}_b[j];" for v in sorted(names)]

    # the float16 reads: their bits (gathered where strided), converted a block at a time
    body = [f"{l.var.name}_bits[j] = {at};" for l, at in half_reads
            if bits[l.var.name] == f"{l.var.name}_bits"]
    lines += loop(body) if body else []
    lines += [f"    fusec_f16_to_f32_block({bits[l.var.name]}, {l.var.name}_b, n);  // F16C"
              for l, _ in half_reads]
    # the ops, a loop per cut; the last loop writes what is not float16
    for n, seg in enumerate(segments, start=1):
        writes_here = [(st, at) for st, at in writes if st.dtype != torch.float16] \
            if n == last else []
        if not seg and not writes_here:
            continue
        needed = {o.name for s in seg for o in s.operands if hasattr(o, "name") and
                  (o.name in value_of or o.name in made_in and made_in[o.name] < n)}
        needed |= {st.var.name for st, _ in writes_here if made_in.get(st.var.name, 0) < n}
        body = reload(needed) + [render_stmt(s, round_f16=False) for s in seg]
        body += [f"{s.var.name}_b[j] = {s.var.name};" for s in seg if s.var.name in kept]
        body += [f"{at} = {store_value(st.var, st.dtype)};" for st, at in writes_here]
        lines += loop(body)
        if seg and seg[-1].round_to == torch.float16:
            lines.append(f"    fusec_round_f16_block({seg[-1].var.name}_b, n);  // F16C: "
                         "rounded like eager's float16")
    # the float16 writes
    lines += [f"    fusec_f32_to_f16_block({st.var.name}_b, {out_bits[k]}, n);  // F16C"
              for k, st, _ in half_writes]
    body = [f"{at} = out{k}_bits[j];" for k, _, at in half_writes if out_bits[k] == f"out{k}_bits"]
    lines += loop(body) if body else []
    lines.append("}")
    return lines

"""float16 pointwise kernels in blocks, so that the CPU's own instructions do the conversions.

Note (float16 blocks): eager rounds every float16 result to float16, and so does a fused kernel
(`fusec_round_f16` after each op: codegen/cpp/text.py). x86 CPUs with F16C (every one with AVX2)
convert 8 or 16 values per instruction (vcvtps2ph, vcvtph2ps), but gcc 12 never vectorizes a
conversion written in C++ (`_Float16` stays one value at a time), and the integer spelling of a
rounding (cpp_prelude.h), though vectorized, costs 20-odd instructions per vector: four of them
made `sigmoid(x * 2 + 1) * x` 6x slower than eager. So on such a CPU a kernel that rounds to
float16 runs its inner loop a block of FUSEC_BLOCK (256, cpp_prelude.h) positions at a time,
cut at every rounding:

    for each block of the chunk:
        loop: read the inputs' bits          -> fusec_f16_to_f32_block  (F16C)
        loop: the ops up to a rounding       -> fusec_round_f16_block   (F16C)
        loop: the ops up to the next one     -> fusec_round_f16_block
        ...                                  -> fusec_f32_to_f16_block  (F16C)
        loop: write the outputs

Every loop is a plain `#pragma omp simd` loop over the block, and every value that one loop
hands to a later one lives in a small array (1 KiB of floats: the block stays in L1). The answers
are the same bits: the block helpers are the hardware's conversions, which are torch's.
Kernels this does not fit (a cat's conditional reads, gathered reads, tiles for transposed
reads) keep the one-loop form with the integer conversions, and so do reductions for now.
"""
from __future__ import annotations

import re

import torch

from fusec.ir import PointwiseKernel

from .text import CTYPE, render_stmt, store_value

def applies(kernel: PointwiseKernel, row_tile: int, f16c: bool) -> bool:
    """Whether `kernel` runs in blocks (see the Note above); `f16c`: whether the CPU the kernel
    is built for converts float16 in hardware (codegen/cpp/__init__.py, `host_has_f16c`)."""
    if not f16c or row_tile > 1 or \
            any(l.valid is not None or l.gather is not None for l in kernel.loads):
        return False  # (a gathered read's position is another load's value: one loop reads both)
    if not any(s.round_to == torch.float16 for s in kernel.stmts):
        return False
    halves = [l.var for l in kernel.loads if l.dtype == torch.float16] + \
             [s.var for s in kernel.stores if s.dtype == torch.float16]
    return all(v.dtype == torch.float32 for v in halves)


def block_loop(kernel: PointwiseKernel, reads: list[tuple], writes: list[tuple]) -> list[str]:
    """The lines that replace the one inner loop. `reads` holds (load, element, value) for each
    load: the element it reads and its value in registers (C++ in terms of `i`); `writes` holds
    (store, target) for each store.

    Why this function is long: it writes one block loop in order, segment by segment (the
    statements up to each float16 rounding, the values each segment hands the next through a
    block buffer, the hardware conversions between them), and each step reads what the step
    before decided; cut apart, the pieces would pass that state around."""
    # segments: the statements up to and including each float16 rounding, then the rest
    segments: list[list] = [[]]
    for s in kernel.stmts:
        segments[-1].append(s)
        if s.round_to == torch.float16:
            segments.append([])
    made_in = {l.var.name: 0 for l in kernel.loads}
    for n, seg in enumerate(segments, start=1):
        made_in.update({s.var.name: n for s in seg})
    stored_at = len(segments) + 1
    used_in: dict[str, set[int]] = {}
    for n, seg in enumerate(segments, start=1):
        for s in seg:
            for o in s.operands:
                if hasattr(o, "name") and o.name in made_in:
                    used_in.setdefault(o.name, set()).add(n)
    for st in kernel.stores:
        used_in.setdefault(st.var.name, set()).add(stored_at)
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
        return [f"const {ctype[v]} {v} = {v}_b[j];" for v in sorted(names)]

    # the reads: float16 bits into their arrays (converted after the loop), the rest converted here
    body = []
    for load, at, value in reads:
        name = load.var.name
        if load.dtype == torch.float16:
            if bits[name] == f"{name}_bits":
                body.append(f"{name}_bits[j] = {at};")
        elif name in kept:
            body.append(f"{name}_b[j] = {value};")
    lines += loop(body) if body else []
    lines += [f"    fusec_f16_to_f32_block({bits[l.var.name]}, {l.var.name}_b, n);  // F16C"
              for l, _ in half_reads]
    # the ops, a loop per rounding
    for n, seg in enumerate(segments, start=1):
        if not seg:
            continue
        needed = {o.name for s in seg for o in s.operands if hasattr(o, "name") and
                  o.name in made_in and made_in[o.name] < n}
        body = reload(needed) + [render_stmt(s, round_f16=False) for s in seg]
        body += [f"{s.var.name}_b[j] = {s.var.name};" for s in seg if s.var.name in kept]
        lines += loop(body)
        if seg[-1].round_to == torch.float16:
            lines.append(f"    fusec_round_f16_block({seg[-1].var.name}_b, n);  // F16C: "
                         "rounded like eager's float16")
    # the writes
    lines += [f"    fusec_f32_to_f16_block({st.var.name}_b, {out_bits[k]}, n);  // F16C"
              for k, st, _ in half_writes]
    body, names = [], set()
    for k, (st, at) in enumerate(writes):
        if st.dtype == torch.float16:
            if out_bits[k] == f"out{k}_bits":
                body.append(f"{at} = out{k}_bits[j];")
        else:
            names.add(st.var.name)
            body.append(f"{at} = {store_value(st.var, st.dtype)};")
    lines += loop(reload(names) + body) if body else []
    lines.append("}")
    return lines

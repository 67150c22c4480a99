"""LLVM backend: kernel IR -> textual LLVM IR -> llvmlite (O3, vectorized) -> machine code, in process.

The C++ backend hands its kernels to gcc, which takes a few hundred milliseconds per kernel and
must be installed. This backend writes the same kernels in LLVM IR, the language Triton itself
lowers to, and compiles them inside Python with llvmlite in a few milliseconds: no toolchain.

    PointwiseKernel ──render()──> llvm_pointwise.ll.j2 text ──parse + verify──> llvm.ModuleRef
        ──O3 pass pipeline (loop + SLP vectorizer, tuned for this CPU)──> optimized module
        ──target machine──> object code (cached on disk) ──MCJIT──> function address ──ctypes

Reading the generated IR
------------------------
LLVM IR is in SSA form: every value is assigned once (`%v1_sin = call float @sinf(float %v0_x)`),
and a loop carries values around with `phi` nodes, which pick a value according to the block
control came from. LLVM has no overloading and no implicit conversions, so every instruction
names its type, and every conversion is an instruction (`fpext float %x to double`, `sitofp i32
%n to float`). Each op's spelling lives in the op table (fusec/ops.py, the `llvm` column): one or more
instructions over `{0}`, `{1}` (operands), `{T}` (the type), `{W}` (its bit width), `{S}` (intrinsic suffix), `{m}` (the C
library's `f` suffix) and `{D}` (fusec's dtype name, for the few helpers in llvm_prelude.ll.j2).

Vector math
-----------
The loop vectorizer turns `load float` into `load <8 x float>` and `fadd float` into `fadd <8 x
float>`, but it can only vectorize a call to `sinf` if it knows a vector version exists. glibc's
libmvec has them (`_ZGVdN8v_sinf`: 8 sines at once with AVX2), and the attribute
`"vector-function-abi-variant"` on the declaration of `sinf` tells LLVM so; this is exactly what
clang emits for `#pragma omp declare simd`. fusec loads libmvec into the process so the JIT can
resolve those names. Results stay within 4 ulp, like the C++ backend's.

Threads
-------
A kernel takes, after its buffers, a range of work items `[first, last)`: tiles of rows for a
pointwise kernel, rows for a reduction. LlvmLauncher cuts the work into one range per core and
runs them on a thread pool; ctypes releases the GIL while the machine code runs, so the threads
really run in parallel, like the OpenMP loops of the C++ backend.
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
import re
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from fusec import cache, ops
from fusec.ir import Const, Index, PointwiseKernel, Reduce, Stmt, Var

from . import llvm_build
from .llvm_build import Target, host
from .cpp import CHUNK, PARALLEL_THRESHOLD, stash_choice, sum_block, summary
from .render import render_template

# ---- types -------------------------------------------------------------------------------------

# The LLVM type a value has in registers (bool in i1) ...
#
# Note (half precision): float16 and bfloat16 values are computed in float (ops.register_dtype)
# and travel as their 16 bits, an i16: loads widen them with @fusec_widen, stores narrow with
# @fusec_narrow (llvm_prelude.ll.j2), both integer bit operations. LLVM's own `half` and `bfloat`
# types are never written: whether the code generator accepts them depends on the CPU it targets
# (with AVX-512 BF16, LLVM 15-22 abort on `fptrunc float to bfloat`; without it, the conversion
# becomes a call to a libgcc routine that older systems lack). Integer code is legal everywhere.
TYPE = {
    torch.float16: "i16", torch.bfloat16: "i16", torch.float32: "float",
    torch.float64: "double", torch.int8: "i8", torch.uint8: "i8", torch.int16: "i16",
    torch.int32: "i32", torch.int64: "i64", torch.bool: "i1",
}
# ... and in memory (a torch.bool is a byte holding 0 or 1).
STORAGE = {**TYPE, torch.bool: "i8"}
SUFFIX = {**{dt: t for dt, t in TYPE.items() if t.startswith("i")},
          torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32", torch.float64: "f64"}
SHORT = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32", torch.float64: "f64",
         torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32",
         torch.int64: "i64", torch.bool: "b8"}


def kind(dtype: torch.dtype) -> str:
    """The section of an op's spelling that applies: f(loat), s(igned), u(nsigned), b(ool)."""
    if dtype.is_floating_point:
        return "f"
    if dtype == torch.bool:
        return "b"
    return "u" if dtype == torch.uint8 else "s"


def is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


def literal(value, dtype: torch.dtype) -> str:
    """An LLVM constant. Floats are written as the hex of a double holding the exact value (LLVM
    rejects `float 0.1`, which a float cannot hold); integers wrap like torch (-1 as uint8 is
    255, which LLVM's i8 spells -1). A float16/bfloat16 constant is its 16 bits as an i16."""
    if dtype == torch.bool:
        return "true" if value else "false"
    if dtype.is_floating_point:
        value = float(value)
        if dtype in (torch.float32, torch.float16, torch.bfloat16) and math.isfinite(value):
            value = struct.unpack("<f", struct.pack("<f", value))[0] if abs(value) < 3.5e38 \
                else math.copysign(math.inf, value)
        if dtype == torch.float16:
            value = float(torch.tensor(value, dtype=torch.float16))
        if dtype == torch.bfloat16:
            value = float(torch.tensor(value, dtype=torch.bfloat16))
        if dtype in ops.FLOAT16_LIKE:
            bits = int(torch.tensor(value, dtype=dtype).view(torch.int16))
            return str(0x7E00 if dtype == torch.float16 and math.isnan(value) else bits)
        return "0x" + struct.pack(">d", value).hex().upper()
    value = int(torch.tensor(value).to(dtype).item())  # wrap like torch
    bits = torch.iinfo(dtype).bits
    if value >= 1 << (bits - 1):
        value -= 1 << bits
    return str(value)


# ---- instruction emission ----------------------------------------------------------------------

class Emitter:
    """Collects the instructions of one block of code. SSA names must be unique in a function,
    so temporaries get a counter shared by the whole kernel, and values recomputed inside a
    phase's loop get that phase's suffix (`%v3_exp.p1`)."""

    def __init__(self, counter, suffix: str = ""):
        self.lines: list[str] = []
        self.counter = counter
        self.suffix = suffix

    def emit(self, rhs: str, base: str, comment: str = "") -> str:
        name = f"%{base}{self.suffix}.{next(self.counter)}"
        self.lines.append(f"{name} = {rhs}" + (f"  ; {comment}" if comment else ""))
        return name

    def named(self, name: str, rhs: str, comment: str = "") -> str:
        full = f"%{name}{self.suffix}"
        self.lines.append(f"{full} = {rhs}" + (f"  ; {comment}" if comment else ""))
        return full


def convert(e: Emitter, value: str, src: torch.dtype, dst: torch.dtype, base: str) -> str:
    """`value` (of dtype src, in registers) converted to dst the way torch's `.to(dst)` does.

    float16 and bfloat16 (i16 bits, see the Note on half precision) go through float32 on both
    sides, as c10's conversions do: a double or an int64 becomes a float first, then a half."""
    if src == dst:
        return value
    if src in ops.FLOAT16_LIKE:
        value = e.emit(f"call float @fusec_widen.{SHORT[src]}(i16 {value})", base)
        return convert(e, value, torch.float32, dst, base)
    if dst in ops.FLOAT16_LIKE:
        value = convert(e, value, src, torch.float32, base)
        return e.emit(f"call i16 @fusec_narrow.{SHORT[dst]}(float {value})", base)
    s, d = TYPE[src], TYPE[dst]
    if dst == torch.bool:  # x != 0 (NaN counts as true, as in torch)
        return e.emit(f"fcmp une {s} {value}, 0.0" if is_float(src) else f"icmp ne {s} {value}, 0",
                      base)
    if src == torch.bool:
        return e.emit(f"uitofp i1 {value} to {d}" if is_float(dst) else f"zext i1 {value} to {d}",
                      base)
    if is_float(src) and is_float(dst):
        wider = _FLOAT_BITS[dst] > _FLOAT_BITS[src]
        return e.emit(f"{'fpext' if wider else 'fptrunc'} {s} {value} to {d}", base)
    if is_float(dst):  # integer -> float
        return e.emit(f"{'uitofp' if src == torch.uint8 else 'sitofp'} {s} {value} to {d}", base)
    if is_float(src):
        # float -> integer goes through int64 like the C++ backend, and an out-of-range value
        # (or NaN) gives INT64_MIN as x86's cvttsd2si does; LLVM's fptosi alone would be poison
        lo = e.emit(f"fcmp oge {s} {value}, {literal(-2.0 ** 63, src)}", base)
        hi = e.emit(f"fcmp olt {s} {value}, {literal(2.0 ** 63, src)}", base)
        ok = e.emit(f"and i1 {lo}, {hi}", base)
        raw = e.emit(f"fptosi {s} {value} to i64", base)
        wide = e.emit(f"select i1 {ok}, i64 {raw}, i64 -9223372036854775808", base)
        return wide if d == "i64" else e.emit(f"trunc i64 {wide} to {d}", base)
    sbits, dbits = _INT_BITS[src], _INT_BITS[dst]
    if sbits == dbits:
        return value  # int8 <-> uint8: the same bits
    if dbits < sbits:
        return e.emit(f"trunc {s} {value} to {d}", base)
    return e.emit(f"{'zext' if src == torch.uint8 else 'sext'} {s} {value} to {d}", base)


_FLOAT_BITS = {torch.float32: 32, torch.float64: 64}
_INT_BITS = {torch.int8: 8, torch.uint8: 8, torch.int16: 16, torch.int32: 32, torch.int64: 64}


def round_half(e: Emitter, value: str, to: torch.dtype | None, base: str) -> str:
    """Round a float32 value through float16/bfloat16 (eager rounds every half result)."""
    if to is None:
        return value
    narrow = e.emit(f"call i16 @fusec_narrow.{SHORT[to]}(float {value})", base,
                    f"rounded like eager's {SHORT[to]}")
    return e.emit(f"call float @fusec_widen.{SHORT[to]}(i16 {narrow})", base)


_SECTION = re.compile(r"^\s*([fsubi*](?:,[fsubi*])*):\s*(.*)$", re.S)


def spelling(row: ops.Op, k: str) -> list[str]:
    """The instructions of `row` for values of kind `k` (see fusec/ops.py)."""
    chosen = None
    for section in row.llvm.split("||"):
        m = _SECTION.match(section)
        kinds, text = (m.group(1).split(","), m.group(2)) if m else (["*"], section)
        if k in kinds or (k in "sub" and "i" in kinds and chosen is None) or \
                ("*" in kinds and chosen is None):
            chosen = text
            if k in kinds:
                break
    if chosen is None:
        raise NotImplementedError(f"fusec: the llvm spelling of {row.name!r} has no case for "
                                  f"{ {'f': 'floats', 's': 'signed ints', 'u': 'uint8', 'b': 'bool'}[k]}")
    return [line.strip() for line in chosen.strip().split("\n")]


def emit_stmt(e: Emitter, s: Stmt, values: dict[str, str]) -> None:
    """Emit `s` and record the LLVM value that now holds s.var."""
    row = ops.OPS[s.op]
    args = [_operand(e, o, dt, values) for o, dt in zip(s.operands, s.operand_dtypes)]
    dtype = s.operand_dtypes[-1]
    if dtype in ops.FLOAT16_LIKE:  # lowering computes halves in float (ops.register_dtype)
        raise NotImplementedError(f"fusec: {s.op} computes in {dtype}; the LLVM backend computes "
                                  f"float16/bfloat16 in float32 registers")
    bits = 1 if dtype == torch.bool else dtype.itemsize * 8
    fields = dict(T=TYPE[dtype], S=SUFFIX[dtype], D=SHORT[dtype], W=bits, W1=bits - 1,
                  m="f" if dtype == torch.float32 else "")
    temps: list[str] = []
    for n, line in enumerate(spelling(row, kind(dtype))):
        text = line.format(*args, **fields, **{f"t{j}": t for j, t in enumerate(temps)})
        if text in args or text in temps:  # an identity (a cast computed in the target dtype)
            temps.append(text)
        else:
            temps.append(e.emit(text, s.var.name, s.origin if n == 0 else ""))
    value = convert(e, temps[-1], s.result_dtype, s.var.dtype, s.var.name)
    values[s.var.name] = round_half(e, value, s.round_to, s.var.name)


def _operand(e: Emitter, o, dtype: torch.dtype, values: dict[str, str]) -> str:
    if isinstance(o, Const):
        return literal(o.value, dtype)
    return convert(e, values[o.name], o.dtype, dtype, o.name)


def emit_load(e: Emitter, param: str, storage: torch.dtype, index: str, var: Var,
              values: dict[str, str]) -> None:
    ptr = e.emit(f"getelementptr inbounds {STORAGE[storage]}, ptr %{param}_ptr, i64 {index}",
                 var.name + ".ptr")
    raw = e.emit(f"load {STORAGE[storage]}, ptr {ptr}", var.name + ".raw")
    if storage == torch.bool:
        raw = e.emit(f"trunc i8 {raw} to i1", var.name)
    values[var.name] = convert(e, raw, storage, var.dtype, var.name)


def emit_store(e: Emitter, param: str, storage: torch.dtype, index: str, var: Var,
               values: dict[str, str]) -> None:
    value = convert(e, values[var.name], var.dtype, storage, var.name)
    if storage == torch.bool:
        value = e.emit(f"zext i1 {value} to i8", var.name)
    ptr = e.emit(f"getelementptr inbounds {STORAGE[storage]}, ptr %{param}_ptr, i64 {index}",
                 param + ".ptr")
    e.lines.append(f"store {STORAGE[storage]} {value}, ptr {ptr}")


def index_sum(e: Emitter, terms: list[tuple[str, int]], offset: int, base: str) -> str:
    """offset + sum(value * stride) as i64 instructions (or a constant)."""
    acc = str(offset) if offset else None
    for value, stride in terms:
        if not stride:
            continue
        term = value if stride == 1 else e.emit(f"mul nsw i64 {value}, {stride}", base)
        acc = term if acc is None else e.emit(f"add nsw i64 {acc}, {term}", base)
    return acc or "0"


def coords(e: Emitter, flat: str, shape: tuple[int, ...], prefix: str) -> list[str]:
    """Row-major coordinates of position `flat` in `shape`, as named SSA values."""
    out = []
    for d in range(len(shape)):
        below = math.prod(shape[d + 1:])
        value = flat if below == 1 else e.named(f"{prefix}{d}.q", f"udiv i64 {flat}, {below}")
        if d:
            value = e.named(f"{prefix}{d}", f"urem i64 {value}, {shape[d]}")
        out.append(value)
    return out


# ---- declarations and the prelude ----------------------------------------------------------------

LIBM = {"sin", "cos", "tan", "exp", "exp2", "expm1", "log", "log2", "log1p", "tanh", "erf", "pow"}
_CALL = re.compile(r"call (\S+) @([\w.]+)\(([^)]*)\)")


def vector_isas(target: Target | None = None) -> tuple[tuple[str, int], ...]:
    """libmvec's vector variants `target` (this CPU by default) runs, widest first, as (ISA
    letter, floats per call): ('e', 16) with AVX-512, ('d', 8) with AVX2, ('b', 4) with SSE.
    Declaring all of them lets the vectorizer find a match for whichever width it picks (gcc
    -march=native makes the same choice). Empty where there is no libmvec, or not on x86-64."""
    return (target or host()).vector_isas


@functools.lru_cache(maxsize=None)
def has_symbol(name: str) -> bool:
    """True when the JIT can resolve `name` in this process (libmvec is loaded by then)."""
    return bool(llvm_binding().address_of_symbol(name))


def vector_isa() -> tuple[str, int] | None:
    """The widest of vector_isas() on this CPU, or None."""
    return vector_isas()[0] if vector_isas() else None


def declarations(lines: list[str], defined: set[str], target: Target | None = None) -> str:
    """Declare every function the kernel calls, read off the call instructions themselves.
    C library math functions also get their libmvec vector variants (see the module docstring)."""
    seen: dict[str, str] = {}
    for line in lines:
        for ret, name, args in _CALL.findall(line):
            if name in defined or name in seen:
                continue
            types = ", ".join(a.strip().rsplit(" ", 1)[0] for a in args.split(",") if a.strip())
            seen[name] = f"{ret} @{name}({types})"
    out, groups, used = [], [], []
    for n, (name, signature) in enumerate(sorted(seen.items())):
        ret = signature.split(" ", 1)[0]
        # sinf is sin for floats; but erf is erf for doubles (its float version is erff)
        scalar = name[:-1] if ret == "float" else name
        if scalar in LIBM and vector_isas(target):
            params = "v" * (signature.count(",") + 1)  # one vector argument per scalar one
            variants = []
            for letter, floats in vector_isas(target):
                lanes = floats if ret == "float" else floats // 2
                variant = f"_ZGV{letter}N{lanes}{params}_{name}"
                if not has_symbol(variant):  # older glibc: no vector erf, say
                    continue
                vec = f"<{lanes} x {ret}>"
                out.append(f"declare {vec} @{variant}({', '.join([vec] * len(params))})")
                variants.append(f"{variant}({variant})")
                used.append(variant)
            out.append(f"declare {signature} #{n + 1}")
            abi = f' "vector-function-abi-variant"="{",".join(variants)}"' if variants else ""
            groups.append(f'attributes #{n + 1} = {{ nounwind willreturn memory(none){abi} }}')
        elif scalar in LIBM:
            out.append(f"declare {signature} #{n + 1}")
            groups.append(f"attributes #{n + 1} = {{ nounwind willreturn memory(none) }}")
        else:
            out.append(f"declare {signature}")
    if used:  # keep the vector declarations alive until the vectorizer has looked at them
        out.append(f"@llvm.compiler.used = appending global [{len(used)} x ptr] "
                   f"[{', '.join('ptr @' + u for u in used)}], section \"llvm.metadata\"")
    return "\n".join(["", "; functions the kernel calls (C library math with its vector variants)"]
                     + out + groups) if out else ""


HELPERS = re.compile(r"@(fusec_\w+)\.(\w+)\(")


def prelude(lines: list[str]) -> tuple[str, set[str]]:
    """The helper functions (llvm_prelude.ll.j2) this kernel calls, rendered for the types it
    calls them with, and the set of names they define."""
    wanted = sorted({(name, short) for line in lines for name, short in HELPERS.findall(line)})
    if not wanted:
        return "", set()
    by_short = {v: k for k, v in SHORT.items()}
    helpers = []
    for name, short in wanted:
        dtype = by_short[short]
        helpers.append(dict(name=name, D=short, T=TYPE[dtype], S=SUFFIX[dtype], kind=kind(dtype),
                            c=_helper_constants(dtype) if is_float(dtype) else {}))
    text = render_template("llvm_prelude.ll.j2", helpers=helpers)
    defined = {f"{h['name']}.{h['D']}" for h in helpers}
    # the helpers call intrinsics too: declare those along with the kernel's
    return text, defined


def _helper_constants(dtype) -> dict:
    return {k: literal(v, dtype) for k, v in {
        "half": 0.5, "one": 1.0, "sqrt1_2": 0.70710678118654752440,
        "sqrt_2_over_pi": 0.79788456080286535588, "gelu_c": 0.044715}.items()}


# ---- pointwise kernels -------------------------------------------------------------------------

def _params(kernel) -> list[str]:
    return [f"ptr noalias {'' if p.is_output else 'readonly '}%{p.name}_ptr" for p in kernel.params]


def render(kernel, target: Target | None = None) -> str:
    """The kernel as LLVM IR text. `target` (default: this CPU) only decides which libmvec
    vector functions the IR declares; the rest is the same for every CPU."""
    if not isinstance(kernel, PointwiseKernel):
        return render_reduction(kernel, target)
    counter = _counter()
    shape = kernel.shape
    rows, inner = math.prod(shape[:-1]), shape[-1]
    chunk = max(inner if rows >= 64 or inner <= CHUNK else CHUNK, 1)
    chunks = max(-(-inner // chunk), 1)
    setup = Emitter(counter)
    c = coords(setup, "%row", shape[:-1], "c") if len(shape) > 1 else []

    def base(idx: Index, label: str) -> str:
        return index_sum(setup, list(zip(c, idx.strides[:-1])), idx.offset, label + ".base")

    body = Emitter(counter)
    values: dict[str, str] = {}

    def index(idx: Index, label: str) -> str:
        b = base(idx, label)
        inner_term = index_sum(body, [("%i", idx.strides[-1])], 0, label + ".idx")
        if b == "0":
            return inner_term
        if inner_term == "0":
            return b
        return body.emit(f"add nsw i64 {b}, {inner_term}", label + ".idx")

    for load in kernel.loads:
        emit_load(body, load.param, load.dtype, index(load.index, load.var.name), load.var, values)
    for s in kernel.stmts:
        emit_stmt(body, s, values)
    for n, store in enumerate(kernel.stores):
        emit_store(body, store.param, store.dtype, index(store.index, f"out{n}"), store.var, values)
    return _finish("llvm_pointwise.ll.j2", setup.lines + body.lines, target, name=kernel.name,
                   summary=summary(kernel), source_shape=kernel.source_shape, numel=kernel.numel,
                   rows=rows, inner=inner, chunk=chunk, chunks=chunks,
                   items=rows * chunks if kernel.numel else 0,
                   parallel=str(kernel.numel >= PARALLEL_THRESHOLD and rows * chunks > 1).lower(),
                   params=_params(kernel), row_setup=setup.lines, body=body.lines)


def _finish(template: str, lines: list[str], target: Target | None, **context) -> str:
    helper_text, defined = prelude(lines)
    decl_lines = lines + helper_text.splitlines() + ["call i64 @llvm.umin.i64(i64 %a, i64 %b)"]
    context.update(prelude=helper_text, declarations=declarations(decl_lines, defined, target))
    return render_template(template, **context)


def _counter():
    import itertools
    return itertools.count()


# ---- reductions --------------------------------------------------------------------------------

NO_NAN = str(2**63 - 1)  # argmax's "no NaN seen yet": larger than any position


class Accumulator:
    """How one Reduce carries its running value through a loop over k: its phi states, the
    instructions that fold in one element, and the final value after the loop."""

    def __init__(self, r: Reduce):
        self.r = r
        self.red = ops.REDUCTIONS[r.op]
        self.name = f"acc_{r.var.name}"
        self.dtype = r.operand.dtype if self.red.returns_index else r.acc_dtype

    def states(self) -> list[tuple[str, str, str]]:
        """(name, type, initial value) of each loop-carried value."""
        t = TYPE[self.dtype]
        init = literal(self.red.init(self.dtype), self.dtype)
        if self.red.returns_index:  # the running max (or min), and where it is
            states = [(self.name, t, init), (self.name + ".at", "i64", "0")]
            if is_float(self.dtype):  # ... and where the first NaN is
                states.append((self.name + ".nan.at", "i64", NO_NAN))
            return states
        if self.nan_flag:
            return [(self.name, t, init), (self.name + ".nan", "i1", "false")]
        return [(self.name, t, init)]

    @property
    def nan_flag(self) -> bool:
        """Float max/min keep "saw a NaN" apart from the running value (see fold)."""
        return self.r.op in ("amax", "amin") and kind(self.dtype) == "f"

    def extreme(self, e: Emitter, acc: str, x: str) -> str:
        """The running max (amax, argmax) or min of acc and x: one instruction. For floats it is
        `maxnum` that may assume no NaN (`nnan`: a NaN element makes the result poison, i.e.
        garbage) and ignore the sign of zero (`nsz`), so it is one vmaxps. torch's max is NaN if
        any element is; llvm.maximum says exactly that, but x86 has no such instruction, and its
        expansion (a NaN test, a signed-zero fix-up, blends) took twice the time of the C++
        kernel. So the callers track NaN beside it, and `result` never reads the garbage."""
        t, d, big = TYPE[self.dtype], self.dtype, self.r.op in ("amax", "argmax")
        fn = {"f": "maxnum" if big else "minnum", "s": "smax" if big else "smin",
              "u": "umax" if big else "umin", "b": "umax" if big else "umin"}[kind(d)]
        flags = "nnan nsz " if is_float(d) else ""
        return e.emit(f"call {flags}{t} @llvm.{fn}.{SUFFIX[d]}({t} {acc}, {t} {x})", self.name)

    def fold(self, e: Emitter, x: str, cur: dict[str, str], k: str) -> dict[str, str]:
        """Instructions folding element x into the current states; returns the next states."""
        t, d, acc = TYPE[self.dtype], self.dtype, cur[self.name]
        op, n = self.r.op, self.name
        if self.red.returns_index:
            # argmax: the running max and beside it the position where it last grew. From one
            # element to the next the chain is a max and a select; a compare-or-and-select
            # chain that also tracked NaN made it 4x slower than gcc's branches.
            k_ = kind(d)
            cmp = "fcmp o" if k_ == "f" else ("icmp s" if k_ == "s" else "icmp u")
            cmp += "gt" if op == "argmax" else "lt"
            better = e.emit(f"{cmp} {t} {x}, {acc}", n)  # strictly: a tie keeps the first
            nxt = {n: self.extreme(e, acc, x),
                   n + ".at": e.emit(f"select i1 {better}, i64 {k}, i64 {cur[n + '.at']}", n)}
            if k_ == "f":  # the first NaN wins: the smallest k of a NaN element (none: NO_NAN)
                is_nan = e.emit(f"fcmp uno {t} {x}, {x}", n + ".nan")
                k_nan = e.emit(f"select i1 {is_nan}, i64 {k}, i64 {NO_NAN}", n + ".nan")
                nxt[n + ".nan.at"] = e.emit(f"call i64 @llvm.smin.i64(i64 {cur[n + '.nan.at']}, "
                                            f"i64 {k_nan})", n + ".nan")
            return nxt
        if op in ("amax", "amin"):
            if not self.nan_flag:
                return {n: self.extreme(e, acc, x)}
            # ... and beside it, whether a NaN went by: the vectorizer knows both as reductions
            is_nan = e.emit(f"fcmp uno {t} {x}, {x}", n + ".nan")
            return {n: self.extreme(e, acc, x),
                    n + ".nan": e.emit(f"or i1 {cur[n + '.nan']}, {is_nan}", n + ".nan")}
        k_ = kind(d)
        if op == "sum":
            rhs = f"fadd reassoc {t} {acc}, {x}" if k_ == "f" else \
                (f"or i1 {acc}, {x}" if k_ == "b" else f"add {t} {acc}, {x}")
        elif op == "prod":
            rhs = f"fmul reassoc {t} {acc}, {x}" if k_ == "f" else \
                (f"and i1 {acc}, {x}" if k_ == "b" else f"mul {t} {acc}, {x}")
        elif op == "any":
            rhs = f"or i1 {acc}, {x}"
        elif op == "all":
            rhs = f"and i1 {acc}, {x}"
        else:
            raise NotImplementedError(f"fusec: the llvm backend has no reduction {op!r}")
        return {n: e.emit(rhs, n)}

    def result(self, e: Emitter, final: dict[str, str]) -> str:
        r = self.r
        if self.red.returns_index:
            if not is_float(self.dtype):
                return final[self.name + ".at"]
            # a NaN wins; then the running max may be poison, but it is not the one picked
            nan_at = final[self.name + ".nan.at"]
            saw_nan = e.emit(f"icmp slt i64 {nan_at}, {NO_NAN}", self.name)
            return e.emit(f"select i1 {saw_nan}, i64 {nan_at}, i64 {final[self.name + '.at']}",
                          self.name)
        value = final[self.name]
        if self.nan_flag:
            t = TYPE[self.dtype]
            value = e.emit(f"select i1 {final[self.name + '.nan']}, {t} "
                           f"{literal(math.nan, self.dtype)}, {t} {value}", self.name)
        value = convert(e, value, self.dtype, r.var.dtype, r.var.name)
        return round_half(e, value, r.round_to, r.var.name)


# How many vectors a reduction loop works on per trip (LLVM's "interleave count"; it would pick 4
# for these loops by itself). One, like gcc's loops in the C++ backend. A loop that calls a
# vector math function (softmax's exp) gains nothing from more: the call clobbers every vector
# register, so four running sums are four spills and reloads around every call, and in
# side-by-side runs one was as fast or faster on softmax. It also means a quarter of the loop
# body for LLVM's instruction selection and register allocation: 20-30% less compile time.
REDUCTION_INTERLEAVE = 1


def render_reduction(kernel, target: Target | None = None) -> str:
    """One function over a range of rows; inside a row, one loop over k per reduction phase,
    then a last loop that recomputes and stores the element values (softmax's division, say).
    Python decides everything here (which values each loop needs, the accumulators and their
    phi nodes, blocking of long float sums); the template only lays out the blocks."""
    counter = _counter()
    n_rows = len(kernel.row_shape)
    top = Emitter(counter)
    c = coords(top, "%row.i", kernel.row_shape, "c")
    values: dict[str, str] = {}  # row values, visible everywhere after their definition
    bases: dict[str, str] = {}

    def base(idx: Index, label: str) -> str:
        if label not in bases:
            bases[label] = index_sum(top, list(zip(c, idx.strides[:n_rows])), idx.offset,
                                     label + ".base")
        return bases[label]

    producers = {l.var.name: l for l in kernel.loads}
    for item in kernel.body:
        producers[item.var.name] = item
    order = [l.var.name for l in kernel.loads] + [i.var.name for i in kernel.body]
    reduces = [i for i in kernel.body if isinstance(i, Reduce)]

    closure = kernel.values_needed

    def out_index(e: Emitter, n: int, q: list[str]) -> str:
        """The element index of store number n at k coordinates q."""
        s = kernel.stores[n]
        b = base(s.index, f"out{n}")
        kidx = index_sum(e, list(zip(q, s.index.strides[n_rows:])), 0, f"out{n}.k")
        return kidx if b == "0" else (b if kidx == "0" else e.emit(f"add nsw i64 {b}, {kidx}", f"out{n}.idx"))

    def emit_elements(e: Emitter, names: list[str], local: dict[str, str], k: str, sid: str,
                      given: dict[str, int] | None = None):
        """Recompute element values inside the loop of section `sid`; a value in `given` is read
        back from the output (store number) where the last phase kept it (see stash_choice)."""
        q = coords(e, k, kernel.k_shape, f"{sid}.q") if len(kernel.k_shape) > 1 else [k]
        for name in names:
            item = producers[name]
            if given and name in given:
                s = kernel.stores[given[name]]
                emit_load(e, s.param, s.dtype, out_index(e, given[name], q), item.var, local)
            elif isinstance(item, Stmt):
                emit_stmt(e, item, local)
            else:
                b = base(item.index, name)
                kidx = index_sum(e, list(zip(q, item.index.strides[n_rows:])), 0, name + ".k")
                idx = kidx if b == "0" else (b if kidx == "0" else e.emit(f"add nsw i64 {b}, {kidx}", name + ".idx"))
                emit_load(e, item.param, item.dtype, idx, item.var, local)
        return q

    def row_value(e: Emitter, name: str) -> None:
        item = producers[name]
        if isinstance(item, Stmt):
            emit_stmt(e, item, values)
        else:  # a load that does not vary along k (a per-row scale, say)
            emit_load(e, item.param, item.dtype, base(item.index, name), item.var, values)

    done: set[str] = set()
    for name in order:  # row values needing no reduction: once per row, before the loops
        if name not in kernel.varying and not isinstance(producers[name], Reduce) \
                and kernel.level.get(name, 0) == 0:
            row_value(top, name)
            done.add(name)

    sections, all_lines = [], []
    k = kernel.k
    stash = stash_choice(kernel)  # a costly element value the last phase keeps in the output
    for phase in range(kernel.phases):
        sid = f"phase{phase}"
        reds = [Accumulator(r) for r in reduces if r.phase == phase]
        blocked = [a for a in reds if a.r.op == "sum" and is_float(a.dtype)]
        kblock = sum_block(k) if blocked and k else 0
        before, phis, block_phis, block_after, after = (Emitter(counter) for _ in range(5))
        body = Emitter(counter, suffix="." + sid)
        local = dict(values)
        kvar = f"%{sid}.k"
        finals: dict[str, dict[str, str]] = {}
        if k:
            q = emit_elements(body, closure({a.r.operand.name for a in reds}), local, kvar, sid)
            if stash and phase == kernel.phases - 1:  # keep it where the last pass reads it
                s = kernel.stores[stash[1]]
                final = all((st.var.name, n) == stash or st.var.name not in kernel.varying
                            for n, st in enumerate(kernel.stores))
                body.lines.append(f"; {stash[0]}: " + ("the output, stored once: no last pass"
                                                       if final else "kept for the last pass"))
                emit_store(body, s.param, s.dtype, out_index(body, stash[1], q),
                           producers[stash[0]].var, local)
            for a in reds:
                x = local[a.r.operand.name]
                x = convert(body, x, a.r.operand.dtype, a.dtype, a.name)
                loop_id, entry = f"{sid}.loop", (f"{sid}.block" if kblock else sid)
                cur, inits = {}, {}
                for state, t, init in a.states():
                    cur[state] = f"%{state}"
                    inits[state] = (t, init)
                nxt = a.fold(body, x, cur, kvar)
                for state, (t, init) in inits.items():
                    if kblock and a in blocked:  # a block sum starts at 0 in every block
                        phis.lines.append(f"%{state} = phi {t} [ {init}, %{entry} ], "
                                          f"[ {nxt[state]}, %{loop_id} ]")
                    elif kblock:  # carried across blocks too
                        block_phis.lines.append(f"%{state}.outer = phi {t} [ {init}, %{sid} ], "
                                                f"[ {nxt[state]}, %{sid}.block.done ]")
                        phis.lines.append(f"%{state} = phi {t} [ %{state}.outer, %{entry} ], "
                                          f"[ {nxt[state]}, %{loop_id} ]")
                    else:
                        phis.lines.append(f"%{state} = phi {t} [ {init}, %{entry} ], "
                                          f"[ {nxt[state]}, %{loop_id} ]")
                if kblock and a in blocked:
                    t = TYPE[a.dtype]
                    total = f"%{a.name}.total"
                    block_phis.lines.append(f"{total} = phi double [ 0.0, %{sid} ], "
                                            f"[ {total}.next, %{sid}.block.done ]")
                    if t == "double":
                        block_after.lines.append(f"{total}.next = fadd double {total}, {nxt[a.name]}")
                    else:
                        block_after.lines.append(f"%{a.name}.wide = fpext {t} {nxt[a.name]} to double")
                        block_after.lines.append(f"{total}.next = fadd double {total}, %{a.name}.wide")
                    final = f"{total}.next" if t == "double" else \
                        after.emit(f"fptrunc double {total}.next to {t}", a.name)
                    finals[a.name] = {a.name: final}
                else:
                    finals[a.name] = nxt
        else:
            for a in reds:
                finals[a.name] = {state: init for state, _, init in a.states()}
        for a in reds:
            values[a.r.var.name] = a.result(after, finals[a.name])
            done.add(a.r.var.name)
        for name in order:
            if name not in done and name not in kernel.varying \
                    and not isinstance(producers[name], Reduce) and kernel.level.get(name, 0) == phase + 1:
                row_value(after, name)
                done.add(name)
        # where a block ends: K a multiple of the block gives every block the same constant
        # trip count, so the vectorizer needs no remainder loop (less code, faster to compile)
        block_end = [f"%{sid}.k.end = add i64 %{sid}.kb, {kblock}"] if kblock and k % kblock == 0 \
            else [f"%{sid}.kb.end = add i64 %{sid}.kb, {kblock}",
                  f"%{sid}.k.end = call i64 @llvm.umin.i64(i64 %{sid}.kb.end, i64 {k})"]
        sec = dict(id=sid, comment=f"phase {phase}: " + ", ".join(a.r.op for a in reds),
                   before=before.lines, phis=phis.lines, body=body.lines, after=after.lines,
                   kblock=kblock, block_phis=block_phis.lines, block_after=block_after.lines,
                   loop=bool(k), block_end=block_end, interleave=REDUCTION_INTERLEAVE)
        sections.append(sec)
        all_lines += body.lines + after.lines + phis.lines

    row_stores = Emitter(counter)
    # element stores; the stashed value, if it is itself the output, is already stored
    elem = [n for n, s in enumerate(kernel.stores)
            if s.var.name in kernel.varying and stash != (s.var.name, n)]
    if elem and k:
        sid = "store"
        body = Emitter(counter, suffix="." + sid)
        local = dict(values)
        given = {stash[0]: stash[1]} if stash else None
        targets = {kernel.stores[n].var.name for n in elem}
        q = emit_elements(body, closure(targets, set(given or ())), local, f"%{sid}.k", sid, given)
        for n in elem:
            s = kernel.stores[n]
            emit_store(body, s.param, s.dtype, out_index(body, n, q), s.var, local)
        comment = "last pass: element values, stored"
        if stash:
            comment += f" ({stash[0]} read back from where the last phase kept it)"
        sections.append(dict(id=sid, comment=comment, before=[],
                             phis=[], body=body.lines, after=[], kblock=0, block_phis=[],
                             block_after=[], loop=True, interleave=REDUCTION_INTERLEAVE))
        all_lines += body.lines
    for n, s in enumerate(kernel.stores):
        if s.var.name not in kernel.varying:
            emit_store(row_stores, s.param, s.dtype, base(s.index, f"out{n}"), s.var, values)
    all_lines = top.lines + all_lines + row_stores.lines
    return _finish("llvm_reduction.ll.j2", all_lines, target, name=kernel.name, summary=summary(kernel),
                   source_shape=kernel.source_shape, reduce_dims=kernel.reduce_dims,
                   rows=kernel.rows, k=k,
                   parallel=str(kernel.rows > 1 and kernel.rows * k >= PARALLEL_THRESHOLD).lower(),
                   params=_params(kernel), row_lines=top.lines, sections=sections,
                   row_stores=row_stores.lines)


# ---- compiling -----------------------------------------------------------------------------------
# codegen/llvm_build.py drives llvmlite: targets, and the compiler process that runs LLVM's
# optimizer and code generator outside the user's process (an LLVM assertion there cannot take
# the user's program down). What stays here: the cache, and loading the machine code.

_INIT = threading.Lock()


def llvm_binding():
    """llvmlite.binding, initialized once (all targets; libmvec loaded into the process)."""
    return llvm_build.binding()


def target_machine():
    """A new target machine for this CPU: all its features, O3 (an execution engine takes
    ownership of the one it is given)."""
    return llvm_build.target_machine(host())


@functools.lru_cache(maxsize=None)
def triple_and_layout() -> tuple[str, str]:
    """Read once: llvmlite hands out these strings from memory it may later reuse."""
    return host().triple, llvm_build.data_layout(host())


def available() -> bool:
    try:
        llvm_binding()
        return True
    except Exception:  # llvmlite missing or broken
        return False


def host_id(target: Target | None = None) -> str:
    """What the object code depends on besides the IR: LLVM's version and the target."""
    return f"{llvm_binding().llvm_version_info} {target or host()!r}"


def _compile(source: str, what: str, name: str, target: Target | None = None):
    """LLVM's optimizer (and code generator) in the guarded compiler process."""
    from fusec.errors import CompileError
    try:
        return llvm_build.guarded(source, target or host(), what, name)
    except llvm_build.BuildError as exc:
        raise CompileError(f"fusec: LLVM could not compile kernel {name}: {exc}") from None


def optimized_ir(source: str, name: str = "kernel") -> str:
    """The kernel after LLVM's optimizer: what the vectorizer made of the loops."""
    return _compile(source, "optimized", name)


def assembly(source: str, name: str = "kernel", target: Target | None = None) -> str:
    """The machine code of the kernel (for this CPU, or `target`), as assembly."""
    return _compile(source, "assembly", name, target)


def object_code(source: str, name: str = "kernel", target: Target | None = None) -> bytes:
    """The kernel as an object file's bytes (for this CPU, or `target`)."""
    return _compile(source, "object", name, target)


def build(source: str, name: str) -> Path:
    """Compile `source` to an object file (or reuse the cached one). Returns its path."""
    key = cache.content_hash(source, host_id(), "O3 loop+slp vectorize, no unroll",
                             "lsr" if llvm_build.LSR else "no lsr")
    obj = cache.cache_dir("llvm") / f"{name}-{key}.o"
    if cache.verified(obj):
        cache.STATS["hits"] += 1
        cache.log(f"hit {obj.name}")
        return obj
    cache.STATS["misses"] += 1
    cache.atomic_write(obj.with_suffix(".ll"), source)
    data = object_code(source, name)
    cache.atomic_write(obj, data)
    cache.write_manifest(obj)
    cache.STATS["compiles"] += 1
    cache.log(f"compiled {obj.name}")
    return obj


def check_symbols(data: bytes, name: str) -> None:
    """Refuse to load machine code that calls a function this process lacks: MCJIT would link
    the call to address 0, and the kernel would crash the process on its first run. (This is
    how a `bfloat` conversion used to fail on older systems: a call to libgcc's __truncsfbf2.)"""
    missing = [s for s in llvm_build.undefined_symbols(data) if not has_symbol(s)]
    if missing:
        from fusec.errors import CompileError
        raise CompileError(f"fusec: kernel {name}'s machine code calls {', '.join(missing)}, "
                           f"which this process does not have")


# ---- loading and launching -----------------------------------------------------------------------

# Note (threads): a parallel kernel is launched on OpenMP's threads, the same ones torch's own
# CPU ops and the C++ backend's kernels use: `GOMP_parallel(fn, frame, n, 0)` from the libgomp
# that torch already loaded, with fn a small trampoline (llvm_parallel.ll.j2) that runs parts
# of the kernel's range on each thread. Those threads spin a while between parallel regions, so
# a launch costs about a microsecond. A pool of
# Python threads (the fallback, where no libgomp is found) must wake a sleeping thread per
# launch, tens of microseconds in a VM: enough to cancel the second core on a 0.2 ms softmax.

@functools.lru_cache(maxsize=None)
def gomp_parallel():
    """libgomp's GOMP_parallel as a ctypes function (it releases the GIL), or None."""
    try:
        lib = ctypes.CDLL("libgomp.so.1")  # the one torch loaded (same soname: the same library)
        fn = lib.GOMP_parallel
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    fn.restype = None
    return fn


_TRAMPOLINES: dict[int, tuple] = {}


def omp_trampoline(n_params: int) -> int:
    """The address of the OpenMP body (llvm_parallel.ll.j2) for kernels of n_params pointers,
    compiled on first use and kept (with its execution engine) for the life of the process."""
    llvm = llvm_binding()  # (takes the lock itself)
    with _INIT:
        if n_params not in _TRAMPOLINES:
            name = f"fusec_omp_trampoline_{n_params}"
            module = llvm.parse_assembly(render_template("llvm_parallel.ll.j2", name=name,
                                                         n=n_params))
            module.triple = triple_and_layout()[0]
            module.verify()
            engine = llvm.create_mcjit_compiler(module, target_machine())
            engine.finalize_object()
            _TRAMPOLINES[n_params] = (engine, engine.get_function_address(name))
        return _TRAMPOLINES[n_params][1]


@functools.lru_cache(maxsize=None)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(threads() - 1, 1), thread_name_prefix="fusec-llvm")


@functools.lru_cache(maxsize=None)
def threads() -> int:
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:
        return os.cpu_count() or 1


class LlvmLauncher:
    """Calls a JIT-compiled kernel: one call over all its work, or split across threads."""

    def __init__(self, lib: Path, name: str, n_params: int):
        self.lib, self.name, self.n_params = lib, name, n_params  # for the printed wrapper
        llvm = llvm_binding()
        tm = target_machine()  # an execution engine owns (and frees) its target machine
        empty = llvm.parse_assembly("")
        empty.triple = triple_and_layout()[0]
        data = lib.read_bytes()
        check_symbols(data, name)
        self.engine = llvm.create_mcjit_compiler(empty, tm)  # keeps the code alive
        self.engine.add_object_file(llvm.ObjectFileRef.from_data(data))
        self.engine.finalize_object()
        address = self.engine.get_function_address(name)
        if not address:
            from fusec.errors import CompileError
            raise CompileError(f"fusec: kernel {name} is missing from {lib}")
        proto = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * n_params, ctypes.c_int64,
                                 ctypes.c_int64)
        self.fn = proto(address)
        self.frame_type = ctypes.c_int64 * (4 + n_params)
        self.address = address
        self.work = ctypes.c_int64.from_address(self.engine.get_global_value_address(f"{name}.tiles")).value
        self.parallel = ctypes.c_bool.from_address(
            self.engine.get_global_value_address(f"{name}.parallel")).value

    def parts(self) -> int:
        """How many threads this launch uses: torch's intra-op thread count (torch.set_num_threads
        applies, as it does to the C++ backend's OpenMP), at most one per unit of work."""
        return min(torch.get_num_threads(), self.work) if self.parallel else 1

    def __call__(self, *tensors: torch.Tensor) -> None:
        ptrs = [t.data_ptr() for t in tensors]
        parts = self.parts()
        if parts <= 1:
            self.fn(*ptrs, 0, self.work)
            return
        gomp = gomp_parallel()
        if gomp is not None:
            frame = self.frame_type(0, parts, self.work, self.address, *ptrs)
            gomp(omp_trampoline(self.n_params), ctypes.addressof(frame), parts, 0)
            return
        step = -(-self.work // parts)
        ranges = [(lo, min(lo + step, self.work)) for lo in range(0, self.work, step)]
        futures = [_pool().submit(self.fn, *ptrs, lo, hi) for lo, hi in ranges[1:]]
        self.fn(*ptrs, *ranges[0])  # this thread takes the first range itself
        for f in futures:
            f.result()


def launcher(obj: Path, name: str, n_params: int) -> LlvmLauncher:
    """Load a built object file (fusec/build.py builds first, several at a time, then loads)."""
    return LlvmLauncher(obj, name, n_params)


def load(kernel, source: str) -> LlvmLauncher:
    return launcher(build(source, kernel.name), kernel.name, len(kernel.params))

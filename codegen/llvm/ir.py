"""LLVM IR text: the pieces both LLVM renderers (__init__.py for pointwise kernels, reduction.py)
write with. Types and literals, an `Emitter` of SSA instructions, conversions as torch does them,
each op's spelling from the op table's `llvm` column, loads, stores and index arithmetic, and the
declarations (libm, libmvec's vector variants, torch's SLEEF) and prelude of helpers a module needs.

Why this file is long: it is the LLVM backend's whole spelling of values, the counterpart of the
C++ backend's cpp/text.py plus cpp_prelude.h; the vector-math section (which library a math call
goes to, and at what vector width) is the part that could stand alone next.
"""
from __future__ import annotations

import functools
import itertools
import math
import os
import pathlib
import platform
import re
import struct

import torch

from fusec import ops
from fusec.ir import Const, Stmt, Var

from . import compiler as llvm_build
from ..cpu_plan import SLEEF, sleef_symbols_in  # (Note: eager's vector math)
from fusec.codegen.cpu_plan import eager_gelu_multiplies_first  # (Note: eager's gelu depends on the CPU)
from .compiler import Target, host
from .sizes import Sizes, known, size_arguments
from ..render import render_template

# ---- types -------------------------------------------------------------------------------------

# The LLVM type a value has in registers (bool in i1) ...
#
# Note (half precision): float16 and bfloat16 values are computed in float (ops.register_dtype)
# and travel as their 16 bits, an i16: loads widen them with @fusec_widen, stores narrow with
# @fusec_narrow (llvm_prelude.ll.j2), integer bit operations that vectorize on every target.
# LLVM's own `bfloat` type is never written, and `half` only inside the float16 helpers of a
# target with F16C (has_f16c), where `fpext`/`fptrunc` become vcvtph2ps/vcvtps2ph, 16 values per
# instruction, with torch's answers bit for bit: a float16 chain rounds after every op as eager
# does, and the integer rounding took 6x eager's time there. Elsewhere whether the code generator
# accepts those types depends on the CPU it targets (with AVX-512 BF16, LLVM 15-22 abort on
# `fptrunc float to bfloat`; without F16C, `half` becomes a call to a libgcc routine that older
# systems lack); integer code is legal everywhere.
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

class Counter:
    """What the Emitters of one kernel function share: the count that keeps SSA names unique,
    and the function's size values (llvm/sizes.py), whose instructions go in its entry block."""

    def __init__(self):
        self._count = itertools.count()
        self.sizes = Sizes(self._count)

    def __iter__(self):
        return self

    def __next__(self) -> int:
        return next(self._count)


class Emitter:
    """Collects the instructions of one block of code. SSA names must be unique in a function,
    so temporaries get a counter shared by the whole kernel, and values recomputed inside a
    phase's loop get that phase's suffix (`%v3_exp.p1`)."""

    def __init__(self, counter: Counter, suffix: str = ""):
        self.lines: list[str] = []
        self.counter = counter
        self.suffix = suffix

    def size(self, x) -> str:
        """Size `x` (an int or a SymInt) as an i64 operand: its number, or the value the
        kernel's entry block computes from its size arguments (llvm/sizes.py)."""
        return self.counter.sizes.operand(x)

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
    if isinstance(o, Const) and known(o.value) is None:  # a size (a mean's count): an i64 value
        return convert(e, e.size(o.value), torch.int64, dtype, "size")
    if isinstance(o, Const) and isinstance(o.value, torch.SymFloat) \
            and o.value.node.expr.free_symbols:  # a float of sizes (batch norm's n / (n - 1))
        return convert(e, e.counter.sizes.real(o.value), torch.float64, dtype, "size")
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


def gather_row(e: Emitter, load, position_dtype: torch.dtype, values: dict[str, str]) -> str:
    """The element offset of a gathered read's row (fusec.ir.Load's `gather`), as an i64: the
    index value, counted from the end where negative, kept inside [0, size) (no read leaves the
    source; passes/check_gathers.py reports a value out of range), times the row's stride."""
    pos, stride, size = load.gather
    name = load.var.name + ".row"
    at = values[pos]
    if position_dtype != torch.int64:
        at = e.emit(f"sext {TYPE[position_dtype]} {at} to i64", name)
    negative = e.emit(f"icmp slt i64 {at}, 0", name)
    wrapped = e.emit(f"add nsw i64 {at}, {e.size(size)}", name)
    at = e.emit(f"select i1 {negative}, i64 {wrapped}, i64 {at}", name)
    below = e.emit(f"icmp slt i64 {at}, 0", name)
    at = e.emit(f"select i1 {below}, i64 0, i64 {at}", name)
    last = e.size(size - 1)
    above = e.emit(f"icmp sgt i64 {at}, {last}", name)
    at = e.emit(f"select i1 {above}, i64 {last}, i64 {at}", name)
    return at if known(stride) == 1 else e.emit(f"mul nsw i64 {at}, {e.size(stride)}", name)


def emit_store(e: Emitter, param: str, storage: torch.dtype, index: str, var: Var,
               values: dict[str, str]) -> None:
    value = convert(e, values[var.name], var.dtype, storage, var.name)
    if storage == torch.bool:
        value = e.emit(f"zext i1 {value} to i8", var.name)
    ptr = e.emit(f"getelementptr inbounds {STORAGE[storage]}, ptr %{param}_ptr, i64 {index}",
                 param + ".ptr")
    e.lines.append(f"store {STORAGE[storage]} {value}, ptr {ptr}")


def index_sum(e: Emitter, terms: list[tuple[str, int]], offset: int, base: str) -> str:
    """offset + sum(value * stride) as i64 instructions (or a constant). Strides and offset may
    be sizes that are symbols (llvm/sizes.py): a term is left out only where it is 0 for every
    size, and a stride multiplies only where it is not 1 for every size."""
    acc = e.size(offset) if known(offset) != 0 else None
    for value, stride in terms:
        if known(stride) == 0:
            continue
        term = value if known(stride) == 1 else e.emit(f"mul nsw i64 {value}, {e.size(stride)}",
                                                       base)
        acc = term if acc is None else e.emit(f"add nsw i64 {acc}, {term}", base)
    return acc or "0"


def coords(e: Emitter, flat: str, shape: tuple[int, ...], prefix: str) -> list[str]:
    """Row-major coordinates of position `flat` in `shape`, as named SSA values."""
    out = []
    for d in range(len(shape)):
        below = math.prod(shape[d + 1:])
        value = flat if known(below) == 1 else \
            e.named(f"{prefix}{d}.q", f"udiv i64 {flat}, {e.size(below)}")
        if d:
            value = e.named(f"{prefix}{d}", f"urem i64 {value}, {e.size(shape[d])}")
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
def sleef_library() -> str | None:
    """libtorch_cpu's path, loaded into the JIT's symbol search (it is in the process already, but
    loaded privately), or None where it does not export SLEEF's vector functions."""
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    if not sleef_symbols_in(path):
        return None
    llvm_build.binding().load_library_permanently(path)
    return path


def vector_variant(letter: str, lanes: int, params: str, name: str, ret: str) -> str:
    """The vector function a call to C library function `name` becomes, `lanes` at a time:
    SLEEF's 1-ulp version for float32 (Note: eager's vector math), else libmvec's."""
    if ret == "float" and name[:-1] in SLEEF and sleef_library():
        sleef = f"_ZGV{letter}N{lanes}{params}_Sleef_{name}_u10"
        if has_symbol(sleef):
            return sleef
    return f"_ZGV{letter}N{lanes}{params}_{name}"


@functools.lru_cache(maxsize=None)
def has_symbol(name: str) -> bool:
    """True when the JIT can resolve `name` in this process (libmvec is loaded by then; torch's
    SLEEF is loaded here, for a kernel loaded from the disk cache before any was rendered)."""
    if "_Sleef_" in name and not sleef_library():
        return False
    return bool(llvm_build.binding().address_of_symbol(name))


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
                variant = vector_variant(letter, lanes, params, name, ret)
                if not has_symbol(variant):  # older glibc: no vector erf, say
                    continue
                if variants and "_Sleef_" in variants[0] and "_Sleef_" not in variant:
                    continue  # no narrower libmvec lanes next to SLEEF's: the remainder is libm's
                vec = f"<{lanes} x {ret}>"
                out.append(f"declare {vec} @{variant}({', '.join([vec] * len(params))})")
                variants.append(f"_ZGV{letter}N{lanes}{params}_{name}({variant})")
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


# x86-64 CPUs (LLVM's names) that have F16C, for targets named without a feature list
F16C_CPUS = {"x86-64-v3", "x86-64-v4", "haswell", "broadwell", "skylake", "skylake-avx512",
             "cascadelake", "cooperlake", "icelake-client", "icelake-server", "tigerlake",
             "alderlake", "sapphirerapids", "graniterapids", "znver1", "znver2", "znver3", "znver4"}


def has_f16c(target: Target | None = None) -> bool:
    """Whether `target` (this CPU by default) converts float16 in hardware (F16C: vcvtph2ps and
    vcvtps2ph, 4 to 16 values per instruction; every x86-64 CPU with AVX2 has it). Then the float16
    helpers are LLVM's own `fpext`/`fptrunc` through `half` (Note: half precision), which the
    code generator turns into those instructions; elsewhere they are integer operations."""
    target = target or host()
    if not target.triple.startswith("x86_64"):
        return False
    features = target.features.split(",")
    return "+f16c" in features or ("-f16c" not in features and target.cpu in F16C_CPUS)


def prelude(lines: list[str], target: Target | None = None) -> tuple[str, set[str]]:
    """The helper functions (llvm_prelude.ll.j2) this kernel calls, rendered for the types it
    calls them with and for `target`, and the set of names they define. A helper may call another
    (tanh-GELU calls `fusec_tanh`): those are added until nothing new is called."""
    wanted = {(name, short) for line in lines for name, short in HELPERS.findall(line)}
    if not wanted:
        return "", set()
    by_short = {v: k for k, v in SHORT.items()}
    while True:
        helpers = []
        for name, short in sorted(wanted):
            dtype = by_short[short]
            helpers.append(dict(name=name, D=short, T=TYPE[dtype], S=SUFFIX[dtype],
                                kind=kind(dtype),
                                c=_helper_constants(dtype) if is_float(dtype) else {}))
        text = render_template("llvm_prelude.ll.j2", helpers=helpers, tables=prelude_tables(),
                               f16c=has_f16c(target),
                               gelu_multiplies_first=eager_gelu_multiplies_first())
        called = wanted | set(HELPERS.findall(text))
        if called == wanted:
            break
        wanted = called
    defined = {f"{h['name']}.{h['D']}" for h in helpers}
    # the helpers call intrinsics too: declare those along with the kernel's
    return text, defined


@functools.lru_cache(maxsize=None)
def prelude_tables() -> dict[str, list[str]]:
    """The polynomial coefficients of the C++ prelude's tanh and erf helpers
    (fusec_expm1_reduced, fusec_tanh, fusec_erf: `static constexpr double P[] = {...}`, each a
    float written exactly as a double), as LLVM constants, read from
    codegen/cpp/templates/cpp_prelude.h so that both backends compute with the same numbers:
    {"fusec_erf.S": [...]}."""
    text = (pathlib.Path(__file__).parent.parent / "cpp" / "templates" / "cpp_prelude.h").read_text()
    tables, function = {}, None
    for line_no, line in enumerate(text.splitlines()):
        head = re.match(r"static inline \w+ (\w+)\(", line)
        function = head.group(1) if head else function
        table = re.match(r"\s*static constexpr double (\w+)\[\] = \{", line)
        if table:
            body = text.split("\n", line_no)[-1]
            numbers = body[body.index("{") + 1:body.index("}")]
            tables[f"{function}.{table.group(1)}"] = [
                literal(float.fromhex(v.strip()), torch.float64) for v in numbers.split(",")]
    return tables


def _helper_constants(dtype) -> dict:
    return {k: literal(v, dtype) for k, v in {
        "half": 0.5, "one": 1.0, "sqrt1_2": 0.70710678118654752440,
        "sqrt_2_over_pi": 0.79788456080286535588, "gelu_c": 0.044715}.items()}




def kernel_params(kernel) -> list[str]:
    """The kernel's parameters: its buffers, then one i64 per size that is a symbol (in the
    order of fusec.symbolic.size_params; none for a kernel of fixed sizes)."""
    return [f"ptr noalias {'' if p.is_output else 'readonly '}%{p.name}_ptr"
            for p in kernel.params] + size_arguments(kernel)



@functools.lru_cache(maxsize=None)
def function_attributes(target: Target | None = None) -> str:
    """The attributes of a kernel function. On this machine, where torch runs its AVX512 kernels,
    vectors of 512 bits, as the C++ backend asks gcc for (codegen/cpp/__init__.py vector_flags): LLVM's
    default there is 256, and a loop of 8 lanes calls SLEEF's 8-lane functions (Note: eager's
    vector math), which took 2-4x the time of its 16-lane ones (log2 of 4M floats on one core:
    8.3 ms against 2.35; eager 2.3)."""
    here = target is None or target == host()
    if here and platform.machine() in ("x86_64", "AMD64") and \
            torch.backends.cpu.get_cpu_capability() == "AVX512":
        return 'nounwind "prefer-vector-width"="512"'
    return "nounwind"


def finish(template: str, lines: list[str], target: Target | None, counter: Counter,
           launch: dict, **context) -> str:
    """Render the kernel's template with what every kernel has: the helpers and declarations its
    instructions call, its attributes, its size values (`sizes`, the entry block's lines) and
    the functions the launcher asks where the amount of work depends on the sizes (`launch`:
    llvm/sizes.py launch_functions)."""
    sizes = counter.sizes.lines
    lines = lines + sizes + [line for f in launch.values() if f for line in f["lines"]]
    helper_text, defined = prelude(lines, target)
    decl_lines = lines + helper_text.splitlines() + ["call i64 @llvm.umin.i64(i64 %a, i64 %b)"]
    context.update(prelude=helper_text, declarations=declarations(decl_lines, defined, target),
                   function_attributes=function_attributes(target), sizes=sizes, **launch)
    return render_template(template, **context)


def new_counter() -> Counter:
    return Counter()

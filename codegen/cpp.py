"""C++/OpenMP backend: PointwiseKernel -> C++ source -> shared library -> ctypes function.

The kernel is one `extern "C"` function taking a pointer per buffer. Sizes, strides and offsets
are compile-time constants (fusec compiles one schedule per input signature), which lets gcc
unroll and vectorize freely. Half-precision values are converted to float on load and rounded
back on store; integer arithmetic wraps as PyTorch's does (`-fwrapv`).

Building shells out to the system C++ compiler (`$CXX`, else g++, c++ or clang++):

    g++ -O3 -march=native -fopenmp -fwrapv -ffp-contract=off -fno-math-errno -shared -fPIC kernel.cpp -o kernel.so

and the library is cached on disk by the hash of its source and the compiler command
(fusec/cache.py), so a second process loads it without compiling.
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
import shutil
import subprocess
from pathlib import Path

import torch

from fusec import cache, ops
from fusec.errors import CompileError, CompilerNotFoundError
from fusec.ir import Const, Index, PointwiseKernel, Stmt, Var

from .render import render_template

# -fno-math-errno: fusec never reads errno, and a math call that may set it is a store gcc cannot
# move or vectorize: with it, a loop with a select around exp/log1p (softplus, mish) stays scalar
# (libm, one element per call); without it, gcc calls libmvec's 8-wide versions. Results are the
# same functions' results; only the errno side effect is dropped.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fwrapv", "-ffp-contract=off", "-fno-math-errno",
         "-std=c++17", "-shared", "-fPIC"]
TEMPLATES = Path(__file__).parent / "templates"
PARALLEL_THRESHOLD = 1 << 15  # below this many elements, threads cost more than they save
CHUNK = 8192
# Note (tiles for transposed reads): the loop order follows the first output's layout, so an input
# laid out the other way (x.t() next to a row-major y) is read with a large stride on every inner
# step: each element a different cache line, and by the time the next row wants the neighbouring
# element that line is long gone. Cutting the iteration into ROW_TILE x TILE_CHUNK tiles keeps the
# lines one tile touches (TILE_CHUNK of them per strided input) in L1 while ROW_TILE rows use them.
ROW_TILE, TILE_CHUNK = 16, 64
REDUCTION_TILE_MAX = 4096  # longest row copied into an array on the stack (Note: rows reduced ...)
TILE_STRIDE = 16  # an inner stride of this many elements or more puts each step on a new line

CTYPE = {
    torch.float16: "uint16_t", torch.bfloat16: "uint16_t", torch.float32: "float",
    torch.float64: "double", torch.int8: "int8_t", torch.uint8: "uint8_t",
    torch.int16: "int16_t", torch.int32: "int32_t", torch.int64: "int64_t", torch.bool: "bool",
}


# ---- compiler discovery ------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def find_compiler() -> str:
    """The C++ compiler to use, or a CompilerNotFoundError that names what was tried."""
    wanted = os.environ.get("CXX")
    if wanted:
        found = shutil.which(wanted)
        if found:
            return found
        raise CompilerNotFoundError(
            f"fusec: the C++ backend needs a C++ compiler, but CXX={wanted!r} was not found. "
            "Install it, point CXX at a compiler, or use backend='llvm' (no compiler needed).")
    chosen_c = os.environ.get("CC")
    if chosen_c and not shutil.which(chosen_c):
        # CC names a C compiler, which the C++ backend cannot use itself; but a user who points
        # it at something missing means "no compiler here", and gets the toolchain-free backend
        raise CompilerNotFoundError(
            f"fusec: the C++ backend needs a C++ compiler, but CC={chosen_c!r} was not found "
            "(and CXX is not set). Set CXX to a C++ compiler, or use backend='llvm'.")
    for name in ("g++", "c++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    raise CompilerNotFoundError(
        "fusec: the C++ backend needs a C++ compiler and none was found (tried $CXX, g++, c++, "
        "clang++). Install g++ (e.g. `apt-get install g++`), set CXX, or use backend='llvm' (no compiler needed).")


@functools.lru_cache(maxsize=None)
def compiler_id(path: str) -> str:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else path
    except (OSError, subprocess.SubprocessError):
        return path


@functools.lru_cache(maxsize=None)
def math_flags() -> list[str]:
    """Link glibc's vector math library where it exists (see cpp_prelude.h), else nothing."""
    import ctypes.util
    return ["-DFUSEC_LIBMVEC", "-lmvec", "-lm"] if ctypes.util.find_library("mvec") else []


@functools.lru_cache(maxsize=None)
def host_cpu() -> str:
    """What -march=native compiles for: a library built on one CPU may not run on another."""
    import platform
    fields = [platform.machine()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features", "CPU part")):
                    fields.append(line.strip())
                if len(fields) >= 4:
                    break
    except OSError:
        fields.append(platform.processor())
    return "\n".join(fields)


def available() -> bool:
    try:
        find_compiler()
        return True
    except CompilerNotFoundError:
        return False


# ---- rendering ---------------------------------------------------------------------------------

def literal(value, dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "true" if value else "false"
    if dtype.is_floating_point:
        value = float(value)
        ctype = "double" if dtype == torch.float64 else "float"
        if math.isnan(value):
            return f"std::numeric_limits<{ctype}>::quiet_NaN()"
        if math.isinf(value):
            sign = "-" if value < 0 else ""
            return f"({sign}std::numeric_limits<{ctype}>::infinity())"
        return f"{ctype}({value!r})"
    value = torch.tensor(value).to(dtype).item()  # wrap like torch: -1 as uint8 is 255
    if dtype == torch.int64 and value == -(2 ** 63):
        return "std::numeric_limits<int64_t>::min()"
    return f"{CTYPE[dtype]}({value})"


def convert(expr: str, src: torch.dtype, dst: torch.dtype) -> str:
    """C++ for `expr` (of dtype src) converted to dst the way torch's `.to(dst)` does."""
    if src == dst:
        return expr
    if dst == torch.bool:
        return f"({expr} != 0)"
    if src.is_floating_point and not dst.is_floating_point and dst != torch.int64:
        return f"static_cast<{CTYPE[dst]}>(static_cast<int64_t>({expr}))"
    return f"static_cast<{CTYPE[dst]}>({expr})"


def _operand(o, dtype) -> str:
    if isinstance(o, Const):
        return literal(o.value, dtype)
    return convert(o.name, o.dtype, dtype)


def _stmt(s: Stmt) -> str:
    row = ops.OPS[s.op]
    args = [_operand(o, dt) for o, dt in zip(s.operands, s.operand_dtypes)]
    expr = row.cpp.format(*args)
    expr = convert(f"({expr})", s.result_dtype, s.var.dtype)
    if s.round_to == torch.float16:
        expr = f"fusec_round_f16({expr})"
    elif s.round_to == torch.bfloat16:
        expr = f"fusec_round_bf16({expr})"
    return f"const {CTYPE[s.var.dtype]} {s.var.name} = {expr};  // {s.origin}"


def _load_value(ptr_expr: str, storage: torch.dtype) -> str:
    if storage == torch.float16:
        return f"fusec_f16_to_f32({ptr_expr})"
    if storage == torch.bfloat16:
        return f"fusec_bf16_to_f32({ptr_expr})"
    return ptr_expr


def _store_value(var: Var, storage: torch.dtype) -> str:
    if storage == torch.float16:
        return f"fusec_f32_to_f16({var.name})"
    if storage == torch.bfloat16:
        return f"fusec_f32_to_bf16({var.name})"
    return convert(var.name, var.dtype, storage)


def render(kernel) -> str:
    if not isinstance(kernel, PointwiseKernel):
        return render_reduction(kernel)
    shape = kernel.shape
    rows = math.prod(shape[:-1])
    inner = shape[-1]
    chunk = inner if rows >= 64 or inner <= CHUNK else CHUNK
    outer_dims = len(shape) - 1
    strided = sorted({l.param for l in kernel.loads if abs(l.index.strides[-1]) >= TILE_STRIDE})
    row_tile = 1
    if strided and rows >= 2 and inner >= 2:
        row_tile, chunk = min(ROW_TILE, rows), min(TILE_CHUNK, inner)

    row_setup: list[str] = []
    if outer_dims:
        # coordinates of `row` along the outer dims (row-major)
        rem = "row"
        for d in range(outer_dims):
            below = math.prod(shape[d + 1:-1])
            row_setup.append(f"const int64_t c{d} = {rem} / {below};" if d < outer_dims - 1
                             else f"const int64_t c{d} = {rem};")
            if d < outer_dims - 1:
                row_setup.append(f"const int64_t r{d} = {rem} % {below};")
                rem = f"r{d}"

    def index(idx: Index, label: str) -> str:
        base = [str(idx.offset)] if idx.offset else []
        base += [f"c{d} * {s}" for d, s in enumerate(idx.strides[:-1]) if s]
        if base:
            row_setup.append(f"const int64_t {label}_base = {' + '.join(base)};")
        inner_term = {0: "", 1: "i"}.get(idx.strides[-1], f"i * {idx.strides[-1]}")
        terms = ([f"{label}_base"] if base else []) + ([inner_term] if inner_term else [])
        return " + ".join(terms) or "0"

    body: list[str] = []
    gathers: list[str] = []
    for load in kernel.loads:
        ptr = f"{load.param}_ptr[{index(load.index, load.var.name)}]"
        if row_tile > 1 and load.param in strided:
            # gcc will not vectorize a loop with a load this strided: copy the tile's part of
            # the row into a small contiguous array first, then the main loop reads that
            tile = f"{load.var.name}_tile"
            gathers += [f"{CTYPE[load.dtype]} {tile}[CHUNK];",
                        f"for (int64_t i = start; i < end; ++i) {tile}[i - start] = {ptr};"]
            ptr = f"{tile}[i - start]"
        body.append(f"const {CTYPE[load.var.dtype]} {load.var.name} = "
                    f"{convert(_load_value(ptr, load.dtype), ops.register_dtype(load.dtype), load.var.dtype)};")
    body += [_stmt(s) for s in kernel.stmts]
    for k, store in enumerate(kernel.stores):
        target = f"{store.param}_ptr[{index(store.index, f'out{k}')}]"
        body.append(f"{target} = {_store_value(store.var, store.dtype)};")

    params = [f"{'' if p.is_output else 'const '}{CTYPE[p.dtype]}* __restrict__ {p.name}_ptr"
              for p in kernel.params]
    return render_template(
        "cpp_pointwise.cpp.j2",
        name=kernel.name, summary=summary(kernel),
        source_shape=kernel.source_shape, numel=kernel.numel, rows=rows, inner=inner,
        chunk=max(chunk, 1), parallel=f"ROWS * INNER >= {PARALLEL_THRESHOLD}", row_tile=row_tile,
        tile_reason=f"{', '.join(strided)} step(s) across cache lines in the inner loop: each "
                    f"tile reuses the lines it loads for {row_tile} rows (Note: tiles for transposed reads)",
        params=params, row_setup=row_setup, gathers=gathers, body=body)


def summary(kernel: PointwiseKernel) -> str:
    names = [op.replace("aten.", "").split(".")[0] for op in kernel.ops]
    return f"fuses {len(names)} ATen op(s): {', '.join(names)}"


@functools.lru_cache(maxsize=None)
def prelude() -> str:
    return (TEMPLATES / "cpp_prelude.h").read_text()


# ---- building and loading ----------------------------------------------------------------------

def build(source: str, name: str) -> Path:
    """Compile `source` into a shared library (or reuse the cached one). Returns its path."""
    compiler = find_compiler()
    key = cache.content_hash(source, prelude(), compiler_id(compiler), " ".join(FLAGS + math_flags()),
                             host_cpu())
    directory = cache.cache_dir("cpp")
    lib = directory / f"{name}-{key}.so"
    if cache.verified(lib):
        cache.STATS["hits"] += 1
        cache.log(f"hit {lib.name}")
        return lib
    cache.STATS["misses"] += 1
    src = directory / f"{name}-{key}.cpp"
    cache.atomic_write(src, source)
    tmp = directory / f"{name}-{key}.{os.getpid()}.so.tmp"
    cmd = [compiler, *FLAGS, *math_flags(), f"-I{TEMPLATES}", str(src), "-o", str(tmp)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise CompileError(f"fusec: {os.path.basename(compiler)} failed to compile kernel {name} "
                           f"({src}):\n{result.stderr[-4000:]}")
    os.replace(tmp, lib)
    cache.write_manifest(lib)
    cache.STATS["compiles"] += 1
    cache.log(f"compiled {lib.name}")
    return lib


def compile_object(source: str, name: str, arch: list[str], out: Path,
                   compiler: str | None = None) -> None:
    """Compile `source` to an object file for the CPU that `arch` names (["-march=haswell"])
    instead of this one, with `compiler` (a cross compiler, say) or the usual one: compile only,
    nothing is linked or loaded. tests/test_targets.py uses it to check that every kernel
    compiles for CPU families other than the test machine's."""
    flags = [f for f in FLAGS if f not in ("-march=native", "-shared")]
    defines = [f for f in math_flags() if f.startswith("-D")]
    src = out.with_suffix(".cpp")
    src.write_text(source)
    cmd = [compiler or find_compiler(), *flags, *arch, *defines, f"-I{TEMPLATES}", "-c", str(src), "-o", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise CompileError(f"fusec: {os.path.basename(cmd[0])} {' '.join(arch)} failed to compile "
                           f"{name} ({src}):\n{result.stderr[-4000:]}")


def _load_library(lib: Path) -> ctypes.CDLL:
    """dlopen a kernel library. The first one also loads the system's OpenMP runtime, which is
    not the one inside torch's wheel: two thread pools then share the cores, and a pool whose
    idle threads spin after a parallel loop starves the other (measured on 2 cores: a small MLP
    call went from 0.1 ms to 2 ms). Unless the user chose a wait policy, our threads sleep at
    once when idle (libgomp reads GOMP_SPINCOUNT when it loads)."""
    chosen = "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ
    if not chosen:
        os.environ["GOMP_SPINCOUNT"] = "0"
    try:
        return ctypes.CDLL(str(lib))
    finally:
        if not chosen:
            del os.environ["GOMP_SPINCOUNT"]


class CppLauncher:
    """Calls the compiled kernel with the data pointers of its tensors (inputs, then outputs).

    The ctypes function is prepared once: its argument types say "one pointer per buffer", so a
    call converts plain ints (`t.data_ptr()`) without building ctypes objects. `pointer_entry` is
    that function itself: the runtime's straight-line program (fusec/runtime.py) calls it
    directly with the data pointers, skipping this class's `__call__` and its list.
    """

    def __init__(self, lib: Path, name: str, n_params: int):
        self.lib, self.name, self.n_params = lib, name, n_params  # for the printed wrapper
        self.fn = getattr(_load_library(lib), name)
        self.fn.argtypes = [ctypes.c_void_p] * n_params
        self.fn.restype = None
        self.pointer_entry = self.fn  # fn(*data_ptrs): what a prepared call site uses

    def __call__(self, *tensors: torch.Tensor) -> None:
        self.fn(*[t.data_ptr() for t in tensors])


def launcher(lib: Path, name: str, n_params: int) -> CppLauncher:
    """Load a built library (fusec/build.py builds first, several at a time, then loads)."""
    return CppLauncher(lib, name, n_params)


def load(kernel: PointwiseKernel, source: str) -> CppLauncher:
    return launcher(build(source, kernel.name), kernel.name, len(kernel.params))


# ---- reductions ------------------------------------------------------------------------------

def render_reduction(kernel) -> str:
    """One OpenMP-parallel loop over rows; inside, one loop over k per reduction phase, then a
    last loop that recomputes and stores the element values (softmax's division, say)."""
    from fusec.ir import Reduce
    n_rows = len(kernel.row_shape)
    row_lines = _coords("c", "row", kernel.row_shape)
    k_coords = _coords("q", "k", kernel.k_shape)

    def index(idx: Index, label: str) -> str:
        base = ([str(idx.offset)] if idx.offset else []) + \
            [f"c{d} * {s}" for d, s in enumerate(idx.strides[:n_rows]) if s]
        if base:
            row_lines.append(f"const int64_t {label}_base = {' + '.join(base)};")
        kterms = [f"q{d}" if s == 1 else f"q{d} * {s}"
                  for d, s in enumerate(idx.strides[n_rows:]) if s]
        if len(kernel.k_shape) > 1 and flat_k(idx.strides[n_rows:], kernel.k_shape):
            # contiguous over all of k (group norm's (C/G, H*W)): the address is k itself;
            # gcc cannot see that q0 * 1024 + q1 is k again and would gather element by element
            last = idx.strides[-1]
            kterms = ["k" if last == 1 else f"k * {last}"]
        return " + ".join(([f"{label}_base"] if base else []) + kterms) or "0"

    # Note (rows reduced across a strided axis): softmax over the channels of an NCHW tensor
    # reduces K values that lie H*W elements apart. Read in place, every k step is a new cache
    # line and gcc will not vectorize the row's loops (exp, say). Such an access is copied
    # between memory and a small contiguous array once per row (the rows next to each other share
    # those cache lines, so the copies hit L1); the row's phases then run on the array, vectorized.
    def k_strided(idx: Index) -> bool:
        ks = [abs(s) for s in idx.strides[n_rows:] if s]
        return bool(ks) and min(ks) >= TILE_STRIDE
    lanes = lane_blocks(kernel, k_strided)
    if lanes:
        # Note (lanes of rows): see lane_blocks. The row's coordinates come from the block and
        # the lane, so every address is linear in the lane and gcc vectorizes across lanes.
        row_lines = _coords("c", "outer", kernel.row_shape[:-1])
        row_lines.append(f"const int64_t c{n_rows - 1} = lane0 + lane;")

    def strided_k(idx: Index) -> bool:
        return not lanes and k_strided(idx) and kernel.k <= REDUCTION_TILE_MAX
    gather_k = " ".join(k_coords)
    scatters: list[str] = []

    lines: dict[str, str] = {}
    for l in kernel.loads:
        ptr = f"{l.param}_ptr[{index(l.index, l.var.name)}]"
        if strided_k(l.index):
            tile = f"{l.var.name}_tile"
            row_lines.append(f"{CTYPE[l.dtype]} {tile}[K];  // {l.param}'s row, gathered")
            row_lines.append(f"for (int64_t k = 0; k < K; ++k) {{ {gather_k} {tile}[k] = {ptr}; }}")
            ptr = f"{tile}[k]"
        lines[l.var.name] = (f"const {CTYPE[l.var.dtype]} {l.var.name} = "
                             f"{convert(_load_value(ptr, l.dtype), ops.register_dtype(l.dtype), l.var.dtype)};")
    producers = {l.var.name: l for l in kernel.loads}
    reduces = [i for i in kernel.body if isinstance(i, Reduce)]
    for item in kernel.body:
        producers[item.var.name] = item
        if not isinstance(item, Reduce):
            lines[item.var.name] = _stmt(item)
    order = [l.var.name for l in kernel.loads] + [i.var.name for i in kernel.body]

    def closure(targets, given: dict | None = None) -> list[str]:
        """Lines computing the element values `targets` need; `given` maps a value that is read
        back from memory (see stash_choice) to the line that reads it."""
        given = given or {}
        return [given.get(n, lines[n]) for n in kernel.values_needed(targets, given)]

    store_targets: dict[int, str] = {}

    def target(n: int) -> str:  # a store's address, its `_base` row line written once
        if n not in store_targets:
            s = kernel.stores[n]
            store_targets[n] = f"{s.param}_ptr[{index(s.index, f'out{n}')}]"
            if strided_k(s.index):
                tile = f"out{n}_tile"
                row_lines.append(f"{CTYPE[s.dtype]} {tile}[K];  // {s.param}'s row, scattered at the end")
                scatters.append(f"for (int64_t k = 0; k < K; ++k) {{ {gather_k} {store_targets[n]} = {tile}[k]; }}")
                store_targets[n] = f"{tile}[k]"
        return store_targets[n]

    stash = stash_choice(kernel)

    done: set[str] = set()
    for name in order:  # row values needing no reduction: once per row, before the loops
        item = producers[name]
        if name not in kernel.varying and not isinstance(item, Reduce) and kernel.level.get(name, 0) == 0:
            row_lines.append(lines[name])
            done.add(name)

    sections = []
    for phase in range(kernel.phases):
        reds = [r for r in reduces if r.phase == phase]
        before, body, after = [], list(k_coords), []
        body += closure({r.operand.name for r in reds})
        simd = all(ops.REDUCTIONS[r.op].name in ("sum", "prod") and r.acc_dtype != torch.bool
                   for r in reds)
        maxmin = bool(reds) and all(r.op in ("amax", "amin") and r.acc_dtype != torch.bool
                                    for r in reds)
        if stash and phase == kernel.phases - 1:
            final = all((st.var.name, n) == stash or st.var.name not in kernel.varying
                        for n, st in enumerate(kernel.stores))
            why = "the output, stored once: no last pass" if final else "kept for the last pass"
            body.append(f"{target(stash[1])} = {stash[0]};  // {why}")
        for r in reds:
            red = ops.REDUCTIONS[r.op]
            acc = f"acc_{r.var.name}"
            x = convert(r.operand.name, r.operand.dtype, r.acc_dtype if not red.returns_index
                        else r.operand.dtype)
            if red.returns_index:
                cmp = ">" if r.op == "argmax" else "<"
                before.append(f"{CTYPE[r.operand.dtype]} {acc} = "
                              f"{literal(red.init(r.operand.dtype), r.operand.dtype)};")
                before.append(f"int64_t {acc}_at = 0; bool {acc}_seen = false;")
                nan = f"({x} != {x})" if r.operand.dtype.is_floating_point else "false"
                body.append(f"if (!({acc} != {acc}) && (!{acc}_seen || {x} {cmp} {acc} || {nan})) "
                            f"{{ {acc} = {x}; {acc}_at = k; {acc}_seen = true; }}")
                after.append(f"const int64_t {r.var.name} = {acc}_at;  // {r.origin}")
            elif maxmin:
                # a plain max/min the compiler vectorizes, plus a flag for NaN (which torch's
                # amax propagates and a compare-and-select would skip)
                cmp = ">" if r.op == "amax" else "<"
                before.append(f"{CTYPE[r.acc_dtype]} {acc} = {literal(red.init(r.acc_dtype), r.acc_dtype)};")
                body.append(f"{acc} = ({x} {cmp} {acc}) ? {x} : {acc};")
                value = convert(acc, r.acc_dtype, r.var.dtype)
                if r.acc_dtype.is_floating_point:
                    # an int, not a bool: gcc vectorizes a bool |-reduction ~9x slower
                    before.append(f"int {acc}_nan = 0;")
                    body.append(f"{acc}_nan |= ({x} != {x});")
                    value = f"({acc}_nan ? std::numeric_limits<{CTYPE[r.acc_dtype]}>::quiet_NaN() : {value})"
                if r.round_to is not None:
                    value = f"fusec_round_{'f16' if r.round_to == torch.float16 else 'bf16'}({value})"
                after.append(f"const {CTYPE[r.var.dtype]} {r.var.name} = {value};  // {r.origin}")
            else:
                before.append(f"{CTYPE[r.acc_dtype]} {acc} = {literal(red.init(r.acc_dtype), r.acc_dtype)};")
                body.append(f"{acc} = {red.combine.format(acc=acc, x=x)};")
                value = convert(acc, r.acc_dtype, r.var.dtype)
                if r.round_to is not None:
                    value = f"fusec_round_{'f16' if r.round_to == torch.float16 else 'bf16'}({value})"
                after.append(f"const {CTYPE[r.var.dtype]} {r.var.name} = {value};  // {r.origin}")
            done.add(r.var.name)
        for name in order:
            item = producers[name]
            if name not in done and name not in kernel.varying and not isinstance(item, Reduce) \
                    and kernel.level.get(name, 0) == phase + 1:
                after.append(lines[name])
                done.add(name)
        # Note (long float sums): adding K values one after another into one float loses
        # ~K ulps; eager sums in a cascade and loses ~log K. A long float sum is blocked: each
        # block of ~sqrt(K) values is summed on its own (vectorized), and the block sums are
        # added up in double, so the error grows like sqrt(K) ulps of a block sum.
        blocked = [r for r in reds if r.op == "sum" and r.acc_dtype.is_floating_point]
        kblock = sum_block(kernel.k) if blocked else 0
        block_before, block_after = [], []
        if kblock:
            for r in blocked:
                acc = f"acc_{r.var.name}"
                before.append(f"double {acc}_total = 0.0;")
                block_before.append(f"{CTYPE[r.acc_dtype]} {acc}_blk = {literal(0, r.acc_dtype)};")
                block_after.append(f"{acc}_total += {acc}_blk;")
                after.insert(0, f"{acc} = static_cast<{CTYPE[r.acc_dtype]}>({acc}_total);")
                body = [b.replace(f"{acc} = {acc} + ", f"{acc}_blk = {acc}_blk + ") for b in body]
        pragma = ""
        if lanes:  # vectorized across the lanes instead: the k loop runs inside each lane
            pragma = f"#pragma GCC unroll {LANES_UNROLL_K}" if kernel.k <= LANES_UNROLL_K else ""
        elif maxmin:
            clauses = [f"reduction({'max' if r.op == 'amax' else 'min'}:acc_{r.var.name})"
                       for r in reds]
            flags = [f"acc_{r.var.name}_nan" for r in reds if r.acc_dtype.is_floating_point]
            clauses += [f"reduction(|:{', '.join(flags)})"] if flags else []
            pragma = "#pragma omp simd " + " ".join(clauses)
        if simd and reds and not lanes:
            op = "+" if ops.REDUCTIONS[reds[0].op].name == "sum" else "*"
            if all(ops.REDUCTIONS[r.op].name == ops.REDUCTIONS[reds[0].op].name for r in reds):
                names = ["acc_" + r.var.name + ("_blk" if r in blocked and kblock else "") for r in reds]
                pragma = f"#pragma omp simd reduction({op}:{', '.join(names)})"
        sections.append({"comment": f"phase {phase}: " + ", ".join(r.op for r in reds),
                         "before": before, "pragma": pragma, "body": body, "after": after,
                         "kblock": kblock, "block_before": block_before,
                         "block_after": block_after})

    elem_stores, row_stores = [], []
    for n, s in enumerate(kernel.stores):
        if stash == (s.var.name, n):
            continue  # already there: the last phase stored it
        text = f"{target(n)} = {_store_value(s.var, s.dtype)};"
        (elem_stores if s.var.name in kernel.varying else row_stores).append(text)
    if elem_stores:  # (none left when the last phase stored the only element output)
        given = {}
        if stash:
            name = stash[0]
            given[name] = f"const {CTYPE[producers[name].var.dtype]} {name} = {target(stash[1])};"
        body = list(k_coords) + closure({s.var.name for s in kernel.stores
                                         if s.var.name in kernel.varying}, given) + elem_stores
        comment = "last pass: element values, stored"
        if stash:
            comment += f" ({stash[0]} read back from where the last phase kept it)"
        sections.append({"comment": comment, "before": [],
                         "pragma": f"#pragma GCC unroll {LANES_UNROLL_K}" if lanes else "#pragma omp simd", "body": body, "after": [], "kblock": 0,
                         "block_before": [], "block_after": []})
    return render_template(
        "cpp_reduction.cpp.j2", name=kernel.name, summary=summary(kernel),
        source_shape=kernel.source_shape, reduce_dims=kernel.reduce_dims, rows=kernel.rows,
        k=kernel.k, parallel=f"ROWS > 1 && ROWS * K >= {PARALLEL_THRESHOLD}", lanes=lanes,
        last=kernel.row_shape[-1] if kernel.row_shape else 1,
        params=[f"{'' if p.is_output else 'const '}{CTYPE[p.dtype]}* __restrict__ {p.name}_ptr"
                for p in kernel.params],
        row_lines=row_lines, sections=sections, row_stores=row_stores + scatters)


# Note (keeping an element value in the output): the last pass recomputes the element values
# from the inputs, so softmax's last pass would compute exp(x - max) a second time. When the last
# reduction phase already computes a value that the stores need, and computing it again would
# take a costly op (exp, log, tanh ... anything beyond + - * and compares), that phase also
# writes it into the output row, where the last pass reads it back and overwrites it with the
# result: softmax's last pass becomes out[k] = out[k] / sum. The output must hold the value
# exactly (same dtype as the register, so not a float16 output) and be written by this one
# store at distinct places (no broadcast, no input read from it), and the row must stay in
# cache between the two passes. CPU softmax 512x512 on 2 cores: 0.114 -> 0.085 ms.

CHEAP_OPS = {"add", "add_alpha", "sub", "sub_alpha", "mul", "neg", "abs", "to", "copy", "full",
             "where", "maximum", "minimum", "relu", "eq", "ne", "lt", "le", "gt", "ge",
             "logical_not", "logical_and", "logical_or", "logical_xor", "bitwise_not",
             "bitwise_and", "bitwise_or", "bitwise_xor", "lshift", "rshift"}
STASH_MAX_ROW_BYTES = 1 << 20  # 1 MiB: a row that stays in a core's L2 cache; a longer one
# would cost an extra trip to memory (written, read back, written again) to save the op


def stash_choice(kernel) -> tuple[str, int] | None:
    """(value, store number) to keep in the output between the last phase and the last pass, or
    None (see the note above): the value whose reading back saves the most costly ops."""
    from fusec.ir import Reduce
    if not kernel.phases:
        return None
    producers = {item.var.name: item for item in kernel.body}
    order = [item.var.name for item in kernel.body]

    def needed(targets, given=()) -> set[str]:
        return set(kernel.values_needed(targets, given))

    def costly(names) -> int:
        return sum(1 for n in names if isinstance(producers.get(n), Stmt)
                   and producers[n].op not in CHEAP_OPS)

    params = [s.param for s in kernel.stores]
    elems = {s.var.name for s in kernel.stores if s.var.name in kernel.varying}
    outs = [n for n, s in enumerate(kernel.stores)  # where a value can wait: see the note above
            if s.var.name in kernel.varying and params.count(s.param) == 1 and all(s.index.strides)
            and all(l.param != s.param for l in kernel.loads)
            and kernel.k * s.dtype.itemsize <= STASH_MAX_ROW_BYTES]
    computed = needed({r.operand.name for r in kernel.body
                       if isinstance(r, Reduce) and r.phase == kernel.phases - 1})
    recomputed = needed(elems)
    best, gain = None, 0
    for name in order:
        if name not in computed or name not in recomputed or not isinstance(producers[name], Stmt):
            continue
        saved = costly(recomputed) - costly(needed(elems, {name}) - {name})
        fits = [n for n in outs if kernel.stores[n].dtype == producers[name].var.dtype]
        if fits and saved > gain:
            best, gain = (name, fits[0]), saved
    return best


SUM_BLOCK_MIN = 256


# Note (lanes of rows): a reduction across a strided axis (softmax or a minimum over the channels
# of NCHW: K values H*W apart, for every one of N*H*W rows) has short rows lying side by side:
# row r+1's values sit right next to row r's. Vectorizing along a row gathers; vectorizing across
# rows does not: LANES neighbouring rows are computed together, one per SIMD lane, and each k step
# loads LANES contiguous values. gcc vectorizes such an outer loop (`omp simd` on the row loop)
# when the row runs a single inner k loop (one-phase kernels without a last pass: amax/amin/sum/
# mean over channels, with any pointwise prologue and row epilogue), or when its k loops are short
# enough (K <= LANES_UNROLL_K) to be unrolled away (softmax over 16 channels); other rows use the
# row copies of the note "rows reduced across a strided axis".
LANES = 16
LANES_UNROLL_K = 16  # rows this short are unrolled completely, so several k loops are fine


def lane_blocks(kernel, k_strided) -> int:
    """LANES when the kernel computes LANES neighbouring rows at once (note above), else 0."""
    from fusec.ir import Reduce
    if not kernel.row_shape or kernel.row_shape[-1] < 8 or not kernel.k:
        return 0
    several = kernel.phases != 1 or any(s.var.name in kernel.varying for s in kernel.stores)
    if several and kernel.k > LANES_UNROLL_K:
        return 0  # several k loops (phases, a last pass) that gcc cannot unroll away
    reds = [i for i in kernel.body if isinstance(i, Reduce)]
    if several and any(not isinstance(i, Reduce) and i.var.name not in kernel.varying
                       and 0 < kernel.level.get(i.var.name, 0) < kernel.phases for i in kernel.body):
        return 0  # row math between phases (logsumexp's guard on the max): gcc keeps it a branch
    if any(ops.REDUCTIONS[r.op].returns_index for r in reds):
        return 0
    if any(r.op == "sum" and r.acc_dtype.is_floating_point for r in reds) and sum_block(kernel.k):
        return 0  # blocked sums: two nested loops
    n_rows = len(kernel.row_shape)
    accesses = [l.index for l in kernel.loads] + [s.index for s in kernel.stores]
    if any(idx.strides[n_rows - 1] not in (0, 1) for idx in accesses):
        return 0
    if not any(k_strided(l.index) and l.index.strides[n_rows - 1] == 1 for l in kernel.loads):
        return 0
    return LANES


def sum_block(k: int) -> int:
    """Block length for a float sum over k values (0: no blocking): about sqrt(k), so the
    values summed in a row, per block and across blocks, both stay near sqrt(k)."""
    if k <= SUM_BLOCK_MIN:
        return 0
    return max(SUM_BLOCK_MIN, 1 << math.isqrt(k - 1).bit_length())


def flat_k(strides, shape) -> bool:
    """Whether an access walks the k dims as one flat run: each dim's stride is the next one's
    times its size (then the address is k times the last stride)."""
    return strides[-1] != 0 and all(strides[d] == strides[d + 1] * shape[d + 1]
                                    for d in range(len(shape) - 1))


def _coords(prefix: str, var: str, shape) -> list[str]:
    """Row-major coordinates of the flat position `var` over `shape`.

    Positions are never negative, and saying so (dividing as uint64_t) matters inside a
    vectorized loop: a signed k / 1024 must round toward zero for negative k, so gcc emits a
    division sequence and cannot see that q0 * 1024 + q1 is k again; unsigned, it is a shift and
    a mask, and a contiguous load stays contiguous (group norm's rows: 4x faster)."""
    out = []
    for d in range(len(shape)):
        below = math.prod(shape[d + 1:])
        expr = var if below == 1 else f"(uint64_t){var} / {below}u"
        if d:
            expr = f"({expr}) % {shape[d]}u" if below != 1 else f"(uint64_t){var} % {shape[d]}u"
        out.append(f"const int64_t {prefix}{d} = {expr};")
    return out

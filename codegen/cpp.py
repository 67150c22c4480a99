"""C++/OpenMP backend: PointwiseKernel -> C++ source -> shared library -> ctypes function.

The kernel is one `extern "C"` function taking a pointer per buffer. Sizes, strides and offsets
are compile-time constants (fusec compiles one schedule per input signature), which lets gcc
unroll and vectorize freely. Half-precision values are converted to float on load and rounded
back on store; integer arithmetic wraps as PyTorch's does (`-fwrapv`).

Building shells out to the system C++ compiler (`$CXX`, else g++, c++ or clang++):

    g++ -O3 -march=native -fopenmp -fwrapv -ffp-contract=off -shared -fPIC kernel.cpp -o kernel.so

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

FLAGS = ["-O3", "-march=native", "-fopenmp", "-fwrapv", "-ffp-contract=off", "-std=c++17",
         "-shared", "-fPIC"]
TEMPLATES = Path(__file__).parent / "templates"
PARALLEL_THRESHOLD = 1 << 15  # below this many elements, threads cost more than they save
CHUNK = 8192

CTYPE = {
    torch.float16: "_Float16", torch.bfloat16: "uint16_t", torch.float32: "float",
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
            "Install it, point CXX at a compiler, or use backend='triton'.")
    for name in ("g++", "c++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    raise CompilerNotFoundError(
        "fusec: the C++ backend needs a C++ compiler and none was found (tried $CXX, g++, c++, "
        "clang++). Install g++ (e.g. `apt-get install g++`), set CXX, or use backend='triton'.")


@functools.lru_cache(maxsize=None)
def compiler_id(path: str) -> str:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else path
    except (OSError, subprocess.SubprocessError):
        return path


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
        return f"(float){ptr_expr}"
    if storage == torch.bfloat16:
        return f"fusec_bf16_to_f32({ptr_expr})"
    return ptr_expr


def _store_value(var: Var, storage: torch.dtype) -> str:
    if storage == torch.float16:
        return f"(_Float16){var.name}"
    if storage == torch.bfloat16:
        return f"fusec_f32_to_bf16({var.name})"
    return convert(var.name, var.dtype, storage)


def render(kernel: PointwiseKernel) -> str:
    shape = kernel.shape
    rows = math.prod(shape[:-1])
    inner = shape[-1]
    chunk = inner if rows >= 64 or inner <= CHUNK else CHUNK
    outer_dims = len(shape) - 1

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
    for load in kernel.loads:
        ptr = f"{load.param}_ptr[{index(load.index, load.var.name)}]"
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
        chunk=max(chunk, 1), parallel=f"ROWS * INNER >= {PARALLEL_THRESHOLD}",
        params=params, row_setup=row_setup, body=body)


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
    key = cache.content_hash(source, prelude(), compiler_id(compiler), " ".join(FLAGS), host_cpu())
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
    cmd = [compiler, *FLAGS, f"-I{TEMPLATES}", str(src), "-o", str(tmp)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise CompileError(f"fusec: {os.path.basename(compiler)} failed to compile kernel {name} "
                           f"({src}):\n{result.stderr[-4000:]}")
    os.replace(tmp, lib)
    cache.write_manifest(lib)
    cache.STATS["compiles"] += 1
    cache.log(f"compiled {lib.name}")
    return lib


class CppLauncher:
    """Calls the compiled kernel with the data pointers of its tensors (inputs, then outputs)."""

    def __init__(self, lib: Path, name: str, n_params: int):
        self.fn = getattr(ctypes.CDLL(str(lib)), name)
        self.fn.argtypes = [ctypes.c_void_p] * n_params
        self.fn.restype = None

    def __call__(self, *tensors: torch.Tensor) -> None:
        self.fn(*[t.data_ptr() for t in tensors])


def load(kernel: PointwiseKernel, source: str) -> CppLauncher:
    return CppLauncher(build(source, kernel.name), kernel.name, len(kernel.params))

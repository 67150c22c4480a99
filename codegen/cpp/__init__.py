"""C++/OpenMP backend: PointwiseKernel -> C++ source -> shared library -> ctypes function.

The kernel is one `extern "C"` function taking a pointer per buffer. Sizes, strides and offsets
are compile-time constants (fusec compiles one schedule per input signature), which lets gcc
unroll and vectorize freely; a shape family's kernel takes its symbolic sizes as `int64_t`
arguments after the pointers (cpp/text.py, Note: sizes as arguments in C++). Half-precision
values are converted to float on load and rounded back on store; integer arithmetic wraps as
PyTorch's does (`-fwrapv`).

Building shells out to the system C++ compiler (`$CXX`, else g++, c++ or clang++):

    g++ -O3 -march=native -fopenmp -fwrapv -ffp-contract=off -fno-math-errno -shared -fPIC kernel.cpp -o kernel.so

and the library is cached on disk by the hash of its source and the compiler command
(fusec/cache.py), so a second process loads it without compiling. The prelude every kernel
includes is compiled once into a precompiled header (cpp/precompiled.py): gcc then parses only
the kernel itself.

This file holds the compiler (discovery, flags, building, loading, launching) and `render`, which
picks a renderer: cpp/pointwise.py renders pointwise loops, cpp/reduction.py reductions,
cpp/text.py spells the IR in C++, cpu_plan.py holds the decisions the LLVM backend makes the same
way. A kernel is compiled to an object, then linked: against torch's library only when it calls
torch's SLEEF (`TORCH_LINK`).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform
import shutil
from pathlib import Path

import torch

from fusec import cache
from fusec.errors import CompileError, CompilerNotFoundError
from fusec.ir import PointwiseKernel

from .. import elf, families, tools
from ..elf import undefined_symbols
from . import precompiled, read_order
from .pointwise import render_pointwise, render_short_rows
from .reduction import render_reduction
from .text import TEMPLATES, host_cpu, kernel_sizes, prelude, with_size_helpers
from ..cpu_plan import short_rows, sleef_symbols_in
from ..render import no_indexed_writes

# -fno-math-errno: fusec never reads errno, and a math call that may set it is a store gcc cannot
# move or vectorize: with it, a loop with a select around exp/log1p (softplus, mish) stays scalar
# (libm, one element per call); without it, gcc calls libmvec's 8-wide versions. Results are the
# same functions' results; only the errno side effect is dropped.
# -fno-thread-jumps: jump threading copies the rest of a loop body once per outcome of a branch
# whose condition it can predict from an earlier one. `gelu(leaky_relu(relu(x)))` tests x < 0 in
# relu and relu > 0 in leaky_relu; threaded, the body held two gelus, and once vectorized (both
# sides of a select are computed) every element paid two exps: 2x eager's time for that chain
# (KernelBench-style 23_ at 0.81x eager on one core). Vectorized loops have no branches to gain.
# -fno-trapping-math: fusec never reads the floating-point exception flags, and an add or a
# divide that may raise one is a side effect gcc keeps inside a branch: `c ? a / b : d` stays a
# branch, and a loop with a branch is not vectorized (the prelude's tanh ran 20x slower). Results
# are unchanged (clang's default is the same).
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fwrapv", "-ffp-contract=off", "-fno-math-errno",
         "-fno-trapping-math", "-fno-thread-jumps", "-std=c++17", "-shared", "-fPIC"]


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
    """The first line of `path --version` (part of every library's cache key), or the path
    itself when the compiler does not answer in time (codegen/tools.py kills it then)."""
    try:
        out = tools.run([path, "--version"], "printing its version", min(30, tools.timeout()))
        return out.stdout.splitlines()[0] if out.stdout else path
    except CompileError:
        return path


@functools.lru_cache(maxsize=None)
def vector_flags() -> list[str]:
    """Vectors as wide as eager's own kernels use. On Intel's AVX-512 server CPUs gcc's
    -march=native keeps to 256-bit vectors (gcc picks 512 on AMD's Zen 4 by itself), while torch
    runs its AVX512 kernels there. So where torch reports the AVX512 capability (it respects
    ATEN_CPU_CAPABILITY), fusec asks for 512-bit vectors too: sin x 4 on one thread of the GPU
    machine's Xeon took 2.65 ms with it and 2.79 without (benchmarks/diagnostics/cpu_threads.py)."""
    if platform.machine() not in ("x86_64", "AMD64") or \
            torch.backends.cpu.get_cpu_capability() != "AVX512":
        return []
    return ["-mprefer-vector-width=512"]


@functools.lru_cache(maxsize=None)
def math_flags() -> list[str]:
    """Link glibc's vector math library where it exists, and torch's own SLEEF (eager's float32
    vector math, exported by libtorch_cpu) where torch has it (see cpp_prelude.h), else nothing."""
    flags = ["-DFUSEC_LIBMVEC", "-lmvec", "-lm"] if ctypes.util.find_library("mvec") else []
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    if sleef_symbols_in(os.path.join(torch_lib, "libtorch_cpu.so")):
        flags += ["-DFUSEC_SLEEF", *TORCH_LINK]
    return flags


def _torch_link() -> list[str]:
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    return [f"-L{torch_lib}", "-Wl,--push-state,--no-as-needed", "-ltorch_cpu", "-Wl,--pop-state",
            f"-Wl,-rpath,{torch_lib}"]


# How a kernel that calls torch's SLEEF links libtorch_cpu. Only such a kernel does (`build`
# compiles, then reads the object's undefined symbols, then links): reading libtorch_cpu's
# symbols cost the linker 0.5 s per kernel on this project's 2-core AMD EPYC, more than
# compiling a small kernel with the precompiled prelude.
TORCH_LINK = _torch_link()


def _links(flag: str) -> bool:
    """A flag only the link step reads."""
    return flag == "-shared" or flag.startswith(("-l", "-L", "-Wl,"))


def available() -> bool:
    try:
        find_compiler()
        return True
    except CompilerNotFoundError:
        return False


def render(kernel) -> str:
    """The kernel's C++ source: a kernel family's, if one takes it (codegen/families.py), else a
    reduction (cpp/reduction.py) or a pointwise loop."""
    # (kernel families spell sizes as numbers: a shape family's kernel takes the general path)
    special, notes = (None, []) if kernel_sizes(kernel) else families.special(kernel, "cpp")
    if special is not None:
        return special
    if not isinstance(kernel, PointwiseKernel):
        return with_size_helpers(render_reduction(kernel, notes))
    no_indexed_writes(kernel, "C++")
    kernel = read_order.read_order(kernel)  # a transposed read of a few channels: along the read
    tile_rows = short_rows(kernel)
    text = render_short_rows(kernel, tile_rows) if tile_rows else render_pointwise(kernel)
    return with_size_helpers(text)


# ---- building and loading ----------------------------------------------------------------------

def build(source: str, name: str) -> Path:
    """Compile `source` into a shared library (or reuse the cached one). Returns its path."""
    compiler = find_compiler()
    flags = FLAGS + vector_flags() + math_flags()
    options = (compiler_id(compiler), " ".join(flags), host_cpu())
    key = cache.content_hash(source, prelude(), *options)
    lib = cache.cache_dir("cpp") / f"{name}-{key}.so"
    src = lib.with_suffix(".cpp")

    def make(tmp: Path) -> None:
        # compile (with the prelude precompiled once, cpp/precompiled.py), then link: torch's
        # library only where the kernel calls its SLEEF (TORCH_LINK)
        code = [f for f in flags if not _links(f)]
        includes = precompiled.include_flags(compiler, options[0], code,
                                             cache.content_hash(*options), prelude(), TEMPLATES)
        obj = Path(f"{tmp}.o")
        try:
            _run(compiler, [*code, *includes, "-c", str(tmp.parent / src.name), "-o", str(obj)],
                 name, src)
            calls_sleef = any("Sleef" in s for s in undefined_symbols(obj.read_bytes()))
            links = [f for f in flags if _links(f) and (calls_sleef or f not in TORCH_LINK)]
            _run(compiler, ["-fopenmp", str(obj), "-o", str(tmp), *links], name, src)
        finally:
            obj.unlink(missing_ok=True)
    return cache.build_once(lib, source, ".cpp", make)


def _run(compiler: str, args: list[str], name: str, src: Path) -> None:
    result = tools.run([compiler, *args], f"compiling kernel {name} ({src})")  # (time limit)
    if result.returncode != 0:
        raise CompileError(f"fusec: {os.path.basename(compiler)} failed to compile kernel "
                           f"{name} ({src}), exit status {result.returncode}:\n"
                           f"{(result.stderr.strip() or result.stdout)[-4000:]}")


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
    result = tools.run(cmd, f"compiling {name} for {' '.join(arch)}")
    if result.returncode != 0:
        raise CompileError(f"fusec: {os.path.basename(cmd[0])} {' '.join(arch)} failed to compile "
                           f"{name} ({src}):\n{result.stderr[-4000:]}")


def _load_library(lib: Path) -> ctypes.CDLL:
    """dlopen a kernel library. The first one also loads the system's OpenMP runtime, which is
    not the one inside torch's wheel: two thread pools then share the cores, and a pool whose
    idle threads spin after a parallel loop starves the other (measured on 2 cores: a small MLP
    call went from 0.1 ms to 2 ms). Unless the user chose a wait policy, our threads sleep at
    once when idle (libgomp reads GOMP_SPINCOUNT when it loads).

    The file is checked first (codegen/elf.py): dlopen maps a library cut short past its end,
    and the first touch of the missing pages is SIGBUS. A library that fails the check or that
    dlopen refuses is a CompileError: fusec/runtime/build.py deletes it and builds it again."""
    try:
        with open(lib, "rb") as f:
            wrong = elf.problem(f.read(), "shared")
    except OSError as err:
        wrong = f"cannot be read ({err.strerror})"
    if wrong:
        raise CompileError(f"fusec: {lib} is not a loadable shared library: {wrong}")
    chosen = "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ
    if not chosen:
        os.environ["GOMP_SPINCOUNT"] = "0"
    try:
        return ctypes.CDLL(str(lib))
    except OSError as err:  # ("invalid ELF header", a missing dependency, ...)
        raise CompileError(f"fusec: the loader refused {lib}: {err}") from None
    finally:
        if not chosen:
            del os.environ["GOMP_SPINCOUNT"]


class CppLauncher:
    """Calls the compiled kernel with the data pointers of its tensors (inputs, then outputs).

    The ctypes function is prepared once: its argument types say "one pointer per buffer", so a
    call converts plain ints (`t.data_ptr()`) without building ctypes objects. `pointer_entry` is
    that function itself: the runtime's straight-line program (fusec/runtime/writer.py) calls it
    directly with the data pointers, skipping this class's `__call__` and its list.
    """

    def __init__(self, lib: Path, name: str, n_params: int, n_sizes: int = 0):
        self.lib, self.name, self.n_params = lib, name, n_params  # for the printed wrapper
        self.n_sizes = n_sizes  # int64 size arguments after the pointers (fusec/symbolic.py)
        try:
            self.fn = getattr(_load_library(lib), name)
        except AttributeError:
            raise CompileError(f"fusec: kernel {name} is missing from {lib}") from None
        self.fn.argtypes = [ctypes.c_void_p] * n_params + [ctypes.c_int64] * n_sizes
        self.fn.restype = None
        self.pointer_entry = self.fn  # fn(*data_ptrs): what a prepared call site uses

    def __call__(self, *args) -> None:  # its tensors, then its sizes (ints)
        self.fn(*[a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args])


def launcher(lib: Path, name: str, n_params: int, n_sizes: int = 0) -> CppLauncher:
    """Load a built library (fusec/runtime/build.py builds first, several at a time, then loads)."""
    return CppLauncher(lib, name, n_params, n_sizes)


def load(kernel: PointwiseKernel, source: str) -> CppLauncher:
    return launcher(build(source, kernel.name), kernel.name, len(kernel.params), len(kernel_sizes(kernel)))

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
pointwise kernel, rows for a reduction (blocks of rows for one turned inside out). LlvmLauncher cuts the work into one range per core and
runs them on a thread pool; ctypes releases the GIL while the machine code runs, so the threads
really run in parallel, like the OpenMP loops of the C++ backend.

The backend in five files: llvm/ir.py writes instructions, llvm/reduction.py renders reductions,
llvm/columns.py those whose rows lie side by side (the loops turned inside out), llvm/jit.py
drives llvmlite (optimize, compile, cache), and this file renders pointwise kernels, loads object
files and launches them.
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from fusec.errors import CompileError
from fusec.ir import Index, PointwiseKernel

from .. import elf
from ..cpu_plan import CHUNK, column_blocks, heading, thread_choice
from .compiler import Target, host  # noqa: F401 (host: llvm.host(), this CPU)
from .ir import (TYPE, Emitter, new_counter, finish, kernel_params, coords, emit_load, emit_stmt, gather_row,
                      emit_store, index_sum, literal)
from .ir import vector_isa, vector_isas  # noqa: F401 (the backend's views, read as llvm.X)
from .jit import (assembly, available, build, check_symbols, llvm_binding,  # noqa: F401
                       object_code, optimized_ir, target_machine, triple_and_layout)
from .columns import render_columns
from .reduction import render_reduction
from ..unroll_rows import unrolled_or_same
from ..render import no_indexed_writes, render_template

# ---- pointwise kernels -------------------------------------------------------------------------

def render(kernel, target: Target | None = None) -> str:
    """The kernel as LLVM IR text. `target` (default: this CPU) only decides which libmvec
    vector functions the IR declares; the rest is the same for every CPU."""
    if not isinstance(kernel, PointwiseKernel):
        # rows side by side, their values far apart: the loops turned inside out (llvm/columns.py)
        unrolled, note = unrolled_or_same(kernel)
        columns = column_blocks(unrolled)
        if columns:
            return render_columns(unrolled, columns, note, target)
        return render_reduction(kernel, target)
    no_indexed_writes(kernel, "LLVM")
    counter = new_counter()
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

    dtypes = {l.var.name: l.var.dtype for l in kernel.loads}
    for load in kernel.loads:
        at = index(load.index, load.var.name)
        if load.gather is not None:  # a gathered read: the row its index value names
            row = gather_row(body, load, dtypes[load.gather[0]], values)
            at = body.emit(f"add nsw i64 {at}, {row}", load.var.name + ".at")
        if load.valid is None:
            emit_load(body, load.param, load.dtype, at, load.var, values)
        else:
            emit_piece(body, load, at, c[load.valid[0]] if load.valid[0] < len(c) else "%i",
                       values)
    for s in kernel.stmts:
        emit_stmt(body, s, values)
    for n, store in enumerate(kernel.stores):
        emit_store(body, store.param, store.dtype, index(store.index, f"out{n}"), store.var, values)
    return finish("llvm_pointwise.ll.j2", setup.lines + body.lines, target, name=kernel.name,
                   summary=heading(kernel), source_shape=kernel.source_shape, numel=kernel.numel,
                   rows=rows, inner=inner, chunk=chunk, chunks=chunks,
                   items=rows * chunks if kernel.numel else 0,
                   parallel=str(thread_choice(kernel)[0] and rows * chunks > 1).lower(),
                   params=kernel_params(kernel), row_setup=setup.lines, body=body.lines)



def emit_piece(e: Emitter, load, at: str, coord: str, values: dict[str, str]) -> None:
    """A piece of a cat (fusec.ir.Load.valid): read where `coord` is inside the piece's range,
    else take the next piece's value. Outside its range the piece's address may lie before or
    after its buffer, so the load reads element 0 there instead (always there), and a select
    drops it: a load that cannot fault, which the vectorizer can still widen."""
    _, lo, hi = load.valid
    name = load.var.name
    inside = e.emit(f"icmp slt i64 {coord}, {hi}", name + ".in")  # (the last piece: always)
    if lo:
        above = e.emit(f"icmp sge i64 {coord}, {lo}", name + ".in")
        inside = e.emit(f"and i1 {inside}, {above}", name + ".in")
    safe = e.emit(f"select i1 {inside}, i64 {at}, i64 0", name + ".at")
    emit_load(e, load.param, load.dtype, safe, load.var, values)
    kind = TYPE[load.var.dtype]
    other = values[load.other.name] if load.other is not None else literal(0, load.var.dtype)
    values[name] = e.emit(f"select i1 {inside}, {kind} {values[name]}, {kind} {other}", name)


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
_INIT = threading.Lock()


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

    def __init__(self, lib: Path, name: str, n_params: int, n_sizes: int = 0):
        self.lib, self.name, self.n_params = lib, name, n_params  # for the printed wrapper
        self.n_sizes = n_sizes  # int64 size arguments after the pointers (fusec/symbolic.py)
        llvm = llvm_binding()
        tm = target_machine()  # an execution engine owns (and frees) its target machine
        empty = llvm.parse_assembly("")
        empty.triple = triple_and_layout()[0]
        data = lib.read_bytes()  # checked, then linked: these bytes, not the file again
        wrong = elf.problem(data, "relocatable")  # (MCJIT trusts its input: a bad one can crash it)
        if wrong:
            raise CompileError(f"fusec: {lib} is not a loadable object file: {wrong}")
        check_symbols(data, name)
        self.engine = llvm.create_mcjit_compiler(empty, tm)  # keeps the code alive
        try:
            self.engine.add_object_file(llvm.ObjectFileRef.from_data(data))
            self.engine.finalize_object()
        except RuntimeError as err:  # (llvmlite's form of an LLVM error)
            raise CompileError(f"fusec: MCJIT could not load {lib}: {err}") from None
        address = self.engine.get_function_address(name)
        if not address:
            raise CompileError(f"fusec: kernel {name} is missing from {lib}")
        proto = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * n_params, ctypes.c_int64,
                                 ctypes.c_int64)
        self.fn = proto(address)
        self.frame_type = ctypes.c_int64 * (4 + n_params)
        self.address = address
        tiles, parallel = (self.engine.get_global_value_address(f"{name}.{g}")
                           for g in ("tiles", "parallel"))
        if not (tiles and parallel):  # (read at address 0: a crash, not an error)
            raise CompileError(f"fusec: kernel {name}'s globals are missing from {lib}")
        self.work = ctypes.c_int64.from_address(tiles).value
        self.parallel = ctypes.c_bool.from_address(parallel).value

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


def launcher(obj: Path, name: str, n_params: int, n_sizes: int = 0) -> LlvmLauncher:
    """Load a built object file (fusec/runtime/build.py builds first, several at a time, then loads)."""
    return LlvmLauncher(obj, name, n_params, n_sizes)


def load(kernel, source: str) -> LlvmLauncher:
    return launcher(build(source, kernel.name), kernel.name, len(kernel.params))

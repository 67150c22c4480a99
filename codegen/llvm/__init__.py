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
A kernel takes, after its buffers (and its sizes, where they are arguments: see below), a range of
work items `[first, last)`: tiles of rows for a
pointwise kernel, rows for a reduction (blocks of rows for one turned inside out). LlvmLauncher cuts the work into one range per core and
runs them on a thread pool; ctypes releases the GIL while the machine code runs, so the threads
really run in parallel, like the OpenMP loops of the C++ backend.

Sizes as arguments
------------------
A kernel compiled for a shape family (fusec/symbolic.py) takes one `i64` per size that is a
symbol, between its buffers and its range: `(ptr %x_ptr, ptr %out_ptr, i64 %x_size0, i64
%tile_first, i64 %tile_last)`. Its entry block computes the sizes it uses from them once
(`%size.3 = mul nsw i64 %x_size0, 64`, llvm/sizes.py); where the amount of work depends on them,
the kernel exports `@<name>.tiles_for(i64 %x_size0)` in place of the constant `@<name>.tiles` (and
`@<name>.parallel_for` in place of `@<name>.parallel`), which the launcher asks at each launch.

The backend in six files: llvm/ir.py writes instructions, llvm/sizes.py sizes that are symbols,
llvm/reduction.py renders reductions,
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
from ..cpu_plan import (CHUNK, column_blocks, heading, row_values, short_row_lanes, thread_choice,
                        work_per_call)
from .compiler import Target, host  # noqa: F401 (host: llvm.host(), this CPU)
from .ir import (TYPE, Emitter, new_counter, finish, kernel_params, coords, emit_load, emit_stmt, gather_row,
                      emit_store, index_sum, literal)
from .ir import vector_isa, vector_isas  # noqa: F401 (the backend's views, read as llvm.X)
from .jit import (assembly, available, build, check_symbols, llvm_binding,  # noqa: F401
                       object_code, optimized_ir, target_machine, triple_and_layout)
from . import blocks
from .columns import render_columns
from .reduction import render_reduction
from .sizes import hinted, known, launch_functions
from fusec.symbolic import hint, is_symbolic, size_params
from ..unroll_rows import unrolled_or_same
from ..render import no_indexed_writes, render_template

# ---- pointwise kernels -------------------------------------------------------------------------

def render(kernel, target: Target | None = None) -> str:
    """The kernel as LLVM IR text. `target` (default: this CPU) only decides which libmvec
    vector functions the IR declares; the rest is the same for every CPU."""
    if not isinstance(kernel, PointwiseKernel):
        # rows side by side, their values far apart: the loops turned inside out (llvm/columns.py)
        unrolled, note = unrolled_or_same(kernel) if not is_symbolic(kernel.row_shape[:1]) \
            else (kernel, "")  # (M activation rows unrolled: a fixed M, not a shape family's)
        # a layout, which the traced sizes choose; but its loops need k > 0 (a guard if k is
        # a symbol that could be 0)
        columns = column_blocks(hinted(unrolled)) if unrolled.k else 0
        if columns:
            return render_columns(unrolled, columns, note, target)
        # short rows (a pool's window): a few neighbouring rows in the lanes, each folding its
        # K values in turn (Note: short rows in lanes, codegen/cpu_plan.py)
        lanes = short_row_lanes(unrolled) if unrolled.k else 0
        if lanes:
            return render_columns(unrolled, lanes, note, target, short=True)
        return render_reduction(kernel, target)
    no_indexed_writes(kernel, "LLVM")
    counter = new_counter()
    shape = kernel.shape
    rows, inner = math.prod(shape[:-1]), shape[-1]
    # a whole row per tile, or chunks of CHUNK positions: a heuristic (any chunk computes the
    # same), so rows that are a symbol decide by their traced number (llvm/sizes.py); a row
    # whose length is a symbol is cut in chunks, as many as its length at each call asks for
    whole = known(inner) is not None and (hint(rows) >= 64 or inner <= CHUNK)
    chunk = max(inner, 1) if whole else CHUNK
    chunks = 1 if whole else (inner + CHUNK - 1) // CHUNK  # (rounded up; no sign to fix up)
    setup = Emitter(counter)
    c = coords(setup, "%row", shape[:-1], "c") if len(shape) > 1 else []

    def base(idx: Index, label: str) -> str:
        return index_sum(setup, list(zip(c, idx.strides[:-1])), idx.offset, label + ".base")

    body = Emitter(counter)
    values: dict[str, str] = {}

    def index(e: Emitter, idx: Index, label: str, position: str = "%i") -> str:
        b = base(idx, label)
        inner_term = index_sum(e, [(position, idx.strides[-1])], 0, label + ".idx")
        if b == "0":
            return inner_term
        if inner_term == "0":
            return b
        return e.emit(f"add nsw i64 {b}, {inner_term}", label + ".idx")

    dtypes = {l.var.name: l.var.dtype for l in kernel.loads}
    per_row = row_values(kernel)  # computed once per row, in the tile block (Note: values per row)
    if per_row:
        setup.lines.append("; the same at every position of the row: once per row (Note: values per row)")
    cut = blocks.cut_reason(kernel)  # a chain of math calls: a loop per call (llvm/blocks.py)
    for load in kernel.loads:
        if load.var.name in per_row:
            emit_load(setup, load.param, load.dtype, base(load.index, load.var.name), load.var, values)
        elif not cut:  # (blocks read in their own loops)
            emit_read(body, load, index(body, load.index, load.var.name), c, dtypes, values)
    for s in kernel.stmts:
        if s.var.name in per_row or not cut:
            emit_stmt(setup if s.var.name in per_row else body, s, values)
    for n, store in enumerate([] if cut else kernel.stores):
        emit_store(body, store.param, store.dtype, index(body, store.index, f"out{n}"), store.var,
                   values)
    allocas, block_lines = blocks.block_loops(kernel, body, index, per_row, values) if cut \
        else ([], [])
    # (with sizes that are symbols, rows * chunks is 0 exactly when the space is empty: no guard)
    items = rows * chunks if known(kernel.numel) != 0 else 0
    # the sizes the code uses, as operands (a number, or a value the entry block computes)
    code = dict(inner=setup.size(inner), chunk=setup.size(chunk), chunks=setup.size(chunks))
    return finish("llvm_pointwise.ll.j2", setup.lines + body.lines, target, counter,
                   launch_functions(kernel, items, work_per_call(kernel)), name=kernel.name,
                   summary=heading(kernel), source_shape=kernel.source_shape, numel=kernel.numel,
                   rows=rows, inner=inner, chunk=chunk, chunks=chunks, items=items, code=code,
                   parallel=str(thread_choice(kernel)[0] and hint(items) > 1).lower(),
                   params=kernel_params(kernel), row_setup=setup.lines, body=body.lines,
                   cut=cut, allocas=allocas, blocks=block_lines)


def emit_read(e: Emitter, load, at: str, coords: list[str], dtypes: dict, values: dict) -> None:
    """The one loop's read of `load` at element `at`: gathered (the row its index value names),
    a piece of a cat, or plain."""
    if load.gather is not None:
        row = gather_row(e, load, dtypes[load.gather[0]], values)
        at = e.emit(f"add nsw i64 {at}, {row}", load.var.name + ".at")
    if load.valid is None:
        emit_load(e, load.param, load.dtype, at, load.var, values)
    else:
        emit_piece(e, load, at, coords[load.valid[0]] if load.valid[0] < len(coords) else "%i",
                   values)


def emit_piece(e: Emitter, load, at: str, coord: str, values: dict[str, str]) -> None:
    """A piece of a cat (fusec.ir.Load.valid): read where `coord` is inside the piece's range,
    else take the next piece's value. Outside its range the piece's address may lie before or
    after its buffer, so the load reads element 0 there instead (always there), and a select
    drops it: a load that cannot fault, which the vectorizer can still widen."""
    _, lo, hi = load.valid
    name = load.var.name
    inside = e.emit(f"icmp slt i64 {coord}, {e.size(hi)}", name + ".in")  # (the last: always)
    if known(lo) != 0:
        above = e.emit(f"icmp sge i64 {coord}, {e.size(lo)}", name + ".in")
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


def omp_trampoline(n_params: int, n_sizes: int = 0) -> int:
    """The address of the OpenMP body (llvm_parallel.ll.j2) for kernels of n_params pointers
    (and n_sizes size arguments), compiled on first use and kept (with its execution engine) for
    the life of the process."""
    llvm = llvm_binding()  # (takes the lock itself)
    key = (n_params, n_sizes) if n_sizes else n_params
    with _INIT:
        if key not in _TRAMPOLINES:
            name = f"fusec_omp_trampoline_{n_params}" + (f"_{n_sizes}" if n_sizes else "")
            module = llvm.parse_assembly(render_template("llvm_parallel.ll.j2", name=name,
                                                         n=n_params, m=n_sizes))
            module.triple = triple_and_layout()[0]
            module.verify()
            engine = llvm.create_mcjit_compiler(module, target_machine())
            engine.finalize_object()
            _TRAMPOLINES[key] = (engine, engine.get_function_address(name))
        return _TRAMPOLINES[key][1]


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
    """Calls a JIT-compiled kernel: one call over all its work, or split across threads.

    The kernel's C signature is `void name(void *buffers[n_params]..., int64_t sizes[n_sizes]...,
    int64_t first, int64_t last)`: its buffers, then one int64 per size that is a symbol (in
    fusec.symbolic.size_params order; none for a kernel of fixed sizes), then the range of work
    items [first, last) this call computes. The launcher is called the same way without the
    range: `launcher(*tensors, *sizes)`. How much work there is (`work`) and whether threads pay
    off (`parallel`) are constants of the object file, read once; for a kernel whose sizes are
    arguments either may instead be a function of the sizes (`tiles_for`, `parallel_for`:
    llvm/sizes.py launch_functions), asked at each launch.
    """

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
        proto = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * n_params,
                                 *[ctypes.c_int64] * n_sizes, ctypes.c_int64, ctypes.c_int64)
        self.fn = proto(address)
        # the OpenMP trampoline's frame (llvm_parallel.ll.j2): 4 words, the pointers, the sizes
        self.frame_type = ctypes.c_int64 * (4 + n_params + n_sizes)
        self.address = address
        self.work, self.tiles_for = self._answer("tiles", ctypes.c_int64)
        self.parallel, self.parallel_for = self._answer("parallel", ctypes.c_bool)
        self.plans: dict[tuple, tuple[int, bool]] = {}  # sizes -> (work, parallel), asked once

    def _answer(self, what: str, kind) -> tuple:
        """(the constant `@<name>.<what>`, None), or (None, the function `@<name>.<what>_for` of
        the sizes) where the kernel's answer depends on them (see the class docstring)."""
        if self.n_sizes:
            function = self.engine.get_function_address(f"{self.name}.{what}_for")
            if function:
                return None, ctypes.CFUNCTYPE(kind, *[ctypes.c_int64] * self.n_sizes)(function)
        at = self.engine.get_global_value_address(f"{self.name}.{what}")
        if not at:  # (read at address 0: a crash, not an error)
            raise CompileError(f"fusec: kernel {self.name}'s {what} is missing from {self.lib}")
        return kind.from_address(at).value, None

    def plan(self, sizes: tuple) -> tuple[int, bool]:
        """(how much work, whether threads pay off) at these sizes: the kernel's functions of its
        sizes, asked once per distinct sizes (a served model sees the same few sizes again and
        again, and a ctypes call costs half a microsecond) and remembered, a few thousand at most."""
        work = self.work if self.tiles_for is None else self.tiles_for(*sizes)
        parallel = self.parallel if self.parallel_for is None else self.parallel_for(*sizes)
        if len(self.plans) >= 4096:
            self.plans.clear()
        self.plans[sizes] = work, parallel
        return work, parallel

    def parts(self, work: int | None = None, parallel: bool | None = None) -> int:
        """How many threads this launch uses: torch's intra-op thread count (torch.set_num_threads
        applies, as it does to the C++ backend's OpenMP), at most one per unit of work. (`work`
        and `parallel`: this launch's, for a kernel whose sizes are arguments.)"""
        work = self.work if work is None else work
        parallel = self.parallel if parallel is None else parallel
        return min(torch.get_num_threads(), work) if parallel else 1

    def __call__(self, *args) -> None:
        """Run the kernel over all its work: `args` are its tensors, then its sizes (ints)."""
        if self.n_sizes:
            sizes, args = args[self.n_params:], args[:self.n_params]
            plan = self.plans.get(sizes)
            if plan is None:
                plan = self.plan(sizes)
            parts = self.parts(*plan)
            work = plan[0]
        else:
            sizes, work, parts = (), self.work, self.parts()
        ptrs = [t.data_ptr() for t in args]
        if parts <= 1:
            self.fn(*ptrs, *sizes, 0, work)
            return
        gomp = gomp_parallel()
        if gomp is not None:
            frame = self.frame_type(0, parts, work, self.address, *ptrs, *sizes)
            gomp(omp_trampoline(self.n_params, self.n_sizes), ctypes.addressof(frame), parts, 0)
            return
        step = -(-work // parts)
        ranges = [(lo, min(lo + step, work)) for lo in range(0, work, step)]
        futures = [_pool().submit(self.fn, *ptrs, *sizes, lo, hi) for lo, hi in ranges[1:]]
        self.fn(*ptrs, *sizes, *ranges[0])  # this thread takes the first range itself
        for f in futures:
            f.result()


def launcher(obj: Path, name: str, n_params: int, n_sizes: int = 0) -> LlvmLauncher:
    """Load a built object file (fusec/runtime/build.py builds first, several at a time, then loads)."""
    return LlvmLauncher(obj, name, n_params, n_sizes)


def load(kernel, source: str) -> LlvmLauncher:
    return launcher(build(source, kernel.name), kernel.name, len(kernel.params),
                    len(size_params(kernel)))

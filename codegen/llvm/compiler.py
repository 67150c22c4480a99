"""Driving llvmlite: which CPU to generate code for, and a compiler process that may crash alone.

codegen/llvm/__init__.py writes a kernel as LLVM IR text. This module turns that text into machine code:

    IR text ──parse, verify──> module ──O3 (loop + SLP vectorizers)──> optimized module
            ──target machine (triple, CPU, features)──> object code (ELF bytes)

Two things make this more delicate than calling llvmlite directly.

Targets. The code generator is told which CPU to write for: by default this one (`host()`),
with every feature it has. A kernel must be acceptable to the code generator of *every* CPU a
user may have, and LLVM answers an IR construct it cannot lower on some target (say, the
`bfloat` type with AVX-512 BF16 in LLVM 15-22) with an assertion that aborts the whole process.
`NAMED_TARGETS` lists the CPU families the tests compile every kernel for, from baseline x86-64
to Sapphire Rapids and AArch64, whatever machine the tests happen to run on.

A guarded compiler. An aborting code generator must not take the user's program (and their
data) down with it. So fusec never runs LLVM's optimizer or code generator in the user's
process: it keeps helper processes (this file, run as `python llvm/compiler.py --worker`; it
imports llvmlite and nothing else, so it starts in a fraction of a second), one per kernel it
builds at once (`WorkerPool`), and sends one the IR; the helper sends the object code back. If
the helper dies, `compile_ir` raises `WorkerDied` with the signal and the end of what LLVM
printed, a fresh helper starts for the next kernel, and fusec falls back to another backend
(fusec/runtime/build.py). Loading the object (MCJIT linking) is cheap
and stays in the user's process; `elf.undefined_symbols` lets llvm/__init__.py check, before loading, that
every function the machine code calls exists in this process: a missing one would otherwise be
linked as address 0 and crash on the first call.

This file must import nothing from fusec and nothing heavy (no torch): it is also the worker.
"""
from __future__ import annotations

import atexit
import ctypes.util
import functools
import os
import pickle
import platform
import select
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import astuple, dataclass


@dataclass(frozen=True)
class Target:
    """What the code generator writes for: an LLVM triple, a CPU name and extra features, and the
    libmvec vector variants ((ISA letter, floats per call), widest first) kernels may call."""

    name: str
    triple: str
    cpu: str
    features: str = ""
    vector_isas: tuple = ()

    def __str__(self) -> str:
        return f"{self.name} ({self.triple}, cpu={self.cpu})"


# libmvec's x86 variants: 'b' SSE (4 floats), 'd' AVX2 (8), 'e' AVX-512 (16).
_SSE, _AVX2, _AVX512 = (("b", 4),), (("d", 8), ("b", 4)), (("e", 16), ("d", 8), ("b", 4))
X86 = "x86_64-unknown-linux-gnu"

# The CPU families every kernel is compiled for in tests/test_targets.py.
NAMED_TARGETS = {
    "x86-64": Target("x86-64", X86, "x86-64", "", _SSE),  # the baseline every x86-64 CPU runs
    "haswell": Target("haswell", X86, "haswell", "", _AVX2),  # AVX2 + FMA
    "skylake-avx512": Target("skylake-avx512", X86, "skylake-avx512", "", _AVX512),  # no BF16
    "sapphirerapids": Target("sapphirerapids", X86, "sapphirerapids", "", _AVX512),  # BF16, FP16
    "znver4": Target("znver4", X86, "znver4", "", _AVX512),  # AMD Zen 4: AVX-512 with BF16
    "aarch64": Target("aarch64", "aarch64-unknown-linux-gnu", "neoverse-n1", "", ()),
}


# ---- llvmlite, initialized once ------------------------------------------------------------------

_INIT = threading.Lock()


@functools.lru_cache(maxsize=None)
def binding():
    """llvmlite.binding with every target llvmlite was built with (the host's, and the others
    that cross-target compiles need), and libmvec loaded so JIT-linked code can call it."""
    import llvmlite.binding as llvm  # lazy: LLVM loads only when a kernel is compiled or loaded
    with _INIT:
        try:
            llvm.initialize()
        except RuntimeError:  # newer llvmlite initializes itself and refuses the call
            pass
        llvm.initialize_all_targets()
        llvm.initialize_all_asmprinters()
        lib = ctypes.util.find_library("mvec")
        if lib:
            llvm.load_library_permanently(lib)
    return llvm


@functools.lru_cache(maxsize=None)
def host() -> Target:
    """This machine's CPU, with all its features."""
    llvm = binding()
    features = llvm.get_host_cpu_features()
    if platform.machine() in ("x86_64", "AMD64") and ctypes.util.find_library("mvec"):
        isas = _AVX512 if features.get("avx512f") else _AVX2 if features.get("avx2") else _SSE
    else:
        isas = ()
    return Target("host", llvm.get_process_triple(), llvm.get_host_cpu_name(),
                  features.flatten(), isas)


def available_targets() -> dict[str, Target]:
    """NAMED_TARGETS whose LLVM backend this llvmlite build contains."""
    llvm = binding()
    out = {}
    for name, t in NAMED_TARGETS.items():
        try:
            llvm.Target.from_triple(t.triple)
        except RuntimeError:
            continue
        out[name] = t
    return out


def target_machine(target: Target):
    """A new LLVM target machine for `target` at O3 (an execution engine takes ownership of the
    one it is given, so each caller gets its own)."""
    llvm = binding()
    return llvm.Target.from_triple(target.triple).create_target_machine(
        cpu=target.cpu, features=target.features, opt=3, codemodel="jitdefault")


@functools.lru_cache(maxsize=None)
def _cached_machine(target: Target):
    return target_machine(target)


def data_layout(target: Target) -> str:
    return str(_cached_machine(target).target_data)


# ---- the compiler itself (runs in the worker) -----------------------------------------------------

def optimize(source: str, target: Target):
    """Parse, verify and optimize `source` with LLVM's O3 pipeline (loop and SLP vectorizers on)
    for `target`; returns the optimized module. Loop unrolling is off: the vectorizer still
    interleaves (runs several vectors per trip) where the kernel does not say otherwise, and
    unrolling on top doubled compile time for no measured gain."""
    llvm = binding()
    tm = _cached_machine(target)
    module = llvm.parse_assembly(source)
    module.verify()
    module.triple, module.data_layout = target.triple, str(tm.target_data)
    pto = llvm.create_pipeline_tuning_options(speed_level=3)
    pto.loop_vectorization = True
    pto.slp_vectorization = True
    pto.loop_unrolling = False
    builder = llvm.create_pass_builder(tm, pto)
    builder.getModulePassManager().run(module, builder)
    return module


# Loop Strength Reduction is a pass of LLVM's code generator that rewrites a loop's address
# arithmetic (`base + 4*k` becomes a pointer bumped every trip). On fusec's kernels it took a
# quarter to a third of the code generator's time and made no difference to their speed in
# side-by-side runs: x86 addresses `[base + 4*k]` in one instruction anyway. LLVM has no
# per-module switch, only the process-wide option `-disable-lsr`; the worker is fusec's own
# process, so it sets it once (the user's process, and any llvmlite use in it, never sees it).
LSR = False


def compile_ir(source: str, target: Target, what: str = "object"):
    """In this process: `what` = "object" (ELF bytes), "assembly" or "optimized" (IR text)."""
    module = optimize(source, target)
    if what == "optimized":
        return str(module)
    tm = _cached_machine(target)
    return tm.emit_assembly(module) if what == "assembly" else tm.emit_object(module)


def _serve() -> None:
    """The worker's loop: a request is a length-prefixed pickle of (source, target, what) on
    stdin; the answer, ("ok", result) or ("error", message), goes back the same way on stdout."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    llvm = binding()
    if not LSR:
        llvm.set_option("fusec", "-disable-lsr=true")
    while True:
        head = stdin.read(8)
        if len(head) < 8:
            return
        source, fields, what = pickle.loads(stdin.read(struct.unpack("<Q", head)[0]))
        target = Target(*fields)
        try:
            answer = ("ok", compile_ir(source, target, what))
        except Exception as exc:  # LLVM's verifier or parser said no: an error, not a crash
            answer = ("error", f"{type(exc).__name__}: {exc}")
        data = pickle.dumps(answer)
        stdout.write(struct.pack("<Q", len(data)) + data)
        stdout.flush()


# ---- the worker, seen from the user's process -----------------------------------------------------

class BuildError(RuntimeError):
    """LLVM rejected the kernel (its verifier, parser or code generator reported an error)."""


class WorkerDied(BuildError):
    """The compiler process died while compiling (an LLVM assertion or a crash)."""


def _wait(fd: int, writing: bool, deadline: float | None) -> None:
    """Wait until `fd` can be read (or written), or raise TimeoutError at `deadline`."""
    left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
    if not any(select.select(*(([], [fd]) if writing else ([fd], [])), [], left)):
        raise TimeoutError


def _send(fd: int, data: bytes, deadline: float | None) -> None:
    """Write all of `data` to the pipe `fd` by `deadline`, a piece at a time as it has room (a
    request can be larger than a pipe holds: a worker that stopped reading would block a write)."""
    os.set_blocking(fd, False)
    view = memoryview(data)
    while view:
        _wait(fd, True, deadline)
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:  # (room for less than a page: wait again)
            pass


def _receive(fd: int, n: int, deadline: float | None) -> bytes:
    """Read `n` bytes from the pipe `fd` by `deadline`; fewer only at end of file (it died).
    (Read from the file descriptor itself: a buffered reader could hold bytes select() misses.)"""
    chunks, got = [], 0
    while got < n:
        _wait(fd, False, deadline)
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class Worker:
    """One compiler process, started on first use and restarted after a crash. Requests are
    answered one at a time (a lock), in the order they come. `command` starts the process (the
    tests give it one that crashes)."""

    def __init__(self, command: list[str] | None = None):
        self.command = command or [sys.executable, os.path.abspath(__file__), "--worker"]
        self.proc, self.pid = None, None
        self.lock = threading.Lock()
        self.stderr = None

    def _start(self) -> None:
        self.stderr, self.pid = tempfile.TemporaryFile(), os.getpid()
        self.proc = subprocess.Popen(self.command, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr)

    def _died(self, name: str, target: Target, why: str = "") -> WorkerDied:
        code = self.proc.wait()
        self.stderr.seek(0)
        tail = self.stderr.read().decode(errors="replace").strip().splitlines()[-12:]
        for f in (self.proc.stdin, self.proc.stdout, self.stderr):
            try:
                f.close()
            except OSError:  # its pipe is broken: nothing left to flush
                pass
        self.proc = None
        how = why or f"died ({f'signal {-code}' if code < 0 else f'exit status {code}'})"
        return WorkerDied(f"LLVM's compiler process {how} compiling {name} for {target}"
                          + ("; it printed:\n    " + "\n    ".join(tail) if tail else ""))

    def compile(self, source: str, target: Target, what: str, name: str,
                timeout: float | None = None):
        """Send one request and wait for its answer, at most `timeout` seconds (None: forever).
        A worker that does not answer in time (stopped, stuck, swapped out) is killed and the
        request is a WorkerDied that says so; the next request starts a fresh worker."""
        with self.lock:
            if self.proc is not None and self.pid == os.getpid() and self.proc.poll() is not None:
                self._died(name, target)  # (killed while idle: its pipes closed, then restarted)
            if self.proc is None or self.pid != os.getpid():
                try:  # first use, after a crash, or in a forked child (own pipes)
                    self._start()
                except OSError as exc:  # no usable Python executable (an embedded interpreter)
                    self.proc = None
                    self.stderr.close()
                    raise BuildError(f"could not start LLVM's compiler process "
                                     f"({' '.join(self.command[:2])}): {exc}") from None
            data = pickle.dumps((source, astuple(target), what))  # plain data: the worker
            # imports no fusec module, so it could not unpickle a Target by its class
            deadline = None if timeout is None else time.monotonic() + timeout
            try:
                _send(self.proc.stdin.fileno(), struct.pack("<Q", len(data)) + data, deadline)
                head = _receive(self.proc.stdout.fileno(), 8, deadline)
                if len(head) < 8:
                    raise self._died(name, target)
                answer = _receive(self.proc.stdout.fileno(), struct.unpack("<Q", head)[0], deadline)
                status, result = pickle.loads(answer)
            except (BrokenPipeError, EOFError, pickle.UnpicklingError):
                raise self._died(name, target) from None
            except TimeoutError:  # the watchdog: no answer in time
                self.proc.kill()  # (SIGKILL also ends a stopped process)
                raise self._died(name, target, f"did not answer within {timeout:g} s "
                                                 "(FUSEC_BUILD_TIMEOUT) and was killed,") from None
        if status != "ok":
            raise BuildError(result)
        return result

    def close(self) -> None:
        """Let the compiler process finish (its stdin closes, its loop ends)."""
        if self.proc is None or self.pid != os.getpid():
            return
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.stderr.close()
        self.proc = None


class WorkerPool:
    """Compiler processes for kernels built at the same time (fusec/runtime/build.py builds several at
    once, each in its own thread). A request takes an idle worker, or starts a new one when all
    are busy, and gives it back when answered; so there are never more workers than builds ever
    ran at once, and a program built one kernel at a time keeps one. `make` makes a Worker (the
    tests give one that crashes)."""

    def __init__(self, make=Worker):
        self.make = make
        self.workers: list[Worker] = []
        self.idle: list[Worker] = []
        self.lock = threading.Lock()

    def compile(self, source: str, target: Target, what: str, name: str,
                timeout: float | None = None):
        with self.lock:
            if self.idle:
                worker = self.idle.pop()
            else:
                worker = self.make()
                self.workers.append(worker)
        try:
            return worker.compile(source, target, what, name, timeout)
        finally:
            with self.lock:
                self.idle.append(worker)

    def close(self) -> None:
        for worker in self.workers:
            worker.close()


_WORKERS = WorkerPool()
atexit.register(_WORKERS.close)


def guarded(source: str, target: Target, what: str = "object", name: str = "kernel",
            timeout: float | None = None):
    """compile_ir(source, target, what) in a compiler process: a crash there, or no answer
    within `timeout` seconds, raises WorkerDied here instead of ending or hanging this process."""
    return _WORKERS.compile(source, target, what, name, timeout)


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    del sys.path[0]  # codegen/llvm/ itself: its ir.py, jit.py... must not shadow other modules
    _serve()

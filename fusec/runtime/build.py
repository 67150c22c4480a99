"""Building a program's kernels: each distinct kernel once, several at a time.

`compile_graph` (fusec/driver.py) lowers every fused group to kernel IR and hands the list here:

    kernel IR ──canonical (fusec/ir.py)──> canonical IR ──render──> canonical source
      distinct canonical sources ──build, `jobs()` at a time──> binaries (cached on disk)
      ──load, once per process──> launchers, shared by every kernel with that canonical source

A 6-layer BERT has 86 fused kernels but only 15 distinct ones: every layer repeats the same
kernels over buffers of the same shapes. Before this file existed fusec compiled all 86, one
after another. Now it compiles the 15, in parallel, and the other 71 kernels share their
binaries (see the note on `canonical` in fusec/ir.py for why that is exact).

What runs in parallel, per backend:

* cpp: `g++` processes (`codegen/cpp/__init__.py`'s `build` runs one per call; Python threads only wait);
* llvm: LLVM's optimizer and code generator, in a pool of guarded compiler processes
  (codegen/llvm/compiler.py), one per job: a crash there still takes down only that process;
* triton: `build` writes the module; then, on a GPU, each distinct module compiles its kernel
  ahead of the first run (Triton's `warmup`), in threads, into Triton's cache, where the first
  launch finds it (under TRITON_INTERPRET=1 nothing is compiled at all).

Loading (dlopen, MCJIT linking, importing a Triton module) happens here, in this thread, one
binary at a time: it takes milliseconds, and ctypes and llvmlite are not meant to be driven
from several threads at once. A kernel whose backend cannot build it is built by the other CPU
backend (its `fallback` in codegen/backends.py), said once per backend.

Note (builds that fail). "Cannot build" covers more than a compiler's refusal: a compiler that
is missing, or that runs past FUSEC_BUILD_TIMEOUT (codegen/tools.py kills it; a Triton compile,
which runs in this process, is abandoned instead: `finish_within`), the LLVM helper
dying or not answering in time, and a binary that does not load. The backends check a binary
before the loader maps it (codegen/elf.py: a library cut short would be SIGBUS, not an error);
`load_or_rebuild` deletes one that fails and builds it once more, so no bad file stays under a
key. When the other backend cannot build the kernel either, `Built.failed` is set and the driver
runs the group's ATen ops in its place (fusec/runtime/eager.py), with one warning and a repro
file. The program always runs, and gives eager's answer.

The disk cache (fusec/cache.py) is unchanged: a file is named after the kernel family and the
hash of the canonical source, written under a temporary name and renamed into place, and
verified before it is loaded. Several processes building into one cold cache each build the
kernel (the same bytes) and the last rename wins; no reader ever sees half a file.
"""
from __future__ import annotations

import os
import threading
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

import torch

from fusec import cache, env, progress
from fusec.codegen import backends
from fusec.codegen import tools
from fusec.errors import CompileError, CompilerNotFoundError, UnsupportedError
from fusec.ir import canonical
from fusec.symbolic import size_params
from fusec.runtime.threads import finish_within

# If a CPU backend cannot build a kernel (gcc fails, or LLVM's code generator dies in its
# guarded process: codegen/llvm/compiler.py), the other CPU backend builds that kernel: both take
# the same kernel IR and their launchers are called the same way.
_FELL_BACK: set[str] = set()

# (cache directory, backend, canonical source, dtypes and device) -> its Built, while some kernel uses it
# (`Kernel.built`): a second program (a new input signature, another model with the same layers)
# loads nothing twice. Pointing FUSEC_CACHE_DIR elsewhere starts afresh.
_LOADED: "weakref.WeakValueDictionary[tuple[str, str], Built]" = weakref.WeakValueDictionary()
_LOADED_LOCK = threading.Lock()

# A kernel found in the caches loads in milliseconds; one that takes longer than this to make
# ready was compiled, and the kernels after it are compiled in threads (see `_compile_ahead`).
SLOW_LOAD_S = 0.05


def jobs() -> int:
    """How many kernels build at once: $FUSEC_COMPILE_JOBS, else one per core this process may
    use (a build is one compiler process, which keeps one core busy)."""
    wanted = env.integer("FUSEC_COMPILE_JOBS", None, minimum=0)  # (0: one job)
    if wanted is not None:
        return max(wanted, 1)
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass
class Built:
    """One distinct kernel: its canonical IR and source, and what building it gave."""

    ir: Any  # the canonical kernel IR
    backend: str  # the backend asked for; after a fallback, the one that built it
    source: str  # the canonical source, for `backend`: the text that was compiled
    key: tuple  # (cache dir, backend asked for, canonical source, dtypes and device): how `_LOADED` finds it
    path: Any = None  # the binary on disk (a .so, an .o or a Triton module)
    launcher: Any = None
    error: CompileError | None = None
    failed: bool = False  # no backend could build it: its group runs eagerly (runtime/eager.py)
    warned: bool = False  # (and that was said, once)


def codegen(backend: str):
    """The backend module (fusec.codegen.cpp, .llvm or .triton) that renders, builds and loads."""
    return backends.get(backend).module


def build_all(irs: list, backend: str, times: dict | None = None,
              device: str | None = None, rendered: list | None = None) -> list[Built]:
    """Build and load the kernels `irs` for `backend` (on `device`): one build per distinct
    canonical source, `jobs()` builds at a time. Returns each kernel's Built, in order (kernels
    with the same canonical source share one). Adds the seconds spent to `times` ("codegen":
    canonical IR and render, "build", "load"). `rendered`, where given, holds each kernel's
    (canonical IR, source) from an earlier render by this same fusec (a saved program,
    fusec/runtime/fast_start/saved.py), or None for a kernel to render here."""
    times = {} if times is None else times
    tools.timeout()  # a bad FUSEC_BUILD_TIMEOUT is the user's error to fix, not a failed build
    start = time.perf_counter()
    distinct: dict[str, Built] = {}
    mine: list[Built] = []
    where = str(cache.root())
    for ir, done in zip(irs, rendered or [None] * len(irs)):
        canon, source = done if done is not None else (None, None)
        if source is None:
            canon = canonical(ir)
            source = codegen(backend).render(canon)
        # A Triton source does not spell its pointers' dtypes: the JIT specializes on them at the
        # first launch, and the launcher keeps that compiled kernel
        # (fusec/runtime/fast_start/triton_launch.py).
        # So the dtypes (and the device) are part of what makes two kernels the same.
        signature = (tuple(str(p.dtype) for p in canon.params), str(device))
        built = distinct.get((source, signature))
        if built is None:
            key = (where, backend, source, signature)
            with _LOADED_LOCK:
                built = _LOADED.get(key)
            if built is None:
                built = Built(canon, backend, source, key)
            distinct[(source, signature)] = built
        mine.append(built)
    todo = [b for b in distinct.values() if b.launcher is None and not b.failed]
    cache.log(f"{len(irs)} kernels, {len(distinct)} distinct, {len(todo)} not loaded yet")
    built_at = time.perf_counter()
    _build_parallel(todo)
    loaded_at = time.perf_counter()
    for built in todo:
        _load(built)
    compiled_at = time.perf_counter()
    _compile_ahead([b for b in todo if backends.get(b.backend).compiles_ahead and not b.failed],
                   device)
    end = time.perf_counter()
    for stage, seconds in (("codegen", built_at - start),
                           ("build", loaded_at - built_at + end - compiled_at),
                           ("load", compiled_at - loaded_at)):
        times[stage] = times.get(stage, 0.0) + seconds
    return mine


def _build_parallel(todo: list[Built]) -> None:
    """Build every kernel of `todo` (binaries on disk; errors kept for `_load`), several at once,
    with a progress bar over the builds."""
    n = min(jobs(), len(todo))
    if n <= 1:
        for built in progress.builds(todo):
            _build(built)
        return
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="fusec-build") as pool:
        for future in progress.builds(as_completed([pool.submit(_build, b) for b in todo]),
                                      len(todo)):
            future.result()


def _compile_ahead(todo: list[Built], device: str | None) -> None:
    """On a GPU, Triton compiles a kernel when it is first launched, so a program's first run
    would compile its kernels one after another. Instead each distinct kernel's module compiles
    it now (`compile_ahead`: Triton's `warmup`, which compiles for the argument types without
    launching), `jobs()` at a time in threads, into Triton's own cache, where the first launch
    finds it. A kernel that fails here is left to its first launch, which compiles it again and,
    failing again, runs the group's ATen ops instead (TritonLauncher's `fallback`, set by the
    driver: fusec/runtime/eager.py). Under TRITON_INTERPRET=1 nothing is compiled at all.

    Triton compiles in this process, so a compile cannot be killed as a g++ can. Each runs in a
    daemon thread instead, and one still running after FUSEC_BUILD_TIMEOUT seconds is left
    behind (`finish_within`): its kernel is marked failed, so its group runs its ATen ops, and
    the program goes on. The abandoned thread never holds the process at exit."""
    if not todo or not _compiles_ahead(device):
        return
    index = torch.device(device).index
    if index is None and torch.cuda.is_available():
        index = torch.cuda.current_device()
    limit = tools.timeout()

    def one(built: Built) -> None:
        _compile_one(built, index)

    def give_up(late: list[Built]) -> None:
        for built in late:
            built.failed = True
            built.error = CompileError(f"fusec: Triton's compile of kernel {built.ir.name} ran "
                                       f"past FUSEC_BUILD_TIMEOUT ({limit} s); it was left "
                                       f"running in a background thread")

    # A module found in fusec's cache was written, and its kernel compiled, by an earlier process:
    # Triton's cache most likely holds the binary, and loading it takes milliseconds of Python.
    # Those are done here, one after another: in 16 threads they only fought over Python's lock
    # (on an H200 host the threads' summed time was 5-15x the wall-clock), and one
    # after another takes the same wall-clock on one core. Should one take long (Triton's cache
    # was emptied), the rest go to the threads with the new ones.
    written = getattr(codegen(todo[0].backend), "WRITTEN", set())
    late: list[Built] = []

    def in_order(built: Built) -> None:
        late.extend(b for b, done in finish_within([built], one, 1, limit) if not done)

    fresh = one_by_one([b for b in todo if b.path not in written], in_order) + \
        [b for b in todo if b.path in written]
    give_up(late)
    fresh = [b for b in fresh if not b.failed]
    if fresh:
        finished = progress.builds(finish_within(fresh, one, min(jobs(), len(fresh)), limit),
                                   len(fresh))
        give_up([b for b, done in finished if not done])


def _compiles_ahead(device: str | None) -> bool:
    """Whether kernels for `device` compile before their first launch: Triton on a GPU, not
    under its interpreter (which compiles nothing)."""
    return device is not None and torch.device(device).type == "cuda" \
        and os.environ.get("TRITON_INTERPRET") != "1"


def _compile_one(built: Built, index: int) -> None:
    """Compile one Triton kernel for GPU `index` (its module's `compile_ahead`), and prepare its
    launch. A compiler error is logged and left to the first launch, which says it."""
    ahead = getattr(built.launcher.module, "compile_ahead", None)
    if ahead is None:
        return
    try:
        with torch.cuda.device(index):  # Triton compiles for the thread's current device
            compiled = ahead(*[p.dtype for p in built.ir.params])
            ready = getattr(codegen(built.backend), "prepare_launch", None)
            if ready is not None and compiled is not None:
                ready(compiled)
    except Exception as err:  # noqa: BLE001 - the first launch compiles it and says why
        cache.log(f"compiling {built.ir.name} ahead failed ({type(err).__name__}: {err}); "
                  "its first launch compiles it")


def one_by_one(found: list, compile_one) -> list:
    """Make the kernels `found` in the cache ready, one after another, until one of them takes
    longer than SLOW_LOAD_S (it was compiled: Triton's cache did not hold it). Returns those not
    done yet, for the threads. (The first is not timed: it also pays for Triton's own start.)"""
    for i, built in enumerate(found):
        start = time.perf_counter()
        compile_one(built)
        if i > 0 and time.perf_counter() - start > SLOW_LOAD_S:
            return found[i + 1:]
    return []


def _build(built: Built) -> None:
    """Render was done; build the binary (or find it in the cache). A CompileError (a compiler
    that failed, timed out or is missing) is kept on `built` so that `_load` can fall back in
    the main thread."""
    try:
        built.path = codegen(built.backend).build(built.source, built.ir.name)
    except CANNOT_BUILD as err:
        built.error = err


# What makes a backend unable to build a kernel: the compiler's refusal, a time-out, a binary
# that does not load (CompileError), no compiler at all, a kernel form it does not render.
CANNOT_BUILD = (CompileError, CompilerNotFoundError, UnsupportedError)


def _load(built: Built) -> None:
    """Load the built binary (or fall back to the other CPU backend), and remember it. When no
    backend can build it, `built.failed` is set (the error on `built.error`): the driver runs
    the group's ATen ops instead (fusec/runtime/eager.py)."""
    if built.error is None:
        try:
            built.launcher, built.path = load_or_rebuild(built.backend, built.source, built.ir,
                                                         built.path)
        except CANNOT_BUILD as err:  # loading refused it (LLVM: a symbol this process lacks)
            built.error = err
    if built.error is not None:
        _fall_back(built)
    with _LOADED_LOCK:
        _LOADED[built.key] = built


def load_or_rebuild(backend: str, source: str, ir, path) -> tuple[Any, Any]:
    """`backend`'s launcher for the binary at `path`, and its path. A binary that does not load
    (damaged on disk, cut short, garbage from a broken compiler: the backends check it before
    the loader sees it, codegen/elf.py) is deleted with its manifest and built again, once; if
    that one does not load either, it is deleted too (the next process builds it afresh: a bad
    file never stays under a key) and the error is a CompileError."""
    module = codegen(backend)
    try:
        return module.launcher(path, ir.name, len(ir.params), len(size_params(ir))), path
    except (CompileError, OSError) as err:
        cache.log(f"{os.path.basename(str(path))} did not load ({err}): building it again")
        discard(path)
    path = module.build(source, ir.name)
    try:
        return module.launcher(path, ir.name, len(ir.params), len(size_params(ir))), path
    except (CompileError, OSError) as err:
        discard(path)
        raise CompileError(f"fusec: kernel {ir.name} was built again and still does not load: "
                           f"{err}") from None


def discard(path) -> None:
    """Delete a built file and its manifest (fusec/cache.py: `<artifact>.json`)."""
    for p in (path, path.with_suffix(".json")):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
        except OSError as err:
            cache.log(f"could not delete {p}: {err}")


def _fall_back(built: Built) -> None:
    """The other CPU backend builds the kernel (warned once per backend); where there is none,
    or it fails too, `built.failed` is set and the error kept, for the eager fallback."""
    first, backend = built.error, built.backend
    other = backends.get(backend).fallback
    if other is None or not codegen(other).available():
        built.failed = True
        return
    module = codegen(other)
    try:
        source = module.render(built.ir)
        path = module.build(source, built.ir.name)
        launcher, path = load_or_rebuild(other, source, built.ir, path)
    except CANNOT_BUILD as second:
        built.error = CompileError(f"{first}\nand the {other} backend could not build it "
                                   f"either:\n{second}")
        built.failed = True
        return
    if backend not in _FELL_BACK:
        _FELL_BACK.add(backend)
        warnings.warn(f"{first}\nfusec: the {other} backend builds {built.ir.name} instead (and "
                      f"any other kernel the {backend} backend cannot build; each kernel's "
                      f".backend says which built it)", stacklevel=5)
    built.backend, built.source, built.path, built.launcher = other, source, path, launcher

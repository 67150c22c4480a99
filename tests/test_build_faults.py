"""Compilers that hang, lie or vanish, binaries damaged on disk, an LLVM worker killed or stopped,
and kernels no backend can build: the program still finishes, with eager's answer.

Each test breaks one external step on purpose and checks three things: the call returns (within
a few seconds where a time limit is involved), its result matches eager PyTorch, and what went
wrong is said once, in words (a warning naming the kernel; a repro file where the group ran
eagerly). Damaged binaries are loaded in a child process, so that a SIGBUS or SIGSEGV there
would show as its return code instead of ending the test run.
"""
import gc
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch

import fusec
from conftest import TRITON_DEVICE
from fusec import cache
from fusec.codegen import cpp, elf, llvm, tools
from fusec.codegen.llvm import compiler as llvm_build
from fusec.codegen import triton as triton_codegen
from fusec.errors import CompileError
from fusec.runtime import build, threads
from fusec.runtime.eager import EagerGroup, FallbackWarning


def chain(x):
    return torch.sin(x) * 2 + torch.cos(x)


def softmax(x):
    return torch.softmax(x * 3, dim=-1) + 1


X = torch.randn(8, 33)


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """A cache of its own, the fallback said again, the C++ compiler looked up again, and the
    time-outs counted against each tool forgotten after the test (a test's short
    FUSEC_BUILD_TIMEOUT must not make later tests give up on gcc: tools.GIVE_UP_AFTER)."""
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_FELL_BACK", set())
    monkeypatch.setattr(tools, "_TIMED_OUT", {})
    cpp.find_compiler.cache_clear()
    yield tmp_path
    monkeypatch.undo()
    cpp.find_compiler.cache_clear()


def fake_cxx(folder, body: str) -> str:
    """A `g++` that is a shell script: `--version` answers like the real one (so the cache key
    is the real compiler's), everything else runs `body`."""
    path = folder / "g++"
    path.write_text(f"#!/bin/sh\nif [ \"$1\" = --version ]; then exec {shutil.which('g++')} "
                    f"--version; fi\n{body}\n")
    path.chmod(0o755)
    return str(path)


def processes_running(needle: str) -> list[int]:
    """Pids of processes whose command line mentions `needle`."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle.encode() in f.read():
                    found.append(int(pid))
        except (OSError, ValueError):
            continue
    return found


def caught(fn, *args):
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        out = fn(*args)
    return out, [str(w.message) for w in said]


needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs the real g++")


# ---- the C++ compiler ------------------------------------------------------------------------------

@needs_gxx
def test_a_hanging_compiler_times_out_and_llvm_builds(fresh, monkeypatch):
    script = fake_cxx(fresh, "sleep 600")
    monkeypatch.setenv("CXX", script)
    monkeypatch.setenv("FUSEC_BUILD_TIMEOUT", "2")
    cf = fusec.compile(chain, backend="cpp")
    start = time.monotonic()
    got, said = caught(cf, X)
    assert time.monotonic() - start < 30
    torch.testing.assert_close(got, chain(X))
    assert [k.backend for k in cf.kernels] == ["llvm"]
    assert any("did not finish compiling kernel" in s and "within 2 s" in s
               and "llvm backend builds" in s for s in said), said
    assert processes_running(script) == []  # the compiler and its children were killed


def test_a_tool_that_always_hangs_is_given_up_on(tmp_path, monkeypatch):
    """Each of a model's kernels would wait out the limit: after a few time-outs in a row the
    tool's calls fail at once (and a finished call resets the count)."""
    monkeypatch.setattr(tools, "_TIMED_OUT", {})
    script = tmp_path / "hangs"
    script.write_text("#!/bin/sh\n[ \"$1\" = quick ] && exit 0\nsleep 600\n")
    script.chmod(0o755)
    for _ in range(tools.GIVE_UP_AFTER - 1):
        with pytest.raises(CompileError, match="did not finish"):
            tools.run([str(script)], "hanging", 0.5)
    assert tools.run([str(script), "quick"], "answering", 5).returncode == 0  # (resets)
    for _ in range(tools.GIVE_UP_AFTER):
        with pytest.raises(CompileError, match="did not finish"):
            tools.run([str(script)], "hanging", 0.5)
    start = time.monotonic()
    with pytest.raises(CompileError, match="not run again"):
        tools.run([str(script), "quick"], "answering", 5)
    assert time.monotonic() - start < 0.5
    assert processes_running(str(script)) == []


def test_a_bad_timeout_setting_names_the_variable(fresh, monkeypatch):
    monkeypatch.setenv("FUSEC_BUILD_TIMEOUT", "soon")
    with pytest.raises(fusec.FusecError, match="FUSEC_BUILD_TIMEOUT"):
        fusec.compile(chain, backend="llvm")(X)
    monkeypatch.setenv("FUSEC_BUILD_TIMEOUT", "0")
    with pytest.raises(fusec.FusecError, match="FUSEC_BUILD_TIMEOUT"):
        tools.timeout()


@needs_gxx
def test_a_compiler_that_writes_garbage_does_not_poison_the_key(fresh, monkeypatch):
    writes_garbage = ('out=""\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && out="$2"; shift; done\n'
                      'yes "not a shared library" | head -c 4096 > "$out"\nexit 0')
    monkeypatch.setenv("CXX", fake_cxx(fresh, writes_garbage))
    cf = fusec.compile(chain, backend="cpp")
    got, said = caught(cf, X)
    torch.testing.assert_close(got, chain(X))
    assert [k.backend for k in cf.kernels] == ["llvm"]
    assert any("still does not load" in s and "not an ELF file" in s for s in said), said
    folder = fresh / "cache" / "cpp"
    assert not list(folder.glob("*.so")) and not list(folder.glob("*.json"))  # nothing kept
    (tried,) = [p.stem for p in folder.glob("*.cpp")]
    # the real compiler back: the same key builds and loads
    del cf
    gc.collect()  # (the fallen-back kernel is no longer shared in this process)
    monkeypatch.delenv("CXX")
    cpp.find_compiler.cache_clear()
    cf = fusec.compile(chain, backend="cpp")
    torch.testing.assert_close(cf(X), chain(X))
    assert [k.backend for k in cf.kernels] == ["cpp"]
    assert (folder / f"{tried}.so").exists()


def test_a_missing_compiler_falls_back_to_llvm(fresh, monkeypatch):
    monkeypatch.setenv("CXX", str(fresh / "no-such-g++"))
    cf = fusec.compile(softmax, backend="cpp")
    got, said = caught(cf, X)
    torch.testing.assert_close(got, softmax(X))
    assert [k.backend for k in cf.kernels] == ["llvm"]
    assert any("no-such-g++" in s and "was not found" in s and "llvm backend builds" in s
               for s in said), said


@needs_gxx
def test_the_compilers_own_message_is_kept(fresh, monkeypatch):
    monkeypatch.setenv("CXX", fake_cxx(fresh, 'echo "kernel.cpp:1: error: pretend" >&2; exit 1'))
    got, said = caught(fusec.compile(chain, backend="cpp"), X)
    torch.testing.assert_close(got, chain(X))
    assert any("exit status 1" in s and "error: pretend" in s for s in said), said


# ---- binaries damaged on disk (loaded in a child process) ---------------------------------------

CHILD = textwrap.dedent("""
    import sys, torch, fusec
    backend = sys.argv[1]
    f = lambda x: torch.softmax(x * 3, dim=-1) + 1
    x = torch.linspace(-2, 2, 8 * 33).reshape(8, 33)
    cf = fusec.compile(f, backend=backend)
    torch.testing.assert_close(cf(x), f(x))
    print("ok", [k.backend for k in cf.kernels], fusec.cache.STATS["compiles"])
""")


def run_child(backend: str, cache_dir) -> subprocess.CompletedProcess:
    env = dict(os.environ, FUSEC_CACHE_DIR=str(cache_dir), FUSEC_SAVED_PROGRAMS="0")
    return subprocess.run([sys.executable, "-c", CHILD, backend], capture_output=True, text=True,
                          env=env, timeout=300)


def damaged(backend: str, cache_dir, damage) -> subprocess.CompletedProcess:
    """Build the child's kernel once, damage the binary, re-sign its manifest (as if the damage
    matched it), then run the child again."""
    first = run_child(backend, cache_dir)
    assert first.returncode == 0, first.stderr
    suffix = ".so" if backend == "cpp" else ".o"
    (binary,) = (cache_dir / backend).glob("*" + suffix)
    binary.chmod(0o600)
    binary.write_bytes(damage(binary.read_bytes()))
    binary.chmod(0o700)
    cache.write_manifest(binary)  # (a signed manifest of the damaged bytes: verified() says yes)
    assert cache.verified(binary)
    second = run_child(backend, cache_dir)
    assert second.returncode == 0, f"rc {second.returncode}\n{second.stderr[-3000:]}"
    assert second.stdout.startswith(f"ok ['{backend}'] 1"), second.stdout  # built again, once
    assert elf.problem(binary.read_bytes(), "shared" if backend == "cpp" else "relocatable") is None
    return second


@needs_gxx
def test_a_truncated_library_is_rebuilt_not_a_sigbus(fresh, monkeypatch):
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(fresh / "cache"))
    damaged("cpp", fresh / "cache", lambda data: data[:len(data) // 2])


@pytest.mark.parametrize("damage", ["random", "random-after-header"])
def test_a_random_object_file_is_rebuilt_not_a_sigsegv(fresh, monkeypatch, damage):
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(fresh / "cache"))
    rng = torch.Generator().manual_seed(0)

    def scramble(data):
        noise = bytes(torch.randint(0, 256, (len(data),), generator=rng, dtype=torch.uint8).tolist())
        return noise if damage == "random" else data[:64] + noise[64:]
    damaged("llvm", fresh / "cache", scramble)


def test_elf_checks_say_what_is_wrong():
    obj = llvm.object_code("define void @f() {\n  ret void\n}")
    assert elf.problem(obj, "relocatable") is None
    assert "cut short" in elf.problem(obj[:len(obj) // 2], "relocatable")
    assert "not an ELF file" in elf.problem(b"garbage" * 20, "shared")
    assert "ELF type 1" in elf.problem(obj, "shared")  # an object file is not a library


# ---- the LLVM worker --------------------------------------------------------------------------------

def slow_worker():
    """A real LLVM worker that takes a second to start: time to kill or stop it mid-request."""
    start = (f"import os, sys, time; time.sleep(1); "
             f"os.execv(sys.executable, [sys.executable, {llvm_build.__file__!r}, '--worker'])")
    return llvm_build.Worker([sys.executable, "-c", start])


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_killed_or_stopped_llvm_worker_does_not_hang(fresh, monkeypatch, how):
    if not cpp.available():
        pytest.skip("no other CPU backend to fall back to")
    pool = llvm_build.WorkerPool(slow_worker)
    monkeypatch.setattr(llvm_build, "_WORKERS", pool)
    # (long enough for gcc's fallback build of a kernel from an unparsed prelude on a loaded
    # 2-core machine; the stopped worker is given up on after it)
    monkeypatch.setenv("FUSEC_BUILD_TIMEOUT", "8")

    def strike():  # once the request is on its way
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            procs = [w.proc for w in pool.workers if w.proc is not None]
            if procs:
                time.sleep(0.3)
                os.kill(procs[0].pid, getattr(signal, how))
                return
            time.sleep(0.01)

    threading.Thread(target=strike, daemon=True).start()
    cf = fusec.compile(chain, backend="llvm")
    start = time.monotonic()
    got, said = caught(cf, X)
    assert time.monotonic() - start < 30
    torch.testing.assert_close(got, chain(X))
    assert [k.backend for k in cf.kernels] == ["cpp"]
    why = "died (signal 9)" if how == "SIGKILL" else "did not answer within 8 s"
    assert any(why in s and "cpp backend builds" in s for s in said), said
    (worker,) = pool.workers
    assert worker.proc is None  # reaped; the next request starts a fresh one
    try:
        cf = fusec.compile(softmax, backend="llvm")
        torch.testing.assert_close(cf(X), softmax(X))
        assert [k.backend for k in cf.kernels] == ["llvm"]
    finally:
        pool.close()


def test_a_worker_killed_while_idle_is_replaced(fresh, monkeypatch):
    pool = llvm_build.WorkerPool()
    monkeypatch.setattr(llvm_build, "_WORKERS", pool)
    torch.testing.assert_close(fusec.compile(chain, backend="llvm")(X), chain(X))
    (worker,) = pool.workers
    os.kill(worker.proc.pid, signal.SIGKILL)
    worker.proc.wait()
    try:
        cf = fusec.compile(softmax, backend="llvm")
        got, said = caught(cf, X)
        torch.testing.assert_close(got, softmax(X))
        assert [k.backend for k in cf.kernels] == ["llvm"] and said == []
    finally:
        pool.close()


# ---- no backend builds it: the group runs eagerly ----------------------------------------------

def _refuse(source, name):
    raise CompileError(f"fusec: pretend the compiler failed on {name}")


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
@pytest.mark.parametrize("fn", [chain, softmax])
def test_a_kernel_no_cpu_backend_builds_runs_eagerly(fresh, monkeypatch, backend, fn):
    monkeypatch.setattr(cpp, "build", _refuse)
    monkeypatch.setattr(llvm, "build", _refuse)
    cf = fusec.compile(fn, backend=backend)
    got, said = caught(cf, X)
    torch.testing.assert_close(got, fn(X))
    (kernel,) = cf.kernels
    assert isinstance(kernel.launcher, EagerGroup)
    assert len(said) == 1 and kernel.name in said[0] and "run eagerly" in said[0], said
    repro = said[0].split("Repro: ")[1].split("\n")[0]
    text = open(repro).read()
    assert "pretend the compiler failed" in text and "aten." in text and kernel.name in text
    got, said = caught(cf, X * 2)  # later calls: the same, said once
    torch.testing.assert_close(got, fn(X * 2))
    assert said == []


@pytest.mark.triton
@pytest.mark.parametrize("fn", [chain, softmax])
def test_a_triton_kernel_that_fails_at_first_launch_runs_eagerly(fresh, monkeypatch, fn):
    real = triton_codegen.launcher

    def failing_module(path, name, n_params, n_sizes=0):
        launcher = real(path, name, n_params, n_sizes)
        module = type(sys)(launcher.module.__name__)  # a copy: the real module stays intact
        vars(module).update(vars(launcher.module))

        def launch(*args):
            raise RuntimeError("PassManager::run failed (pretend)")
        module.launch = launch
        launcher.module = module
        return launcher

    monkeypatch.setattr(triton_codegen, "launcher", failing_module)
    x = X.to(TRITON_DEVICE)
    cf = fusec.compile(fn, backend="triton")
    got, said = caught(cf, x)
    torch.testing.assert_close(got, fn(x))
    assert len(said) == 1 and cf.kernels[0].name in said[0] and "PassManager" in said[0], said
    assert isinstance(cf.kernels[0].launcher.fast, EagerGroup)
    got, said = caught(cf, x + 1)
    torch.testing.assert_close(got, fn(x + 1))
    assert said == []


@pytest.mark.triton
def test_a_saved_triton_program_whose_kernel_fails_runs_eagerly(fresh, monkeypatch):
    """A program loaded from the saved-program cache (fusec/runtime/fast_start/saved.py) holds no ATen
    graphs: its kernel's failure at the first launch compiles it for real, then falls back."""
    monkeypatch.setenv("FUSEC_SAVED_PROGRAMS", "1")
    x = X.to(TRITON_DEVICE)
    first = fusec.compile(softmax, backend="triton")
    torch.testing.assert_close(first(x), softmax(x))  # compiled, and saved
    module = first.kernels[0].launcher.module  # (imported once per process: sys.modules)
    del first
    gc.collect()  # (its kernel no longer loaded in this process)

    def launch(*args):
        raise RuntimeError("pretend: no compile")
    # (the kernel's module, not a fusec function: a patched fusec function changes the saved
    # programs' key, runtime/fast_start/fingerprint.py `settings`)
    monkeypatch.setattr(module, "launch", launch)
    loaded = cache.STATS["programs loaded"]
    cf = fusec.compile(softmax, backend="triton")
    got, said = caught(cf, x)
    assert cache.STATS["programs loaded"] == loaded + 1
    torch.testing.assert_close(got, softmax(x))
    assert len(said) == 1 and "pretend: no compile" in said[0], said


@pytest.mark.triton
def test_a_triton_kernel_that_cannot_be_written_runs_eagerly(fresh, monkeypatch):
    monkeypatch.setattr(triton_codegen, "build", _refuse)
    x = X.to(TRITON_DEVICE)
    cf = fusec.compile(softmax, backend="triton")
    got, said = caught(cf, x)
    torch.testing.assert_close(got, softmax(x))
    assert len(said) == 1 and cf.kernels[0].name in said[0], said
    assert any(isinstance(k.launcher, EagerGroup) for k in cf.kernels)


def test_fallback_warning_is_a_user_warning():
    assert issubclass(FallbackWarning, UserWarning)


# ---- Triton compiles (in this process: abandoned, not killed) ---------------------------------------

def test_work_past_its_limit_is_abandoned_not_waited_for():
    """`finish_within` yields each item as it finishes, and gives up on one still running past
    the limit: the others go on in a fresh thread, and the stuck daemon thread holds nothing."""
    release = threading.Event()
    ran = []

    def work(item):
        if item == "stuck":
            release.wait(30)
        else:
            time.sleep(0.05)
        ran.append(item)

    start = time.monotonic()
    try:
        got = list(threads.finish_within(["a", "stuck", "b", "c"], work, 2, 0.5))
    finally:
        release.set()
    assert time.monotonic() - start < 5
    assert sorted(got) == [("a", True), ("b", True), ("c", True), ("stuck", False)]
    assert sorted(i for i in ran if i != "stuck") == ["a", "b", "c"]
    # one worker, the stuck item first: the items after it still run, in a new thread
    release.clear()
    try:
        got = list(threads.finish_within(["stuck", "a"], work, 1, 0.3))
    finally:
        release.set()
    assert sorted(got) == [("a", True), ("stuck", False)]


@pytest.mark.triton
def test_a_triton_compile_that_hangs_runs_eagerly(fresh, monkeypatch):
    """A Triton compile still running after FUSEC_BUILD_TIMEOUT is left behind (Triton compiles
    in this process: it cannot be killed): its group's ATen ops run instead, with one warning,
    and the program gives eager's answer. On this CPU the compile ahead is pretended (under the
    interpreter there is none); on a GPU the real one runs after the pretended hang."""
    monkeypatch.setenv("FUSEC_BUILD_TIMEOUT", "1")
    monkeypatch.setattr(build, "_compiles_ahead", lambda device: True)
    real, release = build._compile_one, threading.Event()

    def hangs(built, index):
        release.wait(30)
        if torch.cuda.is_available():
            real(built, index)
    monkeypatch.setattr(build, "_compile_one", hangs)
    x = X.to(TRITON_DEVICE)
    cf = fusec.compile(softmax, backend="triton")
    start = time.monotonic()
    try:
        got, said = caught(cf, x)
    finally:
        release.set()
    assert time.monotonic() - start < 20
    torch.testing.assert_close(got, softmax(x))
    assert len(said) == 1 and "FUSEC_BUILD_TIMEOUT" in said[0] and cf.kernels[0].name in said[0], said
    assert all(isinstance(k.launcher, EagerGroup) for k in cf.kernels)

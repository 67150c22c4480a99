"""What is particular to the LLVM backend (codegen/llvm/__init__.py). Everything else it shares with the
other backends runs through the `target` fixture in every other test file (ops, views,
reductions, property tests, examples ...): this file checks the LLVM-only promises.

* kernels are LLVM IR, optimized and vectorized (explain shows the optimized IR and assembly);
* work is split across threads (pointwise tiles, reduction rows) without changing results;
* compiled object code is cached on disk: a second process compiles nothing;
* with no C++ compiler, backend="auto" picks llvm and says so once, and `fusec demo` runs.
"""
import os
import re
import subprocess
import sys

import pytest
import torch

import fusec
from conftest import assert_matches
from fusec.codegen import llvm
from fusec.codegen.llvm import compiler as llvm_build
from fusec.codegen.cpp import find_compiler


def test_kernel_source_is_llvm_ir():
    cf = assert_matches(lambda x, y: torch.sin(x) * 2 + y, torch.randn(64, 37), torch.randn(37),
                        backend="llvm", kernels=1)
    (k,) = cf.kernels
    assert k.backend == "llvm" and k.name == "fused_sin_mul_add_0"
    assert f"define void @{k.name}(" in k.source
    assert "call float @sinf(float" in k.source  # the op table's spelling, typed
    assert "fmul float" in k.source and "fadd float" in k.source


@pytest.mark.skipif(llvm.vector_isa() is None, reason="no libmvec on this machine")
def test_optimized_ir_is_vectorized_with_vector_math():
    e = fusec.explain(lambda x: torch.sin(x) * 2, torch.randn(4096), backend="llvm")
    opt = e.optimized_ir(0)
    widths = {f"<{lanes} x float>" for _, lanes in llvm.vector_isas()}
    assert any(w in opt for w in widths)  # the loop vectorizer widened the loop
    # ... and called a vector sine: torch's SLEEF where torch exports it, else libmvec's
    calls = re.findall(r"call <(\d+) x float> @_ZGV([a-z])N(\d+)v_(?:Sleef_)?sinf(?:_u10)?\(", opt)
    assert calls, "the sines were not vectorized"
    assert all(lanes == n for lanes, _, n in calls)
    asm = e.assembly(e.compiled.kernels[0].name)
    assert "_ZGV" in asm and len(asm.splitlines()) > 10


def test_optimized_ir_needs_an_llvm_kernel():
    e = fusec.explain(lambda x: x * 2, torch.randn(16), backend="cpp")
    with pytest.raises(fusec.FusecError, match="backend='llvm'"):
        e.optimized_ir(0)
    e = fusec.explain(lambda x: x * 2, torch.randn(16), backend="llvm")
    with pytest.raises(fusec.FusecError, match="no kernel named"):
        e.assembly("nope")


def test_threads_split_pointwise_work():
    # big enough to run in parallel: one long row (tiles of one row) and many odd rows
    x = torch.randn(300007)
    cf = assert_matches(lambda x: torch.cos(x) + x, x, backend="llvm")
    assert "@fused_cos_add_0.parallel = constant i1 true" in cf.kernels[0].source
    launcher = cf.last.kernels[0].launcher
    assert launcher.parts() == min(torch.get_num_threads(), launcher.work)
    y = torch.randn(513, 257).t()  # transposed: tiles over rows of a strided walk
    assert_matches(lambda y: torch.relu(y) * 3, y, backend="llvm")


def test_threads_split_reduction_rows():
    x = torch.randn(999, 130)
    cf = assert_matches(lambda x: torch.softmax(x, -1), x, backend="llvm", kernels=1)
    assert "parallel = constant i1 true" in cf.kernels[0].source


def test_parallel_launches_use_openmp_threads():
    """torch's libgomp is in the process: parallel launches go through GOMP_parallel and a
    trampoline per number of kernel arguments (see the note on threads in codegen/llvm/__init__.py)."""
    assert llvm.gomp_parallel() is not None
    cf = assert_matches(lambda x: torch.exp(x) * 2, torch.randn(1 << 18), backend="llvm")
    assert ".omp" not in cf.kernels[0].source  # not in the kernel's module: compiled once
    assert llvm.omp_trampoline(2) == llvm.omp_trampoline(2) != 0
    assert 2 in llvm._TRAMPOLINES


@pytest.mark.parametrize("parts", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("openmp", [True, False], ids=["openmp", "thread_pool"])
def test_any_number_of_parts_covers_the_work_once(parts, openmp, monkeypatch):
    """Parts are claimed with an atomic counter: more parts than threads, or an uneven split,
    still computes every tile (or row) exactly once; so does the fallback thread pool."""
    if not openmp:
        monkeypatch.setattr(llvm, "gomp_parallel", lambda: None)
    monkeypatch.setattr(llvm.LlvmLauncher, "parts", lambda self: min(parts, self.work))
    x = torch.randn(1000, 301)
    assert_matches(lambda x: torch.sin(x) + 1, x, backend="llvm")
    assert_matches(lambda x: torch.softmax(x, -1), x, backend="llvm", kernels=1)


def test_one_thread_when_torch_uses_one():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cf = assert_matches(lambda x: torch.cos(x) + x, torch.randn(300007), backend="llvm")
        assert cf.last.kernels[0].launcher.parts() == 1
    finally:
        torch.set_num_threads(before)


def test_long_float_sums_are_blocked():
    # one row of 1M values: blocks of ~1k summed on their own, block sums added in double
    x = torch.rand(1 << 20) + 0.5
    cf = assert_matches(lambda x: x.sum(), x, backend="llvm", kernels=1)
    assert ".block:" in cf.kernels[0].source
    ref = x.double().sum()
    assert abs(cf(x).double() - ref) / ref < 1e-6


def test_reduction_loops_take_one_vector_per_trip():
    """Every loop over k carries an interleave-count hint of 1 (REDUCTION_INTERLEAVE), and the
    vectorizer honours it: the optimized loops step by one vector, not four."""
    x = torch.randn(64, 512)
    cf = assert_matches(lambda x: torch.softmax(x, -1), x, backend="llvm", kernels=1)
    src = cf.kernels[0].source
    loops = re.findall(r"br i1 %\S+\.more, label %(\S+)\.loop, .*!llvm\.loop !(\d+)", src)
    assert [l for l, _ in loops] == ["phase0", "phase1", "store"]
    for _, n in loops:
        assert f'!{n} = distinct !{{!{n}, !{{ !"llvm.loop.interleave.count", i32 1 }}}}' in src
    opt = fusec.explain(lambda x: torch.softmax(x, -1), x, backend="llvm").optimized_ir(0)
    steps = {int(n) for n in re.findall(r"%index\.next\d* = add nuw i64 %index\d*, (\d+)", opt)}
    lanes = {int(n) for n in re.findall(r"load <(\d+) x float>", opt)}
    assert steps and steps <= lanes  # one vector per trip


def test_float_max_is_maxnum_and_a_nan_flag():
    """amax/amin: a plain maxnum that may ignore NaN, plus a flag that remembers one went by."""
    x = torch.randn(37, 300)
    x[5, 7] = float("nan")
    x[9, 299] = float("nan")
    cf = assert_matches(lambda x: x.amax(-1), x, backend="llvm", kernels=1)
    src = cf.kernels[0].source
    assert "call nnan nsz float @llvm.maxnum.f32(" in src and "fcmp uno float" in src
    assert "@llvm.maximum" not in src
    assert_matches(lambda x: x.amin(-1), x, backend="llvm", kernels=1)
    assert_matches(lambda x: x.amax(-1), torch.full((3, 70), float("nan")), backend="llvm")


def test_argmax_is_a_running_max_and_where_it_grew():
    """argmax: maxnum for the value, a select for its position, and the first NaN's position
    (a min over k) apart; ties keep the first position, and the first NaN wins."""
    x = torch.randn(37, 300)
    x[3, 10] = x[3, 200] = float("nan")
    x[4, :] = float("-inf")
    x[6, 50] = x[6, 60] = 1e9  # a tie
    x[7, :] = float("nan")
    cf = assert_matches(lambda x: x.argmax(-1), x, backend="llvm", kernels=1)
    src = cf.kernels[0].source
    assert "call nnan nsz float @llvm.maxnum.f32(" in src and "@llvm.smin.i64(" in src
    got = cf(x)
    assert got[3] == 10 and got[4] == 0 and got[6] == 50 and got[7] == 0
    assert_matches(lambda x: x.argmin(-1), -x, backend="llvm", kernels=1)
    xi = torch.randint(-5, 5, (33, 129), dtype=torch.int32)
    assert_matches(lambda x: x.argmax(-1), xi, backend="llvm", kernels=1)
    assert_matches(lambda x: x.argmin(-1), xi.to(torch.uint8), backend="llvm", kernels=1)


def test_loop_strength_reduction_is_off_only_inside_fusec():
    """fusec turns LLVM's -disable-lsr on only in its own compiler process: the kernel's object
    code differs from what the default code generator makes of the same optimized IR, and a
    module compiled in this process with llvmlite directly still gets the default."""
    x = torch.randn(64, 512)
    e = fusec.explain(lambda x: torch.softmax(x, -1), x, backend="llvm")
    opt = e.optimized_ir(0)
    binding = llvm.llvm_binding()
    default = llvm.target_machine().emit_object(binding.parse_assembly(opt))
    ours = llvm.object_code(opt)  # the optimizer runs again: a no-op on optimized IR
    assert ours != default  # the switch changes this kernel's code ...
    assert_matches(lambda x: torch.softmax(x, -1) * 2, torch.randn(33, 65), backend="llvm")
    after = llvm.target_machine().emit_object(binding.parse_assembly(opt))
    assert after == default  # ... and never touched this process


def test_second_process_reuses_llvm_object(tmp_path):
    from test_cache import run_child
    cache_dir = tmp_path / "cache"
    first = run_child("llvm", cache_dir)
    second = run_child("llvm", cache_dir)
    assert first["ok"] and second["ok"], (first["problem"], second["problem"])
    assert first["stats"]["compiles"] >= 1, first["stats"]
    assert second["stats"]["compiles"] == 0 and second["stats"]["misses"] == 0, second["stats"]
    assert second["stats"]["hits"] >= 1, second["stats"]
    suffixes = sorted(p.suffix for p in (cache_dir / "llvm").iterdir())
    assert suffixes == [".json", ".ll", ".o"], suffixes


def test_corrupt_object_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path))
    fn = lambda x: torch.tanh(x) - 1  # noqa: E731
    x = torch.randn(100)
    fusec.compile(fn, backend="llvm")(x)
    (obj,) = (tmp_path / "llvm").glob("*.o")
    obj.write_bytes(obj.read_bytes()[:100])  # truncated
    torch.testing.assert_close(fusec.compile(fn, backend="llvm")(x), fn(x))
    assert obj.stat().st_size > 100  # rebuilt, not loaded half


@pytest.fixture
def no_compiler(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("CC", "fusec-missing-cc")
    monkeypatch.setattr(fusec.api, "_SAID_LLVM", False)
    find_compiler.cache_clear()
    yield
    monkeypatch.undo()
    find_compiler.cache_clear()


def test_auto_picks_llvm_without_a_compiler(no_compiler):
    x = torch.randn(100)
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler found.*LLVM backend"):
        cf = fusec.compile(lambda x: torch.sin(x) + 1)
        torch.testing.assert_close(cf(x), torch.sin(x) + 1)
    assert cf.kernels[0].backend == "llvm"
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, not on every compile
        fusec.compile(lambda x: torch.cos(x) + 1)(x)
    # backend="cpp" asked for by name: LLVM builds its kernels, and says why (runtime/build.py)
    monkeypatch_fell_back = fusec.runtime.build._FELL_BACK
    fusec.runtime.build._FELL_BACK = set()
    try:
        with pytest.warns(UserWarning, match="(?s)CC='fusec-missing-cc'.*llvm backend builds"):
            cf = fusec.compile(lambda x: x * 3, backend="cpp")
            torch.testing.assert_close(cf(x), x * 3)
    finally:
        fusec.runtime.build._FELL_BACK = monkeypatch_fell_back
    assert cf.kernels[0].backend == "llvm"


def test_demo_runs_without_any_compiler(tmp_path):
    """CC points at nothing and PATH holds no compiler at all: `fusec demo` still runs."""
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("CXX",)}
    env.update(CC="/nonexistent/cc", PATH=str(empty), FUSEC_CACHE_DIR=str(tmp_path / "cache"),
               TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "fusec.cli", "demo"], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "llvm" in proc.stdout + proc.stderr
    assert not (tmp_path / "cache" / "cpp").exists()  # nothing went through a C++ compiler
    assert any((tmp_path / "cache" / "llvm").glob("*.o"))


def test_assembly_for_another_cpu():
    """explain(...).assembly(target=...) shows what the same kernel becomes on another CPU:
    SSE's 128-bit xmm registers on baseline x86-64, AVX2's ymm on Haswell, AVX-512's zmm on
    Zen 4 (Intel's AVX-512 CPUs get ymm: LLVM prefers 256-bit vectors there), NEON's v
    registers on AArch64."""
    x = torch.randn(4096)
    e = fusec.explain(lambda x: x * 2 + 1, x, backend="llvm")
    base = e.assembly(0, target="x86-64")
    assert "xmm" in base and "ymm" not in base
    assert "ymm" in e.assembly(0, target="haswell")
    assert "zmm" in e.assembly(0, target="znver4")
    if "aarch64" in llvm_build.available_targets():
        assert re.search(r"\bfadd\s+v\d+\.4s", e.assembly(0, target="aarch64"))
    with pytest.raises(fusec.FusecError, match="unknown or unavailable LLVM target 'pentium'"):
        e.assembly(0, target="pentium")

"""The on-disk cache (fusec/cache.py): a second process compiles nothing, a damaged entry is
detected and rebuilt, and the directory is private (mode 0700).

Cross-process behaviour is tested with real child processes running a small script; each prints
fusec.cache.STATS and its timings as JSON on its last line.
"""
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fusec
from fusec import cache
from fusec.ir import canonical

SCRIPT = textwrap.dedent(r'''
    import json, sys, time
    start = time.perf_counter()
    import torch
    import fusec, fusec.api, fusec.cache, fusec.frontend, fusec.runtime.fast_start.saved
    from fusec.check import compare
    # torch's tracing machinery, which a process's first fusec call imports (a warm start's
    # fingerprint makes fake tensors), not `import fusec` (issue 52): paid here, with the import
    import torch._dynamo, torch._inductor
    import_s = time.perf_counter() - start

    # time the two halves of a compile without importing anything early
    stages = {}
    def timed(owner, name):
        inner = getattr(owner, name)
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                stages[name] = stages.get(name, 0.0) + time.perf_counter() - t
        setattr(owner, name, wrapper)
    timed(fusec.frontend, "capture")       # torch.fx capture (make_fx under fake tensors)
    timed(fusec.api, "compile_graph")      # passes, render, build or load from the cache
    timed(fusec.runtime.fast_start.saved, "load")     # or the whole program, saved by a process before

    def sin4(x):
        return torch.sin(torch.sin(torch.sin(torch.sin(x))))

    x = torch.linspace(-3, 3, 1000)
    before = set(sys.modules)
    t = time.perf_counter()
    y = fusec.compile(sin4, backend=sys.argv[1])(x)
    elapsed = time.perf_counter() - t
    problem = compare(y, sin4(x), sin4(x.double()))
    print(json.dumps({
        "stats": dict(fusec.cache.STATS), "ok": problem is None, "problem": problem,
        "elapsed": elapsed, "import": import_s, "stages": stages,
        "heavy_imported_by_call": [m for m in ("networkx", "llvmlite", "jinja2")
                                   if m in sys.modules and m not in before],
    }))
''')


def run_child(backend: str, cache_dir: Path) -> dict:
    script = cache_dir.parent / "fusec_cache_child.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, FUSEC_CACHE_DIR=str(cache_dir), TRITON_INTERPRET="1", FUSEC_LOG="cache")
    proc = subprocess.run([sys.executable, str(script), backend], capture_output=True, text=True,
                          env=env, cwd=str(cache_dir.parent), timeout=300)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["stats"] = {k: result["stats"].get(k, 0)
                       for k in ("hits", "misses", "compiles", "corrupt", "programs loaded")}
    result["log"] = proc.stderr
    return result


class Runs:
    """Child processes run one after another over one cache directory."""

    def __init__(self, cache_dir, runs):
        self.cache_dir = cache_dir
        self.first, self.second, *rest = runs
        self.third = rest[0] if rest else None


def runs_over_one_cache(tmp_path_factory, backend, n) -> Runs:
    cache_dir = tmp_path_factory.mktemp(f"{backend}-warm") / "cache"
    return Runs(cache_dir, [run_child(backend, cache_dir) for _ in range(n)])


@pytest.fixture(scope="module")
def cpp_runs(tmp_path_factory):
    return runs_over_one_cache(tmp_path_factory, "cpp", 3)


@pytest.fixture(scope="module")
def triton_runs(tmp_path_factory):
    return runs_over_one_cache(tmp_path_factory, "triton", 2)


def copy_cache(runs: Runs, tmp_path: Path) -> Path:
    dst = tmp_path / "cache"
    shutil.copytree(runs.cache_dir, dst)
    return dst


# ---- (a) a second process reuses the cache ------------------------------------------------------

def test_second_process_reuses_cpp_build(cpp_runs):
    first, second = cpp_runs.first, cpp_runs.second
    assert first["ok"] and second["ok"], (first["problem"], second["problem"])
    assert first["stats"]["compiles"] >= 1 and first["stats"]["misses"] >= 1, first["stats"]
    assert second["stats"]["compiles"] == 0, second["stats"]
    assert second["stats"]["misses"] == 0, second["stats"]
    assert second["stats"]["hits"] >= 1, second["stats"]
    assert second["stats"]["corrupt"] == 0, second["stats"]
    assert cpp_runs.third["stats"]["compiles"] == 0 and cpp_runs.third["stats"]["hits"] >= 1
    names = sorted(p.suffix for p in (cpp_runs.cache_dir / "cpp").iterdir())
    assert names == [".cpp", ".json", ".so"], names  # one entry, no temporary files left behind


def test_second_process_reuses_triton_module(triton_runs):
    first, second = triton_runs.first, triton_runs.second
    assert first["ok"] and second["ok"], (first["problem"], second["problem"])
    assert first["stats"]["misses"] >= 1, first["stats"]
    assert second["stats"]["misses"] == 0, second["stats"]
    assert second["stats"]["hits"] >= 1, second["stats"]
    # the module and its compiled Python code (codegen/triton/__init__.py's `_bytecode`), nothing else
    assert sorted(p.suffix for p in (triton_runs.cache_dir / "triton").iterdir()) == [".py", ".pyc"]


# ---- (b) warm-cache latency ---------------------------------------------------------------------
#
# Measured in the child, from `fusec.compile(sin4)` to the result (1000 f32 on CPU, warm cache).
# torch's tracing imports (torch._dynamo / torch._inductor, which make_fx and FakeTensorMode pull
# in, ~1-3 s on this 2-core machine) are paid once per process by its first fusec call (since
# issue 52; `import fusec` stays near torch's own import), so the child imports them before timing:
# the target is fusec's own part of a warm call. It measures ~35-100 ms:
# capture ~15-50 ms, passes ~5-20 ms, render ~2-7 ms, cache lookup + dlopen ~3-8 ms.

def test_warm_cache_compiles_nothing_and_fusec_stages_are_quick(cpp_runs):
    """Regression guard for fusec's own part of a warm start, generous for a loaded 2-core
    machine. The first process saved its program (fusec/runtime/fast_start/saved.py), so the second one
    loads it and its kernels: nothing is captured, no pass runs, nothing is compiled."""
    first, second = cpp_runs.first, cpp_runs.second
    assert "capture" in first["stages"] and "compile_graph" in first["stages"]
    assert second["stats"]["compiles"] == 0 and second["stats"]["programs loaded"] == 1
    assert "capture" not in second["stages"] and "compile_graph" not in second["stages"]
    assert second["stages"]["load"] < 0.5, second["stages"]


def test_warm_call_imports_nothing_heavy(cpp_runs):
    """The warm-cache latency target (< 0.2 s after torch's tracing imports, measured by
    benchmarks/compile_latency.py, not in a timed test) depends on a warm call importing none of
    what compiling needs (fusion's networkx, LLVM's bindings, the templates' jinja2)."""
    assert "jinja2" in cpp_runs.first["heavy_imported_by_call"]  # (the cold call renders)
    for run in (cpp_runs.second, cpp_runs.third):
        assert run["heavy_imported_by_call"] == [], run["stages"]
        assert run["stats"]["compiles"] == 0


# ---- (c) damaged entries are detected and rebuilt -------------------------------------------------

def _garbage(path: Path) -> None:
    path.write_bytes(b"\x7fELF this is not a shared library \x00\xff" * 64)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("damage, suffix", [(_garbage, ".so"), (_truncate, ".so"),
                                            (_truncate, ".json")],
                         ids=["garbage-so", "truncated-so", "truncated-manifest"])
def test_damaged_cpp_entry_is_rebuilt(cpp_runs, tmp_path, damage, suffix):
    cache_dir = copy_cache(cpp_runs, tmp_path)
    (victim,) = (cache_dir / "cpp").glob("*" + suffix)
    damage(victim)
    run = run_child("cpp", cache_dir)
    assert run["ok"], run["problem"]
    assert run["stats"]["corrupt"] >= 1, run["stats"]
    assert run["stats"]["compiles"] >= 1, run["stats"]
    assert "corrupt cache entry" in run["log"]
    # the rebuilt entry is sound again: the manifest matches the library on disk
    (lib,) = (cache_dir / "cpp").glob("*.so")
    assert json.loads(lib.with_suffix(".json").read_text())["sha256"] == cache.file_sha256(lib)


def test_truncated_triton_module_is_rewritten(triton_runs, tmp_path):
    cache_dir = copy_cache(triton_runs, tmp_path)
    (module,) = (cache_dir / "triton").glob("*.py")
    _truncate(module)
    run = run_child("triton", cache_dir)
    assert run["ok"], run["problem"]
    assert run["stats"]["corrupt"] >= 1 and run["stats"]["misses"] >= 1, run["stats"]


def test_binary_garbage_triton_module_is_rewritten(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path))
    from fusec.codegen import triton as triton_backend
    from conftest import TRITON_DEVICE
    cf = fusec.compile(lambda x: torch.sin(x) + 1, backend="triton")
    x = torch.randn(100, device=TRITON_DEVICE)
    cf(x)
    kernel = cf.kernels[0]
    (module,) = (tmp_path / "triton").glob("*.py")
    _garbage(module)
    before = cache.STATS["corrupt"]
    # what a new process would do: the module holds the kernel's canonical source (fusec/build.py)
    triton_backend.load(canonical(kernel.ir), kernel.canonical)
    assert cache.STATS["corrupt"] == before + 1
    assert module.read_text() == kernel.canonical


@pytest.mark.parametrize("manifest", ["", "{", "{}", '{"sha256": 5}', "null", "[]", '"x"'],
                         ids=["empty", "truncated", "no-key", "wrong-type", "null", "list", "str"])
def test_unusable_manifest_counts_as_corrupt(tmp_path, monkeypatch, manifest, request):
    lib = tmp_path / "k.so"
    lib.write_bytes(b"library bytes")
    cache.write_manifest(lib)
    assert cache.verified(lib)
    lib.with_suffix(".json").write_text(manifest)
    before = cache.STATS["corrupt"]
    assert not cache.verified(lib)
    assert cache.STATS["corrupt"] == before + 1


# ---- (d) the directory is private -----------------------------------------------------------------

def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_cache_dir_is_created_0700(tmp_path, monkeypatch):
    root = tmp_path / "deep" / "fusec-cache"
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(root))
    cf = fusec.compile(lambda x: torch.cos(x) * 3, backend="cpp")
    x = torch.randn(10)
    torch.testing.assert_close(cf(x), torch.cos(x) * 3)
    assert _mode(root) == 0o700 and _mode(root / "cpp") == 0o700
    for f in (root / "cpp").iterdir():
        assert not _mode(f) & 0o022, f"{f.name} is writable by others: {oct(_mode(f))}"
    assert cache.cache_dir("triton") == root / "triton" and _mode(root / "triton") == 0o700


def test_default_cache_dir_under_xdg_is_0700(tmp_path, monkeypatch):
    monkeypatch.delenv("FUSEC_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = cache.cache_dir("cpp")
    assert path == tmp_path / "xdg" / "fusec" / "cpp"
    assert _mode(path) == 0o700 and _mode(path.parent) == 0o700


def test_loose_existing_cache_dir_is_tightened(tmp_path, monkeypatch):
    root = tmp_path / "loose"
    (root / "cpp").mkdir(parents=True)
    os.chmod(root, 0o777)
    os.chmod(root / "cpp", 0o755)
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(root))
    cache.cache_dir("cpp")
    assert _mode(root) == 0o700 and _mode(root / "cpp") == 0o700


def test_triton_module_code_is_compiled_once_and_checked(tmp_path):
    """codegen/triton/__init__.py keeps each kernel module's compiled code beside it (`.pyc`, stamped with
    the module's hash), so a warm start does not compile the module's text again, even where
    PYTHONDONTWRITEBYTECODE is set. A damaged or stale file is compiled again, never run."""
    from fusec.codegen import triton as triton_backend

    module = tmp_path / "fused_k-0123.py"
    module.write_text("VALUE = 41 + 1\n")
    first = triton_backend._bytecode(module)
    saved = module.with_suffix(".pyc")
    assert saved.exists()
    namespace: dict = {}
    exec(first, namespace)
    assert namespace["VALUE"] == 42

    saved.write_bytes(saved.read_bytes()[:-3] + b"\x00\x01\x02")  # damaged after its stamp
    namespace = {}
    exec(triton_backend._bytecode(module), namespace)
    assert namespace["VALUE"] == 42

    module.write_text("VALUE = 7\n")  # another text under the same name: the old code is stale
    namespace = {}
    exec(triton_backend._bytecode(module), namespace)
    assert namespace["VALUE"] == 7
    assert saved.read_bytes() != b""  # rewritten for the new text

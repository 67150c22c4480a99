"""Building kernels (fusec/build.py): one build per distinct kernel, builds in parallel, and many
processes compiling into one cold cache at once. Every test compares against eager PyTorch."""
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import fusec
from conftest import assert_matches
from fusec import build, cache
from fusec.codegen.llvm import compiler as llvm_build
from fusec.ir import canonical, family


def layers(x, w):
    """The same pointwise kernel three times over (n, n) buffers, with matmuls (extern calls)
    between them, like the layers of a model."""
    for _ in range(3):
        x = torch.tanh(x) * 0.5 + x
        x = x @ w
    return x


def distinct(cf) -> int:
    return len({id(k.built) for k in cf.kernels})


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_identical_kernels_share_one_build(target, fresh_cache):
    backend, device = target
    x, w = torch.randn(33, 33, device=device), torch.randn(33, 33, device=device) / 6
    before = dict(cache.STATS)
    cf = assert_matches(layers, x, w, backend=backend, kernels=3)
    names = [k.name for k in cf.kernels]
    assert len(set(names)) == 3 and len({family(n) for n in names}) == 1, names
    assert distinct(cf) == 1
    assert len({id(k.launcher) for k in cf.kernels}) == 1  # one loaded binary
    assert cache.STATS["misses"] - before.get("misses", 0) == 1
    # each kernel still reads as itself: its own name, its own buffers, its own ATen nodes
    for k in cf.kernels:
        assert k.name in k.source and k.canonical == cf.kernels[0].canonical
        assert k.name not in k.canonical
    assert len({k.source for k in cf.kernels}) == 3
    # the cache holds the canonical source once, named after the kernel family
    kind = {"cpp": "cpp", "llvm": "llvm", "triton": "triton"}[backend]
    files = sorted(p.name for p in (fresh_cache / kind).iterdir())
    assert all(f.startswith(family(names[0]) + "-") for f in files), files
    source_suffix = {"cpp": ".cpp", "llvm": ".ll", "triton": ".py"}[backend]
    (source_file,) = [p for p in (fresh_cache / kind).iterdir() if p.suffix == source_suffix]
    assert source_file.read_text() == cf.kernels[0].canonical


def test_different_strides_or_dtypes_are_not_shared(target, fresh_cache):
    backend, device = target

    def f(a, b, c):
        return torch.tanh(a) * 0.5 + a, torch.tanh(b) * 0.5 + b, torch.tanh(c) * 0.5 + c

    a = torch.randn(20, 30, device=device)
    b = torch.randn(20, 60, device=device)[:, ::2]  # the same shape, other strides
    c = torch.randn(20, 30, device=device, dtype=torch.float64)
    cf = assert_matches(f, a, b, c, backend=backend)
    assert distinct(cf) == len(cf.kernels)


def test_same_source_other_dtype_gets_its_own_launcher(target, fresh_cache):
    """A Triton kernel's source does not spell its pointers' dtypes (the JIT specializes on them
    at the first launch, and the launcher keeps that compiled kernel), so a float32 program and a
    float64 one with the same source text must not share a launcher. Found on an H100: a
    float32 softmax ran the float64 binary that an earlier program had bound."""
    backend, device = target

    def f(a):
        return torch.softmax(a, dim=1)

    a = torch.randn(6, 7, 9, device=device)
    cf32 = assert_matches(f, a, backend=backend)
    cf64 = assert_matches(f, a.double(), backend=backend)
    assert cf32(a).dtype == torch.float32
    assert {id(k.launcher) for k in cf32.kernels}.isdisjoint(id(k.launcher) for k in cf64.kernels)
    assert_matches(f, a, backend=backend)  # after the float64 program, float32 is still right


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_repeated_module_layers_match_eager(target, dtype, fresh_cache):
    backend, device = target
    torch.manual_seed(0)
    block = lambda: torch.nn.Sequential(torch.nn.Linear(24, 24), torch.nn.GELU(),  # noqa: E731
                                        torch.nn.LayerNorm(24))
    model = torch.nn.Sequential(*(block() for _ in range(4))).to(device, dtype).eval()
    x = torch.randn(7, 5, 24, device=device, dtype=dtype)
    x[0, 0, 3] = float("nan")
    with torch.no_grad():
        cf = fusec.compile(model, backend=backend, check=True)
        got = cf(x)
        want = model(x)
    assert torch.isnan(got[0, 0]).all() == torch.isnan(want[0, 0]).all()
    torch.testing.assert_close(got[1:], want[1:], atol=5e-2 if dtype != torch.float32 else 1e-4,
                               rtol=5e-2 if dtype != torch.float32 else 1e-4)
    assert distinct(cf) < len(cf.kernels), [k.name for k in cf.kernels]


def test_non_contiguous_and_empty_inputs(target, fresh_cache):
    backend, device = target
    x = torch.randn(40, 33, device=device)[::2].t()  # (33, 20), strided
    w = torch.randn(20, 20, device=device) / 5
    assert_matches(lambda x, w: layers(x[:20], w), x, w, backend=backend)
    e = torch.randn(0, 7, device=device)
    assert_matches(lambda e: (torch.tanh(e) * 0.5 + e, torch.tanh(e + 1) * 0.5), e,
                   backend=backend)


def test_canonical_renames_one_to_one():
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    cf = fusec.compile(layers, backend="cpp")
    cf(x, w)
    first, second = (canonical(k.ir) for k in cf.kernels[:2])
    assert repr(first) == repr(second)
    k = cf.kernels[0].ir
    assert [p.name for p in first.params] == [f"{'out' if p.is_output else 'in'}{i}"
                                              for i, p in enumerate(k.params)]
    vars_ = [l.var.name for l in first.loads] + [s.var.name for s in first.stmts]
    assert len(set(vars_)) == len(vars_)
    assert all(s.origin.startswith("aten.") for s in first.stmts)


def test_a_second_program_in_the_process_loads_nothing_again(fresh_cache):
    x, w = torch.randn(16, 16), torch.randn(16, 16) / 4
    one = fusec.compile(layers, backend="cpp")
    one(x, w)
    before = dict(cache.STATS)
    two = fusec.compile(lambda x, w: layers(x, w), backend="cpp")  # another compiled object
    torch.testing.assert_close(two(x, w), layers(x, w))
    assert {id(k.launcher) for k in two.kernels} == {id(one.kernels[0].launcher)}
    assert cache.STATS["hits"] == before.get("hits", 0)  # not even a look at the disk
    assert cache.STATS["compiles"] == before.get("compiles", 0)


# ---- parallel builds ------------------------------------------------------------------------------

def many(x, w):
    """Five different kernels (different ops), each separated by an extern call."""
    outs = []
    for op in (torch.sin, torch.cos, torch.tanh, torch.exp, torch.sigmoid):
        x = op(x) * 0.5 + 1
        x = x @ w
        outs.append(x)
    return outs


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_builds_run_at_the_same_time(backend, fresh_cache, monkeypatch):
    """Two builds must be in flight at once: each waits at a barrier for another one, which a
    one-at-a-time build would never reach (the barrier times out)."""
    module = build.codegen(backend)
    inner = module.build
    meet = threading.Barrier(2, timeout=60)
    met, entered, lock = [], [], threading.Lock()

    def build_and_meet(source, name):
        with lock:  # only the first two builds wait (a third must not wait for a fourth)
            first_two = len(entered) < 2
            entered.append(name)
        if first_two:
            met.append(meet.wait())
        return inner(source, name)

    monkeypatch.setattr(module, "build", build_and_meet)
    monkeypatch.setenv("FUSEC_COMPILE_JOBS", "3")
    x, w = torch.randn(9, 9), torch.randn(9, 9) / 3
    cf = assert_matches(many, x, w, backend=backend)
    assert sorted(met) == [0, 1] and distinct(cf) == 5


def test_llvm_workers_compile_at_the_same_time():
    """The pool starts a second compiler process when the first is busy."""
    meet = threading.Barrier(2, timeout=60)

    class Waiting(llvm_build.Worker):
        def compile(self, *args):
            meet.wait()
            return super().compile(*args)

    pool = llvm_build.WorkerPool(Waiting)
    source = "define void @f() {\n  ret void\n}"
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        pool.compile(source, llvm_build.host(), "object", "f"))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert len(results) == 2 and all(r[:4] == b"\x7fELF" for r in results)
        assert len(pool.workers) == 2 and len({w.proc.pid for w in pool.workers}) == 2
    finally:
        pool.close()


def test_compile_jobs_setting(monkeypatch):
    monkeypatch.setenv("FUSEC_COMPILE_JOBS", "3")
    assert build.jobs() == 3
    monkeypatch.setenv("FUSEC_COMPILE_JOBS", "many")
    with pytest.raises(fusec.FusecError, match="FUSEC_COMPILE_JOBS"):
        build.jobs()
    monkeypatch.delenv("FUSEC_COMPILE_JOBS")
    assert build.jobs() >= 1


def test_a_failed_build_among_parallel_ones_falls_back(fresh_cache, monkeypatch):
    """One kernel's gcc fails while others build: that kernel alone goes to LLVM."""
    from fusec.codegen import cpp
    from fusec.errors import CompileError
    inner = cpp.build

    def failing(source, name):
        if "_cos_" in name:
            raise CompileError(f"fusec: pretend g++ failed on {name}")
        return inner(source, name)

    monkeypatch.setattr(cpp, "build", failing)
    monkeypatch.setattr(build, "_FELL_BACK", set())
    x, w = torch.randn(9, 9), torch.randn(9, 9) / 3
    with pytest.warns(UserWarning, match="llvm backend builds fused_cos"):
        cf = assert_matches(many, x, w, backend="cpp")
    assert [k.backend for k in cf.kernels] == ["cpp", "llvm", "cpp", "cpp", "cpp"]
    assert "define" in cf.kernels[1].source  # its source is the LLVM IR that was built


# ---- several processes, one cold cache -------------------------------------------------------------

CHILD = textwrap.dedent(r'''
    import json, sys, torch, fusec
    from fusec.check import compare
    backend = sys.argv[1]

    def model(x, w):
        outs = []
        for op in (torch.sin, torch.tanh, torch.sin, torch.tanh):
            x = op(x) * 0.5 + x
            x = torch.softmax(x @ w, dim=-1) * 3
            outs.append(x)
        return outs

    torch.manual_seed(0)
    x, w = torch.randn(37, 29), torch.randn(29, 29) / 5
    got = fusec.compile(model, backend=backend)(x, w)
    want = model(x, w)
    ref = model(x.double(), w.double())
    problems = [compare(g, e, r) for g, e, r in zip(got, want, ref)]
    print(json.dumps({"problems": [p for p in problems if p], "stats": dict(fusec.cache.STATS)}))
''')


@pytest.mark.parametrize("backend", ["cpp", "llvm", "triton"])
def test_concurrent_compiles_into_one_cold_cache(backend, tmp_path):
    """Three processes compile the same program into one empty cache at the same time: every one
    gets eager's results, each kernel is built once (cache.build_once's lock across processes),
    the cache ends with one sound entry per distinct kernel and no temporary or lock files, and a
    fourth process compiles nothing."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    root = tmp_path / "cache"
    env = dict(os.environ, FUSEC_CACHE_DIR=str(root), TRITON_INTERPRET="1",
               FUSEC_COMPILE_JOBS="2")

    def start():
        return subprocess.Popen([sys.executable, str(script), backend], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def finish(proc) -> dict:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        return json.loads(out.strip().splitlines()[-1])

    results = [finish(p) for p in [start() for _ in range(3)]]
    assert all(r["problems"] == [] for r in results), results
    kind = root / backend
    files = sorted(kind.iterdir())
    assert not [f for f in files if f.name.endswith(".tmp")], files
    if backend == "triton":
        modules = [f for f in files if f.suffix == ".py"]
        assert modules and len(files) == 2 * len(modules)  # each module and its compiled code
        assert {f.stem for f in files} == {m.stem for m in modules}
    else:
        binaries = [f for f in files if f.suffix == (".so" if backend == "cpp" else ".o")]
        assert binaries and all(cache.verified(b) for b in binaries)
        assert len(files) == 3 * len(binaries)  # source, binary, manifest (no lock file left)
        # each kernel built by one process: the others waited on its lock and loaded it
        assert sum(r["stats"].get("compiles", 0) for r in results) == len(binaries), results
    again = finish(start())
    assert again["problems"] == [] and again["stats"].get("compiles", 0) == 0
    assert again["stats"].get("misses", 0) == 0


def test_every_triton_module_can_compile_ahead(fresh_cache):
    """Each Triton template has `compile_ahead(*dtypes)` (fusec/build.py calls it on a GPU before
    the first run). Under the interpreter Triton's warmup compiles nothing; this checks that the
    function is there for pointwise, tiled and reduction kernels and takes one dtype per pointer."""
    from conftest import TRITON_DEVICE

    def f(x, y):
        a = torch.sin(x) + y                   # pointwise
        b = (x.t() * 2).contiguous()           # a transposing copy: the tiled template
        c = torch.softmax(x, dim=-1)           # a reduction
        return a, b, c

    x, y = torch.randn(64, 48, device=TRITON_DEVICE), torch.randn(48, device=TRITON_DEVICE)
    cf = assert_matches(f, x, y, backend="triton")
    templates = {k.source.split("templates/")[1].split()[0].rstrip(".") for k in cf.kernels}
    assert {"triton_pointwise.py.j2", "triton_pointwise_tiled.py.j2",
            "triton_reduction.py.j2"} <= templates, templates
    for k in cf.kernels:
        k.launcher.module.compile_ahead(*[p.dtype for p in k.ir.params])


def test_kernels_found_in_the_cache_are_made_ready_one_by_one(monkeypatch):
    """On a GPU, kernels whose modules an earlier process wrote are loaded from Triton's cache
    one after another (threads only fight over Python's lock there); the first that takes long
    (Triton's cache was emptied: a real compile) hands the rest to the threads."""
    from fusec.runtime import build as runtime_build

    done = []

    def compile_one(name):
        done.append(name)
        if name == "slow":
            runtime_build.time.sleep(runtime_build.SLOW_LOAD_S * 1.5)

    assert runtime_build.one_by_one(["a", "b", "c"], compile_one) == []
    assert done == ["a", "b", "c"]
    done.clear()
    assert runtime_build.one_by_one(["a", "slow", "b", "c"], compile_one) == ["b", "c"]
    assert done == ["a", "slow"]
    done.clear()  # the first pays for Triton's own start: not timed
    assert runtime_build.one_by_one(["slow", "b", "c"], compile_one) == []

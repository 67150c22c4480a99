"""The C++ prelude is precompiled once into the cache (codegen/cpp/precompiled.py): kernels built
with it give eager's answers, it is an entry the size cap can evict like any other, and a cache
capped too small for it never gets one."""
import os
import time

import pytest
import torch

import fusec
from fusec import cache

from fusec.codegen import cpp
from fusec.codegen.cpp import precompiled

pytestmark = pytest.mark.skipif(
    not precompiled.is_gcc(cpp.compiler_id(cpp.find_compiler())),
    reason="only gcc reads a precompiled header by itself")


def _kernels(c: float):
    """Compile and check three different C++ kernels (the prelude is precompiled at the third
    kernel a process builds into a cache: precompiled.PRECOMPILE_AT). `c`: a constant of the
    kernels, different in each test (a kernel this process loaded already is not built again)."""
    x = torch.randn(37, 53)
    for fn in (lambda t: torch.sigmoid(t) * t + c, lambda t: (t * c).softmax(-1),
               lambda t: (t.abs() + c).amax(0)):
        torch.testing.assert_close(fusec.compile(fn, backend="cpp")(x), fn(x))


def test_kernels_use_the_compiled_prelude_and_match_eager(fresh):
    assert precompiled.PRECOMPILE_AT == 3
    before = cache.STATS["prelude compiles"]
    _kernels(1.5)
    (gch,) = (fresh / "cpp-prelude").glob("*/cpp_prelude.h.gch")
    assert cache.verified(gch) and gch.with_suffix("").exists()  # the header it was built from
    assert cache.STATS["prelude compiles"] == before + 1
    x = torch.randn(5, 300)  # a kernel compiled with it
    torch.testing.assert_close(fusec.compile(lambda t: torch.tanh(t) - t, backend="cpp")(x),
                               torch.tanh(x) - x)


def test_a_time_out_while_precompiling_does_not_count_against_gcc(fresh, monkeypatch):
    from fusec.codegen import tools
    monkeypatch.setattr(tools, "_TIMED_OUT", {})
    monkeypatch.setattr(precompiled, "_compiled_here", {})
    monkeypatch.setenv("FUSEC_BUILD_TIMEOUT", "1")
    real = tools.run
    calls = []

    def slow_precompile(cmd, what, limit=None, counted=True):
        if "precompiling" in what:  # a gcc that takes longer than the limit (no sleep needed)
            calls.append(counted)
            return real(["sleep", "5"], what, limit, counted)
        return real(cmd, what, 300, counted)  # the kernels themselves: no limit to hit here
    monkeypatch.setattr(tools, "run", slow_precompile)
    _kernels(2.5)
    assert calls == [False] and tools._TIMED_OUT == {}
    assert not list(fresh.rglob("*.gch"))


def test_a_small_cap_gets_no_compiled_prelude(fresh, monkeypatch):
    monkeypatch.setenv("FUSEC_CACHE_MAX_MB", str(precompiled.SMALLEST_CAP_MB - 1))
    _kernels(3.5)
    assert not list(fresh.rglob("*.gch"))


def test_the_size_cap_evicts_an_old_compiled_prelude_with_its_folder(fresh):
    _kernels(4.5)
    (gch,) = (fresh / "cpp-prelude").glob("*/cpp_prelude.h.gch")
    then = time.time() - 3600
    for p in gch.parent.iterdir():
        os.utime(p, (then, then))
    assert cache.evict(limit=1 << 20) >= 1
    assert not gch.parent.exists()
    assert list((fresh / "cpp").glob("*.so"))  # the kernels, used just now, stay

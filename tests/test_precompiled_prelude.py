"""The C++ prelude is precompiled once into the cache (codegen/cpp/precompiled.py): kernels built
with it give eager's answers, it is an entry the size cap can evict like any other, and a cache
capped too small for it never gets one."""
import os
import time

import pytest
import torch

import fusec
from fusec import cache

from codegen import cpp
from codegen.cpp import precompiled

pytestmark = pytest.mark.skipif(
    not precompiled.is_gcc(cpp.compiler_id(cpp.find_compiler())),
    reason="only gcc reads a precompiled header by itself")


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(root))
    monkeypatch.setenv("FUSEC_SAVED_PROGRAMS", "0")
    return root


def _two_kernels():
    """Compile and check two different C++ kernels (the prelude is precompiled from the second
    kernel a process builds)."""
    x = torch.randn(37, 53)
    for fn in (lambda t: torch.sigmoid(t) * t + 1, lambda t: t.softmax(-1)):
        torch.testing.assert_close(fusec.compile(fn, backend="cpp")(x), fn(x))


def test_kernels_use_the_compiled_prelude_and_match_eager(fresh):
    before = cache.STATS["prelude compiles"]
    _two_kernels()
    (gch,) = (fresh / "cpp-prelude").glob("*/cpp_prelude.h.gch")
    assert cache.verified(gch) and gch.with_suffix("").exists()  # the header it was built from
    assert cache.STATS["prelude compiles"] == before + 1


def test_a_small_cap_gets_no_compiled_prelude(fresh, monkeypatch):
    monkeypatch.setenv("FUSEC_CACHE_MAX_MB", str(precompiled.SMALLEST_CAP_MB - 1))
    _two_kernels()
    assert not list(fresh.rglob("*.gch"))


def test_the_size_cap_evicts_an_old_compiled_prelude_with_its_folder(fresh):
    _two_kernels()
    (gch,) = (fresh / "cpp-prelude").glob("*/cpp_prelude.h.gch")
    then = time.time() - 3600
    for p in gch.parent.iterdir():
        os.utime(p, (then, then))
    assert cache.evict(limit=1 << 20) >= 1
    assert not gch.parent.exists()
    assert list((fresh / "cpp").glob("*.so"))  # the kernels, used just now, stay

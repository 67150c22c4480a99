"""The prelude, compiled once: a precompiled header for cpp_prelude.h.

Every C++ kernel opens with `#include "cpp_prelude.h"`: 600 lines of helpers and the standard
headers they include (<cmath>, <algorithm>, <immintrin.h>...). Parsing them is most of what gcc
does for a small kernel: 0.9 s of the 1.2 s a one-line `abs` kernel took to compile on a 2-core
AMD EPYC, where the same kernel took 0.08 s with the header precompiled. So the C++ backend
compiles the prelude once per compiler, flags and CPU into a precompiled header (gcc's `.gch`,
clang reads its own `.pch` only when told: it compiles the header as before) and puts its folder
first on the include path:

    <cache>/cpp-prelude/<hash>/cpp_prelude.h.gch   the compiled header
    <cache>/cpp-prelude/<hash>/cpp_prelude.h       the header itself, as it was compiled

gcc takes the `.gch` when it finds one beside the header it looks for and was built with the
same options that change code; otherwise it reads the header as usual, so a missing, stale or
refused file only costs time, never a different answer. The kernel's own `#define`s come after
its include, so they do not stop gcc from using it.

The precompiled header is built at the second kernel a process compiles (a program with one
small kernel, or a test with a fresh cache, does not pay its 2-3 s), through the cache's
`build_once` like every artifact (signed, one build when processes race); a failure is logged and
kernels compile from the header, as they did before it existed.
"""
from __future__ import annotations

import functools
import os
import threading
from pathlib import Path

from fusec import cache
from fusec.errors import CompileError

from .. import tools

HEADER = "cpp_prelude.h"
# gcc's compiled prelude is about 40 MB; a cache capped below this many megabytes would spend a
# large share of its room on it, so under such a cap kernels read the header instead
SMALLEST_CAP_MB = 256
_compiled_here = 0  # kernels this process compiled (the header is precompiled from the second)
_LOCK = threading.Lock()


def include_flags(compiler: str, version: str, flags: list[str], key: str, header_text: str,
                  templates: Path) -> list[str]:
    """The include path for a kernel about to be compiled with `compiler` (`version`: the first
    line of its --version) and `flags`: the precompiled prelude's folder first when there is one
    (built here from the second kernel on), then the templates folder. `key` names the compiler,
    flags and CPU."""
    global _compiled_here
    with _LOCK:
        _compiled_here += 1
        wanted = _compiled_here >= 2 and _room_for_it()
    found = _precompiled(cache.root(), compiler, tuple(flags), key, header_text) if wanted and \
        is_gcc(version) else None
    return ([f"-I{found}"] if found else []) + [f"-I{templates}"]


def _room_for_it() -> bool:
    if cache.max_bytes() >= SMALLEST_CAP_MB << 20:
        return True
    cache.log(f"no precompiled prelude: FUSEC_CACHE_MAX_MB={cache.max_bytes() >> 20} leaves no "
              f"room for it (about 40 MB); kernels read {HEADER} as it is")
    return False


def is_gcc(version: str) -> bool:
    """Only gcc looks for `<header>.gch` by itself; clang would need `-include-pch`."""
    name = version.lower()
    return "clang" not in name and ("gcc" in name or "g++" in name or "free software" in name)


@functools.lru_cache(maxsize=None)
def _precompiled(root: Path, compiler: str, flags: tuple[str, ...], key: str,
                 header_text: str) -> Path | None:
    """The folder holding the precompiled prelude for these options in the cache at `root`, built
    if needed; None (and a log line) when it cannot be built. Once per process, cache and
    options."""
    folder = cache.cache_dir("cpp-prelude") / cache.content_hash(header_text, key)
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        artifact = folder / (HEADER + ".gch")
        # the header is written beside it as its source (`build_once` writes `source` to the
        # artifact's name less its suffix: cpp_prelude.h)
        cache.build_once(artifact, header_text, "", functools.partial(
            _compile, compiler, flags, folder / HEADER), counted_as="prelude ")
        return folder
    except (CompileError, OSError) as err:
        cache.log(f"no precompiled prelude ({str(err).splitlines()[0][:200]}): kernels read "
                  f"{HEADER} as it is")
        return None


def _compile(compiler: str, flags: tuple[str, ...], header: Path, out: Path) -> None:
    """Compile `header` as a C++ header with `flags` (the kernels' own, less those that only
    link) to `out`."""
    cmd = [compiler, *flags, "-x", "c++-header", str(header), "-o", str(out)]
    result = tools.run(cmd, f"precompiling {HEADER}")
    if result.returncode != 0 or not os.path.getsize(out):
        raise CompileError(f"fusec: {os.path.basename(compiler)} could not precompile {HEADER}: "
                           f"{(result.stderr.strip() or result.stdout)[-400:]}")

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

The precompiled header is built at the third kernel a process compiles into a cache (a program
with a kernel or two, or a test with a fresh cache, does not pay its 2-3 s), through the cache's
`build_once` like every artifact (signed, one build when processes race, evicted by the size cap
with its folder; none at all under a cap below SMALLEST_CAP_MB); a failure or a time-out is
logged, does not count against the compiler (codegen/tools.py gives up on a tool that keeps
timing out), and kernels compile from the header, as they did before it existed.
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
# the header is precompiled at the PRECOMPILE_AT-th kernel this process compiles into one cache:
# it costs two or three kernels' time, so a program (or a test with a cache of its own) that
# builds a kernel or two never pays it
PRECOMPILE_AT = 3
_compiled_here: dict[Path, int] = {}  # cache root -> kernels this process compiled into it
_LOCK = threading.Lock()


def include_flags(compiler: str, version: str, flags: list[str], key: str, header_text: str,
                  templates: Path) -> list[str]:
    """The include path for a kernel about to be compiled with `compiler` (`version`: the first
    line of its --version) and `flags`: the precompiled prelude's folder first when there is one
    (built here from the PRECOMPILE_AT-th kernel on), then the templates folder. `key` names the compiler,
    flags and CPU."""
    root = cache.root()
    with _LOCK:
        _compiled_here[root] = _compiled_here.get(root, 0) + 1
        wanted = _compiled_here[root] >= PRECOMPILE_AT and _room_for_it()
    found = _precompiled(root, compiler, tuple(flags), key, header_text) if wanted and \
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
    # (a time-out here is not the kernels' compiler hanging: it does not count towards giving
    # up on it, codegen/tools.py)
    result = tools.run(cmd, f"precompiling {HEADER}", counted=False)
    if result.returncode != 0 or not os.path.getsize(out):
        raise CompileError(f"fusec: {os.path.basename(compiler)} could not precompile {HEADER}: "
                           f"{(result.stderr.strip() or result.stdout)[-400:]}")

"""Triton's own cache key, remembered from one process to the next.

Every Triton compile, even one that finds its binary in Triton's cache, keys that cache by
`triton_key()`: Triton's version plus a sha256 of its Python sources and of its compiler library
(`libtriton.so`, hundreds of MB). It is computed once per process and takes 0.4-0.45 s (an H200's
host, and this project's CPU). `codegen/triton/__init__.py` already works it out in a thread while the model
is captured. With a saved program (fusec/runtime/fast_start/) nothing is captured, and a warm start
of ResNet-50 spent 0.2 s of its 1.1 waiting for that hash.

The key only changes when Triton's files do. So the first process that computes it writes it to
fusec's cache under a *stamp* of the installation: every .py and .so file of the triton package,
with its size and modification time (165 files, 3 ms to stat). A later process with the same stamp
reads the key back and hands it to Triton, the way Triton's own compile-warm-up pool hands its
workers the parent's key: by replacing the module attribute `triton_key` (in every loaded Triton
module that holds the original function) with one that returns the remembered value.

Best effort, and never wrong: a Triton without `triton.runtime.cache.triton_key` computes its key
as before; a changed installation has another stamp; an unreadable file is a miss.
"""
from __future__ import annotations

import hashlib
import os
import sys

from fusec import cache


def remember(compute: bool) -> bool:
    """Hand Triton its key from the disk if an earlier process saved it for this installation
    (returns True), else, when `compute`, work it out now and save it (the caller runs this in a
    thread). Never raises."""
    try:
        from triton.runtime import cache as triton_cache
        original = triton_cache.triton_key
        path = cache.cache_dir("triton-key") / f"{_stamp(os.path.dirname(triton_cache.__file__))}.txt"
        if cache.verified(path):
            key = path.read_text()
            _install(original, key)
            return True
        if compute:
            key = original()
            cache.atomic_write(path, key)
            cache.write_manifest(path)
    except Exception:  # noqa: BLE001 - Triton computes its key itself, as it always did
        pass
    return False


def _stamp(runtime_dir: str) -> str:
    """A hash of the triton package's .py and .so files: names, sizes, modification times."""
    import triton
    root = os.path.dirname(os.path.abspath(runtime_dir))  # the triton package
    h = hashlib.sha256(f"{triton.__version__} {root}".encode())
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith((".py", ".so")):
                st = os.stat(os.path.join(folder, name))
                h.update(f"{folder}/{name} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:24]


def _install(original, key: str) -> None:
    """Make every loaded Triton module that calls `triton_key` get `key` (modules imported later
    take the attribute from triton.runtime.cache, which holds it too)."""
    def triton_key() -> str:
        return key
    triton_key.remembered_by_fusec = True
    for name, module in list(sys.modules.items()):
        if (name == "triton" or name.startswith("triton.")) and \
                getattr(module, "triton_key", None) is original:
            module.triton_key = triton_key

"""Launchers: a kernel loaded again from its cached file.

`load_launcher(path)` loads a kernel from its cached artifact (a C++ `.so`, an LLVM `.o`, a
Triton module) into something callable. The program as shown (`cf.source()`, written by
writer.py's `python_wrapper`) loads its kernels this way, so it runs on its own.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from fusec import cache
from fusec.codegen.cpp import CppLauncher
from fusec.codegen.llvm import LlvmLauncher
from fusec.runtime.fast_start.triton_launch import TritonLauncher
from fusec.errors import FusecError


def load_launcher(path: str, name: str = "", n_params: int = 0, n_sizes: int = 0):
    """A kernel launcher from its cached artifact: a C++ shared library, an LLVM object file or a
    Triton module. Only a file this user built is loaded (fusec/cache.py: a binary with its
    signed manifest, a module this user owns and nobody else can write)."""
    why = _untrusted(path)
    if why:
        raise FusecError(f"fusec: not loading {path}: {why}; compile the program again")
    if path.endswith(".so"):
        return CppLauncher(Path(path), name, n_params, n_sizes)
    if path.endswith(".o"):  # LLVM object code, loaded by llvmlite's JIT
        return LlvmLauncher(Path(path), name, n_params, n_sizes)
    spec = importlib.util.spec_from_file_location(f"fusec_wrapper_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return TritonLauncher(module, Path(path), name, n_params, n_sizes)


def _untrusted(path: str) -> str | None:
    """Why `path` is not a kernel this user built (fusec/cache.py's checks), or None."""
    try:
        cache.read_bytes(Path(path))  # this user's, and nobody else can write it
    except OSError as err:
        return err.strerror or str(err)
    if path.endswith((".so", ".o")) and cache.read_verified(Path(path), touch=False) is None:
        return "its manifest is missing, does not match it, or is not signed with this user's key"
    return None

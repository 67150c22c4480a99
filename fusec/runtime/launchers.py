"""Launchers: a kernel loaded again from its cached file.

`load_launcher(path)` loads a kernel from its cached artifact (a C++ `.so`, an LLVM `.o`, a
Triton module) into something callable. The program as shown (`cf.source()`, written by
writer.py's `python_wrapper`) loads its kernels this way, so it runs on its own.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from fusec.codegen.cpp import CppLauncher
from fusec.codegen.llvm import LlvmLauncher
from fusec.codegen.triton_launch import TritonLauncher


def load_launcher(path: str, name: str = "", n_params: int = 0):
    """A kernel launcher from its cached artifact: a C++ shared library, an LLVM object file or a
    Triton module."""
    if path.endswith(".so"):
        return CppLauncher(Path(path), name, n_params)
    if path.endswith(".o"):  # LLVM object code, loaded by llvmlite's JIT
        return LlvmLauncher(Path(path), name, n_params)
    spec = importlib.util.spec_from_file_location(f"fusec_wrapper_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return TritonLauncher(module, Path(path), name, n_params)

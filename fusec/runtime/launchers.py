"""Launchers and the program as Python: what `cf.source()` shows, and how it runs on its own.

`load_launcher(path)` loads a kernel from its cached artifact (a C++ `.so`, an LLVM `.o`, a
Triton module) into something callable; `python_wrapper(program)` writes the whole program as a
runnable `call(*inputs)` function that loads its kernels that way, like torch.compile's output code.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from fusec.codegen.cpp import CppLauncher
from fusec.codegen.llvm import LlvmLauncher
from fusec.codegen.triton_launch import TritonLauncher
from fusec.runtime.program import Program
from fusec.runtime.steps import ExternStep, GetItemStep, KernelStep, SlotRef, ViewStep


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


def python_wrapper(program: Program) -> str:
    """The program as a runnable Python function `call(*inputs)`, like torch.compile's output
    code: one line per step, buffers named after the graph's values. Exec it and call it."""
    names = program.slot_names
    lines = ["import torch", "from fusec.runtime import load_launcher", ""]
    kernels = [s for s in program.steps if isinstance(s, KernelStep)]
    for step in kernels:
        launcher = step.launcher
        if hasattr(launcher, "lib"):
            lines.append(f"{step.name} = load_launcher({str(launcher.lib)!r}, {launcher.name!r}, "
                         f"{launcher.n_params})")
        else:
            path = sys.modules[launcher.__module__].__file__
            lines.append(f"{step.name} = load_launcher({path!r}, {step.name!r})")
    pool_bytes = program.memory.pool_bytes if program.memory is not None else 0
    device = kernels[0].device if kernels else torch.device("cpu")
    lines += ["", "# intermediate buffers share one pool (passes/schedule.py plans the offsets)",
              f"pool = torch.empty({max(pool_bytes, 1)}, dtype=torch.uint8, device={str(device)!r})",
              "", "", f"def call({', '.join(names[s] for s in program.input_slots)}):"]

    def ref(a):
        return names[a.slot] if isinstance(a, SlotRef) else repr(a)

    def render_args(value):
        if isinstance(value, SlotRef):
            return names[value.slot]
        if isinstance(value, (list, tuple)):
            inner = ", ".join(render_args(v) for v in value)
            return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
        if isinstance(value, torch.dtype):
            return str(value)
        if isinstance(value, torch.device):
            return f"torch.device({str(value)!r})"
        return repr(value)

    for slot, tensor in program.constants:
        lines.append(f"    {names[slot]} = ...  # a constant tensor of the graph, {tuple(tensor.shape)}")
    for step in program.steps:
        if isinstance(step, KernelStep):
            for w in step.writes:
                n = names[w.slot]
                if w.inplace is not None:
                    src = names[w.inplace]
                    lines.append(f"    {n} = {src}.as_strided({w.shape}, {w.stride}, "
                                 f"{src}.storage_offset())  # written over {src}: its last use")
                elif w.offset is not None:
                    lines.append(f"    {n} = pool[{w.offset}:{w.offset + w.nbytes}].view({w.dtype})"
                                 f".as_strided({w.shape}, {w.stride})")
                else:
                    lines.append(f"    {n} = torch.empty_strided({w.shape}, {w.stride}, "
                                 f"dtype={w.dtype}, device={str(step.device)!r})")
            args = [names[r] for r in step.reads] + [names[w.slot] for w in step.writes]
            lines.append(f"    {step.name}({', '.join(args)})")
        elif isinstance(step, ExternStep):
            args = ", ".join(render_args(a) for a in step.args)
            kwargs = "".join(f", {k}={render_args(v)}" for k, v in step.kwargs.items())
            lines.append(f"    {names[step.out_slot]} = torch.ops.{step.name}({args}{kwargs})")
        elif isinstance(step, ViewStep):
            lay = step.layout
            lines.append(f"    {names[step.out_slot]} = {names[step.root]}.as_strided({lay.shape}, "
                         f"{lay.stride}, {names[step.root]}.storage_offset() + {lay.offset})")
        elif isinstance(step, GetItemStep):
            lines.append(f"    {names[step.out_slot]} = {names[step.src]}[{step.index}]")
    lines.append(f"    return [{', '.join(names[s] for s in program.output_slots)}]")
    return "\n".join(lines) + "\n"

"""The last fallback: a fused group that no backend could build runs its ATen ops eagerly.

fusec/runtime/build.py tries a kernel's backend, then the other CPU backend (codegen/backends.py's
`fallback`). When neither builds it, or a Triton kernel fails to compile at its first launch
(Triton compiles lazily, and a compiler bug such as "operand #1 does not dominate this use" shows
only then), the program must still run and still give eager's answer. Every fused group is an
fx sub-graph of ATen ops (passes/grouping.py), kept by the scheduled graph as a submodule, so
`EagerGroup` runs that sub-graph with torch, in place of the kernel:

    kernel:  launcher(x_root, w_root, out_root)           reads and writes root buffers
    eager:   x = x_root.as_strided(<x's layout>)  ...     the group's inputs, as views
             outs = sub(x, w)                             its ATen ops, one by one
             out_root.as_strided(<out's layout>).copy_(outs[0])

It is called exactly like the kernel's launcher (the root buffers of its parameters, inputs then
outputs: fusec.ir's `params`), so the program's step, its buffers and its memory plan stay as
they are; only that one step is slower. `fall_back` makes it, writes a repro file (the error,
the kernel's source and the group's graph) and warns once per kernel, naming both.
"""
from __future__ import annotations

import warnings

import torch
import torch.fx as fx

from fusec import cache, symbolic
from fusec.errors import CompileError, FallbackWarning, FusecError  # noqa: F401 (FallbackWarning: its old home)
from fusec.ir import Layout


class EagerGroup:
    """A fused group's sub-graph, called like its kernel (see the module docstring)."""

    def __init__(self, name: str, sub: fx.GraphModule, params: list, in_layouts: list[Layout],
                 out_layouts: list[Layout]):
        at = {p.name: i for i, p in enumerate(params)}
        missing = [l.root for l in (*in_layouts, *out_layouts) if l.root not in at]
        if missing:  # (an input the kernel never reads, as an indexed write's buffer)
            raise CompileError(f"fusec: kernel {name} cannot run eagerly either: its kernel does "
                               f"not take {', '.join(missing)}")
        self.name, self.sub = name, sub
        self.inputs = [(at[l.root], l) for l in in_layouts]
        self.outputs = [(at[l.root], l) for l in out_layouts]
        self.n_params = len(params)
        self.symbols = symbolic.symbols_in_order(in_layouts, out_layouts)

    def __call__(self, *args) -> None:
        tensors, sizes = args[:self.n_params], args[self.n_params:]  # (sizes: a shape family's)
        values = dict(zip(self.symbols, sizes)) if self.symbols else None
        outs = self.sub(*[view(tensors[i], l, values) for i, l in self.inputs])
        for (i, layout), value in zip(self.outputs, outs):
            view(tensors[i], layout, values).copy_(value)

    def __repr__(self) -> str:
        return f"EagerGroup({self.name})"


def view(root: torch.Tensor, layout: Layout, sizes: dict | None = None) -> torch.Tensor:
    """The tensor `layout` describes, over `root`'s memory: what a kernel's index expressions
    read (offset and strides in elements, from the root buffer's first element). `sizes` gives
    the values of a shape family's symbols on this call."""
    if sizes is not None:
        layout = symbolic.evaluate(layout, sizes)
    return root.as_strided(layout.shape, layout.stride, root.storage_offset() + layout.offset)


def fall_back(name: str, sub: fx.GraphModule, params: list, in_layouts: list[Layout],
              out_layouts: list[Layout], error: BaseException, source: str | None,
              warn: bool = True) -> EagerGroup:
    """The EagerGroup for kernel `name`, after (with `warn`) a repro file and a warning that
    names both. Raises the original error (with the reason) where the group cannot run eagerly."""
    try:
        group = EagerGroup(name, sub, params, in_layouts, out_layouts)
    except CompileError as why:
        raise CompileError(f"{error}\n{why}") from None
    if warn:
        where = write_repro(name, sub, error, source)
        warnings.warn(f"fusec: kernel {name} could not be built, so its ATen ops "
                      f"({', '.join(_ops(sub))}) run eagerly instead (correct, but slower; so "
                      f"does any kernel sharing its code). {where}\n"
                      f"The error: {_first_lines(str(error))}", FallbackWarning, stacklevel=2)
    return group


def write_repro(name: str, sub: fx.GraphModule, error: BaseException, source: str | None) -> str:
    """Write what reproduces the failure (the error, the kernel's source, the group's graph) to
    the cache's `failed/` folder; returns a sentence saying where (or why it could not)."""
    text = (f"# fusec could not build kernel {name}; its ATen ops ran eagerly instead.\n"
            f"# ---- the error ----\n{_commented(f'{type(error).__name__}: {error}')}\n"
            f"# ---- the group's graph (ATen) ----\n{_commented(sub.graph.python_code('self').src)}\n"
            f"# inputs: {_inputs(sub)}\n"
            f"# ---- the kernel's source ----\n{source or '# (not rendered)'}\n")
    try:
        path = cache.atomic_write(cache.cache_dir("failed") / f"{name}-{cache.content_hash(text)}.txt",
                                  text)
    except (OSError, FusecError) as err:
        return f"(No repro file: {err}.)"
    return f"Repro: {path}"


def _ops(sub: fx.GraphModule) -> list[str]:
    return [str(n.target).replace("aten.", "") for n in sub.graph.nodes if n.op == "call_function"]


def _inputs(sub: fx.GraphModule) -> str:
    """Each input's shape, strides and dtype, as the group saw it."""
    said = []
    for n in sub.graph.nodes:
        val = n.meta.get("val") if n.op == "placeholder" else None
        if isinstance(val, torch.Tensor):
            said.append(f"{n.name} {tuple(val.shape)} stride {val.stride()} {val.dtype}")
        elif n.op == "placeholder":
            said.append(n.name)
    return "; ".join(said)


def _commented(text: str) -> str:
    return "\n".join("# " + line for line in text.strip().splitlines())


def _first_lines(text: str, n: int = 6) -> str:
    lines = text.strip().splitlines()
    return "\n".join(lines[:n] + (["..."] if len(lines) > n else []))

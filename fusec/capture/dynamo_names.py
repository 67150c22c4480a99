"""The user's names for a region that torch.compile's Dynamo captured: its function and its inputs.

Dynamo calls a backend while it traces a Python function, with a graph whose inputs it named after
where it found them: `L['x']`, `L['fn']._modules['0']._parameters['weight']`. AOT Autograd then
hands fusec graphs of its own (capture/training.py), which fusec captures as `graph(*args)`, so
without help a region's `explain` shows `args_0, args_1, args_2` where the user wrote `x`, and
titles a region of `torch.compile(nn.Sequential(...))` "inner": the name of torch's wrapper around
the module (torch/_dynamo/external_utils.py, `wrap_inline`), which is what Dynamo traced.

Here Dynamo's sources are read back into the names fusec gives the same inputs when it captures a
program itself (capture/frontend.py): a module's parameters and buffers `p_<path>` (`p_0_weight`),
the forward's arguments by its parameter names (`input`, `x`), anything else by its path
(`model_lin_weight` for a global `model.lin.weight`). `named_forward` gives the first graph AOT
Autograd compiles for a region, its forward, that signature; the backward keeps AOT's names
(`primals_1`, `tangents_1`: what autograd saved and the output gradients, not the user's inputs).
"""
from __future__ import annotations

import builtins
import inspect
import keyword
import os
import re
from typing import Callable

import torch
import torch.fx as fx

_ROOT = re.compile(r"[LG]\['([^']*)'\]")  # a local or global of the traced frame
# one step of a source: a submodule, parameter or buffer by name, an attribute, a key, an index
_STEP = re.compile(r"\._(?:modules|parameters|buffers)\['([^']*)'\]|\.(\w+)|\['([^']*)'\]|\[(\d+)\]")


def traced_frame():
    """Dynamo's translator of the frame it is tracing (it calls the backend while tracing), or
    None outside Dynamo or on a torch that keeps it elsewhere."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        return InstructionTranslator.current_tx()
    except Exception:
        return None


def traced_function(tx) -> str:
    """The name of the Python function Dynamo is tracing: the user's function, or, for torch's
    wrapper around a module or function, what it wraps (`Sequential.forward`)."""
    if tx is None:
        return "?"
    wrapped = _wrapped(tx)
    if isinstance(wrapped, torch.nn.Module):
        return f"{type(wrapped).__name__}.forward"
    return getattr(wrapped, "__name__", None) or tx.f_code.co_name


def input_names(gm: fx.GraphModule, tx) -> list[str]:
    """One name per input of Dynamo's graph `gm`, in order, from where Dynamo found it."""
    wrapped = _wrapped(tx) if tx is not None else None
    frame_locals = dict(getattr(tx, "f_locals", None) or {})
    names: list[str] = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        source = getattr(node.meta.get("grapharg"), "source", None)
        text = getattr(source, "name", "")
        text = text() if callable(text) else text
        name = _from_source(text, wrapped, frame_locals) or node.name
        names.append(_fresh(_identifier(name), names))
    return names


def named_forward(compile_fn: Callable, names: list[str]) -> Callable:
    """`compile_fn` (one graph -> a fusec CompiledFunction) for the graphs AOT Autograd compiles
    for one region: the first, the forward, is captured with `names` for its inputs when it has
    one input per name (capture/training.py's `with_source_lines` keeps its graph as `.gm`)."""
    first = [True]

    def compile_named(graph: Callable):
        gm = getattr(graph, "gm", None)
        if first[0] and gm is not None and \
                sum(n.op == "placeholder" for n in gm.graph.nodes) == len(names):
            graph.__signature__ = inspect.Signature(
                [inspect.Parameter(n, inspect.Parameter.POSITIONAL_ONLY) for n in names])
        first[0] = False
        return compile_fn(graph)
    return compile_named


def _wrapped(tx):
    """What torch's wrapper calls (its local `fn`) when the frame Dynamo traces is torch's own."""
    if not tx.f_code.co_filename.startswith(os.path.dirname(torch.__file__) + os.sep):
        return None
    return (getattr(tx, "f_locals", None) or {}).get("fn")


def _from_source(text: str, wrapped, frame_locals: dict) -> str | None:
    root = _ROOT.match(text)
    if root is None:
        return None
    first = root.group(1)
    steps = [next(g for g in m.groups() if g is not None)
             for m in _STEP.finditer(text, root.end())]
    if isinstance(frame_locals.get(first), torch.nn.Module) and steps:
        return "p_" + "_".join(steps)  # a module's parameter or buffer, as fusec names its own
    if wrapped is not None and first == "args" and steps and steps[0].isdigit():
        params = _positional(wrapped)
        i = int(steps[0])
        return "_".join([params[i] if i < len(params) else f"args_{i}"] + steps[1:])
    if wrapped is not None and first == "kwargs" and steps:
        return "_".join(steps)
    return "_".join([first] + steps)


def _positional(fn) -> list[str]:
    """The names of `fn`'s positional parameters (a module's: its forward's, without self)."""
    try:
        sig = inspect.signature(fn.forward if isinstance(fn, torch.nn.Module) else fn)
    except (TypeError, ValueError):
        return []
    return [p.name for p in sig.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _identifier(name: str) -> str:
    name = re.sub(r"\W", "_", name).strip("_") or "arg"
    if name[0].isdigit():
        name = "arg_" + name
    # (a keyword or a builtin, `input`, would be renamed by torch.fx's graph: `input_1`, the very
    # name Dynamo gives the first op's result in the listing beside it)
    return name + "_" if keyword.iskeyword(name) or hasattr(builtins, name) else name


def _fresh(name: str, taken: list[str]) -> str:
    fresh, k = name, 1
    while fresh in taken:
        fresh, k = f"{name}_{k}", k + 1
    return fresh

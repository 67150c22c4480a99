"""Graph breaks: why a program cannot be one graph, said in the user's words, and where.

fusec's fast path captures the whole program with make_fx (capture/frontend.py): one static graph
per input signature, called straight from a generated guard. Some programs have no such graph:

    def f(x):
        y = torch.sin(x) * 2           ┐ region 1: fused_sin_mul_sum_gt_0
        if y.sum() > 0:                ┘ break: Python branches on a tensor value
            return torch.cos(y) + 1    ─ region 2 (when the sum was positive)
        return torch.tanh(y) - 1       ─ region 3 (when it was not)

Python control flow on tensor values, `.item()`, ops whose output shape depends on the data
(`x[x > 0]`, `nonzero`) and Python that must run on every call (`print`, numpy) all make capture
fail with a GraphBreakError. Unless the user asked for `fullgraph=True`, fusec then does what
torch.compile does, with torch's own machinery: it hands the program to TorchDynamo
(`dynamo_compile`), which runs the function's bytecode, records the tensor operations it can
trace into FX graphs and, where it cannot go on, compiles the graph so far, runs the offending
Python eagerly and resumes tracing after it. Each graph is a *region* (capture/regions.py keeps
them). This file holds the rest: a break's reason in plain words (`Break`, `plain_reason`), the
user's frame it happened in (`Frame`), and the one warning fusec.compile gives
(`warn_graph_breaks`).

Note: the whole-graph fast path knows nothing of this module. A program captured whole never
reaches it: its calls still go from the generated guard straight into the schedule.
"""
from __future__ import annotations

import inspect
import linecache
import os
import re
import sys
import types
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from fusec.capture.tracing import is_user_file
from fusec.errors import GraphBreakError, GraphBreakWarning


# ---- why a region ended ---------------------------------------------------------------------------

@dataclass
class Frame:
    """One frame of the user's stack: `file:line` in `function`, and that line's code."""

    file: str
    line: int
    function: str
    code: str

    def __str__(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line}"


# Dynamo's break reasons, in the user's words (torch's own text is kept next to them). A
# reason about an op gets the op's name, from the "Developer debug context" line of torch's text.
_PLAIN_REASONS = [  # (a piece of torch's text, plain words, name the op?)
    ("generic_jump", "Python branches on a tensor value (`if tensor:`)", False),
    ("Data-dependent branching", "Python branches on a tensor value (`if tensor:`)", False),
    ("Tensor.item", "`.item()` turns tensor data into a Python number", False),
    ("Tensor.tolist", "`.tolist()` turns tensor data into Python numbers", False),
    ("Dynamic shape operator", "an op whose output shape depends on the data", True),
    ("data dependent operator", "an op whose output depends on the data", True),
    ("builtin operator `print`", "print() runs Python on every call", False),
]


def plain_reason(torch_reason: str) -> str:
    """A short, plain-words version of Dynamo's break reason (its first line otherwise)."""
    for pattern, words, name_op in _PLAIN_REASONS:
        if pattern in torch_reason:
            op = _debug_context(torch_reason) if name_op else ""
            return f"{words} ({op})" if op else words
    return torch_reason.strip().splitlines()[0] if torch_reason.strip() else "unknown"


def _debug_context(torch_reason: str) -> str:
    """The "Developer debug context" line of a Dynamo reason (names the op), or ""."""
    for line in torch_reason.splitlines():
        if "Developer debug context:" in line:
            return line.split("Developer debug context:", 1)[1].strip()
    return ""


@dataclass
class Break:
    """A graph break: where Dynamo had to stop a region, and why.

    `stack` is the user's stack at the break, outermost first: its last frame is the line that
    caused it; `ran_eagerly` is the line of the region's own function that Python ran instead
    of a graph (the same line, unless the cause is inside a function it calls)."""

    reason: str  # in plain words
    torch_reason: str  # Dynamo's own text, whole
    stack: list[Frame]
    ran_eagerly: Frame | None

    @classmethod
    def of(cls, compile_reason, function: str) -> "Break | None":
        """From Dynamo's GraphCompileReason (`gm.compile_subgraph_reason`); None when the
        region ended because the function returned, not at a break."""
        if compile_reason is None or not getattr(compile_reason, "graph_break", False):
            return None
        stack = [Frame(f.filename, f.lineno, f.name, (f.line or source_line(f.filename, f.lineno)))
                 for f in (compile_reason.user_stack or [])]
        own = next((f for f in stack if f.function == function), stack[0] if stack else None)
        return cls(plain_reason(compile_reason.reason), compile_reason.reason, stack, own)

    @property
    def where(self) -> Frame | None:
        return self.stack[-1] if self.stack else None

    def torch_words(self) -> str:
        return self.torch_reason.strip().splitlines()[0] if self.torch_reason.strip() else ""

    def describe(self) -> list[str]:
        """Lines for explain: where, why (plain words, then torch's), and what ran eagerly."""
        where = self.where
        head = f"break at {where}  `{where.code}`" if where else "break"
        lines = [head, f"  why: {self.reason} (torch: {self.torch_words()})"]
        if self.ran_eagerly is not None:
            ran = self.ran_eagerly
            inside = "" if ran == where else f" (the break is inside the call, at {where})"
            lines.append(f"  ran eagerly: {ran}  `{ran.code}`{inside}")
        return lines

    def to_dict(self) -> dict:
        frame = self.where
        return {"reason": self.reason, "torch_reason": self.torch_reason,
                "file": frame.file if frame else None, "line": frame.line if frame else None,
                "code": frame.code if frame else None,
                "ran_eagerly": str(self.ran_eagerly) if self.ran_eagerly else None,
                "stack": [vars(f) for f in self.stack]}


def source_line(path: str, lineno: int) -> str:
    return linecache.getline(path, lineno).strip()



TRACE_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


def innermost(stack_trace: str | None) -> Frame | None:
    """The innermost user frame of an fx node's `stack_trace` text, or None."""
    if not stack_trace:
        return None
    torch_dir = os.path.dirname(torch.__file__)
    found = None
    for m in TRACE_FRAME.finditer(stack_trace):
        if not m.group("file").startswith(torch_dir):
            found = m
    if found is None:
        return None
    path, lineno = found.group("file"), int(found.group("line"))
    return Frame(path, lineno, found.group("func"), source_line(path, lineno))



# ---- fusec.compile's graph-break path -------------------------------------------------------------

def dynamo_compile(fn: Callable, backend: Callable) -> Callable:
    """`torch.compile(fn, backend=backend)` with static shapes (each signature compiles its own
    regions, as fusec's whole-graph path does) and, where torch has it, its own recompile
    budget, so that compiling the same function several times does not use up Dynamo's."""
    options: dict[str, Any] = {"dynamic": False}
    params = inspect.signature(torch.compile).parameters
    if "isolate_recompiles" in params:
        options["isolate_recompiles"] = True
    elif isinstance(fn, types.FunctionType):
        # An older torch keeps Dynamo's compiled frames on the function's code object, shared by
        # every torch.compile of that function: a second fusec.compile(f, backend=...) would
        # run the first one's regions. A copy of the code object has a cache of its own.
        fn = _with_own_code(fn)
    if "recompile_limit" in params:
        options["recompile_limit"] = 64
        return torch.compile(fn, backend=backend, **options)
    compiled = torch.compile(fn, backend=backend, **options)
    limits = {k: 64 for k in ("recompile_limit", "cache_size_limit")
              if hasattr(torch._dynamo.config, k)}

    def call(*args, **kwargs):  # the older torch's process-wide recompile budget, raised
        with torch._dynamo.config.patch(**limits):
            return compiled(*args, **kwargs)
    return call


def _with_own_code(fn: types.FunctionType) -> types.FunctionType:
    """The same function (globals, defaults, closure) over a distinct copy of its code object."""
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    copy.__module__, copy.__doc__ = fn.__module__, fn.__doc__
    return copy



def warn_graph_breaks(label: str, cause: GraphBreakError) -> None:
    """Say once, when fusec.compile takes the graph-break path, why and where."""
    path, _, lineno = cause.where.rpartition(":")
    code = source_line(path, int(lineno)) if lineno.isdigit() else ""
    where = f" at {os.path.basename(path)}:{lineno}" if cause.where else ""
    code = f" (`{code}`)" if code else ""
    warnings.warn(
        f"fusec: {label} cannot be one graph: {cause.reason}{where}{code}. fusec compiles the "
        "regions around it with TorchDynamo and runs the rest eagerly (graph breaks); "
        f"fusec.explain({label}, ...) lists every region and break. Pass fullgraph=True to make "
        "this an error instead.", GraphBreakWarning, stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    """The `stacklevel` that makes a warning point at the user's call (the first frame, from
    the caller of warnings.warn outwards, that is neither fusec's nor torch's)."""
    frame, level = sys._getframe(2), 2  # 1: warn_graph_breaks's caller
    while frame is not None and not is_user_file(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2

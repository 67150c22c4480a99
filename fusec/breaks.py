"""Graph breaks: compile the regions of a program that cannot be one graph; run the rest eagerly.

fusec's fast path captures the whole program with make_fx (frontend.py): one static graph per
input signature, called straight from a generated guard. Some programs have no such graph:

    def f(x):
        y = torch.sin(x) * 2           ┐ region 1: fused_sin_mul_sum_gt_0
        if y.sum() > 0:                ┘ break: Python branches on a tensor value
            return torch.cos(y) + 1    ─ region 2 (when the sum was positive)
        return torch.tanh(y) - 1       ─ region 3 (when it was not)

Python control flow on tensor values, `.item()`, ops whose output shape depends on the data
(`x[x > 0]`, `nonzero`) and Python that must run on every call (`print`, numpy) all make capture
fail with a GraphBreakError. Unless the user asked for `fullgraph=True`, fusec then does what
torch.compile does, with torch's own machinery: it hands the program to TorchDynamo. Dynamo runs
the function's bytecode, records the tensor operations it can trace into FX graphs and, where it
cannot go on, compiles the graph so far, runs the offending Python eagerly and resumes tracing
after it. Each graph is a *region*; Dynamo hands it to a backend, here a `Regions` object, which
compiles it like any program (AOT Autograd, then fusec: fusec/training.py), so regions train too.

`Regions` is also the collector behind "one compiled object": it keeps, per region, Dynamo's
graph, why Dynamo ended it (`gm.compile_subgraph_reason`: torch's break reason and the user's
stack, the facts `torch._dynamo.explain` reports) and the fusec programs compiled for it. So
`cf.kernels`, `cf.source()`, `cf.schedule`, `fusec.explain` and `fusec.profile` cover every region,
for `fusec.compile(f)` with graph breaks and for `torch.compile(m, backend="fusec")` alike
(`fusec.regions(compiled)` reaches the latter's; see fusec/dynamo.py).

Note: the whole-graph fast path knows nothing of this module. A program captured whole never
reaches it: its calls still go from the generated guard straight into the schedule.
"""
from __future__ import annotations

import inspect
import itertools
import linecache
import os
import re
import sys
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from .errors import FusecError, GraphBreakError, GraphBreakWarning


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
        stack = [Frame(f.filename, f.lineno, f.name, (f.line or _line(f.filename, f.lineno)))
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


def _line(path: str, lineno: int) -> str:
    return linecache.getline(path, lineno).strip()


# ---- one region -----------------------------------------------------------------------------------

@dataclass
class Region:
    """One graph Dynamo captured and fusec compiled.

    `graph` is Dynamo's graph (torch-level ops, each with the user's source line); `parts` are the
    fusec programs AOT Autograd made of it: the forward (or inference) program, then, once a
    backward ran, the backward one (each a fusec CompiledFunction, one schedule per signature).
    """

    index: int  # 1, 2, ... in the order Dynamo compiled them
    function: str  # the Python function Dynamo was tracing (a `torch_dynamo_resume_in_f_at_12`
    #               function is the rest of f after the break at line 12)
    graph: fx.GraphModule
    ended_by: Break | None  # None: the function returned
    parts: list = field(default_factory=list)
    last_run: int = 0  # a tick of the collector's clock, set on every call of the region
    examples: list | None = None  # the inputs of the forward part's last call, when kept

    @property
    def kernels(self) -> list:
        return [k for part in self.parts for k in part.kernels]

    @property
    def compiled_graphs(self) -> list:
        """The fusec CompiledGraph of each part's last signature (forward, then backward)."""
        graphs = []
        for part in self.parts:
            if part.last is not None:
                graphs.append(part.last)
        return graphs

    def lines(self) -> list[Frame]:
        """The user's source lines this region's ops came from, in program order, each once."""
        seen, frames = set(), []
        for node in self.graph.graph.nodes:
            frame = _innermost(node.meta.get("stack_trace"))
            if frame is not None and (frame.file, frame.line) not in seen:
                seen.add((frame.file, frame.line))
                frames.append(frame)
        return frames

    def span(self) -> str:
        """Where the region's ops come from: `f.py:10-12`, per file (at most three)."""
        ranges: dict[str, list[int]] = {}
        for frame in self.lines():
            ranges.setdefault(os.path.basename(frame.file), []).append(frame.line)
        parts = [f"{name}:{min(lines)}" + (f"-{max(lines)}" if max(lines) != min(lines) else "")
                 for name, lines in ranges.items()]
        return ", ".join(parts[:3]) + (f" (+{len(parts) - 3} files)" if len(parts) > 3 else "")

    def title(self) -> str:
        kernels = self.kernels
        names = ", ".join(k.name for k in kernels[:4]) or "no kernel"
        if len(kernels) > 4:
            names += f", +{len(kernels) - 4} more"
        span = f" ({self.span()})" if self.span() else ""
        return (f"region {self.index}: {self.function}{span}: {len(self.graph_ops())} torch op(s) "
                f"-> {len(kernels)} kernel(s): {names}")

    def graph_ops(self) -> list[fx.Node]:
        return [n for n in self.graph.graph.nodes
                if n.op in ("call_function", "call_method", "call_module")]

    def listing(self) -> str:
        """Dynamo's graph of this region, one torch op per line with the user's line:

            y = mul(sin, 2)  # f.py:4  y = torch.sin(x) * 2
        """
        rows = []
        for node in self.graph_ops():
            target = node.target if isinstance(node.target, str) else \
                getattr(node.target, "__name__", str(node.target))
            args = ", ".join(_arg(a) for a in node.args)
            frame = _innermost(node.meta.get("stack_trace"))
            where = f"  # {frame}  {frame.code}" if frame else ""
            rows.append(f"  {node.name} = {target}({args}){where}")
        return "\n".join(rows) or "  (no ops)"

    def compiled_parts(self) -> list[tuple[str, Any]]:
        """("forward" | "backward", part) for each part of this region that has been compiled."""
        return [(name, part) for name, part in zip(("forward", "backward"), self.parts)
                if part.last is not None]

    def source(self) -> str:
        return "\n".join(f"# ----- {name} program -----\n{part.source()}"
                         for name, part in self.compiled_parts()) or "# (not compiled yet)"

    def schedule_text(self) -> str:
        return "\n".join(f"{name}:\n{part.schedule}"
                         for name, part in self.compiled_parts()) or "(not compiled yet)"


def _arg(a) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_arg(x) for x in a) + "]"
    return repr(a)


_TRACE_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


def _innermost(stack_trace: str | None) -> Frame | None:
    """The innermost user frame of an fx node's `stack_trace` text, or None."""
    if not stack_trace:
        return None
    torch_dir = os.path.dirname(torch.__file__)
    found = None
    for m in _TRACE_FRAME.finditer(stack_trace):
        if not m.group("file").startswith(torch_dir):
            found = m
    if found is None:
        return None
    path, lineno = found.group("file"), int(found.group("line"))
    return Frame(path, lineno, found.group("func"), _line(path, lineno))


# ---- the collector: a Dynamo backend --------------------------------------------------------------

class Regions:
    """A TorchDynamo backend that compiles every graph with fusec and remembers it.

        regions = Regions(backend="cpp")
        opt = torch.compile(f, backend=regions)
        opt(x)
        regions.kernels, regions.source(), regions.schedule, print(regions)

    `kernels`, `source()` and `schedule` describe the regions that ran in the last call (for
    a torch.compile'd object, whose calls fusec does not see begin: every region that ran).
    """

    def __init__(self, backend: str = "auto", check: bool = False, label: str = "program",
                 keep_inputs: bool = False):
        self.backend = backend
        self.check = check
        self.label = label
        self.keep_inputs = keep_inputs  # keep each region's last inputs (fusec.profile does)
        self.cause: GraphBreakError | None = None  # why fusec.compile could not take it whole
        self.regions: list[Region] = []
        self._clock = itertools.count(1)
        self._call_started = 0

    # -- the Dynamo backend ------------------------------------------------------------------------
    def __call__(self, gm: fx.GraphModule, example_inputs) -> Callable:
        """Dynamo calls this once per graph it captured: compile it with AOT Autograd and fusec,
        and return a callable that also notes that the region ran."""
        from torch._dynamo.backends.common import aot_autograd

        from .frontend import decompositions
        from .training import graph_compiler

        function = _traced_function()
        region = Region(len(self.regions) + 1, function, gm,
                        Break.of(getattr(gm, "compile_subgraph_reason", None), function))
        self.regions.append(region)
        compile_part = graph_compiler(self.backend, region.parts, self.check)
        if self.keep_inputs:
            compile_part = _keeping_inputs(compile_part, region)
        compiled = aot_autograd(fw_compiler=compile_part, bw_compiler=compile_part,
                                decompositions=decompositions())(gm, example_inputs)
        clock = self._clock

        def run(*args):  # Dynamo calls what a backend returns with the graph's inputs, unboxed
            region.last_run = next(clock)
            return compiled(*args)
        return run

    # -- calls -------------------------------------------------------------------------------------
    def begin_call(self) -> None:
        """Mark the start of a call: `last_call` is the regions that ran after this."""
        self._call_started = next(self._clock)

    @property
    def last_call(self) -> list[Region]:
        """The regions that ran in the last call, in the order Dynamo compiled them."""
        return [r for r in self.regions if r.last_run > self._call_started]

    @property
    def breaks(self) -> list[Break]:
        """Every distinct break (by place and reason), in the order they were met."""
        seen, out = set(), []
        for region in self.regions:
            b = region.ended_by
            if b is not None:
                key = (str(b.where), b.reason)
                if key not in seen:
                    seen.add(key)
                    out.append(b)
        return out

    # -- what fusec.compile's compiled object shows --------------------------------------------------
    @property
    def kernels(self) -> list:
        """The kernels of every region of the last call, region by region."""
        return [k for r in self.last_call for k in r.kernels]

    @property
    def schedule(self) -> str:
        regions = self._ran_last()
        return "\n".join(f"{r.title()}\n{r.schedule_text()}" + _after(r) for r in regions)

    def source(self) -> str:
        """Every region's whole program (kernels, schedule, wrapper, graph), with the breaks."""
        regions = self._ran_last()
        out = [f"# fusec: {self.label} in {len(regions)} region(s) (graph breaks between them "
               "run eagerly)"]
        for r in regions:
            out.append(f"# ===================== {r.title()} =====================")
            out.append(r.source())
            if r.ended_by is not None:
                out.append("\n".join("# " + line for line in r.ended_by.describe()))
        return "\n".join(out)

    def _ran_last(self) -> list[Region]:
        """The last call's regions, or a clear error when there are none."""
        regions = self.last_call
        if regions:
            return regions
        if self._call_started or self.regions:
            raise FusecError(f"fusec: the last call of {self.label} ran no compiled region: "
                             "TorchDynamo found no tensor operations to compile, so all of it "
                             "ran eagerly")
        raise FusecError("fusec: nothing compiled yet; call the compiled function first")

    def summary(self) -> str:
        """Regions and breaks, in program order: what was compiled and what ran eagerly."""
        regions = self.last_call or self.regions
        kernels = sum(len(r.kernels) for r in regions)
        out = [f"fusec: {self.label} ran as {len(regions)} compiled region(s) with "
               f"{len(self.breaks)} graph break(s), {kernels} kernel(s)"]
        if self.cause is not None:
            path, _, line = self.cause.where.rpartition(":")
            at = f" at {os.path.basename(path)}:{line}" if self.cause.where else ""
            out.append(f"  (one graph was impossible: {self.cause.reason}{at}; TorchDynamo "
                       "found the regions)")
        for r in regions:
            out.append("  " + r.title())
            if r.ended_by is not None:
                out += ["    " + line for line in r.ended_by.describe()]
        return "\n".join(out)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        return f"<fusec.Regions of {self.label}: {len(self.regions)} region(s)>"

    def _repr_pretty_(self, p, cycle):
        p.text(self.summary())


def _after(region: Region) -> str:
    return ("\n" + "\n".join(region.ended_by.describe())) if region.ended_by is not None else ""


def _keeping_inputs(compile_part: Callable, region: Region) -> Callable:
    """Wrap an AOT compiler so that the forward part keeps its last real inputs (for profiling)."""
    def compile_and_keep(gm, example_inputs):
        run = compile_part(gm, example_inputs)
        if len(region.parts) != 1:  # the backward part: nothing to keep
            return run

        def keep(args):
            region.examples = list(args)
            return run(args)
        keep._boxed_call = True
        return keep
    return compile_and_keep


def _traced_function() -> str:
    """The name of the Python function Dynamo is tracing right now (while it calls a backend)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        tx = InstructionTranslator.current_tx()
        return tx.f_code.co_name
    except Exception:  # an older torch, or called outside Dynamo
        return "?"


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


class GraphBroken:
    """What a fusec CompiledFunction calls once its program turned out not to be one graph."""

    def __init__(self, fn: Callable, cause: GraphBreakError, backend: str = "auto",
                 check: bool = False, label: str = "program"):
        self.cause = cause
        self.regions = Regions(backend, check, label)
        self.regions.cause = cause
        self.compiled = dynamo_compile(fn, self.regions)

    def __call__(self, args: tuple, kwargs: dict):
        self.regions.begin_call()
        return self.compiled(*args, **kwargs)


def collect_regions(model: Callable, inputs: tuple, kwargs: dict, backend: str = "auto",
                    label: str = "program", keep_inputs: bool = False,
                    cause: GraphBreakError | None = None) -> Regions:
    """Run `model(*inputs, **kwargs)` once through TorchDynamo, with fusec compiling each region,
    under torch.no_grad() (what explain and profile show: the inference programs)."""
    collected = Regions(backend, label=label, keep_inputs=keep_inputs)
    collected.cause = cause
    compiled = dynamo_compile(model, collected)
    collected.begin_call()
    with torch.no_grad():
        compiled(*inputs, **kwargs)
    return collected


def warn_graph_breaks(label: str, cause: GraphBreakError) -> None:
    """Say once, when fusec.compile takes the graph-break path, why and where."""
    path, _, lineno = cause.where.rpartition(":")
    code = _line(path, int(lineno)) if lineno.isdigit() else ""
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
    from .frontend import _is_user_file
    frame, level = sys._getframe(2), 2  # 1: warn_graph_breaks's caller
    while frame is not None and not _is_user_file(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


# ---- reaching the regions of a torch.compile'd object ---------------------------------------------

def regions(compiled) -> Regions:
    """The fusec regions behind a compiled object, for inspection:

        opt = torch.compile(model, backend="fusec")
        opt(x)
        r = fusec.regions(opt)     # r.kernels, r.source(), r.schedule, print(r)

    Works for `torch.compile(..., backend="fusec")` modules and functions, and for a
    `fusec.compile`d program that took the graph-break path."""
    from .api import CompiledFunction, CompiledModule
    if isinstance(compiled, CompiledModule):
        compiled = compiled._compiled
    if isinstance(compiled, CompiledFunction):
        if compiled.breaks is None:
            raise FusecError("fusec: this program was captured as one graph, so it has no "
                             "regions: its kernels are cf.kernels, its program cf.source()")
        return compiled.breaks.regions
    found = _dynamo_regions(compiled)
    if found is None:
        raise FusecError(f"fusec: {type(compiled).__name__} is not compiled by fusec: pass what "
                         "torch.compile(model, backend=\"fusec\") or fusec.compile returned")
    from .api import _label
    found.label = _label(original(compiled))
    return found


def _dynamo_regions(compiled) -> Regions | None:
    """The Regions a torch.compile(..., backend="fusec") object compiled into (see
    fusec/dynamo.py, which stores them on the object's backend wrapper), or None."""
    from torch._dynamo.eval_frame import innermost_backend
    callback = None
    ctx = getattr(compiled, "dynamo_ctx", None)  # an OptimizedModule
    if ctx is not None:
        callback = ctx.callback
    elif getattr(compiled, "__closure__", None):  # a function torch.compile wrapped
        for cell in compiled.__closure__:
            value = cell.cell_contents
            if hasattr(value, "_torchdynamo_orig_backend"):
                callback = value
                break
            if hasattr(value, "callback") and hasattr(value, "_dynamic"):
                callback = value.callback
                break
    if callback is None:
        return None
    backend = innermost_backend(callback)
    found = getattr(backend, "_fusec_regions", None)
    if found is None and isinstance(backend, Regions):
        found = backend
    return found


def original(compiled):
    """The user's function or module behind a torch.compile wrapper, or None if not one."""
    if hasattr(compiled, "_orig_mod") and hasattr(compiled, "dynamo_ctx"):
        return compiled._orig_mod
    if getattr(compiled, "_torchdynamo_orig_callable", None) is not None and \
            _dynamo_regions(compiled) is not None:
        return compiled._torchdynamo_orig_callable
    return None

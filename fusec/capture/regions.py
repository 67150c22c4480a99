"""Regions: the graphs TorchDynamo captured from a program that is not one graph, each compiled.

When capture fails with a graph break (capture/breaks.py says why and where), fusec hands the
program to TorchDynamo, and Dynamo hands each graph it captured, a *region*, to a backend: here a
`Regions` object, which compiles it like any program (AOT Autograd, then fusec:
capture/training.py), so regions train too. How one graph is compiled is not decided here: the
driver passes `compile_fn` (fusec.api.part_compiler), so this room never imports the driver.

`Regions` is also the collector behind "one compiled object": it keeps, per region, Dynamo's
graph, why Dynamo ended it (`gm.compile_subgraph_reason`: torch's break reason and the user's
stack, the facts `torch._dynamo.explain` reports) and the fusec programs compiled for it. So
`cf.kernels`, `cf.source()`, `cf.schedule`, `fusec.explain` and `fusec.profile` cover every region,
for `fusec.compile(f)` with graph breaks and for `torch.compile(m, backend="fusec")` alike
(`fusec.regions(compiled)` reaches the latter's; see fusec/dynamo.py).
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from fusec.capture.breaks import Break, Frame, dynamo_compile, innermost
from fusec.capture.dynamo_names import input_names, named_forward, traced_frame, traced_function
from fusec.capture.frontend import decompositions
from fusec.capture.partition import partitioner
from fusec.capture.training import TrainingParts, graph_compiler
from fusec.errors import FusecError, GraphBreakError


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
    parts: list = field(default_factory=TrainingParts)  # .partitions: saved and recomputed
    last_run: int = 0  # a tick of the collector's clock, set on every call of the region
    examples: list | None = None  # the inputs of the forward part's last call, when kept
    inputs: list = field(default_factory=list)  # the user's name of each input of `graph`

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
            frame = innermost(node.meta.get("stack_trace"))
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
        placeholders = [n for n in self.graph.graph.nodes if n.op == "placeholder"]
        named = dict(zip(placeholders, self.inputs))  # (Dynamo's `l_x_` is the user's `x`)
        for node in self.graph_ops():
            target = node.target if isinstance(node.target, str) else \
                getattr(node.target, "__name__", str(node.target))
            args = ", ".join(_arg(a, named) for a in node.args)
            frame = innermost(node.meta.get("stack_trace"))
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


def _arg(a, named: dict) -> str:
    if isinstance(a, fx.Node):
        return named.get(a, a.name)
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_arg(x, named) for x in a) + "]"
    return repr(a)



# ---- the collector: a Dynamo backend --------------------------------------------------------------

class Regions:
    """A TorchDynamo backend that compiles every graph with fusec and remembers it.

        regions = Regions(fusec.api.part_compiler("cpp"), backend="cpp")
        opt = torch.compile(f, backend=regions)
        opt(x)
        regions.kernels, regions.source(), regions.schedule, print(regions)

    `kernels`, `source()` and `schedule` describe the regions that ran in the last call (for
    a torch.compile'd object, whose calls fusec does not see begin: every region that ran).
    """

    def __init__(self, compile_fn: Callable, backend: str = "auto", label: str = "program",
                 keep_inputs: bool = False):
        self.compile_fn = compile_fn  # one graph -> a compiled callable (fusec.api.part_compiler)
        self.backend = backend
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
        tx = traced_frame()  # the user's names for the function and its inputs: dynamo_names.py
        function = traced_function(tx)
        region = Region(len(self.regions) + 1, function, gm,
                        Break.of(getattr(gm, "compile_subgraph_reason", None), function),
                        inputs=input_names(gm, tx))
        self.regions.append(region)
        compile_part = graph_compiler(named_forward(self.compile_fn, region.inputs), region.parts)
        if self.keep_inputs:
            compile_part = _keeping_inputs(compile_part, region)
        from torch._dynamo.backends.common import aot_autograd  # (Dynamo: imported when used)
        from fusec.capture.buffer_updates import buffers_in_graph  # (buffer writes: after the program)
        compiled = aot_autograd(fw_compiler=compile_part, bw_compiler=compile_part,
                                partition_fn=partitioner(region.parts.partitions),
                                decompositions=decompositions(),
                                keep_inference_input_mutations=buffers_in_graph())(gm, example_inputs)
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



class GraphBroken:
    """What a fusec CompiledFunction calls once its program turned out not to be one graph."""

    def __init__(self, fn: Callable, cause: GraphBreakError, compile_fn: Callable,
                 backend: str = "auto", label: str = "program"):
        self.cause = cause
        self.regions = Regions(compile_fn, backend, label)
        self.regions.cause = cause
        self.compiled = dynamo_compile(fn, self.regions)

    def __call__(self, args: tuple, kwargs: dict):
        self.regions.begin_call()
        return self.compiled(*args, **kwargs)

    def __str__(self) -> str:  # print(cf.breaks): the regions and the breaks between them
        return self.regions.summary()

    def __repr__(self) -> str:
        where = f" at {os.path.basename(self.cause.where)}" if self.cause.where else ""
        return (f"<fusec graph breaks of {self.regions.label}: {len(self.regions.regions)} "
                f"region(s), {len(self.regions.breaks)} break(s); one graph was impossible: "
                f"{self.cause.reason}{where}; print() it for each region and break>")

    def _repr_pretty_(self, p, cycle):
        p.text(str(self))


def collect_regions(model: Callable, inputs: tuple, kwargs: dict, compile_fn: Callable,
                    backend: str = "auto", label: str = "program", keep_inputs: bool = False,
                    cause: GraphBreakError | None = None) -> Regions:
    """Run `model(*inputs, **kwargs)` once through TorchDynamo, with `compile_fn` compiling each
    region, under torch.no_grad() (what explain and profile show: the inference programs)."""
    collected = Regions(compile_fn, backend, label=label, keep_inputs=keep_inputs)
    collected.cause = cause
    compiled = dynamo_compile(model, collected)
    collected.begin_call()
    with torch.no_grad():
        compiled(*inputs, **kwargs)
    return collected



def dynamo_regions(compiled) -> Regions | None:
    """The Regions a torch.compile(..., backend="fusec") object compiled into (see
    fusec/dynamo.py, which stores them on the object's backend wrapper), or None."""
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
    from torch._dynamo.eval_frame import innermost_backend
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
            dynamo_regions(compiled) is not None:
        return compiled._torchdynamo_orig_callable
    return None

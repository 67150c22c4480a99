"""`fusec.explain(model, *inputs)`: every stage of the pipeline, printable and as a dict.

    e = fusec.explain(f, x)
    print(e)            # the walk through the pipeline, below
    e.to_dict()         # the same facts as plain data (JSON-ready)
    e.dot("before")     # Graphviz pictures of the graph before / after fusion (fusec/inspect/graphviz.py)

`str(e)` walks the pipeline in order:

1. the captured ATen graph: every value with its dtype, shape (and strides when it is not
   contiguous), the op that computes it, what kind of op that is, and the user's source line;
2. the graph after each pass, with what the pass changed: nodes removed, groups formed (and from
   which ops), fusions refused and why;
3. the fusion groups as a table: kernel, ops, inputs, outputs, and the bytes the kernel reads
   and writes, counted from the kernel IR (see `kernel_traffic`);
4. every extern step (an eager ATen call between kernels) with the reason it is not a kernel;
5. the schedule, and each kernel's source.

Given a function or module that `fusec.compile` wrapped, and that compiled more than one program
(new input sizes, a changed `self.scale`: fusec/limits.py), `str(e)` first lists why, the last
few reasons (`cf.recompiles`).

Nothing is run on the inputs' data: the program is captured and compiled exactly as
`fusec.compile` would (the kernels are built, so their sources are the real ones).

The sections come from listing.py (the captured graph), changes.py (what each pass changed)
and groups.py (groups, bytes, refusals, extern calls); this file puts them in order.

A program that cannot be one graph (graph breaks, fusec/capture/breaks.py) is explained region by
region: `fusec.explain` then returns a `RegionsExplanation`, which first lists every region,
every break with the user's line and torch's reason, and what ran eagerly, then walks each
region's program as above. Finding the regions means running the program once through
TorchDynamo (a break can depend on the data), under torch.no_grad(). The same holds for a
`torch.compile(model, backend="fusec")` object: `fusec.explain(opt, *inputs)` compiles its
regions afresh; `fusec.explain(opt)` with no inputs explains the regions it already compiled.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fusec.api import (CompiledFunction, CompiledModule, label_of, part_compiler, regions,
                       resolve_backend)
from fusec.capture.frontend import capture
from fusec.capture.regions import Regions, collect_regions, original
from fusec.codegen import llvm
from fusec.codegen.llvm import compiler as llvm_build
from fusec.codegen.triton import target as triton_target
from fusec.codegen import backends
from fusec.driver import CompiledGraph, compile_graph
from fusec.dynamic import ones_in_family
from fusec.errors import FusecError, GraphBreakError
from fusec.inspect.changes import pass_changes
from fusec.inspect import distributed
from fusec.inspect.graphviz import dot_after, dot_before, render_svg
# (kernel_traffic and distinct_elements are also importable from here, where they lived before)
from fusec.inspect.groups import (distinct_elements, fallback_rows, format_groups,  # noqa: F401
                                  format_refusals, group_rows, kernel_traffic, refusal_dicts)
from fusec.inspect.listing import graph_listing, node_rows
from fusec.inspect.training import region_entries, saved_for_backward, training_dicts, training_section
from fusec.record import format_schedule


@dataclass(repr=False)
class Explanation:
    compiled: CompiledGraph
    # why the fusec.compile'd function explained compiled again, the last few (fusec/limits.py)
    recompiles: list[str] = field(default_factory=list)
    # what its training programs saved for backward and recomputed (fusec/inspect/training.py)
    training: list = field(default_factory=list)
    # the program is for a shape family (fusec/dynamic.py): its symbols and guards
    family: dict | None = None

    @property
    def kernels(self) -> list:
        return self.compiled.kernels

    def __repr__(self) -> str:
        return (f"<fusec.explain ({self.compiled.backend}): {len(self.kernels)} kernel(s); "
                "print() it for every stage, .to_dict() for the same as data>")

    # pieces, also used by fusec.profile and FUSEC_DEBUG_DIR
    def groups(self) -> list[dict]:
        return group_rows(self.compiled.gm, self.compiled.kernels)

    def fallbacks(self) -> list[dict]:
        return fallback_rows(self.compiled.gm)

    def graph(self) -> str:
        return graph_listing(self.compiled.captured.gm)

    def dot(self, stage: str = "after") -> str:
        """Graphviz DOT text of the graph "before" or "after" fusion (see fusec/inspect/graphviz.py)."""
        if stage == "before":
            return dot_before(self.compiled.captured.gm, self.compiled.gm)
        if stage == "after":
            return dot_after(self.compiled.gm)
        raise ValueError(f"stage must be 'before' or 'after', not {stage!r}")

    def svg(self, stage: str = "after") -> str | None:
        """The same picture as SVG, or None when Graphviz's `dot` is not installed."""
        return render_svg(self.dot(stage))

    def _kernel(self, kernel: int | str, view: str):
        kernels = self.compiled.kernels
        k = kernels[kernel] if isinstance(kernel, int) else \
            next((k for k in kernels if k.name == kernel), None)
        if k is None:
            raise FusecError(f"fusec: no kernel named {kernel!r}; the kernels are "
                             f"{', '.join(k.name for k in kernels) or 'none'}")
        views = backends.get(k.backend).views
        if view not in views and not (view == "assembly" and "gpu_assembly" in views):
            raise FusecError(f"fusec: kernel {k.name} was built by the {k.backend} backend; the "
                             "optimized IR comes from backend='llvm', machine code from "
                             "backend='llvm' (CPUs) or 'triton' (NVIDIA GPUs)")
        return k

    def optimized_ir(self, kernel: int | str = 0) -> str:
        """LLVM backend: the kernel's IR after LLVM's O3 pipeline, where the loop vectorizer has
        turned `float` loads and math into `<8 x float>` ones (by position or by name)."""
        k = self._kernel(kernel, "optimized_ir")
        return llvm.optimized_ir(k.source, k.name)

    def assembly(self, kernel: int | str = 0, target: str | None = None) -> str:
        """The kernel's machine code, as assembly (by position or by name).

        LLVM backend: for this CPU, or for `target`, one of fusec.codegen.llvm.compiler.NAMED_TARGETS
        ("haswell", "sapphirerapids", "aarch64", ...) to see what the same kernel becomes on
        another CPU. Triton backend: its SASS on an NVIDIA GPU, `target` one of
        fusec.codegen.triton.target.GPU_TARGETS ("sm_80", "sm_90", ...; default sm_90), compiled
        by Triton's own compiler, which needs no GPU."""
        k = self._kernel(kernel, "assembly")
        if "gpu_assembly" in backends.get(k.backend).views:
            return triton_target.assembly(k.ir, k.name, target or triton_target.DEFAULT)
        if target is None:
            return llvm.assembly(k.source, k.name)
        chosen = llvm_build.available_targets().get(target)
        if chosen is None:
            raise FusecError(f"fusec: unknown or unavailable LLVM target {target!r}; choose one "
                             f"of {', '.join(llvm_build.available_targets())}")
        return llvm.assembly(llvm.render(k.ir, chosen), k.name, chosen)

    def to_dict(self) -> dict:
        return plain_data(self._dict())

    def _dict(self) -> dict:
        gm = self.compiled.gm
        cg = self.compiled
        return {
            "backend": cg.backend,
            "graph": node_rows(cg.captured.gm),
            "stages": [{"after": s.after, "graph": s.code} for s in cg.stages()],
            "passes": [{k: v for k, v in c.items() if k != "graph"}
                       for c in pass_changes(cg.captured.gm, gm, cg.stages())],
            "removed_by_dce": list(cg.passes.dce),
            "refusals": refusal_dicts(gm),
            "groups": self.groups(),
            "kernels": [{"name": k.name, "ops": k.ops, "source": k.source, "backend": k.backend,
                         "shape": list(k.ir.source_shape)} for k in cg.kernels],
            "externs": [s.name for s in cg.schedule if s.kind == "extern"],
            "fallbacks": self.fallbacks(),
            "schedule": format_schedule(cg.schedule),
            "layout": cg.passes.layout.to_dict() if cg.passes.layout is not None else None,
            "dot": {"before": self.dot("before"), "after": self.dot("after")},
            "recompiles": list(self.recompiles),
            "family": self.family,
            "training": training_dicts(self.training),
        }

    def __str__(self) -> str:
        cg = self.compiled
        gm = cg.gm
        out = [f"fusec explain ({cg.backend} backend): {len(cg.kernels)} kernel(s), "
               f"{len(self.fallbacks())} extern call(s)"]
        if self.recompiles:  # a fusec.compile'd function that compiled more than one program
            out.append("\n=== recompiles: why it compiled another program (newest last) ===")
            out += [f"  {i}. {reason}" for i, reason in enumerate(self.recompiles, 1)]
        if self.family is not None:
            out.append("\n=== shape family: one program for every size these guards allow ===")
            out += [f"  {s['name']} = {s['source']}, {s['range']}  ({s['symbol']} in the graphs "
                    "below)" for s in self.family["symbols"]]
            out.append("  guards (what compiling assumed; a call that breaks one compiles again):")
            out += [f"    {g}" for g in self.family["guards"]] or ["    none beyond the sizes"]
        out += training_section(self.training, walk_note=True)
        out.append("\n=== captured ATen graph ===\n" + self.graph())
        changes = pass_changes(cg.captured.gm, gm, cg.stages())
        fuse_stages = [c["after"] for c in changes if c["after"].startswith("fuse")]
        previous = None
        for change in changes:
            out.append(f"\n=== graph after {change['after']} === ({change['summary']})")
            out += ["  " + d for d in change["details"]]
            same = change["graph"] == previous
            out.append("(the graph is the same as before this pass)" if same
                       else change["graph"].rstrip())
            previous = change["graph"]
            if change["after"] == "dce":
                out.append(f"dce removed: {', '.join(cg.passes.dce) or 'nothing'}")
            if fuse_stages and change["after"] == fuse_stages[-1]:
                out.append(format_refusals(gm))
        if getattr(cg.passes.layout, "convs", None):  # each tensor's layout, why
            out.append("\n=== memory layout ===\n" + str(cg.passes.layout))
        out.append("\n=== fusion groups ===\n" + format_groups(self.groups()))
        fallbacks = self.fallbacks()
        out.append("\n=== extern (eager ATen) calls ===")
        if fallbacks:
            out.append("extern (eager ATen) calls: " + ", ".join(f["op"] for f in fallbacks))
            for f in fallbacks:
                where = f"  # {f['line']}" if f["line"] else ""
                out.append(f"  {f['node']} = {f['op']}: {f['reason']}{where}")
        else:
            out.append("none: every op runs inside a fused kernel")
        out.append(f"\n=== schedule ===\n{format_schedule(cg.schedule)}")
        for k in cg.kernels:
            out.append(f"\n=== kernel {k.name} over {tuple(k.ir.source_shape)} ===\n{k.source}")
        return "\n".join(out)

    def _repr_pretty_(self, p, cycle):  # IPython / Jupyter print the walk, not the dataclass
        p.text(str(self))


def explain(model, *inputs, backend: str = "auto", **kwargs):
    """Capture and compile `model(*inputs, **kwargs)` and return every stage (see module doc).

    `model` may be a plain function or module, one already wrapped by fusec.compile, or one
    returned by `torch.compile(..., backend="fusec")`. Returns an Explanation, or a
    RegionsExplanation when the program runs in regions with graph breaks between them, or a
    StepTimeline for a model under DDP or FSDP2 (fusec/inspect/distributed.py).
    """
    if distributed.is_distributed(model):  # collectives live in hooks and autograd: run a step
        return distributed.step_timeline(model, inputs, kwargs)
    torch_compiled = original(model)
    if torch_compiled is not None:  # torch.compile(..., backend="fusec"): Dynamo's regions
        collected = regions(model)
        if not inputs and not kwargs:
            return RegionsExplanation(collected)
        backend = collected.backend if backend == "auto" else backend
        return explain_regions(torch_compiled, inputs, kwargs, backend)
    fullgraph = getattr(getattr(model, "_compiled", model), "fullgraph", False)
    wrapped = getattr(model, "_compiled", model)  # a fusec.compile'd one: why it recompiled
    recompiles = list(wrapped.recompiles) if isinstance(wrapped, CompiledFunction) else []
    dims = wrapped.family_dims(inputs, kwargs) if isinstance(wrapped, CompiledFunction) else None
    model, backend = unwrap(model, backend)
    try:
        with ones_in_family(bool(dims)):  # (a family compiles as fusec.compile compiles it)
            captured, chosen = capture_for(model, inputs, kwargs, backend, dims)
    except GraphBreakError as cause:
        if fullgraph:
            raise
        return explain_regions(model, inputs, kwargs, backend, cause)
    with ones_in_family(bool(dims)):
        compiled = compile_graph(captured, chosen, record=True, label=label_of(model))
    return Explanation(compiled, recompiles,
                       saved_for_backward(wrapped) if isinstance(wrapped, CompiledFunction) else [],
                       family_info(captured))


def family_info(captured) -> dict | None:
    """A shape family's symbols (which input size each is) and guards (with the line that
    decided each), for explain; None for a program of one signature."""
    if captured.shape_env is None:
        return None
    from fusec.runtime.program import size_bindings
    from fusec.symbolic import guards_with_places
    symbols = [{"symbol": str(sym), "name": name,
                "source": f"{name.rsplit('_', 1)[0]}.{kind}({d})",
                "range": _range(captured.shape_env, sym)}
               for sym, name, _, kind, d in size_bindings(captured.gm)]
    guards = [f"{g}  ({where})" if where else g
              for g, where in guards_with_places(captured.shape_env)]
    return {"symbols": symbols, "guards": guards}


def plain_data(value):
    """`value` with every size that is a symbol (a shape family's SymInt) as its text (`s26`), so
    explain's dict is plain data (json.dumps takes it)."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return str(value)
    if isinstance(value, dict):
        return {k: plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        items = [plain_data(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


def _range(env, sym) -> str:
    """The sizes a symbol may take in its family, from what compiling assumed (`1 or more`; `2 or
    more` where a guard keeps 1 out; a guard such as `s0 < 132` bounds it above)."""
    bounds = getattr(env, "var_to_range", {}).get(sym)
    if bounds is None:
        return "any"
    low, high = max(bounds.lower, 1), bounds.upper
    top = None if not getattr(high, "is_finite", True) or str(high) in ("oo", "int_oo") else high
    return f"{low} or more" if top is None else f"{low} to {top}"


def explain_regions(model, inputs: tuple, kwargs: dict, backend: str,
                    cause: GraphBreakError | None = None) -> "RegionsExplanation":
    """Run `model` once through TorchDynamo with fusec compiling each region, and explain them."""
    return RegionsExplanation(collect_regions(model, inputs, kwargs, part_compiler(backend), backend,
                                              label=label_of(model), cause=cause))


@dataclass
class RegionsExplanation:
    """`fusec.explain` of a program in regions: the regions and breaks, then each region's
    Explanation (forward program, and backward program when one was compiled)."""

    regions: Regions

    def explanations(self) -> list[tuple]:
        """(region, [Explanation of each compiled part]) for every region of the last call."""
        return [(r, [Explanation(cg) for cg in r.compiled_graphs])
                for r in self.regions.last_call or self.regions.regions]

    @property
    def kernels(self) -> list:
        return self.regions.kernels

    def breaks(self) -> list[dict]:
        return [b.to_dict() for b in self.regions.breaks]

    def _owner(self, kernel: int | str) -> tuple["Explanation", str]:
        """The region program's Explanation that holds `kernel` (by position or name)."""
        name = self.kernels[kernel].name if isinstance(kernel, int) else kernel
        for _, parts in self.explanations():
            for e in parts:
                if any(k.name == name for k in e.kernels):
                    return e, name
        raise FusecError(f"fusec: no kernel named {kernel!r}; the kernels are "
                         f"{', '.join(k.name for k in self.kernels) or 'none'}")

    def optimized_ir(self, kernel: int | str = 0) -> str:
        e, name = self._owner(kernel)
        return e.optimized_ir(name)

    def assembly(self, kernel: int | str = 0, target: str | None = None) -> str:
        e, name = self._owner(kernel)
        return e.assembly(name, target)

    def dot(self, stage: str = "after") -> str:
        raise FusecError("fusec: graph pictures are drawn per region: "
                         "e.explanations()[i][1][0].dot(stage) for region i's program")

    def svg(self, stage: str = "after") -> str | None:
        return self.dot(stage)

    def to_dict(self) -> dict:
        return {"label": self.regions.label, "backend": self.regions.backend,
                "breaks": self.breaks(),
                "cause": ({"reason": self.regions.cause.reason, "where": self.regions.cause.where}
                          if self.regions.cause is not None else None),
                "regions": [{"index": r.index, "function": r.function, "span": r.span(),
                             "lines": [str(f) for f in r.lines()],
                             "ended_by": r.ended_by.to_dict() if r.ended_by else None,
                             "kernels": [k.name for k in r.kernels],
                             "programs": [e.to_dict() for e in parts],
                             "training": training_dicts(region_entries(r))}
                            for r, parts in self.explanations()]}

    def __str__(self) -> str:
        out = ["fusec explain (graph breaks): " + self.regions.summary()]
        for region, parts in self.explanations():
            out.append(f"\n##### {region.title()} #####")
            out.append("Dynamo's graph (torch ops, with your lines):\n" + region.listing())
            for name, e in zip(("forward", "backward"), parts):
                text = str(e).replace("fusec explain", f"region {region.index}, {name} program", 1)
                out.append("\n" + text)
            out += training_section(region_entries(region))
            if region.ended_by is not None:
                out.append("\n" + "\n".join(region.ended_by.describe()))
        return "\n".join(out)

    def _repr_pretty_(self, p, cycle):
        p.text(str(self))


def unwrap(model, backend: str):
    """The plain function or module behind a fusec.compile wrapper, and the backend to use."""
    if isinstance(model, CompiledModule):
        backend = model._compiled.backend if backend == "auto" else backend
        model = model._orig_mod
    if isinstance(model, CompiledFunction):
        backend = model.backend if backend == "auto" else backend
        model = model.fn
    return model, backend


def capture_for(model, inputs: tuple, kwargs: dict, backend: str, dynamic: dict | None = None):
    """Pick the backend for the inputs' device and capture with source lines recorded (and, for
    a shape family's program, `dynamic` dims as symbols)."""
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    chosen = resolve_backend(backend, device)
    with torch.no_grad():
        captured = capture(model, inputs, kwargs, stack_traces=True, dynamic=dynamic)
    return captured, chosen

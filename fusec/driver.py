"""The driver: a captured graph in, a CompiledGraph out (passes, lowering, build, program).

    captured ATen graph ──passes.PIPELINE──> scheduled graph ──codegen/lower.py──> kernel IR
      ──runtime/build.py──> built, loaded kernels ──runtime/program.py──> Program

`compile_graph` runs those stages for one input signature, times each, and publishes what it made
(fusec/events.py: `captured`, `passes_done`, `kernel_built`, `compiled`) for whoever watches;
it knows nothing of the tools that print or explain (fusec/inspect/). `CompiledGraph` is what
it returns: the record of the compilation (fusec/record.py, `Compilation`: captured graph,
snapshots, the passes' decisions, schedule, memory plan, kernels, program, times), read by
`cf.kernels`, `cf.source()`, `cf.schedule`, `fusec.explain` and `fusec.profile`. The memory is
planned here, once, after lowering (passes/memory.py). `Kernel` is one entry of `cf.kernels`.
"""
from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.fx as fx

from fusec import events
from fusec.capture.frontend import Captured
from fusec.codegen.lower import lower_pointwise
from fusec.codegen.lower_reduction import lower_reduction
from fusec.ir import canonical
from fusec.passes import run_pipeline
from fusec.passes.memory import plan_inplace, plan_memory
from fusec.symbolic import raw_sizes_quiet
from fusec.record import Compilation, group_info, layout_of, owns_buffer, record_of
from fusec.runtime import eager
from fusec.runtime.build import build_all, codegen
from fusec.runtime.cuda_graphs import graph_blocker
from fusec.runtime.program import build_program
from fusec.runtime.writer import python_wrapper


@dataclass
class Kernel:
    """One generated kernel: `name` says what it fuses, `source` is the full generated text.

    `source` is this kernel as it reads in its program: its own name, parameters named after the
    buffers it reads and writes, comments citing its ATen nodes. The binary it runs was built
    from `canonical`, the same kernel with generic names, which every kernel of the program
    (and of any other program) that differs from it only in names shares: one build, one
    loaded binary (fusec/runtime/build.py). `shares` lists the kernels of a program that share it."""

    name: str
    backend: str
    source: str | None  # None: rendered from `ir` when first read
    ops: list[str]
    ir: Any = field(repr=False)  # fusec.ir.PointwiseKernel or ReductionKernel
    launcher: Callable = field(repr=False, default=None)
    built: Any = field(repr=False, default=None)  # its fusec.runtime.build.Built

    def __post_init__(self) -> None:
        if self.source is None:  # rendering is cheap, but a warm start renders only what it builds
            del self.source

    def __getattr__(self, attr: str):
        if attr == "source":  # (only reached while the instance has no `source` yet)
            self.source = self._render()
            return self.source
        raise AttributeError(attr)

    def _render(self) -> str:
        """The source, rendered now from `ir`. The generator reads switches (FUSEC_* variables)
        and rules as they are when it runs, so a source rendered after one of them changed can
        differ from the text that was built: then the built text is what is shown, with generic
        names and a first line that says why. A source must be the kernel that runs."""
        gen = codegen(self.backend)
        text = gen.render(self.ir)
        if self.built is not None and gen.render(canonical(self.ir)) != self.built.source:
            return ("# fusec: the generator renders this kernel differently now than when it was "
                    "built (a FUSEC_* switch or a rule changed since); this is the text that was "
                    "built and runs, with generic names\n" + self.built.source)
        return text

    @property
    def canonical(self) -> str:
        """The text that was compiled into the binary this kernel runs."""
        return self.built.source if self.built is not None else self.source

    def __str__(self) -> str:
        return self.source

    def __repr__(self) -> str:
        ops = [o.split(".")[1] if o.startswith("aten.") else o for o in self.ops]
        shown = ", ".join(ops[:6]) + (f", ... ({len(ops)} ops)" if len(ops) > 6 else "")
        return f"Kernel({self.name!r}, backend={self.backend!r}, ops=[{shown}]; print() it for its source)"


@dataclass(repr=False)
class CompiledGraph(Compilation):
    """Everything compiled for one input signature: the Compilation record (fusec/record.py)
    plus what running it needs."""

    graph_blocker: str | None = "not checked"  # why it cannot be one CUDA graph (None: it can)
    runner: Any = None  # the CudaGraphRunner once captured
    calls: int = 0

    def __repr__(self) -> str:
        externs = sum(1 for s in self.schedule if s.kind == "extern")
        names = ", ".join(k.name for k in self.kernels[:4]) + (", ..." if len(self.kernels) > 4 else "")
        return (f"<CompiledGraph ({self.backend}): {len(self.kernels)} kernel(s) [{names}], "
                f"{externs} extern call(s); .source() is the whole program>")

    def stages(self) -> list:
        """The graph after each pass (`passes.Snapshot`s). A compile records them only when
        someone watches (FUSEC_LOG, FUSEC_DEBUG_DIR, explain, profile): printing a model's graph
        seven times was a fifth of its warm start. Otherwise they are made here, on first use, by
        running the passes again over the captured graph (they are deterministic)."""
        if self.snapshots is None:
            self.snapshots = run_pipeline(self.captured.gm, record=True)[1]
        return self.snapshots

    def source(self) -> str:
        """The whole program: each kernel's source, the schedule and memory plan as comments, the
        Python each call runs (fusec/runtime/writer.py: the very text `program.run` was compiled
        from, with what its globals are), and the graph that calls the kernels."""
        parts = [f"# fusec program ({self.backend} backend): {len(self.kernels)} kernel(s)\n"]
        for k in self.kernels:
            parts.append(f"# ===== kernel {k.name} =====\n{k.source}")
        parts.append("# ===== schedule =====\n" + "\n".join(
            "# " + line for line in self.schedule_text().splitlines()))
        parts.append("# ===== program: the Python each call runs (exec it, then call(...)) =====\n"
                     + python_wrapper(self.program))
        parts.append("# ===== graph =====\n" + self.gm.code)
        return "\n".join(parts)



@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector paused for the duration of a compile.

    Tracing a model allocates hundreds of thousands of small objects (fx nodes, fake tensors,
    their metadata), and every 700 allocations CPython looks for cycles among the young ones,
    every tenth time among older ones too: on a 6-layer BERT that was a quarter of a warm start
    (0.2 s of 0.7 on this project's CPU). Nothing a compile makes is garbage until it ends, so
    the collector waits and runs on its own schedule afterwards. Nesting is safe: only the
    outermost pause switches it back on."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def compile_graph(captured: Captured, backend: str, record: bool = False,
                  label: str = "program") -> CompiledGraph:
    """Run the pass pipeline over a captured graph and build every kernel for `backend`.

    `record`: keep the graph after every pass (`CompiledGraph.stages()` makes them later
    otherwise). Each stage is published as it ends (fusec/events.py), so FUSEC_LOG and
    FUSEC_DEBUG_DIR (fusec/inspect/log.py) show it; `label` names the program for them.
    """
    with gc_paused(), raw_sizes_quiet():
        return _compile_graph(captured, backend, record, label)


def _compile_graph(captured: Captured, backend: str, record: bool, label: str) -> CompiledGraph:
    times = {"capture": captured.seconds}
    events.publish("captured", captured.gm)
    record_of(captured.gm).backend = backend  # a pass may decide by it (fuse_reductions)
    start = time.perf_counter()
    gm, snapshots = run_pipeline(captured.gm, record=record)
    snapshots = snapshots if record else None  # CompiledGraph.stages() makes them when asked
    times["passes"] = time.perf_counter() - start
    events.publish("passes_done", captured.gm, gm, snapshots)
    start = time.perf_counter()
    groups, irs = lower_groups(gm)
    # the memory plan, once: the outputs written over a dying input (which needs the lowered
    # kernels' indices) first, then the pool for every other intermediate buffer
    if captured.shape_env is None:
        inplace = plan_inplace(gm, {node.target: ir for node, ir in zip(groups, irs)}, backend)
        memory = plan_memory(gm, skip=set(inplace))
    else:  # a shape family's program: planned again at each size (fusec/runtime/family_pool.py)
        inplace, memory = {}, plan_memory(gm)
        memory.per_size = True
    times["codegen"] = time.perf_counter() - start  # lowering; build_all adds its rendering
    # one build per distinct kernel, several at a time (fusec/runtime/build.py)
    kernels: dict[str, Kernel] = {}
    device = group_info(groups[0]).device if groups else None
    for node, ir, built in zip(groups, irs, build_all(irs, backend, times, device)):
        launcher = eager_instead(gm, node, ir, built)
        kernels[node.target] = kernel = Kernel(ir.name, built.backend, None, list(ir.ops), ir,
                                               launcher, built)
        events.publish("kernel_built", kernel)
    start = time.perf_counter()
    program = build_program(gm, kernels, memory, inplace)
    compiled = CompiledGraph(backend, captured, gm, snapshots, list(kernels.values()), program,
                             memory, inplace)
    if device is not None and not device.startswith("cuda"):  # kernels on the CPU: no CUDA graph
        compiled.graph_blocker = f"its kernels run on {device}, not on a CUDA device"
    else:
        compiled.graph_blocker = graph_blocker(program, gm, len(program.input_slots),
                                               len(getattr(captured, "lifted", ())))
    times["load"] += time.perf_counter() - start  # binaries loaded, then the program assembled
    compiled.times = times
    events.publish("compiled", compiled, label)
    return compiled


def eager_instead(gm: fx.GraphModule, node: fx.Node, ir, built):
    """The launcher for group `node`: its built kernel's, or, where no backend could build it,
    its ATen ops run eagerly (fusec/runtime/eager.py), warned once per distinct kernel. A Triton
    launcher is also told how to do that should the kernel fail to compile at its first launch
    (Triton compiles lazily): the first group that uses it says how, for every group sharing it
    (they share it because their canonical kernels are the same, so they compute the same)."""
    sub = getattr(gm, node.target)
    ins = [layout_of(a) for a in node.args]
    outs = [layout_of(u) for u in sorted(node.users, key=lambda u: u.args[1])]

    def instead(error: BaseException, warn: bool = True):
        return eager.fall_back(ir.name, sub, ir.params, ins, outs, error, built.source, warn)

    if built.failed:
        group = instead(built.error, warn=not built.warned)
        built.warned = True
        return group
    if getattr(built.launcher, "fallback", False) is None:
        built.launcher.fallback = instead
    return built.launcher


def lower_groups(gm: fx.GraphModule) -> tuple[list[fx.Node], list]:
    """Each fused group's call node and its kernel IR (codegen/lower.py, lower_reduction.py)."""
    by_name = {n.name: n for n in gm.graph.nodes}
    root_dtypes = {n.name: n.meta["fusec"].dtype for n in gm.graph.nodes if owns_buffer(n)}
    groups, irs = [], []
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        sub = getattr(gm, node.target)
        in_layouts = [layout_of(a) for a in node.args]
        outs = sorted((u for u in node.users), key=lambda u: u.args[1])
        out_layouts = [layout_of(u) for u in outs]
        lower = lower_reduction if group_info(sub).kind == "reduction" else lower_pointwise
        irs.append(lower(node.target, sub, in_layouts, out_layouts, root_dtypes))
        groups.append(node)
        group_info(node).device = by_name[outs[0].name].meta["fusec"].device
    return groups, irs

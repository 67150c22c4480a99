"""`fusec.profile(model, *inputs)`: eager vs fused under torch.profiler, side by side.

    report = fusec.profile(model, x)
    print(report)                          # tables: summary, one line per kernel, eager ops
    report.export_chrome_traces("traces")  # eager.json, fused.json for Perfetto / chrome://tracing
    report.save_html("report.html")        # one self-contained page: tables, plots, graphs, sources

What it does, in order:

1. captures and compiles the program (with source lines recorded), exactly as fusec.compile would;
2. times eager calls and calls of a `fusec.compile`d callable with fusec.timing (median of many
   calls): the speedup, for the path a user gets (on CUDA, one CUDA-graph replay when the
   program allows it);
3. runs each under `torch.profiler` (CPU activity, plus CUDA when the inputs are on a GPU), a few
   iterations each. In the fused run every kernel launch is wrapped in
   `torch.profiler.record_function(kernel_name)` and every extern call in
   `record_function("extern aten.mm.default")`, so kernels appear by name in the trace. The
   wrapping is done on a *copy* of the program's steps: the normal call path has no profiler code;
4. runs the captured ATen graph op by op (fx.Interpreter, one `record_function("node NAME")` per
   op) to time each ATen op eagerly: the "eager time" of a kernel is the time of the ATen ops it
   fused;
5. compares each kernel's outputs with the same graph run in float64 (fusec/check.py);
6. measures a copy-bandwidth ceiling (`dst.copy_(src)` over a buffer larger than the caches) to
   judge each kernel's achieved bandwidth.

A program in regions (graph breaks, fusec/capture/breaks.py; or `torch.compile(m, backend="fusec")`)
gets a `RegionsProfile`: eager against the whole compiled call (regions, guards and the eager
Python between them), then the report above for every region's forward program, run on the
inputs that region received.

A "launch" is a device kernel on CUDA; on the CPU it is an ATen op that does work (views and
allocations do not count) or a fused kernel call. "device time" is the time spent inside those
launches; "CPU-side time" is the host time of a whole call (Python, dispatch, launches).

The pieces live next to this file: instrument.py runs the program and the graph so they can be
measured, measure.py reads the profiler's events back, report.py holds the result.
"""
from __future__ import annotations

import html
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from fusec.api import label_of, part_compiler
from fusec.api import compile as fusec_compile
from fusec.capture import calls
from fusec.inspect import distributed
from fusec.capture.regions import Regions, collect_regions, dynamo_compile, original
from fusec.check import compare, float64_reference
from fusec.driver import CompiledGraph, compile_graph
from fusec.errors import GraphBreakError
from fusec.inspect.explain import Explanation, RegionsExplanation, capture_for, unwrap
from fusec.inspect.groups import fmt_bytes
from fusec.timing import Timing, doubts, interpreted, measure, median_ms

from fusec.inspect.instrument import kernel_numerics, OpByOp, profiled_steps, run_steps
from fusec.inspect.measure import measure_cuda_peak, kernel_lines, run_profiler, make_side, sync, copy_bandwidth
from fusec.inspect.report import KernelLine, ProfileReport, Side


# ---- the entry point ----------------------------------------------------------------------------

def profile(model, *inputs, backend: str = "auto", iters: int = 10, warmup: int = 3,
            time_budget_s: float = 0.25, copy_bytes: int | None = None,
            progress: Callable[[str], Any] | None = None, name: str | None = None,
            **kwargs) -> ProfileReport:
    """Profile `model(*inputs, **kwargs)` eagerly and compiled by fusec (see the module doc).

    iters: profiled iterations of each run; warmup: calls before any measurement;
    time_budget_s: time spent on each median timing; copy_bytes: buffer size of the
    copy-bandwidth measurement (default 64 MB on the CPU, 256 MB on a GPU);
    progress: called with each stage's name as it starts (the CLI draws a progress bar).
    """
    if distributed.is_distributed(model):  # DDP / FSDP2: one step, collectives between programs
        return distributed.step_timeline(model, inputs, kwargs, times=True)
    step = progress or (lambda stage: None)
    options = dict(iters=iters, warmup=warmup, time_budget_s=time_budget_s,
                   copy_bytes=copy_bytes, progress=progress)
    torch_compiled = original(model)
    if torch_compiled is not None:  # torch.compile(..., backend="fusec"): Dynamo's regions
        return profile_regions(torch_compiled, inputs, kwargs, backend, name, **options)
    fullgraph = getattr(getattr(model, "_compiled", model), "fullgraph", False)
    model, backend = unwrap(model, backend)
    label = name or label_of(model)

    step("compile")
    try:
        captured, chosen = capture_for(model, inputs, kwargs, backend)
    except GraphBreakError as cause:
        if fullgraph:
            raise
        return profile_regions(model, inputs, kwargs, backend, label, cause=cause, **options)
    cg = compile_graph(captured, chosen, record=True, label=label)
    leaves = calls.flatten_call(model, inputs, kwargs)[0]
    tensors = [*captured.lifted, *(l for l in leaves if isinstance(l, torch.Tensor))]
    device, device_name, note = _device_of(tensors)
    cuda = device.type == "cuda"
    runs = _Runs.of(model, inputs, kwargs, cg, captured.gm, chosen, tensors)
    runs.warm_up(max(warmup, 3))  # compile, capture the CUDA graph, replay
    sync(cuda)
    cuda_graph = _cuda_graph_state(runs.user) if cuda else ""

    step("time eager and fused")
    eager_time, fused_time, said = _median_times(runs, str(device), chosen, time_budget_s)
    eager_side, fused_side, f_events, o_events = _profiled_sides(
        runs, iters, cuda, eager_time.median_ms, fused_time.median_ms, step)
    eager_side.wall_rounds = (eager_time.low_ms, eager_time.high_ms)
    fused_side.wall_rounds = (fused_time.low_ms, fused_time.high_ms)

    step("compare with float64")
    errors = kernel_numerics(cg, tensors)
    numerics = _output_check(cg, tensors, runs.eager)

    step("measure copy bandwidth")
    ceiling = copy_bandwidth(str(device), copy_bytes or ((1 << 28) if cuda else (1 << 26)))

    lines = kernel_lines(cg, f_events, o_events, iters, cuda, ceiling, errors)
    return ProfileReport(label, chosen, device.type, device_name, note, iters, eager_side,
                         fused_side, ceiling, lines, Explanation(cg), numerics, cuda_graph,
                         tuple(said), interpreted(chosen, str(device)))


def _device_of(tensors: list[torch.Tensor]) -> tuple[torch.device, str, str]:
    """(device, its name, a note for the report): where the program's tensors live, and why the
    CPU was profiled when it was (no GPU here, or inputs that are not on it)."""
    device = tensors[0].device if tensors else torch.device("cpu")
    if device.type == "cuda":
        return device, torch.cuda.get_device_name(device), ""
    device_name = platform.processor() or platform.machine() or "CPU"
    note = ("no GPU on this machine: profiled the CPU" if not torch.cuda.is_available() else
            "the inputs are on the CPU: profiled the CPU (move them to a GPU to profile it)")
    return device, device_name, note


@dataclass
class _Runs:
    """The program run five ways, each a call of no arguments, so timing and profiling handle
    them alike: eager, the compiled steps, the user's fusec.compile'd callable, the steps with
    a record_function around each, and the captured ATen graph op by op."""

    eager: Callable
    fused: Callable
    fused_call: Callable
    fused_profiled: Callable
    eager_op_by_op: Callable
    user: Callable  # the fusec.compile'd callable behind fused_call (its CUDA-graph state)

    @classmethod
    def of(cls, model, inputs: tuple, kwargs: dict, cg: CompiledGraph, gm, chosen: str,
           tensors: list[torch.Tensor]) -> "_Runs":
        """The five runs of `model` on its inputs, compiled as `cg` (flat inputs `tensors`)."""
        def eager():
            with torch.no_grad():
                return model(*inputs, **kwargs)

        def fused():
            return cg.program(tensors)

        # The median time is taken on a real fusec.compile'd callable: the path a user gets,
        # with its argument handling and, on CUDA, the replay of one CUDA graph when allowed.
        user = fusec_compile(model, backend=chosen)

        def fused_call():
            with torch.no_grad():
                return user(*inputs, **kwargs)

        steps = profiled_steps(cg.program, cg.schedule)

        def fused_profiled():
            return run_steps(cg.program, steps, tensors)

        by_op = OpByOp(gm, ranges=True)

        def eager_op_by_op():
            with torch.no_grad():
                return by_op.run(*tensors)
        return cls(eager, fused, fused_call, fused_profiled, eager_op_by_op, user)

    def warm_up(self, times: int) -> None:
        """Call each run a few times before any measurement: compile, capture, replay."""
        for _ in range(times):
            self.eager()
            self.fused()
            self.fused_call()
            self.eager_op_by_op()


def _median_times(runs: _Runs, device: str, chosen: str,
                  budget_s: float) -> tuple[Timing, Timing, list[str]]:
    """(eager, fused, doubts): times of an eager call and of the user's compiled call (median
    and rounds), with what makes them doubtful (noise, shared cores, Triton's interpreter)."""
    eager_time = measure(runs.eager, device=device, budget_s=budget_s, warmup=1)
    fused_time = measure(runs.fused_call, device=device, budget_s=budget_s, warmup=1)
    said = doubts(eager_time, fused_time, device=device)
    if interpreted(chosen, device):
        said.insert(0, "the kernels ran under Triton's interpreter (Python on the CPU): the fused "
                       "times are not the kernels' and the speedup means nothing")
    return eager_time, fused_time, said


def _profiled_sides(runs: _Runs, iters: int, cuda: bool, eager_wall: float, fused_wall: float,
                    step: Callable[[str], Any]) -> tuple[Side, Side, Any, Any]:
    """(eager side, fused side, fused events, op-by-op events): eager, the fused steps and the
    graph op by op, each under torch.profiler; the events name every kernel and every ATen op."""
    step("profile eager")
    e_events, e_trace = run_profiler(runs.eager, iters, "eager", cuda)
    step("profile fused")
    f_events, f_trace = run_profiler(runs.fused_profiled, iters, "fused", cuda)
    step("profile eager ops one by one")
    o_events, _ = run_profiler(runs.eager_op_by_op, iters, "ops", cuda)

    eager_side = make_side(e_events, e_trace, "eager", iters, cuda, eager_wall,
                           measure_cuda_peak(runs.eager) if cuda else None)
    fused_side = make_side(f_events, f_trace, "fused", iters, cuda, fused_wall,
                           measure_cuda_peak(runs.fused) if cuda else None)
    return eager_side, fused_side, f_events, o_events


@dataclass
class RegionsProfile:
    """`fusec.profile` of a program in regions: the whole call, then each region's report."""

    name: str
    eager_ms: float  # median time of an eager call
    fused_ms: float  # median time of the compiled call: regions, guards, eager Python between
    regions: list  # [(fusec.capture.regions.Region, ProfileReport of its forward program)]
    explanation: RegionsExplanation = field(repr=False)

    @property
    def speedup(self) -> float:
        return self.eager_ms / self.fused_ms if self.fused_ms else float("nan")

    @property
    def kernels(self) -> list[KernelLine]:
        return [k for _, report in self.regions for k in report.kernels]

    def to_dict(self) -> dict:
        return {"name": self.name, "eager_ms": self.eager_ms, "fused_ms": self.fused_ms,
                "speedup": self.speedup, "breaks": self.explanation.breaks(),
                "regions": [dict(report.to_dict(), region=region.index,
                                 function=region.function, span=region.span())
                            for region, report in self.regions]}

    def export_chrome_traces(self, directory) -> list[Path]:
        return [p for _, report in self.regions for p in report.export_chrome_traces(directory)]

    def save_html(self, path) -> Path:
        """One HTML page per region (`<name>_region<i>.html` next to `path`) and, at `path`, a
        page that lists the regions and breaks and links to them."""
        path = Path(path)
        links = []
        for region, report in self.regions:
            page = path.with_name(f"{path.stem}_region{region.index}{path.suffix or '.html'}")
            report.save_html(page)
            links.append(f'<li><a href="{html.escape(page.name)}">{html.escape(region.title())}'
                         f"</a>: {report.speedup:.2f}x</li>")
        summary = html.escape(self.explanation.regions.summary())
        path.write_text(f"<!doctype html><meta charset='utf-8'><title>fusec profile: "
                        f"{html.escape(self.name)}</title><h1>{html.escape(self.name)} in regions"
                        f"</h1><p>eager {self.eager_ms:.4f} ms, fusec {self.fused_ms:.4f} ms "
                        f"({self.speedup:.2f}x)</p><pre>{summary}</pre><ul>{''.join(links)}</ul>",
                        encoding="utf-8")
        return path

    def __str__(self) -> str:
        out = [f"fusec profile: {self.name} in regions (graph breaks)",
               f"whole call: eager {self.eager_ms:.4f} ms, fusec {self.fused_ms:.4f} ms "
               f"({self.speedup:.2f}x; Dynamo's guards and the eager Python between regions "
               "included)",
               self.explanation.regions.summary()]
        for region, report in self.regions:
            out.append(f"\n##### {region.title()} #####\n{report}")
        return "\n".join(out)

    def _repr_pretty_(self, p, cycle):
        p.text(str(self))


def profile_regions(model, inputs: tuple, kwargs: dict, backend: str, name: str | None,
                    progress=None, cause=None, **options) -> RegionsProfile:
    """Profile a program that runs in regions: find them (one run through TorchDynamo), time
    the whole call eagerly and compiled, then profile each region's forward program on the
    inputs it received in that run, as `profile` does for a whole program."""
    step = progress or (lambda stage: None)
    label = name or label_of(model)
    step("compile")
    collected = collect_regions(model, inputs, kwargs, part_compiler(backend), backend, label=label,
                                keep_inputs=True, cause=cause)
    user = dynamo_compile(model, Regions(part_compiler(backend), backend, label=label))

    def eager():
        with torch.no_grad():
            return model(*inputs, **kwargs)

    def compiled():
        with torch.no_grad():
            return user(*inputs, **kwargs)

    for _ in range(3):
        eager()
        compiled()
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    device = str(tensors[0].device) if tensors else "cpu"
    step("time eager and fused")
    budget = options.get("time_budget_s", 0.25)
    eager_ms = median_ms(eager, device=device, budget_s=budget, warmup=1)
    fused_ms = median_ms(compiled, device=device, budget_s=budget, warmup=1)
    reports = []
    for region in collected.last_call:
        if not region.parts or region.examples is None:
            continue
        part = region.parts[0]
        reports.append((region, profile(part.fn, *region.examples, backend=part.backend,
                                        name=f"{label} region {region.index}", **options)))
    return RegionsProfile(label, eager_ms, fused_ms, reports, RegionsExplanation(collected))


def _cuda_graph_state(user) -> str:
    """Whether the compiled callable replays one CUDA graph, or why not."""
    fn = getattr(user, "_compiled", user)
    last = getattr(fn, "last", None)
    if last is None:
        return ""
    if getattr(last, "runner", None) is not None:
        return "replayed as one CUDA graph"
    blocker = getattr(last, "graph_blocker", None)
    return f"not a CUDA graph: {blocker}" if blocker else "not a CUDA graph"


def _output_check(cg: CompiledGraph, tensors: list[torch.Tensor], eager: Callable) -> str:
    """The whole program's outputs judged as check=True judges them."""

    with torch.no_grad():
        fused = cg.program(tensors)
        want = pytree.tree_leaves(eager())
        ref = float64_reference(cg.captured.gm, tensors)
    for i, (f, e) in enumerate(zip(fused, want)):
        problem = compare(f, e, ref[i] if ref is not None and i < len(ref) else None)
        if problem:
            return f"output {i}: {problem}"
    return (f"ok: {len(fused)} output(s) no further from a float64 reference than eager's"
            if ref is not None else f"ok: {len(fused)} output(s) match eager")


__all__ = ["profile", "ProfileReport", "KernelLine", "Side", "copy_bandwidth", "fmt_bytes"]

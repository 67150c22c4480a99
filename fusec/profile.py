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

A program in regions (graph breaks, fusec/breaks.py; or `torch.compile(m, backend="fusec")`)
gets a `RegionsProfile`: eager against the whole compiled call (regions, guards and the eager
Python between them), then the report above for every region's forward program, run on the
inputs that region received.

A "launch" is a device kernel on CUDA; on the CPU it is an ATen op that does work (views and
allocations do not count) or a fused kernel call. "device time" is the time spent inside those
launches; "CPU-side time" is the host time of a whole call (Python, dispatch, launches).
"""
from __future__ import annotations

import functools
import json
import os
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.profiler import ProfilerActivity, record_function

from . import frontend
from .api import CompiledGraph, compile_graph
from .errors import GraphBreakError
from .explain import (Explanation, RegionsExplanation, _label, capture_for, distinct_elements,
                      fmt_bytes, kernel_traffic, unwrap, user_line)
from .runtime import KernelStep, ExternStep

STAGES = ("compile", "time eager and fused", "profile eager", "profile fused",
          "profile eager ops one by one", "compare with float64", "measure copy bandwidth")


# ---- report data --------------------------------------------------------------------------------

@dataclass
class Side:
    """One way of running the program (eager or fused), per iteration."""

    launches: float  # device kernels (CUDA) or working ATen ops / kernel calls (CPU)
    device_ms: float  # time inside those launches
    cpu_ms: float  # host time of a whole call, under the profiler
    wall_ms: float  # median time of a call, timed without the profiler
    peak_bytes: int | None  # memory allocated during a call, at its peak (beyond the inputs)
    by_name: list[dict] = field(default_factory=list)  # name, calls, ms per iteration
    trace: str = field(default="", repr=False)  # Chrome trace JSON


@dataclass
class KernelLine:
    """One step of the fused program, tied to where it came from and what it achieved."""

    name: str
    kind: str  # "kernel" or "extern"
    ops: list[str]
    nodes: list[str]
    lines: list[str]  # user source lines
    eager_ms: float | None  # the same ATen ops, run eagerly one by one
    fused_ms: float | None
    bytes: int | None = None  # read + written, from the kernel IR
    read_bytes: int | None = None
    write_bytes: int | None = None
    eager_bytes: int | None = None  # what eager's separate ops read and write in total
    flops: int | None = None
    bandwidth: float | None = None  # bytes / second
    ceiling_fraction: float | None = None
    max_error: float | None = None  # max |fused - float64 reference| over the step's outputs
    eager_error: float | None = None  # max |eager - float64 reference|
    numerics: str = ""  # "ok", or check.compare's description of the problem

    @property
    def intensity(self) -> float | None:
        return self.flops / self.bytes if self.flops is not None and self.bytes else None


@dataclass
class ProfileReport:
    name: str
    backend: str
    device: str  # "cpu" or "cuda"
    device_name: str
    note: str  # e.g. "no GPU on this machine: profiled the CPU"
    iters: int
    eager: Side
    fused: Side
    copy_bandwidth: float  # bytes / second
    kernels: list[KernelLine]
    explanation: Explanation = field(repr=False)
    numerics: str = ""  # the program's outputs against eager and a float64 reference
    cuda_graph: str = ""  # on CUDA: whether the compiled call replays one CUDA graph, or why not

    @property
    def speedup(self) -> float:
        """Eager median time / fused median time (both timed without the profiler)."""
        return self.eager.wall_ms / self.fused.wall_ms if self.fused.wall_ms else float("nan")

    # -- output ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        def side(s: Side) -> dict:
            return {k: v for k, v in vars(s).items() if k != "trace"}
        return {"name": self.name, "backend": self.backend, "device": self.device,
                "device_name": self.device_name, "note": self.note, "iters": self.iters,
                "speedup": self.speedup, "copy_bandwidth": self.copy_bandwidth,
                "numerics": self.numerics, "cuda_graph": self.cuda_graph,
                "eager": side(self.eager), "fused": side(self.fused),
                "kernels": [dict(vars(k), intensity=k.intensity) for k in self.kernels]}

    def export_chrome_traces(self, directory) -> list[Path]:
        """Write eager.json and fused.json (open in https://ui.perfetto.dev or chrome://tracing)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        paths = []
        safe = "".join(c if c.isalnum() or c in "_-." else "_" for c in self.name)
        for label, s in (("eager", self.eager), ("fused", self.fused)):
            path = directory / f"{safe}_{label}.json"
            path.write_text(s.trace)
            paths.append(path)
        return paths

    def save_html(self, path) -> Path:
        """One self-contained HTML page (no network needed): tables, plots, graphs, sources."""
        from .report_html import render_html
        path = Path(path)
        path.write_text(render_html(self), encoding="utf-8")
        return path

    def rich(self):
        """The report as rich renderables (what print() shows)."""
        from .report_text import renderables
        return renderables(self)

    def __rich_console__(self, console, options):
        yield from self.rich()

    def __str__(self) -> str:
        from .report_text import to_text
        return to_text(self)

    def _repr_pretty_(self, p, cycle):
        p.text(str(self))


# ---- the profiled program -----------------------------------------------------------------------

class _Named:
    """A program step wrapped in a profiler range (used only in the profiled copy of the steps)."""

    def __init__(self, step, label: str):
        self.step, self.label = step, label

    def __call__(self, env: list) -> None:
        with record_function(self.label):
            self.step(env)


def extern_label(op: str, node: str) -> str:
    return f"extern {op} -> {node}"


def profiled_steps(program, schedule=None) -> list:
    """The program's steps, each kernel launch and extern call inside a named profiler range:
    the kernel's name, or `extern aten.mm.default -> mm` (op and the value it computes)."""
    extern_nodes = [s.node for s in schedule or [] if s.kind == "extern"]
    n_extern = sum(isinstance(s, ExternStep) for s in program.steps)
    if len(extern_nodes) != n_extern:
        extern_nodes = None
    out, i = [], 0
    for step in program.steps:
        if isinstance(step, KernelStep):
            out.append(_Named(step, step.name))
        elif isinstance(step, ExternStep):
            node = extern_nodes[i] if extern_nodes else "?"
            out.append(_Named(step, extern_label(step.name, node)))
            i += 1
        else:
            out.append(step)
    return out


def run_steps(program, steps: list, inputs: list[torch.Tensor], keep: bool = False) -> list:
    """Program.__call__ over `steps`, returning the whole slot environment.

    Intermediate buffers share pooled memory (passes/schedule.py): once a buffer's last reader
    has run, a later step may write over its bytes. With `keep=True` each kernel's outputs are
    copied out of the pool as soon as the kernel has run, so that every slot of the returned
    environment still holds the value it had when it was made (what a per-kernel numerics check
    must compare); without it, only the program's outputs are sure to be intact.
    """
    env: list = [None] * program.n_slots
    for slot, t in zip(program.input_slots, inputs):
        env[slot] = t
    for slot, t in program.constants:
        env[slot] = t
    for step in steps:
        saved = {}
        if keep and isinstance(step, KernelStep):  # an input written over stays intact too
            for buf in step.writes:
                if buf.inplace is not None:
                    saved[buf.inplace] = env[buf.inplace]
                    env[buf.inplace] = env[buf.inplace].clone()
        step(env)
        if keep and isinstance(step, KernelStep):
            for buf in step.writes:
                env[buf.slot] = env[buf.slot].clone()
            for slot, t in saved.items():
                env[slot] = t
    return env


def kernel_output_slots(cg: CompiledGraph) -> dict[str, int]:
    """Value name -> slot for every buffer a kernel writes."""
    by_kernel = {k.name: k for k in cg.kernels}
    out = {}
    for step in cg.program.steps:
        if isinstance(step, KernelStep):
            names = [p.name for p in by_kernel[step.name].ir.params if p.is_output]
            for name, buf in zip(names, step.writes):
                out[name] = buf.slot
    return out


class _OpByOp(fx.Interpreter):
    """Runs a captured graph node by node, each ATen op inside `record_function("node NAME")`."""

    def __init__(self, gm, ranges: bool):
        super().__init__(gm, garbage_collect_values=False)
        self.ranges = ranges

    def run_node(self, n):
        if self.ranges and n.op == "call_function":
            with record_function(f"node {n.name}"):
                return super().run_node(n)
        return super().run_node(n)


# ---- measuring ----------------------------------------------------------------------------------

def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _profile(fn: Callable, iters: int, label: str, cuda: bool):
    import warnings
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "Profiler clears events at the end ..."
        with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
            for _ in range(iters):
                with record_function(f"{label} iteration"):
                    fn()
            _sync(cuda)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        trace = Path(path).read_text()
    return prof.events(), trace


@functools.lru_cache(maxsize=None)
def _aten_is_view(name: str) -> bool:
    from fusec import ops
    packet = getattr(torch.ops.aten, name.split("::", 1)[-1], None)
    if packet is None:
        return False
    try:
        overloads = packet.overloads()
        overload = getattr(packet, "default" if "default" in overloads else overloads[0])
        return ops.is_view(overload)
    except Exception:
        return False


_NO_WORK = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::detach",
            "aten::lift_fresh", "aten::alias", "aten::resolve_conj", "aten::resolve_neg",
            "aten::result_type", "aten::set_", "aten::_local_scalar_dense", "aten::item"}
_WRAPPERS = {"aten::to", "aten::contiguous", "aten::reshape", "aten::type_as", "aten::expand_as",
             "aten::view_as", "aten::flatten", "aten::unflatten", "aten::clone"}


def does_work(evt) -> bool:
    """Does this CPU-side op launch real work (not a view, an allocation or a no-op `to`)?"""
    name = evt.name
    if name in _NO_WORK or (name.startswith("aten::") and _aten_is_view(name)):
        return False
    if name in _WRAPPERS:
        return name == "aten::clone" or any(does_work(c) for c in evt.cpu_children)
    return True


def _device_events(events) -> list:
    """Work on the device: kernels, memcpys, memsets (not the GPU-side copies of the
    record_function ranges, which carry the same names as the ranges)."""
    from torch.autograd import DeviceType
    return [e for e in events if e.device_type != DeviceType.CPU
            and not getattr(e, "is_user_annotation", False)
            and "annotation" not in str(getattr(e, "activity_type", "") or "").lower()]


def _iterations(events, label: str) -> list:
    from torch.autograd import DeviceType
    return [e for e in events if e.name == f"{label} iteration" and e.device_type == DeviceType.CPU]


def _launch_events(events, label: str, cuda: bool) -> list:
    if cuda:
        return _device_events(events)
    out = []
    for it in _iterations(events, label):
        out += [c for c in it.cpu_children if does_work(c)]
    return out


def _duration_ms(evt, cuda: bool) -> float:
    if cuda:
        return evt.time_range.elapsed_us() / 1e3
    return evt.cpu_time_total / 1e3


def _by_name(events, iters: int, cuda: bool) -> list[dict]:
    table: dict[str, list] = {}
    for e in events:
        row = table.setdefault(e.name, [0, 0.0])
        row[0] += 1
        row[1] += _duration_ms(e, cuda)
    rows = [{"name": name, "calls": c / iters, "ms": ms / iters} for name, (c, ms) in table.items()]
    return sorted(rows, key=lambda r: -r["ms"])


def _peak_from_trace(trace: str, label: str, cuda: bool) -> int | None:
    """Peak of memory allocated during the first profiled iteration, from the trace's [memory]
    events (bytes allocated minus freed, running sum)."""
    try:
        events = json.loads(trace)["traceEvents"]
    except (ValueError, KeyError):
        return None
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                   if e.get("name") == f"{label} iteration" and e.get("ph") == "X"
                   and e.get("cat") == "user_annotation")
    if not spans:
        return None
    start, end = spans[0]
    wanted = 1 if cuda else 0
    mem = sorted((e["ts"], e["args"].get("Bytes", 0)) for e in events
                 if e.get("name") == "[memory]" and start <= e.get("ts", -1) <= end
                 and e.get("args", {}).get("Device Type") == wanted)
    running = peak = 0
    for _, b in mem:
        running += b
        peak = max(peak, running)
    return peak


def _cuda_peak(fn: Callable) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@functools.lru_cache(maxsize=None)
def copy_bandwidth(device: str, nbytes: int = 1 << 26) -> float:
    """Bytes per second that `dst.copy_(src)` reaches on `device` (read + write counted), over a
    buffer of `nbytes`: the practical ceiling for a memory-bound kernel."""
    from .timing import median_ms
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(dst.copy_, src, device=device, budget_s=0.3)
    return 2 * n * 4 / (ms / 1e3)


def _value_bytes(node: fx.Node) -> int:
    from .ir import TensorMeta
    m = node.meta.get("fusec")
    if not isinstance(m, TensorMeta):
        return 0
    return distinct_elements(m.shape, m.stride) * torch.empty((), dtype=m.dtype).element_size()


def _eager_bytes(gm: fx.GraphModule, names: list[str]) -> int:
    """Bytes eager PyTorch moves for these ATen ops run one by one: each reads its tensor inputs
    and writes its output (views read in place: only the elements they reach count)."""
    by_name = {n.name: n for n in gm.graph.nodes}
    total = 0
    for name in names:
        node = by_name.get(name)
        if node is None or node.op != "call_function":
            continue
        total += _value_bytes(node) + sum(_value_bytes(a) for a in node.all_input_nodes)
    return total


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    d = (a.double() - b.double()).abs()
    d = d[torch.isfinite(d)]
    return float(d.max()) if d.numel() else 0.0


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
    step = progress or (lambda stage: None)
    options = dict(iters=iters, warmup=warmup, time_budget_s=time_budget_s,
                   copy_bytes=copy_bytes, progress=progress)
    from .breaks import original
    torch_compiled = original(model)
    if torch_compiled is not None:  # torch.compile(..., backend="fusec"): Dynamo's regions
        return profile_regions(torch_compiled, inputs, kwargs, backend, name, **options)
    fullgraph = getattr(getattr(model, "_compiled", model), "fullgraph", False)
    model, backend = unwrap(model, backend)
    label = name or _label(model)

    step("compile")
    try:
        captured, chosen = capture_for(model, inputs, kwargs, backend)
    except GraphBreakError as cause:
        if fullgraph:
            raise
        return profile_regions(model, inputs, kwargs, backend, label, cause=cause, **options)
    cg = compile_graph(captured, chosen, record=True, label=label)
    leaves = frontend.flatten_call(model, inputs, kwargs)[0]
    tensors = [*captured.lifted, *(l for l in leaves if isinstance(l, torch.Tensor))]
    device = tensors[0].device if tensors else torch.device("cpu")
    cuda = device.type == "cuda"
    if cuda:
        device_name = torch.cuda.get_device_name(device)
        note = ""
    else:
        import platform
        device_name = platform.processor() or platform.machine() or "CPU"
        note = ("no GPU on this machine: profiled the CPU" if not torch.cuda.is_available() else
                "the inputs are on the CPU: profiled the CPU (move them to a GPU to profile it)")

    def eager():
        with torch.no_grad():
            return model(*inputs, **kwargs)

    def fused():
        return cg.program(tensors)

    # The median time is taken on a real fusec.compile'd callable: the path a user gets, with
    # its argument handling and, on CUDA, the replay of one CUDA graph when the program allows.
    from .api import compile as fusec_compile
    user = fusec_compile(model, backend=chosen)

    def fused_call():
        with torch.no_grad():
            return user(*inputs, **kwargs)

    steps = profiled_steps(cg.program, cg.gm.meta["fusec_schedule"])

    def fused_profiled():
        return run_steps(cg.program, steps, tensors)

    by_op = _OpByOp(captured.gm, ranges=True)

    def eager_op_by_op():
        with torch.no_grad():
            return by_op.run(*tensors)

    for _ in range(max(warmup, 3)):  # compile, capture the CUDA graph, replay
        eager()
        fused()
        fused_call()
        eager_op_by_op()
    _sync(cuda)
    cuda_graph = _cuda_graph_state(user) if cuda else ""

    step("time eager and fused")
    from .timing import median_ms
    eager_wall = median_ms(eager, device=str(device), budget_s=time_budget_s, warmup=1)
    fused_wall = median_ms(fused_call, device=str(device), budget_s=time_budget_s, warmup=1)

    step("profile eager")
    e_events, e_trace = _profile(eager, iters, "eager", cuda)
    step("profile fused")
    f_events, f_trace = _profile(fused_profiled, iters, "fused", cuda)
    step("profile eager ops one by one")
    o_events, _ = _profile(eager_op_by_op, iters, "ops", cuda)

    eager_side = _side(e_events, e_trace, "eager", iters, cuda, eager_wall,
                       _cuda_peak(eager) if cuda else None)
    fused_side = _side(f_events, f_trace, "fused", iters, cuda, fused_wall,
                       _cuda_peak(fused) if cuda else None)

    step("compare with float64")
    errors = _numerics(cg, tensors)
    numerics = _output_check(cg, tensors, eager)

    step("measure copy bandwidth")
    ceiling = copy_bandwidth(str(device), copy_bytes or ((1 << 28) if cuda else (1 << 26)))

    lines = _kernel_lines(cg, f_events, o_events, iters, cuda, ceiling, errors)
    return ProfileReport(label, chosen, device.type, device_name, note, iters, eager_side,
                         fused_side, ceiling, lines, Explanation(cg), numerics, cuda_graph)


@dataclass
class RegionsProfile:
    """`fusec.profile` of a program in regions: the whole call, then each region's report."""

    name: str
    eager_ms: float  # median time of an eager call
    fused_ms: float  # median time of the compiled call: regions, guards, eager Python between
    regions: list  # [(fusec.breaks.Region, ProfileReport of its forward program)]
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
        import html
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
    from .breaks import Regions, collect_regions, dynamo_compile
    from .timing import median_ms
    step = progress or (lambda stage: None)
    label = name or _label(model)
    step("compile")
    collected = collect_regions(model, inputs, kwargs, backend, label=label, keep_inputs=True,
                                cause=cause)
    user = dynamo_compile(model, Regions(backend, label=label))

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
    from torch.utils import _pytree as pytree

    from .check import compare, float64_reference
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


def _side(events, trace, label, iters, cuda, wall_ms, cuda_peak) -> Side:
    launches = _launch_events(events, label, cuda)
    its = _iterations(events, label)
    cpu_ms = statistics.mean(e.cpu_time_total for e in its) / 1e3 if its else 0.0
    device_ms = sum(_duration_ms(e, cuda) for e in launches) / iters
    peak = cuda_peak if cuda else _peak_from_trace(trace, label, cuda)
    return Side(len(launches) / iters, device_ms, cpu_ms, wall_ms, peak,
                _by_name(launches, iters, cuda), trace)


def _range_ms(events, name: str, iters: int, cuda: bool) -> float | None:
    """Per-iteration time of the profiler ranges called `name`: on CUDA the device time of the
    kernels launched inside them, on the CPU the time of the ATen ops (or kernel) inside."""
    from torch.autograd import DeviceType
    found = [e for e in events if e.name == name and e.device_type == DeviceType.CPU]
    if not found:
        return None
    if cuda:
        return sum(e.device_time_total for e in found) / 1e3 / iters
    total = 0.0
    for e in found:
        kids = [c for c in e.cpu_children]
        total += sum(c.cpu_time_total for c in kids) if kids else e.cpu_time_total
    return total / 1e3 / iters


def _kernel_time(events, name: str, iters: int, cuda: bool) -> float | None:
    if cuda:  # the device kernel has the kernel's name (Triton names it after the jit function)
        dev = [e for e in _device_events(events) if e.name == name]
        if dev:
            return sum(e.time_range.elapsed_us() for e in dev) / 1e3 / iters
        return _range_ms(events, name, iters, cuda)
    from torch.autograd import DeviceType
    found = [e for e in events if e.name == name and e.device_type == DeviceType.CPU]
    return sum(e.cpu_time_total for e in found) / 1e3 / iters if found else None


def value_slots(cg: CompiledGraph) -> dict[str, int]:
    """Value name -> slot for every root buffer of the program: inputs, constants, kernel
    outputs and extern results (views have no slot unless materialized; see `_value`)."""
    gm, program = cg.gm, cg.program
    out = dict(kernel_output_slots(cg))
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    out.update(zip(placeholders, program.input_slots))
    attrs = [n.name for n in gm.graph.nodes if n.op == "get_attr"]
    out.update(zip(attrs, [slot for slot, _ in program.constants]))
    externs = [s.node for s in gm.meta["fusec_schedule"] if s.kind == "extern"]
    ext_steps = [s for s in program.steps if isinstance(s, ExternStep)]
    if len(externs) == len(ext_steps):
        out.update(zip(externs, [s.out_slot for s in ext_steps]))
    return out


def _value(node: fx.Node, env: list, slots: dict[str, int], cache: dict):
    """The fused program's value of `node`: its slot, or a view replayed on its root's value."""
    if node.name in cache:
        return cache[node.name]
    if node.name in slots and env[slots[node.name]] is not None:
        value = env[slots[node.name]]
    elif node.op == "call_function":
        args = fx.node.map_arg(node.args, lambda a: _value(a, env, slots, cache))
        kwargs = fx.node.map_arg(node.kwargs, lambda a: _value(a, env, slots, cache))
        value = node.target(*args, **kwargs)
    else:
        raise KeyError(node.name)
    cache[node.name] = value
    return value


def _numerics(cg: CompiledGraph, tensors: list[torch.Tensor]) -> dict[str, tuple]:
    """Kernel name -> (max |fused - f64|, max |eager - f64|, problem or None).

    Each kernel is judged on its own: its sub-graph runs in float64 on the very inputs the fused
    kernel read (a local reference), and eagerly (ATen, the inputs' dtypes) on the same inputs.
    Errors therefore do not pile up from earlier steps: the numbers are this kernel's rounding.
    The judgement is check.compare's (fused may not be further from the reference than eager,
    beyond the dtype's tolerance).
    """
    from .check import compare
    gm = cg.gm
    with torch.no_grad():
        env = run_steps(cg.program, cg.program.steps, tensors, keep=True)
    slots = value_slots(cg)
    by_kernel = {k.name: k for k in cg.kernels}
    cache: dict = {}
    out = {}
    for node in gm.graph.nodes:
        if node.op != "call_module" or node.target not in by_kernel:
            continue
        sub = getattr(gm, node.target)
        try:
            with torch.no_grad():
                inputs = [_value(a, env, slots, cache) for a in node.args]
                eager = list(sub(*inputs))
                ref = list(sub(*[t.double() if t.is_floating_point() else t for t in inputs]))
        except Exception:  # an op without float64 support: no error column for this kernel
            continue
        names = [p.name for p in by_kernel[node.target].ir.params if p.is_output]
        worst_f, worst_e, problem = 0.0, 0.0, None
        for name, e, r in zip(names, eager, ref):
            if name not in slots:
                continue
            f = env[slots[name]]
            r = r if r.shape == f.shape else None
            problem = problem or compare(f, e, r)
            base = r if r is not None else e
            worst_f = max(worst_f, _max_abs(f, base))
            worst_e = max(worst_e, _max_abs(e, base))
        out[node.target] = (worst_f, worst_e, problem)
    return out


def _kernel_times(events, names: list[str], iters: int, cuda: bool) -> dict[str, float | None]:
    """Per-iteration time of each kernel step in `names` (program order).

    Kernels with the same canonical source share one binary (fusec/build.py), and on a GPU the
    device event carries the binary's name: the kernel family, `fused_add_gelu` for
    `fused_add_gelu_3` and `fused_add_gelu_7` alike. The profiled run launches the steps one by
    one in program order, so within a family the i-th launch of an iteration is the family's
    i-th step; events are dealt out to the steps that way."""
    from fusec.ir import family
    out: dict[str, float | None] = {}
    if cuda:
        members: dict[str, list[str]] = {}
        for n in names:
            members.setdefault(family(n), []).append(n)
        device = sorted(_device_events(events), key=lambda e: e.time_range.start)
        for fam, steps in members.items():
            launches = [e for e in device if e.name == fam]
            if launches and len(launches) % len(steps) == 0:
                totals = [0.0] * len(steps)
                for i, e in enumerate(launches):
                    totals[i % len(steps)] += e.time_range.elapsed_us()
                out.update((n, t / 1e3 / iters) for n, t in zip(steps, totals))
    for n in names:
        if n not in out:
            out[n] = _kernel_time(events, n, iters, cuda)
    return out


def _kernel_lines(cg, f_events, o_events, iters, cuda, ceiling, errors) -> list[KernelLine]:
    by_kernel = {k.name: k for k in cg.kernels}
    gm = cg.gm
    captured = cg.captured.gm
    by_name = {n.name: n for n in gm.graph.nodes}
    lines: list[KernelLine] = []
    kernel_ms = _kernel_times(f_events, [s.name for s in gm.meta["fusec_schedule"]
                                         if s.kind == "kernel"], iters, cuda)
    for s in gm.meta["fusec_schedule"]:
        if s.kind == "kernel":
            k = by_kernel[s.name]
            sub = getattr(gm, s.name)
            members = [n for n in sub.graph.nodes if n.op == "call_function"]
            src = []
            for n in members:
                line = user_line(n)
                if line and line not in src:
                    src.append(line)
            names = [n.name for n in members]
            eager_ms = _sum_opt(_range_ms(o_events, f"node {n}", iters, cuda) for n in names)
            fused_ms = kernel_ms[s.name]
            t = kernel_traffic(k.ir)
            bw = t["bytes"] / (fused_ms / 1e3) if fused_ms else None
            err = errors.get(s.name)
            lines.append(KernelLine(
                s.name, "kernel", [str(n.target).replace("aten.", "") for n in members], names, src,
                eager_ms, fused_ms, t["bytes"], t["read_bytes"], t["write_bytes"],
                _eager_bytes(captured, names), t["flops"], bw, bw / ceiling if bw else None,
                err[0] if err else None, err[1] if err else None,
                (err[2] or "ok") if err else ""))
        else:
            node = by_name[s.node]
            line = user_line(node)
            lines.append(KernelLine(
                s.name, "extern", [s.name.replace("aten.", "")], [s.node], [line] if line else [],
                _range_ms(o_events, f"node {s.node}", iters, cuda),
                _range_ms(f_events, extern_label(s.name, s.node), iters, cuda),
                eager_bytes=_eager_bytes(captured, [s.node])))
    return lines


def _sum_opt(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) if values else None


__all__ = ["profile", "ProfileReport", "KernelLine", "Side", "copy_bandwidth", "fmt_bytes"]

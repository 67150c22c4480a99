"""The profile report's data: one `Side` per run (eager, fused), one `KernelLine` per kernel, and
`ProfileReport`, which holds them and prints itself (report_text.py), exports the Chrome traces
and saves one HTML page (report_html.py). `fusec.profile` (profile.py) fills it in.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


from fusec.inspect.explain import Explanation

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
    wall_rounds: tuple = ()  # (fastest, slowest) round's median of wall_ms (fusec/timing.py)

    @property
    def wall_spread(self) -> float | None:
        """(slowest - fastest round) / median: how much wall_ms moved between rounds."""
        if not self.wall_rounds or not self.wall_ms:
            return None
        return (self.wall_rounds[1] - self.wall_rounds[0]) / self.wall_ms


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
    doubts: tuple = ()  # why the times should not be trusted, in sentences (fusec/timing.py)
    interpreted: bool = False  # the kernels ran under Triton's interpreter: no speedup to report

    @property
    def speedup(self) -> float:
        """Eager median time / fused median time (both timed without the profiler); nan under
        Triton's interpreter, whose Python says nothing about the kernels' speed."""
        if self.interpreted or not self.fused.wall_ms:
            return float("nan")
        return self.eager.wall_ms / self.fused.wall_ms

    # -- output ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        def side(s: Side) -> dict:
            return {k: v for k, v in vars(s).items() if k != "trace"}
        return {"name": self.name, "backend": self.backend, "device": self.device,
                "device_name": self.device_name, "note": self.note, "iters": self.iters,
                "speedup": self.speedup, "copy_bandwidth": self.copy_bandwidth,
                "numerics": self.numerics, "cuda_graph": self.cuda_graph,
                "doubts": list(self.doubts), "interpreted": self.interpreted,
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
        from fusec.inspect.report_html import render_html  # lazy: jinja2 and rich, when drawn
        path = Path(path)
        path.write_text(render_html(self), encoding="utf-8")
        return path

    def rich(self, width: int = 160):
        """The report as rich renderables (what print() shows), its tables fitted to `width`."""
        from fusec.inspect.report_text import renderables  # lazy: rich, when drawn
        return renderables(self, width)

    def __rich_console__(self, console, options):
        yield from self.rich(options.max_width)

    def __str__(self) -> str:
        from fusec.inspect.report_text import to_text  # lazy: rich, when drawn
        return to_text(self)

    def _repr_pretty_(self, p, cycle):
        p.text(str(self))

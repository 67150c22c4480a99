"""The profile report as text: rich tables for the terminal (`print(report)`).

Three tables: eager vs fused side by side, one line per step of the fused program (the kernel
line: where it came from, eager vs fused time, bytes, bandwidth, error), and where eager spends
its time, op by op.
"""
from __future__ import annotations

import io

from rich import box
from rich.console import Console, Group
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from fusec.inspect.groups import fmt_bytes


def ms(v: float | None) -> str:
    if v is None:
        return "-"
    if v < 0.01:
        return f"{v * 1e3:.2f} µs"
    return f"{v:.3f} ms"


def bandwidth(v: float | None) -> str:
    return "-" if v is None else f"{v / 1e9:.1f} GB/s"


def err(v: float | None) -> str:
    return "-" if v is None else f"{v:.2g}"


def launches(v: float) -> str:
    return f"{v:.0f}" if abs(v - round(v)) < 1e-9 else f"{v:.1f}"


def change(eager, fused) -> str:
    """`2.50x less` / `1.20x more`: how the fused number compares with eager's."""
    if eager is None or fused is None or not eager or not fused:
        return "-"
    return f"{eager / fused:.2f}x less" if fused <= eager else f"{fused / eager:.2f}x more"


def spread(side) -> str:
    """A side's median time and how much its timing rounds moved: `0.026 ms ±3%` (± half the
    range of the rounds' medians, as the demo prints it)."""
    s = getattr(side, "wall_spread", None)
    return ms(side.wall_ms) + ("" if s is None else f" ±{50 * s:.0f}%")


def summary_rows(report) -> list[tuple[str, str, str, str]]:
    """(metric, eager, fused, fused vs eager) rows, shared by the text and HTML reports."""
    e, f = report.eager, report.fused
    dev = "GPU" if report.device == "cuda" else "CPU"
    return [
        ("kernel launches per call", launches(e.launches), launches(f.launches),
         f"{f.launches - e.launches:+.0f}"),
        (f"{dev} time in launches per call", ms(e.device_ms), ms(f.device_ms),
         change(e.device_ms, f.device_ms)),
        ("CPU-side time per call (profiled)", ms(e.cpu_ms), ms(f.cpu_ms), change(e.cpu_ms, f.cpu_ms)),
        ("median time per call (not profiled)", spread(e),
         *(("-", "interpreter: not timed") if getattr(report, "interpreted", False)
           else (spread(f), f"speedup {report.speedup:.2f}x"))),
        ("peak memory allocated during a call", fmt_bytes(e.peak_bytes), fmt_bytes(f.peak_bytes),
         "-" if e.peak_bytes is None or f.peak_bytes is None
         else f"{(f.peak_bytes - e.peak_bytes) / 1e6:+.2f} MB"),
    ]


def kernel_rows(report) -> list[dict]:
    rows = []
    for k in report.kernels:
        rows.append({
            "step": k.name if k.kind == "kernel" else f"extern {k.name}",
            "kind": k.kind,
            "from": "; ".join(k.lines) or "-",
            "from_short": _lines_short(k.lines),
            "from_lines": list(k.lines) or ["-"],
            "ops": ", ".join(o.split(".")[0] for o in k.ops),
            "eager": ms(k.eager_ms), "fused": ms(k.fused_ms),
            "bytes": fmt_bytes(k.bytes) if k.bytes is not None else "-",
            "eager_bytes": fmt_bytes(k.eager_bytes) if k.eager_bytes else "-",
            "bw": bandwidth(k.bandwidth),
            "ceiling": "-" if k.ceiling_fraction is None else f"{100 * k.ceiling_fraction:.0f}%",
            "error": "-" if k.max_error is None else f"{err(k.max_error)} (eager {err(k.eager_error)})",
            "numerics": k.numerics or "-",
        })
    return rows


# The step table's columns: (header, what rich is told about it, the cell from a kernel_rows row).
# Numbers and step names (which a reader greps for) never wrap; the two text columns fold at a
# bounded width, and the error wraps before eager's ("4e-07 / (eager 4.1e-07)") on a narrow
# terminal.
STEP_COLUMNS = {
    "step": (dict(no_wrap=True), lambda r: r["step"]),
    "from (your code)": (dict(max_width=40, overflow="fold"), lambda r: r["from_short"]),
    "ATen ops": (dict(max_width=26, overflow="fold"), lambda r: r["ops"]),
    "eager": (dict(justify="right", no_wrap=True), lambda r: r["eager"]),
    "fused": (dict(justify="right", no_wrap=True), lambda r: r["fused"]),
    "bytes (eager)": (dict(justify="right", no_wrap=True),
                      lambda r: f"{r['bytes']} ({r['eager_bytes']})" if r["kind"] == "kernel"
                      else r["eager_bytes"]),
    "bandwidth": (dict(justify="right", no_wrap=True), lambda r: r["bw"]),
    "of ceiling": (dict(justify="right", no_wrap=True), lambda r: r["ceiling"]),
    "max error vs f64": (dict(justify="right"), lambda r: r["error"]),
}
# Which columns go first when the table is wider than the terminal: rich would otherwise squeeze
# every column and cut the last ones (at 160 columns "max error vs f64" was lost, issue 52). The
# step, its times and its error always stay.
DROPPED_FIRST = ("of ceiling", "bandwidth", "ATen ops", "bytes (eager)", "from (your code)")


def step_table(report, width: int) -> tuple[Table, list[str]]:
    """One line per step of the fused program, with as many columns as fit in `width`
    characters (dropped in DROPPED_FIRST's order), and the headers of those left out."""
    rows = kernel_rows(report)

    def build(shown: list[str]) -> Table:
        table = Table(title=f"one line per step of the fused program (copy-bandwidth ceiling "
                            f"{report.copy_bandwidth / 1e9:.1f} GB/s)", box=box.SIMPLE_HEAVY,
                      title_justify="left")
        for col in shown:
            options = dict(STEP_COLUMNS[col][0])
            if "max_width" in options:  # a folding column: as wide as its longest cell, up to that
                longest = max([len(col), *(len(STEP_COLUMNS[col][1](r)) for r in rows)])
                options["width"] = min(options.pop("max_width"), longest)
            table.add_column(col, **options)
        for r in rows:
            style = "red" if r["numerics"] not in ("ok", "-") else None
            table.add_row(*(STEP_COLUMNS[c][1](r) for c in shown), style=style)
        return table
    return fitted(build, list(STEP_COLUMNS), DROPPED_FIRST, width)


def fitted(build, columns: list[str], dropped_first, width: int) -> tuple[Table, list[str]]:
    """`build(shown columns)` with every column, or, when that is wider than `width`, without
    the first of `dropped_first`, then the next, ...: (the table, the columns left out).
    (rich would squeeze every column instead, and cut the last ones.)"""
    left_out: list[str] = []
    while True:
        table = build([c for c in columns if c not in left_out])
        more = [c for c in dropped_first if c not in left_out]
        if not more or natural_width(table) <= width:
            return table, [c for c in columns if c in left_out]
        left_out.append(more[0])


def natural_width(renderable) -> int:
    """How wide `renderable` is drawn with all the room it wants (its folding columns have a
    fixed width, so this is the width it needs)."""
    console = Console(file=io.StringIO(), width=10_000, color_system=None)
    return Measurement.get(console, console.options, renderable).maximum


def renderables(report, width: int = 160) -> list:
    """The report as rich renderables, its step table fitted to `width` characters."""
    title = (f"fusec profile: {report.name} — {report.backend} backend on {report.device.upper()} "
             f"({report.device_name}), {report.iters} profiled iterations")
    out: list = [Text(title, style="bold")]
    if report.note:
        out.append(Text(report.note, style="yellow"))
    for doubt in getattr(report, "doubts", ()):
        out.append(Text(f"warning: {doubt}", style="yellow"))
    if report.cuda_graph:
        out.append(Text(f"fused calls: {report.cuda_graph} (the profiled run goes step by step, "
                        "so each step has a name)"))

    t = Table(title="eager vs fused", box=box.SIMPLE_HEAVY, title_justify="left")
    t.add_column("")
    t.add_column("eager", justify="right")
    t.add_column("fused", justify="right")
    t.add_column("fused vs eager", justify="right")
    for row in summary_rows(report):
        t.add_row(*row)
    out.append(t)

    k, left_out = step_table(report, width)
    out.append(k)
    if left_out:
        out.append(Text(f"(left out to fit {width} columns: {', '.join(left_out)}; a wider terminal, "
                        "report.to_dict() or report.save_html() has them)"))

    bad = [r for r in kernel_rows(report) if r["numerics"] not in ("ok", "-")]
    for r in bad:
        out.append(Text(f"numerics: {r['step']}: {r['numerics']}", style="red"))
    out.append(Text(f"outputs: {report.numerics}" if report.numerics else ""))

    ops = Table(title="where eager spends its time (per call)", box=box.SIMPLE,
                title_justify="left")
    ops.add_column("eager op / kernel")
    ops.add_column("calls", justify="right")
    ops.add_column("time", justify="right")
    for row in report.eager.by_name[:12]:
        ops.add_row(_short(row["name"]), launches(row["calls"]), ms(row["ms"]))
    out.append(ops)
    return out


def _lines_short(lines: list[str], width: int = 44) -> str:
    """The first source line, cut to `width`, and how many more there are."""
    if not lines:
        return "-"
    first = _short(" ".join(lines[0].split()), width)
    return first + (f" (+{len(lines) - 1} more)" if len(lines) > 1 else "")


def _short(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def to_text(report, width: int = 160) -> str:
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=False, color_system=None,
                      highlight=False)
    console.print(Group(*renderables(report, width)))
    return buf.getvalue().rstrip() + "\n"

"""The profile report as text: rich tables for the terminal (`print(report)`).

Three tables: eager vs fused side by side, one line per step of the fused program (the kernel
line: where it came from, eager vs fused time, bytes, bandwidth, error), and where eager spends
its time, op by op.
"""
from __future__ import annotations

import io

from rich import box
from rich.console import Console, Group
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
        ("median time per call (not profiled)", ms(e.wall_ms), ms(f.wall_ms),
         f"speedup {report.speedup:.2f}x"),
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


def renderables(report) -> list:
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

    k = Table(title=f"one line per step of the fused program (copy-bandwidth ceiling "
                    f"{report.copy_bandwidth / 1e9:.1f} GB/s)", box=box.SIMPLE_HEAVY,
              title_justify="left")
    k.add_column("step", no_wrap=True)
    k.add_column("from (your code)", min_width=24, overflow="fold")
    k.add_column("ATen ops", max_width=26, overflow="fold")
    for col in ("eager", "fused", "bytes (eager)", "bandwidth", "of ceiling", "max error vs f64"):
        k.add_column(col, justify="right", no_wrap=True)
    for r in kernel_rows(report):
        style = "red" if r["numerics"] not in ("ok", "-") else None
        k.add_row(r["step"], r["from_short"], r["ops"], r["eager"], r["fused"],
                  f"{r['bytes']} ({r['eager_bytes']})" if r["kind"] == "kernel" else r["eager_bytes"],
                  r["bw"], r["ceiling"], r["error"], style=style)
    out.append(k)

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
    console.print(Group(*renderables(report)))
    return buf.getvalue().rstrip() + "\n"

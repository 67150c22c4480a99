"""Logging and debug dumps: watch the pipeline work, the way TORCH_LOGS and TORCH_COMPILE_DEBUG do.

Two environment variables, read on every use (so a test or a notebook can set them at any time):

    FUSEC_LOG=graph,passes,fusion,output_code,schedule,cache    print these stages to stderr
    FUSEC_LOG=all                                                every topic
    FUSEC_DEBUG_DIR=path                                         write every stage to files

Topics, in pipeline order:

    graph        the captured ATen graph: every value with its dtype, shape and source line
    passes       the graph after each pass, and what that pass changed
    fusion       the fusion groups (a table: ops, inputs, outputs, bytes) and every refused merge
    output_code  each generated kernel's source, as soon as it is rendered
    schedule     the ordered list of kernel launches and extern calls
    cache        disk-cache hits, misses, compiles and corrupt entries (fusec/cache.py)
    compile      where each program's compile time went: capture, passes, codegen, build, load
    recompiles   each program a compiled function compiles after its first, and why (what
                 changed in the call: `x: shape (4, 64) -> (5, 64)`)
    debug        torch's own log messages during a capture, kept (by default a capture that
                 fails shows fusec's one-line message only, not torch's fake-tensor traceback)

Every message goes through `log(topic, text)`; its first line is prefixed `[fusec TOPIC]` so a
reader can grep for one stage. The driver does not call this file: it publishes each stage
(fusec/events.py) and `PRINTER`, registered here when fusec is imported, prints what is asked for. With FUSEC_DEBUG_DIR set, each compiled program gets its own
folder (`<dir>/<function>_<n>/`, see `dump_compiled`) that a learner can open in an editor.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from fusec import env, events
from fusec.codegen import backends
from fusec.inspect.changes import pass_changes
from fusec.inspect.explain import Explanation
from fusec.inspect.groups import format_groups, format_refusals, group_rows
from fusec.inspect.listing import graph_listing
from fusec.inspect.graphviz import render_svg
from fusec.record import format_schedule, record_of

TOPICS = ("graph", "passes", "fusion", "output_code", "schedule", "cache", "compile", "recompiles",
          "debug")


def topics() -> set[str]:
    """The topics named in FUSEC_LOG (`all` means every one). Unknown names are ignored."""
    wanted = {t.strip() for t in os.environ.get("FUSEC_LOG", "").split(",") if t.strip()}
    if "all" in wanted:
        return set(TOPICS)
    return wanted & set(TOPICS)


def enabled(topic: str) -> bool:
    return topic in topics()


def log(topic: str, text: str) -> None:
    """Print `text` to stderr under `[fusec TOPIC]` if the topic is enabled."""
    if not enabled(topic):
        return
    first, _, rest = str(text).partition("\n")
    print(f"[fusec {topic}] {first}" + (f"\n{rest.rstrip()}" if rest else ""), file=sys.stderr,
          flush=True)


def debug_dir() -> Path | None:
    value = env.path("FUSEC_DEBUG_DIR")  # (`~` expanded)
    return Path(value) if value else None


def wants_stack_traces() -> bool:
    """Record the user's source line of every ATen node while tracing, and the graph after every
    pass? (Costs ~15% of capture time and ~20% of a warm start, so only when someone will read
    them: explain, profile, FUSEC_LOG or FUSEC_DEBUG_DIR.)"""
    return bool(topics() - {"compile", "cache", "recompiles"} or debug_dir())  # timing must not change what it times


# ---- what the driver published (fusec/driver.py compile_graph), printed ----------------------------

def captured(gm) -> None:
    """Right after capture, before any pass runs."""
    if enabled("graph"):
        log("graph", "captured ATen graph\n" + graph_listing(gm))


def kernel_rendered(name: str, backend: str, source: str) -> None:
    if enabled("output_code"):
        log("output_code", f"kernel {name} ({backend})\n{source}")


def compile_times(compiled_graph, label: str = "program") -> None:
    """`FUSEC_LOG=compile`: one line per program, its compile's seconds per stage."""
    if enabled("compile"):
        times = compiled_graph.times
        kernels = compiled_graph.kernels
        distinct = len({id(k.built) for k in kernels})
        log("compile", f"{label}: {sum(times.values()):.3f} s = " + ", ".join(
            f"{stage} {seconds:.3f}" for stage, seconds in times.items())
            + f" ({len(kernels)} kernels, {distinct} distinct)")


def pipeline_done(captured_gm, gm, snapshots) -> None:
    """After the passes ran: what each pass changed, the fusion groups, the schedule."""
    want = topics()
    if not want & {"passes", "schedule"}:
        return
    if "passes" in want:
        previous = None
        for change in pass_changes(captured_gm, gm, snapshots):
            body = ["  " + line for line in change["details"]]
            body.append("(the graph is the same as before this pass)"
                        if change["graph"] == previous else change["graph"].rstrip())
            previous = change["graph"]
            log("passes", f"after {change['after']}: {change['summary']}\n" + "\n".join(body))
    if "schedule" in want:
        log("schedule", "schedule\n" + format_schedule(record_of(gm).schedule))


def compiled(compiled_graph, label: str = "program") -> Path | None:
    """After every kernel is built: the fusion table (its byte counts come from the kernel IR),
    then every stage to FUSEC_DEBUG_DIR, if set."""
    if enabled("fusion"):
        gm = compiled_graph.gm
        log("fusion", "fusion groups (bytes from the kernel IR)\n"
            + format_groups(group_rows(gm, compiled_graph.kernels)) + "\n"
            + format_refusals(gm))
    root = debug_dir()
    if root is None:
        return None
    try:
        return dump_compiled(compiled_graph, root, label)
    except OSError as err:  # a debugging aid must never break compilation
        print(f"[fusec] could not write FUSEC_DEBUG_DIR={root}: {err}", file=sys.stderr)
        return None


def dump_compiled(compiled_graph, root: Path, label: str = "program") -> Path:
    """Write every stage of one compiled program into a new folder under `root`:

        00_captured_graph.txt      the captured ATen graph (dtypes, shapes, source lines)
        01_capture.py ...          the graph after each pass, as runnable Python
        fusion.txt                 the fusion groups and every refused merge
        schedule.txt               kernel launches and extern calls, in order
        kernels/<name>.cpp|.py     each kernel's source
        program.py                 the whole generated program (cf.source())
        graph_before_fusion.dot    the graph pictures (and .svg when Graphviz is installed)
        graph_after_fusion.dot
        explain.txt, explain.json  str() and to_dict() of fusec.explain
    """
    root.mkdir(parents=True, exist_ok=True)
    safe = "".join(c if c.isalnum() or c in "_-" else "_" for c in label) or "program"
    n = 0
    while True:
        folder = root / f"{safe}_{n:03d}"
        try:
            folder.mkdir()
            break
        except FileExistsError:
            n += 1
    explanation = Explanation(compiled_graph)
    gm = compiled_graph.gm
    (folder / "00_captured_graph.txt").write_text(graph_header(compiled_graph)
                                                  + graph_listing(compiled_graph.captured.gm)
                                                  + "\n")
    for i, snap in enumerate(compiled_graph.stages()):
        (folder / f"{i + 1:02d}_{snap.after}.py").write_text(
            f"# graph after {snap.after}\n{snap.code}")
    (folder / "fusion.txt").write_text(format_groups(explanation.groups()) + "\n\n"
                                       + format_refusals(gm) + "\n")
    (folder / "schedule.txt").write_text(format_schedule(compiled_graph.schedule) + "\n")
    kdir = folder / "kernels"
    kdir.mkdir()
    for k in compiled_graph.kernels:
        (kdir / f"{k.name}{backends.get(k.backend).suffix}").write_text(k.source)
    (folder / "program.py").write_text(compiled_graph.source())
    for stage in ("before", "after"):
        dot = explanation.dot(stage)
        (folder / f"graph_{stage}_fusion.dot").write_text(dot)
        svg = render_svg(dot)
        if svg:
            (folder / f"graph_{stage}_fusion.svg").write_text(svg)
    (folder / "explain.txt").write_text(str(explanation))
    (folder / "explain.json").write_text(json.dumps(explanation.to_dict(), indent=1))
    print(f"[fusec] FUSEC_DEBUG_DIR: wrote every stage to {folder}", file=sys.stderr, flush=True)
    return folder


def graph_header(compiled_graph) -> str:
    return f"# captured ATen graph ({compiled_graph.backend} backend)\n"


class Printer:
    """The watcher (fusec/events.py) that turns what the driver publishes into FUSEC_LOG output
    and FUSEC_DEBUG_DIR folders. It looks the functions above up when an event comes, so a
    benchmark may replace one (`fusec.log.compile_times = record`)."""

    def wants_detail(self) -> bool:
        return wants_stack_traces()

    def captured(self, gm) -> None:
        captured(gm)

    def passes_done(self, captured_gm, gm, snapshots) -> None:
        pipeline_done(captured_gm, gm, snapshots)

    def kernel_built(self, kernel) -> None:
        if enabled("output_code"):
            kernel_rendered(kernel.name, kernel.backend, kernel.source)

    def compiled(self, compiled_graph, label: str) -> None:
        compile_times(compiled_graph, label)
        compiled(compiled_graph, label)

    def cache(self, message: str) -> None:
        log("cache", message)

    def recompiled(self, label: str, reason: str) -> None:
        log("recompiles", f"{label}: compiling a new program ({reason})")


PRINTER = events.watch(Printer())

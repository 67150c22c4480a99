"""`fusec demo`: run the seed examples and show, for each, what fusion did and what it bought.

For every example: eager ATen ops vs fused kernels, one generated kernel, the largest difference
from eager, and eager vs fused time (medians). Each example module in examples/ defines
`example()` returning an `Example`; `run_example` prints one, `run_demo` runs them all.
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

import fusec
from fusec import ops
from fusec.codegen import backends
from fusec.device import default_device
from fusec.timing import Timing, doubts, interpreted, measure

SEED_EXAMPLES = ["sin4", "add_mul", "maximum_neg_uint8", "strided"]


@dataclass
class Example:
    name: str
    fn: Callable
    inputs: tuple
    about: str
    expect_kernels: int | None = None


@dataclass
class Result:
    name: str
    backend: str
    eager_ops: int
    kernels: int
    externs: int
    max_error: float
    eager_ms: float  # nan when not timed (Triton's interpreter)
    fused_ms: float
    source: str
    kernel_name: str
    eager_time: Timing | None = None  # the rounds behind the medians (fusec/timing.py)
    fused_time: Timing | None = None
    doubts: tuple = ()  # why the times should not be trusted, in sentences


def eager_op_count(captured_gm) -> int:
    """ATen ops eager PyTorch runs (views are free, so they are not counted)."""
    return sum(1 for n in captured_gm.graph.nodes
               if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
               and ops.classify(n.target) != ops.VIEW)


def evaluate(ex: Example, backend: str = "auto") -> Result:

    compiled = fusec.compile(ex.fn, backend=backend)
    with torch.no_grad():
        got = compiled(*ex.inputs)
        want = ex.fn(*ex.inputs)
    got_l, want_l = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
    err = max(((g.double() - w.double()).abs().max().item() if g.numel() else 0.0)
              for g, w in zip(got_l, want_l))
    device = str(ex.inputs[0].device)
    last = getattr(compiled, "_compiled", compiled).last  # a CompiledModule wraps one
    eager_t = fused_t = None
    if not interpreted(last.backend, device):
        with torch.no_grad():
            eager_t = measure(ex.fn, *ex.inputs, device=device)
            fused_t = measure(compiled, *ex.inputs, device=device)
    steps = last.schedule
    k = compiled.kernels[0] if compiled.kernels else None
    return Result(ex.name, last.backend, eager_op_count(last.captured.gm), len(compiled.kernels),
                  sum(1 for s in steps if s.kind == "extern"), err,
                  eager_t.median_ms if eager_t else math.nan,
                  fused_t.median_ms if fused_t else math.nan,
                  k.source if k else "", k.name if k else "", eager_t, fused_t,
                  tuple(doubts(eager_t, fused_t, device=device)) if eager_t else ())


def run_example(ex: Example, backend: str = "auto", show_source: bool = True) -> Result:
    r = evaluate(ex, backend)
    print(f"== {r.name}: {ex.about}")
    print(f"   eager: {r.eager_ops} ATen op(s)   fused: {r.kernels} kernel(s)"
          + (f" + {r.externs} extern call(s)" if r.externs else "") + f"   [{r.backend}]")
    print(f"   max |fused - eager| = {r.max_error:.3g}")
    if r.eager_time is None:
        print("   time: interpreter: not timed (Triton's interpreter runs the kernels as Python "
              "on this CPU, so a speedup would mean nothing; on a GPU they are timed)")
    else:
        print(f"   time: eager {r.eager_time}, fused {r.fused_time}: "
              f"{r.eager_ms / r.fused_ms:.2f}x (median of {r.eager_time.rounds} rounds, "
              "± half their range)")
        for doubt in r.doubts:
            print(f"   warning: {doubt}")
    if show_source and r.source:
        print(f"   --- {r.kernel_name} ---")
        print("\n".join("   | " + line for line in r.source.rstrip().splitlines()))
    return r


def load_example(name_or_path: str):
    """Import an example by name (`sin4`) or file path; it must define example()."""
    path = Path(name_or_path)
    if path.suffix == ".py" and path.exists():
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(f"fusec.examples.{name_or_path}")
    if not hasattr(module, "example"):
        raise SystemExit(f"fusec: {name_or_path} has no example() function (the documented "
                         "entry point: def example() -> fusec.demo.Example)")
    return module


def run_demo(backend: str = "auto", device: str | None = None) -> list[Result]:
    if device is None:  # the CPU backends run on the CPU, also on a GPU machine
        device = "cpu" if backends.cpu_only(backend) else default_device()
    print(f"fusec demo on {device} (torch {torch.__version__})\n")
    results = []
    for i, name in enumerate(SEED_EXAMPLES):
        ex = load_example(name).example(device=device)
        results.append(run_example(ex, backend, show_source=(i == 0)))
        print()
    _summary(results)
    return results


def _summary(results: list[Result], width: int | None = None) -> None:
    """The summary table, fitted to `width` (default: the terminal's; a file gets it whole)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover
        return
    from fusec.inspect.report_text import fitted, natural_width
    # Numbers never wrap. When nothing was timed (Triton's interpreter), the three time columns
    # are one that says so; on a terminal too narrow for the rest, the eager and fused times go
    # first (each example's lines above have them), and a file gets the whole table.
    timed = any(r.eager_time is not None for r in results)
    columns = ["example", "ATen ops", "kernels", "max error",
               *(("eager ms", "fused ms", "speedup") if timed else ("time",))]

    def build(shown: list[str]) -> Table:
        table = Table(title="fusec demo: eager vs fused" + (" (median times)" if timed else ""))
        for col in shown:
            table.add_column(col, justify="left" if col == "example" else "right", no_wrap=True)
        for r in results:
            if not timed:
                times = {"time": "interpreter: not timed"}
            elif r.eager_time is None:  # Triton's interpreter
                times = {"eager ms": "-", "fused ms": "-", "speedup": "interpreter: not timed"}
            else:
                times = {"eager ms": _cell(r.eager_time), "fused ms": _cell(r.fused_time),
                         "speedup": f"{r.eager_ms / r.fused_ms:.2f}x" + (" (?)" if r.doubts else "")}
            cells = {"example": r.name, "ATen ops": str(r.eager_ops), "kernels": str(r.kernels),
                     "max error": f"{r.max_error:.2g}", **times}
            table.add_row(*(cells[c] for c in shown))
        return table

    if width is None:
        console = Console(file=sys.stdout)
        width = console.width if console.is_terminal else natural_width(build(columns))
    table, left_out = fitted(build, columns, ("fused ms", "eager ms"), width)
    Console(file=sys.stdout, width=max(width, natural_width(table))).print(table)
    if left_out:
        print(f"(left out to fit {width} columns: {', '.join(left_out)}; see each example above)")
    if any(r.doubts for r in results):
        print("(?): the rounds of that row's times disagree, or the CPU is shared with other "
              "work: see the warnings above each example")


def _cell(t: Timing) -> str:
    """A median with its rounds' spread, as a table cell: `0.012 ±3%`."""
    return f"{t.median_ms:.3f} ±{50 * t.spread:.0f}%"

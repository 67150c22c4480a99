"""Graph passes: each is a plain function `GraphModule -> GraphModule`, run in order.

    PIPELINE = [dce, cse, reinplace, unfuse_bias, small_matmul, pad_matmul, layout, fuse_pointwise,
                fuse_reductions, schedule]

`run_pipeline` runs them, checks the graph after each one (`verify`), and can keep a labelled
snapshot of the graph after every pass, printed as runnable Python, so a reader can see exactly
what each pass changed. Passes keep what they decided (fusion groups, refusals, the schedule) in
`gm.meta`, never in global state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from fusec.graphmodule import copy_graph_module

from .cse import cse
from .dce import dce
from .fuse_pointwise import fuse_pointwise
from .fuse_reductions import fuse_reductions
from .layout import layout
from .pad_matmul import pad_matmul
from .reinplace import reinplace
from .schedule import schedule
from .small_matmul import small_matmul
from .unfuse_bias import unfuse_bias

PIPELINE = [dce, cse, reinplace, unfuse_bias, small_matmul, pad_matmul, layout, fuse_pointwise,
            fuse_reductions, schedule]


@dataclass
class Snapshot:
    """The graph as Python source after the pass named `after`."""

    after: str
    code: str

    def __str__(self) -> str:
        return f"# ---- graph after {self.after} ----\n{self.code}"


def run_pipeline(gm: fx.GraphModule, passes=None, record: bool = False):
    """Run `passes` (default PIPELINE) over a copy of gm. Returns (gm, snapshots).

    The input graph is left untouched: it stays the eager reference (`check=True` runs it).
    """
    gm = copy_graph_module(gm)
    snapshots = [Snapshot("capture", readable(gm))] if record else []
    for p in PIPELINE if passes is None else passes:
        gm = p(gm)
        verify(gm, p.__name__)
        if record:
            snapshots.append(Snapshot(p.__name__, readable(gm)))
    return gm, snapshots


def readable(gm: fx.GraphModule) -> str:
    return gm.print_readable(print_output=False, include_stride=False, include_device=False)


def verify(gm: fx.GraphModule, after: str) -> None:
    """Cheap invariants every pass must keep: a well-formed graph whose tensor nodes are annotated."""
    try:
        gm.graph.lint()
    except Exception as err:  # pragma: no cover - a bug in a pass
        raise AssertionError(f"fusec: graph is malformed after pass {after}: {err}") from err
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_module", "placeholder") and "val" in node.meta \
                and "fusec" not in node.meta:
            raise AssertionError(f"fusec: pass {after} left node {node.name} without metadata")

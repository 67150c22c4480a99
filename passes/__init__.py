"""Graph passes: each is a plain function `GraphModule -> GraphModule`, run in order.

    PIPELINE = [inline_sizes, picks, fold_constants, constant_gathers, check_gathers, check_divisors, dce, cse, canonicalize, simplify, filled_slices, computed_pieces, reinplace, unfuse_bias,
                pad_matmul, pooling, layout, move_permutes, split_reductions, fuse_pointwise, fuse_reductions, schedule]

A pass that only rewrites some ops says which (`@looks_for(aten.mm.default, ...)`, from
fusec/graphmodule.py), and `run_pipeline` skips it when the graph has none of them: compiling
`sin(x) * 2` runs no matmul pass. Passes from outside the core (a kernel family's graph rewrites)
come in through one door, `register(ExtensionPass(name, module, before=core pass, looks_for=...))`:
`pipeline()` is PIPELINE with each registered pass just before the core pass it names, its module
imported the first time it has something to look at.

`run_pipeline` runs them, checks the graph after each one (`verify`), and can keep a labelled
snapshot of the graph after every pass, printed as runnable Python, so a reader can see exactly
what each pass changed. Passes keep what they decided (refusals, the schedule, ...) in the graph's
record, `record_of(gm)` (fusec/record.py), and per-node facts in `node.meta`, never in global state.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch.fx as fx

from fusec.graphmodule import copy_graph_module
from fusec.record import record_of

from .canonicalize import canonicalize
from .check_divisors import check_divisors
from .check_gathers import check_gathers
from .computed_pieces import computed_pieces
from .constant_gathers import constant_gathers
from .cse import cse
from .dce import dce
from .filled_slices import filled_slices
from .fold_constants import fold_constants
from .fuse_pointwise import fuse_pointwise
from .fuse_reductions import fuse_reductions
from .inline_sizes import inline_sizes
from .layout import layout
from .pad_matmul import pad_matmul
from .move_permutes import move_permutes
from .picks import picks
from .pooling import pooling
from .reinplace import reinplace
from .schedule import schedule
from .simplify import simplify
from .split_reductions import split_reductions
from .unfuse_bias import unfuse_bias

PIPELINE = [inline_sizes, picks, fold_constants, constant_gathers, check_gathers, check_divisors, dce, cse, canonicalize, simplify, filled_slices, computed_pieces, reinplace, unfuse_bias,
            pad_matmul, pooling, layout, move_permutes, split_reductions, fuse_pointwise, fuse_reductions, schedule]


@dataclass
class Snapshot:
    """The graph after the pass named `after`: as Python source (`code`), and as the facts a
    reader compares between passes, so nobody has to parse the source back: `nodes`, the names
    of the values the top-level graph computes (not its inputs, not its calls of groups), and
    `groups`, each fused group's name -> the ATen nodes inside it."""

    after: str
    code: str
    nodes: tuple[str, ...] = ()
    groups: dict[str, list[str]] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"# ---- graph after {self.after} ----\n{self.code}"


@dataclass(frozen=True)
class ExtensionPass:
    """A graph pass from outside the core: the function `name` of `module`, run just before the
    core pass named `before`. `looks_for` names the ops it rewrites (OpOverloads or their
    packets); when the graph has none the pass is skipped and its module is not even imported.
    Called like the function it stands for."""

    name: str
    module: str
    before: str
    looks_for: frozenset = frozenset()

    @property
    def __name__(self) -> str:  # noqa: A003 - read by run_pipeline and the snapshots, as a function's
        return self.name

    def __call__(self, gm: fx.GraphModule) -> fx.GraphModule:
        return getattr(importlib.import_module(self.module), self.name)(gm)


REGISTERED: list[ExtensionPass] = []


def register(extension: ExtensionPass) -> ExtensionPass:
    """Add a pass to the pipeline (one of the same name is replaced). Registered passes key the
    saved programs (fusec/runtime/fast_start/fingerprint.py), as kernel families and graph rules do."""
    if extension.before not in [p.__name__ for p in PIPELINE]:
        raise ValueError(f"fusec: no core pass named {extension.before!r} to run {extension.name} before")
    unregister(extension.name)
    REGISTERED.append(extension)
    return extension


def unregister(name: str) -> None:
    REGISTERED[:] = [p for p in REGISTERED if p.name != name]


def pipeline() -> list:
    """PIPELINE with the registered passes in their places, in the order they were registered."""
    passes = []
    for core in PIPELINE:
        passes += [p for p in REGISTERED if p.before == core.__name__]
        passes.append(core)
    return passes


def wanted(p, gm: fx.GraphModule) -> bool:
    """Whether pass `p` has something to look at in gm: it names no ops (it looks at every graph),
    or gm's graph calls one of the ops it names (a pass made of rules asks its rules:
    passes/patterns.py, `looks_for_rules`)."""
    targets = getattr(p, "looks_for", None)
    if not targets:
        return True
    graph_calls = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    if hasattr(targets, "wanted_by"):
        return targets.wanted_by(graph_calls)
    return any(t in targets or getattr(t, "overloadpacket", None) in targets for t in graph_calls)


def run_pipeline(gm: fx.GraphModule, passes=None, record: bool = False):
    """Run `passes` (default `pipeline()`) over a copy of gm. Returns (gm, snapshots).

    A pass with nothing to look at is skipped (`wanted`) and named in `record_of(gm).skipped`.
    The input graph is left untouched: it stays the eager reference (`check=True` runs it).
    """
    gm = copy_graph_module(gm)
    snapshots = [snapshot("capture", gm)] if record else []
    for p in pipeline() if passes is None else passes:
        if wanted(p, gm):
            gm = p(gm)
            verify(gm, p.__name__)
        else:
            rec = record_of(gm)
            rec.skipped = [*rec.skipped, p.__name__]  # replaced, not appended: records share lists
        if record:
            snapshots.append(snapshot(p.__name__, gm))
    return gm, snapshots


def snapshot(after: str, gm: fx.GraphModule) -> Snapshot:
    nodes = tuple(n.name for n in gm.graph.nodes if n.op in ("call_function", "get_attr"))
    groups = {name: [n.name for n in sub.graph.nodes if n.op == "call_function"
                     and getattr(n.target, "namespace", None) == "aten"]
              for name, sub in gm.named_children() if isinstance(sub, fx.GraphModule)}
    return Snapshot(after, readable(gm), nodes, groups)


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

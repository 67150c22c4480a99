"""GraphModules whose Python code is written only when someone reads or runs it.

Every `fx.GraphModule` turns its graph into Python source and compiles it (`recompile`) when it
is made and whenever a pass calls `gm.recompile()`, so that `gm(...)` and `gm.code` work. fusec
never runs the graphs its passes produce: it lowers them to kernels and a schedule. On a 6-layer
BERT, writing that Python (for the graph after each pass, and for each of the 86 fused groups'
sub-GraphModules) was 0.8 s of a 3.7 s warm start.

torch.fx has the lazy variant Inductor uses for the same reason, `_LazyGraphModule`: its
`recompile()` only marks the code stale, and the code is written the first time `gm.code`,
`print(gm)` or `gm(...)` needs it. `graph_module` makes one (or a plain GraphModule if this torch
lacks it: the same behaviour, only slower), and `lazily()` makes torch's own tracers (make_fx)
return lazy ones. Reading a graph (`print_readable`, explain, snapshots) works as before.
"""
from __future__ import annotations

import contextlib

import torch.fx as fx

from fusec.record import copy_record

try:  # private to torch.fx, but what torch.compile itself uses (torch >= 2.3)
    from torch.fx._lazy_graph_module import _LazyGraphModule as _Lazy
    from torch.fx._lazy_graph_module import _use_lazy_graph_module
except ImportError:  # pragma: no cover - older torch
    _Lazy, _use_lazy_graph_module = fx.GraphModule, None


def graph_module(root, graph: fx.Graph, class_name: str = "GraphModule") -> fx.GraphModule:
    """`fx.GraphModule(root, graph, class_name)`, with its Python written only when needed."""
    return _Lazy(root, graph, class_name)


def lazily():
    """While open, torch's tracers make lazy GraphModules too."""
    return _use_lazy_graph_module(True) if _use_lazy_graph_module else contextlib.nullcontext()


def looks_for(*targets):
    """Mark a pass with the ops it rewrites (`@looks_for(aten.mm.default, aten.bmm)`: overloads or
    whole packets): `run_pipeline` (passes/__init__.py) skips it on a graph that calls none."""
    def mark(function):
        function.looks_for = frozenset(targets)
        return function
    return mark


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule with a copy of gm's graph (node metadata is shared, not deep-copied)
    and a record of its own (fusec/record.py), so passes over the copy leave gm's as it was."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    new = graph_module(gm, graph)  # its Python is written only if read
    new.meta.update(gm.meta)
    copy_record(gm, new)
    return new

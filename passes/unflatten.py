"""Cutting a dim of a computed value into parts, without ending its kernel.

Two passes view a value with one of its dims cut in parts: split_reductions cuts a reduced dim
into chunks (`(N, C, H, W) -> (N, C, 8, H/8, W)`), pooling cuts H and W into windows
(`-> (N, C, H/2, 2, W/2, 2)`). A view of a *computed* value would end that value's kernel: it is
stored whole, then read back through the view (passes/fuse_pointwise.py). But a pointwise op
commutes with such a view, so the view can be moved up to what the op reads:

    view(sigmoid(x) * w, [N, C, 8, H/8, W])   ==   sigmoid(view(x, [N, C, 8, H/8, W])) * view(w, [C, 1, 1, 1])

and a view of a program input (or of an extern's result) folds into the kernel's load indices.
`Unflattener(graph, before, mode)(value, dim, parts)` builds the right-hand side: it walks up
through pointwise ops whose inputs broadcast to their shape, gives each input the same cut (an
input that broadcasts along the cut dim gets a 1 for each part instead; one that does not reach
it from the left stays as it is), and ends at anything else with a plain `view`. A view that is
itself such a cut of a pointwise value (group norm's `(N, C, ...) -> (N, G, C/G, ...)`) is
pushed up the same way first, and so is a reshape of a pointwise value whose dims the new shape
only cuts further (`regroups`: a weight packed along K, (K/8, 8, N) -> (K/G, G, N), cut to
(K/G, G/8, 8, N), becomes cuts of the (K/8, 8, N) value). `refine(value, runs)` cuts every dim
at once, which a reshape that merged several dims needs (a weight packed along N,
(K, N/8, 8) -> (K, N), cut to (K/G, G, N/8, 8)).
The original ops stay for their other readers; `finish` removes what nothing reads any more.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from fusec import ops
from fusec.ir import TensorMeta
from fusec.symbolic import hashable

from .grouping import broadcasts_to, meta
from .layout import run_fake, set_meta

aten = torch.ops.aten
RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


class Unflattener:
    """Builds cut views of values before `before` in `graph` (see the module docstring)."""

    def __init__(self, graph: fx.Graph, before: fx.Node, mode, views: dict | None = None):
        self.graph, self.before, self.mode = graph, before, mode
        self.memo: dict = {}
        # plain views of values that are not pointwise, shared with other Unflatteners given the
        # same dict (two reductions of one input then read it through one view node)
        self.views = {} if views is None else views
        self.made: list[fx.Node] = []

    def add(self, target, args, kwargs=None, like=None, name=None) -> fx.Node:
        """A new node before `before`, with its fake value and meta."""
        with self.graph.inserting_before(self.before):
            new = self.graph.call_function(target, args, kwargs or {})
        if name:
            new._rename(name)
        val = run_fake(self.mode, new)
        if val is None:
            raise RuntimeError(f"fusec: {new.format_node()} does not run on its fake inputs")
        set_meta(new, val, like=like or self.before)
        self.made.append(new)
        return new

    def __call__(self, value: fx.Node, dim: int, parts: tuple) -> fx.Node:
        """`value` viewed with dim `dim` cut in `parts` (sizes whose product is its length)."""
        key = (value, dim, hashable(parts))
        if key in self.memo:
            return self.memo[key]
        shape = list(meta(value).shape)
        new_shape = shape[:dim] + list(parts) + shape[dim + 1:]
        cuts = regroups(value, new_shape)
        if cuts is not None:  # a reshape of a pointwise value: cut that value's dims instead
            new = value.args[0]
            for d, run in reversed(cuts):
                new = self(new, d, run)
            self.memo[key] = new
            return new
        cut = unflattens(value)
        if cut is not None and pushable(value.args[0]):
            value = self(value.args[0], *cut)  # the same values, now computed by a pointwise op
        gathered = self._gather_cut(value, dim, tuple(parts))
        if gathered is not None:
            new = gathered
        elif pushable(value):
            args = [self._arg(a, shape, dim, tuple(parts)) for a in value.args]
            new = self.add(value.target, tuple(args), dict(value.kwargs), like=value,
                           name=f"{value.name}_cut")
        else:
            new = self.views.get((value, hashable(new_shape)))  # (a family's sizes are symbols)
            if new is None or getattr(new, "_erased", False):
                new = self.add(aten.view.default, (value, new_shape), like=value,
                               name=f"{value.name}_cut")
                self.views[(value, hashable(new_shape))] = new
        self.memo[key] = new
        return new

    def refine(self, value: fx.Node, runs: list[tuple]) -> fx.Node:
        """`value` with each dim d cut in `runs[d]` at once (a run of one part leaves the dim as
        it is). One cut at a time can get stuck halfway: a weight packed along N, a (K, N/8, 8)
        value reshaped to (K, N), cut first along K, is (K/G, G, N), which is no cut of
        (K, N/8, 8), so the reshape would stay. Cut in both at once, (K/G, G, N/8, 8) cuts the
        value behind the reshape, and the reshape disappears. Pointwise ops pass the runs on to
        their inputs (a broadcast dim gets 1s); a reshape whose input the fine shape also cuts
        passes them on to that input; anything else takes the cuts one dim at a time
        (`__call__`)."""
        runs = [tuple(r) for r in runs]
        key = (value, "refine", hashable(runs))
        if key in self.memo:
            return self.memo[key]
        fine = [p for r in runs for p in r]
        shape = list(meta(value).shape)
        source = _runs_for(list(meta(value.args[0]).shape), fine) \
            if value.op == "call_function" and value.target in RESHAPES else None
        if all(len(r) == 1 for r in runs):
            new = value
        elif source is not None and (pushable(value.args[0]) or value.args[0].target in RESHAPES):
            new = self.refine(value.args[0], source)
        elif pushable(value):
            args = []
            for a in value.args:
                if isinstance(a, fx.Node) and isinstance(a.meta.get("fusec"), TensorMeta):
                    lead = len(shape) - len(meta(a).shape)  # a's dims align with the right end
                    a = self.refine(a, [r if s == shape[lead + p] else (1,) * len(r)
                                        for p, (s, r) in enumerate(zip(meta(a).shape, runs[lead:]))])
                args.append(a)
            new = self.add(value.target, tuple(args), dict(value.kwargs), like=value,
                           name=f"{value.name}_cut")
        else:
            new = value
            for d in reversed(range(len(runs))):  # the last dim first: earlier dims keep their place
                if len(runs[d]) > 1 and 1 not in runs[d]:
                    new = self(new, d, runs[d])
            if list(meta(new).shape) != fine:  # (1s in the runs: a broadcast input's)
                new = self.add(aten.view.default, (new, fine), like=value, name=f"{value.name}_cut")
        self.memo[key] = new
        return new

    def _gather_cut(self, value: fx.Node, dim: int, parts: tuple) -> fx.Node | None:
        """A gathered read (`scales[g_idx]`, fusec.ops.gathered_read) cut along one of its
        index's dims is the read of the index cut the same way: `scales[g_idx]` seen as
        (K/8, 8, N) is `scales[g_idx.view(K/8, 8)]`. Along a source dim after the picked one
        (x[idx] of a 3-D x), it is the read of the source cut. None otherwise (a plain view)."""
        gather = ops.gathered_read(value)
        if gather is None or value.target is aten.index_select.default:
            return None
        d, n = gather.dim, len(meta(gather.index).shape)
        args = list(value.args)
        if d <= dim < d + n:
            index = self(gather.index, dim - d, parts)
            if value.target is aten.index.Tensor:
                args[1] = [index if i is gather.index else i for i in args[1]]
            else:
                args[1] = index
        elif dim >= d + n and value.target is aten.index.Tensor:
            args[0] = self(gather.source, dim - n + 1, parts)
        else:
            return None
        return self.add(value.target, tuple(args), dict(value.kwargs), like=value,
                        name=f"{value.name}_cut")

    def narrow(self, value: fx.Node, dim: int, length: int) -> fx.Node:
        """`value[..., :length, ...]` along `dim` (a slice, the other view pooling needs), moved
        up through pointwise ops the same way."""
        key = (value, dim, "narrow", length)
        if key in self.memo:
            return self.memo[key]
        shape = list(meta(value).shape)
        if pushable(value):
            new = self._rebuilt(value, dim, "narrowed", lambda a, p: self.narrow(a, p, length)
                                if p >= 0 and meta(a).shape[p] == shape[dim] else a)
        else:
            new = self.add(aten.slice.Tensor, (value, dim, 0, length), like=value,
                           name=f"{value.name}_narrowed")
        self.memo[key] = new
        return new

    def _rebuilt(self, value: fx.Node, dim: int, suffix: str, each) -> fx.Node:
        """The pointwise op `value` computed again from its tensor inputs, each replaced by
        `each(input, p)`: p is the input's dim that lines up with `dim` (inputs line up with the
        right end), negative when the input broadcasts from the left of it."""
        rank = len(meta(value).shape)
        args = [each(a, dim - (rank - len(meta(a).shape)))
                if isinstance(a, fx.Node) and isinstance(a.meta.get("fusec"), TensorMeta) else a
                for a in value.args]
        return self.add(value.target, tuple(args), dict(value.kwargs), like=value,
                        name=f"{value.name}_{suffix}")

    def _arg(self, a, shape, dim, parts):
        if not isinstance(a, fx.Node) or not isinstance(a.meta.get("fusec"), TensorMeta):
            return a
        ashape = list(meta(a).shape)
        p = dim - (len(shape) - len(ashape))  # a's dims align with the right end of value's
        if p < 0:
            return a  # a broadcasts over the cut dim from the left: nothing changes
        if ashape[p] == shape[dim]:
            return self(a, p, parts)
        return self.ones(a, p, len(parts))

    def ones(self, value: fx.Node, dim: int, count: int) -> fx.Node:
        """`value`, whose dim `dim` has size 1 (it broadcasts over the cut), with that dim
        made `count` dims of size 1; moved up through pointwise ops to the values they read, as a
        cut is, so that a computed value that broadcasts (a packed weight's shift amounts,
        clamped and narrowed from a constant) stays in the kernel that reads it instead of being
        stored."""
        key = (value, dim, "ones", count)
        if key in self.memo:
            return self.memo[key]
        shape = list(meta(value).shape)
        if pushable(value):  # (an input that broadcasts from the left keeps its place)
            new = self._rebuilt(value, dim, "unsqueezed",
                                lambda a, p: self.ones(a, p, count) if p >= 0 else a)
        else:
            new = self.add(aten.view.default, (value, shape[:dim] + [1] * count + shape[dim + 1:]),
                           like=value, name=f"{value.name}_unsqueezed")
        self.memo[key] = new
        return new

    def finish(self, *originals: fx.Node) -> None:
        """Remove the nodes made here that nothing reads (steps of a view pushed further up),
        and the pointwise chains behind `originals` that only the rewritten node read."""
        for new in reversed(self.made):
            if not new.users:
                self.graph.erase_node(new)
                for k in [k for k, v in self.views.items() if v is new]:
                    del self.views[k]
        erase_dead(self.graph, *originals)


def erase_dead(graph: fx.Graph, *nodes: fx.Node) -> None:
    """Remove `nodes` if nothing reads them, and the pointwise ops and views they read that only
    they read, up the chain (what a rewrite left behind)."""
    todo = list(nodes)
    while todo:
        n = todo.pop()
        if n.op == "call_function" and not n.users and not getattr(n, "_erased", False) \
                and isinstance(n.target, torch._ops.OpOverload) \
                and (ops.classify(n.target) in (ops.POINTWISE, ops.VIEW)
                     or ops.gathered_read(n) is not None):
            inputs = n.all_input_nodes
            graph.erase_node(n)
            todo += inputs


def pushable(value: fx.Node) -> bool:
    """A pointwise op whose tensor inputs are plain positional arguments that broadcast to its
    shape: viewing its result equals computing it from views of its inputs."""
    if value.op != "call_function" or not isinstance(value.target, torch._ops.OpOverload) \
            or ops.classify(value.target) != ops.POINTWISE:
        return False
    tensors = [a for a in value.args if isinstance(a, fx.Node)]
    if not tensors or any(isinstance(a, (list, tuple)) for a in value.args) or \
            any(isinstance(v, fx.Node) for v in value.kwargs.values()):
        return False
    shape = tuple(meta(value).shape)
    return all(isinstance(a.meta.get("fusec"), TensorMeta)
               and broadcasts_to(tuple(meta(a).shape), shape) for a in tensors)


def regroups(value: fx.Node, new_shape: list[int]) -> list[tuple[int, tuple]] | None:
    """[(dim, parts), ...] when `value` is a reshape of a pointwise value whose dims, each cut in
    its parts, give `new_shape`: then `new_shape` is reached by cutting the pointwise value and
    the reshape disappears (a weight packed along K: (K/8, 8, N) -> (K/G, G, N), cut to
    (K/G, G/8, 8, N)). Shapes with 1s are left to the plain view."""
    if value.op != "call_function" or value.target not in RESHAPES or \
            not pushable(value.args[0]) or 1 in new_shape:
        return None
    base = list(meta(value.args[0]).shape)
    if 1 in base:
        return None
    cuts, rest = [], list(new_shape)
    for d in reversed(range(len(base))):
        run = []
        while rest and math.prod(run) < base[d]:
            run.insert(0, rest.pop())
        if math.prod(run) != base[d]:
            return None
        if len(run) > 1:
            cuts.insert(0, (d, tuple(run)))
    return None if rest else cuts


def _runs_for(shape: list[int], fine: list[int]) -> list[tuple] | None:
    """`fine` cut into consecutive runs, one per dim of `shape`, each multiplying to that dim;
    None if there are none (or 1s make them ambiguous)."""
    if 1 in shape or 1 in fine:
        return None
    runs, rest = [], list(fine)
    for s in shape:
        run = []
        while rest and math.prod(run) < s:
            run.append(rest.pop(0))
        if math.prod(run) != s:
            return None
        runs.append(tuple(run))
    return None if rest else runs


def unflattens(value: fx.Node) -> tuple[int, tuple] | None:
    """(dim, parts) when `value` is a view that only cuts one dim of its input in parts."""
    if value.op != "call_function" or value.target is not aten.view.default:
        return None
    base, shape = list(meta(value.args[0]).shape), list(meta(value).shape)
    extra = len(shape) - len(base)
    for e in range(len(base)):
        parts = tuple(shape[e:e + extra + 1])
        if shape[:e] == base[:e] and shape[e + extra + 1:] == base[e + 1:] and extra > 0 \
                and math.prod(parts) == base[e]:
            return e, parts
    return None


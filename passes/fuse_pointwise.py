"""Pointwise fusion: group connected elementwise ops so each group becomes one kernel.

Eager PyTorch runs `torch.sin(torch.sin(x)) * 2` as three kernels, each reading and writing the
whole tensor. Fused, it is one kernel that reads `x` once and writes the result once:

    before                                  after
    sin   = aten.sin(x)                     fused_sin_sin_mul_0 = self.fused_sin_sin_mul_0(x)
    sin_1 = aten.sin(sin)                   mul = fused_sin_sin_mul_0[0]
    mul   = aten.mul(sin_1, 2)              return (mul,)
    return (mul,)

Each group is outlined into a sub-GraphModule (`self.fused_sin_sin_mul_0`) so the graph stays
runnable Python at every stage; the code generator later turns each sub-graph into a kernel.

How groups form: walk the graph in order and try to merge every pointwise node with the group of
each pointwise producer it reads. A merge is legal when

1. the two groups share an iteration space: the same shape, or one broadcasts into the other and
   every node of the smaller one is used only inside the merged group (otherwise we would have to
   store a small tensor from a large loop, writing each element many times);
2. they are on the same device;
3. it creates no cycle: no path leaves one group through an outside node and comes back into the
   other (kernel A -> extern E -> kernel B cannot merge A and B, E needs A's result and B needs E's).
   Paths include the order of side effects: random ops and in-place copies stay in program order.

Every refused merge is recorded with its reason in `record_of(gm).refusals`; a producer that
is a view or an extern op is no merge candidate and is recorded too. A value consumed outside its
group becomes one of the group's outputs: the kernel stores it once and every consumer reads it.

Before grouping, `lift_reshapes` (passes/lift_reshapes.py) moves reshapes of pointwise values up
onto what their ops load, so that such a view stops ending a kernel.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fusec import ops
from fusec.record import Refusal, record_of


from .grouping import (Group, broadcasts_to, creates_cycle, effect_edges, gathered_from, indexed_write, is_cat,
                       is_pointwise, meta, numel_rank, outline, view_root)
from .lift_reshapes import lift_reshapes
from fusec.sizes import at_least_as_large, same_shape, same_size


def fuse_pointwise(gm: fx.GraphModule) -> fx.GraphModule:
    lift_reshapes(gm)
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    effects = effect_edges(graph)
    group_of: dict[fx.Node, Group] = {n: Group([n]) for n in graph.nodes if is_pointwise(n)}
    refusals: list[Refusal] = []

    for node in graph.nodes:
        if node not in group_of:
            continue
        for producer in node.all_input_nodes:
            if producer not in group_of:
                if producer.op == "call_function" and not _view_of_input(producer):
                    kind = ops.classify(producer.target)
                    refusals.append(Refusal(producer.name, node.name, _not_pointwise(producer, kind)))
                continue
            a, b = group_of[producer], group_of[node]
            if a is b:
                continue
            reason = (_reads_an_indexed_write(producer) or _piece_of_a_cat(a, b)
                      or gathered_from(a, b) or why_not_fuse(a, b, order, effects))
            if reason:
                refusals.append(Refusal(producer.name, node.name, reason))
                continue
            merged = Group(sorted(a.nodes + b.nodes, key=order.__getitem__))
            for n in merged.nodes:
                group_of[n] = merged

    fuse_horizontally(group_of, order, effects, refusals)
    groups = list({id(g): g for g in group_of.values()}.values())
    gm = outline(gm, groups, order, effects, refusals)
    record_of(gm).refusals = refusals
    return gm


def _piece_of_a_cat(a: Group, b: Group) -> str | None:
    """A concatenation reads each piece at positions shifted along its dim: the piece must be
    in memory (a kernel's output, an extern's, an input), not computed in the same loop."""
    inside = set(a.nodes) | set(b.nodes)
    for n in inside:
        if is_cat(n) and any(p in inside for p in n.args[0]):
            return ("a piece of a cat: the cat reads it at shifted positions, so the piece is "
                    "stored by its own kernel and loaded where it lies")
    return None


def _reads_an_indexed_write(producer: fx.Node) -> str | None:
    """The buffer an indexed write returns is read whole, after the write: its kernel must end
    first (the write joins the kernel of its values, never of its readers)."""
    if indexed_write(producer) is not None:
        return ("reads the buffer an indexed write updates: the whole buffer, after the write, "
                "so not in the write's own loop")
    return None


def _view_of_input(node: fx.Node) -> bool:
    """A chain of views ending at a program input: it folds into load indices, nothing to fuse."""
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
            and ops.classify(node.target) == ops.VIEW:
        node = node.args[0]
    return node.op in ("placeholder", "get_attr")


def _not_pointwise(producer: fx.Node, kind: str) -> str:
    if kind == ops.VIEW:
        return (f"producer is a view ({producer.target}) of a computed value: the value's kernel "
                "stores it, and this kernel reads it back through the view's strides")
    if kind == ops.REDUCTION:
        return f"producer is a reduction ({producer.target}); fuse_reductions decides"
    if kind == ops.POINTWISE:
        return ("producer cannot be a kernel here (device change, unsupported arguments, or a "
                "dtype kernels do not compute in, such as complex)")
    return f"producer is an extern op ({producer.target}) that runs as an ATen call"


def why_not_fuse(a: Group, b: Group, order: dict, effects: dict) -> str | None:
    """None if groups a (producer side) and b may merge, else the reason they may not."""
    if a.device != b.device:
        return f"different devices ({a.device} vs {b.device})"
    sa, sb = a.shape, b.shape
    if not same_shape(sa, sb):
        big, small_group = (sb, a) if at_least_as_large(sb, sa) else (sa, b)
        small = small_group.shape
        if not broadcasts_to(small, big):
            return f"different iteration space {small} vs {big}"
        inside = set(a.nodes) | set(b.nodes)
        for n in small_group.nodes:
            if any(u not in inside for u in n.users):
                return (f"different iteration space {small} vs {big}: {n.name} is also used "
                        "outside, and storing it from the larger loop would repeat every write")
    if creates_cycle(a, b, order, effects):
        return "would create a cycle (a path between them leaves through another node)"
    return None




# ---- horizontal fusion ------------------------------------------------------------------------

def fuse_horizontally(group_of: dict, order: dict, effects: dict, refusals: list) -> None:
    """Merge independent kernels that read the same buffer, so it is read in one launch.

    Attention's q, k and v are three views of one matmul output; making them contiguous for the
    next matmul takes three copies, of shapes (B, H, T, d), (B, H, d, T) and (B, H, T, d). They
    have the same number of elements and read the same buffer with the same strides once their
    dims are put in the same order, so one loop over the first one's shape can do all three: the
    second one's tensors are indexed with its dims permuted to line up.
    """
    readers: dict[fx.Node, list] = {}
    for g in {id(g): g for g in group_of.values()}.values():
        inside = set(g.nodes)
        for n in g.nodes:
            for a in n.all_input_nodes:
                root = view_root(a)
                if a not in inside and root is not a:
                    readers.setdefault(root, []).append((g, a))
    for root, entries in readers.items():
        first_group, first_view = entries[0]
        for g, view in entries[1:]:
            base = group_of[first_group.nodes[0]]
            if g is base or g.perms or g.space is not None:
                continue
            perm = _matching_perm(base, first_view, g, view)
            if perm is None:
                continue
            if creates_cycle(base, g, order, effects):
                refusals.append(Refusal(first_view.name, view.name,
                                        "horizontal fusion would create a cycle"))
                continue
            merged = Group(sorted(base.nodes + g.nodes, key=order.__getitem__), space=base.shape,
                           perms=dict(base.perms))
            inside = set(g.nodes)
            for n in g.nodes:
                merged.perms[n.name] = perm
                for a in n.all_input_nodes:
                    if a not in inside:
                        merged.perms[a.name] = perm
            for n in merged.nodes:
                group_of[n] = merged


def _full_rank(g: Group) -> bool:
    """Every node and every input of g has g's exact shape (no broadcasting to permute)."""
    shape = g.shape
    inside = set(g.nodes)

    def lined_up(node):  # its shape, in the loop's dim order
        perm = g.perms.get(node.name)
        m = meta(node).shape
        return tuple(m[p] for p in perm) if perm else m
    return all(lined_up(n) == shape for n in g.nodes) and all(
        lined_up(a) == shape for n in g.nodes for a in n.all_input_nodes if a not in inside)


def _matching_perm(a: Group, a_view: fx.Node, b: Group, b_view: fx.Node) -> list[int] | None:
    """The permutation p of b's dims with b.shape[p[d]] == a.shape[d] under which b reads its
    view with the strides a reads its own: None if there is none, or the groups differ in size."""
    if a.device != b.device or not same_size(numel_rank(a.shape)[0], numel_rank(b.shape)[0]) \
            or len(a.shape) != len(b.shape) or not _full_rank(a) or not _full_rank(b) \
            or meta(a_view).shape != a.shape or meta(b_view).shape != b.shape:
        return None
    if set(a.nodes) & {u for n in b.nodes for u in n.all_input_nodes}:
        return None
    if any(ops.gathered_read(n) is not None for n in (*a.nodes, *b.nodes)):
        return None  # (a gathered read's dims are the index's: not permuted here)
    sa, sb = meta(a_view).stride, meta(b_view).stride
    perm, used = [], set()
    for d, size in enumerate(a.shape):
        match = next((j for j, s in enumerate(b.shape) if j not in used and s == size
                      and (size == 1 or sb[j] == sa[d])), None)
        if match is None:
            return None
        used.add(match)
        perm.append(match)
    return perm

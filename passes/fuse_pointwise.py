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

Every refused merge is recorded with its reason in `gm.meta["fusec_refusals"]`; a producer that
is a view or an extern op is no merge candidate and is recorded too. A value consumed outside its
group becomes one of the group's outputs: the kernel stores it once and every consumer reads it.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import networkx as nx
import torch
import torch.fx as fx

from fusec import ops
from fusec.ir import TensorMeta

MAX_NAME_OPS = 6


@dataclass
class Refusal:
    producer: str
    consumer: str
    reason: str

    def __str__(self) -> str:
        return f"{self.producer} -> {self.consumer}: {self.reason}"


@dataclass
class Group:
    nodes: list[fx.Node] = field(default_factory=list)

    @property
    def shape(self) -> tuple[int, ...]:
        return max((meta(n).shape for n in self.nodes), key=_numel_rank)

    @property
    def device(self) -> str:
        return meta(self.nodes[0]).device


def meta(node: fx.Node) -> TensorMeta:
    return node.meta["fusec"]


def is_pointwise(node: fx.Node) -> bool:
    """A node the op table can compile, producing one tensor."""
    return (node.op == "call_function" and isinstance(node.meta.get("fusec"), TensorMeta)
            and ops.normalize(node) is not None
            and not (node.target is torch.ops.aten._to_copy.default
                     and any(str(meta(a).device) != meta(node).device
                             for a in node.all_input_nodes)))


def fuse_pointwise(gm: fx.GraphModule) -> fx.GraphModule:
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
            reason = why_not_fuse(a, b, order, effects)
            if reason:
                refusals.append(Refusal(producer.name, node.name, reason))
                continue
            merged = Group(sorted(a.nodes + b.nodes, key=order.__getitem__))
            for n in merged.nodes:
                group_of[n] = merged

    groups = list({id(g): g for g in group_of.values()}.values())
    gm = _outline(gm, groups, order, effects)
    gm.meta["fusec_refusals"] = refusals
    return gm


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
    if kind == ops.POINTWISE:
        return "producer cannot be a kernel here (device change or unsupported arguments)"
    return f"producer is an extern op ({producer.target}) that runs as an ATen call"


def effect_edges(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """Side-effecting nodes (random ops, in-place copies) must keep their relative order even
    where no data flows between them: rand() then rand() draws different numbers than the
    reverse. Each such node gets an edge to the next one, next to its data edges."""
    impure = [n for n in graph.nodes if n.op == "call_function" and _impure(n)]
    return dict(zip(impure, impure[1:]))


def _impure(node: fx.Node) -> bool:
    try:
        return node.is_impure(impure_random=True)
    except TypeError:  # torch < 2.6
        return node.is_impure()


def _successors(node: fx.Node, effects: dict) -> list[fx.Node]:
    nxt = effects.get(node)
    return list(node.users) + ([nxt] if nxt is not None else [])


def why_not_fuse(a: Group, b: Group, order: dict, effects: dict) -> str | None:
    """None if groups a (producer side) and b may merge, else the reason they may not."""
    if a.device != b.device:
        return f"different devices ({a.device} vs {b.device})"
    sa, sb = a.shape, b.shape
    if sa != sb:
        big, small_group = (sb, a) if _numel_rank(sb) >= _numel_rank(sa) else (sa, b)
        small = small_group.shape
        if not _broadcasts_to(small, big):
            return f"different iteration space {small} vs {big}"
        inside = set(a.nodes) | set(b.nodes)
        for n in small_group.nodes:
            if any(u not in inside for u in n.users):
                return (f"different iteration space {small} vs {big}: {n.name} is also used "
                        "outside, and storing it from the larger loop would repeat every write")
    if _creates_cycle(a, b, order, effects):
        return "would create a cycle (a path between them leaves through another node)"
    return None


def _creates_cycle(a: Group, b: Group, order: dict, effects: dict) -> bool:
    """Is there a path from one group to the other that passes through a node outside both?"""
    inside = set(a.nodes) | set(b.nodes)
    for src, dst in ((a, b), (b, a)):
        targets = set(dst.nodes)
        limit = max(order[n] for n in targets)
        frontier = [u for n in src.nodes for u in _successors(n, effects)
                    if u not in inside and order[u] < limit]
        seen = set(frontier)
        while frontier:
            n = frontier.pop()
            for u in _successors(n, effects):
                if u in targets:
                    return True
                if u not in seen and u not in inside and order[u] < limit:
                    seen.add(u)
                    frontier.append(u)
    return False


def _broadcasts_to(small: tuple[int, ...], big: tuple[int, ...]) -> bool:
    if len(small) > len(big):
        return False
    return all(s == 1 or s == b for s, b in zip(reversed(small), reversed(big)))


def _numel_rank(shape: tuple[int, ...]):
    n = 1
    for s in shape:
        n *= s
    return (n, len(shape))


def kernel_name(nodes: list[fx.Node], index: int) -> str:
    """`fused_sin_sin_mul_0`: the ops in order, then the kernel's position in the program."""
    names = [ops.normalize(n)[0].name for n in nodes]
    if len(names) > MAX_NAME_OPS:
        names = names[: MAX_NAME_OPS - 1] + [f"{len(names) - MAX_NAME_OPS + 1}more"]
    return "fused_" + "_".join(names) + f"_{index}"


def _outline(gm: fx.GraphModule, groups: list[Group], order: dict, effects: dict) -> fx.GraphModule:
    """Rebuild the graph with every group replaced by a call to its own sub-GraphModule.

    Units (single nodes or whole groups) are emitted in a topological order of the unit graph,
    with ties broken by original position, so the result reads like the input.
    """
    unit_of = {}
    for g in groups:
        for n in g.nodes:
            unit_of[n] = id(g)
    for n in gm.graph.nodes:
        unit_of.setdefault(n, id(n))
    members: dict[int, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        members.setdefault(unit_of[n], []).append(n)

    dag = nx.DiGraph()
    dag.add_nodes_from(members)
    for n in gm.graph.nodes:
        for u in _successors(n, effects):
            if unit_of[u] != unit_of[n]:
                dag.add_edge(unit_of[n], unit_of[u])
    first = {k: min(order[n] for n in v) for k, v in members.items()}
    group_ids = {id(g) for g in groups}

    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    count = 0
    for unit in nx.lexicographical_topological_sort(dag, key=first.__getitem__):
        nodes = members[unit]
        if unit not in group_ids:
            (node,) = nodes
            env[node] = new.node_copy(node, env.__getitem__)
            continue
        name = kernel_name(nodes, count)
        count += 1
        sub, inputs, outputs = _subgraph(gm, nodes, name)
        gm.add_submodule(name, sub)
        call = new.call_module(name, tuple(env[i] for i in inputs))
        call.meta["fusec_group"] = sub.meta["fusec_group"]
        for k, out in enumerate(outputs):
            # keep the value's name: a reader follows `mul` across passes
            item = new.create_node("call_function", operator.getitem, (call, k), name=out.name)
            item.meta.update(out.meta)
            env[out] = item
    gm.graph = new
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm


def _subgraph(gm: fx.GraphModule, nodes: list[fx.Node], name: str):
    inside = set(nodes)
    inputs: list[fx.Node] = []
    for n in nodes:
        for i in n.all_input_nodes:
            if i not in inside and i not in inputs:
                inputs.append(i)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    sub = fx.Graph()
    env = {}
    for i in inputs:
        env[i] = sub.placeholder(i.name)
        env[i].meta.update(i.meta)
    for n in nodes:
        env[n] = sub.node_copy(n, env.__getitem__)
    sub.output(tuple(env[o] for o in outputs))
    sub_gm = fx.GraphModule(gm, sub, class_name=name)
    sub_gm.meta["fusec_group"] = {
        "name": name,
        "ops": [str(n.target).replace("aten.", "") for n in nodes],
        "shape": Group(nodes).shape,
        "inputs": [i.name for i in inputs],
        "outputs": [o.name for o in outputs],
    }
    return sub_gm, inputs, outputs

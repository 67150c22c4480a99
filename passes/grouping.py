"""Grouping machinery shared by the fusion passes: groups, cycle checks, outlining.

A *group* is a set of graph nodes that will become one kernel. Both fusion passes grow groups by
merging them along data edges, refuse merges that would create a cycle, and finally *outline*
each group: replace its nodes in the main graph by one call to a sub-GraphModule, so the graph
stays runnable Python after every pass (`self.fused_sin_sin_mul_0(x)`).

`inline_groups` undoes outlining, so a later pass can regroup nodes an earlier one grouped.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fusec import ops
from fusec.ops import indexed_write  # noqa: F401 (passes import it from here)
from fusec.graphmodule import graph_module
from fusec.ir import TensorMeta
from fusec.record import GroupInfo, Refusal, group_info, record_of, set_group_info
from fusec.sizes import is_one, largest_shape

MAX_NAME_OPS = 6


@dataclass
class Group:
    nodes: list[fx.Node] = field(default_factory=list)

    key: tuple | None = None  # (input shape, reduced dims) of the group's reductions, if any
    # horizontal fusion: the loop's shape, and for nodes (and inputs) iterated in a permuted
    # order, the permutation of their dims that lines them up with it
    space: tuple | None = None
    perms: dict = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, ...]:
        if self.key is not None:
            return self.key[0]
        if self.space is not None:
            return self.space
        return largest_shape(loop_shape(n) for n in self.nodes)

    @property
    def device(self) -> str:
        return meta(self.nodes[0]).device


def meta(node: fx.Node) -> TensorMeta:
    return node.meta["fusec"]


def effect_edges(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """Side-effecting nodes (random ops, in-place copies) must keep their relative order even
    where no data flows between them: rand() then rand() draws different numbers than the
    reverse. Each such node gets an edge to the next one, next to its data edges."""
    effects = [n for n in graph.nodes if n.op == "call_function" and impure(n)]
    return dict(zip(effects, effects[1:]))


def impure(node: fx.Node) -> bool:
    """A node with a side effect: a random op (rand() twice draws different numbers) or an
    in-place update. cse keeps each one, and fusion keeps them in program order."""
    try:
        return node.is_impure(impure_random=True)
    except TypeError:  # torch < 2.6
        return node.is_impure()


def successors(node: fx.Node, effects: dict) -> list[fx.Node]:
    nxt = effects.get(node)
    return list(node.users) + ([nxt] if nxt is not None else [])


def creates_cycle(a: Group, b: Group, order: dict, effects: dict) -> bool:
    """Is there a path from one group to the other that passes through a node outside both?"""
    inside = set(a.nodes) | set(b.nodes)
    for src, dst in ((a, b), (b, a)):
        targets = set(dst.nodes)
        limit = max(order[n] for n in targets)
        frontier = [u for n in src.nodes for u in successors(n, effects)
                    if u not in inside and order[u] < limit]
        seen = set(frontier)
        while frontier:
            n = frontier.pop()
            for u in successors(n, effects):
                if u in targets:
                    return True
                if u not in seen and u not in inside and order[u] < limit:
                    seen.add(u)
                    frontier.append(u)
    return False


def broadcasts_to(small: tuple[int, ...], big: tuple[int, ...]) -> bool:
    if len(small) > len(big):
        return False
    return all(is_one(s) or s == b for s, b in zip(reversed(small), reversed(big)))


def numel_rank(shape: tuple[int, ...]):
    n = 1
    for s in shape:
        n *= s
    return (n, len(shape))


def op_name(node: fx.Node) -> str:
    """The short name of what a node computes: its op-table row, reduction, or view."""
    if "fusec_name" in node.meta:  # named by the pass that made it (see kernel_name)
        return node.meta["fusec_name"]["name"]
    red = ops.reduction(node)
    if red is not None:
        return red.op.name
    if indexed_write(node) is not None:  # `cache[:, :, pos] = k`, done by the kernel
        return "write"
    row = ops.normalize(node)
    return row[0].name if row is not None else str(node.target).split(".")[-2]


def kernel_name(nodes: list[fx.Node], index: int) -> str:
    """`fused_sin_sin_mul_0`: the ops in order, then the kernel's position in the program."""
    names = [op_name(n) for n in nodes]
    at = next((i for i, n in enumerate(nodes) if "prologue" in n.meta.get("fusec_name", {})), None)
    if at is not None:
        # a node that a pass named with a word for its prologue (node.meta["fusec_name"] =
        # {"name": "mv", "prologue": "unpack"}): the ops before it are that word when they read
        # integers (a weight stored as integers), else nothing; the ops after it follow, casts
        # left out: `fused_unpack_mv_mul_add_gelu_0`
        prologue = any(isinstance(i.meta.get("fusec"), TensorMeta) and
                       not i.meta["fusec"].dtype.is_floating_point
                       for n in nodes[:at] for i in n.all_input_nodes)
        names = ([nodes[at].meta["fusec_name"]["prologue"]] if prologue else []) + [names[at]] + \
            [x for x in names[at + 1:] if x not in ("to", "copy")]
    if len(names) > MAX_NAME_OPS:
        names = names[: MAX_NAME_OPS - 1] + [f"{len(names) - MAX_NAME_OPS + 1}more"]
    return "fused_" + "_".join(names) + f"_{index}"


def outline(gm: fx.GraphModule, groups: list[Group], order: dict, effects: dict,
            refusals: list | None = None) -> fx.GraphModule:
    """Rebuild the graph with every group replaced by a call to its own sub-GraphModule.

    Units (single nodes or whole groups) are emitted in a topological order of the unit graph,
    with ties broken by original position, so the result reads like the input.
    """
    import networkx as nx  # (imported at the first compile, not with fusec: 0.2 s)
    groups = list(groups)
    while True:
        members, dag = _unit_graph(gm, groups, effects)
        first = {k: min(order[n] for n in v) for k, v in members.items()}
        try:
            units = list(nx.lexicographical_topological_sort(dag, key=first.__getitem__))
            break
        except nx.NetworkXUnfeasible:
            cycle = nx.find_cycle(dag)
        # Note (cycles through other kernels): each merge checks for a path between the two
        # groups through nodes outside them, but a path can also run through a third group,
        # which becomes one kernel too: A holds a constant read by B, and B's value reaches,
        # through an extern, a later node of A. Such a group is dissolved: its nodes run as
        # eager's ops (correct, rarely seen; found in a backward graph by the OpInfo sweep).
        on_cycle = [g for g in groups if id(g) in {u for edge in cycle for u in edge[:2]}]
        dissolved = min(on_cycle, key=lambda g: len(g.nodes))
        groups.remove(dissolved)
        if refusals is not None:
            refusals.append(Refusal(dissolved.nodes[0].name, dissolved.nodes[-1].name,
                                    "one kernel would make a cycle through another kernel: "
                                    "these ops run as eager's (Note: cycles through other kernels)"))
    by_id = {id(g): g for g in groups}

    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    count = 0
    for unit in units:
        nodes = members[unit]
        if unit not in by_id:
            (node,) = nodes
            env[node] = new.node_copy(node, env.__getitem__)
            continue
        name = kernel_name(nodes, count)
        count += 1
        sub, inputs, outputs = _subgraph(gm, nodes, name, by_id[unit])
        gm.add_submodule(name, sub)
        call = new.call_module(name, tuple(env[i] for i in inputs))
        set_group_info(call, group_info(sub))
        for k, out in enumerate(outputs):
            # keep the value's name: a reader follows `mul` across passes
            item = new.create_node("call_function", operator.getitem, (call, k), name=out.name)
            item.meta.update(out.meta)
            env[out] = item
    gm.graph = new
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm


def _unit_graph(gm: fx.GraphModule, groups: list[Group], effects: dict):
    """The graph of units (each group one unit, every other node its own): (unit -> its nodes,
    the networkx DiGraph of the data and effect edges between units)."""
    unit_of = {}
    for g in groups:
        for n in g.nodes:
            unit_of[n] = id(g)
    for n in gm.graph.nodes:
        unit_of.setdefault(n, id(n))
    members: dict[int, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        members.setdefault(unit_of[n], []).append(n)
    import networkx as nx
    dag = nx.DiGraph()
    dag.add_nodes_from(members)
    for n in gm.graph.nodes:
        for u in successors(n, effects):
            if unit_of[u] != unit_of[n]:
                dag.add_edge(unit_of[n], unit_of[u])
    return members, dag


def _subgraph(gm: fx.GraphModule, nodes: list[fx.Node], name: str, group: Group):
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
    sub_gm = graph_module(gm, sub, class_name=name)  # no Python written: fusec/graphmodule.py
    set_group_info(sub_gm, GroupInfo(
        name=name, ops=[str(n.target).replace("aten.", "") for n in nodes],
        kind="pointwise" if group.key is None else "reduction", shape=tuple(group.shape),
        perms=dict(group.perms), reduce_dims=None if group.key is None else tuple(group.key[1]),
        inputs=[i.name for i in inputs], outputs=[o.name for o in outputs]))
    return sub_gm, inputs, outputs


def inline_groups(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[Group]]:
    """Replace every call to a group's sub-GraphModule by the group's own nodes again.

    Returns the flat graph and, for each group that was inlined, a Group of its new nodes (with
    its loop shape and permutations, if horizontally fused), so a pass can start from the groups
    an earlier pass formed.
    """
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    groups: list[Group] = []
    for node in gm.graph.nodes:
        if node.op == "call_module" and group_info(node) is not None:
            sub = getattr(gm, node.target)
            inner: dict[fx.Node, fx.Node] = {}
            members = []
            placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
            for ph, arg in zip(placeholders, node.args):
                inner[ph] = env[arg]
            for n in sub.graph.nodes:
                if n.op == "call_function":
                    inner[n] = new.node_copy(n, inner.__getitem__)
                    members.append(inner[n])
            outs = sub.graph.output_node().args[0]
            env[node] = tuple(inner[o] for o in outs)
            info = group_info(sub)
            renamed = {old.name: new_node.name for old, new_node in inner.items()}
            perms = {renamed.get(k, k): v for k, v in info.perms.items()}
            space = tuple(info.shape) if perms else None
            groups.append(Group(members, space=space, perms=perms))
        elif node.op == "call_function" and node.target is operator.getitem \
                and isinstance(env.get(node.args[0]), tuple):
            env[node] = env[node.args[0]][node.args[1]]
        else:
            env[node] = new.node_copy(node, lambda a: env[a])
    gm.graph = new
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm, groups


def loop_shape(node: fx.Node) -> tuple[int, ...]:
    """The iteration space a node needs: its shape, or for an indexed write the values' shape
    (the buffer it returns is larger: it is written at one position)."""
    write = indexed_write(node)
    if write is None:
        return tuple(meta(node).shape)
    buffer, dim = write[:2]  # the buffer's shape with the written dim 1: the values, full rank
    return tuple(1 if d == dim else s for d, s in enumerate(meta(buffer).shape))


def gathered_from(a: Group, b: Group) -> str | None:
    """A gathered read (`scales[g_idx]`) reads its source at rows its index values pick, so the
    source must be in memory; and its index values are read before the rows they pick, from
    memory too (codegen/lower.py): neither is computed in the read's own loop."""
    inside = set(a.nodes) | set(b.nodes)
    for n in inside:
        gather = ops.gathered_read(n)
        if gather is not None and gather.source in inside:
            return ("the source of a gathered read: its rows are read where index values "
                    "point, so it is stored by its own kernel and loaded where it lies")
        if gather is not None and gather.index in inside:
            return ("the index of a gathered read: the kernel reads the index values before "
                    "the rows they pick, so they are stored first")
    return None


def is_cat(node: fx.Node) -> bool:
    """A concatenation a pointwise kernel can do: each output element is one element of one
    piece, read where the piece lives (codegen/lower.py, `cat_loads`). Its pieces must have the
    output's dtype (no promotion inside the loads) and rank, on its device."""
    if node.op != "call_function" or node.target is not torch.ops.aten.cat.default:
        return False
    out = node.meta.get("fusec")
    pieces = node.args[0]
    if not isinstance(out, TensorMeta) or len(pieces) < 2 \
            or not all(isinstance(p, fx.Node) for p in pieces):
        return False
    return all(isinstance(m := p.meta.get("fusec"), TensorMeta) and m.dtype == out.dtype
               and len(m.shape) == len(out.shape) and m.device == out.device for p in pieces)


# ---- helpers for passes that rewrite nodes and record their decisions -----------------------

def val(n):
    """The example value (a fake tensor) a node carries, or None for a non-node argument."""
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def new_node(graph: fx.Graph, target, args: tuple, value, like: fx.Node, name: str | None = None,
             kwargs: dict | None = None) -> fx.Node:
    """A call of `target` (inserted where the graph's insertion point is), annotated with its
    example value and fusec's TensorMeta, and with `like`'s other meta (stack trace, origin)."""
    new = graph.create_node("call_function", target, tuple(args), kwargs or {}, name=name)
    new.meta.update({k: v for k, v in like.meta.items() if k not in ("val", "fusec", "tensor_meta")})
    new.meta["val"] = value
    new.meta["fusec"] = TensorMeta.of(value)
    return new


def constant_node(gm: fx.GraphModule, base: str, tensor: torch.Tensor) -> fx.Node:
    """A `get_attr` of `tensor`, kept on gm as a graph constant under a free name starting with
    `base`, inserted at the graph's insertion point."""
    name, n = base, 1
    while hasattr(gm, name):
        name, n = f"{base}_{n}", n + 1
    gm.register_buffer(name, tensor, persistent=False)  # a graph constant, as fx expects one
    return gm.graph.get_attr(name)


def record_decisions(gm: fx.GraphModule, pass_name: str, decisions: list) -> fx.GraphModule:
    """Keep a rewriting pass's decisions in the graph's record; if it rewrote anything, drop the
    nodes it left without users and regenerate the module's code. A registered pass's decisions
    (passes/__init__.py, `register`) go in the record's `extensions`, under its name."""
    rec = record_of(gm)
    if hasattr(rec, pass_name):
        setattr(rec, pass_name, decisions)
    else:
        rec.extensions = {**rec.extensions, pass_name: decisions}
    if any(d.taken for d in decisions):
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm


def is_pointwise(node: fx.Node) -> bool:
    """A node the op table can compile, producing one tensor."""
    return (node.op == "call_function" and isinstance(node.meta.get("fusec"), TensorMeta)
            and (ops.normalize(node) is not None or is_cat(node) or indexed_write(node) is not None
                 or ops.gathered_read(node) is not None)
            and not (node.target is torch.ops.aten._to_copy.default
                     and any(str(meta(a).device) != meta(node).device
                             for a in node.all_input_nodes)))


def view_root(node: fx.Node) -> fx.Node:
    """Follow views (and pieces of split/unbind) back to the value they look into."""
    while node.op == "call_function":
        if isinstance(node.target, torch._ops.OpOverload) and ops.classify(node.target) == ops.VIEW:
            node = node.args[0]
        elif node.target is operator.getitem and ops.is_multi_view(node.args[0].target):
            node = node.args[0].args[0]
        else:
            break
    return node

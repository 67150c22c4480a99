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

Before grouping, `lift_reshapes` moves reshapes of pointwise values up onto what their ops load,
so that such a view stops ending a kernel (see Note: reshapes of computed values, below).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fusec import ops
from fusec.ir import TensorMeta
from fusec.codegen import backends
from fusec.record import Decision, Refusal, record_of

import operator

from .grouping import (Group, broadcasts_to, creates_cycle, effect_edges, gathered_from, indexed_write, is_cat,
                       meta, numel_rank, outline)


def is_pointwise(node: fx.Node) -> bool:
    """A node the op table can compile, producing one tensor."""
    return (node.op == "call_function" and isinstance(node.meta.get("fusec"), TensorMeta)
            and (ops.normalize(node) is not None or is_cat(node) or indexed_write(node) is not None
                 or ops.gathered_read(node) is not None)
            and not (node.target is torch.ops.aten._to_copy.default
                     and any(str(meta(a).device) != meta(node).device
                             for a in node.all_input_nodes)))


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
    if sa != sb:
        big, small_group = (sb, a) if numel_rank(sb) >= numel_rank(sa) else (sa, b)
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
    if a.device != b.device or numel_rank(a.shape)[0] != numel_rank(b.shape)[0] \
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


# ---- reshapes up to the loads -----------------------------------------------------------------
#
# Note (reshapes of computed values): a view of a computed value ends that value's kernel (see
# `_not_pointwise`). Group norm's backward reshapes a lot: `dy * x` over (N, C, H, W) is summed
# over H*W through `view(mul, [N, C, H*W])`, and the rows' scale `rstd * gamma`, (N, G, C/G), is
# broadcast over H*W through `unsqueeze(mul_3, -1)`. Each view cuts a kernel: `dy * x` is stored
# and read back, `rstd * gamma` is a kernel of its own. But a pointwise op commutes with a
# reshape of its result, as move_permutes uses for permutes and unflatten for cuts:
#
#     view(dy * x, [N, C, H*W])    ==  view(dy, [N, C, H*W]) * view(x, [N, C, H*W])
#     unsqueeze(rstd * gamma, -1)  ==  unsqueeze(rstd, -1) * unsqueeze(gamma, -1)   (ranked first)
#
# and a view of what a kernel loads (a program input, a weight, an extern's result) folds into
# the load's index expression. So `lift_reshapes` moves such a view above the pointwise ops that
# only it reads, when every value at the top is loaded (lifting onto a computed value would cut
# that value's kernel instead). Two kinds of reshape lift: one whose inputs all have the value's
# exact shape (any regrouping of dims torch can view them with), and one that only inserts or
# removes dims of size 1 (unsqueeze, squeeze), which inputs that broadcast take as well.

LIFTED_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
                torch.ops.aten.reshape.default, torch.ops.aten.unsqueeze.default,
                torch.ops.aten.squeeze.dim, torch.ops.aten.squeeze.dims)


def lift_reshapes(gm: fx.GraphModule) -> None:
    """Move reshapes of pointwise values up to the values their ops load (see the note above).
    A candidate is a reshape of a pointwise value that only the reshape reads, read by a pointwise
    op or a reduction; each is a Decision in `record_of(gm).fuse_pointwise`, lifted or kept."""
    from .layout import run_fake, same_strides, set_meta  # (layout imports passes that import this module)
    from .schedule import fake_mode_of
    from .unflatten import erase_dead

    graph = gm.graph
    decisions: list = []
    mode = None
    backend = record_of(gm).backend
    rows_one_by_one = bool(backend) and backends.get(backend).rows_one_by_one
    for view in [n for n in graph.nodes if n.op == "call_function" and n.target in LIFTED_VIEWS]:
        value = view.args[0]
        if getattr(view, "_erased", False) or not (isinstance(value, fx.Node) and value.op == "call_function" and is_pointwise(value)):
            continue
        if not _liftable_op(value, view) or not any(
                u.op == "call_function" and _fuses_with(u) for u in view.users):
            continue  # no candidate: the value is stored anyway, or no reader could fuse with it
        out = tuple(meta(view).shape)
        why = _why_not_lift(value, out, view, rows_one_by_one)
        if why:
            decisions.append(Decision(view.name, False, why))
            continue
        mode = mode or fake_mode_of(gm)
        made: list[fx.Node] = []

        def add(target, args, like, name, kwargs=None):
            with graph.inserting_before(view):
                new = graph.call_function(target, args, dict(kwargs or {}))
            made.append(new)
            new._rename(name)
            val = run_fake(mode, new)
            if val is None:
                raise ValueError(f"{new.format_node()} does not run on its fake inputs")
            set_meta(new, val, like=like)
            return new

        def lift(v: fx.Node, v_out: tuple) -> fx.Node:
            """v's values reshaped to v_out, from reshaped views of what its chain loads."""
            args = []
            for a in v.args:
                if not _tensor_with_dims(a):
                    args.append(a)
                    continue
                a_out = _reshaped(tuple(meta(a).shape), tuple(meta(v).shape), v_out)
                if _liftable_op(a, v):
                    args.append(lift(a, a_out))
                else:
                    args.append(add(torch.ops.aten.view.default, (a, list(a_out)), a,
                                    f"{a.name}_reshaped"))
            return add(v.target, tuple(args), v, f"{v.name}_reshaped", v.kwargs)
        try:
            new = lift(value, out)
            problem = None
            if not same_strides(meta(new), meta(view)) and not all(
                    u.op == "call_function" and _fuses_with(u) for u in view.users):
                problem = (f"{view.name}'s readers need its strides {meta(view).stride}, not "
                           f"{meta(new).stride}")
        except ValueError as err:
            problem = str(err)
        if problem:
            for n in reversed(made):
                graph.erase_node(n)
            decisions.append(Decision(view.name, False, problem))
            continue
        view.replace_all_uses_with(new)
        graph.erase_node(view)
        erase_dead(graph, value)
        decisions.append(Decision(new.name, True, (
            f"reshape {view.name} of {value.name} moved above its pointwise ops onto the values "
            "they load, where it folds into load indices: the ops fuse with the reshape's readers")))
    record_of(gm).fuse_pointwise = decisions
    if any(taken for _, taken, _ in decisions):
        graph.lint()
        gm.recompile()


def _liftable_op(v: fx.Node, reader: fx.Node) -> bool:
    """A pointwise op only `reader` reads, whose inputs broadcast to its shape (unflatten's
    `pushable`), drawing no random numbers: it can be computed from reshaped inputs."""
    from .unflatten import pushable
    from .grouping import impure
    return (v.op == "call_function" and is_pointwise(v) and ops.normalize(v) is not None
            and pushable(v) and not impure(v) and len(v.users) == 1 and reader in v.users)


def _why_not_lift(value: fx.Node, out: tuple, view: fx.Node, rows_one_by_one: bool) -> str | None:
    """None if reshaping `value` to `out` can move above its pointwise ops, else why not."""
    if not all(isinstance(s, int) for s in (*out, *meta(value).shape)):
        return "symbolic sizes: the reshape of each input is not known"
    todo = [(value, out)]
    while todo:
        v, v_out = todo.pop()
        if rows_one_by_one and not ops.is_cheap(v) and any(
                u.op == "call_function" and _fuses_with(u) and not is_pointwise(u) for u in view.users):
            return (f"{v.name} is costly and {view.name} is read by a reduction: moved into a CPU "
                    f"reduction kernel, it would be computed again in every pass over the row")
        for a in v.all_input_nodes:
            if not _tensor_with_dims(a):
                continue
            if not all(isinstance(size, int) for size in meta(a).shape):
                return "symbolic sizes: the reshape of each input is not known"
            a_out = _reshaped(tuple(meta(a).shape), tuple(meta(v).shape), v_out)
            if a_out is None:
                return (f"{a.name} {tuple(meta(a).shape)} broadcasts to {v.name} "
                        f"{tuple(meta(v).shape)}, and the reshape to {v_out} regroups dims")
            if _liftable_op(a, v):
                todo.append((a, a_out))
            elif _computed_value(a):
                return (f"{a.name} is computed by a kernel: reshaping it would cut that kernel "
                        "instead")
    return None


def _tensor_with_dims(a) -> bool:
    return isinstance(a, fx.Node) and isinstance(a.meta.get("fusec"), TensorMeta) \
        and len(meta(a).shape) > 0


def _fuses_with(u: fx.Node) -> bool:
    """A reader a kernel computes from any strides: a pointwise op or a reduction."""
    return is_pointwise(u) or (isinstance(u.target, torch._ops.OpOverload)
                               and ops.classify(u.target) == ops.REDUCTION)


def _computed_value(a: fx.Node) -> bool:
    root = view_root(a)
    if root.op == "call_function" and root.target is operator.getitem:
        root = root.args[0]
    return root.op == "call_function" and _fuses_with(root)


def _reshaped(a: tuple, v: tuple, out: tuple) -> tuple | None:
    """The shape an input of shape `a` (broadcasting to `v`) takes when `v` is reshaped to `out`;
    None if there is none: `a` must equal `v`, unless `v -> out` only inserts or removes 1s."""
    if a == v:
        return out
    ranked = (1,) * (len(v) - len(a)) + a
    shape, i, j = [], 0, 0
    while i < len(v) or j < len(out):
        if i < len(v) and j < len(out) and v[i] == out[j]:
            shape.append(ranked[i])
            i, j = i + 1, j + 1
        elif j < len(out) and out[j] == 1:
            shape.append(1)
            j += 1
        elif i < len(v) and v[i] == 1:
            i += 1
        else:
            return None
    return tuple(shape)

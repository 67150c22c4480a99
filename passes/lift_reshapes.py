"""Reshapes of pointwise values moved up onto what their ops load, before pointwise fusion.

Called by fuse_pointwise before it groups (it is part of that pass: its decisions are in
`record.fuse_pointwise`, docs/passes/fuse_pointwise.md, "Reshapes lifted onto loads"). Why it
pays is the note below; `lift_reshapes` is the walk, `_why_not_lift` every reason a reshape
stays where it is.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fusec import ops
from fusec.codegen import backends
from fusec.ir import TensorMeta
from fusec.record import Decision, record_of

from .grouping import is_pointwise, meta, view_root


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

# A costly value moved into a CPU reduction kernel is computed once when the loop plan keeps it
# between the passes over a row (`Stash` and `Keep`, fusec/loop_plan.py: the first pass writes it
# into the kernel's element output, the later ones read it back), which it does for values of
# these dtypes; in others it would be computed again in every pass, and the reshape stays.
KEPT_DTYPES = (torch.float32, torch.float64)

LIFTED_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
                torch.ops.aten.reshape.default, torch.ops.aten.unsqueeze.default,
                torch.ops.aten.squeeze.dim, torch.ops.aten.squeeze.dims)


def lift_reshapes(gm: fx.GraphModule) -> None:
    """Move reshapes of pointwise values up to the values their ops load (see the note above).
    A candidate is a reshape of a pointwise value that only the reshape reads, read by a pointwise
    op or a reduction; each is a Decision in `record_of(gm).fuse_pointwise`, lifted or kept."""
    from .layout import run_fake, set_meta  # (layout imports passes that import this module)
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
            if not _same_strides(meta(new), meta(view)) and not all(
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
    if _feeds_a_family_sum(view):
        return (f"{view.name} feeds a matmul computed as a sum (a kernel family's form): the "
                "family reads its operands as buffers laid out by its rewrite")
    todo = [(value, out)]
    while todo:
        v, v_out = todo.pop()
        if rows_one_by_one and not ops.is_cheap(v) and meta(view).dtype not in KEPT_DTYPES \
                and any(u.op == "call_function" and _fuses_with(u) and not is_pointwise(u)
                        for u in view.users):
            return (f"{v.name} is costly and {view.name} is read by a reduction: moved into a CPU "
                    f"reduction kernel, it would be computed again in every pass over the row "
                    f"(a {meta(view).dtype} value is not kept between passes)")
        for a in v.all_input_nodes:
            if not _tensor_with_dims(a):
                continue
            a_out = _reshaped(tuple(meta(a).shape), tuple(meta(v).shape), v_out)
            if a_out is None:
                return (f"{a.name} {tuple(meta(a).shape)} broadcasts to {v.name} "
                        f"{tuple(meta(v).shape)}, and the reshape to {v_out} regroups dims"
                        " (or, with symbolic sizes, is not known to be the same at every size)")
            if _liftable_op(a, v):
                todo.append((a, a_out))
            elif _computed_value(a):
                return (f"{a.name} is computed by a kernel: reshaping it would cut that kernel "
                        "instead")
    return None


def _feeds_a_family_sum(view: fx.Node) -> bool:
    """Whether `view` reaches, through pointwise ops, a sum marked "fusec_matmul"."""
    todo, seen = list(view.users), set()
    while todo:
        u = todo.pop()
        if u in seen or u.op != "call_function":
            continue
        seen.add(u)
        if "fusec_matmul" in u.meta:
            return True
        if is_pointwise(u) or (isinstance(u.target, torch._ops.OpOverload)
                               and ops.classify(u.target) == ops.VIEW):
            todo.extend(u.users)
    return False


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
    None if there is none: `a` must equal `v`, unless `v -> out` only inserts or removes 1s.
    Sizes that are symbols (a shape family) are compared only as far as they are known at every
    size of the family (`_known_equal`): no question here adds a guard, and an answer that holds
    only at some sizes keeps the reshape where it is."""
    if len(a) == len(v) and all(map(_known_equal, a, v)):
        return out
    ranked = (1,) * (len(v) - len(a)) + a
    shape, i, j = [], 0, 0
    while i < len(v) or j < len(out):
        if i < len(v) and j < len(out) and _known_equal(v[i], out[j]):
            shape.append(ranked[i])
            i, j = i + 1, j + 1
        elif j < len(out) and _known_equal(out[j], 1):
            shape.append(1)
            j += 1
        elif i < len(v) and _known_equal(v[i], 1):
            i += 1
        else:
            return None
    return tuple(shape)


def _same_strides(a: TensorMeta, b: TensorMeta) -> bool:
    """layout's `same_strides`, asked without a guard where sizes are symbols (`_known_equal`):
    a symbolic dim is taken as not 1, so its strides are compared."""
    return len(a.shape) == len(b.shape) and all(map(_known_equal, a.shape, b.shape)) and all(
        _known_equal(x, y) for x, y, n in zip(a.stride, b.stride, a.shape) if not _known_equal(n, 1))


def _known_equal(x, y) -> bool:
    """x == y for sizes, True only where it holds at every size of a shape family (the same
    symbol, or the same expression of symbols); plain ints compare as ints."""
    if isinstance(x, torch.SymInt) or isinstance(y, torch.SymInt):
        from torch.fx.experimental.symbolic_shapes import statically_known_true
        return statically_known_true(x == y)
    return x == y

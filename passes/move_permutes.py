"""Move permutes out of the way of fusion: up to what a kernel loads, down past what it computes.

A view of a *computed* value ends that value's kernel (passes/fuse_pointwise.py): the kernel
stores the value, and the next kernel reads it back through the view's strides. Models permute a
lot around convolutions: ConvNeXt normalizes over channels by permuting NCHW to NHWC and back,

    y = conv(x) + b                         # unfuse_bias puts a convolution's bias here (GPU)
    z = layer_norm(y.permute(0, 2, 3, 1))   # its ops: clone, mean, sub, ..., add
    out = gelu(z.permute(0, 3, 1, 2))

and each permute cuts a kernel in two: `+ b`, the norm and the GELU become three kernels with two
trips through memory between them. But a pointwise op does not care in which order it visits
the elements, so a permute commutes with it:

    permute(a + b, p)  ==  permute(a, p) + permute(b, p)

This pass uses that in both directions.

* **Up**: `permute(v, p)` where `v` is a pointwise op that only the permute reads becomes `v`
  computed from permuted inputs. Only when every value at the top of the chain is something a
  kernel loads anyway (a program input, a weight, an extern's result such as the convolution):
  a permute of those folds into the load's index expression, and `+ b` joins the norm's kernel.

      before                                  after
      add = add(conv, b4)                     conv_p = permute(conv, p)      # a view: load indices
      permute = permute(add, p)               b4_p = permute(b4, p)
      clone = clone(permute)                  add_p = add(conv_p, b4_p)      # fuses with clone
                                              clone = clone(add_p)

* **Down**: a pointwise op `u` that reads `permute(w, p)` of a value `w` some kernel computes
  becomes `permute(u', p)`, with `u'` computed in `w`'s own order (so it fuses into `w`'s kernel)
  and its other inputs given the inverse permute. The new permute is a view again, and moves on
  down through the next pointwise op, until it reaches the program's output (where it is free:
  the output *is* a view of `u'`'s buffer) or an op that is not pointwise.

      before                                  after
      add_1 = ... (the norm's kernel)         add_1 = ...
      permute_1 = permute(add_1, q)           gelu_p = gelu(add_1)           # the norm's kernel
      gelu = gelu(permute_1)                  gelu = permute(gelu_p, q)      # output: a view
      return gelu                             return gelu

Each move is taken only when it cannot make anything worse or different:

* the ops moved are pointwise, side-effect free (no random numbers: which element draws which
  number would change), with plain tensor arguments that broadcast to their shape;
* the values a move reads or writes through a new permute are not computed by a kernel unless
  the move is down from that very kernel (a permute of another kernel's value would cut a new
  kernel boundary where there was none);
* a replaced value that changes its strides is read only by pointwise ops and reductions (which
  read any strides); if it is a program output, its strides stay eager's exactly;
* on a backend whose reductions walk one row at a time (the CPU ones), a costly op (not in
  ops.CHEAP_OPS) does not move into a reduction's kernel: down into its epilogue it would be
  computed row by row instead of over the whole tensor, up into its prologue once per pass.

Every candidate is a `Decision` in `record_of(gm).move_permutes`, with its reason, and `explain` lists
them. The values are the same as eager's, bit for bit: every op computes the same numbers, in a
different order of elements.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fusec import ops
from fusec.codegen import backends
from fusec.graphmodule import looks_for
from fusec.ir import TensorMeta
from fusec.record import Decision, record_of

from .grouping import is_pointwise, view_root
from .grouping import impure, meta
from .layout import run_fake, same_strides, set_meta
from .schedule import fake_mode_of
from .unflatten import erase_dead, pushable

aten = torch.ops.aten


@looks_for(aten.permute.default)
def move_permutes(gm: fx.GraphModule) -> fx.GraphModule:
    """Move permutes up to loaded values and down past pointwise ops (see the module docstring)."""
    graph = gm.graph
    decisions: list[Decision] = []
    mode = fake_mode_of(gm)
    backend = record_of(gm).backend
    rows_one_by_one = bool(backend) and backends.get(backend).rows_one_by_one
    for p in [n for n in graph.nodes if _is_permute(n)]:
        if not getattr(p, "_erased", False) and _movable(p.args[0]):
            _move_up(graph, mode, p, decisions, rows_one_by_one)
    todo = [n for n in graph.nodes if _is_permute(n)]
    while todo:
        p = todo.pop(0)
        if getattr(p, "_erased", False) or not _computed(p.args[0]):
            continue
        for user in list(p.users):
            new = _move_down(graph, mode, p, user, decisions, rows_one_by_one)
            if new is not None:
                todo.append(new)
    record_of(gm).move_permutes = decisions
    if any(t for _, t, _ in decisions):
        graph.lint()
        gm.recompile()
    return gm


# ---- up: permute(v(a, b)) -> v(permute(a), permute(b)) -----------------------------------------

def _move_up(graph: fx.Graph, mode, p: fx.Node, decisions: list, rows_one_by_one: bool) -> None:
    perm = _perm(p)
    why = _why_not_up(p.args[0], p, rows_one_by_one)
    if why:
        decisions.append(Decision(p.name, False, why))
        return
    made: list[fx.Node] = []
    try:
        new = _lift(graph, mode, p.args[0], perm, p, made)
        why = _why_not_replace(p, meta(new))
    except _CannotRun as err:
        new, why = None, str(err)
    if why:
        _refuse(graph, made, decisions, p, why)
        return
    old = p.args[0]
    p.replace_all_uses_with(new)
    graph.erase_node(p)
    erase_dead(graph, old)
    decisions.append(Decision(new.name, True, f"permute {p.name} moved above {old.name}: it now "
                              "folds into the loads of what the ops read, and they fuse with "
                              "the permute's readers"))


def _refuse(graph: fx.Graph, made: list[fx.Node], decisions: list, node: fx.Node,
            why: str) -> None:
    """Undo a move that was built and then refused: erase the nodes it made (last first, so
    each has no users left), and record why."""
    for n in reversed(made):
        graph.erase_node(n)
    decisions.append(Decision(node.name, False, why))


def _why_not_up(v: fx.Node, p: fx.Node, rows_one_by_one: bool) -> str | None:
    """None if the pointwise chain ending at v can be computed from permuted inputs."""
    if len(v.users) != 1:
        return f"{v.name} has other readers: it is computed anyway"
    if rows_one_by_one and not ops.is_cheap(v) and _before_reduction(p):
        return (f"{v.name} is costly and {p.name} is read by a reduction: moved into a CPU "
                f"reduction kernel, {v.name} would be computed again in every pass over the row")
    for a in v.all_input_nodes:
        if _movable(a) and len(a.users) == 1:
            why = _why_not_up(a, p, rows_one_by_one)
            if why:
                return why
        elif _computed(view_root(a)):
            return (f"{a.name} is computed by a kernel: permuting it would cut that kernel where "
                    "the permute's readers fuse with it now")
    return None


def _lift(graph, mode, v: fx.Node, perm: list, before: fx.Node, made: list) -> fx.Node:
    """v's values in permuted order, built from permuted views of what the chain loads."""
    args = []
    for a in v.args:
        if not isinstance(a, fx.Node):
            args.append(a)
        elif _movable(a) and len(a.users) == 1:
            args.append(_lift(graph, mode, a, perm, before, made))
        else:
            args.append(_permuted(graph, mode, a, perm, len(perm), before, made))
    return _add(graph, mode, v.target, tuple(args), dict(v.kwargs), like=v, before=before,
                made=made, name=f"{v.name}_permuted")


# ---- down: u(permute(w), b) -> permute(u(w, inverse_permute(b))) --------------------------------

def _move_down(graph: fx.Graph, mode, p: fx.Node, u: fx.Node, decisions: list,
               rows_one_by_one: bool) -> fx.Node | None:
    """Rewrite pointwise reader u of permute p; the new permute node, or None if u stays."""
    if not _movable(u):
        return None  # not pointwise (a reduction, an extern, a view): nothing to decide here
    perm = _perm(p)
    inverse = [perm.index(d) for d in range(len(perm))]
    why = _why_not_down(p, u)
    if why is None and rows_one_by_one and not ops.is_cheap(u) and _after_reduction(p.args[0]):
        why = (f"{u.name} is costly and {p.args[0].name} ends a reduction: a CPU reduction kernel "
               f"computes its epilogue row by row, and {u.name} vectorizes better over the whole "
               "tensor in a kernel of its own (KernelBench-style 19_: 0.128 ms moved, 0.116 not)")
    if why:
        decisions.append(Decision(u.name, False, why))
        return None
    made: list[fx.Node] = []
    try:
        args = []
        for a in u.args:
            if a is p or (isinstance(a, fx.Node) and _is_permute(a) and _perm(a) == perm
                          and a.args[0] is p.args[0]):
                args.append(p.args[0])
            elif isinstance(a, fx.Node) and isinstance(a.meta.get("fusec"), TensorMeta) \
                    and len(meta(a).shape) > 0:
                args.append(_permuted(graph, mode, a, inverse, len(perm), u, made))
            else:
                args.append(a)
        inner = _add(graph, mode, u.target, tuple(args), dict(u.kwargs), like=u, before=u,
                     made=made, name=f"{u.name}_unpermuted")
        new = _add(graph, mode, aten.permute.default, (inner, perm), {}, like=u, before=u,
                   made=made, name=f"{u.name}_permuted")
        why = _why_not_replace(u, meta(new))
    except _CannotRun as err:
        new, why = None, str(err)
    if why:
        _refuse(graph, made, decisions, u, why)
        return None
    why = (f"{u.name} computed before permute {p.name}, in the order of {p.args[0].name}, "
           "whose kernel it joins; the permute moves past it")
    u.replace_all_uses_with(new)
    graph.erase_node(u)
    erase_dead(graph, p)
    decisions.append(Decision(inner.name, True, why))
    return new


def _why_not_down(p: fx.Node, u: fx.Node) -> str | None:
    if len(meta(u).shape) != len(meta(p).shape):
        return f"{u.name} broadcasts {p.name} to a higher rank"
    for a in u.all_input_nodes:
        if a is p or not isinstance(a.meta.get("fusec"), TensorMeta) or not meta(a).shape:
            continue
        if _is_permute(a) and _perm(a) == _perm(p) and a.args[0] is p.args[0]:
            continue
        if _computed(view_root(a)):
            return (f"{u.name} also reads {a.name}, computed by a kernel in another order: "
                    "permuting it would cut that kernel")
    return None


# ---- shared -----------------------------------------------------------------------------------

class _CannotRun(Exception):
    pass


def _why_not_replace(old: fx.Node, new: TensorMeta) -> str | None:
    """Why a value with meta `new` cannot take old's place: its strides differ, and a reader
    cares (the program's caller, a view, an extern). Kernels read any strides."""
    if same_strides(meta(old), new):
        return None
    for user in old.users:
        if user.op == "output":
            return (f"{old.name} is a program output: its strides {meta(old).stride} would "
                    f"become {new.stride}")
        if not (is_pointwise(user) or _classify(user) == ops.REDUCTION):
            return (f"{user.name} reads {old.name} and needs its strides {meta(old).stride}, "
                    f"not {new.stride}")
    return None


def _permuted(graph, mode, a: fx.Node, perm: list, rank: int, before, made) -> fx.Node:
    """permute(a, perm), where a (which broadcasts from the right) is first viewed at `rank`."""
    shape = list(meta(a).shape)
    if len(shape) < rank:
        a = _add(graph, mode, aten.view.default, (a, [1] * (rank - len(shape)) + shape), {},
                 like=a, before=before, made=made, name=f"{a.name}_ranked")
    return _add(graph, mode, aten.permute.default, (a, list(perm)), {}, like=a, before=before,
                made=made, name=f"{a.name}_permuted")


def _add(graph, mode, target, args, kwargs, like, before, made, name=None) -> fx.Node:
    with graph.inserting_before(before):
        new = graph.call_function(target, args, kwargs)
    made.append(new)
    if name:
        new._rename(name)
    val = run_fake(mode, new)
    if val is None:
        raise _CannotRun(f"{new.format_node()} does not run on its fake inputs")
    set_meta(new, val, like=like)
    return new


def _is_permute(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is aten.permute.default


def _perm(p: fx.Node) -> list[int]:
    rank = len(meta(p).shape)
    return [d % rank for d in p.args[1]]


def _movable(v) -> bool:
    """A pointwise op that commutes with a permute of its inputs (and draws no random numbers)."""
    return isinstance(v, fx.Node) and is_pointwise(v) and pushable(v) and not impure(v)


def _computed(v: fx.Node) -> bool:
    """A value some kernel computes (not an input, a weight, or an extern's result)."""
    if v.op == "call_function" and v.target is operator.getitem:
        v = v.args[0]  # one result of a multi-output op (var_mean)
    return v.op == "call_function" and (is_pointwise(v) or _classify(v) == ops.REDUCTION)


def _after_reduction(v: fx.Node) -> bool:
    """v is computed from a reduction's result through pointwise ops: the reduction's epilogue."""
    return _reaches_reduction([v], lambda n: n.all_input_nodes)


def _before_reduction(v: fx.Node) -> bool:
    """A reduction reads v, directly or through pointwise ops and views: v joins its prologue."""
    return _reaches_reduction(list(v.users), lambda n: list(n.users))


def _reaches_reduction(todo: list, step, limit: int = 64) -> bool:
    """A reduction among `todo` or what `step` leads to from them through pointwise ops and
    views (a bounded walk: the rule is about the kernel a node fuses into, not the program)."""
    seen: set = set()
    while todo and len(seen) < limit:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if _classify(n) == ops.REDUCTION:
            return True
        if n.op == "call_function" and (is_pointwise(n) or _classify(n) == ops.VIEW):
            todo += step(n)
    return False


def _classify(n: fx.Node):
    return ops.classify(n.target) if isinstance(n.target, torch._ops.OpOverload) else None

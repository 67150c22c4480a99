"""Common-subexpression elimination: compute each value once.

Decompositions repeat themselves. layer_norm's computes `x - mean` twice, once for the variance
and once to normalize; a program may call `torch.sigmoid(x)` in two places:

    before                            after
    sub   = x - mean                  sub   = x - mean
    sq    = sub * sub                 sq    = sub * sub
    sub_2 = x - mean      # again     out   = sub * rstd
    out   = sub_2 * rstd

Two nodes are the same value when they call the same op on the same arguments (after earlier
duplicates were replaced). A node with an effect — a random op, an in-place update, anything
torch.fx calls impure — is never merged: two `rand()` calls must draw twice. The pass records
each replacement in `record_of(gm).cse` as a `Merge(removed, kept)` (fusec/record.py).

A node is also the same value as its input when its op hands the input's values back: `x - 0`,
`x * 1`, `x / 1`, and `x + 0` where x holds integers (for floats -0.0 + 0 is +0.0, so that one
stays). Programs rarely spell these, but capture makes them: GPT-2's position ids are
`arange(past, past + n) + 0`, traced with a past length of zero; at a fixed n the two fold into a
constant, but where n is a symbol (a shape family, docs/dynamic.md) the add would be a kernel of
its own on every call. Such a node is merged into x, unless the op makes a different tensor (it
promotes the dtype: a bool plus 0 is int64; or it broadcasts), or the program returns it or a
view of it (eager returns a new tensor there, never the input itself).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fusec.record import Merge, record_of
from fusec.symbolic import hashable

from fusec.ops import is_view

from .grouping import impure, meta

aten = torch.ops.aten
# op -> the number it leaves a value unchanged with (`x + 0` only for integers: see above)
IDENTITIES = {aten.add.Tensor: 0, aten.sub.Tensor: 0, aten.mul.Tensor: 1, aten.div.Tensor: 1}


def cse(gm: fx.GraphModule) -> fx.GraphModule:
    seen: dict[tuple, fx.Node] = {}
    replaced: list[Merge] = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or impure(node):
            continue
        same = _identity_of(node)
        if same is not None:  # (x * 1 is x)
            node.replace_all_uses_with(same)
            gm.graph.erase_node(node)
            replaced.append(Merge(node.name, same.name))
            continue
        try:
            key = (node.target, _freeze(node.args), _freeze(node.kwargs))
            hash(key)
        except TypeError:  # an argument that cannot be compared (a tensor constant, say)
            continue
        kept = seen.get(key)
        if kept is None:
            seen[key] = node
            continue
        node.replace_all_uses_with(kept)
        gm.graph.erase_node(node)
        replaced.append(Merge(node.name, kept.name))
    record_of(gm).cse = replaced
    gm.recompile()
    return gm


def _freeze(value):
    """Arguments as a hashable key: nodes by identity, lists as tuples, dicts as sorted items."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, float) and value != value:
        return ("nan",)  # NaN != NaN, but two NaN constants are the same argument
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("size", hashable(value))  # (hashing the SymFloat itself would pin its value)
    return value


def _identity_of(node: fx.Node) -> fx.Node | None:
    """x when `node` is `x + 0`, `x - 0`, `x * 1` or `x / 1` and hands x's values back unchanged,
    with x's dtype and shape, in a tensor the program does not return; else None."""
    unit = IDENTITIES.get(node.target)
    if unit is None or len(node.args) != 2 or node.kwargs:
        return None
    x, number = node.args
    if not (isinstance(x, fx.Node) and type(number) in (int, float) and number == unit
            and "fusec" in x.meta and "fusec" in node.meta):  # (not a bool: x + False)
        return None
    a, out = meta(x), meta(node)
    if a.dtype != out.dtype or tuple(map(str, a.shape)) != tuple(map(str, out.shape)):
        return None  # (the op promotes or broadcasts: it makes a different tensor)
    if node.target is aten.add.Tensor and out.dtype.is_floating_point:
        return None  # (-0.0 + 0 is +0.0)
    return None if _returned(node) else x


def _returned(node: fx.Node) -> bool:
    """Whether the program returns `node` or a view of it."""
    seen = [(user, node) for user in node.users]
    while seen:
        user, source = seen.pop()
        if user.op == "output":
            return True
        if user.op == "call_function" and is_view(user.target) and user.args[:1] == (source,):
            seen += [(u, user) for u in user.users]  # (a view's users see node's memory too)
    return False

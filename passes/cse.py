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
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fusec.record import Merge, record_of
from fusec.symbolic import hashable

from .grouping import impure


def cse(gm: fx.GraphModule) -> fx.GraphModule:
    seen: dict[tuple, fx.Node] = {}
    replaced: list[Merge] = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or impure(node):
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

"""Dead-code elimination: drop nodes whose results nobody uses.

Tracing records everything the program computed, including values it then threw away:

    before                           after
    a = sin(x)                       a = sin(x)
    unused = cos(x)    # no users    return (a,)
    return (a,)

A node may go only if nothing reads it *and* running it has no effect besides its result. torch.fx
already knows which nodes are impure (placeholders, outputs, in-place and `copy_` updates of an
input, random-number ops), so this pass reuses `Graph.eliminate_dead_code` and records what it
removed in the graph's record, `record_of(gm).dce` (fusec/record.py), for `explain`.
"""
from __future__ import annotations

import torch.fx as fx

from fusec.record import record_of


def dce(gm: fx.GraphModule) -> fx.GraphModule:
    before = {n.name: n for n in gm.graph.nodes}
    try:  # random ops count as impure whatever torch's tracing context says (torch >= 2.6)
        gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure(impure_random=True))
    except TypeError:
        gm.graph.eliminate_dead_code()
    after = {n.name for n in gm.graph.nodes}
    record_of(gm).dce = [name for name in before if name not in after]
    gm.recompile()
    return gm

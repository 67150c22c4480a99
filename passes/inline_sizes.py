"""Inline sizes: a size computed in the graph becomes the size itself, as a literal would be.

A program traced for one signature never computes a size: `x.var(0)` divides by the number of
rows, and tracing writes that number into the graph as a literal (`div(sum, 4)`). A program for a
shape family (fusec/dynamic.py) has its sizes as symbols, and tracing records how it got each
one as nodes of the graph:

    before                                         after
    sym_size_int = aten.sym_size.int(x, 0)         (gone)
    sub_1 = sym_size_int - 1                       (gone)
    div_1 = aten.div.Tensor(sum_2, sub_1)          div_1 = aten.div.Tensor(sum_2, s26 - 1)

Each such node's value is known while compiling, as an expression of the symbols (its fake
value, a torch.SymInt), so every use of it can read that expression instead, exactly where a
literal stood in a static program. Kernels then compute `s26 - 1` from their size arguments
(fusec/symbolic.py, Note: sizes as symbols in kernels), and no scalar has to travel from one
step of the program to another. A static graph has no such node: the pass has nothing to do.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fusec.graphmodule import looks_for

aten = torch.ops.aten
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


@looks_for(aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default,
           aten.sym_storage_offset.default)
def inline_sizes(gm: fx.GraphModule) -> fx.GraphModule:
    changed = False
    for node in list(gm.graph.nodes):
        value = node.meta.get("val")
        if node.op != "call_function" or not isinstance(value, (*_SYMBOLIC, int)) \
                or isinstance(value, bool):
            continue
        for user in list(node.users):
            user.args = fx.node.map_arg(user.args, lambda n: value if n is node else n)
            user.kwargs = fx.node.map_arg(user.kwargs, lambda n: value if n is node else n)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.recompile()
    return gm

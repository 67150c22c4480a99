"""The values of a reduction kernel (lower_reduction.py builds the kernel from them): its loads,
the group's ops as statements and reductions, and its stores, with what the loop plan needs of
each value: whether it varies along k, and its level (the phases that must end before it can be
computed). lower_reduction.py decides the space and each tensor's index first; this walks the
group in graph order.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fusec import ops
from fusec.ir import Const, Index, Layout, Load, Param, Reduce, Stmt, Store, TensorMeta, Var

from .lower import Piece, ident, is_cat, needs_rounding, origin_of, param_list


def space_of(node: fx.Node) -> str:
    """Where a node is computed: "elem" (per element) or "rows" (once per row)."""
    return node.meta.get("fusec_space", "elem")


@dataclass
class ReductionValues:
    """What lowering a reduction builds as it walks the group: the kernel's params, loads and
    body, the Var of each (node, space), the values that vary along k, and each value's level
    (the phases that must end before it can be computed: lower_reduction.py, `plan_loops`)."""

    placeholders: list[fx.Node]
    in_layouts: list[Layout]
    root_dtypes: dict[str, torch.dtype]
    index_of: dict[tuple, Index]
    n_rows: int  # merged row dims: an index's strides after them are along k
    params: list[Param] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    body: list = field(default_factory=list)
    load_of: dict[tuple, Var] = field(default_factory=dict)  # (root, index) -> its load's Var
    env: dict[tuple, Var] = field(default_factory=dict)  # (node, space) -> Var
    varying: set[str] = field(default_factory=set)
    level: dict[str, int] = field(default_factory=dict)
    counter: int = 0

    def __post_init__(self):
        self.param = param_list(self.params, self.root_dtypes)

    def fresh(self, node_name: str, dtype: torch.dtype) -> Var:
        """A new Var, numbered in the order values are made."""
        var = Var(f"v{self.counter}_{ident(node_name)}", dtype)
        self.counter += 1
        return var

    def load(self, var: Var, root: str, index: Index, valid=None, other=None, gather=None) -> None:
        """Read `var` from buffer `root`: a level-0 value, varying when its address (or the
        position a gathered read takes its row from) moves along k."""
        self.loads.append(Load(var, self.param(root, False), self.root_dtypes[root], index,
                               valid, other, gather=gather))
        if any(index.strides[self.n_rows:]) or (gather and gather[0] in self.varying):
            self.varying.add(var.name)
        self.level[var.name] = 0

    def value(self, node: fx.Node, where: str) -> Var:
        """`node`'s Var read in space `where`; a placeholder is loaded the first time it is
        read at an address (the same buffer at the same index: one load)."""
        if (node, where) in self.env:
            return self.env[(node, where)]
        if node.op != "placeholder":
            return self.env[(node, space_of(node))]
        i = self.placeholders.index(node)
        layout = self.in_layouts[i]
        index = self.index_of[("in", i, where)]
        key = (layout.root, index)
        if key not in self.load_of:
            var = self.fresh(node.name, ops.register_dtype(self.root_dtypes[layout.root]))
            self.load(var, layout.root, index)
            self.load_of[key] = var
        self.env[(node, where)] = self.load_of[key]
        return self.load_of[key]


def load_pieces(values: ReductionValues, pieces: list[Piece], spaces: list[str]) -> None:
    """Each cat's pieces, each read where it lies (its loop dim within the piece's bounds), the
    loads chained from the last piece to the first so one Var holds the whole cat."""
    for cat in dict.fromkeys(p.cat for p in pieces):
        other = None
        for n in reversed([n for n, p in enumerate(pieces) if p.cat is cat]):
            piece = pieces[n]
            layout = values.in_layouts[piece.index]
            var = values.fresh(f"{cat.name}_{piece.position}",
                           ops.register_dtype(values.root_dtypes[layout.root]))
            sentinel = values.index_of[("sentinel", n, spaces[n])].strides
            dim = next((d for d, s in enumerate(sentinel[:values.n_rows]) if s), 0)
            values.load(var, layout.root, values.index_of[("piece", n, spaces[n])],
                    (dim, piece.lo, piece.hi), other)
            other = var
        values.env[(cat, space_of(cat))] = other


def load_gathers(values: ReductionValues, gathers: list[tuple]) -> None:
    """Each gathered read: its index (once per address), then its source at the row the index
    names."""
    for k, (node, gather, src, idx, row_stride) in enumerate(gathers):
        where = space_of(node)
        index = values.index_of[("gidx", k, where)]
        key = (idx.root, index)
        if key not in values.load_of:
            values.load_of[key] = values.fresh(gather.index.name,
                                               ops.register_dtype(values.root_dtypes[idx.root]))
            values.load(values.load_of[key], idx.root, index)
        var = values.fresh(node.name, ops.register_dtype(values.root_dtypes[src.root]))
        values.env[(node, where)] = var
        values.load(var, src.root, values.index_of[("gsrc", k, where)],
                    gather=(values.load_of[key].name, row_stride, gather.size))


def lower_ops(values: ReductionValues, sub: fx.GraphModule) -> list[str]:
    """The group's ops in graph order, each a Reduce or a Stmt in `values.body`; returns the names
    of the ATen ops the kernel fuses (cats and gathered reads included: their loads)."""
    fused_ops: list[str] = []
    for node in sub.graph.nodes:
        if node.op != "call_function":
            continue
        if ops.gathered_read(node) is not None:  # its load, above
            fused_ops.append(str(node.target))
            continue
        if (node, space_of(node)) in values.env and is_cat(node):  # a cat: its pieces' loads
            fused_ops.append(str(node.target))
            continue
        red = ops.reduction(node)
        var = _lower_reduce(values, node, red) if red is not None else _lower_stmt(values, node)
        values.env[(node, space_of(node))] = var
        fused_ops.append(str(node.target))
    return fused_ops


def _lower_reduce(values: ReductionValues, node: fx.Node, red) -> Var:
    """A reduction: its accumulator's dtype, and its phase (its operand's level): a reduction
    of phase p runs in the p-th pass over k, and its result has level p + 1."""
    out_meta: TensorMeta = node.meta["fusec"]
    operand = values.value(red.operand, "elem")
    if red.op.returns_index:
        acc = operand.dtype
    elif red.op.name in ("any", "all"):
        acc = torch.bool
    else:
        acc = ops.register_dtype(out_meta.dtype)
    var = values.fresh(node.name, ops.register_dtype(out_meta.dtype))
    phase = values.level[operand.name]
    values.body.append(Reduce(var, red.op.name, operand, acc, phase, origin=origin_of(node),
                          round_to=out_meta.dtype if out_meta.dtype in ops.FLOAT16_LIKE else None))
    values.level[var.name] = phase + 1
    return var


def _lower_stmt(values: ReductionValues, node: fx.Node) -> Var:
    """A pointwise op, in its node's space: dtypes as in lower.py; it varies along k when an
    operand does, and its level is its operands' highest."""
    out_meta: TensorMeta = node.meta["fusec"]
    row, operands = ops.normalize(node)
    vals = [o.meta["val"] if isinstance(o, fx.Node) else o for o in operands]
    compute = ops.compute_dtype(row, vals, out_meta.dtype)
    operand_dtypes = tuple(torch.bool if row.name == "where" and k == 0 else compute
                           for k in range(len(operands)))
    args = tuple(values.value(o, space_of(node)) if isinstance(o, fx.Node) else Const(o, dt)
                 for o, dt in zip(operands, operand_dtypes))
    var = values.fresh(node.name, ops.register_dtype(out_meta.dtype))
    rounds = needs_rounding(row, vals, out_meta.dtype)
    values.body.append(Stmt(var, row.name, args, operand_dtypes,
                        torch.bool if row.returns_bool else compute,
                        out_meta.dtype if rounds else None, origin=origin_of(node)))
    vars_in = [a for a in args if isinstance(a, Var)]
    if any(a.name in values.varying for a in vars_in):
        values.varying.add(var.name)
    values.level[var.name] = max((values.level[a.name] for a in vars_in), default=0)
    return var


def store_outputs(values: ReductionValues, outputs: list[fx.Node],
                  out_layouts: list[Layout]) -> list[Store]:
    """One store per output, per element or per row as its index says."""
    stores = []
    for k, (out, layout) in enumerate(zip(outputs, out_layouts)):
        var = values.env[(out, space_of(out))]
        index = values.index_of[("out", k, space_of(out))]
        if any(index.strides[values.n_rows:]) and var.name not in values.varying:
            # stored at every k: computed inside the loop over k, even when nothing it reads
            # varies along k (`zeros_like(x)` next to `x.sum()`: a constant, stored everywhere).
            # If row values are computed from it too, they keep it: the loop takes a copy.
            if any(var in getattr(item, "operands", (getattr(item, "operand", None),))
                   for item in values.body):
                copy = values.fresh(f"{out.name}_at_k", var.dtype)
                values.body.append(Stmt(copy, "copy", (var,), (var.dtype,), var.dtype,
                                    origin=f"{out.name}, stored at every k"))
                values.level[copy.name], var = values.level[var.name], copy
            values.varying.add(var.name)
        stores.append(Store(values.param(layout.root, True), var, values.root_dtypes[layout.root],
                            index))
    return stores

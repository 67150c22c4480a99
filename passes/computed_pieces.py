"""Computed pieces of a cat: concatenate the inputs, then compute, so that one kernel does it all.

A pointwise kernel reads a concatenation piece by piece, each piece where it lies in memory
(codegen/lower.py, `cat_pieces`): output position i along the cat's dim comes from the piece that
covers i, at i minus where that piece starts. A piece *computed* in the same kernel would have
to be computed at those shifted positions, so fuse_pointwise keeps it out: it gets a kernel of
its own, which stores it so that the cat can load it. Rotary position embeddings, in every
Llama-style model, concatenate exactly such a piece:

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)       # -x2: computed

which costs a `fused_neg` kernel per query and key per layer (8 launches per decode step of a
4-layer model). When every computed piece is a chain of float pointwise ops on one input of the
piece's own shape, the ops can run on the whole concatenation of those inputs instead, and a
constant mask picks, at each position, the result of the piece that covers it:

    before                                    after
    neg = neg(x2)                             c   = cat([x2, x1], -1)          # pieces in memory
    cat = cat([neg, x1], -1)                  neg = neg(c)                     # on all of c
                                              cat = where(_piece_mask, neg, c) # [True] * 64 + [False] * 64

Everything after `c` is pointwise, so the cat, the negation, the pick and what follows (the
rotary's multiplies and add) become one kernel. The ops compute on positions whose results are
then dropped; float pointwise ops cannot fault, and neither can integer bitwise ops, shifts,
additions and the like (`SAFE_INTEGER_OPS`), so only chains of those are rewritten (an integer
division by zero would fault). Each value is the same op on the same input as in eager, so
the results are bit for bit eager's. Each cat considered is a `Decision` in
`record_of(gm).computed_pieces`.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fusec import ops
from fusec.graphmodule import looks_for
from fusec.ir import TensorMeta
from fusec.record import Decision
from fusec.symbolic import is_symbolic

from .grouping import constant_node, is_cat, new_node, record_decisions, val

aten = torch.ops.aten


@looks_for(aten.cat.default)
def computed_pieces(gm: fx.GraphModule) -> fx.GraphModule:
    decisions: list[Decision] = []
    for cat in list(gm.graph.nodes):
        if not is_cat(cat):
            continue
        chains = [_chain(p) for p in cat.args[0]]
        if all(not ops_ for _, ops_ in chains):
            continue  # every piece is in memory already
        why = _why_not(cat, chains)
        if why:
            decisions.append(Decision(cat.name, False, why))
            continue
        _rewrite(gm, cat, chains)
        names = ", ".join(str(n.target).split(".")[-2] for _, chain in chains for n in chain)
        decisions.append(Decision(cat.name, True, f"computed piece(s) ({names}) computed on the "
                                  "whole concatenation of their inputs, a constant mask picking "
                                  "each position's piece: one kernel instead of one more per piece"))
    return record_decisions(gm, "computed_pieces", decisions)


def _chain(piece: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """(input, ops): the piece as unary pointwise ops applied in order to one input, each op
    used only by the next one (or by the cat). ops is empty for a piece in memory."""
    chain = []
    node = piece
    while (node.op == "call_function" and ops.normalize(node) is not None and len(node.users) == 1
           and len(node.all_input_nodes) == 1):
        chain.append(node)
        node = node.all_input_nodes[0]
    return node, chain[::-1]


# Integer ops that cannot fault on any value (no division, remainder or power): a chain of these
# may run on positions whose results are dropped. Unpacking two 4-bit values a byte, `(w & 0xF0)
# >> 4` and `w & 0x0F` written into the two halves of one tensor (passes/filled_slices.py), is
# such a cat.
SAFE_INTEGER_OPS = {"bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "rshift", "lshift",
                    "neg", "abs", "add", "sub", "mul", "to", "copy", "maximum", "minimum"}


def _why_not(cat: fx.Node, chains) -> str | None:
    out = val(cat)
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if is_symbolic(out.shape[dim % out.dim()]):
        return "the cat's dim has a symbolic size (a shape family): no constant mask can pick"
    for (_, chain), piece in zip(chains, cat.args[0]):
        unsafe = [n for n in chain if not val(n).dtype.is_floating_point
                  and ops.normalize(n)[0].name not in SAFE_INTEGER_OPS]
        if unsafe:
            return (f"{piece.name} computes {ops.normalize(unsafe[0])[0].name} in "
                    f"{val(unsafe[0]).dtype}: on positions it does not cover it could fault")
    sources = [val(src) for src, _ in chains]
    if len({v.dtype for v in sources}) != 1:
        return "the pieces' inputs have different dtypes: their concatenation would promote"
    for (src, chain), piece in zip(chains, cat.args[0]):
        if tuple(val(src).shape) != tuple(val(piece).shape):
            return f"{piece.name}'s input {src.name} is broadcast: its concatenation is not the cat's shape"
        if any(ops.classify(n.target) != ops.POINTWISE for n in chain):
            return f"{piece.name} is not made of pointwise ops"
    return None


def _rewrite(gm: fx.GraphModule, cat: fx.Node, chains) -> None:
    graph = gm.graph
    out = val(cat)
    rank = out.dim()
    dim = (cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)) % rank

    def add(target, args, value, name):
        return new_node(graph, target, args, value, cat, name)

    with graph.inserting_before(cat):
        sources = [src for src, _ in chains]
        c_val = torch.cat([val(s) for s in sources], dim)
        c = add(aten.cat.default, (sources, dim), c_val, f"{cat.name}_inputs")
        computed: dict[tuple, fx.Node] = {}  # one node per distinct chain of ops

        def apply(chain) -> fx.Node:
            key = tuple((n.target, tuple(a for a in n.args if not isinstance(a, fx.Node)))
                        for n in chain)
            if key not in computed:
                value = c
                for n in chain:
                    args = [value if a is n.all_input_nodes[0] else a for a in n.args]
                    out = n.target(*[val(a) if isinstance(a, fx.Node) else a for a in args],
                                   **n.kwargs)
                    value = new_node(graph, n.target, args, out, n, f"{n.name}_all", dict(n.kwargs))
                computed[key] = value
            return computed[key]

        bounds, lo = [], 0
        for piece in cat.args[0]:
            size = val(piece).shape[dim]
            bounds.append((lo, lo + size))
            lo += size
        plain = [b for b, (_, chain) in zip(bounds, chains) if not chain]
        others = [(b, chain) for b, (_, chain) in zip(bounds, chains) if chain]
        result = c if plain else apply(others.pop()[1])
        for (lo, hi), chain in others:
            mask = torch.zeros(out.shape[dim], dtype=torch.bool)
            mask[lo:hi] = True
            mask = mask.view(-1, *([1] * (rank - 1 - dim))).to(out.device)
            attr = constant_node(gm, f"_piece_mask_{cat.name}", mask)
            attr.meta["val"] = c_val.new_empty(mask.shape, dtype=torch.bool)
            attr.meta["fusec"] = TensorMeta.of(mask)
            branch = apply(chain)
            result = add(aten.where.self, (attr, branch, result),
                         aten.where.self(attr.meta["val"], val(branch), val(result)), f"{cat.name}_pick")
    cat.replace_all_uses_with(result)
    graph.erase_node(cat)

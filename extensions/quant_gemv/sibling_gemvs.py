"""Sibling GEMVs: matmuls that read the same activation row become one GEMV over their weights.

In a transformer layer several linears read the same input: the query, key and value projections
all read the normed hidden state, and so do an MLP's gate and up projections. At M = 1 (decoding
one token) each is a GEMV whose time is its weight's bytes over the memory bandwidth, but a
narrow one cannot reach that speed on its own: Llama's key and value projections (1024 x 4096)
are 8 MB each, too few programs to keep the GPU's memory busy for long, and every launch ends in
a tail where most of the GPU is idle. Measured on an H100 (diagnostics/sibling_gemvs.py):
q, k and v as three GEMVs take 30.9 us, one GEMV over the three weights 24.4 us.

gpt-fast concatenates the weights by hand once (`wqkv`). A compiler cannot: the weights are the
user's parameters, and a concatenated copy would double their memory and go stale when they are
updated. So the GEMV reads each weight *where it lies*, as pieces of a concatenation along N:

    before                                    after
    mm   = mm(x, permute(wq, [1, 0]))         wqkv  = cat([wq, wk, wv])        # never stored
    mm_1 = mm(x, permute(wk, [1, 0]))         mm    = mm(x, permute(wqkv, [1, 0]))
    mm_2 = mm(x, permute(wv, [1, 0]))         q     = slice(mm, 1, 0, 4096)
                                              k     = slice(mm, 1, 4096, 5120)
                                              v     = slice(mm, 1, 5120, 6144)

small_matmul then writes the one mm as a GEMV reduction whose prologue reads the cat (each output
column n loads its row from the weight that holds it, codegen/lower_reduction.py), and
fuse_reductions lets that cat into the GEMV's kernel (the node is marked `fusec_pieces`); the
slices are views of the one output.

The pass groups `mm(x, W.t())` nodes when they share the same `x` (the same graph node) with one
row (M = 1), and each weight is a stored (N_i, K) bf16/fp16 matrix on a device where the stored
GEMV is used (small_matmul.STORED_GEMV_DEVICES). `addmm(b, x, W.t())` nodes with stored bias
vectors (Qwen2's projections) are grouped among themselves, and their biases joined the same way
(a cat the GEMV's epilogue reads per output column). Each decision is recorded with its reason in
`record_of(gm).extensions["sibling_gemvs"]`. A single matmul, or a set of different dtypes or K,
is left alone.
"""
from __future__ import annotations

import sys

import torch
import torch.fx as fx

from fusec.record import Decision

from fusec.passes.grouping import new_node, record_decisions, val
from .small_matmul import STORED_GEMV_DEVICES  # noqa: F401 (read from the module at run time)
from fusec.sizes import is_one

aten = torch.ops.aten

# explain's words for the decisions (fusec/inspect/changes.py): the summary, a joined one, one alone
DECISION_WORDS = ("{n} matmul(s) joined with siblings into one GEMV", "joined", "alone")


def sibling_gemvs(gm: fx.GraphModule) -> fx.GraphModule:
    decisions: list[Decision] = []
    sets: dict[tuple, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        weight, why = _stored_weight(node)
        if weight is None:
            if why:
                decisions.append(Decision(node.name, False, why))
            continue
        w = val(weight)
        x = node.args[1] if node.target is aten.addmm.default else node.args[0]
        sets.setdefault((x, w.dtype, w.shape[1], w.device, node.target), []).append(node)
    for (x, dtype, k, _, _), mms in sets.items():
        if len(mms) < 2:
            decisions.append(Decision(mms[0].name, False,
                                      f"the only M = 1 matmul reading {x.name}: nothing to join"))
            continue
        widths = [val(n).shape[1] for n in mms]
        _join(gm.graph, x, mms)
        why = (f"{len(mms)} GEMVs read {x.name} ({' + '.join(map(str, widths))} columns, K = {k}, "
               f"{dtype}): one GEMV over their weights, each read where it lies (one launch, "
               "enough programs to keep the memory busy)")
        decisions += [Decision(n.name, True, why) for n in mms]
    return record_decisions(gm, "sibling_gemvs", decisions)


def _stored_weight(node: fx.Node):
    """(weight, None) for `mm(x, W.t())` or `addmm(bias, x, W.t())` (a stored bias vector) with
    one row of x and a stored 16-bit W on a GEMV device; (None, reason) for another M = 1
    matmul; (None, None) for anything else."""
    if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default):
        return None, None
    if node.target is aten.addmm.default:
        bias, x, b = node.args[:3]
        if len(node.args) > 3 or node.kwargs or not isinstance(bias, fx.Node):
            return None, None
        bias_v = val(bias)
        if bias.op not in ("placeholder", "get_attr") or not isinstance(bias_v, torch.Tensor) \
                or bias_v.dim() != 1 or bias_v.dtype != val(node).dtype:
            return None, "M = 1, but the bias is not a stored vector of the output's dtype: alone"
    else:
        x, b = node.args
    xv, bv = val(x), val(b)
    if not (isinstance(xv, torch.Tensor) and isinstance(bv, torch.Tensor)) or not is_one(xv.shape[0]):
        return None, None
    is_t = b.op == "call_function" and (b.target is aten.t.default or (
        b.target is aten.permute.default and list(b.args[1]) == [1, 0]))
    weight = b.args[0] if is_t else None
    if weight is None or weight.op not in ("placeholder", "get_attr"):
        return None, "M = 1, but the weight is not a stored matrix read transposed: alone"
    # (the package's `small_matmul` is the pass function; its settings live in the module)
    if bv.device.type not in sys.modules[f"{__package__}.small_matmul"].STORED_GEMV_DEVICES:
        return None, (f"M = 1 on {bv.device.type}: the library matmul runs it, and a launch "
                      "costs little there: alone")
    if bv.dtype not in (torch.bfloat16, torch.float16) or 0 in bv.shape:
        return None, f"M = 1, but a {bv.dtype} weight of shape {tuple(bv.shape)}: alone"
    return weight, None


def _join(graph: fx.Graph, x: fx.Node, mms: list[fx.Node]) -> None:
    def add(target, args, value: torch.Tensor, name: str) -> fx.Node:
        return new_node(graph, target, args, value, mms[0], name)

    with_bias = mms[0].target is aten.addmm.default
    weights = [n.args[-1].args[0] for n in mms]
    first = mms[0]  # (in graph order)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for w in weights + ([n.args[0] for n in mms] if with_bias else []):
        if order[w] > order[first]:  # a constant's get_attr made just before its own use
            first.prepend(w)  # (it reads nothing: moving it earlier is safe)
    with graph.inserting_before(first):
        cat_val = torch.cat([val(w) for w in weights])
        cat = add(aten.cat.default, (weights,), cat_val, f"{first.name}_weights")
        cat.meta["fusec_pieces"] = True  # read by a GEMV's prologue, never stored
        t = add(aten.permute.default, (cat, [1, 0]), cat_val.t(), f"{first.name}_weights_t")
        if with_bias:  # the biases are read where they lie too, in the GEMV's epilogue
            biases = [n.args[0] for n in mms]
            bias_val = torch.cat([val(b) for b in biases])
            bias = add(aten.cat.default, (biases,), bias_val, f"{first.name}_biases")
            bias.meta["fusec_pieces"] = True
            joined = add(aten.addmm.default, (bias, x, t), bias_val + val(x) @ cat_val.t(),
                         f"{first.name}_joined")
        else:
            joined = add(aten.mm.default, (x, t), val(x) @ cat_val.t(), f"{first.name}_joined")
        lo = 0
        for n in mms:
            width = val(n).shape[1]
            part = add(aten.slice.Tensor, (joined, 1, lo, lo + width), joined.meta["val"][:, lo:lo + width],
                       f"{n.name}_part")
            lo += width
            n.replace_all_uses_with(part)
    for n in mms:
        graph.erase_node(n)

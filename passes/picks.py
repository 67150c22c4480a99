"""picks: a gather or scatter of one position per row, written as a comparison with the position.

Cross-entropy picks one value out of each row of the log-probabilities, the target class's:

    loss = -log_softmax(logits, 1).gather(1, target[:, None])

and its backward puts the gradient back at that one position of a row of zeros:

    grad = zeros_like(logits).scatter(1, target[:, None], -1.0)

Eager runs both as library calls (aten.gather, aten.scatter) that read or write whole
tensors: the gather needs the log-probabilities stored first, one (rows x classes) tensor, and
the scatter writes a second one. For a language model those are the largest tensors of the
step (8 x 512 tokens of GPT-2's 50257 classes: 823 MB each in float32). Yet each row picks just
one position, so both are pointwise work on a row that a kernel walks anyway:

    before                                   after
    g = gather(x, 1, t)        t: (N, 1)     p = arange(C).view(1, C)              (a constant)
                                             g = amax(where(eq(p, t), x, -inf), [1], True)
    s = scatter(y, 1, t, -1.0)               s = where(eq(p, t), -1.0, y)

The gather becomes a reduction over the row (the largest of -inf everywhere but at the picked
position is that position's value, exactly: NaN, infinities and -0.0 included), which joins the
kernel that computes the row (log-softmax's amax and sum); the scatter becomes a select, which
joins the pointwise kernel around it. Neither tensor is stored.

When it applies: the index has the shape of the result with size 1 along the picked dim (one
position per row; every row gets one), int64. A gather whose source is read from memory (a
program input, a library call's result) keeps the library call: reading one value per row
beats reading the whole row. Eager refuses a position outside [0, C) with an error; the kernel
cannot, so the pass adds the check as ordinary graph ops, as passes/check_gathers.py does for
gathered reads (one `_assert_async` of them all).

One more gather is a read the kernels already know: a gather from a tensor with one row, where
the source and the index have size 1 along every dim but the picked one. Then the index is a
list of positions in that row, and the gather is `index_select` with the index as a vector,
which a kernel reads in place as a gathered read (fusec.ops.gathered_read; passes/
check_gathers.py adds its range check, [0, size) as gather's):

    before                                   after
    g = gather(x, 1, t)    x: (1, C), t: (1, n)     g = index_select(x, 1, view(t, [n]))

BERT's token types are read so (`token_type_ids.expand(1, -1).gather(1, position_ids)`): the
library call becomes a read inside the embeddings' kernel.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fusec.graphmodule import looks_for
from fusec.ir import TensorMeta
from fusec.record import Decision, record_of

from .check_gathers import POSITION_CHECK, add_call, assert_all, range_check
from .grouping import is_pointwise, view_root
from .schedule import fake_mode_of

aten = torch.ops.aten


@looks_for(aten.gather.default, aten.scatter.value)
def picks(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite one-position-per-row gathers and scatters as comparisons with the position."""
    graph, decisions, checks, checked = gm.graph, [], [], set()
    mode = None
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (aten.gather.default,
                                                             aten.scatter.value):
            continue
        mode = mode or fake_mode_of(gm)
        row = _one_row(graph, mode, node)
        if row is not None:
            node.replace_all_uses_with(row)
            graph.erase_node(node)
            decisions.append(Decision(row.name, True, "a gather from one row: index_select"))
            continue
        why = _declined(node)
        if why:
            decisions.append(Decision(node.name, False, why))
            continue
        source, dim, index = node.args[:3]
        dim %= len(_meta(source).shape)
        size = _meta(source).shape[dim]
        hit = _hit(graph, mode, source, dim, index, node)
        with graph.inserting_after(hit):
            if node.target is aten.gather.default:
                fill = _lowest(_meta(source).dtype)
                masked = add_call(graph, mode, aten.where.ScalarOther, (hit, source, fill), node)
                with graph.inserting_after(masked):
                    new = add_call(graph, mode, aten.amax.default, (masked, [dim], True), node)
                what = f"amax(where(position == {index.name}, {source.name}, {fill}), {dim})"
            else:
                new = add_call(graph, mode, aten.where.ScalarSelf, (hit, node.args[3], source), node)
                what = f"where(position == {index.name}, {node.args[3]}, {source.name})"
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        decisions.append(Decision(new.name, True, f"one position per row: {what}"))
        if (index, size) not in checked:
            checked.add((index, size))
            ok = range_check(graph, mode, index, 0, size, new)
            checks.append((ok, f"every value of {index.name} must be in [0, {size}) "
                               f"({new.name} picks one position of each row of {source.name})"))
    if checks:
        assert_all(graph, mode, checks, POSITION_CHECK)  # (a RuntimeError, as eager's gather)
    record_of(gm).picks = decisions
    if any(d.taken for d in decisions):
        graph.lint()
        gm.recompile()
    return gm


def _meta(node) -> TensorMeta | None:
    m = getattr(node, "meta", {}).get("fusec")
    return m if isinstance(m, TensorMeta) else None


def _declined(node: fx.Node) -> str | None:
    """Why this gather or scatter keeps its library call, or None when it is a pick."""
    source, dim, index = node.args[:3]
    src, idx, out = _meta(source), _meta(index), _meta(node)
    if src is None or idx is None or out is None or not isinstance(dim, int):
        return "not tensors of known shape"
    if node.target is aten.gather.default and node.kwargs.get("sparse_grad", False):
        return "a sparse gradient"
    if src.dtype in (torch.bool, torch.complex64, torch.complex128) or src.dtype.is_complex:
        return f"{src.dtype} values"
    rank = len(src.shape)
    if rank == 0 or len(idx.shape) != rank or idx.dtype != torch.int64:
        return "the index is not an int64 tensor of the source's rank"
    dim %= rank
    if idx.shape[dim] != 1 or any(idx.shape[d] != src.shape[d] for d in range(rank) if d != dim):
        return (f"the index {tuple(idx.shape)} does not pick one position of every row of "
                f"{tuple(src.shape)} along dim {dim}")
    if 0 in src.shape:
        return "an empty tensor"
    if node.target is aten.scatter.value:
        value = node.args[3]
        if not isinstance(value, (int, float)) or isinstance(value, bool) \
                or (isinstance(value, float) and not src.dtype.is_floating_point):
            return f"the value {value!r} is not a number of {src.dtype}"
    elif not is_pointwise(view_root(source)):  # (a view of a computed value is computed)
        return (f"{source.name} is read from memory (an input or a library call's result): "
                "one value per row beats reading every row")
    return None


def _one_row(graph: fx.Graph, mode, node: fx.Node) -> fx.Node | None:
    """`index_select(x, dim, view(t, [n]))` for a gather whose source and index have size 1
    along every dim but `dim` (inserted before `node`); None for any other gather."""
    if node.target is not aten.gather.default or node.kwargs.get("sparse_grad", False):
        return None
    source, dim, index = node.args[:3]
    src, idx, out = _meta(source), _meta(index), _meta(node)
    if src is None or idx is None or out is None or not isinstance(dim, int) \
            or len(src.shape) == 0 or len(idx.shape) != len(src.shape) \
            or idx.dtype not in (torch.int64, torch.int32) or 0 in src.shape:
        return None
    dim %= len(src.shape)
    if any(not (isinstance(a, int) and isinstance(b, int) and a == 1 == b)
           for d, (a, b) in enumerate(zip(src.shape, idx.shape)) if d != dim) \
            or not isinstance(idx.shape[dim], int):
        return None
    with graph.inserting_before(node):
        flat = add_call(graph, mode, aten.view.default, (index, [idx.shape[dim]]), node)
    with graph.inserting_after(flat):
        picked = add_call(graph, mode, aten.index_select.default, (source, dim, flat), node)
    picked.meta["fusec_gather"] = True  # (its range check raises gather's RuntimeError)
    return picked


def _hit(graph: fx.Graph, mode, source: fx.Node, dim: int, index: fx.Node, like: fx.Node):
    """eq(positions, index): True at the one position of each row the index names."""
    src = _meta(source)
    shape = [src.shape[dim] if d == dim else 1 for d in range(len(src.shape))]
    with graph.inserting_before(like):
        positions = add_call(graph, mode, aten.arange.default, (src.shape[dim],), like,
                         dict(dtype=torch.int64, device=torch.device(src.device)))
    with graph.inserting_after(positions):
        along = add_call(graph, mode, aten.view.default, (positions, shape), like)
    with graph.inserting_after(along):
        return add_call(graph, mode, aten.eq.Tensor, (along, index), like)


def _lowest(dtype: torch.dtype):
    return float("-inf") if dtype.is_floating_point else torch.iinfo(dtype).min


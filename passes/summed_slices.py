"""summed_slices: slices written into zeros and summed are a concatenation.

The backward of slicing a tensor is "put the gradient back where the slice was, zeros elsewhere":
`slice_scatter(zeros, grad, dim, start, end)`. When a tensor was cut in pieces that were all used,
its gradient is the sum of one such scatter per piece. Rotary position embeddings, in every
Llama-style model, cut each query and key in two halves (`rotate_half`), so their backward graph
has, per query and key:

    full = full([2, 4, 32, 16], 0)
    a    = slice_scatter(full, neg(g[..., :8]), 3, 8, 16)    # the second half's gradient
    b    = slice_scatter(full, g[..., 8:], 3, 0, 8)          # the first half's
    s    = add(a, b)

Each `slice_scatter` is an eager ATen call (copy the zeros, copy the piece in), then a kernel
adds two tensors that are zero where the other is not. But the two slices do not overlap: at
each position exactly one term is not zero, so the sum *is* the two pieces side by side:

    before                                          after
    a = slice_scatter(full, p, 3, 8, 16)
    b = slice_scatter(full, q, 3, 0, 8)
    s = add(a, b)                                   s = cat([q, p], 3)

and a `cat` is read by the kernel that uses it, piece by piece (codegen/lower.py, `cat_pieces`;
passes/computed_pieces.py moves `neg` after the cat), so the scatters, the zeros and the add
become part of one pointwise kernel. Where the slices leave a gap, a zero-filled piece (`full`)
covers it.

The pass rewrites an `add` (a tree of adds, each read only by the next) whose terms are
such scatters along one dim, with step 1, into fresh zero-filled tensors (`full(..., 0)`,
`zeros`, ...) of the sum's shape and dtype, when no two slices overlap, and at most one term
that is not such a scatter (the rotary's `g * cos`, which autograd adds first or last):
`(c + a) + b` and `(a + b) + c` both become `c + cat`. At each position at most one slice is
not zero, and adding a zero is exact in every dtype, so either way the position's value is
`c + v` (or `v`) for the one slice value `v` there: eager's value for value (one detail:
eager's `-0.0 + 0.0` is `+0.0`, the cat keeps `-0.0`; they compare equal). Two other terms are
left alone: `(c + a) + d` and `(c + d) + a` round differently.
The smallest such sum has one term that covers its whole dim: `slice_scatter(zeros, v, 1, 0,
2**63 - 1)` is `v`. Torch's own decomposition says so when the sizes are numbers; in a shape
family's backward (symbolic sizes) the "to the end" sentinel cannot be compared with the size,
so the scatter stayed an eager call; the pass takes it as the value.
Each sum considered is a `Decision` in `record_of(gm).extensions["summed_slices"]`.
"""
from __future__ import annotations

import contextlib
import sys

import torch
import torch.fx as fx

from fusec.graphmodule import looks_for
from fusec.record import Decision
from fusec.sizes import equal_if_so

from .grouping import new_node, record_decisions, val

aten = torch.ops.aten
ZERO_FILLS = (aten.full.default, aten.zeros.default, aten.new_zeros.default, aten.new_full.default,
              aten.zeros_like.default, aten.full_like.default)


@looks_for(aten.slice_scatter.default)
def summed_slices(gm: fx.GraphModule) -> fx.GraphModule:
    decisions: list[Decision] = []
    for node in list(gm.graph.nodes):
        whole = _whole_dim(node)
        if whole is not None:  # a sum of one slice that covers its dim: the value itself
            node.replace_all_uses_with(whole)
            decisions.append(Decision(whole.name, True, f"{node.name}: a slice of zeros that "
                                      f"covers its whole dim is its value"))
            continue
        terms = _sum_of_scatters(node)
        if terms is None or _sum_of_scatters(_reader(node)) is not None:
            continue  # (no sum of scatters, or a part of a larger one, taken whole)
        scatters, others = terms
        dims = {dim for dim, _, _ in scatters}
        why = ("slices along different dims" if len(dims) != 1 else
               f"{len(others)} terms that are not slices: the order of their additions matters"
               if len(others) > 1 else "")
        spans = sorted(((lo, hi, value) for _, (lo, hi), value in scatters), key=lambda s: s[:2])
        if not why and any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
            why = (f"the slices along dim {min(dims)} "
                   f"({', '.join(f'{lo}:{hi}' for lo, hi, _ in spans)}) overlap")
        if why:
            decisions.append(Decision(node.name, False, why + ": kept"))
            continue
        dim = dims.pop()
        with gm.graph.inserting_before(node):
            pieces = _pieces(gm.graph, spans, val(node).shape[dim], dim, node)
            cat = pieces[0] if len(pieces) == 1 else new_node(  # (the sum's value: the same)
                gm.graph, aten.cat.default, (pieces, dim), val(node), node, f"{node.name}_cat")
            if others:
                cat = new_node(gm.graph, aten.add.Tensor, (others[0], cat), val(node), node,
                               f"{node.name}_sum")
        node.replace_all_uses_with(cat)
        decisions.append(Decision(cat.name, True, f"a sum of {len(scatters)} slice(s) of zeros "
                                  f"along dim {dim} that do not overlap: the pieces side by side "
                                  f"({len(pieces) - len(scatters)} zero-filled gap(s)), a cat"
                                  + (", plus the one other term" if others else "")))
    return record_decisions(gm, "summed_slices", decisions)


def _is_add(node) -> bool:
    """`add(a, b)` of two tensors of the result's shape and dtype (no alpha, no broadcast)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"
            and node.target is aten.add.Tensor and len(node.args) == 2
            and node.kwargs.get("alpha", 1) == 1):
        return False
    out = val(node)
    return isinstance(out, torch.Tensor) and all(
        isinstance(v := val(a), torch.Tensor) and _alike(v.shape, out.shape) and v.dtype == out.dtype
        for a in node.args)


def _reader(node: fx.Node):
    """node's only reader, if it has one."""
    return next(iter(node.users)) if len(node.users) == 1 else None


def _sum_of_scatters(node) -> tuple[list, list] | None:
    """(scatters, others) when node is a tree of adds (each read only by the next) with a slice
    of zeros among its terms: (dim, (start, end), value) of each such term (`_scatter`), and
    the other terms. None when node is no such tree."""
    if not _is_add(node):
        return None
    terms = _terms(node)
    scatters = [s for t in terms if (s := _scatter(t, node)) is not None]
    others = [t for t in terms if _scatter(t, node) is None]
    return (scatters, others) if scatters else None


def _terms(node: fx.Node) -> list:
    """The terms of the tree of adds that ends at node: an add read only by the next one is
    opened when a slice of zeros is among its terms (an add of other values stays one term:
    its own additions keep their order)."""
    out = []
    for a in node.args:
        opened = _is_add(a) and len(a.users) == 1 and _sum_of_scatters(a) is not None
        out += _terms(a) if opened else [a]
    return out


def _scatter(term, total: fx.Node):
    """(dim, (start, end), value) when term is `slice_scatter(zeros, value, dim, start, end)`
    with step 1 into a fresh zero-filled tensor of total's shape and dtype; else None."""
    if not (isinstance(term, fx.Node) and term.op == "call_function"
            and term.target is aten.slice_scatter.default):
        return None
    base, value = term.args[:2]
    rest = dict(zip(("dim", "start", "end", "step"), term.args[2:]), **term.kwargs)
    out, v = val(total), val(value)
    if rest.get("step", 1) != 1 or not _zeros(base) or not isinstance(v, torch.Tensor) \
            or not _alike(val(term).shape, out.shape) or v.dtype != out.dtype or v.dim() != out.dim():
        return None
    dim = rest.get("dim", 0) % out.dim()
    size = out.shape[dim]
    start, end = rest.get("start"), rest.get("end")
    if not all(isinstance(x, int) for x in (size, start or 0, end or 0)):
        return None  # (symbolic sizes: left as they are)
    start, end = 0 if start is None else start, size if end is None else end
    start, end = (max(0, min(x + size if x < 0 else x, size)) for x in (start, end))
    if not _alike(v.shape, tuple(end - start if d == dim else n for d, n in enumerate(out.shape))):
        return None  # (a slice_scatter's value has the slice's shape)
    return dim, (start, end), value


def _whole_dim(node):
    """The value of `slice_scatter(zeros, value, dim, start, end)` (step 1) when the slice is the
    whole dim (start 0, end past the size: AOT Autograd writes torch's "to the end" sentinel,
    2**63 - 1, which a symbolic size cannot be compared with, so it is taken as such), into a
    fresh zero-filled tensor of the value's shape and dtype; else None. A graph input is left
    as it is (the result would be the input itself, not a new tensor)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"
            and node.target is aten.slice_scatter.default):
        return None
    base, value = node.args[:2]
    rest = dict(zip(("dim", "start", "end", "step"), node.args[2:]), **node.kwargs)
    out, v = val(node), val(value)
    if not isinstance(v, torch.Tensor) or not isinstance(out, torch.Tensor) \
            or value.op == "placeholder" or not _zeros(base) or rest.get("step", 1) != 1 \
            or v.dtype != out.dtype or not _alike(v.shape, out.shape):
        return None
    size = out.shape[rest.get("dim", 0) % out.dim()]
    start, end = rest.get("start"), rest.get("end")
    whole_end = end is None or (isinstance(end, int) and (
        end >= sys.maxsize or (isinstance(size, int) and end >= size)))
    return value if (start is None or (type(start) is int and start == 0)) and whole_end else None


def _alike(a, b) -> bool:
    """Two shapes equal, asked as a shortcut's question (declining the rewrite is right at every
    size): in a shape family, sizes that differ when traced answer "no" without a guard, so the
    family is not narrowed to the sizes that are not equal (fusec/sizes.py `equal_if_so`)."""
    return len(a) == len(b) and all(equal_if_so(x, y) for x, y in zip(a, b))


def _zeros(node) -> bool:
    """A fresh tensor filled with zeros: a factory call with no tensor inputs."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in ZERO_FILLS):
        return False
    if node.target in (aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default):
        return True  # (a tensor input only gives the dtype and device)
    at = 2 if node.target is aten.new_full.default else 1
    fill = node.args[at] if len(node.args) > at else node.kwargs.get("fill_value")
    return isinstance(fill, (int, float)) and not isinstance(fill, bool) and fill == 0


def _pieces(graph: fx.Graph, spans: list, size: int, dim: int, like: fx.Node) -> list:
    """The values in order along dim, with a zero-filled piece where no slice writes."""
    out, at = [], 0
    for lo, hi, value in [*spans, (size, size, None)]:
        if lo > at:
            shape = list(val(like).shape)
            shape[dim] = lo - at
            out.append(new_node(graph, aten.full.default, (shape, 0),
                                _zeros_value(val(like), shape), like, f"{like.name}_gap",
                                {"dtype": val(like).dtype, "device": val(like).device}))
        if value is not None:
            out.append(value)
        at = hi
    return out



def _zeros_value(like: torch.Tensor, shape: list) -> torch.Tensor:
    """A zero-filled example value of `shape`, fake in `like`'s fake mode when it is fake (so
    that it meets the graph's other example values)."""
    mode = getattr(like, "fake_mode", None)
    with mode if mode is not None else contextlib.nullcontext():
        return torch.zeros(shape, dtype=like.dtype, device=like.device)

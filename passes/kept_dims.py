"""A reduction that keeps its reduced dims, read only through a view that drops them.

A rule of passes/canonicalize.py (one spelling for each computation). Autograd's backward of a
broadcast add sums the gradient over the broadcast dims with `keepdim=True` and then views the
sum back to the parameter's shape; a linear layer's bias gradient is written so:

    before                                          after
    s = sum(g, [0], True)          # (1, 64)        v = sum(g, [0])                # (64,)
    v = view(s, [64])              # (64,)

Both spellings hold the same values in the same order, so the rewrite is exact. Why it pays:
the kernel that computes `s` writes a fresh buffer, and the program then makes `v` from it as a
view, one more tensor made on every call (fusec/runtime/writer.py: an `as_strided` call, a few
microseconds on a CPU) for every gradient of a bias or a layer norm's weight. Summed straight
into the shape its reader wants, the kernel's buffer is the gradient itself. Only a reduction
whose one user is that view: a kept dim another reader uses stays.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .patterns import Builder, Match, Op, Rule, Var

aten = torch.ops.aten

# Reductions called as op(x, dims, keepdim, ...): keepdim is their third argument.
KEEPDIM_REDUCTIONS = (aten.sum.dim_IntList, aten.mean.dim, aten.amax.default,
                      aten.amin.default)
RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _reduced_dims(dims, rank: int) -> set[int] | None:
    """The reduced dims as non-negative numbers; None for a list this rule does not read."""
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return set(range(rank))  # sum(x, []) reduces every dim, as sum(x) does
    if not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) for d in dims):
        return None
    return {d % rank for d in dims}


def _without_kept_dims(b: Builder, m: Match) -> fx.Node:
    """The reduction without keepdim when the view's shape is its shape with the kept dims
    dropped; else the view unchanged."""
    x, reduced = m.x, m.reduced
    src, out, viewed = (n.meta.get("fusec") for n in (x, reduced, m.view))
    if src is None or out is None or viewed is None or len(src.shape) == 0:
        return m.view
    dims = _reduced_dims(m.dims, len(src.shape))
    if dims is None or len(out.shape) != len(src.shape):
        return m.view
    squeezed = tuple(s for d, s in enumerate(out.shape) if d not in dims)
    if tuple(viewed.shape) != squeezed or viewed.dtype != out.dtype:
        return m.view
    return b(reduced.target, x, m.dims, False, *reduced.args[3:], **reduced.kwargs)


DROPPED_KEPT_DIMS = Rule(
    "kept dims dropped",
    Op(RESHAPES, Op(KEEPDIM_REDUCTIONS, Var("x"), Var("dims"), True, name="reduced",
                    exact=False, one_user=True), Var("shape"), name="view"),
    _without_kept_dims, "{reduced} computed without its kept dims: its one reader, {view}, "
    "drops them")

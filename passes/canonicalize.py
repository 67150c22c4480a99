"""Canonical forms: one spelling for each computation, so later passes recognize it once.

People write the same product many ways. A linear layer with a per-channel scale, for instance:

    (x @ w.float().t()) * s                      the canonical form
    torch.einsum("mk,nk->mn", x, w.float()) * s  capture gives a bmm of batch one between views
    (x[:, None, :] * w.float()).sum(-1) * s      a broadcast multiply, then a sum
    x @ (w.float() * s[:, None]).t()             the scale applied to the weight first

Each later pass that looks for a matmul (passes/small_matmul.py turns a small one into a GEMV
whose prologue dequantizes the weight) would need a matcher per spelling, and would still miss
the next one. This pass rewrites every spelling into the first, so that whatever matches the
canonical form matches them all, at every size. Its rules (passes/patterns.py):

    view chains          permute(unsqueeze(x, 2), [2, 0, 1]) ... view(.., [1, 96, 64]): a chain of
                         views that only adds or drops dims of size one and reorders the others,
                         as one permute and one view (or fewer)
    batch of one         bmm(a, b) with one batch: view(mm(view(a), view(b)))
    contraction          sum(mul(a, b), [d]) where a varies along one kept dim and b along the
                         other: mm(a', b'), the library's or, at small M, fusec's GEMV
    scale after product  mm(x, permute(mul(w, s), [1, 0])) with s constant along K (one scale per
                         output column): mul(mm(x, permute(w, [1, 0])), s); with a bias
                         (addmm, float32 and float64), the bias added after the scale

Each is exact algebra; only the rounding of float sums differs (a matmul accumulates products in
float32 where eager's mul rounds each product to the dtype first: the matmul's answer is the
more accurate one). A contraction over fewer than MIN_K elements stays a fused reduction: the
library call would cost more than the loop. Every rewrite, and every decline with its reason, is
a `Decision` in `record_of(gm).canonicalize`; `fusec.explain` prints them. Next: passes/simplify.py.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fusec.ir import TensorMeta

from .grouping import record_decisions
from .patterns import REGISTERED, Builder, Declined, Match, Op, Rule, Var, rewrite

aten = torch.ops.aten

MIN_K = 16  # shorter contractions stay a fused sum: a library call costs more than the loop


def canonicalize(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite the spellings of a product into its canonical form (see the module docstring),
    then apply the rules registered from outside the core (`patterns.register`)."""
    return record_decisions(gm, "canonicalize", rewrite(gm, RULES + REGISTERED))


def _meta(value) -> TensorMeta | None:
    return value.meta.get("fusec") if isinstance(value, fx.Node) else None


# ---- view chains ------------------------------------------------------------------------------

VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default,
         aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
         aten.permute.default, aten.transpose.int, aten.t.default)


def _dims_after(node: fx.Node, dims: list) -> list | None:
    """Which dim of the chain's source each dim of `node` is (None: a new dim of size one),
    given `dims` for node's input; None when node is not a view of that kind."""
    src = _meta(node.args[0])
    out = _meta(node)
    if src is None or out is None:
        return None
    t = node.target
    if t is aten.permute.default:
        return [dims[d % len(dims)] for d in node.args[1]]
    if t is aten.transpose.int or t is aten.t.default:
        a, b = (node.args[1], node.args[2]) if t is aten.transpose.int else (0, 1)
        if len(dims) < 2 and t is aten.t.default:
            return list(dims)
        new = list(dims)
        a, b = a % len(dims), b % len(dims)
        new[a], new[b] = new[b], new[a]
        return new
    # unsqueeze, squeeze and view alike: the dims of size other than one keep their order
    keep = [d for d, n in zip(dims, src.shape) if n != 1]
    if [n for n in src.shape if n != 1] != [n for n in out.shape if n != 1]:
        return None  # a view that splits or merges dims
    it = iter(keep)
    return [next(it) if n != 1 else None for n in out.shape]


def _chain(node: fx.Node) -> tuple[fx.Node, list] | None:
    """The source of the longest chain of unit views and permutes ending at node, and where each
    of node's dims comes from; None when the chain is shorter than two ops."""
    links = []
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in VIEWS:
        links.append(node)
        node = node.args[0]
    while links:
        source = links[-1].args[0]
        dims = list(range(len(_meta(source).shape))) if _meta(source) else None
        for link in reversed(links):
            dims = None if dims is None else _dims_after(link, dims)
        if dims is not None:
            break
        links.pop()  # the first op is a real reshape: start after it
    if len(links) < 2:
        return None
    return links[-1].args[0], dims


def _shortest(b: Builder, m: Match) -> fx.Node:
    if m.view.users and all(u.target in VIEWS for u in m.view.users):
        return m.view  # the chain goes on: its last view rewrites it whole
    found = _chain(m.view)
    if found is None:
        return m.view
    source, dims = found
    shape = list(_meta(m.view).shape)
    src_shape = _meta(source).shape
    order = [d for d, n in zip(dims, shape) if d is not None and n != 1]
    # Only the order of the dims of size other than one matters: the others can go anywhere.
    permuted = order != sorted(order)
    perm = order + [d for d in range(len(src_shape)) if d not in order] if permuted \
        else list(range(len(src_shape)))
    moved = [src_shape[d] for d in perm]
    ops = permuted + (moved != shape)
    links = 0
    node = m.view
    while node is not source:
        links, node = links + 1, node.args[0]
    if ops >= links:
        return m.view
    out = source
    if permuted:
        out = b(aten.permute.default, out, perm)
    if moved != shape:
        out = b(aten.view.default, out, shape)
    return out


VIEW_CHAIN = Rule("view chain", Op(VIEWS, Var("x"), name="view", exact=False), _shortest,
                  "a chain of views that only moves dims as one permute and one view")


# ---- a batch of one ---------------------------------------------------------------------------

def _batch_of_one(b: Builder, m: Match) -> fx.Node:
    a, w = _meta(m.a), _meta(m.b)
    if a is None or w is None or a.shape[0] != 1:
        return m.bmm
    _, rows, k = a.shape
    cols = w.shape[2]
    mm = b(aten.mm.default, b(aten.view.default, m.a, [rows, k]),
           b(aten.view.default, m.b, [k, cols]))
    return b(aten.view.default, mm, [1, rows, cols])


BATCH_OF_ONE = Rule("batch of one", Op(aten.bmm.default, Var("a"), Var("b"), name="bmm"),
                    _batch_of_one, "bmm of one batch as mm")


# ---- contractions -----------------------------------------------------------------------------

def _contraction(b: Builder, m: Match) -> fx.Node | Declined:
    node, prod = m.sum, m.prod
    out = _meta(prod)
    dims = m.dims if isinstance(m.dims, (list, tuple)) else [m.dims]
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if out is None or len(out.shape) != 3 or len(dims) != 1 or keepdim or node.kwargs.get("dtype"):
        return node
    if not out.dtype.is_floating_point or out.numel == 0:
        return Declined(f"{out.dtype} or empty: the library matmul is for non-empty floats")
    if not all(_meta(v) is not None and _meta(v).dtype == out.dtype for v in (m.a, m.b)):
        return Declined("the operands' dtypes differ from the product's")
    d = dims[0] % 3
    a_shape, b_shape = (_padded(_meta(v).shape) for v in (m.a, m.b))
    k = out.shape[d]
    if a_shape[d] != k or b_shape[d] != k:
        return Declined("an operand is broadcast along the summed dim")
    if k < MIN_K:
        return Declined(f"K = {k} < {MIN_K}: a fused sum is cheaper than a library call")
    kept = [t for t in range(3) if t != d]
    owner = _owners(kept, a_shape, b_shape)
    if isinstance(owner, Declined):
        return owner
    a_dim, b_dim = owner
    a, other = m.a, m.b
    if a_dim > b_dim:  # the operand of the first kept dim is the left one: mm(x, w.t()), not its .t()
        a, other, a_shape, b_shape, a_dim, b_dim = other, a, b_shape, a_shape, b_dim, a_dim
    left = _as_matrix(b, a, a_shape, [a_dim, b_dim, d], [a_shape[a_dim], k])
    right = _as_matrix(b, other, b_shape, [d, a_dim, b_dim], [k, b_shape[b_dim]])
    return b(aten.mm.default, left, right)


def _padded(shape) -> list:
    return [1] * (3 - len(shape)) + list(shape)


def _owners(kept: list, a_shape: list, b_shape: list) -> tuple[int, int] | Declined:
    """(the kept dim a varies along, the one b varies along), or why it is not a matmul."""
    a_only = [t for t in kept if a_shape[t] != 1 and b_shape[t] == 1]
    b_only = [t for t in kept if b_shape[t] != 1 and a_shape[t] == 1]
    if any(a_shape[t] != 1 and b_shape[t] != 1 for t in kept):
        return Declined("both operands vary along a kept dim: a batched product")
    free = [t for t in kept if a_shape[t] == 1 and b_shape[t] == 1]
    while free and (len(a_only) < 1 or len(b_only) < 1):
        (a_only if not a_only else b_only).append(free.pop(0))
    if len(a_only) != 1 or len(b_only) != 1:
        return Declined("one operand varies along both kept dims: a matrix-vector product")
    return a_only[0], b_only[0]


def _as_matrix(b: Builder, value: fx.Node, shape3: list, order: list, shape2: list) -> fx.Node:
    """value (padded to three dims), its dims in `order`, seen as the 2-D `shape2`."""
    if list(_meta(value).shape) != shape3:
        value = b(aten.view.default, value, shape3)
    if order != sorted(order):
        value = b(aten.permute.default, value, order)
    return b(aten.view.default, value, shape2)


CONTRACTION = Rule(
    "contraction",
    Op(aten.sum.dim_IntList, Op(aten.mul.Tensor, Var("a"), Var("b"), name="prod", one_user=True),
       Var("dims"), name="sum", exact=False),
    _contraction, "sum({prod}) over the shared dim is a matmul")


# ---- the scale after the product --------------------------------------------------------------

def _scale_after(b: Builder, m: Match) -> fx.Node | Declined:
    """mm(x, permute(w * s, [1, 0])) -> mm(x, permute(w, [1, 0])) * s' for s constant along K
    (and addmm(b, x, ...) -> that + b, in float32 and float64)."""
    w, s = m.p, m.q
    full = _meta(m.scaled)
    if full is None or _meta(w) is None or _meta(w).shape != full.shape:
        w, s = s, w
    if full is None or _meta(w) is None or _meta(w).shape != full.shape or len(full.shape) != 2:
        return m.mm
    transposed = m.get("t") is not None
    k_dim = 1 if transposed else 0
    if isinstance(s, fx.Node):
        sm = _meta(s)
        if sm is None or sm.dtype != full.dtype or _meta(w).dtype != full.dtype:
            return Declined("the scale's dtype differs from the weight's: the product rounds "
                            "differently")
        shape = _padded(sm.shape)[1:] if len(sm.shape) <= 2 else None
        if shape is None or shape[k_dim] != 1:
            return m.mm  # varies along K: not one scale per output column
        s = b(aten.view.default, s, [shape[1 - k_dim]])
    elif not isinstance(s, (int, float)):
        return m.mm
    bias = m.get("bias")
    if bias is not None and full.dtype not in (torch.float32, torch.float64):
        return Declined(f"{full.dtype}: addmm adds the bias before it rounds, once")
    weight = b(aten.permute.default, w, [1, 0]) if transposed else w
    out = b(aten.mul.Tensor, b(aten.mm.default, m.x, weight), s)
    return out if bias is None else b(aten.add.Tensor, out, bias)


_SCALED = Op(aten.mul.Tensor, Var("p"), Var("q"), name="scaled", one_user=True)
SCALE_AFTER_T = Rule(
    "scale after product",
    Op(aten.mm.default, Var("x"), Op(aten.permute.default, _SCALED, [1, 0], name="t",
                                     one_user=True), name="mm"),
    _scale_after, "the per-column scale of {scaled} applied to the product")
SCALE_AFTER = Rule("scale after product", Op(aten.mm.default, Var("x"), _SCALED, name="mm"),
                   _scale_after, "the per-column scale of {scaled} applied to the product")

SCALE_AFTER_BIAS = Rule(
    "scale after product",
    Op(aten.addmm.default, Var("bias"), Var("x"), Op(aten.permute.default, _SCALED, [1, 0],
                                                     name="t", one_user=True), name="mm"),
    _scale_after, "the per-column scale of {scaled} applied to the product, then the bias")

RULES = [VIEW_CHAIN, BATCH_OF_ONE, CONTRACTION, SCALE_AFTER_T, SCALE_AFTER, SCALE_AFTER_BIAS]

"""Canonical forms: one spelling for each computation, so later passes recognize it once.

Why this file is long: it is one pass whose rules run together until none applies, each feeding
the next (a stack's views, its math, its pieces' views; a bmm, its views, a matmul), so they are
read together: first the spellings of a product, then pieces put together (stack and cat).

People write the same product many ways. A linear layer with a per-channel scale, for instance:

    (x @ w.float().t()) * s                      the canonical form
    torch.einsum("mk,nk->mn", x, w.float()) * s  capture gives a bmm of batch one between views
    (x[:, None, :] * w.float()).sum(-1) * s      a broadcast multiply, then a sum
    x @ (w.float() * s[:, None]).t()             the scale applied to the weight first

Whatever looks for a matmul later (a kernel family that computes a matmul of few rows in one
pass, its weight unpacked and scaled on the way in) would need a matcher per spelling, and would
still miss the next one. This pass rewrites every spelling into the first, so that whatever
matches the canonical form matches them all, at every size. Its rules (passes/patterns.py):

    view chains          permute(unsqueeze(x, 2), [2, 0, 1]) ... view(.., [1, 96, 64]): a chain of
                         views that only adds or drops dims of size one and reorders the others,
                         as one permute and one view (or fewer)
    batch of one         bmm(a, b) with one batch: view(mm(view(a), view(b)))
    contraction          sum(mul(a, b), [d]) where a varies along one kept dim and b along the
                         other: mm(a', b')
    scale after product  mm(x, permute(mul(w, s), [1, 0])) with s constant along K (one scale per
                         output column): mul(mm(x, permute(w, [1, 0])), s); with a bias
                         (addmm, float32 and float64), the bias added after the scale

Each is exact algebra; only the rounding of float sums differs (a matmul accumulates products in
float32 where eager's mul rounds each product to the dtype first: the matmul's answer is the
more accurate one). A contraction over fewer than MIN_K elements stays a fused reduction: the
library call would cost more than the loop.

Pieces put together. A packed 4-bit weight (two values a byte, lo = p & 15 and hi = p >> 4) is
unpacked by putting the pieces together, and scaled per group, (q - zero) * scale, before or
after:

    stack([(lo - z) * s, (hi - z) * s], -1).view(N, K)   the canonical form: math, then stack
    ((stack([lo, hi], -1) - z) * s).view(N, K)           stack, then math
    stack([lo, hi], -1).view(N, K).view(N, K / G, G)...  a view between the stack and the math
    cat([lo, hi], -1).view(N, K / G, G) - z ...          halves: cat, then math (canonical)
    cat([lo3 - z[:, :h], hi3 - z[:, h:]], 1) ...         halves: math, then cat

The two ways of putting pieces together want the math on opposite sides, for the same reason:
each way keeps the pieces where the next kernel can read them.

    math into a stack    f(stack(pieces, -1), u) -> stack([f(piece_i, u_i)], -1) when the
                         stack feeds a matmul through elementwise ops and views: the product
                         distributes over the pieces (column 2j of the weight is piece 0's j,
                         column 2j + 1 piece 1's), so a matmul of few rows reads each piece where
                         it is computed and never stores the stack. The other operands u are
                         used as they are where they broadcast along the stacked dim, and
                         selected per piece where they vary along it. Views between the stack
                         and the math move out to the result: the stack takes the shape in which
                         the stacked dim stays a dim of its own (stack([lo, hi], -1).view(N, K)
                         .view(N, K / G, G) is stacked as (N, K / G, G / 2, 2)), the pieces are
                         viewed so, and those views move onto what the pieces are computed from
                         (p.view(..) & 15, as one writes it). Repeated, every op of a chain moves
                         in, piece by piece in the order the canonical form computes them. A
                         stack that feeds no matmul keeps its math: computed after the stack, it
                         is one kernel with it. (Capture writes a stack along another dim as a
                         cat and a view: its pieces are blocks, as a cat's are: the rules below.)
    math out of a cat    cat([f(a_i, u_i)], d) -> f(cat([a_i], d), cat([u_i], d)) when every
                         piece is the same elementwise op: a kernel reads a concatenation piece
                         by piece (passes/computed_pieces.py makes one kernel of a cat of
                         computed pieces), so the math reads the cat. Operands broadcast along d
                         are used as they are; the consecutive pieces of one split (z.chunk(2,
                         1)) joined are z.
    cat of views         view(cat(pieces, d), S) -> cat(view(piece_i), t) when each piece is
                         whole rows of the view's dim t and is computed by elementwise ops from
                         values in memory: the views move onto those, as for a stack.
    views of a stack     two reshapes of a stack as one view.
    cast after a view    to(view(x, S), dtype) -> view(to(x, dtype), S) for a contiguous x that
                         a kernel computes: the cast then joins x's kernel (a reshape read
                         back ends a kernel, passes/fuse_pointwise.py), and the view is of the
                         cast's result. Autocast's backward writes every gradient so: the
                         gradient of `logits.float()` reshaped, then cast back to bfloat16.
    kept dims dropped    view(sum(g, dims, True), S) -> sum(g, dims) when S is the sum's shape
                         without its kept dims (a bias gradient): the kernel's buffer is the
                         gradient, no view made per call (passes/kept_dims.py).

Each is exact: every element gets the same ops on the same values as in eager, so NaN and
infinity come out where eager's do. Only elementwise ops of the op table (fusec/ops.py) move,
and only pieces that are computed: a stack of pieces in memory keeps its math, which reads them
where they lie (moved into the pieces, it would make each a piece to compute). What stays, and
why, is said: a stacked piece in memory, pieces of different dtypes (the stack promotes them),
an operand that varies along dims a view merges with the stacked one (it cannot be split per
piece without a copy), a stack read by an op that is not elementwise, a cat whose pieces' operands
broadcast differently or differ in a constant. Every rewrite, and every decline with its reason,
is a `Decision` in `record_of(gm).canonicalize`; `fusec.explain` prints them.
Next: passes/simplify.py.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from fusec import ops
from fusec.ir import TensorMeta
from fusec.sizes import is_one, same_shape

from .grouping import record_decisions
from .kept_dims import DROPPED_KEPT_DIMS
from .patterns import REGISTERED, Builder, Declined, Match, Op, Rule, Var, looks_for_rules, rewrite

aten = torch.ops.aten

MIN_K = 16  # shorter contractions stay a fused sum: a library call costs more than the loop


@looks_for_rules("RULES", "REGISTERED")
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
    keep = [d for d, n in zip(dims, src.shape) if not is_one(n)]
    if not same_shape([n for n in src.shape if not is_one(n)], [n for n in out.shape if not is_one(n)]):
        return None  # a view that splits or merges dims
    it = iter(keep)
    return [next(it) if not is_one(n) else None for n in out.shape]


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
    _contraction, "sum({prod}) over the shared dim is a matmul",
    needs=(aten.mul.Tensor,))  # a sum alone (a softmax's) has nothing to contract


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

# ---- math into the pieces of a stack ----------------------------------------------------------

RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default,
            aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
ELEMENTWISE = tuple(t for t in ops.ATEN if t is not aten.cat.default)  # the op table's rows


def _stack(node) -> tuple[list, int, list] | None:
    """(pieces, dim, the unsqueezes) when node is torch.stack(pieces, -1) as captured: a cat of
    unsqueezes of the pieces along the last dim, an interleave. Else None (capture writes a
    stack along another dim as a cat and a view: its pieces are blocks, as a cat's are)."""
    dim = _cat_dim(node)
    if dim is None or dim != len(_meta(node).shape) - 1:
        return None
    tensors = node.args[0]
    if len(tensors) < 2 or not all(
            isinstance(t, fx.Node) and t.target is aten.unsqueeze.default and _meta(t)
            and t.args[1] % len(_meta(node).shape) == dim for t in tensors):
        return None
    return [t.args[0] for t in tensors], dim, list(tensors)


def _cat_dim(node) -> int | None:
    """The dim (0 or more) a cat joins along; None for anything else."""
    if not (isinstance(node, fx.Node) and node.target is aten.cat.default and _meta(node)):
        return None
    return (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) \
        % len(_meta(node).shape)


def _stacked(b: Builder, values: list, dim: int, negative: bool) -> fx.Node:
    """torch.stack(values, dim) along the last dim, spelled as capture spells it (`_stack`)."""
    return b(aten.cat.default, [b(aten.unsqueeze.default, v, dim) for v in values],
             -1 if negative else dim)


def _stored(node: fx.Node) -> bool:
    """node's value lies in memory: a graph input or attribute, or a view of one."""
    while node.op == "call_function" and ops.classify(node.target) == ops.VIEW:
        node = node.args[0]
    return node.op in ("placeholder", "get_attr")


def _groups(a: list, b: list) -> list | None:
    """The dims of shape `a` and of shape `b` (one viewed as the other) that hold the same
    elements: [(a dims, b dims), ...], the smallest such runs in order; None if none fit."""
    i = j = 0
    groups = []
    while i < len(a) or j < len(b):
        ga, gb, pa, pb = [], [], 1, 1
        while not ga or not gb or pa != pb:
            if (pa <= pb or j == len(b)) and i < len(a):
                ga, pa, i = ga + [i], pa * a[i], i + 1
            elif j < len(b):
                gb, pb, j = gb + [j], pb * b[j], j + 1
            elif pa == pb:
                break
            else:
                return None
        groups.append((ga, gb))
    return groups


def _refined(shape: list, dim: int, out: list) -> tuple[list, int] | None:
    """The shape the stack (`shape`, pieces stacked along `dim`) must have so that viewed as
    `out` the stacked dim stays a dim of its own: `out` with the stacked dim split off the dim
    it merges into. stack([lo, hi], -1).view(N, K).view(N, K / G, G) has shape (N, K / 2, 2);
    refined, (N, K / G, G / 2, 2). None when the stacked dim is not the last of what it merges
    with (a view that moves it elsewhere). Also where the stacked dim is in the refined shape."""
    groups = _groups(shape, out)
    if groups is None:
        return None
    n = shape[dim]
    refined, where = [], None
    for ga, gb in groups:
        sizes = [out[d] for d in gb]
        if dim in ga:
            if [shape[d] for d in ga] == sizes:
                where = len(refined) + ga.index(dim)
            elif any(shape[d] != 1 for d in ga if d > dim) or sizes[-1] % n:
                return None
            else:
                sizes = sizes[:-1] + [sizes[-1] // n, n]
                where = len(refined) + len(sizes) - 1
        refined += sizes
    return refined, where


def _seen_as(shape: list, out: list, value_shape: list) -> list | None:
    """An operand of shape `value_shape`, broadcast against `out`, seen in `shape` (of which `out`
    is a view): its shape there, or None when it varies along dims the view merges or splits."""
    padded = [1] * (len(out) - len(value_shape)) + list(value_shape)
    seen = [1] * len(shape)
    for ga, gb in _groups(shape, out):
        varies = [d for d in gb if padded[d] != 1]
        if not varies:
            continue
        real_a = [d for d in ga if shape[d] != 1]
        real_b = [d for d in gb if out[d] != 1]
        if len(real_a) != 1 or real_b != varies or len(varies) != 1:
            return None
        seen[real_a[0]] = padded[varies[0]]
    return seen


def _stack_operand(node: fx.Node) -> tuple | None:
    """(the operand, the reshapes between it and the stack, the stack, _stack's answer) for the
    first operand of node that is a stack seen through reshapes; None if none is."""
    for arg in node.args:
        links, value = [], arg
        while _stack(value) is None and isinstance(value, fx.Node) and value.target in RESHAPES:
            links, value = links + [value], value.args[0]
        if _stack(value) is not None:
            return arg, links, value, _stack(value)
    return None


def _math_into_stack(b: Builder, m: Match) -> fx.Node | Declined:
    """f(stack(pieces), u) -> stack([f(piece_i, u_i)]): see the module docstring."""
    node = m.op
    found = _stack_operand(node)
    if found is None or any(isinstance(v, fx.Node) for v in node.kwargs.values()) \
            or not _feeds_product(node):
        return node
    arg, links, cat, (pieces, dim, spots) = found
    out, whole = _meta(node), _meta(cat)
    if out is None or any(_meta(p) is None for p in pieces):
        return node
    stored = [p.name for p in pieces if _stored(p)]
    if stored:
        return Declined(f"{stored[0]} is stored: the math reads the stack where its pieces lie; "
                        "pushed into the pieces it would compute one more piece")
    if any(len(v.users) != 1 for v in [cat, *links, *spots]):
        return Declined(f"{cat.name} has other users: the pieces would be computed twice")
    if any(_meta(p).dtype != whole.dtype for p in pieces):
        return Declined("the pieces' dtypes differ: the stack promotes them")
    seen, shape = list(_meta(arg).shape), list(whole.shape)
    if list(out.shape) != seen:
        return Declined(f"another operand broadcasts {arg.name} to {list(out.shape)}")
    if out.numel == 0:
        return Declined("empty")
    found = _refined(shape, dim, seen)
    if found is None:
        return Declined("the stack's view merges the stacked dim with a later one")
    refined, dim = found
    if dim != len(refined) - 1:
        return Declined("the stack's view moves the stacked dim from the last place")
    piece_shape = refined[:dim] + refined[dim + 1:]
    operands = _per_piece(b, node, arg, refined, seen, dim, len(pieces))
    if isinstance(operands, Declined):
        return operands
    shared = list(b.made)  # the operands' views, made for every piece
    stacked, reshaped, per_piece, views = [], [], [], {}
    for i, piece in enumerate(pieces):
        start = len(b.made)
        if list(_meta(piece).shape) != piece_shape:
            piece = _reshaped(b, piece, piece_shape, views)
            if piece is None:
                return Declined(f"{pieces[i].name} is not contiguous: it cannot be split "
                                "without a copy")
        reshaped.append(b.made[start:])
        start = len(b.made)
        args = [piece if a is arg else operands[a][i] if a in operands else a for a in node.args]
        stacked.append(b(node.target, *args, **node.kwargs))
        per_piece.append(b.made[start:])
    negative = len(cat.args) > 1 and cat.args[1] < 0
    result = _stacked(b, stacked, dim, negative)
    for nodes, value in zip(per_piece, stacked):  # each piece's unsqueeze goes with it
        nodes += [u for u in value.users if u in b.made and u.target is aten.unsqueeze.default]
    if list(_meta(result).shape) != refined or _meta(result).dtype != out.dtype:
        return Declined(f"per piece the op gives {_meta(result)}, not {out}")
    if refined != seen:
        result = b(aten.view.default, result, seen)
    _piece_by_piece(spots, pieces, shared, reshaped, per_piece)
    return result


def _per_piece(b: Builder, node: fx.Node, arg: fx.Node, refined: list, seen: list, dim: int,
               count: int) -> dict | Declined:
    """Each operand of node other than the stack `arg`, as each piece sees it: {operand: [its
    value for piece 0, for piece 1, ...]}. Broadcast along the stacked dim: the operand itself
    (or its view without that dim) for every piece; varying along it: selected per piece."""
    operands = {}
    for a in node.args:
        if not isinstance(a, fx.Node) or a is arg or a in operands:
            continue
        a_shape = list(_meta(a).shape) if _meta(a) else None
        shaped = None if a_shape is None else _seen_as(refined, seen, a_shape)
        if shaped is None:
            return Declined(f"{a.name} varies along dims that the stack's view merges: it "
                            "cannot be split per piece without a copy")
        if not a_shape:
            operands[a] = [a] * count  # a 0-dim tensor: the same type promotion as before
        elif shaped[dim] == 1:
            operands[a] = [_viewed(b, a, shaped[:dim] + shaped[dim + 1:])] * count
        else:
            whole = _viewed(b, a, shaped)
            operands[a] = [b(aten.select.int, whole, dim, i) for i in range(count)]
    return operands


def _piece_by_piece(stacked_at: list, pieces: list, shared: list, reshaped: list,
                    per_piece: list) -> None:
    """Put each piece's new op where the piece was stacked (and a piece computed anew in the
    refined shape where the piece was computed), so that after every op has moved in, the graph
    computes piece after piece (lo's math, then hi's) as the canonical spelling does:
    the same nodes in the same order make the same kernel, statement for statement. Only when
    what they read is computed before (else they stay where they were built, before the op they
    replace: the same values, in another order)."""
    order = {n: i for i, n in enumerate(stacked_at[0].graph.nodes)}
    place = min(stacked_at, key=order.get)
    made = set(shared).union(*per_piece, *reshaped)
    spots = [(place, shared), *zip(stacked_at, per_piece), *zip(pieces, reshaped)]
    late = {a for spot, nodes in spots for n in nodes for a in n.all_input_nodes
            if a not in made and order[a] >= order[spot]}
    if any(a.target not in RESHAPES or any(order[i] >= order[place] for i in a.all_input_nodes)
           for a in late):
        return
    for a in sorted(late, key=order.get):  # an operand's views, written after the stack: moved
        place.prepend(a)
    for spot, nodes in spots:
        for n in nodes:
            spot.prepend(n)


def _contiguous(node: fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.is_contiguous()


def _reshaped(b: Builder, value: fx.Node, shape: list, views: dict,
              stored_only: bool = False) -> fx.Node | None:
    """value (a computed piece) viewed as `shape`, the view moved onto what the piece is computed
    from, as far as elementwise ops of that shape go: (p & 15).view(s) is p.view(s) & 15, as one
    writes it (one view of p for all the pieces: `views`). None when a view would need a copy
    (a tensor that is not contiguous), or, `stored_only`, when it would view a computed value."""
    if value.op == "call_function" and value.target in ELEMENTWISE and len(value.users) == 1 \
            and not value.kwargs.get("memory_format") and all(
                _meta(a) is not None and _meta(a).shape == _meta(value).shape
                for a in value.all_input_nodes) and value.all_input_nodes:
        args = []
        for a in value.args:
            args.append(_reshaped(b, a, shape, views, stored_only) if isinstance(a, fx.Node)
                        else a)
            if args[-1] is None:
                return None
        return b(value.target, *args, **value.kwargs)
    if not _contiguous(value) or stored_only and not _stored(value):
        return None
    if value not in views:
        views[value] = b(aten.view.default, value, shape)
    return views[value]


def _viewed(b: Builder, value: fx.Node, shape: list) -> fx.Node:
    """value seen as `shape` (the same elements, dims of one added or dropped): value itself, or
    the view along its chain of views that already has that shape, or an unsqueeze or a view of
    the chain's source."""
    node = value
    while True:
        if _meta(node) is not None and list(_meta(node).shape) == shape:
            return node
        if not (isinstance(node, fx.Node) and node.target in RESHAPES):
            break
        node = node.args[0]
    if [n for n in _meta(node).shape if n != 1] != [n for n in shape if n != 1]:
        node = value  # the chain splits or merges dims: view the operand itself
    have = list(_meta(node).shape)
    for d in range(len(have) + 1):
        if have[:d] + [1] + have[d:] == shape:
            return b(aten.unsqueeze.default, node, d)
    return b(aten.view.default, node, shape)


MATH_INTO_STACK = Rule("math into a stack", Op(ELEMENTWISE, name="op", exact=False),
                       _math_into_stack, "{op} applied to each piece of the stack",
                       needs=(aten.cat.default,))  # torch.stack is captured as a cat


def _view_of_view(b: Builder, m: Match) -> fx.Node:
    if _stack(m.x) is None or not _contiguous(m.x):
        return m.outer
    if list(_meta(m.outer).shape) == list(_meta(m.x).shape):
        return m.x
    return b(aten.view.default, m.x, list(_meta(m.outer).shape))


PRODUCTS = (aten.mm.default, aten.addmm.default, aten.bmm.default)


def _feeds_product(node: fx.Node) -> bool:
    """node's value reaches an operand of a matmul through elementwise ops and views only."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        for u in n.users:
            if u.target in PRODUCTS:
                return True
            if u not in seen and u.op == "call_function" and (
                    u.target in ELEMENTWISE or ops.classify(u.target) == ops.VIEW):
                seen.add(u)
                todo.append(u)
    return False


def _not_elementwise(b: Builder, m: Match) -> fx.Node | Declined:
    """A stack read by an op that is not elementwise (a sum, a sort, a library call) stays as
    written: that op needs the pieces together. Said once per stack, for `explain`."""
    user = m.cat
    if _stack(user) is None:
        return m.cat
    while len(user.users) == 1 and next(iter(user.users)).target in RESHAPES:
        user = next(iter(user.users))
    for u in user.users:
        if u.op == "call_function" and u.target not in ELEMENTWISE + PRODUCTS \
                and ops.classify(u.target) != ops.VIEW:
            return Declined(f"{u.name} ({u.target}) is not elementwise: it needs the pieces "
                            "together")
    return m.cat


_CAT = Op(aten.cat.default, Var("pieces"), name="cat", exact=False)  # its dim: `_cat_dim`
STACK_READERS = Rule("math into a stack", _CAT, _not_elementwise)


# ---- math out of a concatenation --------------------------------------------------------------

def _math_out_of_cat(b: Builder, m: Match) -> fx.Node | Declined:
    cat, pieces = m.cat, m.pieces
    out = _meta(cat)
    if out is None or _stack(cat) is not None or len(pieces) < 2:
        return cat
    first = pieces[0]
    if not all(isinstance(p, fx.Node) and p.op == "call_function" and p.target in ELEMENTWISE
               and p.target is first.target and p.kwargs == first.kwargs and len(p.users) == 1
               and len(p.args) == len(first.args) and _meta(p) is not None for p in pieces):
        return cat  # not one op on every piece
    rank = len(out.shape)
    dim = _cat_dim(cat)
    args = []
    for column in zip(*(p.args for p in pieces)):
        nodes = [a for a in column if isinstance(a, fx.Node)]
        if not nodes:
            if any(a != column[0] for a in column):
                return Declined(f"{first.name}'s pieces differ in a constant")
            args.append(column[0])
            continue
        if len(nodes) != len(column) or any(_meta(a) is None for a in nodes):
            return cat
        shapes = [[1] * (rank - len(_meta(a).shape)) + list(_meta(a).shape) for a in nodes]
        if all(a is nodes[0] for a in nodes) and shapes[0][dim] == 1:
            args.append(nodes[0])  # broadcast along the cat's dim: the same for every piece
            continue
        if len({_meta(a).dtype for a in nodes}) != 1:
            return Declined("the pieces' operands differ in dtype: their concatenation promotes")
        if any(len(_meta(a).shape) != rank or s[dim] != _meta(p).shape[dim]
               for a, s, p in zip(nodes, shapes, pieces)):
            return Declined(f"an operand of {first.name} is broadcast along the cat's dim")
        if len({tuple(s[:dim] + s[dim + 1:]) for s in shapes}) != 1:
            return Declined(f"the operands of {first.name} are broadcast differently: they do "
                            "not concatenate")
        args.append(_joined(b, nodes, dim))
    result = b(first.target, *args, **first.kwargs)
    if list(_meta(result).shape) != list(out.shape) or _meta(result).dtype != out.dtype:
        return Declined(f"on the concatenation the op gives {_meta(result)}, not {out}")
    return result


def _joined(b: Builder, values: list, dim: int) -> fx.Node:
    """cat(values, dim), spelled as what it undoes when it can: unsqueeze(x_i, k) joined is
    unsqueeze(joined x_i, k); the consecutive pieces of one split (z.chunk(2, 1)) or the
    adjacent slices of one tensor joined are that tensor."""
    if all(v.target is aten.unsqueeze.default for v in values):
        ks = {v.args[1] % len(_meta(v).shape) for v in values}
        if len(ks) == 1 and dim != next(iter(ks)):
            k = ks.pop()
            inner = _joined(b, [v.args[0] for v in values], dim - (k < dim))
            return b(aten.unsqueeze.default, inner, k)
    whole = _split_of(values, dim)
    if whole is not None:
        return whole
    return b(aten.cat.default, list(values), dim)


def _split_of(values: list, dim: int) -> fx.Node | None:
    """The tensor that `values` split along `dim`, in order and all of it, or None."""
    if all(v.target is operator.getitem for v in values):
        split = values[0].args[0]
        if split.target in (aten.split_with_sizes.default, aten.split.Tensor) \
                and all(v.args[0] is split for v in values) \
                and [v.args[1] for v in values] == list(range(len(split.users))) \
                and len(values) == len(split.users) and _meta(split.args[0]) is not None:
            source = split.args[0]
            split_dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
            if split_dim % len(_meta(source).shape) == dim:
                return source
    return None


MATH_OUT_OF_CAT = Rule("math out of a cat", _CAT, _math_out_of_cat,
                       "the op of every piece of {cat} applied to the whole concatenation")


def _cat_of_views(b: Builder, m: Match) -> fx.Node | Declined:
    """view(cat(pieces, d), S) as cat(view(piece_i, S_i), t): when each piece is whole rows of
    the view's dim t (cat([p & 15, p >> 4], -1).view(N, 2, K / 2)). Only for pieces computed by
    elementwise ops from values in memory: the views move onto those (`_reshaped`), and the cat
    of the pieces stays one kernel (passes/computed_pieces.py)."""
    cat, view = m.cat, m.view
    out = _meta(view)
    if out is None or _meta(cat) is None or _stack(cat) is not None:
        return view
    pieces = cat.args[0]
    if len(pieces) < 2 or not all(isinstance(p, fx.Node) and p.target in ELEMENTWISE
                                  and len(p.users) == 1 for p in pieces):
        return view
    shape, seen = list(_meta(cat).shape), list(out.shape)
    dim = _cat_dim(cat)
    groups = _groups(shape, seen)
    if groups is None:
        return view
    ga, gb = next((ga, gb) for ga, gb in groups if dim in ga)
    if any(shape[d] != 1 for d in ga if d < dim):
        return view  # the pieces interleave with a dim before the cat's
    inner = math.prod(shape[d] for d in ga if d > dim)
    t = next((d for d in gb if seen[d] != 1), None)
    if t is None:
        return view
    rows = math.prod(seen[d] for d in gb if d > t)
    sizes = [_meta(p).shape[dim] * inner for p in pieces]
    if any(s % rows for s in sizes):
        return view  # a piece ends inside a row of the view
    views = {}
    made = []
    for p, s in zip(pieces, sizes):
        made.append(_reshaped(b, p, seen[:t] + [s // rows] + seen[t + 1:], views, True))
        if made[-1] is None:  # a view of a computed piece would keep it from the cat's kernel
            return view
    return b(aten.cat.default, made, t)


CAT_OF_VIEWS = Rule(
    "cat of views",
    Op(RESHAPES, Op(aten.cat.default, Var("pieces"), name="cat", exact=False, one_user=True),
       Var("shape"), name="view"),
    _cat_of_views, "a reshape of {cat} as the cat of its pieces reshaped")


VIEW_OF_VIEW = Rule(
    "views of a stack",
    Op(RESHAPES, Op(RESHAPES, Var("x"), name="inner", one_user=True, exact=False), name="outer",
       exact=False),
    _view_of_view, "two reshapes of {x} as one view")



def _cast_after_view(b: Builder, m: Match) -> fx.Node | Declined:
    """to(view(x, S), dtype) -> view(to(x, dtype), S) for a computed, contiguous x."""
    kw = m.cast.kwargs
    x_meta = m.x.meta.get("fusec") if isinstance(m.x, fx.Node) else None
    if len(m.cast.args) != 1 or "dtype" not in kw or not isinstance(x_meta, TensorMeta) \
            or kw.get("layout", torch.strided) != torch.strided \
            or str(kw.get("device", x_meta.device)) != str(x_meta.device) \
            or kw.get("memory_format", torch.preserve_format) != torch.preserve_format \
            or set(kw) - {"dtype", "layout", "device", "memory_format"}:
        return Declined(f"a cast that also changes device or layout ({dict(kw)})")
    x = m.x
    if not isinstance(x, fx.Node) or not _contiguous(x) or not (
            ops.normalize(x) is not None or ops.reduction(x) is not None):
        return Declined(f"{getattr(x, 'name', x)} is not a contiguous value a kernel computes")
    cast = b(aten._to_copy.default, x, dtype=kw["dtype"])
    return b(m.view.target, cast, m.shape)


CAST_AFTER_VIEW = Rule(
    "cast after a view",
    Op(aten._to_copy.default, Op(RESHAPES, Var("x"), Var("shape"), name="view"), name="cast",
       exact=False),
    _cast_after_view, "the cast of a reshape of {x} as the reshape of its cast")

RULES = [VIEW_CHAIN, BATCH_OF_ONE, CONTRACTION, SCALE_AFTER_T, SCALE_AFTER, SCALE_AFTER_BIAS,
         MATH_INTO_STACK, STACK_READERS, VIEW_OF_VIEW, MATH_OUT_OF_CAT, CAT_OF_VIEWS,
         CAST_AFTER_VIEW, DROPPED_KEPT_DIMS]

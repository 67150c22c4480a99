"""Questions the compiler asks of sizes that may be symbols, without narrowing a shape family.

A pass that asks `if n == 1` of a SymInt adds a guard (`Ne(x_size0, 1)`), and the family then
stops serving a size of 1, though the general code the pass chose would have been right for it
(Note: a size of 1 in a family, fusec/dynamic.py). These helpers ask the way each question needs:

    is_one(n)                  a shortcut for a dim of 1: only when 1 at every size
    same_size(a, b)            "the same iteration space?": a symbol is never 0 or 1 here
    same_shape(a, b)           the same, dim by dim
    equal_if_so(a, b)          a shortcut whose "no" is always right: "no" costs no guard
    at_least_as_large(a, b)    which of two broadcast loops is the full one
    largest_shape(shapes)      the full one of many

For plain ints each is the plain comparison, so a static program is unchanged. A question whose
answer changes what is computed still compares the SymInt itself, and so guards.
"""
from __future__ import annotations

import math

import torch

from fusec.symbolic import hint, is_symbolic


def is_one(n) -> bool:
    """Whether a size is 1, asked for a shortcut (a dim that can be dropped, a broadcast to
    leave out): True only when it is 1 for every size of the family. A symbol that was 1 when
    traced is never one (0 and 1 are not symbols), and one of 2 or more answers False without a
    guard, so the program keeps serving a size of 1 with the general code (Note: a size of 1 in
    a family, fusec/dynamic.py). A question whose answer changes what is computed must compare
    the SymInt itself (`n == 1`), which guards."""
    if isinstance(n, torch.SymInt):
        from torch.fx.experimental.symbolic_shapes import statically_known_true
        return statically_known_true(n == 1)
    return n == 1


def same_size(a, b) -> bool:
    """`a == b` for two sizes as the compiler asks it ("is this the same iteration space?"): a
    symbol against 0 or 1 is "no" without a guard (torch's size-oblivious reading: a symbol
    stands for a size of 2 or more there, and the general code is right for 1 too), any other
    comparison of a symbol guards as `==` does."""
    if not (isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt)):
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    if statically_known_true(a == b):
        return True
    if any(isinstance(v, int) and v in (0, 1) for v in (a, b)):
        return False
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    try:
        return bool(a == b)
    except GuardOnDataDependentSymNode:  # a size from the data (unbacked): no guard can hold
        return False  # it, and "no" is the answer that keeps the general code


def equal_if_so(a, b) -> bool:
    """`a == b` for a shortcut whose "no" is right at every size (merging two dims into one loop,
    a simpler index): a guarded "yes" where the traced sizes are equal, and a "no" without a
    guard where they differ, so the family keeps every size (the general code is right for all
    of them, including the sizes where the two happen to be equal)."""
    if not (isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt)):
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    if statically_known_true(a == b):
        return True
    if hint(a) != hint(b):
        return False
    return bool(a == b)


def same_shape(a, b) -> bool:
    """Two shapes alike dim by dim (`same_size`): the tuple comparison that adds no guard for a
    symbol against a broadcast dim of 1."""
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def at_least_as_large(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether shape `a` has at least as many elements as `b` (the more dims on a tie): which of
    two loops that broadcast into one another is the full one. Asked of symbols without a guard
    where the answer holds for every size of the family (`(3, n)` against `(3, 1)`: n >= 1)."""
    na, nb = math.prod(a), math.prod(b)
    if is_symbolic(na) or is_symbolic(nb):
        from torch.fx.experimental.symbolic_shapes import statically_known_true as known
        if not known(na == nb):  # (equal only at some sizes: either space is the full one there)
            if known(na >= nb) or known(na <= nb):
                return known(na >= nb)
    if na == nb:
        if na == 0 and len(a) == len(b) and all(type(x) is int for x in (*a, *b)) \
                and _broadcasts(a, b) and not _broadcasts(b, a):
            return False  # (empty spaces: (0, 0) is the full one of (1, 0) and (0, 0))
        return len(a) >= len(b)
    return bool(na >= nb)


def _broadcasts(a: tuple, b: tuple) -> bool:
    """Whether shape `a` broadcasts into `b` of the same rank (each dim 1 or b's size)."""
    return all(x == 1 or x == y for x, y in zip(a, b))


def largest_shape(shapes) -> tuple[int, ...]:
    """The shape with the most elements (`at_least_as_large`), the first of equals."""
    best = None
    for shape in shapes:
        if best is None or not at_least_as_large(best, shape):
            best = shape
    return best

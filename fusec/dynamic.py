"""Shape families: one program for every size of a dim that changes (issue 51's policy).

torch.compile's policy, which fusec follows: the first call compiles for its exact sizes (a
static program: every size a constant, the fastest code). When a later call differs from an
earlier one only in some sizes, those dims become *dynamic*: the program is compiled once more,
with those sizes as symbols (fusec/symbolic.py), and serves every later call of that family:

    f(torch.randn(8, 64))     compile 1: static, (8, 64)
    f(torch.randn(13, 64))    compile 2: dim 0 of x changed -> x.size(0) is a symbol s0
    f(torch.randn(500, 64))   no compile: the family's guards hold (s0 >= 2, ...)

`fusec.compile(fn, dynamic=True)` makes every dim of the arguments (not the parameters) a symbol
from the first call; `dynamic=False` compiles every new size (the old behaviour);
`torch._dynamo.mark_dynamic(x, 0)` marks a dim dynamic from the first call. Sizes 0 and 1 are
never symbols: a program for them is its own (torch specializes them too).

A family is checked on each call by its guards: what compiling assumed about the sizes (the
ShapeEnv's guards, as one Python expression over the inputs' sizes and strides). A call that
breaks one compiles again, and `fusec.explain` / `FUSEC_LOG=recompiles` say which guard.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass
class Family:
    """One program for a shape family: the dims that are symbols, its key, its guard check."""

    dims: dict  # flat tensor position -> frozenset of dims that are symbols
    key: tuple
    compiled: Any
    check: Callable  # check(tensors) -> True when the program serves these inputs
    guards: list = field(default_factory=list)  # the guards, as text, for explain


def marked_dims(t: torch.Tensor) -> set:
    """Dims the user marked dynamic (`torch._dynamo.mark_dynamic` / `maybe_mark_dynamic`)."""
    return set(getattr(t, "_dynamo_dynamic_indices", ()) or ()) | \
        set(getattr(t, "_dynamo_weak_dynamic_indices", ()) or ())


def family_key(tensors: list, dims: dict, rest: tuple) -> tuple:
    """What every call of one family shares: each tensor's dtype, device, rank, requires_grad and
    its static sizes (a dynamic dim's size and every stride are the guards' business)."""
    key = []
    for i, t in enumerate(tensors):
        dyn = dims.get(i, ())
        key.append((t.dtype, t.device, t.requires_grad,
                    tuple(None if d in dyn else n for d, n in enumerate(t.shape))))
    return tuple(key) + rest


def changed_dims(old: list, new: list, n_static: int) -> dict:
    """{flat position: dims} whose sizes differ between two calls with tensors alike in all but
    sizes (`old`, `new`: per tensor (shape, dtype, device)), counting only the caller's tensors
    (positions from `n_static` on) and only sizes of 2 or more on both sides. {} when the calls
    differ in anything else."""
    if len(old) != len(new):
        return {}
    dims = {}
    for i, (a, b) in enumerate(zip(old, new)):
        (sa, da, va), (sb, db, vb) = a, b
        if da != db or va != vb or len(sa) != len(sb):
            return {}
        diff = {d for d, (x, y) in enumerate(zip(sa, sb)) if x != y}
        if diff and i < n_static:
            return {}  # a parameter changed size: that is another model, not another size
        if any(sa[d] == 0 or sb[d] < 2 for d in diff):
            return {}  # 0 and 1 are their own programs (a call of size 1 after one of size 5)
        # (one of size 5 after one of size 1 compiles the family: 1 was its own program anyway)
        if diff:
            dims[i] = frozenset(diff)
    return dims


def all_dims(tensors: list, n_static: int) -> dict:
    """dynamic=True: every dim of size >= 2 of the caller's tensors."""
    return {i: frozenset(d for d, n in enumerate(t.shape) if n >= 2)
            for i, t in enumerate(tensors) if i >= n_static and t.dim()}


def from_examples(example_inputs) -> tuple[dict, dict]:
    """What a graph handed over with symbolic sizes (TorchDynamo's after a size changed, through
    AOT Autograd: fake tensors with SymInt sizes, and SymInt arguments) says about its calls:
    ({flat tensor position: dims that are symbols}, {argument position: (argument position of
    a tensor, dim)} for each int argument that is a size of a tensor argument). The program is
    then compiled for the family from its first call, and such an int is read from its tensor
    (capture/frontend.py `flat_callable`'s `derived`), not kept as a value of the signature."""
    dims, derived, where, k = {}, {}, {}, 0
    for i, e in enumerate(example_inputs):
        if isinstance(e, torch.Tensor):
            for d, n in enumerate(e.shape):
                if isinstance(n, torch.SymInt) and n.node.expr.is_Symbol:
                    dims.setdefault(k, set()).add(d)
                    where.setdefault(n.node.expr, (i, d))
            k += 1
    for i, e in enumerate(example_inputs):
        if isinstance(e, torch.SymInt) and e.node.expr in where:
            derived[i] = where[e.node.expr]
    return {t: frozenset(ds) for t, ds in dims.items()}, derived


def derive(key_entries: list, leaves: list, derived: dict) -> None:
    """Replace, in a signature's entries for `leaves`, each derived int (see `from_examples`)
    by where it comes from, when it is that size on this call (else it stays a value)."""
    for i, (j, d) in derived.items():
        if i < len(leaves) and j < len(leaves) and isinstance(leaves[j], torch.Tensor) \
                and leaves[j].dim() > d and leaves[i] == leaves[j].shape[d]:
            key_entries[i] = ("size of", j, d)


def guard_expression(captured) -> str:
    """The family's guards as one Python expression over `L['t0']`, `L['t1']`... (the flat input
    tensors): the ShapeEnv's guards after compiling (capture, passes, lowering and rendering all
    add theirs) and every static size and stride of the inputs. Storage offsets are left out:
    kernels read through data pointers, which include them."""
    exprs = _guard_list(captured)
    return " and ".join(f"({e})" if " or " in e else e for e in exprs) or "True"


def _guard_list(captured) -> list[str]:
    env = captured.shape_env
    fakes = [n.meta["val"] for n in captured.gm.graph.nodes if n.op == "placeholder"]
    exprs = env.produce_guards(fakes, _sources(len(fakes)), ignore_static=False)
    return [e for e in exprs if "storage_offset()" not in e]


def guard_check(captured) -> tuple[Callable, list[str]]:
    """The family's guards (`guard_expression`) as a function of the flat input tensors, and
    the ShapeEnv's own guards as text with where each was decided, for explain."""
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP
    from fusec.symbolic import guards_with_places
    code = guard_expression(captured)
    fn = eval(f"lambda L: {code}", dict(SYMPY_INTERP))  # noqa: S307 (our own guard text)
    n = sum(1 for node in captured.gm.graph.nodes if node.op == "placeholder")
    names = [f"t{i}" for i in range(n)]

    def check(tensors) -> bool:
        return bool(fn(dict(zip(names, tensors))))
    texts = [f"{g}  ({where})" if where else g for g, where in guards_with_places(captured.shape_env)]
    return check, texts


def failed_guard(captured, tensors) -> str:
    """Which guard a call broke, as text (for the recompile's reason)."""
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP
    try:
        exprs = _guard_list(captured)
    except Exception:  # noqa: BLE001 (a reason is a courtesy: never fail a call for it)
        return "a guard of the shape family"
    values = {f"t{i}": t for i, t in enumerate(tensors)}
    names = [n.name for n in captured.gm.graph.nodes if n.op == "placeholder"]
    for expr in exprs:
        try:
            if not eval(expr, dict(SYMPY_INTERP), {"L": values}):  # noqa: S307
                for i in reversed(range(len(names))):  # (t12 before t1)
                    expr = expr.replace(f"L['t{i}']", names[i])
                return expr
        except Exception:  # noqa: BLE001
            continue
    return "a guard of the shape family"


def _sources(n: int) -> list:
    from torch._dynamo.source import LocalSource
    return [LocalSource(f"t{i}") for i in range(n)]

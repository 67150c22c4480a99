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
`torch._dynamo.mark_dynamic(x, 0)` marks a dim dynamic from the first call. A size of 0 or 1
never *makes* a symbol (the call of size 1 after one of size 5 compiles for its own sizes, the
dims are broadcast ones), but a family, once there, serves a size of 1 as well where nothing in
the program depends on it (Note: a size of 1 in a family).

A family is checked on each call by its guards: what compiling assumed about the sizes (the
ShapeEnv's guards, as one Python expression over the inputs' sizes and strides). A call that
breaks one compiles again, and `fusec.explain` / `FUSEC_LOG=recompiles` say which guard.
"""
from __future__ import annotations

import contextlib
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from fusec.symbolic import is_symbolic


@dataclass
class Family:
    """One program for a shape family: the dims that are symbols, its key, its guard check."""

    dims: dict  # flat tensor position -> frozenset of dims that are symbols
    key: tuple
    compiled: Any
    check: Callable  # check(tensors) -> True when the program serves these inputs
    guards: list = field(default_factory=list)  # the guards, as text, for explain


# Note: a size of 1 in a family. torch's ShapeEnv gives a size symbol the range "2 or more" and
# adds the guard `2 <= s0`: a size of 1 may be a broadcast, which is another program. So a model
# called with prompt lengths 1..512 compiled three programs (the first length, the family, and 1).
# A family is compiled under torch's `backed_size_oblivious` instead (`ones_in_family`), with each
# symbol's range "1 or more" (fusec.symbolic.fake_input): a question "is this size 1?" that
# nothing forces is answered "no" without a guard (torch's size-oblivious reasoning: the code for
# a size of 2 or more computes the right values for 1 too, a loop that runs once). A question
# that decides what is computed (a broadcast between two symbols, a reshape that is a view only
# at 1, the program's own `if x.size(0) == 1`) still guards, as `Ne(x_size0, 1)` or
# `Eq(x_size0, y_size0)`; a call of size 1 then breaks the guard and compiles its own program,
# and the reason names the line that asked (`_asked_if_one`). fusec's own passes ask through
# fusec/sizes.py (is_one, same_size, equal_if_so, ...), which add no such guard. Size 0 stays
# outside every family (the guard `1 <= x.size()[0]`): a kernel over nothing is its own program.
# (The switch is torch's global config, set only while a family compiles.)


@contextmanager
def ones_in_family(on: bool = True):
    """While a shape family compiles (`on`): "is this size 1?" without a reason to ask is "no",
    with no guard (Note: a size of 1 in a family)."""
    import torch.fx.experimental._config as config
    with config.patch(backed_size_oblivious=True) if on else contextlib.nullcontext():
        yield


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


def guard_expression(captured, fixed_apart: bool = False) -> str:
    """The family's guards as one Python expression over `L['t0']`, `L['t1']`... (the flat input
    tensors): the ShapeEnv's guards after compiling (capture, passes, lowering and rendering all
    add theirs) and every static size and stride of the inputs. Storage offsets are left out:
    kernels read through data pointers, which include them. `fixed_apart`: without the inputs
    whose sizes and strides are all fixed (a model's weights), which the caller checks itself
    (the fast path, fusec/fastpath.py, as it checks a static program's inputs)."""
    exprs = _guard_list(captured, fixed_apart)
    return " and ".join(f"({e})" if " or " in e else e for e in exprs) or "True"


def _guard_list(captured, fixed_apart: bool = False) -> list[str]:
    env = captured.shape_env
    fakes = [n.meta["val"] for n in captured.gm.graph.nodes if n.op == "placeholder"]
    with ones_in_family():
        exprs = env.produce_guards(fakes, _sources(len(fakes)), ignore_static=False)
    exprs = _whole_tuples([e for e in exprs if "storage_offset()" not in e], fakes, fixed_apart)
    seen = set()
    for i, fake in enumerate(fakes):  # (no size 0 in a family: Note: a size of 1 in a family)
        for d, n in enumerate(getattr(fake, "shape", ())):
            if isinstance(n, torch.SymInt) and n.node.expr.is_Symbol and n.node.expr not in seen:
                seen.add(n.node.expr)
                if not _bounded_below(exprs, f"L['t{i}'].size()[{d}]"):
                    exprs.append(f"1 <= L['t{i}'].size()[{d}]")
    return exprs


def _bounded_below(exprs: list[str], size: str) -> bool:
    """Whether a guard already says `size` is at least 1 (its range: `2 <= L['t0'].size()[0]`)."""
    low = re.compile(r"(\d+) <= " + re.escape(size) + r"(?![\[\d])")
    return any(int(m.group(1)) >= 1 for e in exprs for m in low.finditer(e))


def _whole_tuples(exprs: list[str], fakes: list, leave_out: bool) -> list[str]:
    """The guards with each input whose sizes and strides are all fixed (a model's weight in a
    family over the batch) checked as two tuples, `L['t0'].size() == (1000, 64)`, instead of one
    guard per number (a call's check compares two tuples per weight, as a static program's does,
    where it indexed every size and stride); or, with `leave_out`, not checked here at all."""
    fixed = {i: f for i, f in enumerate(fakes) if isinstance(f, torch.Tensor)
             and not is_symbolic(tuple(f.shape)) and not is_symbolic(tuple(f.stride()))}
    one = re.compile(r"L\['t(\d+)'\]\.(?:size|stride)\(\)\[\d+\] == -?\d+")
    kept = [e for e in exprs if not ((m := one.fullmatch(e)) and int(m.group(1)) in fixed)]
    for i, f in ({} if leave_out else fixed).items():
        shape, stride = tuple(int(v) for v in f.shape), tuple(int(v) for v in f.stride())
        kept += [f"L['t{i}'].size() == {shape}", f"L['t{i}'].stride() == {stride}"]
    return kept


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
                return expr + _asked_if_one(captured, expr)
        except Exception:  # noqa: BLE001
            continue
    return "a guard of the shape family"


def _asked_if_one(captured, expr: str) -> str:
    """Where the program asked whether a size is 1, when the broken guard is that answer (`x !=
    1`) or the bound `2 <=` it left (Note: a size of 1 in a family): ` (1 is kept out by a question
    asked at integrations/sdpa_attention.py:149)`, so a user sees which line keeps 1 out."""
    import re
    from fusec.symbolic import where_one_left
    found = re.fullmatch(r"2 <= (\w+)\.size\(\)\[(\d+)\]|(\w+)\.size\(\)\[(\d+)\] != 1", expr)
    name = found and f"{found[1] or found[3]}_size{found[2] or found[4]}"
    where = found and where_one_left(captured.shape_env, name)
    return f" (1 is kept out by a question asked at {where})" if where else ""


def _sources(n: int) -> list:
    from torch._dynamo.source import LocalSource
    return [LocalSource(f"t{i}") for i in range(n)]

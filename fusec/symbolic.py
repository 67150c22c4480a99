"""Symbolic sizes: what fusec does with a size that is a torch.SymInt.

A program compiled for a shape family sees its dynamic sizes as symbols (`s0` rows, `64 * s0`
elements) from torch's ShapeEnv. A SymInt computes like an int, and a decision on it
(`if n_rows == 1`) is answered by the size it was traced with and recorded as a guard, which
every later call checks. What a SymInt cannot do is be a dict key; `hashable` gives its sympy
expression for that.
"""
from __future__ import annotations

import contextlib
import warnings

import torch

# A shape family's passes put sizes (SymInts, and SymFloats such as batch norm's n / (n - 1))
# straight into the arguments of the nodes they make (`view(x, [s0, 8, 2, 64])`), which is what
# fusec's program writer prints (inline_sizes.py); torch.fx warns about each such node, with
# advice for Dynamo's own graphs that does not apply here. Only that message is silenced: for the
# whole process, and again around each compile (`raw_sizes_quiet`) for callers such as pytest
# that reset the process's filters.
_RAW_SIZE = r"Raw Sym(Int|Float|Bool) value .* passed as argument to Graph"
warnings.filterwarnings("ignore", message=_RAW_SIZE, category=UserWarning)


@contextlib.contextmanager
def raw_sizes_quiet():
    """Within: torch.fx's warning about a size placed in a node's arguments is not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_RAW_SIZE, category=UserWarning)
        yield


def hashable(x):
    """`x` (an int, a SymInt, or a tuple/list of them) as something a dict can key on: a SymInt
    becomes its sympy expression (`s0`, `64*s0`), which two equal sizes share."""
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return x.node.expr
    if isinstance(x, (tuple, list)):
        return tuple(hashable(v) for v in x)
    return x


def is_symbolic(x) -> bool:
    """True when `x` (a size or a tuple of them) holds a size that is a symbol."""
    if isinstance(x, torch.SymInt):
        return not isinstance(x.node.maybe_as_int(), int)
    if isinstance(x, (tuple, list)):
        return any(is_symbolic(v) for v in x)
    return False


def hint(x):
    """The size `x` was traced with, without a guard: for heuristics only (a thread count, a
    block size), decisions that change how fast a kernel runs, never what it computes. A decision
    that changes the result must compare the SymInt itself, so that the comparison is guarded."""
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return x.node.require_hint() if hasattr(x.node, "require_hint") else x.node.hint
    if isinstance(x, (tuple, list)):
        return type(x)(hint(v) for v in x)
    return x


# ---- sizes in generated code --------------------------------------------------------------------
#
# Note: sizes as symbols in kernels. Lowering and rendering work on SymInts, so every decision
# taken on a size is guarded (a renderer's `if n < 8` holds for the whole shape family or the
# program recompiles). A SymInt prints as its sympy expression over torch's symbol names (`s26`,
# `64*s26`); `c_expr`/`py_expr` print one for C/C++ or Python/Triton where the expression needs
# more than + and * (FloorDiv, Mod, Max). `size_params(ir)` lists the symbols a kernel takes as
# arguments: after its pointers, in sorted order, each an int64 (`int64_t s26` in C++, `s26` in
# Triton, `i64 %s26` in LLVM IR). The program (fusec/runtime/writer.py) binds each symbol once
# per call from an input's size and passes it to every kernel that takes it. `name_sizes` (at
# capture) records which input size each symbol is (`x.size(0)`), for the program and for
# comments in the kernels.

_SYM = (torch.SymInt, torch.SymFloat, torch.SymBool)
_LEAVES = (str, int, float, bool, type(None), torch.dtype, torch.device)
_FIELDS: dict = {}  # dataclass type -> its field names


def symbols_of(obj) -> set:
    """The sympy symbols of every SymInt inside `obj` (an IR, a dataclass, tuples, lists...)."""
    import dataclasses
    out, stack = set(), [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, _LEAVES) and not isinstance(x, _SYM):
            continue
        if isinstance(x, _SYM):
            out |= x.node.expr.free_symbols
        elif isinstance(x, (tuple, list, set, frozenset)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        else:
            names = _FIELDS.get(type(x))
            if names is None:
                names = _FIELDS[type(x)] = tuple(f.name for f in dataclasses.fields(x)) \
                    if dataclasses.is_dataclass(x) and not isinstance(x, type) else ()
            stack.extend(getattr(x, n) for n in names)
    return out


def size_params(ir) -> list[str]:
    """The size arguments a kernel takes (Note: sizes as symbols in kernels), in order: each
    symbol by the name of the input size it is (`x_size0`), in the order of torch's names."""
    names = size_names(_first_env(ir))
    return [names.get(s, s.name) for s in size_symbols(ir)]


def size_symbols(ir) -> tuple:
    """The sympy symbols of `size_params(ir)`, in the same order (torch's names sorted: `s9`
    before `s26`)."""
    return tuple(sorted(symbols_of(ir), key=lambda s: (len(s.name), s.name)))


def _first_env(obj):
    """The ShapeEnv of the first SymInt inside `obj` (an IR, a dataclass...), else None."""
    import dataclasses
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, _SYM):
            return x.node.shape_env
        if isinstance(x, _LEAVES):
            continue
        if isinstance(x, (tuple, list, set, frozenset)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            stack.extend(getattr(x, f.name) for f in dataclasses.fields(x))
    return None


def symbols_in_order(*objs) -> tuple:
    """The symbols of the SymInts in `objs`, in size_params order (the kernel's size arguments
    are those of its IR, whose layouts these are: the same set, so the same order)."""
    found = set()
    for obj in objs:
        found |= symbols_of(obj)
    return tuple(sorted(found, key=lambda s: (len(s.name), s.name)))


def evaluate(obj, values: dict):
    """`obj` (a size, a tuple of them, a Layout...) with every SymInt replaced by its value, given
    {symbol: value} for this call."""
    import dataclasses
    if isinstance(obj, torch.SymInt):
        return int(obj.node.expr.xreplace(values))
    if isinstance(obj, (tuple, list)):
        return type(obj)(evaluate(v, values) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: evaluate(getattr(obj, f.name), values)
                                           for f in dataclasses.fields(obj)})
    return obj


def at_call(x, bindings: list, tensors: list):
    """A size the program returns (`return y, x.shape[0]`: a SymInt of the family), as this
    call's number: each symbol read from where `bindings` (runtime/program.py `size_bindings`)
    says, in the call's input `tensors`."""
    values = {symbol: (tensors[k].shape if kind == "size" else tensors[k].stride())[d]
              for symbol, _, k, kind, d in bindings}
    kind = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(x)]
    return kind(x.node.expr.xreplace(values))


def c_expr(x) -> str:
    """A size (int or SymInt) as a C/C++ expression, its symbols by their names (`x_size0`)."""
    if not isinstance(x, torch.SymInt):
        return str(x)
    from torch.utils._sympy.printers import CppPrinter
    return CppPrinter().doprint(named(x))


def py_expr(x, names: dict | None = None) -> str:
    """A size (int or SymInt) as a Python (and Triton) expression, its symbols by their names
    (`x_size0`), or by `names` ({symbol: local name}) where given."""
    if not isinstance(x, torch.SymInt):
        return str(x)
    from torch.utils._sympy.printers import PythonPrinter
    return PythonPrinter().doprint(named(x, names))


def named(x, names: dict | None = None):
    """The sympy expression of SymInt (or SymFloat) `x` with each symbol renamed to the input size it is
    (`s26` -> `x_size0`, `name_sizes`), so that generated code reads `x_size0 * 64`."""
    return rename(x.node.expr, size_names(x.node.shape_env) if names is None else names)


def rename(expr, names: dict):
    """Sympy expression `expr` with its symbols renamed by `names` ({symbol: name})."""
    if not names:
        return expr
    import sympy
    return expr.xreplace({s: sympy.Symbol(names[s], integer=True, positive=True)
                          for s in expr.free_symbols if s in names})


def text(x) -> str:
    """`x` (a size, a tuple or list of sizes, anything else) as a reader should see it in a
    kernel's source or comments: symbols by their names (`(x_size0, 37)`), the rest as `str`."""
    return str(_readable(x))


class _Said(str):
    """A text that is its own repr, so that a tuple of them prints as `(x_size0, 37)`."""

    def __repr__(self) -> str:
        return str(self)


def _readable(x):
    if isinstance(x, _SYM):
        return _Said(named(x)) if x.node.expr.free_symbols else x.node.expr
    if isinstance(x, (tuple, list)) and any(isinstance(v, (_SYM, tuple, list)) for v in x):
        return type(x)(_readable(v) for v in x)
    return x


def shape_env_of(x):
    """The ShapeEnv behind a SymInt (or the first SymInt inside a tuple or list), else None."""
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return x.node.shape_env
    if isinstance(x, (tuple, list)):
        for v in x:
            env = shape_env_of(v)
            if env is not None:
                return env
    return None


def size_names(env) -> dict:
    """{sympy symbol: where it comes from, as a name (`x_size0`)} for a ShapeEnv (set by capture)."""
    return getattr(env, "fusec_names", None) or {}


def set_size_names(env, names: dict) -> None:
    env.fusec_names = dict(names)


# ---- capture ------------------------------------------------------------------------------------

def fake_mode():
    """A fake tensor mode with a ShapeEnv: sizes traced as symbols compute symbolically, and each
    decision on one is recorded as a guard. Sizes 0 and 1 are never symbols (torch specializes
    them: a broadcast dim is not the same program as a real one)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    env = ShapeEnv()
    env.guards = _Guards(env.guards)
    env.fusec_ones_out = {}  # symbol -> the line whose question kept 1 out of its range
    update = env._update_var_to_range

    def noting_where_one_left(symbol, bounds, *args, **kwargs):  # (an instance's own method)
        if bounds.lower >= 2 and symbol not in env.fusec_ones_out:
            env.fusec_ones_out[symbol] = _decided_at()
        return update(symbol, bounds, *args, **kwargs)
    env._update_var_to_range = noting_where_one_left
    return FakeTensorMode(allow_non_fake_inputs=True, shape_env=env)


def where_one_left(env, name: str) -> str:
    """The line whose question ("is it 1?", "is it more than 1?") kept a size of 1 out of the
    family of symbol `name` (`x_size0`), or "" (Note: a size of 1 in a family, fusec/dynamic.py)."""
    names = size_names(env)
    asked = [where for g, where in guards_with_places(env) if g == f"Ne({name}, 1)"]
    return next((where for sym, where in getattr(env, "fusec_ones_out", {}).items()
                 if names.get(sym, str(sym)) == name), asked[0] if asked else "")


class _Guards(list):
    """The ShapeEnv's list of guards, which also notes where in fusec (or in the user's program)
    each guard was decided: `where[i]` is "file:line" of the deciding line, for explain."""

    def __init__(self, items=()):
        super().__init__(items)
        self.where: list[str] = ["" for _ in self]

    def append(self, guard) -> None:
        super().append(guard)
        self.where.append(_decided_at())


def _decided_at() -> str:
    """The innermost frame outside torch and sympy, and outside capture's wrappers around every
    op (tracing.py, torch_level.py, rnn.py, eager_checks.py, which only pass the call on): the
    line whose comparison made the guard, the user's own line where an op of theirs decided it."""
    import os
    import sys
    frame = sys._getframe(2)
    passing_on = tuple(os.sep + os.path.join("capture", f)
                       for f in ("tracing.py", "torch_level.py", "rnn.py", "eager_checks.py"))
    while frame is not None:
        name = frame.f_code.co_filename
        if not any(part in name for part in (os.sep + "torch" + os.sep, os.sep + "sympy" + os.sep,
                                             "symbolic.py", os.sep + "contextlib", *passing_on)):
            parts = name.split(os.sep)
            short = os.sep.join(parts[-2:])
            return f"{short}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


def guards_with_places(env) -> list[tuple[str, str]]:
    """[(guard as text, where it was decided)] for a ShapeEnv made by `fake_mode`; the guard's
    symbols by their names (`Eq(x_size0, y_size0)`)."""
    where = getattr(env.guards, "where", None) or [""] * len(env.guards)
    return [(str(rename(g.expr, size_names(env))), w) for g, w in zip(env.guards, where)]


def fake_input(mode, t: torch.Tensor, dims=None):
    """`t` as a fake tensor of `mode`: the sizes in `dims` as symbols, every other size as is."""
    if mode.shape_env is None:
        return mode.from_tensor(t)
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext
    dims = set(dims or ())
    ctx = StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC
                       for d in range(t.dim())])
    fake = mode.from_tensor(t, symbolic_context=ctx)
    import torch.fx.experimental._config as config
    if config.backed_size_oblivious:  # (a family: sizes from 1 up, Note: a size of 1 in a family)
        from torch.utils._sympy.numbers import int_oo
        for n in fake.shape:
            if isinstance(n, torch.SymInt) and n.node.expr.is_Symbol:
                mode.shape_env.constrain_symbol_range(n.node.expr, 1, int_oo)
    return fake


def name_sizes(gm):
    """Name every symbol after the first input size or stride it is (Note: sizes as names):
    dim 0 of placeholder `x` is `x_size0`. Returns the ShapeEnv (None when no input has one)."""
    env, names = None, {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for kind, values in (("size", val.shape), ("stride", val.stride())):
            for d, v in enumerate(values):
                if not isinstance(v, torch.SymInt):
                    continue
                # (the symbol the size was created as, and the one it is now: a guard such as
                # Eq(s26, s93) replaces y's s93 by x's s26, but explain still prints s93's)
                for expr in (getattr(v.node, "_expr", None), v.node.expr):
                    if expr is not None and expr.is_Symbol:
                        env = env or v.node.shape_env
                        names.setdefault(expr, f"{node.name}_{kind}{d}")
    if env is not None:
        set_size_names(env, names)
    return env

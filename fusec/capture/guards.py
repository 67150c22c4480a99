"""Guards: the Python state a capture read, written down and checked on every call.

A captured graph is Python run once. Whatever Python values that run read are frozen into it:
`x * self.scale` becomes `mul(x, 2.0)`, `if USE_GELU:` keeps one branch, a closure's mask becomes
a constant tensor. Eager reads them again on every call, so after `m.scale = 5.0` it answers
differently. fusec keeps eager's answer the way TorchDynamo does: it writes down what a capture
read (a *guard* per value), checks those values on every call, and compiles again when one
changed, saying which (`FUSEC_LOG=recompiles`: "self.scale changed: 2.0 -> 5.0").

Why this file is long: finding what a program reads (bytecode and modules), recording it while
capture runs, and writing the checks out as Python are one mechanism, read in that order.

What is read, and how fusec finds out:

    module attributes   `self.scale`, `self.use_gelu`, `self.act = F.gelu`, a submodule's
                        `training`, Dropout's `p`: while capture runs, every module of the
                        program wears a subclass of its class whose `__getattribute__` writes
                        down each plain attribute read (this thread only; the class is put back
                        in `finally`). Exact: only what was read is guarded. A lookup that finds
                        nothing (`getattr(self, "shift", None)`) goes through the subclass's
                        `__getattr__` and is guarded as missing: the fast path checks
                        `hasattr`, and setting it later compiles again.
    globals, closures   `SCALE`, `USE_GELU`, a closure's `scale`: found before capture by reading
                        the bytecode (`dis`) of the compiled function, of the Python functions
                        it reaches through globals and closures, and of the methods of its
                        modules' classes (user code only: not torch's, fusec's, the standard
                        library's or installed packages'). `LOAD_GLOBAL` and `LOAD_DEREF` name
                        what each can read; a name on a branch not taken is guarded too.

    config objects      `self.config.scale`, `CFG.use_gelu`, `cfg.sub.eps`: a plain object (an
                        instance with a `__dict__` that is not a module, tensor, function or
                        class: a config, a dataclass, a namespace) reached by any read above
                        wears a recording subclass too while capture runs, so its attribute
                        reads are written down the same way, and so on into the objects they
                        hold. The object itself is guarded by identity.
    submodules          `self.lin`, `self.layers[0]`, a Sequential's children: not read as
                        attributes (`Module.__getattr__`, a container's `_modules` walk), so the
                        tree itself is guarded: each module's `_modules` dict against a copy
                        taken when the program was compiled (== compares modules by identity),
                        one check per module that has children. `m.lin = nn.Linear(...)`, a
                        layer put into or taken out of a Sequential: compile again, and the
                        parameters are looked for again where the new tree holds them.
    dicts, lists, sets  `self.opts["scale"]`, `SIZES[0]`: a container of constants (up to 64
                        items, nested ones included) is guarded by its contents, since its
                        item reads cannot be seen: any change to it compiles again. A flat
                        one that holds tensors too (`TABLE = {"w": t, "scale": 2.0}`): its
                        tensors by identity, its constants by value (`_items`).
    hooks               a module's forward and backward hooks (and the global ones), which
                        `module(x)` runs: a dict that holds hooks is guarded as the children
                        are; the empty ones together by one guard (`NoHooks`), so a hook
                        registered after compiling, or removed, compiles again.
    defaults, partial,  `__defaults__` of every function read (`def f(x, scale=2.0)`), the
    bound methods       keywords of a compiled `functools.partial`, and the object of a compiled
                        bound method (`obj.apply`: its attribute reads recorded as a config's).
    the environment,    `os.environ.get("FLAG")`, `os.getenv(...)`: each variable the program
    the grad mode       reads, or finds missing (`environment_recorded`); `torch.is_grad_enabled()`
                        (capture/tracing.py, Note: grad mode while tracing).

Each value is checked by its kind, in under 0.1 us on a CPU (56 guards of a 2-layer GPT-2 add
~5 us to a 115 us call; a function that read no state adds nothing, a module its hooks' one):

    a constant          (None, bool, int, float, str, a dtype, a tuple of these ...)
                        its type and `==`:          type(self.scale) is float and self.scale == 2.0
    a container         its type and `==` against   type(self.opts) is dict and
    of constants        a copy taken at capture:    self.opts == {'scale': 2.0}
    a function, class,  identity:                   ACT is gelu
    a module, a config
    a tensor the graph  identity, shape and requires_grad. Not its values: the program reads
    reads as it is      such a tensor (a graph attribute) where it lives on every call, so an
                        in-place update (`mask.add_(1)`) is seen without compiling again

Tensors reached through globals and closures that need gradients (a `Parameter`, `requires_grad`),
and the parameters and buffers of modules reached that way (`lin = nn.Linear(...)` used by
`f = lambda x: lin(x)`), are not baked: they are *lifted*, graph inputs read where they live on
every call like the compiled module's own parameters (`refs`: calls.StateRef, GlobalRef, CellRef,
AttrRef). So autograd sees them, and an optimizer's update or replacement is seen next call.

How a call uses this (fusec/api.py): a program is kept under its input signature *plus* the
values of every guard (`Guards.key()`), so a flag that goes back and forth finds both programs;
the fast path (fusec/fastpath.py) checks the same values inline (`Guards.fast_lines`); a miss
whose signature is known names what changed (`Guards.reason`). A program that reads no Python
state has no guard and pays nothing.

Not guarded (state a captured graph still freezes): the items of a container that holds more
than 64 items, or anything but constants and tensors (a dict of modules, a nested list of
tensors), modules and tensors reached only through such containers, attributes of objects whose class cannot be
swapped (`__slots__`, C types), and functions reached other than through globals, closures and
attributes.
While capture runs, a lifted global or closure tensor holds the traced value: another thread
that reads that same global meanwhile sees it. A module's own parameters do not: capture traces a
copy of the module tree (`tree_copy`), so other threads' calls, eager or compiled, read the real
ones meanwhile.
"""
from __future__ import annotations

import argparse
import contextlib
import dis
import enum
import functools
import os
import sys
import sysconfig
import threading
import types
from typing import Any, Callable

import torch

from torch.utils.hooks import RemovableHandle

from fusec.capture.calls import StateRef, module_state
from fusec.errors import GraphBreakError

_LOCAL = threading.local()  # .recording: the Recording of this thread's capture, or None
_MISSING = type("Missing", (), {"__repr__": lambda self: "<missing>"})()

# nn.Module's own bookkeeping (hooks, `_parameters` ...): not state a program reads
_MODULE_INTERNALS = frozenset({*vars(torch.nn.Module()), *vars(torch.nn.Module)}) - {"training"}
# A module's hooks, which `module(x)` runs around its forward (a capture runs those present):
# `register_forward_hook` after compiling changes the answer. A dict with hooks is guarded as
# the children are (the same ids, the same functions); the empty ones together (`NoHooks`)
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_CONSTANT_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
                   torch.layout, torch.memory_format, enum.Enum)


# ---- where a value lives ------------------------------------------------------------------------

class Source:
    """Where a guarded value lives: a global (`owner` is the globals dict), a closure's cell, or
    a module attribute. `label` is what a reader calls it ("global SCALE", "self.scale")."""

    __slots__ = ("kind", "owner", "name", "label")

    def __init__(self, kind: str, owner, name: str, label: str):
        self.kind, self.owner, self.name, self.label = kind, owner, name, label

    @property
    def key(self) -> tuple:
        return (self.kind, id(self.owner), self.name)

    def read(self):
        """The value now (`_MISSING` if it is gone)."""
        try:
            if self.kind == "global":
                return self.owner[self.name]
            if self.kind == "cell":
                return self.owner.cell_contents
            return getattr(self.owner, self.name)
        except (KeyError, ValueError, AttributeError):
            return _MISSING

    def present(self, var: str) -> str:
        """Python that is true when there is a value to read (`read` would not give `_MISSING`):
        an unset environment variable that a library looks up with `os.environ.get` is guarded
        as staying unset, one `in` per call, where a fast path used to give up on such a
        program and send every call through the general path."""
        if self.kind == "global":
            return f"{self.name!r} in {var}"
        if self.kind == "cell":
            return f"_filled({var})"
        return f"hasattr({var}, {self.name!r})"

    def expression(self, var: str) -> str:
        """Python that reads the value, with the owner in variable `var`."""
        if self.kind == "global":
            return f"{var}[{self.name!r}]"
        if self.kind == "cell":
            return f"{var}.cell_contents"
        return f"{var}.{self.name}" if self.name.isidentifier() else f"getattr({var}, {self.name!r})"


def _filled(cell) -> bool:
    """Whether a closure's cell holds a value (an empty one raises ValueError when read)."""
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


class GlobalRef:
    """A lifted tensor that a global holds: read as `owner[name]` (owner: the globals dict)."""

    is_param = False

    def __init__(self, name: str, owner: dict, attr: str):
        self.name, self.owner, self.attr = name, owner, attr

    def get(self):
        return self.owner[self.attr]

    def set(self, value) -> None:
        self.owner[self.attr] = value

    def expression(self, var: str) -> str:
        return f"{var}[{self.attr!r}]"


class CellRef:
    """A lifted tensor that a closure's cell holds."""

    is_param = False

    def __init__(self, name: str, owner):
        self.name, self.owner, self.attr = name, owner, "cell_contents"

    def get(self):
        return self.owner.cell_contents

    def set(self, value) -> None:
        self.owner.cell_contents = value

    def expression(self, var: str) -> str:
        return f"{var}.cell_contents"


class AttrRef:
    """A lifted tensor held as a plain module attribute (not a parameter nor a buffer)."""

    is_param = False

    def __init__(self, name: str, owner: torch.nn.Module, attr: str):
        self.name, self.owner, self.attr = name, owner, attr

    def get(self):
        return vars(self.owner)[self.attr]

    def set(self, value) -> None:
        vars(self.owner)[self.attr] = value

    def expression(self, var: str) -> str:
        return f"{var}.__dict__[{self.attr!r}]"


@contextlib.contextmanager
def substituted(refs: list, tensors) -> Any:
    """While tracing: each lifted state `ref` holds its traced tensor, so the program's reads of
    the global, closure or module reach the graph input; the real tensors are put back after."""
    if not refs:
        yield
        return
    old = [ref.get() for ref in refs]
    try:
        for ref, t in zip(refs, tensors):
            ref.set(t)
        yield
    finally:
        for ref, t in zip(reversed(refs), reversed(old)):
            ref.set(t)


# ---- what a value's guard checks ----------------------------------------------------------------

def _is_constant(value) -> bool:
    if type(value) in (tuple, frozenset):
        return all(_is_constant(v) for v in value)
    return isinstance(value, _CONSTANT_TYPES)


CONTAINER_LIMIT = 64  # items (nested ones counted) up to which a container is guarded by contents


def _freeze(value, budget: list):
    """A container of constants as nested tuples (hashable, for the program's key), or raise
    TypeError when it holds something else or more than CONTAINER_LIMIT items."""
    if type(value) in (list, tuple, dict, set, frozenset):
        budget[0] -= len(value)
        if budget[0] < 0:
            raise TypeError("too many items")
        if type(value) is dict:
            return (dict, tuple((_freeze(k, budget), _freeze(v, budget)) for k, v in value.items()))
        if type(value) in (set, frozenset):
            return (type(value), frozenset(_freeze(v, budget) for v in value))
        return (type(value), tuple(_freeze(v, budget) for v in value))
    if _is_constant(value):
        return value
    raise TypeError(f"holds a {type(value).__name__}")


def freeze(value):
    """A container's contents as a key part (see _freeze)."""
    return _freeze(value, [CONTAINER_LIMIT])


_FOREIGN_MODULES = ("torch", "fusec", "builtins", "triton", "numpy", "typing", "types", "enum")


def _is_plain_object(value) -> bool:
    """A config-like object whose attribute reads can be recorded: an instance with its own
    `__dict__`, of a class that is not a module, tensor, function, class or container, and is
    not torch's, fusec's or the standard library's own."""
    cls = type(value)
    if isinstance(value, (torch.Tensor, torch.nn.Module, type, types.ModuleType, types.FunctionType,
                          types.MethodType, types.BuiltinFunctionType, functools.partial,
                          list, tuple, dict, set, frozenset)) or _is_constant(value):
        return False
    module = (getattr(cls, "__module__", None) or "builtins").split(".")[0]
    if module in _FOREIGN_MODULES or module in sys.stdlib_module_names and module != "__main__":
        return cls is types.SimpleNamespace or cls is argparse.Namespace
    try:
        return isinstance(object.__getattribute__(value, "__dict__"), dict)
    except AttributeError:
        return False


def _kind(value) -> str | None:
    """How a value is guarded: "value", "container", "identity", "tensor" (baked), or None
    (not guarded)."""
    if isinstance(value, torch.Tensor):
        return None if _is_traced(value) else "tensor"
    if _is_constant(value):
        return "value"
    if type(value) in (list, dict, set, tuple):
        try:
            freeze(value)
            return "container"
        except TypeError:
            return "items" if type(value) is not set and len(value) <= CONTAINER_LIMIT and all(
                _is_constant(v) or isinstance(v, torch.Tensor) and not _is_traced(v)
                for v in (value.values() if type(value) is dict else value)) else None
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type,
                          functools.partial, torch.nn.Module, torch._ops.OpOverloadPacket,
                          torch._ops.OpOverload)) or _is_plain_object(value):
        return "identity"
    return None


def _items(container) -> tuple:
    """A flat list, tuple or dict of tensors and constants as a key part: each tensor by
    identity (the graph reads the one it was traced with), each constant by type and value.
    `TABLE["w"] = torch.zeros(8)` or `LAYERS[0] = t` changes it."""
    items = container.items() if type(container) is dict else enumerate(container)
    return (type(container), tuple((k, id(v)) if isinstance(v, torch.Tensor) else (k, type(v), v)
                                   for k, v in items))


def _is_traced(t) -> bool:
    from fusec.capture.tracing import is_traced as traced
    return traced(t)


def _encode(kind: str, value, keep: dict):
    """The value as it enters a program's key (hashable, cheap to compare)."""
    if value is _MISSING:
        return _MISSING
    if kind == "value":
        return (type(value), value)
    if kind == "container":
        return freeze(value)
    if kind == "items":  # (the tensors are kept alive: their ids sit in the key)
        keep.update((id(v), v) for v in (value.values() if type(value) is dict else value)
                    if isinstance(v, torch.Tensor))
        return _items(value)
    if kind == "children":  # (name, id) of each child; the children are kept alive
        keep.update((id(child), child) for child in value.values())
        return tuple((name, id(child)) for name, child in value.items())
    keep[id(value)] = value  # (kept alive: its id must stay its own while a key holds it)
    if kind == "tensor":
        return (id(value), tuple(value.shape), value.requires_grad) \
            if isinstance(value, torch.Tensor) else (id(value), None, None)
    return id(value)


class Values(tuple):
    """The guards' part of a program's key: one entry per guard, in order."""


# ---- finding what a program can read, before capture ------------------------------------------

_TORCH_DIR = os.path.dirname(torch.__file__)
_FUSEC_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + os.sep


@functools.lru_cache(maxsize=1024)
def _user_code(filename: str) -> bool:
    """The user's own code (a script, a notebook cell, a package being developed): not torch,
    fusec, the standard library, an installed package, nor generated code (fx, fast paths)."""
    if filename.startswith("<"):
        return filename in ("<stdin>", "<string>") or filename.startswith("<ipython-input")
    path = os.path.abspath(filename)
    return not (path.startswith(_TORCH_DIR) or path.startswith(_FUSEC_DIR)
                or path.startswith(_STDLIB_DIR) or os.sep + "site-packages" + os.sep in path
                or os.sep + "dist-packages" + os.sep in path)


@functools.lru_cache(maxsize=4096)
def _reads(code: types.CodeType) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(globals, closure variables) that `code` and the functions defined in it can read."""
    names, cells = [], []
    for ins in dis.get_instructions(code):
        if ins.opname == "LOAD_GLOBAL":
            names.append(ins.argval)
        elif ins.opname in ("LOAD_DEREF", "LOAD_CLASSDEREF") and ins.argval in code.co_freevars \
                and ins.argval != "__class__":  # (zero-argument `super()`'s)
            cells.append(ins.argval)
    for const in code.co_consts:  # a lambda or inner function: its globals are ours; its free
        if isinstance(const, types.CodeType):  # variables are ours when they pass through us
            inner_names, inner_cells = _reads(const)
            names += inner_names
            cells += [c for c in inner_cells if c in code.co_freevars]
    return tuple(dict.fromkeys(names)), tuple(dict.fromkeys(cells))


def _writes(code: types.CodeType) -> list[tuple[str, bool]]:
    """(name, is a closure variable) of each global and outer variable `code` (or a function
    defined in it) assigns or deletes."""
    found = [(ins.argval, ins.opname.endswith("DEREF")) for ins in dis.get_instructions(code)
             if ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL") or ins.opname in (
                 "STORE_DEREF", "DELETE_DEREF") and ins.argval in code.co_freevars]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found += [(n, cell) for n, cell in _writes(const) if not cell or n in code.co_freevars]
    return list(dict.fromkeys(found))


def _refuse_writes(written: list[tuple]) -> None:
    """After a capture: a global or closure variable that the program assigned while traced
    (a call counter, a cache filled on the first call) would be assigned once, while tracing,
    and never by the compiled program. Put the old values back and raise a GraphBreakError: in
    regions, TorchDynamo replays such assignments on every call, as eager does."""
    changed = [(source, value) for source, value in written if source.read() is not value]
    for source, value in changed:
        if source.kind == "global":
            source.owner.pop(source.name, None) if value is _MISSING else \
                source.owner.__setitem__(source.name, value)
        elif value is not _MISSING:
            source.owner.cell_contents = value
    if changed:
        names = ", ".join(source.label for source, _ in changed)
        raise GraphBreakError(
            f"fusec: the program assigns {names} while it runs; a captured graph would do that "
            "once, while tracing, and never again", reason=f"the program assigns {names}")


def _refuse_changed_containers(containers: list[tuple]) -> None:
    """After a capture: a list, dict or set the program read and then changed in place
    (`self.seen.append(n)`, `self.stats["calls"] += 1`, `CACHE[key] = y`) was changed once,
    while tracing, and would never be again by the compiled program (and the guard on its
    contents, taken after, would not notice). Put the contents back and raise a
    GraphBreakError: in regions, TorchDynamo replays such changes on every call, as eager does."""
    changed = []
    for source, container, then in containers:
        if type(container) is list:
            same = len(container) == len(then) and all(a is b for a, b in zip(container, then))
        elif type(container) is dict:
            same = container.keys() == then.keys() and all(container[k] is then[k] for k in then)
        else:
            same = container == then
        if not same:
            changed.append(source.label)
            if type(container) is list:
                container[:] = then
            else:
                container.clear()
                container.update(then)
    if changed:
        names = ", ".join(changed)
        raise GraphBreakError(
            f"fusec: the program changes {names} in place while it runs (append, item "
            "assignment); a captured graph would do that once, while tracing, and never again",
            reason=f"the program changes {names} in place")


class Discovery:
    """What a program can reach from Python, found without running it (see the module docstring):
    `static` guards (globals and closure values: (source, kind, value)), `reached` state to lift
    (refs), and every module the program can run (`labels`: id -> (module, "self.block"))."""

    def __init__(self, fn: Callable):
        self.static: list[tuple] = []
        self.reached: list = []
        self.labels: dict[int, tuple] = {}
        self._lifted: set[int] = set()
        self._code: set = set()
        self._static_keys: set = set()
        self._classes: set = set()
        self.writes: list[Source] = []  # globals and closure variables the program assigns
        if isinstance(fn, torch.nn.Module):
            self._lifted.update(id(ref.get()) for ref in module_state(fn))
            self.module(fn, "self", own=True)
        elif isinstance(fn, types.MethodType):
            if isinstance(fn.__self__, torch.nn.Module):
                self.module(fn.__self__, "self", own=False)
            elif _is_plain_object(fn.__self__):  # (a method of the user's own object: its
                # attribute reads are recorded as a config's are, `self.scale` guarded)
                self.static.append((Source("attr", fn, "__self__", "self"), "identity",
                                    fn.__self__))
            self.function(fn.__func__)
        elif isinstance(fn, functools.partial):  # (its keywords dict can change: each value
            if fn.keywords:                       # guarded by identity, as a module's children)
                self.static.append((Source("children", fn, "keywords", "partial keywords"),
                                    _kind(fn.keywords) or "children", fn.keywords))
            self.function(fn.func)
        else:
            self.function(fn)

    def module(self, module: torch.nn.Module, label: str, own: bool) -> None:
        """A module the program runs: its attributes are recorded while capture runs, its classes'
        methods are read for globals, and (when reached, not compiled) its state is lifted."""
        if id(module) in self.labels:
            return
        for prefix, sub in module.named_modules(remove_duplicate=False):
            if id(sub) in self.labels:
                continue
            name = f"{label}.{prefix}" if prefix else label
            self.labels[id(sub)] = (sub, name)
            for attr, value in vars(sub).items():  # plain tensor attributes that need grad
                if isinstance(value, torch.Tensor) and value.requires_grad \
                        and id(value) not in self._lifted:
                    self._lifted.add(id(value))
                    self.reached.append(AttrRef(f"{name}.{attr}", sub, attr))
            for klass in type(sub).__mro__:
                if klass in self._classes or klass is torch.nn.Module or klass is object:
                    continue
                self._classes.add(klass)
                for attr, member in vars(klass).items():
                    if attr.startswith("__") and attr != "__call__":
                        continue  # (`__init__` runs once, not on each call)
                    member = getattr(member, "__func__", getattr(member, "fget", member))
                    if isinstance(member, types.FunctionType):
                        self.function(member)
        if not own:
            for ref in module_state(module):
                if id(ref.get()) not in self._lifted:
                    self._lifted.add(id(ref.get()))
                    self.reached.append(StateRef(f"{label}.{ref.name}", ref.owner, ref.attr,
                                                 ref.is_param))

    def function(self, fn) -> None:
        """A Python function the program can call: what its bytecode can read."""
        code = getattr(fn, "__code__", None)
        if not isinstance(code, types.CodeType) or code in self._code \
                or not _user_code(code.co_filename):
            return
        self._code.add(code)
        names, cells = _reads(code)
        space = fn.__globals__
        for name, in_cell in _writes(code):  # (`global CALLS; CALLS += 1`, `nonlocal step`)
            self.writes.append(Source("cell", fn.__closure__[code.co_freevars.index(name)], name,
                                      f"closure variable {name}") if in_cell
                               else Source("global", space, name, f"global {name}"))
        for name in names:
            if name in space:
                self.value(Source("global", space, name, f"global {name}"), space[name], name)
        for attr in ("__defaults__", "__kwdefaults__"):  # `def f(x, scale=2.0, sizes=[4])`
            value = getattr(fn, attr, None)
            if value:  # (a tuple or dict of constants by contents, else the object itself)
                source = Source("attr", fn, attr, f"{fn.__qualname__}.{attr}")
                if source.key not in self._static_keys:
                    self._static_keys.add(source.key)
                    self.static.append((source, _kind(value) or "identity", value))
        closure = fn.__closure__ or ()
        for name in cells:
            cell = closure[code.co_freevars.index(name)]
            try:
                value = cell.cell_contents
            except ValueError:  # not assigned yet
                continue
            self.value(Source("cell", cell, name, f"closure variable {name}"), value, name)

    def value(self, source: Source, value, name: str) -> None:
        """A global's or closure's value: lifted, guarded, followed, or none of these."""
        if isinstance(value, types.ModuleType):
            return  # `torch`, `F`, `math`
        if isinstance(value, torch.Tensor) and (isinstance(value, torch.nn.Parameter)
                                                or value.requires_grad):
            if id(value) not in self._lifted:
                self._lifted.add(id(value))
                self.reached.append(GlobalRef(name, source.owner, name) if source.kind == "global"
                                    else CellRef(name, source.owner))
            return
        kind = _kind(value)
        if kind is not None and source.key not in self._static_keys:
            self._static_keys.add(source.key)
            self.static.append((source, kind, value))
        if isinstance(value, torch.nn.Module):
            self.module(value, name, own=False)
        elif isinstance(value, types.FunctionType):
            self.function(value)


# ---- recording module attributes while capture runs -------------------------------------------

class Recording:
    """What one capture read: source key -> (source, kind, value), first read wins."""

    def __init__(self, guards: "Guards"):
        self.guards = guards
        self.seen: dict[tuple, tuple] = {}
        self.key: tuple = ()  # the guards' part of the program's key, once capture is done
        self.swapped: list[tuple] = []  # (object, its own class): put back when capture ends
        self.objects: dict[int, str] = {}  # id of a config-like object watched -> its label
        self.originals: dict[int, Any] = {}  # id of a module's copy (tree_copy) -> the module
        self.containers: list[tuple] = []  # (list/dict/set read, a copy of it then)

    def add(self, source: Source, kind: str, value) -> None:
        if source.key not in self.seen:
            self.seen[source.key] = (source, kind, value)
            if kind in ("container", "items") and type(value) in (list, dict, set):
                self.containers.append((source, value, type(value)(value)))
        if kind == "identity" and _is_plain_object(value):
            self.watch(value, source.label.split(" ")[-1])

    def grad_mode_read(self, value: bool) -> None:
        """The program asked `torch.is_grad_enabled()` and was told `value` (capture/tracing.py,
        Note: grad mode while tracing): a guard, so a call under the other mode compiles again."""
        self.add(Source("attr", GRAD_MODE, "enabled", "torch.is_grad_enabled()"), "value", value)

    def watch(self, obj, label: str) -> None:
        """Record `obj`'s attribute reads from now on (it wears a recording subclass until the
        capture ends)."""
        if id(obj) in self.objects:
            return
        self.objects[id(obj)] = label
        cls = type(obj)
        if getattr(cls, "_fusec_recording", False):
            return  # (a capture inside a capture: already recording)
        try:
            obj.__class__ = _recording_class(cls)
        except TypeError:  # a C type (SimpleNamespace): all its attributes are guarded instead
            if _kind(vars(obj)) == "container":
                self.add(Source("attr", obj, "__dict__", f"vars({label})"), "container", vars(obj))
            return
        self.swapped.append((obj, cls))

    def attribute(self, module, name: str, value) -> None:
        """`module.name` was read (by the program, or by torch's module code it runs); `module`
        may also be a config-like object (see `watch`), or a copy `tree_copy` made: the
        original is guarded (the copy has the same attributes, and never changes)."""
        module = self.originals.get(id(module), module)
        if name.startswith("__") or isinstance(module, torch.nn.Module) and (
                name in _MODULE_INTERNALS or  # (training: in the signature)
                (name == "training" and module is self.guards.module)):
            return
        if name not in object.__getattribute__(module, "__dict__"):
            for klass in type(module).__mro__:  # a class attribute, or computed (property,
                if name in vars(klass):         # method: what it reads is recorded itself)
                    if hasattr(type(vars(klass)[name]), "__get__"):
                        return
                    break
            else:
                return
        kind = _kind(value)
        if kind is None:
            return
        labels = self.guards.discovery.labels
        owner = labels[id(module)][1] if id(module) in labels else \
            self.objects.get(id(module), type(module).__name__)
        self.add(Source("attr", module, name, f"{owner}.{name}"), kind, value)

    def missing(self, obj, name: str) -> None:
        """`obj.name` was looked up and is not there (`getattr(self, "shift", None)`): guarded
        as missing, so that setting it later compiles again instead of running the program
        that assumed it absent."""
        obj = self.originals.get(id(obj), obj)
        labels = self.guards.discovery.labels
        if name.startswith("__") or isinstance(obj, torch.nn.Module) and name in _MODULE_INTERNALS \
                or (id(obj) not in labels and id(obj) not in self.objects):
            return  # (an object the capture made, a ModuleList slice being filled: no state)
        owner = labels[id(obj)][1] if id(obj) in labels else \
            self.objects.get(id(obj), type(obj).__name__)
        self.add(Source("attr", obj, name, f"{owner}.{name}"), "value", _MISSING)


_RECORDING_CLASSES: dict[type, type] = {}


def _recording_class(cls: type) -> type:
    """cls with a `__getattribute__` that tells this thread's Recording about each read."""
    sub = _RECORDING_CLASSES.get(cls)
    if sub is None:
        base = cls.__getattribute__

        def __getattribute__(self, name):
            value = base(self, name)
            recording = getattr(_LOCAL, "recording", None)
            if recording is not None:
                recording.attribute(self, name, value)
            return value
        found = getattr(cls, "__getattr__", None)  # (nn.Module's: parameters, submodules)

        def __getattr__(self, name):  # after __getattribute__ failed: the last word
            try:  # (without a __getattr__ of its own: __getattribute__'s error, as it was)
                return base(self, name) if found is None else found(self, name)
            except AttributeError:
                recording = getattr(_LOCAL, "recording", None)
                if recording is not None:
                    recording.missing(self, name)
                raise
        sub = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__,
                                          "__getattr__": __getattr__,
                                          "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__,
                                          "_fusec_recording": True})
        _RECORDING_CLASSES[cls] = sub
    return sub


def tree_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of the module tree to trace, sharing everything but the dicts that hold the
    parameters, buffers and children: functional_call puts the traced tensors into the copy's
    dicts, where no other thread looks (the module's own stay as they are: Note at the top).
    Attribute reads on the copies are guarded on the originals (`Recording.originals`). A
    module whose instances have no `__dict__` to copy is traced itself, as before."""
    recording = getattr(_LOCAL, "recording", None)
    copies: dict[int, torch.nn.Module] = {}

    def copy(m):
        if id(m) not in copies:
            c = copies[id(m)] = object.__new__(type(m))
            vars(c).update(vars(m))
            vars(c).update({k: list(v) for k, v in vars(m).items()  # (an RNN's _flat_weights)
                            if type(v) is list and v and all(isinstance(t, torch.Tensor) or t is None
                                                             for t in v)})
            vars(c).update(_parameters=dict(m._parameters), _buffers=dict(m._buffers),
                           _modules={name: None if sub is None else copy(sub)
                                     for name, sub in m._modules.items()})
            if recording is not None:
                recording.originals[id(c)] = m
            kept = getattr(_LOCAL, "copies", None)
            if kept is not None:
                kept.append((m, c))
        return copies[id(m)]
    try:
        return copy(module)
    except (TypeError, AttributeError):  # (`__slots__`, a C type: no __dict__ to copy)
        return module


@contextlib.contextmanager
def copies_made():
    """Within: the (module, copy) pairs `tree_copy` makes on this thread, listed, so that the
    caller can see what tracing wrote onto the copies (frontend.py `written_attributes`)."""
    outer = getattr(_LOCAL, "copies", None)
    _LOCAL.copies = pairs = []
    try:
        yield pairs
    finally:
        _LOCAL.copies = outer


class NoHooks:
    """One guard for the many hook dicts of a module tree that were empty when it was compiled
    (a module's forward and backward hooks, and the global ones): `ids` is () while they all
    are, else the ids of the hooks each holds. Every hook torch registers takes a new id
    (`RemovableHandle.next_id`), so while none has hooks the dicts are looked at again only
    when that counter moved: one int compare per call."""

    def __init__(self):
        self.tables: list[dict] = []
        self.seen = -1
        self.answer: tuple = ()

    def watch(self, tables: list[dict]) -> None:
        self.tables, self.seen = tables, -1

    @property
    def ids(self) -> tuple:
        now = RemovableHandle.next_id
        if now != self.seen or self.answer:  # (a hook's removal moves no counter)
            self.answer = tuple((i, tuple(t)) for i, t in enumerate(self.tables) if t)
            self.seen = now
        return self.answer


# Environment variables: `os.environ.get("USE_FAST_GELU")` or `os.getenv(...)` in the program
# reads the environment on every call in eager, and only while tracing in a capture. While any
# capture records, `os.environ` wears a subclass whose reads, made while tracing by the program
# (code in a user file: not torch's, fusec's or the standard library's), are guarded as a
# global's are: the variable's value, or that it is missing (`Source("global", os.environ,
# name)`). A missing one turns the fast path off for that program (fusec/fastpath.py).
_ENVIRON = {"lock": threading.Lock(), "depth": 0, "class": type(os.environ)}


class _RecordingEnviron(type(os.environ)):
    def __getitem__(self, name):
        recording = getattr(_LOCAL, "recording", None)
        if recording is None:
            return super().__getitem__(name)
        from fusec.capture.tracing import is_user_file, tracing_here
        if not tracing_here():  # (fusec's own reads while it compiles, its programs' runs)
            return super().__getitem__(name)
        frame = sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename in _ENVIRON_FILES or
                                     frame.f_code.co_filename.startswith("<frozen ")):
            frame = frame.f_back  # (past `os.getenv` and `Mapping.get`, to their caller)
        if frame is None or not is_user_file(frame.f_code.co_filename):
            return super().__getitem__(name)
        source = Source("global", self, name, f"os.environ[{name!r}]")
        try:
            value = super().__getitem__(name)
        except KeyError:
            recording.add(source, "value", _MISSING)  # (guarded as missing)
            raise
        recording.add(source, "value", value)
        return value


_ENVIRON_FILES = {os.__file__, __import__("_collections_abc").__file__}


@contextlib.contextmanager
def environment_recorded():
    """Within: the program's reads of `os.environ` are guards (see above). Re-entrant, and
    thread-safe: the class is swapped while any recording runs."""
    with _ENVIRON["lock"]:
        if _ENVIRON["depth"] == 0:
            os.environ.__class__ = _RecordingEnviron
        _ENVIRON["depth"] += 1
    try:
        yield
    finally:
        with _ENVIRON["lock"]:
            _ENVIRON["depth"] -= 1
            if _ENVIRON["depth"] == 0:
                os.environ.__class__ = _ENVIRON["class"]


class _GradMode:
    """`torch.is_grad_enabled()` read as an attribute (`GRAD_MODE.enabled`), so that it is
    guarded like any other value a program read (capture/tracing.py, Note: grad mode while
    tracing)."""

    @property
    def enabled(self) -> bool:
        return torch.is_grad_enabled()


GRAD_MODE = _GradMode()


# ---- the guards of one compiled function ----------------------------------------------------------

class Guards:
    """Every guard a CompiledFunction's captures needed (their union, in the order found), and
    the state it lifts. Inert for fusec's own pieces (a GraphModule: training's and Dynamo's)."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.module = fn if isinstance(fn, torch.nn.Module) else None
        self.active = not isinstance(fn, torch.fx.GraphModule)
        self.entries: list[tuple[Source, str]] = []  # (source, kind)
        self._index: dict[tuple, int] = {}
        self._keep: dict[int, Any] = {}  # objects whose ids sit in keys
        self._last: dict[tuple, Values] = {}  # a signature -> the guard values it last compiled
        self._rekeyed: dict[tuple, tuple] = {}  # a key before its compile -> the key after
        self._values: Callable[[], Values] = lambda: Values()
        self.discovery = Discovery(fn) if self.active else None
        self.own = module_state(fn) if self.module is not None else []
        self.reached = list(self.discovery.reached) if self.active else []
        self.refs = self.own + self.reached  # what the program lifts: own state, then reached
        self._no_hooks = NoHooks()
        self._guard_tree()

    def _guard_tree(self) -> None:
        """A guard on each `_modules` dict of the module's tree (see "submodules" above), for
        the tree as it is now: after a change, the new subtree's modules are guarded too."""
        if self.module is None or not self.active:
            return
        empty = [getattr(torch.nn.modules.module, f"_global{name}") for name in _HOOK_DICTS]
        for prefix, parent in self.module.named_modules(remove_duplicate=False):
            label = f"self.{prefix}" if prefix else "self"
            sources = [Source("children", parent, "_modules", label)] if parent._modules else []
            for hooks in _HOOK_DICTS:
                table = getattr(parent, hooks, None)
                if table:  # (hooks now: this dict guarded as the children are)
                    sources.append(Source("children", parent, hooks, f"{label}.{hooks}"))
                elif isinstance(table, dict):
                    empty.append(table)
            for source in sources:
                if source.key not in self._index:
                    self._index[source.key] = len(self.entries)
                    self.entries.append((source, "children"))
        source = Source("attr", self._no_hooks, "ids", "the module's hooks (none when compiled)")
        self._no_hooks.watch([d for d in empty if not d])
        if source.key not in self._index:
            self._index[source.key] = len(self.entries)
            self.entries.append((source, "value"))
        self._values = self._make_values()

    def key(self) -> tuple:
        """The guards' part of a program's key: `()` when there is no guard, else the values now."""
        return (self._values(),) if self.entries else ()

    def moved(self) -> bool:
        """Look again (before compiling): do globals and closures now reach other state to lift
        (`lin` rebound to another module)? Then `refs` changes and the caller starts again."""
        if not self.active:
            return False
        self.discovery = Discovery(self.fn)
        reached = self.discovery.reached
        own = module_state(self.module) if self.module is not None else []
        where = lambda refs: [(type(r), id(r.owner), r.attr) for r in refs]  # noqa: E731
        if where(reached) == where(self.reached) and where(own) == where(self.own):
            return False
        self.own, self.reached = own, list(reached)
        self.refs = own + self.reached
        self._guard_tree()
        return True

    def rekeyed(self, key: tuple) -> tuple:
        """The key a program compiled under `key` is kept under (see `recording`)."""
        return self._rekeyed.get(key, key)

    def compiled_meanwhile(self, key: tuple) -> tuple:
        """`key`, or the key of the program another thread compiled for it while this one
        waited (its capture found guards that `key`, made before, lacks), if the state still
        has the values that program was compiled for."""
        new = self._rekeyed.get(key)
        if new is None or new == key:
            return key
        values = next((k for k in new if type(k) is Values), None)
        return new if values is not None and values == self._values() else key

    @contextlib.contextmanager
    def recording(self, key: tuple):
        """Around one compile for `key` (a signature and the guard values known before it):
        write down what it reads. Afterwards `recording.key` is the key to keep the program
        under: the guards' part holds the values it was compiled for, of every guard so far."""
        recording = Recording(self)
        recording.key = key
        if not self.active:
            yield recording
            return
        discovery = self.discovery = Discovery(self.fn)  # (a global may hold a new function)
        for source, kind, _ in discovery.static:
            value = source.read()  # now, as the capture will see it
            if value is not _MISSING:
                recording.add(source, kind, value)
        for module, _ in discovery.labels.values():
            cls = type(module)
            if getattr(cls, "_fusec_recording", False):
                continue  # (a capture inside a capture: already recording)
            try:
                module.__class__ = _recording_class(cls)
            except TypeError:  # (a class whose layout forbids it: its attributes go unguarded)
                continue
            recording.swapped.append((module, cls))
        outer = getattr(_LOCAL, "recording", None)
        _LOCAL.recording = recording
        written = [(source, source.read()) for source in discovery.writes]
        try:
            with environment_recorded():
                yield recording
        finally:
            _LOCAL.recording = outer
            for obj, cls in reversed(recording.swapped):
                obj.__class__ = cls
        _refuse_writes(written)
        _refuse_changed_containers(recording.containers)
        for source, kind, value in recording.seen.values():
            if source.key not in self._index:
                self._index[source.key] = len(self.entries)
                self.entries.append((source, kind))
            if kind != "value":
                self._keep[id(value)] = value
        self._values = self._make_values()
        now = self._values() if self.entries else Values()
        values = Values(_encode(kind, recording.seen[source.key][2], self._keep)
                        if source.key in recording.seen else now[i]
                        for i, (source, kind) in enumerate(self.entries))
        signature = tuple(k for k in key if type(k) is not Values)
        if not self.entries:
            recording.key = signature
        elif any(type(k) is Values for k in key):
            recording.key = tuple(values if type(k) is Values else k for k in key)
        else:
            recording.key = key + (values,)
        self._last[signature] = values
        if len(self._rekeyed) > 64:
            self._rekeyed.clear()
        self._rekeyed[key] = recording.key

    def _make_values(self) -> Callable[[], Values]:
        """`values()`: every guarded value now, encoded, as straight-line Python."""
        glob = {"Values": Values, "slow": self._slow_values, "_id": id, "_freeze": freeze,
                "_children": lambda d: _encode("children", d, self._keep), "_items": _items}
        reads, parts = [], []
        for i, (source, kind) in enumerate(self.entries):
            glob[f"s{i}"] = source.owner
            reads.append(f"v{i} = {source.expression(f's{i}')}")
            parts.append({"value": f"(type(v{i}), v{i})", "identity": f"_id(v{i})",
                          "container": f"_freeze(v{i})", "children": f"_children(v{i})",
                          "items": f"_items(v{i})",
                          "tensor": f"(_id(v{i}), tuple(v{i}.shape), v{i}.requires_grad)"}[kind])
        body = "".join(f"        {r}\n" for r in reads)
        source = (f"def values():\n    try:\n{body}"
                  f"        return Values(({', '.join(parts)}{',' if len(parts) == 1 else ''}))\n"
                  "    except Exception:\n        return slow()\n")
        exec(compile(source, "<fusec guard values>", "exec"), glob)
        return glob["values"]

    def _slow_values(self) -> Values:
        """values(), one guard at a time (some value is gone, or is not what it was)."""
        out = []
        for source, kind in self.entries:
            value = source.read()
            try:
                out.append(_encode(kind, value, {}) if value is not _MISSING else _MISSING)
            except Exception:  # noqa: BLE001 (a tensor where a number was: it changed)
                out.append(_MISSING)
        return Values(out)

    def fast_lines(self, key: tuple) -> tuple[list[str], dict]:
        """(lines, their globals) for the fast path of the program kept under `key`
        (fusec/fastpath.py): each guard's value now against the one the program was compiled
        for; any difference, or a value that is gone, returns MISS. No line when the program
        has no guard."""
        values = next((k for k in key if type(k) is Values), None)
        glob: dict = {}
        if not values:
            return [], glob
        lines = ["try:"]
        for i, ((source, kind), value) in enumerate(zip(self.entries, values)):
            glob[f"g_s{i}"] = source.owner
            read = source.expression(f"g_s{i}")
            if value is _MISSING:  # (compiled while it was missing: it must still be)
                glob["_filled"] = _filled
                lines += [f"    if {source.present(f'g_s{i}')}:", "        return MISS"]
                continue
            if kind == "value":
                typ, const = value
                glob[f"g_c{i}"], glob[f"g_t{i}"] = const, typ
                if const is None or typ is bool:
                    test = f"{read} is not g_c{i}"
                elif isinstance(const, torch.dtype):
                    test = f"{read} is not g_c{i}"
                else:
                    test = f"type(g_v{i} := {read}) is not g_t{i} or g_v{i} != g_c{i}"
            elif kind == "container":  # (== on the live container against a copy made now)
                glob[f"g_c{i}"], glob[f"g_t{i}"] = _thaw(value), value[0]
                test = f"type(g_v{i} := {read}) is not g_t{i} or g_v{i} != g_c{i}"
            elif kind == "items":
                glob[f"g_c{i}"], glob["_items"] = value, _items
                test = f"_items({read}) != g_c{i}"
            elif kind == "identity":
                glob[f"g_o{i}"] = self._keep[value]
                test = f"{read} is not g_o{i}"
            elif kind == "children":  # (dict ==: the same names holding the same modules)
                glob[f"g_c{i}"] = {name: self._keep[ident] for name, ident in value}
                test = f"{read} != g_c{i}"
            else:
                ident, shape, grad = value
                glob[f"g_o{i}"] = self._keep[ident]
                test = (f"(g_v{i} := {read}) is not g_o{i} or g_v{i}.shape != {shape} "
                        f"or {'not ' if grad else ''}g_v{i}.requires_grad")
            lines += [f"    if {test}:", "        return MISS"]
        return lines + ["except Exception:", "    return MISS"], glob

    def reason(self, key: tuple) -> str | None:
        """Why a program is compiled for `key`, when the one compiled for its signature read a
        guard whose value has changed since: "self.scale changed: 2.0 -> 5.0" (else None)."""
        new = next((k for k in key if type(k) is Values), None)
        old = self._last.get(tuple(k for k in key if type(k) is not Values))
        if old is None or new is None:
            return None
        said = []
        for (source, kind), a, b in zip(self.entries, old, new):
            if a == b:
                continue
            if kind == "children" and a is not _MISSING and b is not _MISSING:
                was, now = dict(a), dict(b)  # (name the children that changed)
                said += [f"{source.label}.{name} changed: "
                         f"{_describe('identity', was.get(name, _MISSING), self._keep)} -> "
                         f"{_describe('identity', now.get(name, _MISSING), self._keep)}"
                         for name in dict.fromkeys([*was, *now]) if was.get(name) != now.get(name)]
            else:
                said.append(f"{source.label} changed: {_describe(kind, a, self._keep)} -> "
                            f"{_describe(kind, b, self._keep, source.read())}")
        return "; ".join(said) or None


def _thaw(frozen):
    """A frozen container (`freeze`) as the container again: equal to the one frozen."""
    if type(frozen) is not tuple or len(frozen) != 2 or \
            frozen[0] not in (list, tuple, dict, set, frozenset):
        return frozen
    kind, items = frozen
    if kind is dict:
        return {_thaw(k): _thaw(v) for k, v in items}
    return kind(_thaw(v) for v in items)


def _describe(kind: str, value, keep: dict, now=_MISSING) -> str:
    """A guard's encoded value in words (`now`: the object itself, when it is the current one)."""
    if value is _MISSING:
        return "<missing>"
    if kind == "value":
        return repr(value[1])
    if kind == "container":
        text = repr(_thaw(value))
        return text if len(text) <= 60 else text[:57] + "..."
    if kind == "children":
        return "modules " + ", ".join(name for name, _ in value)
    if kind == "items":
        text = ", ".join(f"{e[0]!r}: tensor {e[1]:#x}" if len(e) == 2 else f"{e[0]!r}: {e[2]!r}"
                         for e in value[1])
        return f"{value[0].__name__} {{{text}}}"
    if kind == "tensor":
        ident, shape, grad = value
        return f"tensor {ident:#x} of shape {shape}" + (" requires_grad" if grad else "")
    obj = keep.get(value, now)
    if obj is _MISSING:
        return "another object"
    return getattr(obj, "__qualname__", None) or f"{type(obj).__name__} at {value:#x}"

"""fusec: a teaching compiler from traced PyTorch graphs to fused Triton and C++/OpenMP kernels.

    import fusec

    @fusec.compile
    def f(x):
        return torch.sin(torch.sin(x)) * 2

    f(torch.randn(1024))        # one fused kernel
    print(f.kernels[0].source)  # read it

The package is laid out in pipeline order (docs/architecture.md has the map): capture/ (a program
into an ATen graph) -> passes/ -> codegen/ -> runtime/ (build, load and run the program), with the
driver (api.py, driver.py) and the data every stage shares (ir.py, ops.py, errors.py, cache.py,
events.py) at this level, and inspect/ (explain, profile, logs, reports) reading all of it.
This file is the public face: it names what `import fusec` gives, and loads almost none of it
(see "Note: a lazy face" below), so `import fusec` does not import torch.
"""
import sys as _sys
import threading as _threading
import types as _types
from importlib import import_module as _import_module
from importlib.machinery import ModuleSpec as _ModuleSpec

# errors.py imports nothing, so the error and warning classes are here at once (`except fusec.
# FusecError` costs no import).
from fusec.errors import (CompileError, CompilerNotFoundError, DeviceError, FallbackWarning,
                          FusecError, FusecWarning, GraphBreakError, GraphBreakWarning,
                          MismatchError, UnsupportedError)

TRITON_IMPORTED_BEFORE_FUSEC = "triton" in _sys.modules  # (fusec/device.py says why it matters)
__version__ = "0.1.0"

__all__ = [
    "compile", "explain", "profile", "regions", "Kernel", "CompiledFunction", "CompiledModule",
    "Regions", "FusecError", "UnsupportedError", "GraphBreakError", "GraphBreakWarning",
    "DeviceError", "CompilerNotFoundError", "CompileError", "MismatchError", "FusecWarning",
    "FallbackWarning",
]

# Note: a lazy face. Importing the compiler means importing torch (~1 s on a small CPU) and, at
# the first capture, torch's tracing machinery (Dynamo, Triton, sympy: ~1-2 s more). A script that
# only asks `fusec --help`, or imports fusec to name `fusec.FusecError`, should pay none of it. So
# this file names each public object by where it lives (PEP 562: the module's `__getattr__` runs
# when a name is not yet here), and the first `fusec.compile` imports fusec.api, which brings the
# core. Three things used to happen at `import fusec` and must still happen before they matter:
#
# 1. fusec/device.py switches Triton's interpreter on when there is no GPU, which Triton reads
#    when it is imported: the finder below imports fusec.device just before anything (fusec,
#    torch's tracing machinery or the user) first imports triton;
# 2. the extensions register their kernel families and passes (each extensions/<name>/plugin.py),
#    and fusec.inspect.log subscribes the FUSEC_LOG / FUSEC_DEBUG_DIR printer to fusec/events.py:
#    the finder does both as soon as an import that brought the registries (fusec.passes,
#    fusec.codegen.families) or the events finishes, so nothing reads them before: not
#    `fusec.compile`, not `torch.compile(m, backend="fusec")` (fusec.dynamo, which Dynamo imports
#    by name), not a test that imports fusec.passes alone;
# 3. the old module names (below) answer as the same module objects as their new homes.
#
# tests/test_first_hour.py checks that `import fusec` imports no torch, that every name of
# __all__ resolves and that the old names are the new modules.

_PUBLIC = {"compile": "fusec.api", "regions": "fusec.api", "Kernel": "fusec.api",
           "CompiledFunction": "fusec.api", "CompiledModule": "fusec.api",
           "Regions": "fusec.capture.regions", "explain": "fusec.inspect.explain",
           "profile": "fusec.inspect.profile"}

# ---- where modules used to be ---------------------------------------------------------------------
# Before fusec/ had rooms, these modules sat at its top level, and code outside this repository
# imports them there (`from fusec.frontend import capture`, `fusec.log.compile_times`). Each old
# name is the same module object as its new home, imported when first asked for, so importing or
# patching either is the same. (`fusec.explain` and `fusec.profile` stay the functions; their
# modules answer `from fusec.explain import kernel_traffic` as before.)
_MOVED = {f"fusec.{old}": f"fusec.{room}.{old}" for room, olds in (
    ("capture", ("decompositions", "frontend", "outputs", "rnn", "training")),
    ("inspect", ("explain", "graphviz", "log", "plots", "profile", "report_html", "report_text")),
    ("runtime", ("build",))) for old in olds}


def __getattr__(name: str):
    """`fusec.compile` and the other public names, imported from their homes when first asked
    for; `fusec.cache`, `fusec.api`, ... (any submodule, old names included) imported likewise."""
    if name in _PUBLIC:
        value = globals()[name] = getattr(_import_module(_PUBLIC[name]), name)
        return value
    if not name.startswith("_"):
        try:
            return _import_module(f"fusec.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"fusec.{name}":
                raise
    raise AttributeError(f"module 'fusec' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Face(_types.ModuleType):
    """The class of this module: the import system sets every module it loads as an attribute of
    its package, which for the old name `fusec.explain` would hide the function `fusec.explain`
    behind its module. A public name stays the public object."""

    def __setattr__(self, name: str, value) -> None:
        if name in _PUBLIC and isinstance(value, _types.ModuleType):
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Face


# ---- the finders that keep the note's promises ----------------------------------------------------
# A meta-path finder (docs.python.org: importlib, "finders") is asked for each module an import
# does not find in sys.modules. fusec puts one first in sys.meta_path until the core is whole
# (promises 1 and 2), then takes it out. The old names (promise 3) are found like any module of
# the package, by a path-entry finder for one more entry of fusec.__path__, which Python asks only
# for fusec's modules. So once the core is loaded, an ordinary import (a kernel's first template,
# an optional module torch looks for) runs none of this file.
_OLD_NAMES_ENTRY = "<fusec's old module names>"  # (not a folder: only the hook below takes it)


class _OldNames:
    """The path-entry finder of the old module names, and their loader: the module it gives is
    its new home's, imported now."""

    @classmethod
    def hook(cls, entry: str) -> "_OldNames":
        if entry != _OLD_NAMES_ENTRY:
            raise ImportError("only fusec's old module names")
        return cls()

    def find_spec(self, name: str, target=None):
        return _ModuleSpec(name, self) if name in _MOVED else None

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        # The import system returns whatever sys.modules holds under the name after this runs.
        _sys.modules[module.__name__] = _import_module(_MOVED[module.__name__])


class _Counted:
    """Wraps a fusec module's own loader to know when the outermost fusec import has finished
    (the modules it brought are then whole): then the first finder does what waits on them."""

    def __init__(self, loader, finder: "_UntilWhole"):
        self.loader, self.finder = loader, finder

    def __getattr__(self, name: str):  # get_code, get_source, ...: runpy (`python -m`) asks
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = module.__spec__.loader = self.loader  # (as if never wrapped)
        depth = getattr(self.finder.local, "depth", 0)
        self.finder.local.depth = depth + 1
        try:
            self.loader.exec_module(module)
        finally:
            self.finder.local.depth = depth
        if depth == 0:
            self.finder.finished_import()


class _UntilWhole:
    """The first finder, until the core is whole. It finds nothing itself: it imports
    fusec.device before triton, and watches fusec's own imports until the registries are filled."""

    def __init__(self):
        self.local = _threading.local()  # how deep this thread is in fusec imports
        self.waiting = {"extensions", "log"}

    def find_spec(self, name: str, path=None, target=None):
        if name == "triton":
            _device_before_triton()
        elif name.startswith("fusec."):
            spec = self._their_spec(name, path, target)
            if spec is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _Counted(spec.loader, self)
            return spec
        return None

    def _their_spec(self, name: str, path, target):
        """The spec the finders after this one give (the installed package's own)."""
        finders = _sys.meta_path
        for finder in finders[finders.index(self) + 1:] if self in finders else ():
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find else None
            if spec is not None:
                return spec
        return None

    def finished_import(self) -> None:
        """An outermost import of fusec modules finished: fill the registries it brought; once
        both are filled, import fusec.device (torch is there by then) and step out."""
        if "extensions" in self.waiting and ("fusec.passes" in _sys.modules
                                             or "fusec.codegen.families" in _sys.modules):
            self.waiting.discard("extensions")
            _register_extensions()
        if "log" in self.waiting and "fusec.events" in _sys.modules:
            self.waiting.discard("log")
            _import_module("fusec.inspect.log")  # subscribes the FUSEC_LOG printer
        if not self.waiting and self in _sys.meta_path:
            _import_module("fusec.device")
            _sys.meta_path = [finder for finder in _sys.meta_path if finder is not self]


def _device_before_triton() -> None:
    """Import fusec.device (it sets TRITON_INTERPRET=1 without a GPU) before triton is imported.
    Not while torch itself is being imported (fusec.device needs a whole torch to ask for a GPU)."""
    torch = _sys.modules.get("torch")
    if "fusec.device" in _sys.modules or \
            torch is not None and getattr(torch.__spec__, "_initializing", False):
        return
    _import_module("fusec.device")


def _register_extensions() -> None:
    """The extensions that ship with fusec (extensions/<name>/, installed as fusec.extensions.
    <name>) plug into the core's doors: codegen/families.py for kernel families, passes.register
    for graph passes. Each folder's `plugin.py` registers what it brings, by name, and its code
    loads when first asked; the core names none of them."""
    from importlib.util import find_spec
    from pathlib import Path

    for folder in find_spec("fusec.extensions").submodule_search_locations:
        for plugin in sorted(Path(folder).glob("*/plugin.py")):
            _import_module(f"fusec.extensions.{plugin.parent.name}.plugin")


_sys.meta_path.insert(0, _UntilWhole())
__path__.append(_OLD_NAMES_ENTRY)
_sys.path_hooks.append(_OldNames.hook)

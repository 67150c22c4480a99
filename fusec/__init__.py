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
This file is the public face: it names what `import fusec` gives.
"""
import sys as _sys

from fusec import device as _device  # first: it switches Triton's interpreter on without a GPU
from fusec.api import CompiledFunction, CompiledModule, Kernel, compile, regions
from fusec.capture.regions import Regions
from fusec.errors import (CompileError, CompilerNotFoundError, DeviceError, FallbackWarning,
                          FusecError, FusecWarning, GraphBreakError, GraphBreakWarning,
                          MismatchError, UnsupportedError)
from fusec.inspect import log  # registers the FUSEC_LOG / FUSEC_DEBUG_DIR printer (events.py)
from fusec.inspect.explain import explain
from fusec.inspect.profile import profile

import importlib as _importlib
from importlib.util import find_spec as _find_spec
from pathlib import Path as _Path

# The extensions that ship with fusec (extensions/<name>/, installed as fusec.extensions.<name>)
# plug into the core's doors: codegen/families.py for kernel families, passes.register for graph
# passes. Each folder's `plugin.py` registers what it brings, by name, and its code loads when
# first asked; the core names none of them.
for _folder in _find_spec("fusec.extensions").submodule_search_locations:
    for _plugin in sorted(_Path(_folder).glob("*/plugin.py")):
        _importlib.import_module(f"fusec.extensions.{_plugin.parent.name}.plugin")

TRITON_IMPORTED_BEFORE_FUSEC = _device.TRITON_IMPORTED_BEFORE_FUSEC
__version__ = "0.1.0"

__all__ = [
    "compile", "explain", "profile", "regions", "Kernel", "CompiledFunction", "CompiledModule",
    "Regions", "FusecError", "UnsupportedError", "GraphBreakError", "GraphBreakWarning",
    "DeviceError", "CompilerNotFoundError", "CompileError", "MismatchError", "FusecWarning",
    "FallbackWarning",
]

# ---- where modules used to be ---------------------------------------------------------------------
# Before fusec/ had rooms, these modules sat at its top level, and code outside this repository
# imports them there (`from fusec.frontend import capture`, `fusec.log.compile_times`). Each old
# name is the same module object as its new home, so importing or patching either is the same.
# (`fusec.explain` and `fusec.profile` stay the functions; their modules answer `from fusec.explain
# import kernel_traffic` as before.)
from fusec.capture import decompositions, frontend, outputs, rnn, training  # noqa: E402
from fusec.inspect import explain as _explain_module  # noqa: E402
from fusec.inspect import graphviz, plots  # noqa: E402
from fusec.inspect import profile as _profile_module  # noqa: E402
from fusec.runtime import build  # noqa: E402

for _module in (decompositions, frontend, outputs, rnn, training, graphviz, log, plots,
                build, _explain_module, _profile_module):
    _sys.modules.setdefault(f"fusec.{_module.__name__.rpartition('.')[2]}", _module)
del _module

# The two report writers bring rich and jinja2 (~0.1 s), which only a report needs, so their old
# names are two small files (fusec/report_html.py, report_text.py) that import the module from its
# new home when first asked for, as the same module object; `fusec.report_text` as an attribute
# imports it too.
_MOVED_LATER = {"fusec.report_html": "fusec.inspect.report_html",
                "fusec.report_text": "fusec.inspect.report_text"}


def __getattr__(name: str):
    if f"fusec.{name}" in _MOVED_LATER:
        return _importlib.import_module(f"fusec.{name}")
    raise AttributeError(f"module 'fusec' has no attribute {name!r}")

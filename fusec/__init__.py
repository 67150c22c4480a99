"""fusec: a teaching compiler from traced PyTorch graphs to fused Triton and C++/OpenMP kernels.

    import fusec

    @fusec.compile
    def f(x):
        return torch.sin(torch.sin(x)) * 2

    f(torch.randn(1024))        # one fused kernel
    print(f.kernels[0].source)  # read it

See README.md and docs/ for the pipeline: frontend -> passes -> codegen -> runtime.
"""
import os as _os
import sys as _sys

import torch as _torch

# Triton decides whether it interprets kernels on the CPU when it is imported (its own library
# functions are decorated then), and importing fusec imports it (through torch's tracing
# machinery). Without a GPU, interpreting is the only way Triton kernels can run, so switch it on
# here unless the user chose otherwise.
TRITON_IMPORTED_BEFORE_FUSEC = "triton" in _sys.modules
if not _torch.cuda.is_available():
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from .api import CompiledFunction, CompiledModule, Kernel, compile  # noqa: E402
from .breaks import Regions, regions  # noqa: E402
from .errors import (CompileError, CompilerNotFoundError, DeviceError, FusecError,  # noqa: E402
                     GraphBreakError, GraphBreakWarning, MismatchError, UnsupportedError)
from .explain import explain  # noqa: E402
from .profile import profile  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "compile", "explain", "profile", "regions", "Kernel", "CompiledFunction", "CompiledModule",
    "Regions", "FusecError", "UnsupportedError", "GraphBreakError", "GraphBreakWarning",
    "DeviceError", "CompilerNotFoundError", "CompileError", "MismatchError",
]

"""fusec: a teaching compiler from traced PyTorch graphs to fused Triton and C++/OpenMP kernels.

    import fusec

    @fusec.compile
    def f(x):
        return torch.sin(torch.sin(x)) * 2

    f(torch.randn(1024))        # one fused kernel
    print(f.kernels[0].source)  # read it

See README.md and docs/ for the pipeline: frontend -> passes -> codegen -> runtime.
"""
from .api import CompiledFunction, CompiledModule, Kernel, compile
from .errors import (CompileError, CompilerNotFoundError, DeviceError, FusecError, MismatchError,
                     UnsupportedError)
from .explain import explain

__version__ = "0.1.0"

__all__ = [
    "compile", "explain", "Kernel", "CompiledFunction", "CompiledModule",
    "FusecError", "UnsupportedError", "DeviceError", "CompilerNotFoundError", "CompileError",
    "MismatchError",
]

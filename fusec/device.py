"""Where programs run: the GPU when there is one, else the CPU, with Triton's interpreter for
Triton kernels on a CPU.

Triton decides whether it interprets kernels on the CPU when it is imported (its own library
functions are decorated then), and fusec's first capture imports it (through torch's tracing
machinery). Without a GPU, interpreting is the only way Triton kernels can run, so this module,
which fusec/__init__.py imports just before triton is first imported (by fusec, torch or the
user: its "lazy face" note), switches it on unless the user chose otherwise, and
remembers whether triton was imported before fusec (then it is too late to switch).
"""
from __future__ import annotations

import os
import sys

import torch

from fusec.errors import DeviceError

TRITON_IMPORTED_BEFORE_FUSEC = "triton" in sys.modules
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def prepare_triton(device: torch.device) -> None:
    """Triton runs CPU tensors only under its interpreter, which must be on before import."""
    if device.type == "cuda":
        return
    # Triton reads TRITON_INTERPRET when it is imported (this module sets it first on a machine
    # without a GPU); a process that imported triton before fusec must have set it itself.
    if os.environ.get("TRITON_INTERPRET") != "1" or TRITON_IMPORTED_BEFORE_FUSEC and \
            "fusec.codegen.triton.helpers" not in sys.modules and _interpreter_off():
        raise DeviceError("fusec: backend 'triton' with CPU tensors needs Triton's interpreter: "
                          "set TRITON_INTERPRET=1 before triton is imported (fusec does so itself "
                          "on a machine without a GPU if it is imported first), or use backend='cpp'")


def default_device() -> str:
    """Where the examples and the demo put their tensors: the GPU if there is one, unless the user
    asked for Triton's interpreter (TRITON_INTERPRET=1), which runs Triton kernels on the CPU."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return "cuda"
    return "cpu"


def _interpreter_off() -> bool:
    """True if triton was imported with its interpreter off (its library is compiled-mode)."""
    import triton.language as tl  # lazy: only a process that imported triton before fusec asks
    return "Interpreted" not in type(tl.standard._sum_combine).__name__ \
        if hasattr(tl, "standard") and hasattr(tl.standard, "_sum_combine") else False

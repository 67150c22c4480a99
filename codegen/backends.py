"""The backends, as one registry: what each is called, which module spells and builds its kernels,
and what it can do. Code outside codegen/ asks a `Backend` instead of testing its name.

Every backend package's entry (triton/, cpp/, llvm/: their __init__.py) has the same few functions: `render(ir)` (the
kernel IR as source text), `build(source, name)` (the binary, through the disk cache:
fusec/cache.py), `launcher(path, name, n_params)` (the binary loaded, callable with tensors) and
`load(ir, source)` (both at once). A `Backend` reaches them through `module`, and declares the
facts the rest of fusec decides by:

    backends.get("llvm").views             ("optimized_ir", "assembly"): explain can show them
    backends.get("triton").views           ("gpu_assembly",): SASS for a named GPU (triton/target.py)
    backends.get("cpp").rows_one_by_one     True: fuse_reductions keeps row math out of the rows
    backends.get(name).takes(device)        whether its kernels take tensors on `device`
    backends.get(name).threadsafe_on(device)  whether they may run in several threads at once

Adding a backend: its module (with those functions), its column in the op table (fusec/ops.py)
and one `Backend(...)` row below; or, from outside fusec, `register(Backend(..., module_name=...))`
(docs/extending.md).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from fusec.device import prepare_triton
from fusec.errors import DeviceError, FusecError


@dataclass(frozen=True)
class Backend:
    name: str
    devices: tuple[str, ...]  # device types whose tensors its kernels take
    suffix: str  # a kernel's source file (FUSEC_DEBUG_DIR)
    lexer: str  # how the HTML report highlights its source: "python", "cpp" or "llvm"
    rows_one_by_one: bool  # its reduction kernels walk one row at a time (the CPU backends)
    writes_over_dying_inputs: bool  # plan_inplace may put an output in a dying input's memory
    compiles_ahead: bool  # on a GPU, binaries compile before the first launch (runtime/build.py)
    views: tuple[str, ...] = ()  # extra views of a built kernel that fusec.explain offers
    interpreted_on: tuple[str, ...] = ()  # device types it runs only under an interpreter
    fallback: str | None = None  # who builds a kernel this backend cannot (runtime/build.py)
    module_name: str = ""  # the module that renders, builds and loads; "": fusec.codegen.<name>

    @property
    def module(self):
        """Its module (fusec.codegen.<name>, or `module_name` for a backend from outside fusec),
        imported when first used (Triton's loads triton)."""
        return importlib.import_module(self.module_name or f"fusec.codegen.{self.name}")

    def render(self, ir) -> str:
        return self.module.render(ir)

    def build(self, source: str, name: str):
        return self.module.build(source, name)

    def launcher(self, path, name: str, n_params: int, n_sizes: int = 0):
        return self.module.launcher(path, name, n_params, n_sizes)

    def available(self) -> bool:
        available = getattr(self.module, "available", None)
        return available() if available is not None else True

    def takes(self, device: torch.device | str) -> bool:
        return torch.device(device).type in self.devices

    def threadsafe_on(self, device: torch.device) -> bool:
        """Whether its kernels on `device` may run in several threads at once (Triton's
        interpreter swaps triton.language's functions while it runs a kernel: it may not)."""
        return device.type not in self.interpreted_on

    def prepare(self, device: torch.device) -> None:
        """Anything the backend needs before it compiles for `device` (Triton on a CPU: its
        interpreter must be on), or a DeviceError saying what is wrong."""
        device = torch.device(device)
        if not self.takes(device):
            if self.devices == ("cpu",):
                raise DeviceError(f"fusec: backend {self.name!r} runs on CPU tensors, but the "
                                  f"inputs are on {device}; use backend='triton' or move the "
                                  "inputs to the CPU")
            raise DeviceError(f"fusec: backend {self.name!r} runs on CUDA tensors (or on CPU "
                              f"tensors under TRITON_INTERPRET=1), not on {device}")
        if device.type in self.interpreted_on:
            prepare_triton(device)
        prepare = getattr(self.module, "prepare", None)
        if prepare is not None:  # (Triton on a GPU: its cache key, worked out in a thread)
            prepare(device)


BACKENDS = {b.name: b for b in (
    Backend("triton", devices=("cuda", "cpu"), suffix=".py", lexer="python", rows_one_by_one=False,
            writes_over_dying_inputs=True, compiles_ahead=True, interpreted_on=("cpu",),
            views=("gpu_assembly",)),
    Backend("cpp", devices=("cpu",), suffix=".cpp", lexer="cpp", rows_one_by_one=True,
            writes_over_dying_inputs=False, compiles_ahead=False, fallback="llvm"),
    Backend("llvm", devices=("cpu",), suffix=".ll", lexer="llvm", rows_one_by_one=True,
            writes_over_dying_inputs=False, compiles_ahead=False,
            views=("optimized_ir", "assembly"), fallback="cpp"),
)}
GPU = "triton"  # what backend="auto" picks for CUDA tensors
CPU = ("cpp", "llvm")  # and for CPU tensors: the first one available


def register(backend: Backend) -> Backend:
    """Add a backend from outside fusec (docs/extending.md, "A new backend"): `fusec.compile(fn,
    backend=backend.name)` then uses it. Its module has the functions above; a name already
    taken is an error (fusec's own backends cannot be replaced)."""
    if backend.name in BACKENDS or backend.name == "auto":
        raise FusecError(f"fusec: a backend named {backend.name!r} exists already")
    BACKENDS[backend.name] = backend
    return backend


def get(name: str) -> Backend:
    if name not in BACKENDS:
        raise FusecError(f"fusec: unknown backend {name!r}; choose one of "
                         f"auto, {', '.join(BACKENDS)}")
    return BACKENDS[name]


def runs_on_gpus(name: str) -> bool:
    """Whether backend `name` (a named one: "auto" is not) runs on CUDA tensors."""
    return name in BACKENDS and "cuda" in BACKENDS[name].devices


def cpu_only(name: str) -> bool:
    """Whether backend `name` ("auto" included: it may pick Triton) runs on CPU tensors only."""
    return name in BACKENDS and BACKENDS[name].devices == ("cpu",)

"""Programmatic dependent launch: the next kernel starts while this one finishes (sm_90 and newer).

A program is a chain of kernels on one stream, and by default a kernel starts only after the one
before it has finished and its writes are flushed. The GPU is not busy in between: the last few
programs of a kernel run on a few SMs while the rest wait, then the next kernel's programs are
launched and do their set-up (addresses, masks, loading constants) before their first load. In a
decode step, sixty kernels of 2-50 microseconds each, those gaps add up.

Hopper lets a kernel be launched early (CUDA's "programmatic stream serialization" launch
attribute; Triton's `launch_pdl=True`). Two PTX instructions then order the kernels instead of
the stream:

    griddepcontrol.wait               (Triton: gdc_wait())                block until the kernel
                                                                          before has finished and
                                                                          its writes are visible
    griddepcontrol.launch_dependents  (Triton: gdc_launch_dependents())  the next kernel may launch
                                                                          once every program here
                                                                          has said so (or ended)

Every fusec kernel says both first thing, before it reads or writes memory: it waits for the
kernel before it, then allows the next one. So the next kernel's programs are placed on SMs as
this kernel's last ones finish, and their wait ends the moment this kernel's writes are visible,
with no launch in between. Because the wait comes before every load and store, no kernel can see
memory earlier than it would without the attribute; a library kernel (cuBLAS, an ATen op) after
one of ours is launched the ordinary way and waits for it completely. Inside a CUDA graph the
ordering is kept as a programmatic edge (CUDA 12.3 and newer), so captured programs gain the same.

Why: a decode step is some sixty kernels of a few microseconds, and overlapping each one's
launch with the end of the one before gave 2-4% more tokens per second on an H100
(`python benchmarks/decode.py`; current numbers in docs/performance.md).

The choice is made when a kernel is rendered, for the GPU this process compiles for (or the
`arch` named, codegen/triton/target.py): on sm_90 and newer, not under the interpreter (which runs
no PTX), not with a Triton that lacks `gdc_wait` and `launch_pdl` (Triton 3.6 has both), not with
a CUDA driver older than 12.3 (the first to keep the programmatic order inside CUDA graphs), and
not with `FUSEC_PDL=0`.
"""
from __future__ import annotations

import ctypes
import functools

from fusec import env


def current_arch() -> int | None:
    """This process's GPU as an sm number, or None (codegen/triton/text.py's, imported when
    asked: the Triton backend's package imports this module when it loads)."""
    from fusec.codegen.triton.text import current_arch as arch_here
    return arch_here()


GRAPH_DRIVER = 12030  # CUDA 12.3: programmatic edges in captured graphs


def pdl_enabled() -> bool:
    return env.flag("FUSEC_PDL", True)


def pdl_fit(arch: int | None = None) -> tuple[bool, str]:
    """(on, why): whether kernels rendered for sm_<arch> (default: this process's GPU) use
    programmatic dependent launch, and why not when they do not."""
    if not pdl_enabled():
        return False, "FUSEC_PDL=0: programmatic dependent launch is switched off"
    if not triton_has_pdl():
        import triton
        return False, (f"Triton {triton.__version__} has no grid dependency control "
                       "(gdc_wait, launch_pdl)")
    here = arch is None
    arch = current_arch() if here else arch
    if arch is None:
        return False, "no CUDA GPU to launch on (or the interpreter)"
    if arch < 90:
        return False, f"sm_{arch}: programmatic dependent launch needs sm_90 or newer"
    driver = driver_version() if here else None
    if driver is not None and driver < GRAPH_DRIVER:
        return False, (f"CUDA driver {driver // 1000}.{driver % 1000 // 10}: programmatic "
                       "dependent launch inside CUDA graphs needs 12.3 or newer")
    return True, f"sm_{arch}: each kernel waits for the one before, then lets the next one launch"


@functools.lru_cache(maxsize=None)
def triton_has_pdl() -> bool:
    """Whether this Triton has the two instructions and the launch option."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
        return "launch_pdl" in CUDAOptions.__dataclass_fields__
    except Exception:  # noqa: BLE001 (an older Triton, or one without the NVIDIA backend)
        return False


@functools.lru_cache(maxsize=None)
def driver_version() -> int | None:
    """The CUDA driver's version as cuDriverGetVersion gives it (12030 for 12.3); None when
    libcuda cannot be asked (then the launch itself would report a problem)."""
    try:
        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0:
            return version.value
    except (OSError, AttributeError):
        pass
    return None


def pdl(arch: int | None = None) -> bool:
    return pdl_fit(arch)[0]

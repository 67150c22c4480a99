"""Runtime: the last room of the pipeline, where a scheduled graph and its kernels run.

    steps.py        what a program is made of: kernel launches, extern ATen calls, views
    program.py      the program model: `build_program(gm, kernels)` -> `Program`
    writer.py       the writer: the steps as one compiled Python function, and that text shown
    family_pool.py  a shape family's intermediate buffers: one pool per size, carved at its first call
    cuda_graphs.py  replaying a whole program as one CUDA graph (`graph_blocker`, `CudaGraphRunner`)
    build.py        building a program's kernels: each distinct one once, several at a time
    launchers.py    loading a kernel from its cached file
    training_call.py  the training fast path: a training call like the last one, checked by
                    generated Python, straight to AOT Autograd's compiled forward
    fast_start/     a second process skips capture and compilation: the call's fingerprint keys a
                    program saved on disk; Triton kernels launched bound, overlapped (PDL)

The names below are re-exported so that `fusec.runtime.graph_blocker`, `from fusec.runtime import
load_launcher` (the generated wrapper's own import) and the like keep working. Modules inside
this folder import each other by their own names, never through this file.
"""
from fusec.runtime.cuda_graphs import (COPY_BYTES_PER_US, EXTERN_US, HBM_BYTES_PER_US, LAUNCH_US,
                                       CudaGraphRunner,
                                       capture_stream, draws_random_numbers, graph_blocker)
from fusec.runtime.family_pool import FamilyPool
from fusec.runtime.launchers import load_launcher
from fusec.runtime.program import Program, build_program
from fusec.runtime.steps import (ExternStep, GetItemStep, KernelStep, OutputBuffer, SlotRef,
                                 ViewStep, settle, settle_as)
from fusec.runtime.writer import last_uses, python_wrapper, step_reads, straight_line

__all__ = ["COPY_BYTES_PER_US", "EXTERN_US", "HBM_BYTES_PER_US", "LAUNCH_US", "CudaGraphRunner", "ExternStep", "FamilyPool", "GetItemStep", "KernelStep", "OutputBuffer", "Program",
           "SlotRef", "ViewStep", "build_program", "capture_stream", "draws_random_numbers",
           "graph_blocker", "last_uses", "load_launcher", "python_wrapper", "settle", "settle_as", "step_reads",
           "straight_line"]

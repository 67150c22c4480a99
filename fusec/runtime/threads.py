"""Running one program from several threads at once (a web server's workers).

Most programs can: each call allocates its own outputs, and a kernel only reads its inputs and
writes its outputs. Two kinds cannot, and `one_at_a_time` wraps their run in a lock:

- a program that keeps intermediate buffers in a pool (the memory plan, passes/memory.py): two
  threads running it at once would write each other's intermediates. One lock per program;
- a program with kernels that a backend runs in a way that is not safe in several threads on
  that device (`Backend.threadsafe_on`, codegen/backends.py: Triton's interpreter on CPU
  tensors swaps triton.language's functions while it runs a kernel). One lock for the process.

(Compiling is guarded elsewhere: one compile at a time per function, CompiledFunction's lock in
fusec/api.py, and one capture at a time in the process, fusec/capture/tracing.py.)
"""
from __future__ import annotations

import threading
from typing import Callable

from fusec.codegen import backends
from fusec.runtime.steps import KernelStep

PROCESS_LOCK = threading.Lock()  # for programs whose backend is not thread-safe on their device


def one_at_a_time(run: Callable, compiled) -> Callable:
    """`run`, made to hold a lock while it runs when the program (`compiled.program`, built by
    backend `compiled.backend`) cannot run in several threads at once; else `run` itself. (A
    program without a pool, such as one kernel, runs in several threads at once.)"""
    program = compiled.program
    memory = getattr(program, "memory", None)
    backend = backends.get(compiled.backend)
    if any(isinstance(s, KernelStep) and not backend.threadsafe_on(s.device)
           for s in getattr(program, "steps", ())):
        lock = PROCESS_LOCK
    elif memory is not None and getattr(memory, "pool_bytes", 0):
        lock = vars(program).setdefault("_run_lock", threading.Lock())
    else:
        return run

    def run_alone(*args):
        with lock:
            return run(*args)
    return run_alone

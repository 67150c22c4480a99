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

`finish_within` is the other thread helper: work that runs in this process and cannot be killed
(a Triton compile, fusec/runtime/build.py) run in daemon threads, and abandoned past a deadline.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from fusec import events
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


def finish_within(items: list, work, workers: int, limit: float):
    """Run `work(item)` for every item, `workers` daemon threads at a time, and yield
    `(item, True)` as each finishes, or `(item, False)` for one still running `limit` seconds
    after it started: that thread is abandoned (it may finish later, unobserved) and a new one
    takes its place for the items still waiting. Daemon threads: Python does not wait for them
    at exit, as it would for a ThreadPoolExecutor's. (`work` should not raise; if it does, the
    item counts as finished and the error is logged.)"""
    waiting = list(items)
    started: dict[int, float] = {}  # index in `items` -> when its work began
    finished: list[int] = []  # indices done, not yet yielded
    position = {id(item): i for i, item in enumerate(items)}
    ready = threading.Condition()

    def worker() -> None:
        while True:
            with ready:
                if not waiting:
                    return
                item = waiting.pop(0)
                started[position[id(item)]] = time.monotonic()
            try:
                work(item)
            except Exception as err:  # noqa: BLE001 - reported, not raised in a daemon thread
                events.publish("cache", f"{getattr(work, '__name__', work)}({item!r}) raised "
                                        f"{type(err).__name__}: {err}")
            with ready:
                finished.append(position[id(item)])
                ready.notify_all()

    def spawn() -> None:
        threading.Thread(target=worker, daemon=True, name="fusec-triton").start()

    for _ in range(min(workers, len(items))):
        spawn()
    pending = set(range(len(items)))
    while pending:
        with ready:
            now = time.monotonic()
            late = [i for i in pending if i in started and now - started[i] > limit
                    and i not in finished]
            if not finished and not late:
                soonest = min((started[i] + limit for i in pending if i in started), default=now + limit)
                ready.wait(timeout=max(soonest - now, 0.001))
                continue
            done, finished[:] = list(finished), []
        for i in done:
            if i in pending:
                pending.discard(i)
                yield items[i], True
        for i in late:
            if i in pending:
                pending.discard(i)
                spawn()  # (the stuck thread keeps its item; the rest need a worker)
                yield items[i], False

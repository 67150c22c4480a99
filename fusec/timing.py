"""Honest timing: warm up, repeat, report the median, and say when it cannot be trusted.

On CUDA this uses `triton.testing.do_bench` (device events, cache flushed between runs); on the
CPU it times repeated calls with `time.perf_counter` until `budget_s` is spent.

A number alone hides how much it moved. `measure` times several rounds and keeps the fastest
and slowest round's median beside the overall one, so a report can say "±40%" and warn
(`doubts`) when the rounds disagree by more than NOISY, when torch's threads outnumber the cores
that other processes leave free, or when there is nothing worth timing: kernels run by Triton's
interpreter on a CPU are Python, and a "speedup" over eager would mean nothing.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass

import torch

NOISY = 0.25  # rounds whose medians differ by more than this fraction of the median: a warning


@dataclass(frozen=True)
class Timing:
    """A time per call: the median over all rounds, and the fastest and slowest round's median."""

    median_ms: float
    low_ms: float
    high_ms: float
    rounds: int

    @property
    def spread(self) -> float:
        """(slowest - fastest round) / median: 0.1 means the rounds agree within 10%."""
        return (self.high_ms - self.low_ms) / self.median_ms if self.median_ms > 0 else 0.0

    def __str__(self) -> str:
        if self.spread > NOISY:
            return f"{self.median_ms:.3f} ms (rounds {self.low_ms:.3g}-{self.high_ms:.3g} ms)"
        return f"{self.median_ms:.3f} ms (±{50 * self.spread:.0f}%)"


def measure(fn, *args, device: str = "cpu", budget_s: float = 0.25, warmup: int = 3,
            rounds: int = 5) -> Timing:
    """`rounds` medians of `median_ms`, each on its share of the budget."""
    for _ in range(warmup):
        fn(*args)
    medians = [median_ms(fn, *args, device=device, budget_s=budget_s / rounds, warmup=0)
               for _ in range(rounds)]
    return Timing(statistics.median(medians), min(medians), max(medians), rounds)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container or `taskset`
    narrows), else the machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def busy_cores() -> str | None:
    """A sentence when torch's CPU threads outnumber the cores other work leaves free (the
    cores this process may use, less the 1-minute load average beyond the one this process
    is), else None."""
    if not hasattr(os, "getloadavg"):
        return None
    cores = usable_cores()
    load = os.getloadavg()[0]
    free = cores - max(0.0, load - 1.0)
    threads = torch.get_num_threads()
    if threads <= math.ceil(free):
        return None
    return (f"torch uses {threads} threads but only about {max(free, 0):.1f} of the {cores} "
            f"cores it may use are free (load average {load:.1f}): CPU times are inflated and "
            "swing between runs")


def interpreted(backend: str, device: str) -> bool:
    """Kernels run by Triton's interpreter (a GPU backend on CPU tensors): Python, not timed."""
    from fusec.codegen import backends
    return backends.runs_on_gpus(backend) and torch.device(device).type == "cpu"


def doubts(*timings: Timing, device: str = "cpu") -> list[str]:
    """Why the times of one comparison should not be trusted (empty when nothing is wrong)."""
    said = []
    worst = max((t.spread for t in timings), default=0.0)
    if worst > NOISY:
        said.append(f"the timing rounds disagree by up to {100 * worst:.0f}% of their median "
                    f"(more than {100 * NOISY:.0f}% is too wide to trust): the machine is busy or "
                    "the program is too short to time; rerun, and trust kernel counts and bytes "
                    "over these times")
    if torch.device(device).type == "cpu":
        busy = busy_cores()
        if busy:
            said.append(busy)
    return said


def median_ms(fn, *args, device: str = "cpu", budget_s: float = 0.25, warmup: int = 3) -> float:
    if torch.device(device).type == "cuda":
        from triton.testing import do_bench  # lazy: triton's timer, only on a GPU
        return float(do_bench(lambda: fn(*args), warmup=25, rep=100, return_mode="median"))
    for _ in range(warmup):
        fn(*args)
    times = []
    start = time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - start < budget_s and len(times) < 1000):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def wall_ms(fn, *args, device: str = "cpu", iters: int = 200) -> float:
    """Wall-clock time per call, including the host-side launch work, for launch-bound programs.

    `do_bench` times the device between events and hides host overhead behind its cache flush, so
    a program whose cost is mostly Python and launches needs this instead: synchronize, call it
    `iters` times back to back, synchronize, divide (median of 5 such rounds).
    """
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for _ in range(10):
        fn(*args)
    rounds = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn(*args)
        sync()
        rounds.append((time.perf_counter() - t0) / iters)
    return statistics.median(rounds) * 1e3


def copy_bandwidth(device: str, n: int = 64 * 2**20) -> float:
    """Bytes per millisecond of a plain device copy (n floats read, n written): the ceiling a
    memory-bound kernel is measured against."""
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / median_ms(dst.copy_, src, device=device)

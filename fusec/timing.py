"""Honest timing: warm up, repeat, report the median.

On CUDA this uses `triton.testing.do_bench` (device events, cache flushed between runs); on the
CPU it times repeated calls with `time.perf_counter` until `budget_s` is spent.
"""
from __future__ import annotations

import statistics
import time

import torch


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

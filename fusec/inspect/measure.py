"""Reading what torch.profiler recorded: which events are launches that do work, the device time
per iteration and per kernel, peak memory, and a copy-bandwidth ceiling to judge each kernel's
achieved bandwidth against. `kernel_lines` turns it all into the report's per-kernel lines.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, record_function

from fusec import ops
from fusec.inspect.groups import kernel_traffic
from fusec.inspect.listing import distinct_lines, group_members, user_line
from fusec.ir import family
from fusec.timing import median_ms

from fusec.inspect.instrument import eager_bytes_of, extern_label
from fusec.inspect.report import KernelLine, Side


# ---- measuring ----------------------------------------------------------------------------------

def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


# What torch.profiler's C++ side (Kineto, the CPU allocator) prints straight to the process's
# stderr, where Python cannot catch it: a `USDT: ... profiler_start` / `profiler_stop` line for
# every start and stop, and "[W... CPUAllocator.cpp] Memory block of unknown size was allocated
# before the profiling started" for any tensor made before and freed during a profiled run.
NATIVE_NOISE = ("USDT:", "Memory block of unknown size was allocated before the profiling started")


@contextlib.contextmanager
def native_noise_held_back():
    """Runs the block with file descriptor 2 (stderr) pointed at a temporary file, then writes
    back every line it caught except torch.profiler's noise (NATIVE_NOISE): a real error or
    warning still shows, after the block. `FUSEC_LOG=debug` (or `all`) leaves stderr alone."""
    from fusec.inspect.log import enabled  # (log imports explain, which imports this module's users)
    if enabled("debug"):
        yield
        return
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to redirect (a daemon, a closed descriptor): nothing to hold back
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().decode(errors="replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not any(n in line for n in NATIVE_NOISE))
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()


def run_profiler(fn: Callable, iters: int, label: str, cuda: bool):
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with warnings.catch_warnings(), native_noise_held_back():
        warnings.simplefilter("ignore", UserWarning)  # "Profiler clears events at the end ..."
        with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
            for _ in range(iters):
                with record_function(f"{label} iteration"):
                    fn()
            sync(cuda)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        trace = Path(path).read_text()
    return prof.events(), trace


@functools.lru_cache(maxsize=None)
def _aten_is_view(name: str) -> bool:
    packet = getattr(torch.ops.aten, name.split("::", 1)[-1], None)
    if packet is None:
        return False
    try:
        overloads = packet.overloads()
        overload = getattr(packet, "default" if "default" in overloads else overloads[0])
        return ops.is_view(overload)
    except Exception:
        return False


_NO_WORK = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::detach",
            "aten::lift_fresh", "aten::alias", "aten::resolve_conj", "aten::resolve_neg",
            "aten::result_type", "aten::set_", "aten::_local_scalar_dense", "aten::item"}
_WRAPPERS = {"aten::to", "aten::contiguous", "aten::reshape", "aten::type_as", "aten::expand_as",
             "aten::view_as", "aten::flatten", "aten::unflatten", "aten::clone"}


def does_work(evt) -> bool:
    """Does this CPU-side op launch real work (not a view, an allocation or a no-op `to`)?"""
    name = evt.name
    if name in _NO_WORK or (name.startswith("aten::") and _aten_is_view(name)):
        return False
    if name in _WRAPPERS:
        return name == "aten::clone" or any(does_work(c) for c in evt.cpu_children)
    return True


def _device_events(events) -> list:
    """Work on the device: kernels, memcpys, memsets (not the GPU-side copies of the
    record_function ranges, which carry the same names as the ranges)."""
    return [e for e in events if e.device_type != DeviceType.CPU
            and not getattr(e, "is_user_annotation", False)
            and "annotation" not in str(getattr(e, "activity_type", "") or "").lower()]


def _iterations(events, label: str) -> list:
    return [e for e in events if e.name == f"{label} iteration" and e.device_type == DeviceType.CPU]


def _launch_events(events, label: str, cuda: bool) -> list:
    if cuda:
        return _device_events(events)
    out = []
    for it in _iterations(events, label):
        out += [c for c in it.cpu_children if does_work(c)]
    return out


def _duration_ms(evt, cuda: bool) -> float:
    if cuda:
        return evt.time_range.elapsed_us() / 1e3
    return evt.cpu_time_total / 1e3


def _by_name(events, iters: int, cuda: bool) -> list[dict]:
    table: dict[str, list] = {}
    for e in events:
        row = table.setdefault(e.name, [0, 0.0])
        row[0] += 1
        row[1] += _duration_ms(e, cuda)
    rows = [{"name": name, "calls": c / iters, "ms": ms / iters} for name, (c, ms) in table.items()]
    return sorted(rows, key=lambda r: -r["ms"])


def _peak_from_trace(trace: str, label: str, cuda: bool) -> int | None:
    """Peak of memory allocated during the first profiled iteration, from the trace's [memory]
    events (bytes allocated minus freed, running sum)."""
    try:
        events = json.loads(trace)["traceEvents"]
    except (ValueError, KeyError):
        return None
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                   if e.get("name") == f"{label} iteration" and e.get("ph") == "X"
                   and e.get("cat") == "user_annotation")
    if not spans:
        return None
    start, end = spans[0]
    wanted = 1 if cuda else 0
    mem = sorted((e["ts"], e["args"].get("Bytes", 0)) for e in events
                 if e.get("name") == "[memory]" and start <= e.get("ts", -1) <= end
                 and e.get("args", {}).get("Device Type") == wanted)
    running = peak = 0
    for _, b in mem:
        running += b
        peak = max(peak, running)
    return peak


def measure_cuda_peak(fn: Callable) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@functools.lru_cache(maxsize=None)
def copy_bandwidth(device: str, nbytes: int = 1 << 26) -> float:
    """Bytes per second that `dst.copy_(src)` reaches on `device` (read + write counted), over a
    buffer of `nbytes`: the practical ceiling for a memory-bound kernel."""
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(dst.copy_, src, device=device, budget_s=0.3)
    return 2 * n * 4 / (ms / 1e3)



def make_side(events, trace, label, iters, cuda, wall_ms, cuda_peak) -> Side:
    launches = _launch_events(events, label, cuda)
    its = _iterations(events, label)
    cpu_ms = statistics.mean(e.cpu_time_total for e in its) / 1e3 if its else 0.0
    device_ms = sum(_duration_ms(e, cuda) for e in launches) / iters
    peak = cuda_peak if cuda else _peak_from_trace(trace, label, cuda)
    return Side(len(launches) / iters, device_ms, cpu_ms, wall_ms, peak,
                _by_name(launches, iters, cuda), trace)


def _range_ms(events, name: str, iters: int, cuda: bool) -> float | None:
    """Per-iteration time of the profiler ranges called `name`: on CUDA the device time of the
    kernels launched inside them, on the CPU the time of the ATen ops (or kernel) inside."""
    found = [e for e in events if e.name == name and e.device_type == DeviceType.CPU]
    if not found:
        return None
    if cuda:
        return sum(e.device_time_total for e in found) / 1e3 / iters
    total = 0.0
    for e in found:
        kids = [c for c in e.cpu_children]
        total += sum(c.cpu_time_total for c in kids) if kids else e.cpu_time_total
    return total / 1e3 / iters


def _kernel_time(events, name: str, iters: int, cuda: bool) -> float | None:
    if cuda:  # the device kernel has the kernel's name (Triton names it after the jit function)
        dev = [e for e in _device_events(events) if e.name == name]
        if dev:
            return sum(e.time_range.elapsed_us() for e in dev) / 1e3 / iters
        return _range_ms(events, name, iters, cuda)
    found = [e for e in events if e.name == name and e.device_type == DeviceType.CPU]
    return sum(e.cpu_time_total for e in found) / 1e3 / iters if found else None



def _kernel_times(events, names: list[str], iters: int, cuda: bool) -> dict[str, float | None]:
    """Per-iteration time of each kernel step in `names` (program order).

    Kernels with the same canonical source share one binary (fusec/runtime/build.py), and on a GPU the
    device event carries the binary's name: the kernel family, `fused_add_gelu` for
    `fused_add_gelu_3` and `fused_add_gelu_7` alike. The profiled run launches the steps one by
    one in program order, so within a family the i-th launch of an iteration is the family's
    i-th step; events are dealt out to the steps that way."""
    out: dict[str, float | None] = {}
    if cuda:
        members: dict[str, list[str]] = {}
        for n in names:
            members.setdefault(family(n), []).append(n)
        device = sorted(_device_events(events), key=lambda e: e.time_range.start)
        for fam, steps in members.items():
            launches = [e for e in device if e.name == fam]
            if launches and len(launches) % len(steps) == 0:
                totals = [0.0] * len(steps)
                for i, e in enumerate(launches):
                    totals[i % len(steps)] += e.time_range.elapsed_us()
                out.update((n, t / 1e3 / iters) for n, t in zip(steps, totals))
    for n in names:
        if n not in out:
            out[n] = _kernel_time(events, n, iters, cuda)
    return out


def kernel_lines(cg, f_events, o_events, iters, cuda, ceiling, errors) -> list[KernelLine]:
    by_kernel = {k.name: k for k in cg.kernels}
    gm = cg.gm
    captured = cg.captured.gm
    by_name = {n.name: n for n in gm.graph.nodes}
    lines: list[KernelLine] = []
    kernel_ms = _kernel_times(f_events, [s.name for s in cg.schedule if s.kind == "kernel"],
                              iters, cuda)
    for s in cg.schedule:
        if s.kind == "kernel":
            k = by_kernel[s.name]
            sub = getattr(gm, s.name)
            members = group_members(sub)
            src = distinct_lines(members)
            names = [n.name for n in members]
            eager_ms = _sum_opt(_range_ms(o_events, f"node {n}", iters, cuda) for n in names)
            fused_ms = kernel_ms[s.name]
            t = kernel_traffic(k.ir)
            bw = t["bytes"] / (fused_ms / 1e3) if fused_ms else None
            err = errors.get(s.name)
            lines.append(KernelLine(
                s.name, "kernel", [str(n.target).replace("aten.", "") for n in members], names, src,
                eager_ms, fused_ms, t["bytes"], t["read_bytes"], t["write_bytes"],
                eager_bytes_of(captured, names), t["flops"], bw, bw / ceiling if bw else None,
                err[0] if err else None, err[1] if err else None,
                (err[2] or "ok") if err else ""))
        else:
            node = by_name[s.node]
            line = user_line(node)
            lines.append(KernelLine(
                s.name, "extern", [s.name.replace("aten.", "")], [s.node], [line] if line else [],
                _range_ms(o_events, f"node {s.node}", iters, cuda),
                _range_ms(f_events, extern_label(s.name, s.node), iters, cuda),
                eager_bytes=eager_bytes_of(captured, [s.node])))
    return lines


def _sum_opt(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) if values else None

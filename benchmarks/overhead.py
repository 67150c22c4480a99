"""Per-call overhead on the CPU: eager, fusec and torch.compile on `torch.sin` of 1024 floats,
side by side in one run, and where fusec's time goes.

    python benchmarks/overhead.py                      # prints a table (docs/runtime.md)
    python benchmarks/overhead.py --no-torch-compile   # skip torch.compile (it compiles ~10 s)
    python benchmarks/overhead.py --json out.json

On 1k elements the work is tiny, so what is measured is the cost of a call itself: for eager,
ATen's dispatch and allocation; for fusec, its runtime (fusec/api.py `__call__`, the guard and
the program's straight-line function of fusec/runtime/writer.py) around one C++ kernel; for
torch.compile, Dynamo's guards and Inductor's wrapper.

Every row is timed call by call with `time.perf_counter_ns`. The rows take turns (round robin,
a batch of calls each), so a noisy neighbour or a clock change hits all of them alike; each row
reports the median, minus the cost of timing an empty call. The parts of a fusec call are timed
the same way, each on its own:

    guard          the generated signature check (shape, strides, dtype, device, requires_grad)
    allocation     the output tensor (`torch.empty_like` of a template, as the program does)
    empty C call   ctypes calling a C function that does nothing: the cost of crossing to C
    kernel launch  ctypes calling the fused kernel with ready data pointers (its work included)

The kernel's own work is `kernel launch - empty C call`; fusec's per-call overhead is the whole
call minus that work: everything fusec adds around the kernel.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import fusec
from fusec.fastpath import guarded_call
from fusec.codegen import cpp


def sin(x):
    return torch.sin(x)


def interleaved_medians(rows: dict, rounds: int, per_round: int) -> dict[str, float]:
    """Median microseconds per call of each zero-argument callable in `rows`, taking turns."""
    samples: dict[str, list[int]] = {name: [] for name in rows}
    for fn in rows.values():
        for _ in range(200):  # warm up: caches, branch predictors, lazy initialisation
            fn()
    clock = time.perf_counter_ns
    for _ in range(rounds):
        for name, fn in rows.items():
            out = samples[name]
            for _ in range(per_round):
                t0 = clock()
                fn()
                out.append(clock() - t0)
    return {name: statistics.median(s) / 1e3 for name, s in samples.items()}


def empty_c_function():
    """A C function that does nothing, built like a kernel (cached), called like one."""
    source = 'extern "C" void fusec_overhead_noop(void* a, void* b) {}\n'
    return cpp.CppLauncher(cpp.build(source, "fusec_overhead_noop"), "fusec_overhead_noop",
                           2).pointer_entry


def measure(n: int, with_torch_compile: bool, rounds: int, per_round: int) -> dict:
    torch.manual_seed(0)
    x = torch.randn(n)
    args = (x,)
    cf = fusec.compile(sin, backend="cpp")
    # a shape family's program (fusec/dynamic.py): the size is a symbol, read from x per call
    family = fusec.compile(sin, backend="cpp", dynamic=True)
    for _ in range(2):  # the first call compiles, the second takes the fast path
        torch.testing.assert_close(cf(x), torch.sin(x))
        torch.testing.assert_close(family(x), torch.sin(x))
    kernel = cf.kernels[0].launcher.pointer_entry
    out = torch.empty_like(x)
    x_ptr, out_ptr = x.data_ptr(), out.data_ptr()
    noop = empty_c_function()
    guard = guarded_call(lambda tensors: None, [x], 0, [], None)  # the same check, running nothing
    like = torch.empty(()).expand(n)
    empty_like = torch.empty_like

    rows = {
        "eager torch.sin": lambda: torch.sin(x),
        "fusec (cpp), whole call": lambda: cf(x),
        "fusec (cpp), every size (dynamic=True)": lambda: family(x),
    }
    if with_torch_compile:
        compiled = torch.compile(sin)
        compiled(x)
        rows["torch.compile (inductor)"] = lambda: compiled(x)
        compiled_dynamic = torch.compile(sin, dynamic=True)
        compiled_dynamic(x)
        rows["torch.compile (inductor), dynamic=True"] = lambda: compiled_dynamic(x)
    rows.update({
        "  guard": lambda: guard(args),
        "  allocation": lambda: empty_like(like),
        "  empty C call": lambda: noop(x_ptr, out_ptr),
        "  kernel launch": lambda: kernel(x_ptr, out_ptr),
        "timing an empty call": lambda: None,
    })
    us = interleaved_medians(rows, rounds, per_round)
    floor = us.pop("timing an empty call")
    us = {name: max(t - floor, 0.0) for name, t in us.items()}
    work = max(us["  kernel launch"] - us["  empty C call"], 0.0)
    parts = us["  guard"] + us["  allocation"] + us["  kernel launch"]
    us["  Python glue (the rest)"] = max(us["fusec (cpp), whole call"] - parts, 0.0)
    us["  a shape family's extra cost (every size - whole call)"] = \
        us["fusec (cpp), every size (dynamic=True)"] - us["fusec (cpp), whole call"]
    return {"n": n, "torch": torch.__version__, "timer_floor_us": floor, "medians_us": us,
            "kernel_work_us": work, "fusec_overhead_us": us["fusec (cpp), whole call"] - work,
            "kernel": cf.kernels[0].name}


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    us = result["medians_us"]
    eager = us["eager torch.sin"]
    table = Table(title=f"per call, torch.sin of {result['n']} float32 on the CPU "
                        f"(torch {result['torch']}); medians in microseconds")
    table.add_column("")
    table.add_column("us", justify="right")
    table.add_column("vs eager", justify="right")
    order = ["eager torch.sin", "fusec (cpp), whole call", "fusec (cpp), every size (dynamic=True)",
             "  a shape family's extra cost (every size - whole call)",
             "torch.compile (inductor)", "torch.compile (inductor), dynamic=True",
             "  guard", "  allocation", "  kernel launch", "  empty C call",
             "  Python glue (the rest)"]
    for name in order:
        if name in us:
            table.add_row(name, f"{us[name]:.2f}", f"{us[name] / eager:.2f}x")
    table.add_row("  kernel's own work (launch - empty C call)", f"{result['kernel_work_us']:.2f}",
                  "")
    table.add_row("fusec per-call overhead (whole call - kernel's work)",
                  f"{result['fusec_overhead_us']:.2f}",
                  f"{result['fusec_overhead_us'] / eager:.2f}x")
    Console(file=sys.stdout).print(table)
    verdict = "below" if result["fusec_overhead_us"] < eager else "NOT below"
    print(f"fusec's per-call overhead is {verdict} eager's time for one torch.sin "
          f"({result['fusec_overhead_us']:.2f} us vs {eager:.2f} us; timer floor "
          f"{result['timer_floor_us']:.2f} us subtracted from every row)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1024, help="elements (default 1024)")
    parser.add_argument("--rounds", type=int, default=40, help="turns each row takes")
    parser.add_argument("--per-round", type=int, default=500, help="calls per turn")
    parser.add_argument("--no-torch-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args(argv)
    result = measure(args.size, not args.no_torch_compile, args.rounds, args.per_round)
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

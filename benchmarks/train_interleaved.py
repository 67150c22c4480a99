"""Training steps of several systems interleaved step by step in one process: the comparison to
read on a machine shared with other work, where benchmarks/train.py's rows (one system after
another) each meet another load.

    python benchmarks/train_interleaved.py [--models llama,bert] [--steps 80] [--warmup 5]
                                           [--systems tc,cpp,cpp-general,llvm,llvm-general,eager]

Systems: `eager`, `tc` (torch.compile), a fusec CPU backend (`cpp`, `llvm`), or a backend with
`-general` (the same with every training call through fusec's general path:
FUSEC_TRAIN_FAST_PATH=0, docs/training.md "The training call path"). Each round runs one step
(forward with the loss, backward, foreach AdamW, zero_grad) of every system in turn, on one
thread; printed are the medians of each system's CPU time per step (time.process_time) after
the warm-up, and ratios. Losses are not compared here: benchmarks/train.py does that.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fusec  # noqa: E402
from train_models import workload  # noqa: E402


def make(system: str, model: torch.nn.Module):
    if system == "eager":
        return model
    if system == "tc":
        return torch.compile(model)
    return fusec.compile(model, backend=system.split("-")[0])


def medians(name: str, systems: list[str], steps: int, warmup: int) -> dict[str, float]:
    """Milliseconds of CPU time per step, the median over the steps after `warmup`."""
    w = workload(name, "cpu", True, 8)
    runs = {}
    for system in systems:
        model = copy.deepcopy(w.model)
        runs[system] = (make(system, model),
                        torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True))
    times: dict[str, list] = {s: [] for s in systems}
    for i in range(steps):
        batch = w.batches[i % len(w.batches)]
        for system, (run, opt) in runs.items():
            os.environ["FUSEC_TRAIN_FAST_PATH"] = "0" if system.endswith("-general") else "1"
            start = time.process_time()
            run(**batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= warmup:
                times[system].append(time.process_time() - start)
    os.environ.pop("FUSEC_TRAIN_FAST_PATH")
    return {s: statistics.median(v) * 1e3 for s, v in times.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama,bert")
    p.add_argument("--systems", default="tc,cpp,cpp-general,llvm,llvm-general,eager")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    systems = args.systems.split(",")
    for name in args.models.split(","):
        ms = medians(name, systems, args.steps, args.warmup)
        general = [s for s in systems if s.endswith("-general") and s[:-8] in ms]
        ratios = [f"{s}/{s[:-8]} {ms[s] / ms[s[:-8]]:.3f}" for s in general]
        versus = [f"tc/{s} {ms['tc'] / ms[s]:.2f}" for s in systems
                  if "tc" in ms and s not in ("tc", "eager") and s not in general]
        print(f"{name:9}" + "  ".join(f"{s} {v:.2f}" for s, v in ms.items()) + " ms | "
              + ", ".join(ratios + versus), flush=True)


if __name__ == "__main__":
    main()

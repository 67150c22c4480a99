"""Training steps: eager vs torch.compile vs fusec.compile on five models, side by side in one run.

    python benchmarks/train.py [--models gpt2,llama,bert,vit,resnet50]
                               [--systems eager,torch.compile,fusec] [--backend cpp,llvm]
                               [--steps N] [--warmup N] [--small | --full] [--json out.json]
                               [--layers L] [--batch B] [--seq S] [--threads T] [--profile]

One step is what a training loop does: forward with the loss, backward, AdamW's step (fused on
a GPU, foreach on a CPU; the optimizer runs eagerly for every system), under bf16 autocast on a
GPU and in float32 on a CPU. The models (benchmarks/train_models.py) are built from configs with
random weights and no dropout; `--small` (the default on a CPU) makes them tiny, so that a step
takes milliseconds. Every system starts from the same weights and sees the same batches, so its
losses are compared with eager's step by step.

Columns, per model and system:
* step ms: the median step time over the steps after `--warmup`, and the fastest and slowest
  of those steps (wall clock, the device synchronized after each step);
* cpu ms: the median CPU time of the process per step (all its threads; time.process_time) over
  the same steps: on a CPU shared with other work, wall-clock times grow with the time slices
  other processes take, CPU time much less (it still grows with cache misses and spinning);
* x eager: eager's median step time over this system's (above 1: faster than eager); x cpu:
  the same ratio of CPU times;
* first step s: the first step's time, compile included (fusec and torch.compile compile on
  their first call; a later step that compiles again shows in the JSON's `steps_s`, every
  step's seconds);
* peak MB: on a GPU, torch.cuda.max_memory_allocated over the steps after the first, less the
  memory allocated before this system's copy of the model was made (so weights, gradients,
  optimizer state and activations count); on a CPU, the process's peak resident set (VmHWM,
  reset after the first step through /proc/self/clear_refs) over the same steps, less the
  resident set before the copy: an upper bound, since it counts anything else the process
  allocated meanwhile (n/a where the peak cannot be reset);
* loss N: the loss of the last step; max |loss - eager|: the largest difference from eager's
  loss over all steps, and whether it is within the tolerance (relative to eager's loss:
  TOLERANCE, per dtype).

On a CPU, fusec runs once per CPU backend (`--backend cpp,llvm`, the default); on a GPU with
`--backend auto` (Triton).
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time
import traceback

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fusec  # noqa: E402
from fusec.timing import busy_cores  # noqa: E402
from train_models import MODELS, workload  # noqa: E402

# the largest |loss - eager's loss| / |eager's loss| over the steps that counts as the same loss:
# float32 rounds differently when kernels sum in another order (1e-6 a step, grown over the
# steps); bf16 autocast rounds every matmul's output to 8 bits of mantissa
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}


def make_optimizer(model: torch.nn.Module, device: str) -> torch.optim.Optimizer:
    """AdamW: fused on CUDA where this torch has it, else foreach."""
    if device == "cuda":
        try:
            return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        except (RuntimeError, TypeError):
            pass
    return torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)


def compiled(system: str, model: torch.nn.Module):
    if system == "eager":
        return model
    if system == "torch.compile":
        return torch.compile(model)
    if system.startswith("fusec"):  # ("fusec-general cpp": the same, FUSEC_TRAIN_FAST_PATH=0)
        backend = system.split()[1] if " " in system else "auto"
        # fusec-graphs: cuda_graphs=True (the forward and backward replayed as CUDA graphs);
        # fusec-no-graphs: cuda_graphs=False (every kernel launched one by one)
        graphs = {"fusec-graphs": True, "fusec-no-graphs": False}.get(system.split()[0], "auto")
        return fusec.compile(model, backend=backend, cuda_graphs=graphs)
    raise ValueError(f"unknown system {system!r}")


def step(run, opt, batch: dict, autocast) -> torch.Tensor:
    """One training step: forward with the loss, backward, the optimizer's step."""
    with autocast:
        loss = run(**batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class PeakMemory:
    """Peak memory of the steps after the first, above what was in use at `start()` (see the
    module's docstring for what is counted on each device)."""

    def __init__(self, device: str):
        self.device = device

    def start(self) -> None:
        gc.collect()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = _status_kb("VmRSS")

    def reset(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.ok = True
            return
        try:  # "5" resets the peak resident set (VmHWM) to the current one (Linux >= 4.0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.ok = self.base is not None
        except OSError:
            self.ok = False

    def peak_mb(self) -> float | None:
        if not getattr(self, "ok", False):
            return None
        if self.device == "cuda":
            return (torch.cuda.max_memory_allocated() - self.base) / 2**20
        peak = _status_kb("VmHWM")
        return None if peak is None else (peak - self.base) / 1024


def train(system: str, w, device: str, warmup: int, profile: bool = False) -> dict:
    """Run one system's training loop over the workload's batches; its losses, times, memory."""
    memory = PeakMemory(device)
    memory.start()
    model = copy.deepcopy(w.model)
    opt = make_optimizer(model, device)
    run = compiled(system, model)
    general = system.startswith("fusec-general")  # every call through fusec's general path
    before = os.environ.get("FUSEC_TRAIN_FAST_PATH")
    os.environ["FUSEC_TRAIN_FAST_PATH"] = "0" if general else (before or "1")
    try:
        result = _steps(run, model, opt, w, device, warmup, memory, profile)
        result["cuda_graphs"] = graph_report(run)
        return result
    finally:
        if before is None:
            del os.environ["FUSEC_TRAIN_FAST_PATH"]
        else:
            os.environ["FUSEC_TRAIN_FAST_PATH"] = before


def graph_report(run) -> list[str]:
    """For a fusec system on a GPU: each training program (forward, backward) replayed as a CUDA
    graph how many times, or why not (fusec/runtime/training_graphs.py)."""
    report = []
    for part in getattr(run, "train_parts", ()):
        state = part.last.__dict__ if part.last is not None else {}
        graph = state.get("training_graph")
        if graph is not None:
            report.append(f"replayed {graph.replays}x")
        elif state.get("training_graph_blocker"):
            report.append(f"step by step: {state['training_graph_blocker']}")
    return report


def _steps(run, model, opt, w, device: str, warmup: int, memory, profile: bool) -> dict:
    """`train`'s loop: the steps, timed, and what they returned."""
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    losses, times, cpu_times, first, every = [], [], [], None, []
    for i, batch in enumerate(w.batches):
        if i == 1:
            memory.reset()
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = step(run, opt, batch, autocast)
        sync()
        seconds = time.perf_counter() - start
        first = seconds if first is None else first
        every.append(seconds)
        if i >= warmup:
            times.append(seconds * 1e3)
            cpu_times.append((time.process_time() - cpu_start) * 1e3)
        losses.append(loss.item())
    result = {"losses": losses, "loss_last": losses[-1], "first_step_s": first, "steps_s": every,
              "step_ms": statistics.median(times) if times else None,
              "step_ms_min": min(times) if times else None,
              "step_ms_max": max(times) if times else None, "timed_steps": len(times),
              "cpu_ms": statistics.median(cpu_times) if cpu_times else None,
              "peak_mb": memory.peak_mb() if len(w.batches) > 1 else None}
    if profile:
        result["profile"] = profiled(lambda: step(run, opt, w.batches[-1], autocast), device)
    return result


def profiled(one_step, device: str, rows: int = 25) -> dict:
    """Two steps under torch.profiler: the device time, the kernels launched and the top rows
    by device time (what `--profile` prints for each system)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            one_step()
        if device == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    on_device = [e for e in events if getattr(e, "device_type", None) is not None
                 and str(e.device_type).endswith("CUDA")]
    total_us = sum(e.self_device_time_total for e in on_device) / 2
    return {"device_ms_per_step": total_us / 1e3,
            "kernels_per_step": sum(e.count for e in on_device) / 2,
            "table": events.table(sort_by="self_cuda_time_total" if device == "cuda"
                                  else "self_cpu_time_total", row_limit=rows, max_name_column_width=70)}


def compare(results: dict, tolerance: float) -> None:
    """Add each system's speed and loss difference against eager's (when eager ran)."""
    eager = results.get("eager", {})
    for r in results.values():
        if "error" in r or "losses" not in eager:
            continue
        diff = max(abs(a - b) for a, b in zip(r["losses"], eager["losses"]))
        r["max_loss_diff"] = diff
        r["loss_tol"] = tolerance * max(abs(x) for x in eager["losses"])
        r["losses_match"] = diff <= r["loss_tol"]
        if r["step_ms"] and eager.get("step_ms"):
            r["x_eager"] = eager["step_ms"] / r["step_ms"]
        if r.get("cpu_ms") and eager.get("cpu_ms"):
            r["x_eager_cpu"] = eager["cpu_ms"] / r["cpu_ms"]


def _f(value, spec: str, missing: str = "n/a") -> str:
    return missing if value is None else format(value, spec)


HEADER = (f"{'model':<9}{'system':<19}{'step ms':>9}{'min-max ms':>16}{'cpu ms':>8}{'x eager':>9}{'x cpu':>7}"
          f"{'first step s':>14}{'peak MB':>9}{'loss N':>9}  max |loss - eager| (tolerance)")


def row_text(model: str, system: str, r: dict) -> str:
    if "error" in r:
        return f"{model:<9}{system:<19}failed: {r['error']}"
    spread = (f"{r['step_ms_min']:.1f}-{r['step_ms_max']:.1f}" if r["step_ms"] is not None
              else "n/a")
    match = ""
    if "max_loss_diff" in r:
        match = (f"{r['max_loss_diff']:.2g} ({r['loss_tol']:.1g}) "
                 f"{'ok' if r['losses_match'] else 'DIFFERENT'}")
    return (f"{model:<9}{system:<19}{_f(r['step_ms'], '.1f'):>9}{spread:>16}"
            f"{_f(r.get('cpu_ms'), '.1f'):>8}"
            f"{_f(r.get('x_eager'), '.2f', '-'):>9}{_f(r.get('x_eager_cpu'), '.2f', '-'):>7}"
            f"{r['first_step_s']:>14.2f}"
            f"{_f(r['peak_mb'], '.0f'):>9}{r['loss_last']:>9.4f}  {match}")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated: {','.join(MODELS)}")
    p.add_argument("--systems", default="eager,torch.compile,fusec",
                   help="comma-separated: eager, torch.compile, fusec, fusec-general (fusec "
                        "with every training call through its general path: "
                        "FUSEC_TRAIN_FAST_PATH=0), fusec-graphs, fusec-no-graphs (fusec with "
                        "cuda_graphs=True, False)")
    p.add_argument("--backend", default=None,
                   help="fusec's backends, comma-separated: one fusec row each "
                        "(default: cpp,llvm on a CPU, auto on a GPU)")
    p.add_argument("--steps", type=int, default=None, help="steps per system (10 CPU, 20 GPU)")
    p.add_argument("--warmup", type=int, default=None,
                   help="steps not timed (3 CPU, 8 GPU); losses count from the first")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--small", action="store_true", default=None,
                      help="tiny configs (the default on a CPU)")
    size.add_argument("--full", dest="small", action="store_false",
                      help="full-size configs (the default on a GPU)")
    p.add_argument("--layers", type=int, help="layers of the transformer models")
    p.add_argument("--batch", type=int, help="batch size")
    p.add_argument("--seq", type=int, help="sequence length of the text models")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads for every system (torch.set_num_threads and OpenMP); "
                        "0: torch's default")
    p.add_argument("--json")
    p.add_argument("--profile", action="store_true",
                   help="also profile two steps of each system: device time, kernels, top rows")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # fusec's kernels' libgomp reads it on load
    device = "cuda" if torch.cuda.is_available() else "cpu"
    small = (device == "cpu") if args.small is None else args.small
    steps = args.steps or (10 if device == "cpu" else 20)
    warmup = args.warmup if args.warmup is not None else (3 if device == "cpu" else 8)
    warmup = min(warmup, steps - 1)
    backends = (args.backend or ("cpp,llvm" if device == "cpu" else "auto")).split(",")
    systems = []
    for s in args.systems.split(","):
        systems += [f"{s} {b}" if b != "auto" else s for b in backends] \
            if s in ("fusec", "fusec-general", "fusec-graphs", "fusec-no-graphs") else [s]
    dtype = "bfloat16" if device == "cuda" else "float32"
    machine = torch.cuda.get_device_name() if device == "cuda" else \
        f"CPU, {os.cpu_count()} cores, {torch.get_num_threads()} thread(s)"
    print(f"{machine}, torch {torch.__version__}, {dtype}{' autocast' if device == 'cuda' else ''}, "
          f"AdamW, {steps} steps, times over the {steps - warmup} after {warmup} warm-up", flush=True)
    if device == "cpu" and busy_cores():
        print(f"note: {busy_cores()}", flush=True)
    rows, texts = [], []
    for name in args.models.split(","):
        w = workload(name, device, small, steps, layers=args.layers, batch=args.batch, seq=args.seq)
        print(f"{name}: {w.about}", flush=True)
        results = {}
        for system in systems:
            try:
                results[system] = train(system, w, device, warmup, args.profile)
            except Exception as err:  # noqa: BLE001 (a system that fails is a row that says so)
                traceback.print_exc()
                results[system] = {"error": f"{type(err).__name__}: {str(err)[:400]}"}
            torch._dynamo.reset()
            print("  " + row_text(name, system, results[system]), flush=True)
            if results[system].get("cuda_graphs"):
                print("    training programs: " + "; ".join(results[system]["cuda_graphs"]), flush=True)
        compare(results, TOLERANCE[dtype])
        for system, r in results.items():
            rows.append({"model": name, "about": w.about, "system": system, **r})
            texts.append(row_text(name, system, r))
        del w
    print("\n" + HEADER)
    print("\n".join(texts))
    for r in rows:
        if "profile" in r:
            prof = r["profile"]
            print(f"\n{r['model']}, {r['system']}: {prof['device_ms_per_step']:.2f} ms of device "
                  f"time and {prof['kernels_per_step']:.0f} device calls per step\n{prof['table']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": machine, "torch": torch.__version__,
                       "dtype": dtype, "small": small, "steps": steps, "warmup": warmup,
                       "tolerance": TOLERANCE[dtype], "rows": rows}, f, indent=1)
    failed = [r for r in rows if "error" in r or r.get("losses_match") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

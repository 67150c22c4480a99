"""Training steps under DDP or FSDP2: eager vs torch.compile vs fusec, launched with torchrun.

    torchrun --nproc-per-node N benchmarks/distributed.py [--model gpt2] [--wrap ddp|fsdp2]
             [--systems eager,torch.compile,fusec] [--steps 50] [--warmup 5]
             [--small | --full] [--layers L] [--batch B] [--seq S] [--json out.json]

Every process builds the same model (benchmarks/train_models.py: from a config, random weights
from seed 0, no dropout) and trains it on its own batches, one system after the other, each
from the same weights (transformers' key/value cache off: a training step does not use it):

    --wrap ddp     eager: DDP(model); torch.compile: torch.compile(DDP(model)) (Dynamo splits
                   the graph at DDP's gradient buckets); fusec: fusec.compile(DDP(model)) (the
                   same Dynamo path, fusec compiling each region)
    --wrap fsdp2   every block (`model.transformer.h[i]`, ...) compiled, then fully_shard, then
                   fully_shard(model): eager: no compile; torch.compile: torch.compile(block);
                   fusec: fusec.compile(block)

One step: forward with the loss (under bf16 autocast on CUDA, float32 on a CPU), backward (the
gradients all-reduced or reduce-scattered by torch.distributed), AdamW's step (fused on CUDA,
foreach on a CPU; eager for every system). On CUDA the processes use NCCL, one GPU each
(LOCAL_RANK); on a CPU, gloo. Sizes: `--full` (the default on CUDA) is GPT-2 with 12 layers,
batch 8 x 512 a process; `--small` (the default on a CPU) 2 layers of width 64, batch 2 x 32.

Rank 0 prints one table, a row per system: step ms (the median over the steps after --warmup,
every rank synchronized after each step, the slowest rank's time: the step time of the job),
its min-max, x eager, first step s (compile included), peak MB (rank 0: CUDA's
max_memory_allocated over the timed steps less what was allocated before the system's model was
made; on a CPU the peak resident set, as benchmarks/train.py measures it), the last loss (rank
0's) and the largest |loss - eager's| over the steps beside the tolerance (relative to eager's
loss, benchmarks/train.py's TOLERANCE: 1e-4 in float32, 2e-2 under bf16 autocast). --json
writes the rows with every step's loss and time. Exit status 1 when a system fails or leaves the
tolerance.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fusec  # noqa: E402
from train import TOLERANCE, PeakMemory, make_optimizer  # noqa: E402
from train_models import MODELS, workload  # noqa: E402

SYSTEMS = ("eager", "torch.compile", "fusec")


def blocks_of(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's repeated blocks: its largest ModuleList (GPT-2's transformer.h, BERT's
    encoder.layer, Llama's model.layers ...), the units FSDP2 shards one by one."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        raise SystemExit(f"{type(model).__name__} has no ModuleList of blocks to shard")
    return max(lists, key=len)


def wrapped(system: str, wrap: str, model: torch.nn.Module, device: str, backend: str):
    """What a step calls for `system` under `wrap` (see the module docstring)."""
    if wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddp = DDP(model, device_ids=[torch.cuda.current_device()] if device == "cuda" else None)
        if system == "torch.compile":
            return torch.compile(ddp)
        return fusec.compile(ddp, backend=backend) if system == "fusec" else ddp
    from torch.distributed.fsdp import fully_shard
    blocks = blocks_of(model)
    for i in range(len(blocks)):
        if system == "torch.compile":
            blocks[i] = torch.compile(blocks[i])
        elif system == "fusec":
            blocks[i] = fusec.compile(blocks[i], backend=backend)
        fully_shard(blocks[i])
    fully_shard(model)
    return model


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def slowest(seconds: float) -> float:
    """The largest of every rank's `seconds` (a step is as slow as its slowest process)."""
    t = torch.tensor([seconds], dtype=torch.float64,
                     device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def train(system: str, args, w, device: str) -> dict:
    """One system's steps on this rank: losses, each step's seconds (the slowest rank's), peak MB."""
    memory = PeakMemory(device)
    memory.start()
    model = copy.deepcopy(w.model)
    run = wrapped(system, args.wrap, model, device, args.backend)
    opt = make_optimizer(model, device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda")
    losses, seconds = [], []
    for i, batch in enumerate(w.batches):
        if i == args.warmup:
            memory.reset()
        sync(device)
        start = time.perf_counter()
        with autocast:
            loss = run(**batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        seconds.append(slowest(time.perf_counter() - start))
        losses.append(loss.item())
    timed = seconds[args.warmup:] or seconds
    return {"system": system, "losses": losses, "steps_s": seconds,
            "step_ms": statistics.median(timed) * 1e3, "min_ms": min(timed) * 1e3,
            "max_ms": max(timed) * 1e3, "first_step_s": seconds[0], "peak_mb": memory.peak_mb()}


def compare(rows: list, tolerance: float) -> None:
    """Each row's largest |loss - eager's| relative to eager's loss, and whether it is ok."""
    eager = next((r for r in rows if r["system"] == "eager" and "losses" in r), None)
    for r in rows:
        if "losses" not in r:
            r.update(ok=False, max_diff=None)
            continue
        if eager is None:
            r.update(ok=True, max_diff=None)
            continue
        diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], eager["losses"])]
        r.update(max_diff=max(diffs), ok=max(diffs) <= tolerance)
    if eager is not None:
        for r in rows:
            if r.get("step_ms"):
                r["x_eager"] = eager["step_ms"] / r["step_ms"]


def table(rows: list, head: str, tolerance: float) -> str:
    out = [head, f"{'system':<14} {'step ms':>8} {'min-max ms':>13} {'x eager':>8} "
                 f"{'first step s':>12} {'peak MB':>8} {'loss N':>8}  max |loss - eager| (tol)"]
    for r in rows:
        if "losses" not in r:
            out.append(f"{r['system']:<14} failed: {r['error']}")
            continue
        peak = f"{r['peak_mb']:.0f}" if r["peak_mb"] is not None else "n/a"
        diff = f"{r['max_diff']:.2g}" if r["max_diff"] is not None else "n/a"
        out.append(f"{r['system']:<14} {r['step_ms']:8.1f} "
                   f"{r['min_ms']:6.1f}-{r['max_ms']:<6.1f} {r.get('x_eager', 1.0):8.2f} "
                   f"{r['first_step_s']:12.2f} {peak:>8} {r['losses'][-1]:8.4f}  "
                   f"{diff} ({tolerance:g}) {'ok' if r['ok'] else 'DIFFERENT'}")
    return "\n".join(out)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt2", choices=MODELS)
    p.add_argument("--wrap", default="ddp", choices=("ddp", "fsdp2"))
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--backend", default="auto", help="fusec's backend (auto: Triton on CUDA, "
                   "C++ on a CPU)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5, help="steps not timed (compiles happen here)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--small", action="store_true", default=None)
    size.add_argument("--full", dest="small", action="store_false")
    p.add_argument("--layers", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--json", help="write the rows here (rank 0)")
    args = p.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown system(s) {', '.join(sorted(unknown))}: choose from {', '.join(SYSTEMS)}")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    small = (not cuda) if args.small is None else args.small
    if args.backend == "auto" and not cuda:
        args.backend = "cpp"
    # every rank its own batches: this rank's share of steps x world batches
    w = workload(args.model, device, small, args.steps * world, layers=args.layers,
                 batch=args.batch, seq=args.seq)
    w.batches = w.batches[rank::world]
    for m in w.model.modules():  # training has no use for transformers' key/value cache (with
        if getattr(getattr(m, "config", None), "use_cache", None):  # it, each block would
            m.config.use_cache = False  # fill the model's cache: a graph break for fusec)
    rows = []
    for system in args.systems:
        try:
            rows.append(train(system, args, w, device))
        except Exception as err:  # noqa: BLE001 (the table says which system failed and why)
            if rank == 0:
                traceback.print_exc()
            rows.append({"system": system, "error": f"{type(err).__name__}: {err}"[:300]})
    tolerance = TOLERANCE["bfloat16" if cuda else "float32"]
    compare(rows, tolerance)
    if rank == 0:
        name = torch.cuda.get_device_name() if cuda else "CPU"
        head = (f"{w.about}; {args.wrap} on {world} process(es), {dist.get_backend()}, {name}, "
                f"torch {torch.__version__}, {'bf16 autocast' if cuda else 'float32'}, AdamW, "
                f"{args.steps} steps, times over the {max(args.steps - args.warmup, 0)} after "
                f"{args.warmup}")
        print(table(rows, head, tolerance), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"about": head, "model": args.model, "wrap": args.wrap, "world": world,
                           "rows": rows}, f, indent=1)
    dist.destroy_process_group()
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

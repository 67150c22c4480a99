"""Training steps: eager vs torch.compile vs fusec.compile, side by side in one run.

    python benchmarks/training.py [--layers 12] [--batch 8] [--seq 512] [--steps 20]
                                  [--systems eager,fusec,torch.compile] [--json out.json] [--profile]

One step is what a training loop does: forward with the loss, backward, AdamW's step, under bf16
autocast on a GPU (float32 on a CPU). The model is Hugging Face's GPT-2, built from a config
with random weights (no download) and no dropout. Every system starts from the same weights and sees the same
batches, so its losses can be compared with eager's step by step: the table says the largest
difference, beside bf16's tolerance. Step times are medians over the steps after `--warmup`.
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

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fusec  # noqa: E402


def gpt2(layers: int, device: str, small: bool) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    dims = dict(n_embd=64, n_head=4, n_positions=64, vocab_size=256) if small else {}
    torch.manual_seed(0)
    # no dropout (as nanoGPT pretrains): random masks would make losses differ between systems
    config = GPT2Config(n_layer=layers, attn_implementation="sdpa", resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, **dims)
    return GPT2LMHeadModel(config).to(device).train()


def train(system: str, model: torch.nn.Module, batches: list, device: str, warmup: int,
          profile: bool = False) -> dict:
    """Run one system's training loop over `batches`; returns its losses and step times."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    if system == "fusec":
        run = fusec.compile(model)
    elif system == "torch.compile":
        run = torch.compile(model)
    else:
        run = model
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")
    losses, times, first = [], [], None
    for i, ids in enumerate(batches):
        start = time.perf_counter()
        with autocast:
            loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        first = seconds if first is None else first
        if i >= warmup:
            times.append(seconds * 1e3)
        losses.append(loss.item())
    result = {"losses": losses, "step_ms": statistics.median(times) if times else None,
              "first_step_s": first}
    if profile:
        result["profile"] = profiled(lambda: step(run, opt, batches[-1], autocast), device)
    return result


def step(run, opt, ids, autocast) -> None:
    with autocast:
        loss = run(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--small", action="store_true", help="a tiny GPT-2 (for a CPU)")
    p.add_argument("--systems", default="eager,fusec,torch.compile")
    p.add_argument("--json")
    p.add_argument("--profile", action="store_true",
                   help="also profile two steps of each system: device time, kernels, top rows")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = gpt2(args.layers, device, args.small)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(device)
               for _ in range(args.steps)]
    results = {}
    for system in args.systems.split(","):
        try:
            results[system] = train(system, model, batches, device, args.warmup, args.profile)
        except Exception as err:  # noqa: BLE001 (a system that fails is a row that says so)
            traceback.print_exc()
            results[system] = {"error": f"{type(err).__name__}: {str(err)[:400]}"}
    eager = results.get("eager", {}).get("losses")
    print(f"GPT-2 {args.layers} layers, batch {args.batch} x {args.seq}, {device}, "
          f"{'bf16 autocast' if device == 'cuda' else 'float32'}, AdamW, {args.steps} steps")
    print(f"{'system':<15}{'step ms':>10}{'first step s':>14}{'max |loss - eager|':>20}")
    for system, r in results.items():
        if "error" in r:
            print(f"{system:<15}failed: {r['error']}")
            continue
        diff = max(abs(a - b) for a, b in zip(r["losses"], eager)) if eager else float("nan")
        r["max_loss_diff"] = diff
        print(f"{system:<15}{r['step_ms']:>10.2f}{r['first_step_s']:>14.1f}{diff:>20.4g}")
    for system, r in results.items():
        if "profile" in r:
            prof = r["profile"]
            print(f"\n{system}: {prof['device_ms_per_step']:.2f} ms of device time and "
                  f"{prof['kernels_per_step']:.0f} device calls per step\n{prof['table']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": torch.cuda.get_device_name() if device == "cuda"
                       else "cpu", "torch": torch.__version__, "results": results}, f, indent=1)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

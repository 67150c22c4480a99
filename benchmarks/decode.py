"""LLM decoding, one token at a time: tokens/s for bf16, int8 and int4 weights (and AWQ's, GPTQ's), side by side.

    python benchmarks/decode.py [--size tiny|real] [--layers 2] [--steps 64] [--formats bf16,int8,int4]
                                [--systems eager,torch.compile,reduce-overhead,fusec] [--batch 1]
                                [--fit] [--prefill N [--mark-dynamic]] [--json out.json]

The model is examples/llama_decode.py (RMSNorm, rotary embeddings, grouped-query attention over a
static KV cache, SwiGLU; random weights). `--formats ...,awq` adds AWQ's packing (eight nibbles
along N per int32, examples/awq_linear.py), `gptq` GPTQ's (eight along K, examples/gptq_linear.py;
`gptq_g_idx`: zero points and scales read through g_idx, as AutoGPTQ's torch path reads them).
For each weight format it runs the same prompt and 64
greedy steps through each system and reports tokens/s and whether the generated tokens equal
eager's. The next token stays on the device (argmax, no host sync between steps), so the loop
measures what the GPU and the launches cost. `--batch B` decodes B sequences together (each
prompt token shifted by 7 per sequence, so that they differ): every linear then multiplies B
activation rows, the case of a server batching requests (at B = 16 a packed-int4 linear runs on
tensor cores, extensions/quant_gemv/triton_gemv_int4_mma.py); tokens/s counts the tokens of all B sequences.

With random weights the best two logits are often nearly equal, so a compiler that rounds
differently from eager may pick the other token and go on from there (examples/llama_fit.py
explains why). `--fit` first trains the bf16 weights on a passage (examples/llama_fit.py), until
each next token wins by a margin as a trained model's does, then quantizes them per format; the
prompt is the passage's first 8 tokens, and "same tokens as eager" then asks whether each system
decodes what eager decodes (and the last column whether eager decodes the rest of the passage).

`--prefill N` serves N requests instead, each a prompt of a random length (2 to 128 tokens, one
seed) prefilled in one forward (examples/llama_decode.py `Prefill`: the whole prompt's keys and
values written into the cache at once), then `--steps` greedy tokens decoded one at a time. Each
new prompt length is a new shape: the table gives how many programs each system compiled for the
prefill (fusec: a shape family after the second length, docs/dynamic.md; torch.compile: automatic
dynamic shapes), the median prefill time, decode tokens/s and whether every request's tokens
equal eager's (with random weights a bf16 rounding can change a greedy token: `--fit`).
`--mark-dynamic` marks each prompt's length dynamic first (`torch._dynamo.mark_dynamic`), as a
server that knows its prompts vary does: fusec then compiles one program for every length.

Systems: eager; torch.compile (default); torch.compile(mode="reduce-overhead") (CUDA graphs);
fusec, whose step is captured as one CUDA graph by this script: the model writes its KV cache in
place, and fusec's own CUDA-graph runner launches such programs step by step
(fusec.runtime.graph_blocker), so here `fusec.compile(model, cuda_graphs=False)` is called once
under torch.cuda.graph and replayed. On a CPU the same loop runs without graphs.
"""
from __future__ import annotations

import argparse
import copy
import json
import time

import torch

import fusec
from fusec.examples.llama_decode import REAL, TINY, Llama, Prefill
from fusec.examples.llama_fit import PASSAGE, encode, fitted, with_format

PROMPT = [1, 5, 9, 14, 2, 7, 3, 11]


def graphed(fn, device, batch: int = 1):
    """fn(tok, pos) captured once as a CUDA graph over static input buffers."""
    tok = torch.zeros(batch, dtype=torch.long, device=device)
    pos = torch.zeros(1, dtype=torch.long, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(tok, pos)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(tok, pos)

    def step(t, p):
        tok.copy_(t)
        pos.copy_(p)
        graph.replay()
        return out
    return step


def decode(step, model, steps: int, device, batch: int = 1, prompt_ids=PROMPT) -> tuple[list, float]:
    """Prompt, then `steps` greedy tokens; returns (tokens, seconds for the generated part). With
    `batch` sequences each step's token is a list of `batch` tokens."""
    model.reset()
    positions = [torch.tensor([i], device=device) for i in range(len(prompt_ids) + steps)]
    prompt = [torch.tensor([t + 7 * b for b in range(batch)], device=device) for t in prompt_ids]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.no_grad():
        for i, t in enumerate(prompt):
            logits = step(t, positions[i])
        tok = logits.argmax(-1)
        out = [tok]
        sync()
        t0 = time.perf_counter()
        for i in range(len(prompt_ids), len(prompt_ids) + steps - 1):
            tok = step(tok, positions[i]).argmax(-1)
            out.append(tok)
        sync()
        seconds = time.perf_counter() - t0
    tokens = torch.stack(out).tolist()  # [steps][batch]
    return [t[0] if batch == 1 else t for t in tokens], seconds


def serve(prefill, step, model, prompts: list, steps: int, device) -> tuple[list, list, float]:
    """Each prompt (B, T) prefilled at once, then `steps` tokens decoded from position T. Returns
    (tokens per request, prefill seconds per request, decode seconds in all)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    positions = [torch.tensor([i], device=device) for i in range(model.cfg["max_seq"])]
    tokens, prefill_s, decode_s = [], [], 0.0
    with torch.no_grad():
        for prompt in prompts:
            model.reset()
            sync()
            t0 = time.perf_counter()
            tok = prefill(prompt).argmax(-1)
            sync()
            t1 = time.perf_counter()
            out = [tok]
            for i in range(prompt.shape[1], prompt.shape[1] + steps - 1):
                tok = step(tok, positions[i]).argmax(-1)
                out.append(tok)
            sync()
            prefill_s.append(t1 - t0)
            decode_s += time.perf_counter() - t1
            tokens.append(torch.stack(out).tolist())
    return tokens, prefill_s, decode_s


def prefill_compiles(system: str, compiled_prefill) -> int | None:
    """How many programs `system` compiled for the prefill so far."""
    if system == "fusec":
        return compiled_prefill._compiled.compiles
    if system in ("torch.compile", "reduce-overhead"):
        from torch._dynamo.utils import counters
        return counters["stats"]["unique_graphs"]
    return None


def make_prefill(system: str, model):
    prefill = Prefill(model)
    if system == "eager":
        return prefill
    if system == "torch.compile":
        return torch.compile(prefill)
    if system == "reduce-overhead":
        return torch.compile(prefill, mode="reduce-overhead")
    if system == "fusec":
        return fusec.compile(prefill)
    raise ValueError(system)


def main_prefill(args, cfg, device) -> list:
    """`--prefill N` (see the module docstring)."""
    import random
    import statistics
    rng = random.Random(0)
    top = min(128, cfg["max_seq"] - args.steps)
    lengths = [rng.randint(2, top) for _ in range(args.prefill)]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg["vocab"], (args.batch, n), generator=gen).to(device)
               for n in lengths]
    if args.mark_dynamic:  # the server says the prompt length varies (every system reads it)
        for prompt in prompts:
            torch._dynamo.mark_dynamic(prompt, 1)
    print(f"{args.prefill} requests, prompt lengths {lengths}, {args.steps} tokens each", flush=True)
    print(f"{'format':6s} {'system':16s} {'prefill compiles':>16s} {'prefill ms':>10s} "
          f"{'decode tok/s':>12s}  same tokens as eager", flush=True)
    results = []
    for fmt in args.formats.split(","):
        model = Llama(cfg, fmt, device=device).eval()
        reference = None
        for system in args.systems.split(","):
            torch._dynamo.reset()
            from torch._dynamo.utils import counters
            counters.clear()
            t0 = time.perf_counter()
            prefill, step = make_prefill(system, model), make(system, model, device, args.batch)
            serve(prefill, step, model, prompts[:1], 2, device)  # warm up (compiles)
            warm = time.perf_counter() - t0
            tokens, prefill_s, decode_s = serve(prefill, step, model, prompts, args.steps, device)
            if system == "eager":
                reference = tokens
            same = None if reference is None else tokens == reference
            row = dict(format=fmt, system=system, lengths=lengths,
                       prefill_compiles=prefill_compiles(system, prefill),
                       prefill_ms=1e3 * statistics.median(prefill_s),
                       decode_tokens_per_s=args.batch * len(prompts) * (args.steps - 1) / decode_s,
                       same=same, warmup_s=warm)
            results.append(row)
            print(f"{fmt:6s} {system:16s} {str(row['prefill_compiles']):>16s} "
                  f"{row['prefill_ms']:10.3f} {row['decode_tokens_per_s']:12.1f}  {same}", flush=True)
            del prefill, step
    return results


def make(system: str, model, device, batch: int = 1):
    if system == "eager":
        return model
    if system == "torch.compile":
        return torch.compile(model)
    if system == "reduce-overhead":
        return torch.compile(model, mode="reduce-overhead")
    if system == "fusec":
        cf = fusec.compile(model, cuda_graphs=False)
        return graphed(cf, device, batch) if device == "cuda" else cf
    raise ValueError(system)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default=None, help="tiny (CPU default) or real (CUDA default)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--formats", default="bf16,int8,int4")
    p.add_argument("--systems", default="eager,torch.compile,reduce-overhead,fusec")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    p.add_argument("--fit", action="store_true",
                   help="fit the weights to a passage first (examples/llama_fit.py)")
    p.add_argument("--mark-dynamic", action="store_true",
                   help="with --prefill: mark each prompt's length dynamic (torch._dynamo.mark_dynamic), "
                        "as a serving engine that knows it varies does")
    p.add_argument("--prefill", type=int, default=0,
                   help="serve this many requests: prompts of random lengths prefilled at once")
    p.add_argument("--json")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = args.size or ("real" if device == "cuda" else "tiny")
    cfg = dict(REAL if size == "real" else TINY)
    if args.layers:
        cfg["layers"] = args.layers
    cfg["max_seq"] = max(cfg["max_seq"], (128 if args.prefill else len(PROMPT)) + args.steps)
    cfg["batch"] = args.batch
    if args.prefill:
        results = main_prefill(args, cfg, device)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(cfg=cfg, device=torch.cuda.get_device_name() if device == "cuda"
                               else "cpu", torch=torch.__version__, results=results), f, indent=1)
        return
    prompt, passage, base, fit = PROMPT, None, None, None
    if args.fit:
        passage = encode(PASSAGE)[:len(PROMPT) + args.steps]
        if len(passage) < len(PROMPT) + args.steps:
            raise SystemExit(f"--fit: the passage has {len(passage)} tokens, fewer than "
                             f"{len(PROMPT)} + --steps {args.steps}")
        t0 = time.perf_counter()
        base, fit = fitted(cfg, "bf16", device=device, text=PASSAGE[:len(passage)])
        prompt = passage[:len(PROMPT)]
        print(f"fitted to the passage in {fit['steps']} Adam steps ({time.perf_counter() - t0:.1f} s): "
              f"loss {fit['loss']:.2g}, smallest margin of a next token {fit['margin']:.2f}", flush=True)
    results = []
    print(f"{'format':6s} {'system':16s} {'tokens/s':>10s} {'ms/token':>9s}  same tokens as eager",
          flush=True)
    for fmt in args.formats.split(","):
        model = Llama(cfg, fmt, device=device).eval() if base is None else \
            with_format(copy.deepcopy(base), fmt)
        reference = None
        for system in args.systems.split(","):
            t0 = time.perf_counter()
            step = make(system, model, device, args.batch)
            decode(step, model, 4, device, args.batch, prompt)  # warm up (compiles)
            warm = time.perf_counter() - t0
            tokens, seconds = decode(step, model, args.steps, device, args.batch, prompt)
            if system == "eager":
                reference = tokens
                if passage is not None and args.batch == 1:
                    print(f"{fmt:6s} eager continues the passage: "
                          f"{tokens == passage[len(prompt):]}", flush=True)
            tps = args.batch * (args.steps - 1) / seconds
            same = None if reference is None else tokens == reference
            first_diff = None if not reference or same else \
                next(i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b)
            results.append(dict(format=fmt, system=system, tokens_per_s=tps, same=same,
                                first_diff=first_diff, warmup_s=warm))
            print(f"{fmt:6s} {system:16s} {tps:10.1f} {1e3 / tps:9.3f}  {same}"
                  + (f" (first difference at step {first_diff})" if first_diff is not None else "")
                  + f"  [warm-up {warm:.0f} s]", flush=True)
            del step
            torch._dynamo.reset()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(cfg=cfg, fit=fit, device=torch.cuda.get_device_name() if device == "cuda"
                           else "cpu", torch=torch.__version__, results=results), f, indent=1)
    systems = args.systems.split(",")
    ratio = "fusec" in systems and "reduce-overhead" in systems  # issue 15's comparison
    print("\nformat  " + "  ".join(f"{s:>16s}" for s in systems)
          + ("  fusec / reduce-overhead" if ratio else ""))
    for fmt in args.formats.split(","):
        cells = {r["system"]: r for r in results if r["format"] == fmt}
        print(f"{fmt:6s}  " + "  ".join(f"{cells[s]['tokens_per_s']:16.1f}" for s in systems)
              + (f"  {cells['fusec']['tokens_per_s'] / cells['reduce-overhead']['tokens_per_s']:23.2f}x"
                 if ratio else ""))


if __name__ == "__main__":
    main()

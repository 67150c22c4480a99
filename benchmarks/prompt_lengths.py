"""Shape families over prompt lengths: HF GPT-2 and a Llama-style model forward on many prompt
lengths in random order; how many programs fusec compiles, every result checked against eager,
then the family's time against a static program's at a few lengths.

    python benchmarks/prompt_lengths.py [--lengths 40] [--speed-at 512] [--policies default,dynamic]
                                        [--json out.json]

On a GPU the models are HF GPT-2 (12 layers, width 768) and a Llama-style model (4 layers, width
2048, 8 key/value heads); on a CPU small configs (2 layers, width 64). Lengths are drawn from
1..512 with one seed. "default" is `fusec.compile(model)` (static first, a family after the
first change: docs/dynamic.md), "dynamic" is `dynamic=True`. Times are
`triton.testing.do_bench` medians on a GPU and fusec.timing medians on a CPU.
"""
from __future__ import annotations

import argparse
import json
import random
import warnings

import torch

import fusec


def models(device: str) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    if device == "cuda":
        gpt2 = GPT2LMHeadModel(GPT2Config())
        llama = LlamaForCausalLM(LlamaConfig(
            vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
            num_attention_heads=32, num_key_value_heads=8))
    else:
        gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000))
        llama = LlamaForCausalLM(LlamaConfig(
            vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2))
    return {"gpt2": gpt2.to(device).eval(), "llama": llama.to(device).eval()}


def timer(device: str):
    if device == "cuda":
        from triton.testing import do_bench
        return lambda fn: do_bench(fn, rep=300)
    from fusec.timing import median_ms
    return lambda fn: median_ms(fn, device=device, budget_s=0.2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, default=40)
    p.add_argument("--speed-at", default="512", help="comma-separated lengths to time")
    p.add_argument("--policies", default="default,dynamic")
    p.add_argument("--json")
    args = p.parse_args()
    warnings.simplefilter("ignore")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lengths = random.Random(0).sample(range(1, 513), args.lengths)
    bench, out = timer(device), {"device": device, "lengths": lengths}
    for name, model in models(device).items():
        for policy in args.policies.split(","):
            cf = fusec.compile(model, dynamic=True if policy == "dynamic" else None)
            worst = 0.0
            with torch.no_grad():
                for n in lengths:
                    ids = torch.randint(0, 1000, (1, n), device=device)
                    got, want = cf(ids).logits, model(ids).logits
                    worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
            inner = cf._compiled
            row = dict(compiles=inner.compiles, families=len(inner.families),
                       worst_rel_err=worst, recompiles=inner.recompiles[-4:], speed={})
            for n in ([] if policy != "default" else [int(v) for v in args.speed_at.split(",") if v]):
                ids = torch.randint(0, 1000, (1, n), device=device)
                static = fusec.compile(model, dynamic=False)
                with torch.no_grad():
                    static(ids)
                    times = {"eager": bench(lambda: model(ids)), "static": bench(lambda: static(ids)),
                             "family": bench(lambda: cf(ids))}
                row["speed"][n] = times
            out[f"{name} {policy}"] = row
            print(f"{name:6s} {policy:8s} compiles {row['compiles']} (families {row['families']}), "
                  f"largest relative error {worst:.1e}", flush=True)
            for n, t in row["speed"].items():
                print(f"    length {n}: eager {t['eager']:.3f} ms, static {t['static']:.3f} ms, "
                      f"family {t['family']:.3f} ms ({t['family'] / t['static']:.2f}x static)",
                      flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

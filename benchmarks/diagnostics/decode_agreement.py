"""Do fusec's decode logits differ from eager's more than rounding explains?

    python benchmarks/diagnostics/decode_agreement.py [--format int4] [--layers 4]

benchmarks/decode.py reports where greedy tokens first differ from eager's; with random weights
the logits are near ties, so a rounding difference can flip a choice. This script separates the
two: after the prompt it prints, for fusec and for torch.compile, the largest logit difference
from eager, and eager's gap between its best and second-best token. Then, for every linear
layer of the first block, each system's error against a float64 product with the same
dequantized weight (a system no less accurate than eager has an error no larger than eager's).
"""
from __future__ import annotations

import argparse

import torch

import fusec
from fusec.examples.llama_decode import REAL, Llama

PROMPT = [1, 5, 9, 14, 2, 7, 3, 11]


def prompt_logits(fn, model, device):
    model.reset()
    with torch.no_grad():
        for i, t in enumerate(PROMPT):
            logits = fn(torch.tensor([t], device=device), torch.tensor([i], device=device))
    return logits.float().clone()


def dequantized(layer):
    if hasattr(layer, "q"):
        return layer.q.to(torch.bfloat16) * layer.scale[:, None]
    if hasattr(layer, "weight") and callable(layer.weight):
        return layer.weight(torch.bfloat16)
    return None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--format", default="int4")
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args()
    device = "cuda"
    model = Llama(dict(REAL, layers=args.layers), args.format, device=device).eval()
    eager = prompt_logits(model, model, device)
    top = eager[0].topk(2)
    print(f"eager: best token {top.indices[0].item()} ({top.values[0].item():.4f}), second "
          f"{top.indices[1].item()} ({top.values[1].item():.4f}), gap {(top.values[0] - top.values[1]).item():.4f}")
    for name, fn in [("fusec", fusec.compile(model, cuda_graphs=False)), ("torch.compile", torch.compile(model))]:
        got = prompt_logits(fn, model, device)
        print(f"{name:14s} best token {got[0].argmax().item()}, max |logit - eager| "
              f"{(got - eager).abs().max().item():.4f}")
    block = model.layers[0]
    x = torch.randn(1, REAL["dim"], device=device, dtype=torch.bfloat16)
    for lname in ["wq", "wk", "w1", "w2"]:
        layer = getattr(block, lname)
        w = dequantized(layer)
        xi = torch.randn(1, w.shape[1], device=device, dtype=torch.bfloat16) if w is not None else x
        with torch.no_grad():
            ref = xi.double() @ w.double().T if w is not None else None
            outs = {"eager": layer(xi), "fusec": fusec.compile(layer)(xi)}
        if ref is None:
            continue
        errs = "  ".join(f"{k} {(v.double() - ref).abs().max().item():.3g}" for k, v in outs.items())
        print(f"{lname} {tuple(w.shape)}: |error| vs float64: {errs}")


if __name__ == "__main__":
    main()

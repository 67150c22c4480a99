"""Convolution programs: eager vs torch.compile vs fusec without and with the layout pass.

    python benchmarks/conv_layout.py                       # CPU, scaled-down sizes
    python benchmarks/conv_layout.py --device cuda --full  # GPU, KernelBench level-2 sizes
    python benchmarks/conv_layout.py --dtype bf16 --only conv_act_bn --json out.json

Each problem is a convolution followed by what KernelBench level 2 puts after one (activations,
batch/group norm, pooling, a softmax over channels), written here in that style. Every problem
runs in one process through eager PyTorch, torch.compile (Inductor, default mode), fusec with
the layout pass switched off (FUSEC_LAYOUT=contiguous: "before"), fusec as it decides
("after") and fusec with channels-last forced ("forced", to check the decision); every result is checked against eager first. Modules stay in their default (training)
mode as in KernelBench, under torch.no_grad(). Times are medians in ms.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import fusec
from fusec.timing import median_ms


class ConvActBN(nn.Module):
    """conv2d -> x * tanh(softplus(x)) -> BatchNorm2d (batch statistics)."""

    def __init__(self, cin, cout):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(cin, cout, 3), nn.BatchNorm2d(cout)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y * torch.tanh(F.softplus(y)))


class ConvGNPool(nn.Module):
    """conv2d -> GroupNorm -> scale -> max-pool."""

    def __init__(self, cin, cout):
        super().__init__()
        self.conv, self.gn = nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(8, cout)

    def forward(self, x):
        return F.max_pool2d(self.gn(self.conv(x)) * 1.5, 2)


class ConvSoftmaxMean(nn.Module):
    """conv2d -> softmax over channels -> global average pool."""

    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3)

    def forward(self, x):
        return torch.softmax(self.conv(x), dim=1).mean((2, 3))


class ConvTMishHardtanh(nn.Module):
    """conv_transpose2d -> Mish -> add -> Hardtanh -> scale."""

    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.ConvTranspose2d(cin, cout, 3, stride=2, padding=1, output_padding=1)

    def forward(self, x):
        return F.hardtanh(F.mish(self.conv(x)) + 0.5, -1, 1) * 2


class Conv3dSoftmaxPool(nn.Module):
    """conv3d -> softmax over channels -> max-pool."""

    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv3d(cin, cout, 3)

    def forward(self, x):
        return F.max_pool3d(torch.softmax(self.conv(x), dim=1), 2)


# name: (module class, (batch, cin, cout, spatial) small, same full)
PROBLEMS = {
    "conv_act_bn": (ConvActBN, (8, 32, 64, (32, 32)), (128, 64, 128, (128, 128))),
    "conv_gn_pool": (ConvGNPool, (8, 32, 64, (32, 32)), (128, 64, 128, (64, 64))),
    "conv_softmax_mean": (ConvSoftmaxMean, (8, 32, 64, (32, 32)), (128, 64, 128, (64, 64))),
    "convT_mish_hardtanh": (ConvTMishHardtanh, (8, 32, 32, (16, 16)), (128, 64, 64, (32, 32))),
    "conv3d_softmax_pool": (Conv3dSoftmaxPool, (4, 8, 16, (8, 16, 16)), (32, 16, 32, (16, 32, 32))),
}


def conv_call(conv, t, w):
    """`conv` applied to input t with weight w (in whatever layout they are)."""
    if isinstance(conv, nn.ConvTranspose2d):
        return F.conv_transpose2d(t, w, conv.bias, conv.stride, conv.padding, conv.output_padding,
                                  conv.groups, conv.dilation)
    return conv._conv_forward(t, w, conv.bias)


def fusec_with_layout(model, x, mode: str):
    """fusec.compile with FUSEC_LAYOUT=mode while it compiles (the first call)."""
    old = os.environ.get("FUSEC_LAYOUT")
    os.environ["FUSEC_LAYOUT"] = mode
    try:
        cf = fusec.compile(model)
        cf(x)
    finally:
        if old is None:
            os.environ.pop("FUSEC_LAYOUT")
        else:
            os.environ["FUSEC_LAYOUT"] = old
    return cf


def run(name, device, dtype, full):
    cls, small, big = PROBLEMS[name]
    n, cin, cout, spatial = big if full else small
    torch.manual_seed(0)
    model = cls(cin, cout).to(device=device, dtype=dtype)
    x = torch.randn(n, cin, *spatial, device=device, dtype=dtype)
    row = {"problem": name, "shape": [n, cin, cout, list(spatial)], "dtype": str(dtype)}
    with torch.no_grad():
        want = model(x)
        tol = 2e-2 if dtype != torch.float32 else 1e-3
        fns = {"eager": model}
        t0 = time.perf_counter()
        fns["torch.compile"] = torch.compile(model)
        fns["torch.compile"](x)
        row["compile_s"] = time.perf_counter() - t0
        fns["fusec before"] = fusec_with_layout(model, x, "contiguous")
        fns["fusec after"] = fusec_with_layout(model, x, "auto")
        fns["fusec forced"] = fusec_with_layout(model, x, "channels_last")
        e = fusec.explain(model, x)
        plan = e.compiled.passes.layout
        row["layout"], row["layout_reason"] = plan.choice, plan.reason
        for label, fn in fns.items():
            got = fn(x)
            err = (got.float() - want.float()).abs().max().item()
            scale = want.float().abs().max().item() + 1e-6
            row[f"{label} ok"] = bool(err <= tol * max(1.0, scale)) and got.stride() == want.stride()
        for label, fn in fns.items():
            row[label] = median_ms(fn, x, device=device, budget_s=1.0 if not full else 0.5)
        # the convolution alone, in each layout: what passes/layout.py's SPEEDUP table records
        conv = model.conv
        fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        x_cl = x.contiguous(memory_format=fmt)
        w_cl = conv.weight.detach().contiguous(memory_format=fmt)
        row["conv nchw"] = median_ms(conv, x, device=device)
        row["conv nhwc"] = median_ms(lambda t: conv_call(conv, t, w_cl), x_cl, device=device)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16"])
    ap.add_argument("--full", action="store_true", help="KernelBench level-2 sizes (GPU)")
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
    rows = []
    for name in args.only or PROBLEMS:
        rows.append(run(name, args.device, dtype, args.full))
        if args.json:  # keep what was measured even if a later problem runs out of time
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    labels = ["eager", "torch.compile", "fusec before", "fusec after", "fusec forced"]
    print(f"{'problem':<22} {'layout':<14}" + "".join(f"{l:>14}" for l in labels)
          + f"{'after/eager':>12}{'after/compile':>14}  ok")
    for r in rows:
        ok = all(r[f"{l} ok"] for l in labels)
        print(f"{r['problem']:<22} {r['layout']:<14}" + "".join(f"{r[l]:>14.3f}" for l in labels)
              + f"{r['eager'] / r['fusec after']:>11.2f}x{r['torch.compile'] / r['fusec after']:>13.2f}x"
              f"  {'yes' if ok else 'NO'}   conv alone nchw {r['conv nchw']:.3f} nhwc "
              f"{r['conv nhwc']:.3f} ({r['conv nchw'] / r['conv nhwc']:.2f}x)")
    for label in ("eager", "torch.compile", "fusec before"):
        g = math.exp(sum(math.log(r[label] / r["fusec after"]) for r in rows) / len(rows))
        print(f"geomean speed of fusec after vs {label}: {g:.2f}x")


if __name__ == "__main__":
    main()

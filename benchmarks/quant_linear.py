"""Quantized linear layers at decode sizes: weight bytes streamed per second, side by side.

    python benchmarks/quant_linear.py [--k 8192] [--n 8192] [--m 1,4,8,16] [--sweep] [--int4-paths]
                                      [--in-a-row 8] [--json out.json]

For each batch size M: a plain bf16 F.linear (cuBLAS: the baseline), and the W8A16 and W4A16
layers of examples/int8_linear.py and examples/int4_linear.py, and AWQ's and GPTQ's formats
(examples/awq_linear.py: eight nibbles along N per int32; examples/gptq_linear.py: eight along
K, the words N-contiguous), run eagerly, through torch.compile
and through fusec. Each row gives the median time and the weight bytes per second (the int8 or
packed int4 bytes plus their scales, which is what the layer has to read); each fusec row also
the quantized weight's bytes alone per second (issue 15's "TB/s of packed bytes"). `--sweep` also times
the fusec GEMV kernel with other block sizes (extensions/quant_gemv/triton_gemv.py, gemv_blocks) and with the GEMV
forced at every M (extensions/quant_gemv/small_matmul.py, SMALL_M), the measurements behind both choices.
Packed int4 at small M is read as 32-bit words: at M = 1 dequantized once per group
(extensions/quant_gemv/triton_gemv_int4_groups.py), at M = 2-16 multiplied on tensor cores with K split
(extensions/quant_gemv/triton_gemv_int4_mma.py), else per weight (extensions/quant_gemv/triton_gemv_int4.py, M <= 4).
`--int4-paths` adds rows with those paths switched off (FUSEC_INT4_PAIRED=0: the group kernel with
the high nibbles masked; FUSEC_INT4_GROUPS=0 FUSEC_INT4_MMA=0: the
per-weight word kernel up to M = 4; FUSEC_INT4_WORDS=0: the byte-per-lane GEMV), so that all are
timed in one run. Each fusec row names its kernels and which int4 path it took.
On CUDA each layer (cuBLAS's, and fusec's as chosen) is followed by a kernel that only reads the same
bytes, timed the same way (benchmarks/speed_of_light.py): at decode sizes a few microseconds of
each call are fixed, so that read, not the memory's peak, is how fast the layer could be.
`--in-a-row L` (K = N) also times L different layers of each kind applied one after another,
each to the last one's output, as a decoding model runs its layers, and reports the time per
layer. A single layer's do_bench time carries its L2 flush's cost: the flush writes zeros over
256 MB and leaves the L2 full of dirty lines, whose write-back shares the memory with the layer's
reads (on an H100, a bare read of the int4 layer's 35.7 MB runs 14% faster after a flush that only
reads). In a row, the flush comes once per L layers and every layer still finds its
weight cold, as in decoding; a bare read of L buffers in a row is its floor.
CUDA gives the numbers the issue asks for; on a CPU it runs the same rows at the C++ backend.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

import fusec
from fusec.examples.awq_linear import AWQLinear
from fusec.examples.gptq_linear import GPTQLinear
from fusec.examples.int4_linear import Int4Linear
from fusec.examples.int8_linear import Int8Linear
from fusec.runtime.build import codegen
from fusec.timing import median_ms


def weight_bytes(layer) -> int:
    return sum(b.numel() * b.element_size() for b in layer.buffers() if b is not None)


def packed_bytes(layer) -> int:
    """The quantized weight alone, without scales and zero points: issue 15 counts packed int4
    in these bytes ("2.0 TB/s of packed bytes")."""
    t = getattr(layer, "packed", getattr(layer, "qweight", getattr(layer, "q", None)))
    return t.numel() * t.element_size()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--m", default="1,4,8,16")
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--int4-paths", action="store_true",
                   help="also time int4's other GEMVs (FUSEC_INT4_GROUPS=0 FUSEC_INT4_MMA=0, "
                        "FUSEC_INT4_WORDS=0)")
    p.add_argument("--in-a-row", type=int, default=0, metavar="L",
                   help="also time L distinct layers applied one after another (K = N)")
    p.add_argument("--json")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    k, n = args.k, args.n
    w = (torch.randn(n, k, device=device) / k ** 0.5).to(torch.bfloat16)
    layers = {"int8": Int8Linear(w).to(device), "int4": Int4Linear(w, args.group).to(device),
              "awq": AWQLinear(w.t().contiguous(), args.group).to(device),
              "gptq": GPTQLinear(w.t().contiguous(), args.group).to(device)}
    rows = []

    def floor(name, m, nbytes):
        """A kernel that only reads the same bytes, timed the same way (benchmarks/speed_of_light.py),
        and the row just above as a fraction of its speed."""
        from speed_of_light import read_floor_ms  # CUDA only
        ms = read_floor_ms(nbytes, device)
        above = rows[-1]
        rows.append(dict(name=name, m=m, ms=ms, bytes=nbytes, tbps=nbytes / ms / 1e9))
        print(f"{name:34s} M={m:<3d} {ms:9.4f} ms {nbytes / ms / 1e9:7.3f} TB/s   "
              f"({above['name']}: {ms / above['ms']:.0%} of this speed)", flush=True)

    def row(name, m, nbytes, fn, x, calls=1):
        """fn(x)'s median time; `calls` layers in it: the time per layer."""
        with torch.no_grad():
            fn(x)
            ms = median_ms(fn, x, device=device) / calls
        rows.append(dict(name=name, m=m, ms=ms, bytes=nbytes, tbps=nbytes / ms / 1e9))
        print(f"{name:34s} M={m:<3d} {ms:9.4f} ms {nbytes / ms / 1e9:7.3f} TB/s", flush=True)

    for m in [int(v) for v in args.m.split(",")]:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        row("bf16 F.linear (cuBLAS/eager)", m, w.numel() * 2, lambda x: F.linear(x, w), x)
        if device == "cuda":
            floor("  bf16 bytes, read only", m, w.numel() * 2)
        for fmt, layer in layers.items():
            nb = weight_bytes(layer)
            row(f"{fmt} eager", m, nb, layer, x)
            if not args.no_compile:
                row(f"{fmt} torch.compile", m, nb, torch.compile(layer), x)
            paths = PATHS if fmt == "int4" and args.int4_paths else [("", {})]
            for label, env in paths:
                before = {key: os.environ.get(key) for key in env}
                os.environ.update(env)  # read when the kernel is rendered, in fusec.compile's run
                try:
                    cf = fusec.compile(layer)
                    row(f"{fmt} fusec{label}", m, nb, cf, x)
                    pb = packed_bytes(layer)
                    rows[-1]["tbps_packed"] = pb / rows[-1]["ms"] / 1e9
                    print(f"{'':34s} the quantized weight alone ({pb / 1e6:.1f} MB): "
                          f"{rows[-1]['tbps_packed']:.3f} TB/s", flush=True)
                    # each kernel rendered again here, under this path's setting
                    sources = [codegen(kk.backend).render(kk.ir) for kk in cf.kernels]
                finally:
                    for key, value in before.items():
                        os.environ.pop(key, None)
                        if value is not None:
                            os.environ[key] = value
                check(rows, cf, layer, fmt, x, sources)
                if device == "cuda" and not label:
                    floor(f"  {fmt} bytes, read only", m, nb)
        if args.sweep and device == "cuda":
            sweep(rows, layers, x, m, row)
        if args.in_a_row:
            in_a_row(rows, args, w, x, m, row)

    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                           torch=torch.__version__, rows=rows), f, indent=1)


class InARow(torch.nn.Module):
    """Layers applied one after another, each to the last one's output."""

    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Bf16Linear(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.register_buffer("w", w)

    def forward(self, x):
        return F.linear(x, self.w)


def in_a_row(rows, args, w, x, m, row):
    """`--in-a-row L`: L layers of each kind, each with its own weight in its own memory (w plus
    noise), so that every layer reads its bytes cold, applied one after another; each row gives
    the time per layer and one layer's bytes. fusec compiles the whole row: one GEMV kernel per
    layer."""
    L = args.in_a_row
    if args.k != args.n:
        print(f"--in-a-row: skipped, K = {args.k} != N = {args.n} (a layer's output is the "
              "next one's input)")
        return
    weights = [(w.float() + torch.randn_like(w, dtype=torch.float32) / args.k ** 0.5 / 4)
               .to(torch.bfloat16) for _ in range(L)]
    stacks = {"bf16": InARow([Bf16Linear(v) for v in weights]),
              "int8": InARow([Int8Linear(v) for v in weights]).to(w.device),
              "int4": InARow([Int4Linear(v, args.group) for v in weights]).to(w.device)}
    for fmt, stack in stacks.items():
        nb = weight_bytes(stack.layers[0])
        runs = {"bf16": [("F.linear (cuBLAS)", stack, {})]}.get(fmt) or (
            [] if args.no_compile else [("torch.compile", torch.compile(stack), {})])
        if fmt != "bf16":
            cf = fusec.compile(stack)
            with torch.no_grad():
                got, ref = cf(x).double(), stack(x).double()
            rel = ((got - ref).norm() / ref.norm()).item()
            print(f"{fmt} fusec, {L} in a row: {len(cf.kernels)} kernels; the last layer's "
                  f"output against eager's: relative error {rel:.2g}", flush=True)
            runs.append(("fusec", cf, dict(kernels=len(cf.kernels), rel_err=rel)))
        for label, fn, facts in runs:
            row(f"{fmt} {label}, {L} in a row", m, nb, fn, x, calls=L)
            rows[-1].update(facts, in_a_row=L)
            inner = getattr(getattr(fn, "_compiled", fn), "last", None)
            if getattr(inner, "runner", None) is not None:
                print(f"{'':34s} (fusec replays this row as one CUDA graph itself)", flush=True)
            elif w.device.type == "cuda":  # and replayed as one CUDA graph, as a decode step is
                try:
                    replay = graphed(fn, x)
                except RuntimeError as e:
                    print(f"{fmt} {label}, {L} in a row: not captured as a graph ({e})")
                    continue
                row(f"{fmt} {label}, {L} in a row, graph", m, nb, replay, x, calls=L)
                rows[-1].update(facts, in_a_row=L)
        if w.device.type != "cuda":
            continue
        bufs = [torch.empty(nb // 4, dtype=torch.int32, device=w.device) for _ in range(L)]
        from speed_of_light import read_row_ms  # CUDA only
        ms = read_row_ms(bufs) / L
        rows.append(dict(name=f"  {fmt} bytes, read only, {L} in a row", m=m, ms=ms, bytes=nb,
                         tbps=nb / ms / 1e9, in_a_row=L))
        print(f"{rows[-1]['name']:34s} M={m:<3d} {ms:9.4f} ms {nb / ms / 1e9:7.3f} TB/s   "
              f"({rows[-2]['name']}: {ms / rows[-2]['ms']:.0%} of this speed)", flush=True)


def graphed(fn, x):
    """fn(x) captured once as a CUDA graph: a callable that replays it (x stays the same)."""
    with torch.no_grad():
        for _ in range(3):
            fn(x)  # compiled, and past fusec's first calls (the second call captures its own graph)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(x)
    return lambda _x: graph.replay()


# the int4 GEMV paths --int4-paths times: as chosen, the word kernel, the byte-per-lane kernel
PATHS = [("", {}), (" (unpaired: FUSEC_INT4_PAIRED=0)", {"FUSEC_INT4_PAIRED": "0"}),
         (" (words: GROUPS=0 MMA=0)", {"FUSEC_INT4_GROUPS": "0", "FUSEC_INT4_MMA": "0"}),
         (" (bytes: FUSEC_INT4_WORDS=0)", {"FUSEC_INT4_WORDS": "0"})]


def check(rows, cf, layer, fmt, x, sources):
    """The last row's kernels, which int4 path they took (their `sources`), and fusec's and
    eager's error against a float64 product of the exactly dequantized weight (eager's error
    includes its rounding of every weight to bf16 before the product)."""
    with torch.no_grad():
        ref = F.linear(x.double(), _dequant(layer, fmt).double())
        err_f = (cf(x).double() - ref).abs().max().item()
        err_e = (layer(x).double() - ref).abs().max().item()
    # (each kernel names its template in the line "Generated by fusec from ...")
    groups = any("from extensions/quant_gemv/templates/triton_gemv_int4_groups.py.j2" in t for t in sources)
    words = any("from extensions/quant_gemv/templates/triton_gemv_int4.py.j2" in t for t in sources)
    mma = any("from extensions/quant_gemv/templates/triton_gemv_int4_mma.py.j2" in t for t in sources)
    rows[-1].update(kernels=[kk.name for kk in cf.kernels], int4_words=words or groups or mma,
                    int4_groups=groups, int4_mma=mma, err_fusec=err_f, err_eager=err_e)
    triton = any(kk.backend == "triton" for kk in cf.kernels)
    path = (" (32-bit words, dequantized per group)" if groups else
            " (32-bit words, tensor cores, split K)" if mma else " (32-bit words)" if words
            else " (byte per lane)") if fmt == "int4" and triton else ""
    print(f"{'':34s} kernels {[kk.name for kk in cf.kernels]}{path}  |err| fusec {err_f:.3g} "
          f"eager {err_e:.3g}", flush=True)


def _dequant(layer, fmt):
    """The weight the quantized layer stands for, in float64: q * scale, (q - zero) * scale."""
    if fmt == "int8":
        return layer.q.double() * layer.scale.double()[:, None]
    if fmt in ("awq", "gptq"):
        return layer.dequantized().t()
    p = layer.packed.view(layer.n, layer.k // layer.group, layer.group // 2).double()
    q = torch.stack([p.remainder(16), p.div(16, rounding_mode="floor")], -1)
    q = q.view(layer.n, layer.k // layer.group, layer.group)
    return ((q - layer.zero.double()[..., None]) * layer.scale.double()[..., None]).view(
        layer.n, layer.k)


def sweep(rows, layers, x, m, row):
    """Other GEMV block sizes, and the GEMV at M above SMALL_M."""
    import fusec.extensions.quant_gemv.triton_gemv as tr
    import importlib
    sm = importlib.import_module("fusec.extensions.quant_gemv.small_matmul")  # the module, not the pass function
    default_blocks, default_dot, default_m = tr.gemv_blocks, tr.gemv_dot_blocks, sm.SMALL_M
    sm.SMALL_M = 64
    try:
        configs = [(16, 1024, 8), (8, 1024, 4), (8, 2048, 8), (4, 2048, 4), (4, 4096, 8),
                   (2, 4096, 4), (8, 512, 4), (16, 512, 4)]
        dot_configs = [(16, 128, 4, 3), (16, 256, 4, 3), (16, 256, 4, 4), (32, 128, 4, 3),
                       (32, 256, 4, 3), (64, 128, 4, 3), (16, 512, 4, 3), (32, 256, 8, 4)]
        for fmt, layer in layers.items():
            if fmt in ("awq", "gptq"):
                continue  # (their blocks are gemv_blocks_n_major's)
            nb = weight_bytes(layer)
            if m > default_m:
                row(f"{fmt} fusec GEMV forced", m, nb, fusec.compile(layer), x)
            if m < tr.GEMV_DOT_MIN_M:
                for bn, bk_m1, warps in configs:
                    bm = 1 << max(m - 1, 0).bit_length()
                    bk = max(16, bk_m1 // bm)
                    tr.gemv_blocks = lambda mm, nn, kk, weight_bytes=1, c=(bm, bn, bk, warps): c
                    row(f"{fmt} fusec BN={bn} BK={bk} w={warps}", m, nb, fusec.compile(layer), x)
                continue  # M = 1 rows are one-dimensional: no tensor-core version
            default_dot_m, tr.GEMV_DOT_MIN_M = tr.GEMV_DOT_MIN_M, 1 << 30
            try:
                row(f"{fmt} fusec GEMV lanes (no dot)", m, nb, fusec.compile(layer), x)
            finally:
                tr.GEMV_DOT_MIN_M = default_dot_m
            for bn, bk, warps, stages in dot_configs:
                bm = max(16, 1 << max(m - 1, 0).bit_length())
                tr.gemv_dot_blocks = lambda mm, nn, kk, t=1, c=(bm, bn, bk, warps, stages): c
                row(f"{fmt} fusec dot BN={bn} BK={bk} w={warps} s={stages}", m, nb,
                    fusec.compile(layer), x)
    finally:
        tr.gemv_blocks, tr.gemv_dot_blocks, sm.SMALL_M = default_blocks, default_dot, default_m


if __name__ == "__main__":
    main()

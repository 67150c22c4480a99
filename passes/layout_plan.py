"""Layout's cost model and record: what channels-last is measured to buy, and what the layout
pass decided (passes/layout.py is the pass itself).

`speedup(device, spatial, transposed, dtype)` is the measured gain of one convolution in
channels-last over NCHW (docs/passes/layout.md has the tables); FLOPS, BANDWIDTH and LAUNCH turn a
convolution and a conversion into estimated seconds. `LayoutPlan` (with a `ConvChoice` per
convolution and a `Conversion` per inserted clone) is what the pass leaves in
the graph's record (`record_of(gm).layout`, fusec/record.py) and `fusec.explain` prints.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fusec.ir import short_dtype

# ---- the cost model ------------------------------------------------------------------------------

# Speed of the convolution alone in channels-last over NCHW, measured with eager PyTorch
# (docs/passes/layout.md has the tables): key (device type, spatial dims, transposed, dtype).
# A missing key means 1.0: no measured gain, so no reason to pay for conversions.
SPEEDUP = {
    # 2-core AMD EPYC (AVX2, no AVX-512), torch 2.13 + oneDNN, one thread, CPU time: conv2d 1.1-7.8x
    # (f32; 1.6-2.2x at typical 3x3 sizes), 2.9x (bf16: without AVX-512 BF16 the NCHW path is
    # slow), transposed conv2d 1.6x, conv3d 1.0-1.3x, depthwise 1.6x.
    ("cpu", 2, False, torch.float32): 1.6,
    ("cpu", 2, False, torch.bfloat16): 2.8,
    ("cpu", 2, False, torch.float16): 1.6,
    # The 2-core Intel Xeon (Sapphire Rapids, AVX-512) CI runs on, f32, one thread, at
    # KernelBench-style CPU sizes: transposed conv2d 1.52x, depthwise 1.59x, conv2d 1.21x.
    ("cpu", 2, True, torch.float32): 1.5,
    ("cpu", 3, False, torch.float32): 1.1,
    # NVIDIA H100 and H200, torch 2.11 + cuDNN 9.19, TF32 as the user left it (on, the default),
    # the convolution alone at KernelBench level-2 sizes (benchmarks/conv_layout.py):
    # conv2d 1.64-1.67x (f32), 1.66-1.68x (bf16); transposed 1.56-1.58x (f32), 1.67x (bf16);
    # conv3d 1.25x (f32), 1.45x (bf16). float16 is assumed to behave as bfloat16.
    ("cuda", 2, False, torch.float32): 1.6,
    ("cuda", 2, False, torch.bfloat16): 1.65,
    ("cuda", 2, False, torch.float16): 1.65,
    ("cuda", 2, True, torch.float32): 1.55,
    ("cuda", 2, True, torch.bfloat16): 1.65,
    ("cuda", 2, True, torch.float16): 1.65,
    ("cuda", 3, False, torch.float32): 1.25,
    ("cuda", 3, False, torch.bfloat16): 1.45,
    ("cuda", 3, False, torch.float16): 1.45,
}

# Depthwise 2-D convolutions (groups = input channels) on CUDA are not FLOP-bound: in NCHW eager
# runs ATen's own `conv_depthwise2d` kernel, which streamed 0.82 TB/s (input + output bytes) at
# KernelBench-style 18_'s size on an H200 (32 x 32 x 128 x 128 f32: 0.164 ms), where cuDNN's
# channels-last kernel took 0.049 ms (3.3x). Their time is priced from bytes, not FLOPs.
# On that Xeon's CPU, one thread, oneDNN's NCHW depthwise conv2d (KernelBench-style 18_, 8
# channels at 32 x 32) streamed 1.8 GB/s and took 1.6x its channels-last time.
DEPTHWISE = {("cuda", torch.float32): (0.82e12, 3.3),  # (NCHW bytes/s, channels-last speedup)
             ("cpu", torch.float32): (1.8e9, 1.6)}

# Rough sustained throughput, to turn FLOPs and bytes into the same unit (seconds). Only their
# ratio matters: how many FLOPs of convolution one byte of conversion traffic is worth.
# Convolution FLOP/s as measured in NCHW: on an H200, 2-D convolutions at KernelBench sizes ran at
# ~110 TFLOP/s (TF32), transposed and 3-D ones at ~35. The CPU figures are per thread (times
# torch.get_num_threads()): oneDNN ran KernelBench-style 8_'s conv2d (4.7 MFLOP, CPU scale) in
# about 0.05 ms on one AVX2 core of this project's EPYC, ~90 GFLOP/s; a transposed conv2d ran at
# ~18 GFLOP/s on one core of the Xeon. (Set too low, it makes small convolutions look slow and
# their layout conversions worth paying, which they are not.) Key: (device, spatial dims,
# transposed), or (device, None) for every other kind (`conv_rate`).
FLOPS = {("cpu", 2, False): 90e9, ("cpu", 2, True): 18e9, ("cpu", None): 45e9,
         ("cuda", 2, False): 100e12, ("cuda", None): 35e12}
PER_THREAD = {"cpu"}  # devices whose FLOPS above are per thread
BANDWIDTH = {"cpu": 10e9, "cuda": 3.5e12}  # bytes/s of a copy that transposes (H200 copy: 4.2)
LAUNCH = {"cpu": 5e-6, "cuda": 4e-6}  # seconds: the fixed cost of one more kernel in the program

# Note (a fused conversion is not free on the CPU): a conversion whose input some kernel writes
# anyway fuses into that kernel and only changes the order it stores in. On a GPU the stores of
# neighbouring threads still land side by side, so it costs nothing. A CPU thread walks the
# kernel's own (say NHWC) order, and each store to the NCHW copy lands H x W elements from the
# last, on a new cache line: an NHWC -> NCHW epilogue over 450 KiB (2 x 64 x 30 x 30 f32) took
# 65 us against 15 us for the same kernel storing in order (C++ backend, one thread of this
# project's 2-core Xeon), about one more pass over its bytes at the transposing-copy bandwidth.
# Priced as free, it made the layout pass choose channels-last for the small convolutions of
# KernelBench level 2 (a conv2d of 8 -> 64 channels at 32 x 32 followed by HardSwish and ReLU):
# three kernels where eager runs one convolution and one pointwise op, and 1.4x slower than eager.
FUSED_CONVERSION = {"cpu": True, "cuda": False}  # does a fused conversion cost its bytes here?


def conv_rate(kind: str, spatial: int, transposed: bool) -> float:
    """FLOP/s of one convolution kind in NCHW (per thread on a CPU: PER_THREAD)."""
    return FLOPS.get((kind, spatial, transposed), FLOPS[kind, None])


def conversion_cost(c: "Conversion") -> float:
    """Estimated seconds one conversion adds per call: a pass of its own (read and write at the
    transposing-copy bandwidth, plus a launch); fused into the kernel that writes its input, the
    write side alone on a CPU and nothing on a GPU (Note: a fused conversion is not free)."""
    kind = "cuda" if c.device.startswith("cuda") else "cpu"
    if c.free:
        return c.nbytes / BANDWIDTH[kind] if FUSED_CONVERSION[kind] else 0.0
    return c.nbytes * 2 / BANDWIDTH[kind] + LAUNCH[kind]


def speedup(device: str, spatial: int, transposed: bool, dtype: torch.dtype) -> tuple[float, str]:
    """(measured channels-last speedup, why) for one convolution."""
    kind = "cuda" if device.startswith("cuda") else device.split(":")[0]
    if kind == "cuda":
        if not torch.backends.cudnn.enabled:
            return 1.0, "cuDNN is disabled (torch.backends.cudnn.enabled = False)"
        if dtype == torch.float32 and not torch.backends.cudnn.allow_tf32:
            # Without TF32 no Tensor Core kernel may run in f32; we do not switch it on.
            return 1.0, "f32 without TF32 (torch.backends.cudnn.allow_tf32 = False): no gain measured"
    elif kind == "cpu":
        if not (torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available()):
            return 1.0, "oneDNN is not available or disabled (torch.backends.mkldnn)"
    s = SPEEDUP.get((kind, spatial, transposed, dtype), 1.0)
    lib = "cuDNN" if kind == "cuda" else "oneDNN"
    what = f"{'transposed ' if transposed else ''}conv{spatial}d {short_dtype(dtype)} on {kind}"
    if s <= 1.0:
        return 1.0, f"{what}: {lib} measured no faster in channels-last"
    return s, f"{what}: {lib} measured {s:.2f}x faster in channels-last"


# ---- what the pass records -----------------------------------------------------------------------

@dataclass
class ConvChoice:
    node: str
    what: str  # "conv2d f32[128, 64, 126, 126]"
    flops: float
    speedup: float
    gain_s: float  # estimated seconds saved per call
    reason: str


@dataclass
class Conversion:
    node: str  # the clone node the pass inserted
    source: str  # the value it converts
    to: str  # "channels_last", "contiguous", ...
    nbytes: int
    free: bool  # fuses into a kernel that runs anyway
    why: str
    device: str = "cpu"


@dataclass
class LayoutPlan:
    """What the layout pass decided for one program (`record_of(gm).layout`)."""

    choice: str  # "channels_last" or "unchanged"
    reason: str
    convs: list[ConvChoice] = field(default_factory=list)
    conversions: list[Conversion] = field(default_factory=list)
    tensors: list[tuple[str, str, str, str]] = field(default_factory=list)  # name, meta, format, why
    gain_s: float = 0.0
    cost_s: float = 0.0

    def summary(self) -> str:
        if self.choice == "channels_last":
            return (f"channels-last for {len(self.convs)} convolution(s), "
                    f"{len(self.conversions)} conversion(s)")
        return "layout unchanged"

    def __str__(self) -> str:
        lines = [f"layout: {self.choice} — {self.reason}"]
        if self.convs:
            lines.append(f"  cost model: gain {self.gain_s * 1e3:.3f} ms vs conversions "
                         f"{self.cost_s * 1e3:.3f} ms per call (estimates)")
        for c in self.convs:
            lines.append(f"  {c.node:<24} {c.what}: {c.flops / 1e9:.3g} GFLOP, "
                         f"gain {c.gain_s * 1e3:.3f} ms  ({c.reason})")
        for c in self.conversions:
            if c.free and not conversion_cost(c):
                cost = "free: fuses into the kernel that writes it"
            elif c.free:
                cost = (f"fuses into the kernel that writes it; its {c.nbytes} bytes are stored "
                        f"out of order, {conversion_cost(c) * 1e3:.3f} ms")
            else:
                cost = f"{c.nbytes} bytes, one extra pass, {conversion_cost(c) * 1e3:.3f} ms"
            lines.append(f"  {c.node:<24} {c.source} -> {c.to}: {c.why} ({cost})")
        if self.tensors:
            lines.append("  tensors:")
            for name, meta, fmt, why in self.tensors:
                lines.append(f"    {name:<24} {meta:<24} {fmt:<16} {why}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"choice": self.choice, "reason": self.reason, "gain_s": self.gain_s,
                "cost_s": self.cost_s,
                "convs": [vars(c) for c in self.convs],
                "conversions": [vars(c) for c in self.conversions],
                "tensors": [dict(zip(("name", "meta", "format", "why"), t)) for t in self.tensors]}

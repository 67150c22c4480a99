"""Conv3d, InstanceNorm3d, clamp, a per-channel multiplier, max over channels.

A KernelBench-style problem written for fusec's benchmark (benchmarks/kernelbench.py): a
3-D convolution followed by the ops a compiler should fuse. `get_model(scale)` and
`get_inputs(scale)` build it at the "cpu" scale (seconds on two cores) or the "gpu" scale.
"""
import torch
import torch.nn.functional as F  # noqa: F401 - used by most problems
from torch import nn

SIZES = {"cpu": dict(batch=2, cin=4, cout=8, depth=8, hw=16), "gpu": dict(batch=16, cin=16, cout=32, depth=16, hw=64)}


class Model(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv3d(cin, cout, 3, padding=1)
        self.norm = nn.InstanceNorm3d(cout)
        self.mult = nn.Parameter(torch.randn(cout, 1, 1, 1))

    def forward(self, inputs):
        x = self.conv(inputs)
        x = torch.clamp(self.norm(x), -1.0, 1.0) * self.mult
        return torch.amax(x, dim=1)


def get_model(scale="cpu"):
    s = SIZES[scale]
    return Model(s["cin"], s["cout"])


def get_inputs(scale="cpu"):
    s = SIZES[scale]
    return [torch.randn(s["batch"], s["cin"], s["depth"], s["hw"], s["hw"])]

"""MobileNet's depthwise block: a 3x3 convolution per channel (groups=channels), BatchNorm, ReLU6.

A KernelBench-style problem written for fusec's benchmark (benchmarks/kernelbench.py): a
2-D convolution followed by the ops a compiler should fuse. `get_model(scale)` and
`get_inputs(scale)` build it at the "cpu" scale (seconds on two cores) or the "gpu" scale.
"""
import torch
import torch.nn.functional as F  # noqa: F401 - used by most problems
from torch import nn

SIZES = {"cpu": dict(batch=2, cin=8, cout=16, hw=32), "gpu": dict(batch=32, cin=32, cout=64, hw=128)}


class Model(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cin, 3, padding=1, groups=cin)
        self.bn = nn.BatchNorm2d(cin)

    def forward(self, inputs):
        x = self.conv(inputs)
        return F.relu6(self.bn(x))


def get_model(scale="cpu"):
    s = SIZES[scale]
    return Model(s["cin"], s["cout"])


def get_inputs(scale="cpu"):
    s = SIZES[scale]
    return [torch.randn(s["batch"], s["cin"], s["hw"], s["hw"])]

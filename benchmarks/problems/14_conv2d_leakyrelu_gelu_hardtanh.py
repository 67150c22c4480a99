"""Conv2d, leaky ReLU, GELU, hardtanh.

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
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)

    def forward(self, inputs):
        x = self.conv(inputs)
        return F.hardtanh(F.gelu(F.leaky_relu(x, 0.01)))


def get_model(scale="cpu"):
    s = SIZES[scale]
    return Model(s["cin"], s["cout"])


def get_inputs(scale="cpu"):
    s = SIZES[scale]
    return [torch.randn(s["batch"], s["cin"], s["hw"], s["hw"])]

"""ConvTranspose3d (2x upsampling), a scale, average pooling, a bias, a second scale.

A KernelBench-style problem written for fusec's benchmark (benchmarks/kernelbench.py): a
3-D transposed convolution followed by the ops a compiler should fuse. `get_model(scale)` and
`get_inputs(scale)` build it at the "cpu" scale (seconds on two cores) or the "gpu" scale.
"""
import torch
import torch.nn.functional as F  # noqa: F401 - used by most problems
from torch import nn

SIZES = {"cpu": dict(batch=2, cin=4, cout=8, depth=4, hw=8), "gpu": dict(batch=16, cin=16, cout=32, depth=8, hw=32)}


class Model(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.ConvTranspose3d(cin, cout, 4, stride=2, padding=1)
        self.bias = nn.Parameter(torch.randn(cout, 1, 1, 1) * 0.1)

    def forward(self, inputs):
        x = self.conv(inputs)
        return (F.avg_pool3d(x * 0.5, 2) + self.bias) * 1.5


def get_model(scale="cpu"):
    s = SIZES[scale]
    return Model(s["cin"], s["cout"])


def get_inputs(scale="cpu"):
    s = SIZES[scale]
    return [torch.randn(s["batch"], s["cin"], s["depth"], s["hw"], s["hw"])]

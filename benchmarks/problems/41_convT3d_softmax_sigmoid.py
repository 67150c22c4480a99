"""ConvTranspose3d, softmax over channels, sigmoid.

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

    def forward(self, inputs):
        x = self.conv(inputs)
        return torch.sigmoid(torch.softmax(x, dim=1))


def get_model(scale="cpu"):
    s = SIZES[scale]
    return Model(s["cin"], s["cout"])


def get_inputs(scale="cpu"):
    s = SIZES[scale]
    return [torch.randn(s["batch"], s["cin"], s["depth"], s["hw"], s["hw"])]

"""ConvTranspose2d, GELU, GroupNorm.

A KernelBench-style problem written for fusec's benchmark (benchmarks/kernelbench.py): a
2-D transposed convolution followed by the ops a compiler should fuse. `get_model(scale)` and
`get_inputs(scale)` build it at the "cpu" scale (seconds on two cores) or the "gpu" scale.
"""
import torch
import torch.nn.functional as F  # noqa: F401 - used by most problems
from torch import nn

SIZES = {"cpu": dict(batch=2, cin=8, cout=16, hw=16), "gpu": dict(batch=32, cin=32, cout=64, hw=64)}


class Model(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.ConvTranspose2d(cin, cout, 4, stride=2, padding=1)
        self.norm = nn.GroupNorm(8, cout)

    def forward(self, inputs):
        x = self.conv(inputs)
        return self.norm(F.gelu(x))


def get_model(scale="cpu"):
    s = SIZES[scale]
    return Model(s["cin"], s["cout"])


def get_inputs(scale="cpu"):
    s = SIZES[scale]
    return [torch.randn(s["batch"], s["cin"], s["hw"], s["hw"])]

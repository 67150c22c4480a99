"""Linear, BatchNorm1d (inference statistics), GELU, ReLU.

A KernelBench-style problem written for fusec's benchmark (benchmarks/kernelbench.py): a
matrix multiply (nn.Linear) followed by the ops a compiler should fuse. `get_model(scale)` and
`get_inputs(scale)` build it at the "cpu" scale (seconds on two cores) or the "gpu" scale.
"""
import torch
import torch.nn.functional as F  # noqa: F401 - used by most problems
from torch import nn

SIZES = {"cpu": dict(batch=64, cin=256, cout=512), "gpu": dict(batch=2048, cin=2048, cout=2048)}


class Model(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.linear = nn.Linear(cin, cout)
        self.bn = nn.BatchNorm1d(cout)

    def forward(self, inputs):
        x = self.linear(inputs)
        return torch.relu(F.gelu(self.bn(x)))


def get_model(scale="cpu"):
    s = SIZES[scale]
    return Model(s["cin"], s["cout"])


def get_inputs(scale="cpu"):
    s = SIZES[scale]
    return [torch.randn(s["batch"], s["cin"])]

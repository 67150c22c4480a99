"""Softmax over the last dim: max, subtract, exp, sum, divide. Eager runs five kernels and reads
each row five times; fused, one kernel loads a row once, reduces it twice and stores the result."""
import torch

from fusec.demo import Example, run_example


def softmax(x):
    return torch.softmax(x, dim=-1)


def example(rows: int = 4096, cols: int = 4096, device: str = "cpu") -> Example:
    return Example("softmax", softmax, (torch.randn(rows, cols, device=device),),
                   "softmax is one reduction kernel", expect_kernels=1)


SMALL = dict(rows=64, cols=256)  # `fusec ... --small`: sizes for quick looks and tests

if __name__ == "__main__":
    run_example(example(rows=1024, cols=1024))

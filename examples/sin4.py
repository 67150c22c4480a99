"""torch.sin four times: eager launches four kernels and reads and writes the tensor four times;
fused, one kernel reads x once and writes the result once."""
import torch

from fusec.demo import Example, run_example


def sin4(x):
    return torch.sin(torch.sin(torch.sin(torch.sin(x))))


def example(size: int = 1 << 20, device: str = "cpu") -> Example:
    return Example("sin4", sin4, (torch.randn(size, device=device),),
                   "four chained sins become one kernel", expect_kernels=1)


SMALL = dict(size=4096)  # `fusec ... --small`: sizes for quick looks and tests

if __name__ == "__main__":
    run_example(example())

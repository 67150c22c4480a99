"""a * b + a: the product never touches memory; one kernel reads a and b and writes the sum."""
import torch

from fusec.demo import Example, run_example


def add_mul(a, b):
    return a * b + a


def example(size: int = 1 << 20, device: str = "cpu") -> Example:
    return Example("add_mul", add_mul,
                   (torch.randn(size, device=device), torch.randn(size, device=device)),
                   "a multiply and an add fuse into one kernel", expect_kernels=1)


SMALL = dict(size=4096)  # `fusec ... --small`: sizes for quick looks and tests

if __name__ == "__main__":
    run_example(example())

"""Views cost nothing: x.t() and a strided slice of y are read in place, their strides folded into
the kernel's load addresses. No copy is made, even though neither input is contiguous."""
import torch

from fusec.demo import Example, run_example


def strided(x, y):
    return torch.tanh(x.t()) * y[:, ::2] + 1.0


def example(n: int = 1024, device: str = "cpu") -> Example:
    x = torch.randn(n, n, device=device)
    y = torch.randn(n, 2 * n, device=device)
    return Example("strided", strided, (x, y),
                   "a transposed input and a sliced input, read in place", expect_kernels=1)


SMALL = dict(n=64)  # `fusec ... --small`: sizes for quick looks and tests

if __name__ == "__main__":
    run_example(example())

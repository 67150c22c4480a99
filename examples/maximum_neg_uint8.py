"""uint8 arithmetic with broadcasting: neg of a (1, 8) row wraps around (-1 is 255), is broadcast
over 8390 rows, and compared with maximum. The cat of a single tensor is a copy. One kernel, and
the result must match eager bit for bit."""
import torch

from fusec.demo import Example, run_example


def maximum_neg(x1, x2):
    return torch.cat([torch.maximum(x2, torch.neg(x1))], dim=0)


def example(device: str = "cpu") -> Example:
    g = torch.Generator().manual_seed(0)
    x1 = torch.randint(0, 256, (1, 8), dtype=torch.uint8, generator=g).to(device)
    x2 = torch.randint(0, 256, (8390, 8), dtype=torch.uint8, generator=g).to(device)
    return Example("maximum_neg_uint8", maximum_neg, (x1, x2),
                   "uint8 neg wraps, broadcasts, and fuses with maximum", expect_kernels=1)


SMALL = dict()  # `fusec ... --small`: sizes for quick looks and tests

if __name__ == "__main__":
    run_example(example())

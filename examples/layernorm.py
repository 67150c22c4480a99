"""LayerNorm: mean, variance, normalize, scale and shift. Two reductions over the same rows and
the affine epilogue all fuse into one kernel."""
import torch
import torch.nn.functional as F

from fusec.demo import Example, run_example


def layernorm(x, weight, bias):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps=1e-5)


def example(rows: int = 8192, cols: int = 4096, device: str = "cpu") -> Example:
    return Example("layernorm", layernorm,
                   (torch.randn(rows, cols, device=device), torch.randn(cols, device=device),
                    torch.randn(cols, device=device)),
                   "layer_norm is one reduction kernel", expect_kernels=1)


SMALL = dict(rows=64, cols=256)  # `fusec ... --small`: sizes for quick looks and tests

if __name__ == "__main__":
    run_example(example(rows=1024, cols=1024))

"""A transformer MLP: LayerNorm -> Linear -> GELU -> Linear, plus the residual. The two matmuls
run as extern ATen calls (cuBLAS / MKL); everything between them fuses: 3 kernels, 2 matmuls."""
import torch

from fusec.demo import Example, run_example


class GeluMLP(torch.nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.fc1 = torch.nn.Linear(dim, hidden)
        self.fc2 = torch.nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def example(batch: int = 64, dim: int = 1024, device: str = "cpu",
            dtype: torch.dtype = torch.float32) -> Example:
    torch.manual_seed(0)
    model = GeluMLP(dim, 4 * dim).to(device=device, dtype=dtype).eval()
    x = torch.randn(batch, dim, device=device, dtype=dtype)
    return Example("gelu_mlp", model, (x,), "LN, GELU and the residual fuse around two matmuls",
                   expect_kernels=3)


SMALL = dict(batch=8, dim=64)  # `fusec ... --small`: sizes for quick looks and tests

if __name__ == "__main__":
    with torch.no_grad():
        run_example(example(dim=256))

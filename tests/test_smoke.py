import torch

from conftest import assert_matches


def test_sin4_is_one_kernel(target):
    backend, device = target
    x = torch.randn(1000, device=device)
    cf = assert_matches(lambda x: torch.sin(torch.sin(torch.sin(torch.sin(x)))), x,
                        backend=backend, kernels=1)
    assert cf.kernels[0].name == "fused_sin_sin_sin_sin_0"
    assert cf.kernels[0].backend == backend


def test_add_mul_broadcast_noncontiguous(target):
    backend, device = target
    a = torch.randn(16, 8, device=device).t()
    b = torch.randn(32, device=device)[::2]
    assert_matches(lambda a, b: a * b + a, a, b, backend=backend, kernels=1)

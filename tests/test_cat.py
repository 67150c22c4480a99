"""torch.cat with empty tensors in the list (a KV cache's first step): the empties are dropped at
capture (fusec/capture/decompositions.py, cat_without_empties), so a cat of one real tensor is a
copy that fuses with its producer. Every case against eager: values, dtype, strides."""
import pytest
import torch

from conftest import assert_matches

EMPTIES = {
    "legacy": lambda x: torch.tensor([], dtype=x.dtype, device=x.device),
    "legacy_f64": lambda x: torch.tensor([], dtype=torch.float64, device=x.device),
    "zero_along_dim": lambda x: x.new_empty(x.shape[0], x.shape[1], 0, x.shape[3]),
}


def grow(x, cache):
    return torch.cat([cache, x * 2], dim=-2) + 1


def grow_transposed(x, cache):
    return torch.cat([cache, x.transpose(1, 2)], dim=-2)


def two_real(x, cache):
    return torch.cat([cache, x, cache, x * 3], dim=2)


@pytest.mark.parametrize("fn", [grow, grow_transposed, two_real])
@pytest.mark.parametrize("empty", sorted(EMPTIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_cat_with_empties_matches_eager(target, fn, empty, dtype, channels_last):
    backend, device = target
    x = torch.randn(2, 3, 5, 7, dtype=dtype, device=device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    cache = EMPTIES[empty](x)
    if fn is grow_transposed and empty == "zero_along_dim":
        cache = x.new_empty(2, 5, 0, 7)
    compiled = assert_matches(fn, x, cache, backend=backend)
    got, want = compiled(x, cache), fn(x, cache)
    assert got.dtype == want.dtype and got.stride() == want.stride()


def test_cat_of_one_real_tensor_is_fused(target):
    """The first step of a growing cache: no cat is left, one kernel makes x*2 and the copy."""
    backend, device = target
    x = torch.randn(2, 3, 5, 7, device=device)
    compiled = assert_matches(grow, x, torch.tensor([], device=device), backend=backend,
                              kernels=1)
    assert "aten.cat" not in compiled.source().split("# ===== graph")[0]


def test_cat_of_empties_only(target):
    backend, device = target
    a = torch.empty(0, device=device)
    assert_matches(lambda a, b: torch.cat([a, b]) + 1, a, torch.empty(0, 3, device=device),
                   backend=backend)


def test_nan_passes_through(target):
    backend, device = target
    x = torch.tensor([[[[float("nan"), 1.0]]]], device=device)
    assert_matches(grow, x, torch.tensor([], device=device), backend=backend)

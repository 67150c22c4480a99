"""Tiled Triton pointwise kernels (codegen/triton/__init__.py, note "tiled pointwise kernels"): a kernel
whose loads and stores are contiguous along different loop dimensions walks 2-D tiles, so both
sides move in contiguous runs. Every case is compared with eager on every backend; the Triton
source is checked for the template the decision picked."""
import pytest
import torch

from conftest import TRITON_DEVICE, assert_matches
from fusec.codegen.triton import TILE_MIN

TILED = "triton_pointwise_tiled.py.j2"


def heads(qkv, n_head=2):
    """Attention's head split: q and v copied as (B, H, T, D), k as (B, H, D, T)."""
    b, t, c3 = qkv.shape
    q, k, v = qkv.split(c3 // 3, dim=2)
    q, k, v = (z.view(b, t, n_head, c3 // 3 // n_head).transpose(1, 2) for z in (q, k, v))
    return q.contiguous(), k.transpose(-2, -1).contiguous(), (v * 2).contiguous()


def source(cf) -> str:
    return cf.kernels[0].source


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_attention_head_split_is_tiled(target, dtype):
    backend, device = target
    qkv = torch.randn(2, 40, 96, device=device).to(dtype)
    cf = assert_matches(heads, qkv, backend=backend, kernels=1)
    assert (TILED in source(cf)) == (backend == "triton")


@pytest.mark.parametrize("shape", [(16, 16), (37, 53), (100, 17), (1, 64, 70)])
def test_transposing_copies(target, shape):
    backend, device = target
    x = torch.randn(*shape, device=device)
    x[0, 0] = float("nan")

    def f(x):
        return (x.transpose(-2, -1) * 3).contiguous()
    cf = assert_matches(f, x, backend=backend, kernels=1)
    if backend == "triton":
        assert TILED in source(cf)


def test_a_transposed_input_with_a_broadcast_row(target):
    backend, device = target
    x, y, b = (torch.randn(33, 48, device=device), torch.randn(48, 33, device=device),
               torch.randn(33, device=device))

    def f(x, y, b):
        return torch.sigmoid(x.t() + y) * b  # x read along dim 0, y and the output along dim 1
    cf = assert_matches(f, x, y, b, backend=backend, kernels=1)
    if backend == "triton":
        assert TILED in source(cf)


def test_a_scalar_read_in_a_tile(target):
    """An input broadcast along both tiled dims: every lane of the tile reads one element."""
    backend, device = target
    x, s = torch.randn(20, 30, device=device), torch.randn(1, 1, device=device)
    assert_matches(lambda x, s: (x.t() - s).contiguous(), x, s, backend=backend, kernels=1)


@pytest.mark.parametrize("shape", [(TILE_MIN - 1, 64), (64, TILE_MIN - 1)])
def test_short_dims_keep_one_dimensional_blocks(shape):
    x = torch.randn(*shape, device=TRITON_DEVICE)
    cf = assert_matches(lambda x: x.t().contiguous() + 1, x, backend="triton", kernels=1)
    assert TILED not in source(cf)


def test_agreeing_strides_keep_one_dimensional_blocks():
    x = torch.randn(40, 50, device=TRITON_DEVICE)
    cf = assert_matches(lambda x: torch.exp(x) + 1, x, backend="triton", kernels=1)
    assert TILED not in source(cf)
    cf = assert_matches(lambda x: torch.exp(x.t()), x, backend="triton", kernels=1)
    assert TILED not in source(cf)  # eager's output keeps x's layout: nothing disagrees


def test_empty_tensors(target):
    backend, device = target
    x = torch.randn(0, 40, device=device)
    assert_matches(lambda x: x.t().contiguous() * 2, x, backend=backend)

"""passes/filled_slices.py: a fresh tensor filled slice by slice (HQQ's unpacking: `tmp =
torch.empty(...)`, `tmp[:s] = hi`, `tmp[s:] = lo`) is a cat of the pieces, so no slice_scatter,
copy or empty runs in eager; with integer pieces that cannot fault (passes/computed_pieces.py)
the whole unpacking is one kernel. Against eager on every backend."""
import pytest
import torch

import fusec
from conftest import assert_matches
from fusec.record import record_of


def record(cf):
    return record_of((cf._compiled if hasattr(cf, "_compiled") else cf).last.gm)


def externs(cf):
    return [s.name for s in record(cf).schedule if s.kind == "extern"]


def unpack_4bit(w):
    """HQQ's layout: the first half of the rows in the high nibbles, the second in the low."""
    step = w.shape[0]
    tmp = torch.empty([2 * step, w.shape[1]], dtype=torch.uint8, device=w.device)
    tmp[:step] = (w & 0b11110000) >> 4
    tmp[step:] = w & 0b00001111
    return tmp


def test_hqq_unpacking_is_one_kernel(target):
    backend, device = target
    w = torch.randint(0, 256, (5, 7), dtype=torch.uint8).to(device)
    cf = assert_matches(unpack_4bit, w, backend=backend, kernels=1)
    assert externs(cf) == []
    (d,) = record(cf).filled_slices
    assert d.taken and "2 slice write(s) along dim 0" in d.why
    assert record(cf).computed_pieces[0].taken  # the integer pieces computed over the cat


class HQQLinear(torch.nn.Module):
    """A 4-bit linear as HQQ's plain-torch backend runs it: the packed bytes unpacked into a
    fresh tensor, then (q - zero) * scale per group of G along K, reshaped to (N, K)."""

    def __init__(self, n, k, group, dtype=torch.float16):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.shape = (n, k)
        q = torch.randint(0, 16, (n * k // group, group), generator=g, dtype=torch.uint8)
        step = q.shape[0] // 2
        self.register_buffer("W_q", (q[:step] << 4) | q[step:])
        self.register_buffer("scale", (torch.rand(n * k // group, 1, generator=g) / 50).to(dtype))
        self.register_buffer("zero", (torch.rand(n * k // group, 1, generator=g) * 15).to(dtype))

    def forward(self, x):
        w = ((unpack_4bit(self.W_q).to(x.dtype) - self.zero) * self.scale).reshape(self.shape)
        return torch.matmul(x, w.t())


@pytest.mark.parametrize("m", [1, 3])
def test_hqq_linear_runs_no_eager_op(target, m):
    backend, device = target
    layer = HQQLinear(32, 64, 16).to(device)
    x = torch.randn(m, 64, generator=torch.Generator().manual_seed(1)).half().to(device)
    with torch.no_grad():
        cf = assert_matches(layer, x, backend=backend)
    assert externs(cf) == [] and any("gemv" in k.name for k in cf.kernels)
    assert len(cf.kernels) <= 2, [k.name for k in cf.kernels]


@pytest.mark.parametrize("fill", ["zeros", "full", "empty"])
def test_three_pieces_along_a_middle_dim_with_a_cast_and_a_broadcast(target, fill):
    """copy casts to the tensor's dtype and broadcasts to the slice's shape: both are kept."""
    backend, device = target
    a = torch.randn(2, 3, 4, device=device)
    b = torch.randn(2, 1, 4, device=device).to(torch.float16)
    c = torch.randn(4, device=device)

    def f(a, b, c):
        out = getattr(torch, fill)(*(([2, 9, 4],) if fill != "full" else ([2, 9, 4], 7.0)),
                                   device=a.device)
        out[:, 3:5] = b
        out[:, :3] = a.sin()
        out[:, 5:] = c
        return out * 2

    cf = assert_matches(f, a, b, c, backend=backend)
    assert externs(cf) == []
    (d,) = record(cf).filled_slices
    assert d.taken and "3 slice write(s) along dim 1" in d.why


def test_what_is_left_alone(target):
    """A partial fill (the allocation's values are read), a tensor read between two writes, a
    strided slice, and slices along two dims: the writes stay as they are, and the results
    match eager."""
    backend, device = target
    a = torch.randn(3, 4, device=device)

    def partial(a):
        out = torch.zeros(5, 4, device=a.device)
        out[:3] = a
        return out

    def read_between(a):
        out = torch.zeros(6, 4, device=a.device)
        out[:3] = a
        seen = out.sum()
        out[3:] = a * 2
        return out, seen

    def strided(a):
        out = torch.zeros(6, 4, device=a.device)
        out[0::2] = a
        out[1::2] = a + 1
        return out

    def two_dims(a):
        out = torch.zeros(3, 8, device=a.device)
        out[:, :4] = a
        out[:, 4:] = a * 3
        out[:1] = 0.5
        return out

    for fn, why in [(partial, "do not fill"), (read_between, None), (strided, None),
                    (two_dims, None)]:
        cf = assert_matches(fn, a, backend=backend)
        taken = [d for d in record(cf).filled_slices if d.taken]
        assert not taken, (fn.__name__, record(cf).filled_slices)
        if why:
            assert why in record(cf).filled_slices[0].why


def test_explain_names_the_rewrite():
    w = torch.randint(0, 256, (4, 3), dtype=torch.uint8)
    text = str(fusec.explain(unpack_4bit, w, backend="cpp"))
    assert "1 tensor(s) filled slice by slice written as a cat" in text

"""passes/computed_pieces.py: a cat whose pieces are computed (rotate_half's -x2) is computed
over the concatenation of the pieces' inputs, with a constant mask picking each position's
piece, so one kernel does it all. Against eager on every backend."""
import pytest
import torch

import fusec
from conftest import assert_matches
from fusec.record import record_of


def decisions(cf):
    last = cf._compiled.last if hasattr(cf, "_compiled") else cf.last
    return record_of(last.gm).computed_pieces


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_is_one_kernel_and_exact(target, dtype):
    backend, device = target
    x = torch.randn(1, 4, 3, 10, device=device).to(dtype)
    cos, sin = (torch.randn(3, 10, device=device).to(dtype) for _ in range(2))
    cf = assert_matches(lambda x, c, s: x * c + rotate_half(x) * s, x, cos, sin, backend=backend,
                        kernels=1)
    assert [taken for _, taken, _ in decisions(cf)] == [True]
    # the rotation alone is bit for bit eager's: the same op on the same values (the rotary's
    # multiply-adds above may become FMAs on a GPU, so that one is compared within tolerance)
    rot = fusec.compile(rotate_half, backend=backend)
    assert torch.equal(rot(x), rotate_half(x)) and len(rot.kernels) == 1


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_several_computed_pieces_and_plain_ones(target, dim):
    """Two computed pieces with different chains, a plain one, along any dim; NaN and inf."""
    backend, device = target
    shapes = [[3, 4, 5], [3, 4, 5], [3, 4, 5]]
    for k, size in enumerate((2, 3, 1)):
        shapes[k][dim] = size
    a, b, c = (torch.randn(s, device=device) for s in shapes)
    a.view(-1)[0] = float("nan")
    b.view(-1)[1] = float("inf")

    def f(a, b, c):
        return torch.cat([a.sigmoid() * 2, c, -(b + 1)], dim=dim).exp()
    cf = assert_matches(f, a, b, c, backend=backend, kernels=1)
    assert decisions(cf)[0].taken


def test_all_pieces_computed(target):
    backend, device = target
    a, b = torch.randn(4, 3, device=device), torch.randn(4, 5, device=device)
    cf = assert_matches(lambda a, b: torch.cat([a.abs(), b * 3], dim=1) + 1, a, b,
                        backend=backend, kernels=1)
    assert decisions(cf)[0].taken


def test_non_contiguous_inputs(target):
    backend, device = target
    a = torch.randn(6, 5, device=device).t()  # (5, 6) transposed
    b = torch.randn(5, 9, device=device)[:, 2:7]
    assert_matches(lambda a, b: torch.cat([a.neg(), b.tanh()], dim=1), a, b, backend=backend,
                   kernels=1)


def test_what_is_left_alone(target):
    """An integer division (on positions a piece does not cover it could fault), a piece whose
    value is also used elsewhere, and a piece with two inputs: those pieces stay in memory."""
    backend, device = target
    i, j = torch.arange(6, device=device).view(2, 3), torch.arange(4, device=device).view(2, 2)
    cf = assert_matches(lambda i, j: torch.cat([i // 2, j], dim=1), i, j, backend=backend)
    assert not decisions(cf)[0].taken and "could fault" in decisions(cf)[0].why
    a, b = torch.randn(2, 3, device=device), torch.randn(2, 4, device=device)

    def twice(a, b):
        n = -a
        return torch.cat([n, b], dim=1), n * 2
    cf = assert_matches(twice, a, b, backend=backend)
    assert decisions(cf) == []  # -a has another user: the cat reads it from memory
    s = torch.randn(1, 3, device=device)  # (an expanded input is read through its strides)
    cf = assert_matches(lambda s, b: torch.cat([s.expand(2, 3).sin(), b], dim=1), s, b,
                        backend=backend, kernels=1)
    assert decisions(cf)[0].taken
    cf = assert_matches(lambda a, b, c: torch.cat([a * c, b], dim=1), a, b, a.clone(), backend=backend)
    assert decisions(cf) == []


def test_llama_decode_step_has_no_separate_negation(target):
    import importlib
    llama = importlib.import_module("fusec.examples.llama_decode")
    backend, device = target
    model = llama.Llama(dict(llama.TINY, layers=1), "bf16", device=device).eval()
    tok, pos = torch.tensor([3], device=device), torch.tensor([2], device=device)
    with torch.no_grad():
        cf = assert_matches(model, tok, pos, backend=backend)
    assert not any(k.name.startswith("fused_neg") for k in cf.kernels)
    assert sum(d.taken for d in decisions(cf)) == 2  # the query's and the key's rotation

"""passes/canonicalize.py: every spelling of a product reaches the kernels of its canonical form.

A per-channel int8 linear, `(x @ w.float().t()) * s`, written the ways people write it (einsum
either way round, a broadcast multiply and a sum, `matmul`, `F.linear`, the scale applied to the
weight first): at M = 1, 4 and 16, on every backend, each spelling compiles to the same kernels
(compared as built: `canonical(kernel.ir)`, the source with generic names) and the same library
calls as the canonical form, and computes eager's answer. Then the rules one by one: what they
rewrite, and what they leave alone and why.
"""
import pytest
import torch
import torch.nn.functional as F

import fusec
from conftest import TRITON_DEVICE
from fusec.driver import canonical, codegen
from fusec.record import record_of

N, K = 37, 50  # odd sizes: no vector width divides them

SPELLINGS = {
    "matmul operator": lambda x, w, s: (x @ w.float().t()) * s,
    "F.linear": lambda x, w, s: F.linear(x, w.float()) * s,
    "torch.matmul, .T": lambda x, w, s: torch.matmul(x, w.float().T) * s,
    "einsum mk,nk": lambda x, w, s: torch.einsum("mk,nk->mn", x, w.float()) * s,
    "einsum nk,mk": lambda x, w, s: torch.einsum("nk,mk->mn", w.float(), x) * s,
    "broadcast, sum(-1)": lambda x, w, s: (x[:, None, :] * w.float()).sum(-1) * s,
    "broadcast, sum(2)": lambda x, w, s: (w.float()[None] * x.unsqueeze(1)).sum(dim=2) * s,
    "scale the weight": lambda x, w, s: x @ (w.float() * s[:, None]).t(),
    "scale first": lambda x, w, s: x @ (s.unsqueeze(1) * w.float()).t(),
    "scale the transposed weight": lambda x, w, s: x @ (w.float().t() * s),
}
CANONICAL = "matmul operator"


def inputs(m, device="cpu"):
    g = torch.Generator().manual_seed(m)
    return tuple(t.to(device) for t in (
        torch.randn(m, K, generator=g),
        torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8),
        torch.rand(N, generator=g) + 0.5))


def made(cf):
    """What a compiled function runs: its kernels as built, and its library calls in order."""
    kernels = sorted(codegen(k.backend).render(canonical(k.ir)) for k in cf.kernels)
    externs = [line.split()[2] for line in cf.schedule.splitlines() if line.split()[1:2] == ["extern"]]
    return kernels, externs


@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("backend", ["cpp", "llvm", "triton"])
def test_every_spelling_reaches_the_canonical_kernels(backend, m):
    x, w, s = inputs(m, TRITON_DEVICE if backend == "triton" else "cpu")
    expected = None
    for name, f in SPELLINGS.items():
        cf = fusec.compile(f, backend=backend)
        torch.testing.assert_close(cf(x, w, s), f(x, w, s), rtol=1e-4, atol=1e-4)
        if name == CANONICAL:
            expected = made(cf)
            assert expected[0], "the canonical form compiles to at least one kernel"
        else:
            assert made(cf) == expected, f"{name} at M = {m} on {backend}: {cf.schedule}"


def decisions(f, *args, backend="cpp"):
    cf = fusec.compile(f, backend=backend)
    cf(*args)
    return [(d.taken, d.why) for d in record_of(cf.last.gm).canonicalize], cf


def test_a_view_chain_becomes_one_view():
    """unsqueeze, permute, permute, view: sizes of one moved about; one view remains."""
    def f(x):
        return torch.sin(x.unsqueeze(2).permute(0, 2, 1).permute(0, 2, 1).reshape(1, 6, 7))
    x = torch.randn(6, 7)
    taken, cf = decisions(f, x)
    assert (True, "view chain: a chain of views that only moves dims as one permute and one view") \
        in taken
    views = [n for n in cf.last.gm.graph.nodes if n.op == "call_function"
             and "permute" in str(n.target)]
    assert views == [], cf.last.gm.graph
    torch.testing.assert_close(cf(x), f(x))


def test_a_reshape_that_splits_dims_is_not_a_view_chain():
    def f(x):
        return torch.cos(x.reshape(3, 2, 7).permute(1, 0, 2).reshape(2, 21))
    x = torch.randn(6, 7)
    taken, cf = decisions(f, x)
    assert not [t for t in taken if t[0]]
    torch.testing.assert_close(cf(x), f(x))


def test_short_contractions_stay_a_fused_sum():
    def f(a, b):
        return (a[:, None, :] * b).sum(-1)
    a, b = torch.randn(5, 4), torch.randn(3, 4)
    taken, cf = decisions(f, a, b)
    assert any(not t and "K = 4 < 16" in why for t, why in taken), taken
    assert "extern" not in cf.schedule
    torch.testing.assert_close(cf(a, b), f(a, b))


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_a_linear_with_a_bias_and_a_scaled_weight(backend):
    """F.linear(x, w * s[:, None], b) reaches the kernels of (x @ w.t()) * s + b in float32;
    in bfloat16 addmm keeps the bias (it adds it before rounding once) and says so."""
    g = torch.Generator().manual_seed(3)
    w, s, b = (torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8),
               torch.rand(N, generator=g) + 0.5, torch.randn(N, generator=g))
    canonical_form = lambda x: (x @ w.float().t()) * s + b  # noqa: E731
    spelled = lambda x: F.linear(x, w.float() * s[:, None], b)  # noqa: E731
    for m in (1, 16):
        x = torch.randn(m, K, generator=g)
        made_by = []
        for f in (canonical_form, spelled):
            cf = fusec.compile(f, backend=backend)
            torch.testing.assert_close(cf(x), f(x), rtol=1e-4, atol=1e-4)
            made_by.append(made(cf))
        assert made_by[0] == made_by[1], m
    x = torch.randn(2, K, generator=g).bfloat16()
    halves = lambda x: F.linear(x, w.bfloat16() * s[:, None].bfloat16(), b.bfloat16())  # noqa: E731
    taken, cf = decisions(halves, x, backend=backend)
    assert (False, "scale after product: torch.bfloat16: addmm adds the bias before it rounds, "
            "once") in taken, taken
    torch.testing.assert_close(cf(x), halves(x))


def test_a_batched_product_is_declined_with_its_reason():
    def f(a, b):
        return (a * b).sum(-1)  # both vary along dim 0: a batched dot, not a matmul
    a, b = torch.randn(4, 1, 32), torch.randn(4, 5, 32)
    taken, cf = decisions(f, a, b)
    assert (False, "contraction: both operands vary along a kept dim: a batched product") in taken
    torch.testing.assert_close(cf(a, b), f(a, b))


def test_a_scale_along_k_stays_on_the_weight():
    """A per-K scale is not one per output column: the product is left as written."""
    def f(x, w, s):
        return x @ (w * s).t()
    x, w, s = torch.randn(2, 24), torch.randn(8, 24), torch.rand(24)
    taken, cf = decisions(f, x, w, s)
    assert not any(t for t, _ in taken), taken
    torch.testing.assert_close(cf(x, w, s), f(x, w, s))


def test_a_scale_of_another_dtype_is_declined():
    """A bfloat16 weight times a float32 scale is a float32 product: moving the scale would
    multiply a bfloat16 matmul's result instead, rounded differently."""
    def f(x, w, s):
        return x @ (w * s[:, None]).t()
    x, w, s = torch.randn(2, 24), torch.randn(8, 24).bfloat16(), torch.rand(8)
    taken, cf = decisions(f, x, w, s)
    assert [t for t, why in taken] == [False] and "dtype differs" in taken[0][1], taken
    torch.testing.assert_close(cf(x, w, s), f(x, w, s))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_contractions_with_nan_empty_and_noncontiguous_inputs(dtype):
    def f(a, b):
        return (a.unsqueeze(1) * b.unsqueeze(0)).sum(-1)
    a = torch.randn(3, 40, dtype=torch.float32).to(dtype)[:, ::2]  # non-contiguous (3, 20)
    b = torch.randn(5, 20).to(dtype)
    b[1, 3] = float("nan")
    cf = fusec.compile(f, backend="cpp")
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(cf(a, b), f(a, b), equal_nan=True, **tol)
    empty_a, empty_b = torch.randn(0, 20).to(dtype), b
    torch.testing.assert_close(cf(empty_a, empty_b), f(empty_a, empty_b))

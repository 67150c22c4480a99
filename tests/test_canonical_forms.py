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


# ---- int4: stack/cat of computed pieces before or after the math -------------------------------
#
# Packed int4 weights (two 4-bit values per byte) unpacked and dequantized per group,
# (q - zero) * scale, written the ways people write them. Interleaved (column 2j in the low
# nibble, 2j + 1 in the high one): the canonical form dequantizes each nibble, then stacks them;
# every other spelling stacks first, with views between the stack and the math or not. Halves
# (the low nibbles are columns 0 .. K/2, the high ones the rest): the canonical form concatenates
# the nibbles, then dequantizes. Each family reaches its canonical form's kernels.

N4, K4, G4 = 24, 64, 16  # groups of 16 columns: four per row, two in each half


def _nibbles(p):
    return p & 15, p >> 4


def _grouped(p):  # packed bytes seen as (N, K / G, G / 2): the group's scale broadcasts
    return p.view(N4, K4 // G4, G4 // 2)


def _dq(q, z, s):
    return (q.float() - z) * s


INTERLEAVED = {
    "dequantize, then stack": lambda x, p, z, s: x @ torch.stack(
        [_dq(h, z[..., None], s[..., None]) for h in _nibbles(_grouped(p))], -1).view(N4, K4).t(),
    "stack, then dequantize": lambda x, p, z, s: x @ _dq(
        torch.stack(_nibbles(_grouped(p)), -1), z[..., None, None], s[..., None, None]
    ).view(N4, K4).t(),
    "stack, .view(N, K), dequantize": lambda x, p, z, s: x @ _dq(
        torch.stack(_nibbles(p), -1).view(N4, K4).view(N4, K4 // G4, G4), z[..., None],
        s[..., None]).view(N4, K4).t(),
    "stack, view the group, dequantize": lambda x, p, z, s: x @ _dq(
        torch.stack(_nibbles(_grouped(p)), dim=3).view(N4, K4 // G4, G4), z[..., None],
        s[..., None]).view(N4, K4).t(),
    "stack, .flatten(-2), dequantize": lambda x, p, z, s: x @ _dq(
        torch.stack(_nibbles(_grouped(p)), -1).flatten(-2), z[..., None], s[..., None]
    ).flatten(1).t(),
    "stack, dequantize step by step": lambda x, p, z, s: x @ torch.stack(
        _nibbles(_grouped(p)), -1).float().sub(z[..., None, None]).mul(s[..., None, None]
                                                                       ).reshape(N4, K4).t(),
}
HALVES = {
    "cat halves, then dequantize": lambda x, p, z, s: x @ _dq(
        torch.cat(_nibbles(p), -1).view(N4, K4 // G4, G4), z[..., None], s[..., None]
    ).view(N4, K4).t(),
    "dequantize halves, then cat": lambda x, p, z, s: x @ torch.cat(
        [_dq(h, zh[..., None], sh[..., None]) for h, zh, sh in
         zip(_nibbles(p.view(N4, K4 // G4 // 2, G4)), z.chunk(2, 1), s.chunk(2, 1))], 1
    ).view(N4, K4).t(),
}


def int4_inputs(m, device="cpu"):
    g = torch.Generator().manual_seed(40 + m)
    return tuple(t.to(device) for t in (
        torch.randn(m, K4, generator=g),
        torch.randint(0, 256, (N4, K4 // 2), generator=g, dtype=torch.uint8),
        torch.rand(N4, K4 // G4, generator=g) * 15,
        torch.rand(N4, K4 // G4, generator=g) / 8))


@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("backend", ["cpp", "llvm", "triton"])
def test_int4_spellings_reach_the_canonical_kernels(backend, m):
    """Every spelling of each family builds its canonical form's kernels and library calls.
    Interleaved at one row: one kernel (the canonical form's; stacked first, the math after the
    stack, it was four on llvm before the math moved into the pieces)."""
    args = int4_inputs(m, TRITON_DEVICE if backend == "triton" else "cpu")
    for family in (INTERLEAVED, HALVES):
        expected = None
        for name, f in family.items():
            cf = fusec.compile(f, backend=backend)
            torch.testing.assert_close(cf(*args), f(*args), rtol=1e-4, atol=1e-4)
            if expected is None:  # the first spelling is the canonical one
                expected = made(cf)
                if family is INTERLEAVED and m == 1:
                    assert len(expected[0]) == 1 and not expected[1], cf.schedule
            else:
                assert made(cf) == expected, f"{name} at M = {m} on {backend}: {cf.schedule}"


def _product(weight):
    """x @ weight(*args).t(): the rules that move math into a stack serve a matmul's operand."""
    return lambda x, *args: x @ weight(*args).t()


def _int(seed, *shape):
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed),
                         dtype=torch.uint8)


def _nan(*shape):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(7))
    t[0, 1], t[1, 0] = float("nan"), float("inf")
    return t


_A, _B = torch.randn(4, 6), torch.randn(4, 6)
STACK_CASES = {  # name: (weight, its inputs, how canonicalize decides: a taken rule or a reason)
    "a scale per piece, selected": (
        lambda a, b, w: (torch.stack([a.sin(), b.cos()], -1) * w).view(4, 12),
        (_A, _B, torch.tensor([2.0, -3.0])), "math into a stack: mul applied"),
    "integers times a float": (
        lambda p: (torch.stack(_nibbles(p), -1) * 0.5).view(4, 12), (_int(1, 4, 6),),
        "math into a stack: mul applied"),
    "integers plus a float64 0-dim tensor": (
        lambda p, t: (torch.stack(_nibbles(p), -1) + t).view(4, 12).float(),
        (_int(2, 4, 6), torch.tensor(1.5, dtype=torch.float64)), "math into a stack: add applied"),
    "NaN and infinity": (
        lambda a, b, u: (torch.maximum(torch.stack([a.exp(), b.log()], -1), u) * 2).view(4, 12),
        (_nan(4, 6), _B, torch.randn(4, 1, 2)), "math into a stack: maximum applied"),
    "a chain of ops": (
        lambda a, b: ((torch.stack([a.sin(), b.cos()], -1) * 3).exp() + 1).sigmoid().view(4, 12),
        (_A, _B), "math into a stack: sigmoid applied"),
    "stacked along dim 2, the last, viewed": (
        lambda a, b, z: (torch.stack([a.sin(), b.cos()], 2).reshape(4, 12) * z),
        (_A, _B, torch.rand(4, 1)), "math into a stack: mul applied"),
    "stacked along dim 0: blocks, as a cat's": (
        lambda a, b: (torch.stack([a.sin(), b.cos()], 0) * torch.arange(6.0)).view(8, 6),
        (_A, _B), "cat of views: a reshape of cat as the cat of its pieces reshaped"),
    "where": (
        lambda a, b, c: torch.where(c, torch.stack([a.sin(), b.cos()], -1), 0.0).view(4, 12),
        (_A, _B, torch.rand(4, 6, 2) > 0.5), "math into a stack: where applied"),
    "stored pieces": (
        lambda a, b, s: (torch.stack([a, b], -1) * s).view(4, 12), (_A, _B, torch.rand(6, 1)),
        "is stored: the math reads the stack where its pieces lie"),
    "mixed dtypes": (
        lambda a, p: (torch.stack([a.sin(), p & 3], -1) * 2).view(4, 12), (_A, _int(3, 4, 6)),
        "math into a stack: the pieces' dtypes differ: the stack promotes them"),
    "an operand the view merges": (
        lambda p, z: torch.stack(_nibbles(p), -1).view(4, 12).float() * z, (_int(4, 4, 6),
                                                                           torch.randn(12)),
        "varies along dims that the stack's view merges: it cannot be split "
        "per piece without a copy"),
    "a stack with another reader": (
        lambda a, b: (lambda t: (t * 2 + t.sum()).view(4, 12))(torch.stack([a.sin(), b.cos()], -1)),
        (_A, _B), "math into a stack: cat has other users: the pieces would be computed twice"),
    "broadcast up by another operand": (
        lambda a, b, u: (torch.stack([a.sin(), b.sin()], -1) * u).view(20, 2),
        (torch.randn(4, 1), torch.randn(4, 1), torch.randn(4, 5, 2)),
        "math into a stack: another operand broadcasts cat to [4, 5, 2]"),
}


def test_stack_rules_decide_as_they_say_and_match_eager():
    """Each case feeds a matmul; its decision is in the record, and the answer is eager's
    (NaN where eager has NaN). One compile per case, on cpp."""
    for name, (weight, args, says) in STACK_CASES.items():
        f = _product(weight)
        x = torch.randn(3, weight(*args).shape[-1])
        taken, cf = decisions(f, x, *args)
        assert any(says in why for _, why in taken), (name, taken)
        torch.testing.assert_close(cf(x, *args), f(x, *args), equal_nan=True)


def test_a_stack_read_by_a_sum_stays_with_its_reason():
    def f(a, b):
        return torch.stack([a.sin(), b.cos()], -1).sum(-1)
    taken, cf = decisions(f, _A, _B)
    assert taken == [(False, "math into a stack: sum_1 (aten.sum.dim_IntList) is not "
                      "elementwise: it needs the pieces together")], taken
    torch.testing.assert_close(cf(_A, _B), f(_A, _B))


def test_a_stack_that_feeds_no_matmul_keeps_its_math():
    """Without a matmul to distribute over the pieces, the math after a stack of computed pieces
    is one kernel with the stack (passes/computed_pieces.py): it stays where it is."""
    def f(a, b, w):
        return torch.stack([a.sin(), b.cos()], -1) * w
    w = torch.tensor([0.5, 2.0])
    taken, cf = decisions(f, _A, _B, w)
    assert taken == [], taken
    torch.testing.assert_close(cf(_A, _B, w), f(_A, _B, w))


CAT_CASES = {  # name: (function, its inputs, how canonicalize decides)
    "unequal pieces": (lambda a, b: torch.cat([a * 2, b * 2], 0),
                       (torch.randn(3, 4), torch.randn(5, 4)), (True, "math out of a cat")),
    "a shared operand, broadcast": (
        lambda a, b, s: torch.cat([(a - s).exp(), (b - s).exp()], 0),
        (torch.randn(3, 4), torch.randn(5, 4), torch.randn(4)), (True, "math out of a cat")),
    "a negative dim": (lambda a, b, s: torch.cat([a * s, b * s], -1),
                       (torch.randn(4, 3), torch.randn(4, 5), torch.randn(4, 1)),
                       (True, "math out of a cat")),
    "the chunks of one operand": (
        lambda a, b, s: torch.cat([a * u for a, u in zip((a, b), s.chunk(2, -1))], -1),
        (torch.randn(4, 3), torch.randn(4, 3), torch.randn(4, 6)), (True, "math out of a cat")),
    "integer floor division": (lambda a, b: torch.cat([a // 3, b // 3], -1),
                               (torch.randint(0, 9, (4, 3)), torch.randint(0, 9, (4, 5))),
                               (True, "math out of a cat")),
    "operands broadcast differently": (
        lambda a, b, s, t: torch.cat([a * s, b * t], 0),
        (torch.randn(3, 4), torch.randn(5, 4), torch.randn(3, 4), torch.randn(5, 1)),
        (False, "math out of a cat: the operands of mul are broadcast differently")),
    "operands of two dtypes": (lambda a, p: torch.cat([a * 2, p * 2], -1),
                               (torch.randn(4, 3), torch.randint(0, 9, (4, 5))),
                               (False, "math out of a cat: the pieces' operands differ in dtype")),
    "different constants": (lambda a, b: torch.cat([a * 2, b * 3], -1),
                            (torch.randn(4, 3), torch.randn(4, 5)),
                            (False, "math out of a cat: mul's pieces differ in a constant")),
}


def test_cat_rules_decide_as_they_say_and_match_eager():
    for name, (f, args, (took, says)) in CAT_CASES.items():
        taken, cf = decisions(f, *args)
        assert any(t == took and why.startswith(says) for t, why in taken), (name, taken)
        torch.testing.assert_close(cf(*args), f(*args))


# ---- cast after a view --------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["cpp", "llvm", "triton"])
def test_a_cast_of_a_reshape_joins_the_kernel_that_computes_the_value(backend):
    """Autocast's backward writes a gradient as the reshape of a float32 value cast back to
    bfloat16; the cast moves before the reshape, into the kernel that computes the value, so no
    float32 tensor is stored for it (a softmax here: the cast is in its kernel's epilogue)."""
    dev = "cpu" if backend != "triton" else TRITON_DEVICE
    x = torch.randn(6, 35, device=dev)
    x[1, 2] = float("nan")

    def f(x):
        return torch.softmax(x * 2, -1).view(2, 3, 35).to(torch.bfloat16)

    cf = fusec.compile(f, backend=backend)
    torch.testing.assert_close(cf(x), f(x), equal_nan=True)
    assert len(cf.kernels) == 1, [k.name for k in cf.kernels]  # the softmax and its cast
    rec = [d for d in record_of(cf.last.gm).canonicalize if "cast after a view" in d.why]
    assert rec and rec[0].taken


def test_a_cast_of_a_reshape_of_a_library_result_stays():
    """The cast of a view of a matmul's result stays where it is: it reads the matmul's result
    through the view inside the next kernel, which a cast moved before the view would not."""
    a, b = torch.randn(6, 8), torch.randn(8, 5)

    def f(a, b):
        return torch.softmax((a @ b).view(2, 3, 5).to(torch.float64), -1)

    cf = fusec.compile(f, backend="cpp")
    torch.testing.assert_close(cf(a, b), f(a, b))
    rec = [d for d in record_of(cf.last.gm).canonicalize if "cast after a view" in d.why]
    assert rec and not rec[0].taken and "not a contiguous value a kernel computes" in rec[0].why

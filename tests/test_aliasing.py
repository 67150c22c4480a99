"""Inputs that share memory: eager's answer whatever the caller passes (fusec/fastpath.py,
"Note (aliased inputs)").

A program that writes into an input checks on every call whether that input shares memory with
another: the very same tensor twice gets a program traced that way (after one eager call), any
other overlap runs eagerly (one warning). A program that writes into no input checks nothing.
Every case compares the outputs *and* the inputs' memory afterwards with eager's, on clones of
the same base, for every backend.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import fusec

BACKENDS = ["cpp", "llvm", "triton"]


def mul_add(x, y):
    x.mul_(2)
    x.add_(y)
    return x


def scale_then_add(x, y):  # eager allows a partial overlap here (mul_add's add_ refuses it)
    x.mul_(2)
    return x + y


def shifted(x, y):
    x[1:] = y[:-1]
    return x * 1


def copied(x, y):
    x.copy_(y * 2 + x)
    return x.sum()


def index_put(x, y):
    x.index_put_((torch.tensor([0, 2]),), y[1:3] + 1)
    return x + y


def pure(x, y):
    return (x.sin() + y * 2).cos()


def three(x, y, z):
    y.add_(x)
    z.mul_(y)
    return x + y + z


# (name, how the arguments are cut from one base of 8 elements)
PAIRS = [
    ("distinct", lambda a, b: (a[:4], b[:4])),
    ("same tensor", lambda a, b: (a[:4], a[:4])),
    ("a view of the other", lambda a, b: (a[:4], a[:4].view(2, 2).view(4))),
    ("overlapping slices", lambda a, b: (a[:4], a[2:6])),
    ("overlapping, other order", lambda a, b: (a[2:6], a[:4])),
    ("disjoint slices of one base", lambda a, b: (a[:4], a[4:])),
    ("distinct again", lambda a, b: (a[:4], b[:4])),
]

TRIPLES = [
    ("distinct", lambda a, b: (a[:4], b[:4], b[4:])),
    ("x is y", lambda a, b: (a[:4], a[:4], b[:4])),
    ("x is z", lambda a, b: (a[:4], b[:4], a[:4])),
    ("y is z", lambda a, b: (b[:4], a[:4], a[:4])),
    ("all three", lambda a, b: (a[:4], a[:4], a[:4])),
    ("y overlaps z", lambda a, b: (b[:4], a[:4], a[1:5])),
    ("disjoint slices of one base", lambda a, b: (a[:2], a[2:4], a[4:6])),
    ("distinct again", lambda a, b: (a[:4], b[:4], b[4:])),
]


def _bases():
    return torch.arange(8.0) + 1, torch.arange(8.0) * 3 - 5


def _eager_vs_fused(f, cf, cut, calls: int = 2):
    """Call eager and the compiled function `calls` times on fresh clones cut the same way;
    outputs, errors and both bases afterwards must match."""
    for _ in range(calls):
        ea, eb = _bases()
        fa, fb = _bases()
        try:
            want, want_err = f(*cut(ea, eb)), None
        except RuntimeError as err:
            want, want_err = None, err
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the eager fallback's warning: tested below)
            if want_err is not None:
                with pytest.raises(type(want_err)):
                    cf(*cut(fa, fb))
            else:
                got = cf(*cut(fa, fb))
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fa, ea)
        torch.testing.assert_close(fb, eb)


@pytest.fixture(autouse=True)
def _room(monkeypatch):
    monkeypatch.setenv("FUSEC_RECOMPILE_LIMIT", "32")  # every variant here compiles


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("f", [mul_add, scale_then_add, shifted, copied, index_put, pure],
                         ids=lambda f: f.__name__)
def test_two_inputs_every_pairing(f, backend):
    cf = fusec.compile(f, backend=backend)
    for name, cut in PAIRS:
        _eager_vs_fused(f, cf, cut)


@pytest.mark.parametrize("backend", BACKENDS)
def test_three_inputs_every_pairing(backend):
    cf = fusec.compile(three, backend=backend)
    for name, cut in TRIPLES:
        _eager_vs_fused(three, cf, cut)


def test_the_issue_case_first_compiled_with_distinct_inputs():
    cf = fusec.compile(mul_add, backend="cpp")
    cf(torch.ones(4), torch.ones(4))
    a = torch.ones(4)
    assert cf(a, a).tolist() == [4.0] * 4 and a.tolist() == [4.0] * 4
    a = torch.ones(4)
    assert cf(a, a).tolist() == [4.0] * 4 and a.tolist() == [4.0] * 4  # the variant's program
    b, c = torch.ones(4), torch.ones(4)
    assert cf(b, c).tolist() == [3.0] * 4 and b.tolist() == [3.0] * 4  # the fast path again


def test_the_issue_case_first_called_aliased():
    cf = fusec.compile(mul_add, backend="cpp")
    for _ in range(3):
        a = torch.ones(4)
        assert cf(a, a).tolist() == [4.0] * 4 and a.tolist() == [4.0] * 4


@pytest.mark.parametrize("saved", ["1", "0"])
def test_a_program_first_traced_with_aliased_arguments_serves_distinct_ones(saved, monkeypatch):
    """Capture once traced `f(a, a)` with one fake tensor for both arguments, so the program
    read y twice, and `f(b, c)` later got 2c + c."""
    monkeypatch.setenv("FUSEC_SAVED_PROGRAMS", saved)

    def f(x, y):
        return x + 2 * y
    cf = fusec.compile(f, backend="cpp")
    a = torch.ones(4)
    assert cf(a, a).tolist() == [3.0] * 4
    b, c = torch.zeros(4), torch.ones(4)
    assert cf(b, c).tolist() == [2.0] * 4


def test_only_programs_that_write_into_inputs_check_memory():
    """The fast path of a program that writes into no input is what it was: no data pointers."""
    p, m = fusec.compile(pure, backend="cpp"), fusec.compile(mul_add, backend="cpp")
    p(torch.ones(4), torch.ones(4))
    m(torch.ones(4), torch.ones(4))
    assert "data_ptr" not in p._fast.source
    assert "data_ptr" in m._fast.source


def test_partial_overlap_runs_eagerly_and_says_so_once():
    cf = fusec.compile(scale_then_add, backend="cpp")
    a, b = torch.arange(8.0), torch.arange(8.0)
    with pytest.warns(UserWarning, match="overlap in memory.*run eagerly"):
        got = cf(a[:4], a[2:6])
    torch.testing.assert_close(got, scale_then_add(b[:4], b[2:6]))
    torch.testing.assert_close(a, b)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cf(a[:4], a[2:6])


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(4.0) + 1)

    def forward(self, x):
        x.mul_(2)
        return x + self.b


class Accumulate(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.arange(4.0))

    def forward(self, x):
        self.total.add_(x)
        return self.total * x


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", [Scaled, Accumulate], ids=lambda c: c.__name__)
def test_a_buffer_passed_as_the_input(cls, backend):
    """The module's own buffer passed as the argument: lifted state aliases an input."""
    eager, fused = cls(), cls()
    cm = fusec.compile(fused, backend=backend)
    torch.testing.assert_close(cm(torch.ones(4)), eager(torch.ones(4)))  # distinct first
    for _ in range(3):
        want = eager(eager.b if cls is Scaled else eager.total)
        got = cm(fused.b if cls is Scaled else fused.total)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(dict(fused.named_buffers()), dict(eager.named_buffers()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pure_program_with_an_extern_leaves_aliased_inputs_alone(backend):
    """The memory plan writes kernel outputs over dying extern results (Triton), never over a
    program input: aliased inputs of a program that writes nothing stay as they were."""
    def f(x, y):
        return torch.mm(x, y).sin() * 2 + x

    cf = fusec.compile(f, backend=backend)
    a = torch.randn(4, 4)
    before = a.clone()
    for _ in range(2):
        torch.testing.assert_close(cf(a, a), f(before, before))
        torch.testing.assert_close(cf(a, a.t()), f(before, before.t()))
        assert torch.equal(a, before)


class WithWeight(torch.nn.Module):
    def __init__(self, writes: bool, kind: str):
        super().__init__()
        w = torch.arange(16.0).reshape(4, 4) / 10
        if kind == "parameter":
            self.w = torch.nn.Parameter(w)
        else:
            self.register_buffer("w", w)
        self.writes = writes

    def forward(self, x):
        if self.writes:
            x.mul_(2)
        return x @ self.w.t() + self.w.sum()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["parameter", "buffer"])
@pytest.mark.parametrize("writes", [True, False], ids=["writes", "pure"])
def test_the_module_state_passed_as_the_input(writes, kind, backend):
    """`m(m.w)` (under no_grad): the lifted tensor and the argument are one tensor. Capture
    traced them as one fake tensor before, and a buffer's program (the same signature as any
    (4, 4) input's) then served `m(x)` as `x @ x.t() + x.sum()`."""
    eager, fused = WithWeight(writes, kind), WithWeight(writes, kind)
    cm = fusec.compile(fused, backend=backend)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(cm(fused.w), eager(eager.w))
            torch.testing.assert_close(fused.w, eager.w)
            x = torch.randn(4, 4)
            torch.testing.assert_close(cm(x.clone()), eager(x.clone()))


def test_torch_compile_with_the_fusec_backend_gives_eager_s_answer_too():
    """Through torch.compile, AOT Autograd handles the aliasing before fusec sees a graph."""
    import torch._dynamo
    torch._dynamo.reset()
    opt = torch.compile(mul_add, backend="fusec")
    a = torch.ones(4)
    assert opt(a, a).tolist() == [4.0] * 4 and a.tolist() == [4.0] * 4


class KVCache(torch.nn.Module):
    """A static KV cache's update (tests/test_indexed_write.py): with indexed writes on, the
    kernel that computes k stores it straight into the cache buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.arange(96.0).reshape(1, 2, 8, 6))

    def forward(self, k, pos):
        self.cache.index_copy_(2, pos, k * 2)
        return self.cache.sum(-1)


def test_a_kernel_that_writes_into_a_buffer_is_seen_writing(monkeypatch):
    """`mutated_inputs` reads the program's steps: an indexed write done by a kernel (its
    output *is* the buffer) counts, so `k` cut from the cache itself is caught."""
    from fusec import ops
    from fusec.fastpath import mutated_inputs
    monkeypatch.setattr(ops, "INDEXED_WRITE_DEVICES", ("cuda", "cpu"))
    eager, fused = KVCache(), KVCache()
    cm = fusec.compile(fused, backend="triton")
    pos = torch.tensor([5])
    torch.testing.assert_close(cm(torch.ones(1, 2, 1, 6), pos), eager(torch.ones(1, 2, 1, 6), pos))
    program = cm._compiled.last.program
    assert any(k.ops.count("aten.index_put_.default") for k in cm.kernels)  # written by a kernel
    assert mutated_inputs(program) == (0,)  # the cache (lifted first)
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = cm(fused.cache[:, :, 2:3], pos)  # k is a slice of the cache: eager
        torch.testing.assert_close(got, eager(eager.cache[:, :, 2:3], pos))
        torch.testing.assert_close(fused.cache, eager.cache)

"""Shape families through the public API (issue 51), on every backend: one program for every
size of a dim that changes (fusec/dynamic.py has the policy, fusec/symbolic.py the symbols).

Each test calls `fusec.compile(fn, backend=...)` with inputs of many sizes and checks three
things: every result is eager's (against a float64 reference, as conftest.assert_matches does),
the number of programs compiled stays small (static first, then one family; sizes 0 and 1 are
their own programs), and no kernel fell back to eager ATen (a FallbackWarning, or a kernel whose
`built.error` is set): a family whose kernels do not build would be correct but not compiled.

The Triton backend runs under Triton's interpreter on CPU tensors here (conftest.py), where one
launch costs milliseconds, so its tests call fewer sizes; the C++ and LLVM ones call them all.
"""
from __future__ import annotations

import contextlib
import copy
import os
import random
import re
import warnings

import pytest
import torch

import fusec
from conftest import TRITON_DEVICE
from fusec.check import compare

BACKENDS = ["cpp", "llvm", "triton"]
DEVICE = {"cpp": "cpu", "llvm": "cpu", "triton": TRITON_DEVICE}
INTERPRETED = TRITON_DEVICE == "cpu"  # Triton under its interpreter: milliseconds a launch


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


# -- helpers ---------------------------------------------------------------------------------------
def _reference(fn, args):
    """fn on float64 copies of the floating-point inputs (None where that does not run)."""
    wide = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in args]
    try:
        with torch.no_grad():
            return torch.utils._pytree.tree_leaves(fn(*wide))
    except Exception:  # noqa: BLE001 (an op without a float64 kernel: eager is the reference)
        return None


def same_as_eager(cf, fn, *args) -> None:
    """cf(*args) is eager's fn(*args): every output, judged against a float64 reference."""
    got = torch.utils._pytree.tree_leaves(cf(*args))
    with torch.no_grad():
        want = torch.utils._pytree.tree_leaves(fn(*args))
    ref = _reference(fn, args)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        r = ref[i] if ref is not None and ref[i].dtype == torch.float64 else None
        problem = compare(g.cpu(), w.cpu(), None if r is None else r.cpu())
        assert problem is None, (f"output {i} for sizes {[tuple(a.shape) for a in args]}: "
                                 f"{problem}")


def fell_back(cf) -> list[str]:
    """Names of the kernels, in every program cf compiled, that run eagerly (not built)."""
    cf = getattr(cf, "_compiled", cf)
    return [k.name for compiled in cf.compiled.values() for k in compiled.kernels
            if k.built.error is not None]


@contextlib.contextmanager
def all_built(cf):
    """The calls inside compile every kernel: no FallbackWarning, no kernel left unbuilt."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        yield
    said = [str(w.message).splitlines()[0] for w in seen
            if issubclass(w.category, fusec.FallbackWarning)]
    assert not said, f"kernels fell back to eager: {said}"
    assert not fell_back(cf), f"kernels not built: {fell_back(cf)}"


def compiles(cf) -> int:
    return getattr(cf, "_compiled", cf).compiles


def rss_mib() -> float:
    """This process's resident memory now (MiB), from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_sizes(backend, fn, make, sizes, **options):
    """Compile fn, call it with make(n, device) for each n, compare each with eager; the
    compiled function."""
    cf = fusec.compile(fn, backend=backend, **options)
    with all_built(cf):
        for n in sizes:
            torch.manual_seed(n)  # (the same inputs on every run: a failure can be replayed)
            args = make(n, DEVICE[backend])
            same_as_eager(cf, fn, *(args if isinstance(args, tuple) else (args,)))
    return cf


def pointwise_sum(x):
    return (torch.sin(x) * 2 + x).sum(-1)


# -- 1. 500 batch sizes: two or three programs, bounded memory ---------------------------------
@pytest.mark.parametrize("dynamic, most", [(True, 1), (None, 2)])
def test_500_batch_sizes(backend, dynamic, most):
    """Every batch size 1..500 in random order: dynamic=True compiles the family, which serves
    a size of 1 too (Note: a size of 1 in a family); the default policy one static program more
    (the first size)."""
    # under Triton's interpreter a launch costs milliseconds: 60 sizes there, 500 elsewhere
    count = 60 if backend == "triton" and INTERPRETED else 500
    sizes = random.Random(51).sample(range(1, 501), count)
    if 1 not in sizes:
        sizes[count // 2] = 1
    if sizes[0] == 1:  # (a first call of size 1 would be a program of its own)
        sizes[0], sizes[1] = sizes[1], sizes[0]
    device = DEVICE[backend]
    cf = fusec.compile(pointwise_sum, backend=backend, dynamic=dynamic)
    with all_built(cf):
        same_as_eager(cf, pointwise_sum, torch.randn(sizes[0], 64, device=device))
        before = rss_mib()
        for n in sizes[1:]:
            same_as_eager(cf, pointwise_sum, torch.randn(n, 64, device=device))
    grew = rss_mib() - before
    assert cf.compiles <= most, cf.recompiles
    assert grew < 50, f"RSS grew {grew:.1f} MiB over {count} sizes"


# -- 2. sizes, broadcasts, equal dims, strides, reductions, GEMV rows, dtypes --------------------
def test_sizes_zero_one_and_primes(backend):
    sizes = [0, 1, 2, 3, 7, 13, 127, 1031]
    cf = run_sizes(backend, pointwise_sum, lambda n, d: torch.randn(n, 64, device=d), sizes)
    assert cf.compiles <= 3, cf.recompiles  # 0, 1, then the family (2 onwards)


def test_a_family_serves_one_but_not_zero(backend):
    """Once a family is there, a size of 1 is one of its sizes (nothing in the program depends
    on it); 0 is a program of its own, named by the family's guard `1 <= x.size()[0]`."""
    cf = run_sizes(backend, pointwise_sum, lambda n, d: torch.randn(n, 64, device=d),
                   [5, 9, 1, 3, 1, 0, 2])
    assert cf.compiles == 3, cf.recompiles  # 5, the family (9, 1, 3, 1, 2), then 0
    assert "1 <= x.size()[0]" in cf.recompiles[-1], cf.recompiles


def test_a_dim_that_becomes_one_broadcasts(backend):
    """y's dim 0 follows x's, then becomes 1: the family's guard (they are equal) breaks, and
    the call compiles a program that broadcasts."""
    def add(x, y):
        return torch.relu(x + y) * 3
    pairs = [(4, 4), (5, 5), (6, 1), (9, 9), (7, 1), (8, 1)]
    cf = run_sizes(backend, add, lambda n, d: (torch.randn(pairs[n][0], 8, device=d),
                                               torch.randn(pairs[n][1], 8, device=d)),
                   range(len(pairs)))
    assert cf.compiles <= 3, cf.recompiles
    assert any("guard" in r for r in cf.recompiles), cf.recompiles


def test_dims_that_must_stay_equal(backend):
    """x + y with both dims changing together; a call where they differ raises as eager does
    (never a result), and the family still serves the calls after it."""
    def add(x, y):
        return (x + y).sum(-1)
    device = DEVICE[backend]
    cf = fusec.compile(add, backend=backend)
    with all_built(cf):
        for n in (4, 5, 6):
            same_as_eager(cf, add, torch.randn(n, 8, device=device), torch.randn(n, 8, device=device))
        x, y = torch.randn(6, 8, device=device), torch.randn(7, 8, device=device)
        with pytest.raises(RuntimeError):
            add(x, y)
        with pytest.raises(Exception, match="size|broadcast|shape"):
            cf(x, y)
        same_as_eager(cf, add, torch.randn(9, 8, device=device), torch.randn(9, 8, device=device))
    assert cf.compiles == 2, cf.recompiles


def test_a_matmul_whose_dims_must_match(backend):
    """x @ x.T (one symbol on both sides), and x @ y whose inner dims differ in one call."""
    def gram(x):
        return torch.relu(x @ x.T) + 1
    run_sizes(backend, gram, lambda n, d: torch.randn(n, 8, device=d), [4, 5, 11])

    def mm(x, y):
        return (x @ y).relu()
    device = DEVICE[backend]
    cf = run_sizes(backend, mm, lambda n, d: (torch.randn(n, 8, device=d),
                                              torch.randn(8, 5, device=d)), [4, 5, 6])
    x, y = torch.randn(6, 8, device=device), torch.randn(9, 5, device=device)
    with pytest.raises(RuntimeError):
        mm(x, y)
    with pytest.raises(Exception, match="reduction dim|mat1 and mat2|size|shape"):
        cf(x, y)
    same_as_eager(cf, mm, torch.randn(7, 8, device=device), torch.randn(8, 5, device=device))


def test_strides_that_change_with_the_size(backend):
    """A transposed input (strides (1, n)), a slice of a fixed buffer (x[:, :n]: the row stride
    stays, the size changes; at n = 40 the slice is the whole buffer, contiguous, which breaks
    the family's guard that the row stride is not the row's size) and a slice inside the
    function."""
    run_sizes(backend, lambda x: torch.sin(x) * 2,
              lambda n, d: torch.randn(64, n, device=d).T, [4, 5, 9, 33])
    big = torch.randn(8, 40, device=DEVICE[backend])
    cf = run_sizes(backend, lambda x: torch.exp(x) - x, lambda n, d: big[:, :n],
                   [4, 6, 10, 34, 40, 17])
    assert cf.compiles <= 3, cf.recompiles
    run_sizes(backend, lambda x: torch.exp(x[:, : x.shape[1] // 2]),
              lambda n, d: torch.randn(8, n, device=d), [4, 6, 10, 34])


REDUCTIONS = {
    "sum_0": (lambda x: x.sum(0) * 2, 0),
    "softmax_0": (lambda x: torch.softmax(x, 0), 0),
    "var_0": (lambda x: x.var(0), 0),
    "sum_last": (lambda x: x.sum(-1) * 2, 1),
    "softmax_last": (lambda x: torch.softmax(x, -1), 1),
    "var_last": (lambda x: x.var(-1), 1),
}


@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_a_reduction_over_the_dynamic_dim(backend, name):
    fn, dim = REDUCTIONS[name]
    sizes = [3, 5, 1, 9, 130] if dim == 0 else [3, 5, 1, 9, 1030]
    shape = (lambda n: (n, 16)) if dim == 0 else (lambda n: (4, n))
    cf = run_sizes(backend, fn, lambda n, d: torch.randn(*shape(n), device=d), sizes)
    assert cf.compiles == 2 and len(cf.families) == 1, cf.recompiles


# programs where the symbol reaches more than a loop bound: a value (a mean's count, a size
# times x), a view's shape, a cat's offset, an arange's length, an index
SYMBOL_USES = {
    "mean_0": (lambda x: x.mean(0), (lambda n: (n, 16))),
    "size_as_value": (lambda x: x * x.shape[0] + x.shape[1], (lambda n: (n, 16))),
    "view": (lambda x: x.view(-1, 2, 32).sum(1), (lambda n: (n, 64))),
    "layer_norm_last": (lambda x: torch.nn.functional.layer_norm(x, (x.shape[-1],)),
                        (lambda n: (3, n))),
    "cat_0": (lambda x: torch.cat([x, x * 2], 0).sum(-1), (lambda n: (n, 16))),
    "arange": (lambda x: x + torch.arange(x.shape[0], dtype=x.dtype, device=x.device)[:, None],
               (lambda n: (n, 16))),
    "argmax_0": (lambda x: x.argmax(0), (lambda n: (n, 16))),
}


@pytest.mark.parametrize("name", list(SYMBOL_USES))
def test_a_symbol_used_beyond_a_loop_bound(backend, name):
    fn, shape = SYMBOL_USES[name]
    cf = run_sizes(backend, fn, lambda n, d: torch.randn(*shape(n), device=d), [5, 9, 1, 31, 2])
    assert cf.compiles == 2 and len(cf.families) == 1, cf.recompiles


# programs run by a family at a size of 1 (Note: a size of 1 in a family, fusec/dynamic.py): each
# is traced at 5 and 9 (the family), then called at 1, where a broadcast, a reduction of one
# value or a view of one row must still give eager's answer; `most` is 2 where nothing in the
# program asks whether the size is 1, 3 where torch's op itself asks (its guard keeps 1 out)
_W = torch.randn(16, 8)
AT_ONE = {
    "row_vector_bias": (lambda x: torch.relu(x + torch.arange(16.0, device=x.device)) * 2,
                        (lambda n: (n, 16)), 2),
    "column_broadcast": (lambda x: x * x.sum(-1, keepdim=True), (lambda n: (n, 16)), 2),
    "softmax_rows": (lambda x: torch.softmax(x, -1), (lambda n: (n, 16)), 2),
    "softmax_over_n": (lambda x: torch.softmax(x, 0), (lambda n: (n, 16)), 2),
    "mean_var_over_n": (lambda x: x.mean(0) + x.var(0, correction=0), (lambda n: (n, 16)), 2),
    "max_over_n": (lambda x: x.amax(0) - x.amin(-1).sum(), (lambda n: (n, 16)), 2),
    "matmul": (lambda x: torch.tanh(x @ _W.to(x.device)) + 1, (lambda n: (n, 16)), 2),
    # (torch's contiguity of a transpose asks whether n is 1: a (16, 1) with strides (1, 16) is
    # contiguous, so 1 is another program, its guard named at this line)
    "transposed": (lambda x: (x.t() * 3).contiguous(), (lambda n: (n, 16)), 3),
    "cat_with_itself": (lambda x: torch.cat([x, -x], 0).exp(), (lambda n: (n, 16)), 2),
    "view_split": (lambda x: x.view(x.shape[0], 4, 4).sum(-1), (lambda n: (n, 16)), 2),
    "middle_dim": (lambda x: x.sum(1) * x.shape[1], (lambda n: (3, n, 8)), 2),
    "layer_norm": (lambda x: torch.nn.functional.layer_norm(x, (16,)), (lambda n: (n, 16)), 2),
    "expand_to_n": (lambda x: x[:, :1].expand(-1, 16) + x, (lambda n: (n, 16)), 2),
    "argmax_over_n": (lambda x: x.argmax(0), (lambda n: (n, 16)), 2),
}


@pytest.mark.parametrize("name", list(AT_ONE))
def test_a_family_at_size_one(backend, name):
    fn, shape, most = AT_ONE[name]
    cf = run_sizes(backend, fn, lambda n, d: torch.randn(*shape(n), device=d), [5, 9, 1, 3, 1])
    assert cf.compiles <= most and len(cf.families) == 1, cf.recompiles


def test_gemv_rows_1_to_16(backend):
    w = torch.randn(256, 32, device=DEVICE[backend])

    def gemv(x):
        return torch.relu(x @ w) * 2
    cf = run_sizes(backend, gemv, lambda m, d: torch.randn(m, 256, device=d), range(1, 17))
    assert cf.compiles <= 2, cf.recompiles  # one row is its own program, then the family
    cf = run_sizes(backend, gemv, lambda m, d: torch.randn(m, 256, device=d), [4, 7, 1, 16, 1])
    assert cf.compiles == 2, cf.recompiles  # 4, then the family, which serves one row too


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_dtypes(backend, dtype):
    if dtype == torch.int64:
        fn, make = (lambda x: x * 3 + 1), (lambda n, d: torch.randint(-9, 9, (n, 16), device=d))
    else:
        fn = lambda x: (torch.sin(x) * 2 + x).sum(-1)  # noqa: E731
        make = lambda n, d: torch.randn(n, 16, device=d, dtype=dtype)  # noqa: E731
    cf = run_sizes(backend, fn, make, [3, 5, 9])
    assert cf.compiles == 2, cf.recompiles


def test_nan_inputs(backend):
    def make(n, d):
        x = torch.randn(n, 16, device=d)
        x[0] = float("nan")  # a row of NaNs
        x[1:, 3] = float("nan")  # and one in every other row
        return x
    run_sizes(backend, lambda x: torch.softmax(x, -1) + x.amax(-1, keepdim=True), make,
              [3, 5, 9])


def test_non_contiguous_inputs(backend):
    run_sizes(backend, lambda x: torch.sin(x) + x.sum(-1, keepdim=True),
              lambda n, d: torch.randn(n, 32, device=d)[::2, ::3], [6, 10, 18])


# -- 3. the policy's knobs ---------------------------------------------------------------------
def test_mark_dynamic_makes_the_first_compile_a_family(backend):
    x = torch.randn(10, 64, device=DEVICE[backend])
    torch._dynamo.mark_dynamic(x, 0)
    cf = fusec.compile(pointwise_sum, backend=backend)
    with all_built(cf):
        same_as_eager(cf, pointwise_sum, x)
        assert len(cf.families) == 1 and cf.families[0].dims == {0: frozenset({0})}
        same_as_eager(cf, pointwise_sum, torch.randn(11, 64, device=DEVICE[backend]))
    assert cf.compiles == 1, cf.recompiles


class _Prefill(torch.nn.Module):
    """A prompt of t rows written into a cache at positions[:t], plus a table's last t rows: the
    slices end at a size of the family (examples/llama_decode.py's Prefill does both)."""

    def __init__(self, device):
        super().__init__()
        self.register_buffer("positions", torch.arange(40, device=device))
        self.register_buffer("cache", torch.zeros(40, 8, device=device))
        self.register_buffer("table", torch.randn(40, 8, device=device))

    def forward(self, x):
        t = x.shape[0]
        self.cache.index_copy_(0, self.positions[:t], x * 2)
        return torch.sin(x) + self.table[-t:] + self.cache[:t].sum(0)


def _no_answer_for_symbols(torch_own):
    """A fake slice bound that answers None (then the slice's length is a new unbacked symbol)
    for every symbolic index, as torch 2.11's did for `positions[:t]` while fusec traced the
    prefill of benchmarks/decode.py (capture/torch_level.py backed_slices)."""
    def compute_slice_index(size, index):
        return None if isinstance(index, torch.SymInt) else torch_own(size, index)
    return compute_slice_index


@pytest.mark.parametrize("rule", ["torch's own", "no answer for symbols"])
def test_slices_that_end_at_a_size_compile_one_family(backend, rule, monkeypatch):
    """On torch 2.11 (the GPU machine's), `positions[:t]` had a length from the data, and the
    prefill of benchmarks/decode.py compiled every prompt length: one family here, under torch's
    own slice rule and one that answers as 2.11's did, with the cache written as eager writes it."""
    if rule != "torch's own":
        from torch._subclasses import fake_impls
        monkeypatch.setattr(fake_impls, "_compute_slice_index",
                            _no_answer_for_symbols(fake_impls._compute_slice_index))
    device = DEVICE[backend]
    if backend == "triton":  # (the GPU's question, asked of the interpreter's CPU tensors too)
        monkeypatch.setattr(fusec.ops, "INDEXED_WRITE_DEVICES", ("cuda", device))
    model, twin = _Prefill(device), _Prefill(device)
    twin.load_state_dict(model.state_dict())
    cf = fusec.compile(model, backend=backend)
    with all_built(cf):
        for t in (5, 9, 13, 17) if not INTERPRETED else (5, 9, 13):
            x = torch.randn(t, 8, device=device)
            got, want = cf(x), twin(x)
            assert compare(got.cpu(), want.cpu(), None) is None, t
            assert torch.equal(model.cache, twin.cache), t
    inner = cf._compiled
    assert inner.compiles == 2 and len(inner.families) == 1, inner.recompiles


def test_dynamic_false_compiles_every_size(backend):
    cf = run_sizes(backend, pointwise_sum, lambda n, d: torch.randn(n, 64, device=d), [3, 4, 5],
                   dynamic=False)
    assert cf.compiles == 3 and not cf.families, cf.recompiles


def test_torch_compile_hands_fusec_one_symbolic_graph(backend):
    """torch.compile(backend="fusec") follows Dynamo's policy: its first graph is static, and
    after a second size Dynamo hands over a graph with symbolic sizes, which fusec compiles once
    (fusec/dynamic.py `from_examples`) and which serves every later size."""
    torch._dynamo.reset()

    def f(x):
        return torch.softmax(x, -1) * 2 + 1
    opt = torch.compile(f, backend="fusec", options={"backend": backend})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for n in (8, 13, 21, 300, 2):
            same_as_eager(opt, f, torch.randn(n, 64, device=DEVICE[backend]))
    assert not [w for w in seen if issubclass(w.category, fusec.FallbackWarning)]
    parts = [part for region in fusec.regions(opt).regions for part in region.parts]
    assert len(fusec.regions(opt).regions) == 2, str(fusec.regions(opt))
    assert sum(part.compiles for part in parts) == 2, [part.recompiles for part in parts]
    assert not [name for part in parts for name in fell_back(part)]
    torch._dynamo.reset()


# -- 4. a broken guard recompiles, and says which ------------------------------------------------
def test_a_broken_guard_is_named(backend, monkeypatch, capsys):
    monkeypatch.setenv("FUSEC_LOG", "recompiles")
    device = DEVICE[backend]
    cf = fusec.compile(lambda x, y: (x + y).sum(-1), backend=backend)
    for n in (4, 5):
        cf(torch.randn(n, 8, device=device), torch.randn(n, 8, device=device))
    capsys.readouterr()
    cf(torch.randn(6, 8, device=device), torch.randn(1, 8, device=device))  # y's dim 0 is 1 now
    reason = cf.recompiles[-1]
    assert "guard" in reason and "y.size()[0] == x.size()[0]" in reason, reason
    err = capsys.readouterr().err
    assert "[fusec recompiles]" in err and "guard y.size()[0] == x.size()[0] failed" in err, err



def test_each_size_is_bounded_below_once(backend):
    """`x[1:] - x[:-1]` needs x.size(0) >= 2: the family checks that bound, and not also
    `1 <= x.size(0)` (every symbol of a family is at least 1, and the range says so already)."""
    from fusec import dynamic
    device = DEVICE[backend]
    cf = fusec.compile(lambda x: x[1:] - x[:-1], backend=backend)
    for n in (3, 5, 7):
        x = torch.randn(n, 4, device=device)
        torch.testing.assert_close(cf(x), x[1:] - x[:-1])
    [family] = cf.families
    guards = dynamic.guard_expression(family.compiled.captured)
    assert "2 <= L['t0'].size()[0]" in guards and "1 <= " not in guards, guards


def test_a_family_lifts_reshapes_as_a_static_program_does(backend):
    """A view or unsqueeze of a pointwise value over symbolic sizes moves onto the loads
    (passes/lift_reshapes.py), so the ops on both sides share one kernel, as at fixed sizes."""
    from fusec.record import record_of
    device = DEVICE[backend]

    def f(x, y, z):
        return ((x * y).view(x.shape[0], -1) * z).sum(-1), \
            torch.cos((x + 1).unsqueeze(1)) * z[:, None, :1, None]
    cf = fusec.compile(f, backend=backend, dynamic=True)
    for n in (3, 5):
        x, y = torch.randn(n, 7, 4, device=device), torch.randn(n, 7, 4, device=device)
        z = torch.randn(n, 28, device=device)
        for got, want in zip(cf(x, y, z), f(x, y, z)):
            torch.testing.assert_close(got, want)
    assert len(cf.kernels) == 2, [k.name for k in cf.kernels]
    assert sum(d.taken for d in record_of(cf.last.gm).fuse_pointwise) == 2

# -- 5. explain and the kernels show the symbols -------------------------------------------------
def test_explain_shows_the_family(backend):
    device = DEVICE[backend]
    cf = fusec.compile(lambda x, y: torch.softmax(x + y, -1), backend=backend)
    with all_built(cf):
        for n in (4, 5):
            cf(torch.randn(n, 8, device=device), torch.randn(n, 8, device=device))
    e = fusec.explain(cf, torch.randn(7, 8, device=device), torch.randn(7, 8, device=device))
    family = e.to_dict()["family"]
    assert family is not None
    [symbol] = family["symbols"]
    assert symbol["source"] == "x.size(0)" and symbol["name"] == "x_size0", symbol
    assert any("Eq(" in g for g in family["guards"]), family["guards"]  # x's dim 0 is y's
    text = str(e)
    assert "shape family" in text and "guards" in text and symbol["symbol"] in text
    assert any("Eq(x_size0, y_size0)" in g for g in family["guards"]), family["guards"]
    s = symbol["name"]  # (kernels name each size after the input size it is, as the program does)
    spelled = {"cpp": f"int64_t {s}", "llvm": f"i64 %{s}", "triton": f"_ptr, {s}"}[backend]
    assert any(spelled in k.source for k in cf.kernels), [k.source[:600] for k in cf.kernels]
    assert "x_size0 = " in cf.last.program.run.source  # the program binds it from x's shape


# -- 6. transformers models: prompt lengths 1..512 -------------------------------------------------
def _models():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=512)).eval()
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=128, max_position_embeddings=512)).eval()
    return {"gpt2": gpt2, "llama": llama}


@pytest.fixture(scope="module")
def models():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (transformers' notes on the small config's token ids)
        return _models()


LENGTHS = random.Random(0).sample([1, 2, 7, 13, 33, 64, 100, 255, 511, 512], 10)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
# (the default policy on C++ and LLVM, dynamic=True on C++ only: the file's CPU budget)
@pytest.mark.parametrize("model_backend, dynamic, most", [("cpp", None, 3), ("cpp", True, 2),
                                                          ("llvm", None, 3)])
def test_transformers_prompt_lengths(models, name, model_backend, dynamic, most):
    model = models[name]
    cf = fusec.compile(copy.deepcopy(model), backend=model_backend, dynamic=dynamic)
    with all_built(cf), torch.no_grad():
        for length in LENGTHS:
            ids = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(length))
            got, want = cf(ids).logits, model(ids).logits
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"length {length}: {m}")
    assert compiles(cf) <= most, cf._compiled.recompiles
    # (the third program is the length of 1, which transformers' attention asks about:
    # `q_length > 1` chooses SDPA's causal flag; the reason names that line)
    assert all("sdpa_attention.py" in r for r in cf._compiled.recompiles if "2 <=" in r), \
        cf._compiled.recompiles


def test_prefill_of_every_prompt_length_compiles_once():
    """benchmarks/decode.py --prefill's model: a whole prompt at once writes its keys and values
    into the model's cache (in place) and returns the last position's logits. Prompts of many
    lengths: the static program, then one family; the logits and the cache are eager's. (A
    prompt of one token would be a third program: the attention's `q.reshape` of a transposed
    tensor is a view only when the length is 1, so torch's reshape asks.)"""
    from fusec.examples.llama_decode import TINY, Llama, Prefill
    model = Llama(dict(TINY, max_seq=48), "bf16").eval()
    prefill = Prefill(model)
    cf = fusec.compile(prefill, backend="cpp")
    with all_built(cf), torch.no_grad():
        for length in (5, 9, 40, 3):
            tokens = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(length))
            model.reset()
            want = prefill(tokens)
            caches = [t.clone() for layer in model.layers for t in (layer.k_cache, layer.v_cache)]
            model.reset()
            got = cf(tokens)
            torch.testing.assert_close(got, want, msg=lambda m: f"length {length}: {m}")
            for c, layer_cache in zip(caches, [t for layer in model.layers
                                               for t in (layer.k_cache, layer.v_cache)]):
                torch.testing.assert_close(layer_cache, c, msg=lambda m: f"cache, length {length}: {m}")
    assert compiles(cf) == 2, cf._compiled.recompiles


@pytest.mark.parametrize("mask", ["none", "float", "bool", "causal"])
def test_attention_of_a_family_is_torchs_sdpa(mask, monkeypatch):
    """On CUDA, SDPA reads sizes as numbers while tracing; a family traces it as one call of
    fusec::attention (capture/torch_level.py), torch's own SDPA at run time. Switched on for
    the CPU here: the program calls it, the sizes stay symbols, the answers are eager's."""
    import importlib
    monkeypatch.setattr(importlib.import_module("fusec.capture.torch_level"), "SDPA_READS_SIZES",
                        ("cuda", "cpu"))
    import torch.nn.functional as F

    def f(q, k, v, m):
        if mask == "causal":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask == "none" else m)
        return torch.relu(out) * 2

    cf = fusec.compile(f, backend="cpp")
    with all_built(cf), torch.no_grad():
        for n in (5, 9, 13):
            q, k, v = (torch.randn(2, 4, n, 16) for _ in range(3))
            m = torch.randn(2, 1, n, n) if mask == "float" else torch.rand(2, 1, n, n) > 0.3
            same_as_eager(cf, f, q, k, v, m)
    assert compiles(cf) == 2 and len(cf.families) == 1, cf.recompiles
    assert "_fusec_attention_default(" in cf.last.program.run.source


def test_a_mask_broadcast_along_the_keys_reaches_sdpa_dense(monkeypatch):
    """SDPA's fused kernels read a mask densely along the keys, and take the math kernel for one
    broadcast there: transformers' BERT handed fusec::attention a (1, 1, 512, 1) mask and ran
    1.24x its static program's time on an H100. fusec::attention hands SDPA the mask dense along
    the keys (capture/torch_level.dense_along_keys), with eager's answers."""
    import importlib
    import torch.nn.functional as F
    monkeypatch.setattr(importlib.import_module("fusec.capture.torch_level"), "SDPA_READS_SIZES",
                        ("cuda", "cpu"))
    sdpa, handed = F.scaled_dot_product_attention, []

    def recording(*args, attn_mask=None, **kwargs):  # (what fusec::attention calls at run time)
        handed.append(attn_mask)
        return sdpa(*args, attn_mask=attn_mask, **kwargs)

    def f(q, k, v, m):
        return sdpa(q, k, v, attn_mask=m) * 2

    cf = fusec.compile(f, backend="cpp")
    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    with all_built(cf), torch.no_grad():
        for n in (5, 9, 13):
            q, k, v = (torch.randn(2, 4, n, 16) for _ in range(3))
            m = torch.rand(1, 1, n, 1) > 0.3
            m[0, 0, 0, 0] = True  # (a query that sees no key gives NaN in eager too)
            same_as_eager(cf, f, q, k, v, m)
    assert compiles(cf) == 2 and len(cf.families) == 1, cf.recompiles
    masks = [m for m in handed if m is not None]
    assert masks and all(m.shape[-1] == 13 and m.stride(-1) == 1 for m in masks[-1:]), \
        [(tuple(m.shape), m.stride()) for m in masks]


# -- 7. the family's fast path -------------------------------------------------------------------
def test_the_family_fast_path_is_taken(backend):
    device = DEVICE[backend]
    cf = fusec.compile(pointwise_sum, backend=backend)
    with all_built(cf):
        for n in (8, 13):
            same_as_eager(cf, pointwise_sum, torch.randn(n, 64, device=device))
        assert "shape family" in cf._fast.source, cf._fast.source
        general = []
        call = cf._call
        cf._call = lambda *a: (general.append(a), call(*a))[1]
        same_as_eager(cf, pointwise_sum, torch.randn(21, 64, device=device))
    assert not general, "a call of a third size took the general path"
    assert re.search(r"x_size0\b", cf.last.program.run.source)
    assert cf.compiles == 2


# -- 8. a family's intermediate buffers: one pool per size (fusec/runtime/family_pool.py) ----------
def test_a_family_keeps_its_buffers_in_one_pool_per_size(backend):
    from fusec.runtime.family_pool import KEEP
    device = DEVICE[backend]
    w = torch.randn(64, 32, device=device)

    def f(x):  # sin's result lives between two steps: a planned buffer, not an output
        return torch.cos(torch.sin(x) @ w) + 1

    # (no CUDA graphs: a replay runs no Python, so `in_use` would keep the last size that ran it)
    cf = fusec.compile(f, backend=backend, dynamic=True, cuda_graphs=False)
    sizes = (5, 9, 5) if INTERPRETED and backend == "triton" else (5, 9, 5, 7, 11, 13, 17, 5)
    returned = []
    with all_built(cf):
        for n in sizes:
            x = torch.randn(n, 64, device=device)
            same_as_eager(cf, f, x)
            out = cf(x)
            returned.append((out, out.clone()))  # (what it returned, and a copy)
            pool = cf.last.program.family_pool
            views = pool.kept[n]
            cf(x)
            assert pool.kept[n] is views, "a second call at a size carved its pool again"
            assert pool.in_use is views  # (what a CUDA graph captured at this size keeps)
    assert compiles(cf) == 1
    assert "_pool.carve(" in cf.last.program.run.source, cf.last.program.run.source
    assert len(pool.kept) <= KEEP
    for out, before in returned:  # no later call wrote into what an earlier one returned
        assert torch.equal(out, before)
    assert "plans again at each size" in str(cf.last.memory)  # (the traced sizes' plan)


# -- 9. sizes a family returns, and training through torch.compile ------------------------------
def test_a_family_returns_this_calls_sizes(backend):
    """`return y, x.shape[0]`: the size is this call's number, not the symbol it was traced as."""
    device = DEVICE[backend]

    def f(x):
        return x * 2, x.shape[0], x.shape[0] * x.shape[1] // 2

    for compiled in (fusec.compile(f, backend=backend, dynamic=True),
                     torch.compile(f, backend="fusec", dynamic=True,
                                   options={"backend": backend})):
        for n in (5, 9, 3):
            x = torch.randn(n, 4, device=device)
            out = compiled(x)
            assert out[1:] == (n, n * 2) and type(out[1]) is int, out[1:]
            assert torch.equal(out[0], x * 2)


def test_training_through_torch_compile_compiles_one_family(backend):
    """Dynamo marks the batch dim dynamic after its second size; the forward and backward
    programs must not narrow it back to a number (a size read with `int()` would), so the third
    size reuses the second's graph."""
    if backend == "triton" and INTERPRETED:
        pytest.skip("a training step under Triton's interpreter takes minutes")
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 4)).to(DEVICE[backend])
    reference = copy.deepcopy(model)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="fusec", options={"backend": backend})
    for n in (5, 9, 3, 32, 8):  # (32: the layers' width, a size equal to another)
        x = torch.randn(n, 16, device=DEVICE[backend])
        compiled(x).square().mean().backward()
        reference(x).square().mean().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=f"{n}: {name}")
            p.grad = q.grad = None
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])

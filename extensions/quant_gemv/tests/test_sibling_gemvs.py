"""passes/sibling_gemvs.py: M = 1 matmuls that read the same activation become one GEMV over their
weights, each weight read where it lies (pieces of a cat along N), against eager.

The stored-weight GEMV is used on GPUs (small_matmul.STORED_GEMV_DEVICES); the tests widen that
list so that the Triton interpreter runs the same kernels on the CPU. The CPU backends keep the
library matmul for stored weights, and the pass leaves their graphs alone (checked below)."""
import importlib

import pytest
import torch
import torch.nn.functional as F

import fusec
from conftest import TRITON_DEVICE, assert_matches
from fusec.record import record_of

small_matmul = importlib.import_module("fusec.extensions.quant_gemv.small_matmul")
llama = importlib.import_module("fusec.examples.llama_decode")
# the example's tiny Llama with one layer and a narrower MLP: its decode kernels run under the
# Triton interpreter, where each GEMV program costs (the full TINY took two minutes a test)
SMALL_LLAMA = dict(llama.TINY, dim=32, heads=2, kv_heads=1, hidden=64, layers=1, vocab=64)


@pytest.fixture
def gemv_here(monkeypatch):
    monkeypatch.setattr(small_matmul, "STORED_GEMV_DEVICES", ("cuda", TRITON_DEVICE))


def rand(*shape, dtype=torch.bfloat16, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(TRITON_DEVICE)


def qkv(x, wq, wk, wv):
    """Llama's attention projections: three linears of one normed input."""
    return F.linear(x, wq) * 2, F.linear(x, wk).sin(), F.linear(x, wv)


def decisions(cf):
    last = cf._compiled.last if hasattr(cf, "_compiled") else cf.last
    return record_of(last.gm).extensions["sibling_gemvs"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("widths,k", [((64, 16, 16), 128), ((37, 5, 90), 77), ((3, 1), 1000)])
def test_siblings_become_one_gemv(gemv_here, dtype, widths, k):
    """Odd widths (pieces that start inside a program's block of columns), odd K, one-column
    pieces: every output column reads the weight that holds it."""
    x = rand(1, k, dtype=dtype)
    ws = [rand(n, k, dtype=dtype, seed=i + 1, scale=k ** -0.5) for i, n in enumerate(widths)]
    fn = (lambda x, *ws: tuple(F.linear(x, w) for w in ws)) if len(ws) != 3 else qkv
    with torch.no_grad():
        cf = assert_matches(fn, x, *ws, backend="triton")
    gemvs = [kern for kern in cf.kernels if "gemv" in kern.name]
    assert len(gemvs) == 1, [kern.name for kern in cf.kernels]
    src = gemvs[0].source
    # one load per chunk of K reads all the weights: each column's address from its own weight
    assert "tl.load(tl.where((n " in src
    assert all(f"{name}_ptr + " in src for name in ("wq", "wk", "wv")[:len(ws)]) or len(ws) != 3
    assert all(taken for _, taken, _ in decisions(cf))


def test_nan_and_inf_stay_in_their_own_weights_columns(gemv_here):
    x = rand(1, 64)
    wq, wk, wv = rand(8, 64, seed=1), rand(4, 64, seed=2), rand(4, 64, seed=3)
    wk[1, 5] = float("nan")
    wv[2, 0] = float("inf")
    with torch.no_grad():
        cf = fusec.compile(qkv, backend="triton")
        got = cf(x, wq, wk, wv)
        want = qkv(x, wq, wk, wv)
    for g, w in zip(got, want):
        assert torch.equal(g.isnan(), w.isnan()) and torch.equal(g.isinf(), w.isinf())
        fin = w.isfinite()
        torch.testing.assert_close(g[fin].float(), w[fin].float(), rtol=2e-2, atol=2e-2)


def test_what_is_left_alone(gemv_here):
    """Different K, another activation, two rows, a float32 weight: no siblings to join."""
    x, y = rand(1, 32), rand(1, 32, seed=9)
    a, b, c = rand(8, 32, seed=1), rand(8, 32, seed=2), rand(8, 48, seed=3)
    x48 = rand(1, 48, seed=4)
    with torch.no_grad():
        cf = assert_matches(lambda x, y, a, b: (F.linear(x, a), F.linear(y, b)), x, y, a, b,
                            backend="triton")
        assert not any(taken for _, taken, _ in decisions(cf))
        cf = assert_matches(lambda x, x48, a, c: (F.linear(x, a), F.linear(x48, c)), x, x48, a, c,
                            backend="triton")
        assert not any(taken for _, taken, _ in decisions(cf))
        x2 = rand(2, 32)
        cf = assert_matches(lambda x, a, b: (F.linear(x, a), F.linear(x, b)), x2, a, b, backend="triton")
        assert decisions(cf) == []
        af, bf = a.float(), b.float()
        cf = assert_matches(lambda x, a, b: (F.linear(x, a), F.linear(x, b)), x.float(), af, bf,
                            backend="triton")
        assert [why for _, taken, why in decisions(cf)][0].startswith("M = 1, but a torch.float32")


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_cpu_backends_keep_the_library_matmul(backend):
    x = torch.randn(1, 32, dtype=torch.bfloat16)
    ws = [torch.randn(n, 32, dtype=torch.bfloat16) for n in (8, 4, 4)]
    with torch.no_grad():
        cf = assert_matches(qkv, x, *ws, backend=backend)
    whys = [why for _, taken, why in decisions(cf) if not taken]
    assert whys and all("M = 1 on cpu" in w for w in whys)


def test_explain_says_which_weights_were_joined(gemv_here):
    x, ws = rand(1, 32), [rand(n, 32, seed=n) for n in (8, 4, 4)]
    with torch.no_grad():
        text = str(fusec.explain(qkv, x, *ws, backend="triton"))
    assert "graph after sibling_gemvs" in text
    assert "3 GEMVs read" in text and "8 + 4 + 4 columns" in text
    assert "each read where it lies" in text


def test_llama_decode_tokens_match_eager(gemv_here):
    """The decode example: q/k/v and gate/up joined in every layer, the same greedy tokens."""
    model = llama.Llama(SMALL_LLAMA, "bf16", device=TRITON_DEVICE).eval()
    cf = fusec.compile(model, backend="triton")
    assert llama.generate(cf, model, [1, 2], 3) == llama.generate(model, model, [1, 2], 3)
    joined = [d for d in decisions(cf) if d[1]]
    assert len(joined) == 5 * SMALL_LLAMA["layers"]  # wq, wk, wv, w1, w3 in every layer


def test_weights_captured_from_a_closure(gemv_here):
    """Tensors a function closes over become constants (get_attr nodes made just before their
    first use): the joined GEMV still finds every weight defined before it."""
    ws = [rand(n, 64, seed=n) for n in (32, 8, 8)]
    x = rand(1, 64)
    with torch.no_grad():
        cf = assert_matches(lambda v: tuple(F.linear(v, w) for w in ws), x, backend="triton")
    assert [kern.name for kern in cf.kernels] == ["fused_gemv_0"]


@pytest.mark.parametrize("widths", [(64, 16, 16), (37, 5, 90)])
def test_linears_with_biases(gemv_here, widths):
    """Qwen2's q/k/v projections have biases: they are pieces too, added in the epilogue."""
    k = 96
    lins = [torch.nn.Linear(k, n, bias=True).to(torch.bfloat16).to(TRITON_DEVICE) for n in widths]
    x = rand(1, k)

    def f(x):
        q, kk, v = (lin(x) for lin in lins)
        return q.sigmoid(), kk * 2, v
    with torch.no_grad():
        cf = assert_matches(f, x, backend="triton")
    gemvs = [kern for kern in cf.kernels if "gemv" in kern.name]
    assert len(gemvs) == 1 and sum(d.taken for d in decisions(cf)) == 3
    # the biases are read per column in the GEMV's epilogue: the weights' and the biases' loads
    assert "aten.add.Tensor" in gemvs[0].ops and gemvs[0].name.startswith("fused_gemv_cat_add")
    # (one for the biases, before the loop; the weights' chunk 0 and its prefetch in the loop)
    assert gemvs[0].source.count("tl.load(tl.where((n < ") == 3


def test_mixed_bias_and_no_bias_are_separate_sets(gemv_here):
    a = torch.nn.Linear(32, 8, bias=True).to(torch.bfloat16).to(TRITON_DEVICE)
    b = torch.nn.Linear(32, 8, bias=False).to(torch.bfloat16).to(TRITON_DEVICE)
    with torch.no_grad():
        cf = assert_matches(lambda x: (a(x), b(x)), rand(1, 32), backend="triton")
    assert not any(d.taken for d in decisions(cf))

"""torch.cat, against eager. With empty tensors in the list (a KV cache's first step), the
empties are dropped at capture (fusec/capture/decompositions.py, cat_without_empties), so a cat
of one real tensor is a copy that fuses with its producer. A real concatenation is done inside a
pointwise kernel, each piece read where it lies (codegen/lower.py, cat_pieces)."""
import pytest
import torch

import fusec
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


# ---- concatenation inside a kernel (codegen/lower.py, cat_pieces) ------------------------------

def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def test_rotary_embedding_reads_its_pieces_in_place(target):
    """Llama's rotate_half: the cat becomes masked loads in the kernel that uses it."""
    backend, device = target
    x = torch.randn(2, 4, 7, 16, device=device)
    cos, sin = torch.randn(7, 16, device=device), torch.randn(7, 16, device=device)
    cf = assert_matches(rotary, x, cos, sin, backend=backend)
    # -x2 is computed over the whole concatenation (passes/computed_pieces.py): one kernel
    assert [k.name for k in cf.kernels] == ["fused_mul_cat_neg_where_mul_add_0"]
    assert "aten.cat" not in cf.source().split("# ===== graph")[0].split("===== program")[1]


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32,
                                   torch.int8, torch.bool])
def test_cat_along_any_dim_in_any_dtype(target, dim, dtype):
    backend, device = target
    shapes = [[3, 5, 7], [3, 5, 7], [3, 5, 7]]
    for k, size in enumerate((2, 1, 4)):
        shapes[k][dim] = size
    pieces = [torch.randn(s, device=device) * 4 for s in shapes]
    pieces = [p > 0 if dtype == torch.bool else p.to(dtype) for p in pieces]

    def f(a, b, c):
        out = torch.cat([a, b, c], dim=dim)
        return out if dtype == torch.bool else out * 2
    cf = assert_matches(f, *pieces, backend=backend)
    assert len(cf.kernels) == 1


def test_non_contiguous_pieces(target):
    backend, device = target
    a = torch.randn(6, 5, device=device).t()  # (5, 6) transposed
    b = torch.randn(5, 9, device=device)[:, 2:7]  # (5, 5) sliced
    c = torch.randn(5, 1, device=device).expand(5, 3)  # broadcast
    assert_matches(lambda a, b, c: torch.cat([a, b, c], dim=1).sigmoid(), a, b, c,
                   backend=backend, kernels=1)


def test_channels_last_pieces(target):
    backend, device = target
    a = torch.randn(2, 3, 5, 6, device=device).to(memory_format=torch.channels_last)
    b = torch.randn(2, 4, 5, 6, device=device).to(memory_format=torch.channels_last)
    assert_matches(lambda a, b: torch.relu(torch.cat([a, b], dim=1)), a, b, backend=backend)


def test_same_tensor_twice_and_cat_as_output(target):
    backend, device = target
    x = torch.randn(4, 6, device=device)

    def f(x):
        emb = torch.cat([x, x], dim=-1)  # Llama's cos/sin table
        return emb, emb.cos()
    cf = assert_matches(f, x, backend=backend)
    assert len(cf.kernels) == 1


def test_nan_inf_and_signed_zero_survive(target):
    backend, device = target
    a = torch.tensor([[float("nan"), -0.0, float("inf")]], device=device)
    b = torch.tensor([[-0.0, float("-inf")]], device=device)
    cf = fusec.compile(lambda a, b: torch.cat([a, b], dim=1) * 1.0, backend=backend)
    got = cf(a, b).cpu()
    want = torch.tensor([[float("nan"), -0.0, float("inf"), -0.0, float("-inf")]])
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.signbit(got), torch.signbit(want))
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_mixed_dtypes_stay_an_extern(target):
    backend, device = target
    a, b = torch.randn(3, 4, device=device), torch.randn(3, 2, device=device).half()
    cf = assert_matches(lambda a, b: torch.cat([a, b], dim=1) + 1, a, b, backend=backend)
    assert "aten.cat" in cf.source()


def test_cat_then_softmax_keeps_the_reduction_apart(target):
    backend, device = target
    a, b = torch.randn(4, 5, device=device), torch.randn(4, 3, device=device)
    assert_matches(lambda a, b: torch.softmax(torch.cat([a, b], dim=1) * 2, dim=1), a, b,
                   backend=backend)


def test_a_computed_piece_is_refused_with_a_reason():
    """A piece computed from two inputs (not a chain that passes/computed_pieces.py can move
    past the cat) gets a kernel of its own, and explain says why."""
    e = fusec.explain(lambda x, y: torch.cat([x * y, x], dim=-1), torch.randn(3, 8),
                      torch.randn(3, 8), backend="cpp")
    assert any("a piece of a cat" in r for r in str(e).splitlines())
    text = str(fusec.explain(rotate_half, torch.randn(3, 8), backend="cpp"))
    assert "computed piece(s) (neg) computed on the whole concatenation" in text


def test_large_odd_shapes(target):
    backend, device = target
    a, b = torch.randn(3, 1037, device=device), torch.randn(3, 515, device=device)
    assert_matches(lambda a, b: torch.cat([b, a], dim=1).tanh(), a, b, backend=backend, kernels=1)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_cat_broadcast_into_a_larger_iteration_space(target, dim):
    """The cat's dim counts in the cat's own rank: a (N, K) cat times an (M, 1, K) tensor runs
    over (M, N, K), and the pieces must be read along the space's dim 1, not its dim 0 (a bug
    once read every row of every piece from row 0)."""
    backend, device = target
    sizes = {0: [(4, 6), (3, 6)], 1: [(5, 2), (5, 4)], -1: [(5, 2), (5, 4)]}[dim]
    pieces = [torch.randn(s, device=device) for s in sizes]
    cat_shape = torch.cat(pieces, dim=dim).shape
    x = torch.randn(2, 1, cat_shape[1], device=device)

    def f(x, a, b):
        return x * torch.cat([a, b], dim=dim) + 1
    assert_matches(f, x, *pieces, backend=backend, kernels=1)
    xs = torch.randn(3, 1, 1, cat_shape[1], device=device)  # two dims in front, one broadcast
    assert_matches(lambda x, a, b: (x * torch.cat([a, b.sin()], dim=dim)), xs, *pieces,
                   backend=backend)

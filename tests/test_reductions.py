"""Reductions end to end: every reduction over every kind of dim choice, dtype, odd shapes, NaN and
infinities, empty dims, and the fused normalizations (softmax, layer_norm ...) as one kernel each.
Every case runs on both backends (the `target` fixture) and is compared with eager through
`assert_matches` (float64-referenced for floats, exact for ints and bools).

Tensors stay small: each new signature costs a C++ compile (~0.3 s), and Triton's interpreter
runs every program instance in Python. A few rows of 10000 take the looped Triton template
(rows longer than codegen.triton.PERSISTENT_MAX_K) and the blocked C++ float sum.
"""
import pytest
import torch
import torch.nn.functional as F

import fusec
from conftest import assert_matches
from fusec.codegen.triton import PERSISTENT_MAX_K

LONG = 10000  # > PERSISTENT_MAX_K: the looped Triton template
assert LONG > PERSISTENT_MAX_K


def _randn(shape, device, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


# (name, fn(x, dim, keepdim)). `dim` is an int, a tuple of ints, or None (every dim).
REDUCTIONS = {
    "sum": lambda x, d, k: x.sum(d, keepdim=k) if d is not None else x.sum(),
    "mean": lambda x, d, k: x.mean(d, keepdim=k) if d is not None else x.mean(),
    "amax": lambda x, d, k: x.amax(d if d is not None else (), keepdim=k),
    "amin": lambda x, d, k: x.amin(d if d is not None else (), keepdim=k),
    "argmax": lambda x, d, k: x.argmax(d, keepdim=k),
    "argmin": lambda x, d, k: x.argmin(d, keepdim=k),
    "prod": lambda x, d, k: x.prod(d, keepdim=k) if d is not None else x.prod(),
    "var0": lambda x, d, k: x.var(d, correction=0, keepdim=k),
    "var1": lambda x, d, k: x.var(d, correction=1, keepdim=k),
    "std0": lambda x, d, k: x.std(d, correction=0, keepdim=k),
    "std1": lambda x, d, k: x.std(d, correction=1, keepdim=k),
    "logsumexp": lambda x, d, k: torch.logsumexp(x, d if d is not None else tuple(range(x.dim())),
                                                 keepdim=k),
    "any": lambda x, d, k: (x > 0.5).any(d, keepdim=k) if d is not None else (x > 0.5).any(),
    "all": lambda x, d, k: (x > -1.5).all(d, keepdim=k) if d is not None else (x > -1.5).all(),
}
SINGLE_DIM_ONLY = {"argmax", "argmin", "prod"}  # torch takes one dim (or none) for these

# dims of a (2, 3, 5) tensor: the last, the first, a middle one, a set with a gap
DIMS = [-1, 0, 1, (0, 2)]


def _reduce(name, dim, keepdim):
    fn = REDUCTIONS[name]
    return lambda x: fn(x, dim, keepdim)


@pytest.mark.parametrize("keepdim", [False, True], ids=["nokeep", "keepdim"])
@pytest.mark.parametrize("name,dim", [(n, d) for n in REDUCTIONS for d in DIMS
                                      if not (n in SINGLE_DIM_ONLY and isinstance(d, tuple))],
                         ids=lambda v: str(v))
def test_reduction_over_dims(target, name, dim, keepdim):
    backend, device = target
    x = _randn((2, 3, 5), device)
    cf = assert_matches(_reduce(name, dim, keepdim), x, backend=backend)
    assert len(cf.kernels) == 1, [k.name for k in cf.kernels]


@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_full_reduction_to_a_scalar(target, name):
    backend, device = target
    x = _randn((3, 4, 5), device)
    out = assert_matches(_reduce(name, None, False), x, backend=backend, kernels=1)(x)
    assert out.dim() == 0


@pytest.mark.parametrize("name", ["sum", "amax", "argmin", "var1", "any"])
def test_full_reduction_with_keepdim(target, name):
    backend, device = target
    x = _randn((3, 4), device)
    fn = {"sum": lambda x: x.sum((0, 1), keepdim=True),
          "amax": lambda x: x.amax((0, 1), keepdim=True),
          "argmin": lambda x: x.argmin(keepdim=True),  # dim=None: position in the flat tensor
          "var1": lambda x: x.var((0, 1), keepdim=True),
          "any": lambda x: (x > 1).any(0, keepdim=True).any(1, keepdim=True)}[name]
    assert_matches(fn, x, backend=backend)


# (B, C, H, W): over C (the classic non-innermost case), over everything but C (batch norm's
# statistics), and over trailing dims together.
@pytest.mark.parametrize("dims", [(1,), (0, 2, 3), (2, 3), (1, 2, 3)], ids=str)
@pytest.mark.parametrize("name", ["sum", "mean", "amax", "var1", "logsumexp"])
def test_reduction_of_nchw(target, name, dims):
    backend, device = target
    x = _randn((2, 3, 4, 5), device)
    assert_matches(_reduce(name, dims, True), x, backend=backend, kernels=1)


@pytest.mark.parametrize("name", ["argmax", "argmin"])
def test_argmax_over_nchw_channels(target, name):
    backend, device = target
    x = _randn((2, 3, 4, 5), device)
    assert_matches(_reduce(name, 1, False), x, backend=backend, kernels=1)


def test_reduction_of_scalar_tensor(target):
    backend, device = target
    x = _randn((), device)
    assert_matches(lambda x: (x.sum(), x.amax(0), x.argmax(), x.mean(0, keepdim=True)), x,
                   backend=backend)


@pytest.mark.parametrize("k", [1, 2, 7, 33, 64, 1000], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("name", ["sum", "amax", "argmax", "var1", "softmax"])
def test_row_lengths(target, name, k):
    """Rows of length 1, powers of two and not; var with correction 1 of a single value is NaN
    in eager (0 / 0), and must be NaN here too."""
    backend, device = target
    x = _randn((3, k), device)
    fn = (lambda x: torch.softmax(x, -1)) if name == "softmax" else _reduce(name, -1, False)
    assert_matches(fn, x, backend=backend, kernels=1)


def test_length_one_rows_of_middle_dim(target):
    backend, device = target
    x = _randn((4, 1, 6), device)
    assert_matches(lambda x: (x.sum(1), x.amin(1, keepdim=True), x.std(1), x.argmin(1)), x,
                   backend=backend)


# ---- long rows: the looped Triton template, the blocked C++ sum ---------------------------------

LONG_ROW = {
    "sum": lambda x: x.sum(-1),
    "amax": lambda x: x.amax(-1),
    "argmax": lambda x: x.argmax(-1),
    "argmin_keepdim": lambda x: x.argmin(-1, keepdim=True),
    "var": lambda x: x.var(-1),
    "logsumexp": lambda x: torch.logsumexp(x, -1),
    "softmax": lambda x: torch.softmax(x, -1),
    "log_softmax": lambda x: torch.log_softmax(x, -1),
    "layer_norm": lambda x: F.layer_norm(x, (LONG,)),
    "max_dim": lambda x: x.max(-1),
}


@pytest.mark.parametrize("name", list(LONG_ROW))
def test_long_rows(target, name):
    backend, device = target
    x = _randn((2, LONG), device) + 1.0  # an offset makes a naive float sum drift
    x[0, 7777] = 40.0  # the max sits in a later chunk of the row
    cf = assert_matches(LONG_ROW[name], x, backend=backend, kernels=1)
    if backend == "triton":
        assert "for k_start in range(0, n_k, RBLOCK)" in cf.kernels[0].source


def test_long_row_with_nan_and_ties(target):
    backend, device = target
    x = _randn((3, LONG), device)
    x[0, 100] = x[0, 9000] = 50.0  # ties: the first position wins
    x[1, 5000] = x[1, 9999] = float("nan")  # the first NaN wins
    x[2] = float("-inf")  # all equal: position 0
    assert_matches(lambda x: (x.argmax(-1), x.argmin(-1), x.amax(-1), x.amin(-1)), x,
                   backend=backend, kernels=1)


def test_long_sum_over_strided_dim(target):
    """9000 values 2 apart: the C++ loop cannot vectorize it into partial sums, so a plain
    running float sum drifts past eager's error; blocking keeps it as accurate as eager."""
    backend, device = target
    x = _randn((2, 9000, 2), device, seed=3)
    assert_matches(lambda x: (x.sum(1), x.mean(1, keepdim=True)), x, backend=backend,
                   kernels=1)


def test_long_full_reduction(target):
    backend, device = target
    x = _randn((100, 1000), device) + 1.0
    # on a GPU one row of 100000 is split in two reductions (passes/split_reductions.py), and the
    # sum and the mean share both
    assert_matches(lambda x: (x.sum(), x.mean()), x, backend=backend,
                   kernels=1 if device == "cpu" else 2)


# ---- dtypes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["sum", "mean", "amax", "argmin", "var1", "logsumexp", "softmax",
                                  "layer_norm"])
def test_half_precision(target, dtype, name):
    """Half inputs accumulate in float32, as eager does: a float16 sum of 1000 values is as
    accurate as eager's, not 1000 float16 roundings."""
    backend, device = target
    x = _randn((3, 1000), device, dtype) + 0.5
    fn = {"softmax": lambda x: torch.softmax(x, -1),
          "layer_norm": lambda x: F.layer_norm(x, (1000,))}.get(name) or _reduce(name, -1, False)
    cf = assert_matches(fn, x, backend=backend, kernels=1)
    assert cf(x).dtype == fn(x).dtype


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_sum_to_float32(target, dtype):
    backend, device = target
    x = _randn((3, 40), device, dtype)
    assert_matches(lambda x: (x.sum(0, dtype=torch.float32), x.mean(-1, dtype=torch.float32)), x,
                   backend=backend)


def test_float64(target):
    backend, device = target
    x = _randn((5, 33), device, torch.float64)
    assert_matches(lambda x: (x.sum(0), x.var(-1), x.amax(-1), torch.softmax(x, 0),
                              torch.logsumexp(x, 1)), x, backend=backend)


def test_sum_to_float64(target):
    backend, device = target
    x = _randn((4, 7), device)
    assert_matches(lambda x: x.sum(-1, dtype=torch.float64), x, backend=backend, kernels=1)


def _ints(shape, dtype, device, lo=-50, hi=50):
    gen = torch.Generator().manual_seed(1)
    if dtype == torch.bool:
        return (torch.rand(shape, generator=gen) > 0.5).to(device)
    if dtype == torch.uint8:
        lo = 0
    return torch.randint(lo, hi, shape, generator=gen).to(dtype).to(device)


INT_DTYPES = [torch.int32, torch.int64, torch.uint8, torch.bool]


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
def test_integer_sum_is_int64(target, dtype):
    backend, device = target
    x = _ints((4, 33), dtype, device)
    cf = assert_matches(lambda x: (x.sum(-1), x.sum(0, keepdim=True), x.sum()), x,
                        backend=backend)
    assert all(o.dtype == torch.int64 for o in cf(x))


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
def test_integer_max_min(target, dtype):
    backend, device = target
    x = _ints((4, 7), dtype, device)
    fns = [lambda x: x.amax(-1), lambda x: x.amin(0, keepdim=True)]
    if dtype != torch.bool:  # eager has no argmax for bool
        fns += [lambda x: x.argmax(-1), lambda x: x.argmin(0)]
    assert_matches(lambda x: tuple(f(x) for f in fns), x, backend=backend)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
def test_integer_prod(target, dtype):
    backend, device = target
    x = _ints((4, 5), dtype, device, -4, 5)
    assert_matches(lambda x: (x.prod(-1), x.prod(0, keepdim=True)), x, backend=backend)


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int32, torch.float32], ids=str)
def test_any_all(target, dtype):
    """any/all of bool and numbers (nonzero is true); eager's any/all of uint8 are uint8."""
    backend, device = target
    x = _ints((5, 6), dtype, device, -1, 2) if dtype != torch.float32 else \
        torch.tensor([[0.0, 0.5, 0, 0, 0, 0]] * 2 + [[0.0] * 6] + [[1.0, -1, 2, 3, 4, 5]] * 2,
                     device=device)
    assert_matches(lambda x: (x.any(-1), x.all(-1), x.any(0, keepdim=True), x.all(0), x.any(),
                              x.all()), x, backend=backend)


# ---- NaN and infinities ----------------------------------------------------------------------

def _with_nan(device):
    x = _randn((4, 7), device)
    x[1, 2] = float("nan")
    x[1, 5] = float("nan")  # two NaNs in a row: argmax/argmin point at the first one
    x[3, 0] = float("nan")
    return x


NAN_FNS = {
    "amax": lambda x: x.amax(-1),
    "amin": lambda x: x.amin(-1),
    "argmax": lambda x: x.argmax(-1),
    "argmin": lambda x: x.argmin(-1),
    "argmax_dim0": lambda x: x.argmax(0),
    "argmin_flat": lambda x: x.argmin(),
    "max_dim": lambda x: x.max(-1),
    "min_dim": lambda x: x.min(0),
    "sum": lambda x: x.sum(-1),
    "mean_dim0": lambda x: x.mean(0),
    "softmax": lambda x: torch.softmax(x, -1),
    "logsumexp": lambda x: torch.logsumexp(x, -1),
    "var": lambda x: x.var(-1),
    "nansum": lambda x: x.nansum(-1),
}


@pytest.mark.parametrize("name", list(NAN_FNS))
def test_nan_in_rows(target, name):
    backend, device = target
    assert_matches(NAN_FNS[name], _with_nan(device), backend=backend, kernels=1)


def _with_inf(device):
    x = _randn((5, 7), device)
    x[0, 1] = float("inf")
    x[1, 3] = float("-inf")
    x[2] = float("inf")  # a row of +inf: softmax is NaN, logsumexp is inf
    x[3] = float("-inf")  # a row of -inf: softmax is NaN, logsumexp is -inf
    x[4, 0], x[4, 6] = float("inf"), float("-inf")  # sum is NaN
    return x


INF_FNS = {
    "amax": lambda x: x.amax(-1),
    "amin": lambda x: x.amin(0),
    "argmax": lambda x: x.argmax(-1),
    "argmin": lambda x: x.argmin(-1),
    "sum": lambda x: x.sum(-1),
    "prod": lambda x: x.prod(-1),
    "softmax": lambda x: torch.softmax(x, -1),
    "log_softmax": lambda x: torch.log_softmax(x, -1),
    "logsumexp": lambda x: torch.logsumexp(x, -1),
}


@pytest.mark.parametrize("name", list(INF_FNS))
def test_infinities_in_rows(target, name):
    backend, device = target
    assert_matches(INF_FNS[name], _with_inf(device), backend=backend, kernels=1)


# ---- empty dims ------------------------------------------------------------------------------

EMPTY_OK = {  # eager returns a value: the identity of the reduction (or what follows from it)
    "sum": (lambda x: x.sum(-1), (4, 0)),
    "sum_keepdim": (lambda x: x.sum(1, keepdim=True), (4, 0)),
    "sum_dim0": (lambda x: x.sum(0), (0, 4)),
    "sum_all": (lambda x: x.sum(), (0, 3)),
    "prod": (lambda x: x.prod(-1), (4, 0)),
    "any": (lambda x: x.any(-1), (4, 0)),
    "all": (lambda x: x.all(-1), (4, 0)),
    "any_dims": (lambda x: x.any((0, 1)), (0, 3)),
    "mean": (lambda x: x.mean(-1), (4, 0)),  # 0 / 0 = NaN
    "var": (lambda x: x.var(-1), (4, 0)),
    "logsumexp": (lambda x: torch.logsumexp(x, -1), (4, 0)),  # log(0) = -inf
    "softmax": (lambda x: torch.softmax(x, -1), (4, 0)),  # an empty result
    "no_rows": (lambda x: x.sum(-1), (0, 4)),  # nothing reduced into nothing
    "sum_then_add": (lambda x: x.sum(-1, keepdim=True) + 1, (4, 0)),
}


@pytest.mark.parametrize("name", list(EMPTY_OK))
def test_empty_dim_matches_eager(target, name):
    backend, device = target
    fn, shape = EMPTY_OK[name]
    assert_matches(fn, _randn(shape, device), backend=backend)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.uint8], ids=str)
def test_empty_dim_integer(target, dtype):
    backend, device = target
    x = torch.zeros((3, 0), dtype=dtype, device=device)
    assert_matches(lambda x: (x.sum(-1), x.prod(-1), x.any(-1), x.all(-1)), x, backend=backend)


EMPTY_RAISES = {  # eager raises: there is no identity
    "amax": lambda x: x.amax(-1),
    "amin": lambda x: x.amin(1),
    "argmax": lambda x: x.argmax(-1),
    "argmin": lambda x: x.argmin(1),
    "max_dim": lambda x: x.max(-1),
}


@pytest.mark.parametrize("name", list(EMPTY_RAISES))
def test_empty_dim_without_identity_raises(target, name):
    backend, device = target
    fn = EMPTY_RAISES[name]
    x = _randn((4, 0), device)
    with pytest.raises((IndexError, RuntimeError)):
        fn(x)  # eager refuses
    with pytest.raises(fusec.FusecError, match=r"(?i)zero[- ]size|non-zero size|empty"):
        fusec.compile(fn, backend=backend)(x)


# ---- fused normalizations: one kernel each ----------------------------------------------------

def _norm_cases(device):
    x = _randn((4, 6, 10), device)
    w, b = _randn((10,), device, seed=1), _randn((10,), device, seed=2)
    img = _randn((2, 6, 3, 3), device)
    cw, cb = _randn((6,), device, seed=3), _randn((6,), device, seed=4)
    mean, var = _randn((6,), device, seed=5), _randn((6,), device, seed=6).abs() + 0.1
    return {
        "softmax": (lambda x: torch.softmax(x, -1), [x]),
        "softmax_dim1": (lambda x: torch.softmax(x, 1), [x]),
        "log_softmax": (lambda x: torch.log_softmax(x, -1), [x]),
        "log_softmax_dim0": (lambda x: torch.log_softmax(x, 0), [x]),
        "layer_norm": (lambda x: F.layer_norm(x, (10,)), [x]),
        "layer_norm_affine": (lambda x, w, b: F.layer_norm(x, (10,), w, b), [x, w, b]),
        "layer_norm_2d": (lambda x: F.layer_norm(x, (6, 10)), [x]),
        "rms_norm": (lambda x: F.rms_norm(x, (10,)), [x]),
        "rms_norm_weight": (lambda x, w: F.rms_norm(x, (10,), w, 1e-6), [x, w]),
        "group_norm": (lambda x, w, b: F.group_norm(x, 3, w, b), [img, cw, cb]),
        "group_norm_plain": (lambda x: F.group_norm(x, 2), [img]),
        "batch_norm_eval": (lambda x, m, v, w, b: F.batch_norm(x, m, v, w, b, training=False),
                            [img, mean, var, cw, cb]),
        "batch_norm_eval_plain": (lambda x, m, v: F.batch_norm(x, m, v, training=False),
                                  [img, mean, var]),
        # batch statistics, no running statistics: InstanceNorm's and BatchNorm(track_running_stats=False)'s
        "batch_norm_batch_stats": (lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
                                   [img, cw, cb]),
        "instance_norm": (lambda x: F.instance_norm(x), [img]),
        "instance_norm_1d": (lambda x: F.instance_norm(x), [x]),
        "logsumexp": (lambda x: torch.logsumexp(x, -1), [x]),
        "normalize_by_var": (lambda x: (x - x.mean(-1, keepdim=True))
                             * torch.rsqrt(x.var(-1, keepdim=True, correction=0) + 1e-5), [x]),
    }


NORMS = list(_norm_cases("cpu"))


@pytest.mark.parametrize("name", NORMS)
def test_fused_normalization_is_one_kernel(target, name):
    backend, device = target
    fn, args = _norm_cases(device)[name]
    cf = assert_matches(fn, *args, backend=backend)
    assert len(cf.kernels) == 1, [k.name for k in cf.kernels]
    steps = [type(s).__name__ for s in cf.last.program.steps]
    assert "ExternStep" not in steps, steps  # (a ViewStep only reshapes the kernel's output)


@pytest.mark.parametrize("name", ["rms_norm", "rms_norm_weight"])
def test_rms_norm_matches_eager(target, name):
    backend, device = target
    fn, args = _norm_cases(device)[name]
    assert_matches(fn, *args, backend=backend)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_norms_are_one_kernel(target, dtype):
    backend, device = target
    x = _randn((3, 4, 16), device, dtype)
    w, b = _randn((4,), device, dtype, 1), _randn((4,), device, dtype, 2)
    mean, var = _randn((4,), device, seed=3), _randn((4,), device, seed=4).abs() + 0.1
    for fn, args in [(lambda x, w, b: F.group_norm(x, 2, w, b), [x, w, b]),
                     (lambda x, m, v: F.batch_norm(x, m, v, training=False), [x, mean, var]),
                     (lambda x: F.layer_norm(x, (16,)), [x])]:
        assert_matches(fn, *args, backend=backend, kernels=1)


def test_norm_modules_in_eval_mode(target):
    backend, device = target
    model = torch.nn.Sequential(torch.nn.BatchNorm2d(4), torch.nn.GroupNorm(2, 4),
                                torch.nn.LayerNorm(5)).to(device).eval()
    with torch.no_grad():
        model[0].running_mean.uniform_(-1, 1)
        model[0].running_var.uniform_(0.5, 2)
    x = _randn((2, 4, 3, 5), device)
    cf = assert_matches(model, x, backend=backend)
    assert len(cf.kernels) <= 3, [k.name for k in cf.kernels]


@pytest.mark.parametrize("layout", ["transposed", "sliced", "permuted"])
def test_layer_norm_affine_non_contiguous_input(target, layout):
    backend, device = target
    base = _randn((9, 8), device)
    x = {"transposed": base.t(),  # (8, 9), rows 1 apart, elements 8 apart
         "sliced": base[1::2, :],
         "permuted": _randn((3, 9, 4), device).permute(0, 2, 1)}[layout]
    n = x.shape[-1]
    w, b = _randn((n,), device, seed=1), _randn((n,), device, seed=2)
    assert not x.is_contiguous() or layout == "sliced"
    assert_matches(lambda x, w, b: F.layer_norm(x, (n,), w, b), x, w, b, backend=backend,
                   kernels=1)


def test_softmax_of_non_contiguous_input(target):
    backend, device = target
    x = _randn((6, 5), device).t()
    assert_matches(lambda x: torch.softmax(x, -1), x, backend=backend, kernels=1)


# ---- several reductions, prologues, epilogues -----------------------------------------------

SIBLINGS = {
    "sum_amax": lambda x: (x.sum(-1), x.amax(-1)),
    "sum_amax_keepdim": lambda x: (x.sum(-1, keepdim=True), x.amax(-1)),
    "max_dim": lambda x: x.max(-1),  # (amax, argmax)
    "min_dim_keepdim": lambda x: x.min(1, keepdim=True),
    "var_mean": lambda x: torch.var_mean(x, -1),
    "std_mean_dims": lambda x: torch.std_mean(x, (0, 1), correction=0),
    "range": lambda x: x.amax(-1) - x.amin(-1),
    "mean_and_centered": lambda x: (x.mean(-1), x - x.mean(-1, keepdim=True)),
}


@pytest.mark.parametrize("name", list(SIBLINGS))
def test_several_reductions_over_the_same_rows_share_a_kernel(target, name):
    backend, device = target
    x = _randn((3, 4, 9), device)
    assert_matches(SIBLINGS[name], x, backend=backend, kernels=1)


FUSED = {  # (fn, input shapes): prologue and epilogue work fuses into the reduction's kernel
    "prologue": (lambda x, y: (x * y + 1).sum(-1), [(4, 7), (4, 7)]),
    "prologue_broadcast": (lambda x, b: (x + b).amax(0), [(4, 7), (7,)]),
    "prologue_transposed": (lambda x: (x.t() * 2).sum(0), [(5, 6)]),
    "epilogue_rows": (lambda x: x.sum(1) * 2 + 1, [(2, 3, 4)]),
    "epilogue_rows_input": (lambda x, y: x.sum(1) + y, [(2, 3, 4), (2, 4)]),
    "epilogue_broadcast_back": (lambda x: x / x.sum((0, 2), keepdim=True), [(2, 3, 4)]),
    "epilogue_all": (lambda x: x - x.mean(), [(4, 7)]),
    "sum_of_mask": (lambda x: (x > 0).sum(1), [(4, 7)]),
    "count_nonzero": (lambda x: torch.count_nonzero(x, 1), [(4, 7)]),
    "vector_norm": (lambda x: torch.linalg.vector_norm(x, dim=-1), [(4, 7)]),
    "mse_loss": (lambda x, y: F.mse_loss(x, y), [(4, 7), (4, 7)]),
    "expanded_input": (lambda x: x.expand(4, 5, 6).sum(1), [(4, 1, 6)]),
    "sliced_input": (lambda x: x[:, 1::2].sum(-1), [(4, 10)]),
    "stored_element_value": (lambda x: (lambda e: (e, e.sum(-1)))(x.exp()), [(4, 7)]),
}


@pytest.mark.parametrize("name", list(FUSED))
def test_prologue_and_epilogue_fuse(target, name):
    backend, device = target
    fn, shapes = FUSED[name]
    args = [_randn(s, device, seed=i) for i, s in enumerate(shapes)]
    assert_matches(fn, *args, backend=backend, kernels=1)


ROW_VALUE_NEXT_TO_ELEMENTS = {  # (fn, input shapes): x is square, so a row-shaped value also
    # broadcasts over x's own shape; it must still be computed once per row, not per element
    "sin_of_row_input": (lambda x, s: x.sum(-1) + s.sin(), [(3, 3), (3,)]),
    "row_input_twice": (lambda x, s: x.sum(-1) * s + s.sin(), [(3, 3), (3,)]),
    "column_of_x": (lambda x: x.amax(-1) + x[:, 0].sin(), [(3, 3)]),
    "row_of_x": (lambda x: x.sum(-1) + x[0] * 2, [(4, 4)]),
    "cube": (lambda x, s: x.mean(2) - torch.tanh(s), [(2, 2, 2), (2, 2)]),
}


@pytest.mark.parametrize("name", list(ROW_VALUE_NEXT_TO_ELEMENTS))
def test_row_value_beside_element_shaped_value(target, name):
    backend, device = target
    fn, shapes = ROW_VALUE_NEXT_TO_ELEMENTS[name]
    args = [_randn(s, device, seed=i) for i, s in enumerate(shapes)]
    assert_matches(fn, *args, backend=backend)


def test_reduction_of_a_reduction(target):
    backend, device = target
    x = _randn((3, 4, 5), device)
    cf = assert_matches(lambda x: x.sum(-1).amax(-1), x, backend=backend)
    assert len(cf.kernels) == 2  # different rows: two kernels, correct


# ---- bad input ---------------------------------------------------------------------------------

MISSING_DIM = {
    "sum": lambda x: x.sum(3),
    "amax": lambda x: x.amax(-3),
    "argmax": lambda x: x.argmax(2),
    "softmax": lambda x: torch.softmax(x, 2),
    # mean/var/std/logsumexp are fusec's own decompositions: dim 5 of a 2-d tensor must not
    # wrap around to dim 1 (5 % 2) and quietly reduce the wrong dim
    "mean": lambda x: x.mean(5),
    "var": lambda x: x.var((0, 5)),
    "std": lambda x: x.std(-3),
    "logsumexp": lambda x: torch.logsumexp(x, 2),
}


@pytest.mark.parametrize("name", list(MISSING_DIM))
def test_reduction_over_missing_dim_raises_clearly(target, name):
    fn = MISSING_DIM[name]
    backend, device = target
    x = _randn((4, 7), device)
    with pytest.raises(IndexError, match="Dimension out of range"):
        fn(x)
    with pytest.raises(fusec.UnsupportedError) as info:
        fusec.compile(fn, backend=backend)(x)
    message = str(info.value)
    assert message.startswith("fusec:"), message
    # torch's own words (its fake-tensor kernels say "out of bounds" in some versions), at the
    # user's line
    assert "Dimension out of range" in message or "out of bounds" in message, message
    assert "test_reductions.py" in message, message


@pytest.mark.parametrize("fn", [lambda x: x.var((1, -1)), lambda x: x.mean((0, 0)),
                                lambda x: x.sum((1, 1))], ids=["var", "mean", "sum"])
def test_reduction_over_repeated_dim_raises(target, fn):
    backend, device = target
    x = _randn((4, 7), device)
    with pytest.raises(RuntimeError, match="multiple times"):
        fn(x)
    with pytest.raises(fusec.UnsupportedError, match="duplicate|multiple times"):
        fusec.compile(fn, backend=backend)(x)


def test_few_long_rows_stay_torch_reductions_on_a_gpu(target, monkeypatch):
    """On a GPU a reduction of a few very long rows (one number per image of a batch) stays
    torch's kernel, which splits a row across blocks: fusec's one program per row would leave
    most SMs idle. The rule is for GPUs; here it is switched on for the CPU device too, so every
    backend runs the extern path and explain's reason."""
    import importlib
    fuse_reductions = importlib.import_module("fusec.passes.fuse_reductions")  # the module
    backend, device = target
    monkeypatch.setattr(fuse_reductions, "FEW_ROWS_DEVICES", ("cpu", "cuda"))
    # (on a GPU split_reductions would split these rows first: this is the rule for what it
    # cannot split, so it is switched off)
    monkeypatch.setattr(importlib.import_module("fusec.passes.split_reductions"), "SPLIT_DEVICES", ())
    x = torch.randn(3, 4, 128, 130, device=device)  # 3 rows of 66560 elements
    x[1, 2, 3, 4] = float("nan")

    def f(x):
        return torch.sigmoid(x).sum(dim=(1, 2, 3)), (x * 2).amax(dim=1)  # amax: 3 * 128 * 130 rows

    cf = assert_matches(f, x, backend=backend)
    assert [k.name for k in cf.kernels] == ["fused_sigmoid_0", "fused_mul_amax_1"]
    d = fusec.explain(f, x, backend=backend).to_dict()
    assert d["externs"] == ["aten.sum.dim_IntList"]
    (refusal,) = [r for r in d["refusals"] if r["consumer"] == "sum_1"]
    assert refusal["reason"].startswith("few long rows: 3 row(s) of 66560 elements")
    monkeypatch.setattr(fuse_reductions, "FEW_ROWS_DEVICES", ("cuda",))
    if device == "cpu":  # the rule is off for CPU devices: one kernel does the sum again
        assert "aten.sum.dim_IntList" not in fusec.explain(f, x, backend=backend).to_dict()["externs"]


def test_a_global_pool_over_channels_last_is_a_column_reduction_of_few_programs(monkeypatch):
    """A channels-last (N, C, H, W) averaged over H, W: N * C rows, but a Triton column
    reduction takes 64 adjacent channels per program, so 2 * 64 rows are 2 programs."""
    import importlib
    fuse_reductions = importlib.import_module("fusec.passes.fuse_reductions")
    monkeypatch.setattr(fuse_reductions, "FEW_ROWS_DEVICES", ("cpu",))
    x = torch.randn(2, 64, 64, 32).contiguous(memory_format=torch.channels_last)

    def f(x):
        return torch.nn.functional.gelu(x).mean(dim=(2, 3))

    cf = assert_matches(f, x, backend="cpp")
    d = fusec.explain(f, x, backend="cpp").to_dict()
    reasons = [r["reason"] for r in d["refusals"] if "few long rows" in r["reason"]]
    assert reasons and "128 rows of 2048 elements, 64 adjacent rows per program" in reasons[0]
    # gelu before torch's sum, and mean's division by H * W after it (decomposed: sum, then div)
    assert [k.name for k in cf.kernels] == ["fused_gelu_0", "fused_truediv_1"]
    # the same tensor in NCHW: 128 programs of 2048 contiguous elements each, short: one kernel
    y = x.contiguous()
    assert not any("few long rows" in r["reason"]
                   for r in fusec.explain(f, y, backend="cpp").to_dict()["refusals"])


def test_rows_are_walked_in_the_memory_order_of_the_reduced_tensor(target):
    # min over the depth of a channels-last (N, C, D, H, W) tensor: rows (N, C, H, W), and C is
    # the dim whose neighbours are neighbours in memory, so the row walk puts it innermost
    backend, device = target
    x = _randn((2, 8, 5, 6, 7), device).to(memory_format=torch.channels_last_3d)
    x[1, 3, 2, 4, 5] = float("nan")
    for fn in (lambda x: torch.amin(x, dim=2), lambda x: torch.softmax(x.sum(2), 1)):
        cf = assert_matches(fn, x, backend=backend)
        (load,) = [l for l in cf.kernels[0].ir.loads if l.param == "x"]
        n_rows = len(cf.kernels[0].ir.row_shape)
        assert load.index.strides[n_rows - 1] == 1, load.index.strides
    y = _randn((4, 6, 10), device)  # contiguous: the graph's order, unchanged
    cf = assert_matches(lambda y: y.sum(1), y, backend=backend)
    assert [l.index.strides for l in cf.kernels[0].ir.loads] == [(60, 1, 10)]


# ---- constants stored next to a reduction (found by benchmarks/opinfo_sweep.py --grad) ------------

STORED_CONSTANTS = {
    # the backward of div(a, b, rounding_mode="trunc"): zeros for a, a sum for b
    "zeros_and_their_sum": lambda x: (torch.zeros_like(x), torch.zeros_like(x).sum()),
    "full_times_x_summed": lambda x: (torch.full_like(x, 2.0), (torch.full_like(x, 2.0) * x).sum()),
    "per_row": lambda x: (torch.full_like(x, 3.0), x.sum(-1),
                          torch.ones_like(x) * x.amax(-1, keepdim=True)),
}


@pytest.mark.parametrize("case,shape", [(c, s) for c in STORED_CONSTANTS
                                        for s in [(5,), (3, 7), (2, 3000)]
                                        if c != "per_row" or len(s) > 1])
def test_a_constant_stored_in_a_reduction_kernel_fills_every_element(target, case, shape):
    """A value that varies along no reduced dim but is stored at every element (a `zeros_like`
    in the same kernel as a sum) was computed once per row and stored once: the C++ kernel did
    not compile, the LLVM one left the rest of the tensor uninitialized."""
    backend, device = target
    # positive values: the sums stay far from 0, so their rounding is judged against their size
    # (a sum of 3000 standard normals can cancel to near 0, where the C++ kernel's blocked sum,
    # 1.6e-5 off at the median against eager's cascade's 6.9e-6, fails a relative tolerance on
    # about one random row in twenty: a question of the sum's accuracy, not of this test's)
    x = torch.rand(*shape, generator=torch.Generator().manual_seed(0)).to(device) + 0.5
    assert_matches(STORED_CONSTANTS[case], x, backend=backend)

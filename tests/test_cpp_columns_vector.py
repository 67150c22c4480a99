"""Reductions over a dim that is not the innermost, on the C++ backend: eager's answers, and loops
that gcc vectorizes on every x86-64 level.

A softmax over the channels of an NCHW tensor, a sum over dim 1 of (B, K, N), a var over dim 0:
the reduced values of a row lie far apart and neighbouring rows lie side by side, so the kernel
is turned inside out (codegen/cpp/columns.py): the k loop outside, a block of COLUMNS rows inside,
one row per SIMD lane, each row's accumulators in small arrays. Two things can go wrong:

* answers: odd sizes (a row count side by side of 1, 3, 17 or 100, a reduced dim of 1, 5 or 64, a
  ragged last block), NaN and infinities (a max with a NaN is NaN, an argmax points at the first
  NaN), float32, float64, float16 and bfloat16, non-contiguous inputs: all must equal eager's.
* speed: one lane loop that gcc leaves scalar makes the whole kernel several times slower than
  eager (softmax over 16 channels ran at 0.4x eager on AVX-512 when its rows ran in 16 lanes
  with the k loops inside each). So each kernel is compiled to assembly for baseline x86-64
  (SSE2), x86-64-v3 (AVX2) and x86-64-v4 (AVX-512), and gcc's own report (read by
  tests/gcc_vector_report.py) must say that every lane loop inside a k loop is vectorized with
  the target's widest vectors, and that every other lane loop (accumulators set, results kept,
  outputs stored) is vectorized too or became a memset or memcpy. Compiling for a CPU this
  machine lacks is fine: nothing compiled that way runs.

Two float64 kernels are known to keep one loop scalar on baseline x86-64 only (SSE2 has no
64-bit integer compare or select): an argmax's k loop (its int64 position) and logsumexp's row
guard (the op table's where, a 64-bit bit-mask select); they are marked xfail there.
"""
import pytest
import torch

from conftest import assert_matches
from fusec.codegen import cpp
from gcc_vector_report import LEVELS, NEEDS_CPP, X86, compile_report, simd_loops

REDUCTIONS = {
    "softmax": lambda x: torch.softmax(x, 1),
    "log_softmax": lambda x: torch.log_softmax(x, 1),
    "sum": lambda x: x.sum(1),
    "mean": lambda x: x.mean(1, keepdim=True),
    "amax": lambda x: torch.amax(x, 1),
    "amin": lambda x: torch.amin(x * 2, 1),
    "max": lambda x: torch.max(x, 1).values,
    "logsumexp": lambda x: torch.logsumexp(x, 1),
    "var": lambda x: torch.var(x, 1),
    "argmax": lambda x: torch.argmax(x, 1),
    "softmax_sigmoid": lambda x: torch.sigmoid(torch.softmax(x, 1)),
}
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _values(*shape, dtype=torch.float32, special=False):
    torch.manual_seed(0)
    x = torch.randn(*shape) * 3
    if special:  # NaN, infinities and a large value at scattered places
        flat = x.view(-1)
        for i, v in enumerate([float("nan"), float("inf"), -float("inf"), 80.0, float("nan")]):
            flat[(i * 37 + 3) % flat.numel()] = v
    return x.to(dtype)


def _source(cf) -> str:
    return "\n".join(k.source for k in cf.kernels)


# ---- answers -------------------------------------------------------------------------------------

# (batch, reduced, side by side): every row count side by side with every reduced length
SHAPES = [(2, k, n) for n in (1, 3, 17, 100) for k in (1, 5, 64)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", ["softmax", "sum", "amax", "var", "argmax"])
def test_float32_matches_eager(name, shape):
    cf = assert_matches(REDUCTIONS[name], _values(*shape), backend="cpp")
    if shape[2] >= 17 and shape[1] > 1:  # rows side by side: the loops are turned inside out
        assert "COLUMNS" in _source(cf), _source(cf)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_every_reduction_and_dtype_matches_eager(name, dtype):
    cf = assert_matches(REDUCTIONS[name], _values(3, 5, 100, dtype=dtype), backend="cpp")
    assert "COLUMNS" in _source(cf), _source(cf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_nan_and_infinities_as_eager(name, dtype):
    """A NaN anywhere in a row makes its max, softmax and sum NaN, and its argmax points at the
    first NaN; an infinite max is handled as eager handles it (logsumexp's guard)."""
    x = _values(2, 64, 17, dtype=dtype, special=True)
    x[1, :, 5] = float("-inf")  # a whole row of -inf
    x[1, 3, 6] = float("inf")
    cf = assert_matches(REDUCTIONS[name], x, backend="cpp")
    assert "COLUMNS" in _source(cf), _source(cf)


@pytest.mark.parametrize("name", ["softmax", "amax", "argmax", "var"])
def test_ties_and_a_row_of_one_value(name):
    x = torch.zeros(2, 5, 40)
    x[:, 2, ::3] = 1.0  # ties between positions 2 and later equal values
    x[:, 4, ::3] = 1.0
    x[:, :, 1] = -0.0
    assert_matches(REDUCTIONS[name], x, backend="cpp")


@pytest.mark.parametrize("name", ["softmax", "sum", "amax", "logsumexp", "argmax"])
def test_non_contiguous_inputs(name):
    """A channels-last tensor viewed as NCHW (the reduced dim is the innermost in memory), a
    sliced one (offsets, a ragged row), and a transposed one."""
    fn = REDUCTIONS[name]
    nhwc = _values(2, 9, 11, 16, special=True).permute(0, 3, 1, 2)  # (2, 16, 9, 11)
    assert_matches(fn, nhwc, backend="cpp")
    sliced = _values(3, 70, 40, special=True)[1:, 3:67, 2:39]
    cf = assert_matches(fn, sliced, backend="cpp")
    assert "COLUMNS" in _source(cf), _source(cf)
    assert_matches(fn, _values(50, 2, 64).transpose(0, 1).transpose(1, 2), backend="cpp")


# ---- loops gcc vectorizes ------------------------------------------------------------------------

# (reduction, dtype, shape): the KernelBench-style rows (softmax over 16 and 8 channels, a ragged
# block), long blocked float sums, every kind of phase; each compiled for every target
KERNELS = [
    ("softmax", torch.float32, (2, 16, 1024)),
    ("softmax_sigmoid", torch.float32, (2, 8, 2048)),
    ("softmax", torch.float32, (2, 64, 100)),
    ("log_softmax", torch.float32, (2, 5, 100)),
    ("sum", torch.float32, (2, 300, 100)),
    ("mean", torch.float32, (2, 40, 64)),
    ("amax", torch.float32, (2, 40, 100)),
    ("amin", torch.float32, (2, 5, 64)),
    ("logsumexp", torch.float32, (2, 16, 100)),
    ("var", torch.float32, (2, 100, 64)),
    ("argmax", torch.float32, (2, 40, 100)),
    ("softmax", torch.float64, (2, 100, 40)),
    ("amax", torch.float64, (2, 5, 64)),
    ("var", torch.float64, (2, 100, 64)),
    ("softmax", torch.float16, (2, 16, 100)),
    ("softmax", torch.bfloat16, (2, 100, 64)),
    ("sum", torch.bfloat16, (2, 100, 64)),
    ("argmax", torch.float64, (2, 40, 100)),
    ("logsumexp", torch.float64, (2, 16, 100)),
]
SSE2_SCALAR = {("argmax", torch.float64), ("logsumexp", torch.float64)}  # see the module's docstring


def _kernel_source(name, dtype, shape) -> str:
    import fusec
    kernels = fusec.explain(REDUCTIONS[name], _values(*shape, dtype=dtype), backend="cpp") \
        .compiled.kernels
    assert len(kernels) == 1, [k.name for k in kernels]
    source = cpp.render(kernels[0].ir)
    assert "COLUMNS" in source, source
    return source


@X86
@NEEDS_CPP
@pytest.mark.parametrize("target", LEVELS)
@pytest.mark.parametrize("case", KERNELS, ids=lambda c: f"{c[0]}-{str(c[1])[6:]}-{'x'.join(map(str, c[2]))}")
def test_every_lane_loop_is_vectorized_for(case, target, tmp_path, request):
    name, dtype, shape = case
    if target == "x86-64" and (name, dtype) in SSE2_SCALAR:
        request.applymarker(pytest.mark.xfail(strict=True, reason="SSE2: 64-bit select"))
    report = compile_report(_kernel_source(name, dtype, shape), target, tmp_path)
    width = report.target.width
    loops = simd_loops(report.lines)
    in_k = {loop: "each k step" in loop.above for loop in loops}  # (the template's comment)
    assert any(in_k.values()), report.source
    scalar = []
    for loop in loops:
        said = report.said(loop)
        if report.vectorized(loop):
            continue
        if not in_k[loop] and any("split to 0 loops and" in line for line in said):
            continue  # a fill or a copy, now a memset or memcpy
        scalar.append(f"lines {loop.first + 1}-{loop.last + 1}"
                      + (" (inside the k loop)" if in_k[loop] else "")
                      + ":\n    " + "\n    ".join(said))
    assert not scalar, f"not vectorized with {width}-byte vectors for {target}:\n" + \
        "\n".join(scalar) + "\n" + report.source
    # and the assembly computes on the target's registers
    assert report.packed(r"(?:max|min|add|sub|mul|div|cmp\w*)p[sd]"), \
        f"no packed float arithmetic on {report.target.reg} registers"

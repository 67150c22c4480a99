"""The op table (fusec/ops.py), row by row, on both backends, against eager PyTorch.

Every test compiles a function with fusec, runs it, and compares each output with eager (floats
against a float64 reference, integers and booleans exactly; see the root conftest.py), and checks
that the ops it is about really ran through the table (a row that silently became an eager extern
would pass any comparison without testing anything).

Compiling is the slow part (each new input signature builds a new C++ kernel with gcc), so most
tests put many ops into one function that returns a tuple: one kernel, many stores, each op still
checked on its own output. fusec fuses producer -> consumer chains, not siblings, so such a
function first clones its inputs (`x = x.clone()`, the table's exact `copy` row): every op then
consumes the clone and joins its kernel.

Not tested on purpose:
* integer division by zero: eager raises on CPU (ZeroDivisionError) and a kernel cannot raise,
  and INT32_MIN // -1 and INT64_MIN // -1 trap inside eager itself (SIGFPE), so divisors are
  non-zero and numerators of the 32/64-bit tests are above the minimum;
* float -> integer casts of values outside the target's range (NaN, inf, -3.5 -> uint8): C++ and
  CUDA leave them undefined, and eager differs between devices;
* gelu of +-inf: eager's CPU kernel gives NaN, CUDA gives the limit.
"""
import math
import re

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_matches
from fusec import ops
from fusec.codegen.triton import helpers as triton_helpers

# Triton's interpreter computes with numpy, which warns about every overflow and NaN it meets
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
I8, U8, I16, I32, I64 = torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64
BOOL = torch.bool
FLOATS = [F32, F16, BF16, F64]
INTS = [I8, U8, I16, I32, I64]
ALL = [*FLOATS, *INTS, BOOL]
NAN, INF = float("nan"), float("inf")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def run(target, fn, *inputs, rows=(), kernels=None):
    """assert_matches on `target`, plus: every row in `rows` became a statement of some kernel."""
    backend, _ = target
    cf = assert_matches(fn, *inputs, backend=backend, kernels=kernels)
    # (a reduction's statements are in its body, with its Reduces: an integer division's check
    # that no divisor is 0, passes/check_divisors.py, joins the divisions' kernel)
    seen = {s.op for k in cf.kernels
            for s in getattr(k.ir, "stmts", None) or getattr(k.ir, "body", ()) if hasattr(s, "op")}
    missing = set(rows) - seen
    assert not missing, f"rows {sorted(missing)} did not reach a kernel (ran as externs?); " \
                        f"kernels computed {sorted(seen)}"
    return cf


def randf(shape, dtype, device, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)


def randi(shape, dtype, device, low=None, high=None, seed=0):
    info = torch.iinfo(dtype)
    low = info.min if low is None else low
    high = info.max + 1 if high is None else high
    high = min(high, 2 ** 63 - 1)  # randint's exclusive bound is an int64 too
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=g, dtype=torch.int64).to(dtype).to(device)


# ---- the table itself ---------------------------------------------------------------------------

def test_every_row_has_every_backend():
    for name, row in ops.OPS.items():
        assert name == row.name
        for backend in ops.BACKENDS:
            spelling = row.spelling(backend)
            assert isinstance(spelling, str) and spelling.strip(), \
                f"op {name!r} has no {backend} spelling"
            # every operand the row takes is used by every backend
            used = set(re.findall(r"\{(\d+)\}", spelling))
            others = [set(re.findall(r"\{(\d+)\}", row.spelling(b))) for b in ops.BACKENDS]
            assert all(used == o for o in others), f"op {name!r}: backends use different operands"


def test_every_helper_exists():
    from fusec.codegen import cpp
    prelude = cpp.prelude()
    for name, row in ops.OPS.items():
        for helper in re.findall(r"\bfusec_\w+", row.triton):
            assert callable(getattr(triton_helpers, helper, None)), \
                f"op {name!r}: {helper} is missing from codegen/triton/helpers.py"
        for helper in re.findall(r"\bfusec_\w+", row.cpp):
            assert re.search(rf"static inline [\w:<>]+ {helper}\s*\(", prelude), \
                f"op {name!r}: {helper} is missing from codegen/cpp/templates/cpp_prelude.h"


def test_every_aten_entry_names_a_row():
    # Normalizers are called with their op's arguments; calling them with fake ones is enough to
    # see the row names they produce for the common shapes of arguments.
    x, y = object(), object()
    for target, norm in ops.ATEN.items():
        for args, kwargs in (((x, y), {}), ((x, y, 1), {}), ((x,), {}), ((x, y, y), {})):
            try:
                result = norm(args, kwargs)
            except (IndexError, KeyError, TypeError, ValueError):
                continue
            if result is not None:
                assert result[0] in ops.OPS, f"{target} maps onto unknown row {result[0]!r}"


def test_every_row_is_tested_here():
    # Every row of the table appears in some `rows=` list of this file, so it is checked to reach a
    # kernel and to match eager (adding an op means adding it to a test here).
    import ast
    tree = ast.parse(open(__file__).read())
    constants = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                 for t in node.targets if isinstance(t, ast.Name)}
    tested = set()
    for node in ast.walk(tree):
        for kw in getattr(node, "keywords", []) if isinstance(node, ast.Call) else []:
            if kw.arg == "rows":
                value = constants.get(kw.value.id) if isinstance(kw.value, ast.Name) else kw.value
                tested |= set(ast.literal_eval(value))
    assert set(ops.OPS) - tested == set(), "rows without a test in tests/test_ops.py"
    assert tested - set(ops.OPS) == set(), "tests name rows the table does not have"


# ---- floating point ------------------------------------------------------------------------------

def _float_unary(x):
    x = x.clone()  # one shared producer: every op below joins its kernel
    return (
        -x, x.abs(), torch.reciprocal(x),
        torch.exp(x), torch.exp2(x), torch.expm1(x),
        torch.log(x), torch.log2(x), torch.log1p(x), torch.sqrt(x), torch.rsqrt(x),
        torch.sin(x), torch.cos(x), torch.tan(x), torch.tanh(x), torch.erf(x),
        torch.sigmoid(x), torch.nn.functional.silu(x), torch.relu(x),
        torch.nn.functional.gelu(x), torch.nn.functional.gelu(x, approximate="tanh"),
        torch.floor(x), torch.ceil(x), torch.trunc(x),
        x ** 2, x ** 3, x ** 3.5, x ** 0.5, x ** -1.5, 2 ** x, 0.5 ** x,
        torch.isnan(x), torch.logical_not(x),
        x.clamp(-1.0, 1.5), x.clamp(min=0.25), x.clamp(max=-0.5), x.clamp(1.0, -1.0),
        x == 0.5, x != 1.0, x < 0.25, x <= -1, x > 2, x >= 0,
        x + 1, x - 2.5, 1 - x, x * 3, x / 3, 2.0 / x, x // 0.75, x // -2.0,
        torch.div(x, 1.5, rounding_mode="trunc"), torch.add(x, 2, alpha=0.5),
        x.clone(), torch.where(x > 0, x, 0.25), torch.where(x > 0, -1.0, x),
    )


UNARY_ROWS = ["neg", "abs", "reciprocal", "exp", "exp2", "expm1", "log", "log2", "log1p",
              "sqrt", "rsqrt", "sin", "cos", "tan", "tanh", "erf", "sigmoid", "relu", "gelu",
              "gelu_tanh", "floor", "ceil", "trunc", "pow", "isnan", "logical_not", "clamp",
              "clamp_min", "clamp_max", "eq", "ne", "lt", "le", "gt", "ge", "add", "sub", "mul",
              "truediv", "floordiv", "truncdiv", "add_alpha", "copy", "where"]


@pytest.mark.parametrize("dtype", FLOATS, ids=_name)
def test_float_unary(target, dtype):
    x = randf((6, 8), dtype, target[1])
    run(target, _float_unary, x, rows=UNARY_ROWS, kernels=1)


@pytest.mark.parametrize("dtype", FLOATS, ids=_name)
def test_square_and_cube(target, dtype):
    # x ** 2 and x ** 3 are products, as in eager's PowKernel, except on the CPU in float16,
    # whose eager kernel calls pow
    x = randf((6, 8), dtype, target[1])
    x[0, 0], x[0, 1], x[0, 2] = float("nan"), float("inf"), -float("inf")
    def fn(x):
        x = x.clone()  # one shared producer: the ops below join its kernel
        return x ** 2, x ** 3, torch.pow(x, 3.0) + 1
    if dtype == F16 and target[1] == "cpu":
        run(target, fn, x, rows=["pow"], kernels=1)
    else:
        run(target, fn, x, rows=["square", "cube"], kernels=1)


def _float_binary(x, y):
    x, y = x.clone(), y.clone()
    return (
        x + y, x - y, torch.sub(x, y, alpha=2), torch.add(x, y, alpha=-0.5), torch.rsub(x, y),
        torch.rsub(x, y, alpha=3), x * y, x / y, torch.true_divide(x, y),
        torch.div(x, y, rounding_mode="floor"), torch.div(x, y, rounding_mode="trunc"),
        torch.floor_divide(x, y), x ** y, torch.maximum(x, y), torch.minimum(x, y),
        torch.clamp(x, y, y + 1), torch.clamp(x, min=y), torch.clamp(x, max=y),
        torch.where(x > y, x, y), x == y, x != y, x < y, x <= y, x > y, x >= y,
        torch.logical_and(x, y), torch.logical_or(x, y), torch.logical_xor(x, y),
    )


BINARY_ROWS = ["add", "sub", "sub_alpha", "add_alpha", "mul", "truediv", "floordiv", "truncdiv",
               "pow", "maximum", "minimum", "clamp", "clamp_min", "clamp_max", "where", "eq",
               "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor"]


@pytest.mark.parametrize("dtype", FLOATS, ids=_name)
def test_float_binary(target, dtype):
    x = randf((6, 8), dtype, target[1], seed=1)
    y = randf((6, 8), dtype, target[1], seed=2)
    # make some elements equal so == / <= / >= see ties, and some zeros for the logical ops
    x[0] = y[0]
    x[1, :4] = 0
    y[2, :4] = 0
    run(target, _float_binary, x, y, rows=BINARY_ROWS, kernels=1)


def test_silu_row(target, monkeypatch):
    # torch's core decompositions turn silu into sigmoid * mul before fusec sees it; keep it whole
    # to test the table's own silu row.
    from fusec import frontend
    table = frontend.decompositions()
    monkeypatch.setattr(frontend, "decompositions", lambda: {
        k: v for k, v in table.items() if k is not torch.ops.aten.silu.default})
    for dtype in (F32, F16):
        x = randf((40,), dtype, target[1])
        run(target, lambda x: torch.nn.functional.silu(x) + 1, x, rows=["silu"])


@pytest.mark.parametrize("dtype", [F32, BF16, F16, F64], ids=_name)
def test_leaky_relu_and_hardtanh_fuse(target, dtype):
    # the core opset keeps both whole; decomposed (fusec/decompositions.py) they join the kernel
    x = randf((4, 37), dtype, target[1], scale=5.0)
    x[0, 0], x[1, 1], x[1, 2], x[2, 3] = float("nan"), float("inf"), -float("inf"), -0.0
    fn = lambda x: (F.leaky_relu(x, 0.01), F.leaky_relu(x, 0.2) * 2, F.hardtanh(x),  # noqa: E731
                    F.relu6(x), F.hardtanh(x * 2, -2.5, 0.5) + 1)
    cf = run(target, fn, x, rows=["where", "clamp"])
    assert not [s for s in cf.last.program.steps if type(s).__name__ == "ExternStep"]


# ---- integers and booleans -----------------------------------------------------------------------

def _int_ops(a, b, n, d, e):
    """a, b: any values; n / d: numerator / non-zero divisor; e: small exponents (>= 0)."""
    a, b, n, d, e = (t.clone() for t in (a, b, n, d, e))
    return (
        a + b, a - b, a * b, torch.add(a, b, alpha=3), torch.sub(a, b, alpha=2), torch.rsub(a, b),
        a + 7, a - 3, 5 - a, a * 3, -a, a.abs(), torch.relu(a),
        torch.div(n, d, rounding_mode="floor"), torch.div(n, d, rounding_mode="trunc"),
        torch.floor_divide(n, d), n // 3, n / d, a / 4, torch.reciprocal(d),
        a ** 2, a ** 3, e ** e, a ** e, 2 ** e, a ** 0.5,
        torch.maximum(a, b), torch.minimum(a, b), a.clamp(1, 100), a.clamp(min=10),
        a.clamp(max=20), torch.clamp(a, torch.minimum(b, e), torch.maximum(b, e)),
        torch.where(a > b, a, b), torch.where(a > 0, a, 3), torch.where(a > 0, 2, b),
        a == b, a != b, a < b, a <= b, a > b, a >= b, a == 3, a < 2.5, a >= 0,
        a & b, a | b, a ^ b, ~a, a & 0x0F, a | 1, a ^ -1,
        torch.logical_and(a, b), torch.logical_or(a, b), torch.logical_xor(a, b),
        torch.logical_not(a), torch.isnan(a),
        torch.floor(a), torch.ceil(a), torch.trunc(a),
        torch.sin(a), torch.exp(e), torch.sqrt(e), torch.sigmoid(a), torch.log1p(e),
        a.clone(),
    )


INT_ROWS = ["add", "sub", "mul", "add_alpha", "sub_alpha", "neg", "abs", "relu", "floordiv",
            "truncdiv", "truediv", "reciprocal", "pow", "maximum", "minimum", "clamp",
            "clamp_min", "clamp_max", "where", "eq", "ne", "lt", "le", "gt", "ge", "bitwise_and",
            "bitwise_or", "bitwise_xor", "bitwise_not", "logical_and", "logical_or",
            "logical_xor", "logical_not", "isnan", "sin", "exp", "sqrt", "sigmoid", "log1p"]


@pytest.mark.parametrize("dtype", INTS, ids=_name)
def test_int_ops(target, dtype):
    device = target[1]
    info = torch.iinfo(dtype)
    a = randi((6, 8), dtype, device, seed=1)
    b = randi((6, 8), dtype, device, seed=2)
    a[0, :3] = torch.tensor([info.min, info.max, 0], dtype=dtype)
    b[0, 3:6] = a[0, 3:6]  # ties for the comparisons
    b[1, :3] = 0  # zeros for the logical ops
    # numerators above the minimum (INT_MIN // -1 traps in eager), divisors of both signs, never 0
    n = randi((6, 8), dtype, device, low=info.min + 1, seed=3)
    d = randi((6, 8), dtype, device, low=max(info.min, -9), high=10, seed=4)
    d[d == 0] = 1
    if dtype == I8:
        n[0, 0], d[0, 0] = info.min, -1  # -128 // -1 wraps to -128 in eager too
    e = randi((6, 8), dtype, device, low=0, high=6, seed=5)
    run(target, _int_ops, a, b, n, d, e, rows=INT_ROWS)


def test_int_negative_exponents(target):
    # Tensor-Tensor pow of signed integers allows negative exponents: 1 for base 1, +-1 for base
    # -1 and 0 for every other base (a scalar negative exponent raises in eager).
    base = torch.tensor([1, -1, -1, 2, -3, 0, 5, 1, -1], dtype=I32, device=target[1])
    exp = torch.tensor([-1, -1, -2, -1, -3, 2, 0, -7, -8], dtype=I32, device=target[1])
    run(target, lambda b, e: (b ** e, 2 ** e.abs(), b.to(I64) ** e.to(I64)), base, exp,
        rows=["pow"])


def _bool_ops(p, q):
    p, q = p.clone(), q.clone()
    return (
        p + q, p * q, torch.add(p, q, alpha=1), p & q, p | q, p ^ q, ~p, torch.bitwise_not(q),
        torch.logical_and(p, q), torch.logical_or(p, q), torch.logical_xor(p, q),
        torch.logical_not(p), torch.maximum(p, q), torch.minimum(p, q),
        p == q, p != q, p < q, p <= q, p > q, p >= q, p == 1, p != False,  # noqa: E712
        torch.where(p, q, False), torch.where(p, p, q), p.clone(), torch.isnan(p),
        p + 1, p * 2.5, p / q.to(F32), -(p.to(I8)), p.to(I32) - q.to(I32),
        torch.sin(p), p & True, p | False, p ^ True,
    )


def test_bool_ops(target):
    g = torch.Generator().manual_seed(0)
    p = (torch.rand(64, generator=g) > 0.5).to(target[1])
    q = (torch.rand(64, generator=g) > 0.5).to(target[1])
    run(target, _bool_ops, p, q, rows=["add", "mul", "bitwise_and", "bitwise_or", "bitwise_xor",
                                       "bitwise_not", "logical_and", "logical_or", "logical_xor",
                                       "logical_not", "maximum", "minimum", "eq", "ne", "lt",
                                       "le", "gt", "ge", "where", "copy", "isnan", "neg", "sub"],
        kernels=1)


# ---- casts, fills, copies ------------------------------------------------------------------------

def _source_values(src: torch.dtype, device) -> torch.Tensor:
    """Values of `src` that every target dtype can hold after torch's conversion rules (integer
    narrowing wraps; float -> integer only in range; float -> uint8 only non-negative)."""
    if src == BOOL:
        return torch.tensor([True, False, True, True, False, False], device=device)
    if src.is_floating_point:
        values = [0.0, -0.0, 0.5, -0.5, 1.0, -1.0, 1.5, -2.5, 2.5, 3.75, -7.9, 100.25, -127.0,
                  126.99, 1e-3, 2.0 ** -20, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 1 + 2.0 ** -8,
                  # just above a float16 / bfloat16 midpoint, but exactly on it once in float32
                  1 + 2.0 ** -11 + 2.0 ** -40, 1 + 2.0 ** -8 + 2.0 ** -40]
        g = torch.Generator().manual_seed(0)
        noise = (torch.rand(24, generator=g, dtype=F64) - 0.5) * 240  # many mantissa bits
        return torch.cat([torch.tensor(values, dtype=F64), noise]).to(src).to(device)
    info = torch.iinfo(src)
    values = [0, 1, -1, 2, -2, 7, -100, 127, -128, 255, 300, -300, 70000, -70000, 2 ** 31 - 1,
              -(2 ** 31), 2 ** 40 + 3, -(2 ** 53) - 1, info.max, info.min]
    return torch.tensor([v for v in values if info.min <= v <= info.max], dtype=src).to(device)


def _casts(x):
    x = x.clone()
    outs = []
    for dst in ALL:
        if x.is_floating_point() and dst == U8:
            outs.append(x.abs().to(U8))
        else:
            outs.append(x.to(dst))
    return tuple(outs)


@pytest.mark.parametrize("src", ALL, ids=_name)
def test_casts(target, src):
    x = _source_values(src, target[1])
    cf = run(target, _casts, x, rows=["to"])
    # a cast has one right answer: compare bit for bit, not within a tolerance
    for dst, got, want in zip(ALL, cf(x), _casts(x)):
        if dst == BF16 and target == ("triton", "cpu"):
            continue  # BF16_INTERPRETER (tracked by test_cast_rounds[triton-bfloat16])
        assert torch.equal(got, want), f"{src} -> {dst}: {got.tolist()} vs {want.tolist()}"


@pytest.mark.parametrize("src", [I8, U8, I16], ids=_name)
def test_every_small_int_converts_exactly(target, src):
    # Every value of an 8- or 16-bit integer type, as float32 (and bf16 through it): the Triton
    # backend converts these with a bit trick (codegen/triton/helpers.py, fusec_small_int_to_f32)
    # instead of the slow cast instruction, so check the whole range, bit for bit.
    info = torch.iinfo(src)
    x = torch.arange(info.min, info.max + 1, dtype=torch.int64).to(src).to(target[1])
    fn = lambda x: (x.to(F32), x.to(F32) * 0.5 + 1)  # noqa: E731
    cf = run(target, fn, x, rows=["to"])
    for got, want in zip(cf(x), fn(x)):
        assert torch.equal(got, want)


def test_float_specials_cast(target):
    # NaN and inf survive float -> float casts (and narrow to inf), and NaN is True as a bool.
    values = [NAN, INF, -INF, 1e300, -1e300, 7e4, 3.5e38, 1e-8, -0.0, 5e-324]
    x = torch.tensor(values, dtype=F64, device=target[1])
    run(target, lambda x: (x.to(F32), x.to(F16), x.to(BF16), x.to(BOOL),
                           x.to(F32).to(F16), x.to(F32).to(BF16), x.to(F32).to(F64),
                           x.to(BF16).to(F16), x.to(F16).to(BF16), x.to(F16).to(F64)),
        x, rows=["to"])


@pytest.mark.parametrize("half", [F16, BF16], ids=_name)
def test_cast_rounds(target, half, request):
    # A cast to half precision inside a kernel rounds the value (values live in float32 between
    # ops, so without the rounding step x.to(f16).to(f32) would be the identity), exactly: the
    # float64 reference's tolerance would let a rounding off by one unit pass.
    x = randf((64,), F32, target[1], scale=10.0)
    cf = run(target, lambda x: (x.to(half).to(F32), x.to(half) * 3, (x * 3).to(half).to(F64),
                                x.to(half)), x, rows=["to"])
    got = cf(x)
    assert torch.equal(got[0], x.to(half).to(F32))
    assert torch.equal(got[2], (x * 3).to(half).to(F64))
    assert torch.equal(got[3], x.to(half))


@pytest.mark.parametrize("half", [F16, BF16], ids=_name)
def test_a_copy_of_a_half_value_is_not_rounded_again(target, half):
    """A copy (clone, a cast to its own dtype) of a half-precision value keeps it as it is: the
    value was rounded where it was loaded or made (codegen/lower.py, needs_rounding)."""
    x = randf((2, 33), F32, target[1], scale=10.0).to(half)
    cf = run(target, lambda x: (x * 3).clone() + x.clone(), x, rows=["copy"], kernels=1)
    copies = [s for s in cf.kernels[0].ir.stmts if s.op == "copy"]
    assert copies and all(s.round_to is None for s in copies)
    assert all(s.round_to == half for s in cf.kernels[0].ir.stmts if s.op in ("mul", "add"))


def test_half_intermediates_are_rounded(target, request):
    # eager stores x16 * 2 as float16, so 65504 * 2 is inf before it is widened again
    x = torch.tensor([65504.0, 60000.0, 1.0, 1e-7], device=target[1])
    run(target, lambda x: (x.to(F16) * 2).to(F32), x, rows=["to", "mul"])


@pytest.mark.parametrize("dtype", [F32, F16, BF16, I8, U8, I64, BOOL], ids=_name)
def test_fills(target, dtype):
    x = (randf((5, 7), F32, target[1]) * 10).to(dtype)

    def fn(x):
        x = x.clone()
        return (
            torch.full_like(x, 3), torch.zeros_like(x), torch.ones_like(x),
            torch.full_like(x, 7, dtype=I16), torch.full_like(x, 2.5, dtype=F32),
            torch.full_like(x, -1, dtype=F64), torch.full_like(x, True, dtype=BOOL),
            torch.full_like(x, 0.1, dtype=F16), torch.full_like(x, 0.1, dtype=BF16),
            torch.full_like(x, 200, dtype=U8), torch.full_like(x, -2 ** 40, dtype=I64),
            x + torch.full((5, 7), 2, dtype=dtype, device=x.device),
            x + torch.ones_like(x), x.clone(),
        )
    run(target, fn, x, rows=["full", "copy"])


def test_full_specials(target):
    x = torch.zeros(3, 4, device=target[1])
    run(target, lambda x: (torch.full_like(x, NAN), torch.full_like(x, -INF),
                           torch.full_like(x, INF, dtype=F16), torch.full_like(x, 6e4, dtype=F16),
                           torch.full_like(x, NAN, dtype=BF16), torch.full_like(x, NAN, dtype=F64),
                           torch.full_like(x, -0.0) + x, torch.full_like(x, 1e-45)),
        x, rows=["full"])


# ---- type promotion ------------------------------------------------------------------------------

def test_mixed_dtype_promotion(target):
    device = target[1]
    i32 = randi((4, 8), I32, device, low=-50, high=50, seed=1)
    f32 = randf((4, 8), F32, device, seed=2)
    u8 = randi((4, 8), U8, device, seed=3)
    f16 = randf((4, 8), F16, device, seed=4)
    i8 = randi((4, 8), I8, device, seed=5)
    i16 = randi((4, 8), I16, device, seed=6)
    i64 = randi((4, 8), I64, device, low=-10 ** 6, high=10 ** 6, seed=7)
    b = i8 > 0
    bf16 = randf((4, 8), BF16, device, seed=8)
    f64 = randf((4, 8), F64, device, seed=9)

    def fn(i32, f32, u8, f16, i8, i16, i64, b, bf16, f64):
        return (
            i32 + f32, f32 - i32, i32 * f16, u8 + 1, u8 + 300, u8 * -1, u8 - 3, f16 + f32,
            bf16 * f16, bf16 + f64, i32 + 2.5, i32 * 0.5, i64 / 3, u8 + i8, i8 * i16, i16 - u8,
            b + i8, b * f16, b + 1.5, i64 + f16, i64 * i32, torch.maximum(i32, f16),
            torch.minimum(u8, i8),
            torch.where(b, i8, f32), torch.where(b, u8, 1.5), torch.where(b, i16, -1),
            i32 > f16, u8 < i8, i8 == -1.0, i64 >= 1e5, f16 != bf16, u8 & i8, b | i16,
            i32 // f32, torch.div(i8, f16, rounding_mode="trunc"), i16 ** 2.0, f16 ** i32,
            torch.clamp(u8, i8, i16), torch.clamp(i32, min=0.5),
            i32 + 2 ** 40, u8 + True, u8 * 1.5, f16 + 2 ** 40, bf16 * 1e-3, i8 + 3.0,
        )
    run(target, fn, i32, f32, u8, f16, i8, i16, i64, b, bf16, f64)


def test_python_scalars(target):
    device = target[1]
    x = randf((3, 5), F32, device)
    a = randi((3, 5), I64, device, low=-1000, high=1000)
    a[a == 0] = 1  # `7 // a` below

    def fn(x, a):
        return (
            x + 0.1, x * 1e-30, x - 1e30, x / 7.0, x + True, 3.0 - x,
            a + 2 ** 40, a * -(2 ** 33), a - 2 ** 62, a // 7, a * 1e10, a + 0.1, a == 2 ** 40,
            torch.where(a > 0, 2 ** 40, -(2 ** 40)), torch.where(x > 0, 1e-3, -1e38),
            x.clamp(NAN, 1.0), x.clamp(-INF, INF), x + INF, x * NAN, a.clamp(-(2 ** 50), 2 ** 50),
            # the scalar on the left
            2.0 // x, 7 // a, torch.div(-7, a, rounding_mode="trunc"), 2.5 ** x, 3 ** a.abs(),
            1.5 - x, 2 ** 40 - a, torch.div(2.0, x, rounding_mode="trunc"),
        )
    run(target, fn, x, a, rows=["add", "mul", "sub", "clamp", "where", "floordiv", "truncdiv",
                                "pow", "eq"])


# ---- shapes and layouts --------------------------------------------------------------------------

def test_broadcasting(target):
    device = target[1]
    x = randf((4, 1, 8), F32, device, seed=1)
    y = randf((3, 1), F32, device, seed=2)
    z = randf((8,), F32, device, seed=3)
    i = randi((3, 8), I16, device, low=-5, high=5, seed=4)

    def fn(x, y, z, i):
        return (x + y, x * z - y, torch.maximum(x, z), torch.where(x > y, z, y),
                torch.clamp(x, y, y + 1), x ** y, (x > z) & (i > 0), i * x, i // 2 + z.to(I16))
    run(target, fn, x, y, z, i, rows=["add", "mul", "sub", "maximum", "where", "clamp", "pow",
                                      "bitwise_and", "floordiv"])


def test_noncontiguous_inputs(target):
    device = target[1]
    base = randf((8, 12), F32, device, seed=1)
    other = randf((12, 8), F32, device, seed=2)
    ints = randi((16, 24), I32, device, low=-100, high=100, seed=3)
    t = base.t()  # (12, 8), transposed
    s = other[:, ::2]  # (12, 4), sliced with a step
    w = ints[1::2, ::3].t()  # (8, 8), sliced and transposed

    def fn(t, s, w, base):
        return (t * 2 + 1, torch.sin(t), t[:, ::2] - s, torch.maximum(t[:, 1::2], s),
                w // 3, -w, w.to(F16), torch.where(w > 0, base[:, :8], -base[:, 4:]),
                s.to(BF16), base.t()[::3] + 1)
    run(target, fn, t, s, w, base, rows=["mul", "add", "sin", "sub", "maximum", "floordiv",
                                         "neg", "to", "where"])


def test_expanded_input(target):
    x = randf((1, 6), F32, target[1]).expand(5, 6)
    run(target, lambda x: (x * 2, torch.exp(x)), x, rows=["mul", "exp"])


def test_many_blocks(target):
    # big enough for several Triton blocks and for the C++ kernel's threads and chunks, read
    # through a transpose and a step
    device = target[1]
    x = randf((300, 514), F32, device)[:, ::2]  # (300, 257)
    y = randf((257, 300), F16, device, seed=1).t()

    def fn(x, y):
        x = x.clone()
        return torch.sin(x) * y, torch.maximum(x, y).to(F16), x > y
    run(target, fn, x, y, rows=["sin", "mul", "maximum", "to", "gt"], kernels=1)


@pytest.mark.parametrize("shape", [(0,), (3, 0), (1,), (1, 1, 1), ()], ids=str)
def test_tiny_shapes(target, shape):
    device = target[1]
    x = randf(shape, F32, device, seed=1)
    a = randi(shape, I32, device, low=-9, high=9, seed=2)
    b = randi(shape, U8, device, seed=3)

    def fn(x, a, b):
        return (x + 1, torch.sin(x) * a, -b, a // 2, x > 0, torch.where(x > 0, a, b),
                b.to(F16), torch.full_like(x, 2.0), torch.maximum(x, a))
    cf = run(target, fn, x, a, b)
    if 0 not in shape:
        assert cf.kernels, "the ops should have compiled into a kernel"


def test_zero_dim_with_tensor(target):
    # 0-d tensors broadcast like scalars but take part in type promotion only when their dtype
    # category (bool < int < float) is higher than every dimensioned operand's: u8 + i64(0-d) is
    # u8, i32 + f64(0-d) is f64, f16 * f64(0-d) is f16.
    device = target[1]
    x = randf((4, 6), F32, device)
    u8 = randi((4, 6), U8, device, seed=1)
    i32 = randi((4, 6), I32, device, low=-50, high=50, seed=2)
    f16 = randf((4, 6), F16, device, seed=3)
    s = torch.tensor(1.5, device=device)
    k = torch.tensor(3, dtype=I32, device=device)
    d = torch.tensor(2.5, dtype=F64, device=device)
    m = torch.tensor(-2, dtype=I64, device=device)

    def fn(x, u8, i32, f16, s, k, d, m):
        x = x.clone()
        return (x * s + k, torch.clamp(x, -s, s), torch.where(x > s, k, x), x ** k, k - x,
                torch.maximum(x, s), u8 + m, u8 * m, i32 + d, f16 * d, i32 // m, f16 + k,
                x > d, u8 & m)
    run(target, fn, x, u8, i32, f16, s, k, d, m,
        rows=["mul", "add", "clamp", "where", "pow", "sub", "maximum", "floordiv", "gt",
              "bitwise_and"])


# ---- integer corner cases ------------------------------------------------------------------------

def test_integer_wraparound(target):
    device = target[1]
    u8 = torch.tensor([0, 1, 2, 127, 128, 200, 255], dtype=U8, device=device)
    i8 = torch.tensor([100, 127, -128, -100, 50, 1, -1], dtype=I8, device=device)
    i32 = torch.tensor([2 ** 30, 2 ** 31 - 1, -(2 ** 31), 65536, 46341, -46341, 7], dtype=I32,
                       device=device)
    i64 = torch.tensor([2 ** 62, 2 ** 63 - 1, -(2 ** 63), 2 ** 32, 3037000500, -1, 7], dtype=I64,
                       device=device)

    def fn(u8, i8, i32, i64):
        return (
            -u8, u8 + 100, u8 - 200, u8 * 3, u8 + u8, ~u8, u8 ** 3, u8.abs(),
            i8 + 100, i8 + i8, i8 - 100, i8 * 3, -i8, i8.abs(), i8 * i8,
            i32 * 3, i32 * i32, i32 + 2 ** 31 - 1, -i32, i32.abs(), i32 ** 3,
            i64 * 5, i64 * i64, i64 + (2 ** 63 - 1), -i64, i64.abs(), ~i64,
            torch.add(i8, i8, alpha=3), torch.sub(u8, u8, alpha=5),
        )
    run(target, fn, u8, i8, i32, i64, rows=["neg", "add", "sub", "mul", "bitwise_not", "pow",
                                            "abs", "add_alpha", "sub_alpha"])


@pytest.mark.parametrize("dtype", [I8, I16, I32, I64], ids=_name)
def test_integer_division_of_negatives(target, dtype):
    # floor rounds toward -inf (Python's //), trunc toward zero (C's /); they differ exactly when
    # the signs differ and the division is inexact.
    device = target[1]
    a_vals = list(range(-9, 10))
    b_vals = [-4, -3, -2, -1, 1, 2, 3, 5]
    a = torch.tensor([x for x in a_vals for _ in b_vals], dtype=dtype, device=device)
    b = torch.tensor([y for _ in a_vals for y in b_vals], dtype=dtype, device=device)

    def fn(a, b):
        a, b = a.clone(), b.clone()
        return (torch.div(a, b, rounding_mode="floor"), torch.div(a, b, rounding_mode="trunc"),
                a // b, torch.floor_divide(a, b), a // -3, a // 4,
                torch.div(a, -3, rounding_mode="trunc"), a / b,
                torch.div(a.to(F32), b.to(F32), rounding_mode="floor"),
                torch.div(a.to(F64), b.to(F64), rounding_mode="trunc"))
    # one kernel, the check that no divisor is 0 (passes/check_divisors.py) fused into it
    run(target, fn, a, b, rows=["floordiv", "truncdiv", "truediv"], kernels=1)


@pytest.mark.parametrize("dtype", [I8, U8], ids=_name)
def test_small_int_results_stay_small(target, dtype):
    # a helper's result must keep its operands' dtype: a quotient that silently became int32
    # would not wrap in the ops that follow it inside the kernel
    device = target[1]
    n = randi((64,), dtype, device, low=max(torch.iinfo(dtype).min + 1, -100), seed=1)
    d = randi((64,), dtype, device, low=max(torch.iinfo(dtype).min, -5), high=6, seed=2)
    d[d == 0] = 3
    e = randi((64,), dtype, device, low=0, high=4, seed=3)

    def fn(n, d, e):
        q, t, p = n // d, torch.div(n, d, rounding_mode="trunc"), n ** e
        return (q * 100 > 0, (q * 100) // 7, t * 100 > 0, (t * 100) // 7, p * 50 > 0,
                (p * 50) // 7, n.abs() * 3 > 0, torch.maximum(n, d) * 100 > 0, ~n * 3 > 0)
    run(target, fn, n, d, e, rows=["floordiv", "truncdiv", "pow", "mul", "gt"])


def test_float_floor_division_corners(target):
    # floor division of floats: exact multiples, signs of zero, infinities and NaN
    device = target[1]
    a = torch.tensor([7.0, -7.0, 7.0, -7.0, 6.0, -6.0, 0.0, -0.0, 1.0, -1.0, INF, -INF, NAN, 5.0,
                      0.3, -0.3, 1e30, 2.5, -2.5, 0.0, INF], device=device)
    b = torch.tensor([2.0, 2.0, -2.0, -2.0, 3.0, 3.0, 5.0, 5.0, INF, INF, 2.0, 3.0, 1.0, NAN,
                      0.1, 0.1, 1e-10, 0.0, 0.0, 0.0, -INF], device=device)
    run(target, lambda a, b: (torch.div(a, b, rounding_mode="floor"),
                              torch.div(a, b, rounding_mode="trunc"), a // b,
                              a.to(F16) // b.to(F16), a.double() // b.double()),
        a, b, rows=["floordiv", "truncdiv"])


# ---- NaN and infinities --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, F16, F64], ids=_name)
def test_nan_and_inf(target, dtype):
    device = target[1]
    x = torch.tensor([NAN, 1.0, NAN, -INF, INF, 0.0, -0.0, -1.0, 2.0, -3.0, NAN, 0.5],
                     dtype=dtype, device=device)
    y = torch.tensor([1.0, NAN, NAN, 0.0, 1.0, -0.0, 0.0, INF, -INF, NAN, -1.0, 0.5],
                     dtype=dtype, device=device)

    def fn(x, y):
        x, y = x.clone(), y.clone()
        return (
            torch.maximum(x, y), torch.minimum(x, y), torch.clamp(x, -1.0, 1.0),
            torch.clamp(x, min=0.0), torch.clamp(x, max=0.0), torch.clamp(x, y, y + 1),
            torch.clamp(x, min=y), torch.relu(x), torch.exp(x), torch.exp2(x), torch.expm1(x),
            torch.log(x), torch.log2(x), torch.log1p(x), torch.sqrt(x), torch.rsqrt(x),
            torch.reciprocal(x), 1 / x, x / y, x * y, x + y, x - y, torch.sigmoid(x),
            torch.tanh(x), torch.erf(x), torch.sin(y), torch.floor(x), torch.ceil(x),
            torch.trunc(x), x.abs(), -x, x ** 2, x ** 0.5, x ** -0.5, x ** -1, x ** 3, x ** y,
            torch.isnan(x), x == x, x != y, x < y, x >= y, torch.where(torch.isnan(x), y, x),
            torch.logical_not(x), torch.logical_and(x, y), x.to(BOOL),
        )
    run(target, fn, x, y, rows=["maximum", "minimum", "clamp", "clamp_min", "clamp_max", "relu",
                                "exp", "log", "isnan", "pow", "logical_and"], kernels=1)


def test_large_and_tiny_floats(target):
    # the edges of the float range: overflow to inf, underflow to 0 and subnormals, exp next to
    # its overflow threshold (where a GPU's fast exp is 50x less accurate than eager)
    x = torch.tensor([88.0, 89.0, -104.0, 710.0, 1e-40, 3e38, -3e38, 65504.0, 70000.0, 1e-7],
                     device=target[1])
    run(target, lambda x: (torch.exp(x), torch.expm1(x), torch.sigmoid(-x), x * 10, x.to(F16),
                           x.to(F16) * 2, x.to(BF16) * 2, torch.tanh(x),
                           torch.log(x), torch.rsqrt(x)),
        x, rows=["exp", "mul", "to"])


def _shift_ops(a, s):
    return a >> s, a << s, a >> 3, a << 2, torch.bitwise_right_shift(a, s), \
        torch.bitwise_left_shift(a, 1), (a & 0x0F), (a >> 4) & 0x0F


@pytest.mark.parametrize("dtype", INTS, ids=_name)
def test_shifts_follow_torch_for_every_amount(target, dtype):
    # shift amounts past the bit width (and negative ones) are undefined in C, LLVM and Triton;
    # torch defines them: << gives 0, >> gives the sign (signed) or 0 (unsigned)
    device = target[1]
    info, bits = torch.iinfo(dtype), dtype.itemsize * 8
    a = randi((6, 8), dtype, device, seed=1)
    a[0, :3] = torch.tensor([info.min, info.max, 0], dtype=dtype)
    s = randi((6, 8), dtype, device, low=max(info.min, -3), high=min(info.max, bits + 3) + 1, seed=2)
    s[1, :4] = torch.tensor([0, bits - 1, bits, min(bits + 1, info.max)], dtype=dtype)
    run(target, _shift_ops, a, s, rows=["lshift", "rshift", "bitwise_and"])

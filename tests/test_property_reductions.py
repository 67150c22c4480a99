"""Property-based tests: random programs around one reduction, fused vs eager, on both backends.

hypothesis draws a program over a base shape of rank 1-4 (dims 1-6, all equal one time in three):

    inputs    x of the base shape, laid out contiguous, transposed or sliced with a step;
              sometimes y, which broadcasts to it (leading dims dropped, some dims set to 1)
    prologue  0-3 pointwise ops over x, y and earlier values            -> p
    reduce    sum, amax, amin, mean or var (correction 0 or 1) of p over a random non-empty set
              of dims (every dim: a scalar), keepdim or not             -> r
    epilogue  keepdim: r broadcast back over the reduced rows and combined with p or x
              (p - r, p * r, (p - r) / (|r| + 1)), then maybe a unary op;
              no keepdim: r stays a row tensor: a unary op of it, sometimes first combined
              with z, an input of the rows' shape (some dims 1), or a unary op of z

and returns the epilogue's value, and sometimes r too. The ops are "safe" as in
test_property.py: no exp/log overflow, no division by a value that can be 0. var over rows of
one value with correction 1 is NaN in eager and must be NaN here too.

Every op has a row in the op table, so nothing may run as an extern ATen call.
"""
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import CPU_BACKENDS, TRITON_DEVICE, assert_matches

UNARY = {
    "sin": torch.sin,
    "tanh": torch.tanh,
    "neg": torch.neg,
    "abs": torch.abs,
    "relu": torch.relu,
    "half": lambda a: a * 0.5,
    "plus_one": lambda a: a + 1.0,
    "square": lambda a: a * a,
}
BINARY = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "maximum": torch.maximum,
    "div_safe": lambda a, b: a / (torch.abs(b) + 1),
}
REDUCE = {
    "sum": lambda a, dims, keep: a.sum(dims, keepdim=keep),
    "amax": lambda a, dims, keep: a.amax(dims, keepdim=keep),
    "amin": lambda a, dims, keep: a.amin(dims, keepdim=keep),
    "mean": lambda a, dims, keep: a.mean(dims, keepdim=keep),
    "var0": lambda a, dims, keep: a.var(dims, correction=0, keepdim=keep),
    "var1": lambda a, dims, keep: a.var(dims, correction=1, keepdim=keep),
}
BROADCAST_BACK = {
    "sub": lambda p, r: p - r,
    "mul": lambda p, r: p * r,
    "centered_scaled": lambda p, r: (p - r) / (torch.abs(r) + 1),
}
LAYOUTS = ["contiguous", "transposed", "sliced"]


@st.composite
def programs(draw):
    rank = draw(st.integers(1, 4))
    base = tuple(draw(st.lists(st.integers(1, 6), min_size=rank, max_size=rank)))
    if draw(st.integers(0, 2)) == 0:  # square: a row's shape broadcasts over x's own shape too
        base = (max(base[0], 2),) * rank
    dtype = draw(st.sampled_from([torch.float32] * 4 + [torch.bfloat16]))
    inputs = [(base, draw(st.sampled_from(LAYOUTS)))]
    if draw(st.booleans()):
        drop = draw(st.integers(0, rank - 1))
        shape = tuple(1 if draw(st.integers(0, 3)) == 0 else s for s in base[drop:])
        inputs.append((shape, draw(st.sampled_from(LAYOUTS))))

    prologue = []
    for k in range(draw(st.integers(0, 3))):
        available = len(inputs) + k
        if draw(st.booleans()):
            prologue.append(("unary", draw(st.sampled_from(sorted(UNARY))),
                             (draw(st.integers(0, available - 1)),)))
        else:
            # the first operand is x or a value of x's shape, so p keeps the base shape
            first = draw(st.sampled_from([0] + list(range(len(inputs), available))))
            prologue.append(("binary", draw(st.sampled_from(sorted(BINARY))),
                             (first, draw(st.integers(0, available - 1)))))

    reduce = draw(st.sampled_from(sorted(REDUCE)))
    dims = tuple(sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1, max_size=rank))))
    if draw(st.booleans()):  # negative dims, as users write them
        dims = tuple(d - rank for d in dims)
    keepdim = draw(st.booleans())
    rows_op = None
    if keepdim:
        epilogue = (draw(st.sampled_from(sorted(BROADCAST_BACK))), draw(st.booleans()))
    else:
        epilogue = (None, True)
        if draw(st.booleans()):
            # z: the shape of the rows (x's shape without the reduced dims), some dims 1. With
            # a square x, z also broadcasts over x's own dims: a row value must still be
            # computed per row, not per element.
            kept = [s for d, s in enumerate(base) if d not in {d % rank for d in dims}]
            inputs.append((tuple(1 if draw(st.integers(0, 3)) == 0 else s for s in kept),
                           "contiguous"))
            rows_op = (draw(st.sampled_from(sorted(BINARY))),
                       draw(st.sampled_from(sorted(UNARY) + [None])))
    after = draw(st.sampled_from(sorted(UNARY)))
    return_r = draw(st.booleans())
    return dtype, inputs, prologue, reduce, dims, keepdim, epilogue, rows_op, after, return_r


def _make_input(shape, layout, dtype, gen):
    def fresh(s):
        return torch.randn(s, generator=gen).to(dtype)

    if layout == "transposed" and len(shape) >= 2:
        return fresh((*shape[:-2], shape[-1], shape[-2])).transpose(-1, -2)
    if layout == "sliced" and len(shape) >= 1:
        return fresh((*shape[:-1], 2 * shape[-1] + 1))[..., 1::2]
    return fresh(shape)


def _make_fn(program):
    _, inputs, prologue, reduce, dims, keepdim, (back, use_p), rows_op, after, return_r = program

    def fn(*tensors):
        values = list(tensors[:2] if rows_op is None else tensors[:-1])
        for kind, name, args in prologue:
            if kind == "unary":
                values.append(UNARY[name](values[args[0]]))
            else:
                values.append(BINARY[name](*(values[a] for a in args)))
        # p: the last value of x's shape (x itself when the prologue made none)
        p = next(v for v in reversed(values) if v.shape == tensors[0].shape)
        r = REDUCE[reduce](p, dims, keepdim)
        out = BROADCAST_BACK[back](p if use_p else tensors[0], r) if back else r
        if rows_op is not None:
            z = tensors[-1] if rows_op[1] is None else UNARY[rows_op[1]](tensors[-1])
            out = BINARY[rows_op[0]](out, z)
        out = UNARY[after](out)
        return (out, r) if return_r else out

    return fn


def _describe(program):
    dtype, inputs, prologue, reduce, dims, keepdim, (back, use_p), rows_op, after, return_r = \
        program
    lines = [f"input{i}: {shape} {layout} {dtype}" for i, (shape, layout) in enumerate(inputs)]
    if rows_op is not None:
        lines[-1] += " (z)"
    n = len(inputs) - (rows_op is not None)
    for k, (kind, name, args) in enumerate(prologue):
        lines.append(f"v{n + k} = {name}({', '.join(f'v{a}' for a in args)})")
    lines.append(f"p = last value of input0's shape; r = {reduce}(p, dims={dims}, "
                 f"keepdim={keepdim})")
    out = "r"
    if back:
        lines.append(f"out = {back}({'p' if use_p else 'v0'}, r)")
        out = "out"
    if rows_op is not None:
        lines.append(f"out = {rows_op[0]}({out}, {rows_op[1] or ''}(z))")
        out = "out"
    lines.append(f"return {after}({out})" + (", r" if return_r else ""))
    return "\n".join(lines)


def _check(backend, device, program):
    dtype, inputs = program[0], program[1]
    gen = torch.Generator().manual_seed(len(program[2]) * 31 + len(inputs))
    args = [_make_input(shape, layout, dtype, gen).to(device) for shape, layout in inputs]
    fn = _make_fn(program)
    try:
        compiled = assert_matches(fn, *args, backend=backend)
        steps = [type(s).__name__ for s in compiled.last.program.steps]
        assert "ExternStep" not in steps, steps
        # the reduction with its prologue and its epilogue (broadcast back or over the rows) is
        # one kernel; work on z alone may stand in a kernel of its own
        most = 1 if program[7] is None else 2
        assert len(compiled.kernels) <= most, [k.name for k in compiled.kernels]
    except Exception as err:
        err.add_note(f"program ({backend}):\n{_describe(program)}")
        raise


# The same examples on every run (derandomize), so that a red test is a change's doing and not
# the draw's. To explore new programs, run with FUSEC_EXPLORE=1: random draws, and hypothesis
# keeps any failure it finds in .hypothesis/ and replays it first next time.
SETTINGS = settings(max_examples=20, deadline=None, derandomize=not os.environ.get("FUSEC_EXPLORE"),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@SETTINGS
@given(data=st.data())
def test_random_reduction_program_cpu(backend, data):
    _check(backend, "cpu", data.draw(programs()))


@SETTINGS
@given(data=st.data())
def test_random_reduction_program_triton(data):
    _check("triton", TRITON_DEVICE, data.draw(programs()))


# Found by hypothesis (a random draw, 2026-11-25), and not fixed yet: a sum of 125 elements read
# through a gathered index, then `(x - sum) / (|sum| + 1)` squared. fusec's C++ kernel adds the
# 125 values one after another in float32; eager's sum adds them pairwise (cascade summation), so
# fusec's sum is about 10x further from float64 (2e-5 against 3e-6), and the subtraction carries
# that into the output. Making long sums pairwise in the CPU kernels would fix it.
KNOWN_GAP = (torch.float32, [((5, 5, 5, 5), "contiguous")], [("binary", "add", (0, 0))], "sum",
             (0, 1, 3), True, ("centered_scaled", False), None, "square", False)


@pytest.mark.xfail(strict=True, reason="float32 sum in sequence, not pairwise: 10x eager's error")
def test_long_sum_before_a_cancellation_is_as_accurate_as_eager():
    _check("cpp", "cpu", KNOWN_GAP)

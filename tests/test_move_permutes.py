"""move_permutes: permutes moved up to loaded values and down past pointwise ops
(passes/move_permutes.py), checked against eager on every backend: values, output strides, and the
kernels that fusion makes once the permutes are out of its way."""
import importlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import torch.nn.functional as F

import fusec
from conftest import assert_matches
from fusec.frontend import capture

passes = importlib.import_module("fusec.passes")
run_pipeline = passes.run_pipeline


def _randn(shape, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype)


def decisions(fn, *args, backend="cpp"):
    """The move_permutes lines of explain: 'node: moved: why' or 'node: kept: why'."""
    d = fusec.explain(fn, *args, backend=backend).to_dict()
    (change,) = [c for c in d["passes"] if c["after"] == "move_permutes"]
    return [line for line in change["details"] if ": moved: " in line or ": kept: " in line]


def assert_same_strides(fn, *inputs, backend):
    got = fusec.compile(fn, backend=backend)(*inputs)
    want = fn(*inputs)
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        assert g.shape == w.shape
        assert w.numel() == 0 or all(a == b for a, b, n in zip(g.stride(), w.stride(), w.shape) if n > 1), \
            (g.stride(), w.stride())


def convnext_block(x, b, w, gamma, beta):
    """ConvNeXt's channel LayerNorm, with the convolution's bias added the way unfuse_bias
    leaves it on a GPU: conv, + bias, permute to NHWC, LayerNorm over C, permute back, GELU."""
    y = F.conv2d(x, w, padding=1) + b.view(1, -1, 1, 1)
    z = F.layer_norm(y.permute(0, 2, 3, 1), (y.shape[1],), gamma, beta)
    return F.gelu(z.permute(0, 3, 1, 2))


def _convnext_inputs(device, dtype=torch.float32, hw=(7, 9)):
    c = 12
    return (_randn((2, 5) + hw, device, dtype), _randn((c,), device, dtype, 1),
            _randn((c, 5, 3, 3), device, dtype, 2) * 0.3, _randn((c,), device, dtype, 3),
            _randn((c,), device, dtype, 4))


def test_convnext_norm_is_one_kernel_between_the_convolution_and_the_output(target):
    backend, device = target
    args = _convnext_inputs(device)
    args[0][1, 2, 3, 4] = float("nan")
    cf = assert_matches(convnext_block, *args, backend=backend)
    assert_same_strides(convnext_block, *args, backend=backend)
    lines = decisions(convnext_block, *args, backend=backend)
    # the bias add joins the norm's kernel on every backend (plus any layout conversions)
    assert any(line.startswith("add_permuted: moved: permute") for line in lines), lines
    (norm,) = [k for k in cf.kernels if "aten.sum.dim_IntList" in k.ops]
    assert {"aten.add.Tensor", "aten.rsqrt.default"} <= set(norm.ops)
    if backend == "triton":  # and the GELU too
        assert "aten.gelu.default" in norm.ops and len(cf.kernels) <= 3, [k.name for k in cf.kernels]
        assert any(": moved: gelu computed before permute" in line for line in lines), lines
    else:  # a CPU reduction kernel computes its epilogue row by row: the GELU keeps its kernel
        assert [k.ops for k in cf.kernels if "aten.gelu.default" in k.ops] == [["aten.gelu.default"]]
        assert any(line.startswith("gelu: kept: gelu is costly") for line in lines), lines


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_convnext_block_in_other_dtypes(dtype):
    args = _convnext_inputs("cpu", dtype, hw=(5, 3))
    if dtype is torch.float16:
        args = tuple(a.float() for a in args)  # CPU conv2d has no float16 kernel in old torch
    assert_matches(convnext_block, *args, backend="cpp")


def test_the_graph_after_the_pass_has_no_permute_between_kernels():
    """After the pass: the permutes read only the convolution and the bias (folded into loads)
    and the last one is the output's view; no pointwise op reads a permute of a computed value."""
    args = _convnext_inputs("cpu")
    gm, _ = run_pipeline(capture(convnext_block, args).gm, passes.PIPELINE[:passes.PIPELINE.index(
        passes.move_permutes) + 1])
    permutes = [n for n in gm.graph.nodes if n.target is torch.ops.aten.permute.default]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for p in permutes:
        root = p.args[0]
        while root.target is torch.ops.aten.view.default:
            root = root.args[0]
        assert root.op == "placeholder" or root.target in (
            torch.ops.aten.convolution.default, torch.ops.aten.clone.default) \
            or list(p.users) == [output], p.format_node()
    assert sum(list(p.users) == [output] for p in permutes) == 1


def test_a_permuted_output_keeps_eagers_strides(target):
    """clone(x.t()) is contiguous in eager; clone computed before the permute would not be:
    the move is refused and says why."""
    backend, device = target
    x = _randn((6, 10), device)

    def f(x):
        return torch.sin(x).t().contiguous() * 1.0

    assert_matches(f, x, backend=backend)
    assert_same_strides(f, x, backend=backend)


def test_a_permute_moves_past_a_broadcast_operand_and_a_scalar(target):
    backend, device = target
    x, b = _randn((3, 5, 7), device), _randn((3,), device, seed=1)
    s = torch.tensor(1.5, device=device)

    def f(x, b, s):
        y = torch.softmax(x, -1).permute(1, 2, 0)  # (5, 7, 3), a view of the softmax's result
        return torch.tanh(y + b) * s

    cf = assert_matches(f, x, b, s, backend=backend)
    assert_same_strides(f, x, b, s, backend=backend)
    lines = decisions(f, x, b, s, backend=backend)
    if backend == "triton":
        assert sum(": moved: " in line for line in lines) == 3, lines  # add, tanh, mul
        (last,) = [k for k in cf.kernels if "aten.tanh.default" in k.ops]
        assert {"aten.exp.default", "aten.div.Tensor", "aten.mul.Tensor"} <= set(last.ops)
    else:  # the add is cheap and joins the softmax; tanh is costly after a CPU reduction
        assert sum(": moved: " in line for line in lines) == 1, lines
        assert any(line.startswith("tanh: kept: tanh is costly") for line in lines), lines


def test_a_reader_that_needs_the_strides_keeps_the_permute(target):
    """view() needs the strides the eager value had: the op it reads stays after the permute."""
    backend, device = target
    x = _randn((4, 6), device)

    def f(x):
        y = torch.sigmoid(x * 2).t()
        z = y.contiguous() + 1  # contiguous in eager; a permute of (x*2+1) would not be
        return z.view(-1), z.sum(0)

    assert_matches(f, x, backend=backend)
    assert_same_strides(f, x, backend=backend)


def test_a_second_computed_operand_keeps_its_kernel(target):
    backend, device = target
    x, y = _randn((4, 5, 6), device), _randn((6, 4, 5), device, seed=1)

    def f(x, y):
        s = torch.sin(x)  # also an output: computed by its kernel whatever happens
        b = torch.cos(y)
        return s.permute(2, 0, 1) * b, b, s

    assert_matches(f, x, y, backend=backend)
    lines = decisions(f, x, y, backend=backend)
    assert any(": kept: " in line and "computed by a kernel in another order" in line
               for line in lines), lines


def test_random_ops_are_never_moved():
    x = _randn((8, 6))

    def f(x):
        return F.dropout(torch.sin(x), 0.5, training=True).t() * 2

    lines = decisions(f, x)
    assert not any("dropout" in line or "bernoulli" in line for line in lines if ": moved: " in line)
    torch.manual_seed(0)
    got = fusec.compile(f, backend="cpp")(x)
    assert got.shape == (6, 8)
    kept = got != 0
    torch.testing.assert_close(got[kept], (torch.sin(x).t() * 4)[kept])


def test_a_costly_op_is_not_moved_into_a_cpu_reduction_it_would_repeat_in(target):
    """exp under a permute that a layer norm reads: moved up into a CPU reduction kernel (which
    walks the row once per phase), exp would be computed in each pass; a kernel of its own
    computes it once. A GPU's layer norm over a short row keeps it in registers: moved."""
    backend, device = target
    x = _randn((3, 8, 5), device)

    def f(x):
        return F.layer_norm(torch.exp(x * 0.5).permute(0, 2, 1), (8,))

    cf = assert_matches(f, x, backend=backend)
    lines = decisions(f, x, backend=backend)
    if backend == "triton":
        assert any(line.startswith("exp_permuted: moved:") for line in lines), lines
        assert len(cf.kernels) == 1
    else:
        assert any(line.startswith("permute: kept: exp is costly") for line in lines), lines


def test_up_stops_at_a_value_a_kernel_computes_for_other_readers(target):
    backend, device = target
    x = _randn((3, 4, 5), device)

    def f(x):
        s = torch.sin(x)
        return (s * 2).permute(2, 1, 0).contiguous(), s.sum()

    assert_matches(f, x, backend=backend)
    assert_same_strides(f, x, backend=backend)


@pytest.mark.parametrize("shape", [(0, 3, 4), (1, 1, 5), (2, 3, 1)])
def test_empty_and_size_one_dims(target, shape):
    backend, device = target
    x = _randn(shape, device)

    def f(x):
        return torch.relu(torch.exp(x).permute(2, 0, 1) - 1) * 3

    assert_matches(f, x, backend=backend)
    assert_same_strides(f, x, backend=backend)


def test_non_contiguous_inputs(target):
    backend, device = target
    x = _randn((6, 8, 10), device)[:, ::2, 1:]  # (6, 4, 9), strided
    b = _randn((9, 6), device, seed=1).t()       # (6, 9), transposed

    def f(x, b):
        y = (x + 1).permute(0, 2, 1)  # (6, 9, 4)
        return torch.sigmoid(y) * b.unsqueeze(-1)

    assert_matches(f, x, b, backend=backend)
    assert_same_strides(f, x, b, backend=backend)


# ---- property: any permutation, any side of a kernel ------------------------------------------

UNARY = {"sin": torch.sin, "relu": torch.relu, "exp": lambda t: torch.exp(t * 0.1),
         "twice": lambda t: t * 2.0}


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_permutation_before_and_after_a_kernel_matches_eager(data):
    """A random shape and permutation; pointwise ops before the permute (moved up), a softmax or
    nothing computing the permuted value (moved down), pointwise ops after it with a broadcast
    operand: values and output strides as eager's, on every backend."""
    rank = data.draw(st.integers(2, 4), label="rank")
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=rank, max_size=rank),
                            label="shape"))
    perm = data.draw(st.permutations(range(rank)), label="perm")
    before = data.draw(st.sampled_from(sorted(UNARY)), label="before")
    after = data.draw(st.sampled_from(sorted(UNARY)), label="after")
    reduce_first = data.draw(st.booleans(), label="softmax")
    x = _randn(shape)
    b = _randn(tuple(shape[p] for p in perm)[-1:], seed=1)

    def f(x, b):
        y = UNARY[before](x)
        if reduce_first:
            y = torch.softmax(y, -1)
        return UNARY[after](y.permute(*perm) + b)

    for backend in ("cpp", "llvm", "triton"):
        assert_matches(f, x, b, backend=backend)
        assert_same_strides(f, x, b, backend=backend)

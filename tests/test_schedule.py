"""passes/schedule.py: the ordered steps, the layout of every value, and the strides of outputs.

The schedule decides where each value lives. Views get a Layout into their root buffer instead of
memory; program outputs keep the strides eager PyTorch gives them; and views that the program
returns must alias what they view, exactly as in eager.
"""
import pytest
import torch
import torch.fx as fx

import fusec
from conftest import assert_matches
from fusec.frontend import capture
from fusec.ir import Layout
from fusec.passes import run_pipeline
from fusec.passes.schedule import format_schedule
from fusec.record import record_of

aten = torch.ops.aten


def _schedule(fn, *args):
    gm, _ = run_pipeline(capture(fn, args).gm)
    return gm


def _node(gm: fx.GraphModule, name: str) -> fx.Node:
    (node,) = [n for n in gm.graph.nodes if n.name == name]
    return node


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# ---- the list of steps -------------------------------------------------------------------------

def mixed(x, w, b):
    a = torch.sin(x) + b          # kernel
    m = a @ w                     # extern
    s = torch.cumsum(m, 1)        # extern
    return torch.relu(s) * a, m.t()   # kernel, and a view of an extern's result


def _assert_valid_order(gm):
    """Every buffer a step reads is an input or was written by an earlier step."""
    steps = record_of(gm).schedule
    available = {n.name for n in gm.graph.nodes if n.op in ("placeholder", "get_attr")}
    written = set()
    for step in steps:
        assert step.kind in ("kernel", "extern")
        missing = set(step.reads) - available
        assert not missing, f"{step} reads {missing} before they are written"
        assert not set(step.writes) & written, f"{step} writes a buffer twice"
        written |= set(step.writes)
        available |= set(step.writes)
    for out in gm.graph.output_node().all_input_nodes:
        assert out.meta["fusec_layout"].root in available


def test_schedule_lists_kernels_and_externs_in_order():
    x, w, b = torch.randn(4, 4), torch.randn(4, 4), torch.randn(4)
    gm = _schedule(mixed, x, w, b)
    steps = record_of(gm).schedule
    assert [(s.kind, s.name) for s in steps] == [
        ("kernel", "fused_sin_add_0"),
        ("extern", "aten.mm.default"),
        ("extern", "aten.cumsum.default"),
        ("kernel", "fused_relu_mul_1"),
    ]
    assert steps[0].reads == ["x", "b"] and steps[0].writes == ["add"]
    assert steps[1].reads == ["add", "w"] and steps[1].writes == ["mm"]
    assert steps[2].reads == ["mm"] and steps[2].writes == ["cumsum"]
    assert sorted(steps[3].reads) == ["add", "cumsum"] and steps[3].writes == ["mul"]
    assert steps[0].shapes["x"] == "f32[4, 4]" and steps[1].shapes["w"] == "f32[4, 4]"
    _assert_valid_order(gm)
    # the printed form names every step with its buffers
    text = format_schedule(steps)
    assert text.splitlines()[0].split() == ["1.", "kernel", "fused_sin_add_0", "reads", "x",
                                            "f32[4,", "4],", "b", "f32[4]", "writes", "add",
                                            "f32[4,", "4]"]
    assert len(text.splitlines()) == 4


def test_schedule_of_mixed_program_is_correct(target):
    backend, device = target
    args = [torch.randn(s, device=device) for s in [(4, 4), (4, 4), (4,)]]
    assert_matches(mixed, *args, backend=backend, kernels=2)


def test_steps_read_roots_not_views():
    def f(x, y):
        return torch.sin(x.t()[1:]) + y

    gm = _schedule(f, torch.randn(6, 7), torch.randn(6, 6))
    (step,) = record_of(gm).schedule
    assert step.reads == ["x", "y"]  # slice_1/permute are views of x, not buffers


def test_schedule_with_multi_output_extern_is_valid():
    def f(x):
        values, indices = torch.sort(x, 1)  # (torch.max(x, 1) is a fused reduction now)
        return torch.sin(values) + indices

    gm = _schedule(f, torch.randn(5, 7))
    _assert_valid_order(gm)
    assert [s.kind for s in record_of(gm).schedule] == ["extern", "kernel"]


# ---- layouts -----------------------------------------------------------------------------------

def test_layout_of_a_view_of_an_input():
    def f(x, y):
        return x.t()[1:] + y

    gm = _schedule(f, torch.randn(6, 7), torch.randn(6, 6))
    assert _node(gm, "x").meta["fusec_layout"] == Layout("x", (6, 7), (7, 1), 0)
    assert _node(gm, "permute").meta["fusec_layout"] == Layout("x", (7, 6), (1, 7), 0)
    assert _node(gm, "slice_1").meta["fusec_layout"] == Layout("x", (6, 6), (1, 7), 1)


@pytest.mark.parametrize("view,shape,stride,offset", [
    (lambda x: x[:, 1::3], (6, 3), (9, 3), 1),
    (lambda x: x[2:], (4, 9), (9, 1), 18),
    (lambda x: x[-2:, -4:-1], (2, 3), (9, 1), 41),
    (lambda x: x[3], (9,), (1,), 27),
    (lambda x: x[:, 4], (6,), (9,), 4),
    (lambda x: x.unsqueeze(1)[1:, :, ::2], (5, 1, 5), (9, 9, 2), 9),
    (lambda x: x[1:2].expand(4, 9), (4, 9), (0, 1), 9),
    (lambda x: x.view(2, 27)[1], (27,), (1,), 27),
], ids=["step", "start", "negative", "select", "column", "unsqueeze", "expand", "view"])
def test_layout_of_views_matches_torch(view, shape, stride, offset):
    x = torch.randn(6, 9)
    eager = view(x)
    assert (tuple(eager.shape), eager.stride(), eager.storage_offset()) == (shape, stride, offset)
    gm = _schedule(lambda x: view(x) * 2, x)
    (mul,) = [n for n in gm.graph.nodes if n.op == "call_module"]
    (arg,) = mul.args
    assert arg.meta["fusec_layout"] == Layout("x", shape, stride, offset)


def test_layout_of_a_non_contiguous_input_is_its_own():
    base = torch.randn(8, 10)
    x = base[1:, 2::2]  # storage offset 12 in base, but offsets are relative to the input itself
    gm = _schedule(lambda x: torch.sin(x.t()), x)
    assert _node(gm, "x").meta["fusec_layout"] == Layout("x", (7, 4), (10, 2), 0)
    assert _node(gm, "permute").meta["fusec_layout"] == Layout("x", (4, 7), (2, 10), 0)


def test_kernel_output_layouts_are_their_own_roots():
    gm = _schedule(mixed, torch.randn(4, 4), torch.randn(4, 4), torch.randn(4))
    for name in ("add", "mm", "cumsum", "mul"):
        layout = _node(gm, name).meta["fusec_layout"]
        assert layout.root == name and layout.offset == 0
    permute = _node(gm, "permute").meta["fusec_layout"]
    assert permute == Layout("mm", (4, 4), (1, 4), 0)


# ---- program outputs keep eager's strides ------------------------------------------------------

STRIDES = {
    "sin(x.t())": (lambda x: torch.sin(x.t()), [(3, 5)]),
    "permuted 3-D": (lambda x: torch.sin(x.permute(2, 0, 1)), [(2, 3, 4)]),
    "expanded input": (lambda x: torch.sin(x.expand(4, 5)), [(1, 5)]),
    "sliced input": (lambda x: torch.cos(x[:, ::2]), [(4, 8)]),
    "x.t() + y": (lambda x, y: x.t() + y, [(5, 3), (3, 5)]),
    "y + x.t()": (lambda x, y: y + x.t(), [(5, 3), (3, 5)]),
    "sin(x).t()": (lambda x: torch.sin(x).t(), [(3, 5)]),
    "size-1 dims": (lambda x: torch.sin(x.t()), [(1, 5)]),
    "two outputs": (lambda x: (torch.sin(x.t()), torch.cos(x.t()) * 2), [(3, 5)]),
    "mixed layouts": (lambda x, y: (lambda a: (a, a + y, y - a))(torch.sin(x.t())),
                      [(3, 5), (5, 3)]),
    "channels_last": (lambda x: torch.sin(x.contiguous(memory_format=torch.channels_last)) * 2,
                      [(2, 3, 4, 5)]),
}


@pytest.mark.parametrize("case", list(STRIDES))
def test_output_strides_match_eager(target, case):
    backend, device = target
    fn, shapes = STRIDES[case]
    args = [torch.randn(s, device=device) for s in shapes]
    got = fusec.compile(fn, backend=backend)(*args)
    want = fn(*args)
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        torch.testing.assert_close(g, w)
        assert g.stride() == w.stride()


VIEW_OUTPUT_STRIDES = {
    "sin(x.t()).t()": (lambda x: torch.sin(x.t()).t(), [(3, 5)]),
    "sin(x.t())[1:]": (lambda x: torch.sin(x.t())[1:], [(3, 5)]),
    "permute back": (lambda x: torch.sin(x.permute(2, 0, 1)).permute(1, 2, 0), [(2, 3, 4)]),
    # not a view, same cause: flip keeps its input's layout, and that input's layout was not eager's
    "extern of intermediate": (lambda x: torch.flip(torch.sin(x.t()), [0]), [(3, 5)]),
}


@pytest.mark.parametrize("case", list(VIEW_OUTPUT_STRIDES))
def test_view_output_of_intermediate_strides_match_eager(target, case):
    backend, device = target
    fn, shapes = VIEW_OUTPUT_STRIDES[case]
    args = [torch.randn(s, device=device) for s in shapes]
    got = fusec.compile(fn, backend=backend)(*args)
    want = fn(*args)
    torch.testing.assert_close(got, want)
    assert got.stride() == want.stride()


@pytest.mark.parametrize("fn,shape", [
    (lambda x: torch.sin(x.t()).t().view(15), (3, 5)),
    (lambda x: torch.sin(x.t()).t().reshape(-1) * 2, (3, 5)),
    (lambda x: torch.sin(x.permute(2, 0, 1)).permute(1, 2, 0).flatten() + 1, (2, 3, 4)),
], ids=["view", "reshape-then-mul", "flatten-3d"])
def test_view_traced_on_eager_strides_of_an_intermediate(target, fn, shape):
    backend, device = target
    assert_matches(fn, torch.randn(shape, device=device), backend=backend)


# ---- views returned as outputs alias -----------------------------------------------------------

def test_views_of_an_input_returned_alias_the_input(target):
    backend, device = target
    x = torch.randn(6, 7, device=device)

    def views(x):
        return x.t(), x[2:], x[:, 1::3], x[0], x.unsqueeze(0), x[1:2].expand(3, 7), x

    got = fusec.compile(views, backend=backend)(x)
    want = views(x)
    for g, w in zip(got, want):
        assert _storage(g) == _storage(x)
        assert (g.shape, g.stride(), g.storage_offset()) == \
            (w.shape, w.stride(), w.storage_offset())
    assert got[-1] is x or (got[-1].shape == x.shape and got[-1].stride() == x.stride())


def test_views_of_an_intermediate_returned_alias_it(target):
    backend, device = target

    def f(x):
        y = torch.sin(x)
        return y, y.t(), y[1:, ::2], y[3]

    x = torch.randn(5, 6, device=device)
    got = fusec.compile(f, backend=backend)(x)
    want = f(x)
    assert len({_storage(g) for g in got}) == 1
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
        assert (g.stride(), g.storage_offset()) == (w.stride(), w.storage_offset())
    got[0].fill_(7.0)  # writing through the base shows through every view, as in eager
    assert (got[1] == 7).all() and (got[2] == 7).all() and (got[3] == 7).all()


def test_view_of_an_extern_result_returned(target):
    backend, device = target

    def f(x, w):
        m = x @ w
        return m.t(), m[:, 1:]

    x, w = torch.randn(4, 5, device=device), torch.randn(5, 6, device=device)
    got = fusec.compile(f, backend=backend)(x, w)
    want = f(x, w)
    assert _storage(got[0]) == _storage(got[1])
    for g, w_ in zip(got, want):
        torch.testing.assert_close(g, w_)
        assert (g.stride(), g.storage_offset()) == (w_.stride(), w_.storage_offset())


def test_returning_a_mutated_input_returns_the_input(target):
    backend, device = target

    def f(x):
        x.add_(1)
        return x

    x = torch.zeros(3, device=device)
    out = fusec.compile(f, backend=backend)(x)
    assert _storage(out) == _storage(x)


def test_copy_into_input_writes_the_input_root():
    def f(x):
        x.add_(1)
        return x * 2

    gm = _schedule(f, torch.randn(4))
    (step,) = [s for s in record_of(gm).schedule if s.name == "aten.copy_.default"]
    assert step.writes == ["x"]

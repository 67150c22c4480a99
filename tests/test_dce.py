"""passes/dce.py: dead-code elimination removes what nobody reads, and nothing with a side effect.

The side effects a captured graph can have are (1) the `copy_` that functionalization writes at the
end of the graph for every input the program updated in place, and (2) random-number ops, which
advance the global generator even when their result is thrown away. Both must survive DCE, and
both must behave like eager PyTorch on every backend.
"""
import pytest
import torch
import torch.fx as fx

import fusec
from conftest import assert_matches
from fusec.frontend import capture
from fusec.passes import dce, run_pipeline
from fusec.record import record_of

aten = torch.ops.aten


def _dce(fn, *args):
    """(captured graph, graph after dce alone)."""
    captured = capture(fn, args)
    gm, snapshots = run_pipeline(captured.gm, passes=[dce], record=True)
    assert [s.after for s in snapshots] == ["capture", "dce"]
    return captured.gm, gm


def _targets(gm: fx.GraphModule) -> set:
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


# ---- removing dead nodes -------------------------------------------------------------------------

def unused_values(x):
    c = torch.cos(x)          # unused
    _ = c * 2                 # unused, and the only user of c
    _ = torch.exp(x) + 1      # unused
    return torch.sin(x)


def test_removes_unused_nodes_and_records_them():
    before, gm = _dce(unused_values, torch.randn(8))
    assert sorted(record_of(gm).dce) == ["add", "cos", "exp", "mul"]
    assert _targets(gm) == {aten.sin.default}
    names = {n.name for n in gm.graph.nodes}
    assert not names & set(record_of(gm).dce)
    # the pipeline works on a copy: the captured graph (the eager reference) keeps everything
    assert {aten.cos.default, aten.exp.default, aten.mul.Tensor} <= _targets(before)


def test_dce_snapshot_no_longer_mentions_removed_nodes():
    captured = capture(unused_values, (torch.randn(8),))
    _, snapshots = run_pipeline(captured.gm, record=True)
    by_pass = {s.after: s.code for s in snapshots}
    assert "aten.cos" in by_pass["capture"]
    assert "aten.cos" not in by_pass["dce"] and "aten.exp" not in by_pass["dce"]


def test_nothing_to_remove_records_empty_list():
    _, gm = _dce(lambda x: torch.sin(x) * 2, torch.randn(8))
    assert record_of(gm).dce == []


def test_dead_inplace_update_of_an_intermediate_is_removed():
    def f(x):
        y = x.clone()
        y.add_(1)           # mutates a temporary nobody reads: no observable effect
        return torch.sin(x)

    _, gm = _dce(f, torch.randn(8))
    assert _targets(gm) == {aten.sin.default}
    assert record_of(gm).dce


def test_dead_code_compiles_no_kernel(target):
    backend, device = target
    x = torch.randn(64, device=device)
    cf = assert_matches(unused_values, x, backend=backend, kernels=1)
    assert cf.kernels[0].name == "fused_sin_0"


# ---- in-place updates of inputs ------------------------------------------------------------------

def add_inplace(x):
    x.add_(1)
    return x * 2


def test_copy_into_mutated_input_survives_dce():
    _, gm = _dce(add_inplace, torch.randn(4, 4))
    copies = [n for n in gm.graph.nodes if n.target is aten.copy_.default]
    assert len(copies) == 1 and not copies[0].users       # unused, yet kept
    assert copies[0].is_impure()
    assert copies[0].args[0].op == "placeholder" and copies[0].args[0].name == "x"
    assert "copy_" not in record_of(gm).dce


def _check_mutation(fn, make, backend):
    """fn mutates its inputs: compiled and eager must return the same and leave the same inputs.
    Called twice so the second call goes through the cached Program."""
    compiled = fusec.compile(fn, backend=backend)
    for _ in range(2):
        mine, theirs = make(), make()
        got = compiled(*mine)
        with torch.no_grad():
            want = fn(*theirs)
        torch.testing.assert_close(got, want)
        for m, t in zip(mine, theirs):
            torch.testing.assert_close(m, t)
    return compiled


MUTATIONS = {
    "add_": (add_inplace, lambda d: [torch.arange(16.0, device=d).reshape(4, 4)]),
    "add_ then return x": (lambda x: (x.add_(1), x)[1], lambda d: [torch.zeros(3, device=d)]),
    "mul_ through transpose view": (lambda x: (x.t().mul_(2), torch.sin(x))[1],
                                    lambda d: [torch.arange(12.0, device=d).reshape(3, 4)]),
    "add_ on one row": (lambda x: (x[1].add_(10), x * 1)[1],
                        lambda d: [torch.arange(12.0, device=d).reshape(3, 4)]),
    "non-contiguous input": (add_inplace,
                             lambda d: [torch.arange(20.0, device=d).reshape(4, 5).t()]),
    "sliced input": (add_inplace, lambda d: [torch.arange(20.0, device=d).reshape(4, 5)[1:, ::2]]),
    "read before and after": (lambda x, y: (x * 2, x.mul_(3), y.sub_(x))[0] + x,
                              lambda d: [torch.arange(8.0, device=d), torch.ones(8, device=d)]),
    "copy_ from other input": (lambda x, y: (x.copy_(y), torch.cos(x))[1],
                               lambda d: [torch.zeros(5, device=d), torch.arange(5.0, device=d)]),
}


@pytest.mark.parametrize("case", list(MUTATIONS))
def test_inplace_update_mutates_callers_tensor(target, case):
    backend, device = target
    fn, make = MUTATIONS[case]
    _check_mutation(fn, lambda: make(device), backend)


def test_inplace_update_of_input_outside_a_sliced_window_is_untouched(target):
    backend, device = target
    base = torch.arange(30.0, device=device).reshape(5, 6)
    expected = base.clone()
    expected[1:4, ::2] += 1
    fusec.compile(add_inplace, backend=backend)(base[1:4, ::2])
    torch.testing.assert_close(base, expected)


# ---- random ops ----------------------------------------------------------------------------------

def unused_rand(x):
    _ = torch.rand(4, 4)
    return torch.sin(x)


def unused_dropout(x):
    _ = torch.nn.functional.dropout(x, 0.5, training=True)
    return torch.sin(x)


def test_fx_considers_random_ops_impure():
    """What the dce docstring relies on: torch.fx marks random ops (and copy_) impure."""
    _, gm = _dce(unused_rand, torch.randn(4, 4))
    (rand,) = [n for n in gm.graph.nodes if n.target is aten.rand.default]
    assert rand.is_impure() and not rand.users
    assert "rand" not in record_of(gm).dce


def test_unused_dropout_keeps_its_random_op_but_drops_the_arithmetic():
    before, gm = _dce(unused_dropout, torch.randn(4, 4))
    random_before = [n for n in before.graph.nodes if n.is_impure() and n.op == "call_function"]
    assert random_before, before.code  # bernoulli (or whatever dropout decomposes to)
    kept = {n.name for n in gm.graph.nodes}
    assert all(n.name in kept for n in random_before)
    assert aten.mul.Tensor not in _targets(gm)  # x * mask / (1-p) is gone
    assert record_of(gm).dce


@pytest.mark.parametrize("fn", [unused_rand, unused_dropout], ids=["rand", "dropout"])
def test_unused_random_op_advances_the_generator_like_eager(target, fn):
    backend, device = target
    x = torch.randn(4, 4, device=device)
    compiled = fusec.compile(fn, backend=backend)
    compiled(x)  # compile first: tracing runs on fake tensors and must not draw numbers either
    for _ in range(2):
        torch.manual_seed(1234)
        got = compiled(x)
        after_compiled = torch.rand(8)
        torch.manual_seed(1234)
        want = fn(x)
        after_eager = torch.rand(8)
        torch.testing.assert_close(got, want)
        assert torch.equal(after_compiled, after_eager)


def test_random_ops_stay_impure_under_a_tracing_context():
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    captured = capture(unused_rand, (torch.randn(4, 4),))
    with tracing(TracingContext(FakeTensorMode())):
        gm, _ = run_pipeline(captured.gm, passes=[dce])
    assert "rand" not in record_of(gm).dce

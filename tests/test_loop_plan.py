"""The loop plan of a reduction kernel (fusec/loop_plan.py, made by `plan_loops` in
codegen/lower_reduction.py): what a row computes before its loops, in each pass over k and after
it, and which stores are per element or per row. Every backend spells this one plan, so each case
also runs on every backend against eager (`target` fixture, float64-referenced)."""
import torch
import torch.nn.functional as F

from conftest import assert_matches
from fusec.ir import Reduce, canonical


def _plan(fn, x, target):
    backend, device = target
    cf = assert_matches(fn, x.to(device), backend=backend, kernels=1)
    ir = cf.kernels[0].ir
    made = {item.var.name: item for item in ir.body}
    ops = lambda names: [made[n].op for n in names]  # noqa: E731
    return ir, ir.plan, ops


def test_softmax(target):
    """max, then the sum of exp(x - max), then the division stored per element."""
    ir, plan, ops = _plan(lambda x: torch.softmax(x, -1), torch.randn(6, 50), target)
    assert [ops(p.reduces) for p in plan.phases] == [["amax"], ["sum"]]
    assert plan.before == () and all(p.ready == () for p in plan.phases)
    assert ops(plan.phases[1].loop[1:]) == ["sub", "exp"]  # after the load of x
    assert ops(plan.last_pass[1:]) == ["sub", "exp", "truediv"]
    assert plan.element_stores == (0,) and plan.row_stores == ()
    # the sum may share the max's pass (online softmax): one pass covers both phases
    [pair] = plan.phases[0].folds
    assert [[p.number for p in ps] for ps in plan.passes(online=True)] == [[0, 1]]
    assert [[p.number for p in ps] for ps in plan.passes(online=False)] == [[0], [1]]
    # exp(x - max) may be kept in the output for the last pass, which then reads it back
    # instead of loading x again (the CPU backends take it)
    keep = plan.keep
    assert keep is not None and ops([keep.value]) == ["exp"] and keep.stores == (0,)
    assert ops(keep.last_pass) == ["exp", "truediv"]
    text = str(ir)
    assert "phase 0: amax(" in text and "phase 1: sum(" in text and "last pass:" in text


def test_logsumexp_row_values(target):
    """Row math between the passes (the guard on an infinite max) and after them (log + max);
    one value per row, so no last pass."""
    ir, plan, ops = _plan(lambda x: torch.logsumexp(x, -1), torch.randn(6, 50), target)
    assert ops(plan.before) == ["full"]  # needs no reduction: once per row, before the loops
    assert ops(plan.phases[0].ready) == ["abs", "eq", "where"]
    assert ops(plan.phases[1].ready) == ["log", "add"]
    assert plan.element_stores == () and plan.row_stores == (0,) and plan.last_pass == ()
    assert plan.keep is None


def test_layer_norm_folds_its_variance_into_the_mean_pass(target):
    """The variance's sum of (x - mean)^2 needs the mean, known after phase 0; it folds into
    that pass as an online variance (per-lane running means): one pass, then the last pass."""
    ir, plan, ops = _plan(lambda x: F.layer_norm(x, (40,)), torch.randn(6, 40), target)
    assert len(plan.phases) == 2
    [fold] = plan.phases[0].folds
    assert type(fold).__name__ == "OnlineVariance" and fold.total == plan.phases[1].reduces[0]
    assert fold.value in plan.phases[0].loop and fold.shift in plan.phases[0].ready
    assert len(plan.passes(online=True)) == 1 and len(plan.passes(online=False)) == 2
    assert plan.element_stores == (0,)


def test_row_and_element_outputs(target):
    """A kernel that returns its row results and its element results: stored in their places."""
    def fn(x):
        m = x.amax(-1, keepdim=True)
        e = torch.exp(x - m)
        s = e.sum(-1, keepdim=True)
        return e / s, m, s
    ir, plan, ops = _plan(fn, torch.randn(6, 30), target)
    kinds = ["elem" if n in plan.element_stores else "row" for n in range(len(ir.stores))]
    assert sorted(kinds) == ["elem", "row", "row"]
    assert set(plan.element_stores) | set(plan.row_stores) == set(range(len(ir.stores)))


def test_canonical_renames_the_plan():
    x = torch.randn(6, 50)
    ir, plan, _ = _plan(lambda x: torch.softmax(x, -1), x, ("cpp", "cpu"))
    canon = canonical(ir)
    reduces = [item.var.name for item in canon.body if isinstance(item, Reduce)]
    assert [n for p in canon.plan.phases for n in p.reduces] == reduces
    names = {l.var.name for l in canon.loads} | {item.var.name for item in canon.body}
    assert set(canon.plan.last_pass) <= names and canon.plan.keep.value in names
    assert canon.plan.phases[0].folds[0].total == reduces[1]

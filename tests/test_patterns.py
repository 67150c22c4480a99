"""passes/patterns.py: rules are a pattern plus a replacement; rewrite applies them to a fixpoint.

Each test captures a small program (fusec.frontend.capture gives the ATen graph with its example
values), applies hand-made rules and checks what matched, what was built, what was recorded,
and that the rewritten graph still computes eager's answer.
"""
import pytest
import torch

from fusec.frontend import capture
from fusec.passes.patterns import Declined, Op, Rule, RuleError, Var, match, rewrite

aten = torch.ops.aten


def graph_of(f, *args):
    return capture(f, args).gm


def calls(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def run(gm, *args):
    gm.recompile()
    out = gm(*args)
    return out[0] if isinstance(out, (list, tuple)) else out


def test_a_var_used_twice_must_match_the_same_value():
    x = Var("x")
    pattern = Op(aten.mul.Tensor, x, x)
    gm = graph_of(lambda a, b: a * a + a * b, torch.randn(3), torch.randn(3))
    muls = calls(gm, aten.mul.Tensor)
    assert [match(pattern, n) is not None for n in muls] == [True, False]
    assert match(pattern, muls[0]).x is muls[0].args[0]


def test_constants_must_be_equal_and_commutative_ops_match_both_ways():
    pattern = Op(aten.mul.Tensor, Var("s"), Op(aten.exp.default, Var("x")), commutative=True)
    gm = graph_of(lambda a, b: torch.exp(a) * b + b * torch.exp(a), torch.randn(3), torch.randn(3))
    assert all(match(pattern, n) for n in calls(gm, aten.mul.Tensor))
    add_one = Op(aten.add.Tensor, Var("x"), 1)
    gm = graph_of(lambda a: (a + 1) * (a + 2), torch.randn(3))
    assert [match(add_one, n) is not None for n in calls(gm, aten.add.Tensor)] == [True, False]


def test_a_rule_rewrites_records_and_keeps_eagers_answer():
    """(a * 2) * 3 * 0.5 becomes a * 3.0 in two sweeps (the first rewrite makes the second
    match); with scales like these the product rounds exactly as eager's does."""
    def build(b, m):
        return b(aten.mul.Tensor, m.x, m.c1 * m.c2)
    rule = Rule("fold scales", Op(aten.mul.Tensor, Op(aten.mul.Tensor, Var("x"), Var("c1"),
                                                      one_user=True), Var("c2")),
                build, "{x} times {c1} times {c2} in one multiply")
    f = lambda a: (a * 2.0) * 3.0 * 0.5  # noqa: E731
    a = torch.randn(5)
    gm = graph_of(f, a)
    decisions = rewrite(gm, [rule])
    assert len(calls(gm, aten.mul.Tensor)) == 1, gm.graph  # two sweeps: rules compose
    assert [d.taken for d in decisions] == [True, True]
    assert decisions[0].why == "fold scales: a times 2.0 times 3.0 in one multiply"
    for node in gm.graph.nodes:
        if node.op == "call_function":
            assert "val" in node.meta and "fusec" in node.meta
    torch.testing.assert_close(run(gm, a), f(a))


def test_one_user_keeps_a_shared_value_whole():
    rule = Rule("fold scales", Op(aten.mul.Tensor, Op(aten.mul.Tensor, Var("x"), Var("c1"),
                                                      one_user=True), Var("c2")),
                lambda b, m: b(aten.mul.Tensor, m.x, m.c1 * m.c2))
    def f(a):
        t = a * 2.0
        return t * 3.0 + t.sin()
    gm = graph_of(f, torch.randn(4))
    assert rewrite(gm, [rule]) == []


def test_a_decline_is_recorded_once_with_its_reason():
    rule = Rule("no", Op(aten.sin.default, Var("x")), lambda b, m: Declined("never here"))
    gm = graph_of(lambda a: torch.sin(a) + 1, torch.randn(2))
    decisions = rewrite(gm, [rule])
    assert [(d.taken, d.why) for d in decisions] == [(False, "no: never here")]
    assert calls(gm, aten.sin.default)


def test_a_replacement_that_cannot_run_is_an_error_not_a_wrong_graph():
    rule = Rule("bad", Op(aten.sin.default, Var("x")),
                lambda b, m: b(aten.mm.default, m.x, m.x))  # (3,) @ (3,): no such matmul
    gm = graph_of(lambda a: torch.sin(a), torch.randn(3))
    with pytest.raises(RuleError, match="rule 'bad'"):
        rewrite(gm, [rule])


def test_rules_that_undo_each_other_are_stopped():
    to_cos = Rule("sin to cos", Op(aten.sin.default, Var("x")),
                  lambda b, m: b(aten.cos.default, m.x))
    to_sin = Rule("cos to sin", Op(aten.cos.default, Var("x")),
                  lambda b, m: b(aten.sin.default, m.x))
    gm = graph_of(lambda a: torch.sin(a), torch.randn(3))
    with pytest.raises(RuleError, match="undo each other"):
        rewrite(gm, [to_cos, to_sin])

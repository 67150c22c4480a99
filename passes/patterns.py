"""Patterns: a graph rewrite written as what to find and what to put in its place.

Many passes are the same loop: walk the graph, recognize a little tree of ops, check a condition
on shapes or dtypes, build a replacement, rewire the users, record why. Written by hand, each
such walk is mostly bookkeeping, and the one line that matters (the algebra) is hard to find. A
`Rule` keeps only the part that matters:

    x = Var("x")
    TANH_OF_SOFTPLUS = Rule(
        "tanh(softplus(x))",
        Op(aten.tanh.default, Op(aten.where.self, Op(aten.gt.Scalar, x, 20), x,
                                 Op(aten.log1p.default, Op(aten.exp.default, x)))),
        build=lambda b, m: ...,        # the replacement, built with `b` (a Builder)
    )

`Op(target, *args)` matches a call of `target` (one ATen overload, or a tuple of them) whose
arguments match `args` in order: each is a pattern again, a `Var` (a hole that matches anything,
and the same name twice must be the same value), or a plain constant that must be equal.
`Op(..., name="prod")` also binds the matched node itself, and `commutative=True` tries the two
first arguments both ways round (`mul(w, s)` and `mul(s, w)`). A Var's `when` is a predicate on
the value it matched (`lambda v: meta(v).dtype.is_floating_point`).

`build(b, m)` gets the match `m` (its names as attributes, `m.x`) and a `Builder`, and returns
the node that replaces the matched one, or a `Declined("why")` when a condition the pattern
cannot say (sizes, costs) does not hold. `b(target, *args)` inserts a call before the matched
node with its example value and TensorMeta worked out by running the op on fake tensors, so a
replacement never leaves a node without metadata (passes/__init__.py's `verify`).

`rewrite(gm, rules)` tries every rule on every node, in graph order, and sweeps again until no
rule applies (a replacement may expose another match: rules compose). Every application, and
every decline, is a `Decision(node, taken, why)` the calling pass keeps in its record, so
`fusec.explain` shows what each rule did and why it did not. Users: passes/canonicalize.py (the
canonical forms) and passes/simplify.py; a kernel family's graph rewrites use the same facility.
A pass made of rules says what it looks for with its rules, `@looks_for_rules("RULES")`
(each rule's root op and the ops it `needs`; rules registered later count too): the pipeline skips
it on a graph that calls none of them (passes/__init__.py, `wanted`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch.fx as fx

from fusec.record import Decision

from .layout import run_fake, set_meta
from .schedule import fake_mode_of
from .unflatten import erase_dead

MAX_SWEEPS = 64  # rules that undo each other would loop: a bug, stopped here with an error


@dataclass(frozen=True)
class Var:
    """A hole in a pattern: matches any argument (a node or a constant) for which `when` holds.
    The same name used twice in one pattern must match the same value both times."""

    name: str
    when: Callable[[Any], bool] | None = None


@dataclass(frozen=True)
class Op:
    """A call of `target` (an OpOverload or a tuple of them) with arguments matching `args`;
    extra arguments of the call are allowed only when `exact` is False. `name` binds the node."""

    target: Any
    args: tuple = ()
    name: str | None = None
    commutative: bool = False
    exact: bool = True
    one_user: bool = False  # the matched node feeds nothing but its parent in the pattern

    def __init__(self, target, *args, name=None, commutative=False, exact=True, one_user=False):
        object.__setattr__(self, "target", target if isinstance(target, tuple) else (target,))
        object.__setattr__(self, "args", args)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "commutative", commutative)
        object.__setattr__(self, "exact", exact)
        object.__setattr__(self, "one_user", one_user)


class Match(dict):
    """The values a pattern's names matched, read as attributes: `m.x`, `m.prod`."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass(frozen=True)
class Declined:
    """What `build` returns when the pattern matched but the rewrite does not apply: why not."""

    why: str


@dataclass
class Rule:
    """A pattern, the replacement `build(b, m)` makes for it, and the words for a Decision:
    `name` says what the rule rewrites (the Decision reads "<name>: <why>")."""

    name: str
    pattern: Op
    build: Callable[["Builder", Match], "fx.Node | Declined"]
    why: str = ""
    # Ops the graph must also call, every one, for the rule to have anything to do: its root
    # alone may be an op most graphs call (a sum; any elementwise op), while the pattern cannot
    # match without the ops inside it (a mul under the sum; a cat under the math).
    needs: tuple = ()
    # Only nodes matched with these targets are tried (the pattern's root), for speed.
    roots: tuple = field(init=False)

    def __post_init__(self):
        self.roots = self.pattern.target


REGISTERED: list[Rule] = []  # rules from outside the core, run by canonicalize after its own


def register(rule: Rule) -> Rule:
    """Add a rule of your own (docs/extending.md, "A graph rewrite"): passes/canonicalize.py
    applies it after its own rules, in every compile from now on; one of the same name is
    replaced. The programs fusec saves on disk are keyed by the registered rules' names
    (runtime/fast_start/fingerprint.py), so a program made without the rule is not reused with it."""
    REGISTERED[:] = [r for r in REGISTERED if r.name != rule.name] + [rule]
    return rule


def unregister(name: str) -> None:
    """Remove the registered rule called `name` (nothing if there is none)."""
    REGISTERED[:] = [r for r in REGISTERED if r.name != name]


def calls(graph_calls: set, target) -> bool:
    """Whether a graph whose call_function targets are `graph_calls` calls `target` (an
    OpOverload, or a packet that stands for all its overloads)."""
    return target in graph_calls or any(getattr(t, "overloadpacket", None) is target
                                        for t in graph_calls)


def applies(rule: Rule, graph_calls: set) -> bool:
    """Whether `rule` can match anywhere in a graph that calls `graph_calls`: its root is called,
    and every op it `needs`."""
    return any(calls(graph_calls, t) for t in rule.roots) and \
        all(calls(graph_calls, t) for t in rule.needs)


class RulesLookFor:
    """What a pass made of rules looks for: a graph where one of the rules `rules()` returns
    `applies` (asked each time, so a rule registered later counts). `passes.wanted` asks
    `wanted_by(the graph's calls)`."""

    def __init__(self, rules: Callable[[], list[Rule]]):
        self.rules = rules

    def wanted_by(self, graph_calls: set) -> bool:
        return any(applies(rule, graph_calls) for rule in self.rules())

    def __bool__(self) -> bool:
        return True


def looks_for_rules(*names: str):
    """Mark a pass made of rules with what it looks for (as fusec/graphmodule.py's `looks_for`
    does with a list of ops), derived from its rules so it can never drift from them: the pass
    runs on a graph where one of them `applies`. `names` name the pass module's lists of rules,
    `@looks_for_rules("RULES", "REGISTERED")`, read each time it is asked: the rules are defined
    below the pass, and a rule registered later counts too."""
    def mark(function):
        function.looks_for = RulesLookFor(
            lambda: [rule for name in names for rule in function.__globals__[name]])
        return function
    return mark


def match(pattern, value, m: Match | None = None) -> Match | None:
    """The names `pattern` binds when it matches `value`, or None."""
    m = Match() if m is None else m
    if isinstance(pattern, Var):
        if pattern.name in m:
            return m if _same(m[pattern.name], value) else None
        if pattern.when is not None and not pattern.when(value):
            return None
        m[pattern.name] = value
        return m
    if isinstance(pattern, Op):
        if not (isinstance(value, fx.Node) and value.op == "call_function"
                and value.target in pattern.target):
            return None
        args = value.args
        if value.kwargs and pattern.exact or len(args) < len(pattern.args) \
                or (pattern.exact and len(args) != len(pattern.args)):
            return None
        orders = [args]
        if pattern.commutative and len(args) >= 2:
            orders.append((args[1], args[0], *args[2:]))
        for order in orders:
            trial = Match(m)
            if all(match(p, a, trial) is not None for p, a in zip(pattern.args, order)):
                if pattern.name is not None:
                    trial[pattern.name] = value
                m.clear()
                m.update(trial)
                return m
        return None
    return m if _same(pattern, value) else None  # a constant


def _same(a, b) -> bool:
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        return a is b
    try:
        return bool(a == b)
    except Exception:
        return False


def _users_ok(pattern, node: fx.Node, top: bool = True) -> bool:
    """Every `one_user` Op below the root feeds only its parent."""
    if not isinstance(pattern, Op) or not isinstance(node, fx.Node):
        return True
    if pattern.one_user and not top and len(node.users) != 1:
        return False
    args = node.args
    if pattern.commutative and len(args) >= 2 and not all(
            _users_ok(p, a, False) for p, a in zip(pattern.args, args)):
        args = (args[1], args[0], *args[2:])
    return all(_users_ok(p, a, False) for p, a in zip(pattern.args, args))


class Builder:
    """Makes the nodes of a replacement, each with its example value and TensorMeta.

    `b(aten.mm.default, x, w)` inserts the call before the matched node (`like`, whose stack
    trace the new nodes inherit). An op that cannot run on the fake values (a shape mismatch: a
    bug in a rule) raises `RuleError` naming the rule, rather than leaving a graph that lies."""

    def __init__(self, gm: fx.GraphModule, like: fx.Node, rule: str):
        self.gm, self.like, self.rule = gm, like, rule
        self.mode = None  # the graph's fake mode, found when the first node is made
        self.made: list[fx.Node] = []

    def __call__(self, target, *args, **kwargs) -> fx.Node:
        graph = self.gm.graph
        with graph.inserting_before(self.like):  # named after the op (`mm`, `permute_3`)
            node = graph.create_node("call_function", target, tuple(args), kwargs,
                                     name=getattr(target, "_opname", None))
        self.mode = self.mode or fake_mode_of(self.gm)
        value = run_fake(self.mode, node)
        if value is None:
            graph.erase_node(node)
            raise RuleError(f"fusec: rule {self.rule!r} built {target}{tuple(args)}, which "
                            "does not run on these shapes")
        set_meta(node, value, self.like)
        self.made.append(node)
        return node


class RuleError(AssertionError):
    """A rule built a replacement that cannot be right (a bug in the rule, not in the program)."""


def rewrite(gm: fx.GraphModule, rules: list[Rule]) -> list[Decision]:
    """Apply `rules` to every node until none applies; the Decisions, taken and declined."""
    decisions: list[Decision] = []
    declined: set[tuple[str, str]] = set()
    for _ in range(MAX_SWEEPS):
        changed = False
        for node in list(gm.graph.nodes):
            if node.graph is None or node.op != "call_function":
                continue  # erased by an earlier rewrite in this sweep
            for rule in rules:
                if node.target not in rule.roots:
                    continue
                done = _apply(gm, rule, node, decisions, declined)
                if done is not None:
                    changed = True
                    break
        if not changed:
            return decisions
    raise RuleError(f"fusec: rules {[r.name for r in rules]} still rewrite after {MAX_SWEEPS} "
                    "sweeps: two of them undo each other")


def _apply(gm, rule: Rule, node: fx.Node, decisions: list, declined: set) -> fx.Node | None:
    """Try one rule at one node: the replacement node if it was rewritten, else None."""
    m = match(rule.pattern, node)
    if m is None or not _users_ok(rule.pattern, node):
        return None
    b = Builder(gm, node, rule.name)
    result = rule.build(b, m)
    if isinstance(result, Declined):
        for made in reversed(b.made):
            if not made.users:
                gm.graph.erase_node(made)
        if (node.name, rule.name) not in declined:
            declined.add((node.name, rule.name))
            decisions.append(Decision(node.name, False, f"{rule.name}: {result.why}"))
        return None
    if result is node:
        return None
    why = rule.why.format(**{k: getattr(v, "name", v) for k, v in m.items()}) if rule.why else ""
    decisions.append(Decision(node.name, True, f"{rule.name}" + (f": {why}" if why else "")))
    old_args = [a for a in node.all_input_nodes]
    node.replace_all_uses_with(result)
    gm.graph.erase_node(node)
    for old in old_args:
        erase_dead(gm.graph, old)
    return result

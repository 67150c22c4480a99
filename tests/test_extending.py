"""docs/extending.md's four recipes, each done here: a new op, a graph rewrite, a new kernel family,
a new backend.

Each test makes the change at run time (a row and a mapping added to the op table, a rule, a family and a
backend registered from modules made here) and undoes it afterwards, so the recipe is checked
against today's code without editing fusec's files: the page says which file each edit belongs
in when it is made for good.
"""
from __future__ import annotations

import sys
import types

import pytest
import torch

import fusec
from conftest import TRITON_DEVICE, assert_matches
from fusec import ops
from fusec.codegen import backends, cpp, families
from fusec.ir import PointwiseKernel

aten = torch.ops.aten


def cosh_times_two(x):
    return torch.cosh(x) * 2


@pytest.mark.parametrize("backend", ["cpp", "llvm", "triton"])
def test_a_new_op_is_one_row_and_one_mapping(fresh, monkeypatch, backend):
    """Recipe 1. `torch.cosh` runs as an extern today, between two kernels; one row of the op
    table (a spelling per backend) and one ATen mapping bring it into the fused kernel."""
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    x = torch.randn(37, 5, device=device)
    before = fusec.explain(cosh_times_two, x, backend=backend).to_dict()["schedule"]
    assert "extern aten.cosh.default" in str(before)
    row = ops.Op("cosh", "(tl.exp({0}) + tl.exp(-{0})) * 0.5", "std::cosh({0})",
                 llvm="call {T} @cosh{m}({T} {0})", promote=ops.F)
    monkeypatch.setitem(ops.OPS, "cosh", row)
    monkeypatch.setitem(ops.ATEN, aten.cosh.default, ops._plain("cosh", 1))
    cf = assert_matches(cosh_times_two, x, backend=backend, kernels=1)
    assert "cosh" in cf.kernels[0].name
    after = fusec.explain(cosh_times_two, x, backend=backend).to_dict()["schedule"]
    assert "extern" not in str(after), after


def test_a_new_kernel_family_renders_the_kernels_of_its_form(fresh, monkeypatch):
    """Recipe 2. A family is a module with `render_<backend>(kernel, arch)`: here one that takes
    every pointwise kernel on the C++ backend and renders it as the core would, with a line of
    its own on top (a real family writes its own kernel: extensions/quant_gemv/)."""
    module = types.ModuleType("my_family")

    def render_cpp(kernel, arch):
        if not isinstance(kernel, PointwiseKernel):
            return families.Declined()
        monkeypatch.setattr(families, "REGISTRY", [])  # (the core's own renderer, just this once)
        try:
            return "// made by my_family\n" + cpp.render(kernel)
        finally:
            monkeypatch.setattr(families, "REGISTRY", [family])
    module.render_cpp = render_cpp
    monkeypatch.setitem(sys.modules, "my_family", module)
    monkeypatch.setattr(families, "REGISTRY", [])
    family = families.register(families.Family("mine", "my_family", ("cpp",)))
    cf = assert_matches(lambda x: torch.sin(x) * 2, torch.randn(50), backend="cpp", kernels=1)
    assert cf.kernels[0].source.startswith("// made by my_family")


def test_a_new_backend_is_a_module_and_a_registration(fresh, monkeypatch):
    """Recipe 3. A backend is a module with render, build, launcher and available, and one
    `Backend` that says what it can do. This one is the C++ backend with its own name and a
    header line: fusec.compile(fn, backend="cpp_annotated") compiles through it."""
    module = types.ModuleType("cpp_annotated")
    module.render = lambda kernel: "// cpp_annotated\n" + cpp.render(kernel)
    module.build, module.launcher, module.available = cpp.build, cpp.launcher, cpp.available
    monkeypatch.setitem(sys.modules, "cpp_annotated", module)
    monkeypatch.setattr(backends, "BACKENDS", dict(backends.BACKENDS))
    backends.register(backends.Backend(
        "cpp_annotated", devices=("cpu",), suffix=".cpp", lexer="cpp", rows_one_by_one=True,
        writes_over_dying_inputs=False, compiles_ahead=False, module_name="cpp_annotated"))
    cf = assert_matches(lambda x: torch.softmax(x, -1) * 2, torch.randn(6, 33),
                        backend="cpp_annotated")
    assert cf.kernels and all(k.source.startswith("// cpp_annotated") for k in cf.kernels)
    with pytest.raises(fusec.FusecError, match="exists already"):
        backends.register(backends.BACKENDS["cpp"])


def test_a_graph_rewrite_is_a_pattern_and_a_replacement(fresh):
    """docs/extending.md, "A graph rewrite": a rule registered with canonicalize runs in every
    compile after it, shows in explain, keys the saved programs, and comes out again."""
    from fusec.runtime.fast_start.fingerprint import environment
    from fusec.passes import patterns
    from fusec.passes.patterns import Op, Rule, Var

    spelled_out = Op(aten.reciprocal.default,
                     Op(aten.add.Tensor, Op(aten.exp.default, Op(aten.neg.default, Var("x"))), 1))
    rule = Rule("sigmoid spelled out", spelled_out,
                lambda b, m: b(aten.sigmoid.default, m.x), "1 / (1 + exp(-{x})) as sigmoid({x})")

    def f(x):
        return 1 / (1 + torch.exp(-x)) * 3

    x = torch.tensor([-200.0, -3.0, 0.0, 2.5, 90.0, float("nan")])
    before = environment("cpp")
    patterns.register(rule)
    try:
        assert environment("cpp") != before and "rule sigmoid spelled out" in environment("cpp")
        cf = assert_matches(f, x, backend="cpp", kernels=1)
        assert "aten.sigmoid.default" in cf.kernels[0].ops and \
            "aten.exp.default" not in cf.kernels[0].ops, cf.kernels[0].ops
        text = str(fusec.explain(f, x, backend="cpp"))
        assert "sigmoid spelled out: 1 / (1 + exp(-x)) as sigmoid(x)" in text
    finally:
        patterns.unregister("sigmoid spelled out")
    assert patterns.REGISTERED == [] and environment("cpp") == before
    cf = fusec.compile(f, backend="cpp")
    cf(x)
    assert "aten.exp.default" in cf.kernels[0].ops

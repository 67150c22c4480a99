"""Test helper for symbolic sizes before the runtime binds them (issue 51): compile a program of
ONE kernel for a shape family, then launch that kernel directly on inputs of other sizes.

    out = run_one_kernel(fn, example, dynamic={0: {0}}, backend="cpp", inputs=[x2])

`dynamic` is {flat input index: dims traced as symbols}. The kernel's parameters are its
pointers (inputs by placeholder name, outputs freshly allocated like eager's results), then its
size arguments (fusec.symbolic.size_params: named `x_size0`, in the order of size_symbols), each bound from the input size it stands for.
"""
from __future__ import annotations

import sympy
import torch

from fusec.capture.frontend import capture
from fusec.check import compare
from fusec.driver import compile_graph
from fusec.symbolic import size_symbols


def compile_one(fn, example, dynamic, backend):
    captured = capture(fn, tuple(example), dynamic=dynamic)
    compiled = compile_graph(captured, backend)
    assert len(compiled.kernels) == 1, [k.name for k in compiled.kernels]
    kernel = compiled.kernels[0]
    if kernel.built.error is not None:
        raise kernel.built.error
    return captured, compiled, kernel


def bind_sizes(captured, inputs) -> dict:
    """{symbol: its value for these inputs}."""
    values = {}
    placeholders = [n for n in captured.gm.graph.nodes if n.op == "placeholder"]
    for node, real in zip(placeholders, inputs):
        fake = node.meta["val"]
        for fake_sizes, real_sizes in ((fake.shape, real.shape), (fake.stride(), real.stride())):
            for f, r in zip(fake_sizes, real_sizes):
                if isinstance(f, torch.SymInt) and f.node.expr.is_Symbol:
                    values.setdefault(f.node.expr, int(r))
    return values


def run_one_kernel(fn, example, dynamic, backend, inputs, compiled_once=None):
    captured, compiled, kernel = compiled_once or compile_one(fn, example, dynamic, backend)
    expected = fn(*inputs)
    expected = expected if isinstance(expected, (tuple, list)) else [expected]
    names = [n.name for n in captured.gm.graph.nodes if n.op == "placeholder"]
    by_name = dict(zip(names, inputs))
    outs = [torch.empty_like(e) for e in expected]
    args, k = [], 0
    for p in kernel.ir.params:
        if p.is_output:
            args.append(outs[k])
            k += 1
        else:
            args.append(by_name[p.name])
    sizes = bind_sizes(captured, inputs)
    kernel.launcher(*args, *[sizes[s] for s in size_symbols(kernel.ir)])
    return outs, expected, (captured, compiled, kernel)


def randn(*shape, dtype=torch.float32, seed=0, device="cpu"):
    """Seeded inputs: normal floats, or integers in [-50, 50) for an integer dtype."""
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=gen).to(dtype)
    else:
        t = torch.randint(-50, 50, shape, generator=gen).to(dtype)
    return t.to(device)


def guards_pinning(captured) -> list[str]:
    """The guards that pin a symbol to one number (`Eq(s26, 37)`): none may remain."""
    out = []
    for g in captured.shape_env.guards:
        expr = g.expr
        if isinstance(expr, sympy.Eq) and (expr.lhs.is_Number or expr.rhs.is_Number):
            out.append(str(expr))
    return out


def check_outputs(what: str, fn, inputs, outs, expected, source: str) -> None:
    """Each output as close to eager's as the project's check allows, judged against a float64
    reference (fusec.check.compare)."""
    wide = fn(*[t.double() if t.is_floating_point() else t for t in inputs])
    wide = wide if isinstance(wide, (tuple, list)) else [wide]
    for got, want, ref in zip(outs, expected, wide):
        problem = compare(got, want, ref if want.is_floating_point() else None)
        assert problem is None, f"{what}: {problem}\n{source}"

"""Symbolic sizes in the LLVM backend (issue 51; codegen/llvm/sizes.py): a kernel compiled once
for a shape family takes its sizes as `i64` arguments between its pointers and its range of work,
computes the sizes it uses from them in its entry block, and is right at every size of the family.

Each case compiles a one-kernel program with some dims traced as symbols (tests/dynamic_harness.py)
at one example size, then launches that same build on inputs of many other sizes: primes, 2 and 3,
sizes below and far above the traced one (a chunk, a block or a layout chosen from the traced size
must still be right), and one large enough that the launcher splits the work across threads (the
kernel's `tiles_for` and `parallel_for` functions answer per call). Every result is compared with
eager (float64-referenced for floats, exact for ints), and the shape family must really be every
size: no guard pins a symbol to one number.
"""
import ctypes
import itertools
import re

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch.utils._sympy import functions as sym

from dynamic_harness import bind_sizes, check_outputs, compile_one, guards_pinning, run_one_kernel
from dynamic_harness import randn as _randn
from fusec.codegen import llvm
from fusec.codegen.llvm.sizes import Sizes
from fusec.symbolic import size_params

SIZES = [1, 2, 3, 7, 13, 127, 1031]




# (id, fn, inputs(n) -> list of tensors, dynamic {input: dims}, example n, sizes launched)
CASES = [
    ("flat", lambda x: torch.sin(x) * 2, lambda n: [_randn(n, 5)], {0: {0}}, 37,
     SIZES + [30000]),
    ("broadcast_row", lambda x, y: x * y + 1, lambda n: [_randn(n, 33), _randn(33, seed=1)],
     {0: {0}}, 64, SIZES + [20000]),
    ("inner_dynamic", lambda x, y: torch.relu(x - y), lambda n: [_randn(7, n), _randn(7, 1, seed=1)],
     {0: {1}}, 100, SIZES + [100000]),
    ("long_row_chunks", lambda x: torch.exp(x) * 2, lambda n: [_randn(3, n)], {0: {1}}, 20000,
     SIZES + [8192, 8193, 50000]),
    ("transposed", lambda x, y: x.t() * 2 + y, lambda n: [_randn(n, 40), _randn(40, n, seed=1)],
     {0: {0}, 1: {1}}, 50, SIZES + [20000]),
    ("transposed_rows", lambda x, y: x.t() * 2 + y, lambda n: [_randn(40, n), _randn(n, 40, seed=1)],
     {0: {1}, 1: {0}}, 50, SIZES + [20000]),
    ("step_slice", lambda x: x[::2] * 2, lambda n: [_randn(n, 6)], {0: {0}}, 21,
     [3, 4, 7, 13, 127, 1031, 40001]),  # (1 and 2 leave one row: another program)
    ("offset_slice", lambda x: x[:, 3:] + 1, lambda n: [_randn(4, n)], {0: {1}}, 40,
     [5, 7, 13, 127, 1031, 100000]),
    ("cat_beside_dynamic", lambda x, y: torch.cat([x, y], 1).relu() * 2,
     lambda n: [_randn(n, 5), _randn(n, 3, seed=1)], {0: {0}, 1: {0}}, 12, SIZES + [30000]),
    ("cat_along_dynamic", lambda x, y: torch.cat([x, y], 0) * 2,
     lambda n: [_randn(n, 5), _randn(4, 5, seed=1)], {0: {0}}, 12, SIZES + [30000]),
    ("half", lambda x: torch.sigmoid(x * 2 + 1) * x, lambda n: [_randn(n, 30, dtype=torch.float16)],
     {0: {0}}, 40, SIZES + [30000]),
    ("bfloat16", lambda x, y: torch.exp(x) * y, lambda n: [_randn(n, 3, dtype=torch.bfloat16),
                                                           _randn(3, dtype=torch.bfloat16, seed=1)],
     {0: {0}}, 9, SIZES + [100000]),
    ("int32", lambda x: x * 3 - 7, lambda n: [_randn(n, 10, dtype=torch.int32)], {0: {0}}, 11,
     SIZES + [60000]),
    ("int64_floordiv", lambda x: torch.div(x, 3, rounding_mode="floor") + torch.where(x > 0, x, -x),
     lambda n: [_randn(n, 6, dtype=torch.int64)], {0: {0}}, 11, SIZES + [60000]),
    ("softmax_rows", lambda x: torch.softmax(x, -1), lambda n: [_randn(n, 64)], {0: {0}}, 20,
     SIZES + [8000]),
    ("softmax_k", lambda x: torch.softmax(x, -1), lambda n: [_randn(6, n)], {0: {1}}, 100,
     SIZES + [70000]),
    ("sum_k", lambda x: x.sum(-1), lambda n: [_randn(4, n)], {0: {1}}, 50, SIZES + [300000]),
    ("sum_k_half", lambda x: x.sum(-1), lambda n: [_randn(3, n, dtype=torch.float16)], {0: {1}},
     50, SIZES + [50000]),
    ("sum_k_int64", lambda x: x.sum(-1), lambda n: [_randn(5, n, dtype=torch.int64)], {0: {1}},
     20, SIZES + [40000]),
    ("mean_var", lambda x: (x.mean(-1), x.var(-1)), lambda n: [_randn(n, 48)], {0: {0}}, 30,
     SIZES + [20000]),
    ("mean_k", lambda x: x.mean(-1), lambda n: [_randn(5, n)], {0: {1}}, 30, SIZES + [50000]),
    ("var_k", lambda x: x.var(-1), lambda n: [_randn(5, n)], {0: {1}}, 30, SIZES + [50000]),
    ("layer_norm", lambda x, w, b: F.layer_norm(x, (96,), w, b),
     lambda n: [_randn(n, 96), _randn(96, seed=1), _randn(96, seed=2)], {0: {0}}, 17,
     SIZES + [10000]),
    ("argmax_k", lambda x: x.argmax(-1), lambda n: [_randn(9, n)], {0: {1}}, 40, SIZES + [50000]),
    ("sum_over_rows", lambda x: (x * 2).sum(0), lambda n: [_randn(n, 70)], {0: {0}}, 300,
     SIZES + [40000]),
    ("columns_last_dynamic", lambda x: x.sum(0), lambda n: [_randn(40, n)], {0: {1}}, 100,
     SIZES + [50000]),
    ("channel_softmax", lambda x: torch.softmax(x, 1), lambda n: [_randn(n, 12, 4, 4)], {0: {0}}, 3,
     SIZES + [3000]),
    ("channel_amax", lambda x: x.amax(1), lambda n: [_randn(2, n, 5, 6)], {0: {1}}, 10,
     SIZES + [9000]),
    ("amax_rows_k", lambda x: x.amax(-1), lambda n: [_randn(n, n)], {0: {0, 1}}, 20,
     [2, 3, 13, 127, 1031]),
]




def _in_family(captured, inputs) -> None:
    """The sizes of `inputs` satisfy every guard of the program: a launch the family covers."""
    values = bind_sizes(captured, inputs)
    env = captured.shape_env
    for g in env.guards:
        expr = g.expr.xreplace(env.replacements)  # (a symbol found equal to another: that one)
        expr = expr.xreplace({s: values[s] for s in expr.free_symbols})
        assert bool(expr), f"sizes {values} break the guard {g.expr}: not in the family"




@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_one_build_for_every_size(case):
    name, fn, make, dynamic, example, sizes = case
    captured, compiled, kernel = once = compile_one(fn, make(example), dynamic, "llvm")
    names = size_params(kernel.ir)
    assert names, "the kernel takes no size argument: it was compiled for one size"
    define = next(line for line in kernel.source.splitlines() if line.startswith("define void"))
    assert ", ".join(f"i64 %{s}" for s in names) + ", i64 %" in define, define
    obj, fn_address = kernel.launcher.lib, kernel.launcher.address
    for n in sizes:
        inputs = make(n)
        _in_family(captured, inputs)
        outs, expected, again = run_one_kernel(fn, None, dynamic, "llvm", inputs, compiled_once=once)
        assert again[2] is kernel  # the same build, launched again
        assert kernel.launcher.lib == obj and kernel.launcher.address == fn_address
        check_outputs(f"{name} at n={n}", fn, inputs, outs, expected, kernel.source)
    assert not guards_pinning(captured), guards_pinning(captured)


def _sized_launch(kernel, n_rows):
    """The launcher's work and thread answers for a kernel of rows `n_rows` (one size)."""
    launcher = kernel.launcher
    work = launcher.work if launcher.tiles_for is None else launcher.tiles_for(n_rows)
    parallel = launcher.parallel if launcher.parallel_for is None else launcher.parallel_for(n_rows)
    return work, parallel


def test_work_and_threads_are_asked_per_call():
    """A kernel whose work depends on its sizes exports `tiles_for` and `parallel_for` in place of
    the constants `tiles` and `parallel`; the launcher asks them at each launch: one thread at
    the traced size, several (one range per thread, every tile once) at a large one."""
    fn = lambda x, y: torch.exp(x) + y  # noqa: E731
    make = lambda n: [_randn(n, 64), _randn(64, seed=1)]  # noqa: E731
    captured, compiled, kernel = once = compile_one(fn, make(10), {0: {0}}, "llvm")
    src = kernel.source
    assert f"@{kernel.ir.name}.tiles_for(i64 %" in src and f"@{kernel.ir.name}.parallel_for(" in src
    assert ".tiles = constant" not in src and ".parallel = constant" not in src
    assert "threads: chosen per call" in src
    assert _sized_launch(kernel, 10) == (10, False)
    work, parallel = _sized_launch(kernel, 20000)
    assert work == 20000 and parallel
    for n in (10, 20000):
        outs, expected, _ = run_one_kernel(fn, None, {0: {0}}, "llvm", make(n), compiled_once=once)
        check_outputs(f"n={n}", fn, make(n), outs, expected, src)


@pytest.mark.parametrize("parts", [2, 3, 7])
@pytest.mark.parametrize("openmp", [True, False], ids=["openmp", "thread_pool"])
def test_any_number_of_parts_with_sizes(parts, openmp, monkeypatch):
    """Split across threads, the sizes travel with each part: through the OpenMP trampoline's
    frame (one per number of pointers and sizes) or the fallback pool's calls."""
    if not openmp:
        monkeypatch.setattr(llvm, "gomp_parallel", lambda: None)
    monkeypatch.setattr(llvm.LlvmLauncher, "parts",
                        lambda self, work=None, parallel=None:
                        min(parts, self.work if work is None else work))
    for fn, make, dynamic in [
            (lambda x: torch.sin(x) + 1, lambda n: [_randn(n, 301)], {0: {0}}),
            (lambda x: torch.softmax(x, -1), lambda n: [_randn(n, 301)], {0: {0}}),
            (lambda x: x.sum(0), lambda n: [_randn(50, n)], {0: {1}})]:
        once = compile_one(fn, make(100), dynamic, "llvm")
        for n in (5, 333, 1000):
            outs, expected, _ = run_one_kernel(fn, None, dynamic, "llvm", make(n),
                                               compiled_once=once)
            check_outputs(f"n={n}", fn, make(n), outs, expected, once[2].source)
    if openmp:  # trampolines keyed by (pointers, sizes) for kernels that take sizes
        assert (2, 1) in llvm._TRAMPOLINES


def test_static_kernel_takes_no_sizes():
    """Without symbols the kernel is the one it always was: constants, pointers only."""
    fn = lambda x: torch.sin(x) * 2  # noqa: E731
    _, _, kernel = compile_one(fn, [_randn(37, 5)], {}, "llvm")
    assert size_params(kernel.ir) == []
    assert f"@{kernel.ir.name}.tiles = constant i64 1" in kernel.source
    assert "_for(" not in kernel.source and "%size." not in kernel.source
    define = next(line for line in kernel.source.splitlines() if line.startswith("define void"))
    assert "i64 %s" not in define and define.endswith("i64 %tile_first, i64 %tile_last) #0 {")


# ---- the size expressions themselves ---------------------------------------------------------

A, B = sympy.Symbol("s0", integer=True), sympy.Symbol("s1", integer=True)
EXPRESSIONS = [
    A * B + 3, 64 * A - 5, sym.FloorDiv(A - 7, 3), sym.PythonMod(A - 7, 3), sym.FloorDiv(A, B),
    sym.PythonMod(A, B), sym.FloorDiv(A * 4 + 1, B), sym.ModularIndexing(A + 20, 2, 5),
    sym.CeilDiv(A + 20, 3), sym.Max(A, B, 4), sym.Min(A, B), sym.PowByNatural(A, 3),
    -sym.FloorDiv(-A, 8),
]


def _compiled(expr):
    """A function `i64 f(i64 s0, i64 s1)` returning `expr`, spelled by llvm/sizes.py."""
    sizes = Sizes(itertools.count())
    value = sizes.operand(expr)
    declared = sorted({f"declare i64 @{m}(i64, i64)" for m in
                       re.findall(r"@(llvm\.s(?:max|min)\.i64)", "\n".join(sizes.lines))})
    text = "\n".join([*declared, "define i64 @f(i64 %s0, i64 %s1) {", "entry:",
                      *["  " + line for line in sizes.lines], f"  ret i64 {value}", "}"])
    binding = llvm.llvm_binding()
    module = binding.parse_assembly(text)
    module.triple = llvm.triple_and_layout()[0]
    module.verify()
    engine = binding.create_mcjit_compiler(module, llvm.target_machine())
    engine.finalize_object()
    f = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)(
        engine.get_function_address("f"))
    return engine, f, text


@pytest.mark.parametrize("expr", EXPRESSIONS, ids=[str(e) for e in EXPRESSIONS])
def test_size_expressions_round_like_python(expr):
    """Integer division and remainder round towards minus infinity, as Python's and sympy's do,
    also where an operand is negative (LLVM's sdiv/srem round towards zero)."""
    engine, f, text = _compiled(expr)
    for a in range(-12, 13):
        for b in (-5, -3, -1, 1, 2, 3, 7):
            want = expr.subs({A: a, B: b})
            if not want.is_Integer:
                continue  # (an operation sympy leaves unevaluated at these numbers)
            assert f(a, b) == int(want), f"{expr} at s0={a}, s1={b}:\n{text}"

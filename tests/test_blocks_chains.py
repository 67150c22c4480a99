"""Chains of math calls in blocks, a loop per call (Note: blocks for chains of math calls in
codegen/cpp/half_blocks.py; the LLVM side in codegen/llvm/blocks.py).

A kernel whose longest dependent chain holds CHAIN_CALLS or more opaque math calls (sin, cos,
log, ...) runs a block of positions at a time, one loop per call. These tests check the rule
(which kernels are cut, and that the kernel's comment says why), the answers against eager on
both CPU backends (odd lengths that leave a short last block, an empty input, a non-contiguous
input, a broadcast operand, NaN and infinities, float32 / float16 / bfloat16), and that every
loop of a cut kernel is still vectorized on the x86-64 levels (baseline, AVX2, AVX-512).
"""
import pytest
import torch

import fusec
from conftest import CPU_BACKENDS
from fusec.codegen import cpp, llvm
from fusec.codegen.cpp import half_blocks
from fusec.codegen.llvm import compiler as llvm_build
from gcc_vector_report import LEVELS, NEEDS_CPP, TARGETS, X86, compile_report, packed, simd_loops

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CUT = "math calls in a chain"


def chain(x):
    """sin, cos, sin: three calls, each waiting for the last."""
    return torch.sin(torch.cos(torch.sin(x) * 1.5) + 0.25)


def chain_with_operands(x, y):
    """Two calls in a chain, and x and y read again after them (a value kept across loops)."""
    return torch.log(torch.cos(x * y) + 2.0) * x + y


def one_call(x):
    return torch.sin(x) * 2 + torch.cos(x)  # two calls side by side: a chain of one


def _ir(fn, *args):
    kernels = fusec.explain(fn, *args, backend="llvm").compiled.kernels
    assert len(kernels) == 1
    return kernels[0].ir


def test_the_rule_counts_calls_in_a_chain():
    x = torch.randn(300)
    assert half_blocks.chained_calls(_ir(chain, x)) == 3
    assert half_blocks.chained_calls(_ir(chain_with_operands, x, x)) == 2
    assert half_blocks.chained_calls(_ir(one_call, x)) == 1


@pytest.mark.parametrize("fn, cut", [(chain, True), (one_call, False)], ids=["chain", "one"])
def test_the_kernel_comment_names_the_cut(fn, cut):
    ir = _ir(fn, torch.randn(300))
    for text in (llvm.render(ir), cpp.render(ir) if cpp.available() else ""):
        if text:
            assert (CUT in text) == cut


def _inputs(dtype, n):
    x = torch.randn(n) * 4
    if n >= 8:
        x[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
    return x.to(dtype)


def _close(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[want.dtype]
    # (float16/bfloat16: SLEEF's and libmvec's float answers may differ by an ulp of float32,
    # which can round to the neighbouring half)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, equal_nan=True)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [0, 1, 255, 257, 1000, 4099])
def test_a_chain_matches_eager(backend, dtype, n):
    if backend == "cpp" and not cpp.available():
        pytest.skip("no C++ compiler")
    x = _inputs(dtype, n)
    _close(fusec.compile(chain, backend=backend)(x), chain(x))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_and_broadcast_operands(backend, dtype):
    if backend == "cpp" and not cpp.available():
        pytest.skip("no C++ compiler")
    x = _inputs(dtype, 2 * 37 * 301).view(37, 602)[:, ::2]  # rows of 301, every other value
    y = _inputs(dtype, 301)  # the same row for every row of x
    _close(fusec.compile(chain_with_operands, backend=backend)(x, y), chain_with_operands(x, y))
    rows = torch.randn(37, 1).to(dtype)  # the same value along a row: computed once per row
    _close(fusec.compile(chain_with_operands, backend=backend)(x, rows),
           chain_with_operands(x, rows))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_sizes_that_are_arguments(backend, dtype):
    """A shape family's kernel (fusec/symbolic.py): rows and row length are arguments, one build."""
    from dynamic_harness import check_outputs, compile_one, randn, run_one_kernel
    if backend == "cpp" and not cpp.available():
        pytest.skip("no C++ compiler")
    make = lambda rows, n: [randn(rows, n, dtype=dtype), randn(n, dtype=dtype, seed=1)]  # noqa: E731
    dynamic = {0: {0, 1}, 1: {0}}  # (x: both dims; y: its length, which is x's row)
    once = compile_one(chain_with_operands, make(3, 300), dynamic, backend)
    assert CUT in once[2].source
    for rows, n in ((3, 300), (5, 1), (2, 1031)):
        inputs = make(rows, n)
        outs, expected, _ = run_one_kernel(chain_with_operands, None, dynamic, backend, inputs,
                                           compiled_once=once)
        check_outputs(f"{rows}x{n}", chain_with_operands, inputs, outs, expected, once[2].source)


# ---- every loop still vectorized ---------------------------------------------------------------

@X86
@NEEDS_CPP
@pytest.mark.parametrize("name", LEVELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpp_block_loops_are_vectorized_for(name, dtype, tmp_path):
    source = cpp.render(_ir(chain_with_operands, torch.randn(4099).to(dtype),
                            torch.randn(4099).to(dtype)))
    assert CUT in source
    report = compile_report(source, name, tmp_path)
    loops = simd_loops(report.lines)
    assert len(loops) >= 3, "expected a loop per call and one for the rest"
    for loop in loops:
        assert report.vectorized(loop), \
            f"the loop at lines {loop.first + 1}-{loop.last + 1} is not vectorized with " \
            f"{report.target.width}-byte vectors:\n" + "\n".join(report.said(loop))


@X86
@pytest.mark.parametrize("name", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_llvm_block_loops_are_vectorized_for(name, dtype):
    from test_half_vectorized import ISAS
    cpu, reg = TARGETS[name].llvm_cpu, TARGETS[name].reg
    target = llvm_build.Target(name, llvm_build.X86, cpu, "", ISAS[reg])
    ir = _ir(chain_with_operands, torch.randn(4099).to(dtype), torch.randn(4099).to(dtype))
    text = llvm.render(ir, target)
    assert CUT in text
    asm = llvm.assembly(text, ir.name, target)
    # (an AVX-512 target that is not this machine gets LLVM's default of 256-bit vectors, the
    # one loop as well: 512 is asked for on the host only, llvm/ir.py function_attributes)
    regs = [reg, "ymm"] if reg == "zmm" else [reg]
    assert any(packed(asm, "mulps", r) and packed(asm, "addps", r) for r in regs), \
        f"LLVM for {cpu}: the block loops' math is not packed on {' or '.join(regs)} registers"

"""float32 exp and log1p on the CPU are fusec's own inline code, and a loop over them is vectorized.

`fusec_exp_f32` and `fusec_log1p_f32` (codegen/cpp/templates/cpp_prelude.h; `@fusec_exp.f32` and
`@fusec_log1p.f32` in llvm_prelude.ll.j2) are plain arithmetic, integer bit moves and selects, with
no library call: torch's SLEEF functions were a call per vector of values, and a loop with a call
in it spills its registers around it (and gcc 12 left some such loops scalar). These tests compile
a few such loops (a lone exp and log1p, softmax's exp, mish's one exp and division, softplus's
log1p(exp(x))) for baseline x86-64 (SSE2), x86-64-v3 (AVX2) and x86-64-v4 (AVX-512) with gcc and
with LLVM, whatever this machine is, and read the assembly: every `#pragma omp simd` loop
vectorized with the target's widest vectors (gcc's report), packed multiplies on those registers,
and no call to an exp or log1p function anywhere. The answers are tests/test_math_accuracy.py's.
"""
import re

import pytest
import torch
import torch.nn.functional as F

import fusec
from fusec.codegen import cpp, llvm
from fusec.codegen.llvm import compiler as llvm_build
from gcc_vector_report import LEVELS, NEEDS_CPP, TARGETS, X86, compile_report, packed, simd_loops

LOOPS = {
    "exp": (torch.exp, (4099,)),
    "softmax": (lambda x: torch.softmax(x, dim=-1), (16, 1000)),
    "mish": (F.mish, (4099,)),
    "log1p": (torch.log1p, (4099,)),
    "softplus": (F.softplus, (4099,)),
}
# a call to exp or log1p in any of their spellings (expf, SLEEF's and libmvec's vector names),
# not expm1's or exp2's
EXP_CALL = re.compile(r"^\s*call\w*\s+\S*(exp(?!m1|2)|log1p)\w*", re.M)
ISAS = {"xmm": llvm_build.NAMED_TARGETS["x86-64"].vector_isas,
        "ymm": llvm_build.NAMED_TARGETS["haswell"].vector_isas,
        "zmm": llvm_build.NAMED_TARGETS["skylake-avx512"].vector_isas}


def _kernels(name):
    fn, shape = LOOPS[name]
    return fusec.explain(fn, torch.randn(*shape), backend="llvm").compiled.kernels


@X86
@NEEDS_CPP
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", list(LOOPS))
def test_cpp_loop_is_vectorized_without_a_call(name, level, tmp_path):
    for kernel in _kernels(name):
        report = compile_report(cpp.render(kernel.ir), level, tmp_path)
        loops = simd_loops(report.lines)
        assert loops, "no simd loop in the kernel"
        for loop in loops:
            assert report.vectorized(loop), \
                f"{name}: the loop at lines {loop.first + 1}-{loop.last + 1} is not vectorized " \
                f"with {report.target.width}-byte vectors:\n" + "\n".join(report.said(loop))
        assert report.packed("mulps"), f"{name}: no packed multiply on {report.target.reg}"
        found = EXP_CALL.search(report.assembly)
        assert found is None, f"{name} for {level}: {found.group(0).strip()}"


@X86
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", list(LOOPS))
def test_llvm_loop_is_vectorized_without_a_call(name, level):
    cpu, reg = TARGETS[level].llvm_cpu, TARGETS[level].reg
    target = llvm_build.Target(level, llvm_build.X86, cpu, "", ISAS[reg])
    # a named target gets LLVM's own preference on AVX-512 (256-bit vectors; llvm/ir.py
    # function_attributes asks for 512 only on this machine, where torch runs AVX512 kernels)
    reg = "[yz]mm" if reg == "zmm" else reg
    for kernel in _kernels(name):
        text = llvm.render(kernel.ir, target)
        assert "@fusec_exp.f32" in text or "@fusec_log1p.f32" in text
        assert not re.search(r"call float @(expf|log1pf)\(", text)
        asm = llvm.assembly(text, kernel.ir.name, target)
        assert packed(asm, "mulps", reg), f"{name}: LLVM for {cpu}: no packed multiply on {reg}"
        assert packed(asm, "fmadd\\d+ps" if level != "x86-64" else "mulps", reg)
        found = EXP_CALL.search(asm)
        assert found is None, f"{name}: LLVM for {cpu}: {found.group(0).strip()}"

"""float16 and bfloat16 kernels on the CPU: vectorized on every x86-64 level, and torch's bits.

Half-precision values live in memory as 16 bits and in registers as float32; the conversions at
a kernel's loads, stores and per-op roundings are integer and float operations with packed forms
on every x86-64 level (cpp_prelude.h: Note on vectorized half precision; llvm_prelude.ll.j2 spells
the same steps). Two things can go wrong, and these tests look at both:

* speed: a conversion the compiler cannot vectorize (gcc 12's `_Float16`, a branch) leaves the
  whole loop scalar, 4-16x slower. So a float16 and a bfloat16 kernel are compiled to assembly
  for named CPUs (baseline x86-64, x86-64-v3 = AVX2, x86-64-v4 = AVX-512, Sapphire Rapids =
  AVX-512-FP16) by gcc and by LLVM, and the loop must use packed instructions as wide as the
  CPU's vectors for the conversions (shifts by 13 or 16 bits) and for the math (mulps/addps).
  Compiling for a CPU this machine lacks is fine; running its code is not, so only the targets
  /proc/cpuinfo allows also run.
* answers: every 16-bit pattern is widened, and float32 values chosen to hit every rounding case
  (each half value, the midpoints between neighbours and one ulp either side, random bit
  patterns, NaNs with payloads, infinities, subnormals, overflow) are narrowed and rounded in
  registers, on both backends and on each runnable target, and compared bit for bit with torch.
"""
import re

import pytest
import torch

import fusec
from fusec.codegen import cpp, llvm
from fusec.codegen.llvm import compiler as llvm_build
from gcc_vector_report import (LEVELS, NEEDS_CPP, TARGETS, X86, compile_report, packed, runs_here,
                               simd_loops)

HALVES = [torch.float16, torch.bfloat16]
SHIFT = {torch.float16: 13, torch.bfloat16: 16}  # the bits between a half and a float mantissa


def _chain(x):
    return torch.sigmoid(x * 2 + 1) * x


# the named CPUs, gcc's report and the assembly's packed instructions: tests/gcc_vector_report.py;
# LLVM's vector ISAs for a target's widest register
ISAS = {"xmm": llvm_build.NAMED_TARGETS["x86-64"].vector_isas,
        "ymm": llvm_build.NAMED_TARGETS["haswell"].vector_isas,
        "zmm": llvm_build.NAMED_TARGETS["skylake-avx512"].vector_isas}


def _kernel(half):
    """The fused kernel IR of `_chain` over `half` values (one pointwise kernel)."""
    kernels = fusec.explain(_chain, torch.randn(4099).to(half), backend="llvm").compiled.kernels
    assert len(kernels) == 1
    return kernels[0].ir


# half conversions by a call into libgcc, one value at a time
SCALAR = re.compile(r"\b(__extendhfsf2|__truncsfhf2|__truncsfbf2|__extendbfsf2)\b")


def _assert_vectorized(asm: str, half, reg: str, where: str) -> None:
    """Packed conversions and packed math on `reg` registers, and no one-value conversion. A
    conversion is either the hardware's (F16C's vcvtph2ps/vcvtps2ph, or AVX512-FP16's `x` forms)
    or integer code (shifts by 13 or 16 bits each way); the math is float (mulps, addps) or,
    where LLVM proves it gives the same bits, AVX512-FP16's own (vmulph, vaddph, on half as
    many bits)."""
    shift = SHIFT[half]
    hardware = packed(asm, "cvtph2psx?", reg) and packed(asm, "cvtps2phx?", reg)
    if not hardware:
        assert packed(asm, f"pslld\\s+\\${shift},", reg), f"{where}: no packed widening on {reg}"
        assert packed(asm, f"psr[al]d\\s+\\${shift},", reg), f"{where}: no packed narrowing on {reg}"
    for op, what in (("mul", "multiply"), ("add", "add")):  # (16 halves fill a ymm register)
        assert packed(asm, f"{op}ps", reg) or packed(asm, f"{op}ph", "[xyz]mm"), \
            f"{where}: no packed {what} on {reg} registers"
    found = SCALAR.search(asm)
    assert found is None, f"{where}: converts one value at a time ({found.group(0)})"
    # AVX512-FP16's one-value conversions only next to packed ones (a loop's last few elements)
    if re.search(r"\bvcvt(sh2ss|ss2sh)\b", asm):
        assert hardware, f"{where}: converts one value at a time (vcvtsh2ss)"


@X86
@NEEDS_CPP
@pytest.mark.parametrize("name", list(TARGETS))
@pytest.mark.parametrize("half", HALVES, ids=str)
def test_cpp_loop_is_vectorized_for(name, half, tmp_path):
    report = compile_report(cpp.render(_kernel(half)), name, tmp_path)
    # gcc's own report: every `#pragma omp simd` loop of the kernel (the inner loop, or the
    # loops of a float16 block: codegen/cpp/half_blocks.py) is vectorized with the CPU's vectors.
    loops = simd_loops(report.lines)
    assert loops, "no simd loop in the kernel"
    for loop in loops:
        assert report.vectorized(loop), \
            f"the loop at lines {loop.first + 1}-{loop.last + 1} is not vectorized with " \
            f"{report.target.width}-byte vectors:\n" + "\n".join(report.said(loop))
    _assert_vectorized(report.assembly, half, report.target.reg,
                       f"g++ {' '.join(report.target.arch)}")


@X86
@pytest.mark.parametrize("name", list(TARGETS))
@pytest.mark.parametrize("half", HALVES, ids=str)
def test_llvm_loop_is_vectorized_for(name, half):
    cpu, reg = TARGETS[name].llvm_cpu, TARGETS[name].reg
    target = llvm_build.Target(name, llvm_build.X86, cpu, "", ISAS[reg])
    ir = _kernel(half)
    asm = llvm.assembly(llvm.render(ir, target), ir.name, target)
    _assert_vectorized(asm, half, reg, f"LLVM for {cpu}")
    if half == torch.float16 and name != "x86-64":  # F16C: the hardware converts (ir.has_f16c)
        assert packed(asm, "cvtps2phx?", reg), f"LLVM for {cpu}: float16 not converted by F16C"


# ---- answers, bit for bit ------------------------------------------------------------------------

def _every_pattern(half) -> torch.Tensor:
    return torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(half)


def _narrowing_inputs(half) -> torch.Tensor:
    """float32 values that reach every case of rounding to `half`."""
    exact = _every_pattern(half).to(torch.float32)
    finite = exact[torch.isfinite(exact)].unique()  # sorted
    mid = ((finite[:-1].double() + finite[1:].double()) / 2).float()  # exact: a half has fewer bits
    bits = mid.view(torch.int32)
    g = torch.Generator().manual_seed(0)
    noise = torch.randint(-2 ** 31, 2 ** 31, (300_000,), generator=g, dtype=torch.int64)
    nans = torch.tensor([0x7f800001, 0x7fc00000, 0x7fa00000, 0x7fffffff, 0x7f802000, 0x7fbfe000,
                         0xff800001, 0xffc00000, 0xffffe000, 0x7f810000, 0xff818000],
                        dtype=torch.int64).to(torch.int32).view(torch.float32)  # payloads, signs
    specials = torch.tensor([0.0, -0.0, 65504.0, 65519.996, 65520.0, -65520.0, 65536.0, 3.4e38,
                             -3.4e38, float("inf"), float("-inf"), 2.0 ** -24, 2.0 ** -25,
                             -2.0 ** -25, 2.0 ** -25 * 1.0000001, 2.0 ** -14, 2.0 ** -14 * 0.99999,
                             6.1e-5, 1e-45, -1e-45, 1.17549435e-38, 3.3895314e38, 3.3961776e38])
    return torch.cat([exact, mid, (bits - 1).view(torch.float32), (bits + 1).view(torch.float32),
                      noise.to(torch.int32).view(torch.float32), nans, specials])


def _bf16_nan_bits_are_torchs() -> bool:
    """torch's own NaN for a float -> bfloat16 conversion depends on its kernels: 0xffff with
    AVX2 and AVX-512 (what fusec writes), c10's 0x7fc0 in the DEFAULT build."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _same_bits(got: torch.Tensor, want: torch.Tensor, nan_bits: bool = True) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    int_type = {2: torch.int16, 4: torch.int32}[want.element_size()]
    keep = torch.ones_like(want, dtype=torch.bool) if nan_bits else ~torch.isnan(want)
    if not nan_bits:
        assert torch.equal(torch.isnan(got), torch.isnan(want)), "NaNs differ from eager's"
    g, w = got[keep].view(int_type), want[keep].view(int_type)
    bad = (g != w).nonzero().flatten()
    assert bad.numel() == 0, (f"{bad.numel()} values differ; first: got {hex(g[bad[0]].item() & 0xffffffff)}"
                              f" want {hex(w[bad[0]].item() & 0xffffffff)}")


def _widen(x):
    return x.to(torch.float32)


def _narrow(x, half):
    return x.to(half)


def _round_in_registers(x, half):
    """x rounded to `half` inside the kernel and kept as float (fusec_round_f16/bf16)."""
    return x.to(half).to(torch.float32) * 1.0


def _backends():
    """(label, backend, gcc -march flags or None) for each way this machine can run a kernel."""
    out = [("llvm-host", "llvm", None)]
    if cpp.available():
        out.append(("cpp-native", "cpp", None))
        out += [(f"cpp-{name}", "cpp", list(TARGETS[name].arch)) for name in LEVELS
                if llvm.host().triple.startswith("x86_64") and runs_here(name)]
    return out


@pytest.fixture
def compiled(monkeypatch, tmp_path):
    def compile(fn, backend, arch):
        if arch is not None:  # the C++ backend built for an older CPU than this one, in a cache
            # directory of its own (fusec keeps built kernels in memory by directory and source)
            monkeypatch.setattr(cpp, "FLAGS", [f for f in cpp.FLAGS if f != "-march=native"] + arch)
            monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / arch[0].lstrip("-")))
        return fusec.compile(fn, backend=backend)
    return compile


@pytest.mark.parametrize("label,backend,arch", _backends(), ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("half", HALVES, ids=str)
def test_conversions_are_torchs_bit_for_bit(half, label, backend, arch, compiled, tmp_path):
    patterns = _every_pattern(half)
    _same_bits(compiled(_widen, backend, arch)(patterns), _widen(patterns))
    x = _narrowing_inputs(half)
    nan_bits = half == torch.float16 or _bf16_nan_bits_are_torchs()
    narrow = lambda x: _narrow(x, half)  # noqa: E731
    _same_bits(compiled(narrow, backend, arch)(x), narrow(x), nan_bits)
    rounded = lambda x: _round_in_registers(x, half)  # noqa: E731
    _same_bits(compiled(rounded, backend, arch)(x), rounded(x), nan_bits)
    if arch is not None:  # the kernels that ran are the ones built for `arch`
        assert list(tmp_path.rglob("*.so")), f"nothing was built for {arch}"


# ---- whole kernels against eager -----------------------------------------------------------------

def _inputs(half):
    g = torch.Generator().manual_seed(1)
    odd = (torch.randn(4099, generator=g) * 4).to(half)
    odd[::97] = float("nan")
    odd[5], odd[6] = float("inf"), float("-inf")
    grid = (torch.randn(37, 53, generator=g) * 3).to(half)
    return {"empty": torch.empty(0, dtype=half), "one": odd[:1], "tail": odd,
            "transposed": grid.t(), "strided": odd[::3], "subnormal": (odd * 2 ** -20).to(half)}


def _reductions(x):
    return x.sum(-1), x.amax(-1), torch.softmax(x, -1)


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
@pytest.mark.parametrize("half", HALVES, ids=str)
def test_kernels_match_eager(backend, half):
    if backend == "cpp" and not cpp.available():
        pytest.skip("no C++ compiler")
    for label, x in _inputs(half).items():
        got, want = fusec.compile(_chain, backend=backend)(x), _chain(x)
        torch.testing.assert_close(got, want, equal_nan=True, msg=lambda m: f"{label}: {m}")
        if x.dim() == 2 and x.numel():
            fused = fusec.compile(_reductions, backend=backend)(x)
            for g, w in zip(fused, _reductions(x)):
                # eager sums half values in float and rounds once, as fusec does; the order differs
                torch.testing.assert_close(g, w, equal_nan=True, atol=0.05, rtol=2e-3,
                                           msg=lambda m: f"{label} reductions: {m}")

"""Test helper: compile a generated C++ kernel to assembly for a named x86-64 CPU and read what
gcc says it vectorized.

A loop gcc leaves scalar is correct but several times slower, and nothing but the compiler can
tell: so tests compile kernels for baseline x86-64 (SSE2), x86-64-v3 (AVX2), x86-64-v4
(AVX-512) and Sapphire Rapids (AVX-512-FP16), whatever this machine is, and read two things:

* gcc's own report (`-fopt-info-vec-optimized -fopt-info-loop-optimized`): a line per loop it
  vectorized, `.../kernel.cpp:65:76: optimized: loop vectorized using 64 byte vectors`, and per
  loop it unrolled or replaced by a library call (`split to 0 loops and 1 library calls`: a
  memset or memcpy), each named by a line of the loop's body (from its `for` to its `}`);
* the assembly: packed instructions on the target's registers (`vmulps ... %zmm1`).

    report = compile_report(source, "x86-64-v4", tmp_path)
    for loop in simd_loops(report.lines):
        assert report.vectorized(loop), report.said(loop)
    assert report.packed("mulps")

Compiling for a CPU this machine lacks is fine: nothing compiled here runs. A gcc that does not
know a target's flags skips the test (`pytest.skip`). Used by tests/test_half_vectorized.py,
tests/test_cpp_columns_vector.py and tests/test_cpp_short_rows.py.
"""
from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from fusec.codegen import cpp, llvm
from fusec.codegen.llvm import compiler as llvm_build


@dataclass(frozen=True)
class Target:
    """A CPU the tests compile for: gcc's flags, LLVM's name for it, its widest vector register,
    and the /proc/cpuinfo flags its code needs to run here."""

    arch: tuple[str, ...]
    llvm_cpu: str
    reg: str  # "xmm", "ymm" or "zmm"
    needs: frozenset[str]

    @property
    def width(self) -> int:
        """The vector register's bytes, as gcc's report says them ("using 32 byte vectors")."""
        return {"xmm": 16, "ymm": 32, "zmm": 64}[self.reg]


TARGETS = {
    "x86-64": Target(("-march=x86-64",), "x86-64", "xmm", frozenset({"sse2"})),
    "x86-64-v3": Target(("-march=x86-64-v3",), "x86-64-v3", "ymm",
                        frozenset({"avx2", "fma", "f16c", "bmi2"})),
    "x86-64-v4": Target(("-march=x86-64-v4", "-mprefer-vector-width=512"), "x86-64-v4", "zmm",
                        frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"})),
    "sapphirerapids": Target(("-march=sapphirerapids", "-mprefer-vector-width=512"),
                             "sapphirerapids", "zmm",
                             frozenset({"avx512f", "avx512bw", "avx512fp16", "avx512_bf16",
                                        "amx_tile"})),
}
LEVELS = ["x86-64", "x86-64-v3", "x86-64-v4"]  # the x86-64 levels every CPU kernel must vectorize on

X86 = pytest.mark.skipif(llvm_build.NAMED_TARGETS["x86-64"].triple != llvm.host().triple,
                         reason="x86-64 targets are checked on an x86-64 machine")
NEEDS_CPP = pytest.mark.skipif(not cpp.available(), reason="no C++ compiler")


def cpu_flags() -> set[str]:
    """This machine's CPU flags (/proc/cpuinfo), empty where there is no such file."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def runs_here(name: str) -> bool:
    """Whether code built for TARGETS[name] can run on this machine."""
    return TARGETS[name].needs <= cpu_flags()


@dataclass(frozen=True)
class Loop:
    """A `#pragma omp simd` loop of a source: 0-based lines of its `for` and of its closing brace,
    and the line above the pragma (the comment that says what the loop does, if any)."""

    first: int
    last: int
    above: str


def simd_loops(lines: list[str]) -> list[Loop]:
    """Every `#pragma omp simd` loop of `lines` (a source's lines), in order. A loop ends at the
    first line that is its `for`'s indentation and a `}`."""
    loops = []
    for n, text in enumerate(lines):
        if text.strip() != "#pragma omp simd":
            continue
        indent = lines[n + 1][:len(lines[n + 1]) - len(lines[n + 1].lstrip())]
        last = next(m for m in range(n + 1, len(lines)) if lines[m] == indent + "}")
        loops.append(Loop(n + 1, last, lines[n - 1] if n else ""))
    return loops


@dataclass
class Report:
    """What gcc made of one kernel for one target (`compile_report`)."""

    target: Target
    source: str
    report: str  # gcc's -fopt-info lines (its stderr)
    assembly: str

    @property
    def lines(self) -> list[str]:
        """The source's lines, 0-based as `Loop` counts them."""
        return self.source.splitlines()

    def said(self, first: int | Loop, last: int | None = None) -> list[str]:
        """gcc's report lines about source lines first..last (0-based, both included), or about
        the lines of a `Loop`."""
        if isinstance(first, Loop):
            first, last = first.first, first.last
        inside = {f"kernel.cpp:{n + 1}:" for n in range(first, last + 1)}
        return [line for line in self.report.splitlines() if any(at in line for at in inside)]

    def vectorized(self, first: int | Loop, last: int | None = None) -> bool:
        """Whether gcc says a loop within those lines is vectorized with the target's widest
        vectors (a narrower vectorization does not count)."""
        width = self.target.width
        return any(f"loop vectorized using {width} byte vectors" in line
                   for line in self.said(first, last))

    def packed(self, op: str, reg: str | None = None) -> list[str]:
        """`packed` on this assembly, on the target's registers unless `reg` says others."""
        return packed(self.assembly, op, self.target.reg if reg is None else reg)


def packed(assembly: str, op: str, reg: str) -> list[str]:
    """The lines of `assembly` (AT&T syntax, gcc's or LLVM's) that run `op` (a regex: "mulps",
    "cvtph2psx?"; its VEX/EVEX form `v...` too) on `reg` registers (a regex too: "[xyz]mm")."""
    return [m.group(0) for m in
            re.finditer(rf"^\s+v?{op}\s[^\n]*%{reg}\d+[^\n]*$", assembly, re.M)]


def compile_report(source: str, name: str, tmp_path: Path) -> Report:
    """`source` (a rendered C++ kernel) compiled to assembly by fusec's C++ compiler for
    TARGETS[name], with fusec's own flags less -march=native and -shared, and gcc's report of
    the loops it vectorized. Skips the test where the compiler does not know the target."""
    target = TARGETS[name]
    compiler = cpp.find_compiler()
    probe = subprocess.run([compiler, *target.arch, "-x", "c++", "-fsyntax-only", "-"],
                           input="int f() { return 0; }", capture_output=True, text=True,
                           timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"{compiler} does not know {' '.join(target.arch)}")
    src, asm = tmp_path / "kernel.cpp", tmp_path / "kernel.s"
    src.write_text(source)
    flags = [f for f in cpp.FLAGS if f not in ("-march=native", "-shared")]
    defines = [f for f in cpp.math_flags() if f.startswith("-D")]
    out = subprocess.run([compiler, *flags, *target.arch, *defines, f"-I{cpp.TEMPLATES}", "-S",
                          str(src), "-o", str(asm), "-fopt-info-vec-optimized",
                          "-fopt-info-loop-optimized"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return Report(target, source, out.stderr, asm.read_text())

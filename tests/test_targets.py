"""Every kernel compiles for every CPU family a user may have, not only for the test machine's.

A kernel's LLVM IR is handed to LLVM's code generator for the user's CPU, and a construct that
one CPU's code generator cannot lower can abort the whole process (the `bfloat` type did, with
AVX-512 BF16). Running the suite only on CI's CPU would not notice. So these tests take the
kernels of the op tests - every op-table row in every dtype the op tests use, every cast between
every pair of dtypes, the reductions - and compile each one for named CPUs (codegen/llvm/compiler.py
NAMED_TARGETS: baseline x86-64, Haswell, Skylake-AVX512, Sapphire Rapids, Zen 4, AArch64),
emitting object code only. LLVM runs in fusec's guarded compiler process, so a code generator
that aborts fails the test with its message instead of killing pytest. The C++ backend's kernels
are compiled the same way with gcc's `-march=` for the same CPUs.
"""
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import fusec
from fusec.symbolic import size_params
from fusec import ops
from fusec.codegen import cpp, elf, llvm
from fusec.codegen.llvm import compiler as llvm_build

from test_ops import (ALL, F32, FLOATS, INTS, _bool_ops, _casts, _float_binary,
                      _float_unary, _int_ops, _shift_ops, _source_values, randf, randi)

SHAPE = (6, 8)


def _fills(x):
    x = x.clone()
    return (torch.full_like(x, 3), torch.zeros_like(x), torch.full_like(x, 0.1, dtype=torch.float16),
            torch.full_like(x, 0.1, dtype=torch.bfloat16), torch.full_like(x, -1, dtype=torch.float64),
            torch.full_like(x, True, dtype=torch.bool), torch.full_like(x, 200, dtype=torch.uint8))


def _float_reductions(x):
    return (x.sum(-1), x.prod(-1), x.amax(-1), x.amin(0), x.argmax(-1), x.argmin(0),
            x.mean(-1), x.var(-1), torch.softmax(x, -1), torch.log_softmax(x, -1),
            torch.logsumexp(x, -1), F.layer_norm(x, x.shape[-1:]), (x > 0).any(-1),
            (x > 0).all(-1))


def _column_reductions(x):
    return (x.sum(0), torch.softmax(x, 0), x.argmax(0), x.var(0), x.amin(0))


def _int_reductions(x):
    return (x.sum(-1), x.prod(-1), x.amax(-1), x.amin(0), x.argmax(-1), x.argmin(0),
            x.bool().any(-1), x.bool().all(-1))


def _bool_reductions(x):  # (argmax/argmin of bool: eager refuses them, and so does fusec)
    return (x.sum(-1), x.prod(-1), x.amax(-1), x.amin(0), x.any(-1), x.all(-1))


def _silu(x):
    return F.silu(x) + 1


def _cats(x, y):
    """Concatenations inside kernels: pieces along the inner and an outer dim (masked loads)."""
    return torch.cat([x, y[:, :3]], dim=1) * 2, torch.cat([y, x, y], dim=0).neg()


def _gathers(table, ids, ids32):
    return torch.nn.functional.embedding(ids.abs(), table) * 2 + table[ids32].sin()


def programs():
    """(label, fn, inputs) for every program whose kernels the targets compile. Values do not
    matter (nothing runs); shapes and dtypes decide the code."""
    out = []
    for dt in FLOATS:
        x, y = randf(SHAPE, dt, "cpu", seed=1), randf(SHAPE, dt, "cpu", seed=2)
        out += [(f"float_unary_{dt}", _float_unary, (x,)),
                (f"float_binary_{dt}", _float_binary, (x, y)),
                (f"float_reductions_{dt}", _float_reductions, (x,)),
                (f"silu_{dt}", _silu, (x,)),
                (f"cats_{dt}", _cats, (x, y))]
    # long rows: the reduction loops take the blocked, vectorized path
    out.append(("float_reductions_long", _float_reductions, (randf((3, 70000), F32, "cpu"),)))
    # reductions across rows side by side: C++'s loops turned inside out (codegen/cpp/columns.py)
    for dt in (F32, torch.bfloat16):
        out.append((f"column_reductions_{dt}", _column_reductions, (randf((300, 24), dt, "cpu"),)))
    for dt in INTS:
        a = [randi(SHAPE, dt, "cpu", seed=s) for s in range(5)]
        out += [(f"int_ops_{dt}", _int_ops, tuple(a)), (f"int_reductions_{dt}", _int_reductions, (a[0],)),
                (f"shifts_{dt}", _shift_ops, (a[0], a[1]))]
    p = torch.rand(SHAPE) > 0.5
    out += [("bool_ops", _bool_ops, (p, ~p)), ("bool_reductions", _bool_reductions, (p,))]
    # packed-int4 GEMVs (the C++ table kernel, extensions/quant_gemv/cpp_int4.py): groups of 32 weights take its
    # vector lookups, groups of 16 its plain loop; one and four activation rows
    from fusec.examples.int4_linear import Int4Linear
    for group, m in ((32, 1), (16, 4)):
        layer = Int4Linear(randf((16, 128), F32, "cpu").to(torch.bfloat16), group)
        out.append((f"int4_linear_g{group}_m{m}", layer, (randf((m, 128), F32, "cpu").to(torch.bfloat16),)))
    # an int8 GEMV with four activation rows (codegen/unroll_rows.py: the rows in one loop)
    from fusec.examples.int8_linear import example as int8_example
    ex = int8_example(m=4, k=192, n=24)
    out.append(("int8_linear_m4", ex.fn, ex.inputs))
    # GPTQ's int32 words unpacked in plain torch: the GEMV over K cut in three dims
    # (passes/refine_views.py), its shifts and masks on int32 words; one and four rows
    from test_refine_views import SHIFTS, gptq, group_params, packed_along_k
    _, qweight = packed_along_k(256, 32)
    scales, zeros = group_params(2, 32)
    qzeros = (zeros.view(2, 4, 8) << SHIFTS[None, None, :]).sum(2, dtype=torch.int32)
    for m in (1, 4):
        out.append((f"gptq_m{m}", gptq, (randf((m, 256), F32, "cpu").to(torch.bfloat16), qweight,
                                         qzeros, scales, SHIFTS)))
    # gathered reads (passes/check_gathers.py): an embedding and x[idx] in a pointwise kernel, and
    # act-order GPTQ's scales[g_idx] inside a GEMV, one and four rows (int32 and int64 indices)
    from test_check_gathers import ActOrderQuantLinear
    table, ids = randf((50, 16), F32, "cpu"), torch.tensor([[3, -1, 49], [0, 7, 7]])
    out.append(("gathers", _gathers, (table, ids, ids.int())))
    layer = ActOrderQuantLinear(256, 32, 64, dtype=torch.bfloat16)
    for m in (1, 4):
        out.append((f"act_order_gptq_m{m}", layer, (randf((m, 256), F32, "cpu").to(torch.bfloat16),)))
    # AWQ's weight packed along N (passes/constant_gathers.py, refine_views): a GEMV whose output
    # columns are (N/8, 8), with 32-bit shifts (passes/simplify.py)
    from fusec.examples.awq_linear import example as awq_example
    for m in (1, 4):
        ex = awq_example(m=m, k=128, n=64, group=32)
        out.append((f"awq_m{m}", ex.fn, ex.inputs))
    for src in ALL:
        out += [(f"casts_from_{src}", _casts, (_source_values(src, "cpu"),)),
                (f"fills_{src}", _fills, (randf(SHAPE, F32, "cpu").to(src),))]
    return out


@pytest.fixture(scope="module")
def by_program():
    """{label: the kernel IRs of that program}, lowered once (through the LLVM backend here)."""
    from fusec import frontend
    table = frontend.decompositions()
    # keep silu whole so that the table's own silu row is among the kernels (test_ops does the same)
    no_silu = {k: v for k, v in table.items() if k is not torch.ops.aten.silu.default}
    original, found = frontend.decompositions, {}
    try:
        for label, fn, inputs in programs():
            frontend.decompositions = (lambda: no_silu) if fn is _silu else original
            found[label] = [k.ir for k in fusec.explain(fn, *inputs, backend="llvm").compiled.kernels]
    finally:
        frontend.decompositions = original
    found.update(dynamic_programs())
    return found


def dynamic_programs() -> dict:
    """Kernels of shape families (docs/dynamic.md): their sizes are arguments, not constants, and
    every target must compile those too (a row count that is a symbol, a reduced dim that is)."""
    from fusec.capture.frontend import capture
    from fusec.driver import compile_graph
    found = {}
    for dt in FLOATS:
        x, y = randf((37, 24), dt, "cpu", seed=1), randf((37, 24), dt, "cpu", seed=2)
        for label, fn, inputs, dims in (
                ("float_unary", _float_unary, (x,), {0: {0}}),
                ("float_binary", _float_binary, (x, y), {0: {0, 1}, 1: {0, 1}}),
                ("float_reductions", _float_reductions, (x,), {0: {0, 1}}),
                ("column_reductions", _column_reductions, (x,), {0: {0}}),
                ("cats", _cats, (x, y), {0: {0}, 1: {0}})):
            compiled = compile_graph(capture(fn, inputs, dynamic=dims), "llvm")
            irs = [k.ir for k in compiled.kernels]
            assert any(size_params(ir) for ir in irs), f"{label}: no kernel takes a size"
            found[f"dynamic_{label}_{dt}"] = irs
    return found


@pytest.fixture(scope="module")
def kernels(by_program):
    return [ir for irs in by_program.values() for ir in irs]


def test_kernels_cover_every_row_and_cast(by_program, kernels):
    rows = {s.op for ir in kernels for s in (ir.stmts if hasattr(ir, "stmts") else ir.body)}
    assert set(ops.OPS) - rows == set(), "op-table rows no target compiles"
    assert set(ops.REDUCTIONS) - rows == set(), "reductions no target compiles"
    for src in ALL:  # every cast: one program per source dtype stores every other dtype
        irs = by_program[f"casts_from_{src}"]
        assert {ld.dtype for ir in irs for ld in ir.loads} == {src}
        stored = {st.dtype for ir in irs for st in ir.stores}
        assert stored >= set(ALL) - {src}, f"casts from {src} missing: {set(ALL) - {src} - stored}"


def test_the_special_gemv_kernels_are_among_those_compiled(by_program):
    """The int4 table kernel, the unrolled GEMV and GPTQ's refined GEMV are compiled for every
    target below."""
    sources = {label: [cpp.render(ir) for ir in by_program[label]]
               for label in ("int4_linear_g32_m1", "int4_linear_g16_m4", "int8_linear_m4")}
    assert all("cpp_gemv_int4.cpp.j2" in s for s in sources["int4_linear_g32_m1"])
    assert all("codegen/unroll_rows.py" in s for s in sources["int8_linear_m4"])
    for dt in (F32, torch.bfloat16):
        assert all("cpp/columns.py" in cpp.render(ir) for ir in by_program[f"column_reductions_{dt}"])
    assert any("gemv" in ir.name for ir in by_program["gptq_m1"])
    for label in ("act_order_gptq_m1", "act_order_gptq_m4", "gathers"):
        assert any(ld.gather for ir in by_program[label] for ld in ir.loads), label


# the type names, outside comments (a value may be called %half.x)
_TYPE = re.compile(r"^[^;\n]*(?<![%@.\w])(half|bfloat)\b(?!\.)", re.M)


def test_ir_has_no_half_or_bfloat_types(kernels):
    """Never `bfloat`; `half` only in the float16 helpers for a CPU with F16C (codegen/llvm/ir.py
    has_f16c), where the code generator turns it into vcvtph2ps/vcvtps2ph."""
    from fusec.codegen.llvm.ir import has_f16c
    assert not has_f16c(llvm_build.NAMED_TARGETS["x86-64"])
    f16c_lines = {"%h = bitcast i16 %bits to half", "%out = fpext half %h to float",
                  "%h = fptrunc float %x to half", "%out = bitcast half %h to i16"}
    for ir in kernels:
        source = "\n".join(line for line in llvm.render(ir).splitlines()
                           if not (has_f16c() and line.strip() in f16c_lines))
        source += "\n" + llvm.render(ir, llvm_build.NAMED_TARGETS["x86-64"])
        found = _TYPE.search(source)
        assert found is None, f"{ir.name} uses LLVM's {found.group(1)} type:\n{found.group(0)}"


@pytest.mark.parametrize("name", list(llvm_build.NAMED_TARGETS))
def test_llvm_emits_every_kernel_for(name, kernels):
    target = llvm_build.available_targets().get(name)
    if target is None:
        pytest.skip(f"this llvmlite has no {llvm_build.NAMED_TARGETS[name].triple} backend")
    failures = []
    for ir in kernels:
        try:
            obj = llvm.object_code(llvm.render(ir, target), ir.name, target)
        except fusec.CompileError as exc:  # includes the compiler process dying
            failures.append(f"{ir.name}: {exc}")
            continue
        assert len(obj) > 0
        # only C library math and its vector versions may be called: nothing from a compiler
        # runtime (libgcc's __truncsfbf2, say) that the user's process may not have
        runtime = [s for s in elf.undefined_symbols(obj) if s.startswith("__")]
        if runtime:
            failures.append(f"{ir.name}: calls {runtime}")
    assert not failures, f"{len(failures)} kernel(s) fail on {target}:\n" + "\n".join(failures[:10])


# gcc names for the same CPUs. gcc older than 13 has no -march=znver4: Zen 4 is then znver3 plus
# the AVX-512 extensions Zen 4 added (BF16 among them).
ZEN4 = ["-march=znver3", "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mavx512cd",
        "-mavx512bf16", "-mavx512vnni", "-mavx512ifma", "-mavx512vbmi", "-mavx512vbmi2",
        "-mavx512bitalg", "-mavx512vpopcntdq", "-mgfni", "-mvaes", "-mvpclmulqdq"]
GCC_TARGETS = {"x86-64": ["-march=x86-64"],
               # what a compiler without a half type (gcc before 12) gets: integer conversions
               "x86-64-no-float16": ["-march=x86-64", "-DFUSEC_NO_FLOAT16"], "haswell": ["-march=haswell"],
               # AVX-512 CPUs: with the 512-bit vectors fusec asks for there (cpp.vector_flags)
               "skylake-avx512": ["-march=skylake-avx512", "-mprefer-vector-width=512"],
               "sapphirerapids": ["-march=sapphirerapids", "-mprefer-vector-width=512"],
               "znver4": ["-march=znver4", "-mprefer-vector-width=512"],
               "aarch64": ["-march=armv8.2-a"]}


def _accepts(compiler: str, flags: list[str]) -> bool:
    result = subprocess.run([compiler, *flags, "-x", "c++", "-c", "-", "-o", "/dev/null"],
                            input="int f() { return 0; }", capture_output=True, text=True)
    return result.returncode == 0


def _compiler_for(name: str) -> str | None:
    """The host's C++ compiler for a target of its own architecture; for the other one, a cross
    compiler (.ci/run installs g++-aarch64-linux-gnu / g++-x86-64-linux-gnu where it can)."""
    import platform
    arm_host = platform.machine() in ("aarch64", "arm64")
    if (name == "aarch64") == arm_host:
        return cpp.find_compiler()
    return shutil.which("aarch64-linux-gnu-g++" if name == "aarch64" else "x86_64-linux-gnu-g++")


@pytest.mark.skipif(not cpp.available(), reason="no C++ compiler")
@pytest.mark.parametrize("name", list(GCC_TARGETS))
def test_cpp_compiles_every_kernel_for(name, kernels, tmp_path):
    compiler, flags = _compiler_for(name), GCC_TARGETS[name]
    if compiler is None:
        pytest.skip(f"no C++ cross compiler for {name} here (apt-get install g++-aarch64-linux-gnu)")
    if name == "znver4" and not _accepts(compiler, flags):
        flags = ZEN4
    assert _accepts(compiler, flags), f"{compiler} rejects {flags}"
    # one translation unit per target: every kernel (renamed apart), the prelude included once
    parts, seen = [], set()
    for n, ir in enumerate(kernels):
        source = cpp.render(ir).replace(f" {ir.name}(", f" {ir.name}_{n}(")
        if seen:
            source = source.replace('#include "cpp_prelude.h"', "")
        seen.add(ir.name)
        parts.append(source)
    cpp.compile_object("\n".join(parts), f"{len(kernels)} kernels", flags, tmp_path / "all.o",
                       compiler)
    assert (tmp_path / "all.o").stat().st_size > 0


# ---- the guard itself ----------------------------------------------------------------------------

def _crashing_worker():
    return llvm_build.Worker([sys.executable, "-c",
                              "import os, sys; sys.stderr.write('LLVM ERROR: pretend\\n'); "
                              "sys.stderr.flush(); os.abort()"])


def test_a_dying_compiler_is_an_error_not_a_crash():
    worker = _crashing_worker()
    with pytest.raises(llvm_build.WorkerDied, match=r"(?s)signal 6.*fused_k for host.*pretend"):
        worker.compile("define void @f() {\n  ret void\n}", llvm.host(), "object", "fused_k")
    # the real worker is unaffected and a new one starts after a death
    assert llvm.object_code("define void @f() {\n  ret void\n}")


def test_a_compiler_process_that_cannot_start_is_an_error():
    worker = llvm_build.Worker(["/nonexistent/python", "--worker"])
    with pytest.raises(llvm_build.BuildError, match="could not start LLVM's compiler process"):
        worker.compile("define void @f() {\n  ret void\n}", llvm.host(), "object", "fused_k")


def test_fusec_falls_back_when_llvm_dies(monkeypatch, tmp_path):
    if not cpp.available():
        pytest.skip("no other CPU backend to fall back to")
    from fusec import build
    monkeypatch.setattr(llvm_build, "_WORKERS", llvm_build.WorkerPool(_crashing_worker))
    monkeypatch.setattr(build, "_FELL_BACK", set())
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path))  # nothing cached: LLVM must compile
    x = torch.randn(300)
    fn = lambda x: torch.sin(x) * 2 + 1  # noqa: E731
    cf = fusec.compile(fn, backend="llvm")
    with pytest.warns(UserWarning, match=r"(?s)compiler process died.*cpp backend builds"):
        got = cf(x)
    torch.testing.assert_close(got, fn(x))
    assert [k.backend for k in cf.kernels] == ["cpp"]


def test_undefined_symbols_reads_the_object():
    source = "declare float @sinf(float)\ndefine float @f(float %x) {\n" \
             "  %y = call float @sinf(float %x)\n  ret float %y\n}"
    obj = llvm.object_code(source)
    assert elf.undefined_symbols(obj) == ["sinf"]
    with pytest.raises(fusec.CompileError, match="__no_such_routine"):
        bad = llvm.object_code("declare void @__no_such_routine()\ndefine void @g() {\n"
                               "  call void @__no_such_routine()\n  ret void\n}")
        llvm.check_symbols(bad, "g")

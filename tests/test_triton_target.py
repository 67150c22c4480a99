"""Triton kernels compiled for named NVIDIA GPUs on a machine without one
(fusec/codegen/triton/target.py, `Explained.assembly(k, "sm_90")`, `fusec kernels --asm`).

This is also how the suite checks the GPU-only code paths on a CPU: the int4 GEMV's PTX
dequantization (`fma.rn.bf16x2`, `lop3`) is rendered only for sm_80 and newer, and here ptxas
must accept it, keep it out of local memory, and turn it into packed bf16 instructions.
"""
import importlib
import importlib.util
from pathlib import Path

import pytest
import torch

import fusec
from conftest import TRITON_DEVICE
from fusec.codegen.triton import target as triton_target
from fusec.extensions.quant_gemv.triton_gemv_int4 import pair_math
from fusec.errors import FusecError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _tools() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


needs_tools = pytest.mark.skipif(not _tools(), reason="this Triton has no NVIDIA tools (ptxas)")


def _example(name: str, device: str = TRITON_DEVICE):
    """An example at its small sizes, where Triton kernels run here (the CPU: the interpreter)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.example(device=device, **getattr(module, "SMALL", {}))


@needs_tools
@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
def test_the_int4_gemv_compiles_for_the_gpu_with_its_ptx_dequantization(target):
    ex = _example("int4_linear")
    e = fusec.explain(ex.fn, *ex.inputs, backend="triton")
    [k] = e.kernels
    sass = e.assembly(k.name, target)
    header = sass.splitlines()[0]
    assert f"{k.name} on {target}" in header
    assert "0 bytes spilled" in header, header  # nothing in local memory
    assert f"code for {target}" in sass and f"Function : {k.name}" in sass
    # the packed bf16 FMAs of dequant_pairs, rendered for the target whatever this machine runs
    # (under the interpreter its own source has the float32 version)
    assert "HFMA2" in sass
    assert ("fma.rn.bf16x2" in k.source) == pair_math()[0]


@needs_tools
@pytest.mark.parametrize("name", ["sin4", "softmax", "layernorm", "int8_linear", "gelu_mlp"])
def test_every_kernel_of_an_example_compiles_for_sm_90(name):
    ex = _example(name)
    e = fusec.explain(ex.fn, *ex.inputs, backend="triton")
    for k in e.kernels:
        if "gpu_assembly" not in fusec.codegen.backends.get(k.backend).views:
            continue
        sass = e.assembly(k.name)  # sm_90 unless told
        header, body = sass.split("\n", 1)
        assert header.startswith(f"// {k.name} on sm_90"), header
        instructions = int(header.rsplit(", ", 1)[1].split()[0])
        assert instructions > 0 and "EXIT" in body


@needs_tools
def test_the_cli_prints_the_sass(capsys):
    from fusec.cli import main as cli
    assert cli(["kernels", "sin4", "--backend", "triton", "--small", "--asm",
                "--target", "sm_80"]) == 0
    out = capsys.readouterr().out
    assert "# ===== fused_" in out and " on sm_80 (Triton " in out and "code for sm_80" in out


def test_an_unknown_target_is_a_clear_error():
    ex = _example("sin4")
    e = fusec.explain(ex.fn, *ex.inputs, backend="triton")
    with pytest.raises(FusecError, match="unknown GPU target 'sm_70'; choose one of sm_80"):
        e.assembly(0, "sm_70")
    cpu = _example("sin4", device="cpu")
    cpp = fusec.explain(cpu.fn, *cpu.inputs, backend="cpp")
    with pytest.raises(FusecError, match="machine code from backend='llvm'"):
        cpp.assembly(0)


@needs_tools
def test_a_kernel_triton_refuses_is_a_fusec_error_not_a_crash():
    source = ("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
              "def broken_kernel(x_ptr, BLOCK: tl.constexpr):\n"
              "    tl.store(x_ptr + tl.arange(0, BLOCK), no_such_name)\n\n\n"
              "def launch(x):\n    return broken_kernel[(1,)](x, BLOCK=64)\n")
    with pytest.raises(FusecError, match="compiling broken_kernel for sm_90 failed"):
        triton_target.compile_for(source, "broken_kernel", ["float32"], 90)


def test_the_dequantization_is_chosen_for_the_target_not_this_machine():
    assert pair_math(80)[0] and pair_math(90)[0]
    asm, why = pair_math(75)
    assert not asm and "sm_75 has no bf16x2 FMA" in why
    if not torch.cuda.is_available():
        assert not pair_math()[0]  # this machine: no GPU, the float32 version


@needs_tools
@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
def test_the_int4_tensor_core_gemv_compiles_for_the_gpu(target):
    """M = 4 rows of a packed int4 linear: both kernels of the tensor-core GEMV (the shares of K,
    and the one that adds them up) compile for the target, tensor-core instructions (HMMA on
    sm_80, HMMA or wgmma's HGMMA on sm_90) and packed bf16 FMAs in the first."""
    from fusec.examples.int4_linear import Int4Linear
    layer = Int4Linear(torch.randn(256, 1024, dtype=torch.bfloat16) / 32, 128).to(TRITON_DEVICE)
    x = torch.randn(4, 1024, dtype=torch.bfloat16, device=TRITON_DEVICE)
    [k] = fusec.explain(layer, x, backend="triton").kernels
    assert "triton_gemv_int4_mma.py.j2" in k.source
    sass = triton_target.assembly(k.ir, k.name, target)
    assert "0 bytes spilled" in sass.splitlines()[0], sass.splitlines()[0]
    assert "HFMA2" in sass and ("HMMA" in sass or "HGMMA" in sass)
    finish = triton_target.assembly(k.ir, f"{k.name}_finish", target)
    assert f"Function : {k.name}_finish" in finish and "0 bytes spilled" in finish.splitlines()[0]


@needs_tools
def test_the_four_row_int4_group_gemv_keeps_sixteen_programs_on_an_sm():
    """The M = 1 group kernel's 4-row tile (N = 4352: 1088 programs) is capped at 128 registers
    (Triton's maxnreg), so that 16 one-warp programs fit in an SM's 65536; ptxas would take 168
    (extensions/quant_gemv/triton_gemv_int4_groups.py, max_registers). With Triton 3.6, the GPU machine's,
    the cap costs no spills. The 2-row tile (N = 1024) is left to ptxas."""
    import re

    import triton

    from fusec.examples.int4_linear import Int4Linear
    x = torch.randn(1, 1024, dtype=torch.bfloat16, device=TRITON_DEVICE)
    sources = {}
    for n in (4352, 1024):
        layer = Int4Linear(torch.randn(n, 1024, dtype=torch.bfloat16) / 32, 128).to(TRITON_DEVICE)
        [k] = fusec.explain(layer, x, backend="triton").kernels
        assert "triton_gemv_int4_groups.py.j2" in k.source
        sources[n] = k
    assert "ROWS=4" in sources[4352].source and "maxnreg=128" in sources[4352].source
    assert "ROWS=2" in sources[1024].source and "maxnreg" not in sources[1024].source
    k = sources[4352]
    head = triton_target.assembly(k.ir, k.name, "sm_90").splitlines()[0]
    assert int(re.search(r"(\d+) registers per thread", head).group(1)) <= 128, head
    if triton.__version__.startswith("3.6."):
        assert "0 bytes spilled" in head, head


@needs_tools
@pytest.mark.parametrize("fmt", ["awq", "gptq", "gptq through g_idx"])
def test_the_packed_int4_chunk_kernels_compile_for_sm_90_without_spills(monkeypatch, fmt):
    """The chunk kernel of an AWQ or a GPTQ GEMV at M = 1 (extensions/quant_gemv/triton_gemv_int4_columns.py,
    extensions/quant_gemv/triton_gemv_int4_k_words.py; the cut along K is made on GPUs, here switched on for
    the CPU): its registers leave room for 16 one-warp programs an SM, and nothing goes to local
    memory. GPTQ's makes its nibble pairs with one PTX lop3 (int4_helpers.j2) on a GPU."""
    import re

    from fusec.codegen import triton as triton_codegen
    from fusec.examples.awq_linear import AWQLinear
    from fusec.examples.gptq_linear import GPTQLinear
    split = importlib.import_module("fusec.passes.split_reductions")
    monkeypatch.setattr(split, "SPLIT_DEVICES", ("cpu", "cuda"))
    if fmt == "gptq through g_idx":  # AutoGPTQ's torch path: scales[g_idx], zeros[g_idx]
        from test_check_gathers import ActOrderQuantLinear
        layer = ActOrderQuantLinear(1024, 512, 128)
        layer.g_idx = (torch.arange(1024) // 128).int()
        layer, template = layer.to(TRITON_DEVICE), "triton_gemv_int4_k_words.py.j2"
    else:
        cls, template = {"awq": (AWQLinear, "triton_gemv_int4_columns.py.j2"),
                         "gptq": (GPTQLinear, "triton_gemv_int4_k_words.py.j2")}[fmt]
        layer = cls(torch.randn(1024, 512, dtype=torch.float16) / 32, 128).to(TRITON_DEVICE)
    x = torch.randn(1, 1024, dtype=torch.float16, device=TRITON_DEVICE)
    [k] = [k for k in fusec.explain(layer, x, backend="triton").kernels if template in k.source]
    head = triton_target.assembly(k.ir, k.name, "sm_90").splitlines()[0]
    assert int(re.search(r"(\d+) registers per thread", head).group(1)) <= 128, head
    assert "0 bytes spilled" in head, head
    if fmt != "awq":
        assert "lop3.b32" in triton_codegen.render(k.ir, arch=90)
        assert ("lop3" in k.source) == (TRITON_DEVICE == "cuda")  # (the interpreter runs no PTX)


def _gelu_new_training_forward(x):
    """GPT-2's gelu_new as CUDA autocast runs it: `pow` in float32 (autocast's fp32 list), so
    the kernel reads bfloat16 and writes bfloat16 and float32 values it saves for backward."""
    cubed = torch.pow(x.float(), 3.0)
    inner = 0.7978845608028654 * (x + 0.044715 * cubed)
    return 0.5 * x * (1.0 + torch.tanh(inner)), x.float(), cubed


def test_a_kernel_of_mixed_widths_gives_every_thread_one_vector_of_the_widest():
    """Note "one layout for mixed widths" (codegen/triton/text.py `block_size`): a kernel that
    reads bfloat16 and writes float32 gives each thread 4 elements (16 bytes of float32), not 8,
    so Triton needs no layout conversion between its loads and stores; Triton 3.6 could not
    compile GPT-2's training gelu_new with the conversions. One width keeps 8 per thread."""
    x = torch.randn(8, 64, 96, dtype=torch.bfloat16, device=TRITON_DEVICE)
    cf = fusec.compile(_gelu_new_training_forward, backend="triton")
    for got, want in zip(cf(x), _gelu_new_training_forward(x)):
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
    (mixed,) = [k for k in cf.kernels if "aten.tanh.default" in k.ops]
    assert "BLOCK_SIZE=1024, num_warps=8" in mixed.source  # 1024 lanes / (32 x 4 per thread)
    same = fusec.compile(lambda x: torch.tanh(x * 2) + 1, backend="triton")
    same(x)
    assert "BLOCK_SIZE=1024, num_warps=4" in same.kernels[0].source  # 8 bfloat16 per thread


@needs_tools
def test_the_mixed_width_kernel_compiles_for_sm_90():
    x = torch.randn(8, 64, 96, dtype=torch.bfloat16, device=TRITON_DEVICE)
    e = fusec.explain(_gelu_new_training_forward, x, backend="triton")
    names = [k.name for k in e.compiled.kernels if "aten.tanh.default" in k.ops]
    assert names and "registers per thread" in e.assembly(names[0], "sm_90")

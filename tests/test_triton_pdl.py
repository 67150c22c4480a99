"""Programmatic dependent launch (fusec/runtime/fast_start/pdl.py): on sm_90 and newer every
Triton kernel waits for the kernel before it, then lets the next one launch, before it touches
memory.

On a CPU the kernels are rendered for named GPUs and compiled offline (codegen/triton/target.py);
on an sm_90 GPU the chained kernels run, alone and under a CUDA graph, against eager.
"""
import re

import pytest
import torch

import fusec
from conftest import GPU, TRITON_DEVICE
from fusec.codegen import triton as triton_codegen
from fusec.codegen.triton import target as triton_target
from fusec.runtime.fast_start.pdl import pdl_fit
from fusec.examples.llama_decode import TINY, Llama
from test_triton_target import needs_tools

CHAIN_STEPS = 12


def chain(x):
    """Kernels that each read the one before: softmaxes along rows, then columns, then rows...
    (a kernel reduces along one of them, so each one's input is the kernel before's output)."""
    for i in range(CHAIN_STEPS):
        x = torch.softmax(torch.sin(x) * 1.5, dim=i % 2) + x
    return x


def decode_kernels(fmt: str):
    model = Llama(dict(TINY, layers=1, max_seq=16), fmt, device=TRITON_DEVICE).eval()
    tok, pos = torch.tensor([3], device=TRITON_DEVICE), torch.tensor([0], device=TRITON_DEVICE)
    return fusec.explain(model, tok, pos, backend="triton").kernels


def first_memory_access(source: str, name: str) -> int:
    body = source[source.index(f"def {name}("):]
    return min(i for i in (body.find("tl.load("), body.find("tl.store(")) if i >= 0)


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_kernels_for_sm_90_wait_before_any_memory_access(fmt):
    """Every kernel of a decode step (pointwise, reductions, GEMVs, the int4 kernels), rendered
    for sm_90: launched with launch_pdl=True, and gdc_wait() comes before its first load or
    store; for sm_80 none of it is there."""
    for k in decode_kernels(fmt):
        source = triton_codegen.render(k.ir, arch=90)
        assert re.search(r"launch_pdl=True\)", source), k.name
        names = re.findall(r"^def (\w+)\(", source, re.M)
        for name in [n for n in names if n.startswith(k.name)]:
            body = source[source.index(f"def {name}("):]
            assert body.index("gdc_wait()") < first_memory_access(source, name), name
            assert body.index("gdc_launch_dependents()") < first_memory_access(source, name), name
        old = triton_codegen.render(k.ir, arch=80)
        assert "gdc_" not in old and "launch_pdl" not in old, k.name


def test_the_choice_and_its_reasons(monkeypatch):
    assert pdl_fit(90)[0] and pdl_fit(100)[0]
    on, why = pdl_fit(80)
    assert not on and "sm_90 or newer" in why
    monkeypatch.setenv("FUSEC_PDL", "0")
    on, why = pdl_fit(90)
    assert not on and "FUSEC_PDL=0" in why
    if not GPU:
        monkeypatch.delenv("FUSEC_PDL")
        assert not pdl_fit()[0]  # the interpreter runs no PTX


@needs_tools
def test_a_pdl_kernel_compiles_for_sm_90_with_grid_dependency_control():
    x = torch.randn(8, 33, device=TRITON_DEVICE)
    [k, *_] = fusec.explain(chain, x, backend="triton").kernels
    source = triton_codegen.render(k.ir, arch=90)
    done = triton_target.compile_for(source, k.name, ["float32"] * len(k.ir.params), 90)
    assert "griddepcontrol.wait" in done["ptx"] and "griddepcontrol.launch_dependents" in done["ptx"]


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_cuda_chained_kernels_match_eager(cuda_graphs):
    """Kernels that read the one before, launched back to back (with PDL on an sm_90 GPU), give
    eager's results on every call, with and without a CUDA graph."""
    cf = fusec.compile(chain, backend="triton", cuda_graphs=cuda_graphs)
    for seed in range(4):
        x = torch.randn(64, 257, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        torch.testing.assert_close(cf(x), chain(x), rtol=1e-4, atol=1e-4)
    if torch.cuda.get_device_capability() >= (9, 0):
        assert len(cf.kernels) >= CHAIN_STEPS and all("gdc_wait()" in k.source for k in cf.kernels)


def test_an_old_driver_keeps_kernels_without_pdl(monkeypatch):
    """A GPU whose CUDA driver predates 12.3 could not keep the order inside a CUDA graph."""
    from fusec.runtime.fast_start import pdl as triton_pdl
    monkeypatch.setattr(triton_pdl, "current_arch", lambda: 90)
    monkeypatch.setattr(triton_pdl, "driver_version", lambda: 12020)
    on, why = triton_pdl.pdl_fit()
    assert not on and "CUDA driver 12.2" in why
    monkeypatch.setattr(triton_pdl, "driver_version", lambda: 13000)
    assert triton_pdl.pdl_fit()[0]
    assert triton_pdl.pdl_fit(90)[0]  # rendering for a named target does not ask this machine


def test_a_triton_without_grid_dependency_control_keeps_kernels_without_pdl(monkeypatch):
    from fusec.runtime.fast_start import pdl as triton_pdl
    monkeypatch.setattr(triton_pdl, "triton_has_pdl", lambda: False)
    on, why = triton_pdl.pdl_fit(90)
    assert not on and "no grid dependency control" in why

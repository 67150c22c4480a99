"""The door for kernel families (fusec/codegen/families.py): a family registered for a backend is
asked before the general renderer, takes the kernels of its form, and declines the others with
the near misses the general kernel's header then shows. The quantized GEMVs come through it
(extensions/quant_gemv/tests/); this file checks the door itself, with small
families of its own, on the Triton backend (under the interpreter here)."""
from __future__ import annotations

import sys
import types

import pytest
import torch

import fusec
from conftest import TRITON_DEVICE, assert_matches
from fusec.codegen import families
from fusec.codegen.triton import reduction as triton_reduction
from fusec.ir import ReductionKernel


@pytest.fixture
def toy(monkeypatch):
    """A module `toy_family` whose renderers the test sets, and a registry that forgets them."""
    module = types.ModuleType("toy_family")
    monkeypatch.setitem(sys.modules, "toy_family", module)
    monkeypatch.setattr(families, "REGISTRY", list(families.REGISTRY))
    monkeypatch.setenv("FUSEC_SAVED_PROGRAMS", "0")  # (a saved program would skip rendering)
    return module


def row_sums(x):
    return x.sum(dim=-1) * 2


def test_a_family_takes_the_kernels_of_its_form(toy, tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path))
    taken = []

    def render(kernel, arch):
        if not isinstance(kernel, ReductionKernel):
            return families.Declined()
        taken.append(kernel.name)
        # the general kernel with a line of the family's: what a family renders is used as is
        return "# rendered by the toy family\n" + triton_reduction.render_reduction(kernel, arch)
    toy.render_triton = render
    families.register(families.Family("toy", "toy_family", ("triton",)))
    x = torch.randn(6, 33, device=TRITON_DEVICE)
    cf = assert_matches(row_sums, x, backend="triton")
    assert taken and all(k.source.startswith("# rendered by the toy family") for k in cf.kernels
                         if k.name in taken)


def test_a_declining_family_leaves_its_notes_in_the_kernel(toy, tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path))
    toy.render_triton = lambda kernel, arch: families.Declined(["Not the toy kernel: rows are too short."])
    never = types.ModuleType("never_family")
    never.render_cpp = lambda kernel, arch: pytest.fail("a family for another backend was asked")
    monkeypatch.setitem(sys.modules, "never_family", never)
    families.register(families.Family("toy", "toy_family", ("triton",)))
    families.register(families.Family("elsewhere", "never_family", ("cpp",)))
    x = torch.randn(6, 33, device=TRITON_DEVICE)
    cf = assert_matches(row_sums, x, backend="triton")
    assert any("Not the toy kernel: rows are too short." in k.source for k in cf.kernels)


def test_registering_a_name_again_replaces_it(monkeypatch):
    monkeypatch.setattr(families, "REGISTRY", [])
    families.register(families.Family("a", "x", ("triton",)))
    families.register(families.Family("b", "y", ("triton",)))
    families.register(families.Family("a", "z", ("cpp",)))
    assert [(f.name, f.module) for f in families.REGISTRY] == [("b", "y"), ("a", "z")]


def test_the_quantized_gemvs_are_a_registered_family():
    """fusec's own GEMV kernels come through the door, and the core's reduction renderer no
    longer imports them (tests/test_architecture.py keeps the imports out)."""
    gemv = [f for f in families.REGISTRY if f.name == "quantized GEMV"]
    assert gemv and {"triton", "cpp"} <= set(gemv[0].backends)
    assert gemv[0].renderer("triton") is not None and gemv[0].renderer("llvm") is None
    source = open(triton_reduction.__file__).read()
    assert "gemv" not in source.split('"""', 2)[2].lower()


def test_a_family_is_asked_only_about_the_kernels_it_wants(toy, tmp_path, monkeypatch):
    """`wants(kernel)` is asked before the family's module is imported: a family that wants none
    of a program's kernels is never loaded (here its module does not even exist)."""
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path))
    asked = []
    families.register(families.Family("absent", "no_such_family_module", ("triton",),
                                      wants=lambda kernel: asked.append(kernel.name) or False))
    x = torch.randn(6, 33, device=TRITON_DEVICE)
    assert_matches(row_sums, x, backend="triton")
    assert asked and "no_such_family_module" not in sys.modules


def test_the_quantized_gemvs_want_only_matmuls_computed_as_sums(tmp_path, monkeypatch):
    """The GEMV family wants a reduction that is a matmul (`ReductionKernel.matmul`, set by
    passes/small_matmul.py): a softmax's kernels are never offered to it, an int8 linear of one
    row is."""
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FUSEC_SAVED_PROGRAMS", "0")
    gemv = next(f for f in families.REGISTRY if f.name == "quantized GEMV")
    x = torch.randn(5, 33)
    softmax = assert_matches(lambda x: torch.softmax(x.sin() * 2, -1), x, backend="cpp")
    assert softmax.kernels and not any(gemv.wants(k.ir) for k in softmax.kernels)
    w = torch.randint(-127, 128, (7, 33), dtype=torch.int8)
    linear = assert_matches(lambda x, w, s: torch.nn.functional.linear(x, w.float()) * s,
                            x[:1], w, torch.rand(7), backend="cpp")
    assert [k.ir.matmul is not None for k in linear.kernels] == [True]
    assert gemv.wants(linear.kernels[0].ir)

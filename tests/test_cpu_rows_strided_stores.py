"""Reductions whose reads lie side by side and whose stores do not, on both CPU backends.

ConvNeXt's layer norm over channels, `norm(x.permute(0, 2, 3, 1))` of an NCHW tensor, reduces
rows of C values H*W apart, neighbouring rows side by side, and stores its output channels-last:
element (n, h, w, c) of a row at h*W*C + w*C + c, rows C elements apart. cpu_plan.column_blocks
turns such a kernel inside out (Note: rows side by side): the reads decide, a store may move by
any amount from a row to the next. Checked here: eager's answers on both backends (odd sizes,
NaN and infinities, non-contiguous inputs, a permuted softmax and a permuted argmax, a mean
stored with strides), that the kernel takes the inside-out form, and that gcc
vectorizes its lane loops (tests/gcc_vector_report.py).
"""
import pytest
import torch
import torch.nn.functional as F

import fusec
from conftest import assert_matches
from fusec.codegen import cpp
from gcc_vector_report import LEVELS, NEEDS_CPP, X86, compile_report, simd_loops

BACKENDS = ["cpp", "llvm"]


def _values(*shape, special=True):
    torch.manual_seed(0)
    x = torch.randn(*shape) * 2
    if special:
        flat = x.view(-1)
        for i, v in enumerate([float("nan"), float("inf"), -float("inf")]):
            flat[(i * 97 + 11) % flat.numel()] = v
    return x


def _inside_out(cf) -> bool:
    return any("inside out" in k.source for k in cf.kernels)


def channel_norm(x):
    c = x.shape[1]
    w, b = torch.linspace(0.5, 1.5, c), torch.linspace(-0.2, 0.2, c)
    return F.gelu(F.layer_norm(x.permute(0, 2, 3, 1), (c,), w, b).permute(0, 3, 1, 2))


CASES = {
    "channel_norm": channel_norm,
    "channel_norm_out_channels_last": lambda x: F.layer_norm(x.permute(0, 2, 3, 1), (x.shape[1],)),
    "softmax_permuted": lambda x: torch.softmax(x.permute(0, 2, 3, 1), -1) * 2,
    "argmax_permuted": lambda x: x.permute(0, 2, 3, 1).argmax(-1),
    "mean_transposed_out": lambda x: x.mean(1).transpose(1, 2).contiguous() + 1,
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(2, 16, 32, 32), (3, 12, 9, 17), (1, 40, 5, 8)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", list(CASES))
def test_matches_eager(name, shape, backend):
    special = name not in ("argmax_permuted",)
    cf = assert_matches(CASES[name], _values(*shape, special=special), backend=backend)
    if name.startswith("channel_norm") and shape[-1] >= 8:
        assert _inside_out(cf), "\n".join(k.source for k in cf.kernels)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs(backend):
    x = _values(2, 20, 36, 16)[:, 2:18, 1:33, :].transpose(2, 3)  # (2, 16, 16, 32), strided
    assert_matches(channel_norm, x, backend=backend)
    assert_matches(CASES["softmax_permuted"], _values(2, 34, 16, 12)[:, ::2], backend=backend)


@X86
@NEEDS_CPP
@pytest.mark.parametrize("target", LEVELS)
def test_cpp_lane_loops_of_the_channel_norm_are_vectorized_for(target, tmp_path):
    """gcc's own report: every lane loop of the inside-out layer norm is vectorized (the last
    pass too, whose stores lie C elements apart), on x86-64, x86-64-v3 and x86-64-v4."""
    kernels = fusec.explain(CASES["channel_norm_out_channels_last"], _values(2, 16, 32, 32,
                            special=False), backend="cpp").compiled.kernels
    (source,) = [cpp.render(k.ir) for k in kernels if "COLUMNS" in k.source]
    report = compile_report(source, target, tmp_path)
    loops = simd_loops(report.lines)
    scalar = [f"lines {loop.first + 1}-{loop.last + 1}:\n    " + "\n    ".join(report.said(loop))
              for loop in loops if not report.vectorized(loop)
              and not any("split to 0 loops and" in line for line in report.said(loop))]
    assert loops and not scalar, "\n".join(scalar) + "\n" + report.source

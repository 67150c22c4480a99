"""C++ pointwise loops in the order of a transposed read (codegen/cpp/read_order.py).

A conversion of an NCHW tensor to channels-last with a few channels (the layout pass's conversion
before a channels-last convolution, or `x.permute(0, 2, 3, 1).contiguous()`) reads each output
row's C values H*W apart. The C++ backend swaps the last two loop dims of such a kernel, so its
inner loop reads contiguously and stores C elements apart. Checked here: eager's answers (odd
sizes, NaN and infinities, other dtypes, 3-D, broadcast operands, an operand that is contiguous
along the channels and keeps the order), which kernels take the swapped order, and that gcc
vectorizes the swapped loop on x86-64, x86-64-v3 and x86-64-v4.
"""
import re

import pytest
import torch

import fusec
from conftest import assert_matches
from fusec.codegen import cpp
from gcc_vector_report import LEVELS, NEEDS_CPP, X86, compile_report, simd_loops


def _values(*shape, dtype=torch.float32):
    torch.manual_seed(0)
    x = torch.randn(*shape) * 3
    flat = x.view(-1)
    for i, v in enumerate([float("nan"), float("inf"), -float("inf")]):
        flat[(i * 31 + 7) % flat.numel()] = v
    return x.to(dtype)


def to_cl(x):
    fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    return x.contiguous(memory_format=fmt) * 2 + 1


def _swapped(cf, channels) -> bool:
    return any(re.search(rf"_ptr\[out0_base \+ i \* {channels}\]", k.source) for k in cf.kernels)


@pytest.mark.parametrize("shape", [(2, 3, 64, 64), (2, 8, 32, 32), (1, 2, 5, 7), (3, 15, 9, 11),
                                   (2, 4, 8, 16, 16), (2, 16, 32, 32)],
                         ids=lambda s: "x".join(map(str, s)))
def test_channels_last_conversions_match_eager(shape):
    cf = assert_matches(to_cl, _values(*shape), backend="cpp")
    out = cf(_values(*shape))
    assert out.stride() == to_cl(_values(*shape)).stride()
    swaps = shape[1] < 16 and shape[-1] * shape[-2] >= 16
    assert _swapped(cf, shape[1]) == swaps, "\n".join(k.source for k in cf.kernels)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int32,
                                   torch.uint8], ids=str)
def test_other_dtypes(dtype):
    x = _values(2, 3, 20, 24) if dtype.is_floating_point else torch.arange(2 * 3 * 20 * 24).view(
        2, 3, 20, 24).to(dtype)
    cf = assert_matches(lambda x: x.permute(0, 2, 3, 1).contiguous() + 1, x, backend="cpp")
    assert _swapped(cf, 3), "\n".join(k.source for k in cf.kernels)


def test_broadcast_and_contiguous_operands():
    x, bias = _values(2, 4, 16, 16), torch.linspace(-1, 1, 4)
    # a per-channel bias (broadcast): still swapped
    cf = assert_matches(lambda x, b: torch.sigmoid(x.permute(0, 2, 3, 1) + b).contiguous(), x, bias,
                        backend="cpp")
    assert _swapped(cf, 4), "\n".join(k.source for k in cf.kernels)
    # an operand contiguous along the channels: the order stays, both answers right
    y = _values(2, 16, 16, 4)
    cf = assert_matches(lambda x, y: x.permute(0, 2, 3, 1) * y, x, y, backend="cpp")
    assert not _swapped(cf, 4), "\n".join(k.source for k in cf.kernels)


def test_strided_input():
    x = _values(2, 5, 40, 36)[:, 1:4, ::2, 2:34]
    assert_matches(to_cl, x, backend="cpp")


@X86
@NEEDS_CPP
@pytest.mark.parametrize("target", LEVELS)
@pytest.mark.parametrize("channels", [3, 8])
def test_the_swapped_loop_is_vectorized_for(channels, target, tmp_path):
    kernels = fusec.explain(to_cl, _values(2, channels, 32, 32), backend="cpp").compiled.kernels
    (source,) = [cpp.render(k.ir) for k in kernels]
    assert re.search(rf"_ptr\[out0_base \+ i \* {channels}\]", source), source
    report = compile_report(source, target, tmp_path)
    loops = simd_loops(report.lines)
    assert loops and all(report.vectorized(loop) for loop in loops), \
        "\n".join(line for loop in loops for line in report.said(loop)) + "\n" + source

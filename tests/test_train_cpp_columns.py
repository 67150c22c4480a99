"""A batch norm backward over channels-last activations on the C++ backend (resnet50's training
step): eager's answers, and lane loops that gcc vectorizes.

The kernel is turned inside out (codegen/cpp/columns.py): the channels side by side in the SIMD
lanes, the k loop over batch and pixels outside. Two things kept gcc 12 from vectorizing its lane
loops, which then ran 3-4x the LLVM backend's time for the same kernel:

* a `bool` load (the ReLU backward's mask) next to float loads: now read as its byte
  (`fusec_bool`, cpp_prelude.h);
* a 0-d tensor's value (the `where`'s scalar) read inside every lane loop: now read once per
  block, before them;

and with fewer channels than COLUMNS the one block is exactly as wide as the channels, so the lane
loops run a count gcc knows (no vector part and remainder at every k step).
"""
import pytest
import torch

from conftest import assert_matches
from fusec.codegen import cpp
from gcc_vector_report import NEEDS_CPP, X86, compile_report, simd_loops


def bn_relu_backward(g, mask, zero, x, mean, invstd, w):
    """ReLU's backward (a where on a saved mask) then batch norm's backward in training."""
    y = torch.where(mask, zero, g)
    xc = x - mean[None, :, None, None]
    n = g.numel() // g.shape[1]
    sy = y.sum((0, 2, 3))
    syx = (y * xc).sum((0, 2, 3))
    scale = (invstd * invstd * syx / n)[None, :, None, None]
    dx = (y - xc * scale - (sy / n)[None, :, None, None]) * (invstd * w)[None, :, None, None]
    return dx, sy, syx * invstd


def _inputs(n, c, h, w, special=False):
    torch.manual_seed(0)
    last = torch.channels_last
    g, x = torch.randn(n, c, h, w), torch.randn(n, c, h, w)
    if special:  # NaN and infinities at scattered places of the gradient and the input
        g.view(-1)[::37] = float("nan")
        x.view(-1)[5::53] = float("inf")
    g, x = g.to(memory_format=last), x.to(memory_format=last)
    mask = (torch.randn(n, c, h, w) < 0).to(memory_format=last)
    return (g, mask, torch.tensor(0.0), x, torch.randn(c), torch.rand(c) + 0.5, torch.randn(c))


def _source(cf) -> str:
    return "\n".join(k.source for k in cf.kernels)


# channels below, at and above COLUMNS (64), odd counts, a ragged last block (72 = 64 + 8)
@pytest.mark.parametrize("shape", [(2, 8, 3, 5), (3, 9, 5, 7), (2, 32, 4, 4), (1, 64, 3, 3),
                                   (2, 72, 3, 5)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("special", [False, True], ids=["finite", "nan"])
def test_matches_eager(shape, special):
    cf = assert_matches(bn_relu_backward, *_inputs(*shape, special=special), backend="cpp")
    source = _source(cf)
    assert "COLUMNS" in source, source
    assert "fusec_bool(" in source, source  # the mask is read as its byte
    c = shape[1]
    if c < 64:  # one full block exactly as wide as the channels
        assert f"constexpr int64_t COLUMNS = {c};" in source, source
        assert "constexpr int64_t lanes = COLUMNS;" in source, source


def test_the_scalar_is_read_once_per_block():
    cf = assert_matches(bn_relu_backward, *_inputs(2, 16, 4, 4), backend="cpp")
    lines = _source(cf).splitlines()
    reads = [n for n, line in enumerate(lines) if "zero_ptr[0]" in line or "_ptr[0];" in line]
    assert reads, "\n".join(lines)
    loops = simd_loops(lines)
    inside = [n for n in reads for loop in loops if loop.first <= n <= loop.last]
    assert not inside, f"a 0-d tensor read inside a lane loop at lines {inside}:\n" + "\n".join(lines)


@X86
@NEEDS_CPP
@pytest.mark.parametrize("target", ["x86-64", "x86-64-v3"])
@pytest.mark.parametrize("channels", [16, 64])
def test_every_lane_loop_inside_k_is_vectorized(channels, target, tmp_path):
    import fusec
    kernels = fusec.explain(bn_relu_backward, *_inputs(2, channels, 4, 4), backend="cpp") \
        .compiled.kernels
    sources = [cpp.render(k.ir) for k in kernels]
    sources = [s for s in sources if "COLUMNS" in s]
    assert sources, [k.name for k in kernels]
    for source in sources:
        report = compile_report(source, target, tmp_path)
        loops = [loop for loop in simd_loops(report.lines) if "each k step" in loop.above]
        assert loops, source
        # (any width: with a byte mask beside the floats, gcc names the mask's vectors, 16
        # bytes for 16 lanes, while the float math runs on the target's widest registers)
        scalar = [loop for loop in loops
                  if not any("loop vectorized using" in line for line in report.said(loop))]
        assert not scalar, f"lane loops inside k left scalar for {target}: " + \
            ", ".join(f"lines {loop.first + 1}-{loop.last + 1}" for loop in scalar) + "\n" + source

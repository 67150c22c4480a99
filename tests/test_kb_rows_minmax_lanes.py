"""Float max and min over rows that lie side by side (the loops turned inside out,
llvm/columns.py): KernelBench-style 15_ (a min over channels after a convolution) and 30_ (a min
over depth, then softmax over channels) reduce this way.

In the lanes of a block of rows the LLVM backend folds each element with one select that takes
NaN (`Accumulator.sticky_extreme`, codegen/llvm/reduction.py), where a loop over k keeps a NaN
flag beside `maxnum`. These tests check that select against eager: NaN anywhere in a row
(first, last, alone, beside infinities), signed zeros, odd shapes with a ragged last block,
non-contiguous inputs, and the two rows' programs, each of which must read no array of NaN
flags."""
import pytest
import torch

from conftest import assert_matches

BACKEND = "llvm"


def lanes(cf) -> str:
    """The kernels' sources, asserting the reduction was turned inside out."""
    text = "\n".join(k.source for k in cf.kernels)
    assert "llvm_reduction_columns" in text, text
    return text


def with_specials(*shape) -> torch.Tensor:
    """Random values with NaN first, last and alone in some rows, and infinities in others."""
    x = torch.randn(*shape) * 3
    flat = x.view(-1)
    n = flat.numel()
    for i, v in enumerate([float("nan"), float("inf"), -float("inf"), float("nan"), 0.0, -0.0]):
        flat[(i * 977 + 3) % n] = v
    flat[0] = float("nan")
    flat[-1] = float("nan")
    return x


@pytest.mark.parametrize("op", [torch.amin, torch.amax])
@pytest.mark.parametrize("shape,dim", [((2, 8, 8, 37), 2), ((3, 70), 0), ((2, 5, 3, 130), 1)])
def test_extremes_in_lanes_match_eager_with_nan(op, shape, dim):
    cf = assert_matches(lambda x: op(x, dim), with_specials(*shape), backend=BACKEND)
    assert ".nan = alloca" not in lanes(cf)


@pytest.mark.parametrize("op", [torch.amin, torch.amax])
def test_a_row_of_nans_and_a_row_of_infinities(op):
    x = torch.randn(9, 70)
    x[:, 3] = float("nan")          # a whole row (the rows are columns of x) of NaN
    x[:, 4] = float("inf")
    x[:, 5] = -float("inf")
    x[4, 6] = float("nan")          # one NaN in the middle of a row
    x[:, 7] = 0.0
    x[::2, 7] = -0.0                # zeros of both signs
    lanes(assert_matches(lambda t: op(t, 0), x, backend=BACKEND))


def test_non_contiguous_input():
    x = with_specials(2, 16, 12, 40).transpose(2, 3)[..., 1:]   # strided, with an offset
    lanes(assert_matches(lambda t: torch.amin(t * 2, 1, keepdim=True).tanh(), x, backend=BACKEND))


@pytest.mark.parametrize("nan", [False, True])
def test_min_over_depth_then_softmax_over_channels(nan):
    """KernelBench-style 30_'s pointwise part: a min over depth, softmax over channels."""
    x = with_specials(2, 8, 8, 16, 16) if nan else torch.randn(2, 8, 8, 16, 16)
    cf = assert_matches(lambda t: torch.softmax(torch.amin(t, dim=2), dim=1), x, backend=BACKEND)
    assert ".nan = alloca" not in lanes(cf)


def test_convolution_min_over_channels_tanh_tanh():
    """KernelBench-style 15_ (a convolution, a min over channels, tanh twice) at a small size."""
    conv = torch.nn.Conv2d(3, 6, 3, padding=1)

    def f(x):
        return torch.tanh(torch.tanh(torch.amin(conv(x), dim=1, keepdim=True)))
    x = torch.randn(2, 3, 9, 70)
    x[0, 1, 4, 5] = float("nan")
    with torch.no_grad():
        lanes(assert_matches(f, x, backend=BACKEND))

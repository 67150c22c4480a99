"""pooling: non-overlapping max and average pools as a view and a reduction (passes/pooling.py).

The rewrite is for GPUs (POOL_DEVICES); here it is switched on for the CPU device as well, so
that every backend runs the rewritten graphs against eager, with odd sizes, NaN, infinities,
half precision and channels-last inputs. The last test checks that it stays off on the CPU.
"""
import pytest
import torch
import torch.nn.functional as F

import fusec
from conftest import assert_matches


def _randn(shape, device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype)


def decisions(fn, *args, backend):
    d = fusec.explain(fn, *args, backend=backend).to_dict()
    (change,) = [c for c in d["passes"] if c["after"] == "pooling"]
    return d, [line for line in change["details"] if ": reduction: " in line or ": kept: " in line]


@pytest.mark.parametrize("shape", [(2, 3, 8, 12), (1, 4, 9, 7), (2, 5, 6, 6)])
def test_max_and_avg_pool2d_become_reductions_fused_with_their_neighbours(target, pools_here, shape):
    backend, device = target
    x = _randn(shape, device)
    x[0, 1, 2, 3] = float("nan")
    x[-1, -1, 0, 0] = float("-inf")

    def f(x):
        return torch.clamp(F.max_pool2d(torch.tanh(x) * 2 + 1, 2), -0.5, 0.5), \
            F.avg_pool2d(x * 3, 3) - 1

    cf = assert_matches(f, x, backend=backend)
    d, lines = decisions(f, x, backend=backend)
    assert [line.split(":")[1].strip() for line in lines] == ["reduction", "reduction"], lines
    assert d["externs"] == []
    # the tanh before the max and the clamp after it share one kernel
    assert any({"aten.tanh.default", "aten.amax.default", "aten.clamp.default"} <= set(k.ops)
               for k in cf.kernels), [k.ops for k in cf.kernels]


def test_pool3d_and_divisor_override(target, pools_here):
    backend, device = target
    x = _randn((2, 3, 4, 6, 5), device)

    def f(x):
        return F.max_pool3d(x, 2), F.avg_pool3d(x, (1, 2, 2)), \
            F.avg_pool2d(x[:, :, 0], 2, divisor_override=3)

    assert_matches(f, x, backend=backend)
    _, lines = decisions(f, x, backend=backend)
    assert len(lines) == 3 and all(": reduction: " in line for line in lines), lines


def test_half_precision_average_pool_adds_in_float32(target, pools_here):
    backend, device = target
    x = _randn((2, 4, 16, 16), device, torch.bfloat16) * 4 + 100
    assert_matches(lambda x: F.avg_pool2d(x, 4), x, backend=backend)


def test_channels_last_input(target, pools_here):
    backend, device = target
    x = _randn((2, 16, 10, 10), device).contiguous(memory_format=torch.channels_last)
    cf = assert_matches(lambda x: F.max_pool2d(F.relu(x), 2) * 2, x, backend=backend)
    out = cf(x)
    assert out.stride() == F.max_pool2d(x, 2).stride()


def test_pools_eager_keeps(target, pools_here):
    """Overlapping windows, padding, ceil_mode and read indices keep eager's kernel; each says why."""
    backend, device = target
    x = _randn((2, 3, 9, 9), device)

    def f(x):
        out, idx = F.max_pool2d(x, 2, return_indices=True)
        return (F.max_pool2d(x, 3, stride=2), F.avg_pool2d(x, 2, padding=1),
                F.max_pool2d(x, 2, ceil_mode=True), out, idx)

    assert_matches(f, x, backend=backend)
    d, lines = decisions(f, x, backend=backend)
    whys = [line.split(": kept: ")[1] for line in lines]
    assert whys == ["the indices of the maxima are read (return_indices=True): eager's kernel",
                    "overlapping windows (kernel [3, 3], stride [2, 2])",
                    "padding, dilation or ceil_mode", "padding, dilation or ceil_mode"], whys
    assert len(d["externs"]) == 4


def test_integer_pools_keep_eager_s_kernel(target, pools_here):
    backend, device = target
    x = torch.randint(-50, 50, (2, 3, 8, 8), device=device)
    if device == "cpu":  # max_pool2d has no integer kernel on CUDA
        assert_matches(lambda x: F.max_pool2d(x, 2), x, backend=backend)
        _, lines = decisions(lambda x: F.max_pool2d(x, 2), x, backend=backend)
        assert lines == ["max_pool2d_with_indices: kept: torch.int64 input (eager's integer "
                         "pooling keeps its kernel)"]


def test_pools_are_reductions_on_the_cpu_by_default():
    """On by default for CPUs too (a 2 x 2 window is a short row, which the C++ and LLVM
    reduction kernels run side by side in SIMD lanes): no pooling extern is left."""
    x = _randn((2, 3, 8, 8), "cpu")
    d = fusec.explain(lambda x: torch.relu(F.max_pool2d(x, 2)), x, backend="cpp").to_dict()
    assert d["externs"] == [] and len(d["kernels"]) == 1, (d["externs"], d["kernels"])

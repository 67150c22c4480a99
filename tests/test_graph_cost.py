"""The CUDA-graph cost model's floor under a program's GPU time (fusec/runtime/cuda_graphs.py),
checked on CPU programs: it counts every byte each kernel and extern call reads and writes."""
import torch

import fusec
from fusec.runtime import HBM_BYTES_PER_US
from fusec.runtime.cuda_graphs import gpu_floor_us


def test_floor_counts_each_kernels_reads_and_writes():
    def one_kernel(x, y):
        return torch.sin(x) * y  # one pointwise kernel: reads x and y, writes the result
    x, y = torch.randn(256, 128), torch.randn(256, 128)
    cf = fusec.compile(one_kernel, backend="cpp")
    cf(x, y)
    program, gm = cf.last.program, cf.last.gm
    assert len(program.steps) == 1
    assert gpu_floor_us(program, gm) == 3 * x.numel() * 4 / HBM_BYTES_PER_US


def test_floor_counts_extern_calls_and_grows_with_the_data():
    def mm_then_relu(a, b):
        return torch.relu(a @ b)
    floors = []
    for n in (64, 128):
        a, b = torch.randn(n, n), torch.randn(n, n)
        cf = fusec.compile(mm_then_relu, backend="cpp")
        torch.testing.assert_close(cf(a, b), mm_then_relu(a, b))
        floors.append(gpu_floor_us(cf.last.program, cf.last.gm))
    # the matmul reads two n x n matrices and writes one, the relu reads and writes one: 5 n^2
    assert floors[0] == 5 * 64 * 64 * 4 / HBM_BYTES_PER_US
    assert floors[1] == 4 * floors[0]


def test_floor_of_a_big_matmul_is_its_arithmetic():
    """512^3 multiply-adds in float32 take longer at the peak than the 3 MB they move."""
    from fusec.runtime.cuda_graphs import FLOPS_PER_US
    def mm(a, b):
        return a @ b + 1.0
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    cf = fusec.compile(mm, backend="cpp")
    torch.testing.assert_close(cf(a, b), mm(a, b))
    floor = gpu_floor_us(cf.last.program, cf.last.gm)
    arithmetic = 2 * 512 ** 3 / FLOPS_PER_US[torch.float32]
    assert arithmetic > 3 * a.numel() * 4 / HBM_BYTES_PER_US
    assert arithmetic < floor <= arithmetic + 2 * a.numel() * 4 / HBM_BYTES_PER_US


def test_floor_of_a_convolution_counts_its_multiply_adds():
    from fusec.runtime.cuda_graphs import FLOPS_PER_US
    conv = torch.nn.Conv2d(64, 64, 3, padding=1)
    x = torch.randn(4, 64, 32, 32)
    cm = fusec.compile(torch.nn.Sequential(conv, torch.nn.ReLU()), backend="cpp")
    with torch.no_grad():
        cm(x)
    floor = gpu_floor_us(cm._compiled.last.program, cm._compiled.last.gm)
    key = "tf32" if torch.backends.cudnn.allow_tf32 else torch.float32
    arithmetic = 2 * (4 * 64 * 32 * 32) * (64 * 9) / FLOPS_PER_US[key]
    assert floor >= arithmetic

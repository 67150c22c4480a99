"""split_reductions: a reduction of few long rows becomes two reductions (passes/split_reductions.py).

The pass is for GPUs (SPLIT_DEVICES); here it is switched on for the CPU device too, with
thresholds scaled down to small tensors, so every backend (C++, LLVM, Triton under the
interpreter) runs the split graphs against eager. The InstanceNorm and per-channel group norm
paths of capture (fusec/capture/torch_level.py, decompositions.py) are tested alongside: they
exist so that those norms split and fuse on channels-last tensors.
"""
import importlib
import math

import pytest
import torch
import torch.nn.functional as F

import fusec
from conftest import assert_matches

split_module = importlib.import_module("fusec.passes.split_reductions")
decompositions = importlib.import_module("fusec.capture.decompositions")


@pytest.fixture
def split_here(monkeypatch):
    """The pass on for CPU tensors, with rows of a few thousand elements counting as long."""
    monkeypatch.setattr(split_module, "SPLIT_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(split_module, "LONG_PROGRAM", 2048)
    monkeypatch.setattr(split_module, "MIN_CHUNK", 256)
    monkeypatch.setattr(decompositions, "GROUP_NORM_PER_CHANNEL_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(decompositions, "GROUP_NORM_LONG_ROWS", 2048)


def split_details(fn, *args, backend):
    d = fusec.explain(fn, *args, backend=backend).to_dict()
    (change,) = [c for c in d["passes"] if c["after"] == "split_reductions"]
    return d, [line for line in change["details"] if ": split: " in line or ": kept: " in line]


def _randn(shape, device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype)


def test_a_sum_of_few_long_rows_is_split_and_keeps_its_prologue(target, split_here):
    backend, device = target
    x = _randn((3, 16, 40, 24), device)
    x[1, 2, 3, 4] = float("nan")
    w = _randn((16, 1, 1), device, seed=1)

    def f(x, w):
        return (torch.sigmoid(x) * w).sum(dim=(1, 2, 3))

    cf = assert_matches(f, x, w, backend=backend)
    # the partial sums with the sigmoid and the scale inside, then the sum of the partials
    assert [k.name for k in cf.kernels] == ["fused_sigmoid_mul_sum_0", "fused_sum_1"]
    d, lines = split_details(f, x, w, backend=backend)
    assert lines == ["sum_1: split: 3 row(s) of 15360 elements (3 program(s)) -> 48 rows of "
                     "960 (48 programs), then 3 row(s) of 16: dim 1 of (3, 16, 40, 24) cut in 16 "
                     "chunks"]
    assert d["externs"] == []


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("op", ["sum", "amax", "amin", "mean"])
def test_split_reductions_match_eager_with_and_without_keepdim(target, split_here, op, keepdim):
    backend, device = target
    x = _randn((2, 8, 30, 36), device)
    x[0, 1, 2, 3] = float("inf") if op != "amin" else float("-inf")

    def f(x):
        return getattr(torch.exp(x * 0.5), op)(dim=(0, 2, 3), keepdim=keepdim)

    assert_matches(f, x, backend=backend)
    _, lines = split_details(f, x, backend=backend)
    assert len(lines) == 1 and ": split: " in lines[0], lines


def test_a_channels_last_global_pool_splits_its_column_reduction(target, split_here):
    """2 x 64 channels side by side: one column-reduction program of 64 rows per image. The
    split cuts H, so each program takes 64 channels of a slab of rows."""
    backend, device = target
    x = _randn((2, 64, 32, 16), device).contiguous(memory_format=torch.channels_last)

    def f(x):
        return F.silu(x).mean(dim=(2, 3))

    cf = assert_matches(f, x, backend=backend)
    _, lines = split_details(f, x, backend=backend)
    assert lines and "128 row(s) of 512 elements (2 program(s))" in lines[0], lines
    assert "dim 2 of (2, 64, 32, 16)" in lines[0]
    assert any("silu" in k.name or "sigmoid" in k.name for k in cf.kernels if "sum" in k.name)


def test_a_half_precision_sum_adds_its_partials_in_float32(target, split_here):
    """Rounding each partial sum to bfloat16 would lose bits eager's kernel keeps: the partials
    stay float32 and the result is rounded once."""
    backend, device = target
    x = _randn((2, 32, 64, 4), device, torch.bfloat16) + 3

    def f(x):
        return x.sum(dim=(1, 2, 3))

    cf = assert_matches(f, x, backend=backend)
    d = fusec.explain(f, x, backend=backend).to_dict()
    (graph,) = [s["graph"] for s in d["stages"] if s["after"] == "split_reductions"]
    assert "dtype = torch.float32" in graph and "sum_1_rounded" in graph
    exact = x.double().sum(dim=(1, 2, 3))
    ours, eager = cf(x).double(), f(x).double()
    assert ((ours - exact).abs() <= (eager - exact).abs() + 0.5).all()


def test_what_does_not_split_is_said(target, split_here):
    """argmax's partial results would need their positions; a reduced dim of prime length
    has no chunks. Both are kept (as one kernel here: on a GPU, an extern)."""
    backend, device = target
    x = _randn((2, 4099), device)

    def f(x):
        return x.argmax(dim=1), torch.tanh(x).sum(dim=1)

    assert_matches(f, x, backend=backend)
    _, lines = split_details(f, x, backend=backend)
    assert lines == ["argmax: kept: argmax: its partial results do not combine by the same reduction",
                     "sum_1: kept: no reduced dim divides into chunks of at least 256 elements"]


def test_the_pass_is_off_for_cpu_tensors_by_default(target):
    backend, device = target
    x = _randn((3, 16, 64, 64), device)
    cf = assert_matches(lambda x: x.sum(dim=(1, 2, 3)), x, backend=backend)
    assert len(cf.kernels) == (1 if device == "cpu" else 2)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("affine", [False, True])
def test_group_norm_per_channel_then_a_mean(target, split_here, layout, affine):
    """Group norm's statistics split; its normalization runs in x's own shape, so the ReLU and
    the partial sums of the mean after it join the same kernel (no tensor is stored whole)."""
    backend, device = target
    norm = torch.nn.GroupNorm(4, 16, affine=affine).to(device)
    if affine:
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    x = _randn((2, 16, 24, 32), device)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)

    def f(x):
        return torch.relu(norm(x)).mean(dim=(1, 2, 3))

    cf = assert_matches(f, x, backend=backend)
    _, lines = split_details(f, x, backend=backend)
    assert sum(": split: " in line for line in lines) == 3, lines  # mean, variance, the last mean
    # (on CUDA, torch's group_norm first copies a channels-last input to NCHW, as eager does;
    # that copy may join the normalization's kernel)
    wanted = {"aten.sub.Tensor", "aten.relu.default", "aten.sum.dim_IntList"}
    assert any(wanted <= set(k.ops) for k in cf.kernels), [k.ops for k in cf.kernels]


@pytest.mark.parametrize("shape", [(3, 6), (2, 6, 50), (2, 6, 5, 7, 9)])
def test_group_norm_per_channel_ranks(target, split_here, shape, monkeypatch):
    backend, device = target
    monkeypatch.setattr(decompositions, "GROUP_NORM_LONG_ROWS", 1)  # every group norm
    x = _randn(shape, device) * 3 + 1
    w, b = _randn((6,), device, seed=1), _randn((6,), device, seed=2)
    assert_matches(lambda x: F.group_norm(x, 3, w, b, eps=1e-3) * 2, x, backend=backend)


@pytest.mark.parametrize("affine", [False, True])
def test_instance_norm_runs_on_channels_last_without_a_copy_back(target, affine, monkeypatch):
    """InstanceNorm views (N, C, H, W) as (1, N * C, H, W), which a channels-last tensor cannot
    take; capture computes it per image and channel instead (capture/torch_level.py)."""
    backend, device = target
    conv = torch.nn.Conv2d(3, 8, 3, padding=1).to(device)
    norm = torch.nn.InstanceNorm2d(8, affine=affine).to(device)
    if affine:
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    x = _randn((2, 3, 12, 10), device)

    def f(x):
        return norm(conv(x)) / 2.0

    monkeypatch.setenv("FUSEC_LAYOUT", "channels_last")
    assert_matches(f, x, backend=backend)
    layout = fusec.explain(f, x, backend=backend).to_dict()["layout"]
    assert layout["choice"] == "channels_last"
    whys = [c["why"] for c in layout["conversions"]]
    assert not any("needs eager's layout" in w for w in whys), whys


def test_instance_norm_with_running_statistics_and_functional(target):
    """With running statistics torch's composite runs (they are read, or updated); without,
    `F.instance_norm` called directly takes fusec's path."""
    backend, device = target
    norm = torch.nn.InstanceNorm1d(4, track_running_stats=True).to(device).eval()
    with torch.no_grad():
        norm.running_mean.uniform_(-1, 1)
        norm.running_var.uniform_(0.5, 2)
    x = _randn((3, 4, 20), device)
    assert_matches(norm, x, backend=backend)
    assert_matches(lambda x: F.instance_norm(x, use_input_stats=True, eps=1e-3), x, backend=backend)


def test_a_view_that_cuts_a_computed_value_is_pushed_up_too(target, split_here):
    """Group norm views (N, C, H, W) as (N, G, C/G, H, W). When its input is computed (a bias
    add), the split pushes that view up through the add as well: every kernel reads x and b,
    and no (N, C, H, W) tensor is stored."""
    backend, device = target
    x = _randn((2, 16, 24, 32), device)
    b = _randn((16, 1, 1), device, seed=1)

    def f(x, b):
        return torch.relu(F.group_norm(x + b, 4)).mean(dim=(1, 2, 3))

    cf = assert_matches(f, x, b, backend=backend)
    sizes = {name: eval(shape[3:]) for s in cf.last.schedule for name, shape in s.shapes.items()}
    big = [w for s in cf.last.schedule for w in s.writes if math.prod(sizes[w]) >= x.numel()]
    assert not big, big
    # two kernels read x + b: the chunks' sums and squared deviations (one pass, see the note on
    # variance in split_reductions), and the normalization with the ReLU and the last mean's sums
    assert sum(k.name.startswith("fused_add") and "sum" in k.name for k in cf.kernels) == 2, \
        [k.name for k in cf.kernels]


def test_rows_too_few_after_one_cut_are_cut_again(target, split_here, monkeypatch):
    """A 3-D volume of depth 4: cutting D into 4 slices still leaves too few programs, so the
    first reduction is split again, along H."""
    backend, device = target
    monkeypatch.setattr(split_module, "TARGET_PROGRAMS", 64)
    monkeypatch.setattr(split_module, "FEW_PROGRAMS", 32)
    monkeypatch.setattr(split_module, "LONG_PROGRAM", 512)
    monkeypatch.setattr(split_module, "MIN_CHUNK", 64)
    x = _randn((2, 3, 4, 16, 40), device)

    def f(x):
        return torch.tanh(x).sum(dim=(2, 3, 4))

    assert_matches(f, x, backend=backend)
    _, lines = split_details(f, x, backend=backend)
    assert [line.split(":")[0] for line in lines] == ["sum_1", "sum_1_partial"], lines
    assert "dim 2 of (2, 3, 4, 16, 40) cut in 4 chunks" in lines[0]
    assert "cut in" in lines[1] and "dim 4 of (2, 3, 4, 1, 16, 40)" in lines[1], lines


@pytest.mark.parametrize("keepdim", [False, True])
def test_a_split_variance_reads_its_input_once(target, split_here, keepdim):
    """var = sum((x - mean)^2) / n, split: the chunks' own means and squared deviations are one
    kernel, and Chan's formula adds the chunks' corrections (split_reductions, note on variance).
    A large offset is where a variance formula loses digits: it must match eager's accuracy."""
    backend, device = target
    x = _randn((2, 6, 40, 48), device) * 3 + 1000.0
    x[1, 2, 3, 4] = float("nan")

    def f(x):
        return torch.var(torch.sigmoid(x - 1000.0) * 4 + x, dim=(1, 2, 3), keepdim=keepdim,
                         correction=0)

    cf = assert_matches(f, x, backend=backend)
    _, lines = split_details(f, x, backend=backend)
    assert any(line.startswith("sum_2: split: one pass with the chunks' own means") for line in lines), lines
    # the chunk sums and the chunks' squared deviations share a kernel: x is read by one kernel
    readers = [s for s in cf.last.schedule if s.kind == "kernel" and "x" in s.reads]
    assert len(readers) == 1, [(s.name, s.reads) for s in cf.last.schedule]
    exact = torch.var(torch.sigmoid(x.double() - 1000.0) * 4 + x.double(), dim=(1, 2, 3),
                      keepdim=keepdim, correction=0)
    ours, eager = cf(x).double(), f(x).double()
    ok = torch.isfinite(exact)
    assert ((ours - exact).abs()[ok] <= 2 * (eager - exact).abs()[ok] + 1e-4).all()
    assert torch.isnan(ours[~ok]).all()


def test_a_variance_split_twice_still_reads_its_input_once(target, split_here):
    """A depth of 4 gives 4 chunks, too few programs: the partial sums are split again along H
    (the note on variance applies at both levels, each with its own chunks' means), and the
    chunk sums and squared deviations of the second level share one kernel reading x."""
    backend, device = target
    x = _randn((2, 3, 4, 64, 48), device) * 2 + 100.0
    x[0, 1, 2, 3, 4] = float("nan")

    def f(x):
        return torch.var(x * 0.5, dim=(2, 3, 4), correction=0)

    cf = assert_matches(f, x, backend=backend)
    _, lines = split_details(f, x, backend=backend)
    variance = [line for line in lines if line.startswith("sum_2")]
    assert len(variance) == 2 and all("one pass with the chunks' own means" in line
                                      for line in variance), lines
    readers = [s for s in cf.last.schedule if s.kind == "kernel" and "x" in s.reads]
    assert len(readers) == 1, [(s.name, s.reads) for s in cf.last.schedule]


def test_a_shape_familys_group_norm_splits_along_its_fixed_sizes(target, split_here):
    """With the batch a symbol (a shape family, fusec/dynamic.py), the statistics still split:
    the cut is along a reduced dim of a fixed size, so its chunks divide it at every batch size,
    and the one program serves batches it was not traced at."""
    backend, device = target
    norm = torch.nn.GroupNorm(4, 16).to(device)

    def f(x):
        return torch.relu(norm(x)).mean(dim=(1, 2, 3))

    cf = fusec.compile(f, backend=backend)
    first = _randn((3, 16, 24, 32), device)
    torch._dynamo.mark_dynamic(first, 0)
    with torch.no_grad():
        for n in (3, 2, 5, 8):
            x = first if n == 3 else _randn((n, 16, 24, 32), device, seed=n)
            torch.testing.assert_close(cf(x), f(x), rtol=1e-4, atol=1e-5)
    assert cf.compiles == 1 and len(cf.families) == 1, cf.recompiles
    with torch.no_grad():
        _, lines = split_details(cf, first, backend=backend)
    assert sum(": split: " in line for line in lines) == 3, lines

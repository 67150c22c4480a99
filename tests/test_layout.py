"""layout: convolutions channels-last, kernels around them in the same layout, outputs as eager's.

Most tests force the rewrite (FUSEC_LAYOUT=channels_last) so that small, odd shapes exercise it
on every backend; the cost model's own choices are tested on the graph, without running.
"""
import pytest
import torch
import torch.nn.functional as F

import fusec
from conftest import assert_matches
from fusec.frontend import capture
from fusec.passes import run_pipeline
from fusec.passes.layout import speedup
from fusec.passes.memory import plan_memory
from fusec.record import record_of

aten = torch.ops.aten


@pytest.fixture
def channels_last(monkeypatch):
    monkeypatch.setenv("FUSEC_LAYOUT", "channels_last")


def plan_of(fn, *inputs):
    gm, _ = run_pipeline(capture(fn, inputs).gm)
    return record_of(gm).layout, gm


def check(fn, *inputs, backend):
    """Values match eager (float64-referenced) and every output has eager's strides.

    On a GPU the float32 checks run with TF32 off for cuDNN: with PyTorch's default (TF32 allowed)
    cuDNN is free to pick a TF32 algorithm, and for some shapes it does so in NHWC but not in NCHW
    (a 3-D transposed convolution: 2e-3 instead of 5e-7 from float64). That is TF32's error, which
    the user's flag allows; with the flag off both layouts must give float32's accuracy."""
    cudnn = torch.backends.cudnn
    with cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark,
                     deterministic=cudnn.deterministic, allow_tf32=False):
        return _check(fn, *inputs, backend=backend)


def _check(fn, *inputs, backend):
    cf = assert_matches(fn, *inputs, backend=backend)
    got = torch.utils._pytree.tree_leaves(cf(*inputs))
    with torch.no_grad():
        want = torch.utils._pytree.tree_leaves(fn(*inputs))
    for g, w in zip(got, want):
        assert g.shape == w.shape
        if w.numel() == 0:
            continue  # strides of an empty tensor carry no meaning (fusec returns 0 strides)
        assert all(a == b for a, b, n in zip(g.stride(), w.stride(), w.shape) if n != 1), \
            (g.stride(), w.stride())
    return cf


def conv_args(device, dtype=torch.float32, n=3, cin=5, cout=7, hw=(9, 11), k=3, groups=1):
    torch.manual_seed(0)
    x = torch.randn(n, cin, *hw, device=device, dtype=dtype)
    w = torch.randn(cout, cin // groups, *([k] * len(hw)), device=device, dtype=dtype) * 0.3
    b = torch.randn(cout, device=device, dtype=dtype)
    return x, w, b


# ---- programs: a convolution followed by what KernelBench level 2 puts after one ----------------

def conv_relu_scale(x, w, b):
    return torch.relu(F.conv2d(x, w, b, padding=1)) * 0.5 + 1.0


def conv_bn_eval(x, w, b):
    y = F.conv2d(x, w, b, stride=2, padding=1)
    c = y.shape[1]
    mean, var = torch.linspace(-1, 1, c, device=x.device, dtype=x.dtype), \
        torch.linspace(0.5, 2, c, device=x.device, dtype=x.dtype)
    return F.batch_norm(torch.tanh(y), mean, var, weight=var, bias=mean, training=False)


def conv_bn_train(x, w, b):
    y = F.conv2d(x, w, b)
    c = y.shape[1]
    mean, var = torch.zeros(c, device=x.device, dtype=x.dtype), torch.ones(c, device=x.device,
                                                                            dtype=x.dtype)
    return F.batch_norm(F.silu(y), mean, var, training=True)


def conv_groupnorm(x, w, b):
    return F.group_norm(F.gelu(F.conv2d(x, w, b, padding=1)), 1) * 2


def conv_instancenorm(x, w, b):
    return F.instance_norm(F.conv2d(x, w, b)) + 0.1


def conv_pools(x, w, b):
    y = F.conv2d(x, w, b, padding=1)
    return F.max_pool2d(y, 2) - F.avg_pool2d(y, 2), F.adaptive_avg_pool2d(y, 1)


def conv_global_mean(x, w, b):
    y = torch.sigmoid(F.conv2d(x, w, b))
    return y.mean((2, 3)), y.mean((2, 3), keepdim=True) * y


def conv_softmax_channels(x, w, b):
    return torch.softmax(F.conv2d(x, w, b, padding=1), dim=1)


def conv_only(x, w, b):
    return F.conv2d(x, w, b)


def conv_flatten_linear(x, w, b):
    y = torch.relu(F.conv2d(x, w, b))
    return y.flatten(1) @ torch.ones(y[0].numel(), 3, device=x.device, dtype=x.dtype)


def conv_residual(x, w, b):
    y = torch.relu(F.conv2d(x, w, b, padding=1))
    w2 = w[:, :1].expand(-1, y.shape[1], -1, -1).contiguous() * 0.2
    return torch.relu(F.conv2d(y, w2, padding=1) + y)


PROGRAMS_2D = [conv_relu_scale, conv_bn_eval, conv_bn_train, conv_groupnorm, conv_instancenorm,
               conv_pools, conv_global_mean, conv_softmax_channels, conv_only,
               conv_flatten_linear]


@pytest.mark.parametrize("fn", PROGRAMS_2D, ids=lambda f: f.__name__)
def test_conv2d_programs_match_eager_in_channels_last(channels_last, target, fn):
    backend, device = target
    x, w, b = conv_args(device)
    plan, _ = plan_of(fn, x, w, b)
    assert plan.choice == "channels_last"
    check(fn, x, w, b, backend=backend)


def test_kernels_around_the_convolution_walk_nhwc(channels_last, target):
    """The fused kernel after the conv reads the conv's NHWC output contiguously: its loop has
    channels innermost, stride 1 (the conversion back to NCHW is the store's business)."""
    backend, device = target
    x, w, b = conv_args(device, cin=4, cout=8)

    def fn(x, w, b):
        y = torch.relu(F.conv2d(x, w, b, padding=1))
        return torch.softmax(y * 2, dim=1)

    cf = check(fn, x, w, b, backend=backend)
    sm = [k for k in cf.kernels if "amax" in k.name]
    assert len(sm) == 1
    ir = sm[0].ir
    assert ir.k_shape == (8,)  # the softmax's channels: one contiguous run per pixel
    assert all(ld.index.strides[-1] == 1 for ld in ir.loads if ld.param.startswith("conv"))


def test_intermediate_buffers_get_channels_last_strides(channels_last):
    x, w, b = conv_args("cpu")

    def fn(x, w, b):
        y = torch.relu(F.conv2d(x, w, b, padding=1))
        return F.max_pool2d(y, 2, stride=1)  # (overlapping windows: an extern) reads y, so y is a planned buffer

    _, gm = plan_of(fn, x, w, b)
    relu = next(n for n in gm.graph.nodes if n.name == "relu")
    assert relu.meta["fusec_layout"].stride == (7 * 9 * 11, 1, 11 * 7, 7)
    assert "relu" in plan_memory(gm).placements


def test_conv_residual_block(channels_last, target):
    backend, device = target
    x, w, b = conv_args(device, cin=6, cout=6)
    check(conv_residual, x, w, b, backend=backend)


def test_depthwise_and_strided_conv(channels_last, target):
    backend, device = target
    x, w, b = conv_args(device, cin=6, cout=6, groups=3, hw=(10, 7))
    check(lambda x, w, b: F.hardtanh(F.conv2d(x, w, b, stride=(2, 1), groups=3), -0.5, 0.5),
          x, w, b, backend=backend)


def test_conv3d_programs(channels_last, target):
    backend, device = target
    x, w, b = conv_args(device, n=2, cin=3, cout=5, hw=(4, 5, 6))

    def fn(x, w, b):
        y = F.conv3d(x, w, b, padding=1)
        return torch.softmax(F.leaky_relu(y), dim=1), F.group_norm(y, 5), F.max_pool3d(y, 2)

    plan, _ = plan_of(fn, x, w, b)
    assert plan.choice == "channels_last"
    assert any(t[2] == "channels_last_3d" for t in plan.tensors)
    check(fn, x, w, b, backend=backend)


def test_avg_pool3d_reads_eager_layout_on_cuda(channels_last, target):
    # cuDNN's conv3d runs NDHWC; CUDA's avg_pool3d has no channels-last kernel and would copy its
    # input back itself (slowly), so the pass converts it first, inside the kernel that writes it.
    # (Windows that tile the input become reductions on a GPU, passes/pooling.py, and need no
    # pooling kernel: these overlap.)
    backend, device = target
    x, w, b = conv_args(device, n=2, cin=3, cout=5, hw=(4, 6, 6))

    def fn(x, w, b):
        return F.avg_pool3d(torch.relu(F.conv3d(x, w, b, padding=1)) * 2, 2, stride=1)

    plan, gm = plan_of(fn, x, w, b)
    assert plan.choice == "channels_last"
    back = [c for c in plan.conversions if "no channels-last kernel" in c.why]
    if device == "cuda":
        assert len(back) == 1 and back[0].free and back[0].to == "contiguous"
    else:  # the CPU's avg_pool3d reads channels-last itself
        assert back == []
    check(fn, x, w, b, backend=backend)
    x2, w2, b2 = conv_args(device)  # avg_pool2d: it has a channels-last kernel, a slow one

    def fn2(x, w, b):
        return torch.sigmoid(F.avg_pool2d(F.conv2d(x, w, b, padding=1) + 1, 2, stride=1)).sum()

    plan, _ = plan_of(fn2, x2, w2, b2)
    back = [c for c in plan.conversions if "slower in channels-last" in c.why]
    assert len(back) == (1 if device == "cuda" else 0)
    check(fn2, x2, w2, b2, backend=backend)


def test_conv_transpose_programs(channels_last, target):
    """KernelBench-style: ConvTranspose2d -> Mish -> add -> Hardtanh -> scale, and a 3-D one."""
    backend, device = target
    x, _, _ = conv_args(device, cin=6, hw=(5, 7))
    w = torch.randn(6, 4, 3, 3, device=device) * 0.3
    b = torch.randn(4, device=device)

    def fn(x, w, b):
        y = F.conv_transpose2d(x, w, b, stride=2, padding=1, output_padding=1)
        return F.hardtanh(F.mish(y) + 0.5, -1, 1) * 2

    check(fn, x, w, b, backend=backend)
    x3 = torch.randn(2, 3, 3, 4, 5, device=device)
    w3 = torch.randn(3, 2, 2, 2, 2, device=device)
    check(lambda x, w: torch.tanh(F.conv_transpose3d(x, w, stride=2)), x3, w3, backend=backend)


def test_non_contiguous_and_channels_last_inputs(channels_last, target):
    backend, device = target
    x, w, b = conv_args(device, hw=(9, 22))
    sliced = x[..., ::2]  # strided view: converted once, read in place
    check(conv_relu_scale, sliced, w, b, backend=backend)
    nhwc = x.contiguous(memory_format=torch.channels_last)  # already channels-last: no conversion
    plan, _ = plan_of(conv_relu_scale, nhwc, w, b)
    assert all(c.source != "x" for c in plan.conversions)
    check(conv_relu_scale, nhwc, w, b, backend=backend)  # eager returns NHWC here: so do we


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes(channels_last, target, dtype):
    backend, device = target
    x, w, b = conv_args(device, dtype=dtype)
    check(conv_groupnorm, x, w, b, backend=backend)
    check(conv_softmax_channels, x, w, b, backend=backend)


def test_nan_and_empty(channels_last, target):
    backend, device = target
    x, w, b = conv_args(device)
    x[1, 2, 3, 4] = float("nan")
    check(conv_softmax_channels, x, w, b, backend=backend)
    check(conv_relu_scale, x[:0], w, b, backend=backend)


def test_output_that_is_a_non_dense_view_keeps_eager_layout(channels_last):
    x, w, b = conv_args("cpu")

    def fn(x, w, b):
        return torch.relu(F.conv2d(x, w, b))[:, :3]

    plan, _ = plan_of(fn, x, w, b)
    assert plan.choice == "unchanged" and "non-dense" in plan.reason
    check(fn, x, w, b, backend="cpp")


# ---- the cost model ----------------------------------------------------------------------------

def test_cost_model_keeps_tiny_convolutions_as_they_are():
    x, w, b = conv_args("cpu")
    plan, gm = plan_of(conv_relu_scale, x, w, b)
    assert plan.choice == "unchanged" and "more than" in plan.reason
    assert not any(n.target is aten.clone.default for n in gm.graph.nodes if n.op == "call_function")


def test_cost_model_picks_channels_last_for_a_real_conv2d_on_cpu():
    x, w, b = conv_args("cpu", n=8, cin=64, cout=128, hw=(32, 32))
    plan, _ = plan_of(conv_relu_scale, x, w, b)
    if not (torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available()):
        assert plan.choice == "unchanged"
        return
    assert plan.choice == "channels_last", plan.reason
    assert plan.gain_s > plan.cost_s
    (conv,) = plan.convs
    assert conv.speedup > 1 and "oneDNN" in conv.reason


@pytest.mark.parametrize("case", ["conv_transpose3d", "f64"])
def test_cost_model_leaves_what_is_not_faster(case):
    if case == "conv_transpose3d":
        x, w, b = conv_args("cpu", n=4, cin=32, cout=32, hw=(8, 16, 16))
        fn = lambda x, w, b: F.conv_transpose3d(x, w, b).relu()  # noqa: E731
    else:
        x, w, b = conv_args("cpu", dtype=torch.float64, n=8, cin=64, cout=128, hw=(32, 32))
        fn = conv_relu_scale
    plan, _ = plan_of(fn, x, w, b)
    assert plan.choice == "unchanged" and "no convolution is measured faster" in plan.reason


def test_cost_model_respects_tf32_setting():
    # torch's flags() context manager, not assignment: once a test module of torch's own testing
    # utilities is imported (the OpInfo tests), setting cudnn flags directly is refused
    cudnn = torch.backends.cudnn
    with cudnn.flags(enabled=cudnn.enabled, allow_tf32=True):
        assert speedup("cuda:0", 2, False, torch.float32)[0] > 1
    with cudnn.flags(enabled=cudnn.enabled, allow_tf32=False):
        s, why = speedup("cuda:0", 2, False, torch.float32)
        assert s == 1.0 and "allow_tf32" in why
        assert speedup("cuda:0", 2, False, torch.bfloat16)[0] > 1  # bf16 needs no TF32 permission
        assert torch.backends.cudnn.allow_tf32 is False  # the pass only reads the flag


def test_forcing_contiguous(monkeypatch):
    monkeypatch.setenv("FUSEC_LAYOUT", "contiguous")
    x, w, b = conv_args("cpu", n=8, cin=64, cout=128, hw=(32, 32))
    plan, _ = plan_of(conv_relu_scale, x, w, b)
    assert plan.choice == "unchanged" and "FUSEC_LAYOUT" in plan.reason


# ---- explain ------------------------------------------------------------------------------------

def test_explain_says_which_layout_each_tensor_got_and_why(channels_last):
    x, w, b = conv_args("cpu")
    e = fusec.explain(conv_flatten_linear, x, w, b, backend="cpp")
    text = str(e)
    section = text[text.index("=== memory layout ==="):text.index("=== fusion groups ===")]
    assert "layout: channels_last" in section
    assert "x_channels_last" in section and "the input of convolution" in section
    assert "relu_contiguous" in section and "needs eager's layout" in section
    for line in ("convolution ", "relu "):
        assert any(l.strip().startswith(line) and "channels_last" in l
                   for l in section.splitlines()), line
    d = e.to_dict()["layout"]
    assert d["choice"] == "channels_last"
    assert {t["name"]: t["format"] for t in d["tensors"]}["convolution"] == "channels_last"


def test_global_average_pool_over_many_channels_reads_rows_side_by_side(channels_last, target):
    """NHWC mean over (H, W): the rows (channels) are adjacent, each row's elements C apart; the
    Triton kernel then takes 64 neighbouring rows per program (a column reduction)."""
    from fusec.codegen.triton import is_column_reduction
    backend, device = target
    x, w, b = conv_args(device, n=2, cin=4, cout=96, hw=(11, 9))

    def fn(x, w, b):
        y = F.relu(F.conv2d(x, w, b))
        return y.mean((2, 3)), y.amax((2, 3), keepdim=True)

    cf = check(fn, x, w, b, backend=backend)
    reductions = [k for k in cf.kernels if hasattr(k.ir, "k_shape")]
    assert reductions and all(is_column_reduction(k.ir) for k in reductions)
    if backend == "triton":
        assert all("XBLOCK=64" in k.source for k in reductions)


def test_group_norm_walks_its_groups_in_memory_order(channels_last, target):
    """Channels-last group norm reduces over (C/G, H*W) with strides (1, C): the kernel walks k as
    (H*W, C/G), so the innermost k dim is the contiguous one."""
    backend, device = target
    x, w, b = conv_args(device, n=2, cin=3, cout=8, hw=(6, 5))

    def fn(x, w, b):
        return F.group_norm(F.conv2d(x, w, b), 2) * 1.5

    cf = check(fn, x, w, b, backend=backend)
    (gn,) = [k for k in cf.kernels if hasattr(k.ir, "k_shape")]
    loads = [l for l in gn.ir.loads if any(l.index.strides[len(gn.ir.row_shape):])]
    assert loads and all(l.index.strides[-1] == 1 for l in loads), gn.ir


def test_a_depthwise_convolution_is_priced_from_its_bytes(target):
    """A depthwise conv2d does little arithmetic per byte: in NCHW eager runs a memory-bound
    kernel, which the channels-last one beats (3.3x on an H200 with cuDNN, 1.6x on a CPU core
    with oneDNN). Priced by FLOPs alone it would never pay for its conversions; it is priced
    from its bytes on both."""
    backend, device = target
    n, hw = (8, (128, 128)) if device == "cuda" else (2, (16, 16))  # 33 MB: worth converting
    x, w, b = conv_args(device, n=n, cin=32, cout=32, hw=hw, groups=32)

    def fn(x, w, b):
        return torch.clamp(F.conv2d(x, w, b, padding=1, groups=32), 0, 6)

    plan, _ = plan_of(fn, x, w, b)
    kind = "cuda" if device == "cuda" else "cpu"
    assert f"depthwise conv2d f32 on {kind}" in plan.convs[0].reason, plan.convs[0].reason
    if device == "cuda":
        assert plan.choice == "channels_last", plan.reason
    check(fn, x, w, b, backend=backend)

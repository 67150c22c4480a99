"""Layout: decide, once per program, whether the convolutions run channels-last.

A 4-D activation `(N, C, H, W)` can sit in memory in two dense orders. PyTorch's default,
*contiguous* (NCHW), keeps each channel's H x W image together; *channels-last* (NHWC) keeps the C
values of each pixel together. The math is the same, the speed is not: a convolution is a matrix
product over the C (and kernel-window) values of each pixel, and the fast convolution kernels of
cuDNN (Tensor Cores) and oneDNN (AVX-512/AVX2 vectors) read those values as one contiguous run,
so they want NHWC. Given NCHW they either run a slower kernel or transpose the tensor first and
transpose the result back, and eager PyTorch pays that on every call (docs/passes/layout.md).

This pass tries the other layout and keeps it when the stated cost model says it pays:

1. every convolution whose device and dtype have fast channels-last kernels gets its input and
   weight converted (`clone(x, memory_format=torch.channels_last)`, `channels_last_3d` for 5-D);
2. the new strides are propagated through the graph with fake tensors, exactly as eager PyTorch
   would propagate them: pointwise ops, norms, pooling and reductions keep the layout of what
   they read, so the schedule gives every kernel output these strides and every fused kernel
   walks its tensors in NHWC order. A view that cannot be expressed on the new layout (a
   `flatten` before a linear layer) gets a conversion back to contiguous just before it;
3. every program output whose strides now differ from eager's gets a conversion back to exactly
   eager's strides (a `clone` pinned to them), so callers see what eager returns;
4. the price: a conversion that reads a tensor some kernel writes anyway fuses into that kernel
   (it only changes the order the kernel stores in): free on a GPU, and on a CPU the price of
   storing its bytes out of order (Note: a fused conversion is not free, layout_plan.py); a
   conversion of a program input, a weight or an extern's result is one extra pass over the
   tensor and one more kernel launch (`conversion_cost`). A convolution gains its estimated time
   (FLOPs / throughput) times (1 - 1/speedup), the speedup measured per device, kind and dtype
   (SPEEDUP, layout_plan.py). Channels-last is kept only when the gains exceed the extra passes.

    before                                         after
    conv = convolution(x, w, b, ...)               x_cl   = clone(x, memory_format=channels_last)
    relu = relu(conv)                              w_cl   = clone(w, memory_format=channels_last)
    return (relu,)                                 conv   = convolution(x_cl, w_cl, b, ...)   # NHWC
                                                   relu   = relu(conv)                        # NHWC
                                                   relu_o = clone(relu)  # eager's NCHW strides,
                                                   return (relu_o,)      # fuses with relu

The decision and a line for every 4-D/5-D tensor (its layout and why) are kept in
`record_of(gm).layout` (a LayoutPlan, fusec/record.py) and printed by `fusec.explain`. The environment
variable FUSEC_LAYOUT=channels_last (or contiguous) overrides the cost model, for experiments and
tests; numerics never depend on it beyond the vendor library's own rounding: the pass changes no
backend flag (torch.backends.cudnn.allow_tf32 and friends stay as the user set them).
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from fusec.symbolic import hint
from fusec import env, ops
from fusec.graphmodule import copy_graph_module, looks_for
from fusec.ir import TensorMeta, contiguous_strides, meta_of, short_dtype
from fusec.record import record_of

from .conv_algorithm import choose_algorithms
from .layout_plan import (BANDWIDTH, DEPTHWISE, FLOPS, LAUNCH, PER_THREAD, SPEEDUP,  # noqa: F401
                          ConvChoice, Conversion, LayoutPlan, conv_rate, conversion_cost, speedup)
from .schedule import is_dense, fake_mode_of

aten = torch.ops.aten

# Extern ops that should read eager's layout on a device, and why. avg_pool3d has no channels-last
# CUDA kernel: given one it copies its input back itself, with a slow generic copy (0.24 ms before
# the pooling in KernelBench-style 29_conv3d_batchnorm_avgpool on an H200); avg_pool2d has one,
# at half the speed (0.208 ms against 0.102 in NCHW, 13_conv2d_avgpool_sigmoid_sum). The pass
# converts their input back to eager's layout, which is free when a kernel writes it.
CONTIGUOUS_ONLY = {
    (aten.avg_pool3d.default, "cuda"): "has no channels-last kernel on cuda",
    (aten.avg_pool2d.default, "cuda"): "runs 2x slower in channels-last on cuda",
}

# ---- the pass ------------------------------------------------------------------------------------

@looks_for(aten.convolution.default)
def layout(gm: fx.GraphModule) -> fx.GraphModule:
    """Channels-last where the cost model says it pays (module doc), then conv_algorithm.py."""
    return choose_algorithms(_layout(gm))


def _layout(gm: fx.GraphModule) -> fx.GraphModule:
    convs = [n for n in gm.graph.nodes if n.op == "call_function"
             and n.target is aten.convolution.default and _tensor(n.args[0]) is not None
             and _tensor(n.args[0]).dim() in (4, 5)]
    if not convs:
        record_of(gm).layout = LayoutPlan("unchanged", "no convolution")
        return gm
    forced = env.choice("FUSEC_LAYOUT", "auto", ("auto", "channels_last", "contiguous", "off", "0", "nchw"))
    choices = [_price_conv(n) for n in convs]
    if forced in ("contiguous", "off", "0", "nchw"):
        record_of(gm).layout = LayoutPlan("unchanged", "FUSEC_LAYOUT=contiguous", choices)
        return gm
    wanted = [n for n, c in zip(convs, choices) if c.speedup > 1.0 or forced == "channels_last"]
    if not wanted:
        record_of(gm).layout = LayoutPlan(
            "unchanged", "no convolution is measured faster in channels-last here", choices)
        return gm
    trial = copy_graph_module(gm)
    try:
        conversions = _rewrite(trial, {n.name for n in wanted})
    except _CannotConvert as err:
        record_of(gm).layout = LayoutPlan("unchanged", str(err), choices)
        return gm
    plan = LayoutPlan("channels_last", "", choices, conversions)
    plan.gain_s = hint(sum(c.gain_s for c in choices))  # (estimates: at the traced sizes)
    plan.cost_s = hint(sum(conversion_cost(c) for c in conversions))
    if forced == "channels_last":
        plan.reason = "FUSEC_LAYOUT=channels_last (cost model overridden)"
    elif plan.gain_s > plan.cost_s:
        plan.reason = "the convolutions' estimated gain exceeds the conversions' cost"
    else:
        record_of(gm).layout = LayoutPlan(
            "unchanged", f"conversions would cost {plan.cost_s * 1e3:.3f} ms, more than the "
            f"{plan.gain_s * 1e3:.3f} ms the convolutions would gain", choices,
            gain_s=plan.gain_s, cost_s=plan.cost_s)
        return gm
    plan.tensors = _describe(trial, conversions, {n.name for n in wanted})
    record_of(trial).layout = plan
    trial.recompile()
    return trial


class _CannotConvert(Exception):
    pass


def _rewrite(gm: fx.GraphModule, conv_names: set[str]) -> list[Conversion]:
    """Insert the conversions and re-derive every node's strides. Returns the conversions."""
    eager_meta = {n: n.meta.get("fusec") for n in gm.graph.nodes}
    convert = _Converter(gm.graph, fake_mode_of(gm))
    _convert_convolution_operands(gm.graph, conv_names, convert)
    _propagate_strides(gm.graph, convert, eager_meta)
    _outputs_in_eager_strides(gm.graph.output_node(), convert, eager_meta)
    return convert.conversions


class _Converter:
    """Inserts the layout conversions (an `aten.clone` to a memory format, or to given strides)
    and lists them; asked twice for one value in one layout, it returns the first clone."""

    def __init__(self, graph: fx.Graph, mode):
        self.graph, self.mode = graph, mode
        self.conversions: list[Conversion] = []
        self.converted: dict[tuple[fx.Node, str], fx.Node] = {}

    def __call__(self, value: fx.Node, fmt, before: fx.Node, why: str, stride=None,
                 suffix: str = "channels_last") -> fx.Node:
        """`value` in memory format `fmt` (or with strides `stride`), computed before `before`."""
        key = (value, str(stride) if stride is not None else str(fmt))
        if key in self.converted:
            return self.converted[key]
        with self.graph.inserting_before(before):
            kwargs = {"memory_format": fmt} if fmt is not None else {}
            new = self.graph.call_function(aten.clone.default, (value,), kwargs)
        new._rename(f"{value.name}_{suffix}")
        src = value.meta["val"]
        with self.mode:
            val = torch.empty_strided(src.shape, stride, dtype=src.dtype, device=src.device) \
                if stride is not None else aten.clone.default(src, memory_format=fmt)
        set_meta(new, val, like=value)
        # A conversion fuses into the kernel that computes its input, when one does.
        free = value.op == "call_function" and ops.classify(value.target) == ops.POINTWISE
        to = _format_name(TensorMeta.of(val))
        self.conversions.append(Conversion(new.name, value.name, to, _nbytes(val), free, why,
                                           str(src.device)))
        self.converted[key] = new
        return new


def _convert_convolution_operands(graph: fx.Graph, conv_names: set[str],
                                  convert: _Converter) -> None:
    """Step 1: each chosen convolution reads its input and weight channels-last."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.name in conv_names:
            x, w = node.args[0], node.args[1]
            fmt = torch.channels_last if _tensor(x).dim() == 4 else torch.channels_last_3d
            args = list(node.args)
            for i, (value, role) in enumerate(((x, "input"), (w, "weight"))):
                m = value.meta["fusec"] if isinstance(value, fx.Node) else None
                if m is not None and not same_strides(  # (a 1x1 weight already is: no copy)
                        m, TensorMeta(m.shape, m.dtype, _cl_strides(m.shape), m.device)):
                    args[i] = convert(value, fmt, node, f"the {role} of {node.name}")
            node.args = tuple(args)


def _propagate_strides(graph: fx.Graph, convert: _Converter, eager_meta: dict) -> None:
    """Step 2: re-derive every later node's strides in program order, as eager would compute
    them; an op that cannot take the new layout gets eager's back, or the plan is refused."""
    mode = convert.mode
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is aten.clone.default and \
                any(c.node == node.name for c in convert.conversions):
            continue
        if not any(_changed(a, eager_meta) for a in node.all_input_nodes):
            continue
        device = str(getattr(node.meta.get("val"), "device", "cpu")).split(":")[0]
        if (node.target, device) in CONTIGUOUS_ONLY and _changed(node.args[0], eager_meta):
            base = node.args[0]
            why = f"{node.target.__name__} ({node.name}) {CONTIGUOUS_ONLY[node.target, device]}"
            node.args = (convert(base, None, node, why, stride=eager_meta[base].stride,
                                 suffix="contiguous"),) + tuple(node.args[1:])
        val = run_fake(mode, node)
        if val is None and isinstance(node.target, torch._ops.OpOverload) \
                and ops.classify(node.target) == ops.VIEW:
            # e.g. flatten before a linear layer: the view needs eager's layout back
            base = node.args[0]
            old = eager_meta[base]
            node.args = (convert(base, None, node, f"{node.target.__name__} ({node.name}) needs "
                                 "eager's layout", stride=old.stride, suffix="contiguous"),) + tuple(node.args[1:])
            val = run_fake(mode, node)
        if val is None:
            raise _CannotConvert(f"{node.name} ({node.target}) cannot run on the channels-last "
                                 "layout; keeping eager's layout everywhere")
        if ops.reduction(node) is not None:
            val = _rows_in_input_order(mode, node, val)
        set_meta(node, val, like=node)


def _outputs_in_eager_strides(output: fx.Node, convert: _Converter, eager_meta: dict) -> None:
    """Step 3: the program's outputs get eager's strides back, exactly (a caller may rely on
    them); a non-dense output view cannot, and refuses the plan."""
    outs = output.args[0]
    flat = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    for i, value in enumerate(flat):
        if not isinstance(value, fx.Node) or not isinstance(value.meta.get("fusec"), TensorMeta):
            continue
        old, new = eager_meta.get(value), value.meta["fusec"]
        if not isinstance(old, TensorMeta) or same_strides(old, new):
            continue
        if not is_dense(old):
            raise _CannotConvert(f"output {value.name} is a non-dense view in eager; keeping "
                                 "eager's layout everywhere")
        fmt = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last,
               "channels_last_3d": torch.channels_last_3d}.get(_format_name(old))
        flat[i] = convert(value, fmt, output, "program output: eager's strides",
                          stride=old.stride, suffix="eager_layout")
    output.args = (type(outs)(flat) if isinstance(outs, (list, tuple)) else flat[0],)


def _rows_in_input_order(mode, node: fx.Node, val):
    """A reduction's result laid out in the memory order of the tensor it reduces.

    torch gives a reduction's result contiguous strides whatever its input's layout. A pooling
    window's maximum (passes/pooling.py) of a channels-last activation would then be NCHW: the
    kernel walks its rows channel by channel, as they lie in the input (codegen/
    lower_reduction.py, `_row_order`), and each store would land H * W elements from the last
    (KernelBench-style 34_ on an H200: 0.135 ms for that kernel, against 0.039 for Inductor's).
    Intermediate strides are fusec's to choose, and program outputs get eager's back
    (`_outputs_in_eager_strides`), so the result keeps the input's order instead."""
    red = ops.reduction(node)
    x = red.operand.meta["val"]
    if not isinstance(val, torch.Tensor) or not isinstance(x, torch.Tensor) or val.dim() == 0:
        return val
    kept = [d for d in range(x.dim()) if d not in red.dims]
    out_dim = {d: (d if red.keepdim else i) for i, d in enumerate(kept)}
    order = [out_dim[d] for d in sorted(kept, key=lambda d: (-x.stride(d), d))]
    order = [d for d in range(val.dim()) if d not in order] + order  # keepdim's 1s outermost
    strides = [0] * val.dim()
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= max(val.shape[d], 1)
    if tuple(strides) == tuple(val.stride()):
        return val
    with mode:
        return torch.empty_strided(val.shape, strides, dtype=val.dtype, device=val.device)


def _describe(gm: fx.GraphModule, conversions: list[Conversion], convs: set[str]) -> list:
    """One line per 4-D/5-D tensor: its layout and why."""
    made = {c.node: c for c in conversions}
    rows = []
    for node in gm.graph.nodes:
        m = node.meta.get("fusec")
        if not isinstance(m, TensorMeta) or len(m.shape) not in (4, 5) or node.op == "output":
            continue
        fmt = _format_name(m)
        if node.name in made:
            why = f"conversion: {made[node.name].why}"
        elif node.name in convs:
            why = "convolution: the vendor library's channels-last kernels"
        elif node.op in ("placeholder", "get_attr"):
            why = "program input: as the caller passed it"
        elif node.op == "call_function" and ops.classify(node.target) == ops.VIEW:
            why = "a view of its input (no copy)"
        else:
            why = "follows its inputs (kernels keep the layout of what they read)"
        rows.append((node.name, str(m), fmt, why))
    return rows


def _price_conv(node: fx.Node) -> ConvChoice:
    x, w, out = _tensor(node.args[0]), _tensor(node.args[1]), node.meta["val"]
    transposed = bool(node.args[6])
    spatial = x.dim() - 2
    groups = node.args[8]
    window = math.prod(w.shape[2:])
    if transposed:  # every input pixel scatters a (C_out/groups x window) patch
        flops = 2 * x.numel() * (w.shape[1]) * window
    else:  # every output pixel gathers a (C_in/groups x window) patch
        flops = 2 * out.numel() * (x.shape[1] // groups) * window
    s, reason = speedup(str(out.device), spatial, transposed, out.dtype)
    kind = "cuda" if out.device.type == "cuda" else "cpu"
    rate = conv_rate(kind, spatial, transposed) * (
        torch.get_num_threads() if kind in PER_THREAD else 1)
    gain = flops / rate * (1 - 1 / s)
    what = f"{'conv_transpose' if transposed else 'conv'}{spatial}d {TensorMeta.of(out)}"
    depthwise = DEPTHWISE.get((kind, out.dtype))
    if depthwise and s > 1.0 and spatial == 2 and not transposed and groups > 1 \
            and groups == x.shape[1]:  # memory-bound: priced from bytes (see DEPTHWISE)
        bandwidth, s = depthwise
        gain = (_nbytes(x) + _nbytes(out)) / bandwidth * (1 - 1 / s)
        reason = (f"depthwise conv2d {short_dtype(out.dtype)} on {kind}: its channels-last "
                  f"kernel measured {s:.1f}x faster than eager's NCHW one (from bytes)")
    return ConvChoice(node.name, what, float(hint(flops)), s, hint(gain), reason)


# ---- helpers -------------------------------------------------------------------------------------

def _kind(c: Conversion) -> str:
    return "cuda" if c.device.startswith("cuda") else "cpu"


def _tensor(a):
    v = a.meta.get("val") if isinstance(a, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _changed(node: fx.Node, eager_meta: dict) -> bool:
    old, new = eager_meta.get(node), node.meta.get("fusec")
    if node not in eager_meta:
        return True  # a conversion the pass inserted
    if isinstance(old, TensorMeta) and isinstance(new, TensorMeta):
        return not same_strides(old, new)
    if isinstance(old, tuple) and isinstance(new, tuple):
        return any(isinstance(a, TensorMeta) and isinstance(b, TensorMeta)
                   and not same_strides(a, b) for a, b in zip(old, new))
    return False


def same_strides(a: TensorMeta, b: TensorMeta) -> bool:
    """Equal strides, ignoring dims of size 1 (their stride never matters)."""
    return a.shape == b.shape and all(x == y for x, y, n in zip(a.stride, b.stride, a.shape)
                                      if n != 1)


def _format_name(m: TensorMeta) -> str:
    if len(m.shape) in (4, 5):
        cl = _cl_strides(m.shape)
        if same_strides(m, TensorMeta(m.shape, m.dtype, contiguous_strides(m.shape), m.device)):
            return "contiguous"
        if same_strides(m, TensorMeta(m.shape, m.dtype, cl, m.device)):
            return "channels_last" if len(m.shape) == 4 else "channels_last_3d"
        return "strided " + str(tuple(m.stride))
    return "contiguous" if m.stride == contiguous_strides(m.shape) else "strided"


def _cl_name(fmt) -> str:
    return "channels_last" if fmt == torch.channels_last else "channels_last_3d"


def _cl_strides(shape) -> tuple[int, ...]:
    """(N, C, *spatial) stored as (N, *spatial, C)."""
    order = [0] + list(range(2, len(shape))) + [1]  # outermost to innermost
    strides = [0] * len(shape)
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= max(shape[d], 1)
    return tuple(strides)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _short(dtype: torch.dtype) -> str:
    return short_dtype(dtype)


def set_meta(node: fx.Node, val, like: fx.Node) -> None:
    for key, value in like.meta.items():
        if node is not like and key not in ("val", "fusec", "tensor_meta"):
            node.meta.setdefault(key, value)
    node.meta["val"] = val
    node.meta["fusec"] = meta_of(val)


def run_fake(mode, node: fx.Node):
    """Run node's op on the (new) fake values of its arguments; None if it cannot run."""
    def arg(a):
        return a.meta["val"]
    try:
        args = fx.node.map_arg(node.args, arg)
        kwargs = fx.node.map_arg(node.kwargs, arg)
        with mode:
            return node.target(*args, **kwargs)
    except Exception:
        return None

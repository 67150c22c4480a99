"""Pooling: a max or average pool whose windows do not overlap becomes a view and a reduction.

`F.max_pool2d(x, 2)` takes the largest of each 2 x 2 window. When the windows tile the image
(stride = kernel size, no padding, no dilation) every input element belongs to exactly one
window, and cutting H and W in two is a view:

    before                                          after
    p = max_pool2d_with_indices(x, [2, 2])[0]       w = view(x, [N, C, H/2, 2, W/2, 2])
                                                    p = amax(w, [3, 5])        # (N, C, H/2, W/2)

An average pool is the same with `sum(w, [3, 5]) / 4` (float32 sums for half inputs, as eager
accumulates). On a GPU the pooling kernel was an extern: its input had to be stored whole by the
kernel before it, and what came after it (a clamp, a mean) started a new kernel. As a reduction,
the pointwise work before it is its prologue (the view is moved up through it, passes/
unflatten.py) and the work after it its epilogue, in one kernel (passes/fuse_reductions.py), and a channels-last input needs no copy back to NCHW for a pooling
kernel that wants one (`CONTIGUOUS_ONLY` in passes/layout.py). torch.compile's Inductor lowers
such pools the same way.

Only where it is the same computation: on the devices of POOL_DEVICES (GPUs, and CPUs since
their C++ and LLVM reduction kernels run rows of a few elements side by side in SIMD lanes:
codegen/cpp/reduction.py, "short rows"), floating-point inputs, stride equal to the kernel size, no padding, dilation 1, `ceil_mode=False` (an image that
the windows do not tile exactly loses its last rows and columns, as in eager: a slice, which is a
view too), and for a max pool no reader of the indices (`return_indices=True` keeps eager's
kernel). NaN propagates as in eager: fusec's amax returns NaN for a window that holds one.
Each pool considered is a `Decision` in `record_of(gm).pooling`, printed by `fusec.explain`.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from fusec.graphmodule import looks_for
from fusec.record import Decision, record_of

from .grouping import meta
from .schedule import fake_mode_of
from .unflatten import Unflattener

aten = torch.ops.aten

POOL_DEVICES = ("cuda", "cpu")
MAX_POOLS = {aten.max_pool2d_with_indices.default: 2, aten.max_pool3d_with_indices.default: 3}
AVG_POOLS = {aten.avg_pool2d.default: 2, aten.avg_pool3d.default: 3}


@looks_for(*MAX_POOLS, *AVG_POOLS)
def pooling(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite non-overlapping max and average pools as reductions (see the module docstring)."""
    decisions = []
    mode = None
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in {**MAX_POOLS, **AVG_POOLS}:
            continue
        x = node.args[0]
        if not str(meta(x).device).startswith(POOL_DEVICES):
            continue
        why = _refusal(node)
        if why:
            decisions.append(Decision(node.name, False, why))
            continue
        mode = mode or fake_mode_of(gm)
        _rewrite(gm, node, mode)
        decisions.append(Decision(node.name, True, "windows that tile the input: a view and "
                                  f"{'amax' if node.target in MAX_POOLS else 'a sum'}"))
    record_of(gm).pooling = decisions
    if any(taken for _, taken, _ in decisions):
        gm.graph.lint()
        gm.recompile()
    return gm


def _window(node: fx.Node) -> tuple[list, list, list, list, bool]:
    """(kernel, stride, padding, dilation, ceil_mode) of a pool call, each spelled out per dim."""
    dims = {**MAX_POOLS, **AVG_POOLS}[node.target]
    names = [a.name for a in node.target._schema.arguments]
    args = dict(zip(names, node.args), **node.kwargs)

    def per_dim(v, default):
        v = default if v is None or (isinstance(v, (list, tuple)) and len(v) == 0) else v
        v = list(v) if isinstance(v, (list, tuple)) else [v]
        return v * dims if len(v) == 1 else v

    kernel = per_dim(args["kernel_size"], None)
    return (kernel, per_dim(args.get("stride"), kernel), per_dim(args.get("padding", 0), 0),
            per_dim(args.get("dilation", 1), 1), bool(args.get("ceil_mode", False)))


def _refusal(node: fx.Node) -> str | None:
    x = meta(node.args[0])
    if not x.dtype.is_floating_point:
        return f"{x.dtype} input (eager's integer pooling keeps its kernel)"
    kernel, stride, padding, dilation, ceil_mode = _window(node)
    dims = len(kernel)
    if x.shape is None or len(x.shape) != dims + 2:
        return "input without a batch dim"
    if stride != kernel:
        return f"overlapping windows (kernel {kernel}, stride {stride})"
    if any(padding) or any(d != 1 for d in dilation) or ceil_mode:
        return "padding, dilation or ceil_mode"
    if node.target in MAX_POOLS and any(
            u.target is not operator.getitem or (u.args[1] != 0 and u.users) for u in node.users):
        return "the indices of the maxima are read (return_indices=True): eager's kernel"
    if node.target in AVG_POOLS:
        names = [a.name for a in node.target._schema.arguments]
        divisor = dict(zip(names, node.args), **node.kwargs).get("divisor_override")
        if divisor is not None and not isinstance(divisor, int):
            return "a divisor that is not a number"
    return None


def _rewrite(gm: fx.GraphModule, node: fx.Node, mode) -> None:
    graph = gm.graph
    x = node.args[0]
    kernel, *_ = _window(node)
    shape = list(meta(x).shape)
    spatial = shape[2:]
    out = [s // k for s, k in zip(spatial, kernel)]

    cut = Unflattener(graph, node, mode)

    def add(target, args, kwargs=None, name=None) -> fx.Node:
        return cut.add(target, args, kwargs, like=node, name=name)

    value = x
    for d, (s, o, k) in enumerate(zip(spatial, out, kernel)):
        if o * k != s:  # floor mode: the rows and columns no window covers are left out
            value = cut.narrow(value, d + 2, o * k)
    for i, (o, k) in enumerate(zip(out, kernel)):  # (N, C, H, W) -> (N, C, H/k, k, W/k, k)
        value = cut(value, 2 + 2 * i, (o, k))
    dims = [3 + 2 * i for i in range(len(kernel))]
    if node.target in MAX_POOLS:
        result = add(aten.amax.default, (value, dims), name=f"{node.name}_amax")
        for user in list(node.users):
            if user.args[1] == 0:
                user.replace_all_uses_with(result)
            graph.erase_node(user)
    else:
        names = [a.name for a in node.target._schema.arguments]
        divisor = dict(zip(names, node.args), **node.kwargs).get("divisor_override") \
            or math.prod(kernel)
        dtype = meta(x).dtype
        wide = dtype in (torch.float16, torch.bfloat16)
        total = add(aten.sum.dim_IntList, (value, dims), {"dtype": torch.float32} if wide else {},
                    name=f"{node.name}_sum")
        result = add(aten.div.Tensor, (total, divisor), name=f"{node.name}_mean")
        if wide:
            result = add(aten._to_copy.default, (result,), {"dtype": dtype},
                         name=f"{node.name}_rounded")
        node.replace_all_uses_with(result)
    graph.erase_node(node)
    cut.finish(x)

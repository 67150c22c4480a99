"""conv1x1_mm: a 1 x 1 convolution over channels-last activations is a matrix multiply.

A convolution with a 1 x 1 kernel (no padding, no dilation, one group) looks at one pixel at a
time: output channel k at pixel p is the sum over input channels c of x[c, p] * w[k, c]. Over all
pixels that is one matrix product. In channels-last memory (NHWC, passes/layout.py) the
activation already *is* that matrix, one row per pixel, so with stride 1 the product needs no
copy at all:

    x : (N, C, H, W), channels-last       x2 = view(permute(x, [0, 2, 3, 1]), [N*H*W, C])
    w : (K, C, 1, 1)                      w2 = view(w, [K, C])
    convolution(x, w)                     permute(view(mm(x2, w2.T), [N, H, W, K]), [0, 3, 1, 2])

(the result is (N, K, H, W) channels-last, the layout the convolution itself would have made).
Its backward, `convolution_backward(g, x, w, ...)`, is two more products with g2 = g as a
(N*H*W, K) matrix: the input's gradient `g2 @ w2` (viewed back to NHWC) and the weight's
`g2.T @ x2` (viewed to (K, C, 1, 1)); the bias's, where asked for, is the column sums of g2.

With stride s (a resnet's downsampling shortcut), the convolution reads every s-th row and column
only: x2 is that strided view of x copied into rows (one small kernel), and the input's gradient
is the product's rows put back at those pixels with zeros between, written as a padding:

    (N*Ho*Wo, C) -> view (N, Ho, 1, Wo, 1, C) -> pad to (N, Ho, s, Wo, s, C) -> view (N, H, W, C)

(sliced to H and W where the last stride runs past the edge). The padding is spelled as a `cat`
with zero-filled pieces, which a kernel reads piece by piece, not as `constant_pad_nd`, which
fusec would leave to an eager call.

Why bother, when ATen has a convolution? At the small batches of a CPU training step, ATen
routes a 1 x 1 convolution on one thread to its generic im2col path (`_slow_conv2d_forward` and
`_slow_conv2d_backward`: oneDNN is chosen only for larger batches or several threads), which
for a 1 x 1 kernel is a matrix multiply wrapped in per-image loops, buffer resizes and, for the
weight's gradient, a transposed copy of the input. The plain `mm` calls do the same arithmetic
without that wrapping. A strided 1 x 1 convolution does go to oneDNN, whose call at these
sizes costs more than a copy and two products. (docs/training.md has the numbers.)

This pass runs on AOT Autograd's joint graph after passes/training_layout.py has made the
convolutions channels-last (it is called from there, so it applies exactly where that layout
applies: float 2-D convolutions on a CPU), and only where the activation (and, for the
backward, the incoming gradient) is channels-last in the propagated strides, so that every view
above is a view. Sizes must be plain integers (a shape family's symbolic batch is left alone).
The sums are the same products in another order: results agree with eager's to float rounding.
FUSEC_TRAIN_CONV1X1_MM=0 keeps the convolutions (to compare).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fusec import env

aten = torch.ops.aten
CL = torch.channels_last


def conv1x1_mm(joint: fx.GraphModule) -> bool:
    """Rewrite, in place, each 1 x 1 convolution (and its convolution_backward) of the joint graph
    that qualifies (see the module's docstring) into matrix multiplies. Returns whether any was
    rewritten; the caller propagates the example values (strides) again."""
    if not env.flag("FUSEC_TRAIN_CONV1X1_MM", True):
        return False
    changed = False
    for node in list(joint.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.convolution.default and _plain_1x1(node, node.args[0],
                                                                   node.args[1], 3):
            _forward(joint.graph, node)
            changed = True
        elif node.target is aten.convolution_backward.default and \
                _plain_1x1(node, node.args[1], node.args[2], 4) and _nhwc(node.args[0]) \
                and all(u.target is operator.getitem and (node.args[10][u.args[1]] or not u.users)
                        for u in node.users):
            _backward(joint.graph, node)
            changed = True
    return changed


def _plain_1x1(node: fx.Node, x, w, first: int) -> bool:
    """x (N, C, H, W) channels-last on a CPU, w (K, C, 1, 1), no padding, no dilation, not
    transposed, one group (any stride); `first`: where stride sits in node.args."""
    stride, padding, dilation, transposed = node.args[first:first + 4]
    groups = node.args[first + 5]
    wv = w.meta.get("val") if isinstance(w, fx.Node) else None
    if not _nhwc(x) or not isinstance(wv, torch.Tensor) or wv.dim() != 4 \
            or not _ints(wv.shape) or tuple(wv.shape[2:]) != (1, 1):
        return False
    xv = x.meta["val"]
    return (xv.device.type == "cpu" and xv.dtype == wv.dtype and xv.is_floating_point()
            and all(type(s) is int and s >= 1 for s in stride) and list(padding) == [0, 0]
            and list(dilation) == [1, 1] and not transposed and groups == 1
            and (wv.is_contiguous() or wv.is_contiguous(memory_format=CL)))


def _nhwc(node) -> bool:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 4 and _ints(val.shape) \
        and val.is_contiguous(memory_format=CL)


def _ints(shape) -> bool:
    return all(type(d) is int for d in shape)


def _rows(graph: fx.Graph, t: fx.Node) -> fx.Node:
    """A channels-last (N, C, H, W) tensor as its (N*H*W, C) matrix: a view."""
    n, c, h, w = t.meta["val"].shape
    nhwc = graph.call_function(aten.permute.default, (t, [0, 2, 3, 1]))
    return graph.call_function(aten.view.default, (nhwc, [n * h * w, c]))


def _input_rows(graph: fx.Graph, x: fx.Node, stride) -> fx.Node:
    """The pixels a 1 x 1 convolution of this stride reads, as a (pixels, C) matrix: with
    stride 1 a view of x; else every stride-th row and column (a strided view), copied."""
    if list(stride) == [1, 1]:
        return _rows(graph, x)
    _, _, h, w = x.meta["val"].shape
    picked = graph.call_function(aten.slice.Tensor, (x, 2, 0, h, stride[0]))
    picked = graph.call_function(aten.slice.Tensor, (picked, 3, 0, w, stride[1]))
    dense = graph.call_function(aten.clone.default, (picked,), {"memory_format": CL})
    n, c = x.meta["val"].shape[:2]
    nhwc = graph.call_function(aten.permute.default, (dense, [0, 2, 3, 1]))
    return graph.call_function(aten.view.default, (nhwc, [n * _out(h, stride[0]) * _out(w, stride[1]), c]))


def _out(size: int, stride: int) -> int:
    """Output pixels along one dim of a 1 x 1 convolution with no padding."""
    return (size - 1) // stride + 1


def _zeros_after(graph: fx.Graph, t: fx.Node, shape: list, dim: int, like) -> fx.Node:
    """`t` followed by zeros of `shape` along `dim`: a cat, which the kernel that reads it reads
    piece by piece (codegen/lower.py `cat_pieces`), where a padding would be an eager call."""
    zeros = graph.call_function(aten.full.default, (shape, 0.0),
                                {"dtype": like.dtype, "device": like.device, "pin_memory": False})
    return graph.call_function(aten.cat.default, ([t, zeros], dim))


def _spread(graph: fx.Graph, rows: fx.Node, like, stride) -> fx.Node:
    """The input's gradient of a strided 1 x 1 convolution: `rows`, the gradient at the pixels
    it read ((N*Ho*Wo, C)), placed back at every stride-th row and column, zeros between. Written
    as a padding: (N, Ho, 1, Wo, 1, C) padded to (N, Ho, s, Wo, t, C) is (N, Ho*s, Wo*t, C).
    `like`: the input's example value (its shape, dtype and device)."""
    n, c, h, w = like.shape
    (s, t), ho, wo = stride, _out(h, stride[0]), _out(w, stride[1])
    if [s, t] == [1, 1]:
        return _image(graph, rows, n, h, w, c)
    cells = graph.call_function(aten.view.default, (rows, [n, ho, 1, wo, 1, c]))
    if t > 1:
        cells = _zeros_after(graph, cells, [n, ho, 1, wo, t - 1, c], 4, like)
    if s > 1:
        cells = _zeros_after(graph, cells, [n, ho, s - 1, wo, t, c], 2, like)
    nhwc = graph.call_function(aten.view.default, (cells, [n, ho * s, wo * t, c]))
    if ho * s != h:
        nhwc = graph.call_function(aten.slice.Tensor, (nhwc, 1, 0, h))
    if wo * t != w:
        nhwc = graph.call_function(aten.slice.Tensor, (nhwc, 2, 0, w))
    return graph.call_function(aten.permute.default, (nhwc, [0, 3, 1, 2]))


def _image(graph: fx.Graph, rows: fx.Node, n: int, h: int, w: int, c: int) -> fx.Node:
    """A (N*H*W, C) matrix back as an (N, C, H, W) channels-last tensor: a view."""
    nhwc = graph.call_function(aten.view.default, (rows, [n, h, w, c]))
    return graph.call_function(aten.permute.default, (nhwc, [0, 3, 1, 2]))


def _forward(graph: fx.Graph, conv: fx.Node) -> None:
    x, w, bias, stride = conv.args[:4]
    n, _, h, wd = x.meta["val"].shape
    k, c = w.meta["val"].shape[:2]
    with graph.inserting_before(conv):
        x2 = _input_rows(graph, x, stride)
        w2t = graph.call_function(aten.permute.default, (
            graph.call_function(aten.view.default, (w, [k, c])), [1, 0]))
        y = graph.call_function(aten.mm.default, (x2, w2t)) if bias is None else \
            graph.call_function(aten.addmm.default, (bias, x2, w2t))
        out = _image(graph, y, n, _out(h, stride[0]), _out(wd, stride[1]), k)
    conv.replace_all_uses_with(out)
    graph.erase_node(conv)


def _backward(graph: fx.Graph, back: fx.Node) -> None:
    g, x, w = back.args[:3]
    stride, mask = back.args[4], back.args[10]
    k, c = w.meta["val"].shape[:2]
    results = {}
    with graph.inserting_before(back):
        g2 = _rows(graph, g)
        if mask[0]:
            w2 = graph.call_function(aten.view.default, (w, [k, c]))
            results[0] = _spread(graph, graph.call_function(aten.mm.default, (g2, w2)),
                                 x.meta["val"], stride)
        if mask[1]:
            g2t = graph.call_function(aten.permute.default, (g2, [1, 0]))
            gw = graph.call_function(aten.mm.default, (g2t, _input_rows(graph, x, stride)))
            results[1] = graph.call_function(aten.view.default, (gw, [k, c, 1, 1]))
        if mask[2]:
            results[2] = graph.call_function(aten.sum.dim_IntList, (g2, [0]))
    for user in list(back.users):  # (each a getitem of a result the mask asks for, or unread)
        if user.users:
            user.replace_all_uses_with(results[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(back)

"""Unfuse a linear layer's bias: `addmm(bias, x, w)` becomes `mm(x, w) + bias` when a kernel can
take the add.

`nn.Linear` reaches the graph as one ATen call, `addmm(bias, x, w.t())`, which looks like the
cheapest way to add a bias: the matrix library does it. On a GPU it often is not. To add a
broadcast bias, cuBLAS first copies it into every row of the output, then runs a GEMM that
accumulates onto it (`beta=1`), and with that contract it may choose a slower GEMM kernel than
for a plain product (on an H200, float32 64x1024 @ 1024x4096: a split-K `sgemm_largek` plus the
copy, against one `xmma` kernel for `mm`). Meanwhile the result of the linear layer is usually
read by pointwise work anyway (GELU, a residual add), which fusec compiles into a kernel: adding
the bias there costs one more load of a vector the size of a row, and no extra pass over memory.

    before                                  after
    addmm = addmm(b1, x, wt)                mm   = mm(x, wt)
    gelu  = gelu(addmm)                     add  = add(mm, b1)       # fuses with gelu:
                                            gelu = gelu(add)         #   fused_add_gelu_0

On a (B, T, C) input, F.linear is `view(addmm(b1, view(x), wt), (B, T, N))`; the add then goes
after the second view, into the (B, T, N) iteration space of the pointwise ops that follow.

The rewrite happens only when it cannot make anything worse or different:
* every use of the result is pointwise (through views, such as the `view` back to 3-D after a
  linear layer on a (B, T, C) input), so the add will fuse into a kernel that runs anyway;
* `beta` and `alpha` are 1 and the bias is a vector or a row (what `nn.Linear` makes);
* the dtype is float32 or float64. `mm` rounds the product to the output dtype before the add;
  in float32 that is what the GEMM's epilogue does too, but in float16/bfloat16 it would be an
  extra rounding to 8 or 11 bits, so half-precision layers keep `addmm` (cuBLASLt has fast bias
  epilogues for them).

Convolutions too, on a GPU. PyTorch runs a convolution with a bias through cuDNN as two kernels:
the convolution, then a broadcast add over the whole output (`output.add_(bias)`): on an H200 the
add of KernelBench-style 7_conv2d_instancenorm_divide, a 134 MB output, took 0.106 ms next to the
convolution's 0.099. fusec runs the convolution without its bias and adds the bias in the kernel
that reads the result next (or, if nothing does, in a kernel of its own: no worse than eager's):

    before                                  after
    conv = convolution(x, w, b, ...)        conv = convolution(x, w, None, ...)
    y    = relu(conv)                       add  = add(conv, view(b, [1, C, 1, 1]))
                                            y    = relu(add)                # fused_add_relu_0

Only on CUDA, where the result is the same bits (the same two roundings), and only in float32 and
float64: torch's depthwise kernel adds the bias before rounding once, which in half precision an
add after the convolution would not reproduce. On the CPU, oneDNN adds the bias inside the
convolution, and the rewrite could only add a pass.

Each rewrite is recorded in `record_of(gm).unfuse_bias` as an `Unfused(op, plain, add)`: the
addmm or convolution, the op without bias, and the add (node names; fusec/record.py).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fusec import ops
from fusec.graphmodule import looks_for
from fusec.ir import TensorMeta
from fusec.record import Unfused, record_of

aten = torch.ops.aten


@looks_for(aten.addmm.default, aten.convolution.default)
def unfuse_bias(gm: fx.GraphModule) -> fx.GraphModule:
    done: list[Unfused] = []
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.addmm.default and _worth_it(node):
            bias, a, b = node.args[:3]
            with gm.graph.inserting_before(node):
                mm = gm.graph.call_function(aten.mm.default, (a, b))
            _annotate(mm, aten.mm.default(a.meta["val"], b.meta["val"]), node)
            node.replace_all_uses_with(mm)
            gm.graph.erase_node(node)
            # add after the view back to (B, T, N), if there is one: in the pointwise ops'
            # iteration space, so that it fuses with them (the bias broadcasts along N either way)
            after = _reshape_keeping_rows(mm)
            with gm.graph.inserting_after(after):
                add = gm.graph.call_function(aten.add.Tensor, (after, bias))
            _annotate(add, aten.add.Tensor(after.meta["val"], bias.meta["val"]), node)
            after.replace_all_uses_with(add, delete_user_cb=lambda user: user is not add)
            done.append(Unfused(node.name, mm.name, add.name))
        elif node.op == "call_function" and node.target is aten.convolution.default \
                and _conv_worth_it(node):
            x, w, bias, *rest = node.args
            with gm.graph.inserting_before(node):
                conv = gm.graph.call_function(aten.convolution.default, (x, w, None, *rest))
            _annotate(conv, aten.convolution.default(x.meta["val"], w.meta["val"], None, *rest), node)
            node.replace_all_uses_with(conv)
            gm.graph.erase_node(node)
            shape = [1, bias.meta["val"].shape[0]] + [1] * (conv.meta["val"].dim() - 2)
            with gm.graph.inserting_after(conv):
                view = gm.graph.call_function(aten.view.default, (bias, shape))
            with gm.graph.inserting_after(view):
                add = gm.graph.call_function(aten.add.Tensor, (conv, view))
            _annotate(view, aten.view.default(bias.meta["val"], shape), node)
            _annotate(add, aten.add.Tensor(conv.meta["val"], view.meta["val"]), node)
            conv.replace_all_uses_with(add, delete_user_cb=lambda user: user is not add)
            done.append(Unfused(node.name, conv.name, add.name))
    record_of(gm).unfuse_bias = done
    gm.recompile()
    return gm


def _conv_worth_it(node: fx.Node) -> bool:
    """A CUDA float32/float64 convolution with a (C_out,) bias (see the module docstring)."""
    if len(node.args) != 9 or node.kwargs:
        return False
    x, w, bias = node.args[:3]
    val = node.meta.get("val")
    if not isinstance(bias, fx.Node) or not isinstance(val, torch.Tensor) \
            or val.device.type != "cuda" or val.dtype not in (torch.float32, torch.float64):
        return False
    b = bias.meta.get("val")
    return isinstance(b, torch.Tensor) and b.dim() == 1 and b.dtype == val.dtype \
        and val.dim() >= 3 and b.shape[0] == val.shape[1] \
        and all(isinstance(t, fx.Node) and isinstance(t.meta.get("val"), torch.Tensor) for t in (x, w))


def _worth_it(node: fx.Node) -> bool:
    bias, a, b = node.args[:3]
    if len(node.args) > 3 or set(node.kwargs) - {"beta", "alpha"} \
            or any(v != 1 for v in node.kwargs.values()):
        return False
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype not in (torch.float32, torch.float64):
        return False
    if not all(isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)
               for x in (bias, a, b)):
        return False
    bias_val = bias.meta["val"]
    if bias_val.dtype != val.dtype or bias_val.dim() > 2 or \
            (bias_val.dim() == 2 and bias_val.shape[0] != 1):
        return False  # a full matrix C is a different contract: leave it to the library
    return _only_pointwise_uses(node)


_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _reshape_keeping_rows(mm: fx.Node) -> fx.Node:
    """The view of `mm` back to more dimensions that F.linear on a (B, T, C) input adds (same
    last dimension, its only use), else `mm` itself: where the bias add goes."""
    users = list(mm.users)
    if len(users) == 1 and users[0].op == "call_function" and users[0].target in _RESHAPES:
        val = users[0].meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() >= 1 and \
                val.shape[-1] == mm.meta["val"].shape[-1]:
            return users[0]
    return mm


def _only_pointwise_uses(node: fx.Node) -> bool:
    """True when every path from `node` through views ends in a pointwise op (and there is one)."""
    users = list(node.users)
    if not users:
        return False
    for user in users:
        if user.op != "call_function":
            return False  # the graph's output: nothing would take the add
        kind = ops.classify(user.target)
        if kind == ops.VIEW or user.target is ops.GETITEM:  # split's pieces are views too
            if not _only_pointwise_uses(user):
                return False
        elif kind != ops.POINTWISE:
            return False
    return True


def _annotate(new: fx.Node, val: torch.Tensor, like: fx.Node) -> None:
    """Give a new node its fake value and fusec's metadata, and the source line it came from."""
    for key, value in like.meta.items():
        if key not in ("val", "fusec", "tensor_meta"):
            new.meta[key] = value
    new.meta["val"] = val
    new.meta["fusec"] = TensorMeta.of(val)

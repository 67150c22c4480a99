"""training_layout: a training program's convolutions channels-last, forward and backward.

passes/layout.py explains the two memory orders of a 4-D activation (NCHW, eager's default, and
channels-last, NHWC) and why oneDNN's and cuDNN's convolutions want NHWC. It decides per program
and keeps eager's strides on every program output. Training has two programs, and that rule
costs them the layout: the forward's outputs are mostly the activations it saves for the
backward (every convolution's input, every batch norm's), so converting them back to NCHW costs
more than the forward's convolutions gain, and the backward (`convolution_backward`, twice the
forward's work) never sees a convolution to convert at all. Yet nobody outside reads those
saved activations: only the backward does. Their strides are the compiler's to choose.

So for training, fusec chooses before the cut: this pass rewrites AOT Autograd's *joint* graph
(forward and backward together, before the partitioner splits it, capture/training.py), where
each convolution and its backward read the same input and weight:

    before                                         after
    c  = convolution(x, w, ...)                    x_cl = clone(x, memory_format=channels_last)
                                                   w_cl = clone(w, memory_format=channels_last)
                                                   c    = convolution(x_cl, w_cl, ...)      # NHWC
    ...                                            ...
    gi, gw, _ = convolution_backward(g, x, w, ..)  g_cl = clone(g, memory_format=channels_last)
                                                   gi, gw_cl, _ = convolution_backward(g_cl, x_cl, w_cl, ..)
    return gw                                      gw = clone(gw_cl)          # eager's strides

Then the strides are propagated through the whole graph with fake tensors (as eager would
propagate them: a batch norm or a ReLU of an NHWC tensor is NHWC), and every conversion whose
input is already channels-last is dropped: only the batch's first conversion, the weights (a
1 x 1 weight is already both) and the few gradients that reach a convolution from a NCHW op
remain. The partitioner then saves NHWC activations, the forward's kernels write them in that
order and the backward's read them so. Outputs keep eager's strides: the loss is a scalar and
each weight's gradient is converted back (a small tensor), so `.grad` is what eager makes.

Applied where passes/layout_plan.py's measured `speedup` says channels-last pays (float
convolutions on a CPU with oneDNN: 1.6x for conv2d f32); 2-D convolutions only, not transposed;
and only when some convolution then reads another's result with no conversion between them (a
CNN's chain of blocks). A lone convolution, ViT's patch embedding, pays a conversion on each
side for one faster call and is left as it is (measured: 5% slower a step with it).
FUSEC_TRAIN_LAYOUT=0 keeps eager's layout (to compare). The numbers do not change beyond
oneDNN's own rounding of the same sums in another order.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fusec import env

from .conv1x1_mm import conv1x1_mm
from .layout_plan import speedup

aten = torch.ops.aten
CL = torch.channels_last


def training_layout(joint: fx.GraphModule) -> fx.GraphModule:
    """Run the joint graph's convolutions (and their backward) channels-last where it pays.
    The rewrite is made on a copy of the graph, which replaces joint's only when it succeeded
    (a graph whose strides cannot be propagated with fake tensors stays as it was)."""
    if not env.flag("FUSEC_TRAIN_LAYOUT", True) or not any(_wanted(n) for n in joint.graph.nodes):
        return joint
    trial = fx.GraphModule(joint, _copy(joint.graph))
    try:
        if not _rewrite(trial):
            return joint
    except Exception:  # noqa: BLE001 (the layout is an optimization: eager's layout is correct)
        return joint
    joint.graph = trial.graph
    joint.recompile()
    return joint


def _rewrite(joint: fx.GraphModule) -> bool:
    """The rewrite the module's docstring describes, in place. False (and the copy left
    half-made) when no convolution reads another's result without a conversion."""
    convs = [n for n in joint.graph.nodes if _wanted(n)]
    mode = _fake_mode(joint)
    if mode is None:
        raise ValueError("no fake tensors to propagate strides with")
    converted: dict = {}  # node -> its channels-last clone

    def cl(node: fx.Node, before: fx.Node) -> fx.Node:
        if node not in converted:
            with joint.graph.inserting_before(before):
                converted[node] = joint.graph.call_function(aten.clone.default, (node,),
                                                            {"memory_format": CL})
        return converted[node]
    pairs = {(c.args[0], c.args[1]) for c in convs}  # (input, weight) of each
    weights = {}  # a convolution_backward -> its weight's example value, as it was
    for node in list(joint.graph.nodes):
        if node in convs:
            node.args = (cl(node.args[0], node), cl(node.args[1], node), *node.args[2:])
        elif node.op == "call_function" and node.target is aten.convolution_backward.default \
                and tuple(node.args[1:3]) in pairs:
            grad, x, w = node.args[:3]
            node.args = (cl(grad, node), cl(x, node), cl(w, node), *node.args[3:])
            weights[node] = w.meta["val"]
    _propagate(joint, mode)
    for original, clone in converted.items():  # already channels-last: no conversion
        if _channels_last(original.meta.get("val")):
            clone.replace_all_uses_with(original)
            joint.graph.erase_node(clone)
    if all(_source(c.args[0]) is not c.args[0] for c in convs):
        return False  # every input converted: nothing stays channels-last (ViT's one patch conv)
    for node, weight in weights.items():  # a weight's gradient: in the weight's layout
        for user in list(node.users):
            if user.target is operator.getitem and user.args[1] == 1 and \
                    weight.is_contiguous() and not user.meta["val"].is_contiguous():
                with joint.graph.inserting_after(user):
                    back = joint.graph.call_function(aten.clone.default, (user,),
                                                     {"memory_format": torch.contiguous_format})
                user.replace_all_uses_with(back, delete_user_cb=lambda n: n is not back)
    _propagate(joint, mode)
    if conv1x1_mm(joint):  # channels-last 1 x 1 convolutions as matrix multiplies
        _propagate(joint, mode)
    return True


def _copy(graph: fx.Graph) -> fx.Graph:
    """A copy of graph whose nodes (and their meta dicts) are its own."""
    new = fx.Graph()
    new.output(new.graph_copy(graph, {}))
    return new


def _wanted(node: fx.Node) -> bool:
    """A 2-D convolution (not transposed) on a device and dtype where channels-last pays."""
    if node.op != "call_function" or node.target is not aten.convolution.default:
        return False
    x, out = node.args[0].meta.get("val"), node.meta.get("val")
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or node.args[6] \
            or out.device.type != "cpu":
        return False
    return speedup(str(out.device), 2, False, out.dtype)[0] > 1.0


def _source(node):
    """What a channels-last clone converts (node itself when it is none)."""
    if isinstance(node, fx.Node) and node.target is aten.clone.default \
            and node.kwargs.get("memory_format") is CL:
        return node.args[0]
    return node


def _channels_last(val) -> bool:
    return isinstance(val, torch.Tensor) and val.dim() == 4 and val.is_contiguous(memory_format=CL)


def _fake_mode(joint: fx.GraphModule):
    for node in joint.graph.nodes:
        mode = getattr(node.meta.get("val"), "fake_mode", None)
        if node.op == "placeholder" and mode is not None:
            return mode
    return None


def _propagate(joint: fx.GraphModule, mode) -> None:
    """Every node's example value again, from the placeholders' (fake tensors)."""
    inputs = [n.meta["val"] for n in joint.graph.nodes if n.op == "placeholder"]
    FakeTensorProp(joint, mode).propagate_dont_convert_inputs(*inputs)

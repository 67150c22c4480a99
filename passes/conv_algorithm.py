"""conv_algorithm: a small 2-D convolution on the CPU runs as whichever of ATen's two ways of
computing it is faster at its sizes, timed once when the program compiles.

ATen computes a float convolution on the CPU in one of two ways. oneDNN (`mkldnn_convolution`)
is what eager picks for a 3 x 3 convolution over NCHW activations: its fast kernels want the
channels of a pixel side by side (NHWC, passes/layout.py), so for NCHW it reorders the input,
the weight and the result around them. The other way is ATen's own im2col path
(`_slow_conv2d_forward`): each image's input windows unfolded into a matrix, then one matrix
multiply with the weight (MKL or OpenBLAS). For large convolutions oneDNN wins. For the small
ones of KernelBench-style CPU problems (8 -> 16 channels over 2 x 32 x 32), whose whole
computation takes about as long as oneDNN's reorders, im2col can be faster: such a row is a
convolution and a kernel or two, and the convolution is four fifths of its time
(docs/performance.md has the measurements).

Which is faster depends on the sizes, the CPU, the BLAS and the thread count, so this pass does
not guess: for each convolution that qualifies it times both on random tensors of the traced
sizes (calls interleaved, the fastest of ROUNDS rounds: other work on the machine only ever
adds time; with torch's thread count as it is now, and on one thread in this process's CPU time,
which a busy machine's other processes do not inflate)
and rewrites the node to

    _slow_conv2d_forward(x, w, kernel_size, bias, stride, padding)

when im2col was faster by more than MARGIN; else the node stays a `convolution`. It qualifies
when it is a plain 2-D convolution on the CPU (float32, one group, no dilation, not transposed, a
kernel larger than 1 x 1: passes/conv1x1_mm.py has those) over contiguous NCHW activations
(the layout pass left it so), of fixed sizes, and small: at most MAX_FLOPS, so that timing it
costs a few milliseconds of the compile. The sums are the same products in another order: the
results agree with eager's to float rounding. The layout pass calls this one as its last step
(`layout`), and each rewritten node keeps the two times in `node.meta["conv_algorithm"]`.
FUSEC_CONV_ALGORITHM=auto turns the pass on; it is off (`onednn`: every convolution kept) by
default until the tests that name the convolution extern accept either call. =im2col rewrites
every one that qualifies without timing (tests).
"""
from __future__ import annotations

import time

import torch
import torch.fx as fx

from fusec import env
from fusec.graphmodule import copy_graph_module

aten = torch.ops.aten

MAX_FLOPS = 50e6  # larger convolutions keep oneDNN, untimed (timing them would slow the compile)
MARGIN = 1.05  # im2col must be this much faster (a noisy timing should not flip the choice)
ROUNDS = 9  # rounds of CALLS calls of each, interleaved; the fastest round counts
CALLS = 3


def choose_algorithms(gm: fx.GraphModule) -> fx.GraphModule:
    """gm, or a copy with the convolutions im2col runs faster rewritten (module docstring)."""
    forced = env.choice("FUSEC_CONV_ALGORITHM", "onednn", ("auto", "onednn", "im2col"))
    if forced == "onednn":
        return gm
    chosen = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is aten.convolution.default \
                and _qualifies(node):
            why = "FUSEC_CONV_ALGORITHM=im2col" if forced == "im2col" else _faster(node)
            if why:
                chosen[node.name] = why
    if not chosen:
        return gm
    gm = copy_graph_module(gm)
    for node in gm.graph.nodes:
        if node.name in chosen:
            x, w, bias, stride, padding = node.args[:5]
            node.target = aten._slow_conv2d_forward.default
            node.args = (x, w, list(w.meta["val"].shape[2:]), bias, list(stride), list(padding))
            node.meta["conv_algorithm"] = chosen[node.name]
    gm.recompile()
    return gm


def _qualifies(node: fx.Node) -> bool:
    x, w, bias, stride, padding, dilation, transposed, _, groups = node.args
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in (x, w, node)]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return False
    xv, wv, out = vals
    sizes = [*xv.shape, *wv.shape, *out.shape, *stride, *padding]
    if not all(type(s) is int for s in sizes) or xv.dim() != 4:  # (a symbol: a shape family's)
        return False
    if transposed or groups != 1 or any(d != 1 for d in dilation) or wv.shape[2:] == (1, 1):
        return False
    if xv.device.type != "cpu" or xv.dtype != torch.float32 or wv.dtype != torch.float32 \
            or not xv.is_contiguous() or not out.is_contiguous():
        return False
    flops = 2 * out.numel() * wv.shape[1] * wv.shape[2] * wv.shape[3]
    return flops <= MAX_FLOPS


def _faster(node: fx.Node) -> str | None:
    """"im2col <t> us, oneDNN <t> us" when im2col was faster by MARGIN, else None."""
    x, w, bias, stride, padding, dilation, transposed, output_padding, groups = node.args
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily(), torch.no_grad():
        xt = torch.randn(x.meta["val"].shape)
        wt = torch.randn(w.meta["val"].shape)
        bt = torch.randn(bias.meta["val"].shape) if isinstance(bias, fx.Node) else None
        kernel = list(wt.shape[2:])
        calls = {
            "onednn": lambda: torch.convolution(xt, wt, bt, stride, padding, dilation, False,
                                                output_padding, 1),
            "im2col": lambda: aten._slow_conv2d_forward(xt, wt, kernel, bt, stride, padding)}
        rounds = {name: [] for name in calls}
        for fn in [*calls.values()] * 2:
            fn()  # (first calls: oneDNN builds its primitive, im2col its buffers)
        clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
        for _ in range(ROUNDS):
            for name, fn in calls.items():
                start = clock()
                for _ in range(CALLS):
                    fn()
                rounds[name].append((clock() - start) / CALLS)
    onednn, im2col = (min(rounds[n]) for n in ("onednn", "im2col"))
    if im2col * MARGIN >= onednn:
        return None
    return f"im2col {im2col * 1e6:.0f} us, oneDNN {onednn * 1e6:.0f} us"

"""Pad a big half-precision matmul whose sizes break the GPU library's alignment.

cuBLAS's fast tensor-core kernels read rows in 16-byte vectors, so every leading dimension must
be a multiple of 8 bf16/fp16 elements (4 float32). GPT-2's language-model head breaks that: its
vocabulary has 50257 words, so `logits = hidden @ wte.T` is a (4096 x 768) @ (768 x 50257)
product whose output rows are 50257 elements long. cuBLAS then falls back to an old kernel that
loads one element at a time (`cutlass_75_tensorop_bf16_s1688gemm_..._align1`): 3.3 ms on an H200,
half of the whole model's time, for a product an aligned kernel does in well under 1 ms.

The fix (Inductor's `pad_mm` does the same) is to multiply slightly bigger matrices: pad the
misaligned sizes with zero rows and columns, which add nothing to any dot product, and take the
wanted block of the result:

    before                                      after
    mm = mm(h, permute(wte, [1, 0]))            wte_p  = constant_pad_nd(wte, [0, 0, 0, 7])  # 50264 rows
                                                mm_p   = mm(h, permute(wte_p, [1, 0]))
                                                mm     = clone(slice(mm_p, 1, 0, 50257))     # contiguous, as eager's

The padded copy of the weight costs one pass over it (77 MB, ~0.03 ms); the slice is copied to a
contiguous tensor (eager's strides; it fuses into the kernel that reads the logits next, if one
does). Both are far cheaper than the slow kernel, but not for a small product, so the pass only
pads products of at least MIN_FLOPS. The values are the same products added in the library's
order; only the kernel changes.

Where: on CUDA (PAD_DEVICES), for `mm` in float16, bfloat16 and float32 (TF32 kernels want 16
bytes too). Each decision, taken or not, is recorded in `record_of(gm).pad_matmul` as a
`Decision(node, taken, why)` (fusec/record.py) and printed by `fusec.explain`.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fusec.symbolic import is_symbolic
from fusec.graphmodule import looks_for
from fusec.ir import TensorMeta
from fusec.record import Decision, record_of

aten = torch.ops.aten

PAD_DEVICES = ("cuda",)
ALIGN_BYTES = 16
MIN_FLOPS = 2e9  # 2 * M * N * K below which the padding copies would cost more than they save
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@looks_for(aten.mm.default)
def pad_matmul(gm: fx.GraphModule) -> fx.GraphModule:
    decisions: list[Decision] = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.mm.default:
            continue
        pads, reason = _plan(node)
        decisions.append(Decision(node.name, pads is not None, reason))
        if pads is not None:
            _rewrite(gm.graph, node, *pads)
    record_of(gm).pad_matmul = decisions
    if any(taken for _, taken, _ in decisions):
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm


def _plan(node: fx.Node):
    """((pad_m, pad_k, pad_n), reason), or (None, reason) when the product stays as it is."""
    a, b = node.args
    av, bv, out = (n.meta.get("val") if isinstance(n, fx.Node) else None for n in (a, b, node))
    if not all(isinstance(t, torch.Tensor) for t in (av, bv, out)):
        return None, "operands without shapes"
    if out.device.type not in PAD_DEVICES or out.dtype not in _DTYPES:
        return None, f"{out.dtype} on {out.device.type}: no alignment to win"
    (m, k), n = av.shape, bv.shape[1]
    if is_symbolic((m, k, n)):
        return None, "sizes are symbols (a shape family): their alignment changes with the size"
    align = ALIGN_BYTES // out.element_size()
    pads = (-m % align, -k % align, -n % align)
    if not any(pads):
        return None, f"({m} x {k}) @ ({k} x {n}): aligned already"
    if 2 * m * n * k < MIN_FLOPS:
        return None, (f"({m} x {k}) @ ({k} x {n}) is misaligned but small: the copies padding "
                      "needs would cost more than the library's slower kernel")
    what = ", ".join(f"{name} {size} -> {size + p}" for name, size, p in
                     zip("MKN", (m, k, n), pads) if p)
    return pads, (f"({m} x {k}) @ ({k} x {n}): {what} (multiples of {align} elements, "
                  f"{ALIGN_BYTES} bytes), so the library can use its aligned tensor-core kernels")


def _rewrite(graph: fx.Graph, node: fx.Node, pad_m: int, pad_k: int, pad_n: int) -> None:
    a, b = node.args
    m, n = node.meta["val"].shape
    with graph.inserting_before(node):
        if pad_m or pad_k:
            a = _call(graph, aten.constant_pad_nd.default, (a, [0, pad_k, 0, pad_m], 0.0), node)
        if pad_k or pad_n:
            # B is usually a transposed weight, (N, K) in memory: pad the weight itself and keep
            # the transpose, so the library sees the same operand layout as before
            if b.op == "call_function" and b.target is aten.permute.default \
                    and list(b.args[1]) == [1, 0]:
                w = _call(graph, aten.constant_pad_nd.default, (b.args[0], [0, pad_k, 0, pad_n], 0.0), node)
                b = _call(graph, aten.permute.default, (w, [1, 0]), node)
            else:
                b = _call(graph, aten.constant_pad_nd.default, (b, [0, pad_n, 0, pad_k], 0.0), node)
        out = _call(graph, aten.mm.default, (a, b), node)
        if pad_m:
            out = _call(graph, aten.slice.Tensor, (out, 0, 0, m), node)
        if pad_n:
            out = _call(graph, aten.slice.Tensor, (out, 1, 0, n), node)
        if pad_m or pad_n:  # eager's contiguous result, not a strided view into the padded one
            out = _call(graph, aten.clone.default, (out,), node, {"memory_format": torch.contiguous_format})
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def _call(graph: fx.Graph, target, args, like: fx.Node, kwargs=None) -> fx.Node:
    """A new node computing target(*args), with its fake value and fusec's metadata."""
    new = graph.call_function(target, args, kwargs or {})
    vals = [x.meta["val"] if isinstance(x, fx.Node) else x for x in args]
    val = target(*vals, **(kwargs or {}))
    for key, value in like.meta.items():
        if key not in ("val", "fusec", "tensor_meta"):
            new.meta[key] = value
    new.meta["val"] = val
    new.meta["fusec"] = TensorMeta.of(val)
    return new

"""In-place ops that functionalization leaves in a captured graph, and what capture does with them.

`torch.func.functionalize` runs above torch's decompositions, so an in-place op that a
decomposition performs on its own temporary survives it:

    rms_norm:       t = pow(x, 2).mean(-1); t.add_(eps)          -> add(t, eps)    (`out_of_place`)
    circular pad:   out = empty(...); out[..., 1:4].copy_(x) ... -> slice_scatter   (`mutated_temporaries`:
                                                                    traced once more through functionalize)

Fusion understands out-of-place ops only; a write into a view of a temporary must become a
functional op, or the temporary's other readers would read it unwritten.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fusec.ops import is_view


def out_of_place(gm: fx.GraphModule) -> None:
    """Functionalization runs above torch's decompositions, so a decomposition that updates its
    own temporary in place (rms_norm's `add_(eps)`) survives it. When nothing else reads the
    temporary, and it is no view of another tensor, the in-place op is its out-of-place twin
    (`add`), which fusion understands. A decomposition that writes into views of its temporary
    (circular padding: `copy_` into three slices of an `empty`) is left for `mutated_temporaries`."""
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        name = target.overloadpacket.__name__
        base = node.args[0] if node.args else None
        if not name.endswith("_") or name.startswith("_") or not isinstance(base, fx.Node) \
                or base.op in ("placeholder", "get_attr") or len(base.users) != 1 \
                or _aliases_an_argument(base):
            continue
        packet = getattr(torch.ops.aten, name[:-1], None)
        twin = getattr(packet, target._overloadname, None) if packet is not None else None
        if twin is not None and _same_result(twin, node):
            node.target = twin
    gm.recompile()


def _aliases_an_argument(node: fx.Node) -> bool:
    """True when `node`'s result is (a view of) one of its arguments, not a temporary of its
    own: a view (`slice`), or an in-place op that returns what it wrote into (`resize_(out)`,
    left by `torch.sin(x, out=out)` when `out` had the wrong size). Writing into such a result
    writes into the argument, so it must stay in place."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    returns = target._schema.returns
    return is_view(target) or any(r.alias_info is not None for r in returns)


def _root(node: fx.Node) -> fx.Node:
    """The node whose memory `node` is: through views and in-place ops back to their base."""
    while _aliases_an_argument(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _same_result(twin, node: fx.Node) -> bool:
    """The out-of-place twin computes what the in-place op wrote: the same dtype. (An in-place
    op keeps its target's dtype; `clamp_min(bf16, f32 scalar)` promotes to float32 where
    `clamp_min_` stays bfloat16, as cosine_similarity's decomposition relies on.)"""
    want = node.meta.get("val")
    args = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
    if not isinstance(want, torch.Tensor) or not all(
            isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes):
        return False
    try:
        with want.fake_mode:
            got = twin(*args[0], **args[1])
    except Exception:  # noqa: BLE001 (no twin for these arguments: stays in place)
        return False
    return isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape


def mutated_temporaries(gm: fx.GraphModule) -> bool:
    """True when an op still writes in place into a value the graph computed (not into an
    input: functionalization ends the graph with those `copy_`s on purpose). Tracing the graph
    once more through functionalization turns such writes into `slice_scatter` and friends."""
    for node in gm.graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) \
                and target._schema.is_mutable:
            written = [a for a, spec in zip(node.args, target._schema.arguments)
                       if spec.alias_info is not None and spec.alias_info.is_write]
            if any(isinstance(a, fx.Node) and _root(a).op != "placeholder" for a in written):
                return True
    return False

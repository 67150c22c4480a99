"""Reinplace: write a buffer update in place instead of copying the whole buffer twice.

A program that updates a buffer in place, as a KV cache is updated at each decoding step,

    self.k_cache.index_copy_(2, pos, k)          # write position `pos` of the cache
    scores = q @ self.k_cache.transpose(-2, -1)

reaches the graph *functionalized*: capture (fusec/capture/frontend.py) turns every mutation
into its out-of-place twin, which returns a new tensor, and copies the final value back into the
buffer at the end, so that every pass can treat the graph as pure dataflow:

    index_put = index_put(k_cache, [None, None, pos], k)     # a new cache: copy all, write one row
    scores    = bmm(q, permute(index_put, ...))
    ...
    copy_     = copy_(k_cache, index_put)                    # copy it all back

For a cache of 256 positions that writes one, that is two copies of the whole cache to change
1/256 of it: on an H200, 16 device-to-device copies per decoding step of a 4-layer Llama. When
nothing reads the buffer's old value, the update can happen in the buffer itself:

    index_put_ = index_put_(k_cache, [None, None, pos], k)   # write one row, in place
    scores     = bmm(q, permute(index_put_, ...))            # (index_put_ *is* k_cache)

The rewrite is safe when
* the updated tensor is an input of the program (a parameter, buffer or argument) that the graph
  copies the update's result back into (`copy_(buffer, update)`), so the program's effect on it
  is exactly the update;
* nothing else reads the buffer: no one sees its old value, which the in-place update destroys,
  and its new value is read through the update's result, whose readers the scheduler already
  orders after the update;
* the values written do not come from the buffer itself (they would be another reader).

The update it knows is `index_put` (indexed assignment: `cache[:, :, pos] = k`, `index_copy_`,
which is how Hugging Face's static cache writes). Not yet `slice_scatter` (assignment to a slice
with a Python int): its in-place form is a `copy_` into a view, whose readers would read the
buffer itself, with no edge in the graph to keep them after the write. Each decision is recorded in `record_of(gm).reinplace` (fusec/record.py, `Reinplaced`: the
update, the in-place node or None, why), for explain.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fusec.graphmodule import looks_for
from fusec.record import Reinplaced, record_of

aten = torch.ops.aten



@looks_for(aten.index_put.default)
def reinplace(gm: fx.GraphModule) -> fx.GraphModule:
    done = []
    copies = {n.args[1]: n for n in gm.graph.nodes
              if n.op == "call_function" and n.target is aten.copy_.default
              and isinstance(n.args[1], fx.Node)}
    for update in list(gm.graph.nodes):
        if update.op != "call_function" or update.target is not aten.index_put.default:
            continue
        buffer, copy = update.args[0], copies.get(update)
        why_not = why_not_in_place(update, buffer, copy)
        if why_not is not None:
            done.append(Reinplaced(update.name, None, why_not))
            continue
        with gm.graph.inserting_before(update):
            in_place = gm.graph.call_function(aten.index_put_.default, update.args, update.kwargs)
        in_place.meta = dict(update.meta)
        update.replace_all_uses_with(in_place, delete_user_cb=lambda user: user is not copy)
        gm.graph.erase_node(copy)
        gm.graph.erase_node(update)
        done.append(Reinplaced(update.name, in_place.name,
                               f"nothing else reads {buffer.name}: written in place"))
    record_of(gm).reinplace = done
    gm.recompile()
    return gm


def why_not_in_place(update: fx.Node, buffer, copy: fx.Node | None) -> str | None:
    """None if `update` may write into `buffer` itself, else the reason it may not."""
    if not isinstance(buffer, fx.Node) or buffer.op != "placeholder":
        return "it updates a value computed in the program, not an input"
    if copy is None or copy.args[0] is not buffer:
        return "its result is not copied back into the buffer it updates"
    if set(buffer.users) != {update, copy}:
        return "something else reads the buffer (its old value would be lost)"
    if any(buffer in _ancestors(a) for a in update.all_input_nodes if a is not buffer):
        return "the values it writes are computed from the buffer itself"
    return None


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return seen

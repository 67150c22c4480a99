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
buffer itself, with no edge in the graph to keep them after the write.

A whole buffer written with a new value by an inference program (an EMA buffer,
`self.ema.mul_(0.9).add_(0.1 * mean)`, a step counter; a training forward's writes are taken
out of its program instead: fusec/capture/buffer_updates.py) reaches the graph as a clone and a
copy back, since functionalization turns `copy_(buffer, v)` into `copy(buffer, v)` (a new tensor
with the buffer's layout and v's values) followed by the copy back:

    copy  = copy(ema, add_3)       # a whole new buffer: clone, then write add_3
    copy_ = copy_(ema, copy)       # and copy it back

The clone is needed only if something else reads it; otherwise the copy back can read v itself
(`copy_` broadcasts and converts v exactly as `copy` does), one copy instead of two:

    copy_ = copy_(ema, add_3)

unless v shares the buffer's memory (a view of an input: the copy would read what it writes).
A counter (`num_batches_tracked += 1`, `copy_(n, add(n, 1))`, read by nothing else) becomes
`add_(n, 1)`: one ATen call where a one-element kernel and a copy were two.

Each decision is recorded in `record_of(gm).reinplace` (fusec/record.py, `Reinplaced`: the
update, the in-place node or None, why), for explain.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fusec.graphmodule import looks_for
from fusec.record import Reinplaced, record_of

aten = torch.ops.aten



@looks_for(aten.index_put.default, aten.copy.default, aten.copy_.default)
def reinplace(gm: fx.GraphModule) -> fx.GraphModule:
    done = _copies_back(gm)
    copies = {n.args[1]: n for n in gm.graph.nodes
              if n.op == "call_function" and n.target is aten.copy_.default
              and isinstance(n.args[1], fx.Node)}
    for update in list(gm.graph.nodes):
        if update.op != "call_function" or update.target is not aten.index_put.default:
            continue
        buffer, copy = update.args[0], copies.get(update)
        fresh = fresh_fill(update, buffer)
        why_not = None if fresh else why_not_in_place(update, buffer, copy)
        if why_not is not None:
            done.append(Reinplaced(update.name, None, why_not))
            continue
        with gm.graph.inserting_before(update):
            in_place = gm.graph.call_function(aten.index_put_.default, update.args, update.kwargs)
        in_place.meta = dict(update.meta)
        update.replace_all_uses_with(in_place, delete_user_cb=lambda user: user is not copy)
        if copy is not None:
            gm.graph.erase_node(copy)
        gm.graph.erase_node(update)
        done.append(Reinplaced(update.name, in_place.name,
                               f"{buffer.name} is a fill made for it alone: written in place"
                               if fresh else f"nothing else reads {buffer.name}: written in place"))
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


# The fills a program makes on every call, each a new tensor of its own (see `fresh_fill`).
FILLS = frozenset({aten.full.default, aten.zeros.default, aten.new_zeros.default,
                   aten.zeros_like.default, aten.full_like.default, aten.new_full.default})


def fresh_fill(update: fx.Node, buffer) -> bool:
    """Whether `update` may write into `buffer` because the program made it for the update alone:
    a fill (`full`, `zeros`, ...: new memory at every call, never an input's or a constant's)
    that nothing else reads. An embedding's backward is such an update: its weight's gradient
    starts as zeros that each looked-up row's gradient is added into,

        full      = full([256, 64], 0.0)
        index_put = index_put(full, [ids], grads, True)   # copies all of full, then adds

    and written in place (`index_put_`) it adds into the zeros themselves, with no copy of the
    table (a BERT step has three such tables)."""
    return isinstance(buffer, fx.Node) and buffer.op == "call_function" \
        and buffer.target in FILLS and set(buffer.users) == {update}


def _copies_back(gm: fx.GraphModule) -> list[Reinplaced]:
    """`copy_(buffer, copy(buffer, v))` -> `copy_(buffer, v)`; a counter's `copy_(n, add(n, k))`
    -> `add_(n, k)` (the module docstring's second half)."""
    done = []
    for back in list(gm.graph.nodes):
        if back.op != "call_function" or back.target is not aten.copy_.default \
                or not isinstance(back.args[1], fx.Node):
            continue
        buffer, value = back.args[0], back.args[1]
        if value.op == "call_function" and value.target is aten.copy.default \
                and value.args[0] is buffer and set(value.users) == {back}:
            clone, value = value, value.args[1]
            if not isinstance(value, fx.Node) or _input_memory(value):
                done.append(Reinplaced(clone.name, None, f"{value} may share {buffer}'s memory"))
                continue
            back.replace_input_with(clone, value)
            gm.graph.erase_node(clone)
            done.append(Reinplaced(clone.name, back.name,
                                   f"{buffer.name} copied from {value.name} once, not cloned"))
        counter = _counter_step(buffer, value, back)
        if counter is None:
            continue
        with gm.graph.inserting_before(back):
            in_place = gm.graph.call_function(aten.add_.Tensor, (buffer, counter))
        in_place.meta = dict(back.meta)
        back.replace_all_uses_with(in_place)
        gm.graph.erase_node(back)
        gm.graph.erase_node(value)
        done.append(Reinplaced(value.name, in_place.name,
                               f"a counter: {buffer.name} += {counter}, in place"))
    return done


def _input_memory(value: fx.Node) -> bool:
    """Whether `value` may be an input's memory: an input, or a view of one."""
    while value.op == "call_function" and getattr(value.target, "is_view", False) \
            and value.args and isinstance(value.args[0], fx.Node):
        value = value.args[0]
    return value.op != "call_function"


def _counter_step(buffer, value: fx.Node, back: fx.Node):
    """k when `value` is `add(buffer, k)` (k a number) of the buffer's own dtype, read only by
    the copy back `back`, and nothing but the two reads the buffer; else None."""
    if value.op != "call_function" or value.target is not aten.add.Tensor \
            or len(value.args) != 2 or value.kwargs or value.args[0] is not buffer \
            or not isinstance(value.args[1], (int, float)) or isinstance(value.args[1], bool) \
            or set(value.users) != {back} or set(buffer.users) != {value, back}:
        return None
    have, want = buffer.meta.get("val"), value.meta.get("val")
    if not isinstance(have, torch.Tensor) or not isinstance(want, torch.Tensor) \
            or have.dtype != want.dtype or have.shape != want.shape:
        return None
    return value.args[1]


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return seen

"""Buffer updates of a training step: batch norm's running statistics, step counters, EMAs.

A training forward writes into some of its inputs: every BatchNorm in train mode updates its
`running_mean` and `running_var` and adds 1 to `num_batches_tracked`; a model may keep a step
counter or an exponential moving average as a buffer. AOT Autograd hands such a write to the
compiler one of two ways:

* by default, out of the graph: the forward graph *returns* every new value, and AOT Autograd's
  runtime wrapper copies each back into its buffer after the forward (`buffer.copy_(new)`, one
  Python-level call per buffer: resnet50 has 51 of them, and each also passes through the
  autograd.Function as an output);
* with `keep_inference_input_mutations=True` (capture/training.py passes it, as torch.compile
  does), in the graph: the forward graph ends with `copy_(buffer, new)` for each.

fusec takes them in the graph, and `buffer_writes` takes those final `copy_`s back out of the
graph it compiles: the program returns the new values, and the callable around it writes them
all at once after the program ran, in two calls whatever their number (`torch._foreach_copy_`
for the new values, `torch._foreach_add_` for counters, whose `add(n, 1)` is not computed by a
kernel at all). The program itself then writes into no input, so its call needs no check that
a written input overlaps another (fusec/aliasing.py), and no clone of each buffer is made.

    copy_   = copy_(running_mean, add_3)        ->   return [..., add_3]
    copy__1 = copy_(num_batches_tracked, add)   ->   (add dropped)
                                                     after the program: _foreach_copy_([running_mean],
                                                     [add_3]); _foreach_add_([num_batches_tracked], 1)

Eager's order holds: the `copy_`s are the graph's last nodes (AOT Autograd puts them there), so
every read of a buffer's old value happens inside the program, before the writes; its new value
is read through `add_3`. A `copy_` that is not a plain write of a whole input (another shape or
dtype, into a computed value, one whose result is read, a second write into the same input)
stays in the graph, where the program runs it in order.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fusec import env

aten = torch.ops.aten


def buffers_in_graph() -> bool:
    """FUSEC_TRAIN_BUFFERS_IN_GRAPH (default on): AOT Autograd keeps a training forward's
    writes into buffers in its graph, and fusec writes them after the program, all at once
    (capture/buffer_updates.py); off: AOT Autograd's wrapper copies each buffer back (to
    compare)."""
    return env.flag("FUSEC_TRAIN_BUFFERS_IN_GRAPH", True)


@dataclass
class BufferWrites:
    """What `buffer_writes` took out of a graph: `copies` (input position, the position among the
    program's outputs of its new value), `counters` (input position, the number added)."""

    copies: list[tuple[int, int]] = field(default_factory=list)
    counters: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.copies or self.counters)

    def apply(self, inputs: list, outputs: list) -> list:
        """Write the buffers (after the program ran) and return the graph's own outputs."""
        if self.copies:
            torch._foreach_copy_([inputs[i] for i, _ in self.copies],
                                 [outputs[o] for _, o in self.copies])
        for step in {k for _, k in self.counters}:
            torch._foreach_add_([inputs[i] for i, k in self.counters if k == step], step)
        return outputs[:len(outputs) - len(self.copies)] if self.copies else outputs


def buffer_writes(gm: fx.GraphModule) -> BufferWrites:
    """Take the final whole-input `copy_`s out of gm (in place), as the module docstring says;
    gm then returns the copied values after its own outputs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = gm.graph.output_node()
    if not isinstance(output.args[0], (list, tuple)):  # (AOT Autograd's graphs return a list)
        return BufferWrites()
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    writes = [n.args[0] for n in gm.graph.nodes
              if n.op == "call_function" and n.target is aten.copy_.default]
    taken, values = BufferWrites(), []
    for node in list(gm.graph.nodes):
        if not _whole_write(node, order) or writes.count(node.args[0]) != 1:
            continue
        buffer, value = node.args[:2]
        step = _counter_step(buffer, value, node)
        gm.graph.erase_node(node)
        if step is not None:
            gm.graph.erase_node(value)
            taken.counters.append((placeholders.index(buffer), step))
        else:
            values.append(value)
            taken.copies.append((placeholders.index(buffer), None))
    if values:
        results = output.args[0]
        first = len(results)
        output.args = (list(results) + values,)
        taken.copies = [(i, first + k) for k, (i, _) in enumerate(taken.copies)]
    if taken:
        gm.recompile()
    return taken


def _whole_write(node: fx.Node, order: dict) -> bool:
    """`copy_(input, value)` whose result nothing reads, that replaces every element with a
    value of the input's shape and dtype, after every other read of the input (nothing but
    other final writes follows it, and none of them reads the input)."""
    if node.op != "call_function" or node.target is not aten.copy_.default or node.users \
            or len(node.args) != 2 or node.kwargs:
        return False
    buffer, value = node.args
    if not isinstance(buffer, fx.Node) or buffer.op != "placeholder" \
            or not isinstance(value, fx.Node) \
            or any(order[u] > order[node] for u in buffer.users if u.op != "output"):
        return False
    have, new = buffer.meta.get("val"), value.meta.get("val")
    if not isinstance(have, torch.Tensor) or not isinstance(new, torch.Tensor) \
            or have.dtype != new.dtype or have.shape != new.shape or have.device != new.device:
        return False
    later = node.next
    while later.op != "output":  # only other final writes follow
        if later.op != "call_function" or later.target is not aten.copy_.default:
            return False
        later = later.next
    return True


def _counter_step(buffer: fx.Node, value: fx.Node, copy: fx.Node) -> int | None:
    """k when `value` is `add(buffer, k)` of an integer buffer (a counter), with an integer k,
    read by nothing but `copy`; else None."""
    if value.op != "call_function" or value.target is not aten.add.Tensor \
            or len(value.args) != 2 or value.kwargs or value.args[0] is not buffer \
            or type(value.args[1]) is not int or set(value.users) != {copy}:
        return None
    dtype = buffer.meta["val"].dtype
    return value.args[1] if not dtype.is_floating_point and not dtype.is_complex \
        and dtype is not torch.bool else None

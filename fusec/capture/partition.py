"""What to save for backward, and what to recompute: the partitioner fusec hands AOT Autograd.

AOT Autograd traces one joint graph (forward and backward together) and hands it to a
*partitioner*, which cuts it in two: what the forward computes, what the backward computes,
and the values that cross the cut (saved by the forward, kept alive until the backward runs).
Its default partition saves every forward value the backward reads. The min-cut partitioner
(torch._functorch.partitioners.min_cut_rematerialization_partition) treats the cut as a
max-flow problem over bytes: where recomputing a value from something smaller is cheap
(pointwise ops: gelu's erf and multiplies, a layernorm's normalization), it saves the smaller
input and lets the backward recompute the rest. fusec then fuses that recomputation into the
backward's kernels, so it costs no extra memory traffic beyond reading the smaller input.
FUSEC_REMAT=0 keeps the default partition (to compare; benchmarks/train.py does).

A `Partition` records each cut (saved tensors and their bytes, recomputed ops); `fusec.explain`
reports it (fusec/inspect/training.py). Used by capture/training.py and capture/regions.py.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils import _pytree as pytree

from fusec import env
from fusec.capture.breaks import innermost
from fusec.symbolic import hint
from fusec.passes.training_layout import training_layout


@dataclass
class Saved:
    """One tensor the forward saves for the backward."""

    name: str  # the joint graph's name for it (primals_1, mm, gelu ...)
    op: str  # the ATen op that made it ("input" for a forward input: a parameter or argument)
    shape: tuple
    dtype: torch.dtype
    nbytes: int
    line: str = ""  # the user's line that made it, when known ("model.py:12")
    view: str = ""  # for a view: of what ("permute of primals_3")
    shared: bool = False  # a view of a value saved too: its bytes are that value's

    @property
    def counted(self) -> bool:
        """Whether its bytes count as saved for backward: not an input, not a view of a
        saved value."""
        return not self.is_input and not self.shared

    @property
    def is_input(self) -> bool:
        """An input of the forward (a parameter, the batch): alive anyway, so saving it costs
        no memory of its own."""
        return self.op == "input"


@dataclass
class Partition:
    """What the partitioner decided for one training program (one joint graph).

    `saved` are the tensors the forward hands the backward; `recomputed` the forward ops the
    backward runs again instead of reading a saved result ((name, op) pairs); `moved` the forward
    ops that only the backward needed, so they run there only. `default_saved` is what AOT
    Autograd's default partition would have saved, so the saving is visible."""

    partitioner: str  # "min-cut" or "default"
    saved: list[Saved] = field(default_factory=list)
    recomputed: list[tuple[str, str]] = field(default_factory=list)
    moved: list[tuple[str, str]] = field(default_factory=list)
    default_saved: list[Saved] = field(default_factory=list)
    forward_out_bytes: int = 0  # the forward's results other than the saved tensors
    backward_out_bytes: int = 0  # the backward's results: the gradients

    @property
    def saved_bytes(self) -> int:
        """Bytes saved for backward that are not forward inputs: memory the step holds only
        because of the backward (activations)."""
        return sum(s.nbytes for s in self.saved if s.counted)

    @property
    def default_bytes(self) -> int:
        """The same count for the default partition."""
        return sum(s.nbytes for s in self.default_saved if s.counted)

    def to_dict(self) -> dict:
        def rows(saved):
            return [{"name": s.name, "op": s.op, "shape": list(s.shape), "dtype": str(s.dtype),
                     "bytes": s.nbytes, "line": s.line, "view": s.view, "counted": s.counted}
                    for s in saved]
        return {"partitioner": self.partitioner, "saved": rows(self.saved),
                "saved_bytes": self.saved_bytes, "default_saved": rows(self.default_saved),
                "default_bytes": self.default_bytes,
                "recomputed": [{"name": n, "op": op} for n, op in self.recomputed],
                "moved": [{"name": n, "op": op} for n, op in self.moved],
                "forward_out_bytes": self.forward_out_bytes,
                "backward_out_bytes": self.backward_out_bytes}


def remat_enabled() -> bool:
    """FUSEC_REMAT (default on): partition with torch's min-cut partitioner, which recomputes
    cheap forward ops in the backward; off: AOT Autograd's default partition."""
    return env.flag("FUSEC_REMAT", True)


def partitioner(decisions: list) -> Callable:
    """A partition_fn for AOT Autograd that appends its decision (a Partition) to `decisions`.

    It also runs the default partition, on a copy of the joint graph (both partitioners may
    rewrite the graph they are given and its nodes' tags), so that the record holds the bytes
    the default would have saved."""
    from torch._functorch.partitioners import (default_partition,  # (imported when first used)
                                               min_cut_rematerialization_partition)

    def partition(joint: torch.fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **options):
        training_layout(joint)  # convolutions channels-last, forward and backward, where it pays
        forward_ops = _forward_nodes(joint, num_fwd_outputs)
        if not remat_enabled():
            fw, bw = default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                                       **options)
            default_saved = _saved(fw, bw)
            decisions.append(Partition("default", default_saved, [], [], default_saved,
                                       *_result_bytes(fw, bw, num_fwd_outputs)))
            fw.meta["fusec_saved_from"] = num_fwd_outputs  # (runtime/training_graphs.py)
            return fw, bw
        default_saved = _saved(*default_partition(_copy(joint), joint_inputs,
                                                  num_fwd_outputs=num_fwd_outputs, **options))
        options.pop("static_lifetime_input_nodes", None)  # (the default partition's own)
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs,
                                                     num_fwd_outputs=num_fwd_outputs, **options)
        in_forward = {n.name for n in fw.graph.nodes if n.op == "call_function"}
        again = [(n.name, _op_name(n)) for n in bw.graph.nodes
                 if n.op == "call_function" and n.name in forward_ops]
        decisions.append(Partition("min-cut", _saved(fw, bw),
                                   [(n, op) for n, op in again if n in in_forward],
                                   [(n, op) for n, op in again if n not in in_forward],
                                   default_saved, *_result_bytes(fw, bw, num_fwd_outputs)))
        # the forward's outputs from here on are what it saves for the backward (its first
        # num_fwd_outputs are the caller's): runtime/training_graphs.py hands those out uncopied
        fw.meta["fusec_saved_from"] = num_fwd_outputs
        return fw, bw
    return partition


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of gm whose nodes (and their meta dicts) are its own; the values in the meta
    (fake tensors) are shared, not copied."""
    graph = torch.fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    return torch.fx.GraphModule(gm, graph)


def _forward_nodes(joint: torch.fx.GraphModule, num_fwd_outputs: int) -> set[str]:
    """Names of the joint graph's forward ops: the call_function nodes that the forward's
    outputs (the first `num_fwd_outputs` outputs of the joint graph) depend on. (Parts of a
    derivative that read only forward values, gelu's erf in its backward, are not forward ops.)"""
    output = next(n for n in reversed(joint.graph.nodes) if n.op == "output")
    results = pytree.tree_leaves(output.args[0])[:num_fwd_outputs]
    todo = [n for n in results if isinstance(n, torch.fx.Node)]
    forward: set[str] = set()
    while todo:
        node = todo.pop()
        if node.name in forward:
            continue
        forward.add(node.name)
        todo += node.all_input_nodes
    return {n.name for n in joint.graph.nodes if n.op == "call_function" and n.name in forward}


def _saved(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule) -> list[Saved]:
    """The tensors that cross from `fw` to `bw`: the backward's inputs that are not tangents
    (symbolic sizes the backward also receives are not tensors and are left out). A view of a
    forward input (a weight's transpose) counts as the input: it shares the input's memory; a
    view of a value saved already shares that value's memory and is not counted twice."""
    made = {n.name: n for n in fw.graph.nodes}
    out, bases = [], set()
    for node in bw.graph.nodes:
        if node.op != "placeholder" or node.name.startswith("tangents"):
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        source = made.get(node.name, node)
        base = source
        while base.op == "call_function" and getattr(base.target, "is_view", False) \
                and base.args and isinstance(base.args[0], torch.fx.Node):
            base = base.args[0]
        frame = innermost(source.meta.get("stack_trace"))
        op = _op_name(source) if source.op != "placeholder" else "input"
        out.append(Saved(node.name, "input" if base.op == "placeholder" else op,
                         tuple(_hint(d) for d in val.shape), val.dtype, _nbytes(val),
                         str(frame) if frame is not None else "",
                         f"{op} of {base.name}" if base is not source else "",
                         shared=base.name in bases))
        bases.add(base.name)
    for saved in out:  # a view saved before its base: the base's entry holds the bytes
        if saved.view and not saved.shared and saved.view.split(" of ")[-1] in {
                s.name for s in out if not s.view}:
            saved.shared = True
    return out


def _result_bytes(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule,
                  num_fwd_outputs: int) -> tuple[int, int]:
    """Bytes of the forward's own results (not the saved tensors) and of the backward's."""
    def outputs(gm, count=None):
        output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        nodes = pytree.tree_leaves(output.args[0])
        vals = [n.meta.get("val") for n in nodes[:count] if isinstance(n, torch.fx.Node)]
        return sum(_nbytes(v) for v in vals if isinstance(v, torch.Tensor))
    return outputs(fw, num_fwd_outputs), outputs(bw)


def _op_name(node: torch.fx.Node) -> str:
    """aten.mm.default -> "mm"; operator.getitem -> "getitem"."""
    target = node.target
    if target is operator.getitem:
        return "getitem"
    packet = getattr(target, "_overloadpacket", None)
    return getattr(packet, "__name__", None) or getattr(target, "__name__", str(target))


def _hint(size) -> int:
    """A size as a number: a symbolic one (a dynamic shape) by the value it was traced with,
    without a guard (`int(size)` would make the ShapeEnv specialize the graph to that value, and
    Dynamo would compile again for every batch size)."""
    value = hint(size)
    return int(value) if value is not None else 0


def _nbytes(val: torch.Tensor) -> int:
    numel = 1
    for d in val.shape:
        numel *= _hint(d)
    return numel * val.element_size()


__all__ = ["Partition", "Saved", "partitioner", "remat_enabled"]

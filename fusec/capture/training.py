"""Training: compile the forward *and* the backward pass.

When an input or parameter requires grad, fusec hands the program to AOT Autograd
(`torch._functorch.aot_autograd.aot_function`). AOT Autograd traces the forward and the backward
together as one joint ATen graph, splits it into a forward graph (which also returns the
activations the backward needs) and a backward graph, and asks a compiler for each. fusec
compiles both like any other program, so the backward's pointwise work (gelu's derivative, the
softmax gradient's reductions ...) is fused too:

    loss = compiled_model(x).sum()   # runs the fused forward kernels
    loss.backward()                  # runs the fused backward kernels
    optimizer.step()                 # unchanged: it updates the module's own parameters

A training call whose batch size (or any size of its arguments) changed compiles once more, for
every size of those dims: a training shape family (capture/training_family.py).

The same compilers serve `torch.compile(model, backend="fusec")` through Dynamo's `aot_autograd`.
How each graph is compiled is the caller's to say (`compile_fn`: fusec.api.part_compiler), so
this file never imports the driver that imports it.
"""
from __future__ import annotations

import operator
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.fx import traceback as fx_traceback
from torch.utils import _pytree as pytree

from fusec import dynamic
from fusec import env
from fusec.capture import calls, frontend, outputs
from fusec.capture.breaks import innermost
from fusec.capture.buffer_updates import buffer_writes, buffers_in_graph
from fusec.capture.training_family import size_relations, symbolic_aot
from fusec.symbolic import hint
from fusec.passes.summed_slices import summed_slices
from fusec.passes.training_layout import training_layout


# ---- what to save for backward, and what to recompute ------------------------------------------
#
# AOT Autograd traces one joint graph (forward and backward together) and hands it to a
# *partitioner*, which cuts it in two: what the forward computes, what the backward computes,
# and the values that cross the cut (saved by the forward, kept alive until the backward runs).
# Its default partition saves every forward value the backward reads. The min-cut partitioner
# (torch._functorch.partitioners.min_cut_rematerialization_partition) treats the cut as a
# max-flow problem over bytes: where recomputing a value from something smaller is cheap
# (pointwise ops: gelu's erf and multiplies, a layernorm's normalization), it saves the smaller
# input and lets the backward recompute the rest. fusec then fuses that recomputation into the
# backward's kernels, so it costs no extra memory traffic beyond reading the smaller input.
# FUSEC_REMAT=0 keeps the default partition (to compare; benchmarks/train.py does).


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


def graph_compiler(compile_fn: Callable, parts: list) -> Callable:
    """A compiler for AOT Autograd: (ATen GraphModule, example inputs) -> callable.

    Each graph becomes `compile_fn(graph)`, a fusec.CompiledFunction that runs step by step
    (its outputs feed autograd, not a caller); it compiles on its first real call (the example
    inputs AOT Autograd passes are fake tensors) and keeps one program per input signature.
    The buffers a graph writes at its end (running statistics, counters) are written after
    its program, all at once (capture/buffer_updates.py).

    AOT Autograd compiles the backward graph on the first `.backward()`, and it does not lock:
    threads that all run their first backward at once each hand it the same graph. A graph
    already compiled here (same code, same example inputs) gets the first one's function, so a
    training program is compiled once however many threads start it (tests/test_threads.py).
    """
    made: dict = {}  # (graph code, example inputs' metadata) -> run, for the threads' repeats
    lock = threading.Lock()

    def compile_part(gm: torch.fx.GraphModule, example_inputs):
        key = (gm.code, tuple(_example_key(x) for x in example_inputs))
        with lock:
            if key not in made:
                made[key] = _compile_part(gm, example_inputs)
            return made[key]

    def _compile_part(gm: torch.fx.GraphModule, example_inputs):
        writes = buffer_writes(gm)
        read_through_aliases(gm)
        summed_slices(gm)  # slice backward's scatters into zeros, summed: a cat
        compiled = compile_fn(with_source_lines(gm))
        # a graph with symbolic sizes (TorchDynamo's, once a size changed): a shape family's
        # program from its first call (fusec/dynamic.py, from_examples)
        compiled.seed_dims, compiled.derived = dynamic.from_examples(example_inputs)
        more, compiled.size_relations = size_relations(example_inputs)  # (training_family.py)
        for k, ds in more.items():
            compiled.seed_dims[k] = compiled.seed_dims.get(k, frozenset()) | ds
        parts.append(compiled)

        def run(args):  # AOT Autograd's boxed convention: one list, which we may clear
            inputs = list(args)
            args.clear()
            with torch.no_grad():
                out = compiled(*inputs)
                return writes.apply(inputs, out) if writes else out
        run._boxed_call = True
        return run
    return compile_part


def _example_key(x) -> tuple | str:
    """What of an example input a compiled graph depends on: a tensor's shape, strides, dtype
    and device (sizes may be symbols: their text), anything else its repr."""
    if isinstance(x, torch.Tensor):
        return (tuple(map(str, x.shape)), tuple(map(str, x.stride())), x.dtype, x.device.type)
    return repr(x)


def read_through_aliases(gm: torch.fx.GraphModule) -> None:
    """Readers of `alias(v)` read `v` itself, in place (the alias stays for the graph's output).

    Autograd saves an op's *result* for its backward through an alias (`relu`'s backward
    reads `alias(relu)`: `le(alias, 0)` is the mask the partitioner saves). An alias has its
    value's shape and strides, but to fusion it is a view of a computed value, which ends that
    value's kernel: the mask would be a kernel of its own, reading back what the kernel before
    it stored. In these functional graphs nothing writes a computed value after it is made, so
    the alias and the value are the same numbers everywhere."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.alias.default \
                or not isinstance(node.args[0], torch.fx.Node) \
                or node.args[0].op != "call_function":
            continue
        for user in list(node.users):
            if user.op != "output":
                user.replace_input_with(node, node.args[0])
                changed = True
        if not node.users:
            gm.graph.erase_node(node)
    if changed:
        gm.recompile()


def with_source_lines(gm: torch.fx.GraphModule) -> Callable:
    """`gm` as a function that fusec's capture traces node by node (fx.Interpreter) with
    `preserve_node_meta` on, so that every ATen node it records keeps the `stack_trace` of the
    node it came from: the user's line, which Dynamo and AOT Autograd put on their graphs'
    nodes (explain and profile show it). Tracing `gm.forward` itself would record the lines
    of its generated code instead. Only capture calls this; the compiled program runs kernels."""

    def graph(*args):
        with fx_traceback.preserve_node_meta():
            return torch.fx.Interpreter(gm).run(*args)
    graph.__name__ = graph.__qualname__ = "graph"
    graph.gm = gm
    return graph


def aot_compile(fn: Callable, args: tuple, kwargs: dict, lifted: list, lifted_names: list,
                compile_fn: Callable, reached: list = (), dims: dict | None = None):
    """Compile fn for training with its (lifted) parameters as explicit inputs. The last
    `len(reached)` of them are state fn reaches through globals and closures (a closure's
    module's weights: capture/guards.py), which autograd differentiates like its own.

    Returns (call, parts): call(*lifted, *tensor_args) runs forward (backward runs on
    .backward()); parts lists the CompiledFunctions made for the forward and backward graphs.
    `dims` ({flat input position, lifted state first: dims}): trace those sizes as symbols, for
    a training shape family (capture/training_family.py); `parts.family` then holds its inputs
    and ShapeEnv once the first call has traced.
    """
    leaves, names, rebuild = calls.flatten_call(fn, args, kwargs)
    tensor_pos = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    call = frontend.flat_callable(fn, leaves, rebuild, tensor_pos, lifted_names, reached)

    spec: list = []  # (the structure of fn's result, its leaves that are not tensors)

    def flat_fn(*tensors):  # objects pytree does not know (a DynamicCache) open up: outputs.py
        leaves, structure = outputs.flatten(call(*tensors))
        spec[:] = [structure, {k: v for k, v in enumerate(leaves) if not isinstance(v, torch.Tensor)}]
        return [v for v in leaves if isinstance(v, torch.Tensor)]

    parts = TrainingParts()
    compiler = graph_compiler(compile_fn, parts)
    if dims:
        input_names = ["p_" + n.replace(".", "_") for n in lifted_names] + \
            [names[i] for i in tensor_pos]
        compiled = symbolic_aot(flat_fn, dims, compiler, partitioner(parts.partitions),
                                frontend.decompositions(), parts, input_names)
    else:
        from torch._functorch.aot_autograd import aot_function  # (imported when first used)
        compiled = aot_function(flat_fn, fw_compiler=compiler, bw_compiler=compiler,
                                partition_fn=partitioner(parts.partitions),
                                decompositions=frontend.decompositions(),
                                keep_inference_input_mutations=buffers_in_graph())

    def run(*tensors):
        """AOT Autograd sees the result's tensors as one flat list; eager's structure (tuples
        stay tuples, a torch.Size a torch.Size, None and numbers where they were) is rebuilt
        around the tensors it returns."""
        tensors_out = iter(compiled(*tensors))
        structure, constants = spec
        return outputs.unflatten([constants[k] if k in constants else next(tensors_out)
                                  for k in range(structure.num_leaves)], structure)
    return run, parts


class TrainingParts(list):
    """The CompiledFunctions made for a training program's forward and backward graphs (a list,
    as before), and `partitions`: what the partitioner saved and recomputed (a Partition per
    joint graph AOT Autograd partitioned; fusec/inspect/training.py reports it). `family`: for
    a training shape family, its traced inputs and ShapeEnv (training_family.FamilyInputs),
    else None."""

    def __init__(self, *parts):
        super().__init__(*parts)
        self.partitions: list[Partition] = []
        self.family = None  # (capture/training_family.py)


def tensor_args(args: tuple, kwargs: dict, fn) -> list:
    leaves, _, _ = calls.flatten_call(fn, args, kwargs)
    return [l for l in leaves if isinstance(l, torch.Tensor)]


__all__ = ["Partition", "Saved", "TrainingParts", "aot_compile", "graph_compiler", "partitioner",
           "pytree", "remat_enabled", "tensor_args", "with_source_lines"]

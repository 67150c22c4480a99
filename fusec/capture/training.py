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

import threading
from typing import Callable

import torch
from torch.fx import traceback as fx_traceback
from torch.utils import _pytree as pytree

from fusec import dynamic
from fusec.capture import calls, frontend, outputs
from fusec.capture.buffer_updates import buffer_writes, buffers_in_graph
from fusec.capture.eager_checks import refuse_overflowing_scalars
from fusec.capture.partition import Partition, partitioner
from fusec.capture.training_family import size_relations, symbolic_aot
from fusec.passes.summed_slices import summed_slices


def graph_compiler(compile_fn: Callable, parts: list, graphs=None) -> Callable:
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

    `graphs` (a runtime/training_graphs.py GraphPair, or None): on a GPU, the forward and the
    backward it compiles may each be replayed as a CUDA graph, sharing its memory pool.
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
        refuse_overflowing_scalars(gm)  # (as frontend._trace does: capture/eager_checks.py)
        writes = buffer_writes(gm)
        read_through_aliases(gm)
        summed_slices(gm)  # slice backward's scatters into zeros, summed: a cat
        compiled = compile_fn(with_source_lines(gm))
        if graphs is not None and any(isinstance(x, torch.Tensor) and x.device.type == "cuda"
                                      for x in example_inputs):
            compiled.graph_pair = graphs  # (the forward's saved activations: handed out uncopied)
            compiled.handed_from = gm.meta.get("fusec_saved_from")
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
                compile_fn: Callable, reached: list = (), dims: dict | None = None, graphs=None):
    """Compile fn for training with its (lifted) parameters as explicit inputs. The last
    `len(reached)` of them are state fn reaches through globals and closures (a closure's
    module's weights: capture/guards.py), which autograd differentiates like its own.

    Returns (call, parts): call(*lifted, *tensor_args) runs forward (backward runs on
    .backward()); parts lists the CompiledFunctions made for the forward and backward graphs.
    `dims` ({flat input position, lifted state first: dims}): trace those sizes as symbols, for
    a training shape family (capture/training_family.py); `parts.family` then holds its inputs
    and ShapeEnv once the first call has traced. `graphs`: see `graph_compiler`.
    """
    leaves, names, rebuild = calls.flatten_call(fn, args, kwargs)
    tensor_pos = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    call = frontend.flat_callable(fn, leaves, rebuild, tensor_pos, lifted_names, reached)

    spec: list = []  # (the structure of fn's result, its leaves that are not tensors)
    leaves_written = LeavesWritten()

    def flat_fn(*tensors):  # objects pytree does not know (a DynamicCache) open up: outputs.py
        with leaves_written.watching(tensors):
            result = call(*tensors)
        leaves, structure = outputs.flatten(result)
        spec[:] = [structure, {k: v for k, v in enumerate(leaves) if not isinstance(v, torch.Tensor)}]
        return [v for v in leaves if isinstance(v, torch.Tensor)]

    parts = TrainingParts()
    compiler = graph_compiler(compile_fn, parts, None if dims else graphs)
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
        leaves_written.check(tensors)
        leaves_written.real = tensors  # (a first call traces: see LeavesWritten)
        try:
            tensors_out = iter(compiled(*tensors))
        finally:
            leaves_written.real = ()
        structure, constants = spec
        return outputs.unflatten([constants[k] if k in constants else next(tensors_out)
                                  for k in range(structure.num_leaves)], structure)
    return run, parts


# Note (a leaf written in place). Eager refuses `w.add_(x)` with gradients on when `w` is a leaf
# that requires grad (a parameter, `torch.randn(3, requires_grad=True)`): "a leaf Variable that
# requires grad is being used in an in-place operation". AOT Autograd traces every input as a
# non-leaf, so the compiled program wrote into the parameter without a word. `LeavesWritten`
# notes, while tracing, which inputs the program writes in place with gradients on (a write under
# `torch.no_grad()`, as an EMA update does, is allowed), and raises eager's error on every call
# that hands such a position a leaf that requires grad, before anything runs.
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "detach_"})
_AUGMENTED = frozenset(f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod",
                                                "pow", "and", "or", "xor", "lshift", "rshift",
                                                "matmul"))


class LeavesWritten(torch.overrides.TorchFunctionMode):
    """See the note above: `watching(inputs)` around the traced call, `check(tensors)` before
    each call runs."""

    def __init__(self):
        super().__init__()
        self.positions: set[int] = set()
        self.inputs: dict[int, int] = {}  # id of a traced input -> its position
        self.real: tuple = ()  # the call's own tensors (the ones being traced for)

    def watching(self, inputs):
        self.inputs = {id(t): i for i, t in enumerate(inputs)}
        return self

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if args and id(args[0]) in self.inputs and torch.is_grad_enabled() and (
                name == "__setitem__" or name in _AUGMENTED or
                name.endswith("_") and not name.endswith("__") and name not in _NOT_WRITES):
            self.positions.add(self.inputs[id(args[0])])
            if self.real:  # (the first call: raised while tracing, before it runs)
                self.check(self.real)
        return func(*args, **(kwargs or {}))

    def check(self, tensors) -> None:
        for i in self.positions:
            if tensors[i].is_leaf and tensors[i].requires_grad:
                raise RuntimeError("a leaf Variable that requires grad is being used in an "
                                   "in-place operation.")


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


__all__ = ["TrainingParts", "aot_compile", "graph_compiler", "pytree", "tensor_args",
           "with_source_lines"]

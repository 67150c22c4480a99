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

The same compilers serve `torch.compile(model, backend="fusec")` through Dynamo's `aot_autograd`.
How each graph is compiled is the caller's to say (`compile_fn`: fusec.api.part_compiler), so
this file never imports the driver that imports it.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.fx import traceback as fx_traceback
from torch.utils import _pytree as pytree

from fusec.capture import calls, frontend, outputs


def graph_compiler(compile_fn: Callable, parts: list) -> Callable:
    """A compiler for AOT Autograd: (ATen GraphModule, example inputs) -> callable.

    Each graph becomes `compile_fn(graph)`, a fusec.CompiledFunction that runs step by step
    (its outputs feed autograd, not a caller); it compiles on its first real call (the example
    inputs AOT Autograd passes are fake tensors) and keeps one program per input signature.
    """
    def compile_part(gm: torch.fx.GraphModule, example_inputs):
        compiled = compile_fn(with_source_lines(gm))
        parts.append(compiled)

        def run(args):  # AOT Autograd's boxed convention: one list, which we may clear
            inputs = list(args)
            args.clear()
            with torch.no_grad():
                return compiled(*inputs)
        run._boxed_call = True
        return run
    return compile_part


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
                compile_fn: Callable, reached: list = ()):
    """Compile fn for training with its (lifted) parameters as explicit inputs. The last
    `len(reached)` of them are state fn reaches through globals and closures (a closure's
    module's weights: capture/guards.py), which autograd differentiates like its own.

    Returns (call, parts): call(*lifted, *tensor_args) runs forward (backward runs on
    .backward()); parts lists the CompiledFunctions made for the forward and backward graphs.
    """
    leaves, _, rebuild = calls.flatten_call(fn, args, kwargs)
    tensor_pos = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    call = frontend.flat_callable(fn, leaves, rebuild, tensor_pos, lifted_names, reached)

    spec: list = []  # (the structure of fn's result, its leaves that are not tensors)

    def flat_fn(*tensors):  # objects pytree does not know (a DynamicCache) open up: outputs.py
        leaves, structure = outputs.flatten(call(*tensors))
        spec[:] = [structure, {k: v for k, v in enumerate(leaves) if not isinstance(v, torch.Tensor)}]
        return [v for v in leaves if isinstance(v, torch.Tensor)]

    parts: list = []
    compiler = graph_compiler(compile_fn, parts)
    from torch._functorch.aot_autograd import aot_function  # (imported when first used)
    compiled = aot_function(flat_fn, fw_compiler=compiler, bw_compiler=compiler,
                            decompositions=frontend.decompositions())

    def run(*tensors):
        """AOT Autograd sees the result's tensors as one flat list; eager's structure (tuples
        stay tuples, a torch.Size a torch.Size, None and numbers where they were) is rebuilt
        around the tensors it returns."""
        tensors_out = iter(compiled(*tensors))
        structure, constants = spec
        return outputs.unflatten([constants[k] if k in constants else next(tensors_out)
                                  for k in range(structure.num_leaves)], structure)
    return run, parts


def tensor_args(args: tuple, kwargs: dict, fn) -> list:
    leaves, _, _ = calls.flatten_call(fn, args, kwargs)
    return [l for l in leaves if isinstance(l, torch.Tensor)]


__all__ = ["aot_compile", "graph_compiler", "pytree", "tensor_args", "with_source_lines"]

"""Training shape families: forward and backward compiled once for every size of a dim that
changes (issue 51's policy for training calls; capture/training.py compiles one signature).

fusec/api.py decides which dims are symbols (the sizes that changed between two training calls
alike in all else, as for inference: fusec/dynamic.py); this file traces the training program
with those sizes as symbols, and hands the traced inputs and their ShapeEnv back, from which
fusec/dynamic.py makes the guards each later call is checked against.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fusec import symbolic


# ---- a training shape family ---------------------------------------------------------------------
#
# Note: training shape families. `aot_function` fakes the real inputs it is called with: every
# size a number, so a new batch size is a new joint graph, forward and backward compiled again.
# For a family, fusec makes the fakes itself, as an inference family's capture does
# (fusec/symbolic.py `fake_mode`, `fake_input`): the dims that changed get symbols of one
# ShapeEnv, the rest (the weights) stay numbers. AOT Autograd (`aot_module_simplified`, the
# entry point TorchDynamo's training path uses, which takes fakes as they are) traces the joint
# graph on them, so the forward and backward graphs it hands `graph_compiler` have symbolic
# sizes, and SymInt inputs where the backward needs a size the forward saved. Each graph is then
# compiled as a shape family of its own (`dynamic.from_examples`: its symbolic dims from the
# first call). What the trace assumed about the sizes is the ShapeEnv's guards: `FamilyInputs`
# hands them to fusec/dynamic.py (`guard_check`, `failed_guard`), which checks them per call
# as for an inference family. As in torch, sizes 0 and 1 are never in the family: a symbol's
# range starts at 2 (the guard `2 <= x.size()[0]`), and a call of size 1 compiles its own pair.


@dataclass
class FamilyInputs:
    """A training family's traced inputs as fusec/dynamic.py reads a capture: `gm`, a graph of
    placeholders only (named after the inputs, each with its fake tensor as `meta["val"]`), and
    `shape_env`, whose guards say which calls the family serves."""

    gm: torch.fx.GraphModule
    shape_env: object


def family_inputs(fakes: list, names: list[str]) -> FamilyInputs:
    """The FamilyInputs of a traced family: one placeholder per input, its symbols named after
    the input size each is (`x_size0`, fusec/symbolic.py `name_sizes`)."""
    graph = torch.fx.Graph()
    for name, fake in zip(names, fakes):
        graph.placeholder(name).meta["val"] = fake
    graph.output(None)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    return FamilyInputs(gm, symbolic.name_sizes(gm))


def symbolic_aot(flat_fn: Callable, dims: dict, compiler: Callable, partition_fn: Callable,
                 decompositions: dict, parts, names: list[str]) -> Callable:
    """`flat_fn` compiled for training with the sizes in `dims` as symbols (Note: training shape
    families): a function of the real flat tensors, which traces on its first call (as
    `aot_function` does) and runs AOT Autograd's forward on every call. `compiler`,
    `partition_fn`, `decompositions`: AOT Autograd's, as capture/training.py `aot_compile` makes
    them; `parts` (a TrainingParts) gets the family's FamilyInputs (`names`: the inputs')."""
    from torch._functorch.aot_autograd import aot_module_simplified  # (imported when first used)
    from fusec.capture.buffer_updates import buffers_in_graph
    traced: list = []

    def run(*tensors):
        if not traced:
            mode = symbolic.fake_mode()
            fakes = [symbolic.fake_input(mode, t, dims.get(i)) for i, t in enumerate(tensors)]
            traced.append(aot_module_simplified(
                _Flat(flat_fn), fakes, fw_compiler=compiler, bw_compiler=compiler,
                partition_fn=partition_fn, decompositions=decompositions,
                keep_inference_input_mutations=buffers_in_graph()))
            parts.family = family_inputs(fakes, names)
        return traced[0](*tensors)
    return run


class _Flat(torch.nn.Module):
    """`flat_fn` as the module `aot_module_simplified` takes (with no state of its own: the
    parameters are among the flat inputs already)."""

    def __init__(self, flat_fn: Callable):
        super().__init__()
        self.flat_fn = flat_fn

    def forward(self, *tensors):
        return self.flat_fn(*tensors)


# ---- the sizes of a family's forward and backward graphs ----------------------------------------
#
# Note: sizes the graphs relate. Each graph AOT Autograd hands over is compiled as a family of its
# own: fusec traces it again with fresh symbols, one per symbolic dim of its inputs (fusec/
# dynamic.py `from_examples`). But the graph's inputs share symbols: `input_ids` and `labels` are
# both (s0, s1), a saved activation is (s0*s1, 32). Traced with independent symbols, the graph's
# ops would have to rediscover those relations from what they do with the sizes, and some they
# cannot (a cross-entropy comparing s0*s1 rows with s2*s3 specializes them to numbers, and the
# family serves one size). So `size_relations` reads the relations off the example inputs, and
# `relate_sizes` states them in the new trace before it runs: each dim that is a symbol already
# seen, or an expression of seen symbols, is traced as a symbol made equal to that expression.


def size_relations(example_inputs) -> tuple[dict, tuple]:
    """({flat tensor position: dims}, relations) for a graph handed over with symbolic sizes:
    the dims that are expressions of symbols (`s0*s1`), which `from_examples` leaves out, and the
    relations `relate_sizes` states: ({symbol: (tensor, dim) where it first is a dim}, [(tensor,
    dim, the dim's expression)] for every other symbolic dim)."""
    roots, related, dims, k = {}, [], {}, 0
    for e in example_inputs:
        if not isinstance(e, torch.Tensor):
            continue
        for d, n in enumerate(e.shape):
            expr = n.node.expr if isinstance(n, torch.SymInt) else None
            if expr is None or not expr.free_symbols:
                continue
            if expr.is_Symbol and expr not in roots:
                roots[expr] = (k, d)
                continue
            related.append((k, d, expr))
            if not expr.is_Symbol:
                dims.setdefault(k, set()).add(d)
        k += 1
    related = [(k, d, expr) for k, d, expr in related if expr.free_symbols <= set(roots)]
    return {k: frozenset(ds) for k, ds in dims.items()}, (roots, related)


def relate_sizes(fakes: list, relations: tuple) -> None:
    """State `relations` (`size_relations`) among the fresh symbols of `fakes`, the fake inputs
    of a new trace: each related dim equal to its expression in the symbols of the roots' dims
    (a guard, which the ShapeEnv turns into a replacement)."""
    roots, related = relations
    inner = {}
    for symbol, (k, d) in roots.items():
        n = fakes[k].shape[d] if k < len(fakes) and d < fakes[k].dim() else None
        if isinstance(n, torch.SymInt) and n.node.expr.is_Symbol:
            inner[symbol] = n.node.expr
    for k, d, expr in related:
        n = fakes[k].shape[d] if k < len(fakes) and d < fakes[k].dim() else None
        if not isinstance(n, torch.SymInt) or not expr.free_symbols <= set(inner):
            continue
        value = n.node.shape_env.create_symintnode(expr.xreplace(inner), hint=symbolic.hint(n))
        torch._check(n == value)

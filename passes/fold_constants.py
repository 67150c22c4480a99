"""Constant folding: compute once, while compiling, what depends on no input of the program.

A traced program often computes values from nothing but constants: a mask built from the
shapes, a table of positions. Eager recomputes them on every call, and so would the compiled
program. torchvision's Swin Transformer builds its shifted-window attention mask in every block.
It takes a zero tensor and nine slice assignments, each filling a window with a number. After
functionalization those are `full`, `slice`, `copy` and `slice_scatter` ops, each one an extern
call on a tiny tensor: dozens of eager ATen calls per forward, all giving the same answer every
time:

    before                                       after
    full = aten.full([56, 56], 0.0)              _folded_mask = <a tensor computed once>
    c0 = lift_fresh_copy(_tensor_constant0)      ...
    ss = slice_scatter(full, copy(...), 0, 0, 49)
    ...                                          add = add(attn, _folded_mask)
    mask = masked_fill(sub(...), ne(...), -100)
    add = add(attn, mask)

The pass walks the graph in order and knows which values are constant. A factory (`full`,
`arange`) is constant, and so is a tensor literal made inside the program (`torch.tensor(3.0)`,
traced as `lift_fresh_copy` of a graph attribute). So is any node whose inputs are all constant,
unless it is impure, random, or uninitialized memory (`empty`). A bare graph attribute is *not*:
it is a tensor the program reached by itself (a closure's), which the program reads at every
call, so the caller may change it in place between calls and the program must see that. Those
nodes are run on real tensors, on the program's device, with the same ATen ops eager would run:
the folded values are eager's, bit for bit. Where a constant value meets the rest of the program,
it becomes a `get_attr` of the computed tensor, laid out with the strides the graph recorded.
The nodes that computed it are left to `dce`.

Only constants that cost an eager ATen call are folded. `full(...) > 0` inside a fused kernel is
computed from each element's index for free, while a folded tensor would be read from memory.
A literal is folded too: its copy would be a kernel of its own per call, and the folded value is
read just as the literal would be.

Parameters and buffers are *not* constants: they are the program's inputs (lifted by capture),
and an optimizer or the user may change them between calls. A value that is a program output is
not folded either: each call must return a tensor of its own. Large values (over MAX_ELEMENTS)
stay computed per call: folding them would trade their compute for memory kept for the program's
life. `explain` lists what was folded, from `record_of(gm).fold_constants`.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fusec.symbolic import is_symbolic
from fusec import ops
from fusec.record import Folded, record_of

from .grouping import constant_node

MAX_ELEMENTS = 1 << 20  # at most 4 MB of float32 kept per folded value

# Uninitialized memory: its values are whatever the allocator hands out, not a constant.
UNINITIALIZED = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                 torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
                 torch.ops.aten.new_empty_strided.default}


def foldable(node: fx.Node) -> bool:
    """An op that gives the same value every time it runs on the same inputs."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    if not isinstance(node.target, torch._ops.OpOverload) or node.target in UNINITIALIZED:
        return False
    if torch.Tag.nondeterministic_seeded in node.target.tags:  # rand, dropout, ...
        return False
    return not node.is_impure()


def fold_constants(gm: fx.GraphModule) -> fx.GraphModule:
    values: dict[fx.Node, object] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            continue  # a tensor the program reaches (a closure's): the caller may change it
        literal = node.target is torch.ops.aten.lift_fresh_copy.default \
            and node.args[0].op == "get_attr"  # `torch.tensor(3.0)` made inside the program
        if not foldable(node) or not (literal or all(a in values for a in node.all_input_nodes)):
            continue
        if not node.all_input_nodes and not _creates_tensor(node):
            continue
        if _reads_a_symbol(node):
            continue  # `scalar_tensor(s0)`: a value of the call's sizes, not of the program
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and is_symbolic(tuple(val.shape)):
            continue  # its size is a shape family's symbol: computed on each call, as sized
        if isinstance(val, torch.Tensor) and val.numel() > MAX_ELEMENTS:
            continue  # not computed while compiling at all: it could not be kept anyway
        try:
            if literal:
                values[node] = _attribute(gm, node.args[0].target).clone()
                continue
            args = fx.node.map_arg(node.args, values.__getitem__)
            kwargs = fx.node.map_arg(node.kwargs, values.__getitem__)
            with torch.no_grad():
                values[node] = node.target(*args, **kwargs)
        except Exception:  # an op that cannot run here: it stays in the program
            continue

    folded = []
    for node, value in list(values.items()):
        if not isinstance(value, torch.Tensor):
            continue
        users = list(node.users)
        if all(u in values for u in users) or any(u.op == "output" for u in users):
            continue  # used only by other constants, or returned to the caller
        meta = node.meta.get("fusec")
        if value.numel() > MAX_ELEMENTS or meta is None or tuple(meta.shape) != tuple(value.shape):
            continue
        if any(st == 0 and n > 1 for st, n in zip(meta.stride, meta.shape)):
            continue  # an expanded view (a broadcast): its producer is the value to keep
        if not _removes_an_extern(node, values):
            continue
        kept = torch.empty_strided(tuple(meta.shape), tuple(meta.stride), dtype=value.dtype,
                                   device=value.device).copy_(value)
        with gm.graph.inserting_before(node):
            attr = constant_node(gm, f"_folded_{node.name}", kept)
        attr.meta.update(node.meta)
        node.replace_all_uses_with(attr)
        dtype = str(value.dtype).replace("torch.", "")
        folded.append(Folded(node.name, attr.target, tuple(value.shape), dtype))
    record_of(gm).fold_constants = folded
    gm.recompile()  # the nodes that computed the folded values are dead now: dce removes them
    return gm


def _reads_a_symbol(node: fx.Node) -> bool:
    """Whether `node` takes a shape family's symbol as an argument (a SymInt or SymFloat of the
    sizes, `n / (n - 1)`): running it here would pin the symbol to this call's size (a guard
    `s0 == 5`), and the family would serve one size."""
    found = []

    def visit(a):
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)) and a.node.expr.free_symbols:
            found.append(a)
        return a
    fx.node.map_aggregate((node.args, node.kwargs), visit)
    return bool(found)


def _removes_an_extern(node: fx.Node, values: dict) -> bool:
    """Whether computing `node` per call takes an eager ATen call (arange, slice_scatter, copy ...).
    A constant made only of ops that fuse (`full`, comparisons, `where`) costs nothing inside a
    kernel, which computes it from the element's index, while a folded tensor would have to be
    read from memory: those stay."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        if n.target is not operator.getitem and ops.classify(n.target) == ops.EXTERN:
            return True
        if n.target is torch.ops.aten.lift_fresh_copy.default:
            return True  # a literal's copy: folded, a kernel reads the literal's values as they are
        todo += [a for a in n.all_input_nodes if a in values]
    return False


def _creates_tensor(node: fx.Node) -> bool:
    """A node without inputs worth folding: a factory (full, arange, scalar_tensor ...)."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor)


def _attribute(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def known_value(gm: fx.GraphModule, node):
    """The tensor `node` always is, if it is a value this pass folded (a `get_attr` it made) or
    views of one; else None. Later passes read such values while compiling (constant_gathers,
    check_gathers). A graph attribute the pass did not make is never read: it is a tensor the
    caller hands in, which may change between calls."""
    chain = []
    while isinstance(node, fx.Node) and node.op == "call_function" \
            and ops.classify(node.target) == ops.VIEW and not ops.is_multi_view(node.target):
        chain.append(node)
        node = node.args[0]
    folded = {f.attr for f in record_of(gm).fold_constants}
    if not (isinstance(node, fx.Node) and node.op == "get_attr" and node.target in folded):
        return None
    value = _attribute(gm, node.target)
    for view in reversed(chain):
        value = view.target(value, *view.args[1:], **view.kwargs)
    return value

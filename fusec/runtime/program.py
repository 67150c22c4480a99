"""The program model: a scheduled graph becomes a Program, a list of steps over buffer slots.

A Program is built once per input signature. Everything that can be decided ahead of time is:
which slot each value lives in, the shapes and strides of every buffer a kernel writes, the
prepared launcher of each kernel. A call then only fills the input slots and runs the steps:

    env = [x, None, None]
    KernelStep  fused_sin_sin_mul_0   env[1] = empty(4, 4); launch(env[0], env[1])
    ExternStep  aten.mm.default       env[2] = aten.mm(env[1], env[0])
    return [env[2]]

Views do not appear here unless an extern call or the caller needs them as tensors: kernels read
views through index expressions (see passes/schedule.py).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.fx as fx

from fusec.ir import TensorMeta
from fusec.symbolic import size_names, size_symbols

from fusec.record import MemoryPlan, folded_view, group_info, layout_of, owns_buffer
from fusec.runtime.family_pool import FamilyPool
from fusec.runtime.steps import ExternStep, GetItemStep, KernelStep, OutputBuffer, SlotRef, ViewStep
from fusec.runtime.writer import straight_line


class Program:
    """A compiled program for one input signature.

    Intermediate buffers live in one pool allocated on the first call and reused by every later
    one (passes/schedule.py plans the offsets), so a call allocates only its outputs.

    The first call also writes the steps out as one straight-line Python function, `self.run`
    (see "Note: the per-call path" below); every call after that is just `self.run(inputs)`.
    `interpret` walks the steps one by one instead: the same result, the slow way.
    """

    def __init__(self, n_slots: int, input_slots: list[int], constants: dict[int, torch.Tensor],
                 steps: list, output_slots: list[int], producers: dict[int, Any],
                 memory=None):
        self.memory = memory
        self.pool: torch.Tensor | None = None
        self.family_pool: FamilyPool | None = None  # a shape family's pools, one per size
        self.n_slots = n_slots
        self.input_slots = input_slots
        self.constants = list(constants.items())
        self.steps = steps
        self.output_slots = output_slots
        self.producers = producers  # output slot -> the kernel (or op name) that produced it
        self.run: Callable | None = None  # the straight-line function, built by prepare()

    def __repr__(self) -> str:
        kernels = sum(isinstance(s, KernelStep) for s in self.steps)
        pool = self.memory.pool_bytes if self.memory else 0
        return (f"<fusec Program: {len(self.steps)} step(s) ({kernels} kernel(s)), "
                f"{self.n_slots} slot(s), inputs {self.input_slots}, outputs "
                f"{self.output_slots}, a {pool}-byte pool; .run.source is the straight-line "
                f"function{'' if self.run else ' (written at the first call)'}>")

    def _bind_pool(self) -> None:
        kernels = [s for s in self.steps if isinstance(s, KernelStep)]
        device = kernels[0].device if kernels else torch.device("cpu")
        per_size = self.memory is not None and self.memory.per_size  # a shape family's plan
        self.pool = torch.empty(1 if per_size else max(self.memory.pool_bytes if self.memory else 0, 1),
                                dtype=torch.uint8, device=device)
        for step in kernels:
            step.bind_pool(self.pool)
        if per_size:  # its buffers are carved per size, at a call (fusec/runtime/family_pool.py)
            self.family_pool = FamilyPool(str(device), [(w.dtype, *w.live) for step in kernels
                                                        for w in step.writes if w.live])

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The output tensors for `inputs` (one tensor per input slot, in order)."""
        return (self.run or self.prepare())(inputs)

    def prepare(self) -> Callable:
        """Allocate the pool and build `self.run`, once; returns it."""
        if self.pool is None:
            self._bind_pool()
        if self.run is None:
            self.run = self.runner()
        return self.run

    def runner(self, aliases: dict | None = None, constants: dict | None = None,
               form: str = "list") -> Callable:
        """A straight-line function `run(inputs)` for this program (see `straight_line`).

        By default it returns the list of output tensors. A caller that knows what the user's
        function returns can have it returned directly: `constants` (output index -> a value
        returned as is) are inserted, `aliases` (output index -> input index) return an input
        itself, and `form` is "list", "tuple" or "single" (the one output, unwrapped).
        """
        if self.pool is None:
            self._bind_pool()
        return straight_line(self, aliases or {}, constants or {}, form)

    def interpret(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Run the steps one by one over a list of slots: what `run` does, written as a loop."""
        if self.pool is None:
            self._bind_pool()
        env: list = [None] * self.n_slots
        for slot, t in zip(self.input_slots, inputs):
            env[slot] = t
        for slot, t in self.constants:
            env[slot] = t
        for step in self.steps:
            step(env)
        return [env[s] for s in self.output_slots]


def build_program(gm: fx.GraphModule, kernels: dict[str, Any], memory: MemoryPlan | None = None,
                  inplace: dict[str, str] | None = None) -> Program:
    """Turn a scheduled graph plus its compiled kernels (name -> Kernel) into a Program.

    `memory` places intermediate buffers in the pool and `inplace` names the outputs written over
    a dying input (passes/memory.py; the driver plans both). Without them every output is a
    fresh buffer."""
    slot_of: dict[str, int] = {}

    def slot(name: str) -> int:
        if name not in slot_of:
            slot_of[name] = len(slot_of)
        return slot_of[name]

    nodes = list(gm.graph.nodes)
    by_name = {n.name: n for n in nodes}
    inplace = inplace or {}
    output = gm.graph.output_node()
    input_slots, constants, steps = [], {}, []
    producers: dict[int, Any] = {}
    # a view read through index arithmetic needs no tensor of its own, unless an extern call or
    # the caller reads it
    materialize = {n for n in nodes if folded_view(n)
                   and any(u.op != "call_module" and not folded_view(u) for u in n.users)}

    def ref(a):
        return SlotRef(slot(a.name)) if isinstance(a, fx.Node) else a

    for node in nodes:
        if node.op == "placeholder":
            input_slots.append(slot(node.name))
        elif node.op == "get_attr":
            constants[slot(node.name)] = getattr(gm, node.target)
        elif node.op == "call_module":
            kernel = kernels[node.target]
            reads = [slot(p.name) for p in kernel.ir.params if not p.is_output]
            writes = []
            for p in kernel.ir.params:
                if p.is_output:
                    layout = layout_of(by_name[p.name])
                    placed = memory.placements.get(p.name) if memory else None
                    per_size = placed is not None and memory.per_size  # (a shape family's)
                    writes.append(OutputBuffer(slot(p.name), layout.shape, layout.stride, p.dtype,
                                               placed.offset if placed and not per_size else None,
                                               placed.nbytes if placed and not per_size else 0,
                                               slot(inplace[p.name]) if p.name in inplace else None,
                                               (placed.first, placed.last) if per_size else None))
                    producers[slot(p.name)] = kernel
            device = group_info(node).device
            # launch unless every output is empty (a reduction over an empty dim still writes
            # its rows: the identity of the reduction)
            out_numel = max((math.prod(w.shape) for w in writes), default=0)
            steps.append(KernelStep(kernel.name, kernel.launcher, reads, writes, device, out_numel,
                                    size_symbols(kernel.ir)))
        elif node.op == "call_function" and "fusec_views" in node.meta:
            continue  # split/unbind: its pieces are views, read in place
        elif node.op == "call_function" and node in materialize:
            layout = layout_of(node)
            steps.append(ViewStep(slot(layout.root), layout, slot(node.name)))
        elif folded_view(node):
            continue  # a view (or a piece of a split) read through index arithmetic
        elif node.op == "call_function" and node.target.__name__ == "getitem":
            src = node.args[0]
            if src.op == "call_module":
                continue  # a kernel output: written by the KernelStep
            planned = layout_of(node) if owns_buffer(node) else None
            steps.append(GetItemStep(slot(src.name), node.args[1], slot(node.name), planned))
            producers[slot(node.name)] = str(src.target)
        elif node.op == "call_function":
            steps.append(ExternStep(node.target, fx.node.map_arg(node.args, ref),
                                    fx.node.map_arg(node.kwargs, ref), slot(node.name),
                                    layout_of(node) if owns_buffer(node) else None))
            producers[slot(node.name)] = str(node.target)
    outputs = [slot(a.name) for a in output.args[0]]
    program = Program(len(slot_of), input_slots, constants, steps, outputs, producers, memory)
    describe_inputs(program, gm)
    program.slot_names = [None] * len(slot_of)
    for name, index in slot_of.items():
        program.slot_names[index] = name
    return program


def describe_inputs(program: Program, gm: fx.GraphModule) -> None:
    """What the writer needs of the inputs of a shape family's program: where each size symbol
    is read (`size_bindings`), each input's meta and rank."""
    program.size_bindings = size_bindings(gm)
    metas = [n.meta.get("fusec") for n in gm.graph.nodes if n.op == "placeholder"]
    program.input_metas = [m if isinstance(m, TensorMeta) else None for m in metas]
    program.input_ranks = [len(m.shape) if isinstance(m, TensorMeta) else None for m in metas]


def size_bindings(gm: fx.GraphModule) -> list[tuple]:
    """For a program over a shape family (fusec/symbolic.py): where each size symbol is read on a
    call, as (symbol, its name, input position, "size" or "stride", dim); [] for a static one."""
    out, seen = [], set()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for k, node in enumerate(placeholders):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for kind, values in (("size", val.shape), ("stride", val.stride())):
            for d, v in enumerate(values):
                if isinstance(v, torch.SymInt) and v.node.expr.is_Symbol and v.node.expr not in seen:
                    seen.add(v.node.expr)
                    name = size_names(v.node.shape_env).get(v.node.expr) or f"{node.name}_{kind}{d}"
                    out.append((v.node.expr, name, k, kind, d))
    return out

"""The program and its captured graph, run so that they can be measured: every kernel launch and
extern call inside a named profiler range (`profiled_steps`, on a copy of the steps: the normal
call path has no profiler code), the captured graph op by op (`OpByOp`), and each kernel's
outputs next to the same values computed in float64 (`kernel_numerics`).
"""
from __future__ import annotations


import torch
import torch.fx as fx
from torch.profiler import record_function

from fusec.check import compare
from fusec.driver import CompiledGraph
from fusec.inspect.groups import distinct_elements
from fusec.ir import TensorMeta
from fusec.runtime.steps import ExternStep, KernelStep

# ---- the profiled program -----------------------------------------------------------------------

class _Named:
    """A program step wrapped in a profiler range (used only in the profiled copy of the steps)."""

    def __init__(self, step, label: str):
        self.step, self.label = step, label

    def __call__(self, env: list) -> None:
        with record_function(self.label):
            self.step(env)


def extern_label(op: str, node: str) -> str:
    return f"extern {op} -> {node}"


def profiled_steps(program, schedule=None) -> list:
    """The program's steps, each kernel launch and extern call inside a named profiler range:
    the kernel's name, or `extern aten.mm.default -> mm` (op and the value it computes)."""
    extern_nodes = [s.node for s in schedule or [] if s.kind == "extern"]
    n_extern = sum(isinstance(s, ExternStep) for s in program.steps)
    if len(extern_nodes) != n_extern:
        extern_nodes = None
    out, i = [], 0
    for step in program.steps:
        if isinstance(step, KernelStep):
            out.append(_Named(step, step.name))
        elif isinstance(step, ExternStep):
            node = extern_nodes[i] if extern_nodes else "?"
            out.append(_Named(step, extern_label(step.name, node)))
            i += 1
        else:
            out.append(step)
    return out


def run_steps(program, steps: list, inputs: list[torch.Tensor], keep: bool = False) -> list:
    """Program.__call__ over `steps`, returning the whole slot environment.

    Intermediate buffers share pooled memory (passes/schedule.py): once a buffer's last reader
    has run, a later step may write over its bytes. With `keep=True` each kernel's outputs are
    copied out of the pool as soon as the kernel has run, so that every slot of the returned
    environment still holds the value it had when it was made (what a per-kernel numerics check
    must compare); without it, only the program's outputs are sure to be intact.
    """
    env: list = [None] * program.n_slots
    for slot, t in zip(program.input_slots, inputs):
        env[slot] = t
    for slot, t in program.constants:
        env[slot] = t
    for step in steps:
        saved = {}
        if keep and isinstance(step, KernelStep):  # an input written over stays intact too
            for buf in step.writes:
                if buf.inplace is not None:
                    saved[buf.inplace] = env[buf.inplace]
                    env[buf.inplace] = env[buf.inplace].clone()
        step(env)
        if keep and isinstance(step, KernelStep):
            for buf in step.writes:
                env[buf.slot] = env[buf.slot].clone()
            for slot, t in saved.items():
                env[slot] = t
    return env


def kernel_output_slots(cg: CompiledGraph) -> dict[str, int]:
    """Value name -> slot for every buffer a kernel writes."""
    by_kernel = {k.name: k for k in cg.kernels}
    out = {}
    for step in cg.program.steps:
        if isinstance(step, KernelStep):
            names = [p.name for p in by_kernel[step.name].ir.params if p.is_output]
            for name, buf in zip(names, step.writes):
                out[name] = buf.slot
    return out


class OpByOp(fx.Interpreter):
    """Runs a captured graph node by node, each ATen op inside `record_function("node NAME")`."""

    def __init__(self, gm, ranges: bool):
        super().__init__(gm, garbage_collect_values=False)
        self.ranges = ranges

    def run_node(self, n):
        if self.ranges and n.op == "call_function":
            with record_function(f"node {n.name}"):
                return super().run_node(n)
        return super().run_node(n)



def _value_bytes(node: fx.Node) -> int:
    m = node.meta.get("fusec")
    if not isinstance(m, TensorMeta):
        return 0
    return distinct_elements(m.shape, m.stride) * torch.empty((), dtype=m.dtype).element_size()


def eager_bytes_of(gm: fx.GraphModule, names: list[str]) -> int:
    """Bytes eager PyTorch moves for these ATen ops run one by one: each reads its tensor inputs
    and writes its output (views read in place: only the elements they reach count)."""
    by_name = {n.name: n for n in gm.graph.nodes}
    total = 0
    for name in names:
        node = by_name.get(name)
        if node is None or node.op != "call_function":
            continue
        total += _value_bytes(node) + sum(_value_bytes(a) for a in node.all_input_nodes)
    return total


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    d = (a.double() - b.double()).abs()
    d = d[torch.isfinite(d)]
    return float(d.max()) if d.numel() else 0.0



def value_slots(cg: CompiledGraph) -> dict[str, int]:
    """Value name -> slot for every root buffer of the program: inputs, constants, kernel
    outputs and extern results (views have no slot unless materialized; see `_value`)."""
    gm, program = cg.gm, cg.program
    out = dict(kernel_output_slots(cg))
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    out.update(zip(placeholders, program.input_slots))
    attrs = [n.name for n in gm.graph.nodes if n.op == "get_attr"]
    out.update(zip(attrs, [slot for slot, _ in program.constants]))
    externs = [s.node for s in cg.schedule if s.kind == "extern"]
    ext_steps = [s for s in program.steps if isinstance(s, ExternStep)]
    if len(externs) == len(ext_steps):
        out.update(zip(externs, [s.out_slot for s in ext_steps]))
    return out


def _value(node: fx.Node, env: list, slots: dict[str, int], cache: dict):
    """The fused program's value of `node`: its slot, or a view replayed on its root's value."""
    if node.name in cache:
        return cache[node.name]
    if node.name in slots and env[slots[node.name]] is not None:
        value = env[slots[node.name]]
    elif node.op == "call_function":
        args = fx.node.map_arg(node.args, lambda a: _value(a, env, slots, cache))
        kwargs = fx.node.map_arg(node.kwargs, lambda a: _value(a, env, slots, cache))
        value = node.target(*args, **kwargs)
    else:
        raise KeyError(node.name)
    cache[node.name] = value
    return value


def kernel_numerics(cg: CompiledGraph, tensors: list[torch.Tensor]) -> dict[str, tuple]:
    """Kernel name -> (max |fused - f64|, max |eager - f64|, problem or None).

    Each kernel is judged on its own: its sub-graph runs in float64 on the very inputs the fused
    kernel read (a local reference), and eagerly (ATen, the inputs' dtypes) on the same inputs.
    Errors therefore do not pile up from earlier steps: the numbers are this kernel's rounding.
    The judgement is check.compare's (fused may not be further from the reference than eager,
    beyond the dtype's tolerance).
    """
    gm = cg.gm
    with torch.no_grad():
        env = run_steps(cg.program, cg.program.steps, tensors, keep=True)
    slots = value_slots(cg)
    by_kernel = {k.name: k for k in cg.kernels}
    cache: dict = {}
    out = {}
    for node in gm.graph.nodes:
        if node.op != "call_module" or node.target not in by_kernel:
            continue
        sub = getattr(gm, node.target)
        try:
            with torch.no_grad():
                inputs = [_value(a, env, slots, cache) for a in node.args]
                eager = list(sub(*inputs))
                ref = list(sub(*[t.double() if t.is_floating_point() else t for t in inputs]))
        except Exception:  # an op without float64 support: no error column for this kernel
            continue
        names = [p.name for p in by_kernel[node.target].ir.params if p.is_output]
        worst_f, worst_e, problem = 0.0, 0.0, None
        for name, e, r in zip(names, eager, ref):
            if name not in slots:
                continue
            f = env[slots[name]]
            r = r if r.shape == f.shape else None
            problem = problem or compare(f, e, r)
            base = r if r is not None else e
            worst_f = max(worst_f, _max_abs(f, base))
            worst_e = max(worst_e, _max_abs(e, base))
        out[node.target] = (worst_f, worst_e, problem)
    return out

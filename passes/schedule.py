"""Schedule: decide where every value lives, then list the launches in order.

After fusion the graph holds four kinds of nodes: inputs, fused kernels (call_module), extern ATen
calls, and views. This pass

1. picks each kernel output's layout in memory: the strides eager PyTorch would have given it
   when those are dense (so `y.stride()` matches eager, and views traced against eager's
   layout stay valid), else contiguous;
2. propagates layouts through the graph with fake tensors: a view such as `x.t()[1:]` gets no
   buffer of its own, only a Layout (root buffer, shape, strides, offset) into `x`. The code
   generator folds that layout into load indices, so views cost nothing;
3. writes the ordered list of steps, each a kernel launch or an extern call with the root
   buffers it reads and writes, into `gm.meta["fusec_schedule"]`;
4. plans memory (`gm.meta["fusec_memory"]`): every intermediate buffer a kernel writes gets an
   offset in one pool, reusing the bytes of buffers whose last reader has run.

    1. kernel fused_sin_sin_mul_0   reads x f32[4, 4]             writes mul f32[4, 4]
    2. extern aten.mm.default       reads mul f32[4, 4], w f32[4, 4]   writes mm f32[4, 4]

The graph order is already topological, so the order of steps is the graph's. Memory planning
and CUDA-graph capture build on this list.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from fusec import ops
from fusec.codegen import backends
from fusec.ir import Layout, TensorMeta, contiguous_strides


@dataclass
class Step:
    kind: str  # "kernel" or "extern"
    name: str  # kernel name or ATen op
    node: str
    reads: list[str] = field(default_factory=list)
    writes: list[str] = field(default_factory=list)
    shapes: dict = field(default_factory=dict)

    def __str__(self) -> str:
        def fmt(names):
            return ", ".join(f"{n} {self.shapes.get(n, '')}".strip() for n in names) or "-"
        return f"{self.kind:<6} {self.name:<32} reads {fmt(self.reads)}  writes {fmt(self.writes)}"


def schedule(gm: fx.GraphModule) -> fx.GraphModule:
    output_values = {a for a in gm.graph.output_node().all_input_nodes}
    fake_of: dict[fx.Node, torch.Tensor] = {}
    mode = _fake_mode(gm)
    steps: list[Step] = []

    for node in gm.graph.nodes:
        m = node.meta.get("fusec")
        if node.op in ("placeholder", "get_attr") and isinstance(m, TensorMeta):
            fake_of[node] = _root(mode, m, m.stride)
            node.meta["fusec_layout"] = Layout(node.name, m.shape, m.stride, 0)
        elif node.op == "call_module":
            steps.append(Step("kernel", node.target, node.name))
        elif node.op == "call_function" and node.target.__name__ == "getitem" \
                and node.args[0].op == "call_module":
            # Eager's strides when they are dense (sin(x.t()) stays transposed): outputs then match
            # eager, and views traced against eager's layout replay on ours.
            stride = m.stride if _dense(m) else contiguous_strides(m.shape)
            fake_of[node] = _root(mode, m, stride)
            node.meta["fusec_layout"] = Layout(node.name, m.shape, stride, 0)
            steps[-1].writes.append(node.name)
        elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
                and ops.classify(node.target) == ops.VIEW:
            base = node.args[0]
            view = _run_fake(mode, node, fake_of)
            if view is None:  # cannot replay on our layout: copy like reshape would
                if node.target is torch.ops.aten.view.default:
                    node.target = torch.ops.aten.reshape.default
                steps.append(Step("extern", str(node.target), node.name))
                _new_root(node, mode, fake_of)
                continue
            fake_of[node] = view
            root = base.meta["fusec_layout"].root
            node.meta["fusec_layout"] = Layout(root, tuple(view.shape), tuple(view.stride()),
                                               view.storage_offset())
        elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
                and ops.is_multi_view(node.target) \
                and isinstance(views := _run_fake(mode, node, fake_of), (list, tuple)):
            # split / unbind: a list of views; each getitem below gets a Layout into the root
            node.meta["fusec_views"] = list(views)
        elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            steps.append(Step("extern", str(node.target), node.name))
            out = _run_fake(mode, node, fake_of)
            if isinstance(out, torch.Tensor) and isinstance(m, TensorMeta):
                fake_of[node] = _root(mode, m, tuple(out.stride()))
                node.meta["fusec_layout"] = Layout(node.name, m.shape, tuple(out.stride()), 0)
            elif isinstance(m, TensorMeta):
                _new_root(node, mode, fake_of)
        elif node.op == "call_function" and node.target.__name__ == "getitem" \
                and "fusec_views" in node.args[0].meta:
            view = node.args[0].meta["fusec_views"][node.args[1]]
            fake_of[node] = view
            root = node.args[0].args[0].meta["fusec_layout"].root
            node.meta["fusec_layout"] = Layout(root, tuple(view.shape), tuple(view.stride()),
                                               view.storage_offset())
        elif node.op == "call_function" and node.target.__name__ == "getitem":
            # one output of a multi-output extern: a root buffer of its own
            if isinstance(m, TensorMeta):
                _new_root(node, mode, fake_of)
                producer = next(s for s in steps if s.node == node.args[0].name)
                producer.writes.append(node.name)

    # reads: the root buffers behind every tensor argument of a step
    by_name = {n.name: n for n in gm.graph.nodes}
    for step in steps:
        node = by_name[step.node]
        if step.kind == "extern" and node.target._schema.is_mutable and node.args:
            # copy_(x, new) and friends write into their first argument's buffer
            step.writes.append(node.args[0].meta["fusec_layout"].root)
        elif step.kind == "extern" and "fusec_layout" in node.meta and not step.writes:
            step.writes.append(node.name)
        for arg in node.all_input_nodes:
            layout = arg.meta.get("fusec_layout")
            if layout and layout.root not in step.reads:
                step.reads.append(layout.root)
        for name in step.reads + step.writes:
            m = by_name[name].meta.get("fusec")
            if isinstance(m, TensorMeta):
                step.shapes[name] = str(m)
    gm.meta["fusec_schedule"] = steps
    gm.meta["fusec_memory"] = plan_memory(gm, steps)
    return gm


# ---- memory plan ------------------------------------------------------------------------------

ALIGN = 64  # bytes: every planned buffer starts on a cache line (and a 16-byte vector boundary)


@dataclass
class Placement:
    """A kernel's output buffer inside the pool: bytes [offset, offset + nbytes), needed from
    step `first` (the kernel that writes it) to step `last` (its last reader)."""

    name: str
    offset: int
    nbytes: int
    first: int
    last: int


@dataclass
class MemoryPlan:
    """Intermediate buffers share one pool; a buffer reuses the bytes of one whose last use has
    passed. Program outputs, inputs and extern results are not planned: outputs must outlive the
    call, and ATen allocates what extern calls return."""

    placements: dict = field(default_factory=dict)
    pool_bytes: int = 0
    naive_bytes: int = 0  # what allocating every planned buffer separately would take

    def __str__(self) -> str:
        lines = [f"memory plan: pool {self.pool_bytes} bytes for {len(self.placements)} "
                 f"intermediate buffer(s), {self.naive_bytes} bytes without reuse"]
        for p in sorted(self.placements.values(), key=lambda p: (p.first, p.offset)):
            lines.append(f"  {p.name:<24} offset {p.offset:>10}  {p.nbytes:>10} bytes  "
                         f"live steps {p.first + 1}-{p.last + 1}")
        return "\n".join(lines)


def plan_memory(gm: fx.GraphModule, steps: list[Step], skip=frozenset()) -> MemoryPlan:
    """Assign every intermediate kernel output an offset in one pool, reusing memory by liveness.

    1. a buffer is live from the step that writes it to the last step that reads it (through any
       view of it: views fold into indices, so their reader reads the root);
    2. buffers are placed in the order they are written; each takes the lowest offset where it
       overlaps no buffer still live at that time (first fit in the address space).
    Buffers in `skip` get no place: they are written over another buffer (see plan_inplace).
    """
    by_name = {n.name: n for n in gm.graph.nodes}
    escaped = _escaped(gm)
    first, last = {}, {}
    for i, step in enumerate(steps):
        for name in step.reads:
            last[name] = i
        if step.kind == "kernel":
            for name in step.writes:
                first.setdefault(name, i)
                last.setdefault(name, i)
    plan = MemoryPlan()
    live: list[Placement] = []
    for name in sorted(first, key=first.__getitem__):
        if name in escaped or name in skip:
            continue
        m = by_name[name].meta["fusec"]
        nbytes = _nbytes(m)
        if nbytes == 0:
            continue
        start, end = first[name], last[name]
        live = [p for p in live if p.last >= start]  # buffers whose last use has passed are free
        offset = 0
        for p in sorted(live, key=lambda p: p.offset):
            if offset + nbytes <= p.offset:
                break
            offset = max(offset, _align(p.offset + p.nbytes))
        placement = Placement(name, offset, nbytes, start, end)
        live.append(placement)
        plan.placements[name] = placement
        plan.pool_bytes = max(plan.pool_bytes, _align(offset + nbytes))
        plan.naive_bytes += _align(nbytes)
    return plan


def _escaped(gm: fx.GraphModule) -> set[str]:
    """Root buffers that must outlive the call or that something else aliases: the program's
    outputs, and the arguments of an extern that returns a view of them."""
    escaped = {a.meta["fusec_layout"].root for a in gm.graph.output_node().all_input_nodes
               if "fusec_layout" in a.meta}
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) \
                and "fusec_layout" in n.meta and n.meta["fusec_layout"].root == n.name \
                and any(r.alias_info is not None for r in n.target._schema.returns):
            escaped |= {a.meta["fusec_layout"].root for a in n.all_input_nodes if "fusec_layout" in a.meta}
    return escaped


# Note (writing over a dying input): softmax over attention scores reads a (B, H, T, T) buffer
# that bmm just allocated and that nothing reads afterwards, and writes a buffer of the same size:
# for a moment both are live, 2 x 12.6 MB in a bf16 GPT-2 block. When a kernel's output has the
# same shape, strides and dtype as such an input, and the kernel reads each element of the input
# exactly where it writes the same element of the output (same index), the output can simply be
# written over the input: every element is read before it is overwritten, by the same program
# instance. torch.compile's Inductor does the same ("inplace" buffer reuse).
#
# Only extern results qualify: ATen allocated them for this call, so nobody else holds them
# (program inputs belong to the caller; pool buffers are planned already). Only the Triton
# backend does it: its pointers make no promise that two of them never alias, while the C++ and
# LLVM kernels declare every pointer `__restrict__`/`noalias`, and the C++ reductions keep values
# in their output between passes (the loop plan's `keep`), which an input in the same memory
# would not survive. CPU memory is rarely what limits a CPU program anyway.

def plan_inplace(gm: fx.GraphModule, kernels: dict, backend: str) -> dict[str, str]:
    """Kernel output -> the extern result it is written over (see the note above)."""
    if not backends.get(backend).writes_over_dying_inputs:
        return {}
    steps = gm.meta["fusec_schedule"]
    by_name = {n.name: n for n in gm.graph.nodes}
    escaped = _escaped(gm)
    last: dict[str, int] = {}
    for i, step in enumerate(steps):
        for name in step.reads:
            last[name] = i
    fresh = {s.node for s in steps if s.kind == "extern" and s.writes == [s.node]
             and "fusec_layout" in by_name[s.node].meta
             and by_name[s.node].meta["fusec_layout"].root == s.node}
    chosen: dict[str, str] = {}
    for i, step in enumerate(steps):
        if step.kind != "kernel":
            continue
        ir = kernels[step.name].ir
        space = ir.shape if hasattr(ir, "shape") else ir.row_shape + ir.k_shape
        for store in ir.stores:
            if any(st == 0 and n > 1 for st, n in zip(store.index.strides, space)):
                continue  # a broadcast store (a row result): several positions, one address
            out = by_name[store.param].meta["fusec_layout"]
            for name in dict.fromkeys(l.param for l in ir.loads):
                if name not in fresh or name in escaped or last.get(name) != i \
                        or name in chosen.values():
                    continue
                loads = [l for l in ir.loads if l.param == name]
                src = by_name[name].meta["fusec_layout"]
                # the same bytes: equal spans, and every element read where it is written
                if _span(src) == _span(out) and src.offset == out.offset == 0 \
                        and by_name[name].meta["fusec"].dtype == store.dtype \
                        and all(l.index == store.index and l.dtype == store.dtype for l in loads) \
                        and sum(st.param == store.param for st in ir.stores) == 1:
                    chosen[store.param] = name
                    break
    return chosen


def _span(layout: Layout) -> int:
    """How many elements a layout's memory spans, from its first element to its last."""
    if any(n == 0 for n in layout.shape):
        return 0
    return 1 + sum((n - 1) * abs(st) for n, st in zip(layout.shape, layout.stride))


def _nbytes(m: TensorMeta) -> int:
    if any(s == 0 for s in m.shape):
        return 0
    span = 1 + sum((size - 1) * abs(st) for size, st in zip(m.shape, m.stride))
    return span * torch.empty((), dtype=m.dtype).element_size()


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def format_schedule(steps: list[Step]) -> str:
    return "\n".join(f"{i + 1:>3}. {s}" for i, s in enumerate(steps))


def _dense(m: TensorMeta) -> bool:
    """Non-overlapping and dense: some permutation of the dims is contiguous."""
    dims = sorted((st, sz) for st, sz in zip(m.stride, m.shape) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def _fake_mode(gm):
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and hasattr(val, "fake_mode"):
            return val.fake_mode
    return FakeTensorMode()


def _root(mode, m: TensorMeta, stride) -> torch.Tensor:
    with mode:
        return torch.empty_strided(m.shape, stride, dtype=m.dtype, device=m.device)


def _new_root(node: fx.Node, mode, fake_of) -> None:
    m = node.meta["fusec"]
    fake_of[node] = _root(mode, m, m.stride)
    node.meta["fusec_layout"] = Layout(node.name, m.shape, m.stride, 0)


def _run_fake(mode, node: fx.Node, fake_of):
    """Run node's op on fake tensors laid out as fusec lays them out (not as eager did)."""
    def arg(a):
        return fake_of[a] if isinstance(a, fx.Node) else a
    try:
        args = fx.node.map_arg(node.args, arg)
        kwargs = fx.node.map_arg(node.kwargs, arg)
        with mode:
            return node.target(*args, **kwargs)
    except Exception:
        return None

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
   buffers it reads and writes, into the graph's record: `record_of(gm).schedule`
   (fusec/record.py).

    1. kernel fused_sin_sin_mul_0   reads x f32[4, 4]             writes mul f32[4, 4]
    2. extern aten.mm.default       reads mul f32[4, 4], w f32[4, 4]   writes mm f32[4, 4]

The graph order is already topological, so the order of steps is the graph's. Memory planning
(passes/memory.py, once the kernels are lowered) and CUDA-graph capture build on this list.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from fusec import ops
from fusec.ir import Layout, TensorMeta, contiguous_strides
from fusec.record import Step, format_schedule, record_of
from fusec.symbolic import hashable, hint
from fusec.sizes import is_one, same_size

from .grouping import indexed_write

# Step and format_schedule live in fusec/record.py, the memory plan in passes/memory.py; they are
# named here too because this is where a reader of the schedule looks for them.
__all__ = ["schedule", "Step", "format_schedule"]


def schedule(gm: fx.GraphModule) -> fx.GraphModule:
    """Lay out every value and list the steps (the module docstring's 1-3), into the record."""
    fake_of: dict[fx.Node, torch.Tensor] = {}
    mode = fake_mode_of(gm)
    roots: dict = {}  # fake buffers by (shape, stride, dtype, device): see _root
    steps: list[Step] = []
    for node in gm.graph.nodes:
        _place(gm, node, mode, fake_of, roots, steps)
    _reads_and_writes(gm, steps)
    record_of(gm).schedule = steps
    return gm


def _place(gm: fx.GraphModule, node: fx.Node, mode, fake_of: dict, roots: dict,
           steps: list[Step]) -> None:
    """One node, in graph order: its Layout (a root buffer of its own, or a view into one) and
    its fake tensor; a kernel launch or an extern call also becomes the next step."""
    m = node.meta.get("fusec")
    call = node.op == "call_function"
    getitem = call and node.target.__name__ == "getitem"
    if node.op in ("placeholder", "get_attr") and isinstance(m, TensorMeta):
        fake_of[node] = _root(mode, m, m.stride, roots)
        node.meta["fusec_layout"] = Layout(node.name, m.shape, m.stride, 0)
    elif node.op == "call_module":
        steps.append(Step("kernel", node.target, node.name))
    elif getitem and node.args[0].op == "call_module":
        _place_kernel_output(gm, node, mode, fake_of, roots, steps)
    elif call and isinstance(node.target, torch._ops.OpOverload) \
            and ops.classify(node.target) == ops.VIEW:
        _place_view(node, mode, fake_of, roots, steps)
    elif call and isinstance(node.target, torch._ops.OpOverload) \
            and ops.is_multi_view(node.target) \
            and isinstance(views := _run_fake(mode, node, fake_of), (list, tuple)):
        # split / unbind: a list of views; each getitem below gets a Layout into the root
        node.meta["fusec_views"] = list(views)
    elif call and isinstance(
            node.target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
        _place_extern(node, mode, fake_of, roots, steps)
    elif getitem and "fusec_views" in node.args[0].meta:
        view = node.args[0].meta["fusec_views"][node.args[1]]
        fake_of[node] = view
        root = node.args[0].args[0].meta["fusec_layout"].root
        node.meta["fusec_layout"] = Layout(root, tuple(view.shape), tuple(view.stride()),
                                           view.storage_offset())
    elif getitem:
        # one output of a multi-output extern: a root buffer of its own
        if isinstance(m, TensorMeta):
            _new_root(node, mode, fake_of, roots)
            producer = next(s for s in steps if s.node == node.args[0].name)
            producer.writes.append(node.name)


def _place_kernel_output(gm: fx.GraphModule, node: fx.Node, mode, fake_of: dict, roots: dict,
                         steps: list[Step]) -> None:
    """One output of a kernel (a getitem of its call): a root buffer of its own, written by
    the last step, or the input buffer it writes into when it is an indexed write."""
    buffer = _written_buffer(gm, node)
    if buffer is not None:
        # an indexed write (`cache[:, :, pos] = k` in a kernel): its output is the buffer
        fake_of[node] = fake_of[buffer]
        node.meta["fusec_layout"] = buffer.meta["fusec_layout"]
        steps[-1].writes.append(buffer.meta["fusec_layout"].root)
        return
    m = node.meta.get("fusec")
    # Eager's strides when they are dense (sin(x.t()) stays transposed): outputs then match
    # eager, and views traced against eager's layout replay on ours.
    stride = m.stride if is_dense(m) else contiguous_strides(m.shape)
    fake_of[node] = _root(mode, m, stride, roots)
    node.meta["fusec_layout"] = Layout(node.name, m.shape, stride, 0)
    steps[-1].writes.append(node.name)


def _place_view(node: fx.Node, mode, fake_of: dict, roots: dict, steps: list[Step]) -> None:
    """A view op: a Layout into its base's root buffer, replayed on fusec's layout with fake
    tensors; a view that cannot replay there is copied instead, as reshape would (an extern)."""
    base = node.args[0]
    view = _run_fake(mode, node, fake_of)
    if view is not None and _reinterprets(view, fake_of.get(base)):
        view = None  # (view_as_complex, view(dtype), conj): eager's op, on the real tensor
    if view is None:  # cannot replay on our layout: copy like reshape would
        if node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
        steps.append(Step("extern", str(node.target), node.name))
        _new_root(node, mode, fake_of, roots)
        return
    fake_of[node] = view
    root = base.meta["fusec_layout"].root
    node.meta["fusec_layout"] = Layout(root, tuple(view.shape), tuple(view.stride()),
                                       view.storage_offset())


def _place_extern(node: fx.Node, mode, fake_of: dict, roots: dict, steps: list[Step]) -> None:
    """An ATen call fusec does not compile: a step of its own, its output a root buffer with
    the strides the op gives it on fusec's layout.

    (A higher-order op too: `with_effects`, which AOT Autograd wraps around an op with a side
    effect, such as linalg.inv's singular-matrix check: eager runs it as it is.)"""
    m = node.meta.get("fusec")
    steps.append(Step("extern", str(node.target), node.name))
    out = _run_fake(mode, node, fake_of)
    if isinstance(out, torch.Tensor) and isinstance(m, TensorMeta):
        fake_of[node] = _root(mode, m, tuple(out.stride()), roots)
        node.meta["fusec_layout"] = Layout(node.name, m.shape, tuple(out.stride()), 0)
    elif isinstance(m, TensorMeta):
        _new_root(node, mode, fake_of, roots)


def _reads_and_writes(gm: fx.GraphModule, steps: list[Step]) -> None:
    """Each step's reads (the root buffers behind its tensor arguments), an extern's writes
    (its own buffer, or the first argument's for an in-place op), and their shapes."""
    by_name = {n.name: n for n in gm.graph.nodes}
    for step in steps:
        node = by_name[step.node]
        if step.kind == "extern" and getattr(node.target, "_schema", None) is not None \
                and node.target._schema.is_mutable and node.args:
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


def _written_buffer(gm: fx.GraphModule, item: fx.Node) -> fx.Node | None:
    """For a kernel output that is an indexed write of an input buffer (passes/grouping.py,
    `indexed_write`), the buffer's node in this graph; else None."""
    call = item.args[0]
    sub = gm.get_submodule(call.target)
    out = sub.graph.output_node().args[0][item.args[1]]
    write = indexed_write(out)
    if write is None:
        return None
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    return call.args[placeholders.index(write[0])]


def is_dense(m: TensorMeta) -> bool:
    """Non-overlapping and dense: some permutation of the dims is contiguous."""
    # (ordered by the traced strides: the equalities below, guarded, make it dense at every size)
    dims = sorted(((st, sz) for st, sz in zip(m.stride, m.shape) if not is_one(sz)),
                  key=lambda pair: hint(pair[0]))
    expected = 1
    for st, sz in dims:
        if not same_size(st, expected):
            return False
        expected *= sz
    return True


def fake_mode_of(gm):
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and hasattr(val, "fake_mode"):
            return val.fake_mode
    return FakeTensorMode()


def _root(mode, m: TensorMeta, stride, roots: dict) -> torch.Tensor:
    """A fake buffer with `m`'s shape and dtype and this stride. Only its metadata is ever read
    (views and externs are replayed on it to learn their strides), so buffers that look alike
    share one: a model's layers make the same shapes again and again, and each new fake tensor
    costs a trip through the fake mode's dispatcher."""
    key = (hashable(m.shape), hashable(stride), m.dtype, str(m.device))
    if key not in roots:
        with mode:
            roots[key] = torch.empty_strided(m.shape, stride, dtype=m.dtype, device=m.device)
    return roots[key]



def _new_root(node: fx.Node, mode, fake_of, roots: dict) -> None:
    m = node.meta["fusec"]
    fake_of[node] = _root(mode, m, m.stride, roots)
    node.meta["fusec_layout"] = Layout(node.name, m.shape, m.stride, 0)


def _reinterprets(view, base) -> bool:
    """True for a view that is more than a layout over its base's elements: another dtype
    (`view_as_complex`, `x.view(torch.int32)`: a Layout counts elements of the root's dtype) or a
    lazy conjugate or negation bit. Such a view runs as eager's op, an extern step, on the real
    tensor; its result still aliases the base (passes/memory.py keeps the base out of the pool)."""
    if not isinstance(view, torch.Tensor) or not isinstance(base, torch.Tensor):
        return False
    return view.dtype != base.dtype or view.is_conj() != base.is_conj() or \
        view.is_neg() != base.is_neg()


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

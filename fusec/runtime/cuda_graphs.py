"""CUDA graphs: replay a whole Program as one CUDA graph, when it may be.

`graph_blocker` says why a program cannot be captured (it writes or returns its inputs, runs
anything on the CPU, draws random numbers, or is a single launch), or None; `CudaGraphRunner`
captures a program once, on one shared side stream per device (`capture_stream`), and replays it.
fusec/api.py decides when: the first call runs step by step, the second captures, later ones replay.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from fusec.symbolic import hint
from fusec.ir import TensorMeta
from fusec.runtime.program import Program
from fusec.runtime.steps import ExternStep, KernelStep, SlotRef, ViewStep


# Note (when a CUDA graph does not pay): a graph saves at most the CPU time of the steps it
# replaces, and only where that CPU time is not already hidden: step by step, the CPU queues
# launch after launch while the GPU works, so a program takes about max(steps' CPU time, GPU
# time). As one graph it takes the GPU time plus a copy of every user input into the graph's
# buffers and of every output out of them. So a graph pays only where
#     launches * LAUNCH_US + extern calls * EXTERN_US  >  GPU time + copy time
# (`cpu_estimate`: a step whose module launches two kernels and allocates counts as three).
# The GPU time is estimated from below (`gpu_floor_us`): every byte each step reads and writes at
# HBM_BYTES_PER_US, or a matmul's, convolution's or attention's multiply-adds at the tensor cores'
# peak, whichever is longer. Why (measured on an H100, benchmarks/diagnostics/graph_choice.py):
# the 50 KernelBench-style problems (2-11 steps, 0.1-0.7 ms of GPU time) all ran faster step by
# step, where the graph's input and output copies cost more than the launches it hides; models
# of a hundred steps and more (ViT-B/16, BERT) ran up to 1.8x faster as a graph, because an ATen
# call through the runtime costs tens of microseconds.
# Measured on an H100, the constants underestimate the CPU time (as the floor does the GPU time),
# yet the rule chose the faster way for all 55 programs timed both ways, and a larger LAUNCH_US
# sends one of them the wrong way. A step whose module launches several kernels counts each
# (a kernel family's launcher may start several: a row of such steps is one graph).
LAUNCH_US = 5.0  # CPU time of one Triton launch through its bound launcher
EXTERN_US = 40.0  # CPU time of one ATen call (dispatch, allocation, settling the strides)
COPY_BYTES_PER_US = 2.0e6  # input + output bytes copied per microsecond (201 MB in 98 us, H200)
HBM_BYTES_PER_US = 3.0e6  # bytes a memory-bound kernel streams per microsecond (H100 ~2.8-3.0e6)
# multiply-adds x 2 per microsecond at the tensor cores' dense peak (H100/H200 SXM): a floor
FLOPS_PER_US = {torch.float16: 990e6, torch.bfloat16: 990e6, "tf32": 495e6, torch.float32: 67e6}


def graph_blocker(program: Program, gm: fx.GraphModule, n_inputs: int,
                  n_static: int = 0) -> str | None:
    """Why this program is not replayed as one CUDA graph, or None if it is.

    A captured graph replays fixed addresses: every input is read from a buffer we own (or from a
    parameter that stays put), every output comes out of the graph's own memory. So a program
    that writes into a user's input (writing into a parameter or buffer is fine), returns an input (or a view of one), or runs anything on the CPU
    is launched step by step instead; and so is one whose launches already hide behind the
    GPU's own time, where the input and output copies would only add to it (the note above). `n_static`: the leading inputs that are
    parameters and buffers, which the graph reads in place.
    """
    devices = {n.meta["fusec"].device for n in gm.graph.nodes
               if isinstance(n.meta.get("fusec"), TensorMeta)}
    if any(not d.startswith("cuda") for d in devices) or len(devices) != 1:
        return f"not all on one CUDA device ({', '.join(sorted(devices))})"
    inputs = set(program.input_slots) | {s for s, _ in program.constants}
    static = set(program.input_slots[:n_static])
    for step in program.steps:
        if isinstance(step, ExternStep) and getattr(step.target, "_schema", None) is not None \
                and step.target._schema.is_mutable and not _writes_only(step, static):
            return f"{step.name} writes into a tensor in place"
        if isinstance(step, KernelStep) and any(w.inplace in set(program.input_slots) - static
                                                for w in step.writes):
            # (a kernel writing one position of a caller's tensor: the graph would write its copy)
            return f"{step.name} writes into a tensor in place"
        if isinstance(step, ViewStep) and step.root in inputs and step.out_slot in program.output_slots:
            return "an output is a view of an input"
    if any(s in inputs for s in program.output_slots):
        return "an output is an input"
    for step in program.steps:
        if draws_random_numbers(step):
            return f"{step.name} draws random numbers (a replay would not follow torch.manual_seed)"
    if sum(isinstance(s, (KernelStep, ExternStep)) for s in program.steps) < 2:
        return "a single launch: a graph would only add the copy of the inputs"
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    copied = sum(_bytes(n) for n in placeholders[n_static:]) \
        + sum(_bytes(n) for n in gm.graph.output_node().all_input_nodes)
    copied = hint(copied)  # (a shape family's: estimated at the traced sizes, unguarded)
    copy_us, gpu_us = copied / COPY_BYTES_PER_US, hint(gpu_floor_us(program, gm))
    kernels, externs, cpu_us = cpu_estimate(program)
    if cpu_us <= gpu_us + copy_us:
        return (f"its {kernels} launches and {externs} ATen calls (~{cpu_us:.0f} us of CPU) hide "
                f"behind the GPU's own ~{gpu_us:.0f} us or more, and a graph would add "
                f"~{copy_us:.0f} us copying {copied / 1e6:.1f} MB of inputs and outputs")
    return None


def cpu_estimate(program: Program) -> tuple[int, int, float]:
    """(launches, ATen calls, microseconds): the CPU work of one run of `program` step by step,
    LAUNCH_US per Triton launch and EXTERN_US per ATen call. A kernel step whose module launches
    more than one kernel or allocates (a split-K matmul of a kernel family: two kernels and its
    partial sums) says how many launches its CPU work is worth (its launcher's `cpu_launches`)."""
    launches = sum(getattr(s.launcher, "cpu_launches", 1) for s in program.steps
                   if isinstance(s, KernelStep))
    externs = sum(isinstance(s, ExternStep) for s in program.steps)
    return launches, externs, launches * LAUNCH_US + externs * EXTERN_US


def gpu_floor_us(program: Program, gm: fx.GraphModule) -> float:
    """A floor under the GPU's time for one run of `program`: for each step, the bytes it reads
    and writes streamed at HBM_BYTES_PER_US, or for a matmul, convolution or attention its
    arithmetic at FLOPS_PER_US, whichever takes longer (views and item picks cost nothing)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    slot_nodes = [nodes.get(name) for name in getattr(program, "slot_names", [])]

    def slot_bytes(slot: int) -> int:
        node = slot_nodes[slot] if slot < len(slot_nodes) else None
        return _bytes(node) if node is not None else 0
    total = 0.0
    for step in program.steps:
        if isinstance(step, KernelStep):
            moved = sum(slot_bytes(s) for s in step.reads) + sum(
                math.prod(w.shape) * w.dtype.itemsize for w in step.writes)
            total += moved / HBM_BYTES_PER_US
        elif isinstance(step, ExternStep):
            refs: list = []
            fx.node.map_aggregate((step.args, step.kwargs),
                                  lambda a: refs.append(a) if isinstance(a, SlotRef) else a)
            moved = sum(slot_bytes(r.slot) for r in refs) + slot_bytes(step.out_slot)
            shapes = [_meta(slot_nodes[r.slot]) for r in refs if r.slot < len(slot_nodes)]
            out = _meta(slot_nodes[step.out_slot]) if step.out_slot < len(slot_nodes) else None
            # (an estimate: a shape family's at the sizes it was traced with, unguarded)
            total += max(hint(moved) / HBM_BYTES_PER_US, hint(_flops_us(step, shapes, out)))
    return hint(total)


def _meta(node) -> TensorMeta | None:
    m = node.meta.get("fusec") if node is not None else None
    return m if isinstance(m, TensorMeta) else None


_MATMULS = {"aten.mm.default": 0, "aten.addmm.default": 1, "aten.bmm.default": 0,
            "aten.baddbmm.default": 1}


def _flops_us(step: ExternStep, tensors: list, out: TensorMeta | None) -> float:
    """The multiply-adds of a matmul, convolution or attention call at the tensor cores' peak, in
    microseconds (0 for any other call). `tensors`: the metas of its tensor arguments, in order."""
    name = str(step.target)
    if out is None or None in tensors or not tensors:
        return 0.0
    if name in _MATMULS and len(tensors) > _MATMULS[name]:
        flops = 2 * math.prod(out.shape) * tensors[_MATMULS[name]].shape[-1]
        tf32 = torch.backends.cuda.matmul.allow_tf32
    elif name == "aten.convolution.default" and len(tensors) >= 2:
        weight, transposed = tensors[1], bool(step.args[6]) if len(step.args) > 6 else False
        per_output = math.prod(weight.shape) // max(weight.shape[0], 1)
        flops = 2 * math.prod((tensors[0] if transposed else out).shape) * per_output
        tf32 = torch.backends.cudnn.allow_tf32
    elif "scaled_dot_product" in name and len(tensors) >= 2:
        q, k = tensors[0], tensors[1]
        flops = 4 * math.prod(q.shape) * k.shape[-2] if len(k.shape) >= 2 else 0
        tf32 = True
    else:
        return 0.0
    key = "tf32" if out.dtype == torch.float32 and tf32 else out.dtype
    return flops / FLOPS_PER_US.get(key, FLOPS_PER_US[torch.float32])


def _writes_only(step: ExternStep, slots: set) -> bool:
    """Does the in-place `step` write only into tensors in `slots`? A graph may write into a
    parameter or buffer (passes/reinplace.py: a KV cache updated in place), since it reads those
    where they live; not into a user's input, of which it holds a copy."""
    refs = _written_refs(step)
    return bool(refs) and all(getattr(r, "slot", None) in slots for r in refs)


def _written_refs(step: ExternStep) -> list:
    schema = getattr(step.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    written = [i for i, a in enumerate(schema.arguments)
               if a.alias_info is not None and a.alias_info.is_write]
    return [step.args[i] if i < len(step.args) else None for i in written]


def written_inputs(program: Program) -> list[int]:
    """The positions, among the program's inputs, of those its steps write in place."""
    where = {slot: i for i, slot in enumerate(program.input_slots)}
    kernels = {where[w.inplace] for step in program.steps if isinstance(step, KernelStep)
               for w in step.writes if w.inplace in where}  # indexed writes (a KV cache)
    return sorted(kernels | {where[r.slot] for step in program.steps if isinstance(step, ExternStep)
                             for r in _written_refs(step) if getattr(r, "slot", None) in where})


def _bytes(node: fx.Node) -> int:
    m = node.meta.get("fusec")
    if not isinstance(m, TensorMeta):
        return 0
    return math.prod(m.shape) * torch.empty((), dtype=m.dtype).element_size()


def draws_random_numbers(step) -> bool:
    """True for an ATen call that consumes the random generator. torch tags such ops
    `nondeterministic_seeded`; the fused attention kernels (flash, efficient, cuDNN) carry the tag
    because they can apply dropout, but with `dropout_p` 0 (inference, eval mode) they draw
    nothing, and a CUDA graph of a vision transformer must not be refused for it."""
    target = getattr(step, "target", None)
    if torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()):
        return False
    schema = getattr(target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "dropout_p" in names:
        i = names.index("dropout_p")
        p = step.kwargs.get("dropout_p", step.args[i] if i < len(step.args) else
                            schema.arguments[i].default_value)
        return not (isinstance(p, (int, float)) and p == 0)
    return True


_CAPTURE_STREAMS: dict = {}


def capture_stream(device: torch.device) -> "torch.cuda.Stream":
    """The one side stream per device on which every fusec graph warms up and is captured.

    Capture cannot happen on the default stream, but a new stream per graph would cost memory:
    cuBLAS keeps a workspace per (handle, stream), tens of MB on recent GPUs, so each fresh stream
    that runs a matmul adds one. Sharing one stream pays for it once per process.
    """
    key = torch.device(device).index if torch.device(device).index is not None \
        else torch.cuda.current_device()
    if key not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[key] = torch.cuda.Stream(device=key)
    return _CAPTURE_STREAMS[key]


def static_copy(t: torch.Tensor) -> torch.Tensor:
    """A buffer the graph owns for input `t`, with `t`'s strides: the program was compiled for
    them, and reads its inputs through them. (`t.clone()` keeps the strides of a dense tensor
    only: a slice such as `kv[..., 6:]` came back contiguous, and the kernels, which step over
    the slice's gaps, read the wrong elements of it from the second call on.)"""
    return copy_into(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device), t)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst[...] = src for two tensors of the same strides. Along a broadcast dim (stride 0: an
    expanded input) every element is one in memory, so only its first slice is copied."""
    along = tuple(slice(0, 1) if st == 0 and n > 1 else slice(None)
                  for st, n in zip(src.stride(), src.shape))
    dst[along].copy_(src[along])
    return dst


class CudaGraphRunner:
    """Replays a Program as one CUDA graph: one launch instead of one per step.

    Parameters and buffers (the first `n_static` inputs) are read in place; a call that passes a
    parameter at another address needs a new capture (`__call__` returns None). Other inputs are
    copied into buffers the graph owns. Outputs are cloned out of the graph's memory, so the next
    replay cannot overwrite what an earlier call returned.
    """

    def __init__(self, program: Program, inputs: list[torch.Tensor], n_static: int):
        self.program, self.n_static = program, n_static
        self.static = [t if i < n_static else static_copy(t) for i, t in enumerate(inputs)]
        self.static_ptrs = [t.data_ptr() for t in self.static[:n_static]]
        side = capture_stream(next((t.device for t in inputs), torch.device("cuda")))
        side.wait_stream(torch.cuda.current_stream())
        # The warm-up runs the program once more than the caller asked: the parameters and
        # buffers it writes in place (a KV cache) are put back as they were after it, or a
        # program that also reads them would see its own update twice.
        written = written_inputs(program)
        saved = [(self.static[i], self.static[i].clone()) for i in written]
        with torch.cuda.stream(side):  # warm up: cuBLAS handles, allocator, Triton binaries
            program(self.static)
            for tensor, before in saved:
                tensor.copy_(before)
        torch.cuda.current_stream().wait_stream(side)
        del saved
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=side):
            self.outputs = program(self.static)
        # a shape family's program (fusec/runtime/family_pool.py) may drop this size's pool
        # later; the graph writes into it on every replay, so the runner holds on to it
        self.pool_views = program.family_pool.in_use if program.family_pool else None

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor] | None:
        for i in range(self.n_static):
            if inputs[i].data_ptr() != self.static_ptrs[i]:
                return None
        for dst, src in zip(self.static[self.n_static:], inputs[self.n_static:]):
            if dst.data_ptr() != src.data_ptr():
                copy_into(dst, src)
        self.graph.replay()
        return [o.clone() for o in self.outputs]

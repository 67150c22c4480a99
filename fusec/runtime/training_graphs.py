"""CUDA graphs for training: a step's forward and backward programs, each replayed as one graph.

A training step on a GPU runs two fusec programs (capture/training.py): the forward, inside AOT
Autograd's autograd.Function, and the backward, which autograd calls from `loss.backward()`.
Step by step, each kernel launch and each ATen call costs the host tens of microseconds of
Python, and a step of resnet50 makes ~750 of them: the GPU waits for the host (measured on an
H100: 16 ms of device time in a 44 ms step). Replaying each program as one CUDA graph costs one
launch instead.

Inference graphs (runtime/cuda_graphs.py) copy every output out of the graph's memory, so that
the next replay cannot overwrite what a call returned. A forward's outputs are mostly the
activations it saves for the backward, hundreds of megabytes: copying them would cost more than
the launches. So here (the way torch.compile's CUDA-graph trees do it):

* the activations saved for the backward are handed out as they are, in the graph's memory; a
  replay is allowed only once nobody holds the last replay's (autograd lets go of them when the
  backward has run): each one's storage use count is back to what the graph alone holds. A call
  while they are still held (two forwards before one backward, `retain_graph=True`, a saved
  tensor someone kept) runs step by step, into fresh memory, and is right;
* the backward reads those activations where they are: an input that lives in a training
  graph's memory, or a parameter, is read in place (its address is checked at every replay; a
  call with another address runs step by step); other inputs (the batch, the loss's gradient)
  are copied into the graph's own buffers;
* what the caller sees (the loss, buffer updates, the gradients) is copied out, and an output
  that is a view of an input is made again on the caller's input;
* the forward and backward graphs of one program share one memory pool, so the backward's
  temporaries reuse the forward's (the activations stay the forward's).

`training_blocker` says why a program is not replayed (not all on one CUDA device, a write into
an input, random numbers, a shape family, a single launch); at capture, `TrainingGraph` also
declines where the launches it would save hide behind the GPU's own time (runtime/cuda_graphs.py's
note: the same estimate, with the bytes this graph would copy). `fusec.compile(model,
cuda_graphs=False)` turns it off. Where next: fusec/api.py `CompiledFunction._run` calls
`GraphPair.run`; capture/training.py makes one GraphPair per training program.
"""
from __future__ import annotations

import warnings

import torch

from fusec.runtime.cuda_graphs import (COPY_BYTES_PER_US, capture_stream, copy_into, cpu_estimate,
                                       draws_random_numbers, gpu_floor_us, static_copy,
                                       written_inputs)
from fusec.symbolic import hint
from fusec.ir import TensorMeta

# a graph whose in-place inputs moved (a parameter replaced, `model.to()`) this many calls in a
# row is captured again; a miss because a last replay's activation is still held never is
RECAPTURE_AFTER = 3


def training_blocker(compiled) -> str | None:
    """Why the training program `compiled` (a CompiledGraph) is not replayed as a CUDA graph,
    or None if it may be."""
    program, gm = compiled.program, compiled.gm
    if compiled.captured.shape_env is not None:
        return "a shape family (its sizes change from call to call)"
    devices = {n.meta["fusec"].device for n in gm.graph.nodes
               if isinstance(n.meta.get("fusec"), TensorMeta)}
    if any(not d.startswith("cuda") for d in devices) or len(devices) != 1:
        return f"not all on one CUDA device ({', '.join(sorted(devices))})"
    if written_inputs(program):
        return "it writes into an input in place"
    for step in program.steps:
        if draws_random_numbers(step):
            return f"{step.name} draws random numbers (a replay would not follow torch.manual_seed)"
    kernels, externs, _ = cpu_estimate(program)
    if kernels + externs < 2:
        return "a single launch"
    return None


def _use_count(t: torch.Tensor) -> int:
    """How many tensors (and other holders) share `t`'s storage."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class TrainingGraph:
    """One program captured as a CUDA graph for training (the module's docstring).

    `handed`: the positions of the program's outputs handed out uncloned (the saved
    activations). After `__init__`, `worth` is False (with `why`) where the graph would not pay;
    `__call__` returns None, and says why in `missed`, for a call it cannot replay."""

    owned: dict[int, int] = {}  # data_ptr -> byte size of every handed output, over all graphs

    def __init__(self, compiled, inputs: list[torch.Tensor], handed: set[int], pool):
        program = compiled.program
        self.ptrs = {i: t.data_ptr() for i, t in enumerate(inputs)
                     if isinstance(t, torch.nn.Parameter) or t.data_ptr() in self.owned}
        self.static = [t if i in self.ptrs else static_copy(t) for i, t in enumerate(inputs)]
        side = capture_stream(inputs[0].device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up on the capture stream (cuBLAS, allocator)
            sizes = [t.numel() * t.element_size() for t in program(self.static)]
        torch.cuda.current_stream().wait_stream(side)
        copied = sum(t.numel() * t.element_size() for i, t in enumerate(inputs) if i not in self.ptrs)
        copy_us = (copied + sum(b for j, b in enumerate(sizes) if j not in handed)) / COPY_BYTES_PER_US
        kernels, externs, cpu_us = cpu_estimate(program)
        gpu_us = hint(gpu_floor_us(program, compiled.gm))
        self.worth = cpu_us > gpu_us + copy_us
        self.why = (f"its {kernels} launches and {externs} ATen calls (~{cpu_us:.0f} us of CPU) "
                    f"hide behind the GPU's own ~{gpu_us:.0f} us or more, and a graph would add "
                    f"~{copy_us:.0f} us of copies")
        if not self.worth:
            return
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, stream=side, capture_error_mode="thread_local"):
            self.outputs = program(self.static)
        self.pool_views = program.family_pool.in_use if program.family_pool else None
        self.replays, self.missed = 0, None
        self._sort_outputs(handed)

    def _sort_outputs(self, handed: set[int]) -> None:
        """Each output: a view of input i (made again on the caller's input), handed out as it is
        (with the use count of its storage when only this graph holds it), or cloned."""
        storages = {t.untyped_storage().data_ptr(): i for i, t in enumerate(self.static)}
        self.views, self.handed, self.cloned = {}, {}, []
        for j, out in enumerate(self.outputs):
            i = storages.get(out.untyped_storage().data_ptr())
            if i is not None:
                self.views[j] = (i, tuple(out.shape), tuple(out.stride()),
                                 out.storage_offset() - self.static[i].storage_offset())
            elif j in handed:
                self.handed[j] = None
            else:
                self.cloned.append(j)
        for j in self.handed:
            self.handed[j] = _use_count(self.outputs[j])
            out = self.outputs[j]
            TrainingGraph.owned[out.data_ptr()] = out.numel() * out.element_size()

    def release(self) -> None:
        """Forget this graph's outputs as places other graphs read in place."""
        for j in getattr(self, "handed", ()):
            TrainingGraph.owned.pop(self.outputs[j].data_ptr(), None)

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor] | None:
        for i, ptr in self.ptrs.items():
            if inputs[i].data_ptr() != ptr:
                self.missed = "moved"
                return None
        for j, count in self.handed.items():
            if _use_count(self.outputs[j]) > count:
                self.missed = "held"  # the last replay's activation is still in use
                return None
        for i, dst in enumerate(self.static):
            src = inputs[i]
            if i not in self.ptrs and dst.data_ptr() != src.data_ptr():
                copy_into(dst, src)
        self.graph.replay()
        self.replays += 1
        result = list(self.outputs)
        for j in self.cloned:
            result[j] = self.outputs[j].clone()
        for j in self.handed:
            result[j] = self.outputs[j].detach()  # (a tensor of its own over the same memory)
        for j, (i, shape, stride, offset) in self.views.items():
            x = inputs[i]
            result[j] = x.as_strided(shape, stride, x.storage_offset() + offset)
        return result


class GraphPair:
    """The forward and backward programs of one training program: their shared memory pool, and
    per program (a CompiledGraph) its graph and why it has none."""

    def __init__(self):
        self.pool = None

    def run(self, compiled, tensors: list, handed_from: int | None) -> list:
        """Run `compiled`'s program on `tensors`: step by step on its first call, captured on
        its second, replayed after; step by step wherever the graph cannot replay (the module's
        docstring). `handed_from`: the first of the graph's outputs that are saved activations
        (the forward's; None for a backward, whose outputs are all copied out)."""
        state = compiled.__dict__
        if "training_graph_blocker" not in state:
            state["training_graph_blocker"] = training_blocker(compiled)
            state["training_graph"], state["training_misses"] = None, 0
        if state["training_graph_blocker"] is not None:
            return compiled.program(tensors)
        graph = state["training_graph"]
        if graph is not None:
            out = graph(tensors)
            if out is not None:
                state["training_misses"] = 0
                return out
            if graph.missed == "moved":
                state["training_misses"] += 1
            if state["training_misses"] < RECAPTURE_AFTER:
                return compiled.program(tensors)
            graph.release()
            state["training_graph"], state["training_misses"] = None, 0
        compiled.calls += 1
        if compiled.calls < 2:
            return compiled.program(tensors)
        return self._capture(compiled, tensors, handed_from)

    def _capture(self, compiled, tensors: list, handed_from: int | None) -> list:
        state = compiled.__dict__
        program = compiled.program
        handed = set() if handed_from is None else set(range(program_position(compiled, handed_from),
                                                              len(program.output_slots)))
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        try:
            graph = TrainingGraph(compiled, tensors, handed, self.pool)
        except Exception as err:  # noqa: BLE001 - a capture that fails leaves the program as it was
            state["training_graph_blocker"] = f"its capture failed: {type(err).__name__}: {err}"
            warnings.warn(f"fusec: a training program runs step by step: "
                          f"{state['training_graph_blocker']}", stacklevel=2)
            return compiled.program(tensors)
        if not graph.worth:
            state["training_graph_blocker"] = graph.why
            return compiled.program(tensors)
        state["training_graph"] = graph
        out = graph(tensors)
        return out if out is not None else compiled.program(tensors)


def program_position(compiled, k: int) -> int:
    """The position among the program's outputs of the graph's output `k`, or of the first
    program output after it: outputs that are constants (None, a number) are not the program's
    (fusec/fastpath.py `complete` inserts them); an input returned as it is keeps its place."""
    return sum(1 for m in range(k) if m not in compiled.captured.output_constants)

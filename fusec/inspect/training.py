"""Training: what the forward saves for the backward, what the backward recomputes, and the
peak memory of a step.

AOT Autograd's partitioner (fusec/capture/training.py) decides, per training program, which
forward values cross to the backward and which the backward recomputes; it records that as a
`Partition`. This module reads those records and shows them:

    cm = fusec.compile(model)
    cm(x).sum().backward()                 # compiles the forward and backward programs
    print(fusec.explain(cm, x))            # ... "=== training: saved for backward ===" section
    print(fusec.explain(torch_compiled))   # the same, region by region, for torch.compile
    saved_for_backward(cm)                 # [(label, Partition, forward, backward)] as data
    peak_memory(lambda: cm(x).sum().backward(), cm)   # the peak of a step, and how it was found

The section lists every saved tensor (name, the op that made it, shape, dtype, bytes, the user's
line), the bytes the default partition would have saved, and the forward ops the backward
recomputes. Forward inputs (parameters, the batch) and views of them are listed but not counted
as saved bytes: they are alive for the whole step anyway (their bytes show in parentheses), nor
are views of a saved value (they share its memory).

Peak memory is measured where it can be and estimated where it cannot, and `Peak.how` says which:
on CUDA, `torch.cuda.max_memory_allocated` around one step; on the CPU (no allocator statistics),
the saved tensors plus the larger of the forward's and the backward's transient bytes (the
intermediate pool of fusec's memory plan, `record.MemoryPlan`, and the results), above the
inputs and parameters. Extern calls' results are allocated by ATen outside the plan and are not
in the estimate.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

from fusec.capture.partition import Partition


def saved_for_backward(compiled) -> list[tuple]:
    """(label, Partition, forward CompiledGraph or None, backward CompiledGraph or None) for every
    training program `compiled` made: a fusec.compile'd function or module (its last training
    signature), one that ran in regions, a `torch.compile(..., backend="fusec")` object or a
    Regions collector (every region that was partitioned)."""
    from fusec.api import CompiledFunction, CompiledModule, regions as regions_of
    from fusec.capture.regions import Regions
    if isinstance(compiled, CompiledModule):
        compiled = compiled._compiled
    if isinstance(compiled, CompiledFunction) and compiled.breaks is None:
        return _entries("training program", compiled.train_parts)
    if not isinstance(compiled, Regions):
        try:
            compiled = regions_of(compiled)
        except Exception:  # not compiled by fusec, or captured whole without training
            return []
    out = []
    for region in compiled.regions:
        out += region_entries(region)
    return out


def region_entries(region) -> list[tuple]:
    """`saved_for_backward` of one region (fusec/capture/regions.py)."""
    return _entries(f"region {region.index}", region.parts)


def _entries(label: str, parts) -> list[tuple]:
    partitions = list(getattr(parts, "partitions", ()))
    if not partitions:
        return []
    graphs = [getattr(p, "last", None) for p in parts]
    if len(partitions) == 1:  # one joint graph: its forward and backward are parts 0 and 1
        return [(label, partitions[0], *(graphs + [None, None])[:2])]
    return [(f"{label}, graph {i}", p, None, None) for i, p in enumerate(partitions, 1)]


@dataclass
class Peak:
    """The peak memory of a training step, in bytes, and how it was found."""

    bytes: int
    how: str

    def __str__(self) -> str:
        return f"{_size(self.bytes)} ({self.how})"


def estimated_peak(partition: Partition, forward, backward) -> int | None:
    """Bytes a step holds at its peak above its inputs and parameters, from the partition and
    the memory plans of the forward and backward programs (None until both were compiled):
    the forward holds its pool, its results and the saved tensors; the backward holds the saved
    tensors, its pool and the gradients it returns."""
    if forward is None or backward is None:
        return None
    saved = partition.saved_bytes
    during_forward = forward.memory.pool_bytes + partition.forward_out_bytes + saved
    during_backward = saved + backward.memory.pool_bytes + partition.backward_out_bytes
    return max(during_forward, during_backward)


def peak_memory(step: Callable[[], object], compiled=None, device=None) -> Peak:
    """Run `step()` (forward, backward, and whatever else it does) once and return its peak.

    `device`: where the step runs (default: CUDA if CUDA is in use in this process, else CPU).
    On CUDA: measured, `torch.cuda.max_memory_allocated` during the step minus what was allocated
    before it. Otherwise: estimated (`estimated_peak`) from what `compiled` (the fusec.compile'd
    model the step trains, or a torch.compile(..., backend="fusec") object) recorded, summed
    over its training programs' saved tensors plus the largest transient of any one of them."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu"
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return Peak(torch.cuda.max_memory_allocated() - before,
                    "measured: torch.cuda.max_memory_allocated during the step, above what was "
                    "allocated before it")
    step()
    if compiled is None:
        raise ValueError("fusec: on the CPU the peak is estimated from the compiled programs: "
                         "pass the fusec-compiled object the step trains")
    entries = saved_for_backward(compiled)
    peaks = [estimated_peak(p, fw, bw) for _, p, fw, bw in entries]
    if not entries or any(p is None for p in peaks):
        raise ValueError("fusec: no training program with a compiled forward and backward was "
                         "found: the step must run a backward through the compiled object")
    saved = sum(p.saved_bytes for _, p, _, _ in entries)
    transient = max(peak - p.saved_bytes for peak, (_, p, _, _) in zip(peaks, entries))
    return Peak(saved + transient,
                "estimated: saved tensors + the largest forward or backward transient (fusec's "
                "memory plan pools and results), above inputs and parameters; extern results "
                "not counted")


# ---- explain's section -------------------------------------------------------------------------


def training_section(entries: list, walk_note: bool = False) -> list[str]:
    """The "=== training: saved for backward ===" lines of `fusec.explain`, one section per
    entry of `saved_for_backward` (nothing for a program that has not run a training step).
    `walk_note`: say that explain's walk that follows is the program captured without autograd."""
    out = []
    for label, partition, forward, backward in entries:
        out.append(f"\n=== training: saved for backward ({label}, "
                   f"{_partitioner_words(partition)}) ===")
        out += format_partition(partition)
        peak = estimated_peak(partition, forward, backward)
        if peak is not None:
            out.append(f"estimated peak of a step above inputs and parameters: {_size(peak)} "
                       "(saved + the larger of the forward's and backward's memory-plan pool "
                       "and results; peak_memory() measures it on CUDA)")
        out += graph_lines(forward, backward)
        if walk_note:
            out.append("(the walk below is the program as explain captures it, without "
                       "autograd: the forward's kernels without the saving)")
    return out


def graph_lines(forward, backward) -> list[str]:
    """Whether the forward and the backward replay as CUDA graphs (fusec/runtime/training_graphs.py):
    how often, or why not; nothing for programs that have not decided (on a CPU, or before
    their second call)."""
    out = []
    for name, part in (("forward", forward), ("backward", backward)):
        state = part.__dict__ if part is not None else {}
        graph, why = state.get("training_graph"), state.get("training_graph_blocker")
        if graph is not None:
            out.append(f"{name}: one CUDA graph, replayed {graph.replays} time(s) "
                       f"({len(graph.ptrs)} inputs read in place, {len(graph.handed)} "
                       f"activations handed to the backward in the graph's memory)")
        elif why:
            out.append(f"{name}: launched step by step, not a CUDA graph: {why}")
    return out


def training_dicts(entries: list) -> list[dict]:
    """`saved_for_backward`'s entries as plain data (explain's to_dict)."""
    return [{"label": label, **p.to_dict(), "estimated_peak": estimated_peak(p, fw, bw)}
            for label, p, fw, bw in entries]


def format_partition(p: Partition) -> list[str]:
    """The saved tensors as a table, the default partition's bytes, the recomputed ops."""
    activations = [s for s in p.saved if s.counted]
    inputs = [s for s in p.saved if s.is_input]
    out = [f"saved: {len(activations)} tensor(s), {_size(p.saved_bytes)}"
           + (f"; and {len(inputs)} input(s) or views of them, alive anyway "
              f"({_size(sum(s.nbytes for s in inputs))})" if inputs else "")]
    if p.partitioner != "default":
        less = p.default_bytes - p.saved_bytes
        share = f" ({100 * less / p.default_bytes:.0f}% less)" if p.default_bytes and less else ""
        out.append(f"the default partition would save "
                   f"{sum(s.counted for s in p.default_saved)} tensor(s), "
                   f"{_size(p.default_bytes)}: {_size(less)} saved by recomputing{share}")
    rows = [("name", "made by", "shape", "dtype", "bytes", "line")]
    for s in p.saved:
        made = s.view or s.op
        rows.append((s.name, made, "x".join(map(str, s.shape)) or "scalar",
                     str(s.dtype).replace("torch.", ""), str(s.nbytes) if s.counted
                     else f"({s.nbytes})", s.line))
    if not any(s.line for s in p.saved):  # (fusec.compile's joint graph has no source lines)
        rows = [r[:-1] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    if p.partitioner == "default":
        out.append("recomputed in the backward: nothing (FUSEC_REMAT=0: AOT Autograd's default "
                   "partition saves every forward value the backward reads)")
    else:
        out.append(f"recomputed in the backward: {_ops(p.recomputed)}")
        if p.moved:
            out.append(f"run only in the backward (the forward's results do not need them): "
                       f"{_ops(p.moved)}")
    return out


def _partitioner_words(p: Partition) -> str:
    return ("min-cut partitioner" if p.partitioner == "min-cut"
            else "default partition, FUSEC_REMAT=0")


def _ops(pairs: list) -> str:
    if not pairs:
        return "nothing"
    counts = Counter(op for _, op in pairs)
    return f"{len(pairs)} op(s): " + ", ".join(
        f"{op} x{n}" if n > 1 else op for op, n in counts.items())


def _size(nbytes: int) -> str:
    if nbytes < 1 << 20:
        return f"{nbytes} bytes"
    if nbytes < 1 << 30:
        return f"{nbytes / (1 << 20):.1f} MiB"
    return f"{nbytes / (1 << 30):.2f} GiB"


__all__ = ["Peak", "estimated_peak", "format_partition", "peak_memory", "region_entries",
           "saved_for_backward", "training_dicts", "training_section"]

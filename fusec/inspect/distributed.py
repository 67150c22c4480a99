"""One training step on one rank, under DDP or FSDP2: fusec's programs and the collectives between.

Under torch.distributed, the processes exchange data at fixed points around the compiled programs,
and it is torch.distributed that does it, not fusec's kernels:

    DistributedDataParallel   the forward broadcasts rank 0's buffers (batch norm's running
                              statistics; `broadcast_buffers=True`, the default); in the backward,
                              each *bucket* of gradients (25 MB by default, the first one
                              smaller; the parameters in about the reverse order of their use)
                              is all-reduced as soon as its last gradient is computed, while the
                              rest of the backward goes on.
                              `fusec.compile(DDP(model))` goes through TorchDynamo, whose DDP
                              optimizer splits the graph at the buckets' edges, so that each
                              region's backward completes a bucket; `DDP(fusec.compile(model))`
                              runs one backward program, and the buckets' all-reduces follow it.
    FSDP2 (`fully_shard`)     each sharded unit all-gathers its parameters before its forward
                              (and again before its backward, since it frees them after the
                              forward), and reduce-scatters its gradients after its backward;
                              the root unit (the model) does the same for the parameters no
                              block holds (embeddings, the head).

`fusec.explain` and `fusec.profile`, given a model wrapped by DDP or sharded by FSDP2 (or holding
fusec-compiled blocks that are), cannot show this by capturing a graph: the collectives happen in
hooks and in autograd, outside any graph. So they run one real training step (the forward, then
the backward of the output's `loss`, or of the sum of its floating-point tensors) under
torch.profiler on this rank, and list, in the order they started, the compiled programs (AOT
Autograd's `CompiledFunction` ranges: fusec's forward programs, `CompiledFunctionBackward`: its
backward programs) and the collectives (`c10d::` calls), each with the FSDP unit or the DDP
bucket it belongs to. Then the fusec programs of the model: each one's kernels. Every rank must
make the same call (the step's collectives wait for the other ranks); the gradients the step
computes are thrown away, the parameters' `.grad` put back as they were.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

# a c10d call's name -> what it does (its name in the table)
COLLECTIVES = {"allreduce": "all-reduce", "allgather": "all-gather",
               "all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
               "broadcast": "broadcast", "all_to_all": "all-to-all", "barrier": "barrier"}
_UNIT = re.compile(r"^FSDP::(pre_forward|pre_backward|post_backward_reduce|all_gather)"
                   r"(?: \((.*)\))?$")


def is_distributed(model) -> bool:
    """Is `model` (or what fusec.compile wrapped) a DDP or FSDP module, or does it hold one?"""
    from fusec.api import CompiledModule, is_fsdp  # (inspect reads the core)
    inner = model._orig_mod if isinstance(model, CompiledModule) else model
    if not isinstance(inner, torch.nn.Module):
        return False
    return any(isinstance(m, torch.nn.parallel.DistributedDataParallel) or is_fsdp(m)
               for m in inner.modules())


@dataclass
class Event:
    """One row of the step: a compiled program or a collective, as the profiler saw it."""

    start_ms: float  # from the step's first event
    ms: float  # its CPU time on the thread that ran it (a collective: the call, not the transfer)
    kind: str  # "forward program", "backward program", "all-reduce", "all-gather", ...
    where: str  # the FSDP unit ("blocks.0", "root") or the DDP bucket ("bucket 0"), or ""
    name: str  # the profiler's name for it

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Program:
    """A fusec-compiled module of the model and the kernels of its last programs."""

    name: str  # its path in the model ("blocks.0"; "" for the model itself)
    how: str  # "one graph" or "N region(s) through TorchDynamo"
    forward: list[str] = field(default_factory=list)  # kernel names
    backward: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class StepTimeline:
    """What `fusec.explain`/`fusec.profile` return for a distributed model (see the module doc).
    `str()` is the table; `times=True` (profile's) adds each row's start and CPU time."""

    rank: int
    world_size: int
    backend: str
    label: str
    events: list[Event]
    programs: list[Program]
    times: bool = False

    def collectives(self) -> list[Event]:
        return [e for e in self.events if "program" not in e.kind]

    def to_dict(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "backend": self.backend,
                "label": self.label, "events": [e.to_dict() for e in self.events],
                "programs": [p.to_dict() for p in self.programs]}

    def __str__(self) -> str:
        out = [f"fusec {'profile' if self.times else 'explain'} (distributed): {self.label}, "
               f"rank {self.rank} of {self.world_size} ({self.backend}), one training step",
               "fusec's programs and torch.distributed's collectives, in the order they started:"]
        head = f"{'start ms':>9}  {'cpu ms':>7}  " if self.times else ""
        out.append(f"  {head}{'what':<17} where")
        for e in self.events:
            cells = f"{e.start_ms:9.2f}  {e.ms:7.2f}  " if self.times else ""
            out.append(f"  {cells}{e.kind:<17} {e.where}".rstrip())
        out.append("fusec's programs (kernels of the last forward and backward):")
        if not self.programs:
            out.append("  none: no module of this model is compiled by fusec")
        for p in self.programs:
            out.append(f"  {p.name or '(the model)'}: {p.how}; forward {len(p.forward)} "
                       f"kernel(s), backward {len(p.backward)} kernel(s)")
            for kind, names in (("forward", p.forward), ("backward", p.backward)):
                if names:
                    out.append(f"    {kind}: " + ", ".join(names))
        return "\n".join(out)

    def _repr_pretty_(self, p, cycle):
        p.text(str(self))


def step_timeline(model, inputs: tuple, kwargs: dict, times: bool = False) -> StepTimeline:
    """Run one training step of `model(*inputs, **kwargs)` under torch.profiler on this rank
    and say what ran (see the module doc)."""
    import torch.distributed as dist
    params = [p for p in model.parameters()]
    # the step's gradients are not the user's: put back each .grad, its values too (DDP copies
    # the reduced gradients into the existing .grad tensors)
    grads = [(p.grad, p.grad.detach().clone() if p.grad is not None else None) for p in params]
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _loss(model(*inputs, **kwargs)).backward()
    finally:
        with torch.no_grad():
            for p, (grad, values) in zip(params, grads):
                p.grad = grad
                if grad is not None:
                    grad.copy_(values)
    ready = dist.is_available() and dist.is_initialized()
    return StepTimeline(dist.get_rank() if ready else 0, dist.get_world_size() if ready else 1,
                        str(dist.get_backend()) if ready else "not initialized",
                        _label(model), _events(prof.events()), _programs(model), times)


def _loss(out) -> torch.Tensor:
    """What the step differentiates: the output's `loss`, else the sum of its floating tensors."""
    from fusec.capture import outputs
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, dict) and isinstance(out.get("loss"), torch.Tensor):
        return out["loss"]
    tensors = [t for t in outputs.leaves(out) if isinstance(t, torch.Tensor)
               and t.is_floating_point() and t.requires_grad]
    if not tensors:
        raise ValueError("fusec: the model's output has no tensor that needs gradients, so the "
                         "step has no backward and no gradient collectives to show")
    return sum(t.float().sum() for t in tensors)


def _events(events) -> list[Event]:
    """The profiler's events, in start order, reduced to programs and collectives. A program's
    FSDP unit is the unit whose pre-forward (pre-backward) hook ran last before it; a
    collective's is the FSDP range it was called from; DDP's all-reduces are its buckets, in
    the order DDP launches them."""
    events = sorted(events, key=lambda e: e.time_range.start)
    t0 = events[0].time_range.start if events else 0
    rows, unit, bucket = [], {"forward": "", "backward": ""}, 0
    for e in events:
        name = e.name
        match = _UNIT.match(name)
        if match is not None and match.group(1) in ("pre_forward", "pre_backward"):
            unit[match.group(1)[4:]] = match.group(2) or "root"
        kind, where = None, ""
        if name == "CompiledFunction":
            kind, where = "forward program", unit["forward"]
        elif name == "CompiledFunctionBackward":
            kind, where = "backward program", unit["backward"]
        elif name.startswith("c10d::"):
            op = name[len("c10d::"):].strip("_")
            kind = next((v for k, v in COLLECTIVES.items() if k in op), op)
            inside = [o for o in events if _UNIT.match(o.name) and o.thread == e.thread
                      and o.time_range.start <= e.time_range.start <= o.time_range.end]
            if inside:  # the innermost FSDP range that called it
                where = _UNIT.match(inside[-1].name).group(2) or "root"
            elif kind == "all-reduce":
                where, bucket = f"bucket {bucket}", bucket + 1
        if kind is not None:
            rows.append(Event(round((e.time_range.start - t0) / 1000, 3),
                              round(e.cpu_time_total / 1000, 3), kind, where, name))
    return rows


def _programs(model) -> list[Program]:
    """Every fusec-compiled module in `model` (the model itself included) and its kernels."""
    from fusec.api import CompiledModule
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, CompiledModule):
            continue
        compiled = module._compiled
        if compiled.breaks is not None:  # each region's parts: [forward, backward]
            regions = compiled.breaks.regions.regions
            pairs = [list(r.parts) for r in regions]
            how = f"{len(regions)} region(s) through TorchDynamo"
        else:
            pairs, how = [list(compiled.train_parts)], "one graph"
        forward = [k.name for parts in pairs for p in parts[:1] for k in p.kernels]
        backward = [k.name for parts in pairs for p in parts[1:2] for k in p.kernels]
        found.append(Program(name.replace("._orig_mod", "").removesuffix("_orig_mod"), how,
                             forward, backward))
    return found


def _label(model) -> str:
    """`DistributedDataParallel(SmallCNN)`, `fusec.compile(DistributedDataParallel(...))`."""
    from fusec.api import CompiledModule
    if isinstance(model, CompiledModule):
        return f"fusec.compile({_label(model._orig_mod)})"
    inner = getattr(model, "module", None)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and inner is not None:
        return f"DistributedDataParallel({_label(inner)})"
    name = type(model).__name__
    return name.removeprefix("FSDP") + " (fully_shard)" if name.startswith("FSDP") else name

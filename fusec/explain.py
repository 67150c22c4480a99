"""`fusec.explain(model, *inputs)`: every stage of the pipeline, printable and as a dict.

    print(fusec.explain(f, x))

walks the captured ATen graph, the graph after each pass (with what the pass removed, grouped
and refused), the schedule, and each kernel's source. Nothing is run on the inputs' data: the
program is captured and compiled exactly as `fusec.compile` would.
"""
from __future__ import annotations

from dataclasses import dataclass

from .api import BACKENDS, CompiledGraph, compile_graph, resolve_backend, _prepare_triton
from .frontend import capture


@dataclass
class Explanation:
    compiled: CompiledGraph

    def to_dict(self) -> dict:
        from fusec.passes.schedule import format_schedule
        gm = self.compiled.gm
        return {
            "backend": self.compiled.backend,
            "stages": [{"after": s.after, "graph": s.code} for s in self.compiled.snapshots],
            "removed_by_dce": list(gm.meta.get("fusec_dce", [])),
            "refusals": [vars(r) for r in gm.meta.get("fusec_refusals", [])],
            "kernels": [{"name": k.name, "ops": k.ops, "source": k.source,
                         "shape": list(k.ir.source_shape)} for k in self.compiled.kernels],
            "externs": [s.name for s in gm.meta["fusec_schedule"] if s.kind == "extern"],
            "schedule": format_schedule(gm.meta["fusec_schedule"]),
        }

    def __str__(self) -> str:
        d = self.to_dict()
        out = [f"fusec explain ({d['backend']} backend)"]
        for stage in d["stages"]:
            out.append(f"\n=== graph after {stage['after']} ===\n{stage['graph']}")
            if stage["after"] == "dce":
                out.append(f"dce removed: {', '.join(d['removed_by_dce']) or 'nothing'}")
            if stage["after"] == "fuse_pointwise":
                out.append("fusion refused:" + ("".join(
                    f"\n  {r['producer']} -> {r['consumer']}: {r['reason']}"
                    for r in d["refusals"]) or " nothing"))
        out.append(f"\n=== schedule ===\n{d['schedule']}")
        if d["externs"]:
            out.append("extern (eager ATen) calls: " + ", ".join(d["externs"]))
        for k in d["kernels"]:
            out.append(f"\n=== kernel {k['name']} over {tuple(k['shape'])} ===\n{k['source']}")
        return "\n".join(out)


def explain(model, *inputs, backend: str = "auto", **kwargs) -> Explanation:
    """Capture and compile `model(*inputs, **kwargs)` and return every stage (see module doc).

    `model` may be a plain function or module, or one already wrapped by fusec.compile.
    """
    import torch

    from .api import CompiledFunction, CompiledModule
    if isinstance(model, CompiledModule):
        model = model._orig_mod
    if isinstance(model, CompiledFunction):
        backend = model.backend if backend == "auto" else backend
        model = model.fn
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    chosen = resolve_backend(backend, device)
    if chosen == "triton":
        _prepare_triton(device)
    with torch.no_grad():
        captured = capture(model, inputs, kwargs)
    return Explanation(compile_graph(captured, chosen, record=True))

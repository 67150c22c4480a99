"""`torch.compile(model, backend="fusec")`: fusec as a TorchDynamo backend.

Dynamo captures the Python-level graph (handling control flow with guards and graph breaks) and
hands each graph to `fusec_backend`, which compiles it like any function. The backend is
registered through the `torch_dynamo_backends` entry point in pyproject.toml, so torch finds it
by name without importing fusec first.

Each torch.compile call gets its own `fusec.capture.regions.Regions` collector, so that what fusec made
for it stays reachable from what torch.compile returned:

    opt = torch.compile(model, backend="fusec")   # options={"backend": "cpp"} picks fusec's backend
    opt(x)
    r = fusec.regions(opt)          # every region Dynamo captured, each compiled by fusec
    r.kernels, r.source(), r.schedule, print(r)   # regions, breaks with the user's lines
    fusec.explain(opt, x)           # every stage of every region (compiles afresh, as explain does)
    fusec.profile(opt, x)           # eager vs fused, region by region
"""
from __future__ import annotations

import sys

import torch

from fusec.api import part_compiler
from fusec.capture.regions import Regions


def fusec_backend(gm: torch.fx.GraphModule, example_inputs, **options):
    """Dynamo's graph goes through AOT Autograd, so training works: forward and backward graphs
    are each compiled by fusec (fusec/capture/training.py). The graph is recorded as one region of the
    collector that belongs to the torch.compile call that is compiling it."""
    return _collector(options, sys._getframe(1))(gm, example_inputs)


def _collector(options: dict, caller):
    """The Regions of the torch.compile(...) call whose graph this is.

    torch.compile wraps a backend named by a string in one `torch._TorchCompileWrapper` per
    call, and that wrapper calls us: the collector lives on it (found again from the compiled
    object by `fusec.regions`, through `innermost_backend(...)`). Called any other way (e.g.
    `torch._dynamo.optimize(fusec_backend)`), the regions are compiled but not kept."""
    chosen = dict(options.get("options") or {})  # torch.compile(..., options={"backend": "cpp"})
    backend = chosen.get("backend", options.get("backend", "auto"))
    wrapper = caller.f_locals.get("self") if caller is not None else None
    if type(wrapper).__name__ != "_TorchCompileWrapper":
        return Regions(part_compiler(backend), backend, label="torch.compile program")
    regions = getattr(wrapper, "_fusec_regions", None)
    if regions is None:
        regions = Regions(part_compiler(backend), backend, label="the torch.compile'd program")
        wrapper._fusec_regions = regions
    return regions


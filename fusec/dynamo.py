"""`torch.compile(model, backend="fusec")`: fusec as a TorchDynamo backend.

Dynamo captures the Python-level graph (handling control flow with guards and graph breaks) and
hands each graph to `fusec_backend`, which compiles it like any function. The backend is
registered through the `torch_dynamo_backends` entry point in pyproject.toml, so torch finds it
by name without importing fusec first.
"""
from __future__ import annotations

import torch


def fusec_backend(gm: torch.fx.GraphModule, example_inputs, **options):
    """Dynamo's graph goes through AOT Autograd, so training works: forward and backward graphs
    are each compiled by fusec (fusec/training.py)."""
    from .training import dynamo_backend

    backend, _parts = dynamo_backend(options.get("backend", "auto"))
    return backend(gm, example_inputs)

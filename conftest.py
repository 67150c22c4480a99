"""Shared fixtures. Every test compares fusec against eager PyTorch.

The tests live in two kinds of folder: tests/ (the core) and extensions/<name>/tests/ (each
extension's own). This file sits at the repository root so that pytest loads it for both, and a
test module in either imports its helpers the same way: `from conftest import assert_matches`.
Both folders are put on sys.path here, so a test may also borrow from a test module of the other
folder (`from test_int4_words import Int4`), whichever file pytest happens to collect first.

`target` runs a test once per backend: ("cpp", cpu), ("llvm", cpu) and ("triton", cuda) on a
machine with a GPU, or ("triton", cpu) under Triton's interpreter otherwise (also on a GPU
machine when TRITON_INTERPRET=1 is set). TRITON_INTERPRET must be set before
triton is imported, so it is set here, first thing, when there is no GPU.
"""
import copy
import os
import sys
from pathlib import Path

# Under pytest-xdist, each worker gets its share of the cores as its threads (OpenMP's, torch's
# and the kernels'), unless OMP_NUM_THREADS was chosen: with `-n auto` on a 2-core machine, two
# workers of two threads each made a thread pool wait for a core it had lost (an eager Llama
# fit, one process: 1.7 s alone, 22 s beside another worker). Set before torch is imported (its
# OpenMP runtime reads the variable when it loads, and so does the system's, which the C++
# kernels load). tests/test_parallel_kernels.py runs kernels on several threads in a process
# of its own.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_ROOT = Path(__file__).resolve().parent
for _folder in [_ROOT / "tests", *sorted(_ROOT.glob("extensions/*/tests"))]:
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))

import pytest  # noqa: E402

import fusec  # noqa: E402
from fusec.check import compare  # noqa: E402

# TRITON_INTERPRET=1 on a machine with a GPU (the README's test line, run there) still means
# "Triton on the CPU": the interpreter cannot launch on CUDA tensors or inside a CUDA graph
GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
TRITON_DEVICE = "cuda" if GPU else "cpu"


CPU_BACKENDS = ["cpp", "llvm"]  # the backends that compile kernels for CPU tensors


@pytest.fixture(params=["cpp", "llvm", "triton"])
def target(request):
    """(backend, device) pairs: every test runs on every backend."""
    if request.param in CPU_BACKENDS:
        return request.param, "cpu"
    return "triton", TRITON_DEVICE


def assert_matches(fn, *inputs, backend: str, kernels: int | None = None, **kwargs):
    """Compile fn, run it, compare every output with eager (float64-referenced; exact for ints).

    Returns the compiled function so a test can look at its kernels.
    """
    compiled = fusec.compile(fn, backend=backend, **kwargs)
    got = compiled(*inputs)
    with torch.no_grad():
        want = fn(*inputs)
    got_leaves = torch.utils._pytree.tree_leaves(got)
    want_leaves = torch.utils._pytree.tree_leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        ref = _float64_reference(fn, inputs, i)
        problem = compare(g.cpu(), w.cpu(), None if ref is None else ref.cpu())
        assert problem is None, f"output {i}: {problem}\nkernels:\n" + \
            "\n".join(k.source for k in compiled.kernels)
    if kernels is not None:
        assert len(compiled.kernels) == kernels, [k.name for k in compiled.kernels]
    return compiled


def _float64_reference(fn, inputs, i):
    wide = [t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            for t in inputs]
    if isinstance(fn, torch.nn.Module):  # its half-precision weights and scales too (exactly)
        fn = copy.deepcopy(fn).double()
    try:
        with torch.no_grad():
            out = torch.utils._pytree.tree_leaves(fn(*wide))
        return out[i]
    except Exception:
        return None


@pytest.fixture
def pools_here(monkeypatch):
    """Switch passes/pooling.py's rewrite on for the CPU too (it is for GPUs: POOL_DEVICES), so
    every backend runs the rewritten graphs against eager."""
    import importlib
    pooling = importlib.import_module("fusec.passes.pooling")
    monkeypatch.setattr(pooling, "POOL_DEVICES", ("cpu", "cuda"))


def values_with_specials(*shape, dtype=torch.float32, special=False):
    """Seeded normal values times 3, with NaN, +inf, -inf and NaN again at spread positions when
    `special`, converted to `dtype`."""
    torch.manual_seed(0)
    x = torch.randn(*shape) * 3
    if special:
        flat = x.view(-1)
        for i, v in enumerate([float("nan"), float("inf"), -float("inf"), float("nan")]):
            flat[(i * 53 + 5) % flat.numel()] = v
    return x.to(dtype)

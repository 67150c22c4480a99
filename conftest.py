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
import math
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
def fresh(tmp_path, monkeypatch):
    """A cache of its own for the test (returned: its root folder), saved programs off unless
    the test turns them on: every kernel is rendered and built again."""
    root = tmp_path / "cache"
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(root))
    monkeypatch.setenv("FUSEC_SAVED_PROGRAMS", "0")
    return root


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


# Note (the default run thins large parameter matrices). A test function with many parametrized
# cases (backends x ops x dims x keepdim...) runs, by default, a subset that still has every value
# of every parameter at least once (each op, each dim, each backend, each dtype) and, up to
# THIN_SHARE of the cases, the combinations that add the most pairs of values not yet seen
# together (a greedy pairwise cover). The rest are deselected, and pytest's summary counts them
# ("N deselected"). On the 2-core machine the CI runs on, the full matrix took longer than the CI's
# 90 minutes. `FUSEC_TESTS=all pytest` runs every case; a run that selects by name or node id
# (-k, as benchmarks/gpu_session.sh does, or a path with ::) is never thinned.
THIN_ABOVE = 3  # cases of one function before thinning starts
THIN_SHARE = 0.25  # the share of a thinned function's cases that runs (at least)

# The longest tests, which the default run leaves to the full one (`FUSEC_TESTS=all`), each
# covered in the default run by a shorter test of the same thing: the transformers models
# beyond tests/models/test_hf_models.py's (its GPT-2, Llama, BERT, ViT... stay), two-process
# DDP/FSDP2 training (tests/test_dynamic_training.py and test_optimizer_step.py train in one
# process), code generation for the CPU families beyond baseline x86-64, AVX2 (haswell) and
# AVX-512 with FP16 and BF16 (sapphirerapids) and GPT-2's rematerialization (the smaller blocks
# of tests/test_remat.py stay). On this project's 2-core CPU they took about a quarter of the
# suite's time.
FULL_RUN_ONLY = ("tests/models/test_hf_more_models.py::", "tests/test_distributed.py::",
                 "tests/test_targets.py::test_llvm_emits_every_kernel_for[znver4]",
                 "tests/test_targets.py::test_llvm_emits_every_kernel_for[skylake-avx512]",
                 "tests/test_targets.py::test_llvm_emits_every_kernel_for[aarch64]",
                 "tests/test_targets.py::test_cpp_compiles_every_kernel_for[znver4]",
                 "tests/test_targets.py::test_cpp_compiles_every_kernel_for[skylake-avx512]",
                 "tests/test_targets.py::test_cpp_compiles_every_kernel_for[aarch64]",
                 "tests/test_targets.py::test_cpp_compiles_every_kernel_for[x86-64-no-float16]",
                 "tests/test_remat.py::test_gpt2[")


def _values(item) -> list[tuple[str, object]]:
    """(parameter, value) for each of the case's parameters (a value that cannot be hashed, by
    its repr)."""
    spec = getattr(item, "callspec", None)
    if spec is None:
        return []
    pairs = []
    for name, value in sorted(spec.params.items()):
        try:
            hash(value)
        except TypeError:
            value = repr(value)
        pairs.append((name, value))
    return pairs


def _cover(cases: list) -> list:
    """The cases kept: every single value first, then the best pairwise additions."""
    keep, seen = [], set()
    for case in cases:
        singles = set(_values(case))
        if not singles <= seen:
            keep.append(case)
            seen |= singles
    budget = max(len(keep), math.ceil(len(cases) * THIN_SHARE))

    def pairs(case):
        v = _values(case)
        return {(a, b) for i, a in enumerate(v) for b in v[i + 1:]}
    covered = set().union(*(pairs(c) for c in keep)) if keep else set()
    rest = [c for c in cases if c not in keep]
    while len(keep) < budget and rest:
        best = max(rest, key=lambda c: len(pairs(c) - covered))
        if not pairs(best) - covered:
            break
        keep.append(best)
        covered |= pairs(best)
        rest.remove(best)
    return keep


def pytest_collection_modifyitems(config, items):
    if os.environ.get("FUSEC_TESTS") == "all" or config.getoption("keyword") or \
            any("::" in str(a) for a in config.args):
        return
    groups: dict = {}
    for item in items:
        if not item.nodeid.startswith(FULL_RUN_ONLY):
            groups.setdefault((str(item.path), item.originalname), []).append(item)
    kept = set()
    for cases in groups.values():
        kept.update(id(c) for c in (_cover(cases) if len(cases) > THIN_ABOVE else cases))
    dropped = [item for item in items if id(item) not in kept]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if id(item) in kept]

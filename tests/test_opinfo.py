"""PyTorch's own ops on PyTorch's own samples (OpInfo), through benchmarks/opinfo_sweep.py's
harness: each sample compiled as a one-op program and compared with eager.

The whole sweep (every op, several dtypes) takes minutes and is run by hand (docs/benchmarks.md,
"OpInfo sweep"). These tests keep the ops where it found a wrong result or a crash, next to a
spread of everyday ops, on both CPU backends and (for a shorter list) Triton:

* `view_as_complex` returned float32 (a Layout counted the complex tensor in float elements);
* circular `pad` returned uninitialized memory (its `copy_`s into slices of an `empty` were
  taken for dead out-of-place ops);
* `cosine_similarity` in bfloat16 gave inf (an in-place `clamp_min_` became a promoting
  `clamp_min`);
* `cfloat`, the FFTs: complex values reached a kernel;
* `tensor_split` with tensor indices: an op reading its argument's values crashed capture;
* `broadcast_shapes` returned a tuple where eager returns a torch.Size.
"""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
pytest.importorskip("expecttest")  # torch.testing._internal needs it
import opinfo_sweep  # noqa: E402

from conftest import TRITON_DEVICE  # noqa: E402
from opinfo_samples import op_db, samples as first_samples  # noqa: E402

FOUND = ["view_as_complex", "view_as_real", "nn.functional.pad", "nn.functional.cosine_similarity",
         "cfloat", "fft.fft2", "fft.irfft", "stft", "tensor_split", "broadcast_shapes"]
EVERYDAY = ["add", "mul", "where", "sum", "mean", "amax", "softmax", "log_softmax", "cumsum",
            "nn.functional.gelu", "nn.functional.silu", "nn.functional.layer_norm",
            "nn.functional.group_norm", "nn.functional.conv2d", "nn.functional.linear",
            "nn.functional.embedding", "cat", "stack", "transpose", "index_select", "gather",
            "masked_fill", "clamp", "pow", "sort", "topk", "argmax", "var_mean", "flip", "roll",
            "tril", "nn.functional.interpolate", "nn.functional.max_pool2d"]


def _ops(names):
    found = [op for op in op_db() if op.name in names]
    assert {op.name for op in found} == set(names), set(names) - {op.name for op in found}
    return found


def _verdicts(op, dtype, backend, device, samples=4):
    out = []
    if dtype not in op.supported_dtypes(device):
        return out
    for sample in first_samples(op, device, dtype, samples):
        verdict, detail = opinfo_sweep.run_sample(op, sample, backend, seconds=120)
        out.append((verdict, detail, opinfo_sweep.describe(sample)))
    return out


# samples per op: the everyday ops' first 2 in bfloat16, whose shapes and arguments float32 runs
# with 2 more (each C++ kernel is a compile of its own; the half-precision loads, stores and
# rounding are per op, not per sample); the ops found wrong, 4 in both
SAMPLES = {("everyday", torch.bfloat16): 2}


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", ["found", "everyday"])
def test_opinfo_samples_match_eager(backend, dtype, group):
    bad = []
    for op in _ops(FOUND if group == "found" else EVERYDAY):
        for verdict, detail, what in _verdicts(op, dtype, backend, "cpu",
                                               samples=SAMPLES.get((group, dtype), 4)):
            if verdict in ("MISMATCH", "CRASH"):
                bad.append(f"{verdict} {op.name} {what}: {detail}")
    assert not bad, "\n".join(bad)


def test_opinfo_samples_match_eager_on_triton():
    bad = []
    for op in _ops(FOUND + ["add", "sum", "softmax", "nn.functional.gelu", "cat", "where"]):
        for verdict, detail, what in _verdicts(op, torch.float32, "triton", TRITON_DEVICE,
                                               samples=2):
            if verdict in ("MISMATCH", "CRASH"):
                bad.append(f"{verdict} {op.name} {what}: {detail}")
    assert not bad, "\n".join(bad)


def test_the_harness_catches_a_wrong_result(monkeypatch):
    """The comparison is not vacuous: a kernel made wrong on purpose is a MISMATCH."""
    import fusec
    real = fusec.compile

    def wrong(fn, **kwargs):
        compiled = real(fn, **kwargs)
        return lambda *a: compiled(*a) * 1.001
    monkeypatch.setattr(fusec, "compile", wrong)
    (op,) = _ops(["mul"])
    verdicts = [v for v, _, _ in _verdicts(op, torch.float32, "cpp", "cpu")]
    assert "MISMATCH" in verdicts, verdicts

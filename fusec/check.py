"""`check=True`: compare every fused result with eager PyTorch, judged the way rounding demands.

Fused kernels keep half-precision values in float32 between ops and may reorder arithmetic, so a
fused result is rarely bit-identical to eager's. Neither is "the truth": the reference is the same
graph run in float64. A fused result passes when it is no further from that reference than
eager's result is, plus the dtype's tolerance:

    |fused - ref| <= |eager - ref| + atol + rtol * |ref|      (elementwise)

Where a result went through many roundings (a model's output), eager is sometimes lucky at an
element; the same rule is then applied to the whole tensor: the root-mean-square and the largest
error may not exceed eager's by more than the tolerance.

Integer and boolean results must match eager exactly, and NaNs must appear in the same places.
"""
from __future__ import annotations

import math

import torch
from torch.utils import _pytree as pytree

from fusec.capture.outputs import leaves
from fusec.errors import MismatchError
from fusec.graphmodule import copy_graph_module

TOLERANCE = {  # (rtol, atol) per dtype: about two units in the last place for half types
    torch.float16: (2e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-12, 1e-12),
}


def float64_reference(gm, inputs: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Run the captured graph in float64: floating inputs upcast, and every floating dtype the
    graph names (casts, fills: `_to_copy(x, dtype=bfloat16)`) replaced by float64, so no step of
    the reference rounds to a narrower type. None if the graph cannot run that way."""

    wide_gm = copy_graph_module(gm)
    for node in wide_gm.graph.nodes:
        dtype = node.kwargs.get("dtype")
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
            node.kwargs = {**node.kwargs, "dtype": torch.float64}
    wide_gm.recompile()
    wide = [t.double() if t.is_floating_point() else t for t in inputs]
    try:
        with torch.no_grad():
            return list(wide_gm(*wide))
    except Exception:
        return None


def compare(fused: torch.Tensor, eager: torch.Tensor, ref: torch.Tensor | None) -> str | None:
    """None if `fused` is acceptable, else a one-line description of the worst error."""
    if fused.shape != eager.shape:
        return f"shape {tuple(fused.shape)} differs from eager's {tuple(eager.shape)}"
    if fused.dtype != eager.dtype:
        return f"dtype {fused.dtype} differs from eager's {eager.dtype}"
    if not fused.is_floating_point():
        bad = fused != eager
        if bad.any():
            i = int(bad.flatten().nonzero()[0])
            return (f"{int(bad.sum())} element(s) differ from eager (first at flat index {i}: "
                    f"{fused.flatten()[i].item()} vs {eager.flatten()[i].item()})")
        return None
    f64, e64 = fused.double(), eager.double()
    nan_f, nan_e = torch.isnan(f64), torch.isnan(e64)
    if (nan_f != nan_e).any():
        return f"NaN in {int((nan_f != nan_e).sum())} place(s) where eager has none (or vice versa)"
    r64 = ref.double() if ref is not None and ref.shape == fused.shape else e64
    rtol, atol = TOLERANCE.get(fused.dtype, (1e-5, 1e-8))
    finite = ~nan_f & torch.isfinite(r64)
    inf_mismatch = (~nan_f & ~torch.isfinite(r64) & (f64 != e64)).any()
    if inf_mismatch:
        return "an infinite value differs from eager"
    err_f = (f64 - r64).abs()[finite]
    err_e = (e64 - r64).abs()[finite]
    allowed = err_e + atol + rtol * r64.abs()[finite]
    bad = err_f > allowed
    if bad.any() and not _aggregate_ok(err_f, err_e, r64.abs()[finite], rtol, atol):
        worst = int(torch.where(bad, err_f - allowed, torch.full_like(err_f, -math.inf)).argmax())
        return (f"max abs error {err_f.max().item():.3g} vs eager's {err_e.max().item():.3g} "
                f"against a float64 reference (worst excess at element {worst})")
    return None


def check_outputs(compiled_fn, compiled, args, kwargs, flat_out) -> None:
    """Raise MismatchError, naming the kernel, when an output of `compiled` (a CompiledGraph run
    by `compiled_fn`) is further from the float64 reference than eager's (see `compare`)."""
    with torch.no_grad():
        eager = leaves(compiled_fn.fn(*args, **kwargs))
    inputs = [*compiled.captured.lifted,
              *(l for l in pytree.tree_leaves((args, kwargs)) if isinstance(l, torch.Tensor))]
    ref = float64_reference(compiled.captured.gm, inputs)
    for i, (f, e) in enumerate(zip(flat_out, eager)):
        problem = compare(f, e, ref[i] if ref is not None and i < len(ref) else None)
        if problem:
            producer = compiled.program.producers.get(compiled.program.output_slots[i])
            if hasattr(producer, "name"):
                who = f"kernel {producer.name} (fusing {', '.join(producer.ops)})"
            else:
                who = f"step {producer}" if producer else "an input passed through"
            raise MismatchError(f"fusec: output {i} from {who} does not match eager: {problem}")


def _aggregate_ok(err_f, err_e, ref_abs, rtol, atol) -> bool:
    """The whole-tensor form of the same rule, for results that went through many roundings
    (a model's output): neither the root-mean-square error nor the largest error may exceed
    eager's by more than the dtype's tolerance. Elementwise, eager is sometimes lucky."""
    scale = ref_abs.max().item() if ref_abs.numel() else 0.0
    rms_f = err_f.pow(2).mean().sqrt().item() if err_f.numel() else 0.0
    rms_e = err_e.pow(2).mean().sqrt().item() if err_e.numel() else 0.0
    max_f = err_f.max().item() if err_f.numel() else 0.0
    max_e = err_e.max().item() if err_e.numel() else 0.0
    return rms_f <= rms_e * (1 + 8 * rtol) + atol and max_f <= max_e + atol + rtol * scale

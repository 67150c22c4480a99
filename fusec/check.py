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
A result that is not a tensor (a number, a string, None, a torch.Size) must equal eager's, and
the results' structure (tuples, lists, dicts and their keys, namedtuples, dataclasses) be eager's.

Random numbers: eager is run from the random-number state the compiled call started from, so a
program that draws them the way eager does (dropout's `bernoulli`, `rand_like`, kept as ATen calls)
is compared like any other. An output that still differs and depends on a random op (a kernel
that draws its own numbers) is not judged: a FusecWarning names the output and the op, and says
it was not compared; the other outputs are. Afterwards the generators are where the compiled call
left them, as if check=True had not run eager at all.
"""
from __future__ import annotations

import math
import warnings

import torch
from torch.utils import _pytree as pytree

from fusec.capture.breaks import innermost
from fusec.capture.outputs import flatten
from fusec.errors import FusecWarning, MismatchError
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


def compare_leaf(fused, eager, ref) -> str | None:
    """`compare` for tensors; any other result (a number, a string, None) must equal eager's."""
    if isinstance(fused, torch.Tensor) and isinstance(eager, torch.Tensor):
        return compare(fused, eager, ref if isinstance(ref, torch.Tensor) else None)
    if isinstance(fused, torch.Tensor) or isinstance(eager, torch.Tensor):
        return f"a {type(fused).__name__} where eager returns a {type(eager).__name__}"
    if type(fused) is float and type(eager) is float and math.isnan(fused) and math.isnan(eager):
        return None
    try:
        same = type(fused) is type(eager) and bool(fused == eager)
    except Exception:  # noqa: BLE001 (a value that cannot say whether it equals another)
        same = fused is eager
    return None if same else f"{fused!r} where eager returns {eager!r}"


def random_ops(gm) -> dict[int, str]:
    """{output index: the random op it depends on} for the graph's outputs computed from random
    numbers (ops tagged `nondeterministic_seeded`: bernoulli, rand, randn_like, native_dropout),
    each op with the user's line that called it where the capture recorded it (check=True does:
    `aten.rand_like.default at model.py:12 (noise = torch.rand_like(x))`)."""
    tainted: dict = {}
    for node in gm.graph.nodes:
        tags = getattr(node.target, "tags", ()) if node.op == "call_function" else ()
        if torch.Tag.nondeterministic_seeded in tags:
            frame = innermost(node.meta.get("stack_trace"))
            tainted[node] = str(node.target) + (f" at {frame} ({frame.code.strip()})" if frame
                                                and frame.code else f" at {frame}" if frame
                                                else "")
        else:
            found = next((tainted[a] for a in node.all_input_nodes if a in tainted), None)
            if found is not None:
                tainted[node] = found
        if node.op == "output":
            return {i: tainted[a] for i, a in enumerate(pytree.tree_leaves(node.args[0]))
                    if isinstance(a, torch.fx.Node) and a in tainted}
    return {}


def rng_state(compiled) -> tuple | None:
    """The random-number state before a run of `compiled`, where its graph draws random numbers
    (else None): CPU's and, where CUDA is in use, every CUDA device's."""
    if not random_ops(compiled.captured.gm):
        return None
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def check_outputs(compiled_fn, compiled, args, kwargs, flat_out, rng: tuple | None = None) -> None:
    """Raise MismatchError, naming the kernel, when an output of `compiled` (a CompiledGraph run
    by `compiled_fn`) is further from the float64 reference than eager's (see `compare`).
    `rng`: the random-number state the compiled run started from (`rng_state`), or None."""
    if rng is not None:
        after = rng_state(compiled)
        _set_rng_state(rng)
    try:
        with torch.no_grad():
            eager, eager_spec = flatten(compiled_fn.fn(*args, **kwargs))
    finally:
        if rng is not None:
            _set_rng_state(after)
    inputs = [*compiled.captured.lifted,
              *(l for l in pytree.tree_leaves((args, kwargs)) if isinstance(l, torch.Tensor))]
    ref = float64_reference(compiled.captured.gm, inputs) if rng is None else None
    # the graph's outputs are the flat outputs less the constants the program returns as they are
    graph_index = {k: j for j, k in enumerate(
        k for k in range(len(flat_out)) if k not in compiled.captured.output_constants)}
    if ref is not None and len(ref) != len(graph_index):
        ref = None  # (judged against eager alone)
    random = random_ops(compiled.captured.gm) if rng is not None else {}
    spec = compiled.captured.out_spec
    if spec is not None and eager_spec != spec:  # (a dict's keys, a tuple's length, a type)
        raise MismatchError(f"fusec: the compiled function's output is shaped "
                            f"{_structure(spec)}, eager's is {_structure(eager_spec)}")
    if len(eager) != len(flat_out):
        raise MismatchError(f"fusec: the compiled function returned {len(flat_out)} value(s) "
                            f"where eager returns {len(eager)}")
    for i, (f, e) in enumerate(zip(flat_out, eager)):
        j = graph_index.get(i)
        problem = compare_leaf(f, e, ref[j] if ref is not None and j is not None else None)
        if problem and j in random:
            warnings.warn(f"fusec: check=True did not compare output {i} with eager: it depends "
                          f"on random numbers ({random[j]}) that this program draws differently "
                          f"from eager, so the two cannot agree ({problem}). The other outputs "
                          "were compared.", FusecWarning, stacklevel=4)
            continue
        if problem:
            producer = None if j is None or j >= len(compiled.program.output_slots) else \
                compiled.program.producers.get(compiled.program.output_slots[j])
            if j is None:
                who = "a value the program returns as it was captured"
            elif hasattr(producer, "name"):
                who = f"kernel {producer.name} (fusing {', '.join(producer.ops)})"
            else:
                who = f"step {producer}" if producer else "an input passed through"
            raise MismatchError(f"fusec: output {i} from {who} does not match eager: {problem}")


def _structure(spec) -> str:
    """An output structure in one line, a leaf as `*`: `{'y': *, 'n': [*, (*, *)]}`."""
    try:
        return pytree.treespec_pprint(spec)
    except Exception:  # noqa: BLE001 (a type pytree cannot print: its plain text, on one line)
        return " ".join(str(spec).split())


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

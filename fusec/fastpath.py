"""The fast path: a call that looks like the last one runs its program with almost no Python.

`CompiledFunction.__call__` (fusec/api.py) first tries `self._fast(args)`: a guard written out
as straight-line Python for the last signature (`_guarded`), which returns `MISS` when the
arguments differ and otherwise runs the program and returns the user's outputs in the user's
structure (`_direct_runner`, `_packer`). `_signature` is the key every compiled program is kept
under; `_complete` puts back the outputs a program does not compute (constants, inputs returned
as they are).
"""
from __future__ import annotations

import builtins
import operator
from typing import Callable

import torch
from torch.utils import _pytree as pytree

from fusec.capture.frontend import Captured


class _Miss:
    """What a fast path returns when the call is not the one it was made for."""

    def __repr__(self) -> str:
        return "MISS"


_MISS = _Miss()


def _no_fast_path(args: tuple) -> _Miss:
    """The fast path before the first call (and after a call that cannot take one)."""
    return _MISS


def _guarded(run: Callable, tensors: list, n_static: int, state_refs: list, module,
             mutated: tuple = (), python_state: tuple = ((), {})) -> Callable:
    """`fast(args)`: run(tensors) when `args` match the call that `tensors` came from, else MISS.

    A guard in the sense of TorchDynamo's, written out as straight-line Python and compiled, so
    that checking costs a handful of attribute reads per tensor. For `f(x)` with x a (1024,)
    float32 CPU tensor:

        def fast(args):
            if len(args) != 1:
                return MISS
            a0, = args
            if (type(a0) is not Tensor or a0.shape != (1024,) or a0.stride() != (1,)
                    or a0.dtype is not float32 or not a0.is_cpu or a0.requires_grad):
                return MISS
            return run(args)

    A module's parameters and buffers are read where they live (an optimizer may replace them)
    and checked the same way, and so is `module.training`. When some tensor requires grad, the
    program is an inference one: it runs only while grad mode is off. A program that writes
    into inputs (`mutated`: their positions in `tensors`) also checks that none of them shares
    memory with another input (see the note on aliased inputs below); one that writes none
    checks nothing more. `python_state`: (lines, their globals) that check the Python state
    the program read (`m.scale`, a global flag: fusec/capture/guards.py `Guards.fast_lines`);
    none for a program that read none.
    """
    glob = {"MISS": _MISS, "Tensor": torch.Tensor, "run": run,
            "is_grad_enabled": torch.is_grad_enabled}
    n_args = len(tensors) - n_static
    args = [f"a{i}" for i in range(n_args)]
    lines = [f"if len(args) != {n_args}:", "    return MISS"]
    if args:
        lines.append(f"{', '.join(args)}{',' if n_args == 1 else ''} = args")
    if module is not None:
        glob["module"] = module
        lines += [f"if module.training is not {module.training}:", "    return MISS"]
    state = [f"p{i}" for i in range(n_static)]
    for i, ref in enumerate(state_refs):
        glob[f"owner{i}"] = ref.owner
        lines.append(f"p{i} = {ref.expression(f'owner{i}')}")  # (`owner0._parameters['weight']`)
    for var, t in zip(state + args, tensors):
        dtype, device = str(t.dtype).replace("torch.", ""), str(t.device).replace(":", "")
        glob[dtype], glob[device] = t.dtype, t.device
        checks = ([f"type({var}) is not Tensor"] if var.startswith("a") else []) + [
            f"{var}.shape != {tuple(t.shape)}", f"{var}.stride() != {tuple(t.stride())}",
            f"{var}.dtype is not {dtype}",
            # is_cpu reads a flag; .device builds a torch.device to compare
            f"not {var}.is_cpu" if device == "cpu" else f"{var}.device != {device}",
            f"{'not ' if t.requires_grad else ''}{var}.requires_grad"]
        rows = [" or ".join(checks[i:i + 3]) for i in range(0, len(checks), 3)]
        lines += [f"if ({rows[0]}", *[f"        or {row}" for row in rows[1:-1]],
                  f"        or {rows[-1]}):", "    return MISS"]
    if any(t.requires_grad for t in tensors):
        lines += ["if is_grad_enabled():  # an inference program: training takes `_call`",
                  "    return MISS"]
    if mutated:
        lines += _overlap_lines(state + args, tensors, mutated)
    lines += python_state[0]
    glob.update(python_state[1])
    everything = "args" if not state else f"[{', '.join(state + args)}]"
    lines.append(f"return run({everything})")
    source = "def fast(args):\n" + "".join(f"    {line}\n" for line in lines)
    exec(builtins.compile(source, "<fusec fast path>", "exec"), glob)  # (fusec's compile is ours)
    fast = glob["fast"]
    fast.source, fast.run = source, run
    return fast


def _complete(compiled: "CompiledGraph", flat_out: list, tensors: list) -> list:
    """A program's output list, completed with the outputs that are not tensors it computes:
    constants (None, a number) and inputs returned as they are."""
    for k, value in sorted(compiled.captured.output_constants.items()):
        flat_out.insert(k, value)
    for k, i in compiled.captured.output_aliases.items():
        flat_out[k] = tensors[i]  # `x.add_(1); return x` returns the caller's x itself
    return flat_out


def _output_form(spec) -> str | None:
    """"single", "tuple" or "list" when the user's outputs are one tensor or a flat tuple or
    list of them (the forms a straight-line function returns itself); None for anything else."""
    n = spec.num_leaves
    forms = {"single": pytree.tree_structure(0), "tuple": pytree.tree_structure((0,) * n),
             "list": pytree.tree_structure([0] * n)}
    return next((name for name, simple in forms.items() if spec == simple), None)


def _packer(spec) -> Callable:
    """flat outputs -> the user's structure, cheaply for the simple forms."""
    form = _output_form(spec)
    if form == "single":
        return operator.itemgetter(0)
    if form is not None:
        return tuple if form == "tuple" else list
    return lambda flat: pytree.tree_unflatten(flat, spec)


def _direct_runner(program, captured: Captured) -> Callable:
    """`run(tensors)` -> the user's outputs: the program's straight-line function, told to
    return the outputs in the user's structure when it is a tensor, a flat tuple or a flat list
    (else the structure is rebuilt by pytree after it)."""
    spec = captured.out_spec
    form = _output_form(spec)
    program.prepare()
    run = program.runner(captured.output_aliases, captured.output_constants, form or "list")
    if form is not None:
        return run
    return lambda tensors: pytree.tree_unflatten(run(tensors), spec)


def _signature(leaves: list, grad: bool) -> tuple:
    key = [grad]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            key.append((tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype, leaf.device,
                        leaf.requires_grad))
        else:
            key.append((type(leaf), leaf))
    return tuple(key)


# ---- inputs that share memory ----------------------------------------------------------------
#
# Note (aliased inputs). A program that writes into its inputs (`x.mul_(2); x.add_(y)`: capture
# functionalizes the writes into one `copy_` into x at the end) was traced with x and y as two
# tensors. Called with y *being* x, eager's second line reads the x its first line wrote; the
# program reads the old x. So a program that writes into an input checks, on every call, that no
# input it writes shares memory with another input (`input_overlaps`; the fast path spells the
# check out with the data pointers: `_overlap_lines`). A program that writes into no input
# checks nothing: two inputs that share memory are only read. When they do overlap (api.py):
# - inputs that are the very same tensor (same memory, shape, strides, dtype) get a program of
#   their own, traced with one tensor in both places (frontend.capture's `same`), which is
#   what AOT Autograd does with duplicated inputs;
# - any other overlap (a slice of the other, two overlapping slices) runs eagerly, with one
#   warning: no static program keeps eager's order of reads and writes through two views.

def mutated_inputs(program) -> tuple[int, ...]:
    """The positions, in the program's input list, of the inputs it writes into (an extern
    `copy_`/`index_put_` into an input or a view of one, a kernel written over an input).
    Computed once per program, from its steps (a program loaded from disk has no graph)."""
    found = getattr(program, "_mutated_inputs", None)
    if found is None:
        found = program._mutated_inputs = _writes_into_inputs(program)
    return found


def _writes_into_inputs(program) -> tuple[int, ...]:
    from fusec.runtime.steps import ExternStep, GetItemStep, KernelStep, SlotRef, ViewStep
    root = {slot: i for i, slot in enumerate(program.input_slots)}  # slot -> the input it views
    written = set()
    for step in program.steps:
        if isinstance(step, ViewStep):
            if step.root in root:
                root[step.out_slot] = root[step.root]
        elif isinstance(step, GetItemStep):
            if step.src in root:  # a piece of a split of an input
                root[step.out_slot] = root[step.src]
        elif isinstance(step, ExternStep):
            schema = getattr(step.target, "_schema", None)
            for arg, spec in zip(step.args, schema.arguments if schema is not None else ()):
                if spec.alias_info is None or not isinstance(arg, SlotRef) or arg.slot not in root:
                    continue
                if spec.alias_info.is_write:
                    written.add(root[arg.slot])
                else:  # a view of the input (aten.view as an extern): writing it writes the input
                    root[step.out_slot] = root[arg.slot]
        elif isinstance(step, KernelStep):
            written.update(root[w.inplace] for w in step.writes if w.inplace in root)
    return tuple(sorted(written))


def _span(t: torch.Tensor) -> int:
    """Bytes from t's first element to just past its last (0 for an empty tensor)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))) * t.element_size()


def input_overlaps(tensors: list, mutated: tuple) -> tuple | None:
    """None when no input in `mutated` shares memory with another input; else ("same", {i: j})
    when every such overlap is an input that is the very tensor j < i (same memory, shape,
    strides, dtype), or ("partial", (i, j)) naming one overlap that is not."""
    spans = [(t.device, t.data_ptr(), _span(t)) for t in tensors]
    hit = None
    for m in mutated:
        dev, start, span = spans[m]
        for o, (dev_o, start_o, span_o) in enumerate(spans):
            if o != m and dev == dev_o and span and span_o and start < start_o + span_o \
                    and start_o < start + span:
                if not _same_view(tensors[m], tensors[o]):
                    return ("partial", (min(m, o), max(m, o)))
                hit = True
    if hit is None:
        return None
    same = {}
    for i, t in enumerate(tensors):
        j = next((j for j in range(i) if j not in same and _same_view(tensors[j], t)), None)
        if j is not None:
            same[i] = j
    return ("same", same)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)


def _overlap_lines(names: list[str], tensors: list, mutated: tuple) -> list[str]:
    """The fast path's check that no input the program writes shares memory with another
    (see the note on aliased inputs): one data pointer read per input involved, and two
    comparisons per pair. (Shapes, strides and devices are guarded already: spans are constants.)"""
    pairs = [(m, o) for m in mutated for o in range(len(tensors))
             if o != m and (o not in mutated or o > m) and _span(tensors[m]) and _span(tensors[o])
             and tensors[m].device == tensors[o].device]
    used = sorted({i for pair in pairs for i in pair})
    lines = [f"d{i} = {names[i]}.data_ptr()" for i in used]
    for m, o in pairs:
        lines += [f"if d{m} < d{o} + {_span(tensors[o])} and d{o} < d{m} + {_span(tensors[m])}:",
                  "    return MISS  # an input the program writes shares memory with another"]
    return lines

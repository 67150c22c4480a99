"""Inputs that share memory: when a compiled program may run on them, and what runs instead.

Note (aliased inputs). A program that writes into its inputs (`x.mul_(2); x.add_(y)`: capture
functionalizes the writes into one `copy_` into x at the end) was traced with x and y as two
tensors. Called with y *being* x, eager's second line reads the x its first line wrote; the
program reads the old x:

    def f(x, y): x.mul_(2); x.add_(y); return x
    a = torch.ones(4)
    f(a, a)            # eager: 4 = 1*2 + 1*2       the program traced with two tensors: 3

So a program that writes into an input checks, on every call, that no input it writes shares
memory with another input (`input_overlaps`; the fast path, fusec/fastpath.py, spells the same
check out with data pointers). A program that writes into no input checks nothing: two inputs
that share memory are only read. When they do overlap, `AliasedCalls.program_key` decides, the
way AOT Autograd treats duplicated inputs:

- inputs that are the very same tensor (same memory, shape, strides, dtype) get a program of
  their own, traced with one tensor in both places (frontend.capture's `same`). The first such
  call runs eagerly: eager may refuse it (`x[1:] = y[:-1]` with y being x raises), and a program
  must not answer where eager raises;
- any other overlap (a slice of the other, two overlapping slices) runs eagerly, with one
  warning: no static program keeps eager's order of reads and writes through two views.

CompiledFunction (fusec/api.py) calls `alias_check` after it picks a program, and hands an
overlapping call to its `_aliased_call`, which follows the decision made here.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch.utils import _pytree as pytree


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


def span(t: torch.Tensor) -> int:
    """Bytes from t's first element to just past its last (0 for an empty tensor)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))) * t.element_size()


def input_overlaps(tensors: list, mutated: tuple) -> tuple | None:
    """None when no input in `mutated` shares memory with another input; else ("same", {i: j})
    when every such overlap is an input that is the very tensor j < i (same memory, shape,
    strides, dtype), or ("partial", (i, j)) naming one overlap that is not."""
    spans = [(t.device, t.data_ptr(), span(t)) for t in tensors]
    hit = None
    for m in mutated:
        dev, start, size = spans[m]
        for o, (dev_o, start_o, size_o) in enumerate(spans):
            if o != m and dev == dev_o and size and size_o and start < start_o + size_o \
                    and start_o < start + size:
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


def alias_check(program, tensors: list) -> tuple | None:
    """None, unless the program writes into an input that shares memory with another input
    (then `input_overlaps`'s answer). Free for a program that writes into no input."""
    mutated = mutated_inputs(program)
    return input_overlaps(tensors, mutated) if mutated else None


def share_memory(args: tuple, kwargs: dict, lifted: list) -> bool:
    """Do two of these tensors share memory (one tensor passed twice, a view of another)?
    Capture then traces them as distinct tensors (unless `same` says otherwise), so that the
    program serves any tensors like these, aliased or not."""
    tensors = [*lifted, *(t for t in pytree.tree_leaves((args, kwargs))
                          if isinstance(t, torch.Tensor))]
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    return len(storages) < len(tensors)


class AliasedCalls:
    """What one compiled function has seen of calls whose inputs overlap (see the note above):
    whether it warned about a partial overlap, and which kinds of "same tensor twice" calls
    already ran eagerly once."""

    def __init__(self):
        self.warned = False
        self.ran_eagerly: set = set()

    def program_key(self, overlap: tuple, key: tuple, label: str,
                    names: Callable[[], list[str]]) -> tuple | None:
        """The key of the program for a call whose inputs overlap as `overlap` says (its
        signature's key plus which inputs are the same tensor), or None: run it eagerly.
        `names()`: every input's name, for the warning about a partial overlap."""
        kind, detail = overlap
        if kind == "same":
            return key + (("same", tuple(sorted(detail.items()))),)
        if not self.warned:
            self.warned = True
            every = names()
            warnings.warn(f"fusec: {label}'s inputs {every[detail[0]]} and {every[detail[1]]} "
                          "overlap in memory without being the same tensor, and the program "
                          "writes into one of them: calls like this run eagerly (a compiled "
                          "program cannot keep eager's order of reads and writes through two "
                          "views of one memory)", stacklevel=5)
        return None

    def runs_eagerly(self, key: tuple | None) -> bool:
        """Whether a call with no program yet for `key` runs eagerly: a partial overlap (key
        None) always, a same-tensor call the first time (eager may raise; `ran(key)` is called
        once it did not), and later ones compile their program."""
        return key is None or key not in self.ran_eagerly

    def ran(self, key: tuple | None) -> None:
        """A call with `key` ran eagerly without raising."""
        if key is not None:
            self.ran_eagerly.add(key)

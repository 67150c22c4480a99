"""Kernel families: kernels made for one form of program, behind one door.

The core renders every kernel the general way: a pointwise kernel over its loop, a reduction as
rows and a loop over k (each backend's `render`). Some forms pay for a kernel of their own. A
matmul of a few activation rows by a weight stored in a compact form (the decode step of an LLM)
is one: the general reduction reads the weight once per activation row, a kernel of its own reads
it once for all of them, unpacks 4-bit values a 32-bit word at a time, or hands 16 rows to the
tensor cores. Such kernels are a *family*: code that recognizes its form and renders it, kept out
of the core's renderers and registered here:

    families.register(Family("my matmuls", "my_package.family", ("triton", "cpp"), wants=has("matmul")))

A backend's renderer asks `special(kernel, backend, arch)` before it renders a kernel the general
way. A family says which kernels it wants to be asked about, `wants(kernel)`: a cheap test of
the kernel IR (its class, a field that is set) that the core makes before it imports the family,
so a kernel no family wants (a softmax, an elementwise loop) never calls into one. Each family
registered for that backend that wants the kernel, in order, either takes it (its source is
the kernel's) or declines with `Declined(notes)`. A note is a near miss worth telling (the
kernel has the family's form, but a size or a layout ruled it out); the general renderer puts
the notes in the kernel's header, so a reader of the generated kernel sees what was tried and
why it was not taken. A family that does not recognize the kernel at all declines with no notes.

A family is a module with one renderer per backend it serves, `render_<backend>(kernel, arch)`,
named and imported when first asked, so `import fusec` does not load kernel code a program may
never use. The face of the package (fusec/__init__.py) registers the families that ship with
fusec (extensions/); docs/extending.md says how to add one.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Declined:
    """A family's answer when it does not take a kernel: the near misses worth telling."""

    notes: list[str] = field(default_factory=list)


@dataclass
class Family:
    """A kernel family: its name, the module that holds its renderers, the backends it serves,
    and which kernels it wants to be asked about (`wants(kernel)`, checked before the module is
    imported). For each backend, the module has `render_<backend>(kernel, arch) -> str | Declined`
    (the kernel's whole source, or why not)."""

    name: str
    module: str
    backends: tuple[str, ...]
    wants: Callable[[object], bool] = lambda kernel: True  # which kernels it is asked about

    def renderer(self, backend: str) -> Callable | None:
        if backend not in self.backends:
            return None
        return getattr(importlib.import_module(self.module), f"render_{backend}")


REGISTRY: list[Family] = []


def register(family: Family) -> Family:
    """Add `family` (after those registered before it: the first that takes a kernel renders
    it). Registering a family of the same name again replaces it."""
    REGISTRY[:] = [f for f in REGISTRY if f.name != family.name]
    REGISTRY.append(family)
    return family


def has(field: str) -> Callable[[object], bool]:
    """A family's `wants` for the kernels whose IR field `field` is set (`has("matmul")`: a
    reduction that computes a matmul, fusec/ir.py)."""
    def wants(kernel) -> bool:
        return getattr(kernel, field, None) is not None
    wants.__qualname__ = f"has({field!r})"
    return wants


def special(kernel, backend: str, arch: int | None = None) -> tuple[str | None, list[str]]:
    """(source, notes): the source of the first registered family that takes `kernel` for
    `backend`, or None and the notes of the families that declined it."""
    notes: list[str] = []
    for family in REGISTRY:
        if backend not in family.backends or not family.wants(kernel):
            continue
        render = family.renderer(backend)
        answer = render(kernel, arch)
        if isinstance(answer, str):
            return answer, notes
        notes.extend(answer.notes)
    return None, notes

"""One Jinja2 environment for every backend's templates (codegen/<backend>/templates/*.j2: each
backend package keeps its own), and one per kernel family that brings its own (its folder first,
then the backends').

StrictUndefined makes a template that mentions a value Python did not decide fail loudly instead
of printing an empty string into a kernel.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from fusec.errors import UnsupportedError

BACKEND_PACKAGES = ("triton", "cpp", "llvm")
# the backends' template folders; template names start with their backend's (triton_..., cpp_...,
# llvm_...), so one search path over all of them finds each
TEMPLATES = tuple(Path(__file__).parent / backend / "templates" for backend in BACKEND_PACKAGES)


@functools.lru_cache(maxsize=None)
def environment(*folders: str) -> jinja2.Environment:
    """The environment over the backends' templates, after `folders` (a kernel family's own
    templates, which may include the core's partials: `{% include "triton_pdl_wait.j2" %}`)."""
    import jinja2  # lazy: the first kernel rendered pays for it, not `import fusec`
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader([*folders, *map(str, TEMPLATES)]),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        # a size of a shape family prints by the name of the input size it is (`x_size0`), in
        # code and comments alike (fusec.symbolic.text)
        finalize=_readable,
    )


def _readable(value):
    """(the templates' finalize: every `{{ value }}` goes through it)"""
    from fusec.symbolic import text
    return text(value) if isinstance(value, (tuple, list, torch.SymInt, torch.SymFloat)) else value


def render_template(template: str, **context) -> str:
    return environment().get_template(template).render(**context)


def no_indexed_writes(kernel, backend: str) -> None:
    """The CPU backends do not write indexed positions (fusec.ir.Store's `scatter`): on a CPU the
    write stays eager's, which raises on a position out of range (fusec.ops.INDEXED_WRITE_DEVICES
    lists the devices where a kernel does it). Reaching here means that list was widened."""
    if any(s.scatter is not None for s in kernel.stores):
        raise UnsupportedError(f"{kernel.name}: the {backend} backend does not render indexed writes "
                               "(fusec.ops.INDEXED_WRITE_DEVICES names the devices that do)")

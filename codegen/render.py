"""One Jinja2 environment for every backend's templates (codegen/templates/*.j2).

StrictUndefined makes a template that mentions a value Python did not decide fail loudly instead
of printing an empty string into a kernel.
"""
from __future__ import annotations

import functools
from pathlib import Path

import jinja2

TEMPLATES = Path(__file__).parent / "templates"


@functools.lru_cache(maxsize=None)
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def render_template(template: str, **context) -> str:
    return environment().get_template(template).render(**context)

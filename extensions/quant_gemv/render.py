"""The family's templates (extensions/quant_gemv/templates/*.j2), in the core's Jinja2 setup
(fusec/codegen/render.py): the same strictness and whitespace rules, the core's partials."""
from __future__ import annotations

from pathlib import Path

from fusec.codegen.render import environment

TEMPLATES = Path(__file__).parent / "templates"


def render_template(template: str, **context) -> str:
    return environment(str(TEMPLATES)).get_template(template).render(**context)

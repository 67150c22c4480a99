"""The old name of fusec.inspect.report_html (from before fusec/ had rooms): `import fusec.report_html`
gives that module itself, imported only now (it brings rich and jinja2)."""
import importlib
import sys

sys.modules[__name__] = importlib.import_module("fusec.inspect.report_html")

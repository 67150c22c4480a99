"""The old name of fusec.inspect.report_text (from before fusec/ had rooms): `import fusec.report_text`
gives that module itself, imported only now (it brings rich and jinja2)."""
import importlib
import sys

sys.modules[__name__] = importlib.import_module("fusec.inspect.report_text")

"""`import fusec` imports nothing a first call may not need (issue 52).

`import fusec` alone imports no torch at all: fusec/__init__.py names its public objects lazily,
and the first `fusec.compile` imports the compiler and torch (tests/test_first_hour.py checks
that, the public names and the old module names). Then torch's tracing machinery (Dynamo and Inductor, which make_fx and FakeTensorMode pull in, and
Triton and sympy, which they bring: ~1-2 s on a 2-core CPU) is imported by the first call that
captures a program or fingerprints it for a warm start, once per process; LLVM's bindings,
networkx and transformers when a program first needs them; rich and jinja2 when a report is drawn
or a kernel rendered. (How long the import takes is measured by `python -X importtime -c "import
fusec"`, not by a test: it depends on the machine's load.)
"""
import json
import os
import subprocess
import sys

HEAVY = ["llvmlite", "networkx", "transformers", "triton", "rich", "jinja2", "sympy",
         "torch._dynamo", "torch._inductor"]


def imported_with(code: str) -> list[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    env = {**os.environ, "FUSEC_SAVED_PROGRAMS": "0"}  # (a saved program would skip the passes)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                         check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_import_fusec_imports_only_what_a_call_needs():
    assert imported_with("import fusec") == []


def test_old_names_of_the_report_writers_import_them_when_asked():
    """fusec.report_html / fusec.report_text (their names before inspect/) stay importable, as
    the same module objects, without `import fusec` importing rich and jinja2 for them."""
    code = ("import fusec, sys\nimport fusec.report_html as h\nfrom fusec.report_text import kernel_rows\n"
            "assert h is sys.modules['fusec.inspect.report_html'] is fusec.report_html\n"
            "assert fusec.report_text is sys.modules['fusec.inspect.report_text']")
    assert {"rich", "jinja2"} <= set(imported_with(code))


def test_the_first_compile_imports_what_it_needs():
    code = "import fusec, torch\nfusec.compile(lambda x: x.sin() * 2, backend='cpp')(torch.randn(4))"
    heavy = imported_with(code)
    assert "networkx" in heavy  # (fusion's graph algorithms, at the first compile)
    assert "torch._dynamo" in heavy and "jinja2" in heavy  # (capture, and the kernel's template)

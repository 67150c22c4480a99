"""`import fusec` imports what a first call needs and nothing it may never need.

torch's tracing machinery (Dynamo and Inductor, which make_fx and FakeTensorMode pull in) is
imported with fusec on purpose, so that a warm call stays quick (tests/test_cache.py); Inductor
brings Triton. LLVM's bindings, networkx and transformers are imported when a program first
needs them. (How
long the import takes is measured by `python -X importtime -c "import fusec"`, not by a test: it
depends on the machine's load.)
"""
import json
import os
import subprocess
import sys

HEAVY = ["llvmlite", "networkx", "transformers"]


def imported_with(code: str) -> list[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    env = {**os.environ, "FUSEC_SAVED_PROGRAMS": "0"}  # (a saved program would skip the passes)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                         check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_import_fusec_imports_only_what_a_call_needs():
    assert imported_with("import fusec") == []


def test_the_first_compile_imports_what_it_needs():
    code = "import fusec, torch\nfusec.compile(lambda x: x.sin() * 2, backend='cpp')(torch.randn(4))"
    assert "networkx" in imported_with(code)  # (fusion's graph algorithms, at the first compile)

"""`import fusec` stays light: torch's compiler stack (Dynamo, Inductor, AOT Autograd), Triton,
LLVM's bindings, networkx and transformers are imported when a program first needs them, not
with fusec, so a script that only imports it (or `fusec --help`) starts in about torch's own
import time. (How long that takes is measured by `python -X importtime -c "import fusec"`, in
docs/compile_time.md; a test only checks what was imported, which does not depend on the load.)
"""
import json
import subprocess
import sys

HEAVY = ["torch._dynamo", "torch._inductor", "torch._functorch.aot_autograd", "triton",
         "llvmlite", "networkx", "transformers", "sympy"]


def imported_with(code: str) -> list[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_import_fusec_imports_no_compiler_stack():
    assert imported_with("import fusec") == []


def test_the_first_compile_imports_what_it_needs():
    code = "import fusec, torch\nfusec.compile(lambda x: x.sin() * 2, backend='cpp')(torch.randn(4))"
    assert "torch._dynamo" in imported_with(code)  # (make_fx's own imports, at the first trace)

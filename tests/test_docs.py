"""Every code block in the docs runs, so the docs never go stale.

* Every ```python block of README.md and docs/**/*.md runs: a file's blocks run in order in one
  namespace (a block may use what an earlier one defined), in a fresh Python process per file,
  in a scratch directory, with TRITON_INTERPRET=1 (no GPU needed) and no FUSEC_LOG /
  FUSEC_DEBUG_DIR from the outside. Output listings are ```text blocks, never ```python.
* Every ```bash block whose first command starts with `fusec ` or `python ` (after any
  `VAR=value` prefixes) runs with bash in a scratch directory (examples are named, not given as
  paths: `fusec explain sin4`), with `fusec` meaning this checkout's CLI, unless SKIP_BASH names it with
  the reason. Blocks whose first command is something else (`pip`, `bash script.sh`) are listed in
  NOT_RUN with the reason, and the test fails when a new such block appears unlisted.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.S | re.M)

# bash blocks that start with fusec/python but are not run, keyed by (file, first line): why
SKIP_BASH: dict = {
    ("docs/benchmarks.md", "python benchmarks/kernelbench.py --threads 1 --markdown table.md --json run.json"):
        "the whole KernelBench-style suite: minutes of eager, torch.compile and fusec on 50 problems "
        "and 5 models (tests/test_kernelbench.py runs the script on two problems)",
    ("docs/benchmarks.md", "python benchmarks/opinfo_sweep.py                                   # every op, float32, C++"):
        "the whole OpInfo sweep: every op on several backends and dtypes, minutes each "
        "(tests/test_opinfo.py runs its harness on the ops it found and 33 everyday ones)",
}
# bash blocks whose first command is neither fusec nor python, keyed the same way: why
NOT_RUN = {
    ("README.md", 'pip install "torch==2.13.0" -e ".[dev]" && fusec demo'):
        "installs packages (the tests already run in the installed checkout), then `fusec demo` "
        "on the full-size seed examples (tests/test_cli.py runs every example at small sizes); "
        "its second line runs this very suite",
    ("docs/gpu.md", "bash benchmarks/gpu_session.sh   # writes tests.log, pointwise.json, "
                    "models.json, cuda_graphs.json/.txt to $OUT"):
        "GPU only: runs the suite with real Triton and the benchmarks on a CUDA machine",
}
# lines inside a run bash block that are not run, with the reason
SKIP_LINES = {
    "python -m pytest -q": "the whole test suite, which this test is part of",
}


def blocks(path: Path, lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(path.read_text()) if kind == lang]


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("FUSEC_LOG", "FUSEC_DEBUG_DIR",
                                                            "FUSEC_PROGRESS")}
    env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


RUNNER = r"""
import json, sys
blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
for i, (where, code) in enumerate(blocks):
    print(f"----- block {i + 1}/{len(blocks)} ({where})", flush=True)
    exec(compile(code, where, "exec"), namespace)
"""

PY_FILES = [p for p in DOCS if blocks(p, "python")]


@pytest.mark.parametrize("path", PY_FILES, ids=[rel(p) for p in PY_FILES])
def test_python_blocks_run(path, tmp_path):
    text = path.read_text()
    found = []
    for m in FENCE.finditer(text):
        if m.group(1) == "python":
            line = text[:m.start()].count("\n") + 2
            found.append((f"{rel(path)}:{line}", m.group(2)))
    (tmp_path / "blocks.json").write_text(json.dumps(found))
    (tmp_path / "runner.py").write_text(RUNNER)
    out = subprocess.run([sys.executable, "runner.py", "blocks.json"], cwd=tmp_path,
                         env=clean_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout[-4000:] + "\n" + out.stderr[-8000:])


def bash_blocks() -> list:
    runs = []
    for path in DOCS:
        for body in blocks(path, "bash"):
            first = body.strip().splitlines()[0]
            key = (rel(path), first)
            command = re.sub(r"^(\w+=\S*\s+)*", "", first)
            if not re.match(r"(fusec|python)\s", command):
                runs.append(pytest.param(key, body, marks=pytest.mark.skip(
                    reason=NOT_RUN.get(key, "UNLISTED"))))
            elif key in SKIP_BASH:
                runs.append(pytest.param(key, body, marks=pytest.mark.skip(reason=SKIP_BASH[key])))
            else:
                runs.append(pytest.param(key, body))
    return runs


def test_every_skipped_bash_block_is_listed():
    for path in DOCS:
        for body in blocks(path, "bash"):
            first = body.strip().splitlines()[0]
            command = re.sub(r"^(\w+=\S*\s+)*", "", first)
            if not re.match(r"(fusec|python)\s", command):
                assert (rel(path), first) in NOT_RUN, f"say why {rel(path)}: {first!r} is not run"
    assert set(NOT_RUN) | set(SKIP_BASH) <= {
        (rel(p), b.strip().splitlines()[0]) for p in DOCS for b in blocks(p, "bash")}, \
        "a listed block is gone from the docs: drop it from the list"


def _id(value) -> str | None:
    if isinstance(value, tuple):  # (file, first line)
        return f"{value[0]}: {value[1][:50]}"
    return "-"  # the block's body: its first line is already in the id


@pytest.mark.parametrize("key,body", bash_blocks(), ids=_id)
def test_bash_blocks_run(key, body, tmp_path):
    lines = [line for line in body.splitlines() if line.strip() not in SKIP_LINES]
    # `fusec` is this checkout's CLI, whatever is installed on PATH
    script = (f'set -e\nfusec() {{ "{sys.executable}" -m fusec.cli "$@"; }}\n'
              + "\n".join(lines))
    env = clean_env()
    out = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, (out.stdout[-4000:] + "\n" + out.stderr[-8000:])

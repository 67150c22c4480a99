"""Every code block in the docs runs, so the docs never go stale.

* Every ```python block of README.md, docs/**/*.md and extensions/**/*.md runs: a file's blocks run in order in one
  namespace (a block may use what an earlier one defined), in a fresh Python process per file,
  in a scratch directory, with TRITON_INTERPRET=1 (no GPU needed) and no FUSEC_LOG /
  FUSEC_DEBUG_DIR from the outside. Output listings are ```text blocks, never ```python.
* A block's printed output is checked: a ```text output block right after a ```python block
  (nothing but blank lines between) is what that block prints (stdout and stderr), compared
  after `normalize` (times, ratios, addresses, hashes and scratch paths vary between runs), with
  a line `...` standing for any number of lines. (A plain ``` or ```text block shows output of
  code the page does not show in full; those are not checked yet: see docs/index.md.) When the code changes what it prints, the test
  fails naming the block; `python tests/test_docs.py --refresh docs/page.md` rewrites every
  block that no longer matches with what the code prints now.
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
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
        *sorted((ROOT / "extensions").rglob("*.md"))]  # an extension's pages are docs too
FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```\s*$", re.S | re.M)

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
    ("docs/performance.md", "bash benchmarks/gpu_session.sh   # writes tests.log, pointwise.json, "
                            "models.json, cuda_graphs.json/.txt to $OUT"):
        "GPU only: runs the suite with real Triton and the benchmarks on a CUDA machine",
}
# lines inside a run bash block that are not run, with the reason
SKIP_LINES = {
    "python -m pytest -q": "the whole test suite, which this test is part of",
}


def blocks(path: Path, lang: str) -> list[str]:
    return [body for kind, _, body in FENCE.findall(path.read_text()) if kind == lang]


def rel(path: Path) -> str:
    try:
        return path.relative_to(ROOT).as_posix()
    except ValueError:  # (a page outside the repository: the output check's own test)
        return str(path)


def clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("FUSEC_LOG", "FUSEC_DEBUG_DIR",
                                                            "FUSEC_PROGRESS")}
    env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


RUNNER = r"""
import contextlib, io, json, sys
blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
printed = []
for i, (where, code) in enumerate(blocks):
    print(f"----- block {i + 1}/{len(blocks)} ({where})", flush=True)
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            exec(compile(code, where, "exec"), namespace)
    finally:
        sys.stdout.write(buffer.getvalue())
        printed.append(buffer.getvalue())
        json.dump(printed, open("printed.json", "w"))
"""

# what varies between runs of the same code, replaced before outputs are compared
VARIES = [
    (re.compile(r"/tmp/[^\s'\")]*"), "<tmp>"),  # scratch directories and files
    (re.compile(r"\b0x[0-9a-fA-F]{6,}\b"), "0x<address>"),
    (re.compile(r"\b[0-9a-f]{20}\b"), "<hash>"),  # content hashes in cache file names
    (re.compile(r"\d+(\.\d+)?(e-?\d+)?\s*(ms|us|µs|ns|s)\b"), "<time>"),
    (re.compile(r"\b\d+\.\d+x\b"), "<ratio>"),
]


def normalize(text: str) -> list[str]:
    """`text`'s lines with what varies between runs replaced, trailing blanks dropped."""
    for pattern, stand_in in VARIES:
        text = pattern.sub(stand_in, text)
    lines = [line.rstrip() for line in text.rstrip().splitlines()]
    return lines


def matches(shown: str, printed: str) -> bool:
    """Does the doc's output block `shown` show what the code `printed`? (`...` lines: any)"""
    want, got = normalize(shown), normalize(printed)
    pattern = "".join("(?:.*\n)*?" if line.strip() == "..." else re.escape(line) + "\n"
                      for line in want)
    return re.fullmatch(pattern, "".join(line + "\n" for line in got)) is not None


def output_blocks(text: str) -> dict[int, re.Match]:
    """{index of a python block in the file: the output block right after it}."""
    fences = list(FENCE.finditer(text))
    found, n = {}, -1
    for a, b in zip(fences, fences[1:]):
        if a.group(1) == "python":
            n += 1
            if b.group(1) == "text" and b.group(2).strip() == "output" \
                    and not text[a.end():b.start()].strip():
                found[n] = b
    if fences and fences[-1].group(1) == "python":
        n += 1
    return found


def run_blocks(path: Path, where: Path):
    """Run `path`'s python blocks (see the module docstring); (process result, printed list)."""
    text = path.read_text()
    found = []
    for m in FENCE.finditer(text):
        if m.group(1) == "python":
            line = text[:m.start()].count("\n") + 2
            found.append((f"{rel(path)}:{line}", m.group(3)))
    (where / "blocks.json").write_text(json.dumps(found))
    (where / "runner.py").write_text(RUNNER)
    out = subprocess.run([sys.executable, "runner.py", "blocks.json"], cwd=where,
                         env=clean_env(), capture_output=True, text=True, timeout=600)
    printed_file = where / "printed.json"
    printed = json.loads(printed_file.read_text()) if printed_file.exists() else []
    return out, found, printed


def stale_outputs(path: Path, found: list, printed: list) -> list[tuple]:
    """(where, output block match, what was printed) for each output block the code no longer
    prints."""
    text = path.read_text()
    return [(found[i][0], block, printed[i]) for i, block in output_blocks(text).items()
            if i < len(printed) and not matches(block.group(3), printed[i])]

PY_FILES = [p for p in DOCS if blocks(p, "python")]


@pytest.mark.parametrize("path", PY_FILES, ids=[rel(p) for p in PY_FILES])
def test_python_blocks_run(path, tmp_path):
    out, found, printed = run_blocks(path, tmp_path)
    assert out.returncode == 0, (out.stdout[-4000:] + "\n" + out.stderr[-8000:])
    stale = stale_outputs(path, found, printed)
    assert not stale, (
        f"{len(stale)} output block(s) of {rel(path)} no longer show what the code prints "
        f"(refresh them: python tests/test_docs.py --refresh {rel(path)}):\n" + "\n".join(
            f"--- after the block at {where}, the code printed:\n{now[:1500]}"
            for where, _, now in stale))


def test_the_output_check_catches_drift_and_refreshes(tmp_path):
    """An output block that matches after normalization passes; one the code no longer prints
    fails; --refresh rewrites the stale one only, keeping the other's `...`."""
    assert matches("took <time>\n...\nend", "took 1.5 ms\nmiddle\nlines\nend\n")
    assert matches("a 2.00x speedup at 0x7f00aa11bb22", "a 0.31x speedup at 0x55d0c0ffee00")
    assert not matches("fused_sin_0", "fused_cos_0")
    page = tmp_path / "page.md"
    page.write_text("```python\nprint('kept'); print('detail')\n```\n\n```text output\nkept\n...\n"
                    "```\n\n```python\nprint('new')\n```\n\n```text output\nold\n```\n")
    out, found, printed = run_blocks(page, tmp_path)
    assert out.returncode == 0 and printed == ["kept\ndetail\n", "new\n"]
    assert [where for where, _, _ in stale_outputs(page, found, printed)] == [f"{page}:11"]  # (the first line of its code)
    assert refresh(page) == 1
    assert page.read_text().endswith("```text output\nnew\n```\n")
    assert "kept\n...\n" in page.read_text()


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


def refresh(path: Path) -> int:
    """Rewrite each output block of `path` that the code no longer prints (the rest, with their
    `...` lines, stay); returns how many were rewritten."""
    import tempfile
    with tempfile.TemporaryDirectory() as scratch:
        out, found, printed = run_blocks(path, Path(scratch))
    if out.returncode != 0:
        raise SystemExit(f"{rel(path)}: a block failed:\n{out.stderr[-4000:]}")
    text = path.read_text()
    stale = stale_outputs(path, found, printed)
    for _, block, now in sorted(stale, key=lambda s: -s[1].start()):
        text = text[:block.start(3)] + now.rstrip() + "\n" + text[block.end(3):]
    path.write_text(text)
    return len(stale)


# ---- the list of the pass pages, generated from the pipeline ---------------------------------------

PASS_PAGES_DOC = "docs/architecture.md"
PASS_PAGES_BEGIN = ("<!-- the pass pages, generated from passes.pipeline(): "
                    "python tests/test_docs.py --pass-pages -->")
PASS_PAGES_END = "<!-- end of the generated pass pages -->"
PASS_PAGES = re.compile(re.escape(PASS_PAGES_BEGIN) + r"\n(.*?)\n?" + re.escape(PASS_PAGES_END), re.S)


def pass_pages() -> str:
    """The pass pages as docs/architecture.md lists them, in the order `passes.pipeline()` runs
    the passes: a core pass links its page in docs/passes/; a pass an extension registered
    (`ExtensionPass`, from a module of fusec.extensions.<folder>) is marked as that extension's
    and links its page in the extension's own docs, extensions/<folder>/docs/<pass>.md. (A pass
    registered from anywhere else, say a test's, has no page and is not listed.)"""
    import textwrap
    from fusec import passes
    items = []
    for p in passes.pipeline():
        if not isinstance(p, passes.ExtensionPass):
            items.append(f"[{p.__name__}](passes/{p.__name__}.md)")
        elif p.module.startswith("fusec.extensions."):
            folder = p.module.split(".")[2]
            items.append(f"[{p.name}](../extensions/{folder}/docs/{p.name}.md) (extension {folder})")
    return textwrap.fill(", ".join(items) + ".", width=100, break_long_words=False,
                         break_on_hyphens=False)


def write_pass_pages() -> bool:
    """Rewrite the generated list in PASS_PAGES_DOC; returns whether it changed."""
    path = ROOT / PASS_PAGES_DOC
    text = path.read_text()
    now = PASS_PAGES.sub(lambda m: f"{PASS_PAGES_BEGIN}\n{pass_pages()}\n{PASS_PAGES_END}", text, count=1)
    if now != text:
        path.write_text(now)
    return now != text


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description="Rewrite the output blocks of docs whose code "
                                     "prints something else now (see the module docstring), or "
                                     "the generated list of the pass pages.")
    parser.add_argument("--refresh", nargs="+", default=[], metavar="FILE")
    parser.add_argument("--pass-pages", action="store_true",
                        help=f"rewrite the list of the pass pages in {PASS_PAGES_DOC}")
    args = parser.parse_args()
    if not args.refresh and not args.pass_pages:
        parser.error("nothing to do: give --refresh FILE... or --pass-pages")
    for name in args.refresh:
        print(f"{name}: {refresh(ROOT / name)} output block(s) rewritten")
    if args.pass_pages:
        print(f"{PASS_PAGES_DOC}: {'rewritten' if write_pass_pages() else 'already up to date'}")


# ---- the pass list, wherever a page spells it -----------------------------------------------------

def pass_lists(text: str, names: list[str]) -> list[tuple[int, list[str]]]:
    """Every place `text` lists passes: a run of lines, starting at one that names four or more
    passes, and taking in the lines before and after it that name at least one (a table whose rows each name a
    pass or two, or prose that names three, is not a list of the pipeline). Returns (first line number,
    the pass names in the order written; a name written twice, as a link's text and its target,
    counts once)."""
    pattern = re.compile(r"(?<![\w/])(" + "|".join(map(re.escape, names)) + r")(?![\w])")
    lines, found, i = text.splitlines(), [], 0
    while i < len(lines):
        if len(set(pattern.findall(lines[i]))) < 4:
            i += 1
            continue
        start, seen = i, []
        while start > 0 and pattern.search(lines[start - 1]) and \
                not (found and found[-1][2] >= start - 1):  # a list may open on a line naming one
            start -= 1
        i = start
        while i < len(lines) and pattern.search(lines[i]):
            for name in pattern.findall(lines[i]):
                if name not in seen:
                    seen.append(name)
            i += 1
        found.append((start + 1, seen, i - 1))
    return [(line, seen) for line, seen, _ in found]


def test_every_pass_list_is_the_pipeline():
    """docs/index.md, architecture.md, compile_time.md and passes/__init__.py each list the
    passes; they used to give three different lists. Each list must be PIPELINE, in its order."""
    from fusec.passes import PIPELINE
    names = [p.__name__ for p in PIPELINE]
    wrong = []
    for path in DOCS + [ROOT / "passes" / "__init__.py"]:
        for line, listed in pass_lists(path.read_text(), names):
            if listed != names:
                wrong.append(f"  {rel(path)}:{line}: {', '.join(listed)}")
    assert not wrong, ("pass lists that are not PIPELINE (" + ", ".join(names) + "):\n" +
                       "\n".join(wrong))


def test_the_pass_list_check_sees_lists():
    names = ["dce", "cse", "layout", "schedule", "simplify"]
    text = ("x\nPIPELINE = [dce, cse, layout, schedule,\n  simplify]\n\nprose: dce, cse, layout\n"
            "| dce | x |\n| cse, layout | y |\n\n[dce](dce.md), [cse](cse.md), [layout](layout.md), "
            "[schedule](s.md)\n")
    assert pass_lists(text, names) == [(2, names), (9, ["dce", "cse", "layout", "schedule"])]


def test_the_pass_pages_are_generated_from_the_pipeline():
    """docs/architecture.md's list of the pass pages is what `pass_pages()` makes of
    `passes.pipeline()` (the extensions' passes included, each marked as its extension's), every
    page it links exists, and docs/passes/ holds a page for each core pass and nothing else: an
    extension's pass pages live in the extension."""
    from fusec import passes
    found = PASS_PAGES.search((ROOT / PASS_PAGES_DOC).read_text())
    assert found, f"{PASS_PAGES_DOC} lost its generated list (its markers: {PASS_PAGES_BEGIN!r})"
    assert found.group(1) == pass_pages(), (
        f"{PASS_PAGES_DOC}'s list of the pass pages is not the pipeline's: "
        "python tests/test_docs.py --pass-pages rewrites it")
    extension_passes = [p for p in passes.pipeline() if isinstance(p, passes.ExtensionPass)
                        and p.module.startswith("fusec.extensions.")]
    assert {"sibling_gemvs", "small_matmul"} <= {p.name for p in extension_passes}
    assert all(f"[{p.name}](../extensions/" in found.group(1) for p in extension_passes)
    links = re.findall(r"\]\(([^)]+)\)", found.group(1))
    assert len(links) == len(passes.PIPELINE) + len(extension_passes)
    missing = [link for link in links if not (ROOT / "docs" / link).resolve().is_file()]
    assert not missing, f"pass pages the list links that do not exist: {missing}"
    core = {p.__name__ for p in passes.PIPELINE}
    pages = {page.stem for page in (ROOT / "docs" / "passes").glob("*.md")}
    assert pages == core, (f"docs/passes/ pages of no core pass: {sorted(pages - core)}; "
                           f"core passes without a page: {sorted(core - pages)}")


def test_the_pass_pages_list_marks_an_extensions_pass(monkeypatch):
    """A pass registered from an extension's module is listed just before the core pass it
    names, marked as that extension's and linked to its page in that extension's docs/."""
    from fusec import passes
    monkeypatch.setattr(passes, "REGISTERED", [passes.ExtensionPass(
        "shuffle", "fusec.extensions.demo_family.shuffle", before="dce")])
    text = pass_pages().replace("\n", " ")
    assert ("[check_gathers](passes/check_gathers.md), [shuffle](../extensions/demo_family/docs/"
            "shuffle.md) (extension demo_family), [dce](passes/dce.md)") in text
    monkeypatch.setattr(passes, "REGISTERED", [passes.ExtensionPass(
        "from_a_test", "tests.some_test", before="dce")])
    assert "from_a_test" not in pass_pages()

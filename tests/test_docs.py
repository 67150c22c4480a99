"""Every code block in the docs runs, so the docs never go stale.

* Every ```python block of README.md, docs/**/*.md and extensions/**/*.md runs: a file's blocks run in order in one
  namespace (a block may use what an earlier one defined), in a fresh Python process per file,
  in a scratch directory, with TRITON_INTERPRET=1 (no GPU needed) and no FUSEC_LOG /
  FUSEC_DEBUG_DIR from the outside. Output listings are ```text blocks, never ```python.
* A block's printed output is checked: an output block, fenced as ```text output (or ```cpp
  output, any language followed by the word `output`), is what the nearest ```python or ```bash
  block above it prints (stdout and stderr; prose may sit between), compared after `normalize`
  (see VARIES: times, ratios, addresses, hashes, scratch paths and errors against eager vary
  between runs and machines, so both sides have them replaced by a placeholder), with a line
  `...` standing for any number of lines. When the code changes what it prints, the test fails
  naming the block; `python tests/test_docs.py --refresh docs/page.md` rewrites every output
  block that no longer matches with what the code prints now (`...` lines of blocks that still
  match stay). A listing right after a python or bash block that is not an output block must say
  why, in an HTML comment just before it: `<!-- not checked: printed on an H100 -->`
  (test_every_listing_after_code_is_checked), so a reader sees which listings are checked.
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


def is_output(info: str) -> bool:
    """Is a fence with this info string (what follows its language) an output block?"""
    return "output" in info.split()


def blocks(path: Path, lang: str) -> list[str]:
    """The bodies of `path`'s code blocks in `lang` (output blocks are not code)."""
    return [body for kind, info, body in FENCE.findall(path.read_text())
            if kind == lang and not is_output(info)]


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


# Each block runs as lines of its page: compiled under the page's name with the page's line numbers,
# and the page's code lines in linecache, so that a warning, a traceback or fusec's own messages
# name `docs/page.md:34` and show that line's code, as they would for a script.
RUNNER = r"""
import contextlib, io, json, linecache, sys
blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
printed = []
pages = {}
for where, code in blocks:
    page, _, line = where.rpartition(":")
    lines = pages.setdefault(page, [])
    lines.extend(["\n"] * (int(line) - 1 + code.count("\n") - len(lines)))
    lines[int(line) - 1:int(line) - 1 + code.count("\n")] = code.splitlines(True)
for page, lines in pages.items():
    linecache.cache[page] = (sum(map(len, lines)), None, lines, page)
for i, (where, code) in enumerate(blocks):
    print(f"----- block {i + 1}/{len(blocks)} ({where})", flush=True)
    page, _, line = where.rpartition(":")
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            exec(compile("\n" * (int(line) - 1) + code, page, "exec"), namespace)
    finally:
        sys.stdout.write(buffer.getvalue())
        printed.append(buffer.getvalue())
        json.dump(printed, open("printed.json", "w"))
"""

# what varies between runs of the same code, replaced before outputs are compared
VARIES = [
    # the cache directory in a cached file's path (~/.cache/fusec, or $FUSEC_CACHE_DIR)
    (re.compile(r"(?:~|/[\w.@+-]+)(?:/[\w.@+-]+)*?(?=/(?:cpp|llvm|triton)/[\w.-]+-[0-9a-f]{20}\.)"),
     "<cache>"),
    (re.compile(r"/tmp/[^\s'\")]*"), "<tmp>"),  # scratch directories and files
    (re.compile(r"\b0x[0-9a-fA-F]{6,}\b"), "0x<address>"),
    (re.compile(r"\b[0-9a-f]{20}\b"), "<hash>"),  # content hashes in cache file names
    (re.compile(r"\d+(\.\d+)?(e-?\d+)?\s*(ms|us|µs|ns|s)\b"), "<time>"),
    (re.compile(r"±\d+(\.\d+)?%"), "±<spread>"),  # the spread of a time over rounds
    # a ratio of two times, and which way it went ("1.57x less", "5.10x more")
    (re.compile(r"\b\d+\.\d+x\b(?: (?:more|less)\b)?"), "<ratio>"),
    # an error against eager or float64 (its rounding differs with the CPU's vector width)
    (re.compile(r"\b\d\.\d+e-\d+\b"), "<error>"),
]


def normalize(text: str) -> list[str]:
    """`text`'s lines with what varies between runs replaced, trailing blanks dropped."""
    for pattern, stand_in in VARIES:
        text = pattern.sub(stand_in, text)
    # a run of spaces counts as one: a table's column widths follow the numbers in it
    lines = [re.sub(r" {2,}", " ", line.rstrip()) for line in text.rstrip().splitlines()]
    return lines


def matches(shown: str, printed: str) -> bool:
    """Does the doc's output block `shown` show what the code `printed`? (`...` lines: any)"""
    want, got = normalize(shown), normalize(printed)
    pattern = "".join("(?:.*\n)*?" if line.strip() == "..." else re.escape(line) + "\n"
                      for line in want)
    return re.fullmatch(pattern, "".join(line + "\n" for line in got)) is not None


def line_of(text: str, m: re.Match) -> int:
    """The line number of a fence's opening line."""
    return text[:m.start()].count("\n") + 1


def code_and_outputs(text: str) -> list[tuple[str, int, re.Match, re.Match | None]]:
    """Each ```python or ```bash block of `text` (output blocks are not code): (its language, its
    index among the blocks of that language, its match, the output block that shows what it
    prints or None). An output block belongs to the nearest python or bash block above it."""
    found, count = [], {"python": 0, "bash": 0}
    for m in FENCE.finditer(text):
        if is_output(m.group(2)):
            assert found, f"the output block at line {line_of(text, m)} has no code above it"
            lang, i, code, shown = found[-1]
            assert shown is None, (f"two output blocks (lines {line_of(text, shown)} and "
                                   f"{line_of(text, m)}) for one code block: join them")
            found[-1] = (lang, i, code, m)
        elif m.group(1) in count:
            found.append((m.group(1), count[m.group(1)], m, None))
            count[m.group(1)] += 1
    return found


def output_blocks(text: str, lang: str = "python") -> dict[int, re.Match]:
    """{index of a `lang` block in the file: the output block that shows what it prints}."""
    return {i: shown for kind, i, _, shown in code_and_outputs(text)
            if kind == lang and shown is not None}


def run_blocks(path: Path, where: Path):
    """Run `path`'s python blocks (see the module docstring); (process result, printed list)."""
    text = path.read_text()
    found = []
    for m in FENCE.finditer(text):
        if m.group(1) == "python" and not is_output(m.group(2)):
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
    assert matches("load('~/.cache/fusec/cpp/f-0123456789abcdef0123.so')  err 2.4e-07\n"
                   "  launches     16   12\n  time   9.463 ms   48.283 ms",
                   "load('/tmp/p/cache/cpp/f-fedcba9876543210fedc.so')  err 8.9e-08\n"
                   "  launches   16     12\n  time    10.588 ms 37.886 ms")
    assert not matches("  launches 16 12", "  launches 16 13")
    assert matches("time 9.4 ms ±3%  5.10x more", "time 2.5 ms ±725%  3.93x less")
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


def run_bash(body: str, where: Path) -> subprocess.CompletedProcess:
    """Run a bash block in the directory `where`; its stdout holds stdout and stderr together,
    as a terminal shows them."""
    lines = [line for line in body.splitlines() if line.strip() not in SKIP_LINES]
    # `fusec` is this checkout's CLI, whatever is installed on PATH
    script = (f'set -e\nfusec() {{ "{sys.executable}" -m fusec.cli "$@"; }}\n'
              + "\n".join(lines))
    return subprocess.run(["bash", "-c", script], cwd=where, env=clean_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)


def bash_output_block(key: tuple, body: str) -> re.Match | None:
    """The output block that shows what the bash block `body` of the page key[0] prints."""
    text = (ROOT / key[0]).read_text()
    return next((shown for kind, _, code, shown in code_and_outputs(text)
                 if kind == "bash" and code.group(3) == body), None)


@pytest.mark.parametrize("key,body", bash_blocks(), ids=_id)
def test_bash_blocks_run(key, body, tmp_path):
    out = run_bash(body, tmp_path)
    assert out.returncode == 0, out.stdout[-12000:]
    shown = bash_output_block(key, body)
    assert shown is None or matches(shown.group(3), out.stdout), (
        f"the output block at {key[0]}:{line_of((ROOT / key[0]).read_text(), shown)} no longer "
        f"shows what `{key[1]}` prints (refresh it: python tests/test_docs.py --refresh {key[0]});"
        f" it prints now:\n{out.stdout[:3000]}")


def refresh(path: Path) -> int:
    """Rewrite each output block of `path` that the code no longer prints (the rest, with their
    `...` lines, stay); returns how many were rewritten."""
    import tempfile
    with tempfile.TemporaryDirectory() as scratch:
        out, found, printed = run_blocks(path, Path(scratch))
    if out.returncode != 0:
        raise SystemExit(f"{rel(path)}: a block failed:\n{out.stderr[-4000:]}")
    text = path.read_text()
    stale = [(block, now) for _, block, now in stale_outputs(path, found, printed)]
    for kind, _, code, shown in code_and_outputs(text):
        if kind == "bash" and shown is not None:
            with tempfile.TemporaryDirectory() as scratch:
                ran = run_bash(code.group(3), Path(scratch))
            if ran.returncode != 0:
                raise SystemExit(f"{rel(path)}:{line_of(text, code)}: the block failed:\n"
                                 f"{ran.stdout[-4000:]}")
            if not matches(shown.group(3), ran.stdout):
                stale.append((shown, ran.stdout))
    for block, now in sorted(stale, key=lambda s: -s[0].start()):
        text = text[:block.start(3)] + now.rstrip() + "\n" + text[block.end(3):]
    path.write_text(text)
    return len(stale)


NOT_CHECKED = re.compile(r"<!-- not checked: [^>]*\S[^>]*-->\s*$")


def unchecked_listings(text: str) -> list[int]:
    """Line numbers of the listings of `text` that sit right after a python or bash block (only
    blank lines and HTML comments between), are not output blocks, and carry no
    `<!-- not checked: why -->` comment."""
    fences, bad = list(FENCE.finditer(text)), []
    for a, b in zip(fences, fences[1:]):
        between = re.sub(r"<!--.*?-->", "", text[a.end():b.start()], flags=re.S)
        if a.group(1) in ("python", "bash") and not is_output(a.group(2)) \
                and not is_output(b.group(2)) and not between.strip() \
                and not NOT_CHECKED.search(text[a.end():b.start()]):
            bad.append(line_of(text, b))
    return bad


def test_every_listing_after_code_is_checked():
    """A listing right after a code block shows what it prints: it is an output block (checked),
    or an HTML comment before it says why it is not. An output block belongs to a block that
    runs."""
    bad = [f"  {rel(path)}:{line}" for path in DOCS for line in unchecked_listings(path.read_text())]
    assert not bad, ("listings right after a code block that are neither ```text output blocks "
                     "nor marked <!-- not checked: why -->:\n" + "\n".join(bad))
    for path in DOCS:
        text = path.read_text()
        for kind, _, code, shown in code_and_outputs(text):
            first = code.group(3).strip().splitlines()[0]
            if shown is not None and kind == "bash":
                assert (rel(path), first) not in SKIP_BASH and (rel(path), first) not in NOT_RUN, \
                    f"{rel(path)}:{line_of(text, shown)}: an output block of a block that is not run"


def test_the_listing_check_sees_unmarked_listings():
    text = ("```python\nprint(1)\n```\n\n```\n1\n```\n\n```python\nprint(2)\n```\n"
            "<!-- not checked: printed on a GPU -->\n```text\n2\n```\n\n```bash\nfusec x\n```\n"
            "```text output\nx\n```\n\nprose\n\n```text\nnot after code\n```\n")
    assert unchecked_listings(text) == [5]
    assert [(kind, i, shown is not None) for kind, i, _, shown in code_and_outputs(text)] == [
        ("python", 0, False), ("python", 1, False), ("bash", 0, True)]


# ---- the README is a front door ------------------------------------------------------------------

QUICK_START = ['pip install "torch==2.13.0" -e ".[dev]" && fusec demo', "python -m pytest -q"]
# a benchmark figure: a speedup (1.6x, 2.3×), a time (12 ms, 40 µs) or a rate (GB/s, TFLOP/s, tokens/s)
FIGURE = re.compile(r"\b\d+(?:\.\d+)?\s*(?:[x×](?!\w)|(?:ms|us|µs|ns)\b|(?:GB|TB|TFLOP|GFLOP|tokens?)/s\b)")


def test_the_readme_first_screen_says_what_fusec_is_and_how_to_run_it():
    """The first 40 lines: a paragraph that says what fusec is, the two Quick start commands
    verbatim, one short example with its checked output, and what to read next."""
    text = (ROOT / "README.md").read_text()
    screen = "\n".join(text.splitlines()[:40])
    assert re.search(r"^fusec is a \w[^\n]*compiler", screen, re.M), "no 'fusec is a ... compiler' paragraph"
    assert "```bash\n" + "\n".join(QUICK_START) + "\n```" in screen, "the Quick start commands changed"
    example = [(code, shown) for kind, _, code, shown in code_and_outputs(screen) if kind == "python"]
    assert example and example[0][1] is not None, "no example with its output block"
    assert len(example[0][0].group(3).splitlines()) <= 12, "the first example is longer than ~10 lines"
    assert re.search(r"^## What to read next\n\n\* \[", screen, re.M), "no 'What to read next' list"


def test_the_readme_maps_every_example():
    """The README's map of the layout names every file of examples/."""
    text = (ROOT / "README.md").read_text()
    line = text[text.index("\nexamples/"):]
    mapped = set(re.findall(r"\w+", line[:line.index("\n", line.index("python examples/"))]))
    missing = sorted(p.stem for p in (ROOT / "examples").glob("*.py")
                     if p.stem != "__init__" and p.stem not in mapped)
    assert not missing, f"examples the README's map leaves out: {missing}"


def test_the_readme_carries_at_most_three_benchmark_figures():
    """The numbers live in docs/performance.md; the README may quote three at most."""
    found = FIGURE.findall((ROOT / "README.md").read_text())
    assert len(found) <= 3, f"{len(found)} benchmark figures in README.md: {found}"
    assert FIGURE.findall("1.62× faster, 2.3x, 0.5 ms and 900 GB/s; not 0x1f, 3x3 kernel, max/s") \
        == ["1.62×", "2.3x", "0.5 ms", "900 GB/s"]


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
    """Rewrite the generated list in PASS_PAGES_DOC and the passes of PIPELINE_DOC's diagram;
    returns whether either changed."""
    changed = False
    for name, rewrite in ((PASS_PAGES_DOC, lambda text: PASS_PAGES.sub(
            lambda m: f"{PASS_PAGES_BEGIN}\n{pass_pages()}\n{PASS_PAGES_END}", text, count=1)),
                          (PIPELINE_DOC, lambda text: PIPELINE_LINES.sub(
                              lambda m: pipeline_lines(), text, count=1))):
        path = ROOT / name
        text = path.read_text()
        now = rewrite(text)
        if now != text:
            path.write_text(now)
            changed = True
    return changed


PIPELINE_DOC = "docs/index.md"
PIPELINE_MARK = ("<!-- the passes of this diagram are generated from passes.pipeline(): "
                 "python tests/test_docs.py --pass-pages -->")
PIPELINE_FIRST = "   │  passes/ (PIPELINE)    "
PIPELINE_MORE = "   │                        "
# from the diagram's passes line down to (not including) the line that says what a pass is
PIPELINE_LINES = re.compile("^" + re.escape(PIPELINE_FIRST) + r".*?(?=^" + re.escape(PIPELINE_MORE)
                            + r"each `def pass)", re.S | re.M)


def pipeline_lines() -> str:
    """The passes of docs/index.md's pipeline diagram, in the order `passes.pipeline()` runs them,
    wrapped under the diagram's `passes/` label; an extension's pass is starred, and a last line
    says whose it is."""
    import textwrap
    from fusec import passes
    names, owners = [], []
    for p in passes.pipeline():
        if not isinstance(p, passes.ExtensionPass):
            names.append(p.__name__)
        elif p.module.startswith("fusec.extensions."):
            names.append(p.name + "*")
            if (folder := p.module.split(".")[2]) not in owners:
                owners.append(folder)
    lines = textwrap.wrap(" → ".join(names), width=100 - len(PIPELINE_FIRST),
                          break_long_words=False, break_on_hyphens=False)
    if owners:
        lines.append("(* registered by " + ", ".join(f"extensions/{o}/" for o in owners) +
                     ", before the pass it names)")
    return "".join((PIPELINE_FIRST if i == 0 else PIPELINE_MORE) + line + "\n"
                   for i, line in enumerate(lines))


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description="Rewrite the output blocks of docs whose code "
                                     "prints something else now (see the module docstring), or "
                                     "the generated list of the pass pages.")
    parser.add_argument("--refresh", nargs="+", default=[], metavar="FILE")
    parser.add_argument("--pass-pages", action="store_true",
                        help=f"rewrite the list of the pass pages in {PASS_PAGES_DOC} and the "
                        f"passes of the pipeline diagram in {PIPELINE_DOC}")
    args = parser.parse_args()
    if not args.refresh and not args.pass_pages:
        parser.error("nothing to do: give --refresh FILE... or --pass-pages")
    for name in args.refresh:
        print(f"{name}: {refresh(ROOT / name)} output block(s) rewritten")
    if args.pass_pages:
        print(f"{PASS_PAGES_DOC}, {PIPELINE_DOC}: "
              f"{'rewritten' if write_pass_pages() else 'already up to date'}")


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


def test_the_index_pipeline_is_generated_from_the_pipeline():
    """docs/index.md's pipeline diagram names the passes `passes.pipeline()` runs, in its order
    (the extensions' passes starred), as `pipeline_lines()` writes them, under its marker."""
    text = (ROOT / PIPELINE_DOC).read_text()
    assert PIPELINE_MARK + "\n```text\n" in text, f"{PIPELINE_DOC} lost its marker {PIPELINE_MARK!r}"
    found = PIPELINE_LINES.search(text)
    assert found, f"{PIPELINE_DOC}'s diagram lost its `passes/ (PIPELINE)` line"
    assert found.group(0) == pipeline_lines(), (
        f"{PIPELINE_DOC}'s pipeline is not passes.pipeline(): python tests/test_docs.py "
        "--pass-pages rewrites it")
    flowing = " ".join(line.split("│")[-1].strip() for line in pipeline_lines().splitlines())
    assert "sibling_gemvs* → small_matmul* → pad_matmul" in flowing


def test_the_pass_pages_list_marks_an_extensions_pass(monkeypatch):
    """A pass registered from an extension's module is listed just before the core pass it
    names, marked as that extension's and linked to its page in that extension's docs/."""
    from fusec import passes
    monkeypatch.setattr(passes, "REGISTERED", [passes.ExtensionPass(
        "shuffle", "fusec.extensions.demo_family.shuffle", before="dce")])
    text = pass_pages().replace("\n", " ")
    assert ("[check_divisors](passes/check_divisors.md), [shuffle](../extensions/demo_family/"
            "docs/shuffle.md) (extension demo_family), [dce](passes/dce.md)") in text
    monkeypatch.setattr(passes, "REGISTERED", [passes.ExtensionPass(
        "from_a_test", "tests.some_test", before="dce")])
    assert "from_a_test" not in pass_pages()

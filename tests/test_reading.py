"""docs/reading.md, the reading path through the core, kept true by walking a compile.

The page names files and, on the path, the functions to read in each. Here: every named function
exists, and every file of the path runs; the lines of the path and the files and lines of the
walk are what the page says; and compiling
`sin(x) * 2` and a softmax on every backend, with a profiler hook that records the file of every
Python function called (in this thread and in fusec's build threads), runs code only in files the
page names. A new file on the compile's way fails this test until the page says where it fits.
"""
from __future__ import annotations

import ast
import re
import sys
import threading
from pathlib import Path

import pytest
import torch

import fusec
from conftest import TRITON_DEVICE

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reading.md"
FILE = re.compile(r"^[\w/.]+\.(py|j2)$")
NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)?$")


def sections() -> dict[str, str]:
    text = PAGE.read_text()
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {title: body for title, body in zip(parts[1::2], parts[2::2])}


def named_in(text: str) -> list[tuple[str, list[str]]]:
    """[(file, [the names after it, up to the next file])] for every `file` in backticks."""
    found: list[tuple[str, list[str]]] = []
    for token in re.findall(r"`([^`]+)`", text):
        if FILE.match(token):
            found.append((token, []))
        elif found and NAME.match(token):
            found[-1][1].append(token)
    return found


def definitions(path: Path) -> dict[str, ast.AST]:
    """Top-level functions and classes of a file, and `Class.method` for their methods."""
    tree = ast.parse(path.read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found[node.name] = node
            for inner in getattr(node, "body", []) if isinstance(node, ast.ClassDef) else []:
                if isinstance(inner, ast.FunctionDef):
                    found[f"{node.name}.{inner.name}"] = inner
    return found


def path_stops():
    return named_in(sections()["The path"])


def listed_files() -> set[str]:
    return {f for body in sections().values() for f, _ in named_in(body)}


def path_files() -> set[str]:
    return {f for f, _ in path_stops()}


BACKEND_TITLES = {"cpp": "C++", "llvm": "LLVM", "triton": "Triton"}


def backend_files(backend: str) -> set[str]:
    """The files the page lists under "### <the backend>" in "The backends"."""
    parts = re.split(r"^### (.+)$", sections()["The backends"], flags=re.M)
    body = dict(zip(parts[1::2], parts[2::2]))[BACKEND_TITLES[backend]]
    return {f for f, _ in named_in(body)}


def test_every_stop_on_the_path_exists():
    stops = path_stops()
    assert len(stops) >= 15
    missing = []
    for file, names in stops:
        assert (ROOT / file).exists(), file
        if file.endswith(".py"):
            defs = definitions(ROOT / file)
            missing += [f"{file}: {n}" for n in names if n not in defs]
    assert not missing, missing
    assert all((ROOT / f).exists() for f in listed_files()), sorted(
        f for f in listed_files() if not (ROOT / f).exists())


def path_lines() -> int:
    """The lines of the functions and classes the path names (each counted once)."""
    total = 0
    for file, names in path_stops():
        if file.endswith(".py"):
            defs = definitions(ROOT / file)
            total += sum(defs[n].end_lineno - defs[n].lineno + 1 for n in set(names))
    return total


def walk(backend: str) -> set[str]:
    """The files of every project function that runs while two programs compile and run."""
    seen: set[str] = set()
    root = str(ROOT) + "/"

    def hook(frame, event, arg):
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(root) and "/tests/" not in name and "-packages/" not in name:
                seen.add(name[len(root):])
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    x = torch.randn(33, 17, device=device)
    programs = [lambda x: torch.sin(x) * 2, lambda x: torch.softmax(x, dim=-1)]
    compiled = [fusec.compile(f, backend=backend) for f in programs]
    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        results = [cf(x) for cf in compiled]
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    for f, result in zip(programs, results):
        torch.testing.assert_close(result, f(x))
    return seen


@pytest.fixture(scope="module")
def walks(tmp_path_factory):
    """One walk per backend, with a cache of their own: every kernel is rendered and built."""
    mp = pytest.MonkeyPatch()
    mp.setenv("FUSEC_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    mp.setenv("FUSEC_SAVED_PROGRAMS", "0")
    try:
        yield {backend: walk(backend) for backend in ("cpp", "llvm", "triton")}
    finally:
        mp.undo()


@pytest.mark.parametrize("backend", ["cpp", "llvm", "triton"])
def test_a_compile_runs_only_the_path_and_its_backend(walks, backend):
    outside = sorted(walks[backend] - path_files() - backend_files(backend))
    assert not outside, (f"{backend}: functions ran in files that are neither on docs/reading.md's "
                         f"path nor the backend's own: {outside}")


def test_the_path_is_at_most_3000_lines():
    assert path_lines() <= 3000, path_lines()


def test_every_file_of_the_path_runs(walks):
    """The path is the compile as it runs: each of its Python files runs a function on the C++
    backend (the backend it follows)."""
    idle = [f for f, _ in path_stops() if f.endswith(".py") and f not in walks["cpp"]]
    assert not idle, f"docs/reading.md's path names files the compile does not run: {idle}"


def lines_of(files) -> int:
    return sum(len((ROOT / f).read_text().splitlines()) for f in files if f.endswith(".py"))


def test_the_page_says_how_long_the_path_and_the_walk_are(walks):
    text = sections()["How long the path is"]
    lines = int(re.search(r"about (\d+) lines", text).group(1))
    found = re.search(r"counts at most (\d+)\s+files\s+and\s+([\d,]+)\s+lines", text)
    files, walk_lines = int(found.group(1)), int(found.group(2).replace(",", ""))
    assert abs(lines - path_lines()) <= 0.1 * path_lines(), (lines, path_lines())
    # At most: a module first imported during the walk, or a function whose result an earlier
    # compile in the same process cached, makes the count vary a little from run to run.
    assert len(walks["cpp"]) <= files, (files, len(walks["cpp"]))
    assert lines_of(walks["cpp"]) <= walk_lines, (walk_lines, lines_of(walks["cpp"]))
    llvm, triton = map(int, re.search(r"at most (\d+) and (\d+) files on LLVM and Triton",
                                      " ".join(text.split())).groups())
    assert len(walks["llvm"]) <= llvm, (llvm, len(walks["llvm"]))
    assert len(walks["triton"]) <= triton, (triton, len(walks["triton"]))

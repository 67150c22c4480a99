"""The layout's rules, checked on the source: no import cycles, inspection above the core, short files.

Every module of the installed package (fusec/, and passes/, codegen/, examples/, which install as
fusec.passes, fusec.codegen and fusec.examples: pyproject.toml's package-dir) is parsed with `ast`,
and every import in it, at the top or inside a function, becomes an edge of one directed graph
(networkx). Then:

1. the graph has no cycle at all: two modules never import each other, directly or around a
   loop. A function-local import counts like any other, so hiding a circle inside a function
   body does not make it go away;
2. the core never imports the inspection tools (fusec/inspect/): they read the core, and the core
   publishes what happened (fusec/events.py) instead of calling them. Only the public face
   (fusec/__init__.py, the command line, the demo, the examples) may import both. The core does
   not import the `fusec` package itself either: that would bring inspect/ in through the back;
3. a file over 400 lines says why, in the opening of its module docstring, on a line that starts
   with "Why this file is long:" (the op table is one table; splitting it would scatter it);
4. outside codegen/ and extensions/, nothing tests a backend's name (`backend == "triton"`): it
   asks the backend registry (codegen/backends.py) for the feature it means. ("auto" is an option, not a backend.)
5. the core never imports extensions/ (kernel families: the quantized GEMVs); it reaches them
   through codegen/families.py, by name (fusec/__init__.py registers them);
6. no module reaches into another's underscore names (`from fusec.passes.layout import _run_fake`,
   `schedule._fake_mode(gm)`): a leading underscore says "only this file uses it", and a reader
   can trust that. What two files share is public, with a docstring that says what it is for.
7. a function over 80 lines (def or async def, methods and nested functions too, counted from its
   `def` line to its last line, docstring included) says why, in its docstring, on a line that
   starts with "Why this function is long:" and gives the reason. A long function is cut along
   the steps it already performs, each a named helper; the top function then reads as the list.
8. the core (every file under fusec/, passes/ and codegen/, templates included) never names an
   extension's formats or its family, in code, comments or docstrings: each extension declares
   the words it names itself by (a top-level `NAMES` in one of its modules: the quantized GEMVs'
   family.py says "gemv", "int4", "awq", ...) and a core word is flagged when it, or a part of
   it, begins with one of them. The core speaks of what a kernel does ("a matmul of few rows",
   "a packed 4-bit weight"), and a reader who opens it meets no special case.
"""
from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"fusec": "fusec", "passes": "fusec.passes", "codegen": "fusec.codegen",
            "extensions": "fusec.extensions",
            "examples": "fusec.examples"}
FACE = {"fusec", "fusec.cli", "fusec.demo"}  # plus fusec.examples.*: may import any room
# folders beside a package that are not fusec: scripts run by hand (extensions/<name>/diagnostics/)
# and an extension's own tests (extensions/<name>/tests/, collected by pytest, not installed)
NOT_MODULES = {"diagnostics", "tests"}
MAX_LINES = 400
REASON = "Why this file is long:"


def modules() -> dict[str, Path]:
    """Dotted module name -> its file, for every .py file of the package."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if NOT_MODULES & set(parts[:-1]):
                continue
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def imported(name: str, path: Path, node: ast.Import | ast.ImportFrom, known: set[str]) -> list[str]:
    """The modules of `known` that one import statement of module `name` (file `path`) loads."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the module's package, `level - 1` packages up
            package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            package = package[:len(package) - (node.level - 1)]
            base = ".".join(package + ([node.module] if node.module else []))
        # `from fusec.codegen import cpp` loads the module fusec.codegen.cpp; `from fusec.ir
        # import Layout` loads fusec.ir
        targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                   for alias in node.names]
    out = []
    for target in targets:
        while target and target not in known:  # `import torch.fx`: not ours; `import a.b.c`: a.b.c
            target = target.rpartition(".")[0]
        if target and target != name:
            out.append(target)
    return out


def import_graph() -> nx.DiGraph:
    known = modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(known)
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in imported(name, path, node, set(known)):
                    graph.add_edge(name, target, line=f"{path.relative_to(ROOT)}:{node.lineno}")
    return graph


def _where(graph: nx.DiGraph, cycle: list[tuple]) -> str:
    return "\n".join(f"  {a} -> {b}   ({graph.edges[a, b]['line']})" for a, b, *_ in cycle)


def test_the_graph_sees_the_imports_it_should():
    """A guard on the guard: the parser finds top-level, function-level and relative imports."""
    graph = import_graph()
    assert graph.has_edge("fusec.driver", "fusec.passes")  # top level
    assert graph.has_edge("fusec.passes", "fusec.passes.dce")  # relative, in a package
    assert graph.has_edge("fusec.codegen.llvm", "fusec.codegen.llvm.compiler")  # `from . import x`
    assert len(graph) > 60 and graph.number_of_edges() > 150


def test_the_skipped_folders_ship_nothing():
    """A guard on the guard: the folders modules() skips (NOT_MODULES: an extension's tests/ and
    diagnostics/) are no package pyproject.toml installs, so every rule here still reads all
    that fusec ships; and an extension's own modules are read, its test modules are not."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        installed = tomllib.load(f)["tool"]["setuptools"]["packages"]
    assert not [p for p in installed if NOT_MODULES & set(p.split("."))]
    found = modules()
    assert "fusec.extensions.quant_gemv.family" in found
    assert (ROOT / "extensions/quant_gemv/tests/test_small_matmul.py").exists()
    assert not [name for name in found if ".tests." in name]


def test_no_import_cycles():
    graph = import_graph()
    cycles = []
    while True:
        try:
            cycle = nx.find_cycle(graph)
        except nx.NetworkXNoCycle:
            break
        cycles.append(cycle)
        graph.remove_edge(*cycle[0][:2])  # find the next one too, so one run lists them all
    assert not cycles, "import cycles:\n" + "\n\n".join(_where(import_graph(), c) for c in cycles)


def is_inspect(name: str) -> bool:
    return name == "fusec.inspect" or name.startswith("fusec.inspect.")


def is_face(name: str) -> bool:
    return name in FACE or name.startswith("fusec.examples")


def test_the_core_never_imports_inspection():
    graph = import_graph()
    wrong = [(a, b) for a, b in graph.edges
             if not is_inspect(a) and not is_face(a) and (is_inspect(b) or b == "fusec")]
    assert not wrong, "core modules that import fusec.inspect (or the whole fusec package):\n" + \
        "\n".join(f"  {a} -> {b}   ({graph.edges[a, b]['line']})" for a, b in wrong)


def test_long_files_say_why():
    too_long = []
    for name, path in modules().items():
        lines = path.read_text().splitlines()
        if len(lines) <= MAX_LINES:
            continue
        doc = ast.get_docstring(ast.parse("\n".join(lines))) or ""
        opening = doc.splitlines()[:30]
        if not any(line.startswith(REASON) for line in opening):
            too_long.append(f"  {path.relative_to(ROOT)}: {len(lines)} lines")
    assert not too_long, (f"files over {MAX_LINES} lines without a line starting {REASON!r} in "
                          "the opening of their module docstring:\n" + "\n".join(too_long))


BACKEND_NAMES = {"triton", "cpp", "llvm"}


def _names_a_backend(node: ast.AST) -> bool:
    """`backend`, `k.backend`, `self.backend`, `chosen`: an expression that holds a backend name."""
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return name in ("backend", "chosen")


def _backend_strings(node: ast.AST) -> set[str]:
    values = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {v.value for v in values if isinstance(v, ast.Constant) and v.value in BACKEND_NAMES}


def test_no_backend_name_tests_outside_codegen():
    found = []
    for name, path in modules().items():
        if name.startswith("fusec.codegen") or is_extension(name):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(_names_a_backend(s) for s in sides) and \
                        any(_backend_strings(s) for s in sides):
                    found.append(f"  {path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.Dict) and \
                    len({k.value for k in node.keys if isinstance(k, ast.Constant)} & BACKEND_NAMES) > 1:
                found.append(f"  {path.relative_to(ROOT)}:{node.lineno} (a table keyed by backend)")
    assert not found, "backend names tested outside codegen/ (ask codegen/backends.py):\n" + \
        "\n".join(found)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def underscore_reaches() -> list[str]:
    """Every place a module of the package uses another module's underscore name: imported by
    name (`from m import _x`) or read through the module (`m._x`, where `m` names a module of
    ours, however it was imported)."""
    known = modules()
    found = []
    for name, path in known.items():
        tree = ast.parse(path.read_text())
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        aliases = {}  # a local name -> the module of ours it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    above = package[:len(package) - (node.level - 1)]
                    base = ".".join(above + ([node.module] if node.module else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in known:
                        aliases[alias.asname or alias.name] = full
                    elif base in known and base != name and _private(alias.name):
                        found.append(f"  {path.relative_to(ROOT)}:{node.lineno} imports "
                                     f"{base}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in known and alias.asname:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and aliases.get(node.value.id, name) != name and _private(node.attr):
                found.append(f"  {path.relative_to(ROOT)}:{node.lineno} reads "
                             f"{aliases[node.value.id]}.{node.attr}")
    return found


def test_no_module_uses_another_modules_underscore_names():
    found = underscore_reaches()
    assert not found, ("underscore names used outside their module (make them public, with a "
                       "docstring, or move the code):\n" + "\n".join(found))


def test_the_underscore_rule_sees_both_spellings(tmp_path, monkeypatch):
    """A guard on the guard: both ways of reaching in are found."""
    import test_architecture as here
    fake = {"fusec.a": tmp_path / "a.py", "fusec.b": tmp_path / "b.py"}
    fake["fusec.a"].write_text("def _x():\n    pass\n")
    fake["fusec.b"].write_text("from fusec.a import _x\nfrom fusec import a\na._x()\n")
    monkeypatch.setattr(here, "modules", lambda: fake)
    monkeypatch.setattr(here, "ROOT", tmp_path)
    found = here.underscore_reaches()
    assert len(found) == 2 and "imports fusec.a._x" in found[0] and "reads fusec.a._x" in found[1]


def is_extension(name: str) -> bool:
    return name == "fusec.extensions" or name.startswith("fusec.extensions.")


def test_the_core_never_imports_an_extension():
    """Kernel families live in extensions/ (the quantized GEMVs: extensions/quant_gemv/) and the
    core reaches them only through codegen/families.py, by name (fusec/__init__.py registers them)."""
    graph = import_graph()
    assert "fusec.extensions.quant_gemv.family" in graph
    wrong = [(a, b) for a, b in graph.edges if is_extension(b) and not is_extension(a)]
    assert not wrong, "core modules that import an extension (ask codegen/families.py):\n" + \
        "\n".join(f"  {a} -> {b}   ({graph.edges[a, b]['line']})" for a, b in wrong)


MAX_FUNCTION_LINES = 80
FUNCTION_REASON = "Why this function is long:"


def long_functions(source: str) -> list[tuple[int, str, int]]:
    """(line, name, length) for every function of `source` (def or async def, methods and nested
    functions too) over MAX_FUNCTION_LINES lines, counted from `def` to its last line, whose
    docstring has no line starting with FUNCTION_REASON followed by a reason."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        length = node.end_lineno - node.lineno + 1
        if length <= MAX_FUNCTION_LINES:
            continue
        doc = ast.get_docstring(node) or ""
        stated = any(line.strip().startswith(FUNCTION_REASON)
                     and line.strip()[len(FUNCTION_REASON):].strip()
                     for line in doc.splitlines())
        if not stated:
            found.append((node.lineno, node.name, length))
    return sorted(found)


def test_long_functions_say_why():
    too_long = [f"  {path.relative_to(ROOT)}:{line} {name} ({length} lines)"
                for path in modules().values()
                for line, name, length in long_functions(path.read_text())]
    assert not too_long, (f"functions over {MAX_FUNCTION_LINES} lines without a line starting "
                          f"{FUNCTION_REASON!r} in their docstring (cut them along their steps):\n"
                          + "\n".join(too_long))


def test_the_function_rule_sees_long_functions():
    """A guard on the guard: an 81-line function is flagged (a method and a nested one too), an
    80-line one is not, and a stated reason (not an empty one) lets a long one pass."""
    def function(name: str, lines: int, doc: str = "", indent: str = "") -> str:
        head = [f"{indent}def {name}():"] + ([f'{indent}    """{doc}"""'] if doc else [])
        body = [f"{indent}    x = {i}" for i in range(lines - len(head))]
        return "\n".join(head + body) + "\n"
    assert long_functions(function("short", 80)) == []
    assert long_functions(function("long", 81)) == [(1, "long", 81)]
    assert long_functions(function("told", 81, "Why this function is long: one table.")) == []
    assert long_functions(function("empty", 81, "Why this function is long:")) == [(1, "empty", 81)]
    method = "class C:\n" + function("m", 81, indent="    ")
    assert long_functions(method) == [(2, "m", 81)]
    nested = "def outer():\n" + function("inner", 81, indent="    ").replace(
        "def inner", "async def inner")
    assert long_functions(nested) == [(1, "outer", 82), (2, "inner", 81)]
    told = function("told", 81, "Adds up.\n\n    Why this function is long: one table.\n    ")
    assert long_functions(told) == []


CORE_FOLDERS = ("fusec", "passes", "codegen")
CORE_SUFFIXES = {".py", ".j2", ".h"}  # the modules and their templates (codegen/<backend>/templates/)
# A word is a run of letters, digits and underscores (every other character separates words:
# `GPTQ-style`, `AWQ's`); its parts are cut at underscores and where a lower-case letter or a
# digit meets an upper-case one (`render_gemv`: render, gemv; `TritonGemv`: Triton, Gemv). A
# name matches the start of a part, so it also catches `GEMVs`, `dequantized`, `FUSEC_INT4_MMA`,
# but not a name inside a part: `struct.unpack_from("<IBBHQQ", ...)` (a struct format: B, H, Q,
# ...) is no HQQ, and `uint4` (a plain dtype, as int8 is) is no int4. Code, comments, docstrings
# and strings are read alike: a string is prose too (a refusal's reason, a kernel's header).
WORD = re.compile(r"\w+", re.ASCII)
PART = re.compile(r"_+|(?<=[a-z0-9])(?=[A-Z])")


def extension_names() -> dict[str, tuple[str, ...]]:
    """Extension folder -> the words it names itself by: a top-level `NAMES` tuple in any of its
    modules (extensions/<name>/*.py), read with `ast` (the test imports nothing of fusec)."""
    found: dict[str, tuple[str, ...]] = {}
    for module in sorted((ROOT / "extensions").glob("*/*.py")):
        for node in ast.parse(module.read_text()).body:
            if isinstance(node, ast.Assign) and \
                    any(getattr(t, "id", "") == "NAMES" for t in node.targets):
                names = tuple(n.lower() for n in ast.literal_eval(node.value))
                found[module.parent.name] = found.get(module.parent.name, ()) + names
    return found


def named_words(text: str, names: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, word) for every word of `text` that has a part beginning with one of `names`."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for word in WORD.findall(line):
            if any(part.lower().startswith(names) for part in PART.split(word)):
                found.append((number, word))
    return found


def core_files() -> list[Path]:
    return sorted(p for folder in CORE_FOLDERS for p in (ROOT / folder).rglob("*")
                  if p.suffix in CORE_SUFFIXES and "__pycache__" not in p.parts)


def test_the_core_names_no_extension():
    """The core is what a learner reads: the quantized GEMVs are an extension (extensions/
    quant_gemv/), and the core names neither the family nor the formats it serves."""
    extensions = extension_names()
    assert "quant_gemv" in extensions and "gemv" in extensions["quant_gemv"]
    files = core_files()
    assert {ROOT / name for name in ("codegen/cpp/templates/cpp_prelude.h", "passes/dce.py",
                                     "codegen/triton/templates/triton_reduction.py.j2",
                                     "fusec/__init__.py")} <= set(files)
    assert not any("extensions" in p.relative_to(ROOT).parts for p in files)
    found = []
    for path in files:
        text = path.read_text()
        for extension, names in extensions.items():
            hits = named_words(text, names)
            if hits:
                found.append(f"  {path.relative_to(ROOT)} ({extension}): " + ", ".join(
                    f"{line}:{word}" for line, word in hits))
    assert not found, ("core files that name an extension's formats or family (say what the "
                       "kernel does instead; an extension's story belongs in its README):\n"
                       + "\n".join(found))


def test_the_naming_rule_sees_words_and_parts():
    """A guard on the guard: names in code, comments, docstrings and strings are found, as words
    or their parts, in any case; a name inside a word (a struct format) and int8 are not."""
    names = ("gemv", "int4", "awq", "gptq", "hqq", "quant", "dequant")
    source = '\n'.join([
        '"""Unpacks AWQ\'s nibbles."""',                     # 1: prose in a docstring
        '# a GPTQ-style weight, dequantized once',            # 2: dequantized
        'def render_gemv(x): return TritonGemvs, GEMVs',      # 3: three spellings
        'FLAG = "FUSEC_INT4_MMA"',                            # 4: in a string
        'info = struct.unpack_from("<IBBHQQ", obj, at)',      # 5: a struct format, not HQQ
        'w = x.to(torch.int8) + y.to(torch.uint4)  # a packed 4-bit weight, a matmul of few rows',
        'class Int4Words: pass  # an hqq weight',             # 7
    ])
    assert named_words(source, names) == [
        (1, "AWQ"), (2, "GPTQ"), (2, "dequantized"), (3, "render_gemv"), (3, "TritonGemvs"),
        (3, "GEMVs"), (4, "FUSEC_INT4_MMA"), (7, "Int4Words"), (7, "hqq")]

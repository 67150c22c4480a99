"""The `fusec` command on every file in examples/: `explain` (text, --json, --dot), `kernels` and
`profile --html`, run in-process through fusec.cli.main with the examples' SMALL sizes and the
C++ backend, checking what they print: the kernel count (the same in all three commands, and the
example's expect_kernels when it has one), a speedup field, valid HTML, valid DOT. Also: a file
without example() is a one-line error, and no progress bar reaches captured output."""
import html.parser
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fusec.cli import main as cli
from fusec.demo import load_example

EXAMPLES_DIR = Path(__file__).parent.parent / "examples"
FILES = sorted(p for p in EXAMPLES_DIR.glob("*.py") if p.name != "__init__.py")


def test_every_example_file_is_covered():
    assert {p.stem for p in FILES} >= {"sin4", "add_mul", "maximum_neg_uint8", "strided",
                                       "softmax", "layernorm", "gelu_mlp", "gpt2_block",
                                       "xor_train", "gpt2_train_step"}


def run(capsys, *argv) -> str:
    assert cli(list(argv)) == 0
    captured = capsys.readouterr()
    assert "\x1b[" not in captured.err and "━" not in captured.err  # no progress bar
    return captured.out


class Parser(html.parser.HTMLParser):
    """Checks that every opened tag is closed in order (void elements aside)."""
    VOID = {"meta", "br", "hr", "img", "input", "link", "col", "area", "base", "wbr", "source"}

    def __init__(self):
        super().__init__()
        self.stack, self.tags, self.problems = [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.append(tag)

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.problems.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()


def check_html(text: str) -> Parser:
    p = Parser()
    p.feed(text)
    p.close()
    assert p.problems == [] and p.stack == [], (p.problems, p.stack)
    assert p.tags[0] == "html" and "table" in p.tags and "svg" in p.tags
    return p


def check_dot(text: str) -> None:
    """A digraph with balanced braces and quotes, whose edges name declared nodes."""
    assert re.match(r"\s*digraph\s+\w*\s*\{", text), text[:80]
    assert text.rstrip().endswith("}")
    unquoted = re.sub(r'"(\\.|[^"\\])*"', '""', text)
    assert unquoted.count('"') % 2 == 0
    assert unquoted.count("{") == unquoted.count("}")
    declared = set(re.findall(r"^\s*(\w+)\s*\[", unquoted, re.M))
    for a, b in re.findall(r"(\w+)\s*->\s*(\w+)", unquoted):
        assert a in declared and b in declared, (a, b)
    if shutil.which("dot"):
        out = subprocess.run(["dot", "-Tplain"], input=text, capture_output=True, text=True,
                             timeout=30)
        assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_every_command_on_every_example(path, capsys, tmp_path):
    module = load_example(str(path))
    ex = module.example(**getattr(module, "SMALL", {}))
    common = [str(path), "--backend", "cpp", "--small"]

    # explain: the header counts the kernels, and each one has a section
    out = run(capsys, "explain", *common)
    first = out.splitlines()[0]
    assert first.startswith("fusec explain (cpp backend)")
    n = out.count("\n=== kernel ")
    assert n >= 1 and f"{n} kernel(s)" in first
    if ex.expect_kernels is not None:
        assert n == ex.expect_kernels

    # explain --json --dot: the same kernels as data, and two valid DOT files
    out = run(capsys, "explain", *common, "--json", "--dot", str(tmp_path / "dot"))
    d = json.loads(out)
    assert len(d["kernels"]) == n
    for stage in ("before", "after"):
        check_dot((tmp_path / "dot" / f"graph_{stage}_fusion.dot").read_text())

    # kernels: just the sources, one per kernel
    out = run(capsys, "kernels", *common)
    assert out.count("# ===== fused_") == n and 'extern "C"' in out
    assert [m for m in re.findall(r"# ===== (\S+)", out)] == [k["name"] for k in d["kernels"]]

    # profile --html: a table with a speedup, one line per fused kernel, a valid HTML page
    html_path = tmp_path / "report.html"
    out = run(capsys, "profile", *common, "--iters", "1", "--html", str(html_path))
    assert f"fusec profile: {ex.name}" in out
    assert re.search(r"speedup \d+\.\d+x", out), out
    launches = re.search(r"kernel launches per call\s+(\d+)\s+(\d+)", out)
    assert launches and int(launches.group(2)) >= n
    for k in d["kernels"]:
        assert k["name"][:30] in out
    text = html_path.read_text()
    check_html(text)
    assert all(k["name"] in text for k in d["kernels"])


def test_a_file_without_a_program_is_a_one_line_error(tmp_path, capsys):
    bad = tmp_path / "no_entry.py"
    bad.write_text("import torch\n\ndef f(x):\n    return x + 1\n")
    for command in ("explain", "kernels", "profile"):
        assert cli([command, str(bad), "--backend", "cpp"]) == 1
        message = capsys.readouterr().err.strip()
        assert "\n" not in message and "defines neither example() nor Model" in message
        assert f"{bad}:name" in message  # ... and says how to name one


KERNELBENCH_STYLE = """
import torch
from torch import nn

class Model(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.lin = nn.Linear(n, n)

    def forward(self, x):
        return torch.relu(self.lin(x)) * 2

def get_inputs():
    return [torch.randn(4, 16)]

def get_init_inputs():
    return [16]

def act(x):
    return torch.sigmoid(x) * x

net = nn.Sequential(nn.Linear(8, 8), nn.GELU())
"""


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "problem.py"
    path.write_text(KERNELBENCH_STYLE)
    return path


def test_any_file_any_callable(model_file, capsys):
    """A KernelBench-style file (Model from get_init_inputs(), get_inputs()), a function in it
    with --inputs, a module object inside it (dotted), each through a command."""
    out = run(capsys, "explain", str(model_file), "--backend", "cpp")
    assert "relu" in out and "mm" in out  # (addmm or mm: the linear layer)
    out = run(capsys, "kernels", f"{model_file}:act", "--inputs", "randn(8, 64)",
              "--backend", "cpp")
    assert "fused_sigmoid_mul" in out and "Iteration space (8, 64)" in out
    out = run(capsys, "kernels", f"{model_file}:net.1", "--inputs", "randn(3, 8, dtype=float64)",
              "--backend", "cpp")
    assert "gelu" in out and "double" in out
    out = run(capsys, "run", "torch.nn.functional:silu", "--inputs", "randn(5, 7)",
              "--backend", "cpp")
    assert "1 kernel(s)" in out


@pytest.mark.parametrize("argv, said", [
    (["run", "/tmp/fusec-no-such-file.py"], "fusec: no such file: /tmp/fusec-no-such-file.py"),
    (["run", "no_such_example"], "'no_such_example' is neither a file nor an example"),
    (["run", "fusec_no_such_package.mod:f"], "cannot import 'fusec_no_such_package.mod'"),
    (["run", "sin4", "--inputs", "randn(4,"], "--inputs 'randn(4,' is not a list of tensors"),
])
def test_clean_errors(argv, said, capsys):
    assert cli(argv + ["--backend", "cpp"]) == 1
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err


def test_missing_attribute_and_inputs(model_file, capsys):
    assert cli(["run", f"{model_file}:nope", "--backend", "cpp"]) == 1
    assert "has no 'nope'" in capsys.readouterr().err
    plain = model_file.parent / "plain.py"
    plain.write_text("def f(x):\n    return x * 2\n")
    assert cli(["run", f"{plain}:f", "--backend", "cpp"]) == 1
    assert 'give them with --inputs "randn(8, 64)"' in capsys.readouterr().err


def test_a_closed_pipe_is_not_an_error():
    """`fusec kernels sin4 | head -1`: the reader leaves early; no BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "fusec", "kernels", "sin4", "--backend", "cpp"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and b"Traceback" not in err and b"BrokenPipe" not in err


def test_dot_without_graphviz_says_so(tmp_path, capsys, monkeypatch):
    """Without Graphviz, --dot writes .dot files only, and says that and why."""
    from fusec.inspect import explain
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(explain, "render_svg", lambda dot: None)
    assert cli(["explain", "sin4", "--backend", "cpp", "--dot", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "wrote graph_before_fusion.dot, graph_after_fusion.dot to" in err
    assert "no .svg pictures: Graphviz's `dot` is not installed" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["graph_after_fusion.dot",
                                                          "graph_before_fusion.dot"]


def test_training_scripts_keep_their_training_entry_points():
    for name, entry in (("xor_train", "train"), ("gpt2_train_step", "step")):
        module = load_example(name)
        assert callable(getattr(module, entry)) and callable(module.example)


def test_progress_bar_only_when_asked(monkeypatch):
    import fusec.progress as progress
    monkeypatch.delenv("FUSEC_PROGRESS", raising=False)
    assert not progress.enabled()  # pytest captures stderr: not a terminal
    monkeypatch.setenv("FUSEC_PROGRESS", "1")
    assert progress.enabled()
    monkeypatch.setenv("FUSEC_PROGRESS", "0")
    assert not progress.enabled()


def test_progress_flag_draws_a_bar_and_changes_nothing_else(monkeypatch, capsys, tmp_path):
    """`--progress` forces the bars on (on stderr); stdout is the same as without."""
    monkeypatch.setenv("FUSEC_PROGRESS", "0")  # restored after the test
    assert cli(["kernels", "gpt2_block", "--backend", "cpp", "--small"]) == 0
    plain = capsys.readouterr().out
    # A bar counts builds. The first command's kernels may still be loaded in this process (until
    # the collector frees them, fusec/runtime/build.py `_LOADED`), and then nothing would be
    # built: a cache of its own makes the second command build its 6 kernels.
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "cache"))
    assert cli(["kernels", "gpt2_block", "--backend", "cpp", "--small", "--progress"]) == 0
    captured = capsys.readouterr()
    assert captured.out == plain
    assert "build kernels" in captured.err  # 6 kernels: a bar
    import os
    assert os.environ.get("FUSEC_PROGRESS") == "0"  # the flag held for that command only


def test_progress_track_counts_builds(monkeypatch):
    import fusec.progress as progress

    builds = [f"kernel {i}" for i in range(5)]
    monkeypatch.setenv("FUSEC_PROGRESS", "0")
    assert progress.builds(builds) == builds  # off: the plain list, no bar
    monkeypatch.setenv("FUSEC_PROGRESS", "1")
    assert list(progress.builds(iter(builds), 5)) == builds  # on: the same items, through a bar
    assert progress._active is None  # the bar is closed afterwards
    assert progress.builds(builds[:2]) == builds[:2]  # under MIN_KERNELS: no bar on its own

"""fusec.profile: eager vs fused under torch.profiler, on the CPU here (CUDA sections run on a GPU
machine: see docs/profiling.md). Checks the report's fields, its text, the Chrome traces, the
HTML page (parsed, and rendered in headless Chromium when it is installed) and `fusec profile`.
"""
import html.parser
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import fusec
from fusec.cli import main as cli
from fusec.inspect.instrument import _Named
from fusec.inspect.report import ProfileReport

FAST = dict(iters=3, warmup=1, time_budget_s=0.02, copy_bytes=1 << 22)


def add_mul(a, b):
    return a * b + a


def with_extern(x, w):
    y = torch.sin(x) * 2
    return (y @ w).relu()


@pytest.fixture(scope="module")
def report() -> ProfileReport:
    a, b = torch.randn(1 << 14), torch.randn(1 << 14)
    return fusec.profile(add_mul, a, b, **FAST)


@pytest.fixture(scope="module")
def extern_report() -> ProfileReport:
    return fusec.profile(with_extern, torch.randn(64, 32), torch.randn(32, 16), backend="cpp",
                         **FAST)


def test_report_fields(report):
    assert report.name == "add_mul" and report.backend == "cpp" and report.device == "cpu"
    if not torch.cuda.is_available():
        assert report.note == "no GPU on this machine: profiled the CPU"
    assert report.iters == 3
    # eager runs mul and add; fused runs one kernel
    assert report.eager.launches == 2 and report.fused.launches == 1
    assert {r["name"] for r in report.eager.by_name} == {"aten::mul", "aten::add"}
    assert [r["name"] for r in report.fused.by_name] == ["fused_mul_add_0"]
    for side in (report.eager, report.fused):
        assert side.device_ms > 0 and side.cpu_ms > 0 and side.wall_ms > 0
        assert side.peak_bytes is not None and side.peak_bytes >= 4 << 14  # at least the output
    assert report.eager.peak_bytes > report.fused.peak_bytes  # eager keeps a * b alive
    assert report.speedup == pytest.approx(report.eager.wall_ms / report.fused.wall_ms)
    assert report.copy_bandwidth > 1e8
    assert report.numerics.startswith("ok")


def test_one_line_per_kernel(report):
    (k,) = report.kernels
    assert k.name == "fused_mul_add_0" and k.kind == "kernel"
    assert k.ops == ["mul.Tensor", "add.Tensor"] and k.nodes == ["mul", "add"]
    assert k.lines == [f"test_profile.py:{add_mul.__code__.co_firstlineno + 1}  return a * b + a"]
    n = 1 << 14
    assert (k.read_bytes, k.write_bytes, k.bytes) == (2 * 4 * n, 4 * n, 3 * 4 * n)
    assert k.eager_bytes == 6 * 4 * n  # mul reads a, b, writes a*b; add reads a*b, a, writes
    assert k.eager_ms and k.fused_ms and k.bandwidth == pytest.approx(k.bytes / (k.fused_ms / 1e3))
    assert k.ceiling_fraction == pytest.approx(k.bandwidth / report.copy_bandwidth)
    assert k.max_error is not None and k.max_error <= 1e-5 and k.numerics == "ok"
    assert k.intensity == pytest.approx(2 * n / k.bytes)


def test_externs_get_lines_too(extern_report):
    kinds = [(k.kind, k.name) for k in extern_report.kernels]
    assert kinds == [("kernel", "fused_sin_mul_0"), ("extern", "aten.mm.default"),
                     ("kernel", "fused_relu_1")]
    mm = extern_report.kernels[1]
    line = with_extern.__code__.co_firstlineno + 2
    assert mm.lines == [f"test_profile.py:{line}  return (y @ w).relu()"]
    assert mm.fused_ms and mm.eager_ms and mm.bytes is None
    assert extern_report.eager.launches == 4  # sin, mul, mm, relu
    assert extern_report.fused.launches == 3
    names = [r["name"] for r in extern_report.fused.by_name]
    assert "extern aten.mm.default -> mm" in names


def test_text_report(report):
    text = str(report)
    assert text.startswith("fusec profile: add_mul — cpp backend on CPU")
    for needle in ("eager vs fused", "kernel launches per call", "median time per call",
                   "speedup", "peak memory", "fused_mul_add_0", "return a * b + a",
                   "copy-bandwidth ceiling", "aten::mul", "outputs: ok"):
        assert needle in text, needle
    launches = next(l for l in text.splitlines() if "kernel launches per call" in l).split()
    assert launches[-3:] == ["2", "1", "-1"]


def test_to_dict(report):
    d = report.to_dict()
    json.dumps(d)
    assert d["speedup"] == report.speedup and d["eager"]["launches"] == 2
    assert "trace" not in d["eager"]
    assert d["kernels"][0]["name"] == "fused_mul_add_0"


def test_chrome_traces_show_kernels_by_name(report, tmp_path):
    eager, fused = report.export_chrome_traces(tmp_path)
    assert eager.name == "add_mul_eager.json" and fused.name == "add_mul_fused.json"
    f_events = json.loads(fused.read_text())["traceEvents"]
    e_events = json.loads(eager.read_text())["traceEvents"]
    ranges = [e["name"] for e in f_events if e.get("cat") == "user_annotation"]
    assert ranges.count("fused_mul_add_0") == 3 and ranges.count("fused iteration") == 3
    assert any(e.get("name") == "aten::mul" for e in e_events)


def test_the_normal_call_path_has_no_profiler_code(report):
    cf = fusec.compile(add_mul)
    cf(torch.randn(100), torch.randn(100))
    assert not any(isinstance(s, _Named) for s in cf.last.program.steps)
    assert not any(isinstance(s, _Named) for s in report.explanation.compiled.program.steps)


class Parser(html.parser.HTMLParser):
    VOID = {"meta", "br", "img", "input", "link", "hr", "col", "source", "wbr", "area", "base"}

    def __init__(self):
        super().__init__()
        self.stack, self.tags, self.problems, self.attrs = [], [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs += attrs
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs += attrs

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.problems.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()


def test_html_is_valid_and_self_contained(extern_report, tmp_path):
    path = extern_report.save_html(tmp_path / "report.html")
    text = path.read_text()
    p = Parser()
    p.feed(text)
    p.close()
    assert p.problems == [] and p.stack == []
    assert p.tags[0] == "html" and "table" in p.tags and "svg" in p.tags
    assert text.count('<svg class="plot"') == 3  # per call, per step, roofline
    assert "fused_sin_mul_0" in text and "extern aten.mm.default" in text
    assert "matrix product" in text  # the extern's reason
    assert 'class="highlight"' in text  # highlighted kernel source
    assert "fusec explain (cpp backend)" in text
    # nothing is fetched from elsewhere
    assert not [v for k, v in p.attrs if k in ("src", "href") and v and not v.startswith("#")]
    assert "<link" not in text and "@import" not in text and "url(http" not in text


# Where tests leave what a person looks at (the report's screenshot): <repo>/test-artifacts/
# (git-ignored), or the folder FUSEC_ARTIFACTS names.
ARTIFACTS = Path(os.environ.get("FUSEC_ARTIFACTS")
                 or Path(__file__).resolve().parents[1] / "test-artifacts")


def chromium() -> str | None:
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(n)), None)


@pytest.mark.skipif(chromium() is None, reason="no Chromium: `apt-get install -y chromium` to run "
                    "the browser test of the HTML report")
def test_html_renders_in_headless_chromium(tmp_path, capsys):
    """The GPT-2 block's report in headless Chromium at 1280 px: its check script's findings, no
    console errors, and a screenshot written to ARTIFACTS/html_report_1280.png (printed)."""
    from fusec.demo import load_example
    ex = load_example("gpt2_block").example()
    report = fusec.profile(ex.fn, *ex.inputs, name="gpt2_block", **FAST)
    page = report.save_html(tmp_path / "gpt2_block.html")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "html_report_1280.png"
    shot.unlink(missing_ok=True)  # (a screenshot left by an earlier run proves nothing)
    base = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
            "--window-size=1280,3000"]
    dom = subprocess.run(base + ["--dump-dom", page.as_uri()], capture_output=True, text=True,
                         timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    check = re.search(r'data-render-check="([^"]*)"', dom.stdout)
    assert check, "the page's check script did not run"
    result = json.loads(html.unescape(check.group(1)))
    assert result["errors"] == []
    assert result["plots"] == 3 and result["drawn"] == 3
    assert result["tables"] >= 5
    if shutil.which("dot"):
        assert result["graphs"] == 2
    assert result["graphs_fit"] == result["graphs"]  # every graph scaled into its box
    assert result["page_width"] <= result["window_width"]  # no horizontal scroll at 1280 px
    assert result["wide_tables"] >= 1 and result["wide_tables_fit"] == result["wide_tables"]
    assert result["label_overlaps"] == 0  # the roofline's kernel names do not overlap
    console = [l for l in dom.stderr.splitlines() if "CONSOLE" in l or "Uncaught" in l]
    assert console == []
    snap = subprocess.run(base + [f"--screenshot={shot}", page.as_uri()], capture_output=True,
                          text=True, timeout=120)
    assert snap.returncode == 0 and shot.exists() and shot.stat().st_size > 20_000
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with capsys.disabled():  # said also when pytest captures output
        print(f"\nthe HTML report's screenshot (1280 px wide): {shot}")


def test_cli_profile(tmp_path, capsys):
    html_path, traces = tmp_path / "r.html", tmp_path / "traces"
    assert cli(["profile", "maximum_neg_uint8", "--iters", "2", "--html", str(html_path),
                "--traces", str(traces)]) == 0
    out = capsys.readouterr().out
    assert "fusec profile: maximum_neg_uint8" in out and "fused_neg_maximum_copy_0" in out
    assert "speedup" in out and html_path.exists()
    assert sorted(p.name for p in traces.iterdir()) == ["maximum_neg_uint8_eager.json",
                                                        "maximum_neg_uint8_fused.json"]


def test_docs_profiling_code_blocks_run(tmp_path, monkeypatch):
    """Every ```python block of docs/profiling.md runs (in order, in one namespace)."""
    doc = Path(__file__).parent.parent / "docs" / "profiling.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)
    assert blocks
    monkeypatch.chdir(tmp_path)
    for var in ("FUSEC_LOG", "FUSEC_DEBUG_DIR"):  # restored after the test, whatever the blocks do
        monkeypatch.delenv(var, raising=False)
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(doc), "exec"), namespace)
    assert (tmp_path / "debug" / "f_000" / "program.py").exists()
    assert (tmp_path / "add_mul.html").exists() and (tmp_path / "traces").is_dir()


def pooled_chain(x, w):
    """Three kernels around two matmuls: the memory plan gives the third kernel's output the pool
    bytes of the first one's, which is dead by then."""
    a = torch.softmax(torch.sin(x) * 3, dim=-1)
    b = torch.layer_norm((a @ w).tanh(), (w.shape[1],))
    return (b @ w.t()).relu() + 1


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_per_kernel_numerics_survive_pool_reuse(backend):
    """Each kernel's numerics are judged on the values it produced, not on pool bytes that a
    later kernel wrote over (the profile used to report errors of order 1 for such kernels)."""
    x, w = torch.randn(64, 48), torch.randn(48, 48)
    cf = fusec.compile(pooled_chain, backend=backend)
    cf(x, w)
    memory = cf.last.program.memory
    assert memory is not None and memory.pool_bytes < memory.naive_bytes  # bytes are reused
    report = fusec.profile(pooled_chain, x, w, backend=backend, **FAST)
    kernels = [line for line in report.kernels if line.kind == "kernel"]
    assert len(kernels) >= 3
    for line in kernels:
        assert line.numerics == "ok", (line.name, line.numerics)
        assert line.max_error is not None and line.max_error < 1e-4, (line.name, line.max_error)


def test_gpu_kernel_times_are_dealt_out_to_the_steps_of_a_family():
    """On a GPU the device event of a kernel carries the name of its shared binary, the kernel
    family (`fused_add` for fused_add_0 and fused_add_2); the profiled run launches steps in
    program order, so the i-th launch of a family in an iteration belongs to its i-th step."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Interval

    from fusec.inspect.measure import _kernel_times

    def launch(name, start, us):
        return SimpleNamespace(name=name, device_type=DeviceType.CUDA, time_range=Interval(start, start + us))

    iteration = [("fused_add", 10), ("fused_mul", 30), ("fused_add", 50)]  # steps 0, 1, 2
    events, t = [], 0
    for _ in range(2):  # two profiled iterations
        for name, us in iteration:
            events.append(launch(name, t, us))
            t += 100
    times = _kernel_times(events, ["fused_add_0", "fused_mul_1", "fused_add_2"], iters=2, cuda=True)
    assert times == {"fused_add_0": 0.010, "fused_mul_1": 0.030, "fused_add_2": 0.050}

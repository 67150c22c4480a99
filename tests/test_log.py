"""FUSEC_LOG prints the stages it names to stderr as they happen; FUSEC_DEBUG_DIR writes every
stage of every compiled program to files a learner can open. Results still match eager."""
import json

import pytest
import torch

import fusec
from fusec import log


def prog(x, w):
    y = torch.sin(x) * 2
    return torch.cumsum(y @ w, 0) + 1  # mm and cumsum run as extern calls


def inputs():
    return torch.randn(8, 16), torch.randn(16, 16)


def compile_and_run(fn=prog):
    x, w = inputs()
    cf = fusec.compile(fn, backend="cpp")
    torch.testing.assert_close(cf(x, w), fn(x, w))
    return cf


def test_topics_parsing(monkeypatch):
    monkeypatch.setenv("FUSEC_LOG", " graph, output_code,nonsense ")
    assert log.topics() == {"graph", "output_code"}
    assert log.enabled("graph") and not log.enabled("cache")
    monkeypatch.setenv("FUSEC_LOG", "all")
    assert log.topics() == set(log.TOPICS)
    monkeypatch.delenv("FUSEC_LOG")
    assert log.topics() == set() and not log.wants_stack_traces()


def test_nothing_printed_without_fusec_log(monkeypatch, capsys):
    monkeypatch.delenv("FUSEC_LOG", raising=False)
    monkeypatch.delenv("FUSEC_DEBUG_DIR", raising=False)
    compile_and_run()
    assert "[fusec" not in capsys.readouterr().err


@pytest.mark.parametrize("topic, expected", [
    ("graph", ["[fusec graph] captured ATen graph", "sin", "f32[8, 16]", "mm", "extern",
               "test_log.py"]),
    ("passes", ["[fusec passes] after capture", "[fusec passes] after dce",
                "[fusec passes] after fuse_pointwise", "formed", "[fusec passes] after schedule"]),
    ("fusion", ["[fusec fusion] fusion groups (bytes from the kernel IR)", "fused_sin_mul_0", "read", "written",
                "fusion refused:", "extern op (aten.cumsum.default)"]),
    ("output_code", ["[fusec output_code] kernel fused_sin_mul_0 (cpp)", 'extern "C" void']),
    ("schedule", ["[fusec schedule] schedule", "kernel fused_sin_mul_0",
                  "extern aten.mm.default", "extern aten.cumsum.default"]),
])
def test_each_topic_prints_its_stage(monkeypatch, capsys, topic, expected):
    monkeypatch.setenv("FUSEC_LOG", topic)
    compile_and_run()
    err = capsys.readouterr().err
    for text in expected:
        assert text in err, f"{text!r} missing from FUSEC_LOG={topic} output:\n{err[:3000]}"
    others = {t for t in log.TOPICS if t != topic}
    assert not any(f"[fusec {t}]" in err for t in others)


def test_stages_print_as_they_happen(monkeypatch, capsys):
    monkeypatch.setenv("FUSEC_LOG", "all")
    compile_and_run()
    err = capsys.readouterr().err
    stages = ("graph", "passes", "schedule", "output_code", "fusion")
    order = [err.index(f"[fusec {t}]") for t in stages]
    assert order == sorted(order)


def test_cache_topic_goes_through_the_same_helper(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FUSEC_LOG", "cache")
    compile_and_run(lambda x, w: torch.tanh(x) * 3.25)  # a fresh cache: compiled
    err = capsys.readouterr().err
    assert "[fusec cache] compiled fused_" in err
    compile_and_run(lambda x, w: torch.tanh(x) * 3.25)
    assert "[fusec cache] hit fused_" in capsys.readouterr().err


def test_debug_dir_writes_every_stage(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("FUSEC_DEBUG_DIR", str(tmp_path / "dbg"))
    monkeypatch.delenv("FUSEC_LOG", raising=False)
    cf = compile_and_run()
    (folder,) = list((tmp_path / "dbg").iterdir())
    assert folder.name == "prog_000"
    names = {p.name for p in folder.iterdir()}
    assert {"00_captured_graph.txt", "01_capture.py", "02_inline_sizes.py", "03_picks.py",
            "04_fold_constants.py", "05_constant_gathers.py", "06_check_gathers.py",
            "07_check_divisors.py", "08_dce.py",
            "fusion.txt", "schedule.txt", "kernels", "program.py", "graph_before_fusion.dot", "graph_after_fusion.dot",
            "explain.txt", "explain.json"} <= names
    assert any(n.endswith("_fuse_pointwise.py") for n in names)
    assert any(n.endswith("_schedule.py") for n in names)

    captured = (folder / "00_captured_graph.txt").read_text()
    assert "sin" in captured and "f32[8, 16]" in captured and "test_log.py" in captured
    assert "torch.ops.aten.sin.default" in (folder / "01_capture.py").read_text()
    fused = next(folder.glob("*_fuse_pointwise.py")).read_text()
    assert "self.fused_sin_mul_0" in fused
    assert "fused_sin_mul_0" in (folder / "fusion.txt").read_text()
    schedule = (folder / "schedule.txt").read_text()
    assert "kernel fused_sin_mul_0" in schedule and "extern aten.mm.default" in schedule
    kernels = {p.name: p.read_text() for p in (folder / "kernels").iterdir()}
    assert set(kernels) == {f"{k.name}.cpp" for k in cf.kernels}
    assert all(kernels[f"{k.name}.cpp"] == k.source for k in cf.kernels)
    assert (folder / "program.py").read_text() == cf.source()
    assert (folder / "graph_before_fusion.dot").read_text().startswith("digraph before_fusion {")
    d = json.loads((folder / "explain.json").read_text())
    assert [k["name"] for k in d["kernels"]] == [k.name for k in cf.kernels]

    compile_and_run()  # a second program gets a folder of its own
    assert sorted(p.name for p in (tmp_path / "dbg").iterdir()) == ["prog_000", "prog_001"]


def test_debug_dir_names_modules_by_class(monkeypatch, tmp_path):
    monkeypatch.setenv("FUSEC_DEBUG_DIR", str(tmp_path))

    class Scale(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x) * 3

    m = fusec.compile(Scale(), backend="cpp")
    x = torch.randn(5)
    torch.testing.assert_close(m(x), torch.relu(x) * 3)
    assert [p.name for p in tmp_path.iterdir()] == ["Scale_000"]

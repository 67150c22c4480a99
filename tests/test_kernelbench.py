"""benchmarks/kernelbench.py and its problems: every problem builds and runs eagerly at both scales'
shapes (the GPU scale on the meta device: shapes only), most have a convolution, and the script
checks and reports two problems end to end (fusec against eager, JSON and Markdown written)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import kernelbench  # noqa: E402

PROBLEMS = sorted(kernelbench.PROBLEMS.glob("*.py"), key=lambda p: int(p.stem.split("_")[0]))


def test_the_set_is_kernelbench_sized_and_mostly_convolutions():
    assert len(PROBLEMS) >= 40
    convs = [p for p in PROBLEMS if "nn.Conv" in p.read_text()]
    assert len(convs) > len(PROBLEMS) // 2
    assert any("ConvTranspose3d" in p.read_text() for p in PROBLEMS)
    assert any("nn.Conv3d" in p.read_text() for p in PROBLEMS)
    numbers = [int(p.stem.split("_")[0]) for p in PROBLEMS]
    assert numbers == list(range(1, len(PROBLEMS) + 1))


@pytest.mark.parametrize("path", PROBLEMS, ids=lambda p: p.stem)
def test_problem_runs_eagerly(path):
    module = kernelbench.load_problem_file(path)
    model = module.get_model("cpu").eval()
    with torch.no_grad():
        out = model(*module.get_inputs("cpu"))
    assert out.numel() > 0 and torch.isfinite(out).all()
    with torch.device("meta"):  # the GPU scale's shapes, without the memory or the time
        big = module.get_model("gpu").eval()
        out = big(*[t.to("meta") for t in module.get_inputs("gpu")])
    assert out.numel() > 0


def test_script_checks_and_reports(tmp_path):
    out_json, out_md = tmp_path / "run.json", tmp_path / "table.md"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kernelbench.py"), "--only", "2_,9_",
         "--skip-models", "--rounds", "1", "--budget", "0.01", "--threads", "1",
         "--json", str(out_json), "--markdown", str(out_md)],
        capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out_json.read_text())
    rows = {r["name"]: r for r in data["rows"]}
    assert set(rows) == {"2_conv2d_mish_mish", "9_conv2d_softmax_channels"}
    for r in rows.values():
        assert r["status"] == "ok" and r["fusec_ok"] and r["inductor_ok"]
        assert r["fusec_rel_err"] < 1e-5
        assert all(r[f"{k}_ms"] > 0 for k in ("eager", "inductor", "fusec"))
    assert data["summary"]["timed"] == 2 and data["summary"]["fusec_correct"] == 2
    table = out_md.read_text()
    assert "| 2_conv2d_mish_mish |" in table and "Geomean over 2 timed rows" in table
    assert "2_conv2d_mish_mish" in proc.stdout  # the rich table


def test_a_failing_compiler_is_a_row_not_a_crash(monkeypatch):
    import fusec

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler today")
    monkeypatch.setattr(fusec, "compile", broken)
    args = type("Args", (), dict(scale="cpu", device="cpu", dtype="float32", backend="cpp",
                                 no_time=True, rounds=1, budget=0.01))()
    name, build = next(kernelbench.problem_rows())
    monkeypatch.setattr(torch, "compile", lambda m: m)  # keep the test quick
    row = kernelbench.run_row(name, build, args)
    assert row["status"] == "error" and "no compiler today" in row["fusec_error"]
    assert row["inductor_ok"]

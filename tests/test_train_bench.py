"""benchmarks/train.py on the CPU: the five models' tiny configs train through fusec with eager's
losses (3 steps each, compared step by step within the script's tolerance), and the JSON has
every column the table prints. GPT-2 runs on the C++ backend; the other four on the LLVM
backend, whose builds take a tenth of gcc's (benchmarks/cpu_backends.py), to keep this file
near a minute of CPU time on a cold cache (about 35 s on a warm one)."""
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import train  # noqa: E402

COLUMNS = {"model", "about", "system", "losses", "loss_last", "first_step_s", "step_ms",
           "step_ms_min", "step_ms_max", "steps_s", "timed_steps", "cpu_ms", "peak_mb", "max_loss_diff", "loss_tol",
           "losses_match", "x_eager", "x_eager_cpu"}


def run(tmp_path, *args) -> tuple[int, dict]:
    out = tmp_path / "train.json"
    code = train.main(["--systems", "eager,fusec", "--steps", "3", "--warmup", "1", "--small",
                       "--json", str(out), *args])
    return code, json.loads(out.read_text())


@pytest.mark.parametrize("models,backend", [("gpt2", "cpp"),
                                            ("llama,bert,vit,resnet50", "llvm")])
def test_small_models_train_with_eagers_losses(tmp_path, models, backend):
    code, report = run(tmp_path, "--models", models, "--backend", backend)
    rows = report["rows"]
    systems = ["eager"] + [f"fusec {b}" for b in backend.split(",")]
    assert [(r["model"], r["system"]) for r in rows] == \
        [(m, s) for m in models.split(",") for s in systems]
    for r in rows:
        assert "error" not in r, r
        assert COLUMNS <= set(r), COLUMNS - set(r)
        assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"])
        assert r["losses_match"], (r["model"], r["system"], r["max_loss_diff"], r["loss_tol"])
        assert r["timed_steps"] == 2 and r["step_ms_min"] <= r["step_ms"] <= r["step_ms_max"]
    eager = {r["model"]: r["losses"] for r in rows if r["system"] == "eager"}
    assert all(losses[0] != losses[-1] for losses in eager.values())  # it trains: the loss moves
    assert code == 0


def test_a_loss_off_by_more_than_the_tolerance_is_reported():
    eager = {"losses": [2.0, 1.9], "step_ms": 10.0, "cpu_ms": 8.0}
    off = {"losses": [2.0, 1.9 + 1e-3], "step_ms": 5.0, "cpu_ms": 2.0}
    close = {"losses": [2.0, 1.9 + 1e-5], "step_ms": 20.0}
    results = {"eager": eager, "fusec cpp": off, "fusec llvm": close}
    train.compare(results, train.TOLERANCE["float32"])
    assert eager["losses_match"] and eager["x_eager"] == 1.0
    assert off["losses_match"] is False and off["max_loss_diff"] == pytest.approx(1e-3)
    assert off["x_eager"] == 2.0 and off["x_eager_cpu"] == 4.0 and "x_eager_cpu" not in close
    assert "DIFFERENT" in train.row_text("gpt2", "fusec cpp", {
        **off, "loss_last": 1.901, "first_step_s": 1.0, "step_ms_min": 5.0, "step_ms_max": 5.0,
        "peak_mb": None})
    assert close["losses_match"] and close["x_eager"] == 0.5

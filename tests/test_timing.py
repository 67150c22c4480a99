"""Honest timings (fusec/timing.py): a time comes with the spread of its rounds, and a report
says when it should not be trusted (rounds that disagree, a CPU shared with other work) or when
there is nothing to time (Triton's interpreter). Repros: the demo's speedup swung from 0.02x to
2237x between runs on a busy 2-core machine without a word, and `fusec demo --backend triton`
reported the interpreter's Python as a 0.00-0.06x "speedup"."""
import math
import os

import pytest
import torch

from fusec import demo, timing
from fusec.timing import Timing


def test_a_timing_carries_its_spread():
    calm = Timing(1.0, 0.95, 1.05, 5)
    assert calm.spread == pytest.approx(0.1) and str(calm) == "1.000 ms (±5%)"
    wild = Timing(1.0, 0.2, 22.0, 5)
    assert str(wild) == "1.000 ms (rounds 0.2-22 ms)"
    assert any("disagree by up to 2180%" in d for d in timing.doubts(calm, wild, device="cuda"))
    assert timing.doubts(calm, calm, device="cuda") == []


def test_measure_times_rounds():
    t = timing.measure(lambda: sum(range(100)), budget_s=0.02, rounds=4)
    assert t.rounds == 4 and 0 < t.low_ms <= t.median_ms <= t.high_ms


def test_a_shared_cpu_is_named(monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (float(os.cpu_count() or 1) + 3.0, 0.0, 0.0))
    said = timing.busy_cores()
    assert said and f"torch uses {torch.get_num_threads()} threads" in said
    assert said in timing.doubts(Timing(1.0, 1.0, 1.0, 5), device="cpu")
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert timing.busy_cores() is None


def test_the_interpreter_is_not_timed(capsys):
    assert timing.interpreted("triton", "cpu") and not timing.interpreted("cpp", "cpu")
    ex = demo.load_example("sin4").example(device="cpu")
    r = demo.run_example(ex, "triton")
    out = capsys.readouterr().out
    assert r.eager_time is None and math.isnan(r.fused_ms)
    assert "time: not timed (Triton's interpreter" in out and "x (median" not in out


def test_the_demo_says_what_its_times_are(capsys, monkeypatch):
    monkeypatch.setattr(timing, "busy_cores", lambda: None)
    ex = demo.load_example("sin4").example(device="cpu")
    r = demo.run_example(ex, "cpp", show_source=False)
    out = capsys.readouterr().out
    assert r.eager_time.rounds == 5 and "(median of 5 rounds, ± half their range)" in out
    # a noisy comparison is flagged in the line and the summary table
    noisy = demo.Result(**{**r.__dict__, "doubts": ("rounds disagree",)})
    demo._summary([r, noisy])
    table = capsys.readouterr().out
    assert "(?)" in table and "see the warnings above each example" in table


def test_profile_says_when_its_times_are_doubtful(monkeypatch):
    import fusec
    monkeypatch.setattr(timing, "busy_cores", lambda: "torch uses 2 threads but 0.5 cores are free")
    report = fusec.profile(lambda x: torch.sin(x) * 2, torch.randn(256), backend="cpp", iters=2,
                           time_budget_s=0.02)
    assert "torch uses 2 threads but 0.5 cores are free" in report.doubts
    assert "warning: torch uses 2 threads" in str(report)
    assert report.to_dict()["doubts"] == list(report.doubts)

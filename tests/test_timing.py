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
    said = timing.doubts(calm, wild, device="cuda")
    assert any("disagree by up to 2180%" in d and "more than 25% is too wide to trust" in d
               for d in said)
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


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this OS")
def test_the_cores_counted_are_those_this_process_may_use(monkeypatch):
    """A container or `taskset` may give the process fewer cores than the machine has: four
    torch threads on an idle 64-core machine but one allowed core is a shared CPU."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(os, "getloadavg", lambda: (1.0, 0.0, 0.0))  # this process alone
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert timing.usable_cores() == 1
    said = timing.busy_cores()
    assert said and "torch uses 4 threads but only about 1.0 of the 1 cores it may use" in said
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert timing.busy_cores() is None


def test_the_interpreter_is_not_timed(capsys):
    assert timing.interpreted("triton", "cpu") and not timing.interpreted("cpp", "cpu")
    ex = demo.load_example("sin4").example(device="cpu")
    r = demo.run_example(ex, "triton")
    out = capsys.readouterr().out
    assert r.eager_time is None and math.isnan(r.fused_ms)
    assert "time: interpreter: not timed (Triton's interpreter" in out and "x (median" not in out
    demo._summary([r])
    table = capsys.readouterr().out
    assert "interpreter: not timed" in table and "speedup" not in table and "ms" not in table


def test_the_profile_under_the_interpreter_reports_no_speedup():
    """`fusec.profile(..., backend="triton")` on a CPU: the summary says "interpreter: not
    timed" where the speedup was, the speedup is nan, and the doubts say why."""
    import fusec
    report = fusec.profile(lambda x: torch.sin(x) * 2, torch.randn(256), backend="triton", iters=2,
                           warmup=1, time_budget_s=0.02, copy_bytes=1 << 20)
    assert report.interpreted and math.isnan(report.speedup)
    assert report.to_dict()["interpreted"] is True
    text = str(report)
    assert "interpreter: not timed" in text and "speedup" not in text.split("eager vs fused")[1]
    assert any("Triton's interpreter" in d for d in report.doubts)


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
    # the median time of each side comes with its rounds' spread
    for side in (report.eager, report.fused):
        low, high = side.wall_rounds
        assert low <= side.wall_ms <= high and side.wall_spread == (high - low) / side.wall_ms
    [row] = [line for line in str(report).splitlines() if "median time per call" in line]
    assert row.count("%") == 2 and row.count(" ±") == 2

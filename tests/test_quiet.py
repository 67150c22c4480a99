"""Quiet by default, and tables that fit (issue 52, a user's first hour).

Repros: the tutorial's shape error printed 86 lines of torch's fake-tensor tracebacks before
fusec's one-line message; `fusec.profile` printed Kineto's `USDT: ... profiler_start` lines and
the CPU allocator's "Memory block of unknown size" warning; the profile's step table was cut at
160 columns and lost its "max error vs f64" column. torch's noise is kept under FUSEC_LOG=debug.

The first two run in a child process and read its real stderr (file descriptor 2), where torch's
C++ side writes and no Python capture reaches.
"""
import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fusec
from fusec import demo
from fusec.inspect.report_text import DROPPED_FIRST, kernel_rows, to_text

SHAPE_ERROR = textwrap.dedent('''
    import torch, fusec
    def f(x, y):
        return torch.sin(x.t()) * y + 1.0
    try:
        fusec.compile(f, backend="cpp")(torch.randn(64, 32), torch.randn(32))
    except fusec.UnsupportedError as err:
        print(err)
''')

PROFILE = textwrap.dedent('''
    import torch, fusec
    before = torch.randn(1 << 12)  # made before profiling, freed during it: the allocator warns
    def f(a, b):
        global before
        before = None
        return (a + b).sin() * 2
    report = fusec.profile(f, torch.randn(256, 64), torch.randn(256, 64), backend="cpp", iters=2,
                           warmup=1, time_budget_s=0.02, copy_bytes=1 << 20)
    print("speedup" in str(report))
''')


def run_child(code: str, debug: bool, tmp_path) -> subprocess.CompletedProcess:
    script = tmp_path / "first_hour.py"  # (a file, so that fusec can quote the user's line)
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "FUSEC_LOG"}
    if debug:
        env["FUSEC_LOG"] = "debug"
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)


@pytest.mark.parametrize("debug", [False, True])
def test_a_shape_error_says_fusecs_message_only(debug, tmp_path):
    child = run_child(SHAPE_ERROR, debug, tmp_path)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.startswith("fusec: could not capture the program at ")
    assert "first_hour.py:4: `return torch.sin(x.t()) * y + 1.0`" in child.stdout
    assert "Attempting to broadcast a dimension of length 32" in child.stdout
    if debug:  # torch's own traceback from inside the trace, kept for whoever asked
        assert "fake_tensor" in child.stderr and "Traceback" in child.stderr
    else:
        assert child.stderr == ""


@pytest.mark.parametrize("debug", [False, True])
def test_profiling_prints_no_profiler_noise(debug, tmp_path):
    child = run_child(PROFILE, debug, tmp_path)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.strip().splitlines()[-1] == "True"  # the report was drawn
    noise = [line for line in child.stderr.splitlines()
             if "USDT:" in line or "Memory block of unknown size" in line]
    if debug:
        assert any("profiler_start" in line for line in noise), child.stderr[-2000:]
    else:
        assert noise == [] and child.stderr == "", child.stderr[-2000:]


def test_noise_held_back_lets_other_lines_through(capfd):
    """Only torch.profiler's known lines are dropped: anything else written to stderr in the
    meantime (a real error, from C or Python) is written back after the block."""
    from fusec.inspect.measure import native_noise_held_back
    with native_noise_held_back():
        os.write(2, b"USDT:2026-12-06 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a real problem\n")
    assert capfd.readouterr().err == "a real problem\n"


def long_named_step(activations_of_the_layer, another_long_named_tensor):
    y = torch.nn.functional.gelu(activations_of_the_layer * another_long_named_tensor
                                 + activations_of_the_layer)
    return y.sum(-1).softmax(-1) * 3


@pytest.fixture(scope="module")
def wide_report():
    return fusec.profile(long_named_step, torch.randn(64, 128), torch.randn(64, 128),
                         backend="cpp", iters=2, warmup=1, time_budget_s=0.02,
                         copy_bytes=1 << 20)


@pytest.mark.parametrize("width", [250, 160, 120, 80])
def test_the_step_table_fits_and_keeps_its_error_column(wide_report, width):
    """Every line fits; the step, its times and "max error vs f64" always show; the columns
    that did not fit are named under the table, in DROPPED_FIRST's order."""
    text = to_text(wide_report, width=width)
    assert max(map(len, text.splitlines())) <= width
    table = text.split("one line per step")[1].split("outputs:")[0]
    assert ("max error vs f64" if width > 80 else "max error") in table  # (the header may wrap)
    for row in kernel_rows(wide_report):  # whole cells, not cut short with "…"
        assert all(row[key] in table for key in ("step", "eager", "fused")), (row, table)
        words = row["error"].split()  # (the cell may wrap at its spaces when narrow)
        assert all(word in table for word in words), (row, table)
    if width >= 250:
        assert "left out" not in table and "of ceiling" in table
    else:
        note = table[table.index("(left out to fit"):]
        assert "of ceiling" in note and "of ceiling" not in table[:table.index("(left out")]
        named = [c for c in DROPPED_FIRST if c in note]
        assert named == list(DROPPED_FIRST[:len(named)])


def test_the_demo_table_fits_a_narrow_terminal(capsys):
    r = demo.evaluate(demo.load_example("sin4").example(device="cpu"), "cpp")
    results = [r, dataclasses.replace(r, name="layernorm_residual", doubts=("noisy",))]
    demo._summary(results)  # not a terminal: the whole table
    whole = capsys.readouterr().out
    assert "eager ms" in whole and "fused ms" in whole and "left out" not in whole
    demo._summary(results, width=70)
    narrow = capsys.readouterr().out
    table = narrow.split("(left out")[0]
    assert max(map(len, table.splitlines())) <= 70
    assert "speedup" in table and "max error" in table and "layernorm_residual" in table
    assert "(left out to fit 70 columns: eager ms, fused ms" in narrow

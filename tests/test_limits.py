"""Limits and copies of a compiled function: the recompile limit (FUSEC_RECOMPILE_LIMIT), the
programs kept in memory, FUSEC_LOG=recompiles and the recompiles fusec.explain shows
(fusec/limits.py, "Note: limits"), and pickling / deep-copying what `fusec.compile` returns.
"""
from __future__ import annotations

import copy
import os
import pickle
import warnings

import pytest
import torch

import fusec
from fusec.errors import FusecError
from fusec.fastpath import MISS
from fusec.limits import KEPT_REASONS, remember


def softmax(x):
    return torch.softmax(x, -1)


def scaled(x):
    return torch.sin(x) * 2 + x


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)
        self.register_buffer("shift", torch.arange(4.0))

    def forward(self, x):
        return torch.relu(self.lin(x)) + self.shift


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_500_batch_sizes_stop_compiling_at_the_limit():
    """The issue's case: a function called with 500 batch sizes compiled 500 programs and kept
    189 MiB. Now: 8 programs, one warning naming what changed, eager's answers after that."""
    cf = fusec.compile(softmax, backend="cpp", dynamic=False)  # (families: tests/test_dynamic.py)
    xs = [torch.randn(n, 64) for n in range(1, 501)]
    for x in xs[:3]:  # (warm: the first compiles load the backend)
        cf(x)
    before = _rss_bytes()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for x in xs:
            torch.testing.assert_close(cf(x), torch.softmax(x, -1))
    grown = _rss_bytes() - before
    limit_warnings = [w for w in said if "recompile limit" in str(w.message)]
    assert len(limit_warnings) == 1
    text = str(limit_warnings[0].message)
    assert "x: shape (8, 64) -> (9, 64)" in text and "FUSEC_RECOMPILE_LIMIT=8" in text
    assert "run eagerly" in text
    assert cf.compiles == 8 and len(cf.compiled) == 8
    assert cf.recompiles[-1] == \
        "past the recompile limit (8), ran eagerly: x: shape (8, 64) -> (9, 64)"
    print(f"RSS grew {grown / 2**20:.1f} MiB over 500 sizes")
    assert grown < 50 * 2**20, f"RSS grew {grown / 2**20:.1f} MiB"
    # the compiled signatures keep their programs (and fast paths)
    torch.testing.assert_close(cf(xs[2]), torch.softmax(xs[2], -1))
    assert cf._fast((xs[2],)) is not MISS


def test_the_limit_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("FUSEC_RECOMPILE_LIMIT", "2")
    cf = fusec.compile(scaled, backend="cpp", dynamic=False)
    with pytest.warns(UserWarning, match=r"recompile limit .*x: shape \(3,\) -> \(4,\)"):
        for n in (2, 3, 4, 5):
            x = torch.randn(n)
            torch.testing.assert_close(cf(x), scaled(x))
    assert cf.compiles == 2


def test_dtype_and_stride_changes_are_named(monkeypatch):
    monkeypatch.setenv("FUSEC_RECOMPILE_LIMIT", "1")
    cf = fusec.compile(scaled, backend="cpp", dynamic=False)
    cf(torch.randn(4, 4))
    with pytest.warns(UserWarning, match=r"x: strides \(4, 1\) -> \(1, 4\)"):
        cf(torch.randn(4, 4).t())
    cf = fusec.compile(scaled, backend="cpp", dynamic=False)
    cf(torch.randn(4))
    with pytest.warns(UserWarning, match=r"x: dtype torch.float32 -> torch.float64"):
        cf(torch.randn(4, dtype=torch.float64))


@pytest.mark.parametrize("value", ["0", "-3", "eight", "2.5"])
def test_a_bad_limit_is_an_error_naming_the_variable(value, monkeypatch):
    monkeypatch.setenv("FUSEC_RECOMPILE_LIMIT", value)
    with pytest.raises(FusecError, match="FUSEC_RECOMPILE_LIMIT"):
        fusec.compile(scaled, backend="cpp", dynamic=False)(torch.randn(3))


def test_lowering_the_limit_drops_the_least_recently_called_programs(monkeypatch):
    """FUSEC_RECOMPILE_LIMIT is read on every new signature; lowered, it also bounds the
    programs kept: the least recently called go first, with their fast paths."""
    monkeypatch.setenv("FUSEC_RECOMPILE_LIMIT", "4")
    cf = fusec.compile(scaled, backend="cpp", dynamic=False)
    xs = {n: torch.randn(n) for n in (1, 2, 3, 4, 5)}
    for n in (1, 2, 3, 4):
        cf(xs[n])
    cf(xs[1])  # now the most recent; (2,) and (3,) are the least recently called
    assert len(cf.compiled) == len(cf._fast_paths) == 4
    monkeypatch.setenv("FUSEC_RECOMPILE_LIMIT", "2")
    with pytest.warns(UserWarning, match="recompile limit"):
        torch.testing.assert_close(cf(xs[5]), scaled(xs[5]))  # eager: 4 compiled >= 2
    assert [k[1][0] for k in cf.compiled] == [(4,), (1,)]
    assert set(cf._fast_paths) == set(cf.compiled)
    torch.testing.assert_close(cf(xs[1]), scaled(xs[1]))  # still compiled: no compile
    torch.testing.assert_close(cf(xs[2]), scaled(xs[2]))  # dropped: eager now
    assert cf.compiles == 4 and len(cf.compiled) == 2


def test_recompiles_are_logged_with_their_reason(monkeypatch, capsys):
    monkeypatch.setenv("FUSEC_LOG", "recompiles")
    cf = fusec.compile(scaled, backend="cpp")
    cf(torch.randn(3))
    cf(torch.randn(5))
    err = capsys.readouterr().err
    assert "[fusec recompiles] scaled: compiling a new program (x: shape (3,) -> (5,); " \
           "x: strides (1,) -> (1,)" not in err  # (strides equal: not named)
    assert "[fusec recompiles] scaled: compiling a new program (x: shape (3,) -> (5,))" in err
    assert err.count("[fusec recompiles]") == 1  # the first compile is no recompile


class Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = 2.0

    def forward(self, x):
        return torch.sin(x) * self.scale


def test_explain_shows_why_a_compiled_function_recompiled():
    """`cf.recompiles` keeps why it compiled again (what FUSEC_LOG=recompiles prints: a new
    signature, a changed attribute), and fusec.explain(cm, x) prints it before the graph."""
    m = Scale()
    cm = fusec.compile(m, backend="cpp")
    x = torch.randn(5)
    cm(torch.randn(3))
    cm(x)
    m.scale = 5.0
    torch.testing.assert_close(cm(x), m(x))
    assert cm._compiled.recompiles == ["x: shape (3,) -> (5,)", "self.scale changed: 2.0 -> 5.0"]
    e = fusec.explain(cm, x)
    assert e.recompiles == cm._compiled.recompiles == e.to_dict()["recompiles"]
    assert "=== recompiles: why it compiled another program (newest last) ===\n" \
           "  1. x: shape (3,) -> (5,)\n  2. self.scale changed: 2.0 -> 5.0\n" in str(e)
    plain = fusec.explain(m, x)  # not a fusec.compile'd module: no history to show
    assert plain.recompiles == [] and "=== recompiles" not in str(plain)


def test_the_recompile_history_is_bounded():
    """A function that recompiles on every call keeps its last KEPT_REASONS reasons only."""
    history: list[str] = []
    for i in range(3 * KEPT_REASONS):
        remember(history, f"reason {i}")
    assert history == [f"reason {i}" for i in range(2 * KEPT_REASONS, 3 * KEPT_REASONS)]


# ---- pickling and copying --------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_a_compiled_function_pickles(backend):
    cf = fusec.compile(scaled, backend=backend)
    x = torch.randn(6)
    torch.testing.assert_close(cf(x), scaled(x))
    again = pickle.loads(pickle.dumps(cf))
    assert again.fn is scaled and again.backend == backend and again.compiled == {}
    torch.testing.assert_close(again(x), scaled(x))  # compiles (or loads its saved program)
    assert again.kernels and again.compiles == 1


def test_a_compiled_module_pickles_and_deep_copies():
    torch.manual_seed(0)
    model = Tiny()
    cm = fusec.compile(model, backend="cpp")
    x = torch.randn(3, 8)
    with torch.no_grad():
        want = model(x)
        torch.testing.assert_close(cm(x), want)
        for copied in (pickle.loads(pickle.dumps(cm)), copy.deepcopy(cm)):
            assert copied._compiled.fn is copied._orig_mod  # one module, not two
            assert copied._orig_mod is not model
            torch.testing.assert_close(copied(x), want)
            with torch.no_grad():
                copied._orig_mod.shift.add_(1)  # the copy's own state, read by its program
            torch.testing.assert_close(copied(x), want + 1)
            torch.testing.assert_close(cm(x), want)  # the original is untouched


def test_a_compiled_function_deep_copies():
    cf = fusec.compile(scaled, backend="cpp", check=True)
    x = torch.randn(5)
    cf(x)
    other = copy.deepcopy(cf)
    assert other.check is True and other.compiled == {}
    torch.testing.assert_close(other(x), scaled(x))


def test_a_lambda_does_not_pickle_and_says_why():
    cf = fusec.compile(lambda x: x + 1, backend="cpp")
    with pytest.raises((pickle.PicklingError, AttributeError), match="lambda"):
        pickle.dumps(cf)


def test_training_programs_count_and_say_why_they_compile_again():
    """A training call (inputs or parameters that require grad) that needs a new program counts as
    a compile and keeps its reason, as an inference call does (explain shows them)."""
    model = torch.nn.Linear(4, 3)
    cf = fusec.compile(model, backend="cpp")
    inner = getattr(cf, "_compiled", cf)
    cf(torch.randn(2, 4)).sum().backward()
    cf(torch.randn(2, 4)).sum().backward()
    assert inner.compiles == 1 and inner.recompiles == []
    cf(torch.randn(5, 4)).sum().backward()
    assert inner.compiles == 2
    assert inner.recompiles[-1].startswith("training: ") and "(2, 4) -> (5, 4)" in inner.recompiles[-1]

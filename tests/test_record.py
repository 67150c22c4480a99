"""The records between stages (fusec/record.py): each pass's decisions travel with the graph in
one typed record, the driver's Compilation carries them with the memory plan, planned once."""
import torch

import fusec
from fusec.frontend import capture
from fusec.passes import memory, run_pipeline
from fusec.record import Compilation, PassRecord, Step, record_of


def f(x):
    y = torch.sin(x) @ x  # a kernel, an extern mm, a kernel
    unused = torch.cos(x)  # noqa: F841 - for DCE
    return torch.relu(y) + 1


def test_passes_fill_the_record_of_a_copy():
    captured = capture(f, (torch.randn(8, 8),))
    record_of(captured.gm).backend = "cpp"
    gm, snapshots = run_pipeline(captured.gm, record=True)
    record = record_of(gm)
    assert isinstance(record, PassRecord) and record.backend == "cpp"
    assert record.dce == ["cos"]
    assert [s.kind for s in record.schedule] == ["kernel", "extern", "kernel"]
    assert all(isinstance(s, Step) for s in record.schedule)
    # the captured graph keeps the eager reference's record: nothing the passes decided
    assert record_of(captured.gm).dce == [] and record_of(captured.gm).schedule == []
    # a snapshot says what the graph computed and grouped, without parsing its printed code
    last = snapshots[-1]
    assert last.after == "schedule" and "mm" in last.nodes
    assert {tuple(m) for m in last.groups.values()} == {("sin",), ("relu", "add")}


def test_the_memory_is_planned_once(monkeypatch):
    calls = []
    plan = memory.plan_memory

    def counted(*args, **kwargs):
        calls.append(kwargs.get("skip"))
        return plan(*args, **kwargs)
    monkeypatch.setattr("fusec.driver.plan_memory", counted)
    # this counts what the driver does: a program that an earlier run of this very test saved
    # (fusec/runtime/fast_start/saved.py) would be loaded instead, and nothing would be planned
    monkeypatch.setenv("FUSEC_SAVED_PROGRAMS", "0")
    cf = fusec.compile(f, backend="cpp")
    cf(torch.randn(8, 8))
    assert len(calls) == 1
    last = cf.last
    assert isinstance(last, Compilation)
    assert last.schedule is last.passes.schedule is record_of(last.gm).schedule
    assert last.program.memory is last.memory
    assert not set(last.inplace) & set(last.memory.placements)

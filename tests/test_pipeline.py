"""The pipeline's two mechanisms around the passes themselves (passes/__init__.py): a pass that
names the ops it looks for is skipped on a graph without them, and a pass from outside the core
comes in through `register` and runs just before the core pass it names."""
from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.fx as fx

from fusec import passes
from fusec.frontend import capture
from fusec.capture.fingerprint import extensions
from fusec.graphmodule import copy_graph_module, looks_for
from fusec.record import record_of

aten = torch.ops.aten


def graph_of(fn, *args):
    return capture(fn, args).gm


@pytest.fixture
def extension_module(monkeypatch):
    """A module outside fusec with one pass that notes every graph it sees."""
    module = types.ModuleType("my_extension_passes")
    module.seen = []

    def note_mms(gm: fx.GraphModule) -> fx.GraphModule:
        module.seen.append(sorted(str(n.target) for n in gm.graph.nodes if n.op == "call_function"))
        return gm

    module.note_mms = note_mms
    monkeypatch.setitem(sys.modules, "my_extension_passes", module)
    yield module
    passes.unregister("note_mms")


def test_a_pass_that_looks_for_ops_runs_only_where_they_are():
    calls = []

    @looks_for(aten.mm)
    def count(gm):
        calls.append(gm)
        return gm

    gm, _ = passes.run_pipeline(graph_of(lambda x: torch.sin(x) * 2, torch.randn(4, 4)), [count])
    assert calls == [] and record_of(gm).skipped == ["count"]
    gm, _ = passes.run_pipeline(graph_of(lambda x, w: torch.sin(x @ w), torch.randn(4, 4),
                                         torch.randn(4, 4)), [count])
    assert len(calls) == 1 and record_of(gm).skipped == []


def test_a_registered_pass_runs_before_the_core_pass_it_names(extension_module):
    ext = passes.register(passes.ExtensionPass("note_mms", "my_extension_passes", before="pad_matmul",
                                               looks_for=frozenset({aten.mm.default})))
    names = [p.__name__ for p in passes.pipeline()]
    assert names.index("note_mms") == names.index("pad_matmul") - 1
    assert [p.__name__ for p in passes.PIPELINE] == [n for n in names if n != "note_mms"]
    assert f"pass note_mms (my_extension_passes, before pad_matmul)" in extensions()

    gm, snaps = passes.run_pipeline(graph_of(lambda x, w: (x @ w).relu(), torch.randn(3, 8),
                                             torch.randn(8, 5)), record=True)
    assert len(extension_module.seen) == 1 and "aten.mm.default" in extension_module.seen[0]
    assert "note_mms" in [s.after for s in snaps]
    assert ext.__name__ == "note_mms"

    passes.run_pipeline(graph_of(lambda x: x.cos(), torch.randn(3)))
    assert len(extension_module.seen) == 1  # no matmul: not called


def test_registering_again_replaces_and_a_wrong_place_is_refused(extension_module):
    passes.register(passes.ExtensionPass("note_mms", "my_extension_passes", before="layout"))
    passes.register(passes.ExtensionPass("note_mms", "my_extension_passes", before="dce"))
    assert [p.before for p in passes.REGISTERED if p.name == "note_mms"] == ["dce"]
    with pytest.raises(ValueError, match="no core pass named 'nosuch'"):
        passes.register(passes.ExtensionPass("other", "my_extension_passes", before="nosuch"))


def test_skipping_changes_no_graph():
    """The core passes that name their ops, run on graphs that lack them, change nothing: the
    skip is only a saving."""
    named = [p for p in passes.pipeline() if getattr(p, "looks_for", None)]
    programs = [(lambda x: torch.softmax(x.sin() * 2, -1), (torch.randn(5, 7),)),
                (lambda x, y: (x + y).relu().sum(0), (torch.randn(5, 7), torch.randn(7))),
                (lambda x: torch.nn.functional.layer_norm(x, (7,)), (torch.randn(5, 7),))]
    for fn, args in programs:
        gm = graph_of(fn, *args)
        for p in named:
            if not passes.wanted(p, gm):
                before = gm.code
                after = p(copy_graph_module(gm)).code
                assert after == before, p.__name__

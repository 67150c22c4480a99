"""The pipeline's two mechanisms around the passes themselves (passes/__init__.py): a pass that
names the ops it looks for is skipped on a graph without them, and a pass from outside the core
comes in through `register` and runs just before the core pass it names."""
from __future__ import annotations

import copy
import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.fx as fx

from fusec import passes
from fusec.frontend import capture
from fusec.runtime.fast_start.fingerprint import extensions
from fusec.graphmodule import copy_graph_module, looks_for
from fusec.record import record_of

aten = torch.ops.aten
ROOT = Path(__file__).resolve().parents[1]


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
    assert [p.__name__ for p in passes.PIPELINE] == [
        n for n in names if n not in {p.name for p in passes.REGISTERED}]
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


# ---- skipping is only a saving -------------------------------------------------------------------

def facts(gm: fx.GraphModule) -> dict:
    """What the later stages read of a graph: its code and each fused group's, and for every node
    the facts passes leave on it (node.meta "fusec...": its TensorMeta, a matmul's sizes, ...)."""
    graphs = [("", gm)] + [(name, sub) for name, sub in gm.named_children()
                           if isinstance(sub, fx.GraphModule)]
    found = {}
    for name, g in graphs:
        found[name] = g.code
        for n in g.graph.nodes:
            found[f"{name}/{n.name}"] = repr({k: v for k, v in n.meta.items() if k.startswith("fusec")})
    return found


def skipping_checked(monkeypatch, skipped: dict):
    """Make `run_pipeline` run every pass; where `wanted` would have skipped one, first run it on
    a copy of the graph as it stands at that point and assert it changes nothing. `skipped`
    counts, per pass, the graphs it was checked on."""
    real = passes.wanted

    def wanted(p, gm):
        if not real(p, gm):
            assert facts(p(copy_graph_module(gm))) == facts(gm), \
                f"{p.__name__} changed a graph that calls none of the ops it looks for"
            skipped[p.__name__] = skipped.get(p.__name__, 0) + 1
        return True
    monkeypatch.setattr(passes, "wanted", wanted)


def skipped_and_not(gm: fx.GraphModule, monkeypatch, skipped: dict) -> None:
    """The final scheduled graph with skipping on and with every pass run is the same, and every
    pass skipped would have changed nothing where it was skipped."""
    record_of(gm).backend = "cpp"
    fast, _ = passes.run_pipeline(gm)
    with monkeypatch.context() as m:
        skipping_checked(m, skipped)
        slow, _ = passes.run_pipeline(gm)
    assert facts(fast) == facts(slow)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1) * x


class Cache(torch.nn.Module):
    """A KV-cache-style buffer written at one position (index_copy_: index_put, reinplaced)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("k", torch.zeros(2, 6, 4))

    def forward(self, pos, k):
        self.k.index_copy_(1, pos, k)
        return self.k.sum(1)


def filled(x):
    t = torch.empty(6, 5)
    t[:3] = x[:3] * 2
    t[3:] = x[3:] + 1
    return t.relu()


# Programs whose graphs lack the ops of some marked pass, several of them near misses: a bmm but
# no mm (pad_matmul), an adaptive pool and no pool of pooling's, a gather but not a gathered read
# (constant_gathers, check_gathers), a shift by a scalar (simplify), softplus without tanh, a
# buffer written through a slice (no index_put: reinplace), a transpose of a 2-D value, a max ...
NEAR_MISSES = [
    (lambda x: torch.softmax(x.sin() * 2, -1), (torch.randn(5, 7),)),
    (lambda x, y: (x + y).relu().sum(0), (torch.randn(5, 7), torch.randn(7))),
    (lambda x: torch.nn.functional.layer_norm(x, (7,)), (torch.randn(5, 7),)),
    (lambda a, b: torch.bmm(a, b).relu(), (torch.randn(2, 3, 4), torch.randn(2, 4, 5))),
    (lambda x: torch.nn.functional.adaptive_avg_pool2d(x, 1).sigmoid(), (torch.randn(2, 3, 4, 4),)),
    (lambda x, i: torch.gather(x, 1, i).exp(), (torch.randn(4, 5), torch.randint(0, 5, (4, 3)))),
    (lambda x: (x >> 2) & 3, (torch.randint(0, 99, (4, 8), dtype=torch.int32),)),
    (lambda x: torch.nn.functional.softplus(x) * x, (torch.randn(4, 8),)),
    (lambda x, w: (x @ w).t().cos(), (torch.randn(3, 4), torch.randn(4, 5))),
    (lambda x: torch.stack([x, x * 2], -1).sum(-1), (torch.randn(4, 6),)),
    (rotate_half, (torch.randn(3, 8),)),
    (filled, (torch.randn(6, 5),)),
    (Cache(), (torch.tensor([2]), torch.randn(2, 1, 4))),
    (lambda x: x.amax(-1), (torch.randn(4, 8),)),  # a max alone: no rule of canonicalize's
]


def test_skipping_changes_no_graph(monkeypatch):
    """Most core passes name the ops they look for; on a graph without them (as the graph stands
    when the pass's turn comes), each changes nothing: skipping it is only a saving, and the
    compiled graph is the same either way."""
    named = [p.__name__ for p in passes.pipeline() if getattr(p, "looks_for", None)]
    assert len(named) >= 12, named
    skipped: dict[str, int] = {}
    for fn, args in NEAR_MISSES:
        skipped_and_not(graph_of(fn, *args), monkeypatch, skipped)
    assert set(named) <= set(skipped), set(named) - set(skipped)  # each checked somewhere


def corpus():
    """(name, fn, args): the KernelBench-style problems at their CPU sizes, small random-init
    GPT-2 and BERT, and programs of the ops the marked passes look for."""
    for path in sorted((ROOT / "benchmarks" / "problems").glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"problem_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield path.stem, module.get_model("cpu"), tuple(module.get_inputs("cpu"))
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(0, 64, (2, 8))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=64))
    yield "gpt2", gpt2.eval(), (ids,)
    bert = transformers.BertModel(transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=16))
    yield "bert", bert.eval(), (ids,)
    nn = torch.nn
    conv_bn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                            nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 16, 4))
    image = torch.randn(2, 3, 8, 8)
    yield "conv_bn_train", conv_bn, (image,)
    yield "conv_bn_eval", copy.deepcopy(conv_bn).eval(), (image,)
    yield "avg_pool", lambda x: nn.functional.avg_pool2d(x.relu(), 2), (image,)
    q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))
    yield "sdpa", lambda q, k, v: nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True).permute(0, 2, 1, 3).reshape(2, 8, 32), (q, k, v)
    table, idx = torch.randn(10, 6), torch.tensor([3, 1, 4, 1, 5])
    yield "gathers", lambda t, i: (nn.functional.embedding(i, t) + t.index_select(0, i)
                                   + t[i] + t[:, torch.tensor([0, 2, 1, 3, 5, 4])][:5]), (table, idx)
    yield "constant_order", lambda q: ((q[:, :, None] >> torch.arange(0, 32, 4)).to(torch.int8).view(
        3, 16)[:, torch.arange(16).view(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].reshape(-1)] & 15), (
        torch.randint(0, 1 << 30, (3, 2), dtype=torch.int32),)
    yield "cat", rotate_half, (torch.randn(3, 8),)
    yield "filled_slices", filled, (torch.randn(6, 5),)
    yield "cache", Cache(), (torch.tensor([2]), torch.randn(2, 1, 4))
    yield "in_place", lambda x, y: x.mul_(2).add_(y).relu_(), (torch.randn(4, 5), torch.randn(4, 5))
    yield "mish_and_shifts", lambda x, q: (x * torch.tanh(nn.functional.softplus(x)),
                                           (q[:, :, None] >> torch.arange(0, 32, 4)).to(torch.int8)), (
        torch.randn(4, 8), torch.randint(0, 1 << 30, (4, 2), dtype=torch.int32))
    yield "linear", nn.Linear(8, 6), (torch.randn(2, 5, 8),)
    yield "matmuls", lambda x, w, a, b: (x @ w.t(), torch.einsum("bik,bkj->bij", a, b)), (
        torch.randn(1, 8), torch.randn(6, 8), torch.randn(1, 3, 4), torch.randn(1, 4, 5))
    yield "permutes", lambda x: nn.functional.gelu(nn.functional.layer_norm(
        (x + 1).permute(0, 2, 3, 1), (3,)).permute(0, 3, 1, 2)), (image,)


def test_skipping_gives_the_same_graphs_over_a_corpus(monkeypatch):
    """Over many real programs, the scheduled graph (its code, every fused group's code, the
    facts on every node) is the same with skipping and with every pass run; where a pass is
    skipped, running it would have changed nothing. The convolutions are made channels-last (on
    this CPU the cost model keeps them as they are, and layout would change no graph at all)."""
    monkeypatch.setenv("FUSEC_LAYOUT", "channels_last")
    skipped: dict[str, int] = {}
    names = []
    for name, fn, args in corpus():
        torch.manual_seed(0)
        try:
            skipped_and_not(graph_of(fn, *args), monkeypatch, skipped)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None
        names.append(name)
    assert len(names) >= 60 and len(skipped) >= 10, (names, skipped)

"""cse: duplicate pure computations are computed once; effects are never merged."""
import torch

import fusec
from conftest import assert_matches
from fusec.frontend import capture
from fusec.passes import run_pipeline
from fusec.passes.cse import cse
from fusec.record import record_of


def test_duplicates_are_merged(target):
    backend, device = target

    def f(x):
        return torch.sigmoid(x) * 2 + torch.sigmoid(x)
    x = torch.randn(16, device=device)
    captured = capture(f, (x,))
    gm = cse(captured.gm)
    sigmoids = [n for n in gm.graph.nodes if n.target is torch.ops.aten.sigmoid.default]
    assert len(sigmoids) == 1
    assert record_of(gm).cse == [("sigmoid_1", "sigmoid")]
    assert_matches(f, x, backend=backend, kernels=1)


def test_layer_norm_subtracts_the_mean_once():
    x, w, b = torch.randn(4, 8), torch.randn(8), torch.randn(8)
    captured = capture(lambda x, w, b: torch.nn.functional.layer_norm(x, (8,), w, b), (x, w, b))
    gm, _ = run_pipeline(captured.gm)
    sub = torch.ops.aten.sub.Tensor
    before = sum(n.target is sub for n in captured.gm.graph.nodes)
    inside = [getattr(gm, n.target) for n in gm.graph.nodes if n.op == "call_module"]
    after = sum(n.target is sub for sub_gm in inside for n in sub_gm.graph.nodes)
    assert before == 2 and after == 1


def test_random_ops_are_never_merged():
    def f(x):
        return x + torch.rand(4), x + torch.rand(4)
    captured = capture(f, (torch.zeros(4),))
    gm = cse(captured.gm)
    assert sum(n.target is torch.ops.aten.rand.default for n in gm.graph.nodes) == 2
    a, b = fusec.compile(f, backend="cpp")(torch.zeros(4))
    assert not torch.equal(a, b)

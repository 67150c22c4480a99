"""passes/summed_slices.py: slices of zeros summed (the backward of cutting a tensor in pieces,
Llama's rotary `rotate_half`) are a cat. The pass on its own graphs (tiling slices, a gap, three
terms, a term that is not a slice; overlapping slices and slices along two dims kept), and a
rotary embedding trained through fusec on every backend: gradients equal eager's, and its
backward runs no `slice_scatter`."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fusec
from fusec.passes.summed_slices import summed_slices
from fusec.record import record_of

aten = torch.ops.aten


def scatter(value, size, start, end, dim=-1):
    """slice_backward as AOT Autograd's decomposition writes it: value into zeros at a slice."""
    shape = list(value.shape)
    shape[dim] = size
    return aten.slice_scatter(torch.zeros(shape), value, dim, start, end)


def rewritten(fn, *args):
    """fn traced to ATen, the pass run on it: (graph module, its decisions)."""
    gm = summed_slices(make_fx(fn)(*args))
    return gm, record_of(gm).extensions["summed_slices"]


def calls(gm, target) -> int:
    return sum(n.op == "call_function" and n.target is target for n in gm.graph.nodes)


CASES = {  # name: (fn, its inputs, slice_scatters left, cats made)
    "two halves": (lambda a, b: scatter(a, 16, 8, 16) + scatter(b, 16, 0, 8),
                   (torch.randn(2, 3, 8), torch.randn(2, 3, 8)), 0, 1),
    "a gap": (lambda a, b: scatter(a, 16, 0, 5) + scatter(b, 16, 9, 16),
              (torch.randn(2, 5), torch.randn(2, 7)), 0, 1),
    "three terms, dim 0": (lambda a, b, c: (scatter(a, 9, 0, 2, 0) + scatter(b, 9, 2, 6, 0))
                           + scatter(c, 9, 6, 9, 0),
                           (torch.randn(2, 4), torch.randn(4, 4), torch.randn(3, 4)), 0, 1),
    "then a product": (lambda a, b, c: scatter(a, 8, 4, 8) + scatter(b, 8, 0, 4) + c * 2,
                       (torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 8)), 0, 1),
    "a product first": (lambda a, b, c: c * 2 + scatter(a, 8, 4, 8) + scatter(b, 8, 0, 4),
                        (torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 8)), 0, 1),
    "one slice and a product": (lambda a, c: c * 2 + scatter(a, 8, 2, 5),
                                (torch.randn(3, 3), torch.randn(3, 8)), 0, 1),
    "two products": (lambda a, b, c: c * 2 + scatter(a, 8, 4, 8) + c * 3 + scatter(b, 8, 0, 4),
                     (torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 8)), 2, 0),
    "overlap": (lambda a, b: scatter(a, 8, 0, 5) + scatter(b, 8, 3, 8),
                (torch.randn(3, 5), torch.randn(3, 5)), 2, 0),
    "two dims": (lambda a, b: scatter(a, 4, 0, 2, 0) + scatter(b, 4, 0, 2, 1),
                 (torch.randn(2, 4), torch.randn(4, 2)), 2, 0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_pass_on_its_pattern(case):
    fn, args, scatters_left, cats = CASES[case]
    gm, decisions = rewritten(fn, *args)
    assert calls(gm, aten.slice_scatter.default) == scatters_left, gm.code
    assert calls(gm, aten.cat.default) == cats, gm.code
    assert any(d.taken for d in decisions) == bool(cats), decisions
    torch.testing.assert_close(gm(*args), fn(*args), rtol=0, atol=0)  # adding zeros is exact


def test_a_gap_is_a_zero_piece():
    fn, args, _, _ = CASES["a gap"]
    gm, (decision,) = rewritten(fn, *args)
    (cat,) = [n for n in gm.graph.nodes if n.target is aten.cat.default]
    assert [tuple(p.meta["val"].shape) for p in cat.args[0]] == [(2, 5), (2, 4), (2, 7)]
    assert "1 zero-filled gap" in decision.why


def test_kept_sums_say_why():
    for case, why in (("overlap", "overlap"), ("two dims", "different dims"),
                      ("two products", "2 terms that are not slices")):
        fn, args, _, _ = CASES[case]
        (decision,) = rewritten(fn, *args)[1]
        assert not decision.taken and why in decision.why


class Rotary(torch.nn.Module):
    """A projection and Llama's rotary embedding, `rotate_half` by slicing as transformers
    writes it: its backward sums two slices of zeros per tensor."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(16, 32)

    def forward(self, x, cos, sin):
        q = self.proj(x).view(2, 6, 2, 16).transpose(1, 2)
        half = torch.cat([-q[..., 8:], q[..., :8]], dim=-1)
        return ((q * cos + half * sin) ** 2).mean()


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_rotary_backward_runs_no_slice_scatter(backend):
    model, ref = Rotary(), Rotary()
    x, cos, sin = torch.randn(2, 6, 16), torch.randn(6, 16), torch.randn(6, 16)
    compiled = fusec.compile(model, backend=backend)
    loss = compiled(x, cos, sin)
    loss.backward()
    ref_loss = ref(x, cos, sin)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    backward = compiled._compiled.train_parts[1].last
    externs = [s.name for s in backward.schedule if s.kind == "extern"]
    assert not any("slice_scatter" in e for e in externs), externs
    assert any("cat" in k.name for k in backward.kernels), [k.name for k in backward.kernels]


def _whole(v):
    """A slice of zeros that covers its dim, as a shape family's backward writes it (end: the
    "to the end" sentinel), of a computed value (a graph input is left alone)."""
    zeros = aten.full.default([v.shape[0], v.shape[1]], 0.0, dtype=v.dtype, device=v.device)
    return aten.slice_scatter.default(zeros, v * 3, 1, 0, 9223372036854775807) * 2


@pytest.mark.parametrize("mode", ["real", "symbolic"])
def test_a_slice_of_zeros_over_its_whole_dim_is_its_value(mode):
    gm = make_fx(_whole, tracing_mode=mode)(torch.randn(3, 5))
    assert calls(gm, aten.slice_scatter.default) == 1 or mode == "real", gm.code
    summed_slices(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    assert calls(gm, aten.slice_scatter.default) == 0, gm.code
    x = torch.randn(3, 5) if mode == "real" else torch.randn(4, 7)  # (another size: no guard)
    torch.testing.assert_close(gm(x), x * 3 * 2, rtol=0, atol=0)

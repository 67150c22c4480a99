"""Training's reductions in few kernels: norm backward (layer, RMS, group, batch), cross entropy
and a GELU MLP compiled forward and backward (AOT Autograd) on every backend.

Each case checks the gradients against eager's and bounds the number of kernels of the backward
program (`train_parts[1]`) by the count fusec reaches today. The bounds are at most torch
Inductor's count on the CPU for the same backward (torch 2.13: layer norm 4, RMS norm 4, group
norm 6, batch norm 5, cross entropy 4, GELU MLP 3).
"""
import pytest
import torch
from torch import nn

import fusec


def _norm(make, shape):
    def case(device):
        torch.manual_seed(0)
        mod = make().to(device)
        with torch.no_grad():  # weights that are not all ones: their gradients matter
            for p in mod.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        return mod, (torch.randn(*shape, device=device),)
    return case


def _cross_entropy(device):
    torch.manual_seed(0)

    class CrossEntropy(nn.Module):
        def forward(self, x, t):
            return nn.functional.cross_entropy(x, t)
    return CrossEntropy(), (torch.randn(8, 10, device=device), torch.randint(0, 10, (8,), device=device))


CASES = {
    "layer_norm": _norm(lambda: nn.LayerNorm(16), (8, 16)),
    "rms_norm": _norm(lambda: nn.RMSNorm(16), (8, 16)),
    "group_norm": _norm(lambda: nn.GroupNorm(2, 4), (2, 4, 3, 3)),
    "batch_norm": _norm(lambda: nn.BatchNorm2d(4), (2, 4, 3, 3)),
    "cross_entropy": _cross_entropy,
    "gelu_mlp": _norm(lambda: nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)), (8, 16)),
}

# The most kernels the backward program may take, and why it takes that many.
BACKWARD_KERNELS = {
    # dx (two row sums and the pointwise math) + dgamma and dbeta (two column sums over the
    # same rows, independent siblings: fuse_reductions.merge_siblings puts them in one kernel)
    "layer_norm": (2, "dx with its row sums; dgamma and dbeta's column sums in one kernel"),
    # dgamma's column sum; dx's row sum; the row value broadcast back by `expand` (a view of a
    # value the row-sum kernel computes ends that kernel, so dx's last ops run in a third)
    "rms_norm": (3, "dgamma; dx's row sum; dx's pointwise tail after an expand view"),
    # the per-channel sums of dy * x and dy (siblings, with `view(dy * x)` lifted onto the loads
    # by fuse_pointwise.lift_reshapes); the per-group sums; dx (rstd * gamma lifted through its
    # unsqueeze into it); dgamma's and dbeta's column sums, over (N, G, C/G) and (N, C): two
    # shapes, two kernels
    "group_norm": (5, "channel sums, group sums, dx, dgamma, dbeta"),
    # the per-channel sums of dy and dy * (x - mean), the per-channel scales and dx: all in the
    # sums' keepdim rows (capture/decompositions.py, batch_norm_backward), one kernel
    "batch_norm": (1, "the channel sums, the scales and dx"),
    "cross_entropy": (3, "the target mask, the scaled one-hot, the softmax gradient"),
    "gelu_mlp": (2, "the bias gradient's column sum, the GELU backward"),
}


def _params_and_inputs_grads(mod, inputs):
    return [p.grad for p in mod.parameters()] + [x.grad for x in inputs if x.is_floating_point()]


@pytest.mark.parametrize("case", sorted(CASES))
def test_backward_matches_eager_in_few_kernels(case, target):
    backend, device = target
    mod, inputs = CASES[case](device)
    ref_mod, ref_inputs = CASES[case](device)
    for x in (*inputs, *ref_inputs):
        if x.is_floating_point():
            x.requires_grad_(True)
    compiled = fusec.compile(mod, backend=backend)
    out = compiled(*inputs)
    (out if out.dim() == 0 else (out * out).sum()).backward()
    ref = ref_mod(*ref_inputs)
    (ref if ref.dim() == 0 else (ref * ref).sum()).backward()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    got, want = _params_and_inputs_grads(mod, inputs), _params_and_inputs_grads(ref_mod, ref_inputs)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    parts = getattr(compiled, "_compiled", compiled).train_parts
    names = [k.name for k in parts[1].kernels]
    most, why = BACKWARD_KERNELS[case]
    assert 0 < len(names) <= most, (f"{case} backward: {len(names)} kernels {names}, expected at "
                                    f"most {most} ({why})")


class NormRelu(nn.Module):
    """Batch norm then ReLU, as a CNN's block has them; with `residual`, two batch norms whose
    sum goes through the ReLU (a bottleneck's last norm and its shortcut's)."""

    def __init__(self, channels: int, residual: bool):
        super().__init__()
        self.norm = nn.BatchNorm2d(channels)
        self.shortcut = nn.BatchNorm2d(channels) if residual else None

    def forward(self, x, y):
        out = self.norm(x)
        return torch.relu(out + self.shortcut(y) if self.shortcut is not None else out)


# (N, C, H, W), a residual or not: odd channel counts, a batch of one (batch norm in training
# needs more than one value per channel: 1 x 3 x 3 has 9), a 2 x 2 image
BATCH_NORM_TRAINING = [((2, 5, 3, 3), False), ((1, 3, 3, 3), False), ((4, 7, 2, 2), True),
                       ((3, 4, 5, 5), True)]


@pytest.mark.parametrize("shape,residual", BATCH_NORM_TRAINING)
def test_batch_norm_training_in_one_kernel_each_way(target, shape, residual):
    """Batch norm in training (AOT Autograd's `_native_batch_norm_legit_functional`, the
    running statistics returned to be copied into the buffers) is one reduction kernel with
    the ReLU, the residual's sum and the new running statistics in it; its backward
    (`native_batch_norm_backward`, ReLU's backward before it) is one kernel for both norms'
    sums and dx. Two steps: outputs, every gradient, the running statistics and the step
    counter equal eager's."""
    backend, device = target

    def make():
        torch.manual_seed(0)
        mod = NormRelu(shape[1], residual).to(device)
        with torch.no_grad():
            for p in mod.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        return mod
    mod, ref = make(), make()
    compiled = fusec.compile(mod, backend=backend)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, y = (torch.randn(shape, generator=gen).mul_(2).add_(0.5).to(device) for _ in range(2))
        grad = torch.randn(shape, generator=gen).to(device)
        xs = [t.clone().requires_grad_(True) for t in (x, y)]
        xr = [t.clone().requires_grad_(True) for t in (x, y)]
        out, want = compiled(*xs), ref(*xr)
        out.backward(grad)
        want.backward(grad)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        for g, w in zip(xs, xr):
            torch.testing.assert_close(g.grad, w.grad, rtol=1e-4, atol=1e-5)
    for g, w in zip(mod.parameters(), ref.parameters()):
        torch.testing.assert_close(g.grad, w.grad, rtol=1e-4, atol=1e-5)
    for (name, g), w in zip(mod.named_buffers(), ref.buffers()):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    forward, backward = (part.kernels for part in compiled._compiled.train_parts)
    # the norm(s) with their statistics and the ReLU in one kernel (two norms over the same sizes
    # are sibling reductions); each num_batches_tracked += 1 is written after the program, with
    # the statistics (fusec/capture/buffer_updates.py), not by a kernel of its own
    assert len(forward) == 1, [k.name for k in forward]
    assert len(backward) == 1, [k.name for k in backward]


def _no_further_than_eager(got, want, exact, what):
    """fusec's value `got` is no further from the float64 value `exact` than eager's `want`
    is, within twice eager's distance, or one unit in the last place of the largest value
    (four for a float32 value: its sums run in another order, and a weight's gradient summed
    over the batch on a GPU is a few units from float64 where eager's is one)."""
    if not got.is_floating_point():
        assert torch.equal(got, want) and torch.equal(got, exact.to(got.dtype)), what
        return
    exact = exact.double()
    ulp = torch.finfo(got.dtype).eps * exact.abs().max().item() * (1 if got.element_size() < 4 else 4)
    err, eager_err = ((t.double() - exact).abs().max().item() for t in (got, want))
    assert err <= max(2 * eager_err, ulp), f"{what}: {err} from float64, eager {eager_err}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("params", ["float32", "half"])
def test_half_batch_norm_training_in_one_kernel_each_way(target, dtype, params):
    """A half-precision activation through a batch norm in training: under autocast a
    convolution's bfloat16 output meets float32 weights and running statistics ("float32"),
    or the whole model was converted (`model.half()`, "half"). Computed in float32 as eager
    computes it (capture/decompositions.py, batch_norm_training), still one kernel each way:
    the output, the input's and the weights' gradients and the running statistics agree with
    eager's: each no further from a float64 run of the same model than eager's is (eager's
    all-half kernels round in places where fusec's do not), in eager's dtypes."""
    backend, device = target

    def make():
        torch.manual_seed(0)
        mod = NormRelu(6, residual=True).to(device)
        with torch.no_grad():
            for p in mod.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        return mod
    mod, ref, exact = make(), make(), make().double()
    if params == "half":
        mod, ref = mod.to(dtype), ref.to(dtype)
    compiled = fusec.compile(mod, backend=backend)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, y, grad = (torch.randn((3, 6, 5, 7), generator=gen).mul_(2).add_(0.5).to(device, dtype)
                      for _ in range(3))
        runs = [[t.clone().to(d).requires_grad_(True) for t in (x, y)]
                for d in (dtype, dtype, torch.float64)]
        outs = [m(*xs) for m, xs in zip((compiled, ref, exact), runs)]
        for out, g in zip(outs, (grad, grad, grad.double())):
            out.backward(g)
        assert outs[0].dtype == outs[1].dtype == dtype
        _no_further_than_eager(*outs, "output")
        for i in range(2):
            _no_further_than_eager(*(xs[i].grad for xs in runs), f"input {i}'s gradient")
    for (name, g), w, e in zip(mod.named_parameters(), ref.parameters(), exact.parameters()):
        assert g.grad.dtype == w.grad.dtype
        _no_further_than_eager(g.grad, w.grad, e.grad, name)
    for (name, g), w, e in zip(mod.named_buffers(), ref.buffers(), exact.buffers()):
        assert g.dtype == w.dtype, name
        _no_further_than_eager(g, w, e, name)
    forward, backward = (part.kernels for part in compiled._compiled.train_parts)
    assert len(forward) == 1, [k.name for k in forward]
    assert len(backward) == 1, [k.name for k in backward]
    assert not any("batch_norm" in str(s) for part in compiled._compiled.train_parts
                   for s in part.schedule), "a batch norm stayed an extern call"


def test_independent_sibling_reductions_share_a_kernel(target):
    """Not a norm: three column sums over the same (rows, columns) of different values, with no
    data between them, and a row sum of another shape. The column sums become one kernel (the
    decision recorded with its reason); the row sum over other dims stays its own."""
    backend, device = target

    def f(a, b, c):
        return (a * b).sum(0), torch.exp(c).sum(0), (a - c).sum(0), b.sum(1)
    torch.manual_seed(0)
    a, b, c = (torch.randn(12, 5, device=device) for _ in range(3))
    compiled = fusec.compile(f, backend=backend)
    for g, w in zip(compiled(a, b, c), f(a, b, c)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert len(compiled.kernels) == 2, [k.name for k in compiled.kernels]
    text = str(fusec.explain(f, a, b, c, backend=backend))
    assert "independent reductions of (12, 5) over dims (0,): one loop over the rows computes both" in text


def test_sibling_reductions_with_a_path_between_stay_apart():
    """Two column sums over the same rows, but the second reads, through an extern (a matrix-vector
    product, eager's), the first one's result: one kernel for both would need the extern's result
    before it has run. The merge is refused, and explain says why."""
    def f(x, y, w):
        s = x.sum(0)
        return s, (y * torch.mv(w, s)).sum(0)
    torch.manual_seed(0)
    x, y, w = torch.randn(12, 5), torch.randn(12, 5), torch.randn(5, 5)
    compiled = fusec.compile(f, backend="cpp")
    for g, want in zip(compiled(x, y, w), f(x, y, w)):
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5)
    # x's column sum; mv, decomposed to a row sum of w * s; y's column sum: three kernels
    assert len(compiled.kernels) == 3, [k.name for k in compiled.kernels]
    assert "would create a cycle" in str(fusec.explain(f, x, y, w, backend="cpp"))


def test_reshapes_of_pointwise_values_lift_onto_the_loads(target):
    """Not a norm: a reshape that regroups dims (`view(a * b, ...)` summed over the merged dim)
    and one that only inserts a dim of size 1 (`unsqueeze(p * q, -1)` broadcast over a new last
    dim, also through a chain of ops) each moved above their pointwise ops, onto the inputs: one
    kernel each, not two."""
    backend, device = target
    torch.manual_seed(0)

    def regroup(a, b):
        return (a * b).view(4, 3, 10).sum(-1)

    def insert(p, q, x):
        return (p * q).unsqueeze(-1) * x

    def chain(p, q, x):  # sin(p), (4, 1), broadcasts in the product: lifted with it
        return (torch.sin(p) * q).unsqueeze(-1) * x
    a, b = torch.randn(4, 3, 2, 5, device=device), torch.randn(4, 3, 2, 5, device=device)
    p, q, x = (torch.randn(4, 1, device=device), torch.randn(1, 3, device=device),
               torch.randn(4, 3, 5, device=device))
    for fn, args in ((regroup, (a, b)), (insert, (p, q, x)), (chain, (p, q, x))):
        compiled = fusec.compile(fn, backend=backend)
        torch.testing.assert_close(compiled(*args), fn(*args), rtol=1e-5, atol=1e-5)
        assert len(compiled.kernels) == 1, (fn.__name__, [k.name for k in compiled.kernels])
        assert "moved above its pointwise ops onto the values they load" in \
            str(fusec.explain(fn, *args, backend=backend))


def test_reshape_of_a_value_read_elsewhere_stays():
    """`a * b` is also a result of its own: it is computed and stored anyway, so its reshape
    stays a view of the stored value: two kernels, the product's and the sum's (which reads
    the product through the view)."""
    def f(a, b):
        m = a * b
        return m, m.view(4, 3, 10).sum(-1)
    a, b = torch.randn(4, 3, 2, 5), torch.randn(4, 3, 2, 5)
    compiled = fusec.compile(f, backend="cpp")
    for g, w in zip(compiled(a, b), f(a, b)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert [k.name for k in compiled.kernels] == ["fused_mul_0", "fused_sum_1"]

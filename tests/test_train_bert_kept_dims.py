"""passes/kept_dims.py (a rule of canonicalize): a reduction with keepdim=True read only through a
view that drops the kept dims is computed without them, so its kernel's buffer is the value the
view was (BERT's bias and layer-norm gradients: one tensor fewer made on every backward call).
Eager's answers over odd sizes and several dtypes, the cases left alone, and a layer trained on
both CPU backends with eager's gradients and no view made of a gradient's sum."""
import pytest
import torch

import fusec
from train_check import train_alongside

CASES = {  # name: (fn, input shape)
    "sum over dim 0": (lambda x: x.sum([0], keepdim=True).view(x.shape[1:]), (7, 13)),
    "sum over the last dims": (lambda x: x.sum([-1, -2], keepdim=True).view(x.shape[0]),
                               (5, 3, 9)),
    "sum over the middle": (lambda x: x.sum([1], keepdim=True).reshape(3, 11), (3, 5, 11)),
    "amax": (lambda x: torch.amax(x, [0, 1], keepdim=True).view(x.shape[2]), (2, 9, 5)),
    "amin": (lambda x: torch.amin(x, [2], keepdim=True).view(x.shape[0], x.shape[1]), (4, 3, 6)),
    "sum of a product": (lambda x: (x * 2 + 1).sum([0, 1], keepdim=True).view(x.shape[2]),
                         (3, 5, 17)),
}


def test_a_mean_keeps_its_view():
    """Capture writes a mean as a sum divided by the count: the view reads the division, not
    the sum, and stays (eager's answer all the same)."""
    fn = lambda x: x.mean([0, 2], keepdim=True).view(-1)  # noqa: E731
    x = torch.randn(3, 7, 5)
    torch.testing.assert_close(fusec.compile(fn, backend="cpp")(x), fn(x), rtol=1e-5, atol=1e-6)


def _views_of_sums(cf) -> list[str]:
    """The lines of the program's straight-line function that make a view of a value per call."""
    run = cf.source().split("def run(inputs):", 1)[1].split("\ndef ", 1)[0]
    return [line for line in run.splitlines()
            if ".as_strided(" in line or "_reinterpret_tensor(" in line]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_a_reduction_viewed_without_its_kept_dims(backend, case, dtype):
    fn, shape = CASES[case]
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype)
    cf = fusec.compile(fn, backend=backend)
    out = cf(x)
    ref = fn(x.double()).to(dtype)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ref, **tol)
    assert out.shape == fn(x).shape and out.is_contiguous()
    assert not _views_of_sums(cf), cf.source()


def test_a_kept_dim_another_reader_uses_stays():
    def fn(x):
        s = x.sum([0], keepdim=True)
        return s.view(x.shape[1]), x - s  # the second reader broadcasts the kept dim

    x = torch.randn(5, 7)
    out = fusec.compile(fn, backend="cpp")(x)
    for a, b in zip(out, fn(x)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_view_that_keeps_another_shape_stays():
    fn = lambda x: x.sum([1], keepdim=True).view(5, 1, 1)  # noqa: E731 (not the squeezed shape)
    x = torch.randn(5, 3)
    torch.testing.assert_close(fusec.compile(fn, backend="cpp")(x), fn(x))


class Layer(torch.nn.Module):
    """A linear layer, GELU and a layer norm, at odd sizes: their backward sums the bias and
    the norm's gradients over the batch and sequence with keepdim, then views them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(13, 17)
        self.norm = torch.nn.LayerNorm(17)

    def forward(self, x):
        return self.norm(torch.nn.functional.gelu(self.fc(x))).square().mean()


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_a_layers_gradients_are_summed_into_their_shape(backend):
    model, ref = Layer(), Layer()
    x = torch.randn(3, 5, 13)
    compiled = fusec.compile(model, backend=backend)
    # (the second call takes the training fast path)
    train_alongside(compiled, model, ref, [x, x], lambda m, x: m(x), step=False)
    backward = compiled._compiled.train_parts[1]
    views = [line for line in _views_of_sums(backward) if "((17,), (1,)" in line]
    assert not views, views

"""Views and strides: every view of an input folds into the kernel's load indices (no copies), and
every non-contiguous input is read correctly. Each case runs on both backends against eager.

`kernels=1` below asserts the whole program is one fused kernel over views of the inputs: had
fusec copied a view into a buffer first, there would be a second kernel (or an extern step).
"""
import pytest
import torch

import fusec
from conftest import assert_matches


def _runs_as_one_kernel_without_copies(cf):
    (kernel,) = cf.kernels
    # nothing but the kernel runs: no extern copy, no materialized view
    steps = cf.last.program.steps
    assert [type(s).__name__ for s in steps] == ["KernelStep"], steps
    return kernel


# (function, input shapes). Every function is a single pointwise group over views of its inputs.
VIEWS_OF_INPUTS = {
    "transpose": (lambda x: torch.sin(x.t()) + 1, [(5, 7)]),
    "transpose+contig": (lambda x, y: x.t() * y, [(5, 7), (7, 5)]),
    "transpose dims 0,2": (lambda x: x.transpose(0, 2) * 2, [(2, 3, 4)]),
    "permute": (lambda x, y: x.permute(2, 0, 1) - y, [(2, 3, 4), (4, 2, 3)]),
    "expand": (lambda x, y: x.expand(5, 7) + y, [(1, 7), (5, 7)]),
    "expand new dims": (lambda x: x.expand(3, 4, 7) * 2, [(7,)]),
    "expand middle": (lambda x, y: x.expand(3, 4, 7) * y, [(3, 1, 7), (3, 4, 7)]),
    "unsqueeze": (lambda x, y: x.unsqueeze(1) + y, [(5, 7), (5, 3, 7)]),
    "unsqueeze last": (lambda x: torch.cos(x.unsqueeze(-1)), [(5, 7)]),
    "squeeze": (lambda x: x.squeeze(1) + 1, [(5, 1, 7)]),
    "squeeze all": (lambda x: torch.sin(x.squeeze()), [(1, 5, 1, 7, 1)]),
    "view": (lambda x: x.view(35) * 2, [(5, 7)]),
    "view split": (lambda x, y: x.view(5, 2, 3) + y, [(5, 6), (2, 3)]),
    "reshape": (lambda x, y: x.reshape(7, 5) - y, [(5, 7), (7, 5)]),
    "flatten": (lambda x: torch.sin(x.flatten()), [(3, 4, 5)]),
    "slice step": (lambda x: x[:, 1::3] + 1, [(6, 10)]),
    "slice both dims": (lambda x: x[::2, ::3] * 2, [(7, 10)]),
    "slice start": (lambda x: torch.sin(x[2:]), [(6, 5)]),
    "slice negative": (lambda x: x[-3:] + x[:3], [(6, 5)]),
    "slice negative stop": (lambda x: x[:, -4:-1] * 3, [(6, 9)]),
    "slice narrow": (lambda x: x.narrow(1, 2, 3) + 1, [(4, 8)]),
    "select": (lambda x, y: x[0] + y, [(4, 6), (6,)]),
    "select column": (lambda x: torch.sin(x[:, 2]), [(4, 6)]),
    "select last": (lambda x: x[-1] * 2, [(4, 6)]),
    "select middle dim": (lambda x: x[:, 1, :] + 1, [(3, 4, 5)]),
    "broadcast": (lambda a, b: a + b, [(5, 1), (1, 7)]),
    "broadcast rank": (lambda a, b: a * b, [(7,), (5, 7)]),
    "broadcast 3-D": (lambda a, b, c: a * b + c, [(4, 1, 6), (5, 1), (4, 5, 1)]),
    "chain of views": (lambda x: x.t()[1:, ::2].unsqueeze(0) + 1, [(6, 7)]),
    "views of two inputs": (lambda x, y: x[1:, :5].t() * y[::2].expand(5, 5), [(6, 7), (10,)]),
    "same input, two views": (lambda x: x.t() + x, [(6, 6)]),
    "view then broadcast": (lambda x, y: x.t()[2] + y, [(4, 6), (3, 4)]),
    "diagonal": (lambda x: torch.sin(x.diagonal()), [(5, 5)]),
    "unfold": (lambda x: x.unfold(0, 3, 2) * 2, [(9,)]),
}


@pytest.mark.parametrize("case", list(VIEWS_OF_INPUTS))
def test_view_of_input_folds_into_one_kernel(target, case):
    backend, device = target
    fn, shapes = VIEWS_OF_INPUTS[case]
    args = [torch.randn(s, device=device) for s in shapes]
    cf = assert_matches(fn, *args, backend=backend, kernels=1)
    _runs_as_one_kernel_without_copies(cf)


# Non-contiguous inputs, as the caller passes them.
def _transposed(device):
    return torch.randn(5, 5, device=device).t()


def _sliced(device):
    return torch.randn(11, 12, device=device)[1::2, 2:7]


def _expanded(device):
    return torch.randn(1, 5, device=device).expand(5, 5)


def _offset(device):
    return torch.randn(40, device=device)[15:40].view(5, 5)


def _permuted(device):
    return torch.randn(5, 2, 5, device=device).permute(2, 0, 1)[..., 0]


NON_CONTIGUOUS = {"transposed": _transposed, "sliced": _sliced, "expanded": _expanded,
                  "storage offset": _offset, "permuted+selected": _permuted}


@pytest.mark.parametrize("kind", list(NON_CONTIGUOUS))
def test_non_contiguous_input(target, kind):
    backend, device = target
    x = NON_CONTIGUOUS[kind](device)
    assert x.shape == (5, 5)
    y = torch.randn(5, 5, device=device)
    cf = assert_matches(lambda x, y: torch.sin(x) * y + x, x, y, backend=backend, kernels=1)
    _runs_as_one_kernel_without_copies(cf)


@pytest.mark.parametrize("kind", list(NON_CONTIGUOUS))
def test_views_of_non_contiguous_input(target, kind):
    backend, device = target
    x = NON_CONTIGUOUS[kind](device)
    cf = assert_matches(lambda x: x.t()[1:, ::2] * 2 + x[1:, ::2], x, backend=backend, kernels=1)
    _runs_as_one_kernel_without_copies(cf)


def test_two_non_contiguous_inputs_in_different_layouts(target):
    backend, device = target
    a = torch.randn(6, 8, device=device).t()          # (8, 6), column-major
    b = torch.randn(8, 12, device=device)[:, ::2]     # (8, 6), strided rows
    c = torch.randn(6, device=device)                 # broadcast along rows
    assert_matches(lambda a, b, c: torch.maximum(a, b) * c, a, b, c, backend=backend, kernels=1)


def test_same_tensor_passed_twice(target):
    backend, device = target
    x = torch.randn(5, 6, device=device)
    assert_matches(lambda a, b: a * b.cos(), x, x, backend=backend, kernels=1)


def test_int_and_bool_views(target):
    backend, device = target
    x = torch.arange(-20, 20, dtype=torch.int32, device=device).reshape(5, 8)
    assert_matches(lambda x: (x.t()[::2] * 3 - 1) > 0, x, backend=backend, kernels=1)
    assert_matches(lambda x: torch.maximum(x[1:], x[:-1]), x, backend=backend, kernels=1)


# Views that need a copy or a materialized view (not a single kernel): only correctness.
NEEDS_MORE = {
    "reshape of transposed input": (lambda x: x.t().reshape(-1) + 1, [(5, 7)]),
    "view of intermediate": (lambda x: torch.sin(x).view(-1) * 2, [(5, 7)]),
    "transpose of intermediate": (lambda x: torch.sin(x).t() + x.t(), [(5, 7)]),
    "expand of intermediate": (lambda x, y: torch.sin(x).expand(5, 7) * y, [(1, 7), (5, 7)]),
    "slice of intermediate": (lambda x: torch.sin(x)[1:, ::2] + 1, [(5, 7)]),
    "select of intermediate": (lambda x: torch.cos(x)[2] * 2, [(5, 7)]),
    "view output": (lambda x: (torch.sin(x).t(), x[1:]), [(5, 7)]),
    "flip (extern) then view": (lambda x: torch.flip(x, [0]).t() * 2, [(5, 7)]),
    "cat then slice": (lambda x, y: torch.cat([x, y])[1::2] + 1, [(3, 4), (5, 4)]),
}


@pytest.mark.parametrize("case", list(NEEDS_MORE))
def test_views_needing_more_than_one_step(target, case):
    backend, device = target
    fn, shapes = NEEDS_MORE[case]
    args = [torch.randn(s, device=device) for s in shapes]
    assert_matches(fn, *args, backend=backend)


# A tensor broadcast over the whole iteration space: every lane reads one address.
WHOLE_SPACE_BROADCAST = {
    "0-d input": (lambda x, s: x * s, [(4, 3), ()]),
    "(1,) input": (lambda x, s: x * s, [(4, 3), (1,)]),
    "(1, 1) input": (lambda x, s: x + s, [(4, 3), (1, 1)]),
    "expand of one element": (lambda x: x.expand(4, 4) + 1, [(1,)]),
    "select to 0-d": (lambda x: x[1, 2] * 2, [(4, 3)]),
    "0-d program": (lambda x: torch.sin(x), [()]),
}


@pytest.mark.parametrize("case", list(WHOLE_SPACE_BROADCAST))
def test_whole_space_broadcast(target, case):
    """Regression: Triton once rendered such an index as `x_ptr + 0`, a scalar pointer that
    tl.load/tl.store reject next to a block mask."""
    backend, device = target
    fn, shapes = WHOLE_SPACE_BROADCAST[case]
    args = [torch.randn(s, device=device) for s in shapes]
    assert_matches(fn, *args, backend=backend, kernels=1)


def test_kernel_reads_views_not_copies_in_source(target):
    """The generated source indexes the original buffer with the view's strides and offset."""
    backend, device = target
    x = torch.randn(6, 10, device=device)
    cf = fusec.compile(lambda x: x[1:, 2::3] * 2, backend=backend)
    cf(x)
    (kernel,) = cf.kernels
    (load,) = kernel.ir.loads
    assert load.param == "x"
    assert load.index.offset == 12 and load.index.strides == (10, 3)


# Shapes large enough for several Triton blocks, C++ chunked rows and the OpenMP parallel path.
LARGE = {
    "transposed, many blocks": (lambda x, y: x.t() * y + 1, [(4000, 3), (3, 4000)]),
    "3-D permute + broadcast": (lambda x, b: x.permute(1, 2, 0) + b, [(5, 70, 130), (5,)]),
    "few long strided rows": (lambda x: x[:, 1::2] * 2, [(3, 40001)]),
    "expanded rows": (lambda x, y: x.expand(300, 257) * y, [(1, 257), (300, 257)]),
}


@pytest.mark.parametrize("case", list(LARGE))
def test_large_views(target, case):
    backend, device = target
    fn, shapes = LARGE[case]
    args = [torch.randn(s, device=device) for s in shapes]
    assert_matches(fn, *args, backend=backend, kernels=1)


# ---- views that are more than a layout (found by benchmarks/opinfo_sweep.py) ----------------------

REINTERPRETING = {
    # a Layout counts elements of its root's dtype: these ran as an as_strided of the float
    # buffer and returned float32 where eager returns complex64 (or garbage element sizes)
    "view_as_complex": lambda x: torch.view_as_complex(x),
    "view_as_complex of a kernel": lambda x: torch.view_as_complex(x * 2) * 3,
    "view_as_real round trip": lambda x: torch.view_as_real(torch.view_as_complex(x * 2)) + 1,
    "view as int32 then bits": lambda x: (torch.abs(x).view(torch.int32) >> 23) + 1,
    "view as uint8 of a kernel": lambda x: x.abs().view(torch.uint8).float().sum(dim=-1),
    "conj of complex": lambda x: torch.view_as_complex(x * 2).conj() * 1j,
}


@pytest.mark.parametrize("case", list(REINTERPRETING))
@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_views_that_change_the_dtype_run_as_eager(backend, case):
    fn = REINTERPRETING[case]
    x = torch.randn(6, 4, 2)
    got = fusec.compile(fn, backend=backend)(x)
    want = fn(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["circular", "reflect", "replicate"])
def test_padding_written_into_slices_of_a_temporary(target, mode):
    """Circular padding decomposes into an `empty` and three `copy_`s into slices of it, below
    functionalization: the copies were taken for dead out-of-place ops and the program returned
    the uninitialized `empty`. Such graphs are traced once more through functionalization."""
    backend, device = target
    f = lambda x: torch.nn.functional.pad(torch.sin(x), (1, 2, 2, 1), mode=mode) * 2  # noqa: E731
    assert_matches(f, torch.randn(2, 3, 5, 6, device=device), backend=backend)
    g = lambda x: torch.nn.functional.pad(x, (1, 2), mode=mode)  # noqa: E731
    assert_matches(g, torch.randn(1, 3, 3, device=device), backend=backend)

"""The views a program makes per call (fusec/runtime/writer.py, "a view made per call" in
fusec/runtime/steps.py): a view only the program reads is `_reinterpret_tensor(s0, shape,
stride)`, its offset a number and left out when 0; an output that is a view stays a real view
(`as_strided`, its `_base` the input's). Every answer is eager's."""
import pytest
import torch

import fusec
from fusec.runtime.steps import reinterpret_tensor, view_at


def _run_lines(cf) -> list[str]:
    return cf.last.program.run.source.splitlines()


def f_slices(x, w):
    """Slices of both inputs handed to a matmul (extern views at constant offsets), and a
    transpose of an input returned (an output that is a view)."""
    return torch.mm(x[1:, 1:], w[1:]), x.t()


def test_views_for_an_extern_call_are_reinterpreted_at_a_constant_offset():
    x, w = torch.randn(8, 4), torch.randn(4, 6)
    cf = fusec.compile(f_slices, backend="cpp")
    for a, b in zip(cf(x, w), f_slices(x, w)):
        torch.testing.assert_close(a, b)
    lines = _run_lines(cf)
    assert any("= _reinterpret_tensor(s0, (7, 3), (4, 1), 5)" in line for line in lines), lines
    assert any("= _reinterpret_tensor(s1, (3, 6), (6, 1), 6)" in line for line in lines), lines
    assert not any("storage_offset() + 0" in line for line in lines), lines
    assert any("= s0.as_strided((4, 8), (1, 4))" in line for line in lines), lines


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_inputs_with_storage_offsets_and_strides(backend):
    """The same program (one signature: the guards fix layouts) called with inputs that sit at
    storage offsets inside larger tensors, and non-contiguous ones: each view starts at its
    input's own offset, call after call."""
    cf = fusec.compile(f_slices, backend=backend)
    for k in range(3):
        big_x, big_w = torch.randn(8 * 4 + 7 * k), torch.randn(4 * 6 + 3 * k)
        x = big_x[7 * k:].view(8, 4)
        w = big_w[3 * k:].view(4, 6)
        assert x.storage_offset() == 7 * k
        for a, b in zip(cf(x, w), f_slices(x, w)):
            torch.testing.assert_close(a, b)
    xt, wt = torch.randn(4, 8).t(), torch.randn(6, 4).t()  # non-contiguous inputs
    for a, b in zip(cf(xt, wt), f_slices(xt, wt)):
        torch.testing.assert_close(a, b)


def test_an_output_that_views_an_input_stays_a_view():
    x, w = torch.randn(8, 4), torch.randn(4, 6)
    _, xt = fusec.compile(f_slices, backend="cpp")(x, w)
    assert xt._base is x and xt.data_ptr() == x.data_ptr()
    x.add_(1)  # writes through the view, as eager's
    torch.testing.assert_close(xt, x.t())


def test_empty_inputs():
    x, w = torch.randn(1, 4), torch.randn(4, 0)
    cf = fusec.compile(f_slices, backend="cpp")
    for a, b in zip(cf(x, w), f_slices(x, w)):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b)


def test_a_shape_familys_views_take_its_sizes():
    """Sizes as symbols: the view's shape, strides and offset (`1 + x_size1*...`: the rows
    skipped are a size of the call) are this call's."""
    def f(x, w):
        return torch.mm(x[2:, 1:], w[1:]) + 1
    cf = fusec.compile(f, backend="cpp", dynamic=True)
    for n, m in ((4, 5), (7, 6), (9, 8)):
        x, w = torch.randn(n, m), torch.randn(m, 3)
        torch.testing.assert_close(cf(x, w), f(x, w))
    views = [line for line in _run_lines(cf) if "_reinterpret_tensor(s0" in line]
    assert views and "x_size1" in views[0].split("),")[-1], _run_lines(cf)


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_a_training_step_with_views_of_weights(backend):
    """A linear layer's backward reads views of its inputs and gradients (`w.t()`), made per
    call; the gradients are eager's on the first call and on the fast path."""
    torch.manual_seed(0)
    model, ref = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    ref.load_state_dict(model.state_dict())
    compiled = fusec.compile(model, backend=backend)
    x = torch.randn(4, 5)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        compiled(x).square().sum().backward()
        ref(x).square().sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)


def test_the_fallback_makes_the_same_view():
    """`view_at` (for a torch without `_reinterpret_tensor`) and `reinterpret_tensor` agree."""
    base = torch.arange(40.0)[3:]
    for offset in (0, 2):
        a = reinterpret_tensor(base, (2, 3), (1, 2), offset)
        b = view_at(base, (2, 3), (1, 2), offset)
        assert a.storage_offset() == b.storage_offset() == 3 + offset
        torch.testing.assert_close(a, b)


def test_the_shown_program_runs():
    """`cf.source()`'s wrapper imports `reinterpret_tensor` and runs as the program does."""
    x, w = torch.randn(8, 4), torch.randn(4, 6)
    cf = fusec.compile(f_slices, backend="cpp")
    cf(x, w)
    scope: dict = {}
    exec(fusec.runtime.python_wrapper(cf.last.program), scope)
    for a, b in zip(scope["call"](x, w), f_slices(x, w)):
        torch.testing.assert_close(a, b)


def test_a_program_written_with_the_fallback(monkeypatch):
    """Where torch has no `_reinterpret_tensor`, the program calls `view_at`: the same answers."""
    from fusec.runtime import writer
    monkeypatch.setattr(writer, "reinterpret_tensor", view_at)
    cf = fusec.compile(f_slices, backend="cpp")
    big = torch.randn(40)
    x, w = big[3:35].view(8, 4), torch.randn(4, 6)
    for a, b in zip(cf(x, w), f_slices(x, w)):
        torch.testing.assert_close(a, b)
    assert cf.last.program.run.__globals__["_reinterpret_tensor"] is view_at


def test_a_kernel_written_over_a_dying_buffer():
    """Triton (the interpreter here): softmax written over the scores' matmul, seen with the
    softmax's shape through `_reinterpret_tensor`, its answers eager's call after call."""
    from conftest import TRITON_DEVICE

    def f(q, k):
        return torch.softmax((q @ k.transpose(-2, -1)) * 0.5, dim=-1) @ k
    cf = fusec.compile(f, backend="triton")
    for seed in range(2):
        torch.manual_seed(seed)
        q, k = torch.randn(3, 20, 8, device=TRITON_DEVICE), torch.randn(3, 20, 8, device=TRITON_DEVICE)
        torch.testing.assert_close(cf(q, k), f(q, k), rtol=1e-4, atol=1e-5)
    lines = [line for line in _run_lines(cf) if "written over" in line]
    assert lines and all("= _reinterpret_tensor(" in line for line in lines), _run_lines(cf)


def test_an_output_that_alone_views_a_fresh_buffer_is_reinterpreted():
    """`relu(x)[1:]`: the buffer relu's kernel allocates is seen only through the slice, so the
    program returns the slice reinterpreted (as torch.compile does); `relu(x)` returned beside
    its slice keeps the slice a real view of it."""
    x = torch.randn(8, 4)
    one = fusec.compile(lambda x: torch.relu(x)[1:], backend="cpp")
    torch.testing.assert_close(one(x), torch.relu(x)[1:])
    assert any("= _reinterpret_tensor(s1, (7, 4), (4, 1), 4)" in line
               for line in _run_lines(one)), _run_lines(one)
    both = fusec.compile(lambda x: (torch.relu(x), torch.relu(x)[1:]), backend="cpp")
    y, y1 = both(x)
    torch.testing.assert_close(y1, torch.relu(x)[1:])
    assert y1._base is y
    assert not any("_reinterpret_tensor(" in line for line in _run_lines(both)), _run_lines(both)

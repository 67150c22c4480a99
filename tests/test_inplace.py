"""Kernel outputs written over a dying extern result (passes/schedule.py, plan_inplace): only on
the Triton backend, only where every element is read where it is written, never over anything
that is read later, returned, or owned by the caller."""
import pytest
import torch

import fusec
from conftest import CPU_BACKENDS, TRITON_DEVICE, assert_matches
from fusec.demo import load_example

# the Triton backend: real Triton on a GPU machine, the interpreter here
DEVICE = TRITON_DEVICE


def randn(*shape):
    return torch.randn(*shape, device=DEVICE)


def inplace_of(cf) -> dict:
    return cf.last.inplace


def scores_softmax(q, k):
    return torch.softmax((q @ k.transpose(-2, -1)) * 0.5, dim=-1) @ k


def test_triton_softmax_is_written_over_the_scores():
    q, k = randn(3, 20, 8), randn(3, 20, 8)
    q0, k0 = q.clone(), k.clone()
    cf = assert_matches(scores_softmax, q, k, backend="triton")
    assert list(inplace_of(cf).values()) == ["bmm"]
    assert "written over bmm (its last use)" in cf.schedule
    again = cf(q, k)
    torch.testing.assert_close(again, scores_softmax(q, k))
    assert torch.equal(q, q0) and torch.equal(k, k0)  # the caller's tensors are never written


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_cpu_backends_never_write_in_place(backend):
    q, k = torch.randn(3, 20, 8), torch.randn(3, 20, 8)
    cf = assert_matches(scores_softmax, q, k, backend=backend)
    assert inplace_of(cf) == {}


def test_triton_gpt2_block_in_bf16_and_f32():
    for dtype in (torch.float32, torch.bfloat16):
        ex = load_example("gpt2_block").example(batch=2, seq=16, n_embd=32, n_head=2,
                                                dtype=dtype, device=DEVICE)
        with torch.no_grad():
            cf = assert_matches(ex.fn, *ex.inputs, backend="triton")
            first = cf(*ex.inputs).clone()
            torch.testing.assert_close(cf(*ex.inputs), first, rtol=0, atol=0)
        chosen = inplace_of(cf._compiled)
        assert len(chosen) >= 3, chosen  # softmax over bmm, GELU over the fc product, ...


def test_triton_output_written_over_a_product_is_fresh_each_call():
    def f(a, b):
        return torch.relu(a @ b) * 2
    a, b = randn(6, 5), randn(5, 7)
    cf = assert_matches(f, a, b, backend="triton")
    assert list(inplace_of(cf).values()) == ["mm"]
    first = cf(a, b)
    second = cf(a * 3, b)
    torch.testing.assert_close(first, f(a, b))  # call 1's output survives call 2
    torch.testing.assert_close(second, f(a * 3, b))
    assert first.data_ptr() != second.data_ptr()


@pytest.mark.parametrize("case", ["shifted", "read_later", "returned", "dtype", "row_result",
                                  "input"])
def test_triton_left_alone(case):
    a, b = randn(6, 5), randn(5, 6)
    fn = {
        "shifted": lambda a, b: (lambda y: y + y.t())(a @ b),  # read at another index too
        "read_later": lambda a, b: (lambda y: (torch.relu(y) @ y) * y)(a @ b),
        "returned": lambda a, b: (lambda y: (y, torch.exp(y)))(a @ b),
        "dtype": lambda a, b: torch.relu(a @ b).to(torch.float16),
        "row_result": lambda a, b: (a @ b).sum(-1),
        "input": lambda a, b: torch.relu(a) * 2,  # the caller's tensor: never written
    }[case]
    cf = assert_matches(fn, a, b, backend="triton")
    assert "mm" not in inplace_of(cf).values(), inplace_of(cf)  # y = a @ b is never written


def test_triton_profile_judges_an_in_place_kernel_on_its_own_inputs():
    from test_profile import FAST
    q, k = randn(3, 20, 8), randn(3, 20, 8)
    report = fusec.profile(scores_softmax, q, k, backend="triton", **FAST)
    kernels = [line for line in report.kernels if line.kind == "kernel"]
    assert kernels
    for line in kernels:
        assert line.numerics == "ok", (line.name, line.numerics)

"""Identities (passes/cse.py): `x - 0`, `x * 1`, `x / 1` and integer `x + 0` are the value x itself.

Each test runs on every backend against eager. The rule must keep what eager returns: -0.0 + 0 is
+0.0 (so float `x + 0` stays), a bool plus 0 is an int64 tensor, `x * 0` is not x (NaN * 0 is
NaN), and an output is a new tensor, never the input.
"""
import torch

import fusec
from conftest import assert_matches
from fusec.record import record_of


def taken(cf) -> list[str]:
    """The nodes merged into another (cse: here every merge is an identity's)."""
    return [m.removed for m in record_of(cf.last.gm).cse]


def test_integer_plus_zero_and_float_times_one_read_their_input(target):
    backend, device = target
    i = torch.tensor([3, -7, 0, 2 ** 40], device=device)
    x = torch.tensor([float("nan"), -0.0, float("inf"), 2.5], device=device)

    def f(i, x):
        return (i + 0) * 2, ((x * 1) - 0) / 1 + x.sin()

    cf = assert_matches(f, i, x, backend=backend)
    assert sorted(taken(cf)) == ["add", "div", "mul_1", "sub"], taken(cf)  # (mul: the * 2)


def test_float_plus_zero_keeps_the_sign_of_zero(target):
    backend, device = target
    x = torch.tensor([-0.0, 0.0, -1.0, float("nan")], device=device)
    cf = assert_matches(lambda x: 1 / (x + 0), x, backend=backend)  # +inf, +inf, -1, nan
    assert taken(cf) == []


def test_promoting_or_zeroing_ops_stay(target):
    backend, device = target
    b = torch.tensor([True, False, True], device=device)
    x = torch.tensor([1.0, float("nan"), float("inf")], device=device)
    i = torch.tensor([1, 2, 3], device=device, dtype=torch.int32)

    def f(b, x, i):
        return (b + 0) * 3, x * 0 + 1, i * 1.0 + 0.5, i / 1  # int64, nan/1, float, float

    cf = assert_matches(f, b, x, i, backend=backend)
    assert taken(cf) == []


def test_an_output_is_a_new_tensor(target):
    """`x * 1` returned, or a view of it: eager gives a new tensor; so does fusec (the rule
    leaves what the program returns)."""
    backend, device = target
    x = torch.randn(6, device=device)
    cf = fusec.compile(lambda x: (x * 1, (x - 0).view(2, 3).t(), x * 1 + 1), backend=backend)
    a, b, c = cf(x)
    torch.testing.assert_close(b, x.view(2, 3).t())
    assert a.data_ptr() != x.data_ptr() and b.data_ptr() != x.data_ptr()
    b.zero_()
    assert x.abs().sum() > 0


def test_a_shape_family_s_position_ids_are_not_a_kernel(target):
    """arange(n) + 0 with n a symbol (a shape family) does not fold into a constant; the add is
    dropped, so the ids are read straight from arange's result by the kernel that uses them."""
    backend, device = target
    table = torch.randn(40, 8, device=device)

    def f(x):
        ids = torch.arange(x.shape[0], device=x.device) + 0
        return table[ids] * x

    cf = fusec.compile(f, backend=backend, dynamic=True)
    for n in (5, 9, 2):
        x = torch.randn(n, 8, device=device)
        torch.testing.assert_close(cf(x), f(x))
    assert not any(k.name.startswith("fused_add_") for k in cf.kernels), [k.name for k in cf.kernels]

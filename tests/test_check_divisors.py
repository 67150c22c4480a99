"""passes/check_divisors.py: an integer division by zero raises, as eager's does, on every
backend; a division with no zero divisor gives eager's answer; float division is not checked."""
import pytest
import torch

import fusec
from fusec.record import record_of

DIVISIONS = {
    "floor_divide": lambda x, y: x // y,
    "remainder": lambda x, y: x % y,
    "fmod": torch.fmod,
    "trunc": lambda x, y: torch.div(x, y, rounding_mode="trunc"),
    "floor": lambda x, y: torch.div(x, y, rounding_mode="floor"),
}


def operands(dtype, device, zero_at=None, shape=(5, 7)):
    torch.manual_seed(0)
    low = 0 if dtype == torch.uint8 else -50
    x = torch.randint(low, 100, shape, dtype=dtype, device=device)
    y = torch.randint(1, 9, shape[-1:], dtype=dtype, device=device)  # (broadcast over rows)
    if dtype != torch.uint8:
        y = y * torch.where(torch.arange(shape[-1], device=device) % 2 == 0, 1, -1).to(dtype)
    if zero_at is not None:
        y[zero_at] = 0
    return x, y


@pytest.mark.parametrize("name", list(DIVISIONS))
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8])
def test_no_zero_gives_eagers_answer_and_a_zero_raises(target, name, dtype):
    backend, device = target
    fn = DIVISIONS[name]
    cf = fusec.compile(lambda x, y: fn(x, y) + 1, backend=backend)
    x, y = operands(dtype, device)
    for _ in range(2):  # (the second call takes the fast path: the check is in the program)
        torch.testing.assert_close(cf(x, y), fn(x, y) + 1)
    x, y = operands(dtype, device, zero_at=3)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        fn(x, y)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        cf(x, y)


def test_one_check_per_divisor_and_explain_says_so():
    def fn(x, y):
        return x // y + x % y, torch.fmod(x * 2, y)
    x, y = operands(torch.int32, "cpu")
    cf = fusec.compile(fn, backend="cpp")
    torch.testing.assert_close(cf(x, y), fn(x, y))
    checks = record_of(cf.last.gm).check_divisors
    assert [d.taken for d in checks] == [True], checks
    assert "integer divisor(s) checked once" in str(fusec.explain(cf, x, y))


def test_float_division_and_a_number_are_not_checked():
    x = torch.randn(4, 6)
    cf = fusec.compile(lambda x, y: x // y + x / 0.0 + torch.fmod(x, y), backend="llvm")
    y = torch.zeros(6)  # (float: inf and NaN, as eager's)
    torch.testing.assert_close(cf(x, y), x // y + x / 0.0 + torch.fmod(x, y), equal_nan=True)
    assert not record_of(cf.last.gm).check_divisors
    xi = torch.arange(6)
    torch.testing.assert_close(fusec.compile(lambda x: x // 4 + x % 3, backend="cpp")(xi),
                               xi // 4 + xi % 3)
    with pytest.raises(fusec.FusecError, match="ZeroDivisionError"):
        fusec.compile(lambda x: x // 0, backend="cpp")(xi)


@pytest.mark.parametrize("dtype, number", [(torch.int32, 2**40), (torch.uint8, 256)])
def test_a_number_the_dtype_holds_as_zero_raises(dtype, number):
    """Eager converts a Python divisor to the dividend's dtype first (wrapping): `int32 // 2**40`
    divides by 0 and raises; fusec compared the number itself and returned 0s."""
    x = torch.tensor([7, 0, 3, 9], dtype=dtype)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        (x * 1) // number
    with pytest.raises(fusec.FusecError, match=f"ZeroDivisionError: .* by the number {number}"):
        fusec.compile(lambda x: (x * 1) // number, backend="cpp")(x)
    wraps = 2**32 + 3 if dtype == torch.int32 else 259  # (3 in the dtype: eager's answer)
    torch.testing.assert_close(fusec.compile(lambda x: (x * 1) // wraps, backend="cpp")(x),
                               (x * 1) // wraps)

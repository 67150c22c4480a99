"""Numerics and op semantics of programs as users write them: eager's answer or eager's error.

Probed (session 2026-12-07b, scripts of a few ops fused together, C++ and LLVM, each compared
with eager: values, dtypes, shapes, NaN positions, and the errors eager raises), and held:
- dtypes and promotion: uint8/int8/int16/int32/int64 wraparound (255 + 1, int32 * 100000), abs and
  neg of INT_MIN, sign, bool arithmetic, int tensors with Python floats and 0-d tensors, half /
  bfloat16 / float64 mixes, float -> int/uint8/bool casts of negative and NaN values, //, % and
  torch.div's rounding modes with negative operands (floored, as torch does), fmod/remainder
  signs, pow with int, negative and tensor exponents, shifts by >= the width and by negatives,
  bitwise ops, clamp with one bound, min > max and NaN bounds, round half-even and with
  decimals, copysign, nextafter, logaddexp(2), xlogy/xlog1py at 0 and NaN, where with scalars,
  nan_to_num, isclose, maximum vs fmax with NaN, heaviside, gcd/lcm.
- reductions with NaN/inf/-0.0: max/min/amax/argmax/argmin (first index on ties), softmax and
  log_softmax of all -inf rows, mean/sum/prod/logsumexp of empty dims, amax/argmax of an empty dim
  (raises), var with correction >= n, vector norms (0, inf, -inf, 3), sums of bools and of small
  ints (promoted to int64), int prod overflow, any/all on empty, cumsum/cumprod/cummax/
  logcumsumexp, sort/topk/argsort/kthvalue/median, rows of 70001.
- shapes: empty tensors anywhere in a chain, 0-d tensors, size-1 broadcasting both ways,
  transposed / stepped / expanded / flipped inputs, channels_last, odd primes, dim=() reductions.
- indexing: negative advanced indices, masks, index_select/gather/scatter/scatter_add/
  scatter_reduce/index_put/take/put with duplicates, and out-of-range indices (raise), masked_fill
  with a tensor value, embedding with padding_idx, bucketize/searchsorted, unique, nonzero.
Found and fixed (the tests below fail on the code before):
- `index_add` with a negative index added into a row counted from the end; eager raises (torch's
  decomposition is an index_put, which takes negatives): it stays eager's op
  (capture/decompositions.py, KEEP_AS_EXTERN).
- `F.one_hot` of a label out of [0, num_classes) gave a row of zeros; eager raises: its checks
  are traced as asserts (capture/eager_checks.py).
- `F.multilabel_margin_loss` with a -1 in its targets: torch's decomposition gave 3.11 where
  eager says 1.33: it stays eager's op.
- `F.binary_cross_entropy` of a probability outside [0, 1] gave NaN; eager raises (eager_checks).
- a Python number a uint8/int8/int32/float32 result cannot hold (`masked_fill(m, 256)`,
  `where(c, int8_x, 300)`, `clamp(max=300)`, `full_like(x, 300)`) was wrapped (256 filled 0s);
  eager raises "value cannot be converted ... without overflow": refused while compiling.
- in-place arithmetic whose result the tensor cannot hold by kind (`int_x *= float_tensor`,
  `u8 *= 1.5`) stored a truncated value; eager raises "result type Float can't be cast to the
  desired output type Long": refused while tracing (eager_checks). An int tensor to a negative
  int power (`x ** -1`) gave 0s; eager raises: refused.
- `mask |= other` (Tensor.__ior__, and &=, ^=, <<=, >>=) could not be captured at all
  (functionalize refuses aten::__ior__): traced as bitwise_or_.
- an empty (0, 0) space broadcast from (1, 0) and (0, 1) crashed lowering ("layout (0, 1) does not
  broadcast to (1, 0)"): the loop is the space both broadcast into (fusec/sizes.py).
- softmax/log_softmax of an int or bool tensor (no dtype=) gave 0s, std/var of an int tensor gave
  0, argmax/argmin of a bool one an index; eager has no kernel for those dtypes: refused.
Diagnosed, left (/work/notes/ask_probe_num.md): `x.index_copy(0, tensor([-1]), s)` writes the
last row where eager raises (a check changes the GPU KV-cache write kernels' tests); `x // 2**40`
of an int32 x: eager wraps the divisor to 0 and raises ZeroDivisionError, fusec divides by 2**40
(passes/check_divisors.py's literal check).
Eager raises and fusec computes, left: `int_x - True`; frac of an int tensor, abs of a bool one
("not implemented for 'Long'").
Differs from eager on degenerate input, left: `torch.std_mean` of a row of all -inf gives mean
-inf (eager's Welford mean is NaN; torch.mean says -inf); eval batch_norm with running_var 0 and
eps=0 gives +-inf (eager's fused formula 0 * inf gives NaN); maximum/minimum of 0.0 and -0.0
(eager's own vectorized and scalar paths disagree).
"""
import pytest
import torch
import torch.nn.functional as F

import fusec


def _check(fn, backend, *args):
    compiled = fusec.compile(fn, backend=backend)
    for _ in range(2):  # (the second call takes the fast path)
        torch.testing.assert_close(compiled(*args), fn(*args), equal_nan=True)
    return compiled


def _index_add(x, index, source):
    return (x * 2).index_add(0, index, source, alpha=3) + 1


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_index_add_of_a_negative_index_raises_as_eager(backend):
    x, source = torch.randn(5, 4), torch.randn(3, 4)
    _check(_index_add, backend, x, torch.tensor([0, 0, 4]), source)  # (duplicates add up)
    compiled = fusec.compile(_index_add, backend=backend)
    for bad in ([0, 0, -1], [0, 5, 1]):
        with pytest.raises(IndexError, match="out of range"):
            _index_add(x, torch.tensor(bad), source)
        with pytest.raises(IndexError, match="out of range"):
            compiled(x, torch.tensor(bad), source)


def _one_hot(labels):
    return F.one_hot(labels * 1, 5) * 2


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_one_hot_of_a_label_out_of_range_raises_as_eager(backend):
    _check(_one_hot, backend, torch.tensor([0, 4, 2]))
    _check(_one_hot, backend, torch.tensor([], dtype=torch.long))
    compiled = fusec.compile(_one_hot, backend=backend)
    for bad, message in (([0, 5, 1], "smaller than num_classes"), ([0, -1], "non-negative")):
        with pytest.raises(RuntimeError, match=message):
            _one_hot(torch.tensor(bad))
        with pytest.raises(RuntimeError, match=message):
            compiled(torch.tensor(bad))


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_an_empty_space_broadcast_from_both_sides(backend):
    out = _check(lambda x: (x * 2).sum(0, keepdim=True) + (x * 2).mean(1, keepdim=True), backend,
                 torch.randn(0, 0))(torch.randn(0, 0))
    assert out.shape == (0, 0)
    _check(lambda x, y: (x * 2) + (y - 1), backend, torch.randn(1, 0), torch.randn(0, 1))


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_multilabel_margin_loss_is_eagers(backend):
    loss = lambda x, t: F.multilabel_margin_loss(x * 2, t, reduction="none") + 1  # noqa: E731
    _check(loss, backend, torch.randn(2, 4), torch.tensor([[3, -1, 2, 1], [0, 1, 2, -1]]))


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_binary_cross_entropy_of_a_probability_outside_0_1_raises(backend):
    bce = lambda p, t: F.binary_cross_entropy(torch.sigmoid(p) * 2 - 0.5, t)  # noqa: E731
    target = torch.tensor([1.0, 0.0, 1.0])
    _check(bce, backend, torch.tensor([0.0, 0.1, -0.2]), target)
    for bad in ([0.0, 3.0, 0.0], [0.0, float("nan"), 0.0]):
        with pytest.raises(RuntimeError, match="between 0 and 1"):
            bce(torch.tensor(bad), target)
        with pytest.raises(RuntimeError, match="between 0 and 1"):
            fusec.compile(bce, backend=backend)(torch.tensor(bad), target)


OVERFLOWING = {
    "masked_fill": (lambda x: (x * 1).masked_fill(x > 100, 256), torch.uint8),
    "where": (lambda x: torch.where(x > 0, x * 2, 300), torch.int8),
    "clamp": (lambda x: (x + 1).clamp(max=300), torch.uint8),
    "full_like": (lambda x: torch.full_like(x, 300) + x, torch.uint8),
    "int32": (lambda x: (x * 1).clamp(max=2**40), torch.int32),
    "float32": (lambda x: (x * 1).masked_fill(x > 100, 1e39), torch.float32),
}


@pytest.mark.parametrize("name", list(OVERFLOWING))
def test_a_number_the_dtype_cannot_hold_is_refused_as_eager(name):
    fn, dtype = OVERFLOWING[name]
    x = torch.tensor([0, 1, 120, 127, 7], dtype=dtype)
    with pytest.raises(RuntimeError, match="without overflow"):
        fn(x)
    with pytest.raises(fusec.UnsupportedError, match="without overflow"):
        fusec.compile(fn, backend="cpp")(x)


def test_numbers_eager_takes_still_compile():
    """uint8 takes -255..255 (a negative wraps), int8 -128..127; arithmetic wraps unchecked."""
    x = torch.tensor([0, 1, 200, 255, 7], dtype=torch.uint8)
    fn = lambda x: (x * 1).masked_fill(x > 100, -1) + torch.full_like(x, -255) + (x + 300)  # noqa: E731
    _check(fn, "cpp", x)
    _check(lambda x: torch.where(x > 0, x, -128) + (x * 1).clamp(-2.5, 2.5), "llvm",
           x.to(torch.int8))


def _inplace_mul(x, y):
    x = x * 1
    x *= y
    return x


def _inplace_bits(x, shift):
    mask = x > 0
    mask |= x < -1
    mask &= x != 3
    y = x * 1
    y <<= shift
    y ^= 5
    y |= 8
    return mask, y


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_in_place_arithmetic_and_powers_eager_refuses(backend):
    x = torch.tensor([1, -2, 3, 4])
    _check(_inplace_mul, backend, x.float(), x)  # (float *= int: fine)
    _check(_inplace_mul, backend, x, x.to(torch.int8))
    _check(lambda x: (x * 1) ** -1.0 + (x * 1.0) ** -1, backend, x)
    for fn, args in ((_inplace_mul, (x, torch.tensor(2.5))), (_inplace_mul, (x, x.float())),
                     (lambda x: (x * 1) ** -1, (x,))):
        with pytest.raises(RuntimeError):
            fn(*args)
        with pytest.raises(fusec.UnsupportedError, match="cast to the desired|negative integer"):
            fusec.compile(fn, backend=backend)(*args)


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_in_place_bitwise_operators_are_captured(backend):
    _check(_inplace_bits, backend, torch.tensor([1, -2, 3, 4, 0]), torch.tensor([0, 1, 2, 3, 4]))


REFUSED_DTYPES = {
    "softmax": lambda x: F.softmax(x * 2, -1),
    "log_softmax_method": lambda x: (x * 2).log_softmax(-1),
    "std": lambda x: (x * 2).std(1),
    "var_mean": lambda x: torch.var_mean(x + 1),
    "argmax_bool": lambda x: torch.argmax(x > 1, 1),
}


@pytest.mark.parametrize("name", list(REFUSED_DTYPES))
def test_ops_eager_has_no_kernel_for_the_dtype_of_are_refused(name):
    fn, x = REFUSED_DTYPES[name], torch.tensor([[1, 5, 3], [2, 2, 0]])
    with pytest.raises((RuntimeError, NotImplementedError)):
        fn(x)
    with pytest.raises(fusec.UnsupportedError, match="eager PyTorch raises this too"):
        fusec.compile(fn, backend="cpp")(x)
    if name != "argmax_bool":
        _check(fn, "llvm", x.float())  # (the float tensors eager takes still compile)


def test_a_dtype_given_to_softmax_still_compiles():
    x = torch.tensor([[1, 5, 3], [2, 2, 0]])
    _check(lambda x: F.softmax(x * 2, -1, dtype=torch.float32) + (x * 1).argmax(1, keepdim=True),
           "cpp", x)


@pytest.mark.parametrize("case", ["softmax_int", "inplace_int_times_float", "bce_out_of_range"])
def test_training_captures_check_what_eager_checks(case):
    """The same refusals when a parameter needs grad (the training capture, through AOT
    Autograd, ran none of capture/eager_checks.py's checks: 0.0, a value and NaN came back)."""
    w = torch.nn.Parameter(torch.ones(4))
    programs = {
        "softmax_int": lambda x: (torch.softmax((x * 3).long(), -1) * w).sum(),
        "inplace_int_times_float": lambda x: _inplace_int(x) + w.sum(),
        "bce_out_of_range": lambda x: F.binary_cross_entropy(torch.sigmoid(x * w) * 2,
                                                             torch.ones(4)),
    }
    fn, x = programs[case], torch.randn(4)
    with pytest.raises((RuntimeError, NotImplementedError)):
        fn(x)
    with pytest.raises((RuntimeError, NotImplementedError, fusec.FusecError)):
        fusec.compile(fn, backend="cpp")(x)


def _inplace_int(x):
    y = (x * 10).long()
    y *= torch.tensor(2.5)
    return y.sum()

"""Checks eager makes on tensor values that tracing would lose, put into the graph.

Some composite ops check their input's values before they compute: `F.one_hot(labels, n)` raises
"Class values must be non-negative." for a label below 0 and "Class values must be smaller than
num_classes." for one at or above n. Under fake tensors there are no values to check, so ATen's
traced path skips both and becomes `eq(labels.unsqueeze(-1), arange(n))`: a label of 7 with n = 5
gave a row of zeros, a wrong answer where eager raises.

While fusec traces, `eager_value_checks` catches those calls (a TorchFunctionMode, as
capture/rnn.py does for recurrent layers) and traces each check eager makes as graph ops,
`_assert_async(all(labels >= 0), message)`, before the op itself. The check is a small reduction
that fusion puts into a kernel; on a CPU the assert raises at once with eager's message (prefixed
"fusec: "), on a GPU it is a device-side assert, as eager's CUDA one_hot has.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

F = torch.nn.functional


def _one_hot_checks(labels, num_classes=-1):
    """Eager's value checks of `F.one_hot(labels, num_classes)`, traced as asserts."""
    if not isinstance(labels, torch.Tensor) or labels.numel() == 0:
        return  # (eager checks nothing in an empty tensor either)
    torch._assert_async(torch.all(labels >= 0), "fusec: one_hot: Class values must be non-negative.")
    if not isinstance(num_classes, int) or num_classes != -1:
        torch._assert_async(torch.all(labels < num_classes),
                            "fusec: one_hot: Class values must be smaller than num_classes.")


# func -> a function of the same arguments that traces eager's checks of them
CHECKS = {F.one_hot: _one_hot_checks}


class _EagerValueChecks(TorchFunctionMode):
    """See `eager_value_checks`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        check = CHECKS.get(func)
        if check is not None:
            check(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def eager_value_checks():
    """While tracing, each op in `CHECKS` first traces the checks eager makes of its values."""
    with _EagerValueChecks():
        yield

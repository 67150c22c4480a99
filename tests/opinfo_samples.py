"""PyTorch's OpInfo samples for the tests that run them (tests/test_opinfo.py,
tests/models/test_capture_models.py), without the stack walk each request costs.

`op.sample_inputs(device, dtype)` asks torch.testing._internal.common_utils.extract_test_fn for
the unittest.TestCase method running it (to seed the samples by its name and to note the
sample being run for a failure message). It looks for one with `inspect.stack()`, which reads
the source lines of every frame on the stack: under pytest, whose stack is deep, that is a
large part of making a few small tensors. Our tests are plain functions, so it never finds one
and returns None; `samples` has it return None without looking, and gets the same samples
(seeded the same way: by the default seed, as when no test method is found).
"""
import contextlib
from unittest import mock

import pytest


@contextlib.contextmanager
def no_test_method_lookup():
    """OpInfo's sample generators, told at once that no unittest test method is running."""
    from torch.testing._internal import common_utils
    from torch.testing._internal.opinfo import core
    with mock.patch.object(common_utils, "extract_test_fn", lambda: None), \
            mock.patch.object(core, "extract_test_fn", lambda: None):
        yield


def op_db() -> list:
    """torch's list of OpInfos (importing it takes a while: once per process)."""
    pytest.importorskip("expecttest")  # torch.testing._internal needs it
    from torch.testing._internal.common_methods_invocations import op_db as ops
    return ops


def samples(op, device, dtype, limit: int) -> list:
    """The first `limit` of `op`'s sample inputs on `device` in `dtype`."""
    with no_test_method_lookup():
        out = []
        for sample in op.sample_inputs(device, dtype):
            if len(out) == limit:
                break
            out.append(sample)
        return out

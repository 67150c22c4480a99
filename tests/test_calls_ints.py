"""Calls of tensors and ints take a fast path (fusec/fastpath.py, Note: calls of tensors and ints).

AOT Autograd hands a shape family's backward the sizes the forward saved as ints among its
tensors. The fast path checks each such int against the size it is (`a0 == a1.shape[0]`), and
any other int against its value; a call whose ints differ returns MISS, and the general path
decides as before.
"""
from __future__ import annotations

import torch

from fusec.fastpath import MISS, fast_path_key, flat_args, guarded_call, int_checks


def test_flat_args_are_tensors_and_ints():
    x = torch.randn(3)
    assert flat_args((x, 3, torch.nn.Parameter(x)))
    assert flat_args(())
    assert not flat_args((x, True))  # (a bool is an int to isinstance, not here)
    assert not flat_args((x, 2.0))
    assert not flat_args((x, [x]))


def test_int_checks_say_which_ints_are_sizes():
    x = torch.randn(4, 5)
    derived = {0: (2, 1), 1: (2, 0)}  # arg 0 is dim 1 of arg 2, arg 1 dim 0 of arg 2
    assert int_checks((5, 4, x, 7), derived) == {0: ("size of", 2, 1), 1: ("size of", 2, 0),
                                                 3: ("value", 7)}
    # an int that is not that size this call: checked by its value
    assert int_checks((6, 4, x), derived)[0] == ("value", 6)


def test_a_guard_checks_sizes_and_values():
    x = torch.randn(4, 5)
    ran = []
    fast = guarded_call(lambda ts: ran.append(ts) or "ran", [x], 0, [], None,
                        ints={1: ("size of", 0, 1), 2: ("value", 7)})
    assert fast((x, 5, 7)) == "ran" and len(ran[0]) == 1 and ran[0][0] is x  # the tensors alone
    assert fast((x, 4, 7)) is MISS  # not dim 1 of x
    assert fast((x, 5, 8)) is MISS  # another value
    assert fast((x, 5.0, 7)) is MISS and fast((x, 5, 7.0)) is MISS
    assert fast((x, 5)) is MISS
    y = torch.randn(4, 6)
    assert fast((y, 6, 7)) is MISS  # (a static program: y's shape is not x's)
    assert "a0 != a2" not in fast.source and "a1 != a0.shape[1]" in fast.source


def test_a_familys_fast_path_is_kept_per_family_and_values():
    class Captured:
        shape_env = object()

    class Compiled:
        captured = Captured()
    x, compiled = torch.randn(4, 5), Compiled()
    derived = {0: (1, 0)}
    assert fast_path_key(("k",), compiled, (4, x), derived) == ("family", id(compiled))
    assert fast_path_key(("k",), compiled, (4, x, 3), derived) == \
        ("family", id(compiled), ((2, 3),))
    Captured.shape_env = None
    assert fast_path_key(("k",), compiled, (4, x), derived) == ("k",)

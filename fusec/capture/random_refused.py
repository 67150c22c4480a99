"""Python's own random numbers, drawn by a program while it is traced.

`if random.random() < self.layerdrop:` (LayerDrop, stochastic depth) or `x * np.random.rand()`:
eager draws a new number on every call, but a captured graph would hold the one drawn while
tracing, forever (a silent wrong answer: every call skips the same layers). So while a capture
runs, `random`'s and `numpy.random`'s functions, called from the user's code, raise a
GraphBreakError instead; with fullgraph=False the program is compiled in regions by TorchDynamo,
which draws them on every call. (`torch.rand(())` is an op of the graph, drawn on every call:
the way to keep such a program one graph.)

Only the module attributes are replaced (`random.random(...)`, `np.random.rand(...)`); a name
imported before (`from random import random`) is the original function and is not seen.
"""
from __future__ import annotations

import random
import sys
from typing import Callable

_PYTHON = ("random", "uniform", "randint", "randrange", "choice", "choices", "sample", "shuffle",
           "gauss", "normalvariate", "triangular", "betavariate", "expovariate")
_NUMPY = ("rand", "randn", "random", "random_sample", "uniform", "normal", "randint", "choice",
          "permutation", "shuffle")


def refuse_random(tracing: Callable[[], bool], user_file: Callable[[str], bool],
                  error: Callable) -> Callable[[], None]:
    """Replace the random functions of `random` and (when imported) `numpy.random` with ones
    that raise `error(what, why, frame)` when called from the user's code (`user_file`) while
    this thread captures (`tracing`), and call the original otherwise; returns the function
    that puts them back."""
    def refusal(label: str):
        frame = sys._getframe(2)  # (the caller of the replaced function)
        if not (tracing() and user_file(frame.f_code.co_filename)):
            return None
        return error(f"a Python random number ({label})", "eager draws a new one on every "
                     "call, a captured graph would keep the one drawn while tracing; use "
                     "torch.rand, or move it outside the compiled function", frame)

    owners = [(random, "random", _PYTHON)]
    np = sys.modules.get("numpy")
    if np is not None:
        owners.append((np.random, "np.random", _NUMPY))
    saved = []
    for owner, prefix, names in owners:
        for name in names:
            real = getattr(owner, name, None)
            if real is not None:
                saved.append((owner, name, real))
                setattr(owner, name, _refusing(real, f"{prefix}.{name}()", refusal))

    def restore():
        for owner, name, real in saved:
            setattr(owner, name, real)
    return restore


def _refusing(real: Callable, label: str, refusal: Callable) -> Callable:
    def draw(*args, **kwargs):
        error = refusal(label)
        if error is not None:
            raise error
        return real(*args, **kwargs)
    draw.__wrapped__ = real
    return draw

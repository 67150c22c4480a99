"""How many programs one compiled function compiles and keeps, and what made it compile again.

Note: limits. Every new signature compiles a program, and a program holds kernels, a pool and a
fast path. A function called with a new batch size on every call would compile forever and keep
every program (500 sizes: 500 compiles, +189 MiB). So, as torch.compile's `recompile_limit`
does, a compiled function compiles at most FUSEC_RECOMPILE_LIMIT programs (default 8); past
that, each call with a new signature runs eagerly, and one warning says what changed:

    fusec: softmax reached its recompile limit (8 programs compiled, FUSEC_RECOMPILE_LIMIT=8)
    and this call needs another (x: shape (8, 64) -> (9, 64)); ...

The programs kept in memory are at most that many as well, in an OrderedDict kept in the order
they were last called (`touch`): when the limit is lowered while a function runs, its next new
signature drops the least recently called programs (with their fast paths) down to the new
limit (`trim`). Every recompile's reason is published as the `recompiled` event
(FUSEC_LOG=recompiles prints it) and kept, the last few, in `cf.recompiles`, which
`fusec.explain(cf, ...)` prints.

CompiledFunction._compile_new (fusec/api.py) is where these are used.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict

from fusec import env

KEPT_REASONS = 16  # recompile reasons a compiled function keeps (`cf.recompiles`), newest last
FIELDS = ("shape", "strides", "dtype", "device", "requires_grad")  # a tensor's part of a signature


def recompile_limit() -> int:
    """FUSEC_RECOMPILE_LIMIT: how many programs one compiled function compiles (default 8, as
    torch.compile's `recompile_limit`)."""
    return env.integer("FUSEC_RECOMPILE_LIMIT", 8, minimum=1)


def trim(programs: OrderedDict, limit: int) -> list[tuple]:
    """Keep at most `limit` programs, dropping the least recently called first; returns the
    keys dropped (their fast paths go too). Compiles stop at the limit, so this drops programs
    only when the limit was lowered since they were compiled: FUSEC_RECOMPILE_LIMIT is read on
    every new signature."""
    dropped = []
    while len(programs) > limit:
        dropped.append(programs.popitem(last=False)[0])
    return dropped


def touch(programs: OrderedDict, key: tuple) -> None:
    """`key`'s program was just called: the last to be dropped."""
    try:
        programs.move_to_end(key)
    except KeyError:  # (another thread dropped it meanwhile)
        pass


def what_changed(old: tuple | None, new: tuple, names: list[str]) -> str:
    """What differs between two signatures (fastpath.call_signature, plus the call's structure), in
    words: `x: shape (4, 64) -> (5, 64)`."""
    if old is None:
        return "no program kept to compare with"
    said = [] if old[0] == new[0] else [f"module.training {old[0]} -> {new[0]}"]
    n = len(names)
    if len(old) != len(new):
        said.append("the number of arguments")
    for name, a, b in zip(names, old[1:1 + n], new[1:1 + n]):
        if a == b:
            continue
        if len(a) == len(b) == len(FIELDS):  # a tensor's
            said += [f"{name}: {field} {x} -> {y}" for field, x, y in zip(FIELDS, a, b) if x != y]
        else:
            said.append(f"{name}: {a[-1]!r} -> {b[-1]!r}")
    if len(old) == len(new) and old[1 + n:] != new[1 + n:]:
        said.append("the arguments' structure, or which inputs are the same tensor")
    return "; ".join(said) or "the signature"


def remember(history: list[str], reason: str) -> None:
    """Add a recompile's reason to a compiled function's history, keeping the last
    KEPT_REASONS (a function that recompiles forever keeps a short list, not a growing one)."""
    history.append(reason)
    del history[:-KEPT_REASONS]


def warn_limit_reached(label: str, compiles: int, limit: int, changed: str) -> None:
    """The one warning a compiled function gives when a call needs a program past its limit."""
    warnings.warn(f"fusec: {label} reached its recompile limit ({compiles} programs compiled, "
                  f"FUSEC_RECOMPILE_LIMIT={limit}) and this call needs another ({changed}); "
                  "calls with signatures not compiled yet run eagerly from now on (the compiled "
                  "ones keep their programs). Raise FUSEC_RECOMPILE_LIMIT to compile more",
                  stacklevel=4)

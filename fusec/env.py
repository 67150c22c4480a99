"""fusec's environment variables, read strictly.

A switch that is silently ignored is worse than none: `FUSEC_SAVED_PROGRAMS=off` used to leave
saved programs on, because only the exact text "0" turned them off. Every `FUSEC_*` variable is
read through one of these functions, which accept the usual spellings and raise a FusecError
that names the variable and the values it takes for anything else:

    flag("FUSEC_PDL", True)             1/0, true/false, on/off, yes/no (any case); unset or
                                        empty: the default
    integer("FUSEC_COMPILE_JOBS", None, minimum=0)
    choice("FUSEC_LAYOUT", "auto", ("auto", "contiguous", "channels_last"))
    path("FUSEC_CACHE_DIR")             `~` expanded, made absolute; None when unset

Each is read on every call (a test or a notebook may set a variable at any time), and this module
imports nothing but `os`, so reading a variable costs microseconds and no import time.
"""
from __future__ import annotations

import os

from fusec.errors import FusecError

TRUE = ("1", "true", "on", "yes")
FALSE = ("0", "false", "off", "no")


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def flag(name: str, default: bool | None) -> bool | None:
    """$name as a switch: True for 1/true/on/yes, False for 0/false/off/no (any case), `default`
    when unset or empty (None: the caller decides, as FUSEC_PROGRESS does with the terminal)."""
    value = _raw(name)
    if value is None:
        return default
    if value.lower() in TRUE:
        return True
    if value.lower() in FALSE:
        return False
    raise FusecError(f"fusec: {name}={os.environ[name]!r} is not a switch; use one of "
                     f"{', '.join(TRUE)} (on) or {', '.join(FALSE)} (off)")


def integer(name: str, default: int | None, minimum: int | None = None) -> int | None:
    """$name as a whole number (at least `minimum`), `default` when unset or empty."""
    value = _raw(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or (minimum is not None and number < minimum):
        least = f" of at least {minimum}" if minimum is not None else ""
        raise FusecError(f"fusec: {name}={os.environ[name]!r} is not a whole number{least}")
    return number


def choice(name: str, default: str, allowed: tuple[str, ...]) -> str:
    """$name (lower case) if it is one of `allowed`, `default` when unset or empty."""
    value = _raw(name)
    if value is None:
        return default
    if value.lower() not in allowed:
        raise FusecError(f"fusec: {name}={os.environ[name]!r} is not one of {', '.join(allowed)}")
    return value.lower()


def path(name: str) -> str | None:
    """$name as a path: `~` and `~user` expanded (`FUSEC_CACHE_DIR='~/fc'` is in the home folder,
    not a folder named `~` under the current one), made absolute. None when unset or empty."""
    value = os.environ.get(name)
    if not value:
        return None
    expanded = os.path.expanduser(value)
    if expanded.startswith("~"):
        raise FusecError(f"fusec: {name}={value!r}: cannot expand {value.split('/')[0]!r} "
                         "(no such user, or no home folder)")
    return os.path.abspath(expanded)

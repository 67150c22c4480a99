"""Progress bars for long work: building many kernels, profiling.

A bar is drawn (with rich, on stderr, erased when done) only when stderr is a terminal, or when
asked: `FUSEC_PROGRESS=1` (or `fusec ... --progress`) forces it on, `FUSEC_PROGRESS=0` off. So a
test's captured output never holds one. All bars of one piece of work share one rich `Progress`
(rich allows one live display at a time): `session()` opens it, `track()` adds a task to it.

    for future in progress.builds(as_completed(futures), len(futures)):  # fusec/runtime/build.py
        ...

On its own (a library call, no session open) a build bar appears only for programs of
`MIN_KERNELS` distinct kernels or more, so compiling `a * b + a` in a terminal does not flash a bar.

This file sits in the core, not in inspect/: the build loop (fusec/runtime/build.py) draws its bar
while it works, and it imports nothing of fusec.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterable, Iterator

from fusec import env

MIN_KERNELS = 4
_active = None  # the open rich Progress, if any


def forced() -> bool:
    """FUSEC_PROGRESS=1 (or --progress): draw bars even when stderr is not a terminal."""
    return env.flag("FUSEC_PROGRESS", None) is True


def enabled() -> bool:
    flag = env.flag("FUSEC_PROGRESS", None)  # None: unset, then the terminal decides
    if flag is not None:
        return flag
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


@contextmanager
def session():
    """Open one shared progress display (or join the open one); yields it, or None when off."""
    global _active
    if _active is not None or not enabled():
        yield _active
        return
    from rich.console import Console  # lazy: rich loads only when a bar is drawn
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, \
        TimeElapsedColumn
    bar = Progress(TextColumn("[bold]fusec[/] {task.description}"), BarColumn(),
                   MofNCompleteColumn(), TimeElapsedColumn(),
                   console=Console(stderr=True, force_terminal=forced() or None),
                   transient=True)
    with bar:
        _active = bar
        try:
            yield bar
        finally:
            _active = None


def track(items: Iterable, description: str, total: int, counts=lambda item: True) -> Iterator:
    """Yield `items`, advancing a bar of `total` steps after each item for which counts(item)."""
    with session() as bar:
        if bar is None:
            yield from items
            return
        task = bar.add_task(description, total=total)
        try:
            for item in items:
                yield item
                if counts(item):
                    bar.advance(task)
        finally:
            bar.remove_task(task)


def builds(items: Iterable, total: int | None = None) -> Iterable:
    """fusec/runtime/build.py's loop over the distinct kernels it builds (or over their futures, as
    they complete), with a bar counting the builds done."""
    if total is None:
        items = list(items)
        total = len(items)
    if not enabled() or (_active is None and total < MIN_KERNELS):
        return items
    return track(items, "build kernels", total)

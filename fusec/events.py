"""Events: the core says what just happened; whoever watches decides what to show.

The core of fusec (capture, passes, codegen, runtime and the driver) never imports the tools
that inspect it (fusec/inspect/): they read the core, never the other way round. So when the
driver has captured a graph, run the passes, built a kernel or finished a program, it
*publishes* that here, and every watcher that registered receives it. fusec/inspect/log.py's
printer (FUSEC_LOG, FUSEC_DEBUG_DIR) registers itself when fusec is imported; a benchmark or a
test can register its own:

    class Count:                                  # any object: it receives the events
        def __init__(self):                       # it has a method for, nothing else
            self.kernels = 0
        def kernel_built(self, kernel):
            self.kernels += 1

    events.watch(counter := Count())
    fusec.compile(f)(x)                           # counter.kernels == 1
    events.unwatch(counter)

The events, in pipeline order, with what they carry:

    captured(gm)                               the captured ATen graph, before any pass
    passes_done(captured_gm, gm, snapshots)    after the pipeline (snapshots: None unless recorded)
    kernel_built(kernel)                       one fusec.Kernel, built and loaded
    compiled(compiled_graph, label)            the finished CompiledGraph, its stage times included
    cache(message)                             a disk-cache hit, miss, compile or corrupt entry
    recompiled(label, reason)                  a compiled function compiles another program, and why

One question goes the other way: `wants_detail()` is True when some watcher will read the
user's source line of every node and the graph after every pass. Recording them costs ~15% of
capture and ~20% of a warm start, so the driver records them only then.
"""
from __future__ import annotations

WATCHERS: list = []  # in the order they registered; each receives every event it has a method for


def watch(watcher):
    """Register `watcher` (once); returns it."""
    if not any(w is watcher for w in WATCHERS):
        WATCHERS.append(watcher)
    return watcher


def unwatch(watcher) -> None:
    WATCHERS[:] = [w for w in WATCHERS if w is not watcher]


def publish(event: str, *args) -> None:
    """Call `watcher.<event>(*args)` on every watcher that has such a method."""
    for watcher in list(WATCHERS):
        handler = getattr(watcher, event, None)
        if handler is not None:
            handler(*args)


def wants_detail() -> bool:
    """Does some watcher want source lines and per-pass snapshots recorded?"""
    return any(getattr(w, "wants_detail", lambda: False)() for w in WATCHERS)

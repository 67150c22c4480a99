"""Inspect: the tools that show what the pipeline did. They read every other room; no other room
imports them (tests/test_architecture.py checks it). What the driver does, it publishes through
fusec/events.py, and log.py's printer, a watcher, prints it. What it made, they read from its
typed records (fusec/record.py): a `CompiledGraph` is a `Compilation`, and `record_of(gm)` holds
what each pass decided.

    explain.py         `fusec.explain`: every stage, in order (from listing, changes, groups)
    listing.py         the captured graph, one row per value, with the user's source lines
    changes.py         what each pass changed
    groups.py          the fusion groups, the bytes each kernel moves, refusals, extern calls
    training.py        training: what is saved for backward and recomputed, a step's peak memory
    profile.py         `fusec.profile`: eager vs fused under torch.profiler
    instrument.py      the program and the graph, run so they can be measured
    measure.py         the profiler's events, read back: launches, times, peaks, bandwidth
    report.py          the profile report's data; report_text.py, report_html.py, plots.py draw it
    log.py             FUSEC_LOG and FUSEC_DEBUG_DIR
    graphviz.py        the graph before and after fusion, as DOT (and SVG)
"""

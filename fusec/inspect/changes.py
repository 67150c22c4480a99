"""What each pass changed: nodes removed, groups formed (and from which ops), fusions refused.

`pass_changes(captured_gm, gm, snapshots)` compares the graph after each pass (`passes.Snapshot`:
the values it computes and its groups' members, recorded with the printed graph) with the one
before, and adds what each pass recorded of its decisions (`record_of(gm)`, fusec/record.py);
`fusec.explain` and `FUSEC_LOG=passes` print it.
"""
from __future__ import annotations

import importlib

import torch.fx as fx

from fusec import passes

from fusec.inspect.groups import group_rows
from fusec.inspect.listing import op_kind
from fusec.record import folded_view, record_of


# Passes whose record is a list of Decision(node, taken, why): the summary when some were taken,
# and the words for a taken and a refused candidate in the detail lines. A registered pass
# (passes/__init__.py, `register`) keeps its decisions in `record.extensions` and may give its
# words as DECISION_WORDS in its module (`decision_words`).
DECISIONS = {
    "picks": ("{n} gather(s)/scatter(s) of one position a row as comparisons with the position",
              "rewritten", "kept"),
    "constant_gathers": ("{n} gather(s) by a constant index moved onto constants", "moved", "kept"),
    "check_gathers": ("{n} change(s) for gathered reads: index values checked once, casts "
                      "dropped", "done", "kept"),
    "check_divisors": ("{n} integer divisor(s) checked once for a 0", "checked", "kept"),
    "canonicalize": ("{n} spelling(s) rewritten in canonical form", "rewritten", "kept"),
    "simplify": ("{n} expression(s) simplified", "rewritten", "kept"),
    "filled_slices": ("{n} tensor(s) filled slice by slice written as a cat", "cat", "kept"),
    "computed_pieces": ("{n} cat(s) of computed pieces computed over the cat", "rewritten", "kept"),
    "pad_matmul": ("padded {n} misaligned matmul(s)", "padded", "kept"),
    "pooling": ("{n} pooling(s) as reductions", "reduction", "kept"),
    "move_permutes": ("moved {n} permute(s) out of fusion's way", "moved", "kept"),
    "split_reductions": ("split {n} reduction(s) of few long rows in two", "split", "kept"),
    "fuse_pointwise": ("{n} reshape(s) lifted onto loads", "lifted", "kept"),
    "fuse_reductions": ("{n} pair(s) of independent reductions over the same rows in one kernel",
                        "merged", "kept"),
}


def pass_changes(captured_gm: fx.GraphModule, gm: fx.GraphModule, snapshots) -> list[dict]:
    """For each recorded stage: a one-line summary, detail lines, and the graph as Python."""
    changes = []
    prev_nodes: set[str] | None = None
    prev_groups: dict[str, list[str]] = {}
    kinds = {n.name: op_kind(n) for n in captured_gm.graph.nodes if n.op == "call_function"}
    final_groups = {r["name"]: r for r in group_rows(gm, None)}
    record = record_of(gm)
    for snap in snapshots:
        groups = snap.groups
        nodes = set(snap.nodes) | {n for members in groups.values() for n in members}
        if prev_nodes is None:
            summary, details = _captured_summary(kinds), []
        else:
            parts, details = _graph_changes(snap, kinds, nodes, prev_nodes, prev_groups,
                                            final_groups)
            recorded, recorded_details = _recorded_changes(snap.after, record, gm)
            summary = "; ".join(parts + recorded) or "no change"
            details += recorded_details
        changes.append({"after": snap.after, "summary": summary, "details": details,
                        "graph": snap.code})
        prev_nodes, prev_groups = nodes, groups
    return changes


def _captured_summary(kinds: dict[str, str]) -> str:
    """The first stage's line: how many ATen ops the captured graph holds, of each kind."""
    counts: dict[str, int] = {}
    for k in kinds.values():
        counts[k] = counts.get(k, 0) + 1
    return f"{len(kinds)} ATen op(s): " + ", ".join(
        f"{v} {k}" for k, v in sorted(counts.items())) if kinds else "no ATen ops"


def _graph_changes(snap, kinds: dict[str, str], nodes: set[str], prev_nodes: set[str],
                   prev_groups: dict[str, list[str]], final_groups: dict[str, dict]
                   ) -> tuple[list[str], list[str]]:
    """(summary parts, detail lines) for what the graphs before and after a pass show by
    themselves, whatever the pass: nodes removed, earlier groups merged, groups formed."""
    groups = snap.groups
    removed = [n for n in kinds if n in prev_nodes and n not in nodes]
    formed = {k: v for k, v in groups.items() if k not in prev_groups}
    dissolved = [k for k in prev_groups if k not in groups]
    parts, details = [], []
    if removed and snap.after != "reinplace":  # (reinplace says what it replaced)
        parts.append(f"removed {len(removed)} node(s)")
        details.append("removed (no user, no side effect): " + ", ".join(removed))
    if dissolved:
        parts.append(f"merged {len(dissolved)} earlier group(s)")
        details.append("regrouped: " + ", ".join(dissolved))
    if formed:
        parts.append(f"formed {len(formed)} group(s)")
        for k, members in formed.items():
            info = final_groups.get(k, {})
            shape = tuple(info.get("shape", ()))
            why = ("connected ops over one iteration space " + str(shape)) if shape else \
                "connected ops over one iteration space"
            if info.get("kind") == "reduction":
                why = f"a reduction with its prologue/epilogue ops over {shape}"
            details.append(f"{k}: {', '.join(members)}  ({why})")
    return parts, details


def decision_words(name: str) -> tuple[str, str, str]:
    """The words for the decisions of the registered pass `name`: its module's DECISION_WORDS,
    else plain ones."""
    module = next((p.module for p in passes.REGISTERED if p.name == name), None)
    words = getattr(importlib.import_module(module), "DECISION_WORDS", None) if module else None
    return words or ("{n} rewrite(s) by " + name, "rewritten", "kept")


def _recorded_changes(after: str, record, gm: fx.GraphModule) -> tuple[list[str], list[str]]:
    """(summary parts, detail lines) from what the pass `after` recorded of its own decisions
    (fusec/record.py): what it computed, rewrote or refused, and why."""
    parts: list[str] = []
    details: list[str] = []
    if after == "fold_constants" and record.fold_constants:
        done = record.fold_constants
        parts.append(f"computed {len(done)} constant value(s) once")
        details += [f"{f.node} -> {f.attr}: {f.dtype}{list(f.shape)}, computed while "
                    "compiling (it depends on no input)" for f in done]
    if after == "reinplace" and record.reinplace:
        decisions = record.reinplace
        if any(d.in_place for d in decisions):
            parts.append(f"{sum(1 for d in decisions if d.in_place)} buffer update(s) in place")
        details += [f"{d.update} -> {d.in_place}: {d.why}" if d.in_place
                    else f"{d.update}: kept: {d.why}" for d in decisions]
    if after == "unfuse_bias" and record.unfuse_bias:
        done = record.unfuse_bias
        parts.append(f"unfused {len(done)} linear bias(es)")
        details += [f"{addmm} -> {mm} + {add} (the add fuses into the kernel after it)"
                    for addmm, mm, add in done]
    decisions = getattr(record, after, None) if after in DECISIONS else record.extensions.get(after)
    if decisions:
        # passes that record a Decision(node, taken, why) per candidate
        summary, taken_word, kept_word = DECISIONS.get(after) or decision_words(after)
        taken = sum(1 for _, t, _ in decisions if t)
        if taken:
            parts.append(summary.format(n=taken))
        details += [f"{name}: {taken_word if t else kept_word}: {why}"
                    for name, t, why in decisions]
    if after == "layout" and getattr(record.layout, "convs", None):
        plan = record.layout
        if plan.choice != "unchanged":
            parts.append(plan.summary())
        details.append(f"layout: {plan.choice} ({plan.reason}); see === memory layout ===")
    if after == "schedule":
        steps = record.schedule
        nk = sum(1 for s in steps if s.kind == "kernel")
        ne = len(steps) - nk
        parts.append(f"{len(steps)} step(s): {nk} kernel launch(es), {ne} extern call(s)")
        folded = [n.name for n in gm.graph.nodes if folded_view(n)]
        if folded:
            details.append("views folded into load indices (no copy): " + ", ".join(folded))
    return parts, details

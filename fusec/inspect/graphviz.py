"""Graph pictures: the program before and after fusion, as Graphviz DOT text (and SVG with `dot`).

    e = fusec.explain(f, x)
    print(e.dot("before"))        # DOT text, always available
    svg = e.svg("after")          # SVG text, or None when Graphviz's `dot` is not installed

*Before fusion* is the captured ATen graph, one box per op. The ops that end up in one kernel sit
in one coloured cluster labelled with the kernel's name; extern calls (eager ATen) are red
octagons; views are grey (they fold into load addresses); nodes that dead-code elimination
removed are dashed. *After fusion* is the program fusec runs: one box per kernel (same colour as
its cluster), one octagon per extern call, and an edge per buffer, labelled with the value it
carries.

DOT is plain text (https://graphviz.org/doc/info/lang.html): `digraph { a -> b; }`. Paste it into
any Graphviz viewer, or install Graphviz (`apt-get install graphviz`) and fusec renders SVG itself.
"""
from __future__ import annotations

import operator
import shutil
import subprocess

import torch
import torch.fx as fx

from fusec import ops
from fusec.record import folded_view, group_info, record_of

# Light fills that read well behind black text, one per kernel (cycled).
PALETTE = ["#cfe8fc", "#d4f4d2", "#fde2c8", "#e7dcfa", "#fbd5e5", "#d9f2f0", "#f6f0c4",
           "#e0e0f8", "#f8dccf", "#dcefc4"]
EXTERN_COLOR = "#d62728"
VIEW_COLOR = "#8c8c8c"


def quote(text: str) -> str:
    """A DOT string literal."""
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _meta_text(node: fx.Node) -> str:
    m = node.meta.get("fusec")
    if isinstance(m, tuple):
        return ", ".join(str(x) for x in m)
    return str(m) if m is not None else ""


def _op_name(target) -> str:
    return str(target).replace("aten.", "").replace(".default", "")


def _title(node: fx.Node) -> str:
    """`sin` for a node named after its op, else `name = op` (`permute = permute`, not twice)."""
    op = _op_name(node.target)
    base = op.split(".")[0]
    if node.name == base or node.name.startswith(base + "_"):
        return op
    return f"{node.name} = {op}"


def _is_view(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and ops.classify(node.target) == ops.VIEW


def kernel_members(gm: fx.GraphModule) -> dict[str, list[str]]:
    """Kernel name -> names of the ATen nodes it computes (from the fused graph's sub-modules)."""
    out: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            sub = getattr(gm, node.target)
            out[node.target] = [n.name for n in sub.graph.nodes if n.op == "call_function"]
    return out


def extern_nodes(gm: fx.GraphModule) -> set[str]:
    return {s.node for s in record_of(gm).schedule if s.kind == "extern"}


def dot_before(captured: fx.GraphModule, fused: fx.GraphModule, title: str = "") -> str:
    """The captured graph with each fusion group drawn as a coloured cluster."""
    members = kernel_members(fused)
    group_of = {n: k for k, names in members.items() for n in names}
    colors = {k: PALETTE[i % len(PALETTE)] for i, k in enumerate(members)}
    removed = set(record_of(fused).dce)
    externs = extern_nodes(fused)
    lines = ["digraph before_fusion {", "  rankdir=TB;", "  compound=true;",
             '  node [fontname="Helvetica", fontsize=10, shape=box, style="rounded,filled", '
             'fillcolor=white];', '  edge [color="#555555", arrowsize=0.6];',
             f"  label={quote(title or 'before fusion: captured ATen graph')}; labelloc=t; "
             "fontname=Helvetica;"]
    ids = {n: f"n{i}" for i, n in enumerate(captured.graph.nodes)}
    clustered: dict[str, list[str]] = {k: [] for k in members}
    loose: list[str] = []
    for node in captured.graph.nodes:
        nid = ids[node]
        if node.op == "placeholder":
            decl = f"{nid} [label={quote(node.name + chr(10) + _meta_text(node))}, shape=ellipse, " \
                   f"fillcolor=\"#f2f2f2\"];"
        elif node.op == "get_attr":
            decl = f"{nid} [label={quote(node.name + chr(10) + 'constant')}, shape=ellipse];"
        elif node.op == "output":
            decl = f"{nid} [label=\"output\", shape=ellipse, fillcolor=\"#f2f2f2\"];"
        else:
            label = f"{_title(node)}\n{_meta_text(node)}"
            if node.name in removed:
                decl = f"{nid} [label={quote(label + chr(10) + '(removed by dce)')}, " \
                       "style=\"rounded,dashed\", fontcolor=\"#777777\"];"
            elif node.name in externs or (node.name not in group_of and not _is_view(node)
                                          and node.target is not operator.getitem):
                decl = f"{nid} [label={quote('extern ' + label)}, shape=octagon, " \
                       f"color=\"{EXTERN_COLOR}\", penwidth=2, fillcolor=\"#fde0e0\"];"
            elif _is_view(node):
                decl = f"{nid} [label={quote(label + chr(10) + '(view)')}, shape=ellipse, " \
                       f"color=\"{VIEW_COLOR}\", fontcolor=\"{VIEW_COLOR}\"];"
            else:
                decl = f"{nid} [label={quote(label)}, fillcolor=\"{colors.get(group_of.get(node.name), 'white')}\"];"
        if node.name in group_of:
            clustered[group_of[node.name]].append(decl)
        else:
            loose.append(decl)
    lines += ["  " + d for d in loose]
    for i, (k, decls) in enumerate(clustered.items()):
        lines.append(f"  subgraph cluster_{i} {{")
        lines.append(f"    label={quote(k)}; style=\"rounded,filled\"; color=\"#666666\"; "
                     f"fillcolor=\"{colors[k]}\"; fontname=Helvetica; fontsize=11;")
        lines += ["    " + d for d in decls]
        lines.append("  }")
    for node in captured.graph.nodes:
        for arg in node.all_input_nodes:
            lines.append(f"  {ids[arg]} -> {ids[node]};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def dot_after(fused: fx.GraphModule, title: str = "") -> str:
    """The program as fusec runs it: kernels, extern calls, views, and the buffers between them."""
    members = kernel_members(fused)
    colors = {k: PALETTE[i % len(PALETTE)] for i, k in enumerate(members)}
    lines = ["digraph after_fusion {", "  rankdir=TB;",
             '  node [fontname="Helvetica", fontsize=10, shape=box, style="rounded,filled", '
             'fillcolor=white];', '  edge [color="#555555", arrowsize=0.6, fontname=Helvetica, '
             'fontsize=9];',
             f"  label={quote(title or 'after fusion: kernels and extern calls')}; labelloc=t; "
             "fontname=Helvetica;"]
    ids: dict[fx.Node, str] = {}
    source: dict[fx.Node, fx.Node] = {}  # getitem of a kernel -> the kernel node
    for i, node in enumerate(fused.graph.nodes):
        if node.op == "call_function" and node.target is operator.getitem \
                and node.args[0].op == "call_module":
            source[node] = node.args[0]
            continue
        nid = ids[node] = f"n{i}"
        if node.op == "placeholder":
            lines.append(f"  {nid} [label={quote(node.name + chr(10) + _meta_text(node))}, "
                         "shape=ellipse, fillcolor=\"#f2f2f2\"];")
        elif node.op == "get_attr":
            lines.append(f"  {nid} [label={quote(node.name + chr(10) + 'constant')}, shape=ellipse];")
        elif node.op == "output":
            lines.append(f"  {nid} [label=\"output\", shape=ellipse, fillcolor=\"#f2f2f2\"];")
        elif node.op == "call_module":
            g = group_info(node)
            ops = ", ".join(o.split(".")[0] for o in (g.ops if g else []))
            shape = tuple(g.shape if g else ())
            kind = g.kind if g else "pointwise"
            label = f"{node.target}\n{kind} kernel over {shape}\n{_wrap(ops)}"
            lines.append(f"  {nid} [label={quote(label)}, fillcolor=\"{colors[node.target]}\", "
                         "penwidth=1.5];")
        elif _is_view(node) and folded_view(node):
            lines.append(f"  {nid} [label={quote('view ' + _title(node))}, "
                         f"shape=ellipse, color=\"{VIEW_COLOR}\", fontcolor=\"{VIEW_COLOR}\"];")
        elif node.op == "call_function":
            label = f"extern {_title(node)}\n{_meta_text(node)}"
            lines.append(f"  {nid} [label={quote(label)}, shape=octagon, color=\"{EXTERN_COLOR}\", "
                         "penwidth=2, fillcolor=\"#fde0e0\"];")
    seen = set()
    for node in fused.graph.nodes:
        if node not in ids:
            continue
        for arg in node.all_input_nodes:
            src = source.get(arg, arg)
            label = arg.name if arg in source else ""
            key = (ids[src], ids[node], label)
            if key in seen:
                continue
            seen.add(key)
            attr = f" [label={quote(label + ' ' + _meta_text(arg))}]" if label else ""
            lines.append(f"  {ids[src]} -> {ids[node]}{attr};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _wrap(text: str, width: int = 40) -> str:
    out, line = [], ""
    for word in text.split(" "):
        if line and len(line) + len(word) > width:
            out.append(line.rstrip())
            line = ""
        line += word + " "
    out.append(line.rstrip())
    return "\n".join(out)


def dot_available() -> bool:
    return shutil.which("dot") is not None


def render_svg(dot: str, timeout: float = 30.0) -> str | None:
    """SVG text from DOT via Graphviz's `dot -Tsvg`, or None when Graphviz is not installed
    (or fails: a picture is a help, never a reason to stop)."""
    exe = shutil.which("dot")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "-Tsvg"], input=dot, capture_output=True, text=True,
                             timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    svg = out.stdout
    start = svg.find("<svg")
    return svg[start:] if start >= 0 else None

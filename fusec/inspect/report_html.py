"""The profile report as one self-contained HTML page (`report.save_html(path)`).

Everything is inline: CSS, the plots (SVG written by fusec/inspect/plots.py), the graph pictures (SVG from
Graphviz when it is installed, else the DOT text), and the kernel sources (highlighted by
pygments, which rich already depends on). The page loads nothing from the network, so it can be
mailed, attached to an issue or opened offline.

A few lines of JavaScript at the end only *check* the page: they record script errors and whether
every plot has a size, in `<body data-render-check="...">`, which tests read from a headless
browser.
"""
from __future__ import annotations

import datetime
import html

import jinja2
import torch

from fusec.codegen import backends
from fusec.inspect.groups import fmt_bytes, format_refusals
from fusec.inspect.plots import bar_chart, roofline
from fusec.inspect.report_text import kernel_rows, launches, ms, summary_rows

TEMPLATE = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>fusec profile: {{ r.name }}</title>
<script>
window.__fusecErrors = [];
window.addEventListener("error", function (e) { window.__fusecErrors.push(String(e.message)); });
</script>
<style>
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 0;
       color: #1d1d1f; background: #fff; line-height: 1.45; }
main { max-width: 1180px; margin: 0 auto; padding: 24px 28px 60px; }
h1 { font-size: 26px; margin: 0 0 4px; }
h2 { font-size: 19px; margin: 34px 0 8px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
h3 { font-size: 15px; margin: 18px 0 6px; }
.meta { color: #555; font-size: 13px; }
.note { background: #fff6d6; border: 1px solid #e9d27a; padding: 8px 12px; border-radius: 6px;
        margin: 12px 0; font-size: 14px; }
.bad { background: #fde8e8; border-color: #e8a0a0; }
.headline { display: flex; gap: 18px; margin: 18px 0 6px; flex-wrap: wrap; }
.card { border: 1px solid #ddd; border-radius: 8px; padding: 10px 16px; min-width: 150px; }
.card .v { font-size: 24px; font-weight: 600; }
.card .k { font-size: 12px; color: #666; }
table { border-collapse: collapse; font-size: 13px; margin: 6px 0 10px; }
th, td { border-bottom: 1px solid #e3e3e3; padding: 4px 10px; text-align: left; vertical-align: top; }
th { background: #f4f5f7; font-weight: 600; }
td.num, th.num { text-align: right; white-space: nowrap; font-variant-numeric: tabular-nums; }
th.num, td.wrap { white-space: normal; }  /* a long heading (or error note) wraps */
td.code, span.code { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12px; }
tr.extern td:first-child { color: #b22; }
td.src { min-width: 200px; max-width: 300px; }
td.src div { margin-bottom: 3px; }
td.step { min-width: 170px; max-width: 260px; overflow-wrap: anywhere; }
td.ops { max-width: 170px; }
.wide { overflow-x: auto; max-width: 100%; }
.explain { font-size: 13px; color: #444; max-width: 900px; }
.graph { overflow: auto; border: 1px solid #e3e3e3; border-radius: 6px; padding: 6px;
         max-height: 900px; background: #fff; }
.graph svg { max-width: 100%; height: auto; cursor: zoom-in; }  /* scaled to fit its box */
.graph.zoomed svg { max-width: none; cursor: zoom-out; }  /* a click: natural size, scrolled */
.graphs { display: grid; grid-template-columns: minmax(0, 1fr) minmax(0, 1fr); gap: 14px; }
.graphs > div { min-width: 0; }
.ok { background: #e6f6e6; border-color: #9fd39f; }
pre { background: #f7f7f9; border: 1px solid #e3e3e3; border-radius: 6px; padding: 10px;
      overflow: auto; font-size: 12px; }
nav { font-size: 13px; margin: 10px 0; }
nav a { margin-right: 12px; color: #2a62b8; text-decoration: none; }
details summary { cursor: pointer; color: #2a62b8; }
{{ pygments_css | safe }}
</style>
</head>
<body>
<main>
<h1>fusec profile: {{ r.name }}</h1>
<div class="meta">{{ r.backend }} backend on {{ r.device | upper }} ({{ r.device_name }}) ·
  {{ r.iters }} profiled iterations · torch {{ torch_version }} · {{ when }}</div>
{% if r.note %}<div class="note">{{ r.note }}</div>{% endif %}
{% if r.cuda_graph %}<div class="note">fused calls: {{ r.cuda_graph }} (the profiled run goes
step by step, so each step has a name)</div>{% endif %}
<nav><a href="#summary">summary</a><a href="#kernels">kernels</a><a href="#plots">plots</a>
<a href="#graphs">graphs</a><a href="#groups">fusion groups</a><a href="#sources">sources</a>
<a href="#eager">eager ops</a><a href="#explain">explain</a></nav>

<div class="headline">
  <div class="card"><div class="v">{{ "%.2f×" | format(r.speedup) if r.speedup == r.speedup else "not timed" }}</div>
    <div class="k">speedup (median time per call)</div></div>
  <div class="card"><div class="v">{{ launches(r.eager.launches) }} → {{ launches(r.fused.launches) }}</div>
    <div class="k">kernel launches per call, eager → fused</div></div>
  <div class="card"><div class="v">{{ ms(r.eager.wall_ms) }} → {{ ms(r.fused.wall_ms) }}</div>
    <div class="k">time per call, eager → fused</div></div>
  <div class="card"><div class="v">{{ "%.1f" | format(r.copy_bandwidth / 1e9) }} GB/s</div>
    <div class="k">measured copy-bandwidth ceiling</div></div>
</div>

<h2 id="summary">Eager vs fused</h2>
<table>
<tr><th></th><th class="num">eager</th><th class="num">fused</th><th class="num">fused vs eager</th></tr>
{% for row in summary %}<tr><td>{{ row[0] }}</td><td class="num">{{ row[1] }}</td>
<td class="num">{{ row[2] }}</td><td class="num">{{ row[3] }}</td></tr>
{% endfor %}
</table>
<p class="explain">A <b>launch</b> is a device kernel on a GPU; on a CPU it is an ATen op that does
work (views and allocations are free) or a call into a fused kernel. <b>Time in launches</b> adds
up the time spent inside them; <b>CPU-side time</b> is the host time of a whole call under the
profiler (Python, dispatch, launches). The speedup compares median times measured without the
profiler.</p>
<div class="note {% if numerics_ok %}ok{% else %}bad{% endif %}">numerics: {{ r.numerics or "not checked" }}</div>

<h2 id="kernels">One line per step of the fused program</h2>
<div class="wide"><table>
<tr><th>step</th><th>from (your code)</th><th>ATen ops</th><th class="num">eager</th>
<th class="num">fused</th><th class="num">bytes moved</th><th class="num">eager's bytes</th>
<th class="num">bandwidth</th><th class="num">of ceiling</th><th class="num">max error vs float64</th></tr>
{% for k in kernel_rows %}<tr class="{{ k.kind }}"><td class="code step">{{ k.step }}</td>
<td class="code src">{% for line in k.from_lines %}<div>{{ line }}</div>{% endfor %}</td><td class="ops">{{ k.ops }}</td><td class="num">{{ k.eager }}</td>
<td class="num">{{ k.fused }}</td><td class="num">{{ k.bytes }}</td><td class="num">{{ k.eager_bytes }}</td>
<td class="num">{{ k.bw }}</td><td class="num">{{ k.ceiling }}</td>
<td class="num wrap" title="{{ k.numerics }}">{{ k.error }}</td></tr>
{% endfor %}
</table></div>
<p class="explain"><b>eager</b> is the time of the same ATen ops run one by one; <b>fused</b> the
kernel's own time. <b>bytes moved</b> come from the kernel IR: every load's distinct elements
and every store, times the dtype size; <b>eager's bytes</b> is what the separate ops read and
write together. <b>bandwidth</b> is bytes moved per second of fused time, against the measured
copy ceiling. The error column is the kernel's own rounding: its sub-graph is run in float64 on
the very inputs the kernel read; eager's error on the same inputs is in brackets.</p>

<h2 id="plots">Plots</h2>
{{ bars | safe }}
{{ roof | safe }}

<h2 id="graphs">The graph before and after fusion</h2>
<p class="explain">Left: the captured ATen graph; ops that share a kernel sit in one coloured
cluster, extern calls (eager ATen) are red octagons, views are grey. Right: the program fusec runs.
{% if not have_svg %}Graphviz is not installed, so here is the DOT text: paste it into any
Graphviz viewer, or install Graphviz (<span class="code">apt-get install graphviz</span>) and
profile again.{% endif %}</p>
<div class="graphs">
{% for g in graphs %}<div><h3>{{ g.title }}</h3><div class="graph">{% if g.svg %}{{ g.svg | safe }}{% else %}<pre>{{ g.dot }}</pre>{% endif %}</div></div>
{% endfor %}
</div>

<h2 id="groups">Fusion groups, refusals and extern calls</h2>
<table>
<tr><th>kernel</th><th>ops</th><th>inputs</th><th>outputs</th><th class="num">read</th><th class="num">written</th></tr>
{% for g in groups %}<tr><td class="code">{{ g.name }}</td><td>{{ g.ops | join(", ") }}</td>
<td class="code">{{ g.inputs | join(", ") }}</td><td class="code">{{ g.outputs | join(", ") }}</td>
<td class="num">{{ fmt_bytes(g.read_bytes) }}</td><td class="num">{{ fmt_bytes(g.write_bytes) }}</td></tr>
{% endfor %}
</table>
<pre>{{ refusals }}</pre>
{% if fallbacks %}<h3>Extern calls (run by eager ATen)</h3>
<table><tr><th>value</th><th>op</th><th>why not a kernel</th><th>from (your code)</th></tr>
{% for f in fallbacks %}<tr class="extern"><td class="code">{{ f.node }}</td><td class="code">{{ f.op }}</td>
<td>{{ f.reason }}</td><td class="code">{{ f.line }}</td></tr>
{% endfor %}</table>{% else %}<p class="explain">No extern calls: every op runs inside a fused kernel.</p>{% endif %}

<h2 id="sources">Kernel sources</h2>
{% for k in sources %}<h3 class="code">{{ k.name }} ({{ k.backend }})</h3>
{{ k.html | safe }}
{% endfor %}

<h2 id="eager">Where the time goes, op by op</h2>
<div class="graphs">
<div><h3>eager</h3><table><tr><th>op / kernel</th><th class="num">calls</th><th class="num">time per call</th></tr>
{% for row in r.eager.by_name %}<tr><td class="code">{{ row.name }}</td><td class="num">{{ launches(row.calls) }}</td><td class="num">{{ ms(row.ms) }}</td></tr>
{% endfor %}</table></div>
<div><h3>fused</h3><table><tr><th>kernel / extern call</th><th class="num">calls</th><th class="num">time per call</th></tr>
{% for row in r.fused.by_name %}<tr><td class="code">{{ row.name }}</td><td class="num">{{ launches(row.calls) }}</td><td class="num">{{ ms(row.ms) }}</td></tr>
{% endfor %}</table></div>
</div>
<p class="explain">The full traces: <span class="code">report.export_chrome_traces(dir)</span>
(or <span class="code">fusec profile FILE --traces DIR</span>) and open them in
Perfetto or chrome://tracing; fused kernels appear by name.</p>

<h2 id="explain">Every stage (fusec.explain)</h2>
<details><summary>show the captured graph, the graph after each pass and the schedule</summary>
<pre>{{ explain_text }}</pre></details>
</main>
<script>
(function () {
  var plots = Array.prototype.slice.call(document.querySelectorAll("svg.plot"));
  var drawn = plots.filter(function (s) { var b = s.getBBox(); return b.width > 0 && b.height > 0; });
  var graphs = Array.prototype.slice.call(document.querySelectorAll(".graph svg"));
  graphs.forEach(function (g) {  // a click toggles between fitting the box and natural size
    g.addEventListener("click", function () { g.parentNode.classList.toggle("zoomed"); });
  });
  var fit = graphs.filter(function (g) {
    var box = g.parentNode.getBoundingClientRect(), r = g.getBoundingClientRect();
    return r.width > 0 && r.height > 0 && r.width <= box.width + 1;
  });
  var wide = Array.prototype.slice.call(document.querySelectorAll(".wide"));
  var tablesFit = wide.filter(function (w) { return w.scrollWidth <= w.clientWidth + 1; });
  var overlaps = 0;  // pairs of point labels in a plot whose boxes overlap
  plots.forEach(function (s) {
    var boxes = Array.prototype.slice.call(s.querySelectorAll("text.label")).map(function (t) {
      return t.getBoundingClientRect(); });
    for (var i = 0; i < boxes.length; i++) for (var j = i + 1; j < boxes.length; j++) {
      var a = boxes[i], b = boxes[j];
      if (a.left < b.right - 1 && b.left < a.right - 1 && a.top < b.bottom - 1 && b.top < a.bottom - 1) overlaps++;
    }
  });
  document.body.setAttribute("data-render-check", JSON.stringify({
    wide_tables: wide.length, wide_tables_fit: tablesFit.length, label_overlaps: overlaps,
    plots: plots.length, drawn: drawn.length,
    tables: document.querySelectorAll("table").length,
    graphs: graphs.length, graphs_fit: fit.length,
    page_width: document.documentElement.scrollWidth, window_width: window.innerWidth,
    errors: window.__fusecErrors}));
})();
</script>
</body>
</html>
"""


def highlight(source: str, backend: str) -> tuple[str, str]:
    """(HTML of the highlighted source, its CSS); plain <pre> if pygments is missing."""
    try:
        from pygments import highlight as pyg
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import get_lexer_by_name
    except ImportError:  # pragma: no cover - rich depends on pygments
        return f"<pre>{html.escape(source)}</pre>", ""
    known = backends.BACKENDS.get(backend)
    lexer = get_lexer_by_name(known.lexer if known else "python")
    formatter = HtmlFormatter(cssclass="highlight")
    return pyg(source, lexer, formatter), formatter.get_style_defs(".highlight")


def render_html(report) -> str:
    ex = report.explanation
    dev = "GPU" if report.device == "cuda" else "CPU"
    bars = bar_chart(
        [("median time per call", report.eager.wall_ms, report.fused.wall_ms),
         ("CPU-side time (profiled)", report.eager.cpu_ms, report.fused.cpu_ms),
         (f"{dev} time in launches", report.eager.device_ms, report.fused.device_ms)],
        "per call: eager vs fused", series=("eager", "fused"))
    bars += "\n" + bar_chart(
        [(k.name if k.kind == "kernel" else f"extern {k.name}", k.eager_ms, k.fused_ms)
         for k in report.kernels], "time per step: eager vs fused")
    roof = roofline([(k.name, k.intensity, k.bandwidth) for k in report.kernels
                     if k.kind == "kernel"], report.copy_bandwidth,
                    "roofline: where each fused kernel lands")
    graphs = []
    for stage, title in (("before", "before fusion"), ("after", "after fusion")):
        dot = ex.dot(stage)
        graphs.append({"title": title, "dot": dot, "svg": ex.svg(stage)})
    sources, css = [], ""
    for k in ex.compiled.kernels:
        body, css = highlight(k.source, k.backend)
        sources.append({"name": k.name, "backend": k.backend, "html": body})
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    template = env.from_string(TEMPLATE)
    return template.render(
        r=report, summary=summary_rows(report), kernel_rows=kernel_rows(report), bars=bars,
        roof=roof, graphs=graphs, have_svg=all(g["svg"] for g in graphs), groups=ex.groups(),
        refusals=format_refusals(ex.compiled.gm), fallbacks=ex.fallbacks(), sources=sources,
        pygments_css=css, explain_text=str(ex), launches=launches, ms=ms, fmt_bytes=fmt_bytes,
        numerics_ok=report.numerics.startswith("ok") if report.numerics else True,
        torch_version=torch.__version__,
        when=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"))

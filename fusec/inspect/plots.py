"""Small SVG plots for the HTML report, written by hand so the page needs nothing from outside.

    bar_chart(rows)                 horizontal bars, two series (eager, fused) per row
    roofline(points, ceiling)       log-log: arithmetic intensity vs achieved bandwidth

Each returns one `<svg class="plot">` element as text, sized in CSS pixels.
"""
from __future__ import annotations

import math
from html import escape

EAGER = "#e07b39"
FUSED = "#3b7dd8"
FONT = 'font-family="Helvetica, Arial, sans-serif"'


def _fmt_ms(v: float) -> str:
    return f"{v * 1e3:.1f} µs" if v < 0.1 else f"{v:.3g} ms"


def bar_chart(rows: list[tuple[str, float | None, float | None]], title: str,
              series=("eager (its ATen ops, one by one)", "fused"), width: int = 820) -> str:
    """rows: (label, eager_ms, fused_ms). A missing value draws no bar and prints '-'."""
    label_w, value_w, bar_h, gap, top = 230, 80, 13, 12, 46
    plot_w = width - label_w - value_w - 20
    vmax = max([v for _, a, b in rows for v in (a, b) if v] + [1e-9])
    height = top + len(rows) * (2 * bar_h + gap) + 16
    out = [f'<svg class="plot" xmlns="http://www.w3.org/2000/svg" width="{width}" '
           f'height="{height}" viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="{escape(title)}">',
           f'<text x="10" y="18" {FONT} font-size="14" font-weight="bold">{escape(title)}</text>']
    for i, (name, color) in enumerate(zip(series, (EAGER, FUSED))):
        x = label_w + i * 260
        out.append(f'<rect x="{x}" y="28" width="12" height="10" fill="{color}"/>')
        out.append(f'<text x="{x + 16}" y="37" {FONT} font-size="11">{escape(name)}</text>')
    y = top
    for label, a, b in rows:
        short = label if len(label) <= 34 else label[:33] + "…"
        out.append(f'<text x="{label_w - 8}" y="{y + bar_h + 4}" text-anchor="end" {FONT} '
                   f'font-size="11"><title>{escape(label)}</title>{escape(short)}</text>')
        for k, (v, color) in enumerate(((a, EAGER), (b, FUSED))):
            yy = y + k * bar_h
            if v:
                w = max(1.0, plot_w * v / vmax)
                out.append(f'<rect x="{label_w}" y="{yy}" width="{w:.1f}" height="{bar_h - 2}" '
                           f'fill="{color}"><title>{escape(_fmt_ms(v))}</title></rect>')
                out.append(f'<text x="{label_w + w + 4:.1f}" y="{yy + bar_h - 3}" {FONT} '
                           f'font-size="10">{escape(_fmt_ms(v))}</text>')
            else:
                out.append(f'<text x="{label_w + 4}" y="{yy + bar_h - 3}" {FONT} font-size="10" '
                           f'fill="#888">-</text>')
        y += 2 * bar_h + gap
    out.append(f'<line x1="{label_w}" y1="{top - 4}" x2="{label_w}" y2="{y - gap + 2}" '
               'stroke="#333" stroke-width="1"/>')
    out.append("</svg>")
    return "\n".join(out)


def _decades(lo: float, hi: float) -> list[float]:
    return [10.0 ** e for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)]


def _tick(v: float) -> str:
    if v >= 1:
        return f"{v:g}"
    return f"{v:.0e}".replace("e-0", "e-")


LABEL_CHAR_W, LABEL_H = 6.3, 13  # px of an 11 px label: a character's width, a line's height


def _label_place(x: float, y: float, chars: int, placed: list, frame: tuple) -> tuple:
    """(x, y, text-anchor) of a point's label: beside the point, on the right if it fits inside
    the frame, else on the left, moved up or down a line at a time until it overlaps no label
    already placed (appended to `placed`); the nearest free place wins."""
    w = chars * LABEL_CHAR_W
    x0, y0, x1, y1 = frame
    sides = [side for side, fits in ((("start", x + 9), x + 9 + w <= x1),
                                     (("end", x - 9), x - 9 - w >= x0)) if fits]
    sides = sides or [("start", x + 9)]
    for step in range(0, 40):
        dy = (step + 1) // 2 * LABEL_H * (1 if step % 2 else -1)
        for anchor, lx in sides:
            bx = lx if anchor == "start" else lx - w
            box = (bx, y + 4 + dy - LABEL_H + 2, bx + w, y + 4 + dy + 2)
            if box[1] < y0 or box[3] > y1 + 12:
                continue
            if all(box[2] <= b[0] or b[2] <= box[0] or box[3] <= b[1] or b[3] <= box[1]
                   for b in placed):
                placed.append(box)
                return lx, y + 4 + dy, anchor
    placed.append((x + 9, y - 8, x + 9 + w, y + 6))
    return x + 9, y + 4, "start"


def roofline(points: list[tuple[str, float, float]], ceiling: float, title: str,
             width: int = 820, height: int = 420) -> str:
    """points: (name, arithmetic intensity in flop/byte, achieved bandwidth in bytes/s).

    The dashed line is the measured copy bandwidth: a memory-bound kernel cannot go above it
    (a small kernel whose data sits in cache can). Further right = more arithmetic per byte.
    """
    left, right, top, bottom = 70, 30, 40, 50
    pw, ph = width - left - right, height - top - bottom
    pts = [(n, ai, bw) for n, ai, bw in points if ai and bw and ai > 0 and bw > 0]
    gbs = [bw / 1e9 for _, _, bw in pts] + [ceiling / 1e9]
    ais = [ai for _, ai, _ in pts] or [0.1, 1.0]
    xlo, xhi = _decades(min(ais) / 2, max(ais) * 2)[0], _decades(min(ais) / 2, max(ais) * 2)[-1]
    ylo, yhi = _decades(min(gbs) / 2, max(gbs) * 2)[0], _decades(min(gbs) / 2, max(gbs) * 2)[-1]
    if xhi <= xlo:
        xhi = xlo * 10
    if yhi <= ylo:
        yhi = ylo * 10

    def sx(v):
        return left + pw * (math.log10(v) - math.log10(xlo)) / (math.log10(xhi) - math.log10(xlo))

    def sy(v):
        return top + ph - ph * (math.log10(v) - math.log10(ylo)) / (math.log10(yhi) - math.log10(ylo))

    out = [f'<svg class="plot" xmlns="http://www.w3.org/2000/svg" width="{width}" '
           f'height="{height}" viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="{escape(title)}">',
           f'<text x="10" y="20" {FONT} font-size="14" font-weight="bold">{escape(title)}</text>',
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#333"/>']
    for v in _decades(xlo, xhi):
        x = sx(v)
        out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + ph}" stroke="#ddd"/>')
        out.append(f'<text x="{x:.1f}" y="{top + ph + 16}" text-anchor="middle" {FONT} '
                   f'font-size="11">{_tick(v)}</text>')
    for v in _decades(ylo, yhi):
        y = sy(v)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" {FONT} '
                   f'font-size="11">{_tick(v)}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 10}" text-anchor="middle" {FONT} '
               'font-size="12">arithmetic intensity (operations per byte moved)</text>')
    out.append(f'<text x="16" y="{top + ph / 2}" text-anchor="middle" {FONT} font-size="12" '
               f'transform="rotate(-90 16 {top + ph / 2})">achieved bandwidth (GB/s)</text>')
    yc = sy(ceiling / 1e9)
    out.append(f'<line x1="{left}" y1="{yc:.1f}" x2="{left + pw}" y2="{yc:.1f}" stroke="#c0392b" '
               'stroke-width="2" stroke-dasharray="6 4"/>')
    out.append(f'<text x="{left + pw - 4}" y="{yc - 6:.1f}" text-anchor="end" {FONT} '
               f'font-size="11" fill="#c0392b">copy ceiling {ceiling / 1e9:.1f} GB/s</text>')
    placed: list[tuple[float, float, float, float]] = []  # label boxes drawn so far
    for name, ai, bw in sorted(pts, key=lambda p: p[2], reverse=True):
        x, y = sx(ai), sy(bw / 1e9)
        out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="6" fill="{FUSED}" fill-opacity="0.8" '
                   f'stroke="#1b4f91"><title>{escape(name)}: {ai:.3g} op/B, '
                   f'{bw / 1e9:.2f} GB/s</title></circle>')
        lx, ly, anchor = _label_place(x, y, len(name), placed, (left, top, left + pw, top + ph))
        out.append(f'<text class="label" x="{lx:.1f}" y="{ly:.1f}" text-anchor="{anchor}" '
                   f'{FONT} font-size="11">{escape(name)}</text>')
    if not pts:
        out.append(f'<text x="{left + pw / 2}" y="{top + ph / 2}" text-anchor="middle" {FONT} '
                   'font-size="12" fill="#888">no kernel with a measured time</text>')
    out.append("</svg>")
    return "\n".join(out)

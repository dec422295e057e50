"""A small SVG writer for the results page's figures: line charts and bar charts, as plain SVG text.

Hand-written rather than matplotlib (a test dependency here) because the page's test compares the committed
SVGs byte for byte with freshly generated ones: matplotlib's SVG changes between its releases (paths, ids,
metadata), so a version bump would fail that test with no result changed. Here the output depends only on the
numbers: fixed palette, fixed number formatting, no ids, no dates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

WIDTH, HEIGHT = 640, 400
LEFT, RIGHT, TOP, BOTTOM = 70, 190, 78, 52  # margins: the legend sits in the right one, the title in the top one
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")


@dataclass
class Series:
    name: str  # the legend's text: a server, or a server and its mode
    points: list[tuple[float, float]] = field(default_factory=list)  # (x, y), drawn in x order
    dashed: bool = False  # a reference (a bound), not a measurement


def fmt(v: float) -> str:
    """A tick label: few digits, no float noise (so the text is the same on every platform)."""
    if v == 0:
        return "0"
    if abs(v) >= 100 or float(v).is_integer():
        return f"{v:.0f}"
    return f"{v:.3g}"


def nice_ticks(hi: float, n: int = 5) -> list[float]:
    """0 and multiples of 1, 2 or 5 x 10^k up to at least hi: a y axis that starts at zero, so ratios read true."""
    if hi <= 0:
        return [0.0, 1.0]
    raw = hi / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    return [i * step for i in range(int(math.ceil(hi / step - 1e-9)) + 1)]


def _frame(title: list[str], x_label: str, y_label: str, y_ticks: list[float]) -> tuple[list[str], float]:
    """The page: title lines, axes, y grid and labels. Returns the SVG lines so far and the y scale's top."""
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="11">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>']
    for i, line in enumerate(title):
        size, weight = (13, "bold") if i == 0 else (11, "normal")
        out.append(f'<text x="{LEFT}" y="{18 + 15 * i}" font-size="{size}" font-weight="{weight}">{escape(line)}</text>')
    top = y_ticks[-1]
    for t in y_ticks:
        y = TOP + plot_h - plot_h * t / top
        out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + plot_w}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{fmt(t)}</text>')
    out.append(f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + plot_h}" stroke="black"/>')
    out.append(f'<line x1="{LEFT}" y1="{TOP + plot_h}" x2="{LEFT + plot_w}" y2="{TOP + plot_h}" stroke="black"/>')
    out.append(f'<text x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 12}" text-anchor="middle">{escape(x_label)}</text>')
    out.append(f'<text transform="translate(16 {TOP + plot_h / 2:.1f}) rotate(-90)" text-anchor="middle">'
               f'{escape(y_label)}</text>')
    return out, top


def _legend(out: list[str], entries: list[tuple[str, str, bool]]) -> None:
    x = WIDTH - RIGHT + 14
    for i, (name, color, dashed) in enumerate(entries):
        y = TOP + 8 + 18 * i
        dash = ' stroke-dasharray="5 3"' if dashed else ""
        out.append(f'<line x1="{x}" y1="{y}" x2="{x + 20}" y2="{y}" stroke="{color}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{x + 26}" y="{y + 4}">{escape(name)}</text>')


def line_chart(title: list[str], x_label: str, y_label: str, series: list[Series], log_x: bool = False) -> str:
    """One polyline per series, x ticks at the measured x values (log scale for concurrency levels)."""
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    xs = sorted({x for s in series for x, _ in s.points})
    ys = [y for s in series for _, y in s.points]
    out, top = _frame(title, x_label, y_label, nice_ticks(max(ys, default=1.0) * 1.05))
    f = math.log if log_x else (lambda v: v)
    lo, hi = f(xs[0]) if xs else 0.0, f(xs[-1]) if xs else 1.0
    if hi == lo:  # one x value: centre it
        lo, hi = lo - 1, hi + 1

    def px(x: float) -> float:
        return LEFT + 20 + (plot_w - 40) * (f(x) - lo) / (hi - lo)

    def py(y: float) -> float:
        return TOP + plot_h - plot_h * y / top

    for x in xs:
        out.append(f'<text x="{px(x):.1f}" y="{TOP + plot_h + 16}" text-anchor="middle">{fmt(x)}</text>')
    entries = []
    for i, s in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        pts = sorted(s.points)
        dash = ' stroke-dasharray="5 3"' if s.dashed else ""
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        out.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        for x, y in pts:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{color}"/>')
        entries.append((s.name, color, s.dashed))
    _legend(out, entries)
    return "\n".join(out + ["</svg>"]) + "\n"


def bar_chart(title: list[str], y_label: str, bars: list[tuple[str, float]],
              refs: list[tuple[str, float]] | None = None) -> str:
    """One bar per (label, value), and dashed horizontal reference lines (a bound) across all of them."""
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    refs = refs or []
    out, top = _frame(title, "", y_label, nice_ticks(max([v for _, v in bars + refs], default=1.0) * 1.05))
    slot = plot_w / max(1, len(bars))
    for i, (label, v) in enumerate(bars):
        h = plot_h * v / top
        x = LEFT + slot * i + slot * 0.15
        out.append(f'<rect x="{x:.1f}" y="{TOP + plot_h - h:.1f}" width="{slot * 0.7:.1f}" height="{h:.1f}" '
                   f'fill="{PALETTE[i % len(PALETTE)]}"/>')
        out.append(f'<text x="{x + slot * 0.35:.1f}" y="{TOP + plot_h - h - 4:.1f}" text-anchor="middle">{fmt(v)}</text>')
    # Server names are too long to sit under a bar: the legend names each bar by its colour.
    entries = [(label, PALETTE[i % len(PALETTE)], False) for i, (label, _) in enumerate(bars)]
    for j, (name, v) in enumerate(refs):
        y = TOP + plot_h - plot_h * v / top
        out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + plot_w}" y2="{y:.1f}" stroke="black" '
                   f'stroke-width="1.5" stroke-dasharray="5 3"/>')
        entries.append((f"{name}: {fmt(v)}", "black", True))
    _legend(out, entries)
    return "\n".join(out + ["</svg>"]) + "\n"

"""bench/scale.py's plot: how each measured figure grows with the fleet, as an SVG written by hand
(no plotting library in the environment).

Both axes are logarithmic: x the fleet's nodes, y each figure divided by its value at the
smallest fleet. The dashed diagonal is growth in proportion to the fleet; a line below it grows
slower than the fleet, a flat one not at all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

WIDTH, HEIGHT = 760, 440
LEFT, RIGHT, TOP, BOTTOM = 60, 230, 30, 50
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")  # fmt: skip


def _ratios(rows: Sequence[Sequence[float]], column: int) -> list[float | None]:
    base = rows[0][column]
    out: list[float | None] = []
    for row in rows:
        value = row[column]
        ok = math.isfinite(base) and math.isfinite(value) and base > 0 and value > 0
        out.append(value / base if ok else None)
    return out


def growth_svg(columns: Sequence[str], rows: Sequence[Sequence[float]], plotted: Sequence[str]) -> str:
    """An SVG of `plotted` columns (names in `columns`) over rows whose first cell is the node count."""
    nodes = [row[0] for row in rows]
    series = {name: _ratios(rows, columns.index(name)) for name in plotted}
    found = [r for values in series.values() for r in values if r is not None]
    x_lo, x_hi = math.log10(min(nodes)), math.log10(max(nodes))
    y_lo = math.floor(math.log2(min([*found, 1.0])))
    y_hi = math.ceil(math.log2(max([*found, max(nodes) / min(nodes)])))
    y_lo, y_hi = min(y_lo, -1), max(y_hi, y_lo + 1)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(value: float) -> float:
        return LEFT + (math.log10(value) - x_lo) / (x_hi - x_lo or 1) * plot_w

    def y(ratio: float) -> float:
        return TOP + (y_hi - math.log2(ratio)) / (y_hi - y_lo) * plot_h

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
           f'<text x="{LEFT}" y="18" font-size="14">bench/scale.py: growth with the fleet '
           f'(value / value at {nodes[0]:.0f} nodes, log scales)</text>']
    for power in range(y_lo, y_hi + 1):
        ratio, top = 2.0**power, y(2.0**power)
        label = f"{ratio:g}x" if ratio >= 1 else f"1/{1 / ratio:g}x"
        out.append(f'<line x1="{LEFT}" y1="{top:.1f}" x2="{LEFT + plot_w}" y2="{top:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 6}" y="{top + 4:.1f}" text-anchor="end">{label}</text>')
    for count in nodes:
        left = x(count)
        out.append(f'<line x1="{left:.1f}" y1="{TOP}" x2="{left:.1f}" y2="{TOP + plot_h}" stroke="#ddd"/>')
        out.append(f'<text x="{left:.1f}" y="{TOP + plot_h + 18}" text-anchor="middle">{count:.0f}</text>')
    out.append(f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 10}" text-anchor="middle">nodes</text>')
    out.append(f'<line x1="{x(nodes[0]):.1f}" y1="{y(1):.1f}" x2="{x(nodes[-1]):.1f}" '
               f'y2="{y(nodes[-1] / nodes[0]):.1f}" stroke="#444" stroke-dasharray="5,4"/>')
    for i, (name, ratios) in enumerate(series.items()):
        colour = COLOURS[i % len(COLOURS)]
        points = [(x(n), y(r)) for n, r in zip(nodes, ratios, strict=True) if r is not None]
        if len(points) > 1:
            path = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
            out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for px, py in points:
            out.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{colour}"/>')
        last = next((r for r in reversed(ratios) if r is not None), None)
        legend_y = TOP + 14 + 18 * i
        out.append(f'<rect x="{WIDTH - RIGHT + 12}" y="{legend_y - 9}" width="12" height="4" fill="{colour}"/>')
        tail = f" ({last:.2f}x)" if last is not None else " (-)"
        out.append(f'<text x="{WIDTH - RIGHT + 30}" y="{legend_y - 3}">{escape(name)}{tail}</text>')
    legend_y = TOP + 14 + 18 * len(series)
    out.append(f'<line x1="{WIDTH - RIGHT + 12}" y1="{legend_y - 7}" x2="{WIDTH - RIGHT + 24}" '
               f'y2="{legend_y - 7}" stroke="#444" stroke-dasharray="5,4"/>')
    out.append(f'<text x="{WIDTH - RIGHT + 30}" y="{legend_y - 3}">nodes ({nodes[-1] / nodes[0]:g}x)</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"

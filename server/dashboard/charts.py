"""Charts for the dashboard, drawn on the server as inline SVG: no JavaScript, no charting library in the page.

``line_chart`` draws learning curves (one ``<polyline class="series">`` per series, one vertex per point, so a
curve of a job's 200 logged steps has 200 vertices); ``strip_chart`` draws a distribution (one
``<circle class="point">`` per value, the quartiles as a box, the median a line across it); ``lineage_chart``
draws an adapter's versions as a row of nodes with an arc from each version to the one it started from. Every
text is escaped; every number is formatted by this module, so the markup can be put in a page as it is.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape

COLORS = ("#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed")


@dataclass(frozen=True)
class Series:
    name: str
    points: Sequence[tuple[float, float]]  # (x, y), x increasing


_RESOLUTION = 2.0**-40  # values closer than this (relative to their size) are drawn as equal: far above an ulp
_TINY = 1e-300  # a span below this is drawn as equal too (its tenth would be subnormal)


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About ``count`` round values (1, 2 or 5 times a power of ten apart) covering [low, high].

    For any finite ``low`` and ``high`` the answer is at most ``count + 3`` finite, strictly increasing values with
    ``ticks[0] <= low`` and ``ticks[-1] >= high``: values one ulp apart are drawn as equal (their ticks are spread
    around them), and a span near the largest float, whose round ticks would pass it, is divided evenly instead.
    Nothing here loops on the data.
    """
    if not math.isfinite(low) or not math.isfinite(high):
        return [0.0]
    low, high = min(low, high), max(low, high)
    scale = max(abs(low), abs(high))
    if high - low <= max(_RESOLUTION * scale, _TINY):  # equal as far as a chart can tell
        half = max(scale / 2, _TINY)
        low, high = max(low - half, -sys.float_info.max), min(high + half, sys.float_info.max)
    raw = (high / 2 - low / 2) / max(1, count - 1) * 2  # halves: the span of two finite floats may overflow
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first, last = math.floor(low / step), math.ceil(high / step)  # at most count + 1 steps apart
    ticks = [k * step for k in range(first, last + 1)]
    if ticks[0] > low:  # low / step rounded up past an integer
        ticks.insert(0, ticks[0] - step)
    if ticks[-1] < high:
        ticks.append(ticks[-1] + step)
    if all(map(math.isfinite, ticks)) and all(a < b for a, b in zip(ticks, ticks[1:])):
        return ticks
    return [low * (1 - i / (count - 1)) + high * (i / (count - 1)) for i in range(count)]  # finite for any pair


def _fraction(value: float, start: float, end: float) -> float:
    """Where ``value`` lies from ``start`` (0) to ``end`` (1), computed on halves so that no difference overflows."""
    span = end / 2 - start / 2
    return (value / 2 - start / 2) / span if span else 0.0


def _label(value: float) -> str:
    return f"{value:.4g}"


def line_chart(
    series: Sequence[Series],
    title: str,
    x_label: str,
    y_label: str,
    width: int = 480,
    height: int = 260,
    y_range: tuple[float, float] | None = None,
) -> str:
    """An SVG line chart of ``series`` sharing both axes (the axes span the data, rounded to ticks, and
    ``y_range`` when given: an accuracy's 0 to 1)."""
    points = [p for s in series for p in s.points if math.isfinite(p[1])]
    if not points:
        return f'<p class="empty">{escape(title)}: nothing measured yet</p>'
    left, right, top, bottom = 56, 16, 28, 40
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    y_low, y_high = (min(ys), max(ys)) if y_range is None else (min(y_range[0], *ys), max(y_range[1], *ys))
    x_ticks, y_ticks = nice_ticks(min(xs), max(xs)), nice_ticks(y_low, y_high)
    x0, x1, y0, y1 = x_ticks[0], x_ticks[-1], y_ticks[0], y_ticks[-1]
    plot_w, plot_h = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + _fraction(x, x0, x1) * plot_w

    def sy(y: float) -> float:
        return top + plot_h - _fraction(y, y0, y1) * plot_h

    parts = [
        f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" role="img" aria-label="{escape(title)}">',
        f'<text x="{left}" y="16" class="title">{escape(title)}</text>',
    ]
    for y in y_ticks:
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" class="grid"/>')
        parts.append(f'<text x="{left - 6}" y="{sy(y) + 4:.1f}" class="tick" text-anchor="end">{_label(y)}</text>')
    for x in x_ticks:
        parts.append(
            f'<text x="{sx(x):.1f}" y="{top + plot_h + 16}" class="tick" text-anchor="middle">{_label(x)}</text>'
        )
    parts.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" class="frame"/>')
    parts.append(
        f'<text x="{left + plot_w / 2:.1f}" y="{height - 6}" class="axis" text-anchor="middle">{escape(x_label)}</text>'
    )
    parts.append(
        f'<text transform="translate(14 {top + plot_h / 2:.1f}) rotate(-90)" class="axis" '
        f'text-anchor="middle">{escape(y_label)}</text>'
    )
    for i, s in enumerate(series):
        parts += _curve(s, COLORS[i % len(COLORS)], sx, sy)
        if len(series) > 1:
            lx = left + 8 + 150 * i
            parts.append(f'<rect x="{lx}" y="{top + 6}" width="10" height="10" fill="{COLORS[i % len(COLORS)]}"/>')
            parts.append(f'<text x="{lx + 14}" y="{top + 15}" class="legend">{escape(s.name)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _curve(s: Series, color: str, sx: Callable[[float], float], sy: Callable[[float], float]) -> list[str]:
    """One series' polyline (its finite points) and, for a short curve, a mark at each point."""
    kept = [(x, y) for x, y in s.points if math.isfinite(y)]
    coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in kept)
    parts = [
        f'<polyline class="series" data-series="{escape(s.name)}" data-points="{len(kept)}" points="{coords}" '
        f'fill="none" stroke="{color}" stroke-width="1.5"/>'
    ]
    if len(kept) <= 40:  # a short curve (held-out measurements): every measurement marked
        parts += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}"/>' for x, y in kept]
    return parts


def strip_chart(
    values: Sequence[float],
    title: str,
    x_label: str,
    quartiles: tuple[float, float, float] | None = None,
    reference: float | None = 0.0,
    width: int = 480,
    height: int = 150,
) -> str:
    """A distribution as an SVG strip chart: one dot per value along a horizontal axis (dots that would overlap are
    stacked above and below the middle), ``quartiles`` (the 25th percentile, the median, the 75th) as a box with the
    median a line across it, and ``reference`` (0: no change) as a dashed line. The axis spans the values and the
    reference, rounded to ticks."""
    kept = sorted(v for v in values if math.isfinite(v))
    if not kept:
        return f'<p class="empty">{escape(title)}: nothing measured yet</p>'
    left, right, top, bottom = 16, 16, 28, 40
    spanned = kept + ([] if reference is None else [reference])
    ticks = nice_ticks(min(spanned), max(spanned))
    plot_w, plot_h, middle = width - left - right, height - top - bottom, top + (height - top - bottom) / 2

    def sx(x: float) -> float:
        return left + _fraction(x, ticks[0], ticks[-1]) * plot_w

    parts = [
        f'<svg class="chart strip" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" role="img" aria-label="{escape(title)}">',
        f'<text x="{left}" y="16" class="title">{escape(title)}</text>',
    ]
    for x in ticks:
        parts.append(f'<line x1="{sx(x):.1f}" x2="{sx(x):.1f}" y1="{top}" y2="{top + plot_h}" class="grid"/>')
        parts.append(
            f'<text x="{sx(x):.1f}" y="{top + plot_h + 16}" class="tick" text-anchor="middle">{_label(x)}</text>'
        )
    parts.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" class="frame"/>')
    parts.append(
        f'<text x="{left + plot_w / 2:.1f}" y="{height - 6}" class="axis" text-anchor="middle">{escape(x_label)}</text>'
    )
    if reference is not None:
        x = sx(reference)
        parts.append(
            f'<line class="reference" data-value="{_label(reference)}" x1="{x:.1f}" x2="{x:.1f}" y1="{top}" '
            f'y2="{top + plot_h}" stroke="#6b7280" stroke-dasharray="4 3"/>'
        )
    if quartiles is not None:
        parts += _quartile_box(quartiles, sx, top + 4, plot_h - 8)
    parts += _dots(kept, sx, middle, plot_h)
    parts.append("</svg>")
    return "\n".join(parts)


def _quartile_box(quartiles: tuple[float, float, float], sx: Callable[[float], float], y: float, h: float) -> list[str]:
    """The box from the 25th to the 75th percentile, the median a line across it; each names its value."""
    q1, median, q3 = quartiles
    parts = [
        f'<rect class="quartiles" data-low="{_label(q1)}" data-high="{_label(q3)}" x="{sx(q1):.1f}" y="{y:.1f}" '
        f'width="{max(sx(q3) - sx(q1), 0.0):.1f}" height="{h:.1f}" fill="#dbeafe" fill-opacity="0.6" '
        f'stroke="{COLORS[0]}"><title>25th to 75th percentile: {_label(q1)} to {_label(q3)}</title></rect>',
        f'<line class="median" data-value="{_label(median)}" x1="{sx(median):.1f}" x2="{sx(median):.1f}" '
        f'y1="{y:.1f}" y2="{y + h:.1f}" stroke="{COLORS[1]}" stroke-width="2"><title>median {_label(median)}</title>'
        "</line>",
    ]
    return parts


def _dots(kept: Sequence[float], sx: Callable[[float], float], middle: float, plot_h: float, r: float = 4) -> list[str]:
    """One dot per value (``kept`` in increasing order), each on the first row (the middle, then one above, one
    below, ...) where it does not overlap the row's last dot; when every row is taken, on the row whose last dot
    is furthest left."""
    pitch = 2 * r + 1
    rows = [0] + [k * sign for k in range(1, int((plot_h / 2 - r - 2) // pitch) + 1) for sign in (-1, 1)]
    last = {row: -math.inf for row in rows}
    parts = []
    for value in kept:
        x = sx(value)
        row = next((row for row in rows if x - last[row] >= pitch), min(rows, key=lambda row: last[row]))
        last[row] = x
        parts.append(
            f'<circle class="point" data-value="{_label(value)}" cx="{x:.1f}" cy="{middle + row * pitch:.1f}" '
            f'r="{r}" fill="{COLORS[0]}" fill-opacity="0.75"><title>{_label(value)}</title></circle>'
        )
    return parts


@dataclass(frozen=True)
class Node:
    id: int
    label: str
    parent: int | None


def lineage_chart(nodes: Sequence[Node], height: int = 90, gap: int = 70) -> str:
    """The versions of one lineage left to right (``nodes`` oldest first), an arc from each to its parent: a
    version that started from an older one than its predecessor shows as a longer arc."""
    if not nodes:
        return ""
    place = {node.id: 30 + i * gap for i, node in enumerate(nodes)}
    width, base = 60 + gap * (len(nodes) - 1), height - 30
    parts = [
        f'<svg class="lineage" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" role="img" aria-label="adapter lineage">'
    ]
    for node in nodes:
        if node.parent in place:
            a, b = place[node.parent], place[node.id]
            lift = min(base - 8, 14 + (b - a) / 4)
            parts.append(
                f'<path d="M {a} {base - 10} Q {(a + b) / 2} {base - 10 - lift} {b} {base - 10}" class="edge" '
                f'data-from="{node.parent}" data-to="{node.id}"/>'
            )
    for node in nodes:
        x = place[node.id]
        parts.append(f'<a href="/ui/adapters/{node.id}"><circle cx="{x}" cy="{base}" r="10" class="node"/>')
        parts.append(f'<text x="{x}" y="{base + 24}" text-anchor="middle" class="tick">{escape(node.label)}</text></a>')
    parts.append("</svg>")
    return "\n".join(parts)

"""The dashboard's charts over any finite values an upload may carry: bounded output, finite coordinates.

A chart whose values were one or two ulps apart once made ``nice_ticks`` loop for ever (a forged upload's losses
of 0.5 and 0.5000000000000001 hung the server on the first view of its page), and values of ±1e308 overflowed the
span (500 for good). These are properties over all finite floats, found by hypothesis, plus the cases that did it.
"""

from __future__ import annotations

import math
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from server.dashboard.charts import Series, line_chart, nice_ticks

finite = st.floats(allow_nan=False, allow_infinity=False)
NUMBER = re.compile(r'(?:x|y|x1|x2|y1|y2|cx|cy)="([^"]*)"')


def _check_ticks(low: float, high: float, count: int = 5) -> None:
    ticks = nice_ticks(low, high, count)
    low, high = min(low, high), max(low, high)
    assert 2 <= len(ticks) <= count + 3
    assert all(math.isfinite(t) for t in ticks)
    assert all(a < b for a, b in zip(ticks, ticks[1:]))
    assert ticks[0] <= low and ticks[-1] >= high


def test_the_values_that_hung_or_broke_the_dashboard() -> None:
    for low, high in ((0.5, 0.5000000000000001), (1e16, 1e16 + 2), (-1e308, 1e308), (1e308, 1e308), (0.0, 5e-324)):
        _check_ticks(low, high)
    big = math.nextafter(math.inf, 0)
    _check_ticks(-big, big)
    _check_ticks(big, big)


@settings(max_examples=500, deadline=None)
@given(finite, finite)
def test_ticks_of_any_two_finite_values_are_few_finite_and_cover_them(a: float, b: float) -> None:
    _check_ticks(a, b)


@settings(max_examples=200, deadline=None)
@given(st.lists(finite, min_size=1, max_size=50), st.lists(finite, min_size=1, max_size=5))
def test_a_chart_of_any_finite_values_has_finite_coordinates(ys: list[float], xs: list[float]) -> None:
    points = [(xs[i % len(xs)], y) for i, y in enumerate(ys)]
    svg = line_chart([Series("loss", points)], "t", "step", "loss")
    coordinates = NUMBER.findall(svg) + re.findall(r'points="([^"]*)"', svg)
    numbers = [float(v) for c in coordinates for v in re.split(r"[ ,]", c) if v]
    assert numbers and all(math.isfinite(v) for v in numbers)
    assert svg.count("<text") <= 2 * (5 + 3) + 3  # ticks of two axes, the title and the two axis labels

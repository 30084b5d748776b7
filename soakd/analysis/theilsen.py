"""Theil–Sen slopes with Sen's distribution-free interval, over one series or within blocks.

The leak judgement's trend (``soakd.analysis.leak``): the median of all pairwise slopes, which
ignores up to ~29% outliers and needs no normality, and Sen's interval from Kendall's S (variance
``n(n-1)(2n+5)/18`` minus the usual correction for tied values). The blocked form takes only the
pairs within each block, with Var S summed over the blocks as the seasonal Kendall test does: a
level shift between blocks (a step of memory) moves no slope.
"""

from __future__ import annotations

import math
import statistics

from soakd.analysis.stats import z_value

__all__ = ["MAX_POINTS", "intercept", "theil_sen", "theil_sen_blocked"]

MAX_POINTS = 500  # Theil-Sen is O(n^2) pairs; longer series are subsampled evenly to this many points




def theil_sen(
    xs: list[float], ys: list[float], confidence: float = 0.95
) -> tuple[float, float, float] | None:
    """``(slope, lo, hi)``: Theil–Sen slope and Sen's rank-based ``confidence`` interval.

    Pairs with equal x are skipped. Ties in y reduce Kendall's variance (the standard tie
    correction). The interval's ranks ``(N - C)/2`` and ``(N + C)/2 + 1`` among the ``N`` sorted
    pairwise slopes (``C = z sqrt(Var S)``) are rounded outwards; a bound whose rank falls off
    the list is infinite (with 95% confidence that happens below 6 points). Beyond ``MAX_POINTS``
    points, that many are taken evenly spaced in x order. None with fewer than two distinct x.
    """
    pts = sorted((float(x), float(y)) for x, y in zip(xs, ys) if x is not None and y is not None)
    pts = [(x, y) for x, y in pts if math.isfinite(x) and math.isfinite(y)]
    n = len(pts)
    if n > MAX_POINTS:
        pts = [pts[round(i * (n - 1) / (MAX_POINTS - 1))] for i in range(MAX_POINTS)]
    return _sen([pts], confidence)


def theil_sen_blocked(
    blocks: list[tuple[list[float], list[float]]], confidence: float = 0.95
) -> tuple[float, float, float] | None:
    """``(slope, lo, hi)``: the slope *within* blocks (Sen's slope of the pairs that lie in the same
    block, with the blocked Kendall interval: Var S summed over the blocks, as the seasonal Kendall test
    does). A level shift between blocks moves no slope; a steady slope in every block is found with
    the power of all of them. None when no block has two distinct x."""
    parts = []
    for xs, ys in blocks:
        pts = sorted((float(x), float(y)) for x, y in zip(xs, ys) if x is not None and y is not None)
        pts = [(x, y) for x, y in pts if math.isfinite(x) and math.isfinite(y)]
        n = len(pts)
        if n > MAX_POINTS:
            pts = [pts[round(i * (n - 1) / (MAX_POINTS - 1))] for i in range(MAX_POINTS)]
        if len(pts) >= 2:
            parts.append(pts)
    return _sen(parts, confidence)


def _sen(blocks: list[list[tuple[float, float]]], confidence: float) -> tuple[float, float, float] | None:
    """Sen's slope and interval over the pairs within each block of sorted ``(x, y)`` points."""
    slopes = []
    var = 0.0
    for pts in blocks:
        n = len(pts)
        for i in range(n):
            xi, yi = pts[i]
            for j in range(i + 1, n):
                xj, yj = pts[j]
                if xj != xi:
                    slopes.append((yj - yi) / (xj - xi))
        ties: dict[float, int] = {}
        for _, y in pts:
            ties[y] = ties.get(y, 0) + 1
        var += (n * (n - 1) * (2 * n + 5) - sum(t * (t - 1) * (2 * t + 5) for t in ties.values())) / 18.0
    if not slopes:
        return None
    slopes.sort()
    big_n = len(slopes)
    slope = statistics.median(slopes)
    c = z_value(confidence) * math.sqrt(max(0.0, var))
    m1 = math.floor((big_n - c) / 2.0 + 1e-9)  # 1-based rank of the lower bound
    m2 = math.ceil((big_n + c) / 2.0 - 1e-9) + 1  # 1-based rank of the upper bound
    lo = slopes[m1 - 1] if 1 <= m1 <= big_n else -math.inf
    hi = slopes[m2 - 1] if 1 <= m2 <= big_n else math.inf
    return slope, min(lo, slope), max(hi, slope)


def intercept(xs: list[float], ys: list[float], slope: float) -> float:
    return statistics.median(y - slope * x for x, y in zip(xs, ys))

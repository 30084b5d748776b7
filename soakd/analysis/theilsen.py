"""Theil–Sen slopes with Sen's distribution-free interval, over one series or within blocks.

The leak judgement's trend (``soakd.analysis.leak``): the median of all pairwise slopes, which
ignores up to ~29% outliers and needs no normality, and Sen's interval from Kendall's S (variance
``n(n-1)(2n+5)/18`` minus the usual correction for tied values). The blocked form takes only the
pairs within each block, with Var S summed over the blocks as the seasonal Kendall test does: a
level shift between blocks (a step of memory) moves no slope.

The plain form is ``scipy.stats.theilslopes``. Both forms place the interval's bounds as scipy
does: at the ranks ``round((N - C)/2)`` and ``round((N + C)/2) + 1`` (1-based, rounded to the
nearest rank) among the ``N`` sorted pairwise slopes, with ``C = z sqrt(Var S)`` and Var S corrected
for ties in x and in y (Sen 1968, eq. 2.6). One difference: where a rank falls off the list of
slopes, scipy clips it to the list's end (the extreme slope, which has less than the confidence);
here that bound is infinite (no finite bound at this confidence: with 95% and no ties, below 5
points).
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections import Counter
from collections.abc import Iterable

import numpy as np
from scipy.stats import linregress, t as student_t, theilslopes

from soakd.analysis.stats import z_value

__all__ = ["MAX_POINTS", "intercept", "least_squares", "theil_sen", "theil_sen_blocked"]

MAX_POINTS = 500  # Theil-Sen is O(n^2) pairs; longer series are subsampled evenly to this many points

Fit = tuple[float, float, float]


def _points(xs: Iterable[float], ys: Iterable[float]) -> list[tuple[float, float]]:
    """The finite ``(x, y)`` pairs in x order; beyond ``MAX_POINTS``, that many evenly spaced."""
    pts = sorted((float(x), float(y)) for x, y in zip(xs, ys) if x is not None and y is not None)
    pts = [(x, y) for x, y in pts if math.isfinite(x) and math.isfinite(y)]
    n = len(pts)
    if n > MAX_POINTS:
        pts = [pts[round(i * (n - 1) / (MAX_POINTS - 1))] for i in range(MAX_POINTS)]
    return pts


def _ties(values: Iterable[float]) -> float:
    return float(sum(t * (t - 1) * (2 * t + 5) for t in Counter(values).values() if t > 1))


def _var_s(pts: list[tuple[float, float]]) -> float:
    """Var S with the corrections for ties in x and in y, as ``scipy.stats.theilslopes`` has it
    (Sen 1968, eq. 2.6). scipy does not return it; ``theil_sen`` needs it only to tell where scipy
    clipped a rank, the blocked form to sum it over the blocks."""
    n = len(pts)
    return (n * (n - 1) * (2 * n + 5) - _ties(x for x, _ in pts) - _ties(y for _, y in pts)) / 18.0


def _pairs(pts: list[tuple[float, float]]) -> int:
    """Pairs with distinct x (the slopes there are)."""
    n = len(pts)
    return n * (n - 1) // 2 - sum(t * (t - 1) // 2 for t in Counter(x for x, _ in pts).values())


def _ranks(n_slopes: int, var: float, confidence: float) -> tuple[int | None, int | None]:
    """0-based indices of the lower and upper bound among ``n_slopes`` sorted slopes, rounded as
    ``scipy.stats.theilslopes`` rounds them; None where an index falls off the list. With no
    variance (every y tied) the bounds are the middle slopes, clipped to the list as scipy does:
    off the list there is only the half-to-even rounding of ``n_slopes / 2``, not a missing bound."""
    c = z_value(confidence) * math.sqrt(max(0.0, var))
    lo = round((n_slopes - c) / 2.0) - 1
    hi = round((n_slopes + c) / 2.0)
    if c <= 0.0:
        return max(lo, 0), min(hi, n_slopes - 1)
    return (lo if lo >= 0 else None), (hi if hi <= n_slopes - 1 else None)


def theil_sen(xs: Iterable[float], ys: Iterable[float], confidence: float = 0.95) -> Fit | None:
    """``(slope, lo, hi)``: Theil–Sen slope and Sen's rank-based ``confidence`` interval
    (``scipy.stats.theilslopes``, its bounds made infinite where scipy clips a rank: see the
    module docstring).

    Pairs with equal x are skipped; ties reduce Kendall's variance. Beyond ``MAX_POINTS`` points,
    that many are taken evenly spaced in x order. None with fewer than two distinct x.
    """
    pts = _points(xs, ys)
    n_slopes = _pairs(pts)
    if n_slopes < 1:
        return None
    with warnings.catch_warnings():
        # a negative Var S (ties in x and in y nearly everywhere) is scipy's NaN bounds, handled below
        warnings.simplefilter("ignore", RuntimeWarning)
        r = theilslopes([y for _, y in pts], [x for x, _ in pts], alpha=confidence)
    slope, lo, hi = float(r.slope), float(r.low_slope), float(r.high_slope)
    if math.isnan(lo) or math.isnan(hi):  # Var S <= 0: no spread of ranks, the bounds are the slope
        return slope, slope, slope
    i_lo, i_hi = _ranks(n_slopes, _var_s(pts), confidence)
    lo = lo if i_lo is not None else -math.inf
    hi = hi if i_hi is not None else math.inf
    return slope, min(lo, slope), max(hi, slope)


def least_squares(xs: Iterable[float], ys: Iterable[float], confidence: float = 0.95) -> Fit | None:
    """``(slope, lo, hi)``: the least-squares slope (``scipy.stats.linregress``) and its Student-t interval
    (``n - 2`` degrees of freedom) at ``confidence``, two-sided as Sen's: the interval that reaches a high
    confidence from a dozen readings, where Sen's rank interval cannot (its Kendall S is bounded by the
    pairs). It assumes independent, near-normal readings (``soakd.analysis.leak`` judges with it only at a
    run-level confidence, beyond 95%). None below 4 points or with no spread of x."""
    pts = _points(xs, ys)
    n = len(pts)
    if n < 4 or len({x for x, _ in pts}) < 2:
        return None
    r = linregress([x for x, _ in pts], [y for _, y in pts])
    half = float(student_t.ppf(0.5 + confidence / 2.0, n - 2)) * float(r.stderr)
    return float(r.slope), float(r.slope) - half, float(r.slope) + half


def theil_sen_blocked(
    blocks: list[tuple[list[float], list[float]]], confidence: float = 0.95
) -> Fit | None:
    """``(slope, lo, hi)``: the slope *within* blocks (Sen's slope of the pairs that lie in the same
    block, with the blocked Kendall interval: Var S summed over the blocks, as the seasonal Kendall test
    does). A level shift between blocks moves no slope; a steady slope in every block is found with
    the power of all of them. None when no block has two distinct x.

    Written here, not taken from scipy: scipy has no blocked (seasonal) Theil–Sen. Each block's
    slopes, its Var S and the bounds' ranks are those of ``scipy.stats.theilslopes``, so one block
    gives what ``theil_sen`` gives.
    """
    slopes: list[np.ndarray] = []
    var = 0.0
    for xs, ys in blocks:
        pts = _points(xs, ys)
        if len(pts) < 2:
            continue
        x = np.array([p[0] for p in pts])
        y = np.array([p[1] for p in pts])
        dx = x[:, np.newaxis] - x
        dy = y[:, np.newaxis] - y
        slopes.append(dy[dx > 0] / dx[dx > 0])
        var += _var_s(pts)
    every = np.sort(np.concatenate(slopes)) if slopes else np.array([])
    if not every.size:
        return None
    slope = float(np.median(every))
    i_lo, i_hi = _ranks(int(every.size), var, confidence)
    lo = float(every[i_lo]) if i_lo is not None else -math.inf
    hi = float(every[i_hi]) if i_hi is not None else math.inf
    return slope, min(lo, slope), max(hi, slope)


def intercept(xs: list[float], ys: list[float], slope: float) -> float:
    """The median of ``y - slope x`` for a given slope (what ``theilslopes(method="joint")`` returns
    as the intercept of its own slope; here also for the blocked form's)."""
    return statistics.median(y - slope * x for x, y in zip(xs, ys))

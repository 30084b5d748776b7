"""Each tracked metric of a window as a *level* with an honest sampling variance, and the noise
between windows that the run itself shows: what the drift, A/B and end-of-run comparisons are made
of, so that a change is judged against the noise the run really has.

(derivation: docs/analysis.md#derivation-levelspy)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scipy.stats import chi2

from soakd.analysis.drift import metric_value
from soakd.analysis.stats import z_value
from soakd.config.analysis import DriftConfig
from soakd.core.summary import WindowSummary
from soakd.core.tracked import METRICS

__all__ = ["Level", "between_variance", "eligible", "level", "levels"]

_FAMILY = {"e2e_seconds": "e2e", "ttft_seconds": "ttft", "itl_seconds": "itl"}


@dataclass(frozen=True)
class Level:
    """One metric of one window on the analysis scale."""

    window: int
    y: float  # log(value), or the value for absolute metrics
    var: float  # sampling variance of y within the window
    value: float
    n: int
    start_unix: float | None = None


def eligible(window: WindowSummary) -> bool:
    """Judged at all: a full window in which the target stayed up and soakd did not stall."""
    return (not window.partial and window.target_down_seconds <= 0
            and not (window.client is not None and window.client.impaired))


def level(window: WindowSummary, metric: str, cfg: DriftConfig) -> Level | None:
    """The window's level of ``metric``, or None (no data, insufficient, or not eligible)."""
    if not eligible(window):
        return None
    spec = METRICS[metric]
    v, ci, n = metric_value(window, metric, confidence=cfg.confidence)
    if v is None or n < cfg.min_requests or ci is None:
        return None
    z = z_value(cfg.confidence)
    if spec.absolute:
        lo, hi = ci
        var = ((hi - lo) / (2 * z)) ** 2
        return Level(window.window, v, max(var, 1e-12), v, n, window.start_unix)
    if v <= 0:
        return None
    lo, hi = ci
    if lo <= 0 or hi <= 0 or not math.isfinite(hi):
        return None
    var = ((math.log(hi) - math.log(lo)) / (2 * z)) ** 2
    if spec.kind == "quantile" and window.subwindows is not None:
        var += window.subwindows.extra_var.get(_FAMILY.get(spec.field or "", ""), 0.0)
    return Level(window.window, math.log(v), max(var, 1e-12), v, n, window.start_unix)


def levels(windows: list[WindowSummary], metric: str, cfg: DriftConfig) -> list[Level]:
    """The eligible windows' levels of ``metric``, in window order."""
    out = []
    for w in sorted(windows, key=lambda w: w.window):
        lv = level(w, metric, cfg)
        if lv is not None:
            out.append(lv)
    return out


def between_variance(series: list[Level], breaks: frozenset[int] = frozenset()) -> tuple[float, int]:
    """``(tau2, df)`` from successive differences (see the module docstring). ``breaks``: indices
    ``i`` whose difference ``y[i+1] - y[i]`` straddles a change point and is left out."""
    d2, within = [], []
    for i in range(len(series) - 1):
        if i in breaks:
            continue
        a, b = series[i], series[i + 1]
        d2.append((b.y - a.y) ** 2)
        within.append((a.var + b.var) / 2.0)
    if not d2:
        return 0.0, 0
    cut = len(d2) // 4
    scale = 1.0
    if cut:
        d2.sort()
        d2[-cut:] = [d2[-cut - 1]] * cut
        scale = _winsorised_mean(cut / len(d2))
    return max(0.0, sum(d2) / (2 * len(d2) * scale) - sum(within) / len(within)), len(d2)


def _winsorised_mean(p: float) -> float:
    """E[min(X, q)] for X chi-square with 1 degree of freedom and q its (1 - p) quantile: what
    winsorising the top ``p`` of the squared differences leaves of their mean under noise (divided
    out, so that the estimate stays unbiased)."""
    q = float(chi2.ppf(1.0 - p, 1))
    # E[X; X < q] for chi2(1) is P(chi2(3) < q); plus q P(X > q)
    return float(chi2.cdf(q, 3)) + q * p

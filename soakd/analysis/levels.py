"""Each tracked metric of a window as a *level* with an honest sampling variance, and the noise
between windows that the run itself shows.

Scale: a latency quantile, a rate or energy per token is analysed as its logarithm (a relative
change is a difference of logs; ``exp(d) - 1`` is the ratio soakd reports); the error rate as
itself (changes are differences of proportions, ``DriftConfig.error_rate_threshold``).

Variance of one window's level, ``var``:

* **within the window, independent part** — a quantile's distribution-free order-statistic
  interval (``stats.quantile_ci``, stored at window close) read as a normal interval in log
  space; Poisson for requests/s, compound Poisson for tokens/s, Wilson for the error rate;
* **within the window, dependent part** — requests in one batch, or under the same slowly
  varying load, are not independent. The window's sub-windows (``SubWindows``, a minute each)
  give batch means of the log latency; what their variance exceeds the independent variance by
  (``extra_var``, per latency family) is added to every quantile of that family. Assumption: the
  load acts multiplicatively on the whole distribution (a slower batch is slower at p50 and p95
  alike).

Noise between windows, ``tau2``: load that wanders over tens of minutes moves whole windows,
which no within-window figure sees. It is estimated from the run's own window series as the
part of the mean squared successive difference (von Neumann) that the windows' ``var`` does not
explain: ``tau2 = max(0, mean((y[i+1] - y[i])^2) / 2 - mean(var))``. Successive differences are
insensitive to a slow trend, and a step moves only one of them; the largest ``df // 4`` squared
differences are winsorised (set to the next largest), so that a step or a throttle episode in the
history does not hide the next change behind a noise floor it inflated (and the mean is divided by
what winsorising leaves of it under noise, ``E[min(X, q)]`` for chi-square X: no bias). ``df`` (the number of
differences) goes with it: comparisons use Student-t quantiles at that many degrees of freedom,
so a noise floor estimated from few windows is trusted accordingly.

Eligible windows: not partial, the target never down in them, soakd itself not stalled in them
(``ClientSummary.impaired``), at least ``min_requests`` samples of the metric. Outage,
client-impaired and insufficient windows are shown, never judged, never a baseline.
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

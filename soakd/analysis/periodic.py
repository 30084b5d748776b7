"""Periodic drops: performance that dips at a steady period (cooling cycles, power management,
a scheduler's batch job), found on the run's per-minute series by a Lomb–Scargle periodogram whose
peaks are measured against the spectrum's own local level, so that slowly varying load is not read
as a period.

(derivation: docs/analysis.md#derivation-periodicpy)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy.signal import lombscargle
from scipy.stats import f as f_dist

from soakd.analysis.levels import eligible
from soakd.core.summary import WindowSummary

__all__ = ["PeriodicDrops", "minute_series", "periodic_drops"]

MIN_COUNT = 5  # requests a sub-window needs to enter the series
NEIGHBOURS = 16  # frequencies on each side that set the spectrum's local level


@dataclass(frozen=True)
class PeriodicDrops:
    period_seconds: float
    fap: float
    depth_ratio: float  # how much slower the slowest quarter of the cycle is (0.11 = +11% latency)
    points: int
    frequencies: int

    def message(self) -> str:
        return (f"e2e latency rises {self.depth_ratio * 100:+.0f}% every {self.period_seconds / 60:.0f} min "
                f"(Lomb-Scargle over {self.points} minutes, false-alarm probability {self.fap:.1g})")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def minute_series(windows: list[WindowSummary], family: str = "e2e") -> tuple[np.ndarray, np.ndarray]:
    """(unix times, log latency) of every sub-window of the eligible windows with enough requests."""
    ts: list[float] = []
    ys: list[float] = []
    for w in sorted(windows, key=lambda w: w.window):
        sub = w.subwindows
        if sub is None or w.start_unix is None or not eligible(w):
            continue
        values = getattr(sub, family)
        for j, (v, ok) in enumerate(zip(values, sub.ok)):
            if v is not None and v > 0 and ok >= MIN_COUNT:
                ts.append(w.start_unix + (j + 0.5) * sub.seconds)
                ys.append(math.log(v))
    return np.asarray(ts), np.asarray(ys)


def periodic_drops(windows: list[WindowSummary], *, min_period: float = 600.0, max_period: float = 14400.0,
                   fap: float = 0.01, min_depth: float = 0.025, family: str = "e2e") -> PeriodicDrops | None:
    """The strongest period between ``min_period`` and ``max_period`` when its FAP is below ``fap``
    and its drops are at least ``min_depth`` deep (half the default drift threshold: a 1% ripple
    is no finding, however regular)."""
    t, y = minute_series(windows, family)
    if len(t) < 60:
        return None
    span = float(t[-1] - t[0])
    if span <= 0:
        return None
    k_lo = max(1, math.ceil(span / min(max_period, span / 3.0)))
    k_hi = math.floor(span / min_period)
    if k_hi - k_lo < 2 * NEIGHBOURS:
        return None
    k = np.arange(max(1, k_lo - NEIGHBOURS), k_hi + NEIGHBOURS + 1)
    freqs = k / span
    x = t - t[0]
    resid = y - np.polyval(np.polyfit(x, y, 1), x)
    power = lombscargle(x, resid - resid.mean(), 2 * np.pi * freqs)
    best_z, best_k = 1.0, None  # the smallest single-frequency p-value, and where
    tested = 0
    for i, kk in enumerate(k):
        if kk < k_lo or kk > k_hi:
            continue
        tested += 1
        around = np.concatenate([power[max(0, i - NEIGHBOURS):max(0, i - 1)], power[i + 2:i + NEIGHBOURS + 1]])
        if len(around) < 4:
            continue
        level = float(np.mean(around))
        if level <= 0:
            continue
        m = len(around)
        p_one = float(f_dist.sf(float(power[i]) / level, 2, 2 * m))
        if best_k is None or p_one < best_z:
            best_z, best_k = p_one, int(kk)
    if best_k is None or tested == 0:
        return None
    p = 1.0 - (1.0 - best_z) ** tested
    if p >= fap:
        return None
    period = span / best_k
    phase = ((x / period) % 1.0 * 4).astype(int)
    means = [float(resid[phase == q].mean()) for q in range(4) if np.any(phase == q)]
    depth = math.expm1(max(means) - float(np.mean([m for m in means if m != max(means)] or [0.0])))
    if depth < min_depth:
        return None
    return PeriodicDrops(period_seconds=period, fap=p, depth_ratio=depth, points=len(t), frequencies=tested)

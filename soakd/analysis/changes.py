"""Drift judged with run-level error control: a pooled baseline, live comparisons that page
rarely by construction, and at the end of the run the change points, a trend test and the
changes they imply, each in one of two tiers (*confident* fails the run, *likely* is reported).
Levels, their variances and the noise floor come from ``soakd.analysis.levels``.

(derivation: docs/analysis.md#derivation-changespy)
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field
from statistics import NormalDist
from typing import Any, Literal

import numpy as np
import pymannkendall
import ruptures
from scipy import stats as sps

from soakd.analysis import page as page_mod
from soakd.analysis.drift import DriftResult
from soakd.analysis.page import PoolCheck
from soakd.analysis.levels import Level, between_variance, levels
from soakd.config.analysis import DriftConfig
from soakd.core.summary import WindowSummary
from soakd.core.tracked import METRICS

__all__ = [
    "Change",
    "RunDrift",
    "Trend",
    "change_points",
    "checked_series",
    "compare_levels",
    "format_change",
    "judge_run",
    "live_z",
    "mde",
    "segment_difference",
    "span_changes",
    "tau2_upper",
]

Tier = Literal["confident", "likely"]


def live_z(cfg: DriftConfig, planned_windows: int, references: int = 2) -> float:
    """The live comparisons' z: Bonferroni over metrics x planned windows x references (the baseline
    and the previous window; in an A/B run also each candidate against the reference), two-sided."""
    alpha = 1.0 - cfg.confidence
    family = cfg.family * max(1, planned_windows) * max(1, references)
    return NormalDist().inv_cdf(1.0 - alpha / (2.0 * family))


def tau2_upper(series: list[Level], bound: float = 0.90) -> float:
    """The noise floor's ``bound`` upper confidence bound: the successive-difference variance's
    chi-square bound at its degrees of freedom, less the windows' own variance."""
    tau2, df = between_variance(series)
    if df <= 0:
        return 0.0
    within = sum((a.var + b.var) / 2.0 for a, b in zip(series, series[1:])) / df
    s = tau2 + within
    return max(0.0, s * df / float(sps.chi2.ppf(1.0 - bound, df)) - within)


def _ratio(metric: str, d: float) -> float:
    return d if METRICS[metric].absolute else math.expm1(d)


def _tier(metric: str, d: float, half: float, thr: float) -> tuple[Tier | None, int]:
    """(tier, side): side +1 for a rise, -1 for a fall, 0 for none."""
    lo, hi = _ratio(metric, d - half), _ratio(metric, d + half)
    r = _ratio(metric, d)
    if lo > thr:
        return "confident", 1
    if hi < -thr:
        return "confident", -1
    if r > thr and lo > 0:
        return "likely", 1
    if r < -thr and hi < 0:
        return "likely", -1
    return None, 0


def compare_levels(
    metric: str,
    current: Level,
    reference: list[Level],
    tau2: float,
    z: float,
    cfg: DriftConfig,
    *,
    reference_kind: Literal["baseline", "previous"] = "baseline",
) -> DriftResult:
    """One window's level against the mean of ``reference`` levels (the pool, or the previous
    window): status ``drift`` only when *confident* at ``z``."""
    spec = METRICS[metric]
    thr = cfg.threshold_for(metric)
    ref_y = sum(lv.y for lv in reference) / len(reference)
    ref_var = sum(lv.var + tau2 for lv in reference) / len(reference) ** 2
    d = current.y - ref_y
    half = z * math.sqrt(current.var + tau2 + ref_var)
    tier, side = _tier(metric, d, half, thr)
    ref_value = ref_y if spec.absolute else math.exp(ref_y)
    status: Literal["ok", "drift"] = "drift" if tier == "confident" else "ok"
    direction = None
    if status == "drift":
        direction = "degraded" if (side > 0) == spec.higher_is_worse else "improved"
    return DriftResult(
        metric=metric, reference=reference_kind, value=current.value, reference_value=ref_value,
        ratio=_ratio(metric, d), ratio_ci=(_ratio(metric, d - half), _ratio(metric, d + half)), status=status,
        direction=direction, threshold=thr, n=current.n, reference_n=sum(lv.n for lv in reference),
        window=current.window, reference_window=reference[0].window if len(reference) == 1 else None,
        tier=tier,
    )  # fmt: skip


def mde(metric: str, window_var: float, pool: list[Level], tau2: float, z: float, cfg: DriftConfig,
        windows: int = 1) -> float:
    """The smallest change that ``windows`` windows at this variance would show as *confident*
    against the pool: ``thr + z · SE`` (on the metric's scale)."""
    pool_var = sum(lv.var + tau2 for lv in pool) / len(pool) ** 2
    se = math.sqrt((window_var + tau2) / windows + pool_var)
    thr = cfg.threshold_for(metric)
    if METRICS[metric].absolute:
        return thr + z * se
    return math.expm1(math.log1p(thr) + z * se)


# ---------------------------------------------------------------------------------------------
# the end of the run


@dataclass(frozen=True)
class Change:
    """A segment of the run whose level differs from the pool's."""

    metric: str
    window: int  # its first window
    end_window: int  # its last window
    start_unix: float | None
    ratio: float
    ci: tuple[float, float]
    tier: Tier
    direction: Literal["degraded", "improved"]
    windows: int
    threshold: float

    def message(self) -> str:
        def f(x: float) -> str:
            return format_change(self.metric, x)

        return (f"{self.metric} {'stepped' if self.window > 0 else 'differs'} {f(self.ratio)} "
                f"(CI {f(self.ci[0])}..{f(self.ci[1])}) from window {self.window}"
                f"{_clock(self.start_unix)} to {self.end_window} vs the baseline: {self.tier} "
                f"{self.direction}, threshold {f(self.threshold)[1:]}")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ci": list(self.ci)}


@dataclass(frozen=True)
class Trend:
    metric: str
    slope_per_window: float  # on the analysis scale (log, or absolute)
    total_ratio: float  # the change over the judged windows
    total_ci: tuple[float, float]
    p_value: float
    tier: Tier
    direction: Literal["degraded", "improved"]
    windows: int
    first_window: int
    last_window: int
    threshold: float

    def message(self) -> str:
        def f(x: float) -> str:
            return format_change(self.metric, x)

        return (f"{self.metric} creeps {f(self.total_ratio)} over windows {self.first_window}-{self.last_window} "
                f"(Sen CI {f(self.total_ci[0])}..{f(self.total_ci[1])}, Mann-Kendall p {self.p_value:.2g}): "
                f"{self.tier} {self.direction}")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total_ci": list(self.total_ci)}


@dataclass
class RunDrift:
    """The end-of-run drift judgement of every metric."""

    changes: list[Change] = field(default_factory=list)
    trends: list[Trend] = field(default_factory=list)
    tau2: dict[str, float] = field(default_factory=dict)
    change_points: dict[str, list[int]] = field(default_factory=dict)  # metric -> first windows of segments
    pool: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"changes": [c.to_dict() for c in self.changes], "trends": [t.to_dict() for t in self.trends],
                "noise_floor": {m: math.sqrt(v) for m, v in self.tau2.items()},
                "change_points": self.change_points, "pool": self.pool}


def format_change(metric: str, x: float) -> str:
    """A change as people read it: +9.1% (error rate: +0.3pp)."""
    return f"{x * 100:+.1f}{'pp' if METRICS[metric].absolute else '%'}"


def _clock(t: float | None) -> str:
    if t is None:
        return ""
    import time

    return " (" + time.strftime("%H:%M", time.gmtime(t)) + " UTC)"


def _segments(series: list[Level], tau2: float) -> list[int]:
    """Indices where a new segment starts (PELT on the standardised levels)."""
    n = len(series)
    if n < 4:
        return []
    scale = math.sqrt(sum(lv.var for lv in series) / n + tau2) or 1.0
    x = np.array([[lv.y / scale] for lv in series])
    algo = ruptures.Pelt(model="l2", min_size=2, jump=1).fit(x)
    ends = algo.predict(pen=3.0 * math.log(n))
    return [e for e in ends if e < n]


def change_points(series: list[Level]) -> tuple[list[int], float, int]:
    """``(starts, tau2, df)``: where PELT starts new segments of ``series`` (indices), and the noise
    floor with its degrees of freedom from the successive differences that straddle none of them."""
    tau2_all, _ = between_variance(series)
    starts = _segments(series, tau2_all)
    tau2, df = between_variance(series, frozenset(s - 1 for s in starts))
    return starts, tau2, df


def segment_difference(part: list[Level], ref_y: float, ref_var: float, ref_windows: int, tau2: float, df: int,
                       p: float) -> tuple[float, float]:
    """``(d, half)``: the mean level of the segment ``part`` less the reference's ``ref_y`` (whose
    variance ``ref_var`` already holds the noise floor of its ``ref_windows`` windows; 0 and 0 for a
    fixed reference), and the half-width of its interval at the one-sided level ``p``: a Student-t
    quantile at the Satterthwaite degrees of freedom of the variance (only its ``tau2`` part is
    estimated, with ``df`` degrees of freedom)."""
    k = len(part)
    var = sum(lv.var + tau2 for lv in part) / k**2 + ref_var
    tau_part = tau2 * (1.0 / k + (1.0 / ref_windows if ref_windows else 0.0))
    dfe = math.inf if tau_part <= 0 or df <= 0 else df * (var / tau_part) ** 2
    q = _t(p, dfe)
    d = sum(lv.y for lv in part) / k - ref_y
    return d, q * math.sqrt(var)


def _t(p: float, df: float) -> float:
    """Student's t quantile (scipy: any df, the normal one at df = inf)."""
    return float(sps.t.ppf(p, max(1.0, df)))


def checked_series(windows: list[WindowSummary], metric: str, pool_windows: list[int], cfg: DriftConfig,
                   checks: dict[str, PoolCheck] | None = None) -> tuple[list[Level], list[Level], PoolCheck | None]:
    """``(series, pool, check)``: the metric's levels less the pool windows its check left out (a blip),
    the pool's levels, and the check (``page.check_pool`` with the run's noise floor; ``checks``: given
    ones instead, per metric: the live run's that moved the reference)."""
    series = levels(windows, metric, cfg)
    pool_set = set(pool_windows)
    pool = [lv for lv in series if lv.window in pool_set]
    if not pool:
        return series, pool, None
    check = (checks or {}).get(metric)
    if check is None:
        # the pool's own test with everything the run knows: the sub-windows' slow wander, the noise floor
        extra = page_mod.extra_of(metric, [w for w in windows if w.window in pool_set])
        _, tau2, _ = change_points(series)
        check = page_mod.check_pool(metric, pool, cfg, extra + tau2)
    if check is not None and check.dropped:
        series = [lv for lv in series if lv.window not in check.dropped]
        pool = [lv for lv in pool if lv.window not in check.dropped]
    return series, pool, check


def judge_run(windows: list[WindowSummary], pool_windows: list[int], cfg: DriftConfig,
              checks: dict[str, PoolCheck] | None = None) -> RunDrift:
    """Change points, segment changes against the checked pool and trends over the run's full windows.
    ``checks``: pool checks to use instead of the run's own, per metric (``checked_series``)."""
    out = RunDrift(pool=list(pool_windows))
    alpha = 1.0 - cfg.confidence
    m = cfg.family
    for metric in cfg.metrics:
        thr = cfg.threshold_for(metric)
        series, pool, check = checked_series(windows, metric, pool_windows, cfg, checks)
        if len(series) < len(pool) + 2 or not pool:
            continue
        starts, tau2, df = change_points(series)
        out.tau2[metric] = tau2
        out.change_points[metric] = [series[s].window for s in starts]
        bounds = [0, *starts, len(series)]
        last_pool = max(lv.window for lv in pool)
        if check is not None and check.moved_from is not None:
            # a regression that began inside the pool: the windows before it are the reference, every
            # segment from it on (the change point at its first window too) is judged against them
            reference = [lv for lv in pool if lv.window in check.reference]
            k = next(i for i, lv in enumerate(series) if lv.window >= check.moved_from)
            # (a change point PELT put a window after it is the same change: its segments are 2 windows long)
            cut = sorted({k, *(s for s in starts if s > k + 1)})
            segs = [series[a:b] for a, b in zip(cut, [*cut[1:], len(series)])]
            if k not in starts:
                out.change_points[metric] = sorted({*out.change_points[metric], series[k].window})
        elif starts and series[starts[0] - 1].window >= last_pool:
            # the first segment holds the pool and the windows that did not differ from it: the reference
            reference = series[:starts[0]]
            segs = [series[a:b] for a, b in zip(bounds[1:], bounds[2:])]
        else:
            reference = pool
            segs = []
            for a, b in zip(bounds, bounds[1:]):
                part = [lv for lv in series[a:b] if lv.window > last_pool]
                if part:
                    segs.append(part)
        for part in segs:
            c = _segment_change(metric, part, reference, tau2, df, alpha / (2.0 * m * len(segs)), thr)
            if c is not None:
                out.changes.append(c)
        changes = [c for c in out.changes if c.metric == metric]
        trend = _trend(metric, series, alpha / m, thr)
        if changes and trend is not None:
            # one explanation per metric: steps, or a straight creep, whichever fits with fewer words
            if _line_fits_better(series, starts, tau2):
                out.changes = [c for c in out.changes if c.metric != metric]
                out.change_points[metric] = []
            else:
                trend = None
        if trend is not None:
            out.trends.append(trend)
    return out


def _segment_change(metric: str, part: list[Level], reference: list[Level], tau2: float, df: int, tail: float,
                    thr: float) -> Change | None:
    """A segment's mean level against the reference's (``segment_difference``), two-sided at ``tail``
    (the family-corrected alpha / 2): a change of a tier, or None."""
    spec = METRICS[metric]
    ref_y = sum(lv.y for lv in reference) / len(reference)
    ref_var = sum(lv.var + tau2 for lv in reference) / len(reference) ** 2
    d, half = segment_difference(part, ref_y, ref_var, len(reference), tau2, df, 1.0 - tail)
    tier, side = _tier(metric, d, half, thr)
    if tier is None:
        return None
    return Change(
        metric=metric, window=part[0].window, end_window=part[-1].window, start_unix=part[0].start_unix,
        ratio=_ratio(metric, d), ci=(_ratio(metric, d - half), _ratio(metric, d + half)), tier=tier,
        direction="degraded" if (side > 0) == spec.higher_is_worse else "improved", windows=len(part), threshold=thr,
    )  # fmt: skip


def span_changes(windows: list[WindowSummary], pool_windows: list[int], cfg: DriftConfig,
                 spans: list[tuple[int, int]], skip: set[tuple[str, int, int]] = frozenset(),
                 checks: dict[str, PoolCheck] | None = None) -> list[tuple[tuple[int, int], Change]]:
    """Every tracked metric over each of ``spans`` (first, last window: the spans of the run's change
    points) against the pool, as ``judge_run`` tests a segment: what else moved in the same windows. The
    family is metrics x spans; ``skip``: (metric, first, last) already judged. ``(span, change)`` for the
    changes of a tier (the change's own windows are the metric's levels inside the span)."""
    out: list[tuple[tuple[int, int], Change]] = []
    if not spans:
        return out
    alpha = 1.0 - cfg.confidence
    m = cfg.family
    for metric in cfg.metrics:
        series, pool, check = checked_series(windows, metric, pool_windows, cfg, checks)
        if not pool or len(series) < len(pool) + 2:
            continue
        last_pool = max(lv.window for lv in pool)
        if check is not None and check.moved_from is not None:
            pool = [lv for lv in pool if lv.window in check.reference]
            last_pool = check.moved_from - 1
        # the differences that straddle a span's edges carry its step, not the noise
        breaks = frozenset(i for i in range(len(series) - 1) for a, b in spans
                           if series[i].window < a <= series[i + 1].window or series[i].window <= b < series[i + 1].window)
        tau2, df = between_variance(series, breaks)
        for a, b in spans:
            if (metric, a, b) in skip:
                continue
            part = [lv for lv in series if a <= lv.window <= b and lv.window > last_pool]
            if not part:
                continue
            c = _segment_change(metric, part, pool, tau2, df, alpha / (2.0 * m * len(spans)), cfg.threshold_for(metric))
            if c is not None:
                out.append(((a, b), c))
    return out


def _line_fits_better(series: list[Level], starts: list[int], tau2: float) -> bool:
    """Whether a straight line explains the levels better than the segments (BIC-like, on the
    standardised scale PELT used: the line costs one parameter, each change point 3 ln n)."""
    n = len(series)
    scale2 = sum(lv.var for lv in series) / n + tau2 or 1.0
    y = np.array([lv.y for lv in series])
    x = np.arange(n, dtype=float)
    rss_line = float(np.sum((y - np.polyval(np.polyfit(x, y, 1), x)) ** 2)) / scale2
    bounds = [0, *starts, n]
    rss_seg = sum(float(np.sum((y[a:b] - y[a:b].mean()) ** 2)) for a, b in zip(bounds, bounds[1:])) / scale2
    return rss_line + math.log(n) <= rss_seg + 3.0 * math.log(n) * len(starts)


def _trend(metric: str, series: list[Level], alpha: float, thr: float) -> Trend | None:
    n = len(series)
    if n < 8:
        return None
    y = np.array([lv.y for lv in series])
    if float(np.ptp(y)) <= 0:
        return None
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore", RuntimeWarning)
            res = pymannkendall.hamed_rao_modification_test(y, alpha=alpha)
    except (ZeroDivisionError, ValueError, FloatingPointError):
        return None
    p = float(res.p)
    if not (p < alpha) or not math.isfinite(p):
        return None
    x = np.arange(n, dtype=float)
    ts = sps.theilslopes(y, x, alpha=1.0 - alpha)
    span = n - 1
    total = _ratio(metric, float(ts.slope) * span)
    lo, hi = _ratio(metric, float(ts.low_slope) * span), _ratio(metric, float(ts.high_slope) * span)
    if total > thr:
        side, tier = 1, "confident" if lo > thr else "likely"
    elif total < -thr:
        side, tier = -1, "confident" if hi < -thr else "likely"
    else:
        return None
    spec = METRICS[metric]
    return Trend(metric=metric, slope_per_window=float(ts.slope), total_ratio=total, total_ci=(lo, hi), p_value=p,
                 tier=tier, direction="degraded" if (side > 0) == spec.higher_is_worse else "improved", windows=n,
                 first_window=series[0].window, last_window=series[-1].window, threshold=thr)  # fmt: skip

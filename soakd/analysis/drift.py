"""Drift: each tracked quantity of a window against the baseline window and the previous window,
flagged only when the whole interval of the change lies beyond the threshold. The plain pairwise
rule, kept for the diagnosis's per-scenario comparisons (the run's drift is judged by
``soakd.analysis.changes``); and across the run the method's stability figure and recurring drops.

(derivation: docs/analysis.md#derivation-driftpy)
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pydantic import ValidationError

from soakd.analysis.stats import (
    difference_ci,
    energy_per_token_ci,
    rate_ci,
    ratio_ci,
    tokens_rate_ci,
    wilson_ci,
    z_value,
)
from soakd.config.analysis import DriftConfig
from soakd.core.summary import CI, SERVER_MEAN_MIN_INTERVALS, Quantiles, ScenarioSummary, WindowSummary
from soakd.core.tracked import METRICS

__all__ = [
    "DriftResult",
    "baseline_from_report",
    "choose_baseline",
    "compare",
    "evaluate",
    "metric_value",
    "recurring_drops",
    "stability",
]

Window = WindowSummary


@dataclass(frozen=True)
class DriftResult:
    """One metric of one window against one reference window."""

    metric: str
    reference: Literal["baseline", "previous"]
    value: float | None
    reference_value: float | None
    ratio: float | None  # signed relative change (error_rate: absolute difference)
    ratio_ci: CI | None
    status: Literal["ok", "drift", "insufficient", "no_data"]
    direction: Literal["degraded", "improved"] | None
    threshold: float
    n: int = 0
    reference_n: int = 0
    window: int | None = None
    reference_window: int | None = None
    scenario: str | None = None
    tier: Literal["confident", "likely"] | None = None
    windows: int = 1  # the live page: the segment of the last ``windows`` windows that paged (soakd.analysis.page)
    segment_ratio: float | None = None  # that segment's change against the reference

    @property
    def flagged(self) -> bool:
        return self.status == "drift"

    def message(self) -> str:
        where = f" [{self.scenario}]" if self.scenario else ""
        absolute = METRICS[self.metric].absolute if self.metric in METRICS else False
        if self.ratio is None:
            return f"{self.metric}{where} vs {self.reference}: {self.status}"

        def fmt(x: float) -> str:
            return f"{x * 100:+.1f}{'pp' if absolute else '%'}"

        ci = f" (CI {fmt(self.ratio_ci[0])}..{fmt(self.ratio_ci[1])})" if self.ratio_ci else ""
        head = f"{self.metric}{where} {fmt(self.ratio)}{ci} vs {self.reference}"
        return (
            f"{head} window {self.reference_window}: {self.value:.6g} vs {self.reference_value:.6g}, "
            f"threshold {self.threshold * 100:.1f}{'pp' if absolute else '%'}, n {self.n}/{self.reference_n}: "
            f"{self.status}{' (' + self.direction + ')' if self.direction else ''}"
            + (f"; the last {self.windows} windows {fmt(self.segment_ratio)}" if self.segment_ratio is not None
               and self.windows > 1 else "")
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratio_ci"] = list(self.ratio_ci) if self.ratio_ci else None
        if self.segment_ratio is None:  # documents of a comparison that did not page stay as they were
            d.pop("windows")
            d.pop("segment_ratio")
        return d


# ---------------------------------------------------------------------------------------------
# reading a window


def _as_ci(v: Any) -> CI | None:
    if v is None:
        return None
    try:
        lo, hi = v
    except (TypeError, ValueError):
        return None
    if lo is None or hi is None:
        return None
    return float(lo), float(hi)



def metric_value(
    window: Window, metric: str, *, scenario: str | None = None, confidence: float = 0.95
) -> tuple[float | None, CI | None, int]:
    """``(value, interval or None, sample count)`` of a metric in a window (or one scenario of it).

    Quantiles use the ``pXX_ci`` stored at window close; rates, error rate and energy per token
    get their interval here at ``confidence``. The sample count is what ``min_requests`` is
    checked against: the sketch count for e2e/TTFT, the number of streamed requests (TTFT count)
    for inter-token gaps, the request count otherwise.
    """
    spec = METRICS.get(metric)
    if spec is None:
        raise KeyError(f"unknown metric {metric!r}; known: {sorted(METRICS)}")
    if window is None:
        return None, None, 0
    src: WindowSummary | ScenarioSummary | None = window if scenario is None else window.scenarios.get(scenario)
    if src is None:
        return None, None, 0
    duration = window.duration_seconds or None
    requests = src.requests
    ok = int(src.outcomes.get("ok", requests) or 0)

    if spec.kind == "quantile":
        d: Quantiles = getattr(src, spec.field)
        n = d.count
        if spec.field == "itl_seconds" and src.ttft_seconds.count:
            n = min(n, src.ttft_seconds.count)
        return d.get(spec.q), _as_ci(d.ci(spec.q)), n

    if spec.kind == "requests_rate":
        ci = rate_ci(ok, duration, confidence) if duration else None
        return src.requests_per_second, ci, requests

    if spec.kind == "tokens_rate":
        value = src.output_tokens_per_second
        tokens = float(src.completion_tokens) if src.completion_tokens is not None else value * (duration or 0.0)
        ci = (
            tokens_rate_ci(tokens, duration, src.completion_tokens_sumsq, ok, confidence)
            if duration
            else None
        )
        return value, ci, requests

    if spec.kind == "error_rate":
        value = src.error_rate
        if value is None and requests:
            value = 1.0 - ok / requests
        ci = wilson_ci(requests - ok, requests, confidence) if requests else None
        return value, ci, requests

    if spec.kind == "goodput":
        g = src.goodput
        if g is None or not g.requests:
            return None, None, 0
        return g.ratio, wilson_ci(g.met, g.requests, confidence), g.requests

    # the server's own means and energy per output token: the window's, not split per scenario
    if scenario is not None:
        return None, None, requests
    if spec.kind == "server_mean":
        assert spec.field is not None
        mean = getattr(window.server, spec.field)
        rse = getattr(window.server, spec.field.replace("_seconds", "_rel_se"))
        k = getattr(window.server, spec.field.replace("_seconds", "_intervals"))
        if mean is None or not mean > 0:
            return None, None, requests
        # shown without an interval (so never judged) where its standard error rests on too few scrape intervals;
        # a report of before the count was kept has the standard error only where it rested on enough
        if rse is None or (k is not None and k < SERVER_MEAN_MIN_INTERVALS):
            return mean, None, requests
        half = z_value(confidence) * rse  # symmetric on the log scale the analysis compares on
        return mean, (mean * math.exp(-half), mean * math.exp(half)), requests
    dev = window.device
    value = dev.energy_per_output_token_joules
    if value is None:
        return None, None, requests
    power = dev.power_watts
    ci = energy_per_token_ci(
        value,
        float(window.completion_tokens or 0),
        window.completion_tokens_sumsq,
        ok,
        power.stdev if power else None,
        power.mean if power else None,
        power.count if power else 0,
        confidence,
    )
    return value, ci, requests


# ---------------------------------------------------------------------------------------------
# comparing


def compare(
    window: Window,
    reference: Window,
    metric: str,
    cfg: DriftConfig | None = None,
    *,
    reference_kind: Literal["baseline", "previous"] = "baseline",
    scenario: str | None = None,
) -> DriftResult:
    """One metric of ``window`` against ``reference`` (see the module docstring for the rule)."""
    cfg = cfg or DriftConfig()
    spec = METRICS[metric]
    thr = cfg.threshold_for(metric)
    v, vci, n = metric_value(window, metric, scenario=scenario, confidence=cfg.confidence)
    r, rci, rn = metric_value(reference, metric, scenario=scenario, confidence=cfg.confidence)
    common = dict(
        metric=metric,
        reference=reference_kind,
        value=v,
        reference_value=r,
        threshold=thr,
        n=n,
        reference_n=rn,
        window=window.window if window is not None else None,
        reference_window=reference.window if reference is not None else None,
        scenario=scenario,
    )
    if v is None or r is None or (not spec.absolute and r <= 0):
        return DriftResult(ratio=None, ratio_ci=None, status="no_data", direction=None, **common)

    if spec.absolute:
        ratio = v - r
        ci = difference_ci(v, vci, r, rci) if vci and rci else None
    else:
        ratio = v / r - 1.0
        rc = ratio_ci(vci, rci, v, r)
        ci = (rc[0] - 1.0, rc[1] - 1.0) if rc else None

    if n < cfg.min_requests or rn < cfg.min_requests or ci is None:
        return DriftResult(ratio=ratio, ratio_ci=ci, status="insufficient", direction=None, **common)

    up = ratio > thr and ci[0] > thr
    down = ratio < -thr and ci[1] < -thr
    if not (up or down):
        return DriftResult(ratio=ratio, ratio_ci=ci, status="ok", direction=None, **common)
    degraded = up if spec.higher_is_worse else down
    return DriftResult(
        ratio=ratio, ratio_ci=ci, status="drift", direction="degraded" if degraded else "improved", **common
    )


def evaluate(
    window: Window,
    baseline: Window | None,
    previous: Window | None,
    cfg: DriftConfig | None = None,
    *,
    scenario: str | None = None,
) -> list[DriftResult]:
    """Every configured metric against the baseline and against the previous window.

    A reference that is missing, or is the window itself, is skipped.
    """
    cfg = cfg or DriftConfig()
    out: list[DriftResult] = []
    idx = window.window
    for ref, kind in ((baseline, "baseline"), (previous, "previous")):
        if ref is None or (ref is window) or (ref.window == idx and kind == "baseline"):
            continue
        for metric in cfg.metrics:
            out.append(compare(window, ref, metric, cfg, reference_kind=kind, scenario=scenario))
    return out


# ---------------------------------------------------------------------------------------------
# baselines


def _sufficient(window: Window, min_requests: int) -> bool:
    return window.requests >= min_requests and window.e2e_seconds.count >= min_requests


def choose_baseline(windows: list[Window], min_requests: int = 50) -> Window | None:
    """The first full window: not partial, with at least ``min_requests`` requests and as many
    successful ones (a window in which everything failed is no baseline). Warm-up is never a
    window, so this is "the first full window after warm-up"."""
    for w in sorted(windows, key=lambda w: w.window):
        if not w.partial and _sufficient(w, min_requests):
            return w
    return None


def baseline_from_report(report: Any, min_requests: int = 50) -> Window | None:
    """The baseline window of an earlier run's JSON report (already parsed): a list of window
    summaries, or an object with ``"baseline"`` (used as is) or ``"windows"``. ValueError when a
    window in it is not a window summary."""

    def load(items: list[Any]) -> list[WindowSummary]:
        try:
            return [WindowSummary.load(w) for w in items if isinstance(w, dict)]
        except ValidationError as exc:
            raise ValueError(f"not a soakd window summary: {exc.errors()[0]['msg']}") from None

    if isinstance(report, list):
        return choose_baseline(load(report), min_requests)
    if isinstance(report, dict):
        if isinstance(report.get("baseline"), dict):
            return load([report["baseline"]])[0]
        if isinstance(report.get("windows"), list):
            return choose_baseline(load(report["windows"]), min_requests)
        if "window" in report and "requests" in report:
            return load([report])[0]
    return None


# ---------------------------------------------------------------------------------------------
# across the run


def _eligible(windows: list[Window], metric: str, cfg: DriftConfig) -> list[tuple[Window, float, CI | None]]:
    out = []
    for w in sorted(windows, key=lambda w: w.window):
        if w.partial:
            continue
        v, ci, n = metric_value(w, metric, confidence=cfg.confidence)
        if v is None or n < cfg.min_requests:
            continue
        out.append((w, v, ci))
    return out


def stability(windows: list[Window], cfg: DriftConfig | None = None) -> dict[str, dict[str, Any]]:
    """The method's stability verdict per metric: ``spread = (max - min) / median`` over all full
    windows, ``stable = spread <= threshold``.

    Partial windows (the one closed at shutdown) and windows with fewer than ``min_requests``
    samples of the metric are left out (``excluded`` counts them). ``error_rate`` uses the
    absolute spread ``max - min`` (its median is often 0). ``stable`` is None with fewer than 2
    windows.

    Sampling noise alone widens the spread (the range of 24 windows is about 4 standard errors),
    so each entry also gives ``spread_lower``: ``(max lo - min hi) / median`` over the windows'
    intervals, and ``significant`` = ``spread_lower > threshold``: some window's interval lies
    more than the threshold beyond another's. Unstable but not significant means the windows had
    too few samples to resolve the threshold.
    """
    cfg = cfg or DriftConfig()
    out: dict[str, dict[str, Any]] = {}
    for metric in cfg.metrics:
        spec = METRICS[metric]
        thr = cfg.threshold_for(metric)
        rows = _eligible(windows, metric, cfg)
        entry: dict[str, Any] = {
            "spread": None,
            "stable": None,
            "min": None,
            "max": None,
            "median": None,
            "windows": len(rows),
            "excluded": len(windows) - len(rows),
            "threshold": thr,
            "absolute": spec.absolute,
            "spread_lower": None,
            "significant": None,
        }
        out[metric] = entry
        if not rows:
            continue
        vals = [v for _, v, _ in rows]
        lo_, hi_, med = min(vals), max(vals), statistics.median(vals)
        entry.update(min=lo_, max=hi_, median=med)
        if len(rows) < 2:
            continue
        if spec.absolute:
            spread = hi_ - lo_
        elif med > 0:
            spread = (hi_ - lo_) / med
        else:
            continue
        entry["spread"] = spread
        entry["stable"] = spread <= thr
        cis = [ci for _, _, ci in rows if ci is not None]
        if len(cis) == len(rows):
            gap = max(c[0] for c in cis) - min(c[1] for c in cis)
            lower = max(0.0, gap if spec.absolute else gap / med)
            entry["spread_lower"] = lower
            entry["significant"] = lower > thr
    return out


def recurring_drops(
    windows: list[Window], metric: str, cfg: DriftConfig | None = None
) -> dict[str, Any] | None:
    """Dips that recur at a near-constant period, or None.

    Rule: among full windows with enough samples (as in ``stability``), a *dip* is a window worse
    than the run's median by more than the metric's threshold (latency/error/energy higher,
    throughput lower) and, when the window has an interval, whose whole interval is beyond that
    line (so a noisy p95 does not make dips). Consecutive dip windows form one episode, starting
    at its first window. The pattern is periodic when there are at least 3 episodes, the median
    spacing ``P`` between episode starts is at least 2 windows, and every spacing is within
    ``max(1, 0.25 P)`` windows of ``P``; dips must also be a minority (at most half the windows),
    else it is a level shift, not drops. The period is reported in windows and in seconds (median
    ``start_unix`` spacing of the episodes, which includes quiesce pauses).
    """
    cfg = cfg or DriftConfig()
    spec = METRICS[metric]
    thr = cfg.threshold_for(metric)
    rows = _eligible(windows, metric, cfg)
    if len(rows) < 5:
        return None
    med = statistics.median(v for _, v, _ in rows)
    if spec.absolute:
        line = med + thr
    else:
        if med <= 0:
            return None
        line = med * (1 + thr) if spec.higher_is_worse else med * (1 - thr)

    def is_dip(v: float, ci: CI | None) -> bool:
        if spec.higher_is_worse:
            return v > line and (ci is None or ci[0] > line)
        return v < line and (ci is None or ci[1] < line)

    dips = [(w, v) for w, v, ci in rows if is_dip(v, ci)]
    if len(dips) > len(rows) / 2:
        return None
    episodes: list[list[tuple[Window, float]]] = []
    for w, v in dips:
        if episodes and w.window - episodes[-1][-1][0].window == 1:
            episodes[-1].append((w, v))
        else:
            episodes.append([(w, v)])
    if len(episodes) < 3:
        return None
    starts = [e[0][0].window for e in episodes]
    spacings = [b - a for a, b in zip(starts, starts[1:])]
    period = statistics.median(spacings)
    if period < 2 or any(abs(s - period) > max(1.0, 0.25 * period) for s in spacings):
        return None
    times = [e[0][0].start_unix for e in episodes]
    if all(t is not None for t in times):
        period_s = statistics.median(b - a for a, b in zip(times, times[1:]))
    else:
        durs = [w.duration_seconds for w, _, _ in rows]
        period_s = period * statistics.median(durs)
    depths = [abs(v / med - 1.0) if not spec.absolute else abs(v - med) for w, v in dips]
    return {
        "metric": metric,
        "dip_windows": [w.window for w, _ in dips],
        "episode_starts": starts,
        "period_windows": period,
        "period_seconds": period_s,
        "median": med,
        "depth": statistics.median(depths),
        "threshold": thr,
        "hint": "periodic drops point at cooling, power management or scheduling",
    }

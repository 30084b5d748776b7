"""The run-level drift statistics (``soakd.analysis.levels`` and ``soakd.analysis.changes``) on
synthetic level series: the noise floor's estimate, the live rule's family-wise z and tiers, and the
end-of-run segments, trends and the choice between them."""

from __future__ import annotations

import math
import random

import pytest

from soakd.analysis.changes import _tier, compare_levels, judge_run, live_z
from soakd.analysis.levels import Level, between_variance
from soakd.config.analysis import DriftConfig
from soakd.core.summary import WindowSummary


def series(ys: list[float], var: float = 1e-4) -> list[Level]:
    return [Level(i, y, var, math.exp(y), 3000, 1.7e9 + 1800 * i) for i, y in enumerate(ys)]


def test_the_noise_floor_is_unbiased_and_a_step_does_not_inflate_it() -> None:
    rng = random.Random(1)
    tau, within = 0.03, 1e-4
    est = [between_variance(series([rng.gauss(0, math.sqrt(tau**2 + within)) for _ in range(24)], within))[0]
           for _ in range(2000)]
    assert sum(est) / len(est) == pytest.approx(tau**2, rel=0.08)  # winsorised, and corrected for it
    ys = [rng.gauss(0, 0.01) for _ in range(24)]
    stepped = [y + (0.10 if i >= 12 else 0.0) for i, y in enumerate(ys)]
    assert between_variance(series(stepped))[0] < 0.2 * 0.10**2  # the step's one difference is winsorised away


def test_live_z_is_bonferroni_over_the_run() -> None:
    cfg = DriftConfig()
    # two-sided 0.05 over 11 metrics (the p99s of e2e and TTFT tracked by default, the error rate judged by
    # the error policy instead: issue 21) x 24 windows x 2; the server's own means (judged only where soakd lagged,
    # standing in for its latencies there) are not counted
    assert len(cfg.metrics) == 13 and cfg.family == 11
    assert live_z(cfg, 24) == pytest.approx(3.904, abs=0.005)
    assert live_z(cfg, 48) > live_z(cfg, 24)


def test_tiers() -> None:
    thr = 0.05
    assert _tier("e2e_p50", math.log(1.10), 0.02, thr) == ("confident", 1)
    assert _tier("e2e_p50", math.log(1.06), 0.03, thr) == ("likely", 1)  # beyond 5%, interval reaches inside
    assert _tier("e2e_p50", math.log(1.04), 0.01, thr) == (None, 0)  # significant, but within the threshold
    assert _tier("requests_per_second", math.log(0.85), 0.02, thr) == ("confident", -1)
    r = compare_levels("e2e_p50", series([math.log(1.2)])[0], series([0.0, 0.0, 0.0, 0.0]), 0.0, 3.7, DriftConfig())
    assert r.status == "drift" and r.direction == "degraded" and r.tier == "confident"
    assert r.ratio == pytest.approx(0.2) and r.ratio_ci[0] > 0.05


def _windows(levels: list[float], n: int = 3000) -> list[WindowSummary]:
    """Window summaries whose e2e p50 is exp(level) with a tight interval."""
    out = []
    for i, y in enumerate(levels):
        v = math.exp(y)
        out.append(WindowSummary.load({
            "window": i, "start_unix": 1.7e9 + 1800 * i, "duration_seconds": 1800.0, "requests": n,
            "outcomes": {"ok": n}, "e2e_seconds": {"p50": v, "count": n, "p50_ci": [v * 0.99, v * 1.01]},
        }))  # fmt: skip
    return out


def test_a_step_is_located_and_a_creep_is_a_trend_not_steps() -> None:
    rng = random.Random(2)
    cfg = DriftConfig(metrics=["e2e_p50"])
    step = _windows([rng.gauss(0, 0.005) + (math.log(1.09) if i >= 12 else 0.0) for i in range(24)])
    rd = judge_run(step, [0, 1, 2, 3], cfg)
    (c,) = rd.changes
    assert c.window == 12 and c.tier == "confident" and c.ratio == pytest.approx(0.09, abs=0.01) and not rd.trends
    assert "e2e_p50 stepped +8." in c.message() and "from window 12" in c.message()
    creep = _windows([rng.gauss(0, 0.005) + 0.004 * i for i in range(24)])
    rd = judge_run(creep, [0, 1, 2, 3], cfg)
    (t,) = rd.trends
    assert t.direction == "degraded" and t.total_ratio == pytest.approx(math.expm1(0.004 * 23), abs=0.02)
    assert rd.changes == []  # one explanation: the line
    flat = _windows([rng.gauss(0, 0.005) for _ in range(24)])
    rd = judge_run(flat, [0, 1, 2, 3], cfg)
    assert rd.changes == [] and rd.trends == []


def _step_windows(n: int = 12, at: int = 6, scale: float = 1.3, no_energy: int | None = None) -> list[WindowSummary]:
    from helpers.windows import make_window

    rng = random.Random(5)
    out = []
    for i in range(n):
        w = make_window(i, rng, 3000, scale=scale if i >= at else 1.0,
                        device={"energy_per_output_token_joules": 2.0 * (scale if i >= at else 1.0)})
        if i == no_energy:
            w.device.energy_per_output_token_joules = None
        out.append(w)
    return out


def test_a_span_finding_names_every_metric_that_moved_and_survives_a_metric_without_the_spans_first_window() -> None:
    """One finding per span; a metric with no level at the span's first window (its own change starts a
    window later) is named in the same finding, not in a second one (and never a KeyError)."""
    from soakd.analysis.changes import Change
    from soakd.analysis.drift_watch import DriftDetector
    from soakd.analysis.changes import RunDrift
    from soakd.config import AnalysisConfig

    cfg = AnalysisConfig()
    windows = _step_windows(no_energy=6)
    det = DriftDetector(cfg, z_live=3.9)
    for w in windows[:4]:
        det.pool.append(w)

    def change(metric: str, a: int, b: int) -> Change:
        return Change(metric=metric, window=a, end_window=b, start_unix=None, ratio=0.3, ci=(0.2, 0.4),
                      tier="confident", direction="degraded", windows=b - a + 1, threshold=0.05)

    # e2e_p50's change point from window 6, ttft_p50's from 7 (overlapping): one span, 6..11
    rd = RunDrift(changes=[change("e2e_p50", 6, 11), change("ttft_p50", 7, 11)])
    (f,) = det._span_findings(rd, windows, [0, 1, 2, 3])
    assert (f.window, f.last_window, f.severity) == (6, 11, "critical")
    assert len(f.metrics) == len(set(f.metrics)) and {"e2e_p50", "ttft_p50"} <= set(f.metrics)
    # the span tested for the other metrics (the windows' arrivals are open loop: only latency and energy
    # moved): energy has no level in window 6, and is named all the same
    assert {"e2e_p95", "itl_p50", "energy_per_token"} <= set(f.metrics), f.metrics
    assert "requests_per_second" not in f.metrics
    energy = next(c for c in f.evidence["changes"] if c["metric"] == "energy_per_token")
    assert energy["window"] == 7  # its own first level in the span


def test_a_span_opened_by_an_improvement_never_fails_the_run() -> None:
    from soakd.analysis.changes import Change, RunDrift
    from soakd.analysis.drift_watch import DriftDetector
    from soakd.config import AnalysisConfig

    windows = _step_windows()  # everything got slower from window 6
    det = DriftDetector(AnalysisConfig(), z_live=3.9)
    det.pool.extend(windows[:4])
    better = Change(metric="requests_per_second", window=6, end_window=11, start_unix=None, ratio=0.3,
                    ci=(0.2, 0.4), tier="confident", direction="improved", windows=6, threshold=0.05)
    (f,) = det._span_findings(RunDrift(changes=[better]), windows, [0, 1, 2, 3])
    assert f.severity == "info"  # what the span test adds is named, it fails no run by itself
    assert any(c["direction"] == "degraded" for c in f.evidence["changes"])

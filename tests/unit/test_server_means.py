"""The server's own TTFT and inter-token means (its histograms' sums over their counts) as tracked metrics: their
standard error over the window's scrape intervals, their interval, and their judgement only in the windows where
soakd lagged ('client lagging': soakd short of CPU, its own latencies carry its queueing and can hide a server's
step: at a half-core quota and ~29,000 tokens/s the server's ITL mean went +10% while soakd's e2e p50 moved +2%).
Windows from the analysis tests' builder through the real analysis engine."""

from __future__ import annotations

import math
import random

import pytest

from helpers.windows import make_window
from soakd.analysis.drift import metric_value
from soakd.analysis.engine import Analyzer
from soakd.analysis.levels import level
from soakd.analysis.telemetry import TelemetryStats
from soakd.config import AnalysisConfig
from soakd.config.analysis import DriftConfig
from soakd.core.series import Series
from soakd.core.summary import ClientSummary


def _scrapes(stats: TelemetryStats, per_interval: list[tuple[float, float]], t0: float = 0.0,
             start: tuple[float, float] = (100.0, 1000.0)) -> None:
    """Cumulative TTFT sum and count scrapes, one a second, increasing by ``per_interval``'s (seconds, requests)."""
    s, c = start
    stats.add([Series("soakd_server_ttft_seconds_total", s), Series("soakd_server_ttft_requests_total", c)], t0)
    for i, (ds, dc) in enumerate(per_interval, 1):
        s, c = s + ds, c + dc
        stats.add([Series("soakd_server_ttft_seconds_total", s), Series("soakd_server_ttft_requests_total", c)],
                  t0 + i)


def test_the_server_mean_has_the_ratio_estimators_standard_error_over_the_scrape_intervals() -> None:
    intervals = [(2.0, 100.0), (2.6, 100.0), (1.8, 90.0), (2.2, 110.0), (2.4, 100.0)]
    stats = TelemetryStats()
    _scrapes(stats, intervals)
    server = stats.server()
    total_s, total_c = sum(s for s, _ in intervals), sum(c for _, c in intervals)
    r = total_s / total_c
    assert server.ttft_mean_seconds == pytest.approx(r)
    k = len(intervals)
    se = math.sqrt(k / (k - 1) * sum((s - r * c) ** 2 for s, c in intervals)) / total_c
    assert server.ttft_mean_rel_se == pytest.approx(se / r)
    assert server.ttft_mean_intervals == k
    assert server.itl_mean_rel_se is None and server.itl_mean_intervals is None  # no ITL histogram scraped


def test_no_standard_error_from_one_interval_nor_across_a_restart() -> None:
    stats = TelemetryStats()
    _scrapes(stats, [(2.0, 100.0)])  # one interval: a mean, no spread
    server = stats.server()
    assert server.ttft_mean_seconds == pytest.approx(0.02) and server.ttft_mean_rel_se is None
    assert server.ttft_mean_intervals == 1
    stats = TelemetryStats()
    _scrapes(stats, [(2.0, 100.0), (2.2, 100.0), (1.9, 100.0)])  # three: a standard error, kept with its count
    server = stats.server()
    assert server.ttft_mean_rel_se is not None and server.ttft_mean_rel_se > 0 and server.ttft_mean_intervals == 3
    stats = TelemetryStats()
    _scrapes(stats, [(2.0, 100.0), (2.0, 100.0), (-50.0, -900.0), (2.0, 100.0), (2.0, 100.0), (2.0, 100.0)])
    server = stats.server()
    assert server.ttft_mean_seconds is None and server.ttft_mean_rel_se is None and server.ttft_mean_intervals is None


def test_a_level_needs_a_standard_error_over_four_intervals_and_the_mean_shows_without_one() -> None:
    """Fewer than SERVER_MEAN_MIN_INTERVALS scrape intervals: the mean is the window's value (soakd_window_value,
    the report's series) with no interval, so no level, never judged; a report written before the count was kept
    (a standard error, no count) is judged as it was."""
    base = {"ttft_mean_seconds": 0.02, "itl_mean_seconds": 0.004, "itl_mean_rel_se": None}
    for extra, judged in (({"ttft_mean_rel_se": 0.01, "ttft_mean_intervals": 3}, False),
                          ({"ttft_mean_rel_se": 0.01, "ttft_mean_intervals": 4}, True),
                          ({"ttft_mean_rel_se": 0.01}, True),
                          ({"ttft_mean_intervals": 6}, False)):
        w = make_window(0, random.Random(1), 500, server={**base, **extra})
        v, ci, _n = metric_value(w, "server_ttft_mean")
        assert v == 0.02 and (ci is not None) == judged, extra
        assert (level(w, "server_ttft_mean", DriftConfig()) is not None) == judged, extra


def test_the_metrics_interval_is_symmetric_on_the_log_scale_and_the_windows_own() -> None:
    w = make_window(0, random.Random(1), 500, server={"ttft_mean_seconds": 0.02, "itl_mean_seconds": 0.004,
                                                     "ttft_mean_rel_se": 0.01, "itl_mean_rel_se": None})
    v, ci, n = metric_value(w, "server_ttft_mean")
    assert v == 0.02 and n == w.requests
    assert ci is not None and ci[0] * ci[1] == pytest.approx(v * v)
    assert math.log(ci[1] / v) == pytest.approx(1.959964 * 0.01, rel=1e-5)
    assert metric_value(w, "server_itl_mean")[:2] == (0.004, None)  # no standard error: shown, no level
    assert metric_value(w, "server_ttft_mean", scenario="short_chat")[:2] == (None, None)


def _run(step: float, lag: dict[int, float] | float, n: int = 10, noise: float = 0.004,
         pages: list[int] | None = None, cfg: AnalysisConfig | None = None) -> tuple[Analyzer, object]:
    """soakd's own latencies flat; the server's own ITL mean x ``step`` from window 5 (the TTFT mean flat), both
    with ``noise`` between windows and that relative standard error; soakd's loop lag p99 per window."""
    rng = random.Random(11)
    analyzer = Analyzer(cfg or AnalysisConfig(), planned_windows=n)
    for i in range(n):
        k = step if i >= 5 else 1.0
        w = make_window(i, rng, 1000, server={
            "ttft_mean_seconds": 0.022 * math.exp(rng.gauss(0, noise)), "ttft_mean_rel_se": noise,
            "itl_mean_seconds": 0.004 * k * math.exp(rng.gauss(0, noise)), "itl_mean_rel_se": noise})
        p99 = lag.get(i, 0.002) if isinstance(lag, dict) else lag
        w.client = ClientSummary(heartbeats=6000, loop_lag_p50_seconds=0.001, loop_lag_p99_seconds=p99,
                                 loop_lag_max_seconds=p99 + 0.01, cpu_share=0.5)
        analyzer.add_window(w)
        if pages is not None and analyzer.states()["drift"].active.get("server_itl_mean"):
            pages.append(i)
    return analyzer, analyzer.verdict()


def test_a_step_of_the_servers_own_itl_fails_and_pages_where_soakd_lagged() -> None:
    pages: list[int] = []
    analyzer, verdict = _run(1.10, 0.06, pages=pages)
    assert verdict.result == "FAIL"
    failing = [f for f in verdict.failing if "server_itl_mean" in f.metrics]
    assert failing and min(f.window for f in failing) == 5
    assert "server_itl_mean +" in failing[0].message
    assert failing[0].evidence["drift"][0]["ratio"] == pytest.approx(0.10, abs=0.02)
    assert failing[0].why.endswith(": the server's inter-token mean (its histograms), judged where soakd lagged "
                                   "(client lagging)")
    assert pages and pages[0] == 5
    assert not any("server_ttft_mean" in f.metrics for f in verdict.failing)


def test_the_servers_own_means_are_shown_not_judged_where_soakd_was_punctual() -> None:
    pages: list[int] = []
    analyzer, verdict = _run(1.10, 0.002, pages=pages)
    assert verdict.result == "PASS" and pages == []
    r = analyzer.states()["drift"].drift[("server_itl_mean", "baseline")]
    assert r.ratio == pytest.approx(0.10, abs=0.02) and not r.flagged  # shown on /metrics, not paged
    # soakd lagged before the step only: the step's windows are judged on soakd's own latencies (flat here)
    analyzer, verdict = _run(1.10, {1: 0.06, 2: 0.06})
    assert verdict.result == "PASS"


def test_no_false_alarm_from_a_calm_server_while_soakd_lags() -> None:
    for seed_step in (1.0, 1.02):
        _, verdict = _run(seed_step, 0.06)
        assert verdict.result == "PASS", verdict.reasons
    # the timing bound off: soakd's lag is never 'lagging', the server's means never judged
    cfg = AnalysisConfig.model_validate({"client": {"timing_lag_p99": None}})
    _, verdict = _run(1.10, 0.06, cfg=cfg)
    assert verdict.result == "PASS"

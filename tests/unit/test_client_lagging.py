"""'client lagging': a judged window in which soakd's own loop lagged beyond analysis.client.timing_lag_p99 at
its p99 (soakd short of CPU all window long: no single stall impairs a request) is said as an info finding that
names the lag and the server's own TTFT beside soakd's; it never fails the run nor leaves a window unjudged.
Windows from the analysis tests' builder through the real analysis engine."""

from __future__ import annotations

import random

from helpers.windows import make_window
from soakd.analysis.engine import Analyzer
from soakd.config import AnalysisConfig
from soakd.core.summary import ClientSummary


def _run(lag_p99: dict[int, float], cfg: AnalysisConfig | None = None, n: int = 8,
         impaired: frozenset[int] = frozenset()) -> tuple[Analyzer, list]:
    rng = random.Random(5)
    analyzer = Analyzer(cfg or AnalysisConfig(), planned_windows=n)
    for i in range(n):
        w = make_window(i, rng, 1000, server={"ttft_mean_seconds": 0.0219, "itl_mean_seconds": 0.004})
        if i in lag_p99:
            w.client = ClientSummary(heartbeats=6000, loop_lag_p50_seconds=0.004, loop_lag_p99_seconds=lag_p99[i],
                                     loop_lag_max_seconds=lag_p99[i] + 0.015, cpu_share=0.5,
                                     impaired=i in impaired, impaired_reason="x" if i in impaired else None)
        analyzer.add_window(w)
    return analyzer, analyzer.verdict()


def _lagging(analyzer: Analyzer) -> list:
    return [f for f in analyzer.findings if f.diagnosis == "client lagging"]


def test_a_window_soakd_lagged_through_is_said_with_its_lag_and_the_servers_own_ttft() -> None:
    analyzer, verdict = _run({3: 0.064, 4: 0.021, 5: 0.019})
    found = _lagging(analyzer)
    assert [f.window for f in found] == [3, 4]  # 19 ms is under the 20-ms default
    f = found[0]
    assert f.kind == "client" and f.severity == "info" and not f.fails
    assert "lagged 64 ms at p99 (longest 79 ms), soakd using 0.50 of a core" in f.message
    assert "the server's own 21.9 ms" in f.message and "ITL mean" in f.message
    assert f.evidence["server_ttft_mean_seconds"] == 0.0219
    assert verdict.result == "PASS"  # judged: an info finding, no window left out
    assert not verdict.inconclusive


def test_no_finding_for_a_punctual_loop_an_impaired_window_or_with_the_rule_off() -> None:
    analyzer, _ = _run({2: 0.002, 3: 0.005})
    assert _lagging(analyzer) == []
    analyzer, _ = _run({3: 0.3}, impaired=frozenset({3}))  # the window is client-impaired: said as that
    assert _lagging(analyzer) == []
    assert [f.window for f in analyzer.findings if f.diagnosis == "client-impaired"] == [3]
    cfg = AnalysisConfig.model_validate({"client": {"timing_lag_p99": None}})
    analyzer, _ = _run({3: 0.064}, cfg)
    assert _lagging(analyzer) == []
    cfg = AnalysisConfig.model_validate({"client": {"timing_lag_p99": "50ms"}})
    analyzer, _ = _run({3: 0.064, 4: 0.04}, cfg)
    assert [f.window for f in _lagging(analyzer)] == [3]


def _stepped(lag: float, server_step: float, n: int = 10, cfg: AnalysisConfig | None = None,
             pages: list[int] | None = None) -> tuple[Analyzer, list]:
    """soakd's latencies +20% from window 5 on; the server's own TTFT and ITL means x ``server_step`` from there;
    ``pages``: the windows after which the live page (soakd_drift_detected) was up for a metric."""
    rng = random.Random(7)
    analyzer = Analyzer(cfg or AnalysisConfig(), planned_windows=n)
    for i in range(n):
        k = server_step if i >= 5 else 1.0
        w = make_window(i, rng, 1000, scale=1.2 if i >= 5 else 1.0,
                        server={"ttft_mean_seconds": 0.0219 * k, "itl_mean_seconds": 0.004 * k})
        w.client = ClientSummary(heartbeats=6000, loop_lag_p50_seconds=0.001, loop_lag_p99_seconds=lag,
                                 loop_lag_max_seconds=lag + 0.01, cpu_share=0.5)
        analyzer.add_window(w)
        if pages is not None and any(analyzer.states()["drift"].active.values()):
            pages.append(i)
    return analyzer, analyzer.verdict()


def test_a_latency_drift_soakds_own_lag_explains_is_reported_not_failing_nor_paged() -> None:
    pages: list[int] = []
    analyzer, verdict = _stepped(0.06, 1.01, pages=pages)  # soakd lagged; the server's own means moved +1%
    assert pages == []
    drift = [f for f in analyzer.findings if f.kind == "drift" and f.severity != "info"]
    assert drift, [f.message for f in analyzer.findings]
    assert not any(f.fails for f in drift)
    assert all("soakd's own delay, not the server's" in (f.why or "") for f in drift), [f.why for f in drift]
    assert "the server's own TTFT mean +1.0% and ITL mean +1.0%" in (drift[0].why or "")
    assert verdict.result == "PASS", verdict.reasons


def test_the_same_drift_fails_and_pages_when_the_server_moved_too_or_soakd_was_punctual_or_the_rule_is_off() -> None:
    pages: list[int] = []
    _, verdict = _stepped(0.06, 1.2, pages=pages)  # the server's own histograms moved +20%: the server's drift
    assert verdict.result == "FAIL" and pages and min(pages) >= 5
    pages = []
    _, verdict = _stepped(0.005, 1.01, pages=pages)  # soakd punctual: its numbers stand
    assert verdict.result == "FAIL" and pages and min(pages) >= 5
    _, verdict = _stepped(0.06, 1.01, cfg=AnalysisConfig.model_validate({"client": {"timing_lag_p99": None}}))
    assert verdict.result == "FAIL"

"""KV cache saturated and stuck (soakd.analysis.kvsat) on injected time: server scrapes into a window's
``server.kv_saturated`` (soakd.analysis.telemetry), the window rule, and the analyzer's one finding per
fault. Stuck: usage pinned at or above 0.98 with requests running and (almost) no tokens for the span.
Not stuck: a busy healthy server at 95-99% that keeps generating, an idle server, a short burst, a restart."""

from __future__ import annotations

from collections.abc import Iterable

from soakd.analysis.engine import Analyzer
from soakd.analysis.kvsat import kv_saturated_finding
from soakd.analysis.telemetry import TelemetryStats
from soakd.config import AnalysisConfig
from soakd.config.analysis import KvSaturationConfig
from soakd.core.series import series
from soakd.core.summary import Quantiles, WindowSummary

CFG = KvSaturationConfig(min_seconds=30.0)


def scrape(kv: float, running: float, tokens: float | None, waiting: float = 0.0) -> list:
    out = [series("soakd_server_kv_cache_usage_ratio", kv), series("soakd_server_requests_running", running),
           series("soakd_server_requests_waiting", waiting)]
    if tokens is not None:
        out.append(series("soakd_server_generation_tokens_total", tokens))
    return out


def window(samples: Iterable[tuple[float, list]], index: int = 5, start: float = 0.0, duration: float = 120.0,
           e2e_p99: float = 2.0, output_tps: float = 1000.0) -> WindowSummary:
    tel = TelemetryStats(CFG.ratio)
    for t, snap in samples:
        tel.add(snap, t)
    return WindowSummary(window=index, start_unix=1000.0 + index * duration, duration_seconds=duration,
                         server=tel.server(start), e2e_seconds=Quantiles(p99=e2e_p99),
                         output_tokens_per_second=output_tps)


def healthy(index: int = 1, kv: float = 0.7) -> WindowSummary:
    """A baseline: 16 running, 1,000 tokens/s by the server's counter, a scrape every 5 s."""
    return window(((t, scrape(kv, 16, 1000.0 * t)) for t in range(0, 121, 5)), index=index)


def stuck(from_t: float = 30.0, to_t: float = 120.0, creep: float = 0.0, kv: float = 1.0) -> WindowSummary:
    """Healthy until ``from_t``, then pinned at ``kv`` with 16 running and 4 waiting, ``creep`` tokens/s."""
    def snap(t: float) -> list:
        if t < from_t or t > to_t:
            return scrape(0.7, 16, 1000.0 * t)
        return scrape(kv, 16, 1000.0 * from_t + creep * (t - from_t), waiting=4)
    return window((t, snap(t)) for t in range(0, 121, 5))


def test_pinned_full_with_requests_running_and_no_tokens_is_kv_cache_saturated() -> None:
    w = stuck()
    sat = w.server.kv_saturated
    assert sat is not None and sat.longest_seconds == 90.0 and sat.longest_tokens == 0.0
    assert sat.longest_start_offset_seconds == 30.0 and sat.requests_waiting_max == 4
    f = kv_saturated_finding(w, healthy(), CFG)
    assert f is not None and f.kind == "freeze" and f.diagnosis == "KV cache saturated" and f.severity == "critical"
    ev = f.evidence
    assert ev["saturated_seconds"] == 90.0 and ev["tokens_per_second"] == 0.0 and ev["source"] == "server_tokens"
    assert ev["reference_tokens_per_second"] == 1000.0 and ev["kv_cache_usage_min"] == 1.0
    assert ev["requests_running_max"] == 16 and ev["requests_waiting_max"] == 4
    assert "pinned at >= 100.0% for 90.0 s" in f.message and "4 waiting" in f.message
    # no baseline yet: not a single token over the span is still stuck
    assert kv_saturated_finding(w, None, CFG) is not None


def test_preemption_thrash_that_still_makes_a_token_now_and_then_is_stuck() -> None:
    """The counter is never flat (the live wedge watch cannot see it), but 3 tokens/s is 0.3% of 1,000."""
    f = kv_saturated_finding(stuck(creep=3.0), healthy(), CFG)
    assert f is not None and abs(f.evidence["tokens_per_second"] - 3.0) < 1e-9
    # without a baseline rate only a still counter counts
    assert kv_saturated_finding(stuck(creep=3.0), None, CFG) is None


def test_a_busy_healthy_server_near_full_that_keeps_generating_is_not_stuck() -> None:
    # 95-99% used, 16 running, tokens at the baseline's rate: vLLM runs near full by design
    for kv in (0.95, 0.98, 0.99, 1.0):
        w = window((t, scrape(kv, 16, 1000.0 * t)) for t in range(0, 121, 5))
        assert kv_saturated_finding(w, healthy(), CFG) is None, kv
    # 0.95-0.97: not even pinned
    assert healthy(kv=0.97).server.kv_saturated is None
    # half the baseline's rate while pinned: slow, not stuck (drift judges slow)
    w = window((t, scrape(0.99, 16, 500.0 * t)) for t in range(0, 121, 5))
    assert kv_saturated_finding(w, healthy(), CFG) is None


def test_an_idle_server_a_short_burst_and_a_restart_are_not_stuck() -> None:
    # idle: usage high (e.g. a prefix cache holding blocks) but nothing running
    idle = window((t, scrape(0.99, 0, 5000.0)) for t in range(0, 121, 5))
    assert idle.server.kv_saturated is None and kv_saturated_finding(idle, healthy(), CFG) is None
    # stuck for 25 s: below min_seconds (30 s)
    assert kv_saturated_finding(stuck(from_t=30, to_t=55), healthy(), CFG) is None
    # ... and below 3x the baseline's e2e p99 (here 20 s: 60 s needed) even when past min_seconds
    slow_ref = healthy()
    slow_ref.e2e_seconds = Quantiles(p99=20.0)
    assert kv_saturated_finding(stuck(from_t=30, to_t=75), slow_ref, CFG) is None
    assert kv_saturated_finding(stuck(from_t=30, to_t=95), slow_ref, CFG) is not None
    # a restart (the counter went down) breaks the span: 40 s and 50 s, not 95 s
    snaps = [(t, scrape(1.0, 16, 50.0 if t < 70 else 0.0)) for t in range(25, 121, 5)]
    w = window(snaps)
    assert w.server.kv_saturated is not None and w.server.kv_saturated.longest_seconds == 50.0
    assert w.server.kv_saturated.seconds == 90.0
    # scrapes that failed for longer than a minute: the gap is not judged
    w = window([(0, scrape(1.0, 16, 0.0)), (10, scrape(1.0, 16, 0.0)), (100, scrape(1.0, 16, 0.0))])
    assert w.server.kv_saturated is not None and w.server.kv_saturated.longest_seconds == 10.0


def test_a_server_without_a_token_counter_is_judged_on_soakds_own_output() -> None:
    pinned = window(((t, scrape(1.0, 16, None)) for t in range(0, 121, 5)), output_tps=2.0)
    ref = window(((t, scrape(0.5, 16, None)) for t in range(0, 121, 5)), index=1, output_tps=1000.0)
    f = kv_saturated_finding(pinned, ref, CFG)
    assert f is not None and f.evidence["source"] == "client_tokens" and f.evidence["saturated_share"] == 1.0
    flowing = window(((t, scrape(1.0, 16, None)) for t in range(0, 121, 5)), output_tps=900.0)
    assert kv_saturated_finding(flowing, ref, CFG) is None


def test_the_window_rate_of_the_servers_counter() -> None:
    assert healthy().server.generation_tokens_per_second == 1000.0
    assert window((t, scrape(0.5, 1, None)) for t in range(0, 60, 5)).server.generation_tokens_per_second is None


def test_the_analyzer_reports_it_once_and_not_again_where_a_live_episode_found_it() -> None:
    cfg = AnalysisConfig(kv_saturated={"min_seconds": 30.0})
    a = Analyzer(cfg, baseline=healthy())
    findings = a.add_window(stuck())
    assert [f.diagnosis for f in findings if f.kind == "freeze"] == ["KV cache saturated"]
    assert a.freeze.kv_saturated_window and any(r.startswith("freeze: KV cache saturated") for r in a.failing)
    a.add_window(healthy(index=6))
    assert not a.freeze.kv_saturated_window
    # a live episode (wedge watch) overlapping the window: that fault has its finding already
    b = Analyzer(cfg, baseline=healthy())
    w = stuck()
    b.freeze.live_episodes.append([w.start_unix + 40.0, None])
    assert not [f for f in b.add_window(w) if f.diagnosis == "KV cache saturated"]
    c = Analyzer(cfg, baseline=healthy())
    c.freeze.live_episodes.append([w.start_unix - 500.0, w.start_unix - 400.0])  # long over
    assert [f for f in c.add_window(stuck()) if f.diagnosis == "KV cache saturated"]

"""SLOs and goodput: which request meets its scenario's SLO, the configuration, the window's
goodput and its place among the tracked metrics."""

from __future__ import annotations

import pytest

from soakd.analysis.drift import metric_value
from soakd.analysis.levels import level
from soakd.config import ConfigError, DriftConfig, load_config
from soakd.core.records import Outcome, RequestRecord
from soakd.core.summary import Goodput, WindowSummary
from soakd.core.timeline import ManualClock, Timeline
from soakd.core.tracked import DEFAULT_METRICS
from soakd.metrics import SoakMetrics
from soakd.soak.recorder import Recorder
from soakd.soak.windows import WindowSet

MS = 1_000_000


def record(ttft_ms: float, gaps_ms: list[float], *, stream: bool = True, ok: bool = True,
           scenario: str = "short_chat") -> RequestRecord:
    rec = RequestRecord(scenario, stream=stream)
    rec.t_start_ns = 1_000 * MS
    t = rec.t_start_ns + int(ttft_ms * MS)
    times = [t]
    for g in gaps_ms:
        t += int(g * MS)
        times.append(t)
    rec.token_times_ns = times if stream else []
    rec.t_end_ns = t + MS
    if not ok:
        rec.fail(Outcome.HTTP_ERROR, "http_500")
    return rec


def test_a_request_meets_every_bound_or_misses() -> None:
    rec = record(400, [40, 60])  # TTFT 400 ms, mean gap 50 ms, e2e 501 ms
    assert rec.meets(0.5, 0.05, 1.0)
    assert not rec.meets(0.3, None, None)  # TTFT beyond
    assert not rec.meets(None, 0.045, None)  # the mean gap (TPOT), not the largest one, is judged
    assert rec.meets(None, 0.055, None)
    assert not rec.meets(None, None, 0.5)  # e2e beyond
    assert rec.meets(None, None, None)
    assert not record(10, [10], ok=False).meets(1.0, 1.0, 10.0)  # a failed request never meets it


def test_a_non_streamed_request_has_its_body_as_first_token() -> None:
    rec = record(100, [100, 100], stream=False)  # e2e 301 ms, no stream events
    assert not rec.meets(0.2, None, None)  # its TTFT is its e2e
    assert rec.meets(0.4, 0.001, None)  # no inter-token gaps to judge


def test_config_adds_goodput_to_the_tracked_metrics() -> None:
    cfg = load_config(None, {"scenarios": {"short_chat": {"slo": {"ttft": "500ms", "itl": "50ms", "e2e": "10s"}}}},
                      environ={})
    slo = cfg.slos()["short_chat"]
    assert (slo.ttft, slo.itl, slo.e2e, slo.quantile) == (0.5, 0.05, 10.0, 0.95)
    assert cfg.analysis.drift.metrics == [*DEFAULT_METRICS, "goodput_ratio"]
    # no SLO: not tracked; an explicit metrics list is the user's
    assert "goodput_ratio" not in load_config(None, {}, environ={}).analysis.drift.metrics
    explicit = load_config(None, {"scenarios": {"short_chat": {"slo": {"ttft": "1s"}}},
                                  "analysis": {"drift": {"metrics": ["e2e_p95"]}}}, environ={})
    assert explicit.analysis.drift.metrics == ["e2e_p95"]
    # an SLO of a scenario outside the mix is not one of this run
    off = load_config(None, {"load": {"mix": {"long_context": 1}},
                             "scenarios": {"short_chat": {"slo": {"ttft": "1s"}}}}, environ={})
    assert off.slos() == {} and "goodput_ratio" not in off.analysis.drift.metrics


@pytest.mark.parametrize("slo, needle", [
    ({}, "at least one of ttft, itl, e2e"),
    ({"ttft": "fast"}, "scenarios.short_chat.slo.ttft"),
    ({"ttft": "1s", "quantile": 1.5}, "scenarios.short_chat.slo.quantile"),
    ({"ttft": "1s", "p95": "1s"}, "scenarios.short_chat.slo.p95"),
])
def test_bad_slo_is_a_clear_error(slo: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(None, {"scenarios": {"short_chat": {"slo": slo}}}, environ={})
    assert needle in str(exc.value)


def test_recorder_counts_goodput_into_metrics_and_windows() -> None:
    clock = ManualClock(0.0)
    windows = WindowSet(Timeline(0.0, 0.0, 10.0, 20.0), clock=clock)
    metrics = SoakMetrics(("short_chat", "long_context"), slo_objectives={"short_chat": 0.9})
    rec = Recorder(metrics, windows, clock, slos={"short_chat": (0.5, None, None)})
    for ttft in (100, 200, 300, 700):  # three meet a 500 ms TTFT bound
        r = record(ttft, [10])
        r.window = 0
        rec.started(r)
        rec.finished(r)
    failed = record(100, [10], ok=False)
    failed.window = 0
    rec.started(failed)
    rec.finished(failed)
    other = record(900, [10], scenario="long_context")  # no SLO: not counted
    other.window = 0
    rec.started(other)
    rec.finished(other)
    assert metrics.goodput.values == {("short_chat",): 3}
    assert other.slo_met is None and failed.slo_met is False
    clock.now = 10.0
    [w] = windows.close_due(10.0)
    assert w.goodput == Goodput(requests=5, met=3)
    assert w.scenarios["short_chat"].goodput == Goodput(requests=5, met=3)
    assert w.scenarios["long_context"].goodput is None
    value, ci, n = metric_value(w, "goodput_ratio")
    assert value == pytest.approx(0.6) and n == 5 and ci[0] < 0.6 < ci[1]


def test_goodput_is_an_absolute_level_and_absent_without_an_slo() -> None:
    w = WindowSummary(window=3, duration_seconds=60.0, requests=1000, goodput=Goodput(requests=1000, met=950))
    lv = level(w, "goodput_ratio", DriftConfig())
    assert lv is not None and lv.y == pytest.approx(0.95)  # a share, not its logarithm
    assert lv.var == pytest.approx(0.95 * 0.05 / 1000, rel=0.1)
    assert DriftConfig().threshold_for("goodput_ratio") == 0.02
    bare = WindowSummary(window=3, duration_seconds=60.0, requests=1000)
    assert metric_value(bare, "goodput_ratio") == (None, None, 0)
    assert "goodput" not in bare.dump()  # a run without SLOs keeps its documents as they were
    assert WindowSummary.load(w.dump()).goodput == Goodput(requests=1000, met=950)

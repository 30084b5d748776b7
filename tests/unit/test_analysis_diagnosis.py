"""Each diagnosis rule of the troubleshooting table, on synthetic windows."""

from __future__ import annotations

import random

import pytest

from soakd.analysis import drift, leak, throttle
from soakd.analysis.diagnosis import TROUBLESHOOTING, Finding, diagnose, performance_drift
from soakd.core.findings import DIAGNOSES
from soakd.config.analysis import DiagnosisConfig
from soakd.core.summary import WindowSummary
from helpers.windows import make_window
from test_analysis_throttle import device

MIB = 2**20


def _by(findings: list[Finding]) -> dict[str, Finding]:
    return {f.diagnosis: f for f in findings}


def test_latency_drift_with_thermal_throttling_is_throttling() -> None:
    rng = random.Random(1)
    base = make_window(0, rng, 3000, device=device({}, 1.95e9))
    hot = make_window(4, rng, 3000, scale=1.2, device=device({"hw_thermal": 0.5}, 1.6e9, temp=91.0))
    dr = drift.evaluate(hot, base, None)
    th = throttle.evaluate(hot, base, latency_drift=bool(performance_drift(dr)))
    f = _by(diagnose(hot, dr, th))
    t = f["throttling"]
    assert t.kind == "throttle" and t.severity == "critical" and t.window == 4
    assert "e2e_p95" in t.message and "hw_thermal" in t.message and "thermal" in t.message
    assert "91" in t.message
    assert {d["metric"] for d in t.evidence["drift"]} >= {"e2e_p50", "e2e_p95"}
    # the latency drift is explained: no separate unexplained-drift finding for those metrics
    assert "performance drift" not in f


def test_a_reason_without_impact_is_no_throttling_nor_a_clock_drop_with_latency_steady() -> None:
    """Issue 21: a clock below the baseline's with latency where it was is no throttling (it used to be a
    failing warning, 'throttling without measurable latency drift')."""
    rng = random.Random(2)
    base = make_window(0, rng, 2000, device=device({"sw_power_cap": 0.3}, 1.9e9))
    capped = make_window(1, rng, 2000, device=device({"sw_power_cap": 0.3}, 1.9e9))  # clock as at the baseline
    assert "throttling" not in _by(diagnose(capped, [], throttle.evaluate(capped, base)))
    (r,) = [t for t in throttle.evaluate(capped, base) if t.reason == "sw_power_cap"]
    assert r.active and not r.impact and not r.detected
    slower = make_window(2, rng, 2000, device=device({"sw_power_cap": 0.3}, 1.7e9))  # 10.5% below the baseline
    (r,) = [t for t in throttle.evaluate(slower, base) if t.reason == "sw_power_cap"]
    assert r.beyond_noise and not r.latency_moving and not r.detected
    assert "throttling" not in _by(diagnose(slower, [], throttle.evaluate(slower, base)))


def test_latency_drift_without_throttling_is_performance_drift() -> None:
    rng = random.Random(3)
    base = make_window(0, rng, 3000, device=device({}))
    w = make_window(1, rng, 3000, scale=1.25, device=device({}))
    f = _by(diagnose(w, drift.evaluate(w, base, None), throttle.evaluate(w, base)))
    assert "throttling" not in f
    assert f["performance drift"].kind == "drift" and "e2e_p50" in f["performance drift"].message


def test_growing_idle_kv_residue_is_kv_cache_not_released() -> None:
    probes = [(3600.0 * i, 0.02 + 0.015 * i) for i in range(8)]
    res = leak.kv_residue(probes)
    w = make_window(7, random.Random(4), 300)
    f = _by(diagnose(w, kv_residue_result=res))
    k = f["KV cache not released"]
    assert k.kind == "leak" and k.severity == "critical" and "idle KV residue" in k.message
    assert k.evidence["source"] == "kv_residue"
    # passed twice (also among the leak results): reported once
    assert len(diagnose(w, leak_results=[res], kv_residue_result=res)) == 1


def test_device_memory_growth_is_memory_leak() -> None:
    ws = [
        WindowSummary.load({"window": i, "start_unix": 1.7e9 + 1800 * i, "duration_seconds": 1800.0, "partial": False,
                            "device": {"memory_used_bytes": {"min": 30e9 + 100 * MIB * 0.5 * i}}})
        for i in range(14)  # 7 hours: the sustained part (from a third on) spans the 4 h min_span
    ]  # fmt: skip
    res = leak.evaluate(ws)
    f = _by(diagnose(make_window(13, random.Random(5), 300), leak_results=res))
    assert f["memory leak"].kind == "leak" and "device_memory" in f["memory leak"].message
    assert "KV cache not released" not in f


def test_device_memory_in_steps_at_flat_kv_is_memory_steps_not_a_leak() -> None:
    """Window floors that step up 512 MiB at windows 3, 6 and 9 and stay flat for 5 hours after, with the
    KV usage under load flat: a 'memory steps' warning (does not fail), no 'memory leak'."""
    ws = [
        WindowSummary.load({"window": i, "start_unix": 1.7e9 + 1800 * i, "duration_seconds": 1800.0, "partial": False,
                            "device": {"memory_used_bytes": {"min": 30e9 + 512 * MIB * min(3, i // 3)},
                                       "memory_total_bytes": 80e9},
                            "server": {"kv_cache_usage_ratio": {"mean": 0.3}}})
        for i in range(20)
    ]  # fmt: skip
    res = leak.evaluate(ws)
    f = _by(diagnose(make_window(19, random.Random(5), 300), leak_results=res))
    assert "memory leak" not in f and set(f) == {"memory steps"}
    s = f["memory steps"]
    assert s.kind == "leak" and s.severity == "warning" and s.evidence["fails"] is False
    assert s.evidence["source"] == "device_memory" and s.evidence["steps"] == 3 and s.evidence["kv_flat"] is True
    assert s.message.startswith("device_memory (20 windows): grew in 3 steps (+1536.0 MiB in total, last step at "
                                "window 9), KV usage flat")
    # the same floors climbing 100 MB/h between the steps too: a memory leak, and no 'memory steps'
    climbing = [w.model_copy(update={"device": w.device.model_copy(update={"memory_used_bytes": w.device.memory_used_bytes.model_copy(
        update={"min": w.device.memory_used_bytes.min + 100e6 * 0.5 * w.window})})}) for w in ws]  # fmt: skip
    f = _by(diagnose(make_window(19, random.Random(5), 300), leak_results=leak.evaluate(climbing)))
    assert set(f) == {"memory leak"} and f["memory leak"].severity == "critical"


def test_error_burst_with_target_down_is_target_restarted() -> None:
    rng = random.Random(6)
    w = make_window(3, rng, 1000, error_rate=0.05, error_outcome="connection_error", target_down_seconds=42.0)
    f = _by(diagnose(w))
    t = f["target restarted"]
    assert t.kind == "target" and t.severity == "critical"
    assert "42s" in t.message and "connection_error" in t.message
    # the same errors with the target up are server errors, not a restart
    w2 = make_window(4, rng, 1000, error_rate=0.05, error_outcome="connection_error")
    f2 = _by(diagnose(w2))
    assert "target restarted" not in f2 and f2["server errors"].kind == "errors"
    # explicit target_down_seconds overrides the window's
    assert "target restarted" in _by(diagnose(w2, target_down_seconds=5.0))


def test_timeouts_are_overload() -> None:
    rng = random.Random(7)
    w = make_window(2, rng, 1000, error_rate=0.08, error_outcome="timeout",
                    server={"requests_waiting": {"mean": 57.0, "max": 180.0}})  # fmt: skip
    o = _by(diagnose(w))["overload"]
    assert o.kind == "errors" and o.severity == "critical" and "queue mean 57.0" in o.message
    few = make_window(3, rng, 1000, error_rate=0.002, error_outcome="timeout")
    assert "overload" not in _by(diagnose(few))


def test_invalid_responses_are_garbled_output() -> None:
    rng = random.Random(8)
    w = make_window(1, rng, 1000, error_rate=0.003, error_outcome="invalid_response")
    g = _by(diagnose(w))["garbled output"]
    assert g.kind == "errors" and g.severity == "warning"
    w = make_window(1, rng, 1000, error_rate=0.05, error_outcome="invalid_response")
    assert _by(diagnose(w))["garbled output"].severity == "critical"


def test_long_context_rising_faster_than_short_chat_is_bandwidth_or_cache_pressure() -> None:
    rng = random.Random(9)
    mix = {"short_chat": {"n": 3000}, "long_context": {"n": 3000, "scale": 5.0}}
    base = make_window(0, rng, scenarios=mix)
    slow_long = {"short_chat": {"n": 3000, "scale": 1.02}, "long_context": {"n": 3000, "scale": 5.0 * 1.3}}
    w = make_window(1, rng, scenarios=slow_long)
    f = _by(diagnose(w, drift.evaluate(w, base, None), baseline=base))
    b = f["bandwidth or cache pressure"]
    assert b.kind == "drift" and "long_context" in b.message and "short_chat" in b.message
    assert any(c["metric"] == "e2e_p95" for c in b.evidence["comparisons"])
    # a uniform slow-down of both scenarios is not
    both = {"short_chat": {"n": 3000, "scale": 1.3}, "long_context": {"n": 3000, "scale": 5.0 * 1.3}}
    w2 = make_window(2, rng, scenarios=both)
    assert "bandwidth or cache pressure" not in _by(diagnose(w2, baseline=base))
    # no baseline, or scenario names that are not there: the rule stays silent
    assert "bandwidth or cache pressure" not in _by(diagnose(w))
    cfg = DiagnosisConfig(long_scenario="rag")
    assert "bandwidth or cache pressure" not in _by(diagnose(w, baseline=base, cfg=cfg))


def test_quiet_window_has_no_findings() -> None:
    rng = random.Random(10)
    base = make_window(0, rng, 2000, device=device({}))
    w = make_window(1, rng, 2000, device=device({}))
    assert diagnose(w, drift.evaluate(w, base, None), throttle.evaluate(w, base), baseline=base) == []


def test_table_and_finding_dict() -> None:
    for d in ("throttling", "KV cache not released", "target restarted", "bandwidth or cache pressure",
              "garbled output", "overload", "memory leak", "memory steps"):  # fmt: skip
        assert d in DIAGNOSES and all(TROUBLESHOOTING[d])
    f = Finding(kind="errors", diagnosis="overload", severity="warning", message="m", evidence={"a": 1}, window=1)
    assert f.to_dict()["evidence"] == {"a": 1}
    with pytest.raises((AttributeError, ValueError)):  # frozen
        f.kind = "drift"  # type: ignore[misc]
    with pytest.raises(ValueError, match="not registered"):
        Finding(kind="errors", diagnosis="no such diagnosis", severity="warning", message="m")
    with pytest.raises(ValueError, match="of kind 'errors'"):
        Finding(kind="drift", diagnosis="overload", severity="warning", message="m")


def test_throughput_and_error_drift_in_an_outage_window_is_the_restart() -> None:
    """A real vLLM stopped for 20 s of a window (tests/e2e/test_vllm.py): its tokens/s fell and its
    error rate rose against the baseline. That is the restart, said once — not also a
    'performance drift' of unknown cause, which would fail the verdict as drift."""
    rng = random.Random(61)
    base = make_window(0, rng, 2000)
    w = make_window(4, rng, 2000, error_rate=0.6, error_outcome="connection_error", target_down_seconds=17.0)
    dr = drift.evaluate(w, base, None)
    # the error rate is no drift metric (issue 21 item 6: errors are judged against their budgets)
    assert not any(r.metric == "error_rate" for r in dr)
    assert any(r.metric == "output_tokens_per_second" and r.status == "drift" for r in dr)
    f = _by(diagnose(w, dr))
    t = f["target restarted"]
    assert "from the outage" in t.message and "output_tokens_per_second" in t.message
    assert any(d["metric"] == "output_tokens_per_second" for d in t.evidence["drift"])
    assert "performance drift" not in f
    # latency drift in the same window is not the outage's: still reported
    slow = make_window(5, rng, 3000, scale=1.3, error_rate=0.6, error_outcome="connection_error",
                       target_down_seconds=17.0)  # fmt: skip
    f2 = _by(diagnose(slow, drift.evaluate(slow, make_window(0, rng, 3000), None)))
    assert "target restarted" in f2 and "e2e_p50" in f2["performance drift"].message
    assert "output_tokens_per_second" not in f2["performance drift"].message


def test_streams_the_outage_cut_are_the_restarts_not_garbled_output() -> None:
    """vLLM stopped mid-soak ends the streams in flight with an error event (its engine died): in the window
    with the target down those are the outage's ('N streams cut by it'), not garbled output; any other
    invalid response there still is."""
    rng = random.Random(9)
    w = make_window(4, rng, 97, error_rate=0.07, error_outcome="invalid_response", target_down_seconds=17.0)
    cut = w.outcomes["invalid_response"]
    assert cut > 0
    w.failures = {"error_in_stream": cut}
    f = _by(diagnose(w))
    assert "garbled output" not in f and f"{cut} streams cut by it" in f["target restarted"].message
    w.failures = {"error_in_stream": cut - 1, "garbled_output": 1}
    g = _by(diagnose(w))["garbled output"]
    assert g.evidence["invalid_responses"] == 1 and g.message.startswith("1 of ")
    # the target up: an error event in a stream is invalid output as before
    w.target_down_seconds, w.failures = 0.0, {"error_in_stream": cut}
    assert _by(diagnose(w))["garbled output"].evidence["invalid_responses"] == cut


# ---- a falling prefix-cache hit rate (issue 23)


def test_latency_drift_with_the_prefix_cache_hit_rate_fallen_is_named_as_its_cause() -> None:
    rng = random.Random(11)
    pool = [make_window(i, rng, 3000, server={"prefix_cache_hit_ratio": h}) for i, h in enumerate((0.62, 0.6, 0.64))]
    w = make_window(5, rng, 3000, ttft_scale=1.5, scale=1.2, server={"prefix_cache_hit_ratio": 0.08})
    f = _by(diagnose(w, drift.evaluate(w, pool[0], None), baseline=pool[0], pool=pool))
    p = f["prefix cache hit rate fell"]
    assert p.kind == "drift" and p.severity == "warning" and p.window == 5
    assert p.evidence["prefix_cache_hit_ratio"] == 0.08 and p.evidence["reference_hit_ratio"] == 0.62
    assert p.evidence["drop"] == pytest.approx(0.54)
    assert "8.0%" in p.message and "62.0%" in p.message and "ttft_p50" in p.message
    assert {d["metric"] for d in p.evidence["drift"]} >= {"ttft_p50", "e2e_p50"}
    # TTFT, e2e and throughput are explained by it; the inter-token latency (scaled with e2e here) is not
    assert all(m.startswith("itl_") for m in f["performance drift"].metrics or [])


def test_a_hit_rate_within_the_drop_or_without_drift_names_nothing() -> None:
    rng = random.Random(12)
    pool = [make_window(i, rng, 3000, server={"prefix_cache_hit_ratio": 0.6}) for i in range(3)]
    # fell by 5 points only: the drift stays unexplained
    w = make_window(5, rng, 3000, scale=1.3, server={"prefix_cache_hit_ratio": 0.55})
    f = _by(diagnose(w, drift.evaluate(w, pool[0], None), baseline=pool[0], pool=pool))
    assert "prefix cache hit rate fell" not in f and "performance drift" in f
    # fallen, latency where it was: no finding (a hit rate alone is no failure)
    w = make_window(6, rng, 3000, server={"prefix_cache_hit_ratio": 0.1})
    assert "prefix cache hit rate fell" not in _by(diagnose(w, drift.evaluate(w, pool[0], None), pool=pool))
    # a server without prefix-cache counters: nothing to compare
    w = make_window(7, rng, 3000, scale=1.3)
    assert "prefix cache hit rate fell" not in _by(diagnose(w, drift.evaluate(w, pool[0], None), pool=pool))
    # a configured drop: 5 points is enough
    w = make_window(8, rng, 3000, scale=1.3, server={"prefix_cache_hit_ratio": 0.54})
    got = diagnose(w, drift.evaluate(w, pool[0], None), pool=pool, cfg=DiagnosisConfig(prefix_hit_drop=0.05))
    assert "prefix cache hit rate fell" in _by(got)
    # without a pool, the baseline window's own hit rate is the reference
    assert "prefix cache hit rate fell" in _by(diagnose(w, drift.evaluate(w, pool[0], None), baseline=pool[0],
                                                        cfg=DiagnosisConfig(prefix_hit_drop=0.05)))
    # exactly the drop (0.6 -> 0.5 is 0.09999... in floating point) names it
    w = make_window(9, rng, 3000, scale=1.3, server={"prefix_cache_hit_ratio": 0.5})
    assert "prefix cache hit rate fell" in _by(diagnose(w, drift.evaluate(w, pool[0], None), pool=pool))


def test_a_fallen_hit_rate_does_not_explain_a_drift_without_ttft() -> None:
    """Decode does not read the prefix cache: an inter-token (and so e2e) drift with TTFT where it was is a
    performance drift of its own, whatever the hit rate did; with TTFT drifted too, ITL stays unexplained."""
    rng = random.Random(13)
    pool = [make_window(i, rng, 3000, server={"prefix_cache_hit_ratio": 0.6}) for i in range(3)]
    w = make_window(5, rng, 3000, scale=1.3, ttft_scale=1.0, server={"prefix_cache_hit_ratio": 0.1})
    results = drift.evaluate(w, pool[0], None)
    assert {r.metric for r in results if r.status == "drift"} >= {"itl_p50", "e2e_p50"}
    assert not any(r.metric.startswith("ttft_") and r.status == "drift" for r in results)
    f = _by(diagnose(w, results, pool=pool))
    assert "prefix cache hit rate fell" not in f and "performance drift" in f
    w = make_window(6, rng, 3000, scale=1.3, ttft_scale=1.5, server={"prefix_cache_hit_ratio": 0.1})
    f = _by(diagnose(w, drift.evaluate(w, pool[0], None), pool=pool))
    p = f["prefix cache hit rate fell"]
    assert "ttft_p50" in {d["metric"] for d in p.evidence["drift"]}
    assert not any(d["metric"].startswith("itl_") for d in p.evidence["drift"])
    assert "itl_p50" in f["performance drift"].message


def test_the_server_s_own_ttft_mean_rising_with_the_cache_s_fall_is_the_same_cause() -> None:
    """Where soakd lagged, the server's own TTFT mean is judged too (``server_ttft_mean``): its rise with the hit rate's
    fall is the same prefill, explained by the cache finding (before: a 'performance drift' of unknown cause beside
    it, seen in a loaded test run: "server_ttft_mean +185.2%")."""
    import dataclasses

    rng = random.Random(11)
    pool = [make_window(i, rng, 3000, server={"prefix_cache_hit_ratio": h}) for i, h in enumerate((0.62, 0.6, 0.64))]
    w = make_window(5, rng, 3000, ttft_scale=1.5, server={"prefix_cache_hit_ratio": 0.08})
    results = drift.evaluate(w, pool[0], None)
    ttft = next(r for r in results if r.metric == "ttft_p50" and r.scenario is None and r.status == "drift")
    results = [*results, dataclasses.replace(ttft, metric="server_ttft_mean")]
    f = _by(diagnose(w, results, baseline=pool[0], pool=pool))
    assert "server_ttft_mean" in {d["metric"] for d in f["prefix cache hit rate fell"].evidence["drift"]}
    assert "server_ttft_mean" not in (f["performance drift"].metrics or []) if "performance drift" in f else True

"""Throttle detection from clocks-event reason shares, with the SM-clock drop as evidence."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from soakd.analysis.throttle import evaluate
from soakd.config.analysis import ThrottleConfig
from soakd.core.reasons import CLOCKS_EVENT_REASON_NAMES, PERFORMANCE_REASONS
from soakd.core.summary import WindowSummary


def device(shares: dict[str, float], sm_mean: float = 1.98e9, *, temp: float = 70.0, power: float = 600.0) -> dict:
    return {
        "power_watts": {"mean": power, "max": power + 50, "min": power - 100, "stdev": 20.0, "count": 600},
        "temperature_celsius": {"mean": temp - 5, "max": temp},
        "memory_temperature_celsius": {"mean": temp, "max": temp + 8},
        "sm_clock_hertz": {"mean": sm_mean, "min": sm_mean * 0.9, "max": 1.98e9},
        "sm_clock_max_hertz": 1.98e9,
        "throttle_share": {r: shares.get(r, 0.0) for r in CLOCKS_EVENT_REASON_NAMES},
    }


def window(i: int, **kw) -> WindowSummary:  # noqa: ANN003
    return WindowSummary.load({"window": i, "device": device(**kw)})


def test_thermal_throttle_detected_with_clock_drop_vs_baseline() -> None:
    base = window(0, shares={}, sm_mean=1.95e9)
    hot = window(5, shares={"sw_thermal": 0.4, "idle": 1.0}, sm_mean=1.70e9, temp=88.0)
    res = {r.reason: r for r in evaluate(hot, base)}
    assert set(res) == set(PERFORMANCE_REASONS)  # idle is not a performance reason
    t = res["sw_thermal"]
    assert t.detected and t.share == 0.4 and t.kind == "thermal"
    assert t.sm_clock_reference_kind == "baseline"
    assert t.sm_clock_drop_ratio == pytest.approx(1 - 1.70 / 1.95)
    assert t.temperature_max == 88.0 and t.power_mean == 600.0 and t.power_max == 650.0
    assert t.window == 5
    assert not res["sw_power_cap"].detected
    msg = t.message()
    assert "sw_thermal" in msg and "40%" in msg and "MHz" in msg and "88" in msg and "W" in msg


def test_share_at_or_below_max_share_is_not_detected() -> None:
    w = window(1, shares={"sw_power_cap": 0.1, "hw_slowdown": 0.05})
    assert not any(r.active for r in evaluate(w, None))
    assert any(r.active for r in evaluate(w, None, ThrottleConfig(max_share=0.05)))


def test_power_cap_without_baseline_uses_max_clock_and_is_not_judged() -> None:
    w = window(2, shares={"sw_power_cap": 0.8}, sm_mean=1.5e9)
    (r,) = [r for r in evaluate(w, None) if r.active]
    assert r.kind == "power" and r.sm_clock_reference_kind == "max" and not r.detected  # no reference: no impact
    assert r.sm_clock_drop_ratio == pytest.approx(1 - 1.5 / 1.98)
    # the window as its own baseline falls back to the max clock too
    assert evaluate(w, w)[0].sm_clock_reference_kind == "max"


def test_no_device_data_and_custom_reasons() -> None:
    assert evaluate(WindowSummary(window=0), None) == []
    assert evaluate(WindowSummary.load({"window": 0, "device": {"power_watts": {"mean": 1}}}), None) == []
    w = window(3, shares={"sync_boost": 0.9})
    assert not any(r.active for r in evaluate(w, None))
    (r,) = evaluate(w, None, ThrottleConfig(reasons=["sync_boost"]))
    assert r.active


def test_config_validation() -> None:
    with pytest.raises(ValidationError, match="unknown clocks-event reason"):
        ThrottleConfig(reasons=["too_hot"])
    with pytest.raises(ValidationError):
        ThrottleConfig(max_share=1.5)
    with pytest.raises(ValidationError):
        ThrottleConfig(share=0.2)


def test_a_steady_power_cap_is_healthy_unless_latency_drifted() -> None:
    base = window(0, shares={"sw_power_cap": 1.0}, sm_mean=1.755e9)
    w = window(6, shares={"sw_power_cap": 1.0}, sm_mean=1.755e9)  # capped from the start, the clock steady
    (r,) = [r for r in evaluate(w, base) if r.reason == "sw_power_cap"]
    assert r.active and r.sm_clock_drop_ratio == pytest.approx(0.0) and not r.impact and not r.detected
    (r,) = [r for r in evaluate(w, base, latency_drift=True) if r.reason == "sw_power_cap"]
    assert r.impact and r.detected

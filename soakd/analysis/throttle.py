"""Throttling: a performance-relevant clocks-event reason active for too much of a window, with
an impact (the SM clock below the baseline's, or latency drift in the same window). A GPU at its
power cap with its clock where it was at the baseline is reported healthy, not throttled.

(derivation: docs/analysis.md#derivation-throttlepy)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from soakd.analysis.stats import as_float
from soakd.config.analysis import ThrottleConfig
from soakd.core.summary import WindowSummary

__all__ = ["ThrottleResult", "evaluate"]

Window = WindowSummary


@dataclass(frozen=True)
class ThrottleResult:
    reason: str
    share: float
    detected: bool
    max_share: float
    sm_clock_mean: float | None
    sm_clock_reference: float | None
    sm_clock_reference_kind: Literal["baseline", "max"] | None
    sm_clock_drop_ratio: float | None  # 1 - mean / reference: 0.12 = clock 12% lower
    temperature_max: float | None
    memory_temperature_max: float | None
    power_mean: float | None
    power_max: float | None
    window: int | None = None
    active: bool = False  # share above max_share
    impact: bool = False  # clock drop beyond clock_drop_ratio vs the baseline, or latency drift

    @property
    def kind(self) -> Literal["thermal", "power"]:
        """thermal for sw/hw_thermal; power for sw_power_cap/hw_power_brake; hw_slowdown (set by
        either an over-temperature or the external power brake) counts as thermal."""
        return "power" if self.reason in ("sw_power_cap", "hw_power_brake") else "thermal"

    def message(self) -> str:
        parts = [f"{self.reason} active {self.share * 100:.0f}% of window {self.window}"]
        if self.sm_clock_mean is not None:
            s = f"SM clock {self.sm_clock_mean / 1e6:.0f} MHz"
            if self.sm_clock_drop_ratio is not None:
                s += f" ({-self.sm_clock_drop_ratio * 100:+.1f}% vs {self.sm_clock_reference_kind})"
            parts.append(s)
        if self.temperature_max is not None:
            parts.append(f"max {self.temperature_max:.0f} °C")
        if self.power_mean is not None:
            p = f"power {self.power_mean:.0f} W mean"
            if self.power_max is not None:
                p += f", {self.power_max:.0f} W max"
            parts.append(p)
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_num = as_float


def evaluate(window: Window, baseline: Window | None = None, cfg: ThrottleConfig | None = None,
             latency_drift: bool = False) -> list[ThrottleResult]:
    """One result per configured reason that the window's device data reports (detected or not).

    Empty without device data. The SM-clock reference is the baseline window's mean SM clock when
    a different baseline window has one (the only reference an impact is judged against), else the
    window's ``sm_clock_max_hertz`` (reported, not judged).
    """
    cfg = cfg or ThrottleConfig()
    dev = window.device
    shares = dev.throttle_share or {}
    if not shares:
        return []
    mean_clock = _num(dev.sm_clock_hertz.mean) if dev.sm_clock_hertz else None
    ref, ref_kind = None, None
    if baseline is not None and baseline is not window and baseline.window != window.window:
        bclock = baseline.device.sm_clock_hertz
        ref = _num(bclock.mean) if bclock else None
        ref_kind = "baseline" if ref else None
    if not ref:
        ref = _num(dev.sm_clock_max_hertz)
        ref_kind = "max" if ref else None
    drop = (1.0 - mean_clock / ref) if (mean_clock is not None and ref) else None
    temp, mtemp, power = dev.temperature_celsius, dev.memory_temperature_celsius, dev.power_watts
    out = []
    clock_impact = ref_kind == "baseline" and drop is not None and drop > cfg.clock_drop_ratio
    judged = ref_kind == "baseline"
    for reason in cfg.reasons:
        share = _num(shares.get(reason))
        if share is None:
            continue
        active = share > cfg.max_share
        impact = judged and (clock_impact or latency_drift)
        out.append(
            ThrottleResult(
                reason=reason,
                share=share,
                detected=active and impact,
                active=active,
                impact=impact,
                max_share=cfg.max_share,
                sm_clock_mean=mean_clock,
                sm_clock_reference=ref,
                sm_clock_reference_kind=ref_kind,
                sm_clock_drop_ratio=drop,
                temperature_max=_num(temp.max) if temp else None,
                memory_temperature_max=_num(mtemp.max) if mtemp else None,
                power_mean=_num(power.mean) if power else None,
                power_max=_num(power.max) if power else None,
                window=window.window,
            )
        )
    return out

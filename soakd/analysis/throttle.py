"""Throttling: a performance-relevant clocks-event reason active for too much of a window, with
an impact: the SM clock below the baseline pool's beyond its noise (the pool's window means give the
reference and the spread) in consecutive windows, *and* latency or throughput drift in the window.
A GPU at its power cap whose clock wanders within its noise, or whose latency has not moved, is
reported healthy ("power-capped, healthy"), never throttled.

(derivation: docs/analysis.md#derivation-throttlepy)
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from soakd.analysis.stats import as_float
from soakd.config.analysis import ThrottleConfig
from soakd.core.summary import WindowSummary

__all__ = ["ClockReference", "ThrottleResult", "charge_gpus", "clock_reference", "evaluate"]

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
    impact: bool = False  # the clock beyond its noise (for long enough) and latency or throughput drift
    clock_noise_ratio: float | None = None  # the pool's relative spread of the window-mean SM clock
    clock_bound_ratio: float | None = None  # the drop beyond which the clock is beyond its noise
    beyond_noise: bool = False  # this window's clock below the reference by more than the bound
    beyond_windows: int = 0  # consecutive windows (this one included) beyond the bound
    latency_moving: bool = False  # latency or throughput drift (degraded) in the window
    gpus: tuple[str, ...] = ()  # detected: the GPUs it is charged to (``charge_gpus``)

    @property
    def kind(self) -> Literal["thermal", "power"]:
        """thermal for sw/hw_thermal; power for sw_power_cap/hw_power_brake; hw_slowdown (set by
        either an over-temperature or the external power brake) counts as thermal."""
        return "power" if self.reason in ("sw_power_cap", "hw_power_brake") else "thermal"

    def message(self) -> str:
        parts = [f"{self.reason} active {self.share * 100:.0f}% of window {self.window}"]
        if self.gpus:
            parts[0] += f" on GPU {', '.join(self.gpus)}"
        if self.sm_clock_mean is not None:
            s = f"SM clock {self.sm_clock_mean / 1e6:.0f} MHz"
            if self.sm_clock_drop_ratio is not None:
                s += f" ({-self.sm_clock_drop_ratio * 100:+.1f}% vs {self.sm_clock_reference_kind}"
                if self.clock_bound_ratio is not None:
                    s += (f"; {'beyond' if self.beyond_noise else 'within'} its noise bound "
                          f"-{self.clock_bound_ratio * 100:.1f}%")
                    if self.beyond_noise:
                        s += f", {self.beyond_windows} window{'s' if self.beyond_windows != 1 else ''}"
                s += ")"
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


@dataclass(frozen=True)
class ClockReference:
    """The SM clock the baseline pool ran at, and how much a window's mean wanders around it."""

    hertz: float  # the mean of the pool windows' mean SM clocks
    noise_ratio: float  # their relative standard deviation (at least the configured floor)
    bound_ratio: float  # a drop beyond this is beyond the noise (at least clock_drop_ratio)
    windows: int


def clock_mean(w: Window, gpu: str | None = None) -> float | None:
    """The window's mean SM clock: of every GPU, or of ``gpu`` (where the window has per-GPU clocks)."""
    if gpu is not None:
        return _num((w.device.sm_clock_by_gpu or {}).get(gpu))
    c = w.device.sm_clock_hertz
    return _num(c.mean) if c else None


def _hot(pool: list[Window], cfg: ThrottleConfig, gpu: str | None = None) -> set[int | None]:
    """The pool windows throttled by heat or the power brake (on ``gpu``, or on any GPU)."""
    def shares(w: Window) -> dict[str, float]:
        if gpu is None:
            return w.device.throttle_share or {}
        return (w.device.throttle_share_by_gpu or {}).get(gpu) or {}
    return {w.window for w in pool if any((_num(v) or 0.0) > cfg.max_share for r, v in shares(w).items()
                                          if r in cfg.reasons and r != "sw_power_cap")}


def clock_reference(pool: list[Window], cfg: ThrottleConfig | None = None,
                    gpu: str | None = None) -> ClockReference | None:
    """The reference from the pool windows that have an SM clock (those not throttled by heat or the power
    brake, when any are left): their mean, the spread of their means
    (relative, at least ``clock_noise_floor``), and the one-sided prediction bound for one more window
    mean, ``t(clock_confidence, n - 1) x spread x sqrt(1 + 1/n)`` (a single window: the normal
    quantile on the floor), at least ``clock_drop_ratio``. ``gpu``: one GPU's (its own clock and reasons,
    from windows with per-GPU clocks)."""
    from scipy import stats  # noqa: PLC0415  (only where a pool is judged)

    cfg = cfg or ThrottleConfig()
    # a pool window throttled by heat (or the power brake) is no reference for the clock: a steady power cap is
    hot = _hot(pool, cfg, gpu)
    pool = [w for w in pool if w.window not in hot] or pool
    means = [m for m in (clock_mean(w, gpu) for w in pool) if m]
    if not means:
        return None
    ref = statistics.fmean(means)
    n = len(means)
    spread = max(statistics.stdev(means) / ref if n >= 2 else 0.0, cfg.clock_noise_floor)
    q = float(stats.t.ppf(cfg.clock_confidence, n - 1)) if n >= 2 else float(stats.norm.ppf(cfg.clock_confidence))
    bound = max(cfg.clock_drop_ratio, q * spread * math.sqrt(1.0 + 1.0 / n))
    return ClockReference(ref, spread, bound, n)


def evaluate(window: Window, baseline: Window | None = None, cfg: ThrottleConfig | None = None,
             latency_drift: bool = False, reference: ClockReference | None = None,
             beyond_before: int | None = None) -> list[ThrottleResult]:
    """One result per configured reason that the window's device data reports (detected or not).

    Empty without device data. The SM-clock reference is ``reference`` (the baseline pool's, from
    ``clock_reference``) when given, else the baseline window's mean SM clock when a different
    baseline window has one (judged against ``clock_drop_ratio``): the only references an impact is
    judged against; else the window's ``sm_clock_max_hertz`` (reported, not judged).
    ``beyond_before``: the consecutive windows just before this one whose clock was beyond the bound
    (None: this window alone decides, as if ``consecutive`` were 1).

    An impact needs both: the clock beyond its noise bound in ``consecutive`` windows (this one the
    last; or this one beyond ``clock_immediate_factor`` x the bound), and ``latency_drift``.
    """
    cfg = cfg or ThrottleConfig()
    dev = window.device
    shares = dev.throttle_share or {}
    if not shares:
        return []
    mean_clock = _num(dev.sm_clock_hertz.mean) if dev.sm_clock_hertz else None
    ref, ref_kind = None, None
    bound = noise = None
    if reference is not None:
        ref, ref_kind = reference.hertz, "baseline"
        bound, noise = reference.bound_ratio, reference.noise_ratio
    elif baseline is not None and baseline is not window and baseline.window != window.window:
        bclock = baseline.device.sm_clock_hertz
        ref = _num(bclock.mean) if bclock else None
        ref_kind = "baseline" if ref else None
        bound = cfg.clock_drop_ratio if ref else None
    if not ref:
        ref = _num(dev.sm_clock_max_hertz)
        ref_kind = "max" if ref else None
    drop = (1.0 - mean_clock / ref) if (mean_clock is not None and ref) else None
    temp, mtemp, power = dev.temperature_celsius, dev.memory_temperature_celsius, dev.power_watts
    out = []
    judged = ref_kind == "baseline"
    beyond = judged and drop is not None and bound is not None and drop > bound
    streak = (1 + (beyond_before or 0)) if beyond else 0
    sustained = beyond and (beyond_before is None or streak >= cfg.consecutive
                            or drop > cfg.clock_immediate_factor * (bound or 0.0))
    for reason in cfg.reasons:
        share = _num(shares.get(reason))
        if share is None:
            continue
        active = share > cfg.max_share
        impact = judged and sustained and latency_drift
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
                clock_noise_ratio=noise,
                clock_bound_ratio=bound if judged else None,
                beyond_noise=beyond,
                beyond_windows=streak,
                latency_moving=latency_drift,
            )
        )
    return out


def charge_gpus(results: list[ThrottleResult], window: Window, pool: list[Window],
                cfg: ThrottleConfig | None = None) -> list[ThrottleResult]:
    """``results`` with each detected reason charged to the GPUs it throttled (``gpus``).

    A heat or power-brake reason (``sw_thermal``, ``hw_thermal``, ``hw_slowdown``, ``hw_power_brake``) is
    charged to every GPU it was active on beyond ``max_share``. A power cap (``sw_power_cap``), on a node of
    several GPUs whose clocks the window has per GPU, only to the GPUs whose own SM clock fell: below their own
    pool reference beyond their own noise bound (``clock_reference`` of that GPU). A GPU at its power cap whose
    clock holds, beside one that slowed, is not charged, and a power cap that no slowed GPU had is no longer
    detected (the slowed GPU names the cause; where its own reason was too brief to count, the latency drift is
    the finding). Where no GPU's own clock fell beyond its bound (only the node's mean did), every GPU with the
    cap active is charged, as without per-GPU clocks."""
    cfg = cfg or ThrottleConfig()
    by_gpu = window.device.throttle_share_by_gpu or {}
    clocks = window.device.sm_clock_by_gpu or {}
    slowed: set[str] = set()
    for gpu, clock in clocks.items() if len(by_gpu) > 1 else ():
        ref = clock_reference(pool, cfg, gpu)
        if ref is None or 1.0 - clock / ref.hertz > ref.bound_ratio:  # no reference of its own: not cleared
            slowed.add(gpu)
    out = []
    for t in results:
        if not t.detected:
            out.append(t)
            continue
        active = tuple(g for g, shares in sorted(by_gpu.items()) if (_num(shares.get(t.reason)) or 0.0) > cfg.max_share)
        if t.reason != "sw_power_cap" or not slowed:
            out.append(replace(t, gpus=active))
        else:
            gpus = tuple(g for g in active if g in slowed or g not in clocks)
            out.append(replace(t, gpus=gpus, detected=bool(gpus)))
    return out

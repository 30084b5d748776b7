"""Per-window aggregates of the sampled telemetry (device, server, host).

Samplers deliver snapshots; ``soakd.soak.telemetry`` routes each to the window it falls in. Across GPUs a
snapshot is reduced first (memory, power and energy summed — the node's totals; temperatures by
their maximum — the hottest device limits; SM clock by the mean; a clocks-event reason counts as
active when any GPU reports it), then aggregated over the window with O(1) state per quantity:
count, sum, sum of squares, min, max, first, last and the sums of a least-squares slope.

Server scrapes are also taken in pairs (consecutive scrapes of the window, at most ``MAX_SCRAPE_GAP``
apart, the token counter not gone down — a restart): the server's generated-token counter's increase
over them gives the window's ``generation_tokens_per_second``, and the pairs whose both scrapes show the
KV cache pinned full (at or above ``kv_saturated_ratio``) with requests running add up to the window's
``kv_saturated`` spans (``soakd.analysis.kvsat``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from soakd.core.reasons import CLOCKS_EVENT_REASON_NAMES
from soakd.core.series import Series
from soakd.core.summary import (
    DeviceSummary,
    HostMemoryStat,
    HostSummary,
    KvSaturation,
    MeanMax,
    MemoryStat,
    PowerStat,
    RangeStat,
    ServerSummary,
)


class Agg:
    __slots__ = ("n", "s", "ss", "lo", "hi", "first", "last", "falls", "st", "stt", "stv", "t0")

    def __init__(self) -> None:
        self.n = 0
        self.s = self.ss = 0.0
        self.lo = math.inf
        self.hi = -math.inf
        self.first: float | None = None
        self.last: float | None = None
        self.falls = 0  # readings below the one before (a counter's reset)
        self.st = self.stt = self.stv = 0.0
        self.t0: float | None = None

    def add(self, v: float, t: float) -> None:
        if self.t0 is None:
            self.t0 = t
            self.first = v
        self.n += 1
        self.s += v
        self.ss += v * v
        self.lo = min(self.lo, v)
        self.hi = max(self.hi, v)
        if self.last is not None and v < self.last:
            self.falls += 1
        self.last = v
        x = (t - self.t0) / 3600.0
        self.st += x
        self.stt += x * x
        self.stv += x * v

    @property
    def mean(self) -> float | None:
        return self.s / self.n if self.n else None

    @property
    def stdev(self) -> float | None:
        if self.n < 2:
            return None
        var = (self.ss - self.s * self.s / self.n) / (self.n - 1)
        return math.sqrt(max(0.0, var))

    @property
    def slope_per_hour(self) -> float | None:
        n = self.n
        if n < 3:
            return None
        den = n * self.stt - self.st * self.st
        if den <= 1e-18:
            return None
        return (n * self.stv - self.st * self.s) / den

    def summary(self, *keys: str) -> dict[str, float | None]:
        full = {
            "mean": self.mean,
            "min": self.lo if self.n else None,
            "max": self.hi if self.n else None,
            "stdev": self.stdev,
            "count": self.n,
            "first": self.first,
            "last": self.last,
            "slope_per_hour": self.slope_per_hour,
        }
        return {k: full[k] for k in keys} if keys else full


def _by_name(series: Iterable[Series]) -> dict[str, list[Series]]:
    out: dict[str, list[Series]] = {}
    for s in series:
        out.setdefault(s.name, []).append(s)
    return out


# name -> (window key, reduction across GPUs/children)
_REDUCE = {
    "soakd_gpu_memory_used_bytes": ("memory_used_bytes", "sum"),
    "soakd_gpu_memory_total_bytes": ("memory_total_bytes", "sum"),
    "soakd_gpu_power_watts": ("power_watts", "sum"),
    "soakd_gpu_energy_joules_total": ("energy_joules_total", "sum"),
    "soakd_gpu_sm_clock_hertz": ("sm_clock_hertz", "mean"),
    "soakd_gpu_sm_clock_max_hertz": ("sm_clock_max_hertz", "max"),
    "soakd_gpu_utilization_ratio": ("utilization_ratio", "mean"),
    "soakd_target_gpu_memory_used_bytes": ("target_gpu_memory_bytes", "sum"),
    "soakd_server_kv_cache_usage_ratio": ("kv_cache_usage_ratio", "mean"),
    "soakd_server_requests_waiting": ("requests_waiting", "sum"),
    "soakd_server_requests_running": ("requests_running", "sum"),
    "soakd_server_generation_tokens_total": ("server_generation_tokens", "sum"),
    "soakd_server_ttft_seconds_total": ("server_ttft_seconds", "sum"),
    "soakd_server_ttft_requests_total": ("server_ttft_count", "sum"),
    "soakd_server_itl_seconds_total": ("server_itl_seconds", "sum"),
    "soakd_server_itl_tokens_total": ("server_itl_count", "sum"),
    "soakd_server_prefix_cache_hits_total": ("server_prefix_hits", "sum"),
    "soakd_server_prefix_cache_queries_total": ("server_prefix_queries", "sum"),
    "soakd_target_resident_memory_bytes": ("target_rss_bytes", "sum"),
    "soakd_target_anon_memory_bytes": ("target_anon_bytes", "sum"),
    "soakd_server_process_resident_memory_bytes": ("server_rss_bytes", "sum"),
    "soakd_server_restarts_total": ("server_restarts_total", "sum"),
    "soakd_self_resident_memory_bytes": ("self_rss_bytes", "sum"),
}


# GPU error counters, kept per GPU (uuid): the count of critical Xid events since soakd started, the
# code of the last one, and the volatile uncorrected ECC count
_GPU_ERRORS = {
    "soakd_gpu_xid_errors_total": "xid_total",
    "soakd_gpu_last_xid": "last_xid",
    "soakd_gpu_ecc_errors_total": "ecc_uncorrected",
}


def reduce_snapshot(series: Iterable[Series]) -> tuple[dict[str, float], dict[str, dict[str, bool]]]:
    """One snapshot -> {window key: value} and {gpu: {reason: active}}."""
    return _reduce(_by_name(series))


def _reduce(grouped: dict[str, list[Series]]) -> tuple[dict[str, float], dict[str, dict[str, bool]]]:
    """``reduce_snapshot`` of a snapshot's series grouped by name."""
    values: dict[str, float] = {}
    for name, (key, how) in _REDUCE.items():
        items = grouped.get(name)
        if not items:
            continue
        vs = [s.value for s in items]
        values[key] = sum(vs) if how == "sum" else max(vs) if how == "max" else sum(vs) / len(vs)
    temps = grouped.get("soakd_gpu_temperature_celsius") or []
    gpu_t = [s.value for s in temps if s.label("sensor") == "gpu"]
    mem_t = [s.value for s in temps if s.label("sensor") == "memory"]
    if gpu_t:
        values["temperature_celsius"] = max(gpu_t)
    if mem_t:
        values["memory_temperature_celsius"] = max(mem_t)
    reasons: dict[str, dict[str, bool]] = {}
    for s in grouped.get("soakd_gpu_clocks_event_active") or ():
        r = s.label("reason")
        gpu = reasons.get(s.label("gpu") or "0")
        if gpu is None:
            gpu = reasons[s.label("gpu") or "0"] = dict.fromkeys(CLOCKS_EVENT_REASON_NAMES, False)
        if r in gpu and s.value >= 0.5:
            gpu[r] = True
    return values, reasons


MAX_SCRAPE_GAP = 60.0  # two server scrapes further apart: scrapes failed in between, the pair is not judged


class _Saturation:
    """The server's scrapes in pairs: its token rate, and the spans pinned full with requests running."""

    __slots__ = ("ratio", "prev", "tok_sum", "tok_seconds", "seconds", "tokens", "run_start", "run_seconds",
                 "run_tokens", "longest", "kv_min", "running_max", "waiting_max")

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio
        self.prev: tuple[float, bool, float | None] | None = None  # (t, pinned with requests running, tokens)
        self.tok_sum = self.tok_seconds = 0.0
        self.seconds = 0.0
        self.tokens: float | None = None
        self.run_start: float | None = None
        self.run_seconds = 0.0
        self.run_tokens: float | None = None
        self.longest: tuple[float, float | None, float] | None = None  # (seconds, tokens, start)
        self.kv_min: float | None = None
        self.running_max: float | None = None
        self.waiting_max: float | None = None

    def _close_run(self) -> None:
        if self.run_start is not None and (self.longest is None or self.run_seconds > self.longest[0]):
            self.longest = (self.run_seconds, self.run_tokens, self.run_start)
        self.run_start, self.run_seconds, self.run_tokens = None, 0.0, None

    def add(self, values: dict[str, float], t: float) -> None:
        kv, running = values.get("kv_cache_usage_ratio"), values.get("requests_running")
        if kv is None and running is None and "server_generation_tokens" not in values:
            return  # not a server scrape
        tokens = values.get("server_generation_tokens")
        pinned = kv is not None and running is not None and kv >= self.ratio and running > 0
        prev, self.prev = self.prev, (t, pinned, tokens)
        if prev is None:
            return
        dt = t - prev[0]
        delta = tokens - prev[2] if tokens is not None and prev[2] is not None else None
        if not 0 < dt <= MAX_SCRAPE_GAP or (delta is not None and delta < 0):
            self._close_run()  # scrapes failed in between, or the server restarted
            return
        if delta is not None:
            self.tok_sum += delta
            self.tok_seconds += dt
        if not (pinned and prev[1]):
            self._close_run()
            return
        self.seconds += dt
        if self.run_start is None:
            self.run_start = prev[0]
            self.run_tokens = 0.0 if delta is not None else None
        self.run_seconds += dt
        if delta is not None:
            self.tokens = (self.tokens or 0.0) + delta
            if self.run_tokens is not None:
                self.run_tokens += delta
        assert kv is not None and running is not None
        self.kv_min = kv if self.kv_min is None else min(self.kv_min, kv)
        self.running_max = running if self.running_max is None else max(self.running_max, running)
        waiting = values.get("requests_waiting")
        if waiting is not None:
            self.waiting_max = waiting if self.waiting_max is None else max(self.waiting_max, waiting)

    def rate(self) -> float | None:
        return self.tok_sum / self.tok_seconds if self.tok_seconds > 0 else None

    def summary(self, start: float | None) -> KvSaturation | None:
        longest = self.longest  # the run in progress counts as it is (a summary changes nothing)
        if self.run_start is not None and (longest is None or self.run_seconds > longest[0]):
            longest = (self.run_seconds, self.run_tokens, self.run_start)
        if longest is None:
            return None
        seconds, tokens, at = longest
        return KvSaturation(seconds=self.seconds, tokens=self.tokens, longest_seconds=seconds, longest_tokens=tokens,
                            longest_start_offset_seconds=at - start if start is not None else None,
                            kv_cache_usage_min=self.kv_min, requests_running_max=self.running_max,
                            requests_waiting_max=self.waiting_max)


class _IntervalMean:
    """A server histogram's mean over the window's scrape intervals taken as clusters: the mean is the sum's
    increase over the count's (``_mean_of_counters``); its standard error is the ratio estimator's, from how far
    each interval's sum lies from its count times that mean, ``sqrt(k / (k - 1) * sum((ds_i - R dc_i)^2)) / C``
    over ``k`` intervals with ``C`` counted in all. Intervals see load that wanders faster than a scrape
    interval; slower wander is what the between-window noise floor is for (``soakd.analysis.page``). O(1)."""

    __slots__ = ("seconds", "count", "prev", "k", "s", "c", "ss", "sc", "cc")

    def __init__(self, seconds: str, count: str) -> None:
        self.seconds, self.count = seconds, count
        self.prev: tuple[float, float] | None = None
        self.k = 0
        self.s = self.c = self.ss = self.sc = self.cc = 0.0

    def add(self, values: dict[str, float]) -> None:
        s, c = values.get(self.seconds), values.get(self.count)
        if s is None or c is None:
            return
        prev, self.prev = self.prev, (s, c)
        if prev is None:
            return
        ds, dc = s - prev[0], c - prev[1]
        if ds < 0 or dc < 0:  # a restart: the mean is not judged (``_mean_of_counters``)
            return
        self.k += 1
        self.s += ds
        self.c += dc
        self.ss += ds * ds
        self.sc += ds * dc
        self.cc += dc * dc

    def rel_se(self) -> float | None:
        """The mean's standard error over the mean, or None (fewer than 2 intervals, nothing counted). How many
        intervals it rests on is the window's ``*_mean_intervals``; ``metric_value`` judges a level only from
        ``SERVER_MEAN_MIN_INTERVALS`` of them."""
        if self.k < 2 or self.c <= 0 or self.s <= 0:
            return None
        r = self.s / self.c
        resid = max(0.0, self.ss - 2.0 * r * self.sc + r * r * self.cc)
        return math.sqrt(self.k / (self.k - 1) * resid) / self.c / r


class TelemetryStats:
    """The telemetry of one window. Bounded: a fixed set of aggregates, whatever the length."""

    def __init__(self, kv_saturated_ratio: float = 0.98) -> None:
        self.saturation = _Saturation(kv_saturated_ratio)
        self.interval_means = {"ttft": _IntervalMean("server_ttft_seconds", "server_ttft_count"),
                               "itl": _IntervalMean("server_itl_seconds", "server_itl_count")}
        self.aggs: dict[str, Agg] = {}
        self.reason_samples: dict[str, int] = {}  # gpu -> samples that reported reasons
        self.reason_active: dict[str, dict[str, int]] = {}  # gpu -> reason -> samples it was active in
        self.gpu_clock: dict[str, list[float]] = {}  # gpu -> [sum of its SM clock samples, their count]
        self.energy_joules = 0.0
        self.energy_seconds = 0.0
        # per GPU (uuid): the GPU error counters' values in the window (soakd.analysis.gpu_errors)
        self.gpu_errors: dict[str, dict[str, float]] = {}

    def add_energy(self, joules: float, seconds: float) -> None:
        """Energy used between two readings of the counter while load was running (the router
        differences the counter; a reset or a paused interval contributes nothing)."""
        self.energy_joules += joules
        self.energy_seconds += seconds

    def _add_gpu_errors(self, grouped: dict[str, list[Series]]) -> None:
        for name, key in _GPU_ERRORS.items():
            for s in grouped.get(name, ()):
                if name == "soakd_gpu_ecc_errors_total" and s.label("kind") != "uncorrected":
                    continue
                gpu = self.gpu_errors.setdefault(s.label("uuid") or s.label("gpu") or "0", {})
                gpu.setdefault(f"{key}_first", s.value)
                gpu[key] = s.value

    def add(self, series: Iterable[Series], t: float) -> None:
        grouped = _by_name(series)  # one pass over the snapshot
        self._add_gpu_errors(grouped)
        values, reasons = _reduce(grouped)
        self.saturation.add(values, t)
        for im in self.interval_means.values():
            im.add(values)
        for key, v in values.items():
            agg = self.aggs.get(key)
            if agg is None:
                agg = self.aggs[key] = Agg()
            agg.add(v, t)
        for s in grouped.get("soakd_gpu_sm_clock_hertz", ()):
            acc = self.gpu_clock.setdefault(s.label("gpu") or "0", [0.0, 0])
            acc[0] += s.value
            acc[1] += 1
        for gpu, active in reasons.items():
            self.reason_samples[gpu] = self.reason_samples.get(gpu, 0) + 1
            counts = self.reason_active.get(gpu)
            if counts is None:
                counts = self.reason_active[gpu] = dict.fromkeys(CLOCKS_EVENT_REASON_NAMES, 0)
            for r, on in active.items():
                if on:
                    counts[r] += 1

    def _stat(self, cls: type, key: str) -> object | None:
        agg = self.aggs.get(key)
        return None if agg is None else cls(**agg.summary(*cls.model_fields))

    def device(self, completion_tokens: int, duration_seconds: float | None = None) -> DeviceSummary:
        """``duration_seconds``: the window's load time, over which ``completion_tokens`` were
        produced. The energy readings cover a slightly different span (from the last reading
        before the window to the last one in it: a late or missed reading moves up to a sampling
        interval of energy between windows), so energy per token is the mean power over the
        readings' span times the window's load time, per token."""
        d = DeviceSummary(
            power_watts=self._stat(PowerStat, "power_watts"),
            temperature_celsius=self._stat(MeanMax, "temperature_celsius"),
            memory_temperature_celsius=self._stat(MeanMax, "memory_temperature_celsius"),
            sm_clock_hertz=self._stat(RangeStat, "sm_clock_hertz"),
            sm_clock_max_hertz=self.aggs["sm_clock_max_hertz"].hi if "sm_clock_max_hertz" in self.aggs else None,
            utilization_ratio=self._stat(MeanMax, "utilization_ratio"),
            memory_used_bytes=self._stat(MemoryStat, "memory_used_bytes"),
            memory_total_bytes=self.aggs["memory_total_bytes"].hi if "memory_total_bytes" in self.aggs else None,
            target_gpu_memory_bytes=self._stat(MemoryStat, "target_gpu_memory_bytes"),
            gpu_errors={g: dict(v) for g, v in sorted(self.gpu_errors.items())} or None,
        )
        if self.energy_seconds > 0:
            d.energy_joules = self.energy_joules
            d.energy_seconds = self.energy_seconds
            joules = self.energy_joules
            if duration_seconds is not None and duration_seconds > 0:
                joules = self.energy_joules / self.energy_seconds * duration_seconds
            d.energy_per_output_token_joules = joules / completion_tokens if completion_tokens else None
        if self.reason_samples:
            by_gpu = {gpu: {r: c / self.reason_samples[gpu] for r, c in counts.items()}
                      for gpu, counts in sorted(self.reason_active.items())}
            d.throttle_share_by_gpu = by_gpu
            d.throttle_share = {r: max(shares[r] for shares in by_gpu.values()) for r in CLOCKS_EVENT_REASON_NAMES}
        if len(self.gpu_clock) > 1:  # one GPU: its clock is sm_clock_hertz
            d.sm_clock_by_gpu = {gpu: total / n for gpu, (total, n) in sorted(self.gpu_clock.items()) if n}
        return d

    def _mean_of_counters(self, seconds: str, count: str) -> float | None:
        """The mean of a server histogram over the window: the sum's increase over the count's; the prefix
        cache's hit rate likewise. None with nothing counted, and where the server restarted inside the
        window (a counter that fell, or a restart soakd recognised): counters that started again from zero
        and grew back would otherwise give a difference of two processes' counts (a hit rate above 1)."""
        s, c = self.aggs.get(seconds), self.aggs.get(count)
        if s is None or c is None or s.n < 2 or c.n < 2 or s.falls or c.falls:
            return None
        restarts = self.aggs.get("server_restarts_total")
        if restarts is not None and restarts.last != restarts.first:
            return None
        ds, dc = s.last - s.first, c.last - c.first
        return ds / dc if dc > 0 and ds >= 0 else None

    def _server_means(self) -> dict[str, Any]:
        """The server's own TTFT and ITL means (``_mean_of_counters``), and where a mean is known its relative
        standard error and how many scrape intervals that rests on: ``ServerSummary``'s ``{family}_mean_*``."""
        out: dict[str, Any] = {}
        for family, im in self.interval_means.items():
            mean = out[f"{family}_mean_seconds"] = self._mean_of_counters(im.seconds, im.count)
            if mean is not None:
                out[f"{family}_mean_rel_se"], out[f"{family}_mean_intervals"] = im.rel_se(), im.k
        return out

    def server(self, start: float | None = None) -> ServerSummary:
        """``start``: the window's start (monotonic), where the offset of its longest KV-saturated span counts from."""
        return ServerSummary(kv_cache_usage_ratio=self._stat(RangeStat, "kv_cache_usage_ratio"),
                             requests_waiting=self._stat(MeanMax, "requests_waiting"),
                             requests_running=self._stat(MeanMax, "requests_running"),
                             **self._server_means(),
                             prefix_cache_hit_ratio=self._mean_of_counters("server_prefix_hits",
                                                                           "server_prefix_queries"),
                             restarts_total=self.aggs["server_restarts_total"].last
                             if "server_restarts_total" in self.aggs else None,
                             generation_tokens_per_second=self.saturation.rate(),
                             kv_saturated=self.saturation.summary(start))

    def host(self) -> HostSummary:
        """The target's memory from /proc when its processes are visible (a shared PID namespace), else
        the server's own process_resident_memory_bytes (``target_memory_source`` says which)."""
        proc = self._stat(HostMemoryStat, "target_rss_bytes")
        rss = proc if proc is not None else self._stat(HostMemoryStat, "server_rss_bytes")
        return HostSummary(target_rss_bytes=rss,
                           target_anon_bytes=self._stat(HostMemoryStat, "target_anon_bytes"),
                           target_memory_source=("proc" if proc is not None else "server_metrics")
                           if rss is not None else None,
                           self_rss_bytes=self._stat(HostMemoryStat, "self_rss_bytes"))

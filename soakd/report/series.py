"""The report's time series: the tracked metrics per window against the baseline band, and the
telemetry (per-minute samples from the store, or the windows' means when a run is too short for
them), averaged down to at most ``MAX_POINTS`` points with a break at every gap."""

from __future__ import annotations

import math
from typing import Any

from soakd.analysis.drift import metric_value
from soakd.analysis.stats import as_float
from soakd.config.analysis import DriftConfig
from soakd.core.summary import WindowSummary
from soakd.core.tracked import METRICS
from soakd.store import StoreReader

_f = as_float
MAX_POINTS = 720  # time series are averaged down to this many points (a week at one per ~14 min)


def _downsample(t: list[float], cols: dict[str, list[float | None]], limit: int = MAX_POINTS,
                gap: float | None = None) -> tuple[list[float], dict[str, list[float | None]]]:
    """Average consecutive points into at most ``limit`` buckets (a bucket never spans a gap)."""
    n = len(t)
    if n <= limit:
        return t, cols
    size = math.ceil(n / limit)
    out_t: list[float] = []
    out_c: dict[str, list[float | None]] = {k: [] for k in cols}
    i = 0
    while i < n:
        j = i + 1
        while j < n and j - i < size and not (gap is not None and t[j] - t[j - 1] > gap):
            j += 1
        out_t.append(sum(t[i:j]) / (j - i))
        for k, vs in cols.items():
            chunk = [v for v in vs[i:j] if v is not None]
            out_c[k].append(sum(chunk) / len(chunk) if chunk else None)
        i = j
    return out_t, out_c


def _with_gaps(t: list[float], cols: dict[str, list[float | None]], gap: float
               ) -> tuple[list[float], dict[str, list[float | None]]]:
    """A None point between two points further apart than ``gap``: the chart's line breaks there."""
    out_t: list[float] = []
    out_c: dict[str, list[float | None]] = {k: [] for k in cols}
    for i, x in enumerate(t):
        if i and x - t[i - 1] > gap:
            out_t.append((x + t[i - 1]) / 2)
            for k in cols:
                out_c[k].append(None)
        out_t.append(x)
        for k, vs in cols.items():
            out_c[k].append(vs[i])
    return out_t, out_c


# the tracked metrics the report charts and tabulates, in its order -> their labels
WINDOW_METRICS: dict[str, str] = {m: METRICS[m].label for m in (
    "e2e_p50", "e2e_p95", "ttft_p50", "ttft_p95", "itl_p50", "itl_p95", "requests_per_second",
    "output_tokens_per_second", "error_rate", "energy_per_token")}


def window_metrics(windows: list[WindowSummary]) -> dict[str, str]:
    """The metrics the report charts and tabulates for these windows: ``WINDOW_METRICS``, and
    goodput where a window had requests under an SLO."""
    if any(w.goodput is not None for w in windows):
        return {**WINDOW_METRICS, "goodput_ratio": METRICS["goodput_ratio"].label}
    return WINDOW_METRICS


def window_series(windows: list[WindowSummary], used_baseline: WindowSummary | None,
                   drift_cfg: DriftConfig, run_start: float) -> dict[str, Any]:
    xs = [w.window for w in windows]
    out: dict[str, Any] = {"window": xs, "partial": [w.partial for w in windows],
                           "elapsed_seconds": [((w.start_unix or run_start) - run_start) for w in windows],
                           "metrics": {}, "baseline": {}, "threshold": {}, "relative": {}}
    for metric in window_metrics(windows):
        vals = []
        for w in windows:
            v, _ci, fmt_num = metric_value(w, metric, confidence=drift_cfg.confidence)
            vals.append(_f(v))
        out["metrics"][metric] = vals
        base = _f(metric_value(used_baseline, metric)[0]) if used_baseline is not None else None
        out["baseline"][metric] = base
        out["threshold"][metric] = drift_cfg.threshold_for(metric)
        if not METRICS[metric].absolute:
            out["relative"][metric] = [(v / base - 1.0) if v is not None and base else None for v in vals]
    return out


# telemetry: stored series -> (key, reduction across GPUs / children)
_SAMPLE_SERIES: dict[str, tuple[str, str, dict[str, str] | None]] = {
    "memory_used_bytes": ("soakd_gpu_memory_used_bytes", "sum", None),
    "memory_total_bytes": ("soakd_gpu_memory_total_bytes", "sum", None),
    "power_watts": ("soakd_gpu_power_watts", "sum", None),
    "power_limit_watts": ("soakd_gpu_power_limit_watts", "sum", None),
    "temperature_celsius": ("soakd_gpu_temperature_celsius", "max", {"sensor": "gpu"}),
    "memory_temperature_celsius": ("soakd_gpu_temperature_celsius", "max", {"sensor": "memory"}),
    "sm_clock_hertz": ("soakd_gpu_sm_clock_hertz", "mean", None),
    "sm_clock_max_hertz": ("soakd_gpu_sm_clock_max_hertz", "max", None),
    "kv_cache_usage_ratio": ("soakd_server_kv_cache_usage_ratio", "mean", None),
    "requests_running": ("soakd_server_requests_running", "sum", None),
    "requests_waiting": ("soakd_server_requests_waiting", "sum", None),
}
DEVICE_KEYS = ("memory_used_bytes", "power_watts", "temperature_celsius", "sm_clock_hertz")
SERVER_KEYS = ("kv_cache_usage_ratio",)


def _samples_series(reader: StoreReader, run_id: str, run_start: float) -> tuple[dict[str, Any], int]:
    per: dict[str, dict[int, float]] = {}
    gpus: set[str] = set()
    period = 60
    loaded: dict[str, list[Any]] = {}
    for key, (series, how, match) in _SAMPLE_SERIES.items():
        rows = loaded.get(series)
        if rows is None:
            rows = loaded[series] = reader.load_samples(run_id, series)
        acc: dict[int, list[float]] = {}
        for r in rows:
            if match and any(r.labels.get(k) != v for k, v in match.items()):
                continue
            if "gpu" in r.labels:
                gpus.add(r.labels["gpu"])
            acc.setdefault(int(r.t_minute), []).append(float(r.mean))
        if acc:
            per[key] = {t: sum(v) if how == "sum" else max(v) if how == "max" else sum(v) / len(v)
                        for t, v in acc.items()}
    minutes = sorted({t for d in per.values() for t in d})
    if len(minutes) > 1:
        period = max(1, min(b - a for a, b in zip(minutes, minutes[1:], strict=False)))
    t = [m + period / 2 - run_start for m in minutes]
    cols: dict[str, list[float | None]] = {k: [per[k].get(m) for m in minutes] for k in per}
    t, cols = _with_gaps(*_downsample(t, cols, gap=2.5 * period), gap=2.5 * period)
    return {"source": "samples", "period_seconds": period, "elapsed_seconds": t, "values": cols}, len(gpus)


def _stat(stat: Any, field: str) -> float | None:
    return getattr(stat, field) if stat is not None else None


# window telemetry: key -> (the window's statistic, its field)
_WINDOW_TELEMETRY: dict[str, tuple[Any, str]] = {
    "memory_used_bytes": (lambda w: w.device.memory_used_bytes, "mean"),
    "power_watts": (lambda w: w.device.power_watts, "mean"),
    "temperature_celsius": (lambda w: w.device.temperature_celsius, "max"),
    "memory_temperature_celsius": (lambda w: w.device.memory_temperature_celsius, "max"),
    "sm_clock_hertz": (lambda w: w.device.sm_clock_hertz, "mean"),
    "kv_cache_usage_ratio": (lambda w: w.server.kv_cache_usage_ratio, "mean"),
    "requests_running": (lambda w: w.server.requests_running, "mean"),
    "requests_waiting": (lambda w: w.server.requests_waiting, "mean"),
}


def _window_telemetry(windows: list[WindowSummary], run_start: float) -> dict[str, Any]:
    t = []
    for w in windows:
        s = w.start_unix or run_start
        t.append(s + (w.wall_duration_seconds or w.duration_seconds or 0.0) / 2 - run_start)
    cols = {k: [_stat(get(w), field) for w in windows] for k, (get, field) in _WINDOW_TELEMETRY.items()}
    mx = [w.device.sm_clock_max_hertz for w in windows]
    if any(v is not None for v in mx):
        cols["sm_clock_max_hertz"] = mx
    cols = {k: v for k, v in cols.items() if any(x is not None for x in v)}
    return {"source": "windows", "period_seconds": None, "elapsed_seconds": t, "values": cols}


def telemetry(reader: StoreReader, run_id: str, windows: list[WindowSummary], run_start: float) -> dict[str, Any]:
    """Per-minute samples when the run has at least two minutes of them, else the window means."""
    tel, n_gpus = _samples_series(reader, run_id, run_start)
    if len(tel["elapsed_seconds"]) < 2:
        wt = _window_telemetry(windows, run_start)
        if len(wt["elapsed_seconds"]) >= len(tel["elapsed_seconds"]) and wt["values"]:
            tel = wt
    vals = tel["values"]
    has_device = any(any(v is not None for v in vals.get(k, [])) for k in DEVICE_KEYS)
    has_server = any(any(v is not None for v in vals.get(k, [])) for k in SERVER_KEYS)
    notes = []
    if not has_device:
        notes.append("No device telemetry was recorded (no GPU visible to soakd: the NVML and dcgm-exporter "
                     "samplers were off or never up), so device memory, power, temperature and SM clock are not "
                     "charted.")
    if not has_server:
        notes.append("No KV-cache usage was recorded (the server's /metrics was not scraped or has no KV gauge), "
                     "so KV usage is not charted.")
    tel.update(device=has_device, server=has_server, gpus=n_gpus or None, notes=notes)
    return tel

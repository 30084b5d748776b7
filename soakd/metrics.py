"""Every metric soakd exports, defined in one place (the metric contract of DESIGN.md).

Two kinds of instruments feed one custom collector:

- soakd's own events (requests, tokens, errors) go to small lock-free counters and histograms
  owned by the event loop (``Counter``/``Histogram`` below). They are cheaper than
  prometheus_client's locked instruments on the hot path, pre-initialise their label sets, and
  are exposed as ordinary Prometheus counters and histograms.
- sampled state (progress, target up, later GPU and server snapshots) is read from plain
  gauges or snapshot callbacks at scrape time; ``collect()`` does no I/O.

``CATALOGUE`` is the single list of names, types, labels and help texts. The metric table of
docs/metrics.md is generated from it (``soakd metrics --update-readme docs/metrics.md``, ``make
metrics-table``) and a test keeps them in sync.

Longer than 500 lines: the catalogue is the metric contract, one entry per exported name with its
help text; it is kept in one place on purpose.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from soakd.core.records import OUTCOMES

Kind = Literal["counter", "gauge", "histogram", "info"]

# Buckets are API: dashboards and alert rules quantile over them.
TTFT_BUCKETS = (
    0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0,
)
ITL_BUCKETS = (
    0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04,
    0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0,
)
E2E_BUCKETS = (
    0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0,
    30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0,
)


@dataclass(frozen=True)
class MetricSpec:
    name: str  # exposition name; counters include their _total suffix
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    group: str = "load"

    @property
    def targeted(self) -> bool:
        """Client-side and analysis series carry the ``target`` label (the configured target's name;
        ``main`` for a single target), so that an A/B run and a single-target run share one schema."""
        return self.group in ("load", "analysis")

    @property
    def exported_labels(self) -> tuple[str, ...]:
        return ("target", *self.labels) if self.targeted else self.labels

    @property
    def family_name(self) -> str:
        """The name prometheus_client's families take: counters without ``_total``, info metrics
        without ``_info`` (they add the suffix to their samples)."""
        if self.kind == "counter":
            return self.name.removesuffix("_total")
        if self.kind == "info":
            return self.name.removesuffix("_info")
        return self.name

    def family(self, labels: tuple[str, ...] | list[str] | None = None) -> Metric:
        """A new, empty metric family of this metric (name, type, help, labels from the
        catalogue); add samples with ``add_metric``."""
        names = list(self.labels if labels is None else labels)
        cls = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily,
               "info": InfoMetricFamily}[self.kind]
        return cls(self.family_name, self.help, labels=names)


CATALOGUE: tuple[MetricSpec, ...] = (
    # ---- load and client side
    MetricSpec("soakd_requests_total", "counter",
               "Measured requests (after warm-up) by scenario and outcome (ok, http_error, timeout, "
               "connection_error, invalid_response, cancelled).", ("scenario", "outcome")),
    MetricSpec("soakd_request_failures_total", "counter",
               "Failed measured requests by scenario and bounded reason (http_429, http_5xx, "
               "first_token_timeout, truncated_stream, garbled_output, ...).", ("scenario", "reason")),
    MetricSpec("soakd_requests_in_flight", "gauge", "Requests sent and not yet finished (warm-up included)."),
    MetricSpec("soakd_request_duration_seconds", "histogram",
               "End-to-end request latency of successful measured requests.", ("scenario",), E2E_BUCKETS),
    MetricSpec("soakd_time_to_first_token_seconds", "histogram",
               "Time from sending to the first streamed content token (streamed, successful, measured requests).",
               ("scenario",), TTFT_BUCKETS),
    MetricSpec("soakd_inter_token_latency_seconds", "histogram",
               "Gaps between consecutive streamed content events (successful, measured requests).",
               ("scenario",), ITL_BUCKETS),
    MetricSpec("soakd_prompt_tokens_total", "counter",
               "Prompt tokens of successful measured requests (server-reported usage).", ("scenario",)),
    MetricSpec("soakd_completion_tokens_total", "counter",
               "Completion tokens of successful measured requests (server usage; counted stream events "
               "where the server reports none).", ("scenario",)),
    MetricSpec("soakd_usage_missing_total", "counter",
               "Successful responses without a usage block; their completion tokens were counted from "
               "stream events.", ("scenario",)),
    MetricSpec("soakd_requests_impaired_total", "counter",
               "Measured requests that overlapped a stall of soakd's own event loop beyond "
               "analysis.client.request_max_lag (a busy node, a CPU limit, soakd stopped): counted in "
               "soakd_requests_total, left out of the latency histograms and the windows' latency statistics.",
               ("scenario",)),
    MetricSpec("soakd_goodput_requests_total", "counter",
               "Measured requests that met every SLO of their scenario (scenarios.<name>.slo: ttft, mean inter-token "
               "gap, e2e); goodput = its rate over soakd_requests_total's. Only scenarios with an SLO.", ("scenario",)),
    MetricSpec("soakd_slo_objective_ratio", "gauge",
               "The share of a scenario's requests that must meet its SLO (scenarios.<name>.slo.quantile); goodput "
               "below it breaks the SLO. Only scenarios with an SLO.", ("scenario",)),
    MetricSpec("soakd_warmup_requests_total", "counter",
               "Warm-up requests by outcome; excluded from every other load statistic.", ("outcome",)),
    MetricSpec("soakd_late_sends_total", "counter",
               "Open loop: sends that left more than 10 ms after their scheduled time (max_in_flight "
               "reached or the process fell behind)."),
    MetricSpec("soakd_records_lost_total", "counter",
               "Requests that started after the window they were scheduled in had closed (scheduled in its last "
               "instant; with load workers, a start reported after the worker had reported past the window's "
               "end): counted in the run, in no window."),
    MetricSpec("soakd_target_up", "gauge",
               "1 while the target answers (last request reached it, or /v1/models answered), else 0."),
    MetricSpec("soakd_engine_wedged", "gauge",
               "1 while requests are in flight and no byte has come from any (or the server's token counter has "
               "stood still with requests running) for longer than the freeze threshold, and the server still "
               "answers GET /v1/models (its engine is wedged), else 0."),
    MetricSpec("soakd_kv_cache_saturated", "gauge",
               "1 while the server's engine is stuck with its KV cache pinned full (usage at or above "
               "analysis.kv_saturated.ratio) and requests running -- a wedge found live with the cache full, or "
               "the last closed window's KV-saturated span with (almost) no tokens generated -- else 0."),
    # ---- run progress
    MetricSpec("soakd_soak_elapsed_seconds", "gauge", "Seconds since the soak started sending load.", group="run"),
    MetricSpec("soakd_soak_progress_ratio", "gauge", "Elapsed share of the configured duration, 0-1.", group="run"),
    MetricSpec("soakd_warmup_active", "gauge", "1 during warm-up, 0 afterwards.", group="run"),
    MetricSpec("soakd_window_index", "gauge",
               "Index of the current analysis window (0 = first window after warm-up; -1 during warm-up).",
               group="run"),
    MetricSpec("soakd_run_start_timestamp_seconds", "gauge", "Unix time the run started.", group="run"),
    MetricSpec("soakd_target_info", "info",
               "What a fleet's peers share (value 1): the target's model, the server's kind and version, the GPU "
               "model soakd samples ('+' between several; empty without a GPU sampler). The fleet rules compare "
               "pods with the same four (deploy/prometheus/rules.yml). The primary target's only (A/B candidates are "
               "compared with their reference, not with the fleet).",
               ("model", "server", "server_version", "gpu_model"), group="load"),
    MetricSpec("soakd_build_info", "info", "soakd version (value 1).", ("version",), group="self"),
    MetricSpec("soakd_log_dropped_total", "counter",
               "Log lines dropped: stdout did not take them (a stalled log driver or terminal, 10,000 lines queued "
               "already) or is gone (a broken pipe). Logging never blocks the run.", group="self"),
    # ---- analysis (updated when a window closes)
    MetricSpec("soakd_windows_closed_total", "counter", "Analysis windows closed (partial ones included).",
               group="analysis"),
    MetricSpec("soakd_window_requests", "gauge", "Measured requests in the last closed window.", group="analysis"),
    MetricSpec("soakd_window_insufficient", "gauge",
               "1 when the last closed window had too few requests to judge drift (min_requests).",
               group="analysis"),
    MetricSpec("soakd_window_client_impaired", "gauge",
               "1 when soakd itself stalled through too much of the last closed window (more than "
               "analysis.client.max_impaired_share of its requests overlapped a stall of its event loop, or of its "
               "time was stalled): the window is shown, not judged on latency.", group="analysis"),
    MetricSpec("soakd_window_requests_impaired_ratio", "gauge",
               "The share of the last closed window's requests that overlapped a stall of soakd's own event loop "
               "beyond analysis.client.request_max_lag (left out of its latency statistics; beyond "
               "analysis.client.max_impaired_share the window is client-impaired).", group="analysis"),
    MetricSpec("soakd_window_loop_lag_seconds", "gauge",
               "soakd's event-loop lag in the last closed window (a 10 ms heartbeat), by stat (p50, p99, max).",
               ("stat",), group="analysis"),
    MetricSpec("soakd_window_freeze_seconds", "gauge",
               "The longest span of the last closed window with requests in flight and no byte received from any.",
               group="analysis"),
    MetricSpec("soakd_window_server_latency_difference_seconds", "gauge",
               "soakd's mean TTFT or inter-token gap in the last closed window minus the server's own (from its "
               "histograms), by metric (ttft, itl): what the network and the client add.", ("metric",),
               group="analysis"),
    MetricSpec("soakd_window_prefix_cache_hit_ratio", "gauge",
               "The server's prefix-cache hit rate over the last closed window, 0-1: its hits' increase over its "
               "queries' (absent without prefix-cache counters, or across a restart).", group="analysis"),
    MetricSpec("soakd_window_value", "gauge",
               "Tracked quantity of the last closed window, by metric (e2e_p95 in seconds, output_tokens_per_second, "
               "energy_per_token in joules, goodput_ratio as a ratio, ...).", ("metric",), group="analysis"),
    MetricSpec("soakd_drift_ratio", "gauge",
               "Signed relative change of a tracked quantity against the baseline or the previous window "
               "(goodput_ratio: absolute difference of ratios).", ("metric", "reference"), group="analysis"),
    MetricSpec("soakd_drift_detected", "gauge",
               "1 while the last closed window pages: it, or the mean of the last two or three windows, is worse "
               "(latency up, throughput down) beyond the threshold against the checked baseline pool, with run-level "
               "confidence. An improvement never pages.",
               ("metric",), group="analysis"),
    MetricSpec("soakd_drift_detectable_ratio", "gauge",
               "The smallest change of a tracked quantity the live page catches within two windows (about half the "
               "time) against the baseline pool at this run's noise, in the direction a page is for (a latency's rise, a "
               "throughput's fall; set when the pool is complete; goodput_ratio in absolute terms).", ("metric",),
               group="analysis"),
    MetricSpec("soakd_drift_events_total", "counter",
               "Windows flagged as drifted against the baseline, by metric.", ("metric",), group="analysis"),
    MetricSpec("soakd_stability_spread_ratio", "gauge",
               "The method's stability figure so far: (max - min) / median over all full windows.", ("metric",),
               group="analysis"),
    MetricSpec("soakd_memory_growth_bytes_per_hour", "gauge",
               "Robust (Theil-Sen) growth across windows by source: device_memory, target_gpu_memory, target_rss "
               "(bytes per hour).", ("source",), group="analysis"),
    MetricSpec("soakd_memory_leak_suspected", "gauge",
               "1 when growth is significant and projects beyond the budget, by source (device_memory, "
               "target_gpu_memory, target_rss, kv_cache, kv_residue); after each window at the run-level live "
               "confidence (analysis.leak.live_confidence), at the end of the run the last judgement's.", ("source",),
               group="analysis"),
    MetricSpec("soakd_memory_steps", "gauge",
               "Steps of a memory staircase named as such, by source (device_memory, target_gpu_memory, target_rss): "
               "memory that grew in discrete steps with flat plateaus while KV usage stayed flat (allocator growth or "
               "graph capture per new shape, not a leak); 0 when the series is no such staircase.", ("source",),
               group="analysis"),
    MetricSpec("soakd_kv_cache_growth_ratio_per_hour", "gauge",
               "Robust growth of KV-cache usage across windows (ratio per hour), by source (kv_cache at load, "
               "kv_residue at idle).", ("source",), group="analysis"),
    MetricSpec("soakd_quiesce_kv_cache_usage_ratio", "gauge",
               "KV-cache usage measured idle in the last quiesce probe.", group="analysis"),
    MetricSpec("soakd_quiesce_gpu_memory_used_bytes", "gauge",
               "Device memory measured idle in the last quiesce probe.", group="analysis"),
    MetricSpec("soakd_quiesce_probes_total", "counter", "Quiesce probes completed.", group="analysis"),
    MetricSpec("soakd_throttle_detected", "gauge",
               "1 when the last window was throttled with an impact: a performance-relevant clocks-event reason active "
               "beyond its share, the SM clock below the baseline pool's beyond its noise (in consecutive windows) and "
               "latency or throughput drift; a power cap without impact is 0.",
               group="analysis"),
    MetricSpec("soakd_throttle_gpu_detected", "gauge",
               "1 for the GPU and clocks-event reason the last window's throttling (soakd_throttle_detected) is charged "
               "to: a heat or power-brake reason active on that GPU beyond its share; a power cap, on a node of several "
               "GPUs, only where the GPU's own SM clock fell below its own baseline beyond its noise; 0 for the others "
               "(a GPU at its power cap whose clock holds beside one that slowed).",
               ("gpu", "reason"), group="analysis"),
    MetricSpec("soakd_throttle_share_ratio", "gauge",
               "Share of the last window's samples with the clocks-event reason active.", ("reason",),
               group="analysis"),
    MetricSpec("soakd_canary_checks_total", "counter", "Canary requests sent (a fixed prompt at temperature 0).",
               group="analysis"),
    MetricSpec("soakd_canary_mismatch_total", "counter",
               "Canary outputs that differed from the run's first canary output.", group="analysis"),
    MetricSpec("soakd_canary_errors_total", "counter", "Canary requests that failed.", group="analysis"),
    MetricSpec("soakd_findings_total", "counter",
               "Findings by kind (drift, leak, throttle, canary, errors, target) and severity.",
               ("kind", "severity"), group="analysis"),
    MetricSpec("soakd_error_ratio", "gauge",
               "The share of measured requests that failed (neither ok nor cancelled), by scope: window = the last "
               "closed window the error policy judged (absent while the last had the target down or too few "
               "requests), run = every full window so far.", ("scope",), group="analysis"),
    MetricSpec("soakd_error_budget_ratio", "gauge",
               "The error policy's budgets, by scope: window = analysis.errors.window_budget (a window beyond it "
               "fails the run), run = analysis.verdict.error_budget.", ("scope",), group="analysis"),
    MetricSpec("soakd_verdict_pass", "gauge",
               "1 while no finding fails the run (analysis.verdict.fail_on), 0 once one does.", group="analysis"),
    # ---- A/B (several targets: each candidate against the reference)
    MetricSpec("soakd_ab_ratio", "gauge",
               "A/B runs: each candidate target's last closed window against the reference target's, by metric "
               "(signed relative change; error_rate and goodput_ratio: difference of ratios). Absent while the "
               "pair has no eligible window (a reference that is down gives no ratio).", ("metric", "target"),
               group="ab"),
    # ---- sweep (soakd sweep: load steps to the knee)
    MetricSpec("soakd_sweep_step", "gauge", "Index of the sweep's current step (0 = the first level).", group="sweep"),
    MetricSpec("soakd_sweep_level", "gauge",
               "The current step's load level, by mode (concurrency: requests in flight; rate: requests per second).",
               ("mode",), group="sweep"),
    MetricSpec("soakd_sweep_step_requests_per_second", "gauge",
               "Successful requests per second of each finished step, by level.", ("level",), group="sweep"),
    MetricSpec("soakd_sweep_step_latency_seconds", "gauge",
               "Latency quantiles of each finished step, by level and metric (e2e_p50, e2e_p95, ttft_p50, ttft_p95, "
               "itl_p50, itl_p95).", ("level", "metric"), group="sweep"),
    MetricSpec("soakd_sweep_knee_level", "gauge",
               "The knee's load level once the sweep found it, by mode (concurrency or rate).", ("mode",),
               group="sweep"),
    # ---- samplers (self)
    MetricSpec("soakd_sampler_up", "gauge", "1 when the sampler's last run succeeded, else 0.", ("sampler",),
               group="self"),
    MetricSpec("soakd_sampler_errors_total", "counter", "Failed sampler runs.", ("sampler",), group="self"),
    MetricSpec("soakd_sampler_missed_runs_total", "counter",
               "Sampler runs the scheduler skipped (previous run still going or the loop was late).",
               ("sampler",), group="self"),
    MetricSpec("soakd_sampler_duration_seconds", "gauge", "Duration of the sampler's last run.", ("sampler",),
               group="self"),
    MetricSpec("soakd_sampler_last_success_timestamp_seconds", "gauge",
               "Unix time of the sampler's last successful run.", ("sampler",), group="self"),
    # ---- device (NVML or dcgm-exporter), sampled every few seconds by soakd itself
    MetricSpec("soakd_gpu_info", "info", "GPU identity (value 1): index, UUID and product name.",
               ("gpu", "uuid", "name"), group="device"),
    MetricSpec("soakd_gpu_memory_used_bytes", "gauge", "Device memory in use.", ("gpu", "uuid"), group="device"),
    MetricSpec("soakd_gpu_memory_total_bytes", "gauge", "Device memory capacity.", ("gpu", "uuid"), group="device"),
    MetricSpec("soakd_gpu_memory_reserved_bytes", "gauge",
               "Device memory reserved by the driver (NVML memory info v2).", ("gpu", "uuid"), group="device"),
    MetricSpec("soakd_gpu_utilization_ratio", "gauge",
               "Share of the last sample period a kernel was running, 0-1.", ("gpu", "uuid"), group="device"),
    MetricSpec("soakd_gpu_memory_utilization_ratio", "gauge",
               "Share of the last sample period device memory was read or written, 0-1.", ("gpu", "uuid"),
               group="device"),
    MetricSpec("soakd_gpu_power_watts", "gauge", "Power draw.", ("gpu", "uuid"), group="device"),
    MetricSpec("soakd_gpu_power_limit_watts", "gauge", "Enforced power limit.", ("gpu", "uuid"), group="device"),
    MetricSpec("soakd_gpu_energy_joules_total", "counter",
               "Energy consumed since soakd started watching (monotonic across driver reloads).",
               ("gpu", "uuid"), group="device"),
    MetricSpec("soakd_gpu_temperature_celsius", "gauge", "Temperature by sensor (gpu, memory).",
               ("gpu", "uuid", "sensor"), group="device"),
    MetricSpec("soakd_gpu_sm_clock_hertz", "gauge", "Current SM clock.", ("gpu", "uuid"), group="device"),
    MetricSpec("soakd_gpu_sm_clock_max_hertz", "gauge", "Maximum SM clock.", ("gpu", "uuid"), group="device"),
    MetricSpec("soakd_gpu_memory_clock_hertz", "gauge", "Current memory clock.", ("gpu", "uuid"), group="device"),
    MetricSpec("soakd_gpu_memory_clock_max_hertz", "gauge", "Maximum memory clock.", ("gpu", "uuid"),
               group="device"),
    MetricSpec("soakd_gpu_clocks_event_active", "gauge",
               "1 while NVML reports this clocks-event (throttle) reason: sw_power_cap, hw_slowdown, sw_thermal, "
               "hw_thermal, hw_power_brake, sync_boost, applications_clocks, display_clock, idle.",
               ("gpu", "uuid", "reason"), group="device"),
    MetricSpec("soakd_gpu_throttle_seconds_total", "counter",
               "Time the GPU was held below its clocks, by reason (NVML violation counters: power, thermal, "
               "sync_boost, board_limit, low_utilization, reliability, app_clocks, base_clocks).",
               ("gpu", "uuid", "reason"), group="device"),
    MetricSpec("soakd_gpu_ecc_errors_total", "counter", "Volatile ECC errors by kind (corrected, uncorrected).",
               ("gpu", "uuid", "kind"), group="device"),
    MetricSpec("soakd_gpu_remapped_rows", "gauge",
               "Remapped memory rows by kind (correctable, uncorrectable, pending, failure).",
               ("gpu", "uuid", "kind"), group="device"),
    MetricSpec("soakd_gpu_xid_errors_total", "counter", "Critical Xid events seen since soakd started.",
               ("gpu", "uuid"), group="device"),
    MetricSpec("soakd_gpu_last_xid", "gauge", "Code of the last critical Xid event.", ("gpu", "uuid"),
               group="device"),
    MetricSpec("soakd_target_gpu_memory_used_bytes", "gauge",
               "Device memory used by the target's processes (when NVML shows them).", ("gpu", "uuid"),
               group="device"),
    # ---- inference server, normalised from its own /metrics
    MetricSpec("soakd_server_info", "info", "Detected inference server kind (vllm, sglang, tgi, trtllm, llamacpp) "
               "and the version the server says (GET /version, /get_server_info, /info or /props; empty when none).",
               ("kind", "version"), group="server"),
    MetricSpec("soakd_server_kv_cache_usage_ratio", "gauge", "KV-cache usage, 0-1 (absent when the server has "
               "no KV gauge).", group="server"),
    MetricSpec("soakd_server_requests_running", "gauge", "Requests the server is running.", group="server"),
    MetricSpec("soakd_server_requests_waiting", "gauge", "Requests queued in the server.", group="server"),
    MetricSpec("soakd_server_preemptions_total", "counter", "Requests the server preempted (or retracted).",
               group="server"),
    MetricSpec("soakd_server_generation_tokens_total", "counter",
               "Tokens the server generated since it started, by its own counter (vLLM, SGLang, TensorRT-LLM, "
               "llama.cpp; summed over engines; resets when the server restarts).", group="server"),
    MetricSpec("soakd_server_prefix_cache_hit_ratio", "gauge",
               "Prefix-cache hits / queries since the server started, 0-1.", group="server"),
    MetricSpec("soakd_server_prefix_cache_hits_total", "counter",
               "The server's prefix-cache hits since it started, by its own counter (tokens; blocks for "
               "TensorRT-LLM; summed over engines; resets when the server restarts).", group="server"),
    MetricSpec("soakd_server_prefix_cache_queries_total", "counter",
               "The server's prefix-cache queries since it started (tokens; blocks for TensorRT-LLM; hits + misses "
               "where the server counts misses).", group="server"),
    MetricSpec("soakd_server_ttft_seconds_total", "counter",
               "The server's own TTFT histogram: sum of seconds (vLLM, SGLang, trtllm-serve; summed over engines).",
               group="server"),
    MetricSpec("soakd_server_ttft_requests_total", "counter",
               "The server's own TTFT histogram: count of requests.", group="server"),
    MetricSpec("soakd_server_itl_seconds_total", "counter",
               "The server's own inter-token latency histogram: sum of seconds (vLLM, SGLang); llama.cpp's "
               "generation seconds (each slot's first token to its last, added when it ends).", group="server"),
    MetricSpec("soakd_server_itl_tokens_total", "counter",
               "The server's own inter-token latency histogram: count of gaps (vLLM, SGLang); llama.cpp's "
               "generated tokens.", group="server"),
    MetricSpec("soakd_server_process_resident_memory_bytes", "gauge",
               "The server's own process_resident_memory_bytes (Python servers: vLLM, SGLang), the target's host "
               "memory when its processes are not visible to soakd.", group="server"),
    MetricSpec("soakd_server_process_start_time_seconds", "gauge",
               "The server's own process_start_time_seconds: a new value is a restarted server.", group="server"),
    MetricSpec("soakd_server_restarts_total", "counter",
               "Server restarts soakd recognised in the server's metrics since soakd started: a new process start "
               "time, or one of its cumulative counters lower than at the previous scrape. Stays exported while the "
               "server's /metrics is away (soakd's own count: it never vanishes in an outage).", group="server"),
    # ---- host
    MetricSpec("soakd_self_resident_memory_bytes", "gauge", "soakd's resident memory (with its load workers', "
               "load.workers).", group="host"),
    MetricSpec("soakd_self_cpu_seconds_total", "counter", "soakd's CPU time (user + system; with its load workers', "
               "load.workers).", group="host"),
    MetricSpec("soakd_self_open_fds", "gauge", "soakd's open file descriptors.", group="host"),
    MetricSpec("soakd_target_resident_memory_bytes", "gauge",
               "Resident memory of the target's process(es), when visible in soakd's PID namespace.", group="host"),
    MetricSpec("soakd_target_anon_memory_bytes", "gauge",
               "Anonymous resident memory plus swap of the target's process(es) (/proc/PID/status RssAnon + VmSwap): "
               "what a heap leak grows, also once it is swapped out.", group="host"),
    MetricSpec("soakd_target_cpu_seconds_total", "counter", "CPU time of the target's process(es), when visible.",
               group="host"),
)

BY_NAME: dict[str, MetricSpec] = {m.name: m for m in CATALOGUE}


def catalogue_markdown(specs: Iterable[MetricSpec] = CATALOGUE) -> str:
    rows = ["| name | type | labels | help |", "|---|---|---|---|"]
    for m in specs:
        labels = ", ".join(f"`{label}`" for label in m.exported_labels) or "—"
        rows.append(f"| `{m.name}` | {m.kind} | {labels} | {m.help} |")
    return "\n".join(rows) + "\n"


README_START = "<!-- metrics-table:start -->"
README_END = "<!-- metrics-table:end -->"


def readme_with_table(text: str) -> str:
    """A Markdown document (docs/metrics.md) with the section between the markers replaced by the
    generated table."""
    start, end = text.index(README_START) + len(README_START), text.index(README_END)
    return text[:start] + "\n" + catalogue_markdown() + text[end:]


# ---------------------------------------------------------------------------------------------
# Instruments (single-threaded: touched only from the event loop)


class LabeledCounter:
    __slots__ = ("spec", "values")

    def __init__(self, spec: MetricSpec) -> None:
        self.spec = spec
        self.values: dict[tuple[str, ...], float] = {}

    def init(self, *labels: str) -> None:
        self.values.setdefault(labels, 0.0)

    def inc(self, labels: tuple[str, ...], amount: float = 1.0) -> None:
        v = self.values
        v[labels] = v.get(labels, 0.0) + amount

    def get(self, *labels: str) -> float:
        return self.values.get(labels, 0.0)

    def family(self) -> Metric:
        fam = self.spec.family()
        for labels, value in self.values.items():
            fam.add_metric(list(labels), value)
        return fam


class Hist:
    """One histogram child: non-cumulative counts, exposed cumulatively."""

    __slots__ = ("bounds", "counts", "sum", "_bounds_np")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self._bounds_np: np.ndarray | None = None

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.bounds, v)] += 1
        self.sum += v

    def observe_many(self, values: Iterable[float] | np.ndarray) -> None:
        """``observe(v)`` for every value; a numpy array or a long list (a batch's gaps) counted by numpy."""
        counts, bounds = self.counts, self.bounds
        if isinstance(values, np.ndarray) or (isinstance(values, list) and len(values) >= 48):
            a = np.asarray(values, dtype=np.float64)
            if not len(a):
                return
            if self._bounds_np is None:
                self._bounds_np = np.asarray(bounds, dtype=np.float64)
            binned = np.bincount(np.searchsorted(self._bounds_np, a, side="left"), minlength=len(counts)).tolist()
            for i, c in enumerate(binned):
                if c:
                    counts[i] += c
            total = 0.0
            for v in a.tolist():  # in order, as one by one: numpy's pairwise sum differs in the last bit, by machine
                total += v
            self.sum += total
            return
        total = 0.0
        for v in values:
            counts[bisect_left(bounds, v)] += 1
            total += v
        self.sum += total

    @property
    def count(self) -> int:
        return sum(self.counts)

    def buckets(self) -> list[tuple[str, float]]:
        out, acc = [], 0
        for bound, c in zip(self.bounds, self.counts):
            acc += c
            out.append((_fmt_le(bound), float(acc)))
        acc += self.counts[-1]
        out.append(("+Inf", float(acc)))
        return out


def _fmt_le(b: float) -> str:
    return repr(float(b))


class LabeledHistogram:
    __slots__ = ("spec", "children")

    def __init__(self, spec: MetricSpec) -> None:
        self.spec = spec
        self.children: dict[tuple[str, ...], Hist] = {}

    def child(self, *labels: str) -> Hist:
        h = self.children.get(labels)
        if h is None:
            h = self.children[labels] = Hist(self.spec.buckets)
        return h

    def family(self) -> Metric:
        fam = self.spec.family()
        for labels, h in self.children.items():
            fam.add_metric(list(labels), h.buckets(), h.sum)
        return fam


@dataclass
class Gauge:
    spec: MetricSpec
    value: float | None = 0.0  # None: not exported (unknown)

    def family(self) -> Metric | None:
        if self.value is None:
            return None
        fam = self.spec.family()
        fam.add_metric([], self.value)
        return fam


SnapshotSource = Callable[[], Iterable[Metric]]

TARGET_LABEL = "target"
TARGETED_NAMES = frozenset(m.family_name for m in CATALOGUE if m.targeted)


def with_target(families: Iterable[Metric], target: str) -> Iterator[Metric]:
    """The families with ``target="<name>"`` on each sample of a targeted (client-side or analysis) metric."""
    for fam in families:
        if fam.name not in TARGETED_NAMES:
            yield fam
            continue
        out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
        out.samples = [s._replace(labels={TARGET_LABEL: target, **s.labels}) for s in fam.samples]
        yield out


def merged(families: Iterable[Metric]) -> list[Metric]:
    """One family per name (the targets' families of one metric side by side), in first-seen order."""
    out: dict[str, Metric] = {}
    for fam in families:
        have = out.get(fam.name)
        if have is None:
            out[fam.name] = fam
        else:
            have.samples = [*have.samples, *fam.samples]
    return list(out.values())


@dataclass
class SoakMetrics:
    """The metric state of one soak. One per runtime (and per test): never module-global."""

    scenarios: tuple[str, ...]
    version: str = "0"
    slo_objectives: dict[str, float] = field(default_factory=dict)  # scenario -> the share that must meet its SLO
    sources: list[SnapshotSource] = field(default_factory=list)  # machine-wide (samplers): no target label
    target: str = "main"  # the target these client-side series are of
    # per target: its analysis (and, for the targets after the first, its own client-side metrics)
    target_sources: list[tuple[str, SnapshotSource]] = field(default_factory=list)
    peers: list[SoakMetrics] = field(default_factory=list)  # the other targets' client-side metrics
    log_dropped: Callable[[], int] = lambda: 0  # soakd_log_dropped_total (the runtime's: logging_setup.dropped)

    def __post_init__(self) -> None:
        S = BY_NAME
        self.requests = LabeledCounter(S["soakd_requests_total"])
        self.failures = LabeledCounter(S["soakd_request_failures_total"])
        self.prompt_tokens = LabeledCounter(S["soakd_prompt_tokens_total"])
        self.completion_tokens = LabeledCounter(S["soakd_completion_tokens_total"])
        self.usage_missing = LabeledCounter(S["soakd_usage_missing_total"])
        self.goodput = LabeledCounter(S["soakd_goodput_requests_total"])
        self.requests_impaired = LabeledCounter(S["soakd_requests_impaired_total"])
        self.warmup_requests = LabeledCounter(S["soakd_warmup_requests_total"])
        self.late_sends = LabeledCounter(S["soakd_late_sends_total"])
        self.records_lost = LabeledCounter(S["soakd_records_lost_total"])
        self.windows_closed = LabeledCounter(S["soakd_windows_closed_total"])
        self.e2e = LabeledHistogram(S["soakd_request_duration_seconds"])
        self.ttft = LabeledHistogram(S["soakd_time_to_first_token_seconds"])
        self.itl = LabeledHistogram(S["soakd_inter_token_latency_seconds"])
        self.in_flight = Gauge(S["soakd_requests_in_flight"])
        self.target_up = Gauge(S["soakd_target_up"])
        self.engine_wedged = Gauge(S["soakd_engine_wedged"])
        self.kv_cache_saturated = Gauge(S["soakd_kv_cache_saturated"])
        self.elapsed = Gauge(S["soakd_soak_elapsed_seconds"])
        self.progress = Gauge(S["soakd_soak_progress_ratio"])
        self.warmup_active = Gauge(S["soakd_warmup_active"])
        self.window_index = Gauge(S["soakd_window_index"], -1.0)
        self.run_start = Gauge(S["soakd_run_start_timestamp_seconds"])
        for sc in self.scenarios:
            for outcome in OUTCOMES:
                self.requests.init(sc, outcome)
            self.prompt_tokens.init(sc)
            self.completion_tokens.init(sc)
            self.usage_missing.init(sc)
            self.requests_impaired.init(sc)
            self.e2e.child(sc)
            self.ttft.child(sc)
            self.itl.child(sc)
        for sc in self.slo_objectives:
            self.goodput.init(sc)
        for outcome in OUTCOMES:
            self.warmup_requests.init(outcome)
        self.late_sends.init()
        self.records_lost.init()
        self.windows_closed.init()

    def _client_families(self) -> Iterator[Metric]:
        """The target's own series: requests, latency histograms, tokens, in flight, up."""
        for counter in (self.requests, self.failures, self.prompt_tokens, self.completion_tokens,
                        self.usage_missing, self.warmup_requests, self.late_sends, self.records_lost,
                        self.windows_closed,
                        self.requests_impaired):
            yield counter.family()
        for hist in (self.e2e, self.ttft, self.itl):
            yield hist.family()
        for gauge in (self.in_flight, self.target_up, self.engine_wedged, self.kv_cache_saturated):
            fam = gauge.family()
            if fam is not None:
                yield fam
        if self.slo_objectives:  # a run without SLOs exports no goodput families
            yield self.goodput.family()
            obj = BY_NAME["soakd_slo_objective_ratio"].family()
            for sc, q in sorted(self.slo_objectives.items()):
                obj.add_metric([sc], q)
            yield obj

    def _families(self) -> Iterator[Metric]:
        yield from self._client_families()
        for gauge in (self.elapsed, self.progress, self.warmup_active, self.window_index, self.run_start):
            fam = gauge.family()
            if fam is not None:
                yield fam
        info = BY_NAME["soakd_build_info"].family(labels=())
        info.add_metric([], {"version": self.version})
        yield info
        dropped = BY_NAME["soakd_log_dropped_total"].family(labels=())
        dropped.add_metric([], float(self.log_dropped()))
        yield dropped

    def collector(self) -> Collector:
        metrics = self

        def sources() -> Iterator[Metric]:
            yield from with_target(metrics._families(), metrics.target)
            for peer in metrics.peers:
                yield from with_target(peer._client_families(), peer.target)
            for target, source in metrics.target_sources:
                try:
                    yield from with_target(list(source()), target)
                except Exception:  # noqa: BLE001 - a broken snapshot source must not break /metrics
                    continue
            for source in metrics.sources:
                try:
                    yield from list(source())
                except Exception:  # noqa: BLE001 - a broken snapshot source must not break /metrics
                    continue

        class _SoakCollector(Collector):
            def collect(self) -> Iterator[Metric]:
                yield from merged(sources())

        return _SoakCollector()

    def registry(self) -> CollectorRegistry:
        reg = CollectorRegistry(auto_describe=False)
        reg.register(self.collector())
        return reg

"""Diagnosis: map a window's findings onto the method's troubleshooting table.

Rules (one window at a time; pure, no I/O):

================================  =============================  ===========================================
evidence                          diagnosis                      rule
================================  =============================  ===========================================
target down + failed requests     ``target restarted``           ``target_down_seconds > 0`` (soakd_target_up
                                                                 was 0); critical when requests failed
                                                                 (connection_error, http_error, timeout);
                                                                 the window's degraded throughput and
                                                                 error-rate drift is the outage's
timeouts                          ``overload``                   timeout share > ``timeout_share`` while the
                                                                 target stayed up; queue depth as evidence
invalid responses                 ``garbled output``             any ``invalid_response``; critical above
                                                                 ``invalid_share_critical``
HTTP / connection errors          ``server errors``              share > ``error_share`` with the target up
performance drift + throttling    ``throttling``                 a degraded latency/throughput drift and a
                                                                 detected throttle reason in the same window
throttling alone                  ``throttling``                 warning: no measurable latency impact (yet)
long context slower than chat     ``bandwidth or cache           see below
                                  pressure``
growing idle KV residue,          ``KV cache not released``      ``kv_residue`` or ``kv_cache`` suspected
growing KV usage at same load
KV pinned full, no tokens         ``KV cache saturated``         ``soakd.analysis.kvsat`` (window close and
                                                                 the live wedge watch)
growing device / process memory   ``memory leak``                ``device_memory``, ``target_gpu_memory`` or
                                                                 ``target_rss`` suspected
memory in steps, KV flat          ``memory steps``               a byte source's pattern is ``staircase`` (two
                                                                 steps or more, flat plateaus, not projected
                                                                 to run out within the budget) and KV usage is
                                                                 flat (``LeakResult.memory_steps``); warning
other degraded drift              ``performance drift``          degraded drift no rule above explains
================================  =============================  ===========================================

Long context vs short chat: for ``e2e_p95`` and ``ttft_p95``, the ``long_context`` scenario
of the window is compared with the same scenario of the baseline (``drift.compare`` with the
drift threshold and confidence) and so is ``short_chat``. The rule fires when long context
has drifted (status ``drift``, degraded: rise above the threshold with confidence) **and** it
rose more than short chat by more than the threshold, ``rel = (1 + r_long) / (1 + r_short) - 1
> threshold``, **and** rose more than short chat with confidence (the interval of ``rel``, from
the two ratio intervals by ``stats.ratio_ci``, lies above 0). Uniform slow-downs (throttling,
a slower build) raise both alike; a long-context-only rise points at memory bandwidth or cache
misses (prefix cache, KV-cache eviction and recomputation).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from soakd.analysis.drift import DriftResult, compare
from soakd.analysis.leak import LeakResult
from soakd.analysis.stats import ratio_ci
from soakd.analysis.throttle import ThrottleResult
from soakd.config.analysis import DiagnosisConfig, DriftConfig
from soakd.core.summary import WindowSummary
from soakd.core.tracked import METRICS

__all__ = ["DIAGNOSES", "TROUBLESHOOTING", "Finding", "diagnose"]

Window = WindowSummary
Kind = Literal["drift", "leak", "throttle", "canary", "errors", "freeze", "target", "ab", "gpu"]
Severity = Literal["info", "warning", "critical"]

# diagnosis -> (what is seen, what to check): the method's troubleshooting table, for the report.
TROUBLESHOOTING: dict[str, tuple[str, str]] = {
    "GPU Xid error": (
        "the GPU driver reported a critical Xid event (NVML): the GPU faulted, whatever latency did",
        "the Xid code's meaning and action (README: GPU errors), dmesg/journalctl -k, nvidia-smi -q, "
        "nvidia-bug-report.sh",
    ),
    "uncorrectable ECC error": (
        "new uncorrected (double-bit) ECC errors in device memory during the run",
        "nvidia-smi -q -d ECC,ROW_REMAPPER (remapping pending: reset the GPU); repeated errors: replace the GPU",
    ),
    "throttling": (
        "latency or throughput drift while a power or thermal clocks-event reason is active",
        "cooling (airflow, inlet temperature), power cap and power-brake settings, SM clock history",
    ),
    "KV cache not released": (
        "memory that keeps rising: idle KV usage that does not return to its first idle value",
        "request cancellation and abort paths, prefix-cache eviction, server version",
    ),
    "memory leak": (
        "device or process memory that keeps rising at the same load",
        "allocator caching, CUDA graphs per new shape, host-side buffers, server version",
    ),
    "memory steps": (
        "device or process memory that grew in discrete steps with flat plateaus between them while KV-cache "
        "usage stayed flat: allocator growth or a CUDA graph captured per new batch shape or sequence length, "
        "not a linear leak",
        "the server's graph-capture sizes (vLLM cudagraph_capture_sizes, --enforce-eager to compare), the "
        "allocator (PYTORCH_CUDA_ALLOC_CONF expandable_segments), new max prompt/batch shapes at each step; "
        "if the steps keep coming, cap the shapes or leave the headroom",
    ),
    "periodic drops": (
        "latency that rises at a steady period (minutes to hours)",
        "cooling cycles (fan curves, inlet temperature), power management, a periodic job on the host or cluster",
    ),
    "engine wedged": (
        "requests in flight and not a byte from any of them (or the server's token counter still while it runs "
        "requests) while the server still answers /health and /v1/models",
        "the engine's logs and stack (py-spy dump of the engine core), a scheduler or collective deadlock, "
        "GPU hangs (Xid); restart the server and note the uptime it wedged at",
    ),
    "KV cache saturated": (
        "KV-cache usage pinned near 100% while the server runs requests and generates (almost) no tokens: out of "
        "KV blocks, not deadlocked (soakd.analysis.kvsat)",
        "preemptions (vllm:num_preemptions_total), leaked blocks (idle usage after a quiesce), admission and "
        "max_num_seqs / max_num_batched_tokens against gpu_memory_utilization, prompt + output lengths vs the "
        "cache; restart the server to free it",
    ),
    "server froze": (
        "requests in flight and not a byte from any of them for seconds, while soakd's own loop was punctual",
        "the server's logs and stack (py-spy dump), GPU hangs (Xid), a scheduler deadlock, a stuck collective",
    ),
    "target restarted": (
        "an error burst while the target was down",
        "server logs and exit codes, OOM kills, liveness-probe restarts",
    ),
    "overload": (
        "requests timing out while the server stays up",
        "concurrency vs the knee, server queue depth, max batch settings, timeouts",
    ),
    "garbled output": (
        "invalid responses (replacement characters, empty output, degenerate repetition)",
        "weights and quantisation, tokenizer, kernels of the new stack",
    ),
    "output changed": (
        "the canary prompt (greedy, fixed seed) answered differently from its reference output",
        "weights and quantisation, tokenizer, kernels of the new stack; batch-variant kernels when it changes "
        "only under load",
    ),
    "server errors": (
        "HTTP or connection errors while the target is up",
        "API format differences, request limits (context length, max_tokens), server logs",
    ),
    "bandwidth or cache pressure": (
        "long generations and long contexts slowing down faster than short chat",
        "memory bandwidth, KV-cache evictions and recomputation, prefix-cache hit rate",
    ),
    "performance drift": (
        "a tracked metric moved beyond its threshold with confidence, without a recognised cause",
        "compare the window's device, server and error evidence with the baseline",
    ),
    "confident drift": (
        "at the end of the run: a level that differs from the baseline beyond the threshold, with confidence, "
        "from some window on",
        "what changed at that time: a deploy, the driver, the thermal state, other tenants of the machine",
    ),
    "likely drift": (
        "at the end of the run: a level beyond the threshold whose change is significant but whose interval "
        "reaches inside the threshold (reported, not failing)",
        "a longer run or more requests per window would settle it",
    ),
    "creep": (
        "a level that moves steadily over the run (Mann-Kendall with autocorrelation, Sen's slope)",
        "fragmentation, growing caches or queues, rising temperature",
    ),
    "power-capped, healthy": (
        "a power or thermal clocks-event reason active with the SM clock and latency where they were at the "
        "baseline",
        "nothing: the GPU runs at its limit under full load",
    ),
}
DIAGNOSES: tuple[str, ...] = tuple(TROUBLESHOOTING)

_PERF_METRICS = frozenset(
    m for m, s in METRICS.items() if s.kind in ("quantile", "tokens_rate", "requests_rate")
)
# What an outage moves by itself: a window with the target down loses throughput and gains errors.
# (Latency quantiles come from successful requests only: an outage does not explain them.)
_OUTAGE_METRICS = frozenset(
    m for m, s in METRICS.items() if s.kind in ("tokens_rate", "requests_rate", "error_rate")
)


@dataclass(frozen=True)
class Finding:
    kind: Kind
    diagnosis: str
    severity: Severity
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)
    window: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def _outcomes(window: Window) -> tuple[int, dict[str, int]]:
    return window.requests, {k: int(v or 0) for k, v in window.outcomes.items()}


def _degraded(results: Iterable[DriftResult], metrics: frozenset[str]) -> list[DriftResult]:
    """Degraded drift results for ``metrics``, one per metric (baseline preferred)."""
    best: dict[str, DriftResult] = {}
    for r in results:
        if r.status == "drift" and r.direction == "degraded" and r.metric in metrics and r.scenario is None:
            if r.metric not in best or (best[r.metric].reference != "baseline" and r.reference == "baseline"):
                best[r.metric] = r
    return list(best.values())


def _drift_text(rs: list[DriftResult]) -> str:
    return "; ".join(
        f"{r.metric} {_pct(r.ratio)} vs {r.reference}" if not METRICS[r.metric].absolute
        else f"{r.metric} {r.ratio * 100:+.1f}pp vs {r.reference}"
        for r in rs
    )  # fmt: skip


def diagnose(
    window: Window,
    drift_results: Iterable[DriftResult] = (),
    throttle_results: Iterable[ThrottleResult] = (),
    leak_results: Iterable[LeakResult] = (),
    kv_residue_result: LeakResult | None = None,
    target_down_seconds: float | None = None,
    baseline: Window | None = None,
    *,
    drift_cfg: DriftConfig | None = None,
    cfg: DiagnosisConfig | None = None,
) -> list[Finding]:
    """Findings of one window (see the module docstring for the rules).

    ``target_down_seconds`` defaults to the window's own; ``baseline`` (its per-scenario stats)
    enables the long-context rule. Leak results are run-level; pass them at the window where
    they were evaluated.
    """
    cfg = cfg or DiagnosisConfig()
    drift_cfg = drift_cfg or DriftConfig()
    drift_results = list(drift_results)
    throttles = [t for t in throttle_results if t.detected]
    idx = window.window
    out: list[Finding] = []
    n, oc = _outcomes(window)
    down = target_down_seconds if target_down_seconds is not None else window.target_down_seconds

    explained: set[str] = set()  # drifted metrics a finding below accounts for

    # --- target and errors
    failed = oc.get("connection_error", 0) + oc.get("http_error", 0) + oc.get("timeout", 0)
    if down > 0:
        # the throughput lost and the errors gained while the target was down are the restart's
        # drift, not a performance drift of unknown cause
        outage = _degraded(drift_results, _OUTAGE_METRICS)
        explained |= {r.metric for r in outage}
        out.append(Finding(
            kind="target", diagnosis="target restarted", severity="critical" if failed else "warning",
            message=(
                f"target down {down:.0f}s in window {idx}; {failed} of {n} requests failed "
                f"(connection_error {oc.get('connection_error', 0)}, http_error {oc.get('http_error', 0)}, "
                f"timeout {oc.get('timeout', 0)})" + (f"; from the outage: {_drift_text(outage)}" if outage else "")
            ),
            evidence={"target_down_seconds": down, "outcomes": oc, "requests": n,
                      "drift": [r.to_dict() for r in outage]}, window=idx,
        ))  # fmt: skip
    if n and down <= 0:
        share = oc.get("timeout", 0) / n
        if share > cfg.timeout_share:
            rw = window.server.requests_waiting
            waiting = rw.model_dump() if rw is not None else {}
            q = ""
            if waiting.get("mean") is not None:
                q = f"; server queue mean {waiting['mean']:.1f}, max {waiting.get('max') or 0:.0f}"
            out.append(Finding(
                kind="errors", diagnosis="overload",
                severity="critical" if share > 5 * cfg.timeout_share else "warning",
                message=f"{oc.get('timeout', 0)} of {n} requests timed out ({share * 100:.1f}%) in window {idx}{q}",
                evidence={"timeout_share": share, "timeouts": oc.get("timeout", 0), "requests": n,
                          "requests_waiting": waiting or None},
                window=idx,
            ))  # fmt: skip
        share = (oc.get("http_error", 0) + oc.get("connection_error", 0)) / n
        if share > cfg.error_share:
            out.append(Finding(
                kind="errors", diagnosis="server errors", severity="warning",
                message=(
                    f"{oc.get('http_error', 0)} HTTP and {oc.get('connection_error', 0)} connection errors of {n} "
                    f"requests ({share * 100:.1f}%) in window {idx} with the target up"
                ),
                evidence={"error_share": share, "outcomes": oc, "requests": n}, window=idx,
            ))  # fmt: skip
    if n and oc.get("invalid_response", 0) > 0:
        share = oc["invalid_response"] / n
        out.append(Finding(
            kind="errors", diagnosis="garbled output",
            severity="critical" if share > cfg.invalid_share_critical else "warning",
            message=f"{oc['invalid_response']} of {n} responses invalid ({share * 100:.2f}%) in window {idx}",
            evidence={"invalid_share": share, "invalid_responses": oc["invalid_response"], "requests": n},
            window=idx,
        ))  # fmt: skip

    # --- throttling, with or without performance drift
    perf = _degraded(drift_results, _PERF_METRICS)
    if throttles:
        t_text = "; ".join(t.message() for t in throttles)
        kinds = sorted({t.kind for t in throttles})
        if perf:
            explained |= {r.metric for r in perf}
            out.append(Finding(
                kind="throttle", diagnosis="throttling", severity="critical",
                message=f"{_drift_text(perf)} with {'/'.join(kinds)} throttling: {t_text}",
                evidence={"drift": [r.to_dict() for r in perf], "throttle": [t.to_dict() for t in throttles]},
                window=idx,
            ))  # fmt: skip
        else:
            out.append(Finding(
                kind="throttle", diagnosis="throttling", severity="warning",
                message=f"{'/'.join(kinds)} throttling without measurable latency drift: {t_text}",
                evidence={"throttle": [t.to_dict() for t in throttles]}, window=idx,
            ))  # fmt: skip

    # --- long context slowing down faster than short chat (only where the window has drifted)
    if perf and baseline is not None and baseline.window != idx:
        scen, base_scen = window.scenarios, baseline.scenarios
        long_s, short_s = cfg.long_scenario, cfg.short_scenario
        if all(s in scen and s in base_scen for s in (long_s, short_s)):
            hits = []
            for metric in ("e2e_p95", "ttft_p95"):
                rl = compare(window, baseline, metric, drift_cfg, scenario=long_s)
                rs = compare(window, baseline, metric, drift_cfg, scenario=short_s)
                if rl.status != "drift" or rl.direction != "degraded" or rs.ratio is None or rs.ratio_ci is None:
                    continue
                rel = (1 + rl.ratio) / (1 + rs.ratio) - 1
                rc = ratio_ci(
                    (1 + rl.ratio_ci[0], 1 + rl.ratio_ci[1]), (1 + rs.ratio_ci[0], 1 + rs.ratio_ci[1]),
                    1 + rl.ratio, 1 + rs.ratio,
                )  # fmt: skip
                if rel > rl.threshold and rc is not None and rc[0] - 1 > 0:
                    hits.append((metric, rl, rs, rel))
            if hits:
                text = "; ".join(
                    f"{m} {long_s} {_pct(rl.ratio)} vs {short_s} {_pct(rs.ratio)} (relative {_pct(rel)})"
                    for m, rl, rs, rel in hits
                )
                out.append(Finding(
                    kind="drift", diagnosis="bandwidth or cache pressure", severity="warning",
                    message=f"long context slowing faster than short chat vs baseline in window {idx}: {text}",
                    evidence={"comparisons": [
                        {"metric": m, "long": rl.to_dict(), "short": rs.to_dict(), "relative": rel}
                        for m, rl, rs, rel in hits
                    ]},
                    window=idx,
                ))  # fmt: skip

    # --- leaks (run-level trends, reported at this window)
    leaks = [r for r in leak_results if r.suspected]
    if kv_residue_result is not None and kv_residue_result.suspected and kv_residue_result not in leaks:
        leaks.append(kv_residue_result)
    for r in leaks:
        diag = "KV cache not released" if r.source in ("kv_cache", "kv_residue") else "memory leak"
        out.append(Finding(kind="leak", diagnosis=diag, severity="critical", message=r.message(),
                           evidence=r.to_dict(), window=idx))  # fmt: skip
    # --- memory in steps at flat KV usage: named, not accused (an unbounded staircase is suspected above)
    for r in leak_results:
        if r.memory_steps:
            out.append(Finding(kind="leak", diagnosis="memory steps", severity="warning", message=r.message(),
                               evidence={**r.to_dict(), "fails": False}, window=idx))  # fmt: skip

    # --- degraded drift that nothing above explains
    rest = [r for r in _degraded(drift_results, frozenset(METRICS)) if r.metric not in explained]
    if rest:
        out.append(Finding(
            kind="drift", diagnosis="performance drift", severity="warning",
            message=f"window {idx}: {_drift_text(rest)}",
            evidence={"drift": [r.to_dict() for r in rest]}, window=idx,
        ))  # fmt: skip
    return out

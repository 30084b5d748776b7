"""Diagnosis: a window's findings mapped onto the method's troubleshooting table — outages, errors,
throttling, a falling prefix-cache hit rate, bandwidth pressure, leaks, SLO goodput, performance drift (one window at a time; pure,
no I/O). The rules, and the long-context-versus-short-chat test, are in docs/analysis.md#derivation-diagnosispy;
each diagnosis's words (what is seen, what to check) are its registry entry (``soakd.core.findings``).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

from soakd.analysis.drift import DriftResult, compare
from soakd.analysis.leak import LeakResult
from soakd.analysis.stats import ratio_ci
from soakd.analysis.throttle import ThrottleResult
from soakd.config.analysis import DiagnosisConfig, DriftConfig
from soakd.core.findings import DIAGNOSES as REGISTRY
from soakd.core.findings import Finding, Severity
from soakd.core.summary import WindowSummary
from soakd.core.tracked import METRICS

__all__ = ["TROUBLESHOOTING", "Finding", "Severity", "diagnose"]

Window = WindowSummary

# diagnosis -> (what is seen, what to check): the method's troubleshooting table, from the registry
TROUBLESHOOTING: dict[str, tuple[str, str]] = {d.name: (d.seen, d.check) for d in REGISTRY.values()}

_PERF_METRICS = frozenset(
    m for m, s in METRICS.items() if s.kind in ("quantile", "tokens_rate", "requests_rate")
)
# Invalid-response reasons a stream gets when the server goes away under it (counted with the outage in a window
# with the target down).
_CUT_BY_OUTAGE = ("error_in_stream", "truncated_stream")
# What an outage moves by itself: a window with the target down loses throughput and gains errors.
# (Latency quantiles come from successful requests only: an outage does not explain them.)
_OUTAGE_METRICS = frozenset(
    m for m, s in METRICS.items() if s.kind in ("tokens_rate", "requests_rate", "error_rate")
)


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def _outcomes(window: Window) -> tuple[int, dict[str, int]]:
    return window.requests, {k: int(v or 0) for k, v in window.outcomes.items()}


def performance_drift(results: Iterable[DriftResult]) -> list[DriftResult]:
    """Latency or throughput drift, degraded, in a window's comparisons: what makes an active throttle
    reason with its clock beyond its noise throttling (``soakd.analysis.throttle``). A page over several
    windows counts only where this window's own change points the same way (a segment paged on the windows
    before it, with this one back at the baseline, is no impact of this window's clock)."""
    return [r for r in _degraded(results, _PERF_METRICS) if _worse_change(r) > 0]


def performance_steady(results: Iterable[DriftResult]) -> bool:
    """Whether a window's latency and throughput were judged against the baseline (some comparison not
    'insufficient') and none of them is worse by more than its threshold, paged or not: what 'a clock drop
    that costs nothing' needs. A window too thin to judge, or one whose latency rose beyond the threshold
    without a page (a noisy run: seen, e2e p50 +150% at a -50% clock under a pool whose noise hid it), says
    nothing of the kind."""
    judged = [r for r in results if r.metric in _PERF_METRICS and r.scenario is None and r.reference == "baseline"
              and r.status != "insufficient" and r.ratio is not None]
    return bool(judged) and not any(_worse_change(r) > r.threshold for r in judged)


def _worse_change(r: DriftResult) -> float:
    """The window's own change against its reference, positive where it is worse (latency up, throughput down)."""
    return r.ratio if METRICS[r.metric].higher_is_worse else -r.ratio


def _degraded(results: Iterable[DriftResult], metrics: frozenset[str]) -> list[DriftResult]:
    """Degraded drift results for ``metrics``, one per metric (baseline preferred)."""
    best: dict[str, DriftResult] = {}
    for r in results:
        if r.status == "drift" and r.direction == "degraded" and r.metric in metrics and r.scenario is None:
            if r.metric not in best or (best[r.metric].reference != "baseline" and r.reference == "baseline"):
                best[r.metric] = r
    return list(best.values())


def reference_hit_ratio(pool: Sequence[Window], baseline: Window | None = None) -> float | None:
    """The prefix cache's hit rate the baseline pool had: the median of its windows' (the baseline window's
    alone without a pool), None where the server exports no prefix-cache counters."""
    ratios = [w.server.prefix_cache_hit_ratio for w in pool if w.server.prefix_cache_hit_ratio is not None]
    if not ratios and baseline is not None and baseline.server.prefix_cache_hit_ratio is not None:
        ratios = [baseline.server.prefix_cache_hit_ratio]
    return statistics.median(ratios) if ratios else None


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
    pool: Sequence[Window] = (),
    drift_cfg: DriftConfig | None = None,
    cfg: DiagnosisConfig | None = None,
) -> list[Finding]:
    """Findings of one window (see the module docstring for the rules).

    ``target_down_seconds`` defaults to the window's own; ``baseline`` (its per-scenario stats)
    enables the long-context rule; ``pool`` (the baseline pool's windows) gives the prefix cache's
    reference hit rate. Leak results are run-level; pass them at the window where they were evaluated.
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
    # streams the outage cut (an error event in the stream, no [DONE]: vLLM's engine dying under SIGTERM
    # sends "EngineCore encountered an issue" to the streams in flight) are the outage's, not garbled output
    cut = sum((window.failures or {}).get(r, 0) for r in _CUT_BY_OUTAGE) if down > 0 else 0
    invalid = max(0, oc.get("invalid_response", 0) - cut)
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
                f"timeout {oc.get('timeout', 0)})" + (f"; {cut} streams cut by it" if cut else "")
                + (f"; from the outage: {_drift_text(outage)}" if outage else "")
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
    if n and invalid > 0:
        share = invalid / n
        out.append(Finding(
            kind="errors", diagnosis="garbled output",
            severity="critical" if share > cfg.invalid_share_critical else "warning",
            message=f"{invalid} of {n} responses invalid ({share * 100:.2f}%) in window {idx}",
            evidence={"invalid_share": share, "invalid_responses": invalid, "requests": n},
            window=idx,
        ))  # fmt: skip

    # --- throttling: a detected throttle has performance drift (its impact needs it); without it an active
    # reason is "power-capped, healthy" (soakd.analysis.detector.PowerCapDetector), never a failing finding
    perf = _degraded(drift_results, _PERF_METRICS)
    if throttles and perf:
        t_text = "; ".join(t.message() for t in throttles)
        kinds = sorted({t.kind for t in throttles})
        explained |= {r.metric for r in perf}
        out.append(Finding(
            kind="throttle", diagnosis="throttling", severity="critical",
            message=f"{_drift_text(perf)} with {'/'.join(kinds)} throttling: {t_text}",
            evidence={"drift": [r.to_dict() for r in perf], "throttle": [t.to_dict() for t in throttles]},
            window=idx,
        ))  # fmt: skip

    # --- the prefix cache's hit rate fell (eviction under fragmentation, a cache shrunk by a leak): cached
    # prompts are prefilled again, so TTFT rises, and with it e2e, and throughput falls. A cache explains
    # nothing without a TTFT drift, and never the inter-token latency (decode does not read the prefix cache).
    # The server's own TTFT mean (judged where soakd lagged) is the same prefill: explained with the rest (seen: a
    # loaded run's window 6, "prefix cache hit rate fell" and beside it "server_ttft_mean +185.2%" of unknown cause).
    cache = [r for r in _degraded(drift_results, _PERF_METRICS | {"server_ttft_mean"})
             if r.metric not in explained and not r.metric.startswith("itl_")]
    hit = window.server.prefix_cache_hit_ratio
    ref = reference_hit_ratio(pool, baseline)
    if (any(r.metric.startswith(("ttft_", "server_ttft")) for r in cache) and hit is not None and ref is not None
            and ref - hit >= cfg.prefix_hit_drop - 1e-9):  # fmt: skip
        explained |= {r.metric for r in cache}
        out.append(Finding(
            kind="drift", diagnosis="prefix cache hit rate fell", severity="warning",
            message=(f"the server's prefix-cache hit rate {hit * 100:.1f}% in window {idx}, {ref * 100:.1f}% in the "
                     f"baseline pool: {_drift_text(cache)}"),
            evidence={"prefix_cache_hit_ratio": hit, "reference_hit_ratio": ref, "drop": ref - hit,
                      "drift": [r.to_dict() for r in cache]},
            window=idx,
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

    # --- the share of requests meeting their SLO fell: its own finding (kind slo)
    slo = [r for r in _degraded(drift_results, frozenset({"goodput_ratio"})) if r.metric not in explained]
    if slo:
        explained |= {r.metric for r in slo}
        out.append(Finding(
            kind="slo", diagnosis="SLO goodput dropped", severity="warning",
            message=f"window {idx}: requests meeting their SLO {_drift_text(slo)}",
            evidence={"drift": [r.to_dict() for r in slo]}, window=idx,
        ))  # fmt: skip

    # --- degraded drift that nothing above explains
    rest = [r for r in _degraded(drift_results, frozenset(METRICS)) if r.metric not in explained]
    if rest:
        out.append(Finding(
            kind="drift", diagnosis="performance drift", severity="warning",
            message=f"window {idx}: {_drift_text(rest)}",
            evidence={"drift": [r.to_dict() for r in rest]}, window=idx,
        ))  # fmt: skip
    return out

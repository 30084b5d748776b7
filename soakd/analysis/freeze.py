"""Silence with requests in flight: the window's server freeze (at its close, from the activity
buckets of ``ClientStats``) and the live engine wedge (``soakd.soak.wedge``), one rule for both.

(derivation: docs/analysis.md#derivation-freezepy)
"""

from __future__ import annotations

import math
from typing import Any

from soakd.core.findings import Finding
from soakd.config import AnalysisConfig
from soakd.core.summary import WindowSummary as Window

__all__ = ["FALSE_FREEZES", "freeze_finding", "freeze_threshold", "hung_finding", "natural_silences", "wedge_finding"]

FALSE_FREEZES = 0.01  # natural silences as long, with as many requests silent, expected per run: at most this
ALPHA = (1.2, 10.0)  # the inter-token tail index estimated from p95 and p99, clipped to this
Z_TAIL = 2.326  # the tail index's one-sided 99% bound: a heavier tail than measured, never a lighter one


def freeze_threshold(cfg: AnalysisConfig, ref: Window | None) -> float:
    if ref is None:
        return cfg.client.freeze_min
    return max(cfg.client.freeze_min, 3.0 * (ref.ttft_seconds.p95 or 0.0), 3.0 * (ref.itl_seconds.p99 or 0.0))


def natural_silences(span: float, requests: int | None, ref: Window | None, windows: int) -> float | None:
    """How many silences of ``span`` seconds with ``requests`` streams silent through it (or its second half) a healthy
    server with the reference's inter-token tail makes in a run of ``windows`` windows like it (None: the reference
    cannot say). The tail is Pareto from the reference's ITL p95 and p99 (index ln 5 / ln(p99/p95)): one stream
    begins a gap that long (each gap's chance s(span)), the others sit in gaps covering half of it (the residual
    chance r(span / 2), the inspection paradox's heavier tail). Sparse streams with heavy tails make long silences
    of one or two streams routinely; a frozen server silences every stream in flight and each new one."""
    itl = ref.itl_seconds if ref is not None else None
    if requests is None or itl is None or not itl.count or not itl.mean or not itl.p95 or not itl.p99:
        return None
    p95, p99 = itl.p95, itl.p99
    if p99 <= p95:
        return None
    # ln(p99/p95) = ln 5 / alpha; its standard error, dominated by p99's (0.01 n gaps beyond it), is about
    # 1 / (alpha sqrt(0.01 n)): the bound widens the ratio by that many standard errors (a heavier tail)
    ratio = math.log(p99 / p95) * (1.0 + Z_TAIL / (math.log(5.0) * math.sqrt(0.01 * itl.count)))
    alpha = min(ALPHA[1], max(ALPHA[0], math.log(5.0) / ratio))
    if span <= p99:
        return math.inf

    def residual(x: float) -> float:  # P(a stream in flight at a random moment stays silent x more)
        if x <= p99:
            return 1.0
        return min(1.0, 0.01 * p99 * (x / p99) ** (1.0 - alpha) / ((alpha - 1.0) * itl.mean))

    gap = 0.01 * (span / p99) ** -alpha
    return itl.count * max(1, windows) * gap * residual(span / 2) ** max(0, requests - 1)


def freeze_finding(w: Window, need: float, ref: Window | None = None, windows: int = 48) -> Finding | None:
    """The window's longest silence with requests in flight, when it is a freeze: past ``need`` and not what the
    reference's own inter-token tail makes in a run (``natural_silences``)."""
    c = w.client
    if c is None or not c.freeze_max_seconds:
        return None
    span = c.freeze_max_seconds
    if span < need or (c.loop_lag_max_seconds or 0.0) >= span / 2:
        return None
    natural = natural_silences(span, c.freeze_requests, ref if ref is not None else w, windows)
    if natural is not None and natural > FALSE_FREEZES:
        return None
    at = (w.start_unix or 0.0) + (c.freeze_start_offset_seconds or 0.0)
    return Finding(kind="freeze", diagnosis="server froze", severity="critical",
                   message=f"no token from any of the requests in flight for {span:.1f} s in window {w.window} "
                           f"(from {at:.0f} unix), soakd's loop lag at most {(c.loop_lag_max_seconds or 0) * 1000:.0f} ms",
                   evidence={"freeze_seconds": span, "start_unix": at, "threshold_seconds": need,
                             "loop_lag_max_seconds": c.loop_lag_max_seconds, "silent_requests": c.freeze_requests,
                             "natural_per_run": natural}, window=w.window)  # fmt: skip


def wedge_finding(ep: dict[str, Any]) -> Finding:
    """A live wedge: requests in flight and no token from any of them (``streams``), or requests running on
    the server and its token counter still (``server_tokens``), while the server answers GET /v1/models."""
    sources = ep.get("sources") or ["streams"]
    seen = []
    if "streams" in sources:
        seen.append(f"no token from any of the {ep['in_flight']} requests in flight for {ep['silence_seconds']:.1f} s")
    if "server_tokens" in sources:
        seen.append(f"the server's generated-token counter still at {ep['server_generation_tokens_total']:.0f} for "
                    f"{ep['server_tokens_flat_seconds']:.1f} s with {ep['server_requests_running']:.0f} requests "
                    "running")
    elif ep.get("server_tokens_flat_seconds") is not None:
        seen.append(f"its token counter flat for {ep['server_tokens_flat_seconds']:.1f} s so far")
    diagnosis = ep.get("diagnosis") or "engine wedged"
    tail = "its engine generates nothing"
    if diagnosis == "KV cache saturated":  # soakd.analysis.kvsat: out of KV blocks, not deadlocked
        waiting = ep.get("server_requests_waiting")
        tail = (f"its KV cache is full ({ep['server_kv_cache_usage_ratio']:.1%} used, "
                f"{ep.get('server_requests_running') or 0:.0f} running"
                + (f", {waiting:.0f} waiting" if waiting is not None else "") + "): the engine is out of KV blocks")
    return Finding(kind="freeze", diagnosis=diagnosis, severity="critical",
                   message="; ".join(seen) + f" (threshold {ep['threshold_seconds']:.1f} s) while the server still "
                           f"answers GET /v1/models: {tail}",
                   evidence=dict(ep), window=ep.get("window"))


def hung_finding(ep: dict[str, Any]) -> Finding:
    """A live hang: requests in flight, no progress from any of them, and GET /models timed out too."""
    return Finding(kind="target", diagnosis="target hung", severity="critical",
                   message=f"no progress from any of the {ep['in_flight']} requests in flight for "
                           f"{ep['silence_seconds']:.1f} s and GET /models did not answer within "
                           f"{ep['probe_timeout_seconds']:.1f} s: the whole server hangs (stopped, or its front end "
                           "blocked); soakd_target_up is 0 until it answers",
                   evidence=dict(ep), window=ep.get("window"))

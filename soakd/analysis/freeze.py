"""Silence with requests in flight: the window's server freeze (at its close, from the activity
buckets of ``ClientStats``) and the live engine wedge (``soakd.soak.wedge``), one rule for both.

(derivation: docs/analysis.md#derivation-freezepy)
"""

from __future__ import annotations

from typing import Any

from soakd.core.findings import Finding
from soakd.config import AnalysisConfig
from soakd.core.summary import WindowSummary as Window

__all__ = ["freeze_finding", "freeze_threshold", "hung_finding", "wedge_finding"]


def freeze_threshold(cfg: AnalysisConfig, ref: Window | None) -> float:
    if ref is None:
        return cfg.client.freeze_min
    return max(cfg.client.freeze_min, 3.0 * (ref.ttft_seconds.p95 or 0.0), 3.0 * (ref.itl_seconds.p99 or 0.0))


def freeze_finding(w: Window, need: float) -> Finding | None:
    """The window's longest silence with requests in flight, when it is a freeze."""
    c = w.client
    if c is None or not c.freeze_max_seconds:
        return None
    span = c.freeze_max_seconds
    if span < need or (c.loop_lag_max_seconds or 0.0) >= span / 2:
        return None
    at = (w.start_unix or 0.0) + (c.freeze_start_offset_seconds or 0.0)
    return Finding(kind="freeze", diagnosis="server froze", severity="critical",
                   message=f"no token from any of the requests in flight for {span:.1f} s in window {w.window} "
                           f"(from {at:.0f} unix), soakd's loop lag at most {(c.loop_lag_max_seconds or 0) * 1000:.0f} ms",
                   evidence={"freeze_seconds": span, "start_unix": at, "threshold_seconds": need,
                             "loop_lag_max_seconds": c.loop_lag_max_seconds}, window=w.window)  # fmt: skip


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

"""KV cache saturated and stuck: the server's KV-cache usage pinned near full while it runs requests and
generates (almost) nothing. Not a deadlock but an engine out of KV blocks, with other things to check,
so it has its own diagnosis, ``KV cache saturated`` (kind ``freeze``): found live (:func:`wedge_diagnosis`)
and at the window's close (:func:`kv_saturated_finding`); one fault, one finding, one page.

(derivation: docs/analysis.md#derivation-kvsatpy)
"""

from __future__ import annotations

from typing import Any

from soakd.core.findings import Finding
from soakd.config.analysis import KvSaturationConfig
from soakd.core.summary import WindowSummary as Window

__all__ = ["DIAGNOSIS", "kv_saturated_finding", "wedge_diagnosis"]

DIAGNOSIS = "KV cache saturated"


def wedge_diagnosis(kv: float | None, running: float | None, cfg: KvSaturationConfig) -> str | None:
    """The live wedge's name when its server's latest scrape shows the cache pinned with requests running."""
    if kv is not None and running is not None and running > 0 and kv >= cfg.ratio:
        return DIAGNOSIS
    return None


def _need(cfg: KvSaturationConfig, ref: Window | None) -> float:
    e2e = ref.e2e_seconds.p99 if ref is not None else None
    return max(cfg.min_seconds, 3.0 * (e2e or 0.0))


def kv_saturated_finding(w: Window, ref: Window | None, cfg: KvSaturationConfig) -> Finding | None:
    """The window's KV-saturated-and-stuck span, when there is one (``ref``: the baseline, not ``w`` itself)."""
    sat = w.server.kv_saturated
    if sat is None or not sat.longest_seconds:
        return None
    need = _need(cfg, ref)
    ref_rate = ref.server.generation_tokens_per_second if ref is not None else None
    evidence: dict[str, Any] = {
        "kv_cache_usage_min": sat.kv_cache_usage_min, "requests_running_max": sat.requests_running_max,
        "requests_waiting_max": sat.requests_waiting_max, "saturated_seconds": sat.longest_seconds,
        "saturated_seconds_in_window": sat.seconds, "start_offset_seconds": sat.longest_start_offset_seconds,
        "threshold_seconds": need, "ratio": cfg.ratio, "max_rate_ratio": cfg.max_rate_ratio,
        "reference_window": ref.window if ref is not None else None,
    }
    if sat.longest_tokens is not None:  # the server's own counter over the span
        if sat.longest_seconds < need:
            return None
        rate = sat.longest_tokens / sat.longest_seconds
        if ref_rate:
            stuck = rate <= cfg.max_rate_ratio * ref_rate
            against = f"{rate:.1f} tokens/s generated (the baseline's {ref_rate:.1f}/s: {rate / ref_rate:.1%})"
        else:
            stuck = sat.longest_tokens <= 0
            against = f"{sat.longest_tokens:.0f} tokens generated (no baseline rate yet: none may be)"
        evidence.update(source="server_tokens", server_tokens=sat.longest_tokens, tokens_per_second=rate,
                        reference_tokens_per_second=ref_rate)
        span = sat.longest_seconds
    else:  # no counter (TGI): soakd's own output, with the window mostly pinned
        share = sat.seconds / w.duration_seconds if w.duration_seconds > 0 else 0.0
        ours = w.output_tokens_per_second
        ref_ours = ref.output_tokens_per_second if ref is not None else None
        if sat.seconds < need or share < 0.5 or not ref_ours:
            return None
        stuck = ours <= cfg.max_rate_ratio * ref_ours
        against = (f"soakd received {ours:.1f} output tokens/s in the window (the baseline's {ref_ours:.1f}/s: "
                   f"{ours / ref_ours:.1%}), pinned {share:.0%} of it")
        evidence.update(source="client_tokens", tokens_per_second=ours, reference_tokens_per_second=ref_ours,
                        saturated_share=share)
        span = sat.seconds
    if not stuck:
        return None
    waiting = f", {sat.requests_waiting_max:.0f} waiting" if sat.requests_waiting_max is not None else ""
    return Finding(kind="freeze", diagnosis=DIAGNOSIS, severity="critical",
                   message=f"KV cache pinned at >= {(sat.kv_cache_usage_min or cfg.ratio):.1%} for {span:.1f} s in window "
                           f"{w.window} (threshold {need:.1f} s) with up to {sat.requests_running_max or 0:.0f} "
                           f"requests running{waiting}: {against}; the engine is out of KV blocks",
                   evidence=evidence, window=w.window)  # fmt: skip

"""KV cache saturated and stuck: the server's KV-cache usage pinned near full while it runs requests and
generates (almost) nothing.

Not a broken engine but one out of KV blocks: preemption and recompute thrash, a leak that filled the
cache, admission stuck behind requests that cannot grow. What to check differs from a wedge (the cache:
preemptions, ``gpu_memory_utilization``, ``max_num_seqs``, long prompts, leaked blocks; not a py-spy
dump of a deadlocked scheduler), so it has its own diagnosis, ``KV cache saturated``, of kind
``freeze`` (the engine makes no progress; ``fail_on`` and the JUnit file treat it as the wedge).

One fault, one finding, one page:

* Live (``soakd.soak.wedge``): a wedge (silent streams, or the server's token counter still with requests
  running, while GET /v1/models answers) whose latest server scrape shows the KV cache at or above
  ``analysis.kv_saturated.ratio`` with requests running is named ``KV cache saturated`` instead of
  ``engine wedged`` (:func:`wedge_diagnosis`), with the usage, the running and waiting requests as
  evidence. ``soakd_kv_cache_saturated`` is 1 during it; ``soakd_engine_wedged`` is 1 too (the engine
  generates nothing), and the alert SoakdEngineWedged stands aside (``unless`` the KV alert's gauge),
  so the on-call engineer gets SoakdKVCacheSaturated alone.
* At the window's close (:func:`kv_saturated_finding`), for what the live watch cannot see: a counter that
  still creeps (thrash makes a token now and then, so it is never flat) or a server whose counter moves
  only when requests end. Rule, on the window's server scrapes taken in pairs (``soakd.analysis.telemetry``):
  the longest unbroken span of scrapes all pinned (usage >= ``ratio``, requests running > 0) lasts at least
  ``min_seconds`` and 3x the baseline's e2e p99, **and** the server's generated tokens per second over it
  are at most ``max_rate_ratio`` (5%) of the baseline window's rate (no baseline yet: not one token). A
  server without a token counter (TGI) is judged on soakd's own output tokens per second of the window
  against the baseline's, with the window pinned at least half its time. A window that a live episode
  (wedge or KV) overlapped is not judged again: that fault already has its finding.

Not stuck: a busy healthy server at 95-99% usage (vLLM runs near full by design: ``gpu_memory_utilization``
sizes the cache to fill) that keeps generating at its usual rate; an idle server (nothing running); a
cache pinned for less than the span (a burst).
"""

from __future__ import annotations

from typing import Any

from soakd.analysis.diagnosis import Finding
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

"""Which windows a verdict rests on, and why the others were not judged: the verdict's causes
(``soakd.core.verdict.NotJudged``, ``Judged``), the same for the analysis at the end of a run and
for the report of a run whose verdict an earlier release stored without them.

A full window is judged when the target stayed up in it, soakd itself did not stall through too much
of it (``ClientSummary.impaired``: more than ``analysis.client.max_impaired_share`` of its requests
or its time; the requests a stall overlapped are left out of its latency, the rest judged) and it had
at least ``min_requests`` requests (and as many latency samples): exactly the windows the baseline
pool and the drift comparisons may use.
"""

from __future__ import annotations

from collections.abc import Iterable

from soakd.core.summary import WindowSummary
from soakd.core.verdict import Judged, NotJudged

__all__ = ["judged", "not_judged", "not_judged_cause"]


def not_judged_cause(w: WindowSummary, min_requests: int) -> str | None:
    """Why ``w`` is not judged (``NotJudged.cause``), or None when it is."""
    if w.partial:
        return "partial"
    if w.target_down_seconds > 0:
        return "target_down"
    if w.client is not None and w.client.impaired:
        return "client_impaired"
    if w.requests < min_requests or w.e2e_seconds.count < min_requests:
        return "too_few_requests"
    return None


def not_judged(windows: Iterable[WindowSummary], min_requests: int) -> list[NotJudged]:
    """The windows not judged, per cause, with what a person needs to know about each cause."""
    windows = list(windows)
    by: dict[str, list[WindowSummary]] = {}
    for w in windows:
        cause = not_judged_cause(w, min_requests)
        if cause is not None:
            by.setdefault(cause, []).append(w)
    out = []
    for cause in ("client_impaired", "too_few_requests", "target_down", "partial"):
        ws = by.get(cause)
        if not ws:
            continue
        if cause == "target_down":
            detail = f"down {sum(w.target_down_seconds for w in ws):.0f} s in all"
        elif cause == "client_impaired":
            cs = [w.client for w in ws if w.client is not None]
            lag = max((c.loop_lag_max_seconds or 0.0) for c in cs)
            stall = sum(c.stall_seconds for c in cs)
            throttled = sum(c.cgroup_throttled_seconds or 0.0 for c in cs)
            why = next((c.impaired_reason for c in cs if c.impaired_reason), None)
            shares = [c.impaired_share for c in cs if c.impaired_share is not None]
            detail = (f"soakd's event loop lagged up to {lag * 1000:.0f} ms, {stall:.1f} s stalled in all"
                      + (f", up to {max(shares):.0%} of a window's requests impaired" if shares else "")
                      + (f", its cgroup throttled {throttled:.1f} s" if throttled else "") + (f" ({why})" if why else "")
                      + "; give soakd CPU of its own (a CPU request, fewer other processes on the node), or judge a "
                        "node that is busy all run long with analysis.client.request_lag_relative: 3")
        elif cause == "too_few_requests":
            detail = (f"fewer than {min_requests} requests: "
                      + ", ".join(f"window {w.window} had {min(w.requests, w.e2e_seconds.count)}" for w in ws[:6]) + ("…" if len(ws) > 6 else ""))
        else:
            detail = "reported, not judged"
        out.append(NotJudged(cause=cause, windows=[w.window for w in ws], detail=detail))  # type: ignore[arg-type]
    if not windows:
        out.append(NotJudged(cause="nothing_measured", detail="no window was closed"))
    return out


def judged(windows: Iterable[WindowSummary], min_requests: int, detectable: dict[str, float] | None = None) -> Judged:
    windows = list(windows)
    full = [w for w in windows if not w.partial]
    ok = [w for w in full if not_judged_cause(w, min_requests) is None]
    return Judged(windows=len(ok), full_windows=len(full), partial_windows=len(windows) - len(full),
                  requests=sum(w.requests for w in ok), requests_measured=sum(w.requests for w in windows),
                  requests_impaired=sum(w.client.requests_impaired for w in ok if w.client is not None),
                  detectable=dict(detectable or {}))

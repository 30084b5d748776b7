"""Server restarts recognised in the server's own metrics (``soakd.samplers.server.RestartDetector``:
a new process start time, or counters that went down), per window.

The window summary carries soakd's count since it started (``server.restarts_total``, the last value
in the window); a window's restarts are its count against the previous window's — a lower count is
a restarted soakd (a resumed run), counted from zero. A window with one gets a 'target restarted'
finding (the outage finding of the same window, when soakd saw the target down, says so instead):
also a restart quicker than soakd's requests noticed.
"""

from __future__ import annotations

from collections.abc import Iterable
from soakd.core.findings import Finding
from soakd.core.summary import WindowSummary as Window

__all__ = ["ServerRestarts", "counter_increase", "restarts_by_window"]


def counter_increase(now: float, before: float) -> float:
    """A counter's increase since ``before``; one lower than ``before`` restarted, and counts from zero."""
    return now - before if now >= before else now


class ServerRestarts:
    def __init__(self) -> None:
        self._seen: float | None = None  # the count at the last window

    def count(self, w: Window) -> int:
        """The restarts recognised during ``w`` (windows in order)."""
        now = w.server.restarts_total if w.server is not None else None
        if now is None:
            return 0
        before = self._seen or 0.0
        self._seen = now
        return max(0, int(counter_increase(now, before)))

    @staticmethod
    def report(w: Window, n: int, findings: list[Finding]) -> None:
        """Say so in the window's findings: in its 'target restarted' finding, or in a new one."""
        what = (f"the server restarted {n} time(s) in window {w.window}, by its own metrics (a new process "
                "start time or counters that went down)")
        for i, f in enumerate(findings):
            if f.diagnosis == "target restarted":
                findings[i] = f.model_copy(update={"message": f"{f.message}; {what}",
                                                   "evidence": {**f.evidence, "restarts": n}})
                return
        findings.append(Finding(kind="target", diagnosis="target restarted", severity="warning",
                                message=what + "; its counters start again, its caches are cold",
                                evidence={"restarts": n, "target_down_seconds": w.target_down_seconds},
                                window=w.window))


def restarts_by_window(windows: Iterable[Window]) -> dict[int, int]:
    """{window: restarts} of the windows that had any (the report's per-window count)."""
    tracker = ServerRestarts()
    out = {}
    for w in windows:
        n = tracker.count(w)
        if n:
            out[w.window] = n
    return out

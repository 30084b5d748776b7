"""The error policy: each full window's failed requests against a per-window budget
(``analysis.errors.window_budget``), the run's against the run budget (``analysis.verdict.error_budget``).
The error rate is no drift metric. The rule and why: docs/analysis.md#errors.

A failed request is one that did not end ``ok`` and was not ``cancelled`` (the run budget's definition).
A window beyond the window budget (its failed share, as counted: a budget is spent by what failed) is a
critical *error burst* that fails the run (kind ``errors``); a window within it whose failures exceed the
run budget's share of its requests with confidence (``analysis.errors.confidence``, a one-sided binomial
test) is a warning burst that does not. Consecutive burst windows are one burst: each finding spans them.
A burst replaces the window's "server errors" diagnosis (it carries the same errors, by reason).
Judged: full windows with ``analysis.drift.min_requests`` requests and the target up all along (a window
with the target down is the outage's, "target restarted"); the run budget counts every full window.
Pure, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scipy.stats import binom

from soakd.config.analysis import AnalysisConfig
from soakd.core.findings import Finding
from soakd.core.summary import WindowSummary

__all__ = ["ErrorDetector", "ErrorState", "burst_finding", "failed", "failures_text", "judged", "pct"]

Window = WindowSummary


def pct(share: float) -> str:
    """A budget as people read it: 0.05 -> 5%, 0.005 -> 0.5%."""
    return f"{share * 100:.3g}%"


def failed(w: Window) -> int:
    """A window's failed requests: neither ok nor cancelled."""
    return max(0, w.requests - int(w.outcomes.get("ok", 0)) - int(w.outcomes.get("cancelled", 0)))


def judged(w: Window, min_requests: int = 1) -> bool:
    """Whether the policy judges a window: full, with ``min_requests`` requests, the target up all along."""
    return not w.partial and w.requests >= max(1, min_requests) and w.target_down_seconds <= 0


def p_value(n_failed: int, n: int, share: float) -> float:
    """P(X >= n_failed) for X ~ Binomial(n, share): how surprising the failures are at the run budget's share."""
    if n_failed <= 0:
        return 1.0
    if share <= 0:
        return 0.0
    return float(binom.sf(n_failed - 1, n, share))


def _size(w: Window) -> dict[str, Any]:
    outcomes = {k: int(v) for k, v in w.outcomes.items() if k not in ("ok", "cancelled") and v}
    return {"failed": failed(w), "requests": w.requests, "outcomes": outcomes, "failures": dict(w.failures)}


# what a reason that makes up most of the failures says about the target
HINTS = {
    "http_404": "HTTP 404: the target no longer serves the model or the endpoint (restarted with another "
                "model or route? see --model and GET /v1/models)",
    "http_401": "HTTP 401: the target stopped accepting the API key (rotated?)",
    "http_403": "HTTP 403: the target stopped accepting the API key (rotated?)",
    "http_429": "HTTP 429: the target's admission control or rate limit refuses the load",
}


def failures_text(failures: dict[str, int]) -> str:
    """Failures by reason, most first (``http_404 120, timeout 3``), with the hint of a reason that
    makes up most of them."""
    if not failures:
        return ""
    ranked = sorted(failures.items(), key=lambda kv: -kv[1])
    text = ", ".join(f"{k} {v}" for k, v in ranked[:6])
    top, n = ranked[0]
    if top in HINTS and n * 2 > sum(failures.values()):
        text += f" — {HINTS[top]}"
    return text


def _text(ev: dict[str, Any]) -> str:
    if ev.get("failures"):
        return failures_text(ev["failures"])
    what = ev.get("outcomes") or {}
    return ", ".join(f"{k} {v}" for k, v in sorted(what.items(), key=lambda kv: -kv[1])) or "failed"


def burst_finding(w: Window, cfg: AnalysisConfig, span: list[Window] | None = None) -> Finding | None:
    """The error burst of window ``w`` (None: none), spanning ``span`` (the burst windows just before it)."""
    if not judged(w, cfg.drift.min_requests):
        return None
    size = _size(w)
    n_failed, n = size["failed"], size["requests"]
    run_budget, window_budget = cfg.verdict.error_budget, cfg.errors.window_budget
    share = n_failed / n
    over = share > window_budget
    p = p_value(n_failed, n, run_budget)
    if not over and p >= 1 - cfg.errors.confidence:
        return None
    before = [x for x in span or [] if x.window < w.window]
    ev: dict[str, Any] = {"share": share, **size, "window_budget": window_budget, "run_budget": run_budget,
                          "p_value": p, "over_window_budget": over}
    where = f"window {w.window}"
    if before:
        ev["burst_windows"] = [x.window for x in before] + [w.window]
        ev["burst_failed"] = sum(failed(x) for x in before) + n_failed
        ev["burst_requests"] = sum(x.requests for x in before) + n
        where += f" (a burst since window {before[0].window}: {ev['burst_failed']} of {ev['burst_requests']})"
    if not over:
        ev["fails"] = False
    judgement = (f"beyond the {pct(window_budget)} window budget" if over else
                 f"within the {pct(window_budget)} window budget, beyond the {pct(run_budget)} run budget's share")
    return Finding(
        kind="errors", diagnosis="error burst", severity="critical" if over else "warning",
        message=f"{n_failed} of {n} requests failed ({share:.2%}) in {where}: {_text(ev)}; {judgement}",
        evidence=ev, window=before[0].window if before else w.window, last_window=w.window if before else None,
    )


@dataclass(frozen=True)
class ErrorState:
    """The policy's state for /metrics: the last closed full window's failed share (None when the policy
    did not judge it: the target down, too few requests), the run's so far, the budgets, the burst windows."""

    window_ratio: float | None = None
    run_ratio: float | None = None
    window_budget: float = 0.05
    run_budget: float = 0.01
    bursts: tuple[int, ...] = ()


class ErrorDetector:
    """The error policy over the closed windows (a ``soakd.analysis.detector.Detector``)."""

    name = "errors"
    partial = False

    def __init__(self, cfg: AnalysisConfig) -> None:
        self.cfg = cfg
        self._span: list[Window] = []  # the burst windows up to the last judged one
        self._last: Window | None = None
        self._failed = self._requests = 0
        self.bursts: list[int] = []

    def add(self, w: Window, ctx: Any) -> None:
        self._count(w)
        self._last = w
        if not judged(w, self.cfg.drift.min_requests):
            self._span = []
            return
        f = burst_finding(w, self.cfg, self._span if self._span and self._span[-1].window == w.window - 1 else None)
        if f is None:
            self._span = []
            return
        self._span = [*(self._span if f.last_window is not None else []), w]
        self.bursts.append(w.window)
        # one finding for the window's errors: the burst says what "server errors" would (the HTTP and
        # connection errors, by reason) and judges them; causes with more to say ("overload": the queue) stay
        ctx.findings[:] = [x for x in ctx.findings if not (x.diagnosis == "server errors" and x.window == w.window)]
        ctx.findings.append(f)

    def _count(self, w: Window) -> None:
        self._failed += failed(w)
        self._requests += w.requests

    def close(self, w: Window, ctx: Any) -> None:
        return None

    def restore(self, windows: list[Window], baseline: Window | None = None) -> None:
        self._span, self._last, self._failed, self._requests, self.bursts = [], None, 0, 0, []
        for w in windows:
            if w.partial:
                continue
            self._count(w)
            self._last = w
            if not judged(w, self.cfg.drift.min_requests):
                self._span = []
                continue
            span = self._span if self._span and self._span[-1].window == w.window - 1 else None
            f = burst_finding(w, self.cfg, span)
            self._span = [*(span or []), w] if f is not None else []
            if f is not None:
                self.bursts.append(w.window)

    def finish(self, ctx: Any) -> list[Finding]:
        return []

    def state(self) -> ErrorState:
        w = self._last
        return ErrorState(
            window_ratio=failed(w) / w.requests if w is not None and judged(w, self.cfg.drift.min_requests) else None,
            run_ratio=self._failed / self._requests if self._requests else None,
            window_budget=self.cfg.errors.window_budget, run_budget=self.cfg.verdict.error_budget,
            bursts=tuple(self.bursts))

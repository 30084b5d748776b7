"""The analysis engine: every closed window goes through drift, throttle, leak and diagnosis;
the results become findings, events and the run's verdict.

Pure bookkeeping (no I/O, no metrics): the window pipeline feeds it window summaries, quiesce
probes and canary results and persists what it emits (``on_event``); ``soakd.soak.exporter``
reads its state for /metrics. It holds the run's one in-memory window history.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from soakd.analysis import drift as drift_mod
from soakd.analysis import leak as leak_mod
from soakd.analysis import throttle as throttle_mod
from soakd.analysis.diagnosis import Finding, diagnose
from soakd.config.analysis import AnalysisConfig
from soakd.core.summary import QuiesceProbe, WindowSummary

Window = WindowSummary
EventSink = Callable[[str, str, str, dict[str, Any], int | None], None]  # kind, severity, message, data, window

LEAK_SOURCES_BYTES = ("device_memory", "target_gpu_memory", "target_rss")


class CanaryOutcome(Protocol):
    """One canary check (``soakd.soak.canary.CanaryResult``)."""

    ok: bool
    match: bool | None
    digest: str | None
    reference: str | None
    text: str
    idle: bool


class WindowHistory:
    """Every closed window of the run, earlier segments included (bounded: the newest
    ``max_windows``), in the order they closed; the partial one cut by the end of a segment too."""

    def __init__(self, max_windows: int = 5000) -> None:
        self.closed: deque[Window] = deque(maxlen=max_windows)
        self.count = 0  # windows ever added, beyond the bound too
        self._requests = self._failed = 0  # over every full window, beyond the bound too

    def restore(self, windows: Iterable[Window]) -> None:
        self.closed.clear()
        self.count = self._requests = self._failed = 0
        for w in windows:
            if not w.partial:
                self.add(w)

    def add(self, w: Window) -> None:
        self.closed.append(w)
        self.count += 1
        if not w.partial:
            self._requests += w.requests
            self._failed += w.requests - int(w.outcomes.get("ok", 0)) - int(w.outcomes.get("cancelled", 0))

    @property
    def last(self) -> Window | None:
        return self.closed[-1] if self.closed else None

    def full(self) -> list[Window]:
        """The windows that are judged: not partial."""
        return [w for w in self.closed if not w.partial]

    def __len__(self) -> int:
        return len(self.closed)

    def error_rate(self) -> float | None:
        """Run-wide share of failed measured requests over every full window of the run (cancelled
        ones are not failures)."""
        return self._failed / self._requests if self._requests else None


@dataclass
class Verdict:
    passed: bool = True
    reasons: list[str] = field(default_factory=list)
    stability: dict[str, Any] = field(default_factory=dict)
    recurring_drops: dict[str, Any] = field(default_factory=dict)
    findings: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "result": "PASS" if self.passed else "FAIL",
            "passed": self.passed,
            "reasons": list(self.reasons),
            "findings": dict(self.findings),
            "stability": self.stability,
            "recurring_drops": self.recurring_drops,
        }


class Analyzer:
    def __init__(self, config: AnalysisConfig, on_event: EventSink | None = None, baseline: Window | None = None,
                 history: WindowHistory | None = None) -> None:
        self.cfg = config
        self.on_event = on_event
        self.history = history if history is not None else WindowHistory()
        self.baseline = baseline
        self.baseline_external = baseline is not None
        self.previous: Window | None = None
        self.drift: dict[tuple[str, str], drift_mod.DriftResult] = {}
        self.drift_events: dict[str, int] = dict.fromkeys(self.cfg.drift.metrics, 0)
        self.drift_active: dict[str, bool] = dict.fromkeys(self.cfg.drift.metrics, False)
        self.leaks: dict[str, leak_mod.LeakResult] = {}
        self.throttles: list[throttle_mod.ThrottleResult] = []
        self.throttle_detected = False
        self.findings: list[dict[str, Any]] = []
        self.finding_counts: dict[tuple[str, str], int] = {}
        self.failing: list[str] = []
        self.canary_checks = self.canary_mismatches = self.canary_errors = 0
        self.quiesce_probes = 0
        self.last_quiesce: QuiesceProbe | None = None
        self.stability: dict[str, Any] = {}

    @property
    def last_window(self) -> Window | None:
        return self.history.last

    # ---- inputs
    def restore(self, windows: list[Window], baseline: Window | None) -> None:
        """Resume: the windows of earlier segments (from the store) and the baseline."""
        self.history.restore(windows)
        if baseline is not None and not self.baseline_external:
            self.baseline = baseline
        full = self.history.full()
        self.previous = full[-1] if full else None

    def add_window(self, w: Window) -> list[Finding]:
        cfg = self.cfg
        if self.baseline is None and not w.partial:
            self.baseline = drift_mod.choose_baseline([w], cfg.drift.min_requests)
            if self.baseline is not None:
                self._event("baseline", "info", f"window {w.window} is the baseline", {"window": w.window}, w.window)
        results = drift_mod.evaluate(w, self.baseline if self.baseline is not w else None,
                                     self.previous, cfg.drift)
        for r in results:
            self.drift[(r.metric, r.reference)] = r
        for metric in cfg.drift.metrics:
            flagged = [r for r in results if r.metric == metric and r.reference == "baseline" and r.flagged]
            self.drift_active[metric] = bool(flagged)
            if flagged:
                self.drift_events[metric] = self.drift_events.get(metric, 0) + 1
        self.throttles = throttle_mod.evaluate(w, self.baseline, cfg.throttle)
        self.throttle_detected = any(t.detected for t in self.throttles)
        self.history.add(w)
        full = self.history.full()
        leaks = leak_mod.evaluate(full, cfg.leak)
        new_leaks = [lk for lk in leaks if lk.suspected and not (self.leaks.get(lk.source)
                                                               and self.leaks[lk.source].suspected)]
        self.leaks = {lk.source: lk for lk in leaks}
        kv_res = self.leaks.get("kv_residue")
        if w.partial:
            # the window cut short by the end of the run: reported, not judged
            self.stability = drift_mod.stability(full, cfg.drift)
            return []
        findings = diagnose(
            w,
            results,
            self.throttles,
            [lk for lk in leaks if lk.source != "kv_residue" and lk in new_leaks],
            kv_res if kv_res is not None and kv_res in new_leaks else None,
            baseline=self.baseline,
            drift_cfg=cfg.drift,
            cfg=cfg.diagnosis,
        )
        for f in findings:
            self._finding(f)
        self.previous = w
        self.stability = drift_mod.stability(full, cfg.drift)
        return findings

    def add_canary(self, result: CanaryOutcome, window: int | None) -> None:
        self.canary_checks += 1
        if not result.ok:
            self.canary_errors += 1
            return
        if result.match is False:
            self.canary_mismatches += 1
            where = "on an idle server" if result.idle else "under load (batch-variant kernels are a possible cause)"
            f = Finding(
                kind="canary", diagnosis="output changed", severity="critical",
                message=f"canary output changed {where}: digest {result.digest} != reference {result.reference}; "
                        f"output now: {result.text[:160]!r}",
                evidence={"digest": result.digest, "reference": result.reference, "text": result.text[:500],
                          "idle": result.idle},
                window=window,
            )
            self._finding(f)

    def add_quiesce(self, probe: QuiesceProbe) -> None:
        self.quiesce_probes += 1
        self.last_quiesce = probe

    # ---- outputs
    def _event(self, kind: str, severity: str, message: str, data: dict[str, Any], window: int | None) -> None:
        if self.on_event is not None:
            self.on_event(kind, severity, message, data, window)

    def _finding(self, f: Finding) -> None:
        d = f.to_dict()
        self.findings.append(d)
        if len(self.findings) > 10_000:
            self.findings = self.findings[-10_000:]
        key = (f.kind, f.severity)
        self.finding_counts[key] = self.finding_counts.get(key, 0) + 1
        self._event(f.kind, f.severity, f"{f.diagnosis}: {f.message}", d, f.window)
        reason = self._fails(f)
        if reason:
            self.failing.append(reason)

    def _fails(self, f: Finding) -> str | None:
        v = self.cfg.verdict
        if f.severity == "info":
            return None
        kind = f.kind
        if kind == "errors":
            return None  # judged run-wide against the error budget
        elif kind not in v.fail_on:
            return None
        return f"{kind}: {f.diagnosis} (window {f.window})"

    def verdict(self) -> Verdict:
        """The run's verdict: every failing finding, and the run-wide error rate against the budget."""
        error_rate = self.history.error_rate()
        v = Verdict()
        v.reasons = list(dict.fromkeys(self.failing))
        if "errors" in self.cfg.verdict.fail_on and error_rate is not None and error_rate > self.cfg.verdict.error_budget:
            v.reasons.append(f"errors: error rate {error_rate:.2%} is above the budget "
                             f"{self.cfg.verdict.error_budget:.2%}")
        v.passed = not v.reasons
        full = self.history.full()
        v.stability = drift_mod.stability(full, self.cfg.drift)
        drops = {}
        for metric in self.cfg.drift.metrics:
            d = drift_mod.recurring_drops(full, metric, self.cfg.drift)
            if d:
                drops[metric] = d
        v.recurring_drops = drops
        v.findings = {f"{k}/{s}": n for (k, s), n in self.finding_counts.items()}
        return v

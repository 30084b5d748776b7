"""The analysis engine: a loop over the detectors (``soakd.analysis.detector``) that every closed
window goes through; their findings judged (whether each fails the run, and why), counted and
announced; the run's verdict (``soakd.core.verdict.RunVerdict``) at the end.

Pure bookkeeping (no I/O, no metrics): the window pipeline feeds it window summaries, quiesce
probes and canary results and persists what it emits (``on_event``); ``soakd.soak.exporter`` and
``/status`` read the detectors' states (``states()``). It holds the run's one in-memory window
history.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from soakd.analysis import changes as changes_mod
from soakd.analysis import drift as drift_mod
from soakd.analysis import judged as judged_mod
from soakd.analysis import freeze as freeze_mod
from soakd.analysis import leak as leak_mod
from soakd.analysis import page as page_mod
from soakd.analysis.detector import (
    AbDetector,
    ClientDetector,
    Detector,
    DiagnosisDetector,
    FreezeDetector,
    GpuErrorDetector,
    LeakDetector,
    PowerCapDetector,
    RestartDetector,
    RunContext,
    ThrottleDetector,
    own_delay,
    WindowContext,
)
from soakd.analysis.drift_watch import DriftDetector
from soakd.analysis import errors as errors_mod
from soakd.analysis.errors import ErrorDetector, failures_text
from soakd.analysis.periodic import PeriodicDrops
from soakd.config.analysis import AnalysisConfig
from soakd.core.findings import Finding, failing_reason
from soakd.core.summary import QuiesceProbe, WindowSummary
from soakd.core.verdict import VERDICT_SCHEMA_VERSION, RunVerdict
from soakd.core.tracked import SERVER_MEANS

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


@dataclass(frozen=True)
class FindingsState:
    """The findings so far: counts by (kind, severity), and the reasons of those that fail the run."""

    counts: dict[tuple[str, str], int]
    failing: tuple[str, ...]


@dataclass(frozen=True)
class ProbeState:
    """The canary's checks and the quiesce probes so far (inputs from the soak, not per window)."""

    canary_checks: int = 0
    canary_mismatches: int = 0
    canary_errors: int = 0
    quiesce_probes: int = 0
    last_quiesce: QuiesceProbe | None = None


class WindowHistory:
    """Every closed window of the run, earlier segments included (bounded: the newest
    ``max_windows``), in the order they closed; the partial one cut by the end of a segment too."""

    def __init__(self, max_windows: int = 5000) -> None:
        self.closed: deque[Window] = deque(maxlen=max_windows)
        self.count = 0  # windows ever added, beyond the bound too
        self._requests = self._failed = 0  # over every full window, beyond the bound too
        self.failures: dict[str, int] = {}  # failed requests by bounded reason, over every full window
        self.measured = 0  # requests in every window, partial ones too

    def restore(self, windows: Iterable[Window]) -> None:
        self.closed.clear()
        self.count = self._requests = self._failed = self.measured = 0
        self.failures = {}
        for w in windows:
            if not w.partial:
                self.add(w)

    def add(self, w: Window) -> None:
        self.closed.append(w)
        self.count += 1
        self.measured += w.requests
        if not w.partial:
            self._requests += w.requests
            self._failed += w.requests - int(w.outcomes.get("ok", 0)) - int(w.outcomes.get("cancelled", 0))
            for reason, n in (w.failures or {}).items():
                self.failures[reason] = self.failures.get(reason, 0) + int(n)

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

    def failed_requests(self) -> tuple[int, int]:
        """(failed, measured) requests over every full window of the run."""
        return self._failed, self._requests


class Analyzer:
    def __init__(self, config: AnalysisConfig, on_event: EventSink | None = None, baseline: Window | None = None,
                 history: WindowHistory | None = None, planned_windows: int | None = None,
                 candidates: int = 0, ab: Any = None) -> None:
        """``ab``: an A/B run's judge (``soakd.analysis.ab.AbJudge``), in the reference target's analysis:
        the A/B detector over every target's windows (the others come in through ``add_target_window``)."""
        self.cfg = config
        # the live page's family: metrics x windows x its scan (page.page_z), and in an A/B run also each of
        # the ``candidates`` against the reference (soakd.analysis.ab): one family
        self.planned_windows = max(1, planned_windows or 48)
        self.candidates = candidates
        self.z_live = page_mod.page_z(config.drift, self.planned_windows, 1 + candidates)
        self.on_event = on_event
        self.history = history if history is not None else WindowHistory()
        # the detectors, in the order a window goes through them
        self.drift_detector = DriftDetector(config, self.z_live, baseline)
        self.throttle = ThrottleDetector(config, pool=lambda: self.drift_detector.pool)
        self.leak = LeakDetector(config, self.planned_windows)
        self.gpu = GpuErrorDetector()
        self.diagnosis = DiagnosisDetector(config)
        self.freeze = FreezeDetector(config)
        self.freeze.planned = self.planned_windows
        self.restarts = RestartDetector()
        self.client = ClientDetector(config)
        self.errors = ErrorDetector(config)
        self.ab = AbDetector(ab) if ab is not None else None
        self.detectors: tuple[Detector, ...] = (
            self.drift_detector, self.throttle, self.leak, self.gpu, self.diagnosis, self.freeze, self.restarts,
            self.client, PowerCapDetector(), self.errors, *((self.ab,) if self.ab is not None else ()))
        self.findings: list[Finding] = []  # every finding so far, judged (the newest 10,000)
        self.finding_counts: dict[tuple[str, str], int] = {}
        self.failing_findings: list[Finding] = []  # the window findings that fail the run
        self._run_findings: list[Finding] | None = None  # the verdict's run-level findings, once made
        self._finished = False
        self.probes = ProbeState()

    # ---- what the detectors know (their states: the exporter's and /status's)
    def states(self) -> dict[str, Any]:
        """Every detector's live state by its name, and the run's so far: ``probes`` (the canary's checks
        and the quiesce probes), ``findings`` (counts and what fails the run), ``window`` (the last closed)."""
        out: dict[str, Any] = {d.name: d.state() for d in self.detectors}
        out["probes"] = self.probes
        out["findings"] = FindingsState(dict(self.finding_counts), tuple(self.failing))
        out["window"] = self.history.last
        return out

    @property
    def last_window(self) -> Window | None:
        return self.history.last

    @property
    def baseline(self) -> Window | None:
        return self.drift_detector.baseline

    @property
    def pool(self) -> list[Window]:
        return self.drift_detector.pool

    @property
    def drift(self) -> dict[tuple[str, str], drift_mod.DriftResult]:
        return self.drift_detector.drift

    @property
    def drift_active(self) -> dict[str, bool]:
        return self.drift_detector.drift_active

    @property
    def leaks(self) -> dict[str, leak_mod.LeakResult]:
        return self.leak.leaks

    @property
    def throttle_detected(self) -> bool:
        return self.throttle.state().detected

    @property
    def periodic(self) -> PeriodicDrops | None:
        return self.drift_detector.periodic

    # ---- inputs
    def restore(self, windows: list[Window], baseline: Window | None, findings: Iterable[Finding] = ()) -> None:
        """Resume: the windows of earlier segments (from the store), the baseline, and the findings those
        segments made as windows closed (the end of a segment's run-level judgements are made again at
        the end of the run), so that one that failed an earlier segment still fails the run."""
        self.history.restore(windows)
        for d in self.detectors:
            d.restore(windows, baseline)
        for f in findings:
            if f.window is None or f.spec.end_of_run:
                continue
            f = self._judge(f)
            self.findings.append(f)
            key = (f.kind, f.severity)
            self.finding_counts[key] = self.finding_counts.get(key, 0) + 1
            if f.fails:
                self.failing_findings.append(f)
            self.leak.restore_page(f)

    def add_window(self, w: Window) -> list[Finding]:
        """A closed window through every detector (a partial one through those that take it); its findings
        (judged: whether each fails the run)."""
        self.history.add(w)
        ctx = WindowContext(window=w, full=self.history.full(), emit=self._event)
        for d in self.detectors:
            if d.partial or not w.partial:
                d.add(w, ctx)
        for d in self.detectors:
            d.close(w, ctx)
        return [self._finding(f) for f in ctx.findings]

    def add_target_window(self, target: str, w: Window) -> list[Finding]:
        """An A/B run: another target's closed window, to the A/B detector; the comparisons it completes."""
        if self.ab is None:
            return []
        return [self._finding(f) for f in self.ab.add_target(target, w)]

    def restore_target(self, target: str, windows: list[Window]) -> None:
        """Resume an A/B run: another target's windows of earlier segments."""
        if self.ab is not None:
            self.ab.restore_target(target, windows)

    def freeze_threshold(self, w: Window | None = None) -> float:
        """The silence a freeze must outlast (``soakd.analysis.freeze``), from the baseline (or ``w``)."""
        return self.freeze.threshold(w if w is not None else self.history.last, self.baseline)

    def add_wedge(self, ep: dict[str, Any]) -> None:
        """A live wedge (``soakd.soak.wedge``): requests in flight, no byte, the server answering."""
        self.freeze.baseline = self.baseline
        self._finding(self.freeze.wedge(ep))

    def natural_silences(self, span: float, requests: int) -> float | None:
        """Silences this long with this many streams silent that the baseline's inter-token tail makes per run
        (``soakd.analysis.freeze.natural_silences``; None: no reference yet)."""
        ref = self.baseline if self.baseline is not None else self.history.last
        return freeze_mod.natural_silences(span, requests, ref, self.planned_windows)

    def add_hung(self, ep: dict[str, Any]) -> None:
        """A live hang (``soakd.soak.wedge``): requests in flight, no progress, GET /models timed out."""
        self._finding(self.freeze.hung(ep))

    def hung_ended(self, ep: dict[str, Any], seconds: float) -> None:
        self.freeze.wedge_ended(ep, seconds)
        self._event("target", "info", f"target answered again after {seconds:.1f} s hung", {"hung_seconds": seconds,
                    **ep}, ep.get("window"))

    def wedge_ended(self, ep: dict[str, Any], seconds: float) -> None:
        self.freeze.wedge_ended(ep, seconds)
        self._event("freeze", "info", f"engine recovered: generating again after {seconds:.1f} s wedged "
                    f"(seen by {', '.join(ep.get('sources_seen') or ep.get('sources') or ['streams'])})",
                    {"wedged_seconds": seconds, **ep}, ep.get("window"))

    def add_canary(self, result: CanaryOutcome, window: int | None) -> None:
        p = self.probes
        if not result.ok:
            self.probes = ProbeState(p.canary_checks + 1, p.canary_mismatches, p.canary_errors + 1, p.quiesce_probes,
                                     p.last_quiesce)
            return
        mismatch = result.match is False
        self.probes = ProbeState(p.canary_checks + 1, p.canary_mismatches + mismatch, p.canary_errors,
                                 p.quiesce_probes, p.last_quiesce)
        if mismatch:
            where = "on an idle server" if result.idle else "under load (batch-variant kernels are a possible cause)"
            self._finding(Finding(
                kind="canary", diagnosis="output changed", severity="critical",
                message=f"canary output changed {where}: digest {result.digest} != reference {result.reference}; "
                        f"output now: {result.text[:160]!r}",
                evidence={"digest": result.digest, "reference": result.reference, "text": result.text[:500],
                          "idle": result.idle},
                window=window,
            ))  # fmt: skip

    def add_quiesce(self, probe: QuiesceProbe) -> None:
        p = self.probes
        self.probes = ProbeState(p.canary_checks, p.canary_mismatches, p.canary_errors, p.quiesce_probes + 1, probe)

    # ---- outputs
    def _event(self, kind: str, severity: str, message: str, data: dict[str, Any], window: int | None) -> None:
        if self.on_event is not None:
            self.on_event(kind, severity, message, data, window)

    @property
    def failing(self) -> list[str]:
        """The reasons of the window findings so far that fail the run (the verdict adds the run's last
        leak judgement and the error budget)."""
        return list(dict.fromkeys(f.reason for f in self.failing_findings))

    def _finding(self, f: Finding) -> Finding:
        """Judge, keep, count and announce a finding; the judged one."""
        f = self._judge(f)
        self.findings.append(f)
        if len(self.findings) > 10_000:
            self.findings = self.findings[-10_000:]
        key = (f.kind, f.severity)
        self.finding_counts[key] = self.finding_counts.get(key, 0) + 1
        self._event(f.kind, f.severity, f"{f.diagnosis}: {f.message}", f.to_dict(), f.window)
        if f.fails:
            self.failing_findings.append(f)
        return f

    def _judge(self, f: Finding) -> Finding:
        """Whether a finding fails the run, and why (or why not)."""
        fail_on = self.cfg.verdict.fail_on
        if f.severity == "info":
            return f.judged(False, "informational")
        if f.diagnosis == "error burst":  # the error policy (soakd.analysis.errors): beyond the window budget
            budget = f.evidence.get("window_budget")
            b = errors_mod.pct(budget) if isinstance(budget, int | float) else "window"
            if not f.evidence.get("over_window_budget"):
                return f.judged(False, f"an error burst within the {b} window budget: reported, not failing")
            if "errors" not in fail_on:
                return f.judged(False, "'errors' is not in analysis.verdict.fail_on")
            return f.judged(True, failing_reason(f.kind, f.diagnosis, f.window, f.last_window)
                            + f": beyond the {b} window budget")
        if not f.spec.fails or f.evidence.get("fails") is False:
            return f.judged(False, f"{f.diagnosis}: reported, never failing")
        if f.evidence.get("tier") == "likely":
            return f.judged(False, "a likely change: reported, not failing")
        if f.kind == "errors":
            return f.judged(False, "errors fail the run only as an error burst beyond the window budget "
                            "or beyond the run budget")
        if f.kind == "leak":
            return f.judged(False, "the run's last leak judgement of this source decides")
        if f.kind not in fail_on:
            return f.judged(False, f"{f.kind!r} is not in analysis.verdict.fail_on")
        # a latency drift that soakd's own lag explains while the server's own histograms stayed put
        own = own_delay(f, self.history.full(), self.drift_detector.pool, self.cfg) if f.kind == "drift" else None
        if own is not None:
            return f.judged(False, own)
        why = failing_reason(f.kind, f.diagnosis, f.window, f.last_window, f.metrics)
        own_means = [changes_mod.METRICS[m].label for m in f.metrics if m in SERVER_MEANS]
        if own_means:
            why += f": the {' and '.join(own_means)} (its histograms), judged where soakd lagged (client lagging)"
        return f.judged(True, why)

    def finish(self) -> changes_mod.RunDrift:
        """The end of the run: each detector's run-level findings (the change points, segment changes,
        trends and periodic drops of ``soakd.analysis.drift_watch``), emitted once. Idempotent."""
        if not self._finished:
            self._finished = True
            ctx = RunContext(full=self.history.full(), emit=self._event)
            for d in self.detectors:
                for f in d.finish(ctx):
                    self._finding(f)
        assert self.drift_detector.run_drift is not None
        return self.drift_detector.run_drift

    @property
    def run_drift(self) -> changes_mod.RunDrift | None:
        return self.drift_detector.run_drift

    def _run_level(self) -> list[Finding]:
        """The verdict's run-level findings, made once: the run's last leak judgement of each source that
        fails the run (the live finding of it, when there is one: one leak, one finding), and the run-wide
        error rate above the budget."""
        if self._run_findings is not None:
            return self._run_findings
        out: list[Finding] = []
        fail_on = self.cfg.verdict.fail_on
        judged: list[Finding] = []  # the live finding of a source that still fails: the one finding of it
        for lk in self.leaks.values():
            if lk.fails:
                diag = "KV cache not released" if lk.source in ("kv_cache", "kv_residue") else "memory leak"
                why = f"leak: {lk.message()}" if "leak" in fail_on else "'leak' is not in analysis.verdict.fail_on"
                live = next((f for f in reversed(self.findings) if f.kind == "leak" and f.diagnosis == diag
                             and f.evidence.get("source") == lk.source), None)
                if live is not None:
                    judged.append(live.judged("leak" in fail_on, why))
                    continue
                out.append(Finding(kind="leak", diagnosis=diag, severity="critical",
                                   message=f"the run's last leak judgement: {lk.message()}", evidence=lk.to_dict(),
                                   fails="leak" in fail_on, why=why))
        error_rate = self.history.error_rate()
        budget = self.cfg.verdict.error_budget
        if error_rate is not None and error_rate > budget:
            failed, requests = self.history.failed_requests()
            text = f"error rate {error_rate:.2%} is above the budget {budget:.2%}"
            bursts = self.errors.state().bursts
            where = f" (error bursts in windows {', '.join(map(str, bursts[:12]))})" if bursts else ""
            by_reason = failures_text(self.history.failures)
            out.append(Finding(kind="errors", diagnosis="error budget exceeded", severity="critical",
                               message=f"{failed} of {requests} measured requests failed over the run: {text}{where}"
                                       + (f"; {by_reason}" if by_reason else ""),
                               evidence={"error_rate": error_rate, "budget": budget, "failed": failed,
                                         "requests": requests, "burst_windows": list(bursts),
                                         "failures": dict(self.history.failures)},
                               fails="errors" in fail_on,
                               why=f"errors: {text}" if "errors" in fail_on else
                               "'errors' is not in analysis.verdict.fail_on"))
        for f in out:
            self.findings.append(f)
            key = (f.kind, f.severity)
            self.finding_counts[key] = self.finding_counts.get(key, 0) + 1
            self._event(f.kind, f.severity, f"{f.diagnosis}: {f.message}", f.to_dict(), None)
        self._run_findings = judged + out
        return self._run_findings

    def verdict(self) -> RunVerdict:
        """The run's verdict: every failing finding, the run's last leak judgement, the run-wide error
        rate against the budget; INCONCLUSIVE when too few windows could be judged, with the causes."""
        rd = self.finish()
        failing = [*self.failing_findings, *(f for f in self._run_level() if f.fails)]
        reasons = list(dict.fromkeys(f.reason for f in failing))
        full = self.history.full()
        min_requests = self.cfg.drift.min_requests
        scope = judged_mod.judged(self.history.closed, min_requests, self.drift_detector.detectable)
        scope = scope.model_copy(update={"requests_measured": self.history.measured})
        need = self.cfg.drift.baseline_windows + 2
        not_judged = judged_mod.not_judged(self.history.closed, min_requests)
        inconclusive = None
        if scope.windows < need or scope.windows < self.cfg.verdict.min_judged_share * len(full):
            causes = "; ".join(c.text() for c in not_judged if c.windows and c.cause != "partial")
            inconclusive = (f"{scope.windows} of {len(full)} full windows could be judged; a verdict needs {need} and "
                            f"{self.cfg.verdict.min_judged_share:.0%} of them"
                            + (f" (not judged: {causes})" if causes else ""))
        drops = {}
        for metric in self.cfg.drift.metrics:
            d = drift_mod.recurring_drops(full, metric, self.cfg.drift)
            if d:
                drops[metric] = d
        passed = not reasons
        stability = drift_mod.stability(full, self.cfg.drift)
        for f in self.findings:  # the run's own change points and trends settle what the spread could not
            if f.diagnosis in ("confident drift", "creep") and f.evidence.get("tier") == "confident":
                moved = [c["metric"] for c in f.evidence.get("changes") or [] if c.get("tier") == "confident"]
                for m in dict.fromkeys([*f.metrics, *moved]):  # improvements too: they moved
                    st = stability.get(m)
                    if st is not None and st.get("stable") is False:
                        st["significant"] = True
                        st["significant_by"] = "a confident change" if f.diagnosis != "creep" else "a confident trend"
        return RunVerdict(
            schema_version=VERDICT_SCHEMA_VERSION,
            result="FAIL" if not passed else "INCONCLUSIVE" if inconclusive else "PASS",
            passed=passed and not inconclusive,
            reasons=reasons,
            inconclusive=inconclusive,
            not_judged=not_judged,
            judged=scope,
            failing=failing,
            findings={f"{k}/{s}": n for (k, s), n in self.finding_counts.items()},
            stability=stability,
            recurring_drops=drops,
            drift=rd.to_dict(),
            leaks=[lk.to_dict() for lk in self.leaks.values() if lk.status != "no_data"],
            periodic=self.periodic.to_dict() if self.periodic is not None else None,
            ab=[r.to_dict() for r in self.ab.run or []] if self.ab is not None else None,
            notes=[f for f in self.findings if f.diagnosis == "leak page withdrawn"],
        )  # fmt: skip

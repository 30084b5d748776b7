"""The analysis engine: every closed window goes through drift, throttle, leak and diagnosis;
the results become findings, events and the run's verdict.

Pure bookkeeping (no I/O, no metrics): the window pipeline feeds it window summaries, quiesce
probes and canary results and persists what it emits (``on_event``); ``soakd.soak.exporter``
reads its state for /metrics. It holds the run's one in-memory window history.

Longer than 500 lines: the one place where a closed window meets every detector (drift and its
run-level family, throttle, leaks, freeze and wedge, KV saturation, GPU errors, restarts, canary,
A/B), and their order and bookkeeping are the verdict's; each rule itself lives in its own module.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from soakd.analysis import changes as changes_mod
from soakd.analysis import drift as drift_mod
from soakd.analysis import leak as leak_mod
from soakd.analysis import levels as levels_mod
from soakd.analysis import throttle as throttle_mod
from soakd.analysis.diagnosis import Finding, diagnose
from soakd.analysis.freeze import freeze_finding, freeze_threshold, wedge_finding
from soakd.analysis.gpu_errors import GpuErrors
from soakd.analysis.kvsat import kv_saturated_finding
from soakd.analysis.periodic import PeriodicDrops, periodic_drops
from soakd.analysis.restarts import ServerRestarts
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


def failing_reason(kind: str, diagnosis: str, window: int | None) -> str:
    """The verdict's reason for a finding that fails the run (the report and the JUnit file match
    findings to the verdict by it)."""
    return f"{kind}: {diagnosis} (window {window})"


@dataclass
class Verdict:
    """PASS, FAIL, or INCONCLUSIVE (too few windows could be judged: ``inconclusive`` says why)."""

    passed: bool = True
    reasons: list[str] = field(default_factory=list)
    stability: dict[str, Any] = field(default_factory=dict)
    recurring_drops: dict[str, Any] = field(default_factory=dict)
    findings: dict[str, int] = field(default_factory=dict)
    inconclusive: str | None = None
    drift: dict[str, Any] = field(default_factory=dict)  # the end-of-run judgement (changes.RunDrift)
    leaks: list[dict[str, Any]] = field(default_factory=list)
    periodic: dict[str, Any] | None = None  # periodic drops on the per-minute series (analysis.periodic)
    ab: list[dict[str, Any]] | None = None  # A/B runs: each candidate against the reference over the run

    @property
    def result(self) -> str:
        if not self.passed:
            return "FAIL"
        return "INCONCLUSIVE" if self.inconclusive else "PASS"

    def to_dict(self) -> dict[str, Any]:
        return {
            "result": self.result,
            "passed": self.passed and not self.inconclusive,
            "reasons": list(self.reasons),
            "inconclusive": self.inconclusive,
            "findings": dict(self.findings),
            "stability": self.stability,
            "recurring_drops": self.recurring_drops,
            "drift": self.drift,
            "leaks": self.leaks,
            "periodic": self.periodic,
            **({"ab": self.ab} if self.ab is not None else {}),
        }


class Analyzer:
    def __init__(self, config: AnalysisConfig, on_event: EventSink | None = None, baseline: Window | None = None,
                 history: WindowHistory | None = None, planned_windows: int | None = None,
                 candidates: int = 0) -> None:
        self.cfg = config
        # the live comparisons' family: metrics x windows x 2 references (changes.live_z), and in an A/B
        # run also each of the ``candidates`` against the reference (soakd.analysis.ab): one family
        self.planned_windows = max(1, planned_windows or 48)
        self.candidates = candidates
        self.z_live = changes_mod.live_z(config.drift, self.planned_windows, 2 + candidates)
        self.pool: list[Window] = [baseline] if baseline is not None else []
        self.series: dict[str, list[levels_mod.Level]] = {m: [] for m in config.drift.metrics}
        self.detectable: dict[str, float] = {}  # metric -> the smallest confident change of one window
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
        self.ab_run: list[dict[str, Any]] | None = None  # A/B: the run-level comparisons (set by the runtime)
        self.canary_checks = self.canary_mismatches = self.canary_errors = 0
        self.quiesce_probes = 0
        self.last_quiesce: QuiesceProbe | None = None
        self.stability: dict[str, Any] = {}
        self._capped_reported = False
        self.run_drift: changes_mod.RunDrift | None = None
        self.periodic: PeriodicDrops | None = None
        self.gpu_errors = GpuErrors()
        self.restarts = ServerRestarts()  # recognised in the server's metrics
        self.wedged_windows: set[int] = set()  # windows a live 'engine wedged' finding was made in
        # live wedge episodes (start unix, end unix or None while it lasts): a window they overlap is not judged
        # KV-saturated again (soakd.analysis.kvsat: one fault, one finding)
        self.live_episodes: deque[list[float | None]] = deque(maxlen=100)
        self.kv_saturated_window = False  # the last full window closed with a KV-saturated finding

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
        if not self.baseline_external:
            self.pool = []
        self.series = {m: [] for m in self.cfg.drift.metrics}
        for w in full:
            self._add_to_pool(w)
            self._add_levels(w)
        for w in windows:  # partial ones too: their counters are the latest of their segment
            self.gpu_errors.prime(w)
            self.restarts.count(w)

    # ---- the baseline pool and the level series
    def _poolable(self, w: Window) -> bool:
        return levels_mod.eligible(w) and drift_mod.choose_baseline([w], self.cfg.drift.min_requests) is not None

    @property
    def pool_complete(self) -> bool:
        return self.baseline_external or len(self.pool) >= self.cfg.drift.baseline_windows

    def _add_to_pool(self, w: Window) -> bool:
        if self.pool_complete or not self._poolable(w):
            return False
        self.pool.append(w)
        if self.baseline is None:
            self.baseline = w
        return True

    def _add_levels(self, w: Window) -> dict[str, levels_mod.Level]:
        out = {}
        for metric in self.cfg.drift.metrics:
            lv = levels_mod.level(w, metric, self.cfg.drift)
            if lv is not None:
                self.series[metric].append(lv)
                out[metric] = lv
        return out

    def _pool_levels(self, metric: str) -> list[levels_mod.Level]:
        out = []
        for p in self.pool:
            lv = levels_mod.level(p, metric, self.cfg.drift) if self.baseline_external else next(
                (x for x in self.series[metric] if x.window == p.window), None)
            if lv is not None:
                out.append(lv)
        return out

    def _live(self, w: Window, current: dict[str, levels_mod.Level]) -> list[drift_mod.DriftResult]:
        """Every metric of ``w`` against the pool and the previous window (changes.compare_levels)."""
        cfg = self.cfg.drift
        out = []
        prev = self.previous
        for metric in cfg.metrics:
            lv = current.get(metric)
            # the noise floor from the windows before this one: a step in it must not hide itself
            history = self.series[metric][:-1] if lv is not None else self.series[metric]
            tau2 = changes_mod.tau2_upper(history)
            refs: list[tuple[str, list[levels_mod.Level]]] = [("baseline", self._pool_levels(metric))]
            if prev is not None:
                p = next((x for x in reversed(self.series[metric]) if x.window == prev.window), None)
                refs.append(("previous", [p] if p is not None else []))
            for kind, ref in refs:
                if lv is None or not ref:
                    r = drift_mod.compare(w, self.baseline if kind == "baseline" else prev, metric, cfg,
                                          reference_kind=kind)  # type: ignore[arg-type]
                    out.append(replace(r, status="no_data" if r.status == "no_data" else "insufficient",
                                       direction=None))
                    continue
                out.append(changes_mod.compare_levels(metric, lv, ref, tau2, self.z_live, cfg,
                                                      reference_kind=kind))  # type: ignore[arg-type]
        return out

    def _pool_done(self, w: Window) -> None:
        cfg = self.cfg.drift
        mde = {}
        for metric in cfg.metrics:
            pool = self._pool_levels(metric)
            if not pool:
                continue
            tau2 = changes_mod.tau2_upper(self.series[metric])
            var = sum(lv.var for lv in pool) / len(pool)
            one = changes_mod.mde(metric, var, pool, tau2, self.z_live, cfg)
            self.detectable[metric] = one
            mde[metric] = {"one_window": one,
                           "pooled_12_windows": changes_mod.mde(metric, var, pool, tau2, self.z_live, cfg, 12)}
        wins = [p.window for p in self.pool]
        text = ", ".join(f"{m} {changes_mod.format_change(m, v['one_window'])[1:]}" for m, v in mde.items())
        self._event("baseline", "info", f"windows {wins} are the baseline pool; smallest change one window can "
                    f"show as confident drift: {text}", {"windows": wins, "detectable": mde}, w.window)

    def add_window(self, w: Window) -> list[Finding]:
        cfg = self.cfg
        joined = False if w.partial else self._add_to_pool(w)
        if joined and len(self.pool) == 1:
            self._event("baseline", "info", f"window {w.window} is the baseline", {"window": w.window}, w.window)
        current = {} if w.partial else self._add_levels(w)
        results: list[drift_mod.DriftResult] = []
        if self.pool_complete and not joined and not w.partial:
            results = self._live(w, current)
        for r in results:
            self.drift[(r.metric, r.reference)] = r
        for metric in cfg.drift.metrics:
            flagged = [r for r in results if r.metric == metric and r.flagged]
            self.drift_active[metric] = bool(flagged)
            if flagged:
                self.drift_events[metric] = self.drift_events.get(metric, 0) + 1
        if joined and self.pool_complete:
            self._pool_done(w)
        perf = any(r.flagged and r.direction == "degraded" and r.metric != "error_rate" for r in results)
        self.throttles = throttle_mod.evaluate(w, self.baseline, cfg.throttle, latency_drift=perf)
        self.throttle_detected = any(t.detected for t in self.throttles)
        self.history.add(w)
        full = self.history.full()
        leaks = leak_mod.evaluate(full, cfg.leak)
        new_leaks = [lk for lk in leaks if lk.suspected and not (self.leaks.get(lk.source)
                                                               and self.leaks[lk.source].suspected)]
        revised = [lk for lk in leaks if not lk.suspected and self.leaks.get(lk.source) is not None
                   and self.leaks[lk.source].suspected]
        # a staircase is named once (a 'memory steps' finding); its later steps are info events
        new_steps = [lk for lk in leaks if lk.memory_steps and not (self.leaks.get(lk.source)
                                                                    and self.leaks[lk.source].memory_steps)]
        more_steps = [lk for lk in leaks if lk.memory_steps and lk not in new_steps
                      and lk.steps > self.leaks[lk.source].steps]
        self.leaks = {lk.source: lk for lk in leaks}
        gpu_findings = self.gpu_errors.add(w)  # critical at once, in a partial window too
        restarts = self.restarts.count(w)
        if w.partial and restarts:
            self.restarts.report(w, restarts, gpu_findings)
        for f in gpu_findings:
            self._finding(f)
        if w.partial:
            # the window cut short by the end of the run: reported, not judged
            self.stability = drift_mod.stability(full, cfg.drift)
            return gpu_findings
        for lk in revised:
            self._event("leak", "info", f"leak finding revised: {lk.message()}", lk.to_dict(), w.window)
        for lk in more_steps:
            self._event("leak", "info", f"memory steps: another step: {lk.message()}", lk.to_dict(), w.window)
        kv_res = self.leaks.get("kv_residue")
        findings = diagnose(
            w,
            results,
            self.throttles,
            [lk for lk in leaks if lk.source != "kv_residue" and (lk in new_leaks or lk in new_steps)],
            kv_res if kv_res is not None and kv_res in new_leaks else None,
            baseline=self.baseline,
            drift_cfg=cfg.drift,
            cfg=cfg.diagnosis,
        )
        freeze = self._freeze(w)
        if freeze is not None:
            findings.append(freeze)
        kv = self._kv_saturated(w)
        self.kv_saturated_window = kv is not None
        if kv is not None:
            findings.append(kv)
        if restarts:
            self.restarts.report(w, restarts, findings)
        if w.client is not None and w.client.impaired:
            self._event("client", "info", f"window {w.window} is client-impaired (shown, not judged): "
                        f"{w.client.impaired_reason}", w.client.model_dump(), w.window)
        capped = [t for t in self.throttles if t.active and not t.impact and t.sm_clock_reference_kind == "baseline"]
        if capped and not self._capped_reported:
            self._capped_reported = True
            findings.append(Finding(
                kind="throttle", diagnosis="power-capped, healthy", severity="info",
                message="; ".join(t.message() for t in capped) + ": the SM clock holds the baseline's and latency "
                "has not drifted, so this is a GPU running at its limit under full load, not throttling",
                evidence={"throttle": [t.to_dict() for t in capped]}, window=w.window))  # fmt: skip
        for f in findings:
            self._finding(f)
        self.previous = w
        self.stability = drift_mod.stability(full, cfg.drift)
        return findings

    def _freeze(self, w: Window) -> Finding | None:
        """The window's server freeze (``soakd.analysis.freeze``), unless a live wedge finding of this
        window already reported the silence."""
        return None if w.window in self.wedged_windows else freeze_finding(w, self.freeze_threshold(w))

    def _kv_saturated(self, w: Window) -> Finding | None:
        """The window's KV-saturated-and-stuck span (``soakd.analysis.kvsat``), unless a live wedge episode
        overlapped the window (that fault has its finding)."""
        if w.server.kv_saturated is None:
            return None
        start = w.start_unix
        end = None if start is None else start + (w.wall_duration_seconds or w.duration_seconds)
        for s, e in self.live_episodes:
            if start is None or s is None or ((e is None or e >= start) and end is not None and s <= end):
                return None
        ref = self.baseline if self.baseline is not None and self.baseline.window != w.window else None
        return kv_saturated_finding(w, ref, self.cfg.kv_saturated)

    def freeze_threshold(self, w: Window | None = None) -> float:
        return freeze_threshold(self.cfg, self.baseline if self.baseline is not None else (
            w if w is not None else self.history.last))

    def add_wedge(self, ep: dict[str, Any]) -> None:
        """A live wedge (``soakd.soak.wedge``): requests in flight, no byte, the server answering."""
        if ep.get("window") is not None:
            self.wedged_windows.add(ep["window"])
        self.live_episodes.append([ep.get("start_unix"), None])
        self._finding(wedge_finding(ep))

    def wedge_ended(self, ep: dict[str, Any], seconds: float) -> None:
        for span in self.live_episodes:
            if span[0] == ep.get("start_unix") and span[1] is None and span[0] is not None:
                span[1] = span[0] + seconds
        self._event("freeze", "info", f"engine recovered: generating again after {seconds:.1f} s wedged "
                    f"(seen by {', '.join(ep.get('sources_seen') or ep.get('sources') or ['streams'])})",
                    {"wedged_seconds": seconds, **ep}, ep.get("window"))

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
        if f.evidence.get("fails") is False or f.evidence.get("tier") == "likely":
            return None  # reported, not failing: a likely change, periodic drops
        if kind == "errors":
            return None  # judged run-wide against the error budget
        elif kind == "leak":
            return None  # judged on the run's last leak judgement (a finding may be revised)
        elif kind not in v.fail_on:
            return None
        return failing_reason(kind, f.diagnosis, f.window)

    def add_ab(self, results: list[Any]) -> None:
        """A/B comparisons (``soakd.analysis.ab.AbResult``) into this, the reference target's analysis:
        a *confident* worse one is a critical finding of kind ``ab`` (failing the run by default), a
        likely or better one is info."""
        for r in results:
            if r.tier is None:
                continue
            worse = r.tier == "confident" and r.direction == "worse"
            self._finding(Finding(kind="ab", diagnosis=f"{r.tier} A/B {'difference' if r.direction != 'worse' else 'regression'}",
                                  severity="critical" if worse else "info", message=r.message(),
                                  evidence={"tier": r.tier, **r.to_dict()}, window=r.window))

    def finish(self) -> changes_mod.RunDrift:
        """The end of the run: change points, segment changes and trends over every full window
        (``changes.judge_run``); their findings are emitted once. Idempotent."""
        if self.run_drift is None:
            rd = changes_mod.judge_run(self.history.full(), [p.window for p in self.pool], self.cfg.drift)
            self.run_drift = rd
            for c in rd.changes:
                self._finding(Finding(kind="drift", diagnosis=f"{c.tier} drift", severity="critical"
                                      if c.tier == "confident" and c.direction == "degraded" else "info",
                                      message=c.message(), evidence={"tier": c.tier, **c.to_dict()},
                                      window=c.window))  # fmt: skip
            self.periodic = periodic_drops(self.history.full())
            if self.periodic is not None:
                pd = self.periodic
                self._finding(Finding(kind="drift", diagnosis="periodic drops", severity="warning",
                                      message=pd.message(), evidence={"fails": False, **pd.to_dict()}, window=None))
            for t in rd.trends:
                self._finding(Finding(kind="drift", diagnosis="creep", severity="critical"
                                      if t.tier == "confident" and t.direction == "degraded" else "info",
                                      message=t.message(),
                                      evidence={"tier": t.tier, **t.to_dict()}, window=t.first_window))
        return self.run_drift

    def verdict(self) -> Verdict:
        """The run's verdict: every failing finding, the run's last leak judgement, the run-wide error
        rate against the budget; INCONCLUSIVE when too few windows could be judged."""
        rd = self.finish()
        error_rate = self.history.error_rate()
        v = Verdict()
        v.reasons = list(dict.fromkeys(self.failing))
        fail_on = self.cfg.verdict.fail_on
        if "leak" in fail_on:
            for lk in self.leaks.values():
                if lk.fails:
                    v.reasons.append(f"leak: {lk.message()}")
        if "errors" in fail_on and error_rate is not None and error_rate > self.cfg.verdict.error_budget:
            v.reasons.append(f"errors: error rate {error_rate:.2%} is above the budget "
                             f"{self.cfg.verdict.error_budget:.2%}")
        v.passed = not v.reasons
        full = self.history.full()
        judged = sum(1 for w in full if self._poolable(w))
        need = self.cfg.drift.baseline_windows + 2
        if judged < need or judged < self.cfg.verdict.min_judged_share * len(full):
            v.inconclusive = (f"{judged} of {len(full)} full windows could be judged (target up, at least "
                              f"{self.cfg.drift.min_requests} requests); a verdict needs {need} and "
                              f"{self.cfg.verdict.min_judged_share:.0%} of them")
        v.stability = drift_mod.stability(full, self.cfg.drift)
        drops = {}
        for metric in self.cfg.drift.metrics:
            d = drift_mod.recurring_drops(full, metric, self.cfg.drift)
            if d:
                drops[metric] = d
        v.recurring_drops = drops
        v.findings = {f"{k}/{s}": n for (k, s), n in self.finding_counts.items()}
        v.drift = rd.to_dict()
        v.periodic = self.periodic.to_dict() if self.periodic is not None else None
        v.leaks = [lk.to_dict() for lk in self.leaks.values() if lk.status != "no_data"]
        v.ab = self.ab_run
        return v

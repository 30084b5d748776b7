"""The analysis engine: every closed window goes through drift, throttle, leak and diagnosis;
the results become gauges, counters, events and the run's verdict.

Pure bookkeeping (no I/O): the daemon feeds it window summaries and canary results, persists what
it emits (``on_event``) and exposes ``families()`` on /metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from soakd.analysis import drift as drift_mod
from soakd.analysis import leak as leak_mod
from soakd.analysis import throttle as throttle_mod
from soakd.analysis.diagnosis import Finding, diagnose
from soakd.metrics import BY_NAME
from soakd.samplers.reasons import CLOCKS_EVENT_REASON_NAMES

Window = dict[str, Any]
EventSink = Callable[[str, str, str, dict[str, Any], int | None], None]  # kind, severity, message, data, window

LEAK_SOURCES_BYTES = ("device_memory", "target_gpu_memory", "target_rss")
KV_SOURCES = ("kv_cache", "kv_residue")


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
    def __init__(self, config: Any, on_event: EventSink | None = None, baseline: Window | None = None,
                 max_windows: int = 5000) -> None:
        self.cfg = config  # AnalysisConfig
        self.on_event = on_event
        self.windows: list[Window] = []
        self.max_windows = max_windows
        self.baseline = baseline
        self.baseline_external = baseline is not None
        self.previous: Window | None = None
        self.last_window: Window | None = None
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
        self.last_quiesce: dict[str, Any] | None = None
        self.stability: dict[str, Any] = {}

    # ---- inputs
    def restore(self, windows: list[Window], baseline: Window | None) -> None:
        """Resume: the windows of earlier segments (from the store) and the baseline."""
        self.windows = [w for w in windows if not w.get("partial")][-self.max_windows:]
        if baseline is not None and not self.baseline_external:
            self.baseline = baseline
        self.previous = self.windows[-1] if self.windows else None

    def add_window(self, w: Window) -> list[Finding]:
        cfg = self.cfg
        self.last_window = w
        if self.baseline is None and not w.get("partial"):
            self.baseline = drift_mod.choose_baseline([w], cfg.drift.min_requests)
            if self.baseline is not None:
                self._event("baseline", "info", f"window {w['window']} is the baseline",
                            {"window": w["window"]}, w["window"])
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
        if not w.get("partial"):
            self.windows.append(w)
            if len(self.windows) > self.max_windows:
                self.windows = self.windows[-self.max_windows:]
        leaks = leak_mod.evaluate(self.windows, cfg.leak)
        new_leaks = [lk for lk in leaks if lk.suspected and not (self.leaks.get(lk.source)
                                                               and self.leaks[lk.source].suspected)]
        self.leaks = {lk.source: lk for lk in leaks}
        kv_res = self.leaks.get("kv_residue")
        if w.get("partial"):
            # the window cut short by the end of the run: reported, not judged
            self.stability = drift_mod.stability(self.windows, cfg.drift)
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
        if not w.get("partial"):
            self.previous = w
        self.stability = drift_mod.stability(self.windows, cfg.drift)
        return findings

    def add_canary(self, result: Any, window: int | None) -> None:
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

    def add_quiesce(self, probe: dict[str, Any]) -> None:
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

    def verdict(self, error_rate: float | None) -> Verdict:
        v = Verdict()
        v.reasons = list(dict.fromkeys(self.failing))
        if "errors" in self.cfg.verdict.fail_on and error_rate is not None and error_rate > self.cfg.verdict.error_budget:
            v.reasons.append(f"errors: error rate {error_rate:.2%} is above the budget "
                             f"{self.cfg.verdict.error_budget:.2%}")
        v.passed = not v.reasons
        v.stability = drift_mod.stability(self.windows, self.cfg.drift)
        drops = {}
        for metric in self.cfg.drift.metrics:
            d = drift_mod.recurring_drops(self.windows, metric, self.cfg.drift)
            if d:
                drops[metric] = d
        v.recurring_drops = drops
        v.findings = {f"{k}/{s}": n for (k, s), n in self.finding_counts.items()}
        return v

    def families(self) -> Iterator[Metric]:
        S = BY_NAME
        g = GaugeMetricFamily
        ratio = g("soakd_drift_ratio", S["soakd_drift_ratio"].help, labels=["metric", "reference"])
        for (metric, ref), r in sorted(self.drift.items()):
            if r.ratio is not None:
                ratio.add_metric([metric, ref], r.ratio)
        yield ratio
        det = g("soakd_drift_detected", S["soakd_drift_detected"].help, labels=["metric"])
        ev = CounterMetricFamily("soakd_drift_events", S["soakd_drift_events_total"].help, labels=["metric"])
        for metric in self.cfg.drift.metrics:
            det.add_metric([metric], 1.0 if self.drift_active.get(metric) else 0.0)
            ev.add_metric([metric], float(self.drift_events.get(metric, 0)))
        yield det
        yield ev
        w = self.last_window
        if w is not None:
            val = g("soakd_window_value", S["soakd_window_value"].help, labels=["metric"])
            for metric in self.cfg.drift.metrics:
                value, _ci, _n = drift_mod.metric_value(w, metric)
                if value is not None:
                    val.add_metric([metric], value)
            yield val
            req = g("soakd_window_requests", S["soakd_window_requests"].help)
            req.add_metric([], float(w.get("requests") or 0))
            yield req
            ins = g("soakd_window_insufficient", S["soakd_window_insufficient"].help)
            ins.add_metric([], 0.0 if (w.get("requests") or 0) >= self.cfg.drift.min_requests else 1.0)
            yield ins
        spread = g("soakd_stability_spread_ratio", S["soakd_stability_spread_ratio"].help, labels=["metric"])
        for metric, st in sorted(self.stability.items()):
            if st.get("spread") is not None:
                spread.add_metric([metric], st["spread"])
        yield spread
        growth = g("soakd_memory_growth_bytes_per_hour", S["soakd_memory_growth_bytes_per_hour"].help,
                   labels=["source"])
        kvg = g("soakd_kv_cache_growth_ratio_per_hour", S["soakd_kv_cache_growth_ratio_per_hour"].help,
                labels=["source"])
        sus = g("soakd_memory_leak_suspected", S["soakd_memory_leak_suspected"].help, labels=["source"])
        for source, lk in sorted(self.leaks.items()):
            if lk.status == "no_data":
                continue
            sus.add_metric([source], 1.0 if lk.suspected else 0.0)
            if lk.growth_per_hour is not None:
                (growth if source in LEAK_SOURCES_BYTES else kvg).add_metric([source], lk.growth_per_hour)
        yield growth
        yield kvg
        yield sus
        thr = g("soakd_throttle_detected", S["soakd_throttle_detected"].help)
        thr.add_metric([], 1.0 if self.throttle_detected else 0.0)
        yield thr
        share = (w or {}).get("device", {}).get("throttle_share") if w else None
        if share:
            sh = g("soakd_throttle_share_ratio", S["soakd_throttle_share_ratio"].help, labels=["reason"])
            for reason in CLOCKS_EVENT_REASON_NAMES:
                sh.add_metric([reason], float(share.get(reason, 0.0)))
            yield sh
        q = self.last_quiesce
        if q is not None:
            if q.get("kv_cache_usage_ratio") is not None:
                fam = g("soakd_quiesce_kv_cache_usage_ratio", S["soakd_quiesce_kv_cache_usage_ratio"].help)
                fam.add_metric([], q["kv_cache_usage_ratio"])
                yield fam
            if q.get("memory_used_bytes") is not None:
                fam = g("soakd_quiesce_gpu_memory_used_bytes", S["soakd_quiesce_gpu_memory_used_bytes"].help)
                fam.add_metric([], q["memory_used_bytes"])
                yield fam
        for name, value in (("soakd_quiesce_probes", self.quiesce_probes), ("soakd_canary_checks", self.canary_checks),
                            ("soakd_canary_mismatch", self.canary_mismatches),
                            ("soakd_canary_errors", self.canary_errors)):
            c = CounterMetricFamily(name, S[name + "_total"].help)
            c.add_metric([], float(value))
            yield c
        fc = CounterMetricFamily("soakd_findings", S["soakd_findings_total"].help, labels=["kind", "severity"])
        for kind in ("drift", "leak", "throttle", "canary", "errors", "target"):
            for sev in ("warning", "critical"):
                fc.add_metric([kind, sev], float(self.finding_counts.get((kind, sev), 0)))
        yield fc
        vp = g("soakd_verdict_pass", S["soakd_verdict_pass"].help)
        vp.add_metric([], 0.0 if self.failing else 1.0)
        yield vp

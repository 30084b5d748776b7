"""The analysis results on /metrics: a snapshot source that reads the analysis detectors' states
(``Analyzer.states()``) at scrape time (no I/O) and turns them into the catalogue's analysis families; and
the target's identity (``TargetIdentity``).

``soakd_target_info``: what a pod's peers in a fleet must share to be compared with it, on one series.

In a cluster every pod runs its sidecar and Prometheus compares each pod's window levels with its peers'
(deploy/prometheus/rules.yml, group ``soakd.fleet``): peers are the pods that soak the same model on the
same GPU model behind the same server kind and version. This source puts the four on one info series,
``soakd_target_info{target, model, server, server_version, gpu_model}``, so that the fleet rules join one
series instead of three: the model is the target's resolved model; the server's kind and version are the
server sampler's (``soakd_server_info``); the GPU model is the product name the NVML or DCGM sampler reads
(``soakd_gpu_info``; several names joined by ``+``, empty without a GPU sampler). Nothing until the model
is known (the target answered).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import Metric

from soakd.analysis.drift import metric_value
from soakd.analysis.detector import AbState, LeakState, ThrottleState
from soakd.analysis.drift_watch import DriftState
from soakd.analysis.errors import ErrorState
from soakd.analysis.engine import LEAK_SOURCES_BYTES, Analyzer, FindingsState, ProbeState
from soakd.core.findings import KINDS
from soakd.core.reasons import CLOCKS_EVENT_REASON_NAMES
from soakd.metrics import BY_NAME
from soakd.samplers.base import SamplerRunner

# soakd_findings_total: every kind of the finding registry (ab only in A/B runs)
FINDING_KINDS = tuple(k for k in KINDS if k != "ab")


class AbExporter:
    """``soakd_ab_ratio{metric,target}``: each candidate's last window against the reference's (the
    reference's A/B detector's state; absent where the pair had no eligible window: a reference that is
    down gives no ratio)."""

    def __init__(self, analyzer: Analyzer) -> None:
        self.analyzer = analyzer

    def __call__(self) -> Iterator[Metric]:
        fam = BY_NAME["soakd_ab_ratio"].family()
        state: AbState | None = self.analyzer.states().get("ab")
        for (metric, cand), r in sorted((state.last if state is not None else {}).items()):
            fam.add_metric([metric, cand], r.ratio)
        yield fam


class AnalysisExporter:
    """``soakd_drift_*``, ``soakd_window_*``, leak, throttle, quiesce, canary, findings and verdict
    families from one :class:`~soakd.analysis.engine.Analyzer` (a ``SoakMetrics`` source)."""

    def __init__(self, analyzer: Analyzer) -> None:
        self.analyzer = analyzer

    def __call__(self) -> Iterator[Metric]:
        a = self.analyzer
        cfg = a.cfg
        states = a.states()
        drift: DriftState = states["drift"]
        leaks: LeakState = states["leak"]
        throttle: ThrottleState = states["throttle"]
        probes: ProbeState = states["probes"]
        found: FindingsState = states["findings"]
        ratio = BY_NAME["soakd_drift_ratio"].family()
        for (metric, ref), r in sorted(drift.drift.items()):
            if r.ratio is not None:
                ratio.add_metric([metric, ref], r.ratio)
        yield ratio
        det = BY_NAME["soakd_drift_detected"].family()
        ev = BY_NAME["soakd_drift_events_total"].family()
        for metric in cfg.drift.metrics:
            det.add_metric([metric], 1.0 if drift.active.get(metric) else 0.0)
            ev.add_metric([metric], float(drift.events.get(metric, 0)))
        yield det
        yield ev
        mde = BY_NAME["soakd_drift_detectable_ratio"].family()
        for metric, v in sorted(drift.detectable.items()):
            mde.add_metric([metric], v)
        yield mde
        w = states["window"]
        if w is not None:
            val = BY_NAME["soakd_window_value"].family()
            for metric in cfg.drift.metrics:
                value, _ci, _n = metric_value(w, metric)
                if value is not None:
                    val.add_metric([metric], value)
            yield val
            req = BY_NAME["soakd_window_requests"].family()
            req.add_metric([], float(w.requests))
            yield req
            ins = BY_NAME["soakd_window_insufficient"].family()
            ins.add_metric([], 0.0 if w.requests >= cfg.drift.min_requests else 1.0)
            yield ins
            c = w.client
            imp = BY_NAME["soakd_window_client_impaired"].family()
            imp.add_metric([], 1.0 if c is not None and c.impaired else 0.0)
            yield imp
            if c is not None and c.impaired_share is not None:
                share = BY_NAME["soakd_window_requests_impaired_ratio"].family()
                share.add_metric([], c.impaired_share)
                yield share
            if c is not None and c.heartbeats:
                lag = BY_NAME["soakd_window_loop_lag_seconds"].family()
                for q, v in (("p50", c.loop_lag_p50_seconds), ("p99", c.loop_lag_p99_seconds),
                             ("max", c.loop_lag_max_seconds)):
                    if v is not None:
                        lag.add_metric([q], v)
                yield lag
            diff = BY_NAME["soakd_window_server_latency_difference_seconds"].family()
            for metric, ours, theirs in w.beside_server():
                diff.add_metric([metric], ours - theirs)
            yield diff
            if w.server.prefix_cache_hit_ratio is not None:
                hit = BY_NAME["soakd_window_prefix_cache_hit_ratio"].family()
                hit.add_metric([], w.server.prefix_cache_hit_ratio)
                yield hit
            fr = BY_NAME["soakd_window_freeze_seconds"].family()
            fr.add_metric([], float(c.freeze_max_seconds or 0.0) if c is not None else 0.0)
            yield fr
        spread = BY_NAME["soakd_stability_spread_ratio"].family()
        for metric, st in sorted(drift.stability.items()):
            if st.get("spread") is not None:
                spread.add_metric([metric], st["spread"])
        yield spread
        growth = BY_NAME["soakd_memory_growth_bytes_per_hour"].family()
        kvg = BY_NAME["soakd_kv_cache_growth_ratio_per_hour"].family()
        sus = BY_NAME["soakd_memory_leak_suspected"].family()
        steps = BY_NAME["soakd_memory_steps"].family()
        for source, lk in sorted(leaks.leaks.items()):
            if lk.status == "no_data":
                continue
            sus.add_metric([source], 1.0 if lk.suspected else 0.0)
            if source in LEAK_SOURCES_BYTES:
                steps.add_metric([source], float(lk.steps) if lk.memory_steps else 0.0)
            if lk.growth_per_hour is not None:
                (growth if source in LEAK_SOURCES_BYTES else kvg).add_metric([source], lk.growth_per_hour)
        yield growth
        yield kvg
        yield sus
        yield steps
        thr = BY_NAME["soakd_throttle_detected"].family()
        thr.add_metric([], 1.0 if throttle.detected else 0.0)
        yield thr
        by_gpu = BY_NAME["soakd_throttle_gpu_detected"].family()
        for t in throttle.results:
            for gpu in throttle.gpus:
                by_gpu.add_metric([gpu, t.reason], 1.0 if t.detected and gpu in t.gpus else 0.0)
        yield by_gpu
        share = w.device.throttle_share if w is not None else None
        if share:
            sh = BY_NAME["soakd_throttle_share_ratio"].family()
            for reason in CLOCKS_EVENT_REASON_NAMES:
                sh.add_metric([reason], float(share.get(reason, 0.0)))
            yield sh
        q = probes.last_quiesce
        if q is not None:
            if q.kv_cache_usage_ratio is not None:
                fam = BY_NAME["soakd_quiesce_kv_cache_usage_ratio"].family()
                fam.add_metric([], q.kv_cache_usage_ratio)
                yield fam
            if q.memory_used_bytes is not None:
                fam = BY_NAME["soakd_quiesce_gpu_memory_used_bytes"].family()
                fam.add_metric([], q.memory_used_bytes)
                yield fam
        for name, value in (("soakd_quiesce_probes_total", probes.quiesce_probes),
                            ("soakd_canary_checks_total", probes.canary_checks),
                            ("soakd_canary_mismatch_total", probes.canary_mismatches),
                            ("soakd_canary_errors_total", probes.canary_errors)):
            c = BY_NAME[name].family()
            c.add_metric([], float(value))
            yield c
        fc = BY_NAME["soakd_findings_total"].family()
        for kind in FINDING_KINDS + (("ab",) if a.candidates else ()):
            for sev in ("warning", "critical"):
                fc.add_metric([kind, sev], float(found.counts.get((kind, sev), 0)))
        yield fc
        es: ErrorState = states["errors"]
        er = BY_NAME["soakd_error_ratio"].family()
        for scope, v in (("window", es.window_ratio), ("run", es.run_ratio)):
            if v is not None:
                er.add_metric([scope], v)
        yield er
        eb = BY_NAME["soakd_error_budget_ratio"].family()
        eb.add_metric(["window"], es.window_budget)
        eb.add_metric(["run"], es.run_budget)
        yield eb
        vp = BY_NAME["soakd_verdict_pass"].family()
        vp.add_metric([], 0.0 if found.failing else 1.0)
        yield vp


_STALE = 3600.0  # identity does not go stale with a failing scrape: the last one read stays


class TargetIdentity:
    """A ``SoakMetrics`` target source: ``soakd_target_info`` of one target."""

    def __init__(self, model: Callable[[], str | None], runners: Sequence[SamplerRunner] = (),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.model = model
        self.runners = runners
        self.clock = clock
        self._server = ("", "")
        self._gpus = ""

    def _read(self) -> None:
        now = self.clock()
        gpus: set[str] = set()
        seen_gpu = False
        for r in self.runners:
            for s in r.fresh(now, _STALE):
                if s.name == "soakd_server_info":
                    self._server = (s.label("kind") or "", s.label("version") or "")
                elif s.name == "soakd_gpu_info":
                    seen_gpu = True
                    if s.label("name"):
                        gpus.add(str(s.label("name")))
        if seen_gpu:
            self._gpus = "+".join(sorted(gpus))

    def __call__(self) -> Iterator[Metric]:
        model = self.model()
        if not model:
            return
        self._read()
        fam = BY_NAME["soakd_target_info"].family()
        server, version = self._server
        fam.add_metric([model, server, version, self._gpus], {})
        yield fam

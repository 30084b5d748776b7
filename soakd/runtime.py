"""The composition root of a soak: builds the parts, owns their start and stop order, the stop
signals and the scheduler — nothing else.

Start: the run store (resume or a new run) → /metrics, /healthz, /readyz, /status → the
scheduler with one job per sampler → the target answers (the model) → the run's segment → the
timeline, windows, recorder and load driver → the load jobs (tick, summary line, progress line,
checkpoint, quiesce probes, canary) → load until the duration, ``max_requests`` or a stop
signal. Stop: drain in-flight requests (``run.grace``) → close the last windows through the
pipeline → the verdict into the store → the reports → samplers, client, web server, store.

One request's path: ``driver`` → ``client`` (fills a ``RequestRecord``) → ``recorder``
(metrics; its window in ``windows``) → at the window's end the tick closes it →
``pipeline`` (store → analysis → events → log) → ``soakd report`` renders it from the store. With
``load.workers`` > 1 the driver is a ``WorkerPool`` of load processes whose records come back into the recorder.
One sample's path: a scheduler job runs a ``SamplerRunner`` → its snapshot is on /metrics and
goes to ``telemetry`` (its window; the store's per-minute samples at the next checkpoint).

Longer than 500 lines: the start and stop order of every part is one sequence, and it reads best in one place.
"""

from __future__ import annotations

import asyncio
import math
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import structlog
from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_MAX_INSTANCES, EVENT_JOB_MISSED
from apscheduler.schedulers.asyncio import AsyncIOScheduler

from soakd import __version__, logging_setup
from soakd.analysis.engine import Analyzer
from soakd.client.openai import OpenAIClient
from soakd.config import SoakConfig
from soakd.core.findings import finding_log
from soakd.core.records import OUTCOMES
from soakd.core.verdict import EXIT_UNSAVED, RunVerdict
from soakd.core.timeline import SYSTEM_CLOCK, Clock, Timeline
from soakd.metrics import SoakMetrics
from soakd.report import write_final_reports
from soakd.samplers.base import SamplerRunner, SnapshotCollector
from soakd.samplers.registry import build_samplers
from soakd.soak.canary import Canary, CanaryRunner
from soakd.soak.driver import LoadDriver
from soakd.soak.events import EventLog
from soakd.soak.wedge import WedgeWatch
from soakd.soak.workers import WorkerPool
from soakd.analysis.ab import AbJudge
from soakd.soak.exporter import AbExporter, AnalysisExporter, TargetIdentity
from soakd.soak.target_run import TargetRun
from soakd.soak.pipeline import WindowPipeline
from soakd.soak.quiesce import QuiesceProber
from soakd.soak.recorder import Recorder, RecordListener
from soakd.soak.selfwatch import CgroupCpu, frozen_startup_heap
from soakd.soak.session import GRACEFUL_STOPS, RunSession, read_baseline
from soakd.soak.status import Load, StatusBoard
from soakd.soak.target import resolve_model
from soakd.soak.telemetry import TelemetryRouter
from soakd.soak.windows import WindowSet
from soakd.web import Heartbeat, WebServer, build_app
from soakd.workload.scenarios import resolve_all, trace_log_fields, with_trace_arrivals
from soakd.workload.workload import Workload

log = structlog.get_logger("soakd")


class StartupError(Exception):
    """The soak cannot start (metrics port taken, state dir not writable): exit 1 with this message."""


@dataclass
class RunOutcome:
    """How a soak ended (the record itself is in the store: ``soakd report``)."""

    run_id: str
    stop_reason: str
    verdict: RunVerdict | None = None
    requests_sent: int = 0
    requests_measured: int = 0
    warmup_requests: int = 0
    windows: int = 0
    resumed: bool = False
    prompt_length_accuracy: dict[str, float] | None = None
    outcomes: dict[str, int] = field(default_factory=dict)  # of the measured requests
    unsaved: tuple[int, int, str] | None = None  # writes the store could not save at the end: (kept, dropped, where)

    @property
    def graceful_stop(self) -> bool:
        return self.stop_reason in GRACEFUL_STOPS


class Runtime:
    def __init__(self, config: SoakConfig, *, progress: bool | None = None, nvml_module: Any = None,
                 new_run: bool = False, clock: Clock = SYSTEM_CLOCK,
                 record_listeners: tuple[RecordListener, ...] = ()) -> None:
        self.config = config
        self.clock = clock
        self.policies = config.policies()
        self.record_listeners = record_listeners
        target_cfgs = config.target_list()  # the reference (or only) target first
        baseline = (read_baseline(config.analysis.baseline, config.analysis.drift.min_requests)
                    if config.analysis.baseline is not None else None)
        self.scenarios = resolve_all(config)
        config = self.config = with_trace_arrivals(config, self.scenarios)
        slos = config.slos()
        self.slos = {name: (slo.ttft, slo.itl, slo.e2e) for name, slo in slos.items()}
        objectives = {name: slo.quantile for name, slo in slos.items()}
        self.session = RunSession(config, new_run=new_run, clock=clock)
        self.events = EventLog(self.session, clock)
        planned = max(1, math.ceil(config.run.duration / config.run.window))
        candidates = len(target_cfgs) - 1
        # an A/B run: the judge of every other target against the reference, a detector of the reference's analysis
        judge = (AbJudge(config.analysis, target_cfgs[0].name, [t.name for t in target_cfgs[1:]], planned)
                 if candidates else None)
        self.targets: list[TargetRun] = []
        for i, t in enumerate(target_cfgs):  # one path per target (soakd.soak.target_run)
            ref = i == 0
            metrics = SoakMetrics(tuple(self.scenarios), __version__, slo_objectives=objectives, target=t.name,
                                  log_dropped=logging_setup.dropped)
            analyzer = Analyzer(config.analysis, on_event=self.events.emit if ref else self._target_event(t.name),
                                baseline=baseline if ref else None, planned_windows=planned, candidates=candidates,
                                ab=judge if ref else None)
            pipeline = WindowPipeline(self.session, analyzer, self.events, metrics, target=None if ref else t.name,
                                      ab=None if ref else self.targets[0].analyzer)
            client = OpenAIClient(t, config.api_key(t), pool_size=self._pool_size(config))  # ConfigError: key missing
            self.targets.append(TargetRun(t, client, metrics, analyzer, pipeline, reference=ref))
        primary = self.targets[0]
        self.metrics, self.analyzer, self.client, self.pipeline = primary.metrics, primary.analyzer, primary.client, \
            primary.pipeline
        self.session.held = lambda: (list(self.analyzer.history.closed), self.analyzer.baseline)  # a deleted db
        self.api_key = config.api_key(primary.cfg)
        for t in self.targets:
            self.metrics.target_sources.append((t.name, AnalysisExporter(t.analyzer)))
            if not t.reference:
                self.metrics.peers.append(t.metrics)
        self.wedge: WedgeWatch | None = None  # set with the load (soakd.soak.wedge)
        self.runners = [SamplerRunner(s, interval) for s, interval in build_samplers(config, nvml_module=nvml_module)]
        self.telemetry = TelemetryRouter(self.runners)
        self.metrics.sources += [SnapshotCollector(self.runners)] + ([AbExporter(self.analyzer)] if judge is not None else [])
        self.metrics.target_sources.append((primary.name, TargetIdentity(lambda: primary.model, self.runners)))
        self.status = StatusBoard(config, session=self.session, metrics=self.metrics, runners=self.runners,
                                  analyzer=self.analyzer, clock=clock)
        if candidates:
            self.status.other_targets = self._targets_status
        self.heartbeat = Heartbeat()
        self.cgroup = CgroupCpu()
        self.registry = self.metrics.registry()
        self.web = WebServer(build_app(self.registry, self.status.status, self.status.ready, self.heartbeat),
                             config.metrics.host, config.metrics.port)
        # the wedge watch's GET /models: its own connection, never queued behind the stuck streams
        self.probe_client = OpenAIClient(primary.cfg, self.api_key, pool_size=1)
        self.progress = (progress if progress is not None
                         else (config.log.progress if config.log.progress is not None else sys.stderr.isatty()))
        self.quiesce: QuiesceProber | None = None
        self.pool: WorkerPool | None = None  # load.workers > 1: the load's processes (soakd.soak.workers)
        self.canary: CanaryRunner | None = None
        self.stop_reason = ""
        self._stop_requested = asyncio.Event()
        self._signals = 0

    def _pool_size(self, config: SoakConfig) -> int:
        load = config.load
        return (load.effective_concurrency * max(sc.burst_size for sc in self.scenarios.values())
                if load.closed_loop else load.max_in_flight)

    # ---- the targets
    def _target_event(self, name: str) -> Any:
        """An A/B run's other target: its analysis's events, named and tagged with the target."""
        def emit(kind: str, severity: str, message: str, data: dict[str, Any], window: int | None) -> None:
            self.events.emit(kind, severity, f"[{name}] {message}", {**data, "target": name}, window)
        return emit

    def _targets_status(self) -> list[dict[str, Any]]:
        ab = self.analyzer.ab.state() if self.analyzer.ab is not None else None
        out = []
        for t in self.targets[1:]:
            st = t.status()
            st["ab"] = {m: {"ratio": r.ratio, "ci": r.ci, "tier": r.tier, "window": r.window}
                        for (m, cand), r in sorted(ab.last.items()) if cand == t.name} if ab is not None else {}
            out.append(st)
        return out

    def _loads(self) -> list[Load]:
        return [t.load for t in self.targets if t.load is not None]

    @property
    def load(self) -> Load | None:
        """The reference target's load (the samplers, probes and the canary follow it)."""
        return self.targets[0].load

    @property
    def run_id(self) -> str:
        return self.session.run_id

    @property
    def timeline(self) -> Timeline | None:
        return self.load.timeline if self.load is not None else None

    # ---- stop signals
    def request_stop(self, reason: str = "signal") -> None:
        """First call: stop sending and drain. Second call: stop draining at once."""
        self._signals += 1
        if self._signals == 1:
            log.info("stop_requested", reason=reason, grace_seconds=self.config.run.grace)
            self.stop_reason = reason
            self._stop_requested.set()
            for ld in self._loads():
                ld.driver.stop(reason)
        elif self.load is not None:
            log.warning("stop_now", reason="second signal: cancelling in-flight requests")
            for ld in self._loads():
                ld.driver.cancel_all()

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested.is_set()

    # ---- the run
    async def run(self) -> RunOutcome:
        cfg = self.config
        await self.session.open()
        if self.session.resumed:
            found = await self.session.findings()  # what the earlier segments found, per target
            self.analyzer.restore(self.session.windows, self.session.baseline, found.get(None, []))
            self.status.model = self.status.model or self.session.model
            if len(self.targets) > 1 and self.session.store is not None:
                earlier = await self.session.store.load_target_windows(self.run_id)
                for t in self.targets[1:]:
                    t.analyzer.restore(earlier.get(t.name, []), None, found.get(t.name, []))
                    self.analyzer.restore_target(t.name, earlier.get(t.name, []))
        try:
            await self.web.start()
        except OSError as exc:
            await self.session.close()
            raise StartupError(
                f"cannot listen on {cfg.metrics.host}:{cfg.metrics.port} for /metrics: {exc.strerror or exc}; "
                "choose another --metrics-port (0 picks a free one)"
            ) from None
        self.heartbeat.start()
        self.metrics.run_start.value = self.status.started_wall
        log.info("soakd_started", run_id=self.run_id, version=__version__, metrics_url=self.web.url + "/metrics",
                 resumed=self.session.resumed, state_db=self.session.path, config=cfg.redacted())
        scheduler = self._scheduler()
        scheduler.start()
        try:
            model = await resolve_model(self.client, cfg.target, self.status.model, has_key=bool(self.api_key),
                                        stop=self._stop_requested,
                                        give_up_after=min(cfg.run.wait_for_target, cfg.run.duration),
                                        on_answer=self._target_answered)
            if model is None:
                self.status.phase = "done"
                reason = self.stop_reason or "target_unreachable"
                log.info("soakd_finished", run_id=self.run_id, stop_reason=reason, requests_measured=0)
                return self._outcome(reason)
            self.status.model = self.targets[0].model = model
            for t in self.targets[1:]:
                t.model = await resolve_model(t.client, t.cfg, t.cfg.model, has_key=t.has_key,
                                              stop=self._stop_requested,
                                              give_up_after=min(cfg.run.wait_for_target, cfg.run.duration))
                if t.model is None:
                    self.status.phase = "done"
                    reason = self.stop_reason or "target_unreachable"
                    log.info("soakd_finished", run_id=self.run_id, stop_reason=reason, target=t.name,
                             requests_measured=0)
                    return self._outcome(reason)
            await self.session.start(model, self._server_kind())
            duration_left = cfg.run.duration - self.session.elapsed_before
            if self.session.resumed and duration_left <= 0.5:
                log.info("run_already_complete", run_id=self.run_id, elapsed=round(self.session.elapsed_before, 1))
                self.status.phase = "done"
                return await self._finish("duration")
            if cfg.load.workers > 1:
                await self._spawn_workers(model)
            self._build_load(model, duration_left)
            assert self.load is not None
            self._add_load_jobs(scheduler)
            with frozen_startup_heap():  # no collection of the startup heap stalls a request (selfwatch)
                await asyncio.gather(*(ld.driver.run(grace=cfg.run.grace) for ld in self._loads()))
                if self.quiesce is not None:  # a quiesce probe still holding the (finished) load
                    await self.quiesce.cancel()
            self.stop_reason = self.stop_reason or self.load.driver.stop_reason
            self.status.phase = "done"
            now = self.clock.monotonic()
            self.status.tick(now)
            self._close_due(now, final=True)
            return await self._finish(self.stop_reason)
        finally:
            scheduler.shutdown(wait=False)
            for runner in self.runners:
                try:
                    await runner.sampler.aclose()
                except Exception as exc:  # noqa: BLE001
                    log.warning("sampler_close_failed", sampler=runner.name, error=repr(exc))
            if self.progress:
                logging_setup.status_line().end()
            for t in self.targets:
                await t.client.close()
            if self.wedge is not None:
                await self.wedge.close()
            await self.probe_client.close()
            if self.pool is not None:
                await self.pool.close()
            await self.heartbeat.stop()
            await self.web.stop()
            await self.session.close()

    async def _progress(self) -> None:  # the live progress line on a terminal (none where stderr is no terminal)
        if (parts := self.status.progress_parts()) is not None:
            logging_setup.status_line().show(parts)

    def _target_answered(self, up: bool) -> None:
        if up:
            self.status.target_seen = True
        self.metrics.target_up.value = 1.0 if up else 0.0

    async def _spawn_workers(self, model: str) -> None:
        """``load.workers`` > 1: the worker processes, started and ready before the timeline starts."""
        cfg, primary = self.config, self.targets[0]
        n = cfg.load.workers
        init = {"config": cfg, "scenarios": self.scenarios, "target": primary.cfg, "api_key": self.api_key,
                "model": model, "pool_size": -(-self._pool_size(cfg) // n), "grace": cfg.run.grace}
        self.pool = WorkerPool(n, init, cfg.run.max_requests, clock=self.clock)
        try:
            await self.pool.spawn()
        except (OSError, RuntimeError, TimeoutError) as exc:
            raise StartupError(f"load.workers: cannot start {n} load worker processes: {exc}") from None
        pool = self.pool
        for r in self.runners:
            if r.name == "host":  # soakd's CPU and memory are its workers' too
                r.sampler.worker_pids = lambda: [w.proc.pid for w in pool.workers if w.proc.returncode is None]

    def _build_load(self, model: str, duration: float) -> None:
        cfg, clock = self.config, self.clock
        timeline = Timeline(clock.monotonic(), cfg.run.warmup, cfg.run.window, duration,
                            first_index=self.session.first_window)
        def window_set() -> WindowSet:  # one per target, on the one timeline
            return WindowSet(timeline, confidence=cfg.analysis.drift.confidence, patience=self.policies.close_patience,
                             clock=clock, client=cfg.analysis.client, kv_saturated_ratio=cfg.analysis.kv_saturated.ratio,
                             heartbeat_period=self.heartbeat.period)

        # the same timeline and seed for every target: the same traffic at the same moments
        for t in self.targets:
            assert t.model is not None
            ws = window_set()
            ws.segment = self.session.segment
            rec = Recorder(t.metrics, ws, clock, slos=self.slos)
            if t.reference:
                rec.on_target_change(self.status.target_changed)
                rec.on_connection_dropped(self.status.connection_dropped)
                for listener in self.record_listeners:
                    rec.add_listener(listener)
            rec.set_target_up(True)
            drv: LoadDriver | WorkerPool
            if self.pool is not None and t.reference:  # the load in worker processes, its records into rec
                drv = self.pool
                self.pool.start(rec, timeline)
            else:
                drv = LoadDriver(cfg.load, t.client, Workload(self.scenarios, cfg.load.mix, t.model, cfg.run.seed),
                                 rec, timeline, max_requests=cfg.run.max_requests, seed=cfg.run.seed, clock=clock)
            t.load = Load(timeline, ws, rec, drv)

        def on_beat(_t: float, lag: float, cpu: float) -> None:  # soakd's own health into every target's windows
            now = clock.monotonic()
            for ld in self._loads():
                ld.windows.add_lag(now, lag, cpu)

        self.heartbeat.on_beat = on_beat
        assert self.load is not None
        windows, recorder, driver = self.load.windows, self.load.recorder, self.load.driver
        self.status.load = self.load
        self.wedge = WedgeWatch(recorder, self.probe_client.list_models, self.analyzer, self.metrics.engine_wedged,
                                kv_gauge=self.metrics.kv_cache_saturated,
                                window_at=lambda ago: timeline.window_at(clock.monotonic() - ago))
        for server in (r for r in self.runners if r.name == "server"):  # the server's own token counter, each scrape
            self.wedge.follow(server)
        self.telemetry.attach(windows, lambda: driver.paused)
        if cfg.analysis.canary.enabled:
            canary = Canary(cfg.analysis.canary, self.client, model, reference=self.session.canary_reference)
            self.canary = self.status.canary = CanaryRunner(canary, self.analyzer, self.events)
        if self.policies.quiesce:
            self.quiesce = QuiesceProber(
                cfg.analysis.quiesce, self.policies, driver=driver, timeline=timeline, windows=windows,
                runners=self.runners, analyzer=self.analyzer, events=self.events,
                canary=self.canary if not self.policies.canary_own_schedule else None,
                running=lambda: self.status.phase == "running", clock=clock)
        elif self.policies.quiesce_skipped_reason:
            log.info("quiesce_skipped", reason=self.policies.quiesce_skipped_reason)
        if self._stop_requested.is_set():
            driver.stop(self.stop_reason)
        self.status.phase = "warmup" if cfg.run.warmup > 0 else "running"
        closed = cfg.load.closed_loop
        log.info("load_started", model=model, scenarios=list(self.scenarios), mode="closed" if closed else "open",
                 workers=cfg.load.workers,
                 concurrency=cfg.load.effective_concurrency if closed else None, rate=cfg.load.rate, duration=duration,
                 window=cfg.run.window, warmup=cfg.run.warmup, **trace_log_fields(self.scenarios, cfg))

    async def _finish(self, reason: str) -> RunOutcome:
        """The last windows, the verdict, the end of the segment (and of the run), the reports."""
        for t in self.targets:
            await t.pipeline.drain()
        verdict = self.analyzer.verdict()  # the run-level A/B comparison is the reference's A/B detector's
        if len(self.targets) > 1:  # each target judged against its own baseline too
            verdict = verdict.with_targets({t.name: t.analyzer.verdict() for t in self.targets[1:]})
        if reason in GRACEFUL_STOPS:  # the run stays resumable: the verdict so far
            verdict = verdict.model_copy(update={"interim": True})
        await self.events.flush()  # the end-of-run findings
        paths, unsaved = None, None
        if self.session.store is not None:
            await self.session.add_samples(self.telemetry.take_pending())
            await self.session.finish(reason, verdict)
            # a full disk: what it kept queued is retried for the grace, then kept beside the database; no report
            if (unsaved := await self.session.settle()) is None:  # report.json/md/html; a failure is logged
                paths = await write_final_reports(self.config.run.state_dir, self.run_id, self.config.run.junit)
        out = self._outcome(reason, verdict, unsaved)
        elapsed = self.load.timeline.elapsed(self.clock.monotonic()) if self.load is not None else 0.0
        report = (paths or {}).get("json")
        log.info("soakd_finished", run_id=self.run_id, stop_reason=reason, elapsed=round(elapsed, 3),
                 requests_sent=out.requests_sent, requests_measured=out.requests_measured,
                 warmup_requests=out.warmup_requests, outcomes={k: v for k, v in out.outcomes.items() if v},
                 windows=out.windows, verdict=verdict.result, interim=verdict.interim,
                 exit_code=EXIT_UNSAVED if unsaved else verdict.exit_code,
                 reasons=verdict.reasons, causes=verdict.cause_lines(),
                 failing=[finding_log(f) for f in verdict.failing][:20],
                 prompt_length_accuracy=out.prompt_length_accuracy,
                 report=str(report) if report else None,  # written by this run
                 **({"unsaved_writes": unsaved[0] + unsaved[1]} if unsaved else {}))
        return out

    def _outcome(self, reason: str, verdict: RunVerdict | None = None, unsaved: Any = None) -> RunOutcome:
        rec = self.load.recorder if self.load is not None else None
        m = self.metrics
        return RunOutcome(
            run_id=self.run_id, stop_reason=reason, verdict=verdict, resumed=self.session.resumed,
            requests_sent=rec.sent if rec else 0, requests_measured=rec.measured if rec else 0,
            warmup_requests=int(sum(m.warmup_requests.values.values())), windows=self.analyzer.history.count,
            outcomes={o: int(sum(m.requests.get(sc, o) for sc in self.scenarios)) for o in OUTCOMES},
            prompt_length_accuracy=rec.prompt_length_accuracy() if rec else None, unsaved=unsaved)

    def _server_kind(self) -> str | None:
        for r in self.runners:
            if r.name == "server":
                kind = getattr(r.sampler, "kind", None)
                return str(kind) if kind else None
        return None

    # ---- the scheduler
    def _scheduler(self) -> AsyncIOScheduler:
        """APScheduler owns the periodic jobs: one per sampler now, the load jobs once load starts."""
        sched = AsyncIOScheduler(event_loop=asyncio.get_running_loop())
        runners = {f"sampler:{r.name}": r for r in self.runners}
        for job_id, runner in runners.items():
            sched.add_job(runner.run_once, "interval", seconds=runner.interval, id=job_id, max_instances=1,
                          coalesce=True, misfire_grace_time=max(1, int(runner.interval)),
                          next_run_time=datetime.now(UTC))

        def _listener(event: Any) -> None:
            runner = runners.get(event.job_id)
            if event.code in (EVENT_JOB_MISSED, EVENT_JOB_MAX_INSTANCES) and runner is not None:
                runner.missed += 1
                return
            if event.code == EVENT_JOB_MAX_INSTANCES and event.job_id in ("quiesce", "canary", "tick", "progress"):
                return  # the previous run is still going: skipping is the intended behaviour
            kind = {EVENT_JOB_ERROR: "error", EVENT_JOB_MISSED: "missed", EVENT_JOB_MAX_INSTANCES: "max_instances"}
            log.warning("scheduler_job_" + kind.get(event.code, "event"), job=event.job_id,
                        error=repr(getattr(event, "exception", None)))

        sched.add_listener(_listener, EVENT_JOB_ERROR | EVENT_JOB_MISSED | EVENT_JOB_MAX_INSTANCES)
        return sched

    def _add_load_jobs(self, sched: AsyncIOScheduler) -> None:
        cfg, pol = self.config, self.policies

        def job(fn: Any, seconds: float, job_id: str, grace: float, first: float | None = None) -> None:
            start = {} if first is None else {"next_run_time": datetime.now(UTC) + timedelta(seconds=first)}
            sched.add_job(fn, "interval", seconds=seconds, id=job_id, max_instances=1, coalesce=True,
                          misfire_grace_time=max(1, int(grace)), **start)

        job(self._tick, pol.tick_seconds, "tick", pol.tick_seconds * 2)
        if self.wedge is not None:
            job(self.wedge.tick, 1.0, "wedge", 2)  # a check unless one is under way: never queued behind a probe
        job(self.status.summary_line, cfg.log.summary_interval, "summary", cfg.log.summary_interval)
        if self.progress:
            job(self._progress, 1.0, "progress", 2)
        job(self._checkpoint, 10.0, "checkpoint", 10)
        if self.cgroup.available:
            job(self._cgroup, 1.0, "cgroup", 2)
        if self.quiesce is not None:
            job(self.quiesce.maybe_probe, pol.tick_seconds, "quiesce", pol.tick_seconds * 2)  # at the schedule's times
        if self.canary is not None and pol.canary_own_schedule:
            job(self._canary, cfg.analysis.canary.interval, "canary", cfg.analysis.canary.interval,
                pol.canary_first_after)

    async def _tick(self) -> None:
        """Progress, the outage so far, the windows that are due: through each target's pipeline."""
        if self.load is None or self.status.phase == "done":  # after the final close: nothing is due
            return
        now = self.clock.monotonic()
        self.status.tick(now)
        self._close_due(now)
        for t in self.targets:
            await t.pipeline.drain()

    def _close_due(self, now: float, final: bool = False) -> None:
        """Every target's outage so far and the windows that are due, into its pipeline."""
        for t in self.targets:
            if t.load is not None:
                t.load.recorder.account_outage(now)
                # load workers: a window closes once every worker has reported past its end
                upto = now if final or self.pool is None or not t.reference else self.pool.closing_time(now)
                t.pipeline.submit(t.load.windows.close_due(upto, final=final))

    async def _cgroup(self) -> None:
        """CFS throttling of soakd's own cgroup since the last second, into the open window."""
        d = self.cgroup.delta()
        if d is not None and self.load is not None and (d[0] > 0 or d[1] > 0):
            self.load.windows.add_throttling(self.clock.monotonic(), d[0], d[1])

    async def _checkpoint(self) -> None:
        """State checkpoint: downsampled samples to the store, a sign of life, retried writes."""
        if self.session.store is None:
            return
        await self.session.add_samples(self.telemetry.take_pending())
        await self.session.heartbeat()

    async def _canary(self) -> None:
        ld = self.load
        if self.canary is None or ld is None or ld.driver.stopping or self.status.phase != "running":
            return
        await self.canary.under_load(ld.timeline.window_at(self.clock.monotonic()))


"""Wires a soak together: client, workload, driver, recorder, web app, scheduler, logs.

One asyncio process. APScheduler's AsyncIOScheduler owns the periodic jobs (the tick that
advances progress and closes windows, the per-minute summary line, the live progress line);
the load driver is a plain asyncio loop.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import structlog
from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_MAX_INSTANCES, EVENT_JOB_MISSED
from apscheduler.schedulers.asyncio import AsyncIOScheduler

from soakd import __version__
from soakd.analysis.drift import baseline_from_report
from soakd.analysis.engine import Analyzer
from soakd.analysis.samples import SampleWindow
from soakd.analysis.window import Timeline, fmt_ms
from soakd.canary import Canary
from soakd.client.openai import OpenAIClient
from soakd.config import ConfigError, SoakConfig
from soakd.store import RunStore, StoreError, StoreUnavailable, hash_config
from soakd.driver import LoadDriver
from soakd.metrics import BY_NAME, SoakMetrics
from soakd.samplers.base import SamplerRunner, SnapshotCollector
from soakd.samplers.registry import build_samplers
from soakd.recorder import Recorder
from soakd.report import write_final_reports
from soakd.web import Heartbeat, WebServer, build_app
from soakd.workload.scenarios import resolve_all
from soakd.workload.workload import Workload

log = structlog.get_logger("soakd")


class StartupError(Exception):
    """The soak cannot start (metrics port taken, state dir not writable): exit 1 with this message."""


class SoakDaemon:
    def __init__(self, config: SoakConfig, *, progress: bool | None = None, label: str = "soak",
                 nvml_module: Any = None, new_run: bool = False) -> None:
        self.config = config
        self.label = label
        self.api_key = config.api_key()  # ConfigError when configured but missing
        self.run_id = uuid.uuid4().hex[:12]
        self.scenarios = resolve_all(config)
        self.metrics = SoakMetrics(tuple(self.scenarios), __version__)
        self.registry = self.metrics.registry()
        self.heartbeat = Heartbeat()
        self.web = WebServer(
            build_app(self.registry, self.status, self.ready, self.heartbeat),
            config.metrics.host,
            config.metrics.port,
        )
        max_in_flight = (
            config.load.effective_concurrency * max(sc.burst_size for sc in self.scenarios.values())
            if config.load.closed_loop
            else config.load.max_in_flight
        )
        self.client = OpenAIClient(config.target, self.api_key, pool_size=max_in_flight)
        self.runners: list[SamplerRunner] = [
            SamplerRunner(sampler, interval) for sampler, interval in build_samplers(config, nvml_module=nvml_module)
        ]
        self.metrics.sources.append(SnapshotCollector(self.runners, BY_NAME))
        for runner in self.runners:
            runner.listeners.append(self._on_sample)
        self.analyzer = Analyzer(config.analysis, on_event=self._queue_event, baseline=self._external_baseline())
        self.metrics.sources.append(self.analyzer.families)
        self.new_run = new_run
        self.store: RunStore | None = None
        self.segment = 0
        self.resumed = False
        self.elapsed_before = 0.0
        self.sample_windows: dict[int, SampleWindow] = {}
        self._pending_samples: list[tuple[float, list[Any]]] = []
        self._closed_queue: list[dict[str, Any]] = []
        self._event_queue: list[tuple[str, str, str, dict[str, Any], int | None, float]] = []
        self._run_created = False
        self._probe_task: asyncio.Task | None = None
        self._energy_reading: dict[str, tuple[float, float]] = {}
        self._quiesce_skip_logged = False
        self.windows: list[dict[str, Any]] = []  # every closed window of the run (earlier segments included)
        self.canary: Canary | None = None
        self._canary_reference: str | None = None
        self.verdict: dict[str, Any] | None = None
        self.model: str | None = config.target.model
        self.timeline: Timeline | None = None
        self.recorder: Recorder | None = None
        self.driver: LoadDriver | None = None
        self.phase = "starting"
        self.started_wall = time.time()
        self.target_seen = False
        self.stop_reason = ""
        self._stop_requested = asyncio.Event()
        self._signals = 0
        self.progress_enabled = (
            progress if progress is not None
            else (config.log.progress if config.log.progress is not None else sys.stderr.isatty())
        )
        self._last_tick: tuple[float, int, int] | None = None
        self._rates = (0.0, 0.0)
        self._last_summary: tuple[float, int, int, dict[str, int]] | None = None
        self.final: dict[str, Any] | None = None

    @property
    def run_dir(self) -> Path:
        return self.config.run.state_dir / self.run_id

    def _external_baseline(self) -> dict[str, Any] | None:
        path = self.config.analysis.baseline
        if path is None:
            return None
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError([f"analysis.baseline: cannot read a JSON report from {path}: {exc}"]) from None
        base = baseline_from_report(data, self.config.analysis.drift.min_requests)
        if base is None:
            raise ConfigError([f"analysis.baseline: {path} holds no full window with at least "
                               f"{self.config.analysis.drift.min_requests} requests to use as the baseline"])
        return base

    # ---- state for /status and /readyz
    def ready(self) -> tuple[bool, str]:
        if not self.target_seen:
            return False, "the target has not answered yet"
        return True, self.phase

    def status(self) -> dict[str, Any]:
        cfg = self.config
        now = asyncio.get_event_loop().time()
        tl, rec = self.timeline, self.recorder
        out: dict[str, Any] = {
            "run_id": self.run_id,
            "version": __version__,
            "phase": self.phase,
            "target": cfg.target.url,
            "model": self.model,
            "started_at": _iso(self.started_wall),
            "duration_seconds": cfg.run.duration,
            "window_seconds": cfg.run.window,
            "warmup_seconds": cfg.run.warmup,
            "load": {"mode": "closed" if cfg.load.closed_loop else "open",
                     "concurrency": cfg.load.effective_concurrency if cfg.load.closed_loop else None,
                     "rate": cfg.load.rate, "mix": cfg.load.mix},
            "segment": self.segment,
            "resumed": self.resumed,
            "samplers": {r.name: r.status() for r in self.runners},
            "store": self.store.health() if self.store is not None else None,
            "analysis": self._analysis_status(),
        }
        if tl is None or rec is None:
            return out
        cur = rec.current(now)
        current = cur.summary(actual_end=min(now, cur.end)) if cur is not None else None
        out.update(
            {
                "elapsed_seconds": round(tl.elapsed(now), 3),
                "progress_ratio": round(tl.progress(now), 4),
                "window_index": tl.window_at(now),
                "in_flight": rec.in_flight,
                "requests_sent": rec.sent,
                "requests_finished": rec.finished_count,
                "requests_measured": rec.measured,
                "outcomes": dict(rec.outcomes),
                "target_up": bool(self.metrics.target_up.value),
                "requests_per_second": round(self._rates[0], 3),
                "output_tokens_per_second": round(self._rates[1], 3),
                "per_scenario": {
                    sc: {o: int(self.metrics.requests.get(sc, o)) for o in rec.outcomes}
                    for sc in self.scenarios
                },
                "current_window": _compact(current) if current else None,
                "closed_windows": [_compact(w) for w in list(rec.closed)[-5:]],
                "windows_closed": len(rec.closed),
                "prompt_length_accuracy": rec.prompt_length_accuracy(),
                "last_error": rec.last_error or None,
            }
        )
        return out

    # ---- control
    def request_stop(self, reason: str = "signal") -> None:
        """First call: stop sending and drain. Second call: stop draining at once."""
        self._signals += 1
        if self._signals == 1:
            log.info("stop_requested", reason=reason, grace_seconds=self.config.run.grace)
            self.stop_reason = reason
            self._stop_requested.set()
            if self.driver is not None:
                self.driver.stop(reason)
        elif self.driver is not None:
            log.warning("stop_now", reason="second signal: cancelling in-flight requests")
            self._drain_now = True
            for task in list(self.driver._tasks):  # noqa: SLF001
                task.cancel()

    # ---- the run
    async def _resolve_model(self) -> bool:
        """Find the model (and that the target answers). Retries until it does or the run is stopped."""
        delay, logged = 0.5, False
        deadline = asyncio.get_running_loop().time() + self.config.run.duration
        while not self._stop_requested.is_set():
            try:
                models = await self.client.list_models()
                self.target_seen = True
                self.metrics.target_up.value = 1.0
                if self.model is None:
                    if not models:
                        raise RuntimeError("GET /models returned no models; pass --model")
                    self.model = models[0]
                elif models and self.model not in models:
                    log.warning("model_not_listed", model=self.model, listed=models[:10])
                return True
            except Exception as exc:  # noqa: BLE001 - unreachable target: log once, keep trying
                self.metrics.target_up.value = 0.0
                if re.search(r"\bHTTP 40[13]\b", str(exc)):
                    # the target answers and refuses the key: a configuration error, not an outage
                    t = self.config.target
                    where = ("target.api_key_env" if t.api_key_env else "target.api_key_file" if t.api_key_file
                             else "target.api_key_env / target.api_key_file")
                    raise ConfigError([
                        f"{where}: the target refused the API key ({exc}); "
                        + ("check the key" if self.api_key else "it needs one: pass --api-key-env or --api-key-file")
                    ]) from None
                if not logged:
                    log.warning("target_unreachable", url=self.config.target.url, error=f"{type(exc).__name__}: {exc}",
                                action="retrying until it answers")
                    logged = True
            if asyncio.get_running_loop().time() + delay > deadline:
                return False
            try:
                await asyncio.wait_for(self._stop_requested.wait(), delay)
            except TimeoutError:
                pass
            delay = min(delay * 2, 10.0)
        return False

    async def _open_store(self) -> None:
        """Open the run store; resume the unfinished run unless --new-run."""
        cfg = self.config
        try:
            self.store = await RunStore.open(cfg.run.state_dir, on_state_change=self._store_state)
        except StoreError as exc:
            raise ConfigError([f"run.state_dir: {exc}"]) from None
        prior = await self.store.latest_unfinished_run()
        if prior is not None and self.new_run:
            await self.store.finish_run(prior.id, "superseded by --new-run", status="failed")
            log.info("run_superseded", run_id=prior.id)
            prior = None
        if prior is None:
            return
        self.resumed = True
        self.run_id = prior.id
        if prior.config_hash != hash_config(self._config_for_store()):
            log.warning("config_changed_on_resume", run_id=prior.id,
                        hint="the run continues with the new configuration; pass --new-run to start afresh")
        self.windows = await self.store.load_windows(prior.id, include_partial=False)
        base = await self.store.load_baseline(prior.id)
        self.analyzer.restore(self.windows, base[1] if base else None)
        segments = await self.store.load_segments(prior.id)
        self.elapsed_before = sum(
            max(0.0, (sg.ended_unix or sg.last_seen_unix or sg.started_unix) - sg.started_unix) for sg in segments
        )
        events = await self.store.load_events(prior.id, kinds=["canary_reference"])
        if events and events[-1].data:
            self._canary_reference = events[-1].data.get("digest")
        self._resume_first_index = (prior.last_window + 1) if prior.last_window is not None else 0
        if prior.model and self.model is None:
            self.model = prior.model

    def _config_for_store(self) -> dict[str, Any]:
        return self.config.redacted()

    def _store_state(self, available: bool, reason: str | None) -> None:
        if available:
            log.info("store_recovered", path=str(self.config.run.state_dir))
        else:
            log.error("store_unavailable", path=str(self.config.run.state_dir), reason=reason,
                      action="keeping writes in memory and retrying; /metrics keeps working")

    async def _store_call(self, what: str, coro: Any) -> Any:
        """Await a store write; a full disk is logged (once, by the store's state callback), never fatal."""
        try:
            return await coro
        except StoreUnavailable:
            return None
        except StoreError as exc:
            log.error("store_write_failed", what=what, error=str(exc))
            return None

    async def run(self) -> dict[str, Any]:
        cfg = self.config
        self._resume_first_index = 0
        await self._open_store()
        try:
            await self.web.start()
        except OSError as exc:
            await self.store.close()
            raise StartupError(
                f"cannot listen on {cfg.metrics.host}:{cfg.metrics.port} for /metrics: {exc.strerror or exc}; "
                "choose another --metrics-port (0 picks a free one)"
            ) from None
        self.heartbeat.start()
        self.metrics.run_start.value = self.started_wall
        log.info("soakd_started", run_id=self.run_id, version=__version__, metrics_url=self.web.url + "/metrics",
                 resumed=self.resumed, state_db=str(self.store.path), config=cfg.redacted())
        self._drain_now = False
        scheduler = self._scheduler()
        scheduler.start()
        try:
            if not await self._resolve_model():
                self.phase = "done"
                self.final = self._final_summary(reason=self.stop_reason or "target_unreachable")
                return self.final
            assert self.model is not None
            if not self.resumed:
                await self.store.create_run(self.run_id, self._config_for_store(), None, cfg.target.url, self.model,
                                            self._server_kind(), __version__)
            self._run_created = True
            self.segment = await self.store.start_segment(self.run_id, "resume" if self.resumed else "start")
            if self.resumed:
                await self._store_call("event", self.store.add_event(
                    self.run_id, "segment", "info",
                    f"resumed (segment {self.segment}) after a gap; window numbering continues at "
                    f"{self._resume_first_index}", {"segment": self.segment}, None))
                log.info("run_resumed", run_id=self.run_id, segment=self.segment, windows=len(self.windows),
                         first_window=self._resume_first_index, elapsed_before=round(self.elapsed_before, 1))
            duration_left = cfg.run.duration - self.elapsed_before
            if self.resumed and duration_left <= 0.5:
                log.info("run_already_complete", run_id=self.run_id, elapsed=round(self.elapsed_before, 1))
                self.phase = "done"
                return await self._finish(reason="duration")
            loop = asyncio.get_running_loop()
            self.timeline = tl = Timeline(loop.time(), cfg.run.warmup, cfg.run.window, duration_left,
                                          first_index=self._resume_first_index)
            self.recorder = Recorder(self.metrics, tl, on_window_closed=self._closed_queue.append,
                                     confidence=cfg.analysis.drift.confidence)
            self.recorder._target_up_cb = self._target_changed  # noqa: SLF001
            self.recorder.on_connection_dropped = self._connection_dropped
            self.recorder.set_target_up(True)
            workload = Workload(self.scenarios, cfg.load.mix, self.model, cfg.run.seed)
            self.driver = LoadDriver(cfg.load, self.client, workload, self.recorder, tl,
                                     max_requests=cfg.run.max_requests, seed=cfg.run.seed)
            if cfg.analysis.canary.enabled:
                self.canary = Canary(cfg.analysis.canary, self.client, self.model, reference=self._canary_reference)
            if self._stop_requested.is_set():
                self.driver.stop(self.stop_reason)
            self.phase = "warmup" if cfg.run.warmup > 0 else "running"
            log.info("load_started", model=self.model, scenarios=list(self.scenarios),
                     mode="closed" if cfg.load.closed_loop else "open",
                     concurrency=cfg.load.effective_concurrency if cfg.load.closed_loop else None,
                     rate=cfg.load.rate, duration=duration_left, window=cfg.run.window, warmup=cfg.run.warmup)
            self._add_load_jobs(scheduler)
            await self.driver.run(grace=cfg.run.grace)
            if self._probe_task is not None:  # a quiesce probe still holding the (finished) load
                self._probe_task.cancel()
                await asyncio.gather(self._probe_task, return_exceptions=True)
            self.stop_reason = self.stop_reason or self.driver.stop_reason
            self.phase = "done"
            self._tick()
            self.recorder.close_due(loop.time(), final=True)
            return await self._finish(self.stop_reason)
        finally:
            scheduler.shutdown(wait=False)
            for runner in self.runners:
                try:
                    await runner.sampler.aclose()
                except Exception as exc:  # noqa: BLE001
                    log.warning("sampler_close_failed", sampler=runner.name, error=repr(exc))
            if self.progress_enabled:
                sys.stderr.write("\n")
                sys.stderr.flush()
            await self.client.close()
            await self.heartbeat.stop()
            await self.web.stop()
            if self.store is not None:
                try:
                    await self.store.close()
                except Exception as exc:  # noqa: BLE001
                    log.error("store_close_failed", error=repr(exc))

    async def _finish(self, reason: str) -> dict[str, Any]:
        """Persist the last windows and events, the verdict; end the segment and the run."""
        await self._process_closed()
        store = self.store
        error_rate = self._run_error_rate()
        verdict = self.analyzer.verdict(error_rate).to_dict()
        self.verdict = verdict
        if store is not None:
            await self._store_call("samples", self._flush_samples())
            await self._store_call("verdict", store.set_verdict(self.run_id, verdict))
            await self._store_call("segment", store.end_segment(self.run_id, self.segment, reason))
            # SIGTERM/SIGINT (a pod being rescheduled, a user's Ctrl-C) leave the run resumable:
            # the next start with this state dir continues it (--new-run starts afresh)
            if reason not in ("SIGTERM", "SIGINT"):
                await self._store_call("finish", store.finish_run(
                    self.run_id, reason, status="finished" if verdict["passed"] else "failed"))
            # report.json/md/html into the run dir; a failure is logged, never fatal
            await write_final_reports(self.config.run.state_dir, self.run_id)
        self.final = self._final_summary(reason=reason)
        return self.final

    def _run_error_rate(self) -> float | None:
        total = failed = 0
        for w in self.windows:
            n = int(w.get("requests") or 0)
            total += n
            failed += n - int((w.get("outcomes") or {}).get("ok", 0)) - int((w.get("outcomes") or {}).get("cancelled", 0))
        return failed / total if total else None

    def _server_kind(self) -> str | None:
        for r in self.runners:
            if r.name == "server":
                kind = getattr(r.sampler, "kind", None)
                return str(kind) if kind else None
        return None

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
        cfg = self.config
        tick = max(0.1, min(1.0, cfg.run.window / 10))
        sched.add_job(self._tick_job, "interval", seconds=tick, id="tick", max_instances=1, coalesce=True,
                      misfire_grace_time=max(1, int(tick * 2)))
        sched.add_job(self._summary_job, "interval", seconds=cfg.log.summary_interval, id="summary",
                      max_instances=1, coalesce=True, misfire_grace_time=int(cfg.log.summary_interval))
        if self.progress_enabled:
            sched.add_job(self._progress_job, "interval", seconds=1.0, id="progress", max_instances=1,
                          coalesce=True, misfire_grace_time=2)
        sched.add_job(self._checkpoint_job, "interval", seconds=10.0, id="checkpoint", max_instances=1,
                      coalesce=True, misfire_grace_time=10)
        q = cfg.analysis.quiesce
        interval = q.interval or cfg.run.window
        if q.enabled:
            first = datetime.now(UTC) + timedelta(seconds=cfg.run.warmup + interval / 2)
            sched.add_job(self._quiesce_job, "interval", seconds=interval, id="quiesce", max_instances=1,
                          coalesce=True, misfire_grace_time=max(1, int(interval)), next_run_time=first)
        c = cfg.analysis.canary
        if self.canary is not None and not (q.enabled and c.with_quiesce and self._quiesce_fits()):
            first = datetime.now(UTC) + timedelta(seconds=cfg.run.warmup + min(c.interval, cfg.run.window) / 2)
            sched.add_job(self._canary_job, "interval", seconds=c.interval, id="canary", max_instances=1,
                          coalesce=True, misfire_grace_time=max(1, int(c.interval)), next_run_time=first)

    # ---- periodic jobs
    async def _tick_job(self) -> None:
        self._tick()
        await self._process_closed()

    async def _checkpoint_job(self) -> None:
        """State checkpoint: downsampled samples to the store, a sign of life, retried writes."""
        if self.store is None:
            return
        await self._store_call("samples", self._flush_samples())
        await self._store_call("heartbeat", self.store.heartbeat(self.run_id))

    async def _flush_samples(self) -> None:
        if self.store is None or not self._run_created:
            return
        pending, self._pending_samples = self._pending_samples, []
        for t_wall, series_list in pending:
            await self.store.add_samples(self.run_id, t_wall, series_list)

    async def _quiesce_job(self) -> None:
        """Stop sending, drain, sample KV-cache usage and device memory at idle, resume.

        Not in the last half window (nothing would follow to compare); a stop request ends the
        probe at once. Probe time is excluded from the windows' load time (paused_seconds) and
        samples taken while it holds the load are kept out of the window aggregates."""
        drv, tl, rec = self.driver, self.timeline, self.recorder
        if drv is None or tl is None or rec is None or drv.stopping or self.phase != "running":
            return
        loop = asyncio.get_running_loop()
        cfg = self.config
        q = cfg.analysis.quiesce
        t0, wall = loop.time(), time.time()
        if tl.end - t0 < min(cfg.run.window / 2, 60.0):
            return
        if not self._quiesce_fits():
            # a probe (drain + settle) would swallow most of such a short window
            if not self._quiesce_skip_logged:
                log.info("quiesce_skipped", reason=f"window {cfg.run.window:g}s is shorter than 10x the probe's "
                         f"settle time ({max(q.settle, 0.1):g}s); lower analysis.quiesce.settle to probe")
                self._quiesce_skip_logged = True
            return
        idx = tl.window_at(t0)
        held = rec.window_for(idx, t0)
        held.in_flight += 1  # the window stays open until its probe ends (else the probe is lost)
        self._probe_task = asyncio.current_task()
        drv.pause()
        probe: dict[str, Any] = {"t_unix": wall, "window": idx, "drained": False,
                                 "kv_cache_usage_ratio": None, "memory_used_bytes": None}
        completed = False
        try:
            probe["drained"] = await drv.wait_idle(min(q.drain_timeout, cfg.run.window / 4))
            if q.settle > 0:
                await asyncio.sleep(q.settle)
            mem_by: dict[str, float] = {}
            for runner in self.runners:
                if runner.name in ("server", "nvml", "dcgm") and await runner.run_once() and runner.snapshot:
                    for sr in runner.snapshot.series:
                        if sr.name == "soakd_server_kv_cache_usage_ratio":
                            probe["kv_cache_usage_ratio"] = sr.value
                        elif sr.name == "soakd_gpu_memory_used_bytes":
                            mem_by[runner.name] = mem_by.get(runner.name, 0.0) + sr.value
            probe["memory_used_bytes"] = mem_by.get("nvml", mem_by.get("dcgm"))
            if self.canary is not None and cfg.analysis.canary.with_quiesce:
                await self._run_canary(idle=True, window=idx)
            completed = True
        except asyncio.CancelledError:
            pass  # the run is ending: the probe is abandoned, the load is not resumed
        finally:
            self._probe_task = None
            if not drv.stopping:
                drv.resume()
            t1 = loop.time()
            rec.add_interval(t0, t1, "paused_seconds")
            held.in_flight -= 1
            probe["seconds"] = round(t1 - t0, 3)
        if not completed:
            return
        sw = self._sample_window(idx, t0)
        if sw is not None:
            sw.quiesce = probe
        self.analyzer.add_quiesce(probe)
        kv, mem = probe["kv_cache_usage_ratio"], probe["memory_used_bytes"]
        self._queue_event("quiesce", "info",
                          f"quiesce probe in window {idx}: idle KV usage {_fmt(kv, '.4f')}, device memory "
                          f"{_fmt(mem / 2**30 if mem is not None else None, '.2f')} GiB, drained={probe['drained']}, "
                          f"{probe['seconds']}s", probe, idx)
        await self._flush_events()

    def _quiesce_fits(self) -> bool:
        """Whether quiesce probes run at all: a window shorter than 10x the settle time (at least
        0.1 s) is skipped, the probe would swallow most of it."""
        return self.config.run.window >= 10 * max(self.config.analysis.quiesce.settle, 0.1)

    async def _canary_job(self) -> None:
        if self.driver is None or self.driver.stopping or self.phase != "running" or self.timeline is None:
            return
        await self._run_canary(idle=False, window=self.timeline.window_at(asyncio.get_running_loop().time()))
        await self._flush_events()

    async def _run_canary(self, idle: bool, window: int | None) -> None:
        assert self.canary is not None
        had_reference = self.canary.reference is not None
        res = await self.canary.check(idle=idle)
        if res.ok and not had_reference and res.digest:
            self._queue_event("canary_reference", "info", f"canary reference output {res.digest}",
                              {"digest": res.digest, "text": res.text[:500], "idle": idle}, window)
        elif not res.ok:
            log.warning("canary_failed", error=res.error, idle=idle)
        self.analyzer.add_canary(res, window)

    def _tick(self) -> None:
        tl, rec = self.timeline, self.recorder
        if tl is None or rec is None:
            return
        now = asyncio.get_running_loop().time()
        m = self.metrics
        m.elapsed.value = round(tl.elapsed(now), 3)
        m.progress.value = round(tl.progress(now), 5)
        idx = tl.window_at(min(now, tl.end - 1e-9))
        m.window_index.value = idx
        m.warmup_active.value = 1.0 if idx < 0 else 0.0
        if self.phase in ("warmup", "running"):
            self.phase = "warmup" if idx < 0 else "running"
            if self.driver is not None and self.driver.stopping:
                self.phase = "draining"
        if self._last_tick is not None:
            t0, n0, c0 = self._last_tick
            dt = now - t0
            if dt >= 0.9:
                self._rates = ((rec.finished_count - n0) / dt, (rec.completion_tokens - c0) / dt)
                self._last_tick = (now, rec.finished_count, rec.completion_tokens)
        else:
            self._last_tick = (now, rec.finished_count, rec.completion_tokens)
        rec.close_due(now)

    async def _summary_job(self) -> None:
        rec, tl = self.recorder, self.timeline
        if rec is None or tl is None:
            return
        now = asyncio.get_running_loop().time()
        prev = self._last_summary
        self._last_summary = (now, rec.finished_count, rec.completion_tokens, dict(rec.outcomes))
        if prev is None:
            return
        dt = max(1e-9, now - prev[0])
        errs = {k: v - prev[3].get(k, 0) for k, v in rec.outcomes.items() if k != "ok" and v - prev[3].get(k, 0)}
        cur = rec.current(now)
        s = cur.summary(actual_end=min(now, cur.end)) if cur else None
        log.info("summary", elapsed=round(tl.elapsed(now), 1), progress=round(tl.progress(now), 4),
                 window=tl.window_at(now), in_flight=rec.in_flight,
                 requests_per_second=round((rec.finished_count - prev[1]) / dt, 2),
                 output_tokens_per_second=round((rec.completion_tokens - prev[2]) / dt, 1),
                 errors=errs, e2e_p95=s["e2e_seconds"]["p95"] if s else None,
                 ttft_p95=s["ttft_seconds"]["p95"] if s else None, target_up=bool(self.metrics.target_up.value))

    async def _progress_job(self) -> None:
        rec, tl = self.recorder, self.timeline
        if rec is None or tl is None:
            return
        now = asyncio.get_running_loop().time()
        cur = rec.current(now)
        s = cur.summary(actual_end=min(now, cur.end)) if cur else None
        failed = sum(v for k, v in rec.outcomes.items() if k != "ok")
        err = failed / rec.finished_count if rec.finished_count else 0.0
        phase = "warm-up" if tl.window_at(now) < 0 else f"window {tl.window_at(now)}"
        line = (
            f"\r[{_hms(tl.elapsed(now))}/{_hms(tl.duration)}] {phase:>10} | {self._rates[0]:7.1f} req/s "
            f"{self._rates[1]:8.0f} tok/s | p95 e2e {fmt_ms(s['e2e_seconds']['p95'] if s else None):>9} "
            f"ttft {fmt_ms(s['ttft_seconds']['p95'] if s else None):>8} | in flight {rec.in_flight:4d} "
            f"| errors {err:6.2%} {'' if self.metrics.target_up.value else '| TARGET DOWN'}"
        )
        sys.stderr.write(line.ljust(120)[:160])
        sys.stderr.flush()

    # ---- events
    def _target_changed(self, up: bool) -> None:
        if up:
            self.target_seen = True
            log.info("target_up", url=self.config.target.url)
        else:
            log.warning("target_down", url=self.config.target.url,
                        last_error=self.recorder.last_error if self.recorder else None)

    def _connection_dropped(self, rec: Any) -> None:
        """Once per run: the target dropped a connection while it answered other requests."""
        keep_alive = self.config.target.keep_alive
        log.warning("connection_dropped_while_up", url=self.config.target.url, reason=rec.reason,
                    error=rec.error[:200], keep_alive=keep_alive,
                    hint="counted as connection_error; the target stays up. " + (
                        "A server that closes reused keep-alive connections (llama.cpp's llama-server after "
                        "streamed responses) is cured by target.keep_alive: false (--no-keep-alive)"
                        if keep_alive else "Check the server's and any proxy's logs"))  # fmt: skip

    # ---- samples and windows
    def _sample_window(self, idx: int, t: float) -> SampleWindow | None:
        if self.timeline is None or idx < self.timeline.first_index:
            return None
        sw = self.sample_windows.get(idx)
        if sw is None:
            sw = self.sample_windows[idx] = SampleWindow()
        return sw

    def _energy_source(self) -> str:
        """One energy counter feeds J/token: NVML's when it is up, else dcgm-exporter's."""
        for name in ("nvml", "dcgm"):
            for r in self.runners:
                if r.name == name and r.up:
                    return name
        return "nvml"

    def _on_sample(self, sampler: str, snap: Any) -> None:
        """Sampler listener: route the snapshot to its window (not while a quiesce probe holds the
        load: idle samples would bias the window's means) and queue it for the store."""
        if len(self._pending_samples) < 10_000:
            self._pending_samples.append((snap.wall, list(snap.series)))
        tl = self.timeline
        energy = [s.value for s in snap.series if s.name == "soakd_gpu_energy_joules_total"]
        paused = self.driver is not None and self.driver.paused
        prev = self._energy_reading.get(sampler)
        if energy:
            self._energy_reading[sampler] = (snap.monotonic, sum(energy))
        if tl is None or paused:
            return
        idx = tl.window_at(snap.monotonic)
        sw = self._sample_window(idx, snap.monotonic)
        if sw is None:
            return
        sw.add(snap.series, snap.monotonic)
        if energy and prev is not None and sampler == self._energy_source():
            delta, dt = sum(energy) - prev[1], snap.monotonic - prev[0]
            if delta >= 0 and dt > 0:
                sw.add_energy(delta, dt)

    async def _process_closed(self) -> None:
        """Closed windows: add telemetry, persist (before announcing), analyse, persist findings, log."""
        while self._closed_queue:
            summary = self._closed_queue.pop(0)
            idx = summary["window"]
            sw = self.sample_windows.pop(idx, None)
            if sw is not None:
                summary.update(sw.summary(int(summary.get("completion_tokens") or 0), summary.get("duration_seconds")))
            else:
                summary.update({"device": {}, "server": {}, "host": {}, "quiesce": None})
            summary["segment"] = self.segment
            had_baseline = self.analyzer.baseline is not None
            if self.store is not None:
                await self._store_call("window", self.store.save_window(
                    self.run_id, idx, self.segment, summary, summary["partial"]))
            self.analyzer.add_window(summary)
            if not summary["partial"]:
                self.windows.append(summary)
            if not had_baseline and self.analyzer.baseline is summary and self.store is not None:
                await self._store_call("baseline", self.store.set_baseline(self.run_id, idx, summary))
            await self._flush_events()
            log.info("window_closed", **_compact(summary), scenarios={
                n: {"requests": v["requests"], "e2e_p95": v["e2e_seconds"]["p95"],
                    "ttft_p95": v["ttft_seconds"]["p95"], "error_rate": v["error_rate"]}
                for n, v in summary["scenarios"].items()},
                power_mean=(summary["device"].get("power_watts") or {}).get("mean"),
                energy_per_token=summary["device"].get("energy_per_output_token_joules"),
                kv_mean=(summary["server"].get("kv_cache_usage_ratio") or {}).get("mean"),
                drift=[f"{r.metric}/{r.reference} {r.ratio:+.1%} ({r.status})"
                       for r in self.analyzer.drift.values() if r.window == idx and r.ratio is not None
                       and r.status in ("drift", "insufficient")][:12])
            self._append_jsonl("windows.jsonl", summary)

    def _queue_event(self, kind: str, severity: str, message: str, data: dict[str, Any], window: int | None) -> None:
        self._event_queue.append((kind, severity, message, data, window, time.time()))

    async def _flush_events(self) -> None:
        """Events are in SQLite before they are logged."""
        while self._event_queue:
            kind, severity, message, data, window, t = self._event_queue.pop(0)
            if self.store is not None:
                await self._store_call("event", self.store.add_event(self.run_id, kind, severity, message, data,
                                                                     window, t_unix=t))
            level = {"critical": log.error, "warning": log.warning}.get(severity, log.info)
            level("finding" if kind not in ("quiesce", "baseline", "canary_reference", "segment") else kind,
                  kind=kind, severity=severity, window=window, message=message)

    def _analysis_status(self) -> dict[str, Any]:
        a = self.analyzer
        return {
            "baseline_window": a.baseline.get("window") if a.baseline else None,
            "baseline_external": a.baseline_external,
            "windows": len(a.windows),
            "drift_detected": sorted(m for m, v in a.drift_active.items() if v),
            "drift": {f"{m}/{ref}": {"ratio": r.ratio, "ci": r.ratio_ci, "status": r.status,
                                     "direction": r.direction, "window": r.window}
                      for (m, ref), r in sorted(a.drift.items()) if r.scenario is None},
            "leaks": {k: {"status": v.status, "growth_per_hour": v.growth_per_hour, "suspected": v.suspected}
                      for k, v in a.leaks.items()},
            "throttle_detected": a.throttle_detected,
            "canary": self.canary.status() if self.canary is not None else None,
            "quiesce_probes": a.quiesce_probes,
            "last_quiesce": a.last_quiesce,
            "findings": a.findings[-10:],
            "failing": list(dict.fromkeys(a.failing)),
            "verdict_so_far": "FAIL" if a.failing else "PASS",
        }

    def _append_jsonl(self, name: str, obj: dict[str, Any]) -> None:
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(self.run_dir / name, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(obj, default=str) + "\n")
        except OSError as exc:
            log.error("state_write_failed", path=str(self.run_dir / name), error=str(exc))

    def _final_summary(self, reason: str) -> dict[str, Any]:
        rec, tl = self.recorder, self.timeline
        now = asyncio.get_running_loop().time()
        out: dict[str, Any] = {
            "run_id": self.run_id,
            "target": self.config.target.url,
            "model": self.model,
            "stop_reason": reason,
            "started_at": _iso(self.started_wall),
            "ended_at": _iso(time.time()),
        }
        if rec is None or tl is None:
            out.update({"requests_measured": 0, "windows": [], "outcomes": {}})
            log.info("soakd_finished", run_id=self.run_id, stop_reason=reason, requests_measured=0)
            return out
        total_ok = sum(self.metrics.requests.get(sc, "ok") for sc in self.scenarios)
        out.update(
            {
                "elapsed_seconds": round(tl.elapsed(now), 3),
                "requests_sent": rec.sent,
                "requests_measured": rec.measured,
                "outcomes": {o: int(sum(self.metrics.requests.get(sc, o) for sc in self.scenarios))
                             for o in rec.outcomes},
                "warmup_requests": int(sum(self.metrics.warmup_requests.values.values())),
                "success_ratio": (total_ok / rec.measured) if rec.measured else None,
                "completion_tokens": rec.completion_tokens,
                "prompt_tokens": rec.prompt_tokens,
                "prompt_length_accuracy": rec.prompt_length_accuracy(),
                "late_sends": self.metrics.late_sends.get(),
                "segment": self.segment,
                "resumed": self.resumed,
                "verdict": self.verdict,
                "windows": list(self.windows) + [w for w in rec.closed if w.get("partial")],
                "findings": self.analyzer.findings,
            }
        )
        self._write_json("summary.json", out)
        # the end of the run is an event too (JSON logs print no summary table)
        log.info("soakd_finished", run_id=self.run_id, stop_reason=reason, elapsed=out["elapsed_seconds"],
                 requests_sent=rec.sent, requests_measured=rec.measured,
                 outcomes={k: v for k, v in out["outcomes"].items() if v}, windows=len(out["windows"]),
                 verdict=(self.verdict or {}).get("result"), reasons=(self.verdict or {}).get("reasons"),
                 summary_path=str(self.run_dir / "summary.json"))
        return out

    def _write_json(self, name: str, obj: dict[str, Any]) -> None:
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            tmp = self.run_dir / (name + ".tmp")
            tmp.write_text(json.dumps(obj, indent=2, default=str), encoding="utf-8")
            tmp.replace(self.run_dir / name)
        except OSError as exc:
            log.error("state_write_failed", path=str(self.run_dir / name), error=str(exc))


def _compact(s: dict[str, Any]) -> dict[str, Any]:
    return {
        "window": s["window"],
        "partial": s["partial"],
        "duration_seconds": round(s["duration_seconds"], 3),
        "requests": s["requests"],
        "error_rate": s["error_rate"],
        "requests_per_second": round(s["requests_per_second"], 3),
        "output_tokens_per_second": round(s["output_tokens_per_second"], 2),
        "e2e_p50": s["e2e_seconds"]["p50"],
        "e2e_p95": s["e2e_seconds"]["p95"],
        "ttft_p50": s["ttft_seconds"]["p50"],
        "ttft_p95": s["ttft_seconds"]["p95"],
        "itl_p50": s["itl_seconds"]["p50"],
        "itl_p95": s["itl_seconds"]["p95"],
        "mix": {k: round(v, 4) for k, v in s["mix"].items()},
        "outcomes": {k: v for k, v in s["outcomes"].items() if v},
    }


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))

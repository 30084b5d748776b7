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
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog
from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_MAX_INSTANCES, EVENT_JOB_MISSED
from apscheduler.schedulers.asyncio import AsyncIOScheduler

from soakd import __version__
from soakd.analysis.window import Timeline, fmt_ms
from soakd.client.openai import OpenAIClient
from soakd.config import ConfigError, SoakConfig
from soakd.driver import LoadDriver
from soakd.metrics import BY_NAME, SoakMetrics
from soakd.samplers.base import SamplerRunner, SnapshotCollector
from soakd.samplers.registry import build_samplers
from soakd.recorder import Recorder
from soakd.web import Heartbeat, WebServer, build_app
from soakd.workload.scenarios import resolve_all
from soakd.workload.workload import Workload

log = structlog.get_logger("soakd")


class StartupError(Exception):
    """The soak cannot start (metrics port taken, state dir not writable): exit 1 with this message."""


def ensure_state_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            [f"run.state_dir: {path} is not writable ({exc.strerror or exc}); "
             "pass --state-dir to a writable directory (a PVC or emptyDir in Kubernetes)"]
        ) from None


class SoakDaemon:
    def __init__(self, config: SoakConfig, *, progress: bool | None = None, label: str = "soak",
                 nvml_module: Any = None) -> None:
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
        self.run_dir = config.run.state_dir / self.run_id

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
            "samplers": {r.name: r.status() for r in self.runners},
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

    async def run(self) -> dict[str, Any]:
        cfg = self.config
        ensure_state_dir(cfg.run.state_dir)
        try:
            await self.web.start()
        except OSError as exc:
            raise StartupError(
                f"cannot listen on {cfg.metrics.host}:{cfg.metrics.port} for /metrics: {exc.strerror or exc}; "
                "choose another --metrics-port (0 picks a free one)"
            ) from None
        self.heartbeat.start()
        self.metrics.run_start.value = self.started_wall
        log.info("soakd_started", run_id=self.run_id, version=__version__, metrics_url=self.web.url + "/metrics",
                 config=cfg.redacted())
        self._drain_now = False
        scheduler = self._scheduler()
        scheduler.start()
        try:
            if not await self._resolve_model():
                self.phase = "done"
                self.final = self._final_summary(reason=self.stop_reason or "target_unreachable")
                return self.final
            assert self.model is not None
            loop = asyncio.get_running_loop()
            self.timeline = tl = Timeline(loop.time(), cfg.run.warmup, cfg.run.window, cfg.run.duration)
            self.recorder = Recorder(self.metrics, tl, on_window_closed=self._window_closed)
            self.recorder._target_up_cb = self._target_changed  # noqa: SLF001
            self.recorder.set_target_up(True)
            workload = Workload(self.scenarios, cfg.load.mix, self.model, cfg.run.seed)
            self.driver = LoadDriver(cfg.load, self.client, workload, self.recorder, tl,
                                     max_requests=cfg.run.max_requests, seed=cfg.run.seed)
            if self._stop_requested.is_set():
                self.driver.stop(self.stop_reason)
            self.phase = "warmup" if cfg.run.warmup > 0 else "running"
            log.info("load_started", model=self.model, scenarios=list(self.scenarios),
                     mode="closed" if cfg.load.closed_loop else "open",
                     concurrency=cfg.load.effective_concurrency if cfg.load.closed_loop else None,
                     rate=cfg.load.rate, duration=cfg.run.duration, window=cfg.run.window, warmup=cfg.run.warmup)
            self._add_load_jobs(scheduler)
            await self.driver.run(grace=cfg.run.grace)
            self.stop_reason = self.stop_reason or self.driver.stop_reason
            self.phase = "done"
            self._tick()
            self.recorder.close_due(loop.time(), final=True)
            self.final = self._final_summary(reason=self.stop_reason)
            return self.final
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

    # ---- periodic jobs
    async def _tick_job(self) -> None:
        self._tick()

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

    def _window_closed(self, summary: dict[str, Any]) -> None:
        log.info("window_closed", **_compact(summary), scenarios={
            n: {"requests": v["requests"], "e2e_p95": v["e2e_seconds"]["p95"], "ttft_p95": v["ttft_seconds"]["p95"],
                "error_rate": v["error_rate"]}
            for n, v in summary["scenarios"].items()})
        self._append_jsonl("windows.jsonl", summary)

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
                "windows": list(rec.closed),
            }
        )
        self._write_json("summary.json", out)
        # the end of the run is an event too (JSON logs print no summary table)
        log.info("soakd_finished", run_id=self.run_id, stop_reason=reason, elapsed=out["elapsed_seconds"],
                 requests_sent=rec.sent, requests_measured=rec.measured,
                 outcomes={k: v for k, v in out["outcomes"].items() if v}, windows=len(out["windows"]),
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


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))

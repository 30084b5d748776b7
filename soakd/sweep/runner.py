"""``soakd sweep``: raise the load step by step until the knee (the validation method's step 6).

The composition of one sweep: the store (a run of kind ``sweep``; one window per step, the
result as its verdict), /metrics, /healthz, /readyz and /status, the client, and per step the
soak's own parts — a timeline of one warm-up and one window, its window set, a recorder and a load
driver at the step's level, with the same stratified mix and prompt sources as the soak (the
prompts of step *i* are drawn with seed ``run.seed + i``: a server's prefix cache does not make
later steps look faster). A step runs ``sweep.step`` after its warm-up, longer while it has fewer
than ``sweep.min_requests`` requests (up to ``sweep.max_step``); then sending stops, the requests
in flight finish (``run.grace``) and the step's window closes at the moment sending stopped.
``soakd.sweep.plan`` decides after each step whether the knee is reached.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import structlog
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from soakd import __version__
from soakd.client.openai import OpenAIClient
from soakd.config import SoakConfig
from soakd.core.timeline import SYSTEM_CLOCK, Clock, Timeline
from soakd.metrics import BY_NAME, SoakMetrics
from soakd.soak.driver import LoadDriver
from soakd.soak.recorder import Recorder
from soakd.soak.target import resolve_model
from soakd.soak.windows import WindowSet
from soakd.store import RunStore, StoreError
from soakd.sweep.plan import STOP_REASONS, Decision, Step, decide, step_of
from soakd.web import Heartbeat, WebServer, build_app
from soakd.workload.scenarios import resolve_all, with_trace_arrivals
from soakd.workload.workload import Workload

log = structlog.get_logger("soakd.sweep")

SCHEMA = "soakd.sweep/1"


def level_label(level: float) -> str:
    return f"{level:g}"


@dataclass
class SweepState:
    """What /status and /metrics show while the sweep runs."""

    mode: str
    levels: list[float]
    phase: str = "starting"  # starting | running | done
    step: int = -1
    steps: list[Step] = field(default_factory=list)
    decision: Decision | None = None


class SweepCollector(Collector):
    def __init__(self, state: SweepState) -> None:
        self.state = state

    def collect(self) -> list[Metric]:
        st = self.state
        out: list[Metric] = []
        if st.step < 0:
            return out
        fam = BY_NAME["soakd_sweep_step"].family()
        fam.add_metric([], float(st.step))
        out.append(fam)
        fam = BY_NAME["soakd_sweep_level"].family()
        fam.add_metric([st.mode], float(st.levels[min(st.step, len(st.levels) - 1)]))
        out.append(fam)
        rps = BY_NAME["soakd_sweep_step_requests_per_second"].family()
        lat = BY_NAME["soakd_sweep_step_latency_seconds"].family()
        for s in st.steps:
            rps.add_metric([level_label(s.level)], s.requests_per_second)
            for metric, q in s.latency.items():
                if q["value"] is not None:
                    lat.add_metric([level_label(s.level), metric], q["value"])
        out += [rps, lat]
        d = st.decision
        if d is not None and d.knee is not None:
            fam = BY_NAME["soakd_sweep_knee_level"].family()
            fam.add_metric([st.mode], float(st.steps[d.knee].level))
            out.append(fam)
        return out


@dataclass
class SweepOutcome:
    sweep_id: str
    document: dict[str, Any] | None
    stop_reason: str


class SweepRunner:
    def __init__(self, config: SoakConfig, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self.api_key = config.api_key()
        self.scenarios = resolve_all(config)
        config = self.config = with_trace_arrivals(config, self.scenarios)
        self.levels = config.sweep_levels()
        self.mode = "concurrency" if config.load.closed_loop else "rate"
        slos = config.slos()
        self.slos = slos
        self.metrics = SoakMetrics(tuple(self.scenarios), __version__,
                                   slo_objectives={n: s.quantile for n, s in slos.items()})
        self.state = SweepState(self.mode, self.levels)
        self.registry = self.metrics.registry()
        self.registry.register(SweepCollector(self.state))
        self.heartbeat = Heartbeat()
        self.web = WebServer(build_app(self.registry, self.status, self.ready, self.heartbeat),
                             config.metrics.host, config.metrics.port)
        burst = max(sc.burst_size for sc in self.scenarios.values())
        pool = int(max(self.levels)) * burst if config.load.closed_loop else config.load.max_in_flight
        self.client = OpenAIClient(config.target, self.api_key, pool_size=pool)
        self.sweep_id = uuid.uuid4().hex[:12]
        self._stop = asyncio.Event()
        self._driver: LoadDriver | None = None
        self.stop_reason = ""

    # ---- control
    def request_stop(self, reason: str = "signal") -> None:
        if not self._stop.is_set():
            log.info("stop_requested", reason=reason)
            self.stop_reason = reason
            self._stop.set()
            if self._driver is not None:
                self._driver.stop(reason)
        elif self._driver is not None:
            self._driver.cancel_all()

    def status(self) -> dict[str, Any]:
        st = self.state
        return {"sweep": self.sweep_id, "phase": st.phase, "mode": st.mode, "levels": st.levels,
                "step": st.step, "steps": [s.to_dict() for s in st.steps],
                "knee": st.decision.knee if st.decision is not None else None}

    def ready(self) -> tuple[bool, str]:
        return (self.state.phase == "running", self.state.phase)

    # ---- the sweep
    async def run(self) -> SweepOutcome:
        cfg = self.config
        store = await RunStore.open(cfg.run.state_dir)
        try:
            await self.web.start()
            self.heartbeat.start()
            log.info("sweep_started", sweep=self.sweep_id, mode=self.mode, levels=self.levels,
                     metrics_url=self.web.url + "/metrics", state_db=str(store.path))
            if cfg.load.workers > 1:
                log.warning("sweep_workers_ignored", workers=cfg.load.workers,
                            reason="a sweep sends from one process (load.workers applies to soakd run): a knee near "
                                   "one process's capacity (docs/performance.md) may be soakd's, not the server's")
            model = await resolve_model(self.client, cfg.target, cfg.target.model, has_key=bool(self.api_key),
                                        stop=self._stop, give_up_after=cfg.run.wait_for_target)
            if model is None:
                return SweepOutcome(self.sweep_id, None, self.stop_reason or "target_unreachable")
            await store.create_run(self.sweep_id, cfg.redacted(), target=cfg.target.display_url, model=model, kind="sweep")
            self.state.phase = "running"
            decision = Decision(False)
            for i, level in enumerate(self.levels):
                if self._stop.is_set():
                    break
                self.state.step = i
                summary = await self._step(i, level, model)
                if summary is None:
                    break
                await store.save_window(self.sweep_id, i, 0, summary)
                step = step_of(i, level, summary, self.slos, open_loop=not cfg.load.closed_loop)
                self.state.steps.append(step)
                decision = decide(self.state.steps, cfg.sweep, self._error_budget(),
                                  last=i == len(self.levels) - 1)
                self.state.decision = decision
                log.info("sweep_step", step=i, level=level, requests=step.requests,
                         requests_per_second=round(step.requests_per_second, 3),
                         e2e_p95=step.latency["e2e_p95"]["value"], error_rate=step.error_rate,
                         goodput_ratio=step.goodput_ratio, status=step.status, note=step.note)
                if decision.stop:
                    break
            if not decision.stop:
                decision = Decision(True, "stopped", None, f"stopped ({self.stop_reason}) before the knee")
                self.state.decision = decision
            doc = self.document(model)
            await store.set_verdict(self.sweep_id, doc)
            await store.finish_run(self.sweep_id, decision.reason or "stopped",
                                   "finished" if decision.reason != "stopped" else "failed")
            self.state.phase = "done"
            log.info("sweep_finished", sweep=self.sweep_id, reason=decision.reason, knee=doc["knee"],
                     message=decision.message)
            if cfg.sweep.linger > 0 and not self._stop.is_set():  # /metrics stays up: the knee gets scraped
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), cfg.sweep.linger)
            return SweepOutcome(self.sweep_id, doc, decision.reason or "stopped")
        finally:
            self.state.phase = "done"
            await self.client.close()
            await self.heartbeat.stop()
            await self.web.stop()
            await store.close()

    def _error_budget(self) -> float:
        sw = self.config.sweep
        return sw.error_budget if sw.error_budget is not None else self.config.analysis.verdict.error_budget

    async def _step(self, index: int, level: float, model: str) -> Any:
        """One step at ``level``: its window summary (None when stopped during it)."""
        cfg, sw, clock = self.config, self.config.sweep, self.clock
        max_step = sw.max_step or 3 * sw.step
        start = clock.monotonic()
        timeline = Timeline(start, sw.warmup, max_step, sw.warmup + max_step)
        windows = WindowSet(timeline, confidence=sw.confidence, patience=max_step, clock=clock,
                            sub_length=sw.step / 10)
        windows.flushed_by_owner = True  # enough() below flushes every 50 ms: batches, not one request at a time
        recorder = Recorder(self.metrics, windows, clock, slos={n: (s.ttft, s.itl, s.e2e)
                                                                for n, s in self.slos.items()})
        recorder.set_target_up(True)
        load = cfg.load.model_copy(update={"concurrency": int(level), "rate": None} if cfg.load.closed_loop
                                   else {"rate": float(level), "concurrency": None})
        workload = Workload(self.scenarios, cfg.load.mix, model, cfg.run.seed + index)
        driver = LoadDriver(load, self.client, workload, recorder, timeline, seed=cfg.run.seed + index, clock=clock)
        self._driver = driver
        measured_from = start + sw.warmup
        stopped_at: list[float] = []

        async def enough() -> None:
            while not driver.stopping:
                windows.flush()  # the step's finished requests into its window and the histograms, 20 batches a second
                now = clock.monotonic()
                if now - measured_from >= sw.step and recorder.measured >= sw.min_requests:
                    stopped_at.append(now)
                    driver.stop("step_done")
                    return
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(enough())
        log.info("sweep_step_started", step=index, level=level, mode=self.mode)
        try:
            await driver.run(grace=cfg.run.grace)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            self._driver = None
        if self._stop.is_set():
            return None
        end = stopped_at[0] if stopped_at else min(clock.monotonic(), timeline.end)
        out = [w for w in windows.close_due(end, final=True) if w.window == 0]
        return out[0] if out else None

    # ---- the record
    def document(self, model: str | None) -> dict[str, Any]:
        """The sweep as JSON (``soakd sweep --json``; ``soakd run --load-from`` reads ``mode`` and ``knee``)."""
        st, cfg = self.state, self.config
        d = st.decision or Decision(False)
        knee = st.steps[d.knee] if d.knee is not None else None
        with_goodput = [s for s in st.steps if s.goodput_per_second is not None and not s.slo_broken]
        best = max(with_goodput, key=lambda s: s.goodput_per_second or 0.0) if with_goodput else None
        return {
            "schema": SCHEMA,
            "sweep": self.sweep_id,
            "created_unix": time.time(),
            "target": cfg.target.display_url,
            "model": model,
            "mode": self.mode,
            "levels": st.levels,
            "mix": dict(cfg.load.mix),
            "step_seconds": cfg.sweep.step,
            "step_warmup_seconds": cfg.sweep.warmup,
            "steps": [s.to_dict() for s in st.steps],
            "stop_reason": d.reason,
            "stop_reason_text": STOP_REASONS.get(d.reason or "", ""),
            "message": d.message,
            "knee": None if knee is None else {"step": knee.index, "level": knee.level,
                                               "requests_per_second": knee.requests_per_second,
                                               "output_tokens_per_second": knee.output_tokens_per_second,
                                               "e2e_p95": knee.latency["e2e_p95"]["value"]},
            "best_goodput": None if best is None else {"step": best.index, "level": best.level,
                                                       "goodput_per_second": best.goodput_per_second,
                                                       "goodput_ratio": best.goodput_ratio},
        }


def read_sweep(state_dir: Any, sweep_id: str | None = None) -> dict[str, Any]:
    """The stored document of a sweep (the newest by default), from the store."""
    from soakd.store import StoreReader

    with StoreReader(state_dir) as reader:
        runs = reader.list_runs("sweep")
        run = next((r for r in runs if r.id == sweep_id), None) if sweep_id else (runs[0] if runs else None)
        if run is None:
            raise StoreError(f"no sweep {sweep_id or ''} in {reader.db}".replace("  ", " "))
        if run.verdict is None:
            raise StoreError(f"sweep {run.id} in {reader.db} has no result (it was interrupted)")
        return dict(run.verdict)

"""What a soak says about itself while it runs: ``/status`` (JSON), ``/readyz``, the run-progress
gauges, the per-minute ``summary`` log line and the live progress line on a terminal.

``StatusBoard`` only reads the other parts (public attributes and methods); it owns the run's
phase and the recent request rates.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from soakd import __version__
from soakd.analysis.engine import Analyzer
from soakd.analysis.window import fmt_ms
from soakd.config import SoakConfig
from soakd.core.findings import finding_log
from soakd.core.summary import WindowSummary
from soakd.core.timeline import SYSTEM_CLOCK, Clock, Timeline
from soakd.metrics import SoakMetrics
from soakd.samplers.base import SamplerRunner
from soakd.soak.canary import CanaryRunner
from soakd.soak.driver import LoadDriver
from soakd.soak.workers import WorkerPool
from soakd.soak.recorder import Recorder
from soakd.soak.session import RunSession
from soakd.soak.windows import WindowSet

log = structlog.get_logger("soakd")


@dataclass
class Load:
    """The parts that exist once load runs."""

    timeline: Timeline
    windows: WindowSet
    recorder: Recorder
    driver: LoadDriver | WorkerPool  # load.workers > 1: the worker processes (soakd.soak.workers)


def compact(s: WindowSummary) -> dict[str, Any]:
    """A window in a few numbers (``/status``)."""
    return {
        "window": s.window,
        "partial": s.partial,
        "duration_seconds": round(s.duration_seconds, 3),
        "requests": s.requests,
        "error_rate": s.error_rate,
        "requests_per_second": round(s.requests_per_second, 3),
        "output_tokens_per_second": round(s.output_tokens_per_second, 2),
        "e2e_p50": s.e2e_seconds.p50,
        "e2e_p95": s.e2e_seconds.p95,
        "ttft_p50": s.ttft_seconds.p50,
        "ttft_p95": s.ttft_seconds.p95,
        "itl_p50": s.itl_seconds.p50,
        "itl_p95": s.itl_seconds.p95,
        "mix": {k: round(v, 4) for k, v in s.mix.items()},
        "outcomes": {k: v for k, v in s.outcomes.items() if v},
        # requests that overlapped a stall of soakd's own loop (their latency left out), and whether too
        # many were for the window to be judged
        "requests_impaired": s.client.requests_impaired if s.client is not None else 0,
        "impaired_share": s.client.impaired_share if s.client is not None else None,
        "client_impaired": bool(s.client is not None and s.client.impaired),
    }


def iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


class StatusBoard:
    def __init__(self, config: SoakConfig, *, session: RunSession, metrics: SoakMetrics,
                 runners: Sequence[SamplerRunner], analyzer: Analyzer, clock: Clock = SYSTEM_CLOCK) -> None:
        self.config = config
        self.session = session
        self.metrics = metrics
        self.runners = runners
        self.analyzer = analyzer
        self.clock = clock
        self.phase = "starting"
        self.started_wall = clock.wall()
        self.model: str | None = config.target.model
        self.target_seen = False
        self.load: Load | None = None
        self.canary: CanaryRunner | None = None
        self.rates = (0.0, 0.0)  # requests/s and output tokens/s over the last second or so
        self.other_targets: Any = None  # A/B runs: a callable giving the other targets' status
        self._last_tick: tuple[float, int, int] | None = None
        self._last_summary: tuple[float, int, int, dict[str, int]] | None = None

    # ---- readiness and the target's state
    def ready(self) -> tuple[bool, str]:
        if not self.target_seen:
            return False, "the target has not answered yet"
        return True, self.phase

    def target_changed(self, up: bool) -> None:
        if up:
            self.target_seen = True
            log.info("target_up", url=self.config.target.display_url)
        else:
            log.warning("target_down", url=self.config.target.display_url,
                        last_error=self.load.recorder.last_error if self.load else None)

    def connection_dropped(self, rec: Any) -> None:
        """Once per run: the target dropped a connection while it answered other requests."""
        keep_alive = self.config.target.keep_alive
        log.warning("connection_dropped_while_up", url=self.config.target.display_url, reason=rec.reason,
                    error=rec.error[:200], keep_alive=keep_alive,
                    hint="counted as connection_error; the target stays up. " + (
                        "A server that closes reused keep-alive connections (llama.cpp's llama-server after "
                        "streamed responses) is cured by target.keep_alive: false (--no-keep-alive)"
                        if keep_alive else "Check the server's and any proxy's logs"))  # fmt: skip

    # ---- the tick: progress gauges, phase, rates
    def tick(self, now: float) -> None:
        ld = self.load
        if ld is None:
            return
        tl, rec, m = ld.timeline, ld.recorder, self.metrics
        m.elapsed.value = round(tl.elapsed(now), 3)
        m.progress.value = round(tl.progress(now), 5)
        idx = tl.window_at(min(now, tl.end - 1e-9))
        m.window_index.value = idx
        m.warmup_active.value = 1.0 if idx < 0 else 0.0
        if self.phase in ("warmup", "running"):
            self.phase = "warmup" if idx < 0 else "running"
            if ld.driver.stopping:
                self.phase = "draining"
        if self._last_tick is not None:
            t0, n0, c0 = self._last_tick
            dt = now - t0
            if dt >= 0.9:
                self.rates = ((rec.finished_count - n0) / dt, (rec.completion_tokens - c0) / dt)
                self._last_tick = (now, rec.finished_count, rec.completion_tokens)
        else:
            self._last_tick = (now, rec.finished_count, rec.completion_tokens)

    def _current(self, now: float) -> WindowSummary | None:
        assert self.load is not None
        cur = self.load.windows.current(now)
        return cur.summary(actual_end=min(now, cur.end)) if cur is not None else None

    # ---- /status
    def status(self) -> dict[str, Any]:
        cfg = self.config
        now = self.clock.monotonic()
        out: dict[str, Any] = {
            "run_id": self.session.run_id,
            "version": __version__,
            "phase": self.phase,
            "target": cfg.target_list()[0].display_url,
            "model": self.model,
            "started_at": iso(self.started_wall),
            "duration_seconds": cfg.run.duration,
            "window_seconds": cfg.run.window,
            "warmup_seconds": cfg.run.warmup,
            "load": {"mode": "closed" if cfg.load.closed_loop else "open",
                     "concurrency": cfg.load.effective_concurrency if cfg.load.closed_loop else None,
                     "rate": cfg.load.rate, "mix": cfg.load.mix},
            "segment": self.session.segment,
            "resumed": self.session.resumed,
            "samplers": {r.name: r.status() for r in self.runners},
            "store": self.session.health(),
            "analysis": self._analysis_status(),
        }
        ld = self.load
        if ld is None:
            return out
        tl, rec = ld.timeline, ld.recorder
        current = self._current(now)
        closed = list(self.analyzer.history.closed)
        out.update(
            {
                "elapsed_seconds": round(tl.elapsed(now), 3),
                "progress_ratio": round(tl.progress(now), 4),
                "window_index": tl.window_at(now),
                "in_flight": rec.in_flight,
                "requests_sent": rec.sent,
                "requests_finished": rec.finished_count,
                "requests_measured": rec.measured,
                "requests_impaired": int(sum(self.metrics.requests_impaired.values.values())),
                "outcomes": dict(rec.outcomes),
                "target_up": rec.target_up,
                "requests_per_second": round(self.rates[0], 3),
                "output_tokens_per_second": round(self.rates[1], 3),
                "per_scenario": {
                    sc: {o: int(self.metrics.requests.get(sc, o)) for o in rec.outcomes}
                    for sc in self.metrics.scenarios
                },
                "current_window": compact(current) if current else None,
                "closed_windows": [compact(w) for w in closed[-5:]],
                "windows_closed": ld.windows.closed_count,
                "records_lost": ld.windows.lost_records,
                "prompt_length_accuracy": rec.prompt_length_accuracy(),
                "last_error": rec.last_error or None,
            }
        )
        if self.other_targets is not None:
            out["target_name"] = cfg.target_list()[0].name
            out["targets"] = self.other_targets()
        return out

    def _analysis_status(self) -> dict[str, Any]:
        a = self.analyzer
        states = a.states()
        drift, leaks, probes = states["drift"], states["leak"], a.probes
        return {
            "baseline_window": drift.baseline_window,
            "baseline_external": drift.baseline_external,
            "windows": len(a.history.full()),
            "drift_detected": sorted(m for m, v in drift.active.items() if v),
            "drift": {f"{m}/{ref}": {"ratio": r.ratio, "ci": r.ratio_ci, "status": r.status,
                                     "direction": r.direction, "window": r.window}
                      for (m, ref), r in sorted(drift.drift.items()) if r.scenario is None},
            "leaks": {k: {"status": v.status, "growth_per_hour": v.growth_per_hour, "suspected": v.suspected}
                      for k, v in leaks.leaks.items()},
            "throttle_detected": states["throttle"].detected,
            "throttled_gpus": {t.reason: list(t.gpus) for t in states["throttle"].results if t.detected},
            "canary": self.canary.status() if self.canary is not None else None,
            "quiesce_probes": probes.quiesce_probes,
            "last_quiesce": probes.last_quiesce.model_dump() if probes.last_quiesce is not None else None,
            "findings": [finding_log(f) for f in a.findings[-10:]],
            "failing": a.failing,
            "failing_findings": [finding_log(f) for f in a.failing_findings[-20:]],
            "verdict_so_far": "FAIL" if a.failing else "PASS",
        }

    # ---- log lines
    async def summary_line(self) -> None:
        """The per-minute ``summary`` log line."""
        if self.load is None:
            return
        rec, tl, now = self.load.recorder, self.load.timeline, self.clock.monotonic()
        prev = self._last_summary
        self._last_summary = (now, rec.finished_count, rec.completion_tokens, dict(rec.outcomes))
        if prev is None:
            return
        dt = max(1e-9, now - prev[0])
        errs = {k: v - prev[3].get(k, 0) for k, v in rec.outcomes.items() if k != "ok" and v - prev[3].get(k, 0)}
        s = self._current(now)
        log.info("summary", elapsed=round(tl.elapsed(now), 1), progress=round(tl.progress(now), 4),
                 window=tl.window_at(now), in_flight=rec.in_flight,
                 requests_per_second=round((rec.finished_count - prev[1]) / dt, 2),
                 output_tokens_per_second=round((rec.completion_tokens - prev[2]) / dt, 1),
                 errors=errs, e2e_p95=s.e2e_seconds.p95 if s else None,
                 ttft_p95=s.ttft_seconds.p95 if s else None, target_up=rec.target_up)

    def progress_parts(self) -> list[str] | None:
        """The live progress line's parts, most important first (a narrow terminal shows the first
        that fit): elapsed/duration with the percentage and the time left, the window, the target
        down, errors, throughput, latency, in flight. None before the load starts."""
        if self.load is None:
            return None
        rec, tl, now = self.load.recorder, self.load.timeline, self.clock.monotonic()
        s = self._current(now)
        failed = sum(v for k, v in rec.outcomes.items() if k not in ("ok", "cancelled"))
        err = failed / rec.finished_count if rec.finished_count else 0.0
        window = tl.window_at(now)
        left = max(0.0, tl.duration - tl.elapsed(now))
        parts = [f"{hms(tl.elapsed(now))}/{hms(tl.duration)} {tl.progress(now):4.0%} ETA {hms(left)}",
                 "warm-up" if window < 0 else f"window {window}"]
        if not rec.target_up:
            parts.append("TARGET DOWN")
        parts += [f"errors {err:.2%}", f"{self.rates[0]:.1f} req/s {self.rates[1]:.0f} tok/s",
                  f"p95 e2e {fmt_ms(s.e2e_seconds.p95 if s else None)} ttft {fmt_ms(s.ttft_seconds.p95 if s else None)}",
                  f"in flight {rec.in_flight}"]
        return parts

"""Quiesce probes: stop sending, let in-flight requests drain, sample KV-cache usage and device
memory at idle, resume.

What a KV cache that is not released looks like only shows at idle: the probe measures it once
per window (``RunPolicies.quiesce_interval``) at a seeded random time in it
(``soakd.soak.probe_schedule``: a fixed phase aliases a memory cycle near the window). Probe time is
excluded from the window's load time (``paused_seconds``); samples taken while it holds the load
stay out of the window's aggregates (``TelemetryRouter``); the window it runs in stays open until
it ends. Not in the last part of the run (nothing would follow to compare); a stop request ends
the probe at once. With the canary tied to the probes, the canary runs on the idle server here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from soakd.analysis.engine import Analyzer
from soakd.config import QuiesceConfig, RunPolicies
from soakd.core.summary import QuiesceProbe
from soakd.core.timeline import SYSTEM_CLOCK, Clock, Timeline
from soakd.samplers.base import SamplerRunner
from soakd.soak.canary import CanaryRunner
from soakd.soak.driver import LoadDriver
from soakd.soak.events import EventLog
from soakd.soak.probe_schedule import ProbeSchedule
from soakd.soak.windows import WindowSet

IDLE_SAMPLERS = ("server", "nvml", "dcgm")


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


class QuiesceProber:
    def __init__(self, cfg: QuiesceConfig, policies: RunPolicies, *, driver: LoadDriver, timeline: Timeline,
                 windows: WindowSet, runners: Sequence[SamplerRunner], analyzer: Analyzer, events: EventLog,
                 canary: CanaryRunner | None, running: Callable[[], bool], clock: Clock = SYSTEM_CLOCK) -> None:
        self.cfg = cfg
        self.policies = policies
        self.driver = driver
        self.timeline = timeline
        self.windows = windows
        self.runners = runners
        self.analyzer = analyzer
        self.events = events
        self.canary = canary
        self.running = running
        self.clock = clock
        self._task: asyncio.Task | None = None
        # slots from the first window's start (the interval's middle: the first probe of earlier releases)
        self.schedule = ProbeSchedule.seeded(timeline.first_window_start, policies.quiesce_interval,
                                             policies.quiesce_jitter, policies.seed, end=timeline.end,
                                             min_remaining=policies.quiesce_min_remaining,
                                             duration=policies.quiesce_drain_timeout + cfg.settle)

    async def maybe_probe(self) -> QuiesceProbe | None:
        """The scheduler's job (every tick): a probe when the schedule says one is due."""
        if self.driver.stopping or not self.running() or not self.schedule.due(self.clock.monotonic()):
            return None
        return await self.probe()

    async def cancel(self) -> None:
        """The run is ending: abandon a probe in progress (the load is not resumed)."""
        task = self._task
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _read_idle(self) -> tuple[float | None, float | None]:
        """One reading of the idle samplers: (KV-cache usage, device memory used), None where none."""
        kv: float | None = None
        mem_by: dict[str, float] = {}
        for runner in self.runners:
            if runner.name in IDLE_SAMPLERS and await runner.run_once() and runner.snapshot:
                for sr in runner.snapshot.series:
                    if sr.name == "soakd_server_kv_cache_usage_ratio":
                        kv = sr.value
                    elif sr.name == "soakd_gpu_memory_used_bytes":
                        mem_by[runner.name] = mem_by.get(runner.name, 0.0) + sr.value
        return kv, mem_by.get("nvml", mem_by.get("dcgm"))

    async def probe(self) -> QuiesceProbe | None:
        """One probe (the scheduler's job); None when it did not run or was abandoned."""
        drv, tl = self.driver, self.timeline
        if drv.stopping or not self.running():
            return None
        t0, wall = self.clock.monotonic(), self.clock.wall()
        if tl.end - t0 < self.policies.quiesce_min_remaining:
            return None
        idx = tl.window_at(t0)
        held = self.windows.hold(idx)  # the window stays open until its probe ends (else the probe is lost)
        self._task = asyncio.current_task()
        drv.pause()
        kv: float | None = None
        mem: float | None = None
        drained = completed = False
        try:
            drained = await drv.wait_idle(self.policies.quiesce_drain_timeout)
            if self.cfg.settle > 0:
                await asyncio.sleep(self.cfg.settle)
            kv, mem = await self._read_idle()
            for _ in range(self.cfg.rereads):  # the gauge may lag the freeing of the last blocks
                if kv is None or kv <= 0 or drv.stopping:
                    break
                await asyncio.sleep(max(0.05, self.cfg.settle))
                kv2, mem2 = await self._read_idle()
                if kv2 is not None:  # idle, usage can only fall
                    kv = min(kv, kv2)
                if mem2 is not None:
                    mem = mem2 if mem is None else min(mem, mem2)
            if self.canary is not None:
                await self.canary.check(idle=True, window=idx)
            completed = True
        except asyncio.CancelledError:
            pass  # the run is ending: the probe is abandoned, the load is not resumed
        finally:
            self._task = None
            if not drv.stopping:
                drv.resume()
            t1 = self.clock.monotonic()
            self.windows.add_interval(t0, t1, "paused_seconds")
            self.windows.release(held)
        if not completed:
            return None
        probe = QuiesceProbe(t_unix=wall, window=idx, drained=drained, kv_cache_usage_ratio=kv,
                             memory_used_bytes=mem, seconds=round(t1 - t0, 3))
        self.windows.set_probe(probe)
        self.analyzer.add_quiesce(probe)
        self.events.emit("quiesce", "info",
                         f"quiesce probe in window {idx}: idle KV usage {_fmt(kv, '.4f')}, device memory "
                         f"{_fmt(mem / 2**30 if mem is not None else None, '.2f')} GiB, drained={drained}, "
                         f"{probe.seconds}s", probe.model_dump(), idx)
        await self.events.flush()
        return probe

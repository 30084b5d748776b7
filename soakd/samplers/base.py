"""The Sampler protocol, the wrapper that isolates each sampler, and the snapshot collector.

A sampler returns a list of ``Series`` (a catalogue metric name, labels, a value) or raises.
``SamplerRunner`` runs it (APScheduler job, one per sampler) within its timeout of the time soakd's
loop was on time (``soakd.core.punctual``: soakd's own stalls are not the source's), times it, records
``soakd_sampler_up``/``errors_total``/``duration``/``last_success``, logs state changes once
(up->down, down->up) rather than every failure, and never lets an exception escape. The
``SnapshotCollector`` exposes the latest snapshot of every sampler at scrape time: no I/O in
``collect()``, and series older than the staleness limit drop out instead of freezing — except
the counts soakd keeps itself (a sampler's optional ``sticky()``: the server sampler's restart
count), which stay exported while the source is away, so that a counter never vanishes in an outage
and comes back higher (``increase()`` would miss the restart that the outage was).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import structlog
from prometheus_client.core import Metric

from soakd.core.punctual import within
from soakd.core.series import Series
from soakd.metrics import BY_NAME

log = structlog.get_logger("soakd.samplers")

class SamplerUnavailable(Exception):
    """The source is absent (no NVML library, no GPU, no /metrics): the sampler is down, with a
    message the user can act on. Logged once, as a warning."""


@runtime_checkable
class Sampler(Protocol):
    name: str  # bounded label value: nvml, dcgm, server, host

    async def sample(self) -> Sequence[Series]:  # raise on failure
        ...

    async def aclose(self) -> None:
        ...


@dataclass
class Snapshot:
    series: Sequence[Series]
    monotonic: float
    wall: float


class SamplerRunner:
    """The execute()-style wrapper around one sampler."""

    def __init__(
        self,
        sampler: Sampler,
        interval: float,
        timeout: float | None = None,
        listeners: Iterable[Callable[[str, Snapshot], None]] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sampler = sampler
        self.name = sampler.name
        self.interval = interval
        self.timeout = timeout if timeout is not None else max(1.0, interval * 0.9)
        self.listeners = list(listeners)
        self.clock = clock
        self.snapshot: Snapshot | None = None
        self.up: bool | None = None  # None: not run yet
        self.errors = 0
        self.runs = 0
        self.missed = 0
        self.last_duration = 0.0
        self.last_success_wall: float | None = None
        self.last_error = ""
        self._lock = asyncio.Lock()

    async def run_once(self) -> bool:
        """Sample once; True on success. Never raises (except CancelledError).

        One sample at a time: a quiesce probe's reading waits for the scheduled sample in flight. Two at
        once can be applied in the other order than the server answered them: counters read earlier,
        applied later, are lower than the last ones (seen: a stationary simulator paged
        SoakdServerRestarted on a busy machine), and an older snapshot replaces a newer one."""
        async with self._lock:
            return await self._run_once()

    async def _run_once(self) -> bool:
        t0 = time.perf_counter()
        self.runs += 1
        try:
            result = await within(self.sampler.sample(), self.timeout)  # soakd's own stalls not charged
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a sampler failure is data, never fatal
            self.last_duration = time.perf_counter() - t0
            self._failed(exc)
            return False
        self.last_duration = time.perf_counter() - t0
        snap = Snapshot(list(result), self.clock(), time.time())
        self.snapshot = snap
        self.last_success_wall = snap.wall
        if self.up is not True:
            if self.up is False:
                log.info("sampler_up", sampler=self.name, after_errors=self.errors)
            self.up = True
        for listener in self.listeners:
            try:
                listener(self.name, snap)
            except Exception as exc:  # noqa: BLE001
                log.error("sampler_listener_failed", sampler=self.name, error=repr(exc))
        return True

    def _failed(self, exc: BaseException) -> None:
        self.errors += 1
        if isinstance(exc, TimeoutError):
            msg = f"timed out after {self.timeout:.1f}s"
        else:
            msg = str(exc) or type(exc).__name__
        self.last_error = msg[:300]
        if self.up is not False:
            if isinstance(exc, SamplerUnavailable):
                log.warning("sampler_unavailable", sampler=self.name, reason=self.last_error)
            else:
                log.warning("sampler_down", sampler=self.name, error=f"{type(exc).__name__}: {self.last_error}")
            self.up = False

    def fresh(self, now: float, staleness: float) -> Sequence[Series]:
        snap = self.snapshot
        if snap is None:
            return ()
        if now - snap.monotonic > staleness:
            sticky = getattr(self.sampler, "sticky", None)
            return tuple(sticky()) if sticky is not None else ()
        return snap.series

    def status(self) -> dict[str, object]:
        return {
            "up": bool(self.up),
            "interval_seconds": self.interval,
            "errors": self.errors,
            "missed": self.missed,
            "last_duration_seconds": round(self.last_duration, 4),
            "last_success": self.last_success_wall,
            "last_error": self.last_error or None,
        }


class SnapshotCollector:
    """Yields metric families from the runners' latest fresh snapshots (a ``SoakMetrics`` source)."""

    def __init__(
        self,
        runners: Sequence[SamplerRunner],
        staleness_factor: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runners = runners
        self.staleness_factor = staleness_factor
        self.clock = clock

    def __call__(self) -> Iterator[Metric]:
        now = self.clock()
        grouped: dict[str, list[Series]] = {}
        for r in self.runners:
            for s in r.fresh(now, max(r.interval * self.staleness_factor, r.interval + 5.0)):
                grouped.setdefault(s.name, []).append(s)
        # self-metrics of every sampler: always present
        yield from self._self_families()
        for name, items in grouped.items():
            spec = BY_NAME.get(name)
            if spec is None:
                continue
            label_names = list(spec.labels)
            fam = spec.family()
            if spec.kind == "info":
                for s in items:
                    fam.add_metric([s.label(k) or "" for k in label_names], {})
                yield fam
                continue
            seen: set[tuple[str, ...]] = set()
            for s in items:
                values = tuple(s.label(k) or "" for k in label_names)
                if values in seen:  # two sources of one series: the first sampler wins
                    continue
                seen.add(values)
                fam.add_metric(list(values), s.value)
            yield fam

    def _self_families(self) -> Iterator[Metric]:
        up = BY_NAME["soakd_sampler_up"].family()
        errors = BY_NAME["soakd_sampler_errors_total"].family()
        duration = BY_NAME["soakd_sampler_duration_seconds"].family()
        last = BY_NAME["soakd_sampler_last_success_timestamp_seconds"].family()
        missed = BY_NAME["soakd_sampler_missed_runs_total"].family()
        for r in self.runners:
            up.add_metric([r.name], 1.0 if r.up else 0.0)
            errors.add_metric([r.name], float(r.errors))
            duration.add_metric([r.name], r.last_duration)
            missed.add_metric([r.name], float(r.missed))
            if r.last_success_wall is not None:
                last.add_metric([r.name], r.last_success_wall)
        yield from (up, errors, duration, last, missed)

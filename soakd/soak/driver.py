"""The load driver: a plain asyncio loop over the workload, closed loop (N workers) or open
loop (seeded arrival times, capped in flight). Request errors are data; nothing here raises
into the loop. It ends at the duration, at ``max_requests``, or when ``stop()`` is called, then
drains in-flight requests within the grace period and cancels the rest (recorded as cancelled).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import structlog

from soakd.client.openai import OpenAIClient
from soakd.config import LoadConfig
from soakd.core.records import Outcome, RequestRecord
from soakd.core.timeline import SYSTEM_CLOCK, Clock, Timeline
from soakd.soak.recorder import Recorder
from soakd.workload.arrivals import arrivals
from soakd.workload.trace import TraceArrival, time_scale, trace_arrivals
from soakd.workload.workload import PlannedRequest, Workload

log = structlog.get_logger("soakd.driver")

LATE_THRESHOLD = 0.010
BACKOFF_FLOOR = 0.1  # seconds a closed-loop worker waits after a failed unit, doubling while they fail ...
BACKOFF_CAP = 2.0  # ... up to this (times a jitter of 1-1.5): an outage's recovery is seen within ~3 s


def backoff_delay(failures: int, u: float) -> float:
    """The wait after the ``failures``-th failed unit in a row (1, 2, ...): the floor doubling up to the
    cap, times ``1 + u / 2`` (``u`` uniform in [0, 1): jitter, so that the workers do not retry in step)."""
    return min(BACKOFF_CAP, BACKOFF_FLOOR * 2 ** min(failures - 1, 16)) * (1.0 + u / 2)


class LoadDriver:
    def __init__(
        self,
        load: LoadConfig,
        client: OpenAIClient,
        workload: Workload,
        recorder: Recorder,
        timeline: Timeline,
        max_requests: int | None = None,
        seed: int = 0,
        clock: Clock = SYSTEM_CLOCK,
        share: tuple[int, int] = (0, 1),
    ) -> None:
        """``share``: (k, N), load worker k of N (``load.workers``, ``soakd.soak.worker``): the closed loop's
        workers k, k+N, ... of the concurrency; the open loop's arrivals k, k+N, ... of the one seeded
        sequence, with an N-th of ``max_in_flight`` (the remainder to the first workers: the sum is the cap)."""
        self.share = share
        self.load = load
        self.client = client
        self.workload = workload
        self.recorder = recorder
        self.timeline = timeline
        self.max_requests = max_requests
        self.seed = seed
        self.clock = clock
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self.issued = 0
        self.stop_reason = ""
        self._running = asyncio.Event()  # cleared while a quiesce probe holds the load
        self._running.set()
        self._resumed_at = 0.0

    # ---- control
    def stop(self, reason: str = "stopped") -> None:
        if not self._stop.is_set():
            self.stop_reason = reason
            self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def pause(self) -> None:
        """Stop sending new requests (in-flight ones finish); for quiesce probes."""
        self._running.clear()

    def resume(self) -> None:
        self._resumed_at = self.clock.monotonic()
        self._running.set()

    def cancel_all(self) -> None:
        """Cancel every request in flight at once (a second stop signal); each is recorded as
        cancelled."""
        for task in list(self._tasks):
            task.cancel()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is in flight (True) or the timeout passes (False)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.recorder.in_flight > 0:
            if loop.time() >= deadline or self._stop.is_set():
                return False
            await asyncio.sleep(0.02)
        return True

    async def _wait_running(self) -> None:
        """While paused: wait for resume or stop."""
        if self._running.is_set():
            return
        resume = asyncio.ensure_future(self._running.wait())
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait((resume, stop), return_when=asyncio.FIRST_COMPLETED)
        finally:
            resume.cancel()
            stop.cancel()

    # ---- one request
    async def _one(self, planned: PlannedRequest, window: int) -> RequestRecord:
        sc = planned.scenario
        rec = RequestRecord(sc.name, sc.endpoint, sc.stream)
        rec.window = window
        rec.warmup = window < 0
        rec.expected_prompt_tokens = planned.expected_prompt_tokens
        rec.max_tokens = planned.max_tokens
        self.recorder.started(rec)
        try:
            await self.client.execute(rec, planned.body, sc.structure_check)
        finally:
            # also on cancellation: the record (outcome cancelled) is counted, then it propagates
            self.recorder.finished(rec)
            if planned.conversation is not None:
                self.workload.finish_turn(planned, rec.ok, rec.text)
        return rec

    async def _unit(self, window: int, arrival: TraceArrival | None = None) -> bool:
        """Run one unit; True when a request of it failed (the closed loop backs off)."""
        unit = self.workload.next_unit(window, arrival)  # warm-up (-1) has its own stratum
        if len(unit) > 1 and unit[1].after_previous:
            return await self._turns(unit, window)
        take = len(unit)
        if self.max_requests is not None:
            take = min(take, self.max_requests - self.issued)
            if take <= 0:
                self.stop("max_requests")
                return False
            unit = unit[:take]
        self.issued += take
        if self.max_requests is not None and self.issued >= self.max_requests:
            self.stop("max_requests")
        if take == 1:
            return _failed(await self._one(unit[0], window))
        recs = await asyncio.gather(*(self._one(p, window) for p in unit))
        return any(map(_failed, recs))

    async def _turns(self, unit: list[PlannedRequest], window: int) -> bool:
        """A replayed conversation: turn by turn, each after the previous one answered, each counted against
        ``max_requests`` when it is sent and in the window it is sent in; none after a failed turn, the stop,
        or the end of the run."""
        for k, planned in enumerate(unit):
            if k:
                await self._wait_running()
                now = self.clock.monotonic()
                if self._stop.is_set() or now >= self.timeline.end:
                    return False
                window = self.timeline.window_at(now)
            if self.max_requests is not None and self.issued >= self.max_requests:
                self.stop("max_requests")
                return False
            self.issued += 1
            if _failed(await self._one(planned, window)):
                return True
        if self.max_requests is not None and self.issued >= self.max_requests:
            self.stop("max_requests")
        return False

    # ---- loops
    async def _worker(self, index: int = 0) -> None:
        tl = self.timeline
        clock = self.clock
        failures = 0
        jitter = random.Random(self.seed * 1_000_003 + index).random
        while not self._stop.is_set():
            if not self._running.is_set():
                await self._wait_running()
                continue
            now = clock.monotonic()
            if now >= tl.end:
                self.stop("duration")
                break
            if await self._unit(tl.window_at(now)):
                # a failed unit: back off before the next, so that a target that fails fast (refused
                # connections, 404 for the model, HTML, 5xx at once) gets less than the configured load,
                # never a flood (at concurrency N: at most N / BACKOFF_FLOOR requests per second)
                failures += 1
                try:
                    await asyncio.wait_for(self._stop.wait(), backoff_delay(failures, jitter()))
                except TimeoutError:
                    pass
            else:
                failures = 0

    async def _open_loop(self) -> None:
        loop = asyncio.get_running_loop()
        tl = self.timeline
        k, n = self.share
        cap = self.load.max_in_flight // n + (1 if k < self.load.max_in_flight % n else 0)
        slots = asyncio.Semaphore(cap)
        late = self.recorder.metrics.late_sends
        stop_wait = asyncio.ensure_future(self._stop.wait())
        try:
            # rate is requests per second; a burst is one arrival of burst_size requests
            unit_rate = float(self.load.rate or 1.0) / self.workload.requests_per_unit
            for i, (t, arrival) in enumerate(self._arrivals(unit_rate)):
                if n > 1 and i % n != k:  # another worker's arrival
                    if t >= tl.end:
                        self.stop("duration")
                        break
                    continue
                if t >= tl.end:
                    self.stop("duration")
                    break
                delay = t - self.clock.monotonic()
                if delay > 0:
                    await asyncio.wait((stop_wait,), timeout=delay)
                if self._stop.is_set():
                    break
                if not self._running.is_set():
                    # a quiesce probe holds the load: arrivals scheduled during it are skipped, not late
                    await self._wait_running()
                    if self._stop.is_set():
                        break
                    continue
                if t < self._resumed_at:
                    continue
                if slots.locked():
                    # the cap is reached: wait for a slot (or the stop), and count the send as late
                    acq = asyncio.ensure_future(slots.acquire())
                    await asyncio.wait((acq, stop_wait), return_when=asyncio.FIRST_COMPLETED)
                    if not acq.done():
                        acq.cancel()
                        break
                else:
                    await slots.acquire()
                now = self.clock.monotonic()
                if now >= tl.end:  # its time came before the end, the send after it (a slot, a coarse clock)
                    slots.release()
                    self.stop("duration")
                    break
                if now - t > LATE_THRESHOLD:
                    late.inc(())
                task = loop.create_task(self._unit_released(tl.window_at(now), slots, arrival))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            else:  # a trace's arrivals end before the run does (its last pass): the run still lasts its duration
                if not self._stop.is_set() and self.load.arrival == "trace":
                    await asyncio.wait((stop_wait,), timeout=max(0.0, tl.end - self.clock.monotonic()))
                    self.stop("duration")
        finally:
            stop_wait.cancel()

    def _arrivals(self, unit_rate: float) -> Iterator[tuple[float, TraceArrival | None]]:
        """Send times: the arrival process's, or the trace's (its timestamps, or its shape at the rate)."""
        trace = self.workload.trace
        if self.load.arrival == "trace" and trace is not None and trace.timed:
            sc = self.workload.trace_scenario
            scale = time_scale(trace, sc.speedup if sc is not None else 1.0, self.load.rate, self.timeline.window)
            for a in trace_arrivals(trace, self.timeline, scale):
                yield a.t, a
            return
        kind = "poisson" if self.load.arrival == "trace" else self.load.arrival
        for t in arrivals(kind, unit_rate, self.timeline.start, self.seed):
            yield t, None

    async def _unit_released(self, window: int, slots: asyncio.Semaphore, arrival: TraceArrival | None = None) -> None:
        try:
            await self._unit(window, arrival)
        finally:
            slots.release()

    async def run(self, grace: float = 30.0) -> None:
        """Drive load until the end; then drain (``grace`` seconds) and cancel what is left."""
        loop = asyncio.get_running_loop()
        if self.load.closed_loop:
            k, n = self.share
            for i in range(k, self.load.effective_concurrency, n):
                task = loop.create_task(self._worker(i))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            stopper = loop.create_task(self._stop_at_end())
            await self._stop.wait()
            stopper.cancel()
        else:
            stopper = loop.create_task(self._stop_at_end())
            await self._open_loop()
            stopper.cancel()
        await self.drain(grace)

    async def _stop_at_end(self) -> None:
        await asyncio.sleep(max(0.0, self.timeline.end - self.clock.monotonic()))
        self.stop("duration")

    async def drain(self, grace: float) -> None:
        pending = set(self._tasks)
        if not pending:
            return
        if grace > 0:
            log.info("draining", in_flight=self.recorder.in_flight, grace_seconds=grace)
            _done, pending = await asyncio.wait(pending, timeout=grace)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
            log.warning("drain_grace_expired", cancelled_units=len(pending))


def _failed(rec: RequestRecord) -> bool:
    return rec.outcome is not Outcome.OK and rec.outcome is not Outcome.CANCELLED

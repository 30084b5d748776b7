"""``load.workers: N`` (N > 1): the load in N worker processes (``soakd.soak.worker``), this process the
parent that owns the windows, sketches, analysis, store and ``/metrics``, as with one.

``WorkerPool`` has the single ``LoadDriver``'s interface (run, stop, cancel_all, pause, resume, wait_idle,
stopping, paused, stop_reason), so the runtime, the quiesce prober and the status board drive either alike.
Each worker sends its requests' records in batches; the pool replays them into the parent's recorder: a started
request is a record here at once (in flight in its window, ``soakd_requests_in_flight``), its progress reaches
the wedge watch every 100 ms, and its finished record replaces it, impaired or not by the worker's own loop.

A window closes only once every worker has reported past its end (``closing_time``: the newest time every
worker has reported), so a request started just before the end is never outside its window. A worker that
exits without saying it is done stops the run (``worker_exited``), its requests in flight recorded as
cancelled; one that stops for a reason of its own (``worker_failed``: a background task of it died) stops the
run with that reason; one silent for ``HANG_AFTER`` seconds is killed (then it exited).
"""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import structlog

from soakd.core.records import Outcome, RequestRecord
from soakd.core.timeline import SYSTEM_CLOCK, Clock, Timeline
from soakd.soak.recorder import Recorder
from soakd.soak.windows import LOST
from soakd.soak.worker import WIRE, frame, read_frame

log = structlog.get_logger("soakd")

START_TIMEOUT = 60.0  # seconds a worker may take to import soakd and answer
HANG_AFTER = 30.0  # seconds past the end and its grace after which a worker still running is killed


@dataclass
class _Worker:
    index: int
    proc: asyncio.subprocess.Process
    reader: asyncio.StreamReader
    proxies: dict[int, RequestRecord] = field(default_factory=dict)  # its requests in flight, here
    seen: float = float("-inf")  # the newest time it reported
    in_flight: int = 0
    paused_gen: int = -1  # the pause it last reported being in (with nothing in flight: idle)
    issued: int = 0
    done: str | None = None  # its stop reason, once it said it is done
    heard: float = 0.0  # when its last frame arrived (this process's clock)
    suspect: float | None = None  # when the watchdog first found it silent
    task: asyncio.Task[None] | None = None


class WorkerPool:
    def __init__(self, count: int, init: dict[str, Any], max_requests: int | None,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        """``init``: what every worker gets (config, scenarios, target, api_key, model, pool_size, grace);
        ``max_requests`` is split among them."""
        self.count = count
        self.init = init
        self.recorder: Recorder = None  # type: ignore[assignment]  # set by start()
        self.max_requests = max_requests
        self.clock = clock
        self.workers: list[_Worker] = []
        self.stop_reason = ""
        self._stop = asyncio.Event()
        self._paused = False
        self._gen = 0
        self._end: float | None = None  # the timeline's end
        self._stopped_at: float | None = None
        self._lost_logged = False

    # ---- start
    async def spawn(self) -> None:
        """Start the worker processes and wait until each has built its client and workload."""
        n = self.count
        for k in range(n):
            share = None
            if self.max_requests is not None:
                share = self.max_requests // n + (1 if k < self.max_requests % n else 0)
            r, w = os.pipe()
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "soakd", "_load-worker", str(w), stdin=asyncio.subprocess.PIPE, pass_fds=(w,),
                start_new_session=True)  # a terminal's Ctrl-C reaches the parent only: it stops them in order
            os.close(w)
            reader = asyncio.StreamReader(limit=1 << 26)
            loop = asyncio.get_running_loop()
            await loop.connect_read_pipe(lambda rd=reader: asyncio.StreamReaderProtocol(rd), os.fdopen(r, "rb"))
            assert proc.stdin is not None
            proc.stdin.write(frame({**self.init, "share": (k, n), "max_requests": share}))
            self.workers.append(_Worker(k, proc, reader))
        for wk in self.workers:
            msg = await asyncio.wait_for(read_frame(wk.reader), START_TIMEOUT)
            if not msg or msg[0] != "ready":
                try:
                    code = await asyncio.wait_for(wk.proc.wait(), 2.0)
                except TimeoutError:
                    code = None
                raise RuntimeError(f"load worker {wk.index} did not start (exit status {code}; its error is on "
                                   "stderr above)")
            wk.heard = self.clock.monotonic()
        log.info("load_workers_started", workers=n, pids=[wk.proc.pid for wk in self.workers])

    def start(self, recorder: Recorder, timeline: Timeline) -> None:
        """Every worker starts its load on the timeline; their records go to ``recorder``."""
        self.recorder = recorder
        self._end = timeline.end
        for wk in self.workers:  # nothing of a window closes before each has reported past its end
            wk.seen = max(wk.seen, timeline.start)
        self._send(("start", (timeline.start, timeline.warmup, timeline.window, timeline.duration,
                              timeline.first_index)))

    # ---- the driver's interface
    @property
    def issued(self) -> int:
        return sum(w.issued for w in self.workers)

    @property
    def stopping(self) -> bool:
        """Told to stop, or the load is over: every worker done, every request of max_requests sent, or the
        timeline's end passed (the workers stop there by themselves)."""
        if self._stop.is_set() or (self.workers and all(w.done is not None for w in self.workers)):
            return True
        if self.max_requests is not None and self.issued >= self.max_requests:
            return True
        return self._end is not None and self.clock.monotonic() >= self._end

    @property
    def paused(self) -> bool:
        return self._paused

    def stop(self, reason: str = "stopped") -> None:
        if not self._stop.is_set():
            self.stop_reason = reason
            self._stopped_at = self.clock.monotonic()
            self._stop.set()
            self._send(("stop", reason))

    def cancel_all(self) -> None:
        self._send(("cancel", self.stop_reason or "stopped"))

    def pause(self) -> None:
        self._paused = True
        self._gen += 1
        self._send(("pause", self._gen))

    def resume(self) -> None:
        self._paused = False
        self._send(("resume",))

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until every worker has reported this pause with nothing in flight, and every request it sent
        has finished here (True), or the timeout passes (False)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not (self.recorder.in_flight <= 0 and all(
                w.done is not None or (w.paused_gen == self._gen and w.in_flight == 0) for w in self.workers)):
            if loop.time() >= deadline or self._stop.is_set():
                return False
            await asyncio.sleep(0.02)
        return True

    def closing_time(self, now: float) -> float:
        """The time up to which windows may close: what every running worker has reported. A worker that reports
        nothing holds them (no request it sent is ever outside its window); one silent for ``HANG_AFTER`` seconds
        is killed by the watchdog, and then holds nothing."""
        seen = [w.seen for w in self.workers if w.done is None]
        return now if not seen else min(now, min(seen))

    async def run(self, grace: float = 30.0) -> None:
        """Read every worker until it is done (or gone); the run's stop reason is the stop's, or the workers'.
        Each worker drains for the grace itself; one still running ``HANG_AFTER`` seconds past its grace (its
        loop stuck) is killed: a worker that exited."""
        for wk in self.workers:
            wk.task = asyncio.ensure_future(self._read(wk))
        watchdog = asyncio.ensure_future(self._watchdog(grace))
        try:
            await asyncio.gather(*(wk.task for wk in self.workers if wk.task is not None))
        finally:
            watchdog.cancel()
            await self.close()
        if not self.stop_reason:
            reasons = {w.done for w in self.workers}
            self.stop_reason = "max_requests" if reasons == {"max_requests"} else \
                next((r for r in reasons if r and r not in ("max_requests", "duration")), "duration")

    async def _watchdog(self, grace: float) -> None:
        """Kill a worker that is hung: silent for ``HANG_AFTER`` seconds (twice in a row, 5 s apart: a parent
        that was itself stopped reads the backlog first), or still running ``HANG_AFTER`` past the end and its
        grace. It is then a worker that exited (the run stops)."""
        while True:
            await asyncio.sleep(1.0)
            now = self.clock.monotonic()
            end = self._stopped_at if self._stopped_at is not None else self._end
            over = end is not None and now > end + grace + HANG_AFTER
            for wk in self.workers:
                if wk.done is not None or wk.proc.returncode is not None:
                    continue
                silent = now - wk.heard > HANG_AFTER
                if silent and wk.suspect is None:
                    wk.suspect = now
                    continue
                if over or (silent and wk.suspect is not None and now - wk.suspect >= 5.0):
                    log.error("load_worker_hung", worker=wk.index, silent_seconds=round(now - wk.heard, 1),
                              action="killed")
                    wk.proc.kill()

    async def close(self) -> None:
        """Every worker process ended (killed when it does not end within 5 s of its stdin closing)."""
        for wk in self.workers:
            if wk.proc.stdin is not None and not wk.proc.stdin.is_closing():
                wk.proc.stdin.close()
        for wk in self.workers:
            try:
                await asyncio.wait_for(wk.proc.wait(), 5.0)
            except TimeoutError:
                wk.proc.kill()
                await wk.proc.wait()

    # ---- what the workers send
    def _send(self, msg: tuple[Any, ...]) -> None:
        data = frame(msg)
        for wk in self.workers:
            if wk.done is None and wk.proc.stdin is not None and not wk.proc.stdin.is_closing():
                wk.proc.stdin.write(data)

    async def _read(self, wk: _Worker) -> None:
        while True:
            msg = await read_frame(wk.reader)
            if msg is None:
                break
            wk.heard, wk.suspect = self.clock.monotonic(), None
            if msg[0] == "b":
                self._apply(wk, msg)
            elif msg[0] == "done":
                wk.done, wk.issued = msg[1] or "duration", msg[2]
                if wk.done not in ("duration", "max_requests"):  # a worker that stopped for its own reason
                    if wk.done == "worker_failed":
                        log.error("load_worker_failed", worker=wk.index, action="the run stops")
                    self.stop(wk.done)  # (a no-op when the run was stopping already)
                return
        # gone without saying it is done: its requests in flight are cancelled, the run stops
        code = await wk.proc.wait()
        wk.done = "worker_exited"
        for rec in list(wk.proxies.values()):
            rec.fail(Outcome.CANCELLED, "worker_exited")
            rec.t_end_ns = rec.t_end_ns or rec.t_start_ns
            self.recorder.finished(rec)
        wk.proxies.clear()
        if not self.stopping:
            log.error("load_worker_exited", worker=wk.index, exit_status=code, action="the run stops")
            self.stop("worker_exited")
        else:  # the load was over: the run keeps its reason
            log.error("load_worker_exited", worker=wk.index, exit_status=code, while_stopping=True)

    def _apply(self, wk: _Worker, msg: tuple[Any, ...]) -> None:
        _, now, events, progress, stalls, late, in_flight, paused_gen, issued = msg
        rec_ = self.recorder
        proxies = wk.proxies
        for e in events:
            if e[0] == "f":
                rec = proxies.pop(e[1])
                for name, v in zip(WIRE, e[2], strict=True):
                    setattr(rec, name, v)
                rec_.finished(rec, e[3])
            else:
                _, n, scenario, endpoint, stream, window, warmup, t_sent, expected, max_tokens = e
                rec = RequestRecord(scenario, endpoint, stream)
                rec.window, rec.warmup, rec.t_sent = window, warmup, t_sent
                rec.expected_prompt_tokens, rec.max_tokens = expected, max_tokens
                proxies[n] = rec
                rec_.started(rec)
                if rec.window == LOST and not self._lost_logged:  # reported after its window was gone
                    self._lost_logged = True
                    log.warning("load_worker_records_lost", worker=wk.index,
                                reason="a worker reported a request that started after its window had closed: "
                                       "counted in the run, in no window (soakd_records_lost_total counts every one)")
        if progress:
            for n, t0, last in progress:
                rec = proxies.get(n)
                if rec is not None:
                    rec.t_start_ns = t0
                    if last:
                        rec.token_times_ns = [last]
        windows = rec_.windows
        windows.flush()  # the batch's finished records, a batch per window
        for a, b, long, lag in stalls:
            windows.charge_stall(a, b, long, lag, wk.index)
        if late:
            rec_.metrics.late_sends.inc((), late)
        wk.seen = max(wk.seen, now)
        wk.in_flight, wk.paused_gen, wk.issued = in_flight, paused_gen, issued

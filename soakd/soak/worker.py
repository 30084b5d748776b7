"""A load worker process (``load.workers`` > 1): ``python -m soakd _load-worker FD``, started by the parent's
``WorkerPool`` (``soakd.soak.workers``). It runs the single process's ``LoadDriver`` with a client and a
workload of its own on the parent's timeline (one ``CLOCK_MONOTONIC`` for every process of the machine, so
its send times and nanosecond stamps are the parent's), its share of the load (``LoadDriver.share``), and
sends what the parent's recorder needs over a pipe of its own, batched every 10 ms:

- ``s``: a request started (its sequence number, scenario, window, send time), so that the parent's window
  holds it in flight and ``/metrics`` shows it;
- ``f``: a request finished: its record (token times and all; not its text) and whether it overlapped a stall
  of this process's own loop beyond the request bound (impaired). Like the parent's window set, it waits for
  its own heartbeat to beat after the request's end before deciding; the parent's stalls never touch it;
- ``p`` (every 100 ms): the in-flight requests' start and newest token, for the parent's wedge watch;
- the stalls of its loop (the windows' client health), its late sends, its in-flight count and whether it
  is paused (the parent's quiesce waits for every worker to be idle).

Its log lines go to the parent's stdout (with ``worker``: its index). Control comes on its stdin: pause, resume, stop (with a reason; then it drains for the grace), cancel (a second
stop signal). Its stdin closing (the parent gone, even by SIGKILL) stops it at once. Terminal signals are the
parent's to act on: SIGINT and SIGTERM are ignored here. Frames both ways are a 4-byte length and a pickle.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import pickle
import struct
import sys
from collections.abc import Callable
from typing import Any

import structlog

from soakd.analysis.window import STALL_LAG
from soakd.core.records import RequestRecord
from soakd.core.timeline import SYSTEM_CLOCK, Timeline
from soakd.soak.selfwatch import frozen_startup_heap
from soakd.soak.windows import LagLedger

log = structlog.get_logger("soakd.worker")

FRAME = struct.Struct("!I")
FLUSH = 0.01  # seconds between two batches
PROGRESS = 0.1  # seconds between two progress reports of the requests in flight
HEARTBEAT = 0.01
BACKLOG = 8 << 20  # bytes of records the parent has not read, past which a worker holds its load
# what the parent copies into its own record of the request (it set window, warmup and the send time at start;
# the text is the worker's: a conversation's next turn)
WIRE = tuple(s for s in RequestRecord.__slots__ if s not in ("scenario", "window", "warmup", "endpoint", "stream",
                                                               "expected_prompt_tokens", "max_tokens", "t_sent",
                                                               "sub", "text"))


def frame(obj: Any) -> bytes:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return FRAME.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next frame; None at the end of the stream."""
    try:
        head = await reader.readexactly(FRAME.size)
        return pickle.loads(await reader.readexactly(FRAME.unpack(head)[0]))
    except asyncio.IncompleteReadError:
        return None


class _Late:
    """The driver's ``metrics.late_sends``: counted here, sent with each batch."""

    def __init__(self) -> None:
        self.count = 0

    def inc(self, _labels: tuple[str, ...]) -> None:
        self.count += 1


class _Metrics:
    def __init__(self) -> None:
        self.late_sends = _Late()


class Forwarder:
    """The recorder a worker's ``LoadDriver`` talks to: it keeps the requests in flight and forwards them."""

    def __init__(self, ledger: LagLedger) -> None:
        self.ledger = ledger
        self.metrics = _Metrics()
        self.in_flight = 0
        self.active: dict[RequestRecord, int] = {}  # in flight -> sequence number
        self._seq = itertools.count()
        self.events: list[tuple[Any, ...]] = []  # the next batch
        self.stalls: list[tuple[float, float, bool, float]] = []
        self._late_sent = 0
        self.pause_gen = -1  # the parent's last pause
        self.parent_paused = False  # the parent holds the load (a quiesce probe)
        self.held = False  # this worker holds its own load: the parent is not reading its records (back-pressure)
        self.parent_gone = False
        self.failed: str | None = None  # a background task of the worker died: why

    def started(self, rec: RequestRecord) -> None:
        n = next(self._seq)
        self.active[rec] = n
        self.in_flight += 1
        rec.t_sent = SYSTEM_CLOCK.monotonic()
        self.events.append(("s", n, rec.scenario, rec.endpoint, rec.stream, rec.window, rec.warmup, rec.t_sent,
                            rec.expected_prompt_tokens, rec.max_tokens))

    def finished(self, rec: RequestRecord) -> None:
        n = self.active.pop(rec)
        self.in_flight -= 1
        start, end = rec.span()
        # decided once this process's heartbeat has beaten after its end (a warm-up request is never judged)
        if rec.warmup or not self.ledger.hold(end, (n, rec, start, end)):
            self._send(n, rec, start, end)

    def _send(self, n: int, rec: RequestRecord, start: float, end: float) -> None:
        self.events.append(("f", n, tuple([getattr(rec, s) for s in WIRE]), self.ledger.impaired(start, end)))

    def release(self, upto: float | None) -> None:
        for n, rec, a, b in self.ledger.due(upto):
            self._send(n, rec, a, b)

    def progress(self) -> list[tuple[int, int, int]]:
        return [(n, r.t_start_ns, r.token_times_ns[-1] if r.token_times_ns else 0)
                for r, n in self.active.items() if r.t_start_ns]

    def batch(self, driver: Any, progress: bool) -> tuple[Any, ...] | None:
        """The next batch, or None when there is nothing to say (with ``progress``, every 100 ms, one is always
        sent: the parent closes a window once every worker has reported past its end)."""
        late = self.metrics.late_sends.count - self._late_sent
        if not (self.events or self.stalls or late or progress):
            return None
        self._late_sent += late
        out = ("b", SYSTEM_CLOCK.monotonic(), self.events, self.progress() if progress else None, self.stalls, late,
               self.in_flight, self.pause_gen if self.parent_paused else -1, driver.issued)
        self.events, self.stalls = [], []
        return out


async def _heartbeat(fwd: Forwarder) -> None:
    """This process's loop lag, 100 times a second: its stalls impair its own requests."""
    loop = asyncio.get_running_loop()
    ledger = fwd.ledger
    while True:
        before = loop.time()
        await asyncio.sleep(HEARTBEAT)
        now = loop.time()
        lag = max(0.0, now - before - HEARTBEAT)
        span = ledger.beat(now, lag)
        if span is not None and (span[2] or lag > STALL_LAG):
            fwd.stalls.append((*span, lag))
        fwd.release(now)


async def _flusher(fwd: Forwarder, driver: Any, out: asyncio.StreamWriter) -> None:
    next_progress = 0.0
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(FLUSH)
        now = loop.time()
        due = now >= next_progress
        if due:
            next_progress = now + PROGRESS
        b = fwd.batch(driver, due)
        if b is not None:
            await send(fwd, driver, out, frame(b))


async def send(fwd: Forwarder, driver: Any, out: asyncio.StreamWriter, data: bytes) -> None:
    """One frame to the parent. While the parent does not read (stopped, starved), the pipe and then this
    worker's buffer fill: past ``BACKLOG`` bytes the worker holds its load (as a quiesce pause does: requests in
    flight finish) until the parent has read it, so that neither its memory nor its unreported requests grow
    without bound; logged once each way."""
    out.write(data)
    if out.transport.get_write_buffer_size() <= BACKLOG:
        return
    if not fwd.held:
        fwd.held = True
        driver.pause()
        log.warning("load_worker_held", backlog_bytes=out.transport.get_write_buffer_size(),
                    reason="soakd's parent process is not reading this worker's records; its load waits for it")
    try:
        await out.drain()
    finally:
        fwd.held = False
        if not fwd.parent_paused:
            driver.resume()
        log.info("load_worker_released")


async def _control(reader: asyncio.StreamReader, driver: Any, fwd: Forwarder) -> None:
    while True:
        msg = await read_frame(reader)
        if msg is None:  # the parent is gone: stop now
            fwd.parent_gone = True
            driver.stop("parent_gone")
            driver.cancel_all()
            return
        kind = msg[0]
        if kind == "pause":
            fwd.pause_gen, fwd.parent_paused = msg[1], True
            driver.pause()
        elif kind == "resume":
            fwd.parent_paused = False
            if not fwd.held:
                driver.resume()
        elif kind == "stop":
            driver.stop(msg[1])
        elif kind == "cancel":
            driver.stop(msg[1] if len(msg) > 1 else "stopped")
            driver.cancel_all()


def supervise(task: asyncio.Task[None], name: str, fwd: Forwarder, driver: Any) -> None:
    """A background task of the worker that ends with an error stops its load at once: the worker then tells
    the parent (``done`` with ``worker_failed``), which stops the run, instead of loading the server unseen."""
    def done(t: asyncio.Task[None]) -> None:
        if t.cancelled() or t.exception() is None or fwd.parent_gone:
            return
        if isinstance(t.exception(), BrokenPipeError | ConnectionResetError):  # the parent closed the pipe: gone
            fwd.parent_gone = True
            driver.stop("parent_gone")
            driver.cancel_all()
            return
        fwd.failed = f"{name}: {t.exception()!r}"
        log.error("load_worker_failed", task=name, error=repr(t.exception()))
        driver.stop("worker_failed")
        driver.cancel_all()

    task.add_done_callback(done)


async def run_worker(reader: asyncio.StreamReader, out: asyncio.StreamWriter,
                     on_init: Callable[[Any, int], None]) -> None:
    from soakd.client.openai import OpenAIClient
    from soakd.soak.driver import LoadDriver
    from soakd.workload.workload import Workload

    init = await read_frame(reader)
    if init is None:
        return
    cfg = init["config"]
    k, n = init["share"]
    on_init(cfg, k)
    cc = cfg.analysis.client
    fwd = Forwarder(LagLedger(cc.request_max_lag, cc.request_lag_relative))
    client = OpenAIClient(init["target"], init["api_key"], pool_size=init["pool_size"])
    workload = Workload(init["scenarios"], cfg.load.mix, init["model"], cfg.run.seed, share=(k, n))
    out.write(frame(("ready", os.getpid())))
    await out.drain()
    start = await read_frame(reader)  # the parent's timeline, once the run's load starts
    if start is None or start[0] != "start":
        await client.close()
        return
    driver = LoadDriver(cfg.load, client, workload, fwd, Timeline(*start[1]),  # type: ignore[arg-type]
                        max_requests=init["max_requests"], seed=cfg.run.seed, share=(k, n))
    tasks = {"heartbeat": _heartbeat(fwd), "flusher": _flusher(fwd, driver, out),
             "control": _control(reader, driver, fwd)}
    running = []
    for name, coro in tasks.items():
        task = asyncio.ensure_future(coro)
        supervise(task, name, fwd, driver)
        running.append(task)
    try:
        with frozen_startup_heap():  # as in the parent (soakd.soak.selfwatch)
            await driver.run(grace=init["grace"])
    finally:
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        await client.close()
    if fwd.parent_gone:  # nobody to tell
        return
    fwd.release(None)
    b = fwd.batch(driver, False)
    if b is not None:
        out.write(frame(b))
    out.write(frame(("done", "worker_failed" if fwd.failed else driver.stop_reason, driver.issued)))
    out.transport.set_write_buffer_limits(high=0)  # drain() now waits until every byte is in the pipe: the
    await out.drain()  # process ends after this, and a transport's buffer would end with it


async def serve(frames_fd: int, on_init: Callable[[Any, int], None] = lambda _cfg, _k: None) -> None:
    """The worker: control frames on stdin, its frames out on file descriptor ``frames_fd``; ``on_init`` is
    called with the run's configuration and the worker's index once they are known (its logging)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin,
                                                        os.fdopen(frames_fd, "wb", buffering=0))
    out = asyncio.StreamWriter(transport, protocol, None, loop)
    try:
        await run_worker(reader, out, on_init)
    finally:
        transport.close()

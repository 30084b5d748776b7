"""structlog's production recipe: JSON lines to stdout (console renderer on a TTY), contextvars,
ISO UTC timestamps; aiohttp's and APScheduler's stdlib logs rendered the same way.

Lines are rendered where they are logged and written by one thread (``LogWriter``): a log call
never blocks the event loop and never raises. stdout is whatever the container runtime or the
shell gave soakd, and it can stall (a log driver that stops reading, a terminal paused with
Ctrl-S) or break (``| head``, a log shipper gone). A stalled stdout fills a bounded queue, and
lines past it are dropped and counted (``soakd_log_dropped_total``, one warning once it drains);
a broken one is said once on stderr and the run goes on, its reports written.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import select
import sys
import threading
from typing import Any, TextIO

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def use_console(fmt: str) -> bool:
    return fmt == "console" or (fmt == "auto" and sys.stdout.isatty())


def _ms(q: object, key: str) -> str | None:
    v = q.get(key) if isinstance(q, dict) else None
    return None if v is None else f"{v * 1000:.1f}ms"


def _console_window(_logger: object, _name: str, event: dict) -> dict:
    """On a terminal, ``window_closed`` in a few numbers; the JSON lines carry the whole summary."""
    if event.get("event") != "window_closed":
        return event
    out = {k: event[k] for k in ("event", "level", "timestamp", "window", "partial", "requests", "error_rate")
           if k in event}
    out.update(req_s=round(event.get("requests_per_second") or 0.0, 2),
               tok_s=round(event.get("output_tokens_per_second") or 0.0, 1),
               e2e_p50=_ms(event.get("e2e_seconds"), "p50"), e2e_p95=_ms(event.get("e2e_seconds"), "p95"),
               ttft_p95=_ms(event.get("ttft_seconds"), "p95"), itl_p95=_ms(event.get("itl_seconds"), "p95"))
    if event.get("drift"):
        out["drift"] = event["drift"]
    return out


QUEUE_LINES = 10_000  # lines a stalled stdout may hold back before they are dropped (a few MB at most)
EXIT_DRAIN_SECONDS = 5.0  # at exit, how long the queued lines may take to reach a slow stdout


_STOP = threading.Event()  # put by close(): the thread ends


class LogWriter:
    """One daemon thread writing rendered lines to a stream; ``put`` never blocks.

    Where the stream has a file descriptor the thread writes with ``os.write`` (no Python lock
    is held while a stalled pipe blocks, so the interpreter can still exit); otherwise (a test's
    captured stdout) with the stream's own ``write``."""

    def __init__(self, stream: TextIO, maxsize: int = QUEUE_LINES) -> None:
        self.stream = stream
        self._queue: queue.Queue[str | threading.Event] = queue.Queue(maxsize)
        self._lock = threading.Lock()
        self.dropped = 0  # lines dropped: the queue was full, or the stream is gone
        self._unreported = 0  # dropped since the last warning
        self.warned = False
        self.broken: str | None = None  # why the stream is gone
        try:
            self._fd: int | None = stream.fileno()
        except (AttributeError, OSError, ValueError):
            self._fd = None
        self._thread = threading.Thread(target=self._run, name="soakd-log-writer", daemon=True)
        self._thread.start()

    # ---- callers (any thread)
    def put(self, line: str) -> None:
        if self.broken is None:
            try:
                self._queue.put_nowait(line)
                return
            except queue.Full:
                pass
        with self._lock:
            self.dropped += 1
            self._unreported += 1

    def close(self, timeout: float = 1.0) -> None:
        """Write what is queued (up to ``timeout`` seconds) and end the thread."""
        self.drain(timeout)
        try:
            self._queue.put_nowait(_STOP)
        except queue.Full:
            pass

    def drain(self, timeout: float) -> bool:
        """Wait until every queued line is written (or ``timeout`` seconds): True when it was."""
        done = threading.Event()  # a marker: the thread sets it once everything before it is written
        try:
            self._queue.put(done, timeout=max(timeout, 0.0))
        except queue.Full:
            return False
        return done.wait(timeout)

    # ---- the thread
    def _run(self) -> None:
        get = self._queue.get
        while True:
            item = get()
            batch: list[str] = []
            markers: list[threading.Event] = []
            while True:
                if isinstance(item, str):
                    batch.append(item)
                else:
                    markers.append(item)
                if len(batch) >= 256 or item is _STOP:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch and (self.broken is not None or not self._write("".join(line + "\n" for line in batch))):
                with self._lock:
                    self.dropped += len(batch)
            for marker in markers:
                if marker is _STOP:
                    return
                marker.set()
            if self._unreported and not self.warned and self.broken is None and self._queue.empty():
                self._warn()

    def _write(self, text: str) -> bool:
        try:
            if self._fd is None:
                self.stream.write(text)
                self.stream.flush()
                return True
            view = memoryview(text.encode("utf-8", "replace"))
            while view:
                try:
                    view = view[os.write(self._fd, view):]
                except BlockingIOError:  # a non-blocking stdout (shared with another process): wait for room
                    select.select([], [self._fd], [], 1.0)
            return True
        except (OSError, ValueError) as exc:  # EPIPE, EBADF, a closed stream
            self._gone(exc)
            return False

    def _gone(self, exc: BaseException) -> None:
        self.broken = f"{type(exc).__name__}: {exc}"
        try:
            sys.__stderr__.write(f"soakd: stdout is gone ({self.broken}); log lines are dropped from now on "
                                 "(soakd_log_dropped_total), the run goes on\n")
            sys.__stderr__.flush()
        except (AttributeError, OSError, ValueError):
            pass
        if self._fd is not None:
            # the interpreter flushes sys.stdout at exit: a broken pipe there would turn a finished run
            # into exit 120; /dev/null takes its place
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, self._fd)
                os.close(devnull)
            except OSError:
                pass

    def _warn(self) -> None:
        with self._lock:
            n, self._unreported = self._unreported, 0
        self.warned = True
        fields = {"dropped": n, "queue_lines": self._queue.maxsize,
                  "hint": "stdout did not take log lines as fast as soakd wrote them (a stalled log driver or "
                          "terminal); later drops are counted in soakd_log_dropped_total only"}
        if _writer is self:  # rendered like every other line
            structlog.get_logger("soakd.log").warning("log_lines_dropped", **fields)
        else:
            self.put(json.dumps({"event": "log_lines_dropped", "level": "warning", **fields}))


_writer: LogWriter | None = None
_dropped_before = 0  # dropped by the writers that came before this one (configure() called again)


def writer() -> LogWriter | None:
    return _writer


def dropped() -> int:
    """Log lines dropped in this process (``soakd_log_dropped_total``)."""
    return _dropped_before + (_writer.dropped if _writer is not None else 0)


def drain(timeout: float = EXIT_DRAIN_SECONDS) -> bool:
    """Wait for the queued log lines to be written (before a summary is printed, and at exit)."""
    return _writer.drain(timeout) if _writer is not None else True


atexit.register(drain)


def _writer_for(stream: TextIO) -> LogWriter:
    global _writer, _dropped_before
    if _writer is None or _writer.stream is not stream:
        if _writer is not None:
            _writer.close(1.0)
            _dropped_before += _writer.dropped
        _writer = LogWriter(stream)
    return _writer


class QueuedLogger:
    """structlog's logger interface (``PrintLogger``'s methods) over the ``LogWriter``."""

    def __init__(self, out: LogWriter) -> None:
        self._out = out

    def msg(self, message: str) -> None:
        self._out.put(message)

    log = debug = info = warn = warning = err = error = critical = exception = fatal = failure = msg


class QueuedHandler(logging.Handler):
    """stdlib records (aiohttp, APScheduler) formatted in the caller, written by the ``LogWriter``."""

    def __init__(self, out: LogWriter) -> None:
        super().__init__()
        self._out = out

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._out.put(self.format(record))
        except Exception:  # noqa: BLE001 - logging never raises into the caller
            self.handleError(record)


def configure(fmt: str = "auto", level: str = "info") -> None:
    lvl = _LEVELS.get(level, logging.INFO)
    console = use_console(fmt)
    out = _writer_for(sys.stdout)
    logger = QueuedLogger(out)
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = (
        structlog.dev.ConsoleRenderer(colors=sys.stdout.isatty())
        if console
        else structlog.processors.JSONRenderer(sort_keys=False)
    )
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info if not console else structlog.processors.ExceptionPrettyPrinter(),
            structlog.processors.UnicodeDecoder(),
            renderer,
        ]
        if not console
        else [*shared, _console_window, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=lambda *_args: logger,
        cache_logger_on_first_use=False,
    )
    # stdlib loggers (aiohttp, apscheduler) through the same renderer
    handler = QueuedHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(lvl, logging.WARNING))
    for noisy in ("aiohttp.access", "apscheduler.executors.default"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # skipped and missed runs are counted and logged by soakd's own scheduler listener
    logging.getLogger("apscheduler.scheduler").setLevel(logging.ERROR)

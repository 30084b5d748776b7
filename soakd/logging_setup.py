"""structlog's production recipe: JSON lines to stdout (console renderer on a TTY), contextvars,
ISO UTC timestamps; aiohttp's and APScheduler's stdlib logs rendered the same way.

Lines are rendered and written where they are logged, without waiting (``LogWriter``): a log call
never blocks the event loop and never raises; a writer thread takes over only while stdout is slow. stdout is whatever the container runtime or the
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
import socket
import stat
import sys
import threading
import time
from typing import Any, TextIO

import structlog

from soakd.terminal import StatusLine

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


class _Sink:
    """Where the lines go, written two ways: ``try_write`` from the logging thread, never blocking
    (what did not fit comes back), and ``write`` from the writer thread, waiting for room.

    A pipe or a terminal is opened a second time through ``/proc/self/fd`` with ``O_NONBLOCK``: a new
    open file description, so that the flag is soakd's own and not that of the shell or the container
    runtime that shares stdout. A socket (systemd's journal) is sent to with ``MSG_DONTWAIT``. A regular
    file or ``/dev/null`` is written directly (a write there does not wait on a reader). Where none of
    this works, every line goes through the writer thread."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.fd: int | None = None
        self.tty = False
        self.kind = "stream"  # stream (no descriptor: a test's capture), file, nonblocking, socket, thread
        self._nb: int | None = None
        self._sock: socket.socket | None = None
        try:
            self.fd = stream.fileno()
        except (AttributeError, OSError, ValueError):
            return
        try:
            mode = os.fstat(self.fd).st_mode
        except OSError:
            self.kind = "thread"
            return
        self.tty = os.isatty(self.fd)
        if stat.S_ISREG(mode) or (stat.S_ISCHR(mode) and not self.tty):
            self.kind = "file"
        elif stat.S_ISSOCK(mode):
            try:
                self._sock = socket.socket(fileno=os.dup(self.fd))
                self.kind = "socket"
            except OSError:
                self.kind = "thread"
        else:  # a pipe (FIFO), a terminal
            try:
                self._nb = os.open(f"/proc/self/fd/{self.fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
                self.kind = "nonblocking"
            except OSError:
                self.kind = "thread"

    def try_write(self, data: str) -> str | bytes | None:
        """Write what fits now; the rest (None: all written). Raises OSError (EPIPE...), ValueError."""
        if self.kind == "stream":
            self.stream.write(data)
            self.stream.flush()
            return None
        if self.kind == "thread":
            return data
        view = memoryview(data.encode("utf-8", "replace"))
        try:
            while view:
                if self.kind == "file":
                    view = view[os.write(self.fd, view):]  # type: ignore[arg-type]
                elif self.kind == "socket":
                    view = view[self._sock.send(view, socket.MSG_DONTWAIT):]  # type: ignore[union-attr]
                else:
                    view = view[os.write(self._nb, view):]  # type: ignore[arg-type]
        except BlockingIOError:
            return bytes(view)
        return None

    def write(self, data: str | bytes) -> None:
        """Write it all, waiting for room (the writer thread). Raises OSError, ValueError."""
        if self.kind == "stream":
            self.stream.write(data if isinstance(data, str) else data.decode("utf-8", "replace"))
            self.stream.flush()
            return
        view = memoryview(data.encode("utf-8", "replace") if isinstance(data, str) else data)
        while view:
            if self.kind == "socket":
                self._sock.sendall(view)  # type: ignore[union-attr]
                return
            fd = self._nb if self.kind == "nonblocking" else self.fd
            try:
                view = view[os.write(fd, view):]  # type: ignore[arg-type]
            except BlockingIOError:  # the reader is behind (or a non-blocking stdout): wait for room
                select.select([], [fd], [], 1.0)

    def gone(self) -> None:
        """The reader is gone: stdout becomes /dev/null (the interpreter flushes sys.stdout at exit:
        a broken pipe there would turn a finished run into exit 120)."""
        for closer in (lambda: self._sock.detach() if self._sock else None,
                       lambda: os.close(self._nb) if self._nb is not None else None):
            try:
                closer()
            except OSError:
                pass
        self._nb, self._sock = None, None
        if self.fd is not None:
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, self.fd)
                os.close(devnull)
            except OSError:
                pass

    def close(self) -> None:
        if self._nb is not None:
            try:
                os.close(self._nb)
            except OSError:
                pass
            self._nb = None
        if self._sock is not None:
            self._sock.detach()
            self._sock = None


class LogWriter:
    """Rendered lines to a stream; ``put`` never blocks and never raises.

    The logging thread writes each line itself, without waiting (``_Sink.try_write``): the common
    case costs one system call and involves no other thread (a writer thread woken per line would
    make the event loop wait for the GIL on a busy machine). When stdout does not take a line whole,
    the rest and every later line go to a bounded queue that a daemon thread writes, waiting for
    room; while that backlog lasts, lines past the queue are dropped and counted, and one warning
    says how many once it drained. A broken stdout is said once on stderr and lines are dropped."""

    def __init__(self, stream: TextIO, maxsize: int = QUEUE_LINES) -> None:
        self.stream = stream
        self.sink = _Sink(stream)
        self._queue: queue.Queue[str | bytes | threading.Event] = queue.Queue(maxsize)
        self._lock = threading.Lock()
        self._backlog = False  # lines are queued: later lines queue behind them (order)
        self.dropped = 0  # lines dropped: the queue was full, or the stream is gone
        self._unreported = 0  # dropped since the last warning
        self.warned = False
        self.broken: str | None = None  # why the stream is gone
        self._thread = threading.Thread(target=self._run, name="soakd-log-writer", daemon=True)
        self._thread.start()

    # ---- callers (any thread)
    def put(self, line: str) -> None:
        status = _status if self.sink.tty and _status is not None and _status.shown else None
        if status is not None:  # a log line on the terminal: above the progress line, never glued to it
            status.clear()
        try:
            self._put(line)
        finally:
            if status is not None:
                status.redraw()

    def _put(self, line: str) -> None:
        data: str | bytes = line + "\n"
        with self._lock:
            if self.broken is None:
                if not self._backlog:
                    try:
                        rest = self.sink.try_write(data)  # type: ignore[arg-type]
                    except (OSError, ValueError) as exc:  # EPIPE, EBADF, a closed stream
                        self._gone(exc)
                        rest = None
                        self._drop(1)
                    if rest is None:
                        return
                    self._backlog, data = True, rest
                try:
                    self._queue.put_nowait(data)
                    return
                except queue.Full:
                    pass
            self._drop(1)

    def _drop(self, n: int) -> None:
        self.dropped += n
        self._unreported += n

    def close(self, timeout: float = 1.0) -> None:
        """Write what is queued (up to ``timeout`` seconds) and end the thread. The sink's descriptor is
        closed only once the thread has ended: closed under a write it would fail (or, its number reused
        by the next open, land the line in some other file)."""
        drained = self.drain(timeout)
        try:
            self._queue.put_nowait(_STOP)
        except queue.Full:
            pass
        self._thread.join(0.5 if drained else 0.0)
        if not self._thread.is_alive():
            self.sink.close()

    def drain(self, timeout: float) -> bool:
        """Wait until every queued line is written (or ``timeout`` seconds): True when it was."""
        deadline = time.monotonic() + max(timeout, 0.0)
        done = threading.Event()  # a marker: the thread sets it once everything before it is written
        while True:
            with self._lock:
                if not self._backlog or self.broken is not None:
                    return True
                try:
                    self._queue.put_nowait(done)
                    break
                except queue.Full:
                    pass
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return done.wait(max(0.0, deadline - time.monotonic()))

    # ---- the thread
    def _run(self) -> None:
        get = self._queue.get
        while True:
            item = get()
            if isinstance(item, threading.Event):
                if item is _STOP:
                    return
                item.set()
            elif self.broken is not None:
                with self._lock:
                    self._drop(1)
            else:
                try:
                    self.sink.write(item)
                except (OSError, ValueError) as exc:
                    with self._lock:
                        self._gone(exc)
                        self._drop(1)
            with self._lock:
                if self._backlog and self._queue.empty():
                    self._backlog = False
                warn = self._unreported and not self.warned and not self._backlog and self.broken is None
            if warn:
                self._warn()

    def _gone(self, exc: BaseException) -> None:
        if self.broken is not None:
            return
        self.broken = f"{type(exc).__name__}: {exc}"
        try:
            sys.__stderr__.write(f"soakd: stdout is gone ({self.broken}); log lines are dropped from now on "
                                 "(soakd_log_dropped_total), the run goes on\n")
            sys.__stderr__.flush()
        except (AttributeError, OSError, ValueError):
            pass
        self.sink.gone()

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


_status: StatusLine | None = None


def status_line() -> StatusLine:
    """The terminal's progress line (inactive where stderr is no terminal)."""
    global _status
    if _status is None:
        _status = StatusLine(sys.stderr)
    return _status


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

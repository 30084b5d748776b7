"""The log writer (soakd.logging_setup.LogWriter): a log call never blocks and never raises,
whatever stdout does. A pipe nobody reads holds lines back until the queue is full, then lines
are dropped and counted, with one warning once it drains; a pipe whose reader is gone is said
once on stderr and the caller goes on."""

from __future__ import annotations

import fcntl
import io
import json
import os
import threading

import pytest
import structlog

from soakd import logging_setup
from soakd.logging_setup import LogWriter

F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


def _small_pipe() -> tuple[int, int]:
    r, w = os.pipe()
    fcntl.fcntl(w, F_SETPIPE_SZ, 4096)
    return r, w


def _read_all(fd: int) -> bytes:
    os.set_blocking(fd, False)
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return out
        if not chunk:
            return out
        out += chunk


def test_a_pipe_nobody_reads_drops_and_counts_instead_of_blocking() -> None:
    r, w = _small_pipe()
    stream = os.fdopen(w, "w")
    out = LogWriter(stream, maxsize=50)
    done = threading.Event()

    def flood() -> None:
        for i in range(2000):
            out.put(json.dumps({"event": "line", "i": i, "pad": "x" * 200}))
        done.set()

    t = threading.Thread(target=flood, daemon=True)
    t.start()
    # put() never waits for the pipe: the 2000 calls return while nothing reads it (a blocked call
    # would leave the thread stuck here for good, not merely slow)
    assert done.wait(60), "LogWriter.put blocked on a pipe nobody reads"
    # 4 KiB of pipe and 50 queued lines hold at most ~70 of the 2000 lines: the rest were dropped
    assert out.dropped >= 2000 - 50 - 4096 // 200 - 256 - 1
    dropped_while_stalled = out.dropped
    # the reader comes back: what was held is written, then one warning says how many were lost
    data = b""
    for _ in range(200):
        data += _read_all(r)
        if b"log_lines_dropped" in data:
            break
        threading.Event().wait(0.05)
    lines = [json.loads(x) for x in data.decode().splitlines() if x.startswith("{")]
    warnings = [x for x in lines if x.get("event") == "log_lines_dropped"]
    assert len(warnings) == 1, data[-500:]
    assert warnings[0]["dropped"] == dropped_while_stalled
    held = [x["i"] for x in lines if x.get("event") == "line"]
    assert held == sorted(held) and held[0] == 0  # the first lines, in order, none torn
    # a second stall is counted, not warned again
    for i in range(500):
        out.put(json.dumps({"event": "again", "i": i, "pad": "y" * 200}))
    assert out.dropped > dropped_while_stalled
    assert out.drain(0.2) is False  # nothing reads the pipe: drain gives up after its timeout
    rest = b""
    for _ in range(400):  # read until the writer holds nothing more (it waits for room in the pipe)
        rest += _read_all(r)
        if b"again" in rest and out.drain(0.05):
            break
    assert b"again" in rest and out.drain(5)  # (drain can see the backlog flag a moment before the thread clears it)
    assert b"log_lines_dropped" not in rest
    # the writer's thread ends before the pipe does: a thread left writing into this pipe after its
    # reader is closed would say "stdout is gone" on stderr during whatever test runs next
    out.close()
    stream.close()
    os.close(r)


def test_a_broken_pipe_is_said_once_on_stderr_and_the_caller_goes_on(capfd: pytest.CaptureFixture[str]) -> None:
    r, w = os.pipe()
    spare = os.dup(1)  # the writer points a broken stdout at /dev/null: keep this process's fd 1 out of it
    stream = os.fdopen(w, "w")
    os.close(r)
    out = LogWriter(stream)
    try:
        for i in range(100):
            out.put(f"line {i}")  # never raises
        out.drain(10)
        for i in range(100):
            out.put(f"after {i}")
        out.drain(10)
        assert out.broken is not None and "Broken pipe" in out.broken
        assert out.dropped == 200
        err = capfd.readouterr().err
        assert err.count("stdout is gone") == 1 and "the run goes on" in err
        # the descriptor now points at /dev/null: the interpreter's flush at exit cannot fail
        os.write(w, b"ignored\n")
    finally:
        stream.close()
        os.dup2(spare, 1)
        os.close(spare)


def test_a_stream_without_a_descriptor_is_written_in_order() -> None:
    buf = io.StringIO()
    out = LogWriter(buf)
    for i in range(1000):
        out.put(str(i))
    assert out.drain(10)
    assert buf.getvalue().split() == [str(i) for i in range(1000)]
    assert out.dropped == 0
    out.close()


def test_configure_routes_structlog_and_stdlib_through_the_writer(monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    buf = io.StringIO()
    monkeypatch.setattr("sys.stdout", buf)
    logging_setup.configure("json", "info")
    structlog.get_logger("t").info("hello", n=1)
    logging.getLogger("aiohttp.server").error("from stdlib")
    assert logging_setup.drain(10)
    lines = [json.loads(x) for x in buf.getvalue().splitlines()]
    assert lines[0]["event"] == "hello" and lines[0]["n"] == 1 and lines[0]["level"] == "info"
    assert lines[1]["event"] == "from stdlib" and lines[1]["level"] == "error"
    before = logging_setup.dropped()
    w = logging_setup.writer()
    assert w is not None and w.stream is buf
    # a second configure (another command in the same process) keeps the count
    monkeypatch.setattr("sys.stdout", io.StringIO())
    logging_setup.configure("json", "info")
    assert logging_setup.writer() is not w and logging_setup.dropped() == before


def test_the_status_line_keeps_the_parts_that_fit_in_order() -> None:
    from soakd.terminal import StatusLine

    parts = ["00:01:00/12:00:00   0% ETA 11:59:00", "window 3", "TARGET DOWN", "errors 1.20%", "12.0 req/s 900 tok/s"]
    assert StatusLine.fit(parts, 200) == " | ".join(parts)
    line = StatusLine.fit(parts, 62)
    assert line == "00:01:00/12:00:00   0% ETA 11:59:00 | window 3 | TARGET DOWN" and len(line) <= 61
    assert StatusLine.fit(parts, 20) == parts[0][:19]  # the first part always, cut
    assert not StatusLine(io.StringIO()).active  # no terminal: nothing is drawn

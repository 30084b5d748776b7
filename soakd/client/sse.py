"""Incremental Server-Sent Events decoder (WHATWG event-stream rules), no I/O.

Feed it bytes exactly as they come off the socket, split anywhere; it returns the complete
events. Lines may end in ``\\n``, ``\\r\\n`` or ``\\r``; a ``\\r`` at the end of a chunk is held
back until the next chunk shows whether a ``\\n`` follows. Comment lines (``:``) are skipped.
Event data stays bytes (multi-byte UTF-8 characters may straddle chunks); decoding is the
caller's business, so that invalid UTF-8 is reported rather than silently replaced.
"""

from __future__ import annotations

from typing import NamedTuple


class SSEEvent(NamedTuple):
    data: bytes
    event: str = ""
    id: str = ""


class SSETooLarge(ValueError):
    """A line, or an event's data, longer than the decoder's limit: the response is too large to
    be a chunk of a completion (a server that streams garbage, or a proxy's error page without
    line breaks); the client classifies it ``response_too_large``."""


class SSEDecoder:
    __slots__ = ("_buf", "_data", "_data_bytes", "_event", "_id", "max_event_bytes")

    def __init__(self, max_event_bytes: int = 16 * 1024 * 1024) -> None:
        self._buf = b""
        self._data: list[bytes] = []
        self._data_bytes = 0
        self._event = ""
        self._id = ""
        self.max_event_bytes = max_event_bytes

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        buf = self._buf + chunk if self._buf else chunk
        hold = b""
        if buf.endswith(b"\r"):
            buf, hold = buf[:-1], b"\r"
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = buf.split(b"\n")
        rest = lines.pop()
        if len(buf) > self.max_event_bytes and max(len(rest), max(map(len, lines), default=0)) > self.max_event_bytes:
            raise SSETooLarge(f"an SSE line longer than {self.max_event_bytes} bytes")
        self._buf = rest + hold
        events: list[SSEEvent] = []
        for line in lines:
            if not line:
                if self._data:
                    events.append(self._dispatch())
                else:  # no data: nothing is dispatched (WHATWG), the event type is reset
                    self._event = ""
                continue
            if line[0] == 58:  # ':' comment / keep-alive
                continue
            name, sep, value = line.partition(b":")
            if sep and value[:1] == b" ":
                value = value[1:]
            if name == b"data":
                self._data.append(value)
                self._data_bytes += len(value) + 1
                if self._data_bytes > self.max_event_bytes:
                    raise SSETooLarge(f"an SSE event's data longer than {self.max_event_bytes} bytes")
            elif name == b"event":
                self._event = value.decode("utf-8", "replace")
            elif name == b"id":
                self._id = value.decode("utf-8", "replace")
            # "retry" and unknown fields are ignored, as the spec says
        return events

    def feed_data(self, chunk: bytes) -> list[bytes]:
        """``feed``, returning only each event's data (the streaming client's hot path).

        A chunk of whole single-line ``data:`` events separated by blank lines, with no carried
        state and no ``\r`` (what OpenAI-compatible servers send) is split at its blank lines
        directly; every other block, and any incomplete tail, goes through ``feed``. The result
        is the data of the events ``feed`` would return, in the same order."""
        if self._buf or self._data or self._event or b"\r" in chunk or len(chunk) > self.max_event_bytes:
            return [ev.data for ev in self.feed(chunk)]
        if chunk.startswith(b"data: ") and chunk.endswith(b"\n\n"):
            # "data: <p1>\n\ndata: <p2>\n\n...": split once; the newline count proves that no
            # payload holds a line break of its own (each event is exactly one data line)
            parts = chunk[6:-2].split(b"\n\ndata: ")
            if chunk.count(b"\n") == 2 * len(parts):
                return parts
        blocks = chunk.split(b"\n\n")
        rest = blocks.pop()
        out: list[bytes] = []
        for block in blocks:
            # between two blank lines with nothing carried: one event's lines
            if block.startswith(b"data: ") and b"\n" not in block:
                out.append(block[6:])
            else:  # several fields, comments, empty: the full rules (the blank line ends it)
                out.extend([ev.data for ev in self.feed(block + b"\n\n")])
        if rest:
            out.extend([ev.data for ev in self.feed(rest)])
        return out

    def _dispatch(self) -> SSEEvent:
        data = self._data[0] if len(self._data) == 1 else b"\n".join(self._data)
        ev = SSEEvent(data, self._event, self._id)
        self._data = []
        self._data_bytes = 0
        self._event = ""
        return ev

    def close(self) -> list[SSEEvent]:
        """End of stream: a final event without its blank line is dispatched, as browsers do not;
        we return it so that callers can tell 'unterminated last event' from 'nothing'."""
        events: list[SSEEvent] = []
        if self._buf.strip(b"\r"):
            events.extend(self.feed(b"\n"))
        if self._data:
            events.append(self._dispatch())
        self._buf = b""
        return events

    @property
    def pending(self) -> bool:
        return bool(self._buf or self._data)

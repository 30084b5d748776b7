"""The live progress line of a terminal (``StatusLine``): what ``soakd run``, ``demo`` and ``batch``
show at the bottom of the terminal while log lines scroll above it."""

from __future__ import annotations

import os
from typing import TextIO

__all__ = ["StatusLine"]


class StatusLine:
    """The live progress line at the bottom of a terminal (stderr): fitted to the terminal's width
    (read at each draw: a resized window is followed), cleared while a log line is written to the
    same terminal and drawn again below it, so that log lines start on their own line. Nothing is
    drawn where stderr is no terminal (a file, a pipe, a log driver). Written without waiting (a
    terminal paused with Ctrl-S drops the updates, never the run)."""

    def __init__(self, stream: TextIO) -> None:
        self.parts: list[str] = []
        self.shown = False
        self.fd: int | None = None
        self._out: int | None = None
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError):
            return
        if not os.isatty(fd):
            return
        self.fd = fd
        try:
            self._out = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError:
            self._out = None

    @property
    def active(self) -> bool:
        return self.fd is not None

    def width(self) -> int:
        try:
            return os.get_terminal_size(self.fd if self.fd is not None else 2).columns
        except OSError:
            return 80

    @staticmethod
    def fit(parts: list[str], width: int) -> str:
        """The parts, in order, joined by " | ", as many as fit in ``width - 1`` columns (the last
        column stays free: a line that fills it wraps on some terminals); the first always (cut)."""
        out = ""
        for i, part in enumerate(parts):
            cand = part if not out else f"{out} | {part}"
            if len(cand) <= width - 1:
                out = cand
            elif i == 0:
                out = part[: max(0, width - 1)]
        return out

    def show(self, parts: list[str]) -> None:
        self.parts = parts
        self._draw()

    def _draw(self) -> None:
        if self.fd is None or not self.parts:
            return
        self._write("\r" + self.fit(self.parts, self.width()) + "\x1b[K")
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self._write("\r\x1b[K")
            self.shown = False

    def redraw(self) -> None:
        if self.parts:
            self._draw()

    def end(self) -> None:
        """The run is over: the last state stays on screen, and the terminal's next line is free."""
        if self.shown:
            self._write("\n")
        self.shown = False
        self.parts = []

    def _write(self, text: str) -> None:
        fd = self._out if self._out is not None else self.fd
        try:
            os.write(fd, text.encode("utf-8", "replace"))  # type: ignore[arg-type]
        except OSError:  # a paused or gone terminal: this update is lost, the next one comes
            pass

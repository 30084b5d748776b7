"""The run's timeline (warm-up, then tumbling windows) and the clock it is read with.

Every part that asks "what time is it" (the recorder, the driver, the scheduler's tick, the
window pipeline) is handed a :class:`Clock`, so that a test or a benchmark can run the same code
on simulated time. ``monotonic()`` is the time base of the timeline, of request deadlines and of
sampler snapshots; ``wall()`` is only for timestamps (logs, the store, ``*_timestamp_seconds``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def wall(self) -> float: ...


class SystemClock:
    """The event loop's clock while one runs (``loop.time()``, what timers use), else
    ``time.monotonic()``; wall time from ``time.time()``."""

    def monotonic(self) -> float:
        try:
            return asyncio.get_running_loop().time()
        except RuntimeError:
            return time.monotonic()

    def wall(self) -> float:
        return time.time()


class ManualClock:
    """A clock that moves only when told to (tests, simulated runs). ``wall`` keeps a fixed
    offset from ``monotonic``."""

    def __init__(self, start: float = 0.0, wall_offset: float = 1_700_000_000.0) -> None:
        self.now = start
        self.wall_offset = wall_offset

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.now + self.wall_offset

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


SYSTEM_CLOCK = SystemClock()


class Timeline:
    """Where a monotonic time falls: warm-up (window -1), window k, or past the end.

    ``first_index`` continues the numbering of a resumed run: the first window of this segment
    is ``first_index``, not 0 (the gap between segments belongs to no window).
    """

    def __init__(self, start: float, warmup: float, window: float, duration: float, first_index: int = 0) -> None:
        self.start = start
        self.warmup = warmup
        self.window = window
        self.duration = duration
        self.first_index = first_index
        self.first_window_start = start + warmup

    def window_at(self, t: float) -> int:
        if t < self.first_window_start:
            return -1
        return self.first_index + int((t - self.first_window_start) // self.window)

    def window_bounds(self, k: int) -> tuple[float, float]:
        s = self.first_window_start + (k - self.first_index) * self.window
        return s, min(s + self.window, self.end)

    @property
    def last_index(self) -> int:
        """The index of the run's last window (the one its end closes, or cuts short); ``first_index - 1`` when
        the run ends within its warm-up (no window: a resumed run with less left than the warm-up)."""
        if self.end <= self.first_window_start:
            return self.first_index - 1
        return max(self.first_index, self.window_at(self.end - 1e-9))  # the window of the run's last instant

    @property
    def end(self) -> float:
        return self.start + self.duration

    def elapsed(self, t: float) -> float:
        return max(0.0, t - self.start)

    def progress(self, t: float) -> float:
        return min(1.0, self.elapsed(t) / self.duration) if self.duration > 0 else 1.0

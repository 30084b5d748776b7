"""soakd watching itself: the CFS throttling of its own cgroup, and its own garbage collector.

A CPU limit on soakd's container (set in the manifests, or imposed by a namespace's LimitRange that
the manifests do not mention) makes the kernel stop soakd's threads for the rest of each 100 ms
period once the quota is used: its event loop stalls, and every request in flight looks slower.
``cpu.stat`` counts it: ``nr_throttled`` periods and ``throttled_usec`` (cgroup v2,
``/sys/fs/cgroup/cpu.stat``) or ``throttled_time`` in ns (cgroup v1, ``/sys/fs/cgroup/cpu,cpuacct/cpu.stat``
or ``/sys/fs/cgroup/cpu/cpu.stat``). ``CgroupCpu.delta()`` returns what was added since the last
call; the runtime polls it once a second into the open window (``WindowSet.add_throttling``), and the
event-loop heartbeat (``soakd.web.Heartbeat``, every 10 ms) gives the lag itself.

Python's collector is the other stall of soakd's own making: a full collection walks every object the
process tracks, and the imports alone (numpy, scipy, aiohttp, pydantic) leave about 120,000 of them, 40-60 ms
of CPU a collection on an idle core and twice that on a starved one. Every request in flight carries the pause
into its latency; live, at half a core, that was one stall of 100-170 ms in most 2-minute runs, the 48 requests
in flight impaired (``benchmarks/busy_node.py``). ``frozen_startup_heap`` moves what exists when the load starts
(which lives all run) out of the collector's reach (``gc.freeze``) and gives it back when the load is over.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from pathlib import Path

__all__ = ["CgroupCpu", "frozen_startup_heap", "parse_cpu_stat"]


@contextlib.contextmanager
def frozen_startup_heap() -> Iterator[int]:
    """Collect once, then freeze every object the process tracks (``gc.freeze``): the collections during the
    load walk only what the load allocates. Yields how many objects were frozen. On exit ``gc.unfreeze``
    returns them to the oldest generation, so that what the run (or, in one test process, an earlier run)
    left behind is collected again."""
    gc.collect()
    gc.freeze()
    try:
        yield gc.get_freeze_count()
    finally:
        gc.unfreeze()

CANDIDATES = (
    (Path("/sys/fs/cgroup/cpu.stat"), "v2"),
    (Path("/sys/fs/cgroup/cpu,cpuacct/cpu.stat"), "v1"),
    (Path("/sys/fs/cgroup/cpu/cpu.stat"), "v1"),
)


def parse_cpu_stat(text: str, version: str) -> tuple[float, int] | None:
    """``(throttled seconds, throttled periods)`` from a ``cpu.stat`` file, or None when it has neither."""
    fields: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            fields[parts[0]] = int(parts[1])
    if "nr_throttled" not in fields:
        return None
    if version == "v2":
        seconds = fields.get("throttled_usec", 0) / 1e6
    else:
        seconds = fields.get("throttled_time", 0) / 1e9
    return seconds, fields["nr_throttled"]


class CgroupCpu:
    """The throttling counters of this process's cgroup; ``available`` False where there is none."""

    def __init__(self, candidates: tuple[tuple[Path, str], ...] = CANDIDATES) -> None:
        self.path: Path | None = None
        self.version = ""
        for path, version in candidates:
            try:
                if parse_cpu_stat(path.read_text(), version) is not None:
                    self.path, self.version = path, version
                    break
            except OSError:
                continue
        self._last = self._read()

    @property
    def available(self) -> bool:
        return self.path is not None

    def _read(self) -> tuple[float, int] | None:
        if self.path is None:
            return None
        try:
            return parse_cpu_stat(self.path.read_text(), self.version)
        except OSError:
            return None

    def delta(self) -> tuple[float, int] | None:
        """Throttled seconds and periods since the last call (a counter that went back counts from 0)."""
        now = self._read()
        if now is None:
            return None
        last = self._last or (0.0, 0)
        self._last = now
        seconds, periods = now[0] - last[0], now[1] - last[1]
        if seconds < 0 or periods < 0:
            return now
        return seconds, periods

"""A closed window's way out: persisted, analysed, published — in that order.

1. persist: the summary into SQLite (before anything announces it);
2. analyse: the analysis engine takes it (drift, throttle, leaks, diagnosis); a new baseline is
   stored; the events it emits go to the store, then the log;
3. publish: ``soakd_windows_closed_total`` and one ``window_closed`` log line carrying the whole
   summary (``kubectl logs`` is the live tail; ``soakd report --format json`` the record).

Windows are processed one at a time, in the order they closed, whoever submits them (the tick,
the end of the run). A revision (a window counted again with the requests that finished after it
closed, ``revision`` > 0) replaces the stored summary and is logged (``window_revised``); the
analysis keeps the judgement it made when the window closed on time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from soakd.analysis.engine import Analyzer
from soakd.core.summary import WindowSummary
from soakd.metrics import SoakMetrics
from soakd.soak.events import EventLog
from soakd.soak.session import RunSession

log = structlog.get_logger("soakd")


class WindowPipeline:
    def __init__(self, session: RunSession, analyzer: Analyzer, events: EventLog, metrics: SoakMetrics,
                 on_window: Callable[[WindowSummary], None] | None = None) -> None:
        self.session = session
        self.on_window = on_window  # after the analysis (A/B runs: the reference's window to the judge)
        self.analyzer = analyzer
        self.events = events
        self.metrics = metrics
        self._queue: list[WindowSummary] = []
        self._lock = asyncio.Lock()

    def submit(self, windows: list[WindowSummary]) -> None:
        self._queue.extend(windows)

    async def drain(self) -> None:
        async with self._lock:
            while self._queue:
                await self._process(self._queue.pop(0))

    async def _process(self, w: WindowSummary) -> None:
        an = self.analyzer
        if w.revision:
            if self.session.store is not None:
                await self.session.save_window(w)
            log.info("window_revised", window=w.window, revision=w.revision, late_records=w.late_records,
                     requests=w.requests)
            return
        had_baseline = an.baseline is not None
        if self.session.store is not None:
            await self.session.save_window(w)
        an.add_window(w)
        if not had_baseline and an.baseline is w and self.session.store is not None:
            await self.session.set_baseline(w)
        if self.on_window is not None:
            self.on_window(w)
        await self.events.flush()
        self.metrics.windows_closed.inc(())
        drift = [f"{r.metric}/{r.reference} {r.ratio:+.1%} ({r.status})"
                 for r in an.drift.values() if r.window == w.window and r.ratio is not None
                 and r.status in ("drift", "insufficient")][:12]
        log.info("window_closed", **w.dump(), drift=drift)

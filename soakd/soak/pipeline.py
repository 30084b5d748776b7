"""A closed window's way out: persisted, analysed, published — in that order.

1. persist: the summary into SQLite (before anything announces it);
2. analyse: the analysis engine takes it (drift, throttle, leaks, diagnosis); a new baseline is
   stored; the events it emits go to the store, then the log;
3. publish: ``soakd_windows_closed_total`` and one ``window_closed`` log line carrying the whole
   summary, whether it was judged (or why not) and its findings with their evidence (``kubectl
   logs`` is the live tail; ``soakd report --format json`` the record).

Windows are processed one at a time, in the order they closed, whoever submits them (the tick,
the end of the run). A revision (a window counted again with the requests that finished after it
closed, ``revision`` > 0) replaces the stored summary and is logged (``window_revised``); the
analysis keeps the judgement it made when the window closed on time.
"""

from __future__ import annotations

import asyncio

import structlog

from soakd.analysis.engine import Analyzer
from soakd.analysis.judged import not_judged_cause
from soakd.core.findings import finding_log
from soakd.core.summary import WindowSummary
from soakd.metrics import SoakMetrics
from soakd.soak.events import EventLog
from soakd.soak.session import RunSession

log = structlog.get_logger("soakd")


class WindowPipeline:
    """One target's closed windows, in order. ``target``: the name of an A/B run's other target (its
    windows are stored under it, its log lines carry it, its windows go to ``ab``, the reference
    target's analysis, which judges them against its own); None for the reference (or only) target,
    whose windows are the run's and whose first judged window is the run's baseline."""

    def __init__(self, session: RunSession, analyzer: Analyzer, events: EventLog, metrics: SoakMetrics,
                 target: str | None = None, ab: Analyzer | None = None) -> None:
        self.session = session
        self.analyzer = analyzer
        self.events = events
        self.metrics = metrics
        self.target = target
        self.ab = ab
        self._queue: list[WindowSummary] = []
        self._lock = asyncio.Lock()

    def submit(self, windows: list[WindowSummary]) -> None:
        self._queue.extend(windows)

    async def drain(self) -> None:
        async with self._lock:
            while self._queue:
                await self._process(self._queue.pop(0))

    async def _save(self, w: WindowSummary) -> None:
        if self.session.store is not None:
            await self.session.save_window(w, self.target or "")

    async def _process(self, w: WindowSummary) -> None:
        an = self.analyzer
        who = {"target": self.target} if self.target else {}
        if w.revision:
            await self._save(w)
            log.info("window_revised", **who, window=w.window, revision=w.revision, late_records=w.late_records,
                     requests=w.requests)
            return
        had_baseline = an.baseline is not None
        await self._save(w)
        findings = an.add_window(w)
        if self.target is None and not had_baseline and an.baseline is w and self.session.store is not None:
            await self.session.set_baseline(w)
        if self.target is not None and self.ab is not None:  # an A/B run: the comparisons it completes
            findings += self.ab.add_target_window(self.target, w)
        await self.events.flush()
        self.metrics.windows_closed.inc(())
        drift = [f"{r.metric}/{r.reference} {r.ratio:+.1%} ({r.status})"
                 for r in an.drift.values() if r.window == w.window and r.ratio is not None
                 and r.status in ("drift", "insufficient")][:12]
        cause = not_judged_cause(w, an.cfg.drift.min_requests)
        log.info("window_closed", **who, **w.dump(), drift=drift, judged=cause is None, not_judged=cause,
                 findings=[finding_log(f) for f in findings])

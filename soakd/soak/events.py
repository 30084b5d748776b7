"""Events and findings of a soak: into the store before they are announced in the log.

Detectors, probes and the canary ``emit`` (synchronously, from wherever they run); whoever
owns an await point ``flush``es: each event is written to SQLite, then logged (a finding as
``finding``, the rest under their own kind).
"""

from __future__ import annotations

from typing import Any

import structlog

from soakd.core.findings import Finding, finding_log
from soakd.core.timeline import SYSTEM_CLOCK, Clock
from soakd.soak.session import RunSession

log = structlog.get_logger("soakd")


class EventLog:
    def __init__(self, session: RunSession, clock: Clock = SYSTEM_CLOCK) -> None:
        self.session = session
        self.clock = clock
        self._queue: list[tuple[str, str, str, dict[str, Any], int | None, float]] = []

    def emit(self, kind: str, severity: str, message: str, data: dict[str, Any], window: int | None) -> None:
        self._queue.append((kind, severity, message, data, window, self.clock.wall()))

    async def flush(self) -> None:
        while self._queue:
            kind, severity, message, data, window, t = self._queue.pop(0)
            if self.session.store is not None:
                await self.session.add_event(kind, severity, message, data, window, t)
            level = {"critical": log.error, "warning": log.warning}.get(severity, log.info)
            f = Finding.from_event(data)
            if f is not None:  # a finding: its diagnosis, span, evidence, runbook and whether it fails the run
                level("finding", window=window, **finding_log(f))
            else:
                level(kind, kind=kind, severity=severity, window=window, message=message)

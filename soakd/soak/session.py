"""The run in the store: open it or resume it, its segments, and every write of the soak.

A restarted soakd (pod rescheduled, SIGKILL) resumes the newest unfinished run of the state dir
with its run id, baseline and window numbering (``--new-run`` starts afresh). Every write goes
through ``RunSession``: a full disk is logged once (by the store's state callback) and never
fatal; the store keeps the writes and replays them when space returns.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog

from soakd import __version__
from soakd.analysis.drift import baseline_from_report
from soakd.config import ConfigError, SoakConfig
from soakd.core.findings import Finding
from soakd.core.series import Series
from soakd.core.summary import WindowSummary
from soakd.core.timeline import SYSTEM_CLOCK, Clock
from soakd.core.verdict import RunVerdict
from soakd.store import RunStore, StoreError, StoreReplaced, StoreUnavailable, hash_config

log = structlog.get_logger("soakd")

GRACEFUL_STOPS = ("SIGTERM", "SIGINT", "SIGHUP")  # stops that leave the run resumable


class RunSession:
    def __init__(self, config: SoakConfig, *, new_run: bool = False, clock: Clock = SYSTEM_CLOCK) -> None:
        self.config = config
        self.new_run = new_run
        self.clock = clock
        self.run_id = uuid.uuid4().hex[:12]
        self.store: RunStore | None = None
        self.segment = 0
        self.resumed = False
        self.created = False
        self.elapsed_before = 0.0  # observed seconds of earlier segments
        self.first_window = 0  # the first window index of this segment
        self.windows: list[WindowSummary] = []  # full windows of earlier segments
        self.baseline: WindowSummary | None = None  # the run's own baseline, from earlier segments
        self.canary_reference: str | None = None
        self.model: str | None = None  # the model an earlier segment used
        self.server_kind: str | None = None
        # what is in memory to re-create the run from when its database is deleted mid-run (the runtime's:
        # every window closed so far, the baseline)
        self.held: Callable[[], tuple[list[WindowSummary], WindowSummary | None]] = lambda: (self.windows, self.baseline)
        self._recreating = False

    # ---- open / resume
    async def open(self) -> None:
        """Open the store; resume the unfinished run unless --new-run. ConfigError when the state
        dir cannot be written."""
        cfg = self.config
        try:
            self.store = await RunStore.open(cfg.run.state_dir, on_state_change=self._store_state)
        except StoreError as exc:
            raise ConfigError([f"run.state_dir: {exc}"]) from None
        applied, left = self.store.read_back
        if applied or left:
            log.warning("store_read_back", path=str(self.store.path), applied=applied, left=left,
                        what="writes an earlier soakd could not save at its end (soakd.db.unsaved.jsonl)",
                        hint="soakd report renders the run they finished")
        prior = await self.store.latest_unfinished_run()
        if prior is not None and self.new_run:
            await self.store.finish_run(prior.id, "superseded by --new-run", status="failed")
            log.info("run_superseded", run_id=prior.id)
            prior = None
        if prior is None:
            return
        self.resumed = True
        self.run_id = prior.id
        if prior.config_hash != hash_config(self.config.redacted()):
            log.warning("config_changed_on_resume", run_id=prior.id,
                        hint="the run continues with the new configuration; pass --new-run to start afresh")
        self.windows = await self.store.load_windows(prior.id, include_partial=False)
        base = await self.store.load_baseline(prior.id)
        self.baseline = base[1] if base else None
        segments = await self.store.load_segments(prior.id)
        self.elapsed_before = sum(
            max(0.0, (sg.ended_unix or sg.last_seen_unix or sg.started_unix) - sg.started_unix) for sg in segments
        )
        events = await self.store.load_events(prior.id, kinds=["canary_reference"])
        if events and events[-1].data:
            self.canary_reference = events[-1].data.get("digest")
        self.first_window = (prior.last_window + 1) if prior.last_window is not None else 0
        self.model = prior.model

    async def findings(self) -> dict[str | None, list[Finding]]:
        """A resumed run's findings so far, per target (None: the reference, or only, target)."""
        out: dict[str | None, list[Finding]] = {}
        if self.store is None or not self.resumed:
            return out
        for e in await self.store.load_events(self.run_id):
            data = e.data if isinstance(e.data, dict) else None
            f = Finding.from_event(data)
            if f is not None and data is not None:
                out.setdefault(data.get("target"), []).append(f)
        return out

    async def start(self, model: str, server_kind: str | None) -> None:
        """The run (when new) and this process's segment."""
        store = self._store()
        self.model, self.server_kind = model, server_kind
        if not self.resumed:
            await store.create_run(self.run_id, self.config.redacted(), None, self.config.target.display_url, model,
                                   server_kind, __version__)
        self.created = True
        self.segment = await store.start_segment(self.run_id, "resume" if self.resumed else "start")
        if self.resumed:
            await self.call("event", lambda: store.add_event(
                self.run_id, "segment", "info",
                f"resumed (segment {self.segment}) after a gap; window numbering continues at {self.first_window}",
                {"segment": self.segment}, None))
            log.info("run_resumed", run_id=self.run_id, segment=self.segment, windows=len(self.windows),
                     first_window=self.first_window, elapsed_before=round(self.elapsed_before, 1))

    # ---- writes
    async def call(self, what: str, write: Callable[[], Awaitable[Any]]) -> Any:
        """Await a store write; a full disk is logged (once, by the store's state callback), never fatal;
        a database deleted or replaced is re-created from memory, and the write made again."""
        for attempt in range(2):
            try:
                return await write()
            except StoreUnavailable:
                return None
            except StoreReplaced as exc:
                if attempt or not await self._recreate(str(exc)):
                    return None
            except StoreError as exc:
                log.error("store_write_failed", what=what, error=str(exc))
                return None
        return None

    async def _recreate(self, why: str) -> bool:
        """The database was deleted or replaced mid-run: open the path again and write the run into it
        from memory (the run, a segment, every window closed so far, the baseline)."""
        if self._recreating or self.store is None:
            return False
        self._recreating = True
        store = self.store
        try:
            await store.reopen()
            windows, baseline = self.held()
            if await store.get_run(self.run_id) is None:
                await store.create_run(self.run_id, self.config.redacted(), None, self.config.target.display_url,
                                       self.model, self.server_kind, __version__)
            self.segment = await store.start_segment(self.run_id, "recreated")
            for w in windows:
                await store.save_window(self.run_id, w.window, w.segment, w, w.partial)
            if baseline is not None:
                await store.set_baseline(self.run_id, baseline.window, baseline)
            await store.add_event(self.run_id, "store", "error", f"{why}; re-created from memory with "
                                  f"{len(windows)} windows (the events and samples written before are lost)",
                                  {"windows": len(windows)}, None)
            log.error("store_recreated", reason=why, path=str(store.path), windows=len(windows),
                      lost="the events and telemetry samples written before")
            return True
        except StoreError as exc:
            log.error("store_recreate_failed", reason=why, error=str(exc),
                      action="the run goes on; its record is not being written")
            return False
        finally:
            self._recreating = False

    async def save_window(self, w: WindowSummary, target: str = "") -> None:
        """A closed window of the reference target (''), or of an A/B run's other target by name."""
        await self.call("window", lambda: self._store().save_window(self.run_id, w.window, w.segment, w, w.partial,
                                                            target=target))

    async def set_baseline(self, w: WindowSummary) -> None:
        await self.call("baseline", lambda: self._store().set_baseline(self.run_id, w.window, w))

    async def add_event(self, kind: str, severity: str, message: str, data: dict[str, Any], window: int | None,
                        t_unix: float) -> None:
        await self.call("event", lambda: self._store().add_event(self.run_id, kind, severity, message, data, window,
                                                         t_unix=t_unix))

    async def add_samples(self, batch: list[tuple[float, list[Series]]]) -> None:
        """Snapshots (wall time, series) into the per-minute samples; only once the run exists."""
        if not self.created:
            return
        store = self._store()
        for t_wall, series_list in batch:
            await self.call("samples", lambda: store.add_samples(self.run_id, t_wall, series_list))

    async def heartbeat(self) -> None:
        if self.store is not None:
            await self.call("heartbeat", lambda: self.store.heartbeat(self.run_id))

    async def finish(self, reason: str, verdict: RunVerdict) -> None:
        """The verdict and the end of this segment; the end of the run unless the stop leaves it
        resumable (SIGTERM/SIGINT: a pod being rescheduled, a user's Ctrl-C)."""
        store = self._store()
        await self.call("verdict", lambda: store.set_verdict(self.run_id, verdict.dump()))
        await self.call("segment", lambda: store.end_segment(self.run_id, self.segment, reason))
        if reason not in GRACEFUL_STOPS:
            await self.call("finish", lambda: store.finish_run(self.run_id, reason,
                                                       status="failed" if verdict.result == "FAIL" else "finished"))

    async def settle(self) -> tuple[int, int, str] | None:
        """The end of the run: what a full disk kept queued, retried for ``run.grace``, then kept beside
        the database (``RunStore.settle``). None when everything was saved; else (kept, dropped, where),
        logged as ``run_not_saved``."""
        kept, dropped, where = await self._store().settle(self.config.run.grace)
        if not (kept or dropped):
            return None
        log.error("run_not_saved", run_id=self.run_id, unsaved_writes=kept + dropped, kept=kept,
                  kept_in=where or None, dropped_samples=dropped, path=self.path,
                  action="no report: the store lacks this run's last writes; the next start on this state dir "
                         "reads them back" + (" once they are put in soakd.db.unsaved.jsonl" if where == "stderr"
                                              else ""))
        return kept, dropped, where

    async def close(self) -> None:
        if self.store is not None:
            try:
                await self.store.close()
            except Exception as exc:  # noqa: BLE001
                log.error("store_close_failed", error=repr(exc))

    def health(self) -> dict[str, Any] | None:
        return self.store.health() if self.store is not None else None

    @property
    def path(self) -> str:
        return str(self.store.path) if self.store is not None else ""

    def _store(self) -> RunStore:
        if self.store is None:
            raise RuntimeError("the run store is not open")
        return self.store

    def _store_state(self, available: bool, reason: str | None) -> None:
        if available:
            log.info("store_recovered", path=str(self.config.run.state_dir))
        else:
            log.error("store_unavailable", path=str(self.config.run.state_dir), reason=reason,
                      action="keeping writes in memory and retrying; /metrics keeps working")


def read_baseline(path: Path, min_requests: int) -> WindowSummary:
    """The baseline window of an earlier run's JSON report (``analysis.baseline``); ConfigError
    naming the file when it cannot be read or holds no usable window."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        base = baseline_from_report(data, min_requests)
    except (OSError, ValueError) as exc:
        raise ConfigError([f"analysis.baseline: cannot read a JSON report from {path}: {exc}"]) from None
    if base is None:
        raise ConfigError([f"analysis.baseline: {path} holds no full window with at least "
                           f"{min_requests} requests to use as the baseline"])
    return base

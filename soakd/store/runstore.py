"""The run store's public, async face: every call runs on the writer's thread."""


from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from soakd import __version__
from soakd.core.summary import WindowSummary
from soakd.store.rows import EventRow, RunRow, SampleRow, SegmentRow, hash_config, to_json
from soakd.store.schema import (PENDING_LIMIT, RUN_STATUSES, SAMPLE_PERIOD, SCHEMA_VERSION, SEVERITIES, StoreError,
                                 StoreUnavailable)
from soakd.store.writer import Writer

# --------------------------------------------------------------------------------------------
# the public, async face


class RunStore:
    """The soak's SQLite store. Open with ``await RunStore.open(state_dir)``; every method is a
    coroutine that runs on the store's own thread; writes are committed before they return."""

    def __init__(self, writer: Writer, executor: ThreadPoolExecutor,
                 on_state_change: Callable[[bool, str | None], None] | None) -> None:
        self._w = writer
        self._executor = executor
        self._on_state_change = on_state_change
        self._reported_available = True
        self._closed = False

    @classmethod
    async def open(cls, state_dir: Path | str, *, sample_period: int = SAMPLE_PERIOD,
                   pending_limit: int = PENDING_LIMIT,
                   on_state_change: Callable[[bool, str | None], None] | None = None) -> RunStore:
        """Create the dir and the database, migrate it, take the writer lock and prove it can write.

        Raises StoreError naming the path and the fix when any of that fails (fail fast at start).
        ``on_state_change(available, reason)`` is called on the event loop when writes start
        failing (False) and when the queued writes have been replayed (True)."""
        if sample_period <= 0 or pending_limit < 1:
            raise ValueError("sample_period and pending_limit must be positive")
        writer = Writer(Path(state_dir), int(sample_period), int(pending_limit))
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="soakd-store")
        try:
            await asyncio.get_running_loop().run_in_executor(executor, writer.open)
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(writer, executor, on_state_change)

    async def __aenter__(self) -> RunStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- state
    @property
    def state_dir(self) -> Path:
        return self._w.state_dir

    @property
    def path(self) -> Path:
        return self._w.db

    @property
    def journal_mode(self) -> str:
        return self._w.journal_mode

    @property
    def migrated(self) -> list[int]:
        """Schema versions applied when this store was opened (empty when it was current)."""
        return list(self._w.migrated)

    @property
    def available(self) -> bool:
        return self._w.available

    @property
    def pending(self) -> int:
        return len(self._w.pending)

    def health(self) -> dict[str, Any]:
        """For /status: is the store writing, and what is waiting to be written."""
        w = self._w
        return {"path": str(w.db), "available": w.available, "pending_writes": len(w.pending),
                "dropped_writes": dict(w.dropped), "failed_writes": w.failed, "last_error": w.last_error,
                "open_sample_aggregates": len(w.aggs), "schema_version": SCHEMA_VERSION}

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._closed:
            raise StoreError(f"{self._w.db} is closed")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        finally:
            now = self._w.available
            if now != self._reported_available:
                self._reported_available = now
                if self._on_state_change is not None:
                    try:
                        self._on_state_change(now, None if now else self._w.last_error)
                    except Exception:  # noqa: BLE001 - a failing log hook must not fail the write
                        pass

    # ---- runs and segments
    async def create_run(self, run_id: str, config_json: str | Mapping[str, Any], config_hash: str | None = None,
                         target: str | None = None, model: str | None = None, server_kind: str | None = None,
                         version: str = __version__, *, created_unix: float | None = None,
                         kind: str = "soak") -> RunRow:
        """A new run (status 'running'). Not queued when the disk fails: a run that cannot be
        recorded should not start. ``config_hash`` defaults to :func:`hash_config` of the config."""
        text = config_json if isinstance(config_json, str) else to_json(config_json, sort_keys=True)
        chash = config_hash or hash_config(text)
        t = time.time() if created_unix is None else created_unix
        return await self._call(self._w.create_run, run_id, text, chash, target, model, server_kind, version, t, kind)

    async def latest_unfinished_run(self) -> RunRow | None:
        """The newest run still 'running' (a soakd that died or was rescheduled): resume it unless --new-run."""
        return await self._call(self._w.latest_unfinished_run)

    async def get_run(self, run_id: str) -> RunRow | None:
        return await self._call(self._w.get_run, run_id)

    async def list_runs(self, kind: str | None = "soak") -> list[RunRow]:
        """Newest first; soaks by default (``kind`` sweep, or None for all)."""
        return await self._call(self._w.list_runs, kind)

    async def start_segment(self, run_id: str, reason: str = "start", *, t_unix: float | None = None) -> int:
        """A process start or resume: returns its seq (0, 1, …). A segment left open by a crash is
        closed at its last sign of life (end_reason 'interrupted'); the gap is not part of any window."""
        t = time.time() if t_unix is None else t_unix
        return await self._call(self._w.start_segment, run_id, reason, t)

    async def end_segment(self, run_id: str, seq: int, reason: str = "stopped", *, t_unix: float | None = None) -> None:
        t = time.time() if t_unix is None else t_unix
        await self._call(self._w.end_segment, run_id, seq, reason, t)

    async def load_segments(self, run_id: str) -> list[SegmentRow]:
        return await self._call(self._w.load_segments, run_id)

    async def heartbeat(self, run_id: str, *, t_unix: float | None = None) -> None:
        """Record a sign of life (bounds the gap after a crash) and replay queued writes. Call it
        from the checkpoint job every few seconds; it is cheap (NORMAL sync) and never queued."""
        t = time.time() if t_unix is None else t_unix
        await self._call(self._w.heartbeat, run_id, t)

    async def finish_run(self, run_id: str, stop_reason: str, status: str = "finished", *,
                         t_unix: float | None = None) -> None:
        """Flush the run's open sample minutes, close its open segment and mark it finished/failed."""
        if status not in RUN_STATUSES or status == "running":
            raise ValueError(f"status must be 'finished' or 'failed', not {status!r}")
        t = time.time() if t_unix is None else t_unix
        await self._call(self._w.finish_run, run_id, stop_reason, status, t)

    # ---- windows and baseline
    async def save_window(self, run_id: str, idx: int, segment: int, summary: WindowSummary | Mapping[str, Any],
                          partial: bool | None = None, *, start_unix: float | None = None,
                          end_unix: float | None = None, target: str = "") -> bool:
        """Upsert window ``idx`` of ``target`` ('' the run's reference, or only, target; an A/B run's
        other targets by name): overall and per-scenario figures inside ``summary``, dumped here once.
        A partial window may be replaced by a later version; a final one only by a final one (returns
        False when a partial version is refused). start/end default to the summary's start_unix and
        start_unix + duration_seconds."""
        summary = _doc(summary)
        is_partial = bool(summary.get("partial", False)) if partial is None else bool(partial)
        start = start_unix if start_unix is not None else summary.get("start_unix")
        end = end_unix
        if end is None and start is not None and summary.get("duration_seconds") is not None:
            end = float(start) + float(summary["duration_seconds"])
        text = to_json(summary)
        return await self._call(self._w.save_window, run_id, int(idx), int(segment), text, is_partial, start, end,
                                time.time(), target)

    async def load_windows(self, run_id: str, *, include_partial: bool = True, target: str = "") -> list[WindowSummary]:
        """Window summaries in index order; ``window``, ``partial`` and ``segment`` are the stored values."""
        return await self._call(self._w.load_windows, run_id, include_partial, target)

    async def set_baseline(self, run_id: str, idx: int, summary: WindowSummary | Mapping[str, Any]) -> None:
        await self._call(self._w.set_baseline, run_id, int(idx), to_json(_doc(summary)), time.time())

    async def load_baseline(self, run_id: str) -> tuple[int, WindowSummary] | None:
        """(window index, summary) of the run's baseline, or None before one was chosen."""
        return await self._call(self._w.load_baseline, run_id)

    async def set_verdict(self, run_id: str, verdict: Mapping[str, Any]) -> None:
        await self._call(self._w.set_verdict, run_id, to_json(verdict), time.time())

    # ---- A/B: the windows of the targets after the first
    async def save_target_window(self, run_id: str, target: str, summary: WindowSummary | Mapping[str, Any]) -> None:
        """A/B runs: another target's window (the windows table, keyed by its name)."""
        await self.save_window(run_id, int(_doc(summary)["window"]), int(_doc(summary).get("segment") or 0), summary,
                               target=target)

    async def load_target_windows(self, run_id: str) -> dict[str, list[WindowSummary]]:
        """target -> its windows in index order (A/B runs; the reference's are load_windows)."""
        return await self._call(self._w.load_target_windows, run_id)

    # ---- batches (soakd batch: resumable accounting of an OpenAI batch input file)
    async def create_batch(self, batch_id: str, input_path: str, input_sha256: str, target: str | None,
                           config: Mapping[str, Any]) -> None:
        await self._call(self._w.create_batch, batch_id, input_path, input_sha256, target,
                         to_json(config, sort_keys=True), time.time())

    async def latest_batch(self, input_sha256: str) -> tuple[str, str] | None:
        """(id, status) of the newest batch of this input: resume it while it is running."""
        return await self._call(self._w.latest_batch, input_sha256)

    async def save_batch_items(self, batch_id: str, items: Sequence[tuple[Any, ...]]) -> None:
        if items:
            await self._call(self._w.save_batch_items, batch_id, list(items), time.time())

    async def load_batch_items(self, batch_id: str) -> list[tuple[Any, ...]]:
        return await self._call(self._w.load_batch_items, batch_id)

    async def finish_batch(self, batch_id: str, status: str, result: Mapping[str, Any]) -> None:
        await self._call(self._w.finish_batch, batch_id, status, to_json(result), time.time())

    # ---- events
    async def add_event(self, run_id: str, kind: str, severity: str, message: str,
                        data: Mapping[str, Any] | None = None, window: int | None = None, *,
                        t_unix: float | None = None) -> int:
        """Append an event (drift, leak, throttle, canary, target_down/up, sampler_down/up…); returns its id.
        The time is taken now (not when a queued write is replayed)."""
        if not kind:
            raise ValueError("event kind must not be empty")
        if severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {', '.join(SEVERITIES)}, not {severity!r}")
        t = time.time() if t_unix is None else t_unix
        return await self._call(self._w.add_event, run_id, t, kind, severity, window, message,
                                None if data is None else to_json(data))

    async def load_events(self, run_id: str, kinds: Iterable[str] | None = None) -> list[EventRow]:
        """Events in time order (insertion order among equal times)."""
        return await self._call(self._w.load_events, run_id, None if kinds is None else list(kinds))

    # ---- samples
    async def add_samples(self, run_id: str, t_unix: float, series_list: Iterable[Any]) -> int:
        """Fold samples taken at ``t_unix`` (wall clock) into per-period aggregates (count, mean,
        min, max, last); periods that closed are written now (returns the rows written). Items are
        ``(name, labels, value)`` tuples (labels: (key, value) pairs, a mapping or None) or
        ``soakd.samplers.base.Series``, so a sampler listener can pass ``snapshot.series`` as is.
        None, NaN, inf and strings are skipped. Memory: one aggregate per series (two across a
        minute boundary)."""
        return await self._call(self._w.add_samples, run_id, float(t_unix), list(series_list))

    async def load_samples(self, run_id: str, series: str | None = None,
                           labels: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None) -> list[SampleRow]:
        return await self._call(self._w.load_samples, run_id, series, labels)

    # ---- durability controls
    async def flush(self) -> None:
        """Write the open sample periods and replay queued writes; StoreUnavailable if it cannot."""
        await self._call(self._w.flush)

    async def retry_pending(self) -> bool:
        """Replay queued writes in order; True when none is left (StoreUnavailable otherwise)."""
        return await self._call(self._w.retry_pending)

    async def reopen(self) -> None:
        """The database was deleted or replaced under this store: release it and open the path again
        (a new, empty database where the file is gone). StoreError when it cannot (another soakd holds
        the new file)."""
        def again() -> None:
            self._w._close_quietly()  # noqa: SLF001 - the writer's own thread
            self._w.open()

        await self._call(again)

    async def settle(self, grace: float) -> tuple[int, int, str]:
        """The end of a run: replay the queued writes, retrying once a second for ``grace`` seconds (a
        disk that fills at the end may free); what is still queued then goes to the unsaved file
        beside the database, or to stderr (``Writer.spill``). (kept, dropped, where); (0, 0, '')
        when everything was saved."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, grace)
        while True:
            try:
                await self.flush()
                return 0, 0, ""
            except StoreUnavailable:
                if loop.time() >= deadline:
                    break
                await asyncio.sleep(min(1.0, max(0.05, deadline - loop.time())))
        return await self._call(self._w.spill)

    @property
    def read_back(self) -> tuple[int, int]:
        """(applied, left) of the writes an earlier soakd could not save, read back at open."""
        return self._w.read_back_result

    async def integrity_check(self) -> str:
        """``PRAGMA integrity_check``: 'ok' for a healthy database."""
        return await self._call(self._w.integrity_check)

    async def close(self) -> None:
        """Flush, replay what is queued, close the connection and release the lock. Raises
        StoreUnavailable (after closing) when writes could not be saved."""
        if self._closed:
            return
        try:
            await self._call(self._w.close)
        finally:
            self._closed = True
            self._executor.shutdown(wait=False)

    async def _execute(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Raw SQL on the writer connection (tests and diagnostics only)."""
        return await self._call(self._w.execute, sql, args)


def _doc(summary: WindowSummary | Mapping[str, Any]) -> dict[str, Any]:
    return summary.dump() if isinstance(summary, WindowSummary) else dict(summary)

"""Rows the store returns, the JSON and label helpers and the queries shared by the writer and the reader, and how SQLite errors are told apart."""


from __future__ import annotations

import errno
import hashlib
import json
import math
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from soakd.core.summary import WindowSummary
from soakd.store.schema import REFERENCE_TARGET, STATE_DIR_HINT, StoreError

# --------------------------------------------------------------------------------------------
# rows returned to callers


@dataclass(frozen=True)
class RunRow:
    id: str
    created_unix: float
    config_json: str
    config_hash: str
    target: str | None
    model: str | None
    server_kind: str | None
    version: str
    status: str
    ended_unix: float | None
    stop_reason: str | None
    baseline_window: int | None
    verdict: dict[str, Any] | None
    segments: int
    windows: int
    last_window: int | None  # the highest window index stored (resume continues after it)
    kind: str = "soak"  # soak, or sweep (soakd sweep: a window per step)

    @property
    def config(self) -> Any:
        return json.loads(self.config_json)


@dataclass(frozen=True)
class SegmentRow:
    run_id: str
    seq: int
    started_unix: float
    ended_unix: float | None
    reason: str
    end_reason: str | None
    last_seen_unix: float | None


@dataclass(frozen=True)
class EventRow:
    id: int
    run_id: str
    t_unix: float
    kind: str
    severity: str
    window: int | None
    message: str
    data: dict[str, Any] | None


@dataclass(frozen=True)
class SampleRow:
    series: str
    labels: dict[str, str]
    t_minute: int  # unix seconds at the start of the period
    count: int
    mean: float
    min: float
    max: float
    last: float


def hash_config(config: Mapping[str, Any] | str) -> str:
    """sha256 of the canonical JSON of a config (a dict, or JSON text: key order and spacing do not
    matter), for the 'config changed since the run started' warning on resume. Text that is not
    JSON is hashed as it is."""
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError:
            return hashlib.sha256(config.encode()).hexdigest()
    return hashlib.sha256(to_json(config, sort_keys=True).encode()).hexdigest()


def segment_gaps(segments: Sequence[SegmentRow]) -> list[tuple[float, float]]:
    """(from, to) wall-clock gaps between consecutive segments: time the run was not observed."""
    out = []
    for prev, nxt in zip(segments, segments[1:], strict=False):
        end = prev.ended_unix if prev.ended_unix is not None else (prev.last_seen_unix or prev.started_unix)
        out.append((end, nxt.started_unix))
    return out


# --------------------------------------------------------------------------------------------
# helpers shared by the writer and the reader


def finite(obj: Any) -> Any:
    """JSON-safe copy: NaN/inf become null (so SQLite's json functions can read every row)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def to_json(obj: Any, *, sort_keys: bool = False) -> str:
    return json.dumps(finite(obj), separators=(",", ":"), sort_keys=sort_keys, default=str, allow_nan=False)


def from_json(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def labels_key(labels: Mapping[str, Any] | Iterable[tuple[str, Any]] | None) -> str:
    if not labels:
        return "{}"
    items = labels.items() if isinstance(labels, Mapping) else labels
    return json.dumps(dict(sorted((str(k), str(v)) for k, v in items)), separators=(",", ":"))


_RUN_SELECT = """
    SELECT r.id, r.created_unix, r.config_json, r.config_hash, r.target, r.model, r.server_kind, r.version,
           r.status, r.ended_unix, r.stop_reason, r.baseline_window, r.verdict_json,
           (SELECT COUNT(*) FROM segments AS s WHERE s.run_id = r.id),
           (SELECT COUNT(*) FROM windows AS w WHERE w.run_id = r.id AND w.target = ''),  -- the reference's
           (SELECT MAX(idx) FROM windows AS w WHERE w.run_id = r.id AND w.target = ''),
           r.kind
    FROM runs AS r
"""


def _run_row(row: Sequence[Any]) -> RunRow:
    return RunRow(*row[:12], from_json(row[12]), *row[13:17])  # type: ignore[arg-type]


def q_get_run(conn: sqlite3.Connection, run_id: str) -> RunRow | None:
    row = conn.execute(_RUN_SELECT + " WHERE r.id = ?", (run_id,)).fetchone()
    return _run_row(row) if row else None


def q_list_runs(conn: sqlite3.Connection, kind: str | None = "soak") -> list[RunRow]:
    """Newest first; of one kind (soak by default; None: all)."""
    where, args = (" WHERE r.kind = ?", (kind,)) if kind is not None else ("", ())
    return [_run_row(r) for r in conn.execute(_RUN_SELECT + where + " ORDER BY r.created_unix DESC, r.rowid DESC",
                                              args)]


def q_latest_unfinished(conn: sqlite3.Connection) -> RunRow | None:
    row = conn.execute(
        _RUN_SELECT + " WHERE r.status = 'running' AND r.kind = 'soak' ORDER BY r.created_unix DESC, r.rowid DESC "
        "LIMIT 1"
    ).fetchone()
    return _run_row(row) if row else None


def q_target_windows(conn: sqlite3.Connection, run_id: str) -> dict[str, list[WindowSummary]]:
    """A/B runs: each other target -> its windows in index order (the reference's are q_windows)."""
    out: dict[str, list[WindowSummary]] = {}
    for target, idx, segment, partial, text in conn.execute(
            "SELECT target, idx, segment, partial, summary_json FROM windows WHERE run_id = ? AND target != ? "
            "ORDER BY target, idx", (run_id, REFERENCE_TARGET)):
        out.setdefault(str(target), []).append(_window(idx, segment, partial, text))
    return out


def _window(idx: int, segment: int, partial: int, text: str) -> WindowSummary:
    summary = json.loads(text)
    summary.update(window=idx, partial=bool(partial), segment=segment)
    return WindowSummary.load(summary)


def q_segments(conn: sqlite3.Connection, run_id: str) -> list[SegmentRow]:
    return [
        SegmentRow(*r)
        for r in conn.execute(
            "SELECT run_id, seq, started_unix, ended_unix, reason, end_reason, last_seen_unix "
            "FROM segments WHERE run_id = ? ORDER BY seq", (run_id,))
    ]


def q_windows(conn: sqlite3.Connection, run_id: str, include_partial: bool,
              target: str = REFERENCE_TARGET) -> list[WindowSummary]:
    """One target's windows in index order (``target`` '' is the run's reference, or only, target)."""
    return [_window(*r) for r in conn.execute(
        "SELECT idx, segment, partial, summary_json FROM windows WHERE run_id = ? AND target = ? "
        + ("" if include_partial else "AND partial = 0 ") + "ORDER BY idx", (run_id, target))]


def q_baseline(conn: sqlite3.Connection, run_id: str) -> tuple[int, WindowSummary] | None:
    row = conn.execute("SELECT baseline_window, baseline_json FROM runs WHERE id = ?", (run_id,)).fetchone()
    if row is None or row[1] is None:
        return None
    idx = int(row[0]) if row[0] is not None else -1
    doc = json.loads(row[1])
    doc.setdefault("window", idx)
    return idx, WindowSummary.load(doc)


def q_events(conn: sqlite3.Connection, run_id: str, kinds: Iterable[str] | None) -> list[EventRow]:
    sql = 'SELECT id, run_id, t_unix, kind, severity, "window", message, data_json FROM events WHERE run_id = ?'
    args: list[Any] = [run_id]
    if kinds is not None:
        kinds = list(kinds)
        sql += f" AND kind IN ({','.join('?' * len(kinds))})"
        args += kinds
    return [EventRow(*r[:7], from_json(r[7])) for r in conn.execute(sql + " ORDER BY t_unix, id", args)]


def q_samples(conn: sqlite3.Connection, run_id: str, series: str | None, labels: Any) -> list[SampleRow]:
    sql = "SELECT series, labels, t_minute, count, mean, min, max, last FROM samples WHERE run_id = ?"
    args: list[Any] = [run_id]
    if series is not None:
        sql += " AND series = ?"
        args.append(series)
    if labels is not None:
        sql += " AND labels = ?"
        args.append(labels_key(labels))
    rows = conn.execute(sql + " ORDER BY series, labels, t_minute", args)
    return [SampleRow(r[0], json.loads(r[1]), *r[2:]) for r in rows]


# error codes (primary, low byte) that mean "cannot write right now", not "bad request"
SQLITE_BUSY, SQLITE_LOCKED, SQLITE_READONLY, SQLITE_IOERR = 5, 6, 8, 10
SQLITE_CORRUPT, SQLITE_FULL, SQLITE_CANTOPEN, SQLITE_PROTOCOL, SQLITE_NOTADB = 11, 13, 14, 15, 26
_TRANSIENT = {SQLITE_BUSY, SQLITE_LOCKED, SQLITE_READONLY, SQLITE_IOERR, SQLITE_FULL, SQLITE_CANTOPEN,
              SQLITE_PROTOCOL}
_TRANSIENT_TEXT = ("disk is full", "disk i/o error", "unable to open", "readonly database", "database is locked")


def errcode(exc: sqlite3.Error) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    return None if code is None else code & 0xFF


def is_transient(exc: BaseException) -> bool:
    if not isinstance(exc, sqlite3.Error):
        return False
    code = errcode(exc)
    if code is not None:
        return code in _TRANSIENT
    return any(t in str(exc).lower() for t in _TRANSIENT_TEXT)


def dir_error(state_dir: Path, exc: OSError) -> StoreError:
    what = {
        errno.EACCES: "permission denied",
        errno.EPERM: "operation not permitted",
        errno.EROFS: "read-only file system",
        errno.ENOSPC: "no space left on device",
        errno.EDQUOT: "disk quota exceeded",
    }.get(exc.errno or 0, exc.strerror or str(exc))
    if isinstance(exc, FileExistsError) or (exc.errno == errno.EEXIST):
        what = "it exists and is not a directory"
    elif isinstance(exc, NotADirectoryError) or exc.errno == errno.ENOTDIR:
        blocker = next((p for p in [state_dir, *state_dir.parents] if p.exists() and not p.is_dir()), None)
        what = f"{blocker} is a file, not a directory" if blocker else "a part of the path is not a directory"
    return StoreError(f"state dir {state_dir} is not writable: {what}; {STATE_DIR_HINT}")


def open_error(db: Path, exc: sqlite3.Error) -> StoreError:
    code = errcode(exc)
    if code in (SQLITE_NOTADB, SQLITE_CORRUPT):
        what = f"{db} is not a SQLite database or is corrupt ({exc}); move it aside (a fresh one is created) or"
    elif code == SQLITE_CANTOPEN and db.is_dir():
        what = f"{db} is a directory, not a database file; remove it or"
    elif code == SQLITE_READONLY:
        what = f"{db} is read-only ({exc}: file permissions or a read-only mount);"
    elif code == SQLITE_FULL:
        what = f"cannot write {db}: the disk is full ({exc}); free space or"
    elif code == SQLITE_BUSY:
        what = f"{db} is locked by another process ({exc}); stop it or"
    else:
        what = f"cannot open {db} ({type(exc).__name__}: {exc});"
    return StoreError(f"{what} {STATE_DIR_HINT}")

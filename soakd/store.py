"""SQLite persistence for soak runs: runs, segments, windows, events, downsampled samples.

One file, ``<state_dir>/soakd.db``, written by one writer: a :class:`RunStore` owns a single
connection that lives on its own one-thread executor, so no SQLite call ever runs on the event
loop and writes are applied in the order they were made. ``soakd report`` (and anyone else)
reads through :class:`StoreReader`, a separate read-only connection; WAL mode lets it read
while a soak is writing. A lock file (``soakd.lock``, ``flock``) keeps a second soakd from
writing the same state dir.

Durability ("Nothing lost": every closed window, event and verdict is in SQLite before it is
announced):

- Every write method commits one transaction before it returns.
- ``journal_mode=WAL``: a commit appends to ``soakd.db-wal``; a reader never blocks the writer.
- ``synchronous``: FULL (fsync of the WAL at each commit) for the writes that matter — runs,
  segments, windows, baseline, events, verdict — and NORMAL for per-minute sample flushes and
  heartbeats. Both survive a SIGKILL of the process at any moment (a committed transaction is in
  the OS page cache, and SQLite rolls an unfinished one back on the next open); FULL also
  survives a kernel crash or power loss of the node, which is what "pod rescheduled" can mean.
  NORMAL can lose the last sample minutes on power loss only, and the next FULL commit syncs
  them too (the WAL is sequential). The cost of FULL at soakd's write rate (a window every
  30 minutes, a few events) is a handful of fsyncs per hour.
- A SIGKILL loses at most what was never handed to the store: the open window and the open
  sample minute (flush() / close() write the open minute; a later minute-row merges with it).

Degrade, never die: when a write fails because the disk is full or the file system errors
(``database or disk is full``, ``disk I/O error``, a file system remounted read-only…), the write
is kept in a bounded in-memory queue (``pending_limit``, 10,000 writes by default; sample flushes
are dropped before anything else) and the method raises :class:`StoreUnavailable`, whose
``first`` is true only on the transition, so the caller logs once. The next write, heartbeat(),
flush() or retry_pending() replays the queue in order once space returns; ``on_state_change``
is told both transitions. Everything that cannot write at start (read-only or missing
permissions, a file where the directory should be, a corrupt or newer database, another soakd
holding the lock) raises :class:`StoreError` from :meth:`RunStore.open` with the path and the fix.

Schema history (``PRAGMA user_version``; ``MIGRATIONS[i]`` takes version i to i + 1, each in one
transaction; never edit a released migration, append a new one):

- v1: meta, runs, windows (no segment column), events.
- v2: segments (one per process start or resume, the gap between two is excluded from
  windows), windows.segment, samples (one row per series, labels and minute). Runs written by
  v1 get segment 0 (open when the run was still running).
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import math
import os
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.request import pathname2url

from soakd import __version__

try:  # POSIX only; without it the one-writer rule is not enforced across processes
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

DB_NAME = "soakd.db"
LOCK_NAME = "soakd.lock"
SAMPLE_PERIOD = 60  # seconds per stored sample row ("t_minute" is the start of the period)
SAMPLE_GRACE = 5.0  # a period is flushed once samples this much past its end arrive (late samplers)
PENDING_LIMIT = 10_000
BUSY_TIMEOUT_MS = 5_000
JOURNAL_SIZE_LIMIT = 4 * 1024 * 1024  # the WAL file is truncated to this after a checkpoint
RUN_STATUSES = ("running", "finished", "failed")
SEVERITIES = ("debug", "info", "warning", "error", "critical")
# Known event kinds (not enforced: a new detector may add its own).
EVENT_KINDS = (
    "run_started", "run_resumed", "run_finished", "drift", "leak", "throttle", "canary",
    "target_down", "target_up", "sampler_down", "sampler_up", "store_unavailable", "store_recovered",
)
_STATE_DIR_HINT = (
    "pass --state-dir (SOAKD_RUN__STATE_DIR) with a writable directory; "
    "in Kubernetes mount a PVC or emptyDir there (the container default is /var/lib/soakd)"
)


class StoreError(Exception):
    """The store cannot do what was asked (and retrying will not help by itself)."""


class StoreUnavailable(StoreError):
    """A write could not be committed now (disk full, I/O error). ``queued``: it is kept in memory
    and replayed in order by a later write or retry_pending(). ``first``: this failure is the
    transition from available to unavailable (log it; stay quiet on the next ones)."""

    def __init__(self, message: str, *, reason: str, pending: int, dropped: int, first: bool, queued: bool) -> None:
        super().__init__(message)
        self.reason = reason
        self.pending = pending
        self.dropped = dropped
        self.first = first
        self.queued = queued


# --------------------------------------------------------------------------------------------
# schema and migrations

_V1 = (
    """CREATE TABLE meta (
        key   TEXT PRIMARY KEY,
        value TEXT NOT NULL
    ) WITHOUT ROWID""",
    """CREATE TABLE runs (
        id              TEXT PRIMARY KEY,
        created_unix    REAL NOT NULL,
        config_json     TEXT NOT NULL,
        config_hash     TEXT NOT NULL,
        target          TEXT,
        model           TEXT,
        server_kind     TEXT,
        version         TEXT NOT NULL,
        status          TEXT NOT NULL DEFAULT 'running' CHECK (status IN ('running', 'finished', 'failed')),
        ended_unix      REAL,
        stop_reason     TEXT,
        baseline_window INTEGER,
        baseline_json   TEXT,
        verdict_json    TEXT
    )""",
    """CREATE TABLE windows (
        run_id       TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
        idx          INTEGER NOT NULL,
        start_unix   REAL,
        end_unix     REAL,
        partial      INTEGER NOT NULL DEFAULT 0,
        summary_json TEXT NOT NULL,
        saved_unix   REAL NOT NULL,
        PRIMARY KEY (run_id, idx)
    )""",
    """CREATE TABLE events (
        id        INTEGER PRIMARY KEY,
        run_id    TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
        t_unix    REAL NOT NULL,
        kind      TEXT NOT NULL,
        severity  TEXT NOT NULL,
        "window"  INTEGER,
        message   TEXT NOT NULL,
        data_json TEXT
    )""",
    "CREATE INDEX events_by_run_time ON events (run_id, t_unix, id)",
)

_V2 = (
    """CREATE TABLE segments (
        run_id         TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
        seq            INTEGER NOT NULL,
        started_unix   REAL NOT NULL,
        ended_unix     REAL,
        reason         TEXT NOT NULL,
        end_reason     TEXT,
        last_seen_unix REAL,
        PRIMARY KEY (run_id, seq)
    ) WITHOUT ROWID""",
    "ALTER TABLE windows ADD COLUMN segment INTEGER NOT NULL DEFAULT 0",
    """CREATE TABLE samples (
        run_id   TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
        series   TEXT NOT NULL,
        labels   TEXT NOT NULL,
        t_minute INTEGER NOT NULL,
        count    INTEGER NOT NULL,
        mean     REAL NOT NULL,
        min      REAL NOT NULL,
        max      REAL NOT NULL,
        last     REAL NOT NULL,
        PRIMARY KEY (run_id, series, labels, t_minute)
    ) WITHOUT ROWID""",
    # runs written by v1 had no segments: one segment per run, open while the run is running
    """INSERT INTO segments (run_id, seq, started_unix, ended_unix, reason, end_reason, last_seen_unix)
       SELECT r.id, 0, r.created_unix,
              CASE WHEN r.status = 'running' THEN NULL
                   ELSE COALESCE(r.ended_unix, w.last_end, r.created_unix) END,
              'start',
              CASE WHEN r.status = 'running' THEN NULL ELSE COALESCE(r.stop_reason, r.status) END,
              COALESCE(r.ended_unix, w.last_end, r.created_unix)
       FROM runs AS r
       LEFT JOIN (SELECT run_id, MAX(end_unix) AS last_end FROM windows GROUP BY run_id) AS w ON w.run_id = r.id""",
)


def _migrate_to_v1(conn: sqlite3.Connection) -> None:
    for stmt in _V1:
        conn.execute(stmt)


def _migrate_to_v2(conn: sqlite3.Connection) -> None:
    for stmt in _V2:
        conn.execute(stmt)


MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_migrate_to_v1, _migrate_to_v2)
SCHEMA_VERSION = len(MIGRATIONS)


def _user_version(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA user_version").fetchone()[0])


def migrate(conn: sqlite3.Connection, db: Path | str, target: int = SCHEMA_VERSION) -> list[int]:
    """Bring a connection (autocommit mode) to schema ``target``; returns the versions applied."""
    current = _user_version(conn)
    if current > SCHEMA_VERSION:
        raise StoreError(
            f"{db} was written by a newer soakd (schema v{current}; this soakd {__version__} knows up to "
            f"v{SCHEMA_VERSION}); upgrade soakd, or pass --state-dir with another directory"
        )
    applied: list[int] = []
    for version in range(current, target):
        conn.execute("BEGIN IMMEDIATE")
        try:
            if _user_version(conn) != version:  # someone else migrated meanwhile
                conn.execute("ROLLBACK")
                continue
            MIGRATIONS[version](conn)
            conn.execute(f"PRAGMA user_version = {version + 1}")
            conn.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                (f"schema_v{version + 1}_applied", json.dumps({"unix": time.time(), "soakd": __version__})),
            )
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        applied.append(version + 1)
    return applied


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
    return hashlib.sha256(_dumps(config, sort_keys=True).encode()).hexdigest()


def segment_gaps(segments: Sequence[SegmentRow]) -> list[tuple[float, float]]:
    """(from, to) wall-clock gaps between consecutive segments: time the run was not observed."""
    out = []
    for prev, nxt in zip(segments, segments[1:], strict=False):
        end = prev.ended_unix if prev.ended_unix is not None else (prev.last_seen_unix or prev.started_unix)
        out.append((end, nxt.started_unix))
    return out


# --------------------------------------------------------------------------------------------
# helpers shared by the writer and the reader


def _finite(obj: Any) -> Any:
    """JSON-safe copy: NaN/inf become null (so SQLite's json functions can read every row)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def _dumps(obj: Any, *, sort_keys: bool = False) -> str:
    return json.dumps(_finite(obj), separators=(",", ":"), sort_keys=sort_keys, default=str, allow_nan=False)


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _labels_key(labels: Mapping[str, Any] | Iterable[tuple[str, Any]] | None) -> str:
    if not labels:
        return "{}"
    items = labels.items() if isinstance(labels, Mapping) else labels
    return json.dumps(dict(sorted((str(k), str(v)) for k, v in items)), separators=(",", ":"))


_RUN_SELECT = """
    SELECT r.id, r.created_unix, r.config_json, r.config_hash, r.target, r.model, r.server_kind, r.version,
           r.status, r.ended_unix, r.stop_reason, r.baseline_window, r.verdict_json,
           (SELECT COUNT(*) FROM segments AS s WHERE s.run_id = r.id),
           (SELECT COUNT(*) FROM windows AS w WHERE w.run_id = r.id),
           (SELECT MAX(idx) FROM windows AS w WHERE w.run_id = r.id)
    FROM runs AS r
"""


def _run_row(row: Sequence[Any]) -> RunRow:
    return RunRow(*row[:12], _loads(row[12]), *row[13:16])  # type: ignore[arg-type]


def _q_get_run(conn: sqlite3.Connection, run_id: str) -> RunRow | None:
    row = conn.execute(_RUN_SELECT + " WHERE r.id = ?", (run_id,)).fetchone()
    return _run_row(row) if row else None


def _q_list_runs(conn: sqlite3.Connection) -> list[RunRow]:
    return [_run_row(r) for r in conn.execute(_RUN_SELECT + " ORDER BY r.created_unix DESC, r.rowid DESC")]


def _q_latest_unfinished(conn: sqlite3.Connection) -> RunRow | None:
    row = conn.execute(
        _RUN_SELECT + " WHERE r.status = 'running' ORDER BY r.created_unix DESC, r.rowid DESC LIMIT 1"
    ).fetchone()
    return _run_row(row) if row else None


def _q_segments(conn: sqlite3.Connection, run_id: str) -> list[SegmentRow]:
    return [
        SegmentRow(*r)
        for r in conn.execute(
            "SELECT run_id, seq, started_unix, ended_unix, reason, end_reason, last_seen_unix "
            "FROM segments WHERE run_id = ? ORDER BY seq", (run_id,))
    ]


def _q_windows(conn: sqlite3.Connection, run_id: str, include_partial: bool) -> list[dict[str, Any]]:
    out = []
    for idx, segment, partial, text in conn.execute(
        "SELECT idx, segment, partial, summary_json FROM windows WHERE run_id = ? "
        + ("" if include_partial else "AND partial = 0 ") + "ORDER BY idx", (run_id,)):
        summary = json.loads(text)
        summary.update(window=idx, partial=bool(partial), segment=segment)
        out.append(summary)
    return out


def _q_baseline(conn: sqlite3.Connection, run_id: str) -> tuple[int, dict[str, Any]] | None:
    row = conn.execute("SELECT baseline_window, baseline_json FROM runs WHERE id = ?", (run_id,)).fetchone()
    if row is None or row[1] is None:
        return None
    return int(row[0]) if row[0] is not None else -1, json.loads(row[1])


def _q_events(conn: sqlite3.Connection, run_id: str, kinds: Iterable[str] | None) -> list[EventRow]:
    sql = 'SELECT id, run_id, t_unix, kind, severity, "window", message, data_json FROM events WHERE run_id = ?'
    args: list[Any] = [run_id]
    if kinds is not None:
        kinds = list(kinds)
        sql += f" AND kind IN ({','.join('?' * len(kinds))})"
        args += kinds
    return [EventRow(*r[:7], _loads(r[7])) for r in conn.execute(sql + " ORDER BY t_unix, id", args)]


def _q_samples(conn: sqlite3.Connection, run_id: str, series: str | None, labels: Any) -> list[SampleRow]:
    sql = "SELECT series, labels, t_minute, count, mean, min, max, last FROM samples WHERE run_id = ?"
    args: list[Any] = [run_id]
    if series is not None:
        sql += " AND series = ?"
        args.append(series)
    if labels is not None:
        sql += " AND labels = ?"
        args.append(_labels_key(labels))
    rows = conn.execute(sql + " ORDER BY series, labels, t_minute", args)
    return [SampleRow(r[0], json.loads(r[1]), *r[2:]) for r in rows]


# error codes (primary, low byte) that mean "cannot write right now", not "bad request"
_SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_READONLY, _SQLITE_IOERR = 5, 6, 8, 10
_SQLITE_CORRUPT, _SQLITE_FULL, _SQLITE_CANTOPEN, _SQLITE_PROTOCOL, _SQLITE_NOTADB = 11, 13, 14, 15, 26
_TRANSIENT = {_SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_READONLY, _SQLITE_IOERR, _SQLITE_FULL, _SQLITE_CANTOPEN,
              _SQLITE_PROTOCOL}
_TRANSIENT_TEXT = ("disk is full", "disk i/o error", "unable to open", "readonly database", "database is locked")


def _errcode(exc: sqlite3.Error) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    return None if code is None else code & 0xFF


def _is_transient(exc: BaseException) -> bool:
    if not isinstance(exc, sqlite3.Error):
        return False
    code = _errcode(exc)
    if code is not None:
        return code in _TRANSIENT
    return any(t in str(exc).lower() for t in _TRANSIENT_TEXT)


def _dir_error(state_dir: Path, exc: OSError) -> StoreError:
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
    return StoreError(f"state dir {state_dir} is not writable: {what}; {_STATE_DIR_HINT}")


def _open_error(db: Path, exc: sqlite3.Error) -> StoreError:
    code = _errcode(exc)
    if code in (_SQLITE_NOTADB, _SQLITE_CORRUPT):
        what = f"{db} is not a SQLite database or is corrupt ({exc}); move it aside (a fresh one is created) or"
    elif code == _SQLITE_CANTOPEN and db.is_dir():
        what = f"{db} is a directory, not a database file; remove it or"
    elif code == _SQLITE_READONLY:
        what = f"{db} is read-only ({exc}: file permissions or a read-only mount);"
    elif code == _SQLITE_FULL:
        what = f"cannot write {db}: the disk is full ({exc}); free space or"
    elif code == _SQLITE_BUSY:
        what = f"{db} is locked by another process ({exc}); stop it or"
    else:
        what = f"cannot open {db} ({type(exc).__name__}: {exc});"
    return StoreError(f"{what} {_STATE_DIR_HINT}")


# --------------------------------------------------------------------------------------------
# the writer: everything below runs on the store's one thread


@dataclass(eq=False, slots=True)
class _Op:
    kind: str  # run | segment | window | baseline | event | verdict | finish | samples | heartbeat
    run_id: str
    t_unix: float
    fn: Callable[[sqlite3.Connection], Any]
    durable: bool = True


class _Agg:
    __slots__ = ("count", "total", "min", "max", "last", "last_t")

    def __init__(self, t: float, v: float) -> None:
        self.count, self.total, self.min, self.max, self.last, self.last_t = 1, v, v, v, v, t

    def add(self, t: float, v: float) -> None:
        self.count += 1
        self.total += v
        if v < self.min:
            self.min = v
        if v > self.max:
            self.max = v
        if t >= self.last_t:
            self.last, self.last_t = v, t


_SAMPLE_UPSERT = """
    INSERT INTO samples (run_id, series, labels, t_minute, count, mean, min, max, last)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
    ON CONFLICT (run_id, series, labels, t_minute) DO UPDATE SET
        mean  = (samples.mean * samples.count + excluded.mean * excluded.count) / (samples.count + excluded.count),
        count = samples.count + excluded.count,
        min   = MIN(samples.min, excluded.min),
        max   = MAX(samples.max, excluded.max),
        last  = excluded.last
"""


class _Writer:
    """Owns the connection. Not thread-safe by design: only the store's executor thread calls it."""

    def __init__(self, state_dir: Path, sample_period: int, pending_limit: int) -> None:
        self.state_dir = state_dir
        self.db = state_dir / DB_NAME
        self.sample_period = sample_period
        self.pending_limit = pending_limit
        self.conn: sqlite3.Connection | None = None
        self.lock_fd: int | None = None
        self.journal_mode = ""
        self.migrated: list[int] = []
        self.pending: deque[_Op] = deque()
        self.pending_samples = 0
        self.dropped = {"samples": 0, "other": 0}
        self.failed = 0  # queued writes that hit a permanent error on replay
        self.available = True
        self.last_error: str | None = None
        self.aggs: dict[tuple[str, str, str, int], _Agg] = {}
        self.hwm: dict[str, float] = {}
        self.label_keys: dict[tuple[Any, ...], str] = {}
        self.thread_id = 0
        self._sync = ""

    # ---- open / close
    def open(self) -> None:
        self.thread_id = threading.get_ident()
        self._prepare_dir()
        self._lock()
        try:
            self._connect()
        except BaseException:
            self._close_quietly()
            raise

    def _prepare_dir(self) -> None:
        d = self.state_dir
        try:
            d.mkdir(parents=True, exist_ok=True)
            # a real write, so that root on a read-only mount, a full disk or a quota fail here and not mid-run
            probe = d / f".soakd-write-test-{os.getpid()}-{threading.get_ident()}"
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, b"ok")
                os.fsync(fd)
            finally:
                os.close(fd)
                try:
                    probe.unlink()
                except FileNotFoundError:
                    pass
        except OSError as exc:
            raise _dir_error(d, exc) from None

    def _lock(self) -> None:
        if fcntl is None:  # pragma: no cover
            return
        path = self.state_dir / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise _dir_error(self.state_dir, exc) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = b""
            try:
                holder = os.pread(fd, 64, 0).strip()
            finally:
                os.close(fd)
            who = f"pid {holder.decode(errors='replace')}" if holder else "another process"
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StoreError(
                    f"state dir {self.state_dir} is in use by another soakd ({who}); one soakd writes one state "
                    "dir: stop the other one, or give this one its own --state-dir"
                ) from None
            raise _dir_error(self.state_dir, exc) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.lock_fd = fd

    def _connect(self) -> None:
        db = self.db
        try:
            conn = sqlite3.connect(db, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
        except sqlite3.Error as exc:
            raise _open_error(db, exc) from None
        self.conn = conn
        try:
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            conn.execute("PRAGMA foreign_keys = ON")
            check = conn.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise StoreError(
                    f"{db} is corrupt (quick_check: {check}); move it aside (a fresh one is created) or "
                    f"{_STATE_DIR_HINT}"
                )
            self.journal_mode = str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]).lower()
            conn.execute(f"PRAGMA journal_size_limit = {JOURNAL_SIZE_LIMIT}")
            self.migrated = migrate(conn, db)
            self._set_sync(True)
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(
                "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                [("last_open_unix", repr(time.time())), ("last_open_version", __version__),
                 ("last_open_pid", str(os.getpid()))],
            )
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            raise _open_error(db, exc) from None

    def close(self) -> None:
        error: StoreUnavailable | None = None
        if self.conn is not None:
            try:
                self.flush()
            except StoreUnavailable as exc:
                error = exc
        self._close_quietly()
        if error is not None or self.pending:
            lost = len(self.pending)
            raise StoreUnavailable(
                f"closed {self.db} with {lost} writes not saved ({self.last_error})",
                reason=self.last_error or "", pending=lost, dropped=sum(self.dropped.values()), first=False,
                queued=False,
            )

    def _close_quietly(self) -> None:
        if self.conn is not None:
            try:
                if self.conn.in_transaction:
                    self.conn.execute("ROLLBACK")
                self.conn.close()
            except sqlite3.Error:
                pass
            self.conn = None
        if self.lock_fd is not None:
            try:
                os.close(self.lock_fd)  # releases the flock
            except OSError:
                pass
            self.lock_fd = None

    # ---- the write path
    def _set_sync(self, durable: bool) -> None:
        want = "FULL" if durable else "NORMAL"
        if self._sync != want:
            assert self.conn is not None
            self.conn.execute(f"PRAGMA synchronous = {want}")
            self._sync = want

    def _apply(self, op: _Op) -> Any:
        conn = self.conn
        if conn is None:
            raise StoreError(f"{self.db} is closed")
        self._set_sync(op.durable)
        conn.execute("BEGIN IMMEDIATE")
        try:
            result = op.fn(conn)
            if op.run_id:
                # the open segment's last sign of life: where the gap starts if the process dies now
                conn.execute(
                    "UPDATE segments SET last_seen_unix = MAX(COALESCE(last_seen_unix, 0), ?) "
                    "WHERE run_id = ? AND ended_unix IS NULL", (op.t_unix, op.run_id))
            conn.execute("COMMIT")
        except BaseException:
            try:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            raise
        return result

    def write(self, op: _Op, *, queue: bool = True) -> Any:
        if self.pending:
            try:
                self._replay()
            except sqlite3.Error as exc:
                if queue:
                    self._enqueue(op)
                raise self._unavailable(exc, queued=queue) from None
        try:
            result = self._apply(op)
        except sqlite3.IntegrityError as exc:
            raise StoreError(f"{op.kind} write for run {op.run_id!r} refused by {self.db}: {exc}") from None
        except sqlite3.Error as exc:
            if not _is_transient(exc):
                raise StoreError(f"{op.kind} write for run {op.run_id!r} failed in {self.db}: {exc}") from None
            if queue:
                self._enqueue(op)
            raise self._unavailable(exc, queued=queue) from None
        self.available = True
        return result

    def _replay(self) -> None:
        """Apply queued writes in order; raises the transient sqlite error that stops it."""
        while self.pending:
            op = self.pending[0]
            try:
                self._apply(op)
            except sqlite3.Error as exc:
                if _is_transient(exc):
                    raise
                self.failed += 1  # permanent (e.g. its run is gone): drop it, keep the rest
                self.last_error = f"dropped a queued {op.kind} write: {exc}"
            except StoreError as exc:
                self.failed += 1
                self.last_error = f"dropped a queued {op.kind} write: {exc}"
            self.pending.popleft()
            if op.kind == "samples":
                self.pending_samples -= 1
        self.available = True

    def _enqueue(self, op: _Op) -> None:
        self.pending.append(op)
        if op.kind == "samples":
            self.pending_samples += 1
        while len(self.pending) > self.pending_limit:
            if self.pending_samples:
                victim = next(o for o in self.pending if o.kind == "samples")
                self.pending.remove(victim)
                self.pending_samples -= 1
                self.dropped["samples"] += 1
            else:
                self.pending.popleft()
                self.dropped["other"] += 1

    def _unavailable(self, exc: sqlite3.Error, *, queued: bool) -> StoreUnavailable:
        first = self.available
        self.available = False
        self.last_error = f"{type(exc).__name__}: {exc}"
        kept = (
            f"{len(self.pending)} writes kept in memory and retried in order when it recovers "
            f"(at most {self.pending_limit}; samples are dropped first"
            + (f", {sum(self.dropped.values())} dropped so far)" if any(self.dropped.values()) else ")")
        )
        return StoreUnavailable(
            f"cannot write to {self.db}: {exc}; " + (kept if queued else "this write is not retried; " + kept),
            reason=str(exc), pending=len(self.pending), dropped=sum(self.dropped.values()), first=first,
            queued=queued,
        )

    def retry_pending(self) -> bool:
        if not self.pending:
            return True
        try:
            self._replay()
        except sqlite3.Error as exc:
            raise self._unavailable(exc, queued=True) from None
        return True

    # ---- runs and segments
    def create_run(self, run_id: str, config_json: str, chash: str, target: str | None, model: str | None,
                   server_kind: str | None, version: str, t: float) -> RunRow:
        def fn(conn: sqlite3.Connection) -> None:
            if conn.execute("SELECT 1 FROM runs WHERE id = ?", (run_id,)).fetchone():
                raise StoreError(f"run {run_id} already exists in {self.db}")
            conn.execute(
                "INSERT INTO runs (id, created_unix, config_json, config_hash, target, model, server_kind, version, "
                "status) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'running')",
                (run_id, t, config_json, chash, target, model, server_kind, version))

        self.write(_Op("run", run_id, t, fn), queue=False)
        row = self.get_run(run_id)
        assert row is not None
        return row

    def start_segment(self, run_id: str, reason: str, t: float) -> int:
        def fn(conn: sqlite3.Connection) -> int:
            if not conn.execute("SELECT 1 FROM runs WHERE id = ?", (run_id,)).fetchone():
                raise StoreError(f"no run {run_id} in {self.db}")
            # a segment still open was ended by a crash: it ended at its last sign of life
            conn.execute(
                "UPDATE segments SET ended_unix = MAX(started_unix, COALESCE(last_seen_unix, started_unix)), "
                "end_reason = 'interrupted' WHERE run_id = ? AND ended_unix IS NULL", (run_id,))
            seq = conn.execute("SELECT COALESCE(MAX(seq) + 1, 0) FROM segments WHERE run_id = ?",
                               (run_id,)).fetchone()[0]
            conn.execute(
                "INSERT INTO segments (run_id, seq, started_unix, reason, last_seen_unix) VALUES (?, ?, ?, ?, ?)",
                (run_id, seq, t, reason, t))
            return int(seq)

        return int(self.write(_Op("segment", run_id, t, fn), queue=False))

    def end_segment(self, run_id: str, seq: int, reason: str, t: float) -> None:
        def fn(conn: sqlite3.Connection) -> None:
            conn.execute(
                "UPDATE segments SET ended_unix = ?, end_reason = ?, "
                "last_seen_unix = MAX(COALESCE(last_seen_unix, 0), ?) "
                "WHERE run_id = ? AND seq = ? AND ended_unix IS NULL", (t, reason, t, run_id, seq))

        self.write(_Op("segment", "", t, fn))

    def heartbeat(self, run_id: str, t: float) -> None:
        self.write(_Op("heartbeat", run_id, t, lambda conn: None, durable=False), queue=False)

    def finish_run(self, run_id: str, stop_reason: str, status: str, t: float) -> None:
        try:
            self._flush_samples(lambda key: key[0] == run_id)
        except StoreUnavailable:
            pass  # queued; the finish below queues behind it and raises

        def fn(conn: sqlite3.Connection) -> None:
            cur = conn.execute(
                "UPDATE runs SET status = ?, ended_unix = ?, stop_reason = ? WHERE id = ?",
                (status, t, stop_reason, run_id))
            if cur.rowcount == 0:
                raise StoreError(f"no run {run_id} in {self.db}")
            conn.execute(
                "UPDATE segments SET ended_unix = ?, end_reason = ?, "
                "last_seen_unix = MAX(COALESCE(last_seen_unix, 0), ?) "
                "WHERE run_id = ? AND ended_unix IS NULL", (t, stop_reason, t, run_id))

        self.write(_Op("finish", "", t, fn))

    # ---- windows, baseline, verdict, events
    def save_window(self, run_id: str, idx: int, segment: int, summary_json: str, partial: bool,
                    start: float | None, end: float | None, t: float) -> bool:
        def fn(conn: sqlite3.Connection) -> bool:
            cur = conn.execute(
                "INSERT INTO windows (run_id, idx, segment, start_unix, end_unix, partial, summary_json, saved_unix) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (run_id, idx) DO UPDATE SET segment = excluded.segment, start_unix = excluded.start_unix, "
                "end_unix = excluded.end_unix, partial = excluded.partial, summary_json = excluded.summary_json, "
                "saved_unix = excluded.saved_unix "
                "WHERE windows.partial = 1 OR excluded.partial = 0",  # a final window is never replaced by a partial
                (run_id, idx, segment, start, end, int(partial), summary_json, t))
            return cur.rowcount > 0

        return bool(self.write(_Op("window", run_id, t, fn)))

    def _update_run(self, kind: str, run_id: str, t: float, sql: str, args: tuple[Any, ...]) -> None:
        def fn(conn: sqlite3.Connection) -> None:
            if conn.execute(sql, (*args, run_id)).rowcount == 0:
                raise StoreError(f"no run {run_id} in {self.db}")

        self.write(_Op(kind, run_id, t, fn))

    def set_baseline(self, run_id: str, idx: int, summary_json: str, t: float) -> None:
        self._update_run("baseline", run_id, t, "UPDATE runs SET baseline_window = ?, baseline_json = ? WHERE id = ?",
                         (idx, summary_json))

    def set_verdict(self, run_id: str, verdict_json: str, t: float) -> None:
        self._update_run("verdict", run_id, t, "UPDATE runs SET verdict_json = ? WHERE id = ?", (verdict_json,))

    def add_event(self, run_id: str, t: float, kind: str, severity: str, window: int | None, message: str,
                  data_json: str | None) -> int:
        def fn(conn: sqlite3.Connection) -> int:
            cur = conn.execute(
                'INSERT INTO events (run_id, t_unix, kind, severity, "window", message, data_json) '
                "VALUES (?, ?, ?, ?, ?, ?, ?)", (run_id, t, kind, severity, window, message, data_json))
            return int(cur.lastrowid or 0)

        return int(self.write(_Op("event", run_id, t, fn)))

    # ---- samples
    def _lkey(self, labels: Any) -> str:
        if not isinstance(labels, tuple):
            return _labels_key(labels)
        key = self.label_keys.get(labels)
        if key is None:
            if len(self.label_keys) >= 10_000:  # bounded, whatever the samplers send
                self.label_keys.clear()
            key = self.label_keys[labels] = _labels_key(labels)
        return key

    def add_samples(self, run_id: str, t: float, items: Sequence[Any]) -> int:
        period = self.sample_period
        minute = int(t // period) * period
        aggs = self.aggs
        for item in items:
            if isinstance(item, tuple):
                name, labels, value = item
            else:  # a soakd.samplers.base.Series
                name, labels, value = item.name, item.labels, item.value
            if value is None or isinstance(value, str):
                continue
            v = float(value)
            if not math.isfinite(v):
                continue
            key = (run_id, str(name), self._lkey(labels), minute)
            agg = aggs.get(key)
            if agg is None:
                aggs[key] = _Agg(t, v)
            else:
                agg.add(t, v)
        hwm = max(self.hwm.get(run_id, t), t)
        self.hwm[run_id] = hwm
        return self._flush_samples(lambda key: key[0] == run_id and key[3] + period + SAMPLE_GRACE <= hwm)

    def _flush_samples(self, due: Callable[[tuple[str, str, str, int]], bool]) -> int:
        keys = [k for k in self.aggs if due(k)]
        if not keys:
            return 0
        by_run: dict[str, list[tuple[Any, ...]]] = {}
        for k in keys:
            a = self.aggs.pop(k)
            by_run.setdefault(k[0], []).append((*k, a.count, a.total / a.count, a.min, a.max, a.last))
        error: StoreUnavailable | None = None
        for run_id, rows in by_run.items():
            t_seen = max(r[3] for r in rows) + self.sample_period

            def fn(conn: sqlite3.Connection, rows: list[tuple[Any, ...]] = rows) -> None:
                conn.executemany(_SAMPLE_UPSERT, rows)

            try:
                self.write(_Op("samples", run_id, min(t_seen, self.hwm.get(run_id, t_seen)), fn, durable=False))
            except StoreUnavailable as exc:
                error = exc
        if error is not None:
            raise error
        return len(keys)

    def flush(self) -> None:
        self._flush_samples(lambda key: True)
        self.retry_pending()

    # ---- reads (the writer's own connection: sees everything committed)
    def _c(self) -> sqlite3.Connection:
        if self.conn is None:
            raise StoreError(f"{self.db} is closed")
        return self.conn

    def get_run(self, run_id: str) -> RunRow | None:
        return _q_get_run(self._c(), run_id)

    def list_runs(self) -> list[RunRow]:
        return _q_list_runs(self._c())

    def latest_unfinished_run(self) -> RunRow | None:
        return _q_latest_unfinished(self._c())

    def load_segments(self, run_id: str) -> list[SegmentRow]:
        return _q_segments(self._c(), run_id)

    def load_windows(self, run_id: str, include_partial: bool) -> list[dict[str, Any]]:
        return _q_windows(self._c(), run_id, include_partial)

    def load_baseline(self, run_id: str) -> tuple[int, dict[str, Any]] | None:
        return _q_baseline(self._c(), run_id)

    def load_events(self, run_id: str, kinds: Iterable[str] | None) -> list[EventRow]:
        return _q_events(self._c(), run_id, kinds)

    def load_samples(self, run_id: str, series: str | None, labels: Any) -> list[SampleRow]:
        return _q_samples(self._c(), run_id, series, labels)

    def integrity_check(self) -> str:
        return "; ".join(str(r[0]) for r in self._c().execute("PRAGMA integrity_check"))

    def execute(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return list(self._c().execute(sql, args))


# --------------------------------------------------------------------------------------------
# the public, async face


class RunStore:
    """The soak's SQLite store. Open with ``await RunStore.open(state_dir)``; every method is a
    coroutine that runs on the store's own thread; writes are committed before they return."""

    def __init__(self, writer: _Writer, executor: ThreadPoolExecutor,
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
        writer = _Writer(Path(state_dir), int(sample_period), int(pending_limit))
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
                         version: str = __version__, *, created_unix: float | None = None) -> RunRow:
        """A new run (status 'running'). Not queued when the disk fails: a run that cannot be
        recorded should not start. ``config_hash`` defaults to :func:`hash_config` of the config."""
        text = config_json if isinstance(config_json, str) else _dumps(config_json, sort_keys=True)
        chash = config_hash or hash_config(text)
        t = time.time() if created_unix is None else created_unix
        return await self._call(self._w.create_run, run_id, text, chash, target, model, server_kind, version, t)

    async def latest_unfinished_run(self) -> RunRow | None:
        """The newest run still 'running' (a soakd that died or was rescheduled): resume it unless --new-run."""
        return await self._call(self._w.latest_unfinished_run)

    async def get_run(self, run_id: str) -> RunRow | None:
        return await self._call(self._w.get_run, run_id)

    async def list_runs(self) -> list[RunRow]:
        """Newest first."""
        return await self._call(self._w.list_runs)

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
    async def save_window(self, run_id: str, idx: int, segment: int, summary: Mapping[str, Any],
                          partial: bool | None = None, *, start_unix: float | None = None,
                          end_unix: float | None = None) -> bool:
        """Upsert window ``idx`` (overall and per-scenario figures inside ``summary``). A partial
        window may be replaced by a later version; a final one only by a final one (returns False
        when a partial version is refused). start/end default to the summary's start_unix and
        start_unix + duration_seconds."""
        is_partial = bool(summary.get("partial", False)) if partial is None else bool(partial)
        start = start_unix if start_unix is not None else summary.get("start_unix")
        end = end_unix
        if end is None and start is not None and summary.get("duration_seconds") is not None:
            end = float(start) + float(summary["duration_seconds"])
        text = _dumps(summary)
        return await self._call(self._w.save_window, run_id, int(idx), int(segment), text, is_partial, start, end,
                                time.time())

    async def load_windows(self, run_id: str, *, include_partial: bool = True) -> list[dict[str, Any]]:
        """Window summaries in index order; ``window``, ``partial`` and ``segment`` are the stored values."""
        return await self._call(self._w.load_windows, run_id, include_partial)

    async def set_baseline(self, run_id: str, idx: int, summary: Mapping[str, Any]) -> None:
        await self._call(self._w.set_baseline, run_id, int(idx), _dumps(summary), time.time())

    async def load_baseline(self, run_id: str) -> tuple[int, dict[str, Any]] | None:
        """(window index, summary) of the run's baseline, or None before one was chosen."""
        return await self._call(self._w.load_baseline, run_id)

    async def set_verdict(self, run_id: str, verdict: Mapping[str, Any]) -> None:
        await self._call(self._w.set_verdict, run_id, _dumps(verdict), time.time())

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
                                None if data is None else _dumps(data))

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


# --------------------------------------------------------------------------------------------
# the synchronous read-only face, for `soakd report` and tools


class StoreReader:
    """Read-only access to a state dir (or a soakd.db path), synchronous; safe beside a running soakd."""

    def __init__(self, path: Path | str) -> None:
        p = Path(path)
        db = p / DB_NAME if p.is_dir() or p.suffix != ".db" else p
        self.db = db
        if not db.is_file():
            raise StoreError(f"no soakd state at {p} ({DB_NAME} not found); pass the --state-dir the run used")
        self.conn = self._connect(db)
        try:
            version = _user_version(self.conn)
            if version > SCHEMA_VERSION:
                migrate(self.conn, db)  # refuses with the 'written by a newer soakd' message
            elif version < SCHEMA_VERSION:
                self.conn.close()
                self._upgrade(db, version)
                self.conn = self._connect(db)
        except sqlite3.Error as exc:
            self.conn.close()
            raise _open_error(db, exc) from None
        except BaseException:
            self.conn.close()
            raise

    @staticmethod
    def _connect(db: Path) -> sqlite3.Connection:
        uri = "file:" + pathname2url(str(db.resolve()))
        try:
            conn = sqlite3.connect(uri + "?mode=ro", uri=True, timeout=BUSY_TIMEOUT_MS / 1000)
            conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
            return conn
        except sqlite3.OperationalError as exc:
            if _errcode(exc) not in (_SQLITE_CANTOPEN, _SQLITE_READONLY):
                raise _open_error(db, exc) from None
        # a WAL database in a directory we cannot write (a copied artifact, a read-only mount) and
        # no -shm file: nobody can be writing it, so read it as immutable
        try:
            conn = sqlite3.connect(uri + "?mode=ro&immutable=1", uri=True)
            conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
            return conn
        except sqlite3.Error as exc:
            raise _open_error(db, exc) from None

    @staticmethod
    def _upgrade(db: Path, version: int) -> None:
        try:
            conn = sqlite3.connect(db, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
            try:
                conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
                migrate(conn, db)
            finally:
                conn.close()
        except sqlite3.Error as exc:
            raise StoreError(
                f"{db} has schema v{version} (older soakd) and could not be upgraded to v{SCHEMA_VERSION} "
                f"({exc}); run this soakd once with write access to it (e.g. `soakd report` on a copy)"
            ) from None

    def __enter__(self) -> StoreReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.conn.close()

    def list_runs(self) -> list[RunRow]:
        return _q_list_runs(self.conn)

    def get_run(self, run_id: str) -> RunRow | None:
        return _q_get_run(self.conn, run_id)

    def latest_run(self) -> RunRow | None:
        runs = self.list_runs()
        return runs[0] if runs else None

    def latest_unfinished_run(self) -> RunRow | None:
        return _q_latest_unfinished(self.conn)

    def load_segments(self, run_id: str) -> list[SegmentRow]:
        return _q_segments(self.conn, run_id)

    def load_windows(self, run_id: str, *, include_partial: bool = True) -> list[dict[str, Any]]:
        return _q_windows(self.conn, run_id, include_partial)

    def load_baseline(self, run_id: str) -> tuple[int, dict[str, Any]] | None:
        return _q_baseline(self.conn, run_id)

    def load_events(self, run_id: str, kinds: Iterable[str] | None = None) -> list[EventRow]:
        return _q_events(self.conn, run_id, kinds)

    def load_samples(self, run_id: str, series: str | None = None,
                     labels: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None) -> list[SampleRow]:
        return _q_samples(self.conn, run_id, series, labels)

"""Schema of the run store: constants, errors, the tables and the versioned migrations."""


from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

from soakd import __version__

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
STATE_DIR_HINT = (
    "pass --state-dir (SOAKD_RUN__STATE_DIR) with a writable directory; "
    "in Kubernetes mount a PVC or emptyDir there (the container default is /var/lib/soakd)"
)


class StoreError(Exception):
    """The store cannot do what was asked (and retrying will not help by itself)."""


class StoreReplaced(StoreError):
    """The database file this soakd writes was deleted or replaced under it (a cleanup job, an
    operator): noticed at the next write or heartbeat; the run is re-created from memory."""


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


_V3 = (
    # what a run is: a soak, or a sweep of load steps (soakd sweep: one window per step, its result
    # as the verdict). Resuming and the report's default pick soaks only.
    "ALTER TABLE runs ADD COLUMN kind TEXT NOT NULL DEFAULT 'soak'",
)

RUN_KINDS = ("soak", "sweep")

_V4 = (
    # soakd batch: an OpenAI Batch API input file sent with resumable accounting
    """CREATE TABLE batches (
        id           TEXT PRIMARY KEY,
        created_unix REAL NOT NULL,
        input_path   TEXT NOT NULL,
        input_sha256 TEXT NOT NULL,
        target       TEXT,
        config_json  TEXT NOT NULL,
        status       TEXT NOT NULL DEFAULT 'running' CHECK (status IN ('running', 'finished', 'failed')),
        ended_unix   REAL,
        result_json  TEXT
    )""",
    """CREATE TABLE batch_items (
        batch_id      TEXT NOT NULL REFERENCES batches (id) ON DELETE CASCADE,
        custom_id     TEXT NOT NULL,
        line_no       INTEGER NOT NULL,
        state         TEXT NOT NULL CHECK (state IN ('done', 'failed', 'invalid')),
        tries         INTEGER NOT NULL DEFAULT 0,
        status_code   INTEGER,
        request_id    TEXT,
        response_json TEXT,
        error_json    TEXT,
        flags         TEXT,
        updated_unix  REAL NOT NULL,
        PRIMARY KEY (batch_id, custom_id)
    ) WITHOUT ROWID""",
)
BATCH_ITEM_STATES = ("done", "failed", "invalid")

_V5 = (
    # A/B runs: the windows of the targets after the first (the reference's are in windows)
    """CREATE TABLE target_windows (
        run_id       TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
        target       TEXT NOT NULL,
        idx          INTEGER NOT NULL,
        summary_json TEXT NOT NULL,
        saved_unix   REAL NOT NULL,
        PRIMARY KEY (run_id, target, idx)
    ) WITHOUT ROWID""",
)


_V6 = (
    # one windows table keyed by target: the reference's windows (target '') and each other target's
    # of an A/B run (its name), with the same columns; target_windows folds into it
    """CREATE TABLE windows_v6 (
        run_id       TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
        target       TEXT NOT NULL DEFAULT '',
        idx          INTEGER NOT NULL,
        segment      INTEGER NOT NULL DEFAULT 0,
        start_unix   REAL,
        end_unix     REAL,
        partial      INTEGER NOT NULL DEFAULT 0,
        summary_json TEXT NOT NULL,
        saved_unix   REAL NOT NULL,
        PRIMARY KEY (run_id, target, idx)
    )""",
    """INSERT INTO windows_v6 (run_id, target, idx, segment, start_unix, end_unix, partial, summary_json, saved_unix)
       SELECT run_id, '', idx, segment, start_unix, end_unix, partial, summary_json, saved_unix FROM windows""",
    """INSERT INTO windows_v6 (run_id, target, idx, segment, start_unix, end_unix, partial, summary_json, saved_unix)
       SELECT run_id, target, idx, COALESCE(json_extract(summary_json, '$.segment'), 0),
              json_extract(summary_json, '$.start_unix'),
              json_extract(summary_json, '$.start_unix') + json_extract(summary_json, '$.duration_seconds'),
              COALESCE(json_extract(summary_json, '$.partial'), 0), summary_json, saved_unix
       FROM target_windows""",
    "DROP TABLE target_windows",
    "DROP TABLE windows",
    "ALTER TABLE windows_v6 RENAME TO windows",
)
REFERENCE_TARGET = ""  # the windows table's target of the run's reference (or only) target


def _statements(stmts: tuple[str, ...]) -> Callable[[sqlite3.Connection], None]:
    """A migration that executes ``stmts`` in order (inside migrate()'s transaction)."""
    def apply(conn: sqlite3.Connection) -> None:
        for stmt in stmts:
            conn.execute(stmt)
    return apply


# MIGRATIONS[v] brings a store from schema v to v + 1
MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = tuple(
    _statements(v) for v in (_V1, _V2, _V3, _V4, _V5, _V6))
SCHEMA_VERSION = len(MIGRATIONS)


def user_version(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA user_version").fetchone()[0])


def migrate(conn: sqlite3.Connection, db: Path | str, target: int = SCHEMA_VERSION) -> list[int]:
    """Bring a connection (autocommit mode) to schema ``target``; returns the versions applied."""
    current = user_version(conn)
    if current > SCHEMA_VERSION:
        raise StoreError(
            f"{db} was written by a newer soakd (schema v{current}; this soakd {__version__} knows up to "
            f"v{SCHEMA_VERSION}); upgrade soakd, or pass --state-dir with another directory"
        )
    applied: list[int] = []
    for version in range(current, target):
        conn.execute("BEGIN IMMEDIATE")
        try:
            if user_version(conn) != version:  # someone else migrated meanwhile
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

"""The read-only face of the store, for ``soakd report`` and tools (WAL: reads while a soak writes)."""


from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.request import pathname2url

from soakd.core.summary import WindowSummary
from soakd.store import rows
from soakd.store.rows import (
    SQLITE_CANTOPEN,
    SQLITE_READONLY,
    EventRow,
    RunRow,
    SampleRow,
    SegmentRow,
    errcode,
    open_error,
)
from soakd.store.schema import BUSY_TIMEOUT_MS, DB_NAME, SCHEMA_VERSION, StoreError, migrate, user_version

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
            version = user_version(self.conn)
            if version > SCHEMA_VERSION:
                migrate(self.conn, db)  # refuses with the 'written by a newer soakd' message
            elif version < SCHEMA_VERSION:
                self.conn.close()
                self._upgrade(db, version)
                self.conn = self._connect(db)
        except sqlite3.Error as exc:
            self.conn.close()
            raise open_error(db, exc) from None
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
            if errcode(exc) not in (SQLITE_CANTOPEN, SQLITE_READONLY):
                raise open_error(db, exc) from None
        # a WAL database in a directory we cannot write (a copied artifact, a read-only mount) and
        # no -shm file: nobody can be writing it, so read it as immutable
        try:
            conn = sqlite3.connect(uri + "?mode=ro&immutable=1", uri=True)
            conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
            return conn
        except sqlite3.Error as exc:
            raise open_error(db, exc) from None

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

    def list_runs(self, kind: str | None = "soak") -> list[RunRow]:
        """Newest first; soaks by default (``kind`` sweep, or None for all)."""
        return rows.q_list_runs(self.conn, kind)

    def get_run(self, run_id: str) -> RunRow | None:
        return rows.q_get_run(self.conn, run_id)

    def latest_run(self) -> RunRow | None:
        runs = self.list_runs()
        return runs[0] if runs else None

    def latest_unfinished_run(self) -> RunRow | None:
        return rows.q_latest_unfinished(self.conn)

    def load_segments(self, run_id: str) -> list[SegmentRow]:
        return rows.q_segments(self.conn, run_id)

    def load_windows(self, run_id: str, *, include_partial: bool = True) -> list[WindowSummary]:
        return rows.q_windows(self.conn, run_id, include_partial)

    def load_target_windows(self, run_id: str) -> dict[str, list[WindowSummary]]:
        """A/B runs: target -> its windows in index order (the reference's are load_windows)."""
        return rows.q_target_windows(self.conn, run_id)

    def load_baseline(self, run_id: str) -> tuple[int, WindowSummary] | None:
        return rows.q_baseline(self.conn, run_id)

    def load_events(self, run_id: str, kinds: Iterable[str] | None = None) -> list[EventRow]:
        return rows.q_events(self.conn, run_id, kinds)

    def load_samples(self, run_id: str, series: str | None = None,
                     labels: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None) -> list[SampleRow]:
        return rows.q_samples(self.conn, run_id, series, labels)

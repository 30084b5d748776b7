"""The store's one writer: a connection that lives on its own thread (see ``soakd.store``).

Longer than 500 lines: the write path, the bounded retry queue for a full disk and the per-period
sample aggregation share the connection's state and its single thread; split, they would reach
into each other's internals."""


from __future__ import annotations

import errno
import json
import math
import os
import sys
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from soakd import __version__
from soakd.core.summary import WindowSummary
from soakd.store import rows
from soakd.store.rows import (
    EventRow,
    RunRow,
    SampleRow,
    SegmentRow,
    dir_error,
    is_transient,
    labels_key,
    open_error,
)
from soakd.store.schema import (
    BUSY_TIMEOUT_MS,
    DB_NAME,
    JOURNAL_SIZE_LIMIT,
    LOCK_NAME,
    SAMPLE_GRACE,
    STATE_DIR_HINT,
    StoreError,
    StoreReplaced,
    StoreUnavailable,
    migrate,
)

try:  # POSIX only; without it the one-writer rule is not enforced across processes
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

# --------------------------------------------------------------------------------------------
# the writer: everything below runs on the store's one thread


@dataclass(eq=False, slots=True)
class _Op:
    kind: str  # run | segment | window | baseline | event | verdict | finish | samples | heartbeat
    run_id: str
    t_unix: float
    fn: Callable[[sqlite3.Connection], Any]
    durable: bool = True
    call: tuple[str, tuple[Any, ...]] | None = None  # (Writer method, its JSON arguments): kept in UNSAVED_NAME


UNSAVED_NAME = DB_NAME + ".unsaved.jsonl"  # writes soakd could not save at its end, read back at the next open
REPLAYABLE = ("save_window", "end_segment", "finish_run", "set_baseline", "set_verdict", "add_event")


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


class Writer:
    """Owns the connection. Not thread-safe by design: only the store's executor thread calls it."""

    def __init__(self, state_dir: Path, sample_period: int, pending_limit: int) -> None:
        self.state_dir = state_dir
        self.db = state_dir / DB_NAME
        self.sample_period = sample_period
        self.pending_limit = pending_limit
        self.conn: sqlite3.Connection | None = None
        self.lock_fd: int | None = None
        self.db_fd: int | None = None  # the database file itself, flock'ed: one writer even without soakd.lock
        self.db_ino: tuple[int, int] | None = None  # (device, inode) of the database this writer opened
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
        self.read_back_result = (0, 0)  # (applied, left) of UNSAVED_NAME at open

    # ---- open / close
    def open(self) -> None:
        self.thread_id = threading.get_ident()
        self._prepare_dir()
        self._lock()
        try:
            self._connect()
            self._lock_db()
            self.read_back_result = self.read_back()
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
            raise dir_error(d, exc) from None

    def _lock(self) -> None:
        if fcntl is None:  # pragma: no cover
            return
        path = self.state_dir / LOCK_NAME
        for _ in range(5):  # the lock file may be replaced between open and flock: lock the file at the path
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise dir_error(self.state_dir, exc) from None
            self._flock(fd, path)
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except OSError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.lock_fd = fd

    def _lock_db(self) -> None:
        """flock the database file too (SQLite's own locks are fcntl locks: independent of flock), so
        that a second soakd is refused even when soakd.lock was removed (a cleanup job, an init
        container); and note which file this is, to see it deleted or replaced later."""
        if fcntl is None:  # pragma: no cover
            return
        try:
            fd = os.open(self.db, os.O_RDONLY)
        except OSError as exc:
            raise dir_error(self.state_dir, exc) from None
        self._flock(fd, self.db)
        st = os.fstat(fd)
        self.db_fd, self.db_ino = fd, (st.st_dev, st.st_ino)

    def check_db(self) -> None:
        """StoreReplaced when the database at the path is no longer the file this writer opened."""
        if self.db_ino is None:
            return
        try:
            st = os.stat(self.db)
        except FileNotFoundError:
            raise StoreReplaced(f"{self.db} was deleted while soakd was writing it") from None
        except OSError:
            return
        if (st.st_dev, st.st_ino) != self.db_ino:
            raise StoreReplaced(f"{self.db} was replaced by another file while soakd was writing it")

    def _flock(self, fd: int, path: Path) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = b""
            try:
                if path.name == LOCK_NAME:
                    holder = os.pread(fd, 64, 0).strip()
            finally:
                os.close(fd)
            who = f"pid {holder.decode(errors='replace')}" if holder else "another process"
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StoreError(
                    f"state dir {self.state_dir} is in use by another soakd ({who}); one soakd writes one state "
                    "dir: stop the other one, or give this one its own --state-dir"
                ) from None
            raise dir_error(self.state_dir, exc) from None

    def _connect(self) -> None:
        db = self.db
        try:
            conn = sqlite3.connect(db, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
        except sqlite3.Error as exc:
            raise open_error(db, exc) from None
        self.conn = conn
        try:
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            conn.execute("PRAGMA foreign_keys = ON")
            check = conn.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise StoreError(
                    f"{db} is corrupt (quick_check: {check}); move it aside (a fresh one is created) or "
                    f"{STATE_DIR_HINT}"
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
            raise open_error(db, exc) from None

    def close(self) -> None:
        error: StoreUnavailable | None = None
        if self.conn is not None:
            try:
                self.flush()
            except StoreUnavailable as exc:
                error = exc
        kept, dropped, where = self.spill() if self.pending else (0, 0, "")
        self._close_quietly()
        if error is not None or kept or dropped:
            raise StoreUnavailable(
                f"closed {self.db} with {kept + dropped} writes not saved ({self.last_error})"
                + (f"; {kept} kept in {where}, read back at the next start" if kept else ""),
                reason=self.last_error or "", pending=kept + dropped, dropped=sum(self.dropped.values()) + dropped,
                first=False, queued=False,
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
        for fd in (self.db_fd, self.lock_fd):
            if fd is not None:
                try:
                    os.close(fd)  # releases the flock
                except OSError:
                    pass
        self.lock_fd = self.db_fd = None
        self.db_ino = None

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
        self.check_db()
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
            if not is_transient(exc):
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
                if is_transient(exc):
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

    # ---- writes that could not be saved at the end: kept beside the database, read back at the next open
    def spill(self) -> tuple[int, int, str]:
        """The queued writes that can be replayed (windows, events, the verdict, the end of the run),
        appended to ``UNSAVED_NAME`` beside the database, or, where that cannot be written either (the
        same full disk), to stderr as JSON lines. (kept, dropped, where); the queue is emptied."""
        lines = [json.dumps({"call": op.call[0], "args": list(op.call[1])}) for op in self.pending if op.call]
        dropped = len(self.pending) - len(lines)  # telemetry samples: not kept
        self.pending.clear()
        self.pending_samples = 0
        if not lines:
            return 0, dropped, ""
        path = self.state_dir / UNSAVED_NAME
        text = "".join(line + "\n" for line in lines)
        try:
            with open(path, "a", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            return len(lines), dropped, str(path)
        except OSError:
            try:
                sys.stderr.write(f"soakd: {len(lines)} writes of {self.db} could not be saved; they follow as JSON "
                                 f"lines (put them in {path} and the next start reads them back):\n{text}")
                sys.stderr.flush()
            except (OSError, ValueError):
                return 0, dropped + len(lines), ""
            return len(lines), dropped, "stderr"

    def read_back(self) -> tuple[int, int]:
        """Apply the writes of ``UNSAVED_NAME`` (an earlier soakd could not save them), in order, and
        remove the file; on a transient error keep the rest for the next open. (applied, left)."""
        path = self.state_dir / UNSAVED_NAME
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return 0, 0
        except OSError as exc:
            raise dir_error(self.state_dir, exc) from None
        lines = [ln for ln in text.splitlines() if ln.strip()]
        applied = 0
        for i, line in enumerate(lines):
            try:
                doc = json.loads(line)
                name, args = doc["call"], doc["args"]
                if name not in REPLAYABLE:
                    raise ValueError(f"not a replayable write: {name!r}")
            except (ValueError, KeyError, TypeError) as exc:
                self.last_error = f"{path} line {i + 1} skipped: {exc}"
                continue
            try:
                getattr(self, name)(*args)
            except StoreUnavailable:  # the disk is still full: the queued write is the file's again
                self.pending.clear()
                self.pending_samples = 0
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_text("".join(x + "\n" for x in lines[i:]), encoding="utf-8")
                os.replace(tmp, path)
                return applied, len(lines) - i
            except StoreError as exc:  # permanent (its run is gone): skipped
                self.last_error = f"{path} line {i + 1} skipped: {exc}"
                continue
            applied += 1
        path.unlink()
        return applied, 0

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
                   server_kind: str | None, version: str, t: float, kind: str = "soak") -> RunRow:
        def fn(conn: sqlite3.Connection) -> None:
            if conn.execute("SELECT 1 FROM runs WHERE id = ?", (run_id,)).fetchone():
                raise StoreError(f"run {run_id} already exists in {self.db}")
            conn.execute(
                "INSERT INTO runs (id, created_unix, config_json, config_hash, target, model, server_kind, version, "
                "status, kind) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'running', ?)",
                (run_id, t, config_json, chash, target, model, server_kind, version, kind))

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

        self.write(_Op("segment", "", t, fn, call=("end_segment", (run_id, seq, reason, t))))

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

        self.write(_Op("finish", "", t, fn, call=("finish_run", (run_id, stop_reason, status, t))))

    # ---- windows, baseline, verdict, events
    def save_window(self, run_id: str, idx: int, segment: int, summary_json: str, partial: bool,
                    start: float | None, end: float | None, t: float, target: str = "") -> bool:
        def fn(conn: sqlite3.Connection) -> bool:
            cur = conn.execute(
                "INSERT INTO windows (run_id, target, idx, segment, start_unix, end_unix, partial, summary_json, "
                "saved_unix) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (run_id, target, idx) DO UPDATE SET segment = excluded.segment, "
                "start_unix = excluded.start_unix, end_unix = excluded.end_unix, partial = excluded.partial, "
                "summary_json = excluded.summary_json, saved_unix = excluded.saved_unix "
                "WHERE windows.partial = 1 OR excluded.partial = 0",  # a final window is never replaced by a partial
                (run_id, target, idx, segment, start, end, int(partial), summary_json, t))
            return cur.rowcount > 0

        return bool(self.write(_Op("window", run_id, t, fn, call=(
            "save_window", (run_id, idx, segment, summary_json, partial, start, end, t, target)))))

    def _update_run(self, kind: str, run_id: str, t: float, sql: str, args: tuple[Any, ...],
                    call: tuple[str, tuple[Any, ...]]) -> None:
        def fn(conn: sqlite3.Connection) -> None:
            if conn.execute(sql, (*args, run_id)).rowcount == 0:
                raise StoreError(f"no run {run_id} in {self.db}")

        self.write(_Op(kind, run_id, t, fn, call=call))

    def set_baseline(self, run_id: str, idx: int, summary_json: str, t: float) -> None:
        self._update_run("baseline", run_id, t, "UPDATE runs SET baseline_window = ?, baseline_json = ? WHERE id = ?",
                         (idx, summary_json), ("set_baseline", (run_id, idx, summary_json, t)))

    def set_verdict(self, run_id: str, verdict_json: str, t: float) -> None:
        self._update_run("verdict", run_id, t, "UPDATE runs SET verdict_json = ? WHERE id = ?", (verdict_json,),
                         ("set_verdict", (run_id, verdict_json, t)))

    def add_event(self, run_id: str, t: float, kind: str, severity: str, window: int | None, message: str,
                  data_json: str | None) -> int:
        def fn(conn: sqlite3.Connection) -> int:
            cur = conn.execute(
                'INSERT INTO events (run_id, t_unix, kind, severity, "window", message, data_json) '
                "VALUES (?, ?, ?, ?, ?, ?, ?)", (run_id, t, kind, severity, window, message, data_json))
            return int(cur.lastrowid or 0)

        return int(self.write(_Op("event", run_id, t, fn, call=(
            "add_event", (run_id, t, kind, severity, window, message, data_json)))))

    # ---- samples
    def _lkey(self, labels: Any) -> str:
        if not isinstance(labels, tuple):
            return labels_key(labels)
        key = self.label_keys.get(labels)
        if key is None:
            if len(self.label_keys) >= 10_000:  # bounded, whatever the samplers send
                self.label_keys.clear()
            key = self.label_keys[labels] = labels_key(labels)
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
        for run_id, batch in by_run.items():
            t_seen = max(r[3] for r in batch) + self.sample_period

            def fn(conn: sqlite3.Connection, batch: list[tuple[Any, ...]] = batch) -> None:
                conn.executemany(_SAMPLE_UPSERT, batch)

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

    # ---- A/B: the other targets' windows (the same windows table, keyed by target)
    def load_target_windows(self, run_id: str) -> dict[str, list[WindowSummary]]:
        return rows.q_target_windows(self._c(), run_id)

    # ---- batches (soakd batch)
    def create_batch(self, batch_id: str, input_path: str, sha: str, target: str | None, config_json: str,
                     t: float) -> None:
        def fn(conn: sqlite3.Connection) -> None:
            conn.execute("INSERT INTO batches (id, created_unix, input_path, input_sha256, target, config_json) "
                         "VALUES (?, ?, ?, ?, ?, ?)", (batch_id, t, input_path, sha, target, config_json))

        self.write(_Op("batch", "", t, fn), queue=False)

    def latest_batch(self, sha: str) -> tuple[str, str] | None:
        row = self._c().execute("SELECT id, status FROM batches WHERE input_sha256 = ? "
                                "ORDER BY created_unix DESC, rowid DESC LIMIT 1", (sha,)).fetchone()
        return (str(row[0]), str(row[1])) if row else None

    def save_batch_items(self, batch_id: str, items: Sequence[tuple[Any, ...]], t: float) -> None:
        """Upsert finished items: (custom_id, line_no, state, tries, status_code, request_id,
        response_json, error_json, flags)."""
        def fn(conn: sqlite3.Connection) -> None:
            conn.executemany(
                "INSERT INTO batch_items (batch_id, custom_id, line_no, state, tries, status_code, request_id, "
                "response_json, error_json, flags, updated_unix) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (batch_id, custom_id) DO UPDATE SET line_no = excluded.line_no, state = excluded.state, "
                "tries = excluded.tries, status_code = excluded.status_code, request_id = excluded.request_id, "
                "response_json = excluded.response_json, error_json = excluded.error_json, flags = excluded.flags, "
                "updated_unix = excluded.updated_unix",
                [(batch_id, *item, t) for item in items])

        self.write(_Op("batch_items", "", t, fn))

    def load_batch_items(self, batch_id: str) -> list[tuple[Any, ...]]:
        return list(self._c().execute(
            "SELECT custom_id, line_no, state, tries, status_code, request_id, response_json, error_json, flags "
            "FROM batch_items WHERE batch_id = ? ORDER BY line_no", (batch_id,)))

    def finish_batch(self, batch_id: str, status: str, result_json: str, t: float) -> None:
        def fn(conn: sqlite3.Connection) -> None:
            conn.execute("UPDATE batches SET status = ?, ended_unix = ?, result_json = ? WHERE id = ?",
                         (status, t, result_json, batch_id))

        self.write(_Op("batch", "", t, fn))

    # ---- reads (the writer's own connection: sees everything committed)
    def _c(self) -> sqlite3.Connection:
        if self.conn is None:
            raise StoreError(f"{self.db} is closed")
        return self.conn

    def get_run(self, run_id: str) -> RunRow | None:
        return rows.q_get_run(self._c(), run_id)

    def list_runs(self, kind: str | None = "soak") -> list[RunRow]:
        return rows.q_list_runs(self._c(), kind)

    def latest_unfinished_run(self) -> RunRow | None:
        return rows.q_latest_unfinished(self._c())

    def load_segments(self, run_id: str) -> list[SegmentRow]:
        return rows.q_segments(self._c(), run_id)

    def load_windows(self, run_id: str, include_partial: bool, target: str = "") -> list[WindowSummary]:
        return rows.q_windows(self._c(), run_id, include_partial, target)

    def load_baseline(self, run_id: str) -> tuple[int, WindowSummary] | None:
        return rows.q_baseline(self._c(), run_id)

    def load_events(self, run_id: str, kinds: Iterable[str] | None) -> list[EventRow]:
        return rows.q_events(self._c(), run_id, kinds)

    def load_samples(self, run_id: str, series: str | None, labels: Any) -> list[SampleRow]:
        return rows.q_samples(self._c(), run_id, series, labels)

    def integrity_check(self) -> str:
        return "; ".join(str(r[0]) for r in self._c().execute("PRAGMA integrity_check"))

    def execute(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return list(self._c().execute(sql, args))

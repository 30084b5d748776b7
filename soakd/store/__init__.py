"""SQLite persistence for soak runs: runs, segments, windows, events, downsampled samples.

Modules: ``schema`` (tables, migrations, errors), ``rows`` (what is returned, shared queries),
``writer`` (the one connection on its thread), ``runstore`` (:class:`RunStore`, the async face),
``reader`` (:class:`StoreReader`, read-only). Window summaries go in and come out as
:class:`~soakd.core.summary.WindowSummary`.

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

from soakd.store.reader import StoreReader
from soakd.store.rows import EventRow, RunRow, SampleRow, SegmentRow, hash_config, segment_gaps
from soakd.store.runstore import RunStore
from soakd.store.schema import (
    DB_NAME,
    EVENT_KINDS,
    LOCK_NAME,
    MIGRATIONS,
    PENDING_LIMIT,
    RUN_STATUSES,
    SAMPLE_PERIOD,
    SCHEMA_VERSION,
    SEVERITIES,
    StoreError,
    StoreReplaced,
    StoreUnavailable,
    migrate,
)

__all__ = [
    "DB_NAME",
    "EVENT_KINDS",
    "LOCK_NAME",
    "MIGRATIONS",
    "PENDING_LIMIT",
    "RUN_STATUSES",
    "SAMPLE_PERIOD",
    "SCHEMA_VERSION",
    "SEVERITIES",
    "EventRow",
    "RunRow",
    "RunStore",
    "SampleRow",
    "SegmentRow",
    "StoreError",
    "StoreReplaced",
    "StoreReader",
    "StoreUnavailable",
    "hash_config",
    "migrate",
    "segment_gaps",
]

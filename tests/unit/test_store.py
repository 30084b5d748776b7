"""The SQLite store: schema and migrations, runs/segments/windows/events/samples, resume helpers,
fail-fast at start, a full disk mid-run, SIGKILL at any moment, the read-only report face."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from helpers import fill_up, make_room

from soakd.store import (
    SCHEMA_VERSION,
    RunStore,
    StoreError,
    StoreReader,
    StoreUnavailable,
    hash_config,
    segment_gaps,
)

REPO = Path(__file__).resolve().parents[2]
T0 = 1_700_000_040  # a minute boundary


def window_summary(idx: int, *, partial: bool = False, requests: int = 100, start: float = 1_700_000_000.0,
                   pad: int = 0) -> dict[str, Any]:
    """Shaped like a stored window summary (soakd.core.summary.WindowSummary.dump())."""
    q = {"p50": 0.2 + idx / 1000, "p95": 0.5 + idx / 1000, "p99": 0.9, "mean": 0.25, "count": requests}
    out: dict[str, Any] = {
        "window": idx, "start_unix": start + idx * 1800.0, "duration_seconds": 1800.0, "partial": partial,
        "requests": requests, "outcomes": {"ok": requests}, "error_rate": 0.0,
        "mix": {"short_chat": 0.5, "long_context": 0.5}, "e2e_seconds": q, "ttft_seconds": q, "itl_seconds": q,
        "requests_per_second": requests / 1800, "output_tokens_per_second": 12.5, "prompt_tokens": 1000,
        "completion_tokens": 5000, "late_records": 0,
        "scenarios": {n: {"requests": requests // 2, "e2e_seconds": q, "ttft_seconds": q, "itl_seconds": q,
                          "error_rate": 0.0} for n in ("short_chat", "long_context")},
    }
    if pad:
        out["pad"] = "x" * pad
    return out


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[RunStore]:
    s = await RunStore.open(tmp_path / "state")
    yield s
    await s.close()


async def new_run(store: RunStore, run_id: str = "run1") -> int:
    await store.create_run(run_id, {"run": {"duration": 86400}}, target="http://127.0.0.1:8000/v1", model="m",
                           server_kind="vllm")
    return await store.start_segment(run_id)


def table_columns(conn: sqlite3.Connection) -> dict[str, list[tuple[str, str, int, int]]]:
    names = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
    return {n: [(c[1], c[2], c[3], c[5]) for c in conn.execute(f"PRAGMA table_info({n})")] for n in names}


# ---------------------------------------------------------------------------------------------
# schema, pragmas, the one writer thread


async def test_open_creates_a_versioned_wal_database_owned_by_one_thread(tmp_path: Path) -> None:
    state = tmp_path / "a" / "b"
    store = await RunStore.open(state)
    try:
        assert store.path == state / "soakd.db" and store.path.is_file()
        assert store.journal_mode == "wal"
        assert store.migrated == list(range(1, SCHEMA_VERSION + 1)) and SCHEMA_VERSION >= 2
        assert await store._execute("PRAGMA user_version") == [(SCHEMA_VERSION,)]
        assert await store._execute("PRAGMA foreign_keys") == [(1,)]
        assert (await store._execute("PRAGMA busy_timeout"))[0][0] >= 1000
        tables = {r[0] for r in await store._execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert {"meta", "runs", "segments", "windows", "events", "samples"} <= tables
        # the connection lives on the store's own thread: the event loop's thread cannot even touch it
        assert store._w.thread_id not in (0, threading.get_ident())
        with pytest.raises(sqlite3.ProgrammingError):
            store._w.conn.execute("SELECT 1")  # type: ignore[union-attr]
    finally:
        await store.close()
    with pytest.raises(StoreError, match="closed"):
        await store.list_runs()
    again = await RunStore.open(state)
    assert again.migrated == []
    await again.close()


async def test_run_lifecycle_verdict_and_listing(store: RunStore) -> None:
    cfg = {"target": {"url": "http://x/v1"}, "run": {"duration": 86400, "window": 1800}}
    row = await store.create_run("r1", cfg, target="http://x/v1", model="m", server_kind="vllm", version="9.9")
    assert (row.id, row.status, row.target, row.model, row.server_kind, row.version) == (
        "r1", "running", "http://x/v1", "m", "vllm", "9.9")
    assert row.config == cfg and row.last_window is None and row.segments == 0
    # the hash ignores key order and text/dict form, so "config changed" compares meaning
    reordered = {"run": {"window": 1800, "duration": 86400}, "target": {"url": "http://x/v1"}}
    assert row.config_hash == hash_config(reordered) == hash_config(json.dumps(reordered, indent=2))
    with pytest.raises(StoreError, match="already exists"):
        await store.create_run("r1", cfg)
    assert (await store.latest_unfinished_run()).id == "r1"  # type: ignore[union-attr]

    await store.set_verdict("r1", {"verdict": "pass", "drift": [], "ratio": float("nan")})
    await store.finish_run("r1", "duration_reached")
    done = await store.get_run("r1")
    assert done is not None and done.status == "finished" and done.stop_reason == "duration_reached"
    assert done.ended_unix is not None and done.verdict == {"verdict": "pass", "drift": [], "ratio": None}
    assert await store.latest_unfinished_run() is None

    await store.create_run("r2", "{}", created_unix=time.time() + 1)
    assert [r.id for r in await store.list_runs()] == ["r2", "r1"]
    with pytest.raises(StoreError, match="no run"):
        await store.set_verdict("nope", {})
    with pytest.raises(ValueError):
        await store.finish_run("r2", "x", status="running")


async def test_windows_upsert_partial_then_final_never_the_reverse(store: RunStore) -> None:
    seg = await new_run(store)
    assert await store.save_window("run1", 0, seg, window_summary(0))
    assert await store.save_window("run1", 1, seg, window_summary(1, partial=True, requests=10))
    assert await store.save_window("run1", 1, seg, window_summary(1, requests=100))  # the final version
    assert not await store.save_window("run1", 1, seg, window_summary(1, partial=True, requests=5))  # refused
    assert await store.save_window("run1", 2, seg, window_summary(2, partial=True, requests=7))

    windows = await store.load_windows("run1")
    assert [(w.window, w.partial, w.requests, w.segment) for w in windows] == [
        (0, False, 100, 0), (1, False, 100, 0), (2, True, 7, 0)]
    assert windows[1].scenarios["long_context"].e2e_seconds.p95 == pytest.approx(0.501)
    assert [w.window for w in await store.load_windows("run1", include_partial=False)] == [0, 1]
    assert await store._execute("SELECT start_unix, end_unix FROM windows WHERE idx = 1") == [
        (1_700_001_800.0, 1_700_003_600.0)]
    with pytest.raises(StoreError, match="refused"):
        await store.save_window("no-such-run", 0, 0, window_summary(0))  # foreign keys are on


async def test_baseline_round_trip_and_survives_reopen(tmp_path: Path) -> None:
    store = await RunStore.open(tmp_path)
    seg = await new_run(store)
    assert await store.load_baseline("run1") is None
    await store.save_window("run1", 0, seg, window_summary(0))
    await store.set_baseline("run1", 0, window_summary(0))
    await store.close()
    store = await RunStore.open(tmp_path)
    idx, summary = await store.load_baseline("run1")  # type: ignore[misc]
    assert idx == 0 and summary.e2e_seconds.p95 == pytest.approx(0.5)
    assert (await store.get_run("run1")).baseline_window == 0  # type: ignore[union-attr]
    await store.close()


async def test_events_in_time_order_then_insertion_order(store: RunStore) -> None:
    await new_run(store)
    t = float(T0)
    await store.add_event("run1", "drift", "warning", "e2e p95 +7.2% vs baseline",
                          {"metric": "e2e_p95", "ratio": 0.072}, window=3, t_unix=t + 30)
    a = await store.add_event("run1", "target_down", "error", "connection refused", t_unix=t + 10)
    b = await store.add_event("run1", "target_up", "info", "answers again", t_unix=t + 10)
    await store.add_event("run1", "leak", "critical", "device memory +2 GiB/h", {"source": "gpu0"}, t_unix=t + 20)
    events = await store.load_events("run1")
    assert [e.kind for e in events] == ["target_down", "target_up", "leak", "drift"]
    assert a < b and events[0].id == a
    drift = events[-1]
    assert (drift.window, drift.severity, drift.t_unix, drift.data) == (3, "warning", t + 30,
                                                                        {"metric": "e2e_p95", "ratio": 0.072})
    assert [e.kind for e in await store.load_events("run1", kinds=["drift", "leak"])] == ["leak", "drift"]
    with pytest.raises(ValueError, match="severity"):
        await store.add_event("run1", "drift", "fatal", "x")


# ---------------------------------------------------------------------------------------------
# samples


async def test_samples_downsampled_to_one_row_per_series_per_minute_with_bounded_memory(store: RunStore) -> None:
    """One hour of 1 s samples of 10 series: 36,000 samples become 600 rows; at most two
    minutes per series are ever held in memory."""
    await new_run(store)
    series = [(f"soakd_gpu_metric_{k}", {"gpu": str(g), "uuid": f"GPU-{g}"}) for k in range(5) for g in range(2)]
    most_open = 0
    for i in range(3600):
        await store.add_samples("run1", T0 + i, [(n, lab, float(i % 60 + j)) for j, (n, lab) in enumerate(series)])
        most_open = max(most_open, len(store._w.aggs))
    assert most_open <= 2 * len(series)
    await store.flush()
    assert len(store._w.aggs) == 0
    rows = await store.load_samples("run1")
    assert len(rows) == 600
    one = await store.load_samples("run1", "soakd_gpu_metric_3", {"uuid": "GPU-1", "gpu": "1"})
    assert [r.t_minute for r in one] == [T0 + 60 * m for m in range(60)]
    j = series.index(("soakd_gpu_metric_3", {"gpu": "1", "uuid": "GPU-1"}))
    assert {(r.count, r.min, r.max, r.last) for r in one} == {(60, j, 59 + j, 59 + j)}
    assert all(r.mean == pytest.approx(29.5 + j) for r in one)
    assert one[0].labels == {"gpu": "1", "uuid": "GPU-1"}


async def test_samples_merge_across_flush_and_restart_and_skip_non_numbers(tmp_path: Path) -> None:
    from soakd.core.series import series

    store = await RunStore.open(tmp_path)
    await new_run(store)
    for i in range(30):
        await store.add_samples("run1", T0 + i, [series("kv", float(i)), ("bad", (), float("nan"))])
    await store.add_samples("run1", T0 + 30, [("kv", None, None), ("kv", None, "n/a"), ("kv", None, float("inf"))])
    await store.close()  # writes the open minute: a SIGTERM mid-minute loses nothing
    store = await RunStore.open(tmp_path)
    for i in range(30, 60):
        await store.add_samples("run1", T0 + i, [("kv", (), float(i))])
    assert await store.add_samples("run1", T0 + 70, [("kv", {}, 100.0)]) == 1  # minute 0 closed (+5 s grace)
    (row,) = await store.load_samples("run1", "kv")
    assert (row.t_minute, row.count, row.min, row.max, row.last) == (T0, 60, 0.0, 59.0, 59.0)
    assert row.mean == pytest.approx(29.5)
    assert await store.load_samples("run1", "bad") == []
    await store.close()


# ---------------------------------------------------------------------------------------------
# resume


async def test_resume_keeps_run_baseline_numbering_and_records_the_gap(tmp_path: Path) -> None:
    cfg = {"run": {"duration": 86400}}
    store = await RunStore.open(tmp_path)
    await store.create_run("run1", cfg)
    t0 = time.time()
    seg0 = await store.start_segment("run1", "start", t_unix=t0)
    for i in range(3):
        await store.save_window("run1", i, seg0, window_summary(i))
    await store.set_baseline("run1", 0, window_summary(0))
    await store.heartbeat("run1", t_unix=t0 + 50)
    await store.close()  # the process dies here: no end_segment, no finish_run

    store = await RunStore.open(tmp_path)
    run = await store.latest_unfinished_run()
    assert run is not None and run.id == "run1" and run.config_hash == hash_config(cfg)
    assert (run.last_window, run.windows, run.segments) == (2, 3, 1)
    assert (await store.load_baseline("run1"))[0] == 0  # type: ignore[index]
    seg1 = await store.start_segment("run1", "resume", t_unix=t0 + 100)
    assert seg1 == 1
    await store.save_window("run1", run.last_window + 1, seg1, window_summary(3))
    await store.end_segment("run1", seg1, "sigterm", t_unix=t0 + 200)
    segs = await store.load_segments("run1")
    assert [(s.seq, s.reason, s.end_reason) for s in segs] == [(0, "start", "interrupted"), (1, "resume", "sigterm")]
    assert segs[0].ended_unix == pytest.approx(t0 + 50)  # the last sign of life, not the restart
    assert segment_gaps(segs) == [(pytest.approx(t0 + 50), pytest.approx(t0 + 100))]
    assert [(w.window, w.segment) for w in await store.load_windows("run1")] == [(0, 0), (1, 0), (2, 0), (3, 1)]

    # --new-run: the caller fails the old one and starts another
    await store.finish_run("run1", "superseded by --new-run", status="failed")
    assert await store.latest_unfinished_run() is None
    await store.create_run("run2", cfg)
    assert (await store.latest_unfinished_run()).id == "run2"  # type: ignore[union-attr]
    await store.close()


# ---------------------------------------------------------------------------------------------
# migrations

# The v1 schema as released (a frozen copy: the test fails if someone edits the v1 migration).
V1_DDL = """
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
) WITHOUT ROWID;
CREATE TABLE runs (
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
);
CREATE TABLE windows (
    run_id       TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    idx          INTEGER NOT NULL,
    start_unix   REAL,
    end_unix     REAL,
    partial      INTEGER NOT NULL DEFAULT 0,
    summary_json TEXT NOT NULL,
    saved_unix   REAL NOT NULL,
    PRIMARY KEY (run_id, idx)
);
CREATE TABLE events (
    id        INTEGER PRIMARY KEY,
    run_id    TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    t_unix    REAL NOT NULL,
    kind      TEXT NOT NULL,
    severity  TEXT NOT NULL,
    "window"  INTEGER,
    message   TEXT NOT NULL,
    data_json TEXT
);
CREATE INDEX events_by_run_time ON events (run_id, t_unix, id);
PRAGMA user_version = 1;
"""


def build_v1(state: Path) -> None:
    state.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(state / "soakd.db")
    conn.executescript(V1_DDL)
    conn.execute("INSERT INTO runs (id, created_unix, config_json, config_hash, target, model, server_kind, version, "
                 "status, baseline_window, baseline_json) VALUES ('old', 1000.0, '{}', 'h1', 'http://t/v1', 'm', "
                 "'vllm', '0.0.9', 'running', 0, ?)", (json.dumps(window_summary(0)),))
    conn.execute("INSERT INTO runs (id, created_unix, config_json, config_hash, version, status, ended_unix, "
                 "stop_reason, verdict_json) VALUES ('done', 500.0, '{}', 'h0', '0.0.9', 'finished', 900.0, "
                 "'duration_reached', '{\"verdict\": \"pass\"}')")
    for i in range(2):
        conn.execute("INSERT INTO windows VALUES ('old', ?, ?, ?, 0, ?, ?)",
                     (i, 1000.0 + i * 100, 1100.0 + i * 100, json.dumps(window_summary(i)), 1100.0 + i * 100))
    conn.execute("INSERT INTO events (run_id, t_unix, kind, severity, \"window\", message, data_json) "
                 "VALUES ('old', 1150.0, 'drift', 'warning', 1, 'p95 +6%', '{\"ratio\": 0.06}')")
    conn.commit()
    conn.close()


async def test_a_store_written_by_schema_v1_migrates_and_keeps_its_data(tmp_path: Path) -> None:
    build_v1(tmp_path / "old")
    store = await RunStore.open(tmp_path / "old")
    try:
        assert store.migrated == [2, 3, 4, 5, 6]
        assert await store._execute("PRAGMA user_version") == [(SCHEMA_VERSION,)]
        run = await store.latest_unfinished_run()
        assert run is not None and (run.id, run.last_window, run.windows, run.segments) == ("old", 1, 2, 1)
        assert run.kind == "soak"  # v3: every run written before it is a soak (v4: batches)
        assert (await store.get_run("done")).verdict == {"verdict": "pass"}  # type: ignore[union-attr]
        assert [(w.window, w.segment, w.requests) for w in await store.load_windows("old")] == [
            (0, 0, 100), (1, 0, 100)]
        assert (await store.load_baseline("old"))[0] == 0  # type: ignore[index]
        (ev,) = await store.load_events("old")
        assert (ev.kind, ev.window, ev.data) == ("drift", 1, {"ratio": 0.06})
        # v1 runs got segment 0: open for the running run (last seen at its last window), closed for the other
        (old_seg,) = await store.load_segments("old")
        assert (old_seg.ended_unix, old_seg.last_seen_unix) == (None, 1200.0)
        (done_seg,) = await store.load_segments("done")
        assert (done_seg.ended_unix, done_seg.end_reason) == (900.0, "duration_reached")
        # the new parts work on the migrated file
        assert await store.start_segment("old", "resume") == 1
        await store.add_samples("old", T0, [("kv", None, 0.5)])
        await store.flush()
        assert len(await store.load_samples("old")) == 1
        assert (await store._execute("SELECT COUNT(*) FROM meta WHERE key = 'schema_v2_applied'")) == [(1,)]
    finally:
        await store.close()
    # migrated schema == fresh schema, column for column
    fresh = await RunStore.open(tmp_path / "fresh")
    await fresh.close()
    with sqlite3.connect(tmp_path / "old" / "soakd.db") as a, sqlite3.connect(tmp_path / "fresh" / "soakd.db") as b:
        assert table_columns(a) == table_columns(b)


async def test_the_report_reader_upgrades_an_old_store_too(tmp_path: Path) -> None:
    build_v1(tmp_path)
    with StoreReader(tmp_path) as reader:
        assert [r.id for r in reader.list_runs()] == ["old", "done"]
        assert len(reader.load_windows("old")) == 2 and len(reader.load_segments("old")) == 1


async def test_a_store_from_a_newer_soakd_is_refused(tmp_path: Path) -> None:
    await (await RunStore.open(tmp_path / "x")).close()
    with sqlite3.connect(tmp_path / "x" / "soakd.db") as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(StoreError, match=r"newer soakd.*--state-dir"):
        await RunStore.open(tmp_path / "x")
    with pytest.raises(StoreError, match="newer soakd"):
        StoreReader(tmp_path / "x")


# ---------------------------------------------------------------------------------------------
# fail fast at start


async def test_state_dir_below_a_regular_file_fails_fast_naming_it(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    with pytest.raises(StoreError) as err:
        await RunStore.open(blocker / "state")
    msg = str(err.value)
    assert f"{blocker} is a file, not a directory" in msg and str(blocker / "state") in msg and "--state-dir" in msg
    with pytest.raises(StoreError, match="exists and is not a directory"):
        await RunStore.open(blocker)


async def test_corrupt_or_misplaced_database_fails_fast(tmp_path: Path) -> None:
    (tmp_path / "soakd.db").write_bytes(b"this is not a database, it is a text file\n" * 200)
    with pytest.raises(StoreError, match=r"not a SQLite database or is corrupt.*move it aside.*--state-dir"):
        await RunStore.open(tmp_path)
    other = tmp_path / "other"
    (other / "soakd.db").mkdir(parents=True)
    with pytest.raises(StoreError, match="is a directory, not a database file"):
        await RunStore.open(other)


async def test_a_second_writer_on_the_same_state_dir_is_refused(tmp_path: Path) -> None:
    first = await RunStore.open(tmp_path)
    with pytest.raises(StoreError, match=rf"in use by another soakd \(pid {os.getpid()}\)"):
        await RunStore.open(tmp_path)
    await first.close()
    await (await RunStore.open(tmp_path)).close()  # the lock went with it


async def test_one_writer_even_when_the_lock_file_is_removed(tmp_path: Path) -> None:
    """``rm soakd.lock`` (a cleanup job, an init container) and a second soakd: refused all the same
    (the database file itself is locked; before, both wrote the same run); and a database deleted
    or replaced under the first is noticed at its next write."""
    from soakd.store import StoreReplaced

    first = await RunStore.open(tmp_path)
    (tmp_path / "soakd.lock").unlink()
    with pytest.raises(StoreError, match="in use by another soakd"):
        await RunStore.open(tmp_path)
    seg = await new_run(first)
    for name in ("soakd.db", "soakd.db-wal", "soakd.db-shm"):
        (tmp_path / name).unlink(missing_ok=True)
    with pytest.raises(StoreReplaced, match="was deleted"):
        await first.save_window("run1", 0, seg, window_summary(0))
    await first.reopen()  # a new, empty database at the path, this writer's again
    assert await first.get_run("run1") is None
    await first.close()


def _open_in_child_as_nobody(state: Path) -> str:
    """Fork, drop to uid/gid 65534 and try RunStore.open: root ignores directory permissions, an
    unprivileged user does not (the case of a container running as non-root on a root-owned PVC)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)

            async def attempt() -> str:
                s = await RunStore.open(state)
                await s.close()
                return "OPENED"

            try:
                msg = asyncio.run(attempt())
            except StoreError as exc:
                msg = f"StoreError: {exc}"
            except BaseException as exc:  # noqa: BLE001
                msg = f"{type(exc).__name__}: {exc}"
            os.write(w, msg.encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX only")
async def test_read_only_state_dir_fails_fast_with_the_path_and_the_fix(tmp_path: Path) -> None:
    base = Path(tempfile.mkdtemp(prefix="soakd-ro-"))  # not under pytest's 0700 tmp root: nobody must reach it
    try:
        os.chmod(base, 0o755)
        state = base / "state"
        state.mkdir()
        os.chmod(state, 0o555)
        if os.geteuid() == 0:
            outcome = _open_in_child_as_nobody(state)
            if outcome.startswith("PermissionError") and "setgid" in outcome.lower():
                pytest.skip("cannot drop privileges here")
            assert outcome.startswith("StoreError: "), outcome
            msg = outcome
        else:
            with pytest.raises(StoreError) as err:
                await RunStore.open(state)
            msg = str(err.value)
        assert f"state dir {state} is not writable: permission denied" in msg and "--state-dir" in msg
    finally:
        os.chmod(base / "state", 0o755)
        shutil.rmtree(base)


@contextmanager
def tmpfs(where: Path, options: str) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "soakd-test", str(where)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


async def test_read_only_file_system_fails_fast_even_for_root_and_reports_still_read(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "mnt", "size=4m") as mnt:
        store = await RunStore.open(mnt)
        seg = await new_run(store)
        await store.save_window("run1", 0, seg, window_summary(0))
        await store.close()
        assert subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=False).returncode == 0
        with pytest.raises(StoreError, match=rf"state dir {mnt} is not writable: read-only file system"):
            await RunStore.open(mnt)
        with pytest.raises(StoreError, match="read-only file system"):
            await RunStore.open(mnt / "sub")
        with StoreReader(mnt) as reader:  # a WAL database on a read-only mount is still readable
            assert [w.window for w in reader.load_windows("run1")] == [0]


# ---------------------------------------------------------------------------------------------
# a full disk mid-run


async def test_full_disk_keeps_writes_in_memory_and_replays_them_in_order(tmp_path: Path) -> None:
    changes: list[tuple[bool, str | None]] = []
    store = await RunStore.open(tmp_path, on_state_change=lambda ok, why: changes.append((ok, why)))
    seg = await new_run(store)
    await store.save_window("run1", 0, seg, window_summary(0))
    await fill_up(store)

    with pytest.raises(StoreUnavailable) as first:
        await store.save_window("run1", 1, seg, window_summary(1, pad=50_000))
    assert first.value.first and first.value.queued and first.value.pending == 1
    assert "disk is full" in str(first.value) and str(store.path) in str(first.value)
    with pytest.raises(StoreUnavailable) as second:
        await store.add_event("run1", "drift", "warning", "during the outage", window=1, t_unix=T0 + 1.0)
    assert not second.value.first and second.value.pending == 2  # log once: only the first one is "first"
    assert changes == [(False, changes[0][1])] and "full" in (changes[0][1] or "")
    assert [w.window for w in await store.load_windows("run1")] == [0]  # reads see SQLite only
    health = store.health()
    assert (health["available"], health["pending_writes"]) == (False, 2)

    await make_room(store)  # space returns: the next write replays the queue first, in order
    assert await store.save_window("run1", 2, seg, window_summary(2))
    assert [w.window for w in await store.load_windows("run1")] == [0, 1, 2]
    (ev,) = await store.load_events("run1")
    assert (ev.message, ev.t_unix) == ("during the outage", T0 + 1.0)  # the time it happened, not of the replay
    assert changes[-1] == (True, None) and store.available and store.pending == 0
    await store.close()
    with StoreReader(tmp_path) as reader:
        assert len(reader.load_windows("run1")) == 3


async def test_the_retry_queue_is_bounded_and_drops_samples_before_windows_and_events(tmp_path: Path) -> None:
    store = await RunStore.open(tmp_path, pending_limit=5)
    seg = await new_run(store)
    await fill_up(store)
    with pytest.raises(StoreUnavailable):
        await store.save_window("run1", 0, seg, window_summary(0, pad=50_000))
    await store.add_samples("run1", T0 + 10, [("kv", None, 0.0)])  # opens minute 0, writes nothing
    for m in range(1, 7):  # each call closes the previous minute: 6 sample writes queued
        with pytest.raises(StoreUnavailable):
            await store.add_samples("run1", T0 + 60 * m + 10, [("kv", None, float(m))])
    with pytest.raises(StoreUnavailable):
        await store.add_event("run1", "leak", "critical", "kv cache keeps growing")
    with pytest.raises(StoreUnavailable) as err:
        await store.save_window("run1", 1, seg, window_summary(1, pad=50_000))
    assert err.value.pending == 5 and err.value.dropped == 4
    assert store.health()["dropped_writes"] == {"samples": 4, "other": 0}

    await make_room(store)
    assert await store.retry_pending()
    assert [w.window for w in await store.load_windows("run1")] == [0, 1]
    assert [e.kind for e in await store.load_events("run1")] == ["leak"]
    # the oldest sample minutes went first; the newest two were kept
    assert [r.t_minute for r in await store.load_samples("run1")] == [T0 + 240, T0 + 300]
    await store.close()


async def test_a_real_full_file_system_degrades_then_recovers(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "mnt", "size=512k") as mnt:
        store = await RunStore.open(mnt)
        seg = await new_run(store)
        saved, error = 0, None
        for i in range(200):
            try:
                await store.save_window("run1", i, seg, window_summary(i, pad=20_000))
                saved += 1
            except StoreUnavailable as exc:
                error = exc
                break
        assert error is not None and error.first and error.queued, "the 512 KiB tmpfs never filled"
        assert saved >= 1
        with pytest.raises(StoreUnavailable):  # the sampler keeps going; its flushes are queued too
            await store.add_samples("run1", T0, [("kv", None, 1.0)])
            await store.add_samples("run1", T0 + 70, [("kv", None, 2.0)])
        assert subprocess.run(["mount", "-o", "remount,size=16m", str(mnt)], check=False).returncode == 0
        assert await store.retry_pending()
        assert [w.window for w in await store.load_windows("run1")] == list(range(saved + 1))
        assert len(await store.load_samples("run1")) == 1
        assert await store.integrity_check() == "ok"
        await store.close()


@pytest.mark.parametrize("space_returns", [True, False])
async def test_finish_and_close_during_an_outage(tmp_path: Path, space_returns: bool) -> None:
    store = await RunStore.open(tmp_path)
    seg = await new_run(store)
    await store.add_samples("run1", T0, [("kv", None, 1.0)])
    await fill_up(store)
    with pytest.raises(StoreUnavailable):
        await store.save_window("run1", 0, seg, window_summary(0, pad=50_000))
    with pytest.raises(StoreUnavailable):
        await store.finish_run("run1", "sigterm")  # its open sample minute and the finish queue behind the window
    assert store.pending == 3
    if space_returns:
        await make_room(store)
        await store.close()  # replays everything
    else:
        # still closes (and releases the lock), says what was not saved, and keeps the window and the
        # finish beside the database (the sample minute is telemetry: dropped)
        with pytest.raises(StoreUnavailable, match="3 writes not saved.*2 kept in .*soakd.db.unsaved.jsonl"):
            await store.close()
        assert (tmp_path / "soakd.db.unsaved.jsonl").is_file()
    store = await RunStore.open(tmp_path)  # reads the kept writes back
    run = await store.get_run("run1")
    assert run is not None
    assert (run.status, run.stop_reason, run.windows) == ("finished", "sigterm", 1)
    assert len(await store.load_samples("run1")) == (1 if space_returns else 0)
    assert store.read_back == ((0, 0) if space_returns else (2, 0))
    assert not (tmp_path / "soakd.db.unsaved.jsonl").exists()
    await store.close()


# ---------------------------------------------------------------------------------------------
# SIGKILL at any moment

CHILD = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from soakd.store import RunStore

    async def main(state):
        store = await RunStore.open(Path(state))
        run = await store.latest_unfinished_run()
        if run is None:
            run = await store.create_run("killme", {"run": {"duration": 86400}})
        seg = await store.start_segment(run.id, "resume" if run.segments else "start")
        i = 0 if run.last_window is None else run.last_window + 1
        pad = "x" * 6000
        while True:
            await store.save_window(run.id, i, seg, {"window": i, "requests": i, "pad": pad})
            print(f"committed {i}", flush=True)
            await store.add_event(run.id, "tick", "info", f"window {i}", {"i": i}, window=i)
            await store.add_samples(run.id, 1_700_000_000 + 13 * i, [("s", {"k": "v"}, float(i))])
            i += 1

    asyncio.run(main(sys.argv[1]))
""")


@pytest.mark.slow
async def test_sigkill_at_any_moment_loses_no_committed_window(tmp_path: Path) -> None:
    rng = random.Random(7)
    reported: set[int] = set()
    rounds = 5
    for _ in range(rounds):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CHILD, str(tmp_path), cwd=REPO,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        assert proc.stdout is not None
        want = rng.randint(5, 40)
        seen = 0
        while seen < want:
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
            assert line, (await proc.stderr.read()).decode()  # type: ignore[union-attr]
            reported.add(int(line.split()[1]))
            seen += 1
        await asyncio.sleep(rng.random() * 0.01)  # land anywhere: mid-transaction, mid-fsync, between writes
        proc.kill()
        rest, _ = await proc.communicate()
        reported.update(int(x.split()[1]) for x in rest.decode().splitlines() if x.startswith("committed"))
        assert proc.returncode == -9

    store = await RunStore.open(tmp_path)
    try:
        assert await store.integrity_check() == "ok"
        windows = [w.window for w in await store.load_windows("killme")]
        assert set(windows) >= reported  # everything the child announced is there
        assert windows == list(range(len(windows)))  # and numbering continued across restarts without holes
        segs = await store.load_segments("killme")
        assert len(segs) == rounds and all(s.end_reason == "interrupted" for s in segs[:-1])
        assert segs[-1].ended_unix is None  # the last one is closed by the next start
        assert all(a <= b for a, b in segment_gaps(segs))
    finally:
        await store.close()


# ---------------------------------------------------------------------------------------------
# the read-only face for `soakd report`


async def test_reader_reads_beside_a_running_writer(tmp_path: Path) -> None:
    store = await RunStore.open(tmp_path)
    seg = await new_run(store)
    await store.save_window("run1", 0, seg, window_summary(0))
    await store.add_event("run1", "throttle", "warning", "power cap", {"reason": "sw_power_cap"})
    with StoreReader(tmp_path) as reader:
        assert reader.latest_run().id == "run1"  # type: ignore[union-attr]
        assert [w.window for w in reader.load_windows("run1")] == [0]
        await store.save_window("run1", 1, seg, window_summary(1))  # WAL: the writer is not blocked
        assert [w.window for w in reader.load_windows("run1")] == [0, 1]
        assert [e.kind for e in reader.load_events("run1")] == ["throttle"]
        assert reader.latest_unfinished_run().id == "run1"  # type: ignore[union-attr]
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            reader.conn.execute("DELETE FROM windows")
    await store.close()
    with StoreReader(tmp_path / "soakd.db") as reader:
        assert reader.get_run("run1").windows == 2  # type: ignore[union-attr]
        assert reader.load_baseline("run1") is None and reader.load_samples("run1") == []
    with pytest.raises(StoreError, match=r"no soakd state.*--state-dir"):
        StoreReader(tmp_path / "missing")


async def test_sweeps_are_runs_of_their_own_kind(tmp_path: Path) -> None:
    """A sweep is stored as a run of kind sweep: never resumed as a soak, listed apart."""
    async with await RunStore.open(tmp_path) as store:
        await store.create_run("soak1", {}, created_unix=100.0)
        await store.create_run("sweep1", {}, created_unix=200.0, kind="sweep")
        assert (await store.latest_unfinished_run()).id == "soak1"  # type: ignore[union-attr]
        assert [r.id for r in await store.list_runs()] == ["soak1"]
        assert [r.id for r in await store.list_runs("sweep")] == ["sweep1"]
        assert [r.id for r in await store.list_runs(None)] == ["sweep1", "soak1"]
        assert (await store.get_run("sweep1")).kind == "sweep"  # type: ignore[union-attr]


async def test_one_windows_table_keyed_by_target_and_a_v5_store_folds_its_target_windows(tmp_path: Path) -> None:
    """Schema v6: the reference's windows (target '') and an A/B run's other targets' in one table; a store
    of schema v5 (target_windows beside windows) migrates into it, nothing lost."""
    from soakd.store.schema import migrate

    state = tmp_path / "v5"
    state.mkdir()
    conn = sqlite3.connect(state / "soakd.db", isolation_level=None)
    migrate(conn, state / "soakd.db", target=5)
    conn.execute("INSERT INTO runs (id, created_unix, config_json, config_hash, version) "
                 "VALUES ('ab', 1000.0, '{}', 'h', '0.1.0')")
    for i in range(3):
        conn.execute("INSERT INTO windows (run_id, idx, start_unix, end_unix, partial, summary_json, saved_unix) "
                     "VALUES ('ab', ?, 0, 1, 0, ?, 1)", (i, json.dumps(window_summary(i))))
        conn.execute("INSERT INTO target_windows (run_id, target, idx, summary_json, saved_unix) VALUES "
                     "('ab', 'cand', ?, ?, 1)", (i, json.dumps(window_summary(i, requests=77, partial=i == 2))))
    conn.close()
    store = await RunStore.open(state)
    try:
        assert store.migrated == [6]
        assert [w.requests for w in await store.load_windows("ab")] == [100, 100, 100]
        cand = (await store.load_target_windows("ab"))["cand"]
        assert [(w.window, w.requests, w.partial) for w in cand] == [(0, 77, False), (1, 77, False), (2, 77, True)]
        run = await store.get_run("ab")
        assert run is not None and run.windows == 3 and run.last_window == 2  # the reference's windows only
        # a new A/B window goes to the same table under its target; the reference's stay apart
        await store.save_target_window("ab", "cand", window_summary(3, requests=55))
        await store.save_window("ab", 3, 0, window_summary(3, requests=66))
        assert [w.requests for w in (await store.load_target_windows("ab"))["cand"]][-1] == 55
        assert [w.requests for w in await store.load_windows("ab", target="cand")][-1] == 55
        assert [w.requests for w in await store.load_windows("ab")][-1] == 66
        tables = {r[0] for r in await store._execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert "target_windows" not in tables and "windows" in tables
    finally:
        await store.close()

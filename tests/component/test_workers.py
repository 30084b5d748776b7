"""``load.workers: 2`` end to end (issue 23 item 3): two load worker processes against the in-process simulator,
the parent owning the windows, analysis, store and ``/metrics``.

- the closed loop's concurrency split, ``max_requests`` split exactly, every record (token times, request id,
  send time) reaching the parent's windows and record listeners, the workers' log lines marked;
- the open loop's arrivals split (one seeded sequence: the same rate as one worker, not twice it);
- a quiesce probe in every window waits for both workers: the idle KV usage it reads is 0 every time;
- a wedged engine named live from the workers' streams (their progress reaches the wedge watch);
- a worker killed mid-run stops the run (``worker_exited``) with nothing left in flight.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
import pytest

from soakd.core.records import Outcome, RequestRecord
from soakd.sim import SimConfig, SimServer
from test_detection import SIM, Soak, samples, soak_config, value

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(120)
async def test_two_workers_split_the_closed_loop_and_every_record_reaches_the_parent(tmp_path: Path) -> None:
    records: list[RequestRecord] = []
    async with SimServer(SimConfig(**SIM)) as sim:
        cfg = soak_config(sim, tmp_path / "run", windows=30, window=1.0, warmup=0.5,
                          load={"concurrency": 8, "mix": {"short_chat": 1}, "workers": 2},
                          run={"max_requests": 301})
        soak = Soak(cfg, record_listeners=(records.append,))
        tl = await soak.timeline()
        pool = soak.daemon.pool
        assert pool is not None and len(pool.workers) == 2
        await soak.finish(90)
        outcome = soak.task.result()
    assert outcome.stop_reason == "max_requests"
    assert outcome.requests_sent == 301 and len(records) == 301  # split 151 + 150, every one replayed here
    assert sorted(w.issued for w in pool.workers) == [150, 151]
    # each said it was done (its last frames reached the parent before it exited) and exited cleanly
    assert [w.done for w in pool.workers] == ["max_requests"] * 2 and all(w.proc.returncode == 0 for w in pool.workers)
    ids = {r.request_id for r in records}
    assert len(ids) == 301 and "" not in ids
    for r in records:
        assert r.outcome is Outcome.OK and r.token_times_ns and r.t_start_ns < r.token_times_ns[0] <= r.t_end_ns
        # the worker's send time on the parent's timeline (uvloop's clock there: whole milliseconds, read at the
        # start of its loop's pass), in the window it counts in (picked a moment before the send)
        assert r.t_sent is not None and tl.start - 0.005 <= r.t_sent <= tl.end
        assert tl.window_at(r.t_sent - 0.01) <= r.window <= tl.window_at(r.t_sent)
    windows = soak.final["windows"]
    assert sum(w["requests"] for w in windows) == outcome.requests_measured == sum(not r.warmup for r in records)
    assert outcome.requests_measured + outcome.warmup_requests == 301
    snap = samples(soak.daemon)
    assert value(snap, "soakd_requests_in_flight") == 0
    assert value(snap, "soakd_requests_total", scenario="short_chat", outcome="ok") == outcome.requests_measured
    e2e = value(snap, "soakd_request_duration_seconds_count", scenario="short_chat")
    assert e2e == outcome.requests_measured  # every measured request in the parent's histogram
    print(f"\n2 workers: {outcome.requests_sent} requests in {len(windows)} windows, issued "
          f"{[w.issued for w in pool.workers]}")


@pytest.mark.timeout(120)
async def test_the_open_loop_is_split_not_doubled(tmp_path: Path) -> None:
    """40 requests/s for 5 s with two workers: the run sends what one would (one seeded sequence, every other
    arrival each), within Poisson noise (about 200 +- 3 sd)."""
    async with SimServer(SimConfig(**SIM)) as sim:
        cfg = soak_config(sim, tmp_path / "run", windows=5, window=1.0, warmup=0.0,
                          load={"concurrency": None, "rate": 40.0, "mix": {"short_chat": 1}, "workers": 2})
        soak = Soak(cfg)
        await soak.finish(60)
        outcome = soak.task.result()
    pool = soak.daemon.pool
    assert pool is not None and all(w.issued > 50 for w in pool.workers)
    assert abs(outcome.requests_sent - 200) <= 45, outcome.requests_sent
    assert outcome.stop_reason == "duration"


@pytest.mark.timeout(120)
async def test_a_quiesce_probe_waits_for_both_workers(tmp_path: Path) -> None:
    """A quiesce probe in every 1 s window: it holds both workers and reads the KV cache once neither has a request
    on the server: 0 every time it says so (a probe that read while one worker still streamed would see blocks in
    use). Its drain timeout is a quarter of the window here, 0.25 s: on a starved machine a worker can take longer
    to finish its streams, and that probe says drained=False (seen once at nice 10 beside a loaded test suite)."""
    async with SimServer(SimConfig(**SIM)) as sim:
        cfg = soak_config(sim, tmp_path / "run", windows=8, load={"concurrency": 16, "mix": {"short_chat": 1},
                                                                   "workers": 2},
                          analysis={"quiesce": {"settle": 0.05, "rereads": 0}})
        soak = Soak(cfg)
        await soak.finish(60)
    probes = [w["quiesce"] for w in soak.final["windows"] if w.get("quiesce")]
    drained = [p for p in probes if p["drained"]]
    assert len(probes) >= 4 and len(drained) >= 3, soak.final["windows"]
    assert all(p["kv_cache_usage_ratio"] == 0 for p in drained), probes
    assert all(w["requests"] > 0 for w in soak.final["windows"] if not w["partial"])


@pytest.mark.timeout(120)
async def test_a_wedged_engine_is_named_from_the_workers_streams(tmp_path: Path) -> None:
    """The simulator's engine sends headers and no token for 4 s every 8 s, /metrics absent: only soakd's own
    streams can see it, and they are in the workers: their progress reaches the parent's wedge watch."""
    faults = {"freeze_every": 8.0, "freeze_duration": 4.0}
    async with SimServer(SimConfig(**SIM, faults=faults, metric_names="none")) as sim:
        soak = Soak(soak_config(sim, tmp_path / "run", windows=6, window=2.0, warmup=1.0,
                                load={"concurrency": 16, "mix": {"short_chat": 1}, "workers": 2},
                                analysis={"client": {"freeze_min": 1.0}, "drift": {"baseline_windows": 2}}))
        await soak.finish(60)
    wedged = [f for f in soak.daemon.analyzer.findings if f.diagnosis == "engine wedged"]
    assert wedged, [(f.diagnosis, f.message[:80]) for f in soak.daemon.analyzer.findings]
    assert all(f.evidence["sources"] == ["streams"] and f.evidence["in_flight"] >= 1 for f in wedged)


@pytest.mark.timeout(120)
async def test_a_killed_worker_stops_the_run_with_nothing_left_in_flight(tmp_path: Path) -> None:
    async with SimServer(SimConfig(**SIM)) as sim:
        cfg = soak_config(sim, tmp_path / "run", windows=40, window=1.0, warmup=0.5,
                          load={"concurrency": 8, "mix": {"short_chat": 1}, "workers": 2})
        soak = Soak(cfg)
        tl = await soak.timeline()
        loop = asyncio.get_running_loop()
        while loop.time() < tl.first_window_start + 1.5 and not soak.task.done():
            await asyncio.sleep(0.05)
        pool = soak.daemon.pool
        assert pool is not None
        os.kill(pool.workers[1].proc.pid, signal.SIGKILL)
        await soak.finish(60)
        outcome = soak.task.result()
    assert outcome.stop_reason == "worker_exited"
    assert loop.time() < tl.end  # it stopped, it did not run its 40 windows
    rec = soak.daemon.load.recorder if soak.daemon.load is not None else None
    assert rec is not None and rec.in_flight == 0 and not rec.active
    # the other worker was told to stop, drained and said so; the killed one's requests in flight were cancelled
    assert pool.workers[0].done == "worker_exited" and pool.workers[0].proc.returncode == 0
    assert pool.workers[1].proc.returncode == -signal.SIGKILL
    assert outcome.outcomes["ok"] > 0


@pytest.mark.timeout(60)
async def test_a_worker_that_cannot_start_is_a_clear_error_not_a_hang() -> None:
    """A worker whose start fails (here: an init it cannot read) exits at once; the pool says which worker,
    with its exit status, and leaves no process behind."""
    from soakd.soak.workers import WorkerPool

    pool = WorkerPool(2, {}, None)
    with pytest.raises(RuntimeError, match=r"load worker 0 did not start \(exit status 1"):
        await pool.spawn()
    await pool.close()
    assert all(w.proc.returncode is not None for w in pool.workers)

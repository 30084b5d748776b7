"""Nothing lost: a SIGKILLed soakd resumes the same run (id, baseline, window numbering) with the
gap recorded as a segment boundary; SIGTERM closes a partial window and leaves the run resumable;
--new-run starts afresh; an unwritable state dir fails fast."""

from __future__ import annotations

import json
import signal
from typing import Any
from pathlib import Path

import pytest
import yaml
from helpers import QUICK_SIM, SoakdProcess, run_soakd, sim_server

from soakd.config import deep_merge, load_config
from soakd.store import StoreReader

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _args(url: str, state: Path, *extra: str, cfg_dir: Path | None = None, yaml_extra: str = "") -> list[str]:
    cfg = (cfg_dir or state.parent) / "soak.yaml"
    # short outputs so a 1 s window holds enough requests (>= 50) to choose a baseline; these tests are about
    # the run's lifecycle, not soakd's own health: a 1 s window is judged even when this machine stalls soakd
    base = {"scenarios": {"short_chat": {"max_tokens": 8, "prompt_tokens": 32}},
            "analysis": {"client": {"max_stall_share": 1.0, "max_lag": 3600, "max_throttled_share": 1.0,
                                    "request_max_lag": 3600, "max_impaired_share": 1.0}}}
    cfg.write_text(yaml.safe_dump(deep_merge(base, yaml.safe_load(yaml_extra) or {})))
    return [
        "run", "-c", str(cfg), "--target", url, "--duration", "60s", "--window", "1s", "--warmup", "0s",
        "--concurrency", "8", "--mix", "short_chat=1", "--metrics-host", "127.0.0.1", "--metrics-port", "0",
        "--state-dir", str(state), "--log-format", "json", "--grace", "2s", "--sample-interval", "0.5s",
        "--nvml", "off", *extra,
    ]  # fmt: skip


def in_process(sim: Any, state: Path, duration: float) -> Any:
    """The configuration of the in-process runs below: 1 s windows, no warm-up, concurrency 4."""
    return load_config(None, {
        "target": {"url": sim.base_url},
        "run": {"duration": duration, "window": 1.0, "warmup": 0, "grace": 1.0, "state_dir": str(state)},
        "load": {"concurrency": 4, "mix": {"short_chat": 1}},
        "scenarios": {"short_chat": {"max_tokens": 8, "prompt_tokens": 32}},
        "samplers": {"nvml": {"mode": "off"}, "interval": 0.5},
        "metrics": {"host": "127.0.0.1", "port": 0},
        "log": {"progress": False},
    }, environ={})  # fmt: skip


async def test_sigkill_then_restart_resumes_the_same_run(tmp_path: Path) -> None:
    async with sim_server(**QUICK_SIM) as sim:
        first = await SoakdProcess.start(*_args(sim.base_url, tmp_path))
        started = await first.json_event("soakd_started")
        run_id = started["run_id"]
        for _ in range(3):
            await first.json_event("window_closed")
        first.proc.kill()  # SIGKILL: no drain, no final window, no report
        await first.finish(10)
        reader = StoreReader(tmp_path)
        before = reader.load_windows(run_id)
        assert [w.window for w in before] == list(range(len(before))) and len(before) >= 3
        base_before = reader.load_baseline(run_id)
        assert base_before is not None and base_before[0] == 0
        assert reader.get_run(run_id).status == "running"

        second = await SoakdProcess.start(*_args(sim.base_url, tmp_path))
        resumed = await second.json_event("soakd_started")
        assert resumed["run_id"] == run_id and resumed["resumed"] is True
        info = await second.json_event("run_resumed")
        assert info["first_window"] == before[-1].window + 1
        closed = await second.json_event("window_closed")
        assert closed["window"] == before[-1].window + 1
        await second.json_event("window_closed")
        second.signal(signal.SIGTERM)
        assert await second.finish(30) == 0

    reader = StoreReader(tmp_path)
    windows = reader.load_windows(run_id)
    idx = [w.window for w in windows]
    assert idx == sorted(set(idx)), "window numbers are unique and increasing across the restart"
    assert idx[: len(before)] == [w.window for w in before]
    assert {w.segment for w in windows} == {0, 1}
    assert reader.load_baseline(run_id)[0] == 0  # the baseline survived the SIGKILL
    segments = reader.load_segments(run_id)
    assert len(segments) == 2 and segments[0].ended_unix is not None
    assert segments[0].ended_unix <= segments[1].started_unix  # the gap is between segments, in no window
    events = reader.load_events(run_id)
    assert any(e.kind == "segment" for e in events)
    # SIGTERM keeps the run resumable; its last window is partial
    assert reader.get_run(run_id).status == "running"
    assert windows[-1].partial is True
    assert (tmp_path / run_id / "report.json").exists()


async def test_new_run_starts_afresh(tmp_path: Path) -> None:
    async with sim_server(**QUICK_SIM) as sim:
        p = await SoakdProcess.start(*_args(sim.base_url, tmp_path))
        old = (await p.json_event("soakd_started"))["run_id"]
        await p.json_event("window_closed")
        p.signal(signal.SIGTERM)
        assert await p.finish(30) == 0
        # judged on errors only (one-second windows on a busy machine are no basis for a latency verdict)
        q = await SoakdProcess.start(*_args(sim.base_url, tmp_path, "--new-run", "--duration", "3s",
                                            yaml_extra="analysis:\n  verdict:\n    fail_on: [errors]\n"))
        new = (await q.json_event("soakd_started"))["run_id"]
        assert await q.finish(30) == 3  # three 1 s windows: too few to judge, INCONCLUSIVE (exit code 3)
    assert new != old
    reader = StoreReader(tmp_path)
    assert reader.get_run(old).status == "failed" and reader.get_run(old).stop_reason.startswith("superseded")
    verdict = reader.get_run(new).verdict
    assert verdict["result"] == "INCONCLUSIVE" and verdict["passed"] is False and "could be judged" in verdict[
        "inconclusive"]
    assert reader.get_run(new).status == "finished"
    assert reader.load_windows(new)[0].window == 0


async def test_unwritable_state_dir_fails_fast(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    rc, out, err = await run_soakd(*_args("http://127.0.0.1:9/v1", blocker / "state", cfg_dir=tmp_path), timeout=20)
    assert rc == 2
    assert "run.state_dir" in err and str(blocker) in err


async def test_exit_code_one_when_the_verdict_fails(tmp_path: Path) -> None:
    """CI gate: errors beyond the budget fail the verdict -> exit 1, and the reports say why."""
    async with sim_server(**dict(QUICK_SIM, faults={"error_rate_500": 0.2})) as sim:
        rc, out, err = await run_soakd(*_args(sim.base_url, tmp_path, "--duration", "4s"), timeout=60)
    assert rc == 1, (out[-2000:], err[-2000:])
    run_id = StoreReader(tmp_path).latest_run().id
    verdict = StoreReader(tmp_path).get_run(run_id).verdict
    assert verdict["passed"] is False and any("error rate" in r for r in verdict["reasons"])
    report = (tmp_path / run_id / "report.md").read_text()
    assert "FAIL" in report


async def test_exit_code_zero_when_the_run_passes(tmp_path: Path) -> None:
    # judged on errors only: one-second windows on a shared 2-core machine are too noisy a basis
    # for a latency verdict (test_analysis_e2e covers drift), and this test is about the exit code
    # (and a baseline of one window: six 1 s windows are enough for a verdict)
    only_errors = "analysis:\n  verdict:\n    fail_on: [errors]\n  drift:\n    baseline_windows: 1\n"
    async with sim_server(**QUICK_SIM) as sim:
        rc, out, err = await run_soakd(*_args(sim.base_url, tmp_path, "--duration", "6s", yaml_extra=only_errors),
                                       timeout=60)
    assert rc == 0, (out[-2000:], err[-2000:])
    run_id = StoreReader(tmp_path).latest_run().id
    assert StoreReader(tmp_path).get_run(run_id).verdict["passed"] is True
    for name in ("report.json", "report.md", "report.html"):
        assert (tmp_path / run_id / name).stat().st_size > 0


async def test_full_disk_mid_run_degrades_and_recovers(tmp_path: Path) -> None:
    """The disk fills up mid-run: an error is logged once, /metrics keeps working, and the windows
    closed meanwhile reach SQLite when space returns."""
    import asyncio

    from helpers import fill_up, http_get, make_room, wait_until
    from structlog.testing import capture_logs

    from soakd.runtime import Runtime

    async with sim_server(**QUICK_SIM) as sim:
        cfg = in_process(sim, tmp_path, 7.0)
        runtime = Runtime(cfg, progress=False)
        history = runtime.analyzer.history
        with capture_logs() as logs:
            task = asyncio.create_task(runtime.run())
            await wait_until(lambda: len(history.full()) >= 2, timeout=20, what="two windows")
            await fill_up(runtime.session.store)
            full_from = len(history.full())
            await wait_until(lambda: len(history.full()) >= full_from + 2, timeout=20, what="windows while full")
            status, body = await http_get(runtime.web.url + "/metrics")
            assert status == 200 and "soakd_requests_total" in body
            await make_room(runtime.session.store)
            final = await asyncio.wait_for(task, 30)
    job_errors = [e for e in logs if e["event"].startswith("scheduler_job")]
    assert not job_errors, job_errors
    errors = [e for e in logs if e["event"] == "store_unavailable"]
    assert len(errors) == 1, [e["event"] for e in logs if "store" in e["event"]]
    assert any(e["event"] == "store_recovered" for e in logs)
    stored = [w.window for w in StoreReader(tmp_path).load_windows(final.run_id)]
    assert stored == [w.window for w in history.closed], ("every window reached SQLite after the disk recovered",
                                                           stored, [w.window for w in history.closed])


async def test_a_state_dir_of_the_earlier_release_resumes(tmp_path: Path) -> None:
    """tests/fixtures/state-v2 was written by soakd before the typed window summaries (schema v2,
    windows.jsonl beside it): the new soakd resumes its SIGTERM-stopped run with that run's id,
    baseline, canary reference and window numbering, reads every stored window as a typed summary,
    and the report shows both segments."""
    import shutil

    from helpers import REPO, report_of

    state = tmp_path / "state"
    shutil.copytree(REPO / "tests" / "fixtures" / "state-v2", state)
    with StoreReader(state) as reader:
        stopped = reader.latest_unfinished_run()
        assert stopped is not None and stopped.status == "running"
        before = reader.load_windows(stopped.id)
        base_before = reader.load_baseline(stopped.id)
        elapsed = sum((s.ended_unix or 0) - s.started_unix for s in reader.load_segments(stopped.id))
    assert [w.window for w in before] == [0, 1, 2] and before[-1].partial
    assert base_before is not None and base_before[0] == 0
    async with sim_server(**QUICK_SIM) as sim:
        p = await SoakdProcess.start(*_args(sim.base_url, state, "--duration", f"{elapsed + 4:.1f}s",
                                            cfg_dir=tmp_path))
        started = await p.json_event("soakd_started")
        assert started["run_id"] == stopped.id and started["resumed"] is True
        resumed = await p.json_event("run_resumed")
        assert resumed["first_window"] == 3 and resumed["windows"] == 2  # the partial one is not judged
        closed = await p.json_event("window_closed", timeout=30)
        assert closed["window"] == 3 and closed["segment"] == 1
        assert await p.finish(30) in (0, 1)  # finished: a verdict, whatever it is
    report = report_of(state, stopped.id)
    assert report["run"]["status"] in ("finished", "failed") and len(report["run"]["segments"]) == 2
    assert [w["window"] for w in report["windows"]][:4] == [0, 1, 2, 3]  # 2: partial, from the first segment
    assert {w["segment"] for w in report["windows"]} == {0, 1}
    assert report["baseline_window"] == 0 and report["baseline"] == base_before[1].dump()
    with StoreReader(state) as reader:
        events = reader.load_events(stopped.id, kinds=["canary_reference"])
    assert len(events) == 1, "the canary kept the earlier release's reference"


async def test_a_run_ending_on_a_full_disk_keeps_what_it_announced_and_the_next_start_reads_it_back(
        tmp_path: Path) -> None:
    """The disk fills two windows before the end and stays full: the run retries for its grace
    period, then keeps the writes it could not save (windows, events, the verdict, the end of the
    run) in soakd.db.unsaved.jsonl, names no report, and exits 4 (before: 11 writes dropped at
    close, exit 3, soakd_finished naming a report never written, the lost windows gone for good).
    The next start on the state dir reads them back: every window announced is stored, the run
    finished with its verdict, and a new run begins."""
    import asyncio

    from helpers import fill_up, wait_until
    from structlog.testing import capture_logs

    from soakd.core.verdict import EXIT_UNSAVED
    from soakd.runtime import Runtime

    async with sim_server(**QUICK_SIM) as sim:
        runtime = Runtime(in_process(sim, tmp_path, 5.0), progress=False)
        history = runtime.analyzer.history
        with capture_logs() as logs:
            task = asyncio.create_task(runtime.run())
            await wait_until(lambda: len(history.full()) >= 2, timeout=20, what="two windows")
            await fill_up(runtime.session.store)
            final = await asyncio.wait_for(task, 40)
        announced = [w.window for w in history.closed]
        finished = next(e for e in logs if e["event"] == "soakd_finished")
        assert final.unsaved is not None and final.unsaved[0] > 0, final.unsaved
        assert finished["exit_code"] == EXIT_UNSAVED and finished["report"] is None, finished
        assert any(e["event"] == "run_not_saved" for e in logs)
        unsaved = tmp_path / "soakd.db.unsaved.jsonl"
        assert unsaved.is_file()
        calls = [json.loads(x)["call"] for x in unsaved.read_text().splitlines()]
        assert "save_window" in calls and "set_verdict" in calls and "finish_run" in calls
        stored = [w.window for w in StoreReader(tmp_path).load_windows(final.run_id)]
        assert stored != announced  # the database alone lacks what the full disk held back
        # space returns (the full disk was the first connection's page limit: the next connection has none)
        with capture_logs() as logs2:
            again = Runtime(in_process(sim, tmp_path, 2.0), progress=False)
            second = await asyncio.wait_for(again.run(), 40)
    read = [e for e in logs2 if e["event"] == "store_read_back"]
    assert read and read[0]["applied"] == len(calls) and read[0]["left"] == 0, read
    assert not unsaved.exists()
    assert second.run_id != final.run_id  # the first run is finished now: a new one began
    with StoreReader(tmp_path) as reader:
        assert [w.window for w in reader.load_windows(final.run_id)] == announced
        run = reader.get_run(final.run_id)
        assert run is not None and run.status in ("finished", "failed") and run.verdict is not None


async def test_a_database_deleted_mid_run_is_recreated_from_memory(tmp_path: Path) -> None:
    """soakd.db (and its WAL) deleted two windows into a run: noticed at the next write or heartbeat,
    logged as an error, and the run re-created in a new database from memory: at the end every
    window is stored and the report written (before: not noticed, the whole run lost at the end)."""
    import asyncio

    from helpers import wait_until
    from structlog.testing import capture_logs

    from soakd.runtime import Runtime

    async with sim_server(**QUICK_SIM) as sim:
        cfg = in_process(sim, tmp_path, 6.0)
        runtime = Runtime(cfg, progress=False)
        history = runtime.analyzer.history
        with capture_logs() as logs:
            task = asyncio.create_task(runtime.run())
            await wait_until(lambda: len(history.full()) >= 2, timeout=20, what="two windows")
            for name in ("soakd.db", "soakd.db-wal", "soakd.db-shm"):
                (tmp_path / name).unlink(missing_ok=True)
            final = await asyncio.wait_for(task, 40)
    recreated = [e for e in logs if e["event"] == "store_recreated"]
    assert len(recreated) == 1 and "was deleted" in recreated[0]["reason"], [e["event"] for e in logs]
    assert recreated[0]["log_level"] == "error"
    finished = next(e for e in logs if e["event"] == "soakd_finished")
    assert finished["report"] and Path(finished["report"]).is_file(), finished
    with StoreReader(tmp_path) as reader:
        assert [w.window for w in reader.load_windows(final.run_id)] == [w.window for w in history.closed]
        assert reader.get_run(final.run_id).verdict is not None

"""End to end, compressed: ``soakd demo``, SIGTERM mid-run, ``max_requests``, and a target that
is down when the soak starts."""

from __future__ import annotations

import asyncio
import json
import re
import signal
from pathlib import Path

import junitparser
import pytest
from prometheus_client.parser import text_string_to_metric_families

from soakd.config import load_config
from soakd.runtime import Runtime
from helpers import QUICK_SIM, SoakdProcess, free_port, http_get, report_of, run_outcomes, run_soakd, sim_server

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]

WINDOW_ROW = re.compile(r"^\s+(\d+)(\*?)\s+(\d+)\s+[\d.]+\s+\d+\s+\d+/\d+\s+\d+/\d+\s+\d+\s+([\d.]+)%(?:\s+\S.*)?$")  # notes may follow


def summary_rows(out: str) -> list[tuple[int, bool, int, float]]:
    rows = []
    for line in out.splitlines():
        m = WINDOW_ROW.match(line)
        if m:
            rows.append((int(m.group(1)), m.group(2) == "*", int(m.group(3)), float(m.group(4))))
    return rows


async def test_demo(tmp_path: Path) -> None:
    rc, out, err = await run_soakd(
        "demo", "--duration", "8s", "--window", "2s", "--warmup", "1s", "--metrics-port", "0", "--no-progress",
        "--junit", "ci/soak.xml", cwd=tmp_path, timeout=60,
    )  # fmt: skip
    # ~20 requests per 2 s window are below min_requests (50): nothing can be judged, and soakd says so
    assert rc == 3, out[-3000:] + err[-3000:]
    assert re.search(r"verdict: INCONCLUSIVE — 0 of \d full windows could be judged", out), out[-1500:]
    assert "soakd demo: simulator at http://127.0.0.1:" in out
    assert "metrics at http://127.0.0.1:0/" not in out  # port 0 is not an address anyone can use
    assert "soakd summary" in out and "ended: duration" in out
    rows = summary_rows(out)
    assert len(rows) >= 3, out[-3000:]
    assert [r[0] for r in rows] == list(range(len(rows)))
    assert all(r[2] > 0 for r in rows) and all(r[3] == 0.0 for r in rows)  # no faults configured
    assert [r[1] for r in rows][:-1] == [False] * (len(rows) - 1)
    assert "requests measured:" in out and "ok=" in out
    reports = list((tmp_path / "soakd-state").glob("*/report.json"))
    assert len(reports) == 1 and json.loads(reports[0].read_text())["run"]["stop_reason"] == "duration"
    # --junit: INCONCLUSIVE is an error of the verdict case, the windows too small to judge are skipped
    suite = next(iter(junitparser.JUnitXml.fromfile(str(tmp_path / "ci" / "soak.xml"))))
    cases = {(c.classname, c.name): c.result for c in suite}
    verdict = cases[("soakd.verdict", "verdict")]
    assert len(verdict) == 1 and isinstance(verdict[0], junitparser.Error) and "INCONCLUSIVE" in verdict[0].message
    windows = [r for (cls, _), r in cases.items() if cls == "soakd.windows"]
    assert len(windows) == len(rows) and all(r and isinstance(r[0], junitparser.Skipped) for r in windows[:-1])
    assert suite.errors == 1 and suite.failures == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
async def test_sigterm_drains_and_writes_a_partial_window(tmp_path: Path, sig: signal.Signals) -> None:
    """JSON logs: read /metrics from the soakd_started line's metrics_url, SIGTERM (or SIGHUP: a
    closed terminal, a dropped ssh session; it had killed soakd at once, exit 129, no report) in
    the middle of a window, then: exit 0, in-flight requests drained (none cancelled), the last window partial,
    the report (report.json, from the store) and the soakd_finished event agree."""
    async with sim_server(**dict(QUICK_SIM, tpot_base=0.005)) as sim:
        proc = await SoakdProcess.start(
            "run", "--target", sim.base_url, "--duration", "60s", "--window", "1s", "--warmup", "0.5s",
            "--concurrency", "3", "--mix", "short_chat=2,multi_turn=1", "--metrics-host", "127.0.0.1",
            "--metrics-port", "0", "--state-dir", str(tmp_path), "--log-format", "json", "--no-progress",
        )  # fmt: skip
        try:
            started = await proc.json_event("soakd_started")
            metrics_url = started["metrics_url"]
            assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", metrics_url) and not metrics_url.endswith(":0/metrics")
            await proc.json_event("window_closed")
            status, text = await http_get(metrics_url)
            assert status == 200
            ok = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                  if s.name == "soakd_requests_total" and s.labels == {"target": "main", "scenario": "short_chat", "outcome": "ok"}]
            assert len(ok) == 1 and ok[0] > 0
            await asyncio.sleep(0.4)  # into the next window
            proc.signal(sig)
            finished = await proc.json_event("soakd_finished", timeout=30)
            rc = await proc.finish()
        finally:
            await proc.kill()
    assert rc == 0, proc.output()[-3000:] + proc.stderr[-2000:]
    assert finished["stop_reason"] == sig.name
    events = [json.loads(line)["event"] for line in proc.lines if line.startswith("{")]
    assert "stop_requested" in events and "drain_grace_expired" not in events
    report = json.loads(Path(finished["report"]).read_text())
    assert report["run"]["stop_reason"] == sig.name
    outcomes = run_outcomes(report)
    assert outcomes["cancelled"] == 0 and outcomes["ok"] == finished["requests_measured"]
    windows = report["windows"]
    assert len(windows) >= 2
    assert windows[-1]["partial"] is True and not any(w["partial"] for w in windows[:-1])
    assert windows[-1]["duration_seconds"] < 1.0
    assert finished["requests_sent"] == finished["requests_measured"] + finished["warmup_requests"]


async def test_max_requests_sends_exactly_that_many(tmp_path: Path) -> None:
    async with sim_server(**QUICK_SIM) as sim:
        cfg = load_config(None, {
            "target": {"url": sim.base_url},
            "run": {"duration": 60.0, "window": 10.0, "warmup": 0, "max_requests": 25, "state_dir": str(tmp_path)},
            "load": {"concurrency": 4},
            "scenarios": {"long_context": {"max_tokens": 16}, "code_completion": {"max_tokens": 16}},
            "metrics": {"host": "127.0.0.1", "port": 0},
        }, environ={})  # fmt: skip
        t0 = asyncio.get_running_loop().time()
        final = await asyncio.wait_for(Runtime(cfg, progress=False).run(), 30)
        elapsed = asyncio.get_running_loop().time() - t0
        received = len(sim.recent)
    assert final.stop_reason == "max_requests"
    assert final.requests_sent == 25 == received
    assert final.requests_measured == 25 and final.outcomes["ok"] == 25
    assert elapsed < 30  # it did not run to the duration
    windows = report_of(tmp_path)["windows"]
    assert len(windows) == 1 and windows[0]["partial"] is True


async def test_target_down_at_start_then_up(tmp_path: Path) -> None:
    port = free_port()
    proc = await SoakdProcess.start(
        "run", "--target", f"http://127.0.0.1:{port}/v1", "--duration", "2s", "--window", "1s", "--warmup", "0s",
        "--concurrency", "2", "--mix", "short_chat=1", "--metrics-host", "127.0.0.1", "--metrics-port", "0",
        "--state-dir", str(tmp_path), "--log-format", "json", "--no-progress",
    )  # fmt: skip
    try:
        unreachable = await proc.json_event("target_unreachable")
        assert unreachable["url"] == f"http://127.0.0.1:{port}/v1"
        async with sim_server(port=port, **QUICK_SIM):
            await proc.json_event("load_started", timeout=20)
            finished = await proc.json_event("soakd_finished", timeout=20)
            rc = await proc.finish()
    finally:
        await proc.kill()
    assert rc == 3, proc.output()[-3000:]  # two 1 s windows: INCONCLUSIVE (exit code 3), not a failure
    assert finished["stop_reason"] == "duration"
    assert finished["requests_measured"] > 0 and set(finished["outcomes"]) == {"ok"}
    # logged once while down, not once per retry
    assert sum('"target_unreachable"' in line for line in proc.lines) == 1


async def test_grace_expiry_cancels_in_flight_requests_as_cancelled(tmp_path: Path) -> None:
    """Requests still running when the drain grace runs out are cancelled and counted as
    ``cancelled`` (not lost); the run still ends with a summary and nothing in flight."""
    async with sim_server(**dict(QUICK_SIM, tpot_base=0.05)) as sim:  # ~3 s per 64-token request
        cfg = load_config(None, {
            "target": {"url": sim.base_url},
            "run": {"duration": 1.0, "window": 1.0, "warmup": 0, "grace": 0.3, "state_dir": str(tmp_path)},
            "load": {"concurrency": 2, "mix": {"short_chat": 1}},
            "scenarios": {"short_chat": {"max_tokens": 64}},
            "metrics": {"host": "127.0.0.1", "port": 0},
        }, environ={})  # fmt: skip
        runtime = Runtime(cfg, progress=False)
        final = await asyncio.wait_for(runtime.run(), 20)
    assert final.stop_reason == "duration"
    assert final.outcomes["cancelled"] == 2 and final.requests_measured == 2
    assert runtime.metrics.requests.get("short_chat", "cancelled") == 2
    assert runtime.metrics.in_flight.value == 0
    assert report_of(tmp_path)["windows"][-1]["outcomes"]["cancelled"] == 2


async def test_second_stop_cancels_without_waiting_for_the_grace(tmp_path: Path) -> None:
    async with sim_server(**dict(QUICK_SIM, tpot_base=0.05)) as sim:
        cfg = load_config(None, {
            "target": {"url": sim.base_url},
            "run": {"duration": 60.0, "window": 1.0, "warmup": 0, "grace": 30.0, "state_dir": str(tmp_path)},
            "load": {"concurrency": 2, "mix": {"short_chat": 1}},
            "scenarios": {"short_chat": {"max_tokens": 64}},
            "metrics": {"host": "127.0.0.1", "port": 0},
        }, environ={})  # fmt: skip
        runtime = Runtime(cfg, progress=False)
        task = asyncio.create_task(runtime.run())
        await asyncio.sleep(0.5)
        runtime.request_stop("SIGTERM")
        await asyncio.sleep(0.2)
        assert not task.done()  # draining: the 3 s requests are still running
        runtime.request_stop("SIGTERM")
        final = await asyncio.wait_for(task, 5)  # well inside the 30 s grace
    assert final.stop_reason == "SIGTERM"
    assert final.outcomes["cancelled"] == 2
    assert runtime.metrics.in_flight.value == 0

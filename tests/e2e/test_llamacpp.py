"""End to end against llama.cpp's native ``llama-server`` (CPU, a tiny random-weight GGUF).

Prepared by tests/e2e/prepare_llamacpp.py (``make e2e-prepare``, run by ``make test``): the binary
is built from the llama.cpp source vendored in the pinned llama-cpp-python sdist, the model is
written by make_tiny_gguf.py. Missing assets fail these tests with the command to run.

1. ``soakd check`` passes against the real server.
2. A time-compressed soak of every built-in scenario (15 s windows) with the server killed
   (SIGKILL) mid-soak and restarted on the same port: outcomes, latencies, llama.cpp's absent KV
   gauge, the outage (``soakd_target_up`` 0, connect failures, "target restarted"), recovery,
   closed windows and the report.
3. Keep-alive: connection reuse at concurrency 8 against llama-server, how many requests fail
   with a dropped connection (classified ``connection_error``), and that ``--no-keep-alive``
   has none.

Loopback only; every soak is bounded by its duration and the test timeout.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from llamacpp_server import LlamaServer, SoakdProcess, metric_values, run_soakd, scrape

pytestmark = [pytest.mark.e2e]

# Random weights: any token sequence is "valid"; the model is built to emit only whole words, but a
# real tokenizer may still split a UTF-8 character across stream events, so U+FFFD is not a defect.
VALIDATION = {"replacement_chars": False}
# llama.cpp honours ignore_eos: outputs are exactly max_tokens long (comparable windows)
IGNORE_EOS = {"ignore_eos": True}
ALL_SCENARIOS = ("short_chat", "long_context", "batch_burst", "multi_turn", "code_completion")


def soak_config(path: Path, *, keep_alive: bool = True, scenarios: dict[str, Any] | None = None) -> Path:
    cfg = {
        "target": {
            "keep_alive": keep_alive,
            "validation": VALIDATION,
            "timeouts": {"connect": "2s", "first_token": "30s", "idle": "15s", "total": "90s"},
        },
        "scenarios": scenarios
        if scenarios is not None
        else {
            # the built-in defaults (prompt lengths fit a 4,096-token slot), outputs shortened so a
            # 15 s window on 2 CPU cores holds tens of requests
            "short_chat": {"max_tokens": [32, 64], "extra_body": IGNORE_EOS},
            "long_context": {"max_tokens": 128, "extra_body": IGNORE_EOS},
            "batch_burst": {"max_tokens": [16, 32], "burst_size": 4, "extra_body": IGNORE_EOS},
            "multi_turn": {"max_tokens": [32, 64], "turns": 3, "extra_body": IGNORE_EOS},
            "code_completion": {"max_tokens": [32, 64], "extra_body": IGNORE_EOS},
        },
        # probes at the middle of each 15 s window (settle 1 s), the canary at temperature 0 with them
        "analysis": {"quiesce": {"settle": "1s", "drain_timeout": "20s"}},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_args(cfg: Path, url: str, state: Path, *extra: str) -> list[str]:
    return [
        "run", "-c", str(cfg), "--target", url, "--metrics-host", "127.0.0.1", "--metrics-port", "0",
        "--state-dir", str(state), "--log-format", "json", "--nvml", "off", "--sample-interval", "1s",
        "--grace", "20s", "--new-run", *extra,
    ]  # fmt: skip


def events(proc: SoakdProcess, name: str) -> list[dict[str, Any]]:
    out = []
    for line in proc.lines:
        if f'"{name}"' not in line:
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if obj.get("event") == name:
            out.append(obj)
    return out


async def poll_metrics(url: str, predicate: Any, timeout: float, what: str) -> str:
    """Scrape soakd's /metrics until ``predicate(text)``; returns that exposition."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        try:
            text = await scrape(url)
        except Exception:  # noqa: BLE001 - soakd is busy; try again
            text = ""
        if text and predicate(text):
            return text
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last /metrics:\n{text[-3000:]}")


def one(text: str, name: str, labels: str = "") -> float | None:
    """The sample of ``name`` with exactly ``labels`` (besides the single target's target="main")."""
    for key, v in metric_values(text, name).items():
        if ",".join(p for p in key.split(",") if p and p != 'target="main"') == labels:
            return v
    return None


def failures_by_reason(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, v in metric_values(text, "soakd_request_failures_total").items():
        reason = [p.split("=", 1)[1].strip('"') for p in labels.split(",") if p.startswith("reason=")]
        if reason:
            out[reason[0]] = out.get(reason[0], 0.0) + v
    return out


def outcomes_total(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, v in metric_values(text, "soakd_requests_total").items():
        oc = [p.split("=", 1)[1].strip('"') for p in labels.split(",") if p.startswith("outcome=")]
        if oc:
            out[oc[0]] = out.get(oc[0], 0.0) + v
    return out


# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
async def test_check_passes_against_llama_server(tmp_path: Path) -> None:
    async with LlamaServer(tmp_path) as srv:
        rc, out, err = await run_soakd("check", "--target", srv.base_url, timeout=60)
    assert rc == 0, f"soakd check failed against llama-server:\n{out}\n{err}"
    assert "4/4 probes passed" in out, out


@pytest.mark.timeout(300)
async def test_soak_all_scenarios_with_outage_and_recovery(tmp_path: Path) -> None:
    state = tmp_path / "state"
    cfg = soak_config(tmp_path / "soak.yaml", keep_alive=False)
    window, warmup, duration = 15.0, 5.0, 95.0  # six 15 s windows after a 5 s warm-up
    mix = "short_chat=4,long_context=1,batch_burst=1,multi_turn=2,code_completion=1"
    timeline: dict[str, float] = {}
    async with LlamaServer(tmp_path) as srv:
        t0 = time.monotonic()
        soak = await SoakdProcess.start(*run_args(
            cfg, srv.base_url, state, "--duration", f"{duration:.0f}s", "--window", f"{window:.0f}s",
            "--warmup", f"{warmup:.0f}s", "--concurrency", "4", "--mix", mix,
        ))  # fmt: skip
        scrape_task: asyncio.Task[None] | None = None
        try:
            started = await soak.json_event("soakd_started", timeout=30)
            metrics_url = started["metrics_url"]
            run_id = started["run_id"]
            last: list[str] = [""]

            async def scraper() -> None:  # the last exposition before soakd exits (failure reasons)
                while True:
                    try:
                        last[0] = await scrape(metrics_url)
                    except Exception:  # noqa: BLE001 - busy or shutting down
                        pass
                    await asyncio.sleep(1.0)

            scrape_task = asyncio.create_task(scraper())
            await soak.json_event("window_closed", timeout=warmup + window + 30)
            # steady state: the real server's gauges, and no invented KV usage
            up = await poll_metrics(metrics_url, lambda t: one(t, "soakd_server_requests_running") is not None,
                                    10, "soakd_server_requests_running")  # fmt: skip
            assert one(up, "soakd_target_up") == 1.0
            assert metric_values(up, "soakd_server_kv_cache_usage_ratio") == {}, "absent, never an invented 0"
            assert one(up, "soakd_sampler_up", 'sampler="server"') == 1.0
            info = metric_values(up, "soakd_server_info")  # kind, and the build llama-server says at /props
            assert [v for k, v in info.items() if 'kind="llamacpp"' in k and 'version="' in k] == [1.0], info
            await soak.json_event("window_closed", timeout=window + 30)  # window 1

            # the outage: SIGKILL (a crash) early in window 2, 5 s down, restart on the same port
            await asyncio.sleep(0.5)
            srv.kill(signal.SIGKILL)
            timeline["killed"] = time.monotonic() - t0
            down = await poll_metrics(metrics_url, lambda t: one(t, "soakd_target_up") == 0.0, 10,
                                      "soakd_target_up 0 after the kill")  # fmt: skip
            timeline["target_up_0"] = time.monotonic() - t0
            await asyncio.sleep(5.0)
            down = await scrape(metrics_url)
            assert one(down, "soakd_target_up") == 0.0
            assert failures_by_reason(down).get("connect_failed", 0) > 0, failures_by_reason(down)
            assert outcomes_total(down).get("connection_error", 0) > 0
            assert one(down, "soakd_sampler_up", 'sampler="server"') == 0.0
            assert soak.proc.returncode is None, "soakd keeps running through the outage"
            srv.start()
            timeline["restarted"] = time.monotonic() - t0
            timeline["ready_after_s"] = await srv.wait_ready()
            await poll_metrics(metrics_url, lambda t: one(t, "soakd_target_up") == 1.0, 15,
                               "soakd_target_up 1 after the restart")  # fmt: skip
            timeline["target_up_1"] = time.monotonic() - t0
            await poll_metrics(metrics_url, lambda t: one(t, "soakd_sampler_up", 'sampler="server"') == 1.0, 10,
                               "the server sampler up again")  # fmt: skip
            timeline["sampler_up_1"] = time.monotonic() - t0
            rc = await soak.finish(timeout=duration + 60)
            timeline["finished"] = time.monotonic() - t0
        finally:
            if scrape_task is not None:
                scrape_task.cancel()
            await soak.kill()

    out = soak.output()
    reasons = failures_by_reason(last[0])
    print("failure reasons:", reasons)
    print("outage timeline (s since soakd start):", json.dumps({k: round(v, 2) for k, v in timeline.items()}))
    assert rc in (0, 1, 3), f"soakd exited {rc}:\n{out[-4000:]}\n{soak.stderr[-2000:]}"  # a verdict, not a crash
    assert "Traceback" not in soak.stderr, soak.stderr[-3000:]
    assert len(events(soak, "server_no_kv_gauge")) == 1, "said once, also across the server's restart"
    assert events(soak, "target_down") and events(soak, "target_up")

    run_dir = state / run_id
    report = json.loads((run_dir / "report.json").read_text())
    for name in ("report.md", "report.html"):
        assert (run_dir / name).stat().st_size > 0, name
    finished = events(soak, "soakd_finished")[-1]
    windows = [w for w in report["windows"] if not w.get("partial")]
    print("windows:", json.dumps([{k: w.get(k) for k in ("window", "requests", "outcomes", "target_down_seconds",
                                                        "paused_seconds")} for w in report["windows"]]))
    assert [w["window"] for w in windows][:6] == list(range(6)), [w["window"] for w in report["windows"]]

    # outcomes: only ok outside the outage; the outage is connection errors, nothing invalid
    oc = finished["outcomes"]
    oc = {o: oc.get(o, 0) for o in ("ok", "http_error", "timeout", "connection_error", "invalid_response",
                                     "cancelled")}
    print("outcomes:", oc, "prompt_length_accuracy:", finished.get("prompt_length_accuracy"))
    assert oc["invalid_response"] == 0 and oc["http_error"] == 0 and oc["timeout"] == 0, (oc, reasons)
    assert oc["connection_error"] > 0 and oc["ok"] > 100, oc
    outage = [w for w in windows if (w.get("target_down_seconds") or 0) > 0]
    assert [w["window"] for w in outage] == [2], [(w["window"], w.get("target_down_seconds")) for w in windows]
    assert 4.0 <= outage[0]["target_down_seconds"] <= 12.0, outage[0]
    for w in windows:
        failed = {k: v for k, v in w["outcomes"].items() if k != "ok" and v}
        if w["window"] == 2:  # the requests in flight at the kill and those sent while it was down
            assert set(failed) == {"connection_error"}, w["outcomes"]
        else:
            assert not failed, (w["window"], w["outcomes"])
        assert w["requests"] >= 10, w
    served = set()
    for w in windows:
        served |= set(w.get("scenarios") or {})
    assert served == set(ALL_SCENARIOS), served

    # latencies are plausible for a tiny model on a CPU: positive, ordered, well under a second
    # per token; long prompts take longer to prefill than short ones
    base = windows[0]
    for key in ("ttft_seconds", "e2e_seconds"):
        q = base[key]
        assert 0 < q["p50"] <= q["p95"], (key, q)
    assert base["ttft_seconds"]["p50"] < 5.0 and base["itl_seconds"]["p50"] < 0.25, base
    assert base["e2e_seconds"]["p50"] > base["ttft_seconds"]["p50"]
    # tokens stream one by one, not in one burst: one inter-token gap per token after the first, and gaps
    # that take time. Beside other work llama-server's HTTP thread writes several of the tiny model's tokens
    # (a millisecond apart) in one send, and they arrive together: seen beside a benchmark on the other
    # core, ITL p50 0 and p95 2.8 ms (8,275 gaps in 183 requests). The median gap is no evidence either way.
    itl = base["itl_seconds"]
    assert 0 <= itl["p50"] <= itl["p95"] and itl["p95"] > 1e-5, itl
    assert itl["count"] >= 8 * base["e2e_seconds"]["count"], (itl, base["e2e_seconds"])
    # llama-server's own inter-token mean (its generation-time and generated-token counters, added as each slot
    # ends) beside soakd's: the same quantity within a small factor (seconds, not ms: a unit slip is 1000x). The
    # outage's window is left out (across a restart the mean is None, or the part before or after it).
    means = [(w["window"], w["server"].get("itl_mean_seconds"), w["itl_seconds"].get("mean"))
             for w in windows if w["window"] != 2]
    print("ITL means (window, llama-server's, soakd's):", means)
    assert sum(1 for _, theirs, _ in means if theirs is not None) >= 3, means
    assert all(0.25 < theirs / ours < 4.0 for _, theirs, ours in means if theirs and ours), means
    # ignore_eos is honoured and usage comes from the server: every response is max_tokens long
    # (at least 16, batch_burst's minimum)
    assert base["completion_tokens"] >= 16 * base["requests"], base
    sc = base["scenarios"]
    assert sc["long_context"]["ttft_seconds"]["p50"] > sc["short_chat"]["ttft_seconds"]["p50"], sc
    assert sum(w["completion_tokens"] for w in windows) > 0 and sum(w["prompt_tokens"] for w in windows) > 0
    acc = finished["prompt_length_accuracy"]
    assert acc["samples"] > 50 and abs(acc["median"]) < 0.25, acc  # the tiny vocabulary: ~1 token per word

    # the report says what happened
    findings = [ev for group in report["findings"].values() for ev in group if ev.get("diagnosis")]
    diagnoses = [f.get("diagnosis") for f in findings]
    assert "target restarted" in diagnoses, findings
    assert "target restarted" in (run_dir / "report.md").read_text()
    assert report["run"]["server_kind"] == "llamacpp"
    restarted = [f for f in findings if f.get("diagnosis") == "target restarted"]
    assert [f["window"] for f in restarted] == [2] and restarted[0]["severity"] == "critical", restarted


async def _keep_alive_soak(tmp_path: Path, srv: LlamaServer, keep_alive: bool) -> dict[str, Any]:
    tag = "ka" if keep_alive else "noka"
    cfg = soak_config(tmp_path / f"{tag}.yaml", keep_alive=keep_alive, scenarios={
        "short_chat": {"prompt_tokens": [32, 64], "max_tokens": [8, 16], "extra_body": IGNORE_EOS},
        "batch_burst": {"prompt_tokens": [32, 64], "max_tokens": [8, 16], "burst_size": 8, "extra_body": IGNORE_EOS},
    })  # fmt: skip
    proc = await SoakdProcess.start(*run_args(
        cfg, srv.base_url, tmp_path / f"state-{tag}", "--duration", "25s", "--window", "10s", "--warmup", "3s",
        "--concurrency", "8", "--mix", "short_chat=3,batch_burst=1",
    ))  # fmt: skip
    try:
        started = await proc.json_event("soakd_started", timeout=30)
        last = ""

        async def scraper() -> None:  # the last exposition before soakd exits (its failure counters)
            nonlocal last
            while True:
                try:
                    last = await scrape(started["metrics_url"])
                except Exception:  # noqa: BLE001 - shutting down
                    pass
                await asyncio.sleep(1.0)

        task = asyncio.create_task(scraper())
        try:
            rc = await proc.finish(60)  # reads stdout while it runs: the pipe never fills
        finally:
            task.cancel()
    finally:
        await proc.kill()
    finished = events(proc, "soakd_finished")[-1]
    oc = {o: finished["outcomes"].get(o, 0) for o in ("ok", "http_error", "timeout", "connection_error",
                                                       "invalid_response", "cancelled")}
    total = sum(oc.values()) + finished.get("warmup_requests", 0)
    failed = failures_by_reason(last)
    return {"rc": rc, "outcomes": oc, "reasons": failed, "requests": total,
            "conn_share": oc["connection_error"] / max(1, sum(oc.values())),
            "target_down": len(events(proc, "target_down")), "drop_logged": len(events(proc, "connection_dropped_while_up")),
            "target_up": one(last, "soakd_target_up"), "stderr": proc.stderr}  # fmt: skip


@pytest.mark.timeout(180)
async def test_keep_alive_reuse_and_no_keep_alive(tmp_path: Path) -> None:
    async with LlamaServer(tmp_path) as srv:
        ka = await _keep_alive_soak(tmp_path, srv, keep_alive=True)
        noka = await _keep_alive_soak(tmp_path, srv, keep_alive=False)
    for name, r in (("keep-alive", ka), ("no keep-alive", noka)):
        print(f"{name}: {r['requests']} requests, outcomes {r['outcomes']}, failure reasons {r['reasons']}, "
              f"connection_error share {r['conn_share']:.2%}, target_down events {r['target_down']}")
        assert r["rc"] in (0, 1, 3) and "Traceback" not in r["stderr"], r["stderr"][-3000:]  # any verdict
        assert r["outcomes"]["ok"] > 100
        assert r["outcomes"]["invalid_response"] == 0 and r["outcomes"]["timeout"] == 0
    # llama-server (this pinned build) closes the connection after every streamed response without
    # `Connection: close`: the next request on a reused connection fails. Measured here: about a
    # third of the requests at concurrency 8. Each is a connection_error saying the server
    # disconnected; the target stays up (it answers everyone else), once said in the log.
    assert ka["conn_share"] > 0.05, f"llama-server's keep-alive drops did not reproduce: {ka['outcomes']}"
    assert set(ka["reasons"]) <= {"server_disconnected", "disconnected"}, ka["reasons"]
    assert ka["target_down"] == 0 and ka["target_up"] == 1.0, "dropped connections are not an outage"
    assert ka["drop_logged"] == 1
    # one connection per request: nothing to drop
    assert noka["outcomes"]["connection_error"] == 0, noka
    assert noka["reasons"] == {} and noka["drop_logged"] == 0, noka


@pytest.mark.timeout(300)
async def test_sweep_against_llama_server(tmp_path: Path) -> None:
    """``soakd sweep`` against the real llama-server (4 slots, CPU): every step answered in full,
    its quantiles with intervals, a knee or the end of the range named. On 2 shared cores the
    server's CPU is the limit, so where the knee falls is reported, not asserted."""
    cfg = soak_config(tmp_path / "sweep.yaml", keep_alive=False, scenarios={
        "short_chat": {"max_tokens": 16, "extra_body": IGNORE_EOS}})
    data = yaml.safe_load(cfg.read_text())
    data["sweep"] = {"min_requests": 120}
    cfg.write_text(yaml.safe_dump(data))
    async with LlamaServer(tmp_path) as srv:
        rc, out, err = await run_soakd(
            "sweep", "-c", str(cfg), "--target", srv.base_url, "--mix", "short_chat=1", "--levels", "1,2,4,8",
            "--step", "6s", "--step-warmup", "1s", "--grace", "20s", "--metrics-host", "127.0.0.1",
            "--metrics-port", "0", "--state-dir", str(tmp_path / "state"), "--log-format", "json",
            "--json", str(tmp_path / "sweep.json"), timeout=240)
    print("\n" + out[out.find("soakd sweep "):])
    assert rc in (0, 1, 3) and "Traceback" not in err, err[-3000:]
    doc = json.loads((tmp_path / "sweep.json").read_text())
    # 3: no knee within the levels (throughput still rising at the last one), said so, no knee
    assert (rc == 3) == (doc["stop_reason"] == "end") and (rc != 3 or doc["knee"] is None), (rc, doc["message"])
    assert doc["steps"] and doc["stop_reason"] in ("plateau", "end", "errors", "slo", "queue"), doc["message"]
    for s in doc["steps"]:
        assert s["requests"] >= 120 and s["requests_per_second"] > 0, s
        assert s["latency"]["e2e_p50"]["ci"] is not None and s["latency"]["e2e_p95"]["ci"] is not None, s
    assert doc["stop_reason"] == "errors" or all(s["error_rate"] == 0 for s in doc["steps"]), doc["steps"]
    if rc == 0:
        assert doc["knee"]["level"] in doc["levels"]

"""benchmarks/client_capacity.py works: its server streams valid OpenAI chunks, its bare client
completes requests against it, the timed server's own timestamps line up with a client's on one
clock, and a ``soakd run`` goes through it end to end. Functional only: no performance assertion
(the numbers depend on the machine; the benchmark itself reports them).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import urllib.request
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.timeout(120)

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "client_capacity.py"


@pytest.fixture(scope="module")
def cc() -> ModuleType:
    spec = importlib.util.spec_from_file_location("client_capacity", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["client_capacity"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _sse_data(body: bytes) -> list[bytes]:
    return [block[6:] for block in body.split(b"\n\n") if block.startswith(b"data: ")]


def test_server_speaks_openai_streaming(cc: ModuleType) -> None:
    with cc.ServerProcess() as srv:
        with urllib.request.urlopen(srv.url + "/v1/models", timeout=10) as r:
            assert json.loads(r.read())["data"][0]["id"] == cc.MODEL
        for _ in range(2):  # ids advance per request
            req = urllib.request.Request(srv.url + "/v1/chat/completions", data=cc.bare_payload(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as r:
                assert r.headers["Content-Type"] == "text/event-stream"
                rid = r.headers["X-Request-Id"]
                events = _sse_data(r.read())  # urllib undoes the chunked framing
        assert events[-1] == b"[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        content = [c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]]
        assert len(content) == cc.N_TOKENS and all(content)
        assert chunks[-1]["usage"]["completion_tokens"] == cc.N_TOKENS
        assert {c["id"] for c in chunks} == {rid} and rid == "chatcmpl-000000000001"


def test_bare_client_against_the_zero_latency_server(cc: ModuleType) -> None:
    with cc.ServerProcess() as srv:
        res = asyncio.run(cc.bare_client(srv.url, concurrency=4, duration=1.0))
    assert res["completed"] > 0 and res["errors"] == 0
    assert res["tokens"] == cc.N_TOKENS * res["completed"]


def test_capacity_runs_pin_the_server_and_the_clients_apart_and_restore(cc: ModuleType) -> None:
    import os

    mine = os.sched_getaffinity(0)
    with cc.ServerProcess() as srv:
        with cc.pinned_apart(srv.pid) as pin:
            if pin is None:  # one CPU, or a sandbox that refuses affinities: nothing pinned
                assert os.sched_getaffinity(0) == mine
                if len(mine) >= 2:  # then it must be the sandbox
                    try:
                        os.sched_setaffinity(0, {min(mine)})
                    except OSError:
                        pass
                    else:
                        os.sched_setaffinity(0, mine)
                        raise AssertionError("affinities can be set here, yet the capacity runs were not pinned")
            else:
                assert pin is not None and pin[0] != pin[1] and {*pin} <= mine
                assert os.sched_getaffinity(srv.pid) == {pin[0]} and os.sched_getaffinity(0) == {pin[1]}
                res = asyncio.run(cc.bare_client(srv.url, concurrency=4, duration=0.5))  # it still serves
                assert res["completed"] > 0 and res["errors"] == 0
        assert os.sched_getaffinity(0) == mine and os.sched_getaffinity(srv.pid) == mine
        with cc.pinned_apart(None) as pin:  # no server process: nothing pinned
            assert pin is None and os.sched_getaffinity(0) == mine


def test_timed_server_timestamps_share_the_clients_clock(cc: ModuleType) -> None:
    """Every request is matched by id; receiving can only follow writing on one clock."""
    with cc.ServerProcess(ttft=0.02, itl=0.002) as srv:
        res = asyncio.run(cc.bare_client(srv.url, concurrency=4, duration=1.0, trace=True))
        ts = srv.timestamps(0)
    errors = cc.timing_errors(res["trace"], ts)
    assert errors["matched"] == res["completed"] > 0
    for kind in ("ttft", "e2e", "send"):
        assert errors[kind]["min"] > 0, (kind, errors[kind])


@pytest.mark.slow
def test_soakd_run_through_the_benchmark(cc: ModuleType) -> None:
    """``python -m soakd run`` as the benchmark runs it: windows give its rate, the trace hook
    (SOAKD_TRACE_FILE) gives per-request times that match the server's by response id."""
    with cc.ServerProcess(ttft=0.02, itl=0.002) as srv:
        run = cc.run_soakd(srv.url, concurrency=4, duration=2.0, trace=True, server_pid=srv.pid)
        ts = srv.timestamps(0)
    assert not run.note, run.note
    assert run.completed > 0 and run.errors == 0 and run.requests_per_second > 0
    errors = cc.timing_errors(run.trace, ts)
    assert errors["matched"] == len(run.trace) > 0
    assert errors["ttft"]["min"] > 0 and errors["e2e"]["min"] > 0


def test_two_load_workers_through_the_benchmark(cc: ModuleType) -> None:
    """The workers comparison's run: ``--workers 2`` against 64-token streams; every request's times reach the
    parent's record listener (the benchmark's trace) and match the server's by response id."""
    with cc.ServerProcess(ttft=0.02, itl=0.002, tokens=64) as srv:
        run = cc.run_soakd(srv.url, concurrency=4, duration=2.0, trace=True, server_pid=srv.pid, tokens=64, workers=2)
        ts = srv.timestamps(0)
    assert not run.note, run.note
    assert run.client == "soakd-2w" and run.completed > 0 and run.errors == 0
    errors = cc.timing_errors(run.trace, ts)
    assert errors["matched"] == len(run.trace) > 0 and errors["ttft"]["min"] > 0


@pytest.mark.slow
def test_soakd_and_the_bare_client_at_once_on_one_cpu(cc: ModuleType) -> None:
    """The same-CPU round: soakd and the bare uvloop client drive load at once; each one's completed requests per
    second of its own CPU time, over the time both drove load."""
    with cc.ServerProcess() as srv:
        r = cc.run_same_cpu(srv.url, concurrency=4, duration=2.0)
    assert "note" not in r, r["note"]
    assert r["soakd"] > 0 and r["bare-uv"] > 0 and r["ratio"] == pytest.approx(r["soakd"] / r["bare-uv"])
    assert 0 < r["seconds"] <= 2.0


def test_report_and_verdict(cc: ModuleType) -> None:
    cap = {"bare": {"requests_per_second": 1000.0, "cpu_percent": 99.0, "server_cpu_percent": 5.0, "runs": [1000.0],
                    "cpu_runs": [99.0], "errors": 0, "notes": []},
           "soakd": {"requests_per_second": 1200.0, "cpu_percent": 80.0, "server_cpu_percent": 5.0,
                     "runs": [1200.0], "cpu_runs": [80.0], "errors": 0, "notes": []}}
    q = {"p50": 0.1, "p99": 1.0, "max": 2.0}
    timing = {c: {"ttft": q, "e2e": q, "send": q, "requests_per_second": 500.0, "cpu_percent": 20.0, "matched": 10}
              for c in ("bare", "soakd")}
    v = cc.verdict(cap, timing, vllm_measured=False)
    assert [c["pass"] for c in v["checks"]] == [True] * 6 and v["pass"]
    res = {"capacity": cap, "timing": timing, "verdict": v,
           "config": {"concurrency": 64, "repeats": 1, "duration": 1.0, "timing_repeats": 1, "ttft": 0.05, "itl": 0.005}}
    text = cc.report(res)
    assert "1.20x" in text and "overall: PASS" in text and "less than 90% of a core" in text
    cap_uv = {**cap, "bare-uv": {**cap["bare"], "requests_per_second": 1100.0}}
    v = cc.verdict(cap_uv, timing, vllm_measured=False, same={"ratio": 0.97})
    both = [c for c in v["checks"] if c["check"].startswith("soakd >= ") and "uvloop" in c["check"]]
    assert [(c["check"], c["basis"], c["pass"]) for c in both] == [
        ("soakd >= the bare uvloop + orjson client", cc.PAIRED_BASIS, True),
        ("soakd >= bare uvloop + orjson per CPU-s", "requests per CPU-second, at once on one CPU", False)]
    assert "[requests per CPU-second, at once on one CPU]" in cc.report({**res, "verdict": v}) and not v["pass"]
    # one sitting's rounds: soakd faster in each round, slower median to median (its slowest rounds met the
    # bare client's fastest): the rounds' ratios judge it, 1.074x, not the medians' 0.991x
    cap_rounds = {**cap, "bare-uv": {**cap["bare"], "runs": [6123.0, 6170.4, 6188.0, 5413.1, 5898.4],
                                     "requests_per_second": 6123.0},
                  "soakd": {**cap["soakd"], "runs": [6576.2, 6673.6, 6031.9, 5955.4, 6067.4],
                            "requests_per_second": 6067.4}}
    check = next(c for c in cc.verdict(cap_rounds, timing, vllm_measured=False)["checks"]
                 if c["check"] == "soakd >= the bare uvloop + orjson client")
    assert check["value"] == pytest.approx(6576.2 / 6123.0) and check["pass"], check
    uneven = {**cap_rounds, "soakd": {**cap_rounds["soakd"], "runs": [6576.2, 6673.6]}}  # no pairs: the medians
    check = next(c for c in cc.verdict(uneven, timing, vllm_measured=False)["checks"]
                 if c["check"] == "soakd >= the bare uvloop + orjson client")
    assert check["value"] == pytest.approx(6067.4 / 6123.0) and not check["pass"], check
    scale = {"tokens": 256, "workers": 2,
             "capacity": {"1": {"tokens_per_second": 200_000.0, "requests_per_second": 781.0, "cpu_percent": 100.0,
                                "runs": [200_000.0], "errors": 0, "notes": []},
                          "2": {"tokens_per_second": 310_000.0, "requests_per_second": 1211.0, "cpu_percent": 190.0,
                                "runs": [310_000.0], "errors": 0, "notes": []}},
             "timing": {"1": {"ttft": q, "e2e": q}, "2": {"ttft": {"p50": 0.1, "p99": 2.5}, "e2e": q}}}
    v = cc.verdict(cap, timing, vllm_measured=False, scale=scale)
    checks = {c["check"]: c["pass"] for c in v["checks"]}
    assert checks == {**checks, "2 workers >= 1.6x the tokens/s of one": False,
                      "2 workers ttft error p99 <= one's + 1 ms": False} and not v["pass"]
    text = cc.report({**res, "verdict": v, "scaling": scale})
    assert "load workers (256-token streams" in text and "1.55x" in text and "overall: FAIL" in text

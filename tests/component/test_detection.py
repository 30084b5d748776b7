"""The analysis end to end: an in-process soak (``soakd.runtime.Runtime``) against the in-process simulator, with
second-long windows, each fault injected and each found -- or, on a clean simulator, nothing found.

These tests run in real time on whatever machine runs them, so they prove the *plumbing* (records ->
windows -> analysis -> findings, gauges, events, the verdict) with faults far beyond the noise: a +50%
latency step, latency doubled by throttling, a 1 GiB/s leak. How often soakd finds a change near its
threshold, and how often it fails a healthy server, is measured on simulated time by
``benchmarks/verdict_quality.py`` and pinned by the seeded cases of ``tests/unit/test_verdict_quality.py``.
No test here skips or retries because the machine was busy: a soak on a busy machine is exactly what users
run, and the analysis has to hold there (batch means over sub-windows widen a window whose requests
stalled together; the live comparisons are Bonferroni-corrected over the run).

Set-up shared by every test (``SIM`` and ``soak_config``):

* The simulator (127.0.0.1, port 0) answers each request with a 30 ms TTFT and 2 more tokens
  30 ms apart (90 ms), every delay multiplied by Gaussian noise of relative standard deviation
  ``jitter`` = 0.15.
* The soak: closed loop, 16 requests in flight, one scenario (``short_chat``: 32 prompt tokens,
  3 output tokens, streamed): ~175 requests per second, ~350 per 2 s window. Samplers every 0.25 s.
  Loopback only. The loop stalls seen during a run (a 10 ms heartbeat late by more than 20 ms) are
  printed with its results.

The fault is placed at a window boundary of the running soak by setting the simulator's fault
field once the soak's timeline exists (``at_window``): the simulator reads its faults live, and
uptime is converted through both clocks, so window k is the first one it touches.

Leak projection: ``analysis.leak.horizon_hours`` is compressed like the run, to 0.01 h (36 s, a
few times a run), and the judged part of a memory series need not span ``min_span`` (4 h).
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from soakd.config import SoakConfig, deep_merge, load_config
from soakd.config.analysis import ClientConfig
from soakd.runtime import Runtime
from soakd.sim import SimConfig, SimServer, fake_pynvml
from soakd.store import StoreReader
from helpers import report_of, wait_until

# run alone in `make test` (its second pass, with the real-server tests): each test judges a live simulator in
# wall time, in soakd's own process, and a load that changes beside it changes the simulator's latency (seen: a
# stationary run paged +20% e2e p95 while the other worker's tests and a benchmark came and went)
pytestmark = [pytest.mark.slow, pytest.mark.alone]

LATENCY = ("e2e_p50", "e2e_p95", "ttft_p50", "ttft_p95", "itl_p50", "itl_p95")
# a +50% step on the simulator's delays, as soakd measures it at p50: diluted by soakd's own
# scheduling delay on a busy 2-core machine (measured: TTFT p50 +34.5% once with the machine loaded
# by a second test run, e2e +42%), or swollen by it when the machine gets busier as the step comes (the
# simulator shares soakd's process: seen e2e p50 +79.8% with a test suite and two CPU-bound processes
# beside it); never twice the step
STEP_SEEN = (0.25, 1.0)

SIM: dict[str, Any] = {
    "host": "127.0.0.1",
    "port": 0,
    "ttft_base": 0.030,
    "tpot_base": 0.030,
    "tpot_per_batch": 0.0,
    "ttft_per_prompt_token": 0.0,
    "jitter": 0.15,
}
# The stationary test: delays 4x SIM's at 2.5x the concurrency (about 2/3 of the requests per second).
# The simulator shares soakd's process and this machine: with two CPU-bound processes beside it, lags of
# 20-50 ms moved SIM's 30 ms TTFT p95 by 20-40% from window to window (seen: "ttft_p95 stepped +29.3%",
# confident, windows 10-16), which no server with a real TTFT shows; the window rules of earlier releases
# (a window with a 250 ms lag, or stalled over 0.5% of its time, not judged) left 19 of 20 windows unjudged.
# At 120 ms a machine's scheduling delay is the noise a real server's client sees; the defaults judge it.
# 40 streams (not 64): soakd's own CPU use stays well below the share of a core it gets beside the two
# processes, so that its queueing delay does not swing as that share does (at 64: ttft_p50 +14.5%, 1 of 4).
SIM_SLOW: dict[str, Any] = {**SIM, "ttft_base": 0.120, "tpot_base": 0.120}
GIB = 1024**3
STALL = 0.02  # loop lags above this are recorded in Soak.stalls (printed, never excused)
# The plumbing tests judge faults far beyond what a stall of this machine does to a 2 s window, and do not
# test soakd's own health: they judge every window and every request (client-impaired off). The stationary
# test and the client-impaired tests keep the defaults: a request that overlapped a loop lag beyond 100 ms
# is impaired (its latency left out), a window with more than a fifth of its requests or time so is not judged.
LAX_CLIENT: dict[str, Any] = {"max_stall_share": 1.0, "max_lag": 3600.0, "max_throttled_share": 1.0,
                              "request_max_lag": 3600.0, "max_impaired_share": 1.0}
# the defaults spelled out: deep-merged over LAX_CLIENT, an empty dict would keep the lax bounds
DEFAULT_CLIENT: dict[str, Any] = ClientConfig().model_dump()


@pytest.fixture(autouse=True)
def _frozen_heap() -> Iterator[None]:
    """Collections scan only what the test creates, not pytest's and every module's objects."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def soak_config(sim: SimServer, state_dir: Path, *, windows: int, window: float = 1.0, warmup: float = 1.0,
                nvml: bool = False, **over: Any) -> SoakConfig:
    base = {
        "target": {"url": sim.base_url},
        "run": {"duration": warmup + windows * window, "window": window, "warmup": warmup, "grace": 5.0,
                "state_dir": str(state_dir)},
        "load": {"concurrency": 16, "mix": {"short_chat": 1}},
        "scenarios": {"short_chat": {"prompt_tokens": 32, "max_tokens": 3}},
        "samplers": {"interval": 0.25, "nvml": {"mode": "on" if nvml else "off"}},
        # the canary (one per quiesce probe) short: 32 tokens x 30 ms would outlast a 1 s window
        "analysis": {"leak": {"horizon_hours": 0.01, "min_span": 0.0}, "canary": {"max_tokens": 4},
                     "client": LAX_CLIENT},
        "metrics": {"host": "127.0.0.1", "port": 0},
        "log": {"progress": False},
    }
    return load_config(None, deep_merge(base, over), environ={})


class Soak:
    """A running daemon with a per-window record of its analysis series (``seen``: one entry per
    window the analyzer took, with every ``soakd_*`` sample of the registry right after it and the
    window's drift results) and of the loop stalls during the run (``stalls``)."""

    def __init__(self, cfg: SoakConfig, nvml: Any = None, record_listeners: tuple[Any, ...] = ()) -> None:
        self.state_dir = cfg.run.state_dir
        self.daemon = Runtime(cfg, progress=False, nvml_module=nvml, new_run=True, record_listeners=record_listeners)
        self.final: dict[str, Any] = {}
        self.extra: dict[str, Any] = {}
        self.seen: list[dict[str, Any]] = []
        self.stalls: list[tuple[float, float, float]] = []
        analyzer = self.daemon.analyzer
        add_window = analyzer.add_window

        def observed(w: Any) -> Any:
            out = add_window(w)
            self.seen.append({"window": w.window, "partial": w.partial, "requests": w.requests,
                              "samples": samples(self.daemon),
                              "drift": [r for r in analyzer.drift.values() if r.window == w.window]})
            return out

        analyzer.add_window = observed  # type: ignore[method-assign]
        self.task = asyncio.create_task(self.daemon.run())
        self._monitor = asyncio.create_task(self._watch_loop())

    async def _watch_loop(self) -> None:
        """Wakes every 10 ms; a wake-up late by more than ``STALL`` is a stall: (loop time, lag,
        the part of it this process spent off the CPU -- starved by the machine, not busy with the
        soak's own work, in the loop or in another of its threads)."""
        loop = asyncio.get_running_loop()
        while True:
            t, cpu = loop.time(), time.process_time()
            await asyncio.sleep(0.01)
            wall = loop.time() - t
            if wall - 0.01 > STALL:
                off_cpu = wall - (time.process_time() - cpu) - 0.01
                self.stalls.append((t, wall - 0.01, max(0.0, off_cpu)))

    def stalls_by_window(self, starved: float | None = None) -> dict[int, list[tuple[int, int]]]:
        """Loop stalls per window as (lag ms, of which off the CPU ms), from 0.2 s before the first
        window (earlier ones count for it); with ``starved``, only the windows whose off-CPU time
        adds up to at least that many seconds."""
        tl, out = self.daemon.timeline, {}
        if tl is None:
            return {}
        for t, lag, off in self.stalls:
            if t >= tl.first_window_start - 0.2:
                out.setdefault(max(tl.window_at(t), tl.first_index), []).append((lag, off))
        return {k: [(round(a * 1000), round(b * 1000)) for a, b in v] for k, v in sorted(out.items())
                if starved is None or sum(b for _, b in v) >= starved}

    def by_window(self) -> dict[int, dict[str, Any]]:
        return {s["window"]: s["samples"] for s in self.seen}

    async def timeline(self) -> Any:
        await wait_until(lambda: self.daemon.timeline is not None or self.task.done(), timeout=10,
                         what="the soak's timeline")
        assert self.daemon.timeline is not None, self.task.result()
        return self.daemon.timeline

    async def finish(self, timeout: float) -> dict[str, Any]:
        try:
            outcome = await asyncio.wait_for(self.task, timeout)
            # every window the run closed, as the report has them, and the verdict
            self.final = {"windows": [w.dump() for w in self.daemon.analyzer.history.closed],
                          "verdict": outcome.verdict.dump() if outcome.verdict is not None else None}
            return self.final
        finally:
            self._monitor.cancel()


def samples(daemon: Runtime) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in daemon.registry.collect() for s in fam.samples if s.name.startswith("soakd_")}


def value(snap: dict, name: str, **labels: str) -> float | None:
    """The sample with exactly ``labels`` (and, on client-side and analysis series, target="main")."""
    exact = snap.get((name, tuple(sorted(labels.items()))))
    if exact is not None:
        return exact
    return snap.get((name, tuple(sorted({**labels, "target": "main"}.items()))))


def at_window(sim: SimServer, tl: Any, k: int, clock: str = "model", offset: float = 0.0) -> float:
    """The simulator uptime (of its engine, or of its device) at which window k of the soak starts
    (plus ``offset`` seconds)."""
    loop_now = asyncio.get_running_loop().time()
    src = sim.model if clock == "model" else sim.device
    uptime_now = src.clock() - src.started
    start, _ = tl.window_bounds(k)
    assert start - loop_now > 0.2, "too late to place the fault at the start of that window"
    return uptime_now + (start + offset - loop_now)


def events(state_dir: Path, run_id: str) -> list[Any]:
    reader = StoreReader(state_dir)
    try:
        return reader.load_events(run_id)
    finally:
        reader.close()


# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
async def test_latency_step_is_flagged_live_and_located_at_the_end(tmp_path: Path) -> None:
    """+50% on every delay from the start of window 4 of 8 (2 s windows, a baseline pool of 3): a
    live degraded latency drift in window 4 (at the latest 5) and nothing before it; at the end of the
    run the change point names window 4 (or 5) with the step's size, *confident*; the verdict FAILs."""
    k = 4

    async def attempt(state_dir: Path) -> Soak:
        async with SimServer(SimConfig(**SIM)) as sim:
            soak = Soak(soak_config(sim, state_dir, windows=8, window=2.0, warmup=2.0,
                                    analysis={"drift": {"baseline_windows": 3}}))
            tl = await soak.timeline()
            sim.config.faults.latency_step_pct = 50.0
            sim.config.faults.latency_step_at = at_window(sim, tl, k)
            await soak.finish(60)
        return soak

    soak = await attempt(tmp_path / "run")
    d, final = soak.daemon, soak.final
    stalls = soak.stalls_by_window()
    windows = final["windows"]
    assert [w["window"] for w in windows] == list(range(8)) and not any(w["partial"] for w in windows)
    # every window judged (a busy machine gives soakd ~100 requests per window instead of ~250: enough)
    assert min(w["requests"] for w in windows) >= d.config.analysis.drift.min_requests, [w["requests"] for w in windows]
    assert [p.window for p in d.analyzer.pool] == [0, 1, 2] and d.analyzer.baseline.window == 0

    live = [f for f in d.analyzer.findings if f.kind == "drift" and f.diagnosis == "performance drift"]
    assert live and all(f.window >= k for f in live), ([(f.window, f.message) for f in live], stalls)
    first = min(f.window for f in live)
    assert first in (k, k + 1), ([(f.window, f.message) for f in live], stalls)
    f = next(f for f in live if f.window == first)
    assert f.severity == "warning"
    hits = [r for r in f.evidence["drift"] if r["metric"] in LATENCY and r["direction"] == "degraded"]
    assert hits, f.message
    # the live rule (``page.scan``): the segment's change beyond the 5% threshold (by a few standard errors)
    # and beyond zero at the run-level significance; the current window's own change beyond the threshold.
    # The interval shown is the current window's, at that significance: on a busy machine a p95 pages with
    # it clearing zero but not 5% (seen: e2e_p95 +33.9% [+0.1%..+79.1%])
    for r in hits:
        assert r["tier"] == "confident" and r["ratio"] > 0.05 and r["segment_ratio"] > 0.05, r
        assert r["windows"] > 1 or r["ratio_ci"][0] > 0, r
    # the step's size, measured: +50% on the simulator's delays; soakd's own scheduling delay on a busy
    # machine (a few ms on a 30 ms TTFT) does not grow with it and dilutes the measured step a little
    on_p50 = [r for r in hits if r["metric"].endswith("_p50")]
    assert on_p50 and all(STEP_SEEN[0] < r["ratio"] < STEP_SEEN[1] for r in on_p50), on_p50

    # the series: nothing detected before k, detected from the first flagged window on
    by_window = soak.by_window()
    for i in range(k):
        assert all(value(by_window[i], "soakd_drift_detected", metric=m) == 0 for m in LATENCY), i
        assert all(value(by_window[i], "soakd_drift_events_total", metric=m) == 0 for m in LATENCY), i
    detected = [m for m in LATENCY if value(by_window[first], "soakd_drift_detected", metric=m) == 1]
    assert {r["metric"] for r in hits if r["reference"] == "baseline"} <= set(detected)
    assert detected and all(value(by_window[first], "soakd_drift_events_total", metric=m) == 1 for m in detected)
    assert value(samples(d), "soakd_verdict_pass") == 0

    # the end of the run: the change point, its size and tier. Each metric's first change is the step's (at k or
    # k + 1); a later one may follow: the simulator shares the machine, and on a loaded one it really slows again
    # (seen under load: ttft_p50 +46.6% from window 4, then +51.8% from window 6, soakd itself never stalled)
    changes = [c for c in final["verdict"]["drift"]["changes"] if c["metric"] in ("e2e_p50", "ttft_p50")]
    seen = [(c["metric"], c["window"], c["tier"], round(c["ratio"], 3)) for c in changes]
    assert changes and all(c["window"] >= k and c["tier"] == "confident" and c["direction"] == "degraded"
                           and STEP_SEEN[0] < c["ratio"] < STEP_SEEN[1] for c in changes), (seen, stalls)
    assert all(min(c["window"] for c in changes if c["metric"] == m) in (k, k + 1)
               for m in {c["metric"] for c in changes}), (seen, stalls)
    print(f"\nstep: first flagged window {first} of step window {k}; requests/window "
          f"{[w['requests'] for w in windows]}; " + "; ".join(
              f"{r['metric']}/{r['reference']} {r['ratio']:+.3f} (CI {r['ratio_ci'][0]:+.3f}..{r['ratio_ci'][1]:+.3f})"
              for r in hits) + f"; at the end: {[c['metric'] + ' from ' + str(c['window']) for c in changes]}"
          f"; loop stalls (ms) by window {stalls}")

    stored = [e for e in events(soak.state_dir, d.run_id) if e.kind == "drift"]
    assert min(e.window for e in stored if e.data["diagnosis"] == "performance drift") == first
    # the end-of-run finding spans its metrics' change points: e2e and TTFT p50 located above; a p95 or a
    # rate may be located one window early on a busy machine (seen: "windows 3-7" for a step at 4, its
    # e2e_p50 "from window 4")
    span = [e for e in stored if e.data["diagnosis"] == "confident drift"]
    assert span and all(k - 1 <= e.window <= k + 1 for e in span), (
        [(c["metric"], c["window"], c["tier"]) for c in final["verdict"]["drift"]["changes"]], stalls)
    assert any(e.data["diagnosis"] == "confident drift" and e.severity == "critical" for e in stored)
    assert final["verdict"]["passed"] is False and final["verdict"]["result"] == "FAIL"
    assert any(r.startswith("drift: performance drift") for r in final["verdict"]["reasons"])
    assert any(r.startswith("drift: confident drift") for r in final["verdict"]["reasons"])


@pytest.mark.timeout(200)
async def test_stationary_noisy_simulator_is_not_flagged_over_twenty_windows(tmp_path: Path) -> None:
    """The noisy simulator at 4x its delays (SIM_SLOW), no fault, 20 windows of 2 s, the default analysis (device
    telemetry through the fake NVML included, so energy per token is judged too): no failing
    finding, every judged comparison ok, the verdict PASS -- or INCONCLUSIVE when this machine kept
    soakd's own loop from running in most windows (client-impaired: shown, never judged), never FAIL."""

    async def attempt(state_dir: Path) -> Soak:
        async with SimServer(SimConfig(**SIM_SLOW)) as sim:
            fake_pynvml.bind(sim.device)
            soak = Soak(soak_config(sim, state_dir, windows=20, window=2.0, warmup=2.0, nvml=True,
                                    load={"concurrency": 40}, analysis={"client": DEFAULT_CLIENT}), nvml=fake_pynvml)
            await soak.finish(90)
        return soak

    soak = await attempt(tmp_path / "run")
    d, final = soak.daemon, soak.final
    metrics = d.config.analysis.drift.metrics
    stalls = soak.stalls_by_window()
    windows = final["windows"]
    assert len(windows) == 20 and not any(w["partial"] for w in windows)
    assert min(w["requests"] for w in windows) >= 110, [w["requests"] for w in windows]  # p95s judged
    assert all((w["device"].get("energy_per_output_token_joules") or 0) > 0 for w in windows)

    # windows in which soakd's own loop stalled (this machine busy) are client-impaired: shown, not judged
    impaired = {w["window"] for w in windows if (w.get("client") or {}).get("impaired")}
    results = [r for s in soak.seen for r in s["drift"]]
    if len(d.analyzer.pool) < d.config.analysis.drift.baseline_windows:
        # so many windows impaired that the baseline pool never filled (seen at nice 10 beside a loaded test
        # suite): nothing was judged, and the run says INCONCLUSIVE with no failing finding -- never FAIL
        assert len(impaired) > 20 - d.config.analysis.drift.baseline_windows, (impaired, stalls)
        assert final["verdict"]["result"] == "INCONCLUSIVE", final["verdict"]
        assert [f for f in d.analyzer.findings if f.severity != "info"] == [], [f.message for f in d.analyzer.findings]
        assert all(r.status == "insufficient" for r in results if r.reference == "baseline"), results
        return  # (not a skip: what a starved soakd must say has been checked; other tests judge the windows)
    pool_last = d.analyzer.pool[-1].window
    assert len(d.analyzer.pool) == d.config.analysis.drift.baseline_windows
    assert not impaired & {p.window for p in d.analyzer.pool}  # never a baseline
    # every window after the pool, against the pool and the previous window
    assert len(results) == sum(w["window"] > pool_last for w in windows) * 2 * len(metrics), len(results)
    judged = [r for r in results if r.window not in impaired
              and not (r.reference == "previous" and r.window - 1 in impaired)]
    # the p99s (tracked by default, issue 21) need more samples than these 2 s windows hold: "insufficient", never
    # flagged; every other comparison is ok
    tails = {m for m in metrics if m.endswith("_p99")}
    not_ok = [r.message() for r in judged if r.status != "ok" and not (r.metric in tails and r.status == "insufficient")]
    assert not_ok == [], (not_ok, f"loop stalls (ms) by window: {stalls}")
    assert all(r.status == "insufficient" for r in results if r.window in impaired)
    assert [f for f in d.analyzer.findings if f.severity != "info"] == [], (
        [f.message for f in d.analyzer.findings], stalls)
    for s in soak.seen:
        assert all(value(s["samples"], "soakd_drift_detected", metric=m) == 0 for m in metrics), s["window"]
    last = samples(d)
    assert all(value(last, "soakd_drift_events_total", metric=m) == 0 for m in metrics)
    leaks = {dict(k[1])["source"]: v for k, v in last.items() if k[0] == "soakd_memory_leak_suspected"}
    assert leaks.get("device_memory") == 0 and leaks.get("kv_cache") == 0 and set(leaks.values()) == {0.0}
    assert value(last, "soakd_throttle_detected") == 0
    v = final["verdict"]
    # a *likely* change (reported, never failing) can happen: the simulator shares this machine, and a busy
    # machine slows it for minutes; nothing confident
    assert v["reasons"] == [] and not [c for c in v["drift"]["changes"] if c["tier"] == "confident"], v["drift"]
    # PASS when at least half the windows (and the pool + 2) could be judged; else INCONCLUSIVE -- never FAIL
    assert v["result"] == ("PASS" if 20 - len(impaired) >= 10 else "INCONCLUSIVE"), (v["result"], impaired)
    assert value(last, "soakd_verdict_pass") == 1  # nothing failed the run
    stored = events(soak.state_dir, d.run_id)
    assert {e.kind for e in stored if e.severity != "info"} == set(), [(e.kind, e.message) for e in stored]
    assert {e.kind for e in stored} <= {"baseline", "canary_reference", "client", "drift"}, {e.kind for e in stored}

    ok = [r for r in judged if r.ratio is not None and r.ratio_ci is not None]  # insufficient p99s have no interval
    worst = {m: max((abs(r.ratio) for r in ok if r.metric == m), default=0.0) for m in metrics}
    # how close a comparison came to a flag: the interval's near end beyond the threshold (> 0 flags)
    # (none when every window after the pool was client-impaired: then there is no closest one to print)
    closest = max(ok, key=lambda r: (r.ratio_ci[0] - r.threshold) if r.ratio >= 0 else (-r.threshold - r.ratio_ci[1]),
                  default=None)
    print(f"\nstationary: requests/window {min(w['requests'] for w in windows)}-{max(w['requests'] for w in windows)}; "
          f"{len(judged)} judged comparisons; client-impaired windows {sorted(impaired)}; largest |change| "
          f"{({m: round(v, 4) for m, v in worst.items()})}; closest to a flag: {closest.message() if closest else None}; "
          f"loop stalls (ms) by window {stalls}; at the end: {[c['metric'] + ' ' + c['tier'] for c in v['drift']['changes']]}")


@pytest.mark.timeout(120)
async def test_kv_leak_is_diagnosed_as_kv_cache_not_released(tmp_path: Path) -> None:
    """8 KV blocks leaked every 20 finished requests (~1.3% of the cache per window); a quiesce
    probe in every 1 s window (settle 0.1 s) reads the idle KV usage, whose residue grows probe
    after probe: 'KV cache not released' once min_windows (6) probes are in.

    ``kv_residue_budget_ratio`` is 0.02 here (default 0.05): the budget is an absolute idle
    residue, which a realistic leak reaches after hours. In 9 compressed windows of ~140 requests
    a leak would have to be ~3x faster to pass 5% by the 6th probe; scaling the budget down keeps
    the leak moderate (it must not fill the cache and stall admission) and the margin wide. No rereads
    (``quiesce.rereads`` 0): this residue is real and reads the same every time; rereading it would
    only take load time (and leaked blocks) from these 1 s windows (test_quiesce covers rereads)."""

    async def attempt(state_dir: Path) -> Soak:
        faults = {"kv_leak_blocks_per_n_requests": 8, "kv_leak_every_n_requests": 20}
        async with SimServer(SimConfig(**SIM, faults=faults)) as sim:
            soak = Soak(soak_config(sim, state_dir, windows=9, analysis={
                "quiesce": {"settle": 0.1, "rereads": 0}, "leak": {"kv_residue_budget_ratio": 0.02}}))
            await soak.finish(40)
            soak.extra["leaked"] = sim.model.kv_leaked
        return soak

    soak = await attempt(tmp_path / "run")
    d, final, leaked = soak.daemon, soak.final, soak.extra["leaked"]
    probes = [(w["window"], w["quiesce"]["kv_cache_usage_ratio"]) for w in final["windows"] if w.get("quiesce")]
    assert len(probes) >= 6, (final["windows"], soak.stalls_by_window())
    residues = [v - probes[0][1] for _, v in probes]
    assert all(b >= a for a, b in zip(residues, residues[1:])) and residues[-1] > 0.05, probes  # only grows
    assert leaked > 0 and probes[-1][1] <= leaked / 4096 + 1e-9

    kv = [f for f in d.analyzer.findings if f.kind == "leak" and f.evidence["source"] == "kv_residue"]
    assert len(kv) == 1, d.analyzer.findings  # reported once, when it becomes suspected
    f = kv[0]
    assert f.diagnosis == "KV cache not released" and f.severity == "critical"
    assert f.window == probes[5][0]  # at the 6th probe (min_windows)
    ev = f.evidence
    assert ev["suspected"] and ev["significant"] and ev["n_windows"] == 6 and ev["projected"] > 0.02
    assert ev["ci"][0] > 0 and ev["residue"] > 0.02
    assert {x.diagnosis for x in d.analyzer.findings if x.kind == "leak"} == {"KV cache not released"}

    by_window = soak.by_window()
    before = [s["window"] for s in soak.seen if s["window"] < f.window]
    assert before and all(value(by_window[i], "soakd_memory_leak_suspected", source="kv_residue") in (0, None)
                          for i in before)
    last = samples(d)
    assert value(last, "soakd_memory_leak_suspected", source="kv_residue") == 1
    assert value(last, "soakd_kv_cache_growth_ratio_per_hour", source="kv_residue") > 0
    assert value(last, "soakd_quiesce_probes_total") >= len(probes)
    assert value(last, "soakd_quiesce_kv_cache_usage_ratio") == pytest.approx(probes[-1][1])
    print(f"\nkv leak: {leaked} blocks leaked; idle KV usage at the probes {[(w, round(v, 4)) for w, v in probes]}; "
          f"flagged in window {f.window}: {f.message}")

    stored = events(soak.state_dir, d.run_id)
    assert sum(e.kind == "quiesce" for e in stored) >= len(probes)
    leak_events = [e for e in stored if e.kind == "leak" and e.data["evidence"]["source"] == "kv_residue"]
    assert len(leak_events) == 1 and leak_events[0].window == f.window
    assert leak_events[0].message.startswith("KV cache not released:")
    assert final["verdict"]["passed"] is False
    assert any(r.startswith("leak: idle KV residue") for r in final["verdict"]["reasons"]), final["verdict"]


@pytest.mark.timeout(120)
async def test_device_memory_leak_is_diagnosed_as_memory_leak(tmp_path: Path) -> None:
    """The simulated GPU leaks 1 GiB/s of device memory (the fake NVML reads it); the idle device memory
    of the quiesce probe in each 1 s window climbs ~1 GiB a window: a 'memory leak' finding (a sustained
    climb) once the sustained part (from a third of the series on) is significant at the run-level confidence
    of the live judgement (issue 21: 1 - 0.05 / the planned looks, 0.9929 over 12 windows). Sen's rank
    interval of 6 probes cannot reach it (a perfect climb's two-sided p is 0.0085), and it paged at the 10th
    or 11th probe; the least-squares interval of a climb that follows the probes' times this closely can, so
    the page comes at the first look with the 6 readings min_windows asks for in the sustained part: the 8th
    probe (the 9th at most). Memory (80 GiB) runs out at that rate within seconds, far inside the 7-day budget."""

    async def attempt(state_dir: Path) -> Soak:
        async with SimServer(SimConfig(**SIM, faults={"device_memory_leak_bytes_per_hour": 3600 * GIB})) as sim:
            fake_pynvml.bind(sim.device)
            soak = Soak(soak_config(sim, state_dir, windows=12, nvml=True, analysis={"quiesce": {"settle": 0.05}}),
                        nvml=fake_pynvml)
            await soak.finish(40)
        return soak

    soak = await attempt(tmp_path / "run")
    d, final = soak.daemon, soak.final
    mins = [(w["device"].get("memory_used_bytes") or {}).get("min") for w in final["windows"]]
    # a 1-s window whose loop stalled may have no device sample (seen beside another make test: window 0 after a 999 ms
    # stall; 3 of 12 windows in another run): the windows that have one climb
    got = [m for m in mins if m is not None]
    assert len(got) >= len(mins) // 2 and all(b > a for a, b in zip(got, got[1:])), (mins, soak.stalls_by_window())

    mem = [f for f in d.analyzer.findings if f.kind == "leak"]
    assert len(mem) == 1, d.analyzer.findings
    f = mem[0]
    assert f.diagnosis == "memory leak" and f.severity == "critical"
    ev = f.evidence
    assert ev["source"] == "device_memory" and ev["unit"] == "bytes" and ev["points"] == "probes"
    # 6 probes in the sustained part (8 - 8 // 3), judged by least squares: never before the 8th probe; later where
    # a loop read a probe's memory late after its recorded time (1 GiB a second: a few hundred ms is a few hundred
    # MiB off the line, and the interval widens). The fresh-clone make test of a17b677 paged at the 10th on an idle
    # machine; the least-squares page on exact probe times is pinned on simulated time (tests/unit/test_leak_probes.py)
    n = ev["n_windows"]
    assert 8 <= n <= 11, (n, ev)  # before the run's last window
    assert ev["pattern"] == "sustained climb" and ev["fails"], ev
    # least squares pages from the 8th probe; from the 10th Sen's rank interval clears 0 itself and judges alone (its
    # evidence names no interval): seen in a fresh-clone make test beside another (probes read late, paged at the 10th)
    assert ev.get("interval", "rank") == "least squares" or n >= 10, ev
    probed = [w["window"] for w in final["windows"] if (w.get("quiesce") or {}).get("memory_used_bytes")]
    assert f.window == probed[n - 1]
    growth = ev["growth_per_hour"]
    assert 0.7 * 3600 * GIB < growth < 1.3 * 3600 * GIB, growth / GIB
    assert ev["ci"][0] > 0 and ev["hours_to_exhaustion"] < 0.1

    by_window = soak.by_window()
    assert all(value(by_window[i], "soakd_memory_leak_suspected", source="device_memory") == 0
               for i in range(f.window))
    last = samples(d)
    assert value(last, "soakd_memory_leak_suspected", source="device_memory") == 1
    assert value(last, "soakd_memory_leak_suspected", source="kv_cache") == 0
    assert value(last, "soakd_memory_growth_bytes_per_hour", source="device_memory") > 0.7 * 3600 * GIB
    print(f"\ndevice memory leak: window minima (GiB) {[round(m / GIB, 2) for m in mins]}; flagged in window "
          f"{f.window}: growth {growth / GIB:.0f} GiB/h (CI {ev['ci'][0] / GIB:.0f}..{ev['ci'][1] / GIB:.0f}), "
          f"memory exhausted in {ev['hours_to_exhaustion'] * 3600:.0f} s at that rate")

    assert value(last, "soakd_memory_steps", source="device_memory") == 0  # a linear leak is no staircase
    assert not [x for x in d.analyzer.findings if x.diagnosis == "memory steps"]
    stored = [e for e in events(soak.state_dir, d.run_id) if e.kind == "leak"]
    assert len(stored) == 1 and stored[0].message.startswith(f"memory leak: device_memory (idle, {n} probes): sustained")
    assert final["verdict"]["passed"] is False
    assert any(r.startswith("leak: device_memory (idle,") and "fails the run" in r for r in final["verdict"]["reasons"])


@pytest.mark.timeout(120)
async def test_device_memory_in_steps_is_named_memory_steps_not_a_leak(tmp_path: Path) -> None:
    """The simulated GPU's memory steps up 512 MiB every 3 s of uptime, three times, then stays flat, with the
    KV cache untouched (what a graph capture or an allocator pool growing per new shape does); the idle
    device memory of the quiesce probes is a staircase. soakd names it once as 'memory steps' (a warning
    with the steps, their total and the window of the last one), counts a later step in an info event,
    exports soakd_memory_steps{source="device_memory"} = 3, and never suspects a leak -- not even while
    the steps still come (their average rate is projected against the exhaustion budget, compressed like
    the run to 36 s: 512 MiB per 3 s exhausts the ~38 GiB left in minutes, beyond it)."""

    async def attempt(state_dir: Path) -> Soak:
        faults = {"device_memory_step_bytes": 512 * 2**20, "device_memory_step_every": 3.0, "device_memory_steps": 3}
        async with SimServer(SimConfig(**SIM, faults=faults)) as sim:
            fake_pynvml.bind(sim.device)
            soak = Soak(soak_config(sim, state_dir, windows=18, nvml=True, analysis={
                "quiesce": {"settle": 0.05}, "leak": {"exhaustion_budget_hours": 0.01}}), nvml=fake_pynvml)
            await soak.finish(60)
        return soak

    soak = await attempt(tmp_path / "run")
    d, final = soak.daemon, soak.final
    probes = [(w["window"], (w.get("quiesce") or {}).get("memory_used_bytes")) for w in final["windows"]
              if not w["partial"]]
    idle = [(k, round((v - 40 * GIB) / 2**20)) for k, v in probes if v is not None]
    # the staircase as soakd saw it: 0, 512, 1024, 1536 MiB above the base, each level held 2+ probes
    assert sorted({v for _, v in idle}) == [0, 512, 1024, 1536] and [v for _, v in idle] == sorted(v for _, v in idle), idle

    leaks = [f for f in d.analyzer.findings if f.kind == "leak"]
    assert [f.diagnosis for f in leaks] == ["memory steps"], (idle, leaks)
    f = leaks[0]
    ev = f.evidence
    assert f.severity == "warning" and ev["source"] == "device_memory" and ev["points"] == "probes"
    assert ev["pattern"] == "staircase" and not ev["suspected"] and ev["fails"] is False and ev["kv_flat"] is True
    assert ev["steps"] >= 2 and "not a linear leak" in f.message and "KV usage flat" in f.message
    final_dm = d.analyzer.leaks["device_memory"]
    assert final_dm.pattern == "staircase" and final_dm.steps == 3 and final_dm.steps_ongoing is False
    assert final_dm.steps_bytes == pytest.approx(1536 * 2**20, rel=0.02)
    last_level = next(k for k, v in idle if v == 1536)  # the first probe at the last step's level
    assert final_dm.last_step_window == last_level, (idle, final_dm)
    assert f"grew in 3 steps (+1536" in final_dm.message() and f"last step at window {last_level}" in final_dm.message()

    # never a leak, live or at the end
    assert all(value(snap, "soakd_memory_leak_suspected", source="device_memory") in (0, None)
               for snap in soak.by_window().values())
    last = samples(d)
    assert value(last, "soakd_memory_steps", source="device_memory") == 3
    assert value(last, "soakd_memory_leak_suspected", source="kv_residue") == 0
    assert not any(r.startswith("leak") for r in final["verdict"]["reasons"]), final["verdict"]["reasons"]

    stored = [e for e in events(soak.state_dir, d.run_id) if e.kind == "leak"]
    named = [e for e in stored if e.severity == "warning"]
    assert len(named) == 1 and named[0].message.startswith("memory steps: device_memory (idle,")
    more = [e for e in stored if e.message.startswith("memory steps: another step")]
    assert len(more) == 3 - ev["steps"]  # the steps after it was named, one info event each
    rep = report_of(soak.state_dir, d.run_id)
    (row,) = [r for r in rep["troubleshooting"] if r["diagnosis"] == "memory steps"]
    assert row["severity"] == "warning" and row["windows"] == [f.window] and "graph" in row["seen"]
    assert any(lk["source"] == "device_memory" and lk["pattern"] == "staircase" for lk in rep["verdict"]["leaks"])
    print(f"\nmemory steps: idle probes (window, MiB above base) {idle}; named in window {f.window}: "
          f"{f.message}; at the end: {final_dm.message()}")


@pytest.mark.timeout(120)
async def test_xid_and_uncorrected_ecc_errors_fail_the_run_at_once(tmp_path: Path) -> None:
    """The simulated GPU (the fake NVML bound to it) has 5 uncorrected ECC errors from before the run;
    half a second into window 2 of 5 it reports Xid 79 and two more uncorrected ECC errors. The NVML
    sampler reads them at its next sample (0.25 s): critical ``gpu`` findings of that window, with the
    code's meaning, and the verdict FAILs on them; the 5 old ECC errors are no finding."""
    k = 2

    async def attempt(state_dir: Path) -> Soak:
        async with SimServer(SimConfig(**SIM)) as sim:
            fake_pynvml.bind(sim.device)
            gpu = fake_pynvml.scenario.gpus[0]
            gpu.ecc_uncorrected = 5
            soak = Soak(soak_config(sim, state_dir, windows=5, window=2.0, nvml=True), nvml=fake_pynvml)
            tl = await soak.timeline()
            loop = asyncio.get_running_loop()
            await asyncio.sleep(tl.window_bounds(k)[0] + 0.5 - loop.time())
            gpu.xid(79)
            gpu.ecc_uncorrected += 2
            await soak.finish(40)
        return soak

    soak = await attempt(tmp_path / "run")
    d, final = soak.daemon, soak.final
    found = {f.diagnosis: f for f in d.analyzer.findings if f.kind == "gpu"}
    assert set(found) == {"GPU Xid error", "uncorrectable ECC error"}, d.analyzer.findings
    xid, ecc = found["GPU Xid error"], found["uncorrectable ECC error"]
    # the window of the first sample after the event: k, or k + 1 if the sampler ran 1.5 s late
    assert xid.window in (k, k + 1) and ecc.window == xid.window, (xid, ecc, soak.stalls_by_window())
    assert xid.severity == ecc.severity == "critical"
    assert xid.evidence["xid"] == 79 and xid.evidence["events"] == 1
    assert "GPU has fallen off the bus" in xid.message and "reboot the node" in xid.message
    assert ecc.evidence["ecc_uncorrected"] == 2 and ecc.evidence["total"] == 7
    reasons = final["verdict"]["reasons"]
    assert f"gpu: GPU Xid error (window {xid.window})" in reasons
    assert f"gpu: uncorrectable ECC error (window {ecc.window})" in reasons and not final["verdict"]["passed"]
    stored = [e for e in events(soak.state_dir, d.run_id) if e.kind == "gpu"]
    assert len(stored) == 2 and all(e.severity == "critical" for e in stored)
    print(f"\nGPU errors: {xid.message}; {ecc.message}")


@pytest.mark.timeout(120)
async def test_a_server_restart_is_recognised_from_its_metrics_and_is_no_leak(tmp_path: Path) -> None:
    """The simulator restarts once, 0.3 s down, mid-run: its process_start_time_seconds moves on and its
    counters start again. soakd counts one restart (``soakd_server_restarts_total``), reports it in
    that window ('target restarted', with the restart's evidence), in the report's window row and
    run section; the counters' reset gives no negative server mean and no leak finding."""

    async def attempt(state_dir: Path) -> Soak:
        async with SimServer(SimConfig(**SIM, faults={"restart_after": 6.0, "restart_downtime": 0.3})) as sim:
            soak = Soak(soak_config(sim, state_dir, windows=6, window=2.0, samplers={"interval": 0.25}))
            await soak.finish(60)
            assert sim.restarts == 1
        return soak

    soak = await attempt(tmp_path / "run")
    d, final = soak.daemon, soak.final
    restarted = [f for f in d.analyzer.findings if f.diagnosis == "target restarted"]
    assert len(restarted) == 1, d.analyzer.findings
    f = restarted[0]
    assert f.evidence["restarts"] == 1 and "by its own metrics" in f.message, f
    assert value(samples(d), "soakd_server_restarts_total") == 1
    assert not [x for x in d.analyzer.findings if x.kind == "leak"]
    assert all((w.get("server") or {}).get("ttft_mean_seconds") is None or w["server"]["ttft_mean_seconds"] > 0
               for w in final["windows"])
    rep = report_of(soak.state_dir, d.run_id)
    assert rep["run"]["server_restarts"] == 1
    (row,) = [r for r in rep["table"] if r["server_restarts"]]
    assert row["window"] == f.window and "server restarted" in row["notes"]
    print(f"\nrestart: window {f.window}: {f.message}")


@pytest.mark.timeout(120)
async def test_target_host_memory_leak_from_the_servers_own_metrics(tmp_path: Path) -> None:
    """The simulated server's process_resident_memory_bytes grows 1 GiB/s (a host-RAM cache never
    evicted, like llama.cpp's prompt cache); its processes are not visible to soakd, so the target's
    host memory comes from the server's own metrics: a 'memory leak' finding of source target_rss."""

    async def attempt(state_dir: Path) -> Soak:
        async with SimServer(SimConfig(**SIM, faults={"host_memory_leak_bytes_per_hour": 3600 * GIB})) as sim:
            soak = Soak(soak_config(sim, state_dir, windows=9))
            await soak.finish(40)
        return soak

    soak = await attempt(tmp_path / "run")
    d, final = soak.daemon, soak.final
    hosts = [w.get("host") or {} for w in final["windows"] if not w["partial"]]
    assert all(h.get("target_memory_source") == "server_metrics" for h in hosts), hosts
    floors = [h["target_rss_bytes"]["min"] for h in hosts]
    assert all(b > a for a, b in zip(floors, floors[1:])), floors
    leaks = [f for f in d.analyzer.findings if f.kind == "leak" and f.evidence["source"] == "target_rss"]
    assert len(leaks) == 1, d.analyzer.findings
    ev = leaks[0].evidence
    assert leaks[0].diagnosis == "memory leak" and 0.6 * 3600 * GIB < ev["growth_per_hour"] < 1.4 * 3600 * GIB
    assert value(samples(d), "soakd_memory_leak_suspected", source="target_rss") == 1
    print(f"\nhost memory: floors (GiB) {[round(x / GIB, 1) for x in floors]}; {leaks[0].message}")


@pytest.mark.timeout(120)
async def test_thermal_throttle_episode_is_diagnosed_as_throttling(tmp_path: Path) -> None:
    """A thermal-throttling episode (SM clock at 0.5 of max: sw_thermal and hw_thermal, every
    latency x2) from the start of window 4 to 0.3 s before the end of window 5 of 8 (2 s windows,
    so the halved throughput still leaves ~175 requests to judge; a baseline pool of 3):
    ``soakd_throttle_detected`` 1 in windows 4 and 5 only, each with a critical 'throttling'
    finding that pairs the latency drift with the throttle and carries the SM clock drop."""
    k = 4

    async def attempt(state_dir: Path) -> Soak:
        async with SimServer(SimConfig(**SIM, faults={"thermal_throttle_clock_ratio": 0.5})) as sim:
            fake_pynvml.bind(sim.device)
            soak = Soak(soak_config(sim, state_dir, windows=8, window=2.0, warmup=2.0, nvml=True,
                                    analysis={"drift": {"baseline_windows": 3}}), nvml=fake_pynvml)
            tl = await soak.timeline()
            # it ends 0.3 s before window 6 so that no throttled reading is stamped into window 6
            sim.config.faults.thermal_throttle_duration = 3.7
            sim.config.faults.thermal_throttle_at = at_window(sim, tl, k, clock="device")
            await soak.finish(40)
        return soak

    soak = await attempt(tmp_path / "run")
    d, final = soak.daemon, soak.final
    shares = {w["window"]: w["device"].get("throttle_share") or {} for w in final["windows"]}
    assert shares[k].get("sw_thermal", 0) > 0.5 and shares[k].get("hw_thermal", 0) > 0.5, shares
    assert all(shares[i].get("sw_thermal") == 0 for i in (0, 1, 2, 3, 6, 7)), shares

    by_window = soak.by_window()
    assert [value(by_window[i], "soakd_throttle_detected") for i in range(8)] == [0, 0, 0, 0, 1, 1, 0, 0]
    throttle = [f for f in d.analyzer.findings if f.kind == "throttle"]
    assert [f.window for f in throttle] == [k, k + 1], d.analyzer.findings
    f = throttle[0]
    assert f.diagnosis == "throttling" and f.severity == "critical"  # with latency drift
    assert "thermal throttling" in f.message
    drift = {r["metric"]: r for r in f.evidence["drift"]}
    # e2e and at least one of its parts: a busy machine adds soakd's own delay (which the clock does not
    # slow) to the short TTFT of these prompts and can keep it within its threshold (seen with a test suite
    # running beside this one: e2e_p50 +90.9%, itl_p50 +101.0%, ttft_p50 not beyond its threshold)
    assert "e2e_p50" in drift and {"ttft_p50", "itl_p50"} & set(drift), f.message
    # latency x1/0.5 (+100%), diluted on a busy machine by soakd's own delay
    assert all(drift[m]["direction"] == "degraded" and 0.5 < drift[m]["ratio"] < 1.3
               for m in ("e2e_p50", "ttft_p50", "itl_p50") if m in drift), drift
    t = {x["reason"]: x for x in f.evidence["throttle"]}
    assert {"sw_thermal", "hw_thermal"} <= set(t)
    sw = t["sw_thermal"]
    assert sw["detected"] and sw["share"] > 0.5 and sw["sm_clock_reference_kind"] == "baseline"
    assert 0.3 < sw["sm_clock_drop_ratio"] <= 0.5, sw  # the SM clock at 0.5 of max (most of the window)
    assert sw["sm_clock_reference"] == pytest.approx(1980e6)
    print(f"\nthrottle: throttle_share by window { {i: round(s.get('sw_thermal', 0), 2) for i, s in shares.items()} }; "
          f"window {f.window}: {f.message}")

    stored = [e for e in events(soak.state_dir, d.run_id) if e.kind == "throttle"]
    assert [e.window for e in stored] == [k, k + 1] and all(e.severity == "critical" for e in stored)
    assert stored[0].data["evidence"]["throttle"][0]["sm_clock_drop_ratio"] > 0.3
    assert final["verdict"]["passed"] is False
    assert f"throttle: throttling (window {k})" in final["verdict"]["reasons"]


@pytest.mark.timeout(120)
async def test_a_prefix_cache_that_stops_hitting_is_named_as_the_drifts_cause(tmp_path: Path) -> None:
    """Every prompt starts with one of two shared 400-token system prompts (``shared_prefix``), which the
    simulator's prefix cache serves after their first use (prefill 0.2 ms per uncached token: ~40 ms of TTFT
    cached, ~120 ms not). From the start of window 4 of 8 the cache keeps nothing (``prefix_cache_shrink_at``):
    each window's own hit rate (``soakd_window_prefix_cache_hit_ratio``, from the server's counters) falls
    from ~0.9 to 0, TTFT rises, and the window's finding is 'prefix cache hit rate fell' with both rates,
    instead of a drift of unknown cause."""
    k = 4
    sim_cfg = {**SIM, "ttft_per_prompt_token": 0.0002}

    async def attempt(state_dir: Path) -> Soak:
        async with SimServer(SimConfig(**sim_cfg)) as sim:
            soak = Soak(soak_config(
                sim, state_dir, windows=8, window=2.0, warmup=2.0, analysis={"drift": {"baseline_windows": 3}},
                scenarios={"short_chat": {"prompt_tokens": 32, "max_tokens": 3,
                                          "shared_prefix": {"count": 2, "tokens": 400, "share": 1.0}}}))
            tl = await soak.timeline()
            sim.config.faults.prefix_cache_shrink_at = at_window(sim, tl, k)
            await soak.finish(60)
        return soak

    soak = await attempt(tmp_path / "run")
    d, final = soak.daemon, soak.final
    hit = {w["window"]: (w.get("server") or {}).get("prefix_cache_hit_ratio") for w in final["windows"]}
    assert all(hit[i] is not None and hit[i] > 0.8 for i in range(k)), hit
    assert all(hit[i] is not None and hit[i] < 0.05 for i in range(k, 8)), hit
    by_window = soak.by_window()
    assert [round(value(by_window[i], "soakd_window_prefix_cache_hit_ratio"), 3) for i in range(8)] == [
        round(hit[i], 3) for i in range(8)]

    cause = [f for f in d.analyzer.findings if f.diagnosis == "prefix cache hit rate fell"]
    assert cause and min(f.window for f in cause) in (k, k + 1), d.analyzer.findings
    f = cause[0]
    assert f.kind == "drift" and f.severity == "warning"
    assert f.evidence["reference_hit_ratio"] > 0.8 and f.evidence["prefix_cache_hit_ratio"] < 0.05
    assert "ttft_p50" in {r["metric"] for r in f.evidence["drift"]}, f.message
    unknown = [g for g in d.analyzer.findings if g.diagnosis == "performance drift" and g.window in
               {c.window for c in cause}]
    assert not unknown, [g.message for g in unknown]
    print(f"\nprefix cache: hit rate by window { {i: round(h, 3) for i, h in hit.items()} }; window {f.window}: "
          f"{f.message}")

    rep = report_of(soak.state_dir, d.run_id)
    (row,) = [r for r in rep["troubleshooting"] if r["diagnosis"] == "prefix cache hit rate fell"]
    assert row["windows"][0] == f.window and "prefix_cache_hit_ratio" in row["check"]
    assert [r["prefix_cache_hit_ratio"] for r in rep["table"]] == [hit[i] for i in range(8)]
    assert final["verdict"]["passed"] is False


@pytest.mark.timeout(120)
async def test_canary_mismatch_is_reported(tmp_path: Path) -> None:
    """From a quarter into window 2 the simulator's deterministic outputs change; the canary (one per
    quiesce probe, on the idle server) matched its reference in window 1 and mismatches from
    window 2: a critical 'canary' finding, ``soakd_canary_mismatch_total`` >= 1, verdict FAIL."""
    k = 2

    async def attempt(state_dir: Path) -> Soak:
        async with SimServer(SimConfig(**SIM)) as sim:
            soak = Soak(soak_config(sim, state_dir, windows=4, analysis={"quiesce": {"settle": 0.1}}))
            tl = await soak.timeline()
            # a quarter into window k: before its probe (at its middle), well after window k-1's
            sim.config.faults.output_change_at = at_window(sim, tl, k, offset=0.25)
            await soak.finish(40)
        return soak

    soak = await attempt(tmp_path / "run")
    d, final = soak.daemon, soak.final
    by_window = soak.by_window()
    assert value(by_window[k - 1], "soakd_canary_checks_total") >= 2, soak.stalls_by_window()  # reference + match
    assert value(by_window[k - 1], "soakd_canary_mismatch_total") == 0
    assert value(by_window[k], "soakd_canary_mismatch_total") == 1
    last = samples(d)
    assert value(last, "soakd_canary_mismatch_total") >= 1 and value(last, "soakd_canary_errors_total") == 0

    canary = [f for f in d.analyzer.findings if f.kind == "canary"]
    assert canary and canary[0].window == k, d.analyzer.findings
    f = canary[0]
    assert f.diagnosis == "output changed" and f.severity == "critical"
    ev = f.evidence
    assert ev["idle"] is True and ev["digest"] != ev["reference"] and ev["text"]
    assert "on an idle server" in f.message
    print(f"\ncanary: {int(value(last, 'soakd_canary_checks_total'))} checks, "
          f"{int(value(last, 'soakd_canary_mismatch_total'))} mismatches from window {f.window}: "
          f"{f.message[:120]}")

    stored = events(soak.state_dir, d.run_id)
    ref = [e for e in stored if e.kind == "canary_reference"]
    assert len(ref) == 1 and ref[0].window == 0 and ref[0].data["digest"] == ev["reference"]
    assert [e.window for e in stored if e.kind == "canary"][0] == k
    assert final["verdict"]["passed"] is False
    assert f"canary: output changed (window {k})" in final["verdict"]["reasons"]


def _stalling(every: int, seconds: float = 0.3) -> Any:
    """A record listener that blocks soakd's event loop for ``seconds`` after every ``every``-th finished request
    (a stop-the-world pause, a CPU limit)."""
    count = 0

    def stall(_rec: Any) -> None:
        nonlocal count
        count += 1
        if count % every == 0:
            time.sleep(seconds)

    return stall


@pytest.mark.timeout(120)
async def test_soakd_stalling_now_and_then_is_charged_to_the_requests_it_overlapped(tmp_path: Path) -> None:
    """soakd's own loop blocked for 900 ms after every 500th request (several seconds apart): the requests in
    flight across each stall are impaired -- counted in the window's client summary and in
    soakd_requests_impaired_total, left out of the latency -- and the windows (5 s) are judged on the rest: no
    drift finding although each stall moves the latency of the requests it touched, and the run PASSes.
    The bound is fixed at 600 ms (request_lag_relative 0): on a busy machine soakd's loop lags 100-350 ms
    by itself, which the default bound (3x the run's p90 lag) would also follow. The slow simulator at 40 streams,
    as in the stationary test: at SIM's 30 ms the simulator, which shares soakd's loop, moved its TTFT p95 +25% in
    one window of an idle run (1 of 4 runs: "ttft_p95 +24.9%", window 4) through lags far below the bound, which no
    real server's TTFT shows; a stall about every 400 requests, about one a window, as before."""
    async with SimServer(SimConfig(**SIM_SLOW)) as sim:
        soak = Soak(soak_config(sim, tmp_path / "run", windows=6, window=5.0, warmup=1.0, load={"concurrency": 40},
                                analysis={"drift": {"baseline_windows": 2},
                                          "client": {"request_max_lag": 0.6, "request_lag_relative": 0}}),
                    record_listeners=(_stalling(400, 0.9),))
        await soak.finish(60)
    d, final = soak.daemon, soak.final
    windows = [w for w in final["windows"] if not w["partial"]]
    clients = [w.get("client") or {} for w in windows]
    touched = sum(c.get("requests_impaired", 0) for c in clients)
    assert touched > 0 and any(c.get("loop_lag_max_seconds", 0) >= 0.85 for c in clients), clients
    for w, c in zip(windows, clients):  # an impaired request is counted, its latency left out
        assert w["e2e_seconds"]["count"] <= w["requests"] - c.get("requests_impaired", 0), (w["window"], c)
    impaired = [w["window"] for w, c in zip(windows, clients) if c.get("impaired")]
    assert len(impaired) < len(windows) / 2, [(w["window"], c.get("impaired_reason")) for w, c in zip(windows, clients)]
    assert not [f for f in d.analyzer.findings if f.kind == "drift" and f.severity != "info"], d.analyzer.findings
    assert final["verdict"]["result"] == "PASS", final["verdict"]
    assert final["verdict"]["judged"]["requests_impaired"] > 0
    last = samples(d)
    exported = sum(v for k, v in last.items() if k[0] == "soakd_requests_impaired_total")
    assert exported >= touched, (exported, touched)
    print(f"\nstalls charged per request: {touched} of {sum(w['requests'] for w in windows)} requests impaired; "
          f"client-impaired windows {impaired}; verdict {final['verdict']['result']}")


@pytest.mark.timeout(120)
async def test_soakd_stalling_through_most_of_its_windows_is_client_impaired_and_inconclusive(tmp_path: Path) -> None:
    """soakd's own loop blocked for 300 ms after every 40th request: it is stalled through most of every
    window and most requests overlap a stall: every window is client-impaired (shown, not judged on
    latency), exported, said as a 'client' event -- no drift finding although the stalls move every
    latency -- and the run is INCONCLUSIVE. (The bound fixed at its default 100 ms, request_lag_relative 0: on
    a busy machine soakd's own lags of 100-400 ms would raise the relative bound past the injected stalls.)"""
    async with SimServer(SimConfig(**SIM)) as sim:
        soak = Soak(soak_config(sim, tmp_path / "run", windows=8, window=2.0, warmup=1.0,
                                analysis={"drift": {"baseline_windows": 2}, "client": DEFAULT_CLIENT}),
                    record_listeners=(_stalling(40),))
        await soak.finish(60)
    d, final = soak.daemon, soak.final
    windows = [w for w in final["windows"] if not w["partial"]]
    impaired = [w["window"] for w in windows if (w.get("client") or {}).get("impaired")]
    assert impaired == [w["window"] for w in windows], [(w["window"], w["requests"], w.get("client")) for w in windows][:2]
    c = windows[0]["client"]
    assert c["loop_lag_max_seconds"] >= 0.25 and c["heartbeats"] > 5 and "beyond 100 ms" in c["impaired_reason"]
    assert not [f for f in d.analyzer.findings if f.kind == "drift"], d.analyzer.findings
    assert d.analyzer.pool == [] and final["verdict"]["result"] == "INCONCLUSIVE", final["verdict"]
    by_window = soak.by_window()
    assert all(value(by_window[i], "soakd_window_client_impaired") == 1 for i in impaired)
    assert value(by_window[impaired[0]], "soakd_window_loop_lag_seconds", stat="max") >= 0.25
    stored = [e for e in events(soak.state_dir, d.run_id) if e.kind == "client"]
    assert len(stored) == len(impaired) and "client-impaired" in stored[0].message
    print(f"\nclient-impaired: windows {impaired}; first: {c['impaired_reason']}; verdict "
          f"{final['verdict']['inconclusive']}")


@pytest.mark.timeout(120)
async def test_a_wedged_engine_is_found_live_while_its_front_end_answers(tmp_path: Path) -> None:
    """From 5 s of uptime on, every 8 s, the simulated engine generates nothing for 4 s while /health
    and /v1/models answer. The live watch finds each wedge within seconds of the threshold (here
    ``freeze_min`` 1 s): ``soakd_engine_wedged`` 1 during it, a critical 'engine wedged' finding with
    the silence and the requests in flight, the gauge back to 0 with the first byte after it."""
    faults = {"freeze_every": 8.0, "freeze_duration": 4.0}
    seen: list[tuple[float, float]] = []  # (loop time, soakd_engine_wedged)
    async with SimServer(SimConfig(**SIM, faults=faults)) as sim:
        soak = Soak(soak_config(sim, tmp_path / "run", windows=6, window=2.0, warmup=1.0,
                                analysis={"client": {"freeze_min": 1.0}, "drift": {"baseline_windows": 2}}))
        loop = asyncio.get_running_loop()
        while not soak.task.done():
            seen.append((loop.time(), value(samples(soak.daemon), "soakd_engine_wedged") or 0.0))
            await asyncio.sleep(0.1)
        await soak.finish(60)
    d, final = soak.daemon, soak.final
    wedged = [f for f in d.analyzer.findings if f.diagnosis == "engine wedged"]
    assert wedged, d.analyzer.findings
    for f in wedged:
        ev = f.evidence
        assert f.severity == "critical" and ev["in_flight"] >= 1 and ev["threshold_seconds"] >= 1.0
        # found live: within 2.5 s of the threshold (a check a second, one GET /models)
        assert ev["threshold_seconds"] <= ev["silence_seconds"] <= ev["threshold_seconds"] + 2.5, ev
    assert d.wedge is not None and d.wedge.episodes == len(wedged)
    flags = [v for _, v in seen]
    assert 1.0 in flags and flags[-1] == 0.0, flags  # up during a wedge, down after it
    assert any(e.kind == "freeze" and e.message.startswith("engine recovered") for e in events(soak.state_dir, d.run_id))
    assert any(r.startswith("freeze: engine wedged") for r in final["verdict"]["reasons"])
    print(f"\nwedge: {[(f.window, round(f.evidence['silence_seconds'], 2)) for f in wedged]} (window, silence "
          f"when found); gauge 1 for {sum(v for v in flags) * 0.1:.1f} s")


@pytest.mark.timeout(120)
async def test_a_wedge_soakds_streams_cannot_see_is_found_from_the_servers_token_counter(tmp_path: Path) -> None:
    """Every request non-streamed (a body is silent until its end: the streams' watch sees nothing). At 8 s of
    uptime (every 8 s; once in this run) the simulated engine generates nothing for 4 s while /v1/models answers, and its
    vllm:generation_tokens_total stands still with 16 requests running. The wedge watch finds it from the
    server's counter (scraped every 0.25 s) within seconds of the 1 s threshold: a critical 'engine wedged'
    finding whose evidence names the source, soakd_engine_wedged 1 during it, soakd_server_generation_tokens_total
    exported."""
    faults = {"freeze_every": 8.0, "freeze_duration": 4.0}
    seen: list[tuple[float, float]] = []  # (loop time, soakd_engine_wedged)
    async with SimServer(SimConfig(**SIM, faults=faults)) as sim:
        soak = Soak(soak_config(sim, tmp_path / "run", windows=6, window=2.0, warmup=1.0,
                                scenarios={"short_chat": {"stream": False}},
                                analysis={"client": {"freeze_min": 1.0}, "drift": {"baseline_windows": 2}}))
        loop = asyncio.get_running_loop()
        tokens = []
        while not soak.task.done():
            now = samples(soak.daemon)
            seen.append((loop.time(), value(now, "soakd_engine_wedged") or 0.0))
            tokens.append(value(now, "soakd_server_generation_tokens_total"))
            await asyncio.sleep(0.1)
        await soak.finish(60)
        started = sim.model.started  # the simulator's uptime clock is time.monotonic, as the loop's
    d, final = soak.daemon, soak.final
    wedged = [f for f in d.analyzer.findings if f.diagnosis == "engine wedged"]
    assert wedged, d.analyzer.findings
    for f in wedged:
        ev = f.evidence
        assert f.severity == "critical" and ev["sources"] == ["server_tokens"], ev
        assert ev["silence_seconds"] is None and ev["server_requests_running"] >= 1
        # judged over scrapes spanning the threshold, found within a check and a few scrapes of it
        assert ev["threshold_seconds"] <= ev["server_tokens_flat_seconds"] <= ev["threshold_seconds"] + 2.5, ev
    assert any(t for t in tokens if t), "soakd_server_generation_tokens_total is exported"
    ups = [t for (t, v), (_, before) in zip(seen[1:], seen) if v == 1.0 and before == 0.0]
    assert ups and seen[-1][1] == 0.0
    # from each freeze's start (uptime 8k s) to the gauge: the threshold plus the detection delay
    delays = [round(t - started - 8.0 * round((t - started) / 8.0), 2) for t in ups]
    assert all(0.9 <= x <= 4.0 for x in delays), delays
    assert any(r.startswith("freeze: engine wedged") for r in final["verdict"]["reasons"])
    print(f"\nwedge from the server's counter: seconds from freeze start to soakd_engine_wedged 1: {delays}; "
          f"flat span when found {[round(f.evidence['server_tokens_flat_seconds'], 2) for f in wedged]}")


@pytest.mark.timeout(120)
async def test_an_engine_freeze_is_found_while_soakd_stays_punctual(tmp_path: Path) -> None:
    """The simulated engine emits no token for 1.5 s every 4 s of its uptime (its health and model
    endpoints keep answering); with ``client.freeze_min`` 1 s (compressed like the run) every
    window that holds a freeze has a freeze finding naming its length — 'engine wedged' where the
    live watch (a check a second) caught the silence and GET /models answered, else the window's
    'server froze' — soakd's own loop lag stays far below it, and the verdict FAILs on it."""
    faults = {"freeze_every": 4.0, "freeze_duration": 1.5}
    async with SimServer(SimConfig(**SIM, faults=faults)) as sim:
        soak = Soak(soak_config(sim, tmp_path / "run", windows=6, window=2.0, warmup=1.0,
                                analysis={"client": {"freeze_min": 1.0}, "drift": {"baseline_windows": 2}}))
        await soak.finish(60)
    d, final = soak.daemon, soak.final
    windows = [w for w in final["windows"] if not w["partial"]]
    spans = {w["window"]: (w.get("client") or {}).get("freeze_max_seconds") or 0.0 for w in windows}
    frozen = [f for f in d.analyzer.findings if f.kind == "freeze"]
    assert frozen, (spans, d.analyzer.findings)
    for f in frozen:
        assert f.diagnosis in ("server froze", "engine wedged") and f.severity == "critical"
        if f.diagnosis == "server froze":
            assert 1.0 <= f.evidence["freeze_seconds"] <= 2.0 and f.evidence["loop_lag_max_seconds"] < 0.5, f
        else:
            assert 1.0 <= f.evidence["silence_seconds"] <= 2.0, f
    assert max(spans.values()) >= 1.2, spans  # the freezes were seen ...
    assert len(frozen) >= 2, spans  # ... in most windows (one every 4 s, windows of 2 s)
    assert value(samples(d), "soakd_window_freeze_seconds") is not None
    assert final["verdict"]["result"] == "FAIL"
    assert any(r.startswith("freeze: ") for r in final["verdict"]["reasons"])
    print(f"\nfreeze: longest silence by window {spans}; findings in windows {[f.window for f in frozen]}")


@pytest.mark.timeout(120)
async def test_a_kv_cache_saturated_and_stuck_is_named_as_such_and_pages_once(tmp_path: Path) -> None:
    """From 0.6 s into window 3 the simulated KV cache is full for 4 s: vllm:kv_cache_usage_perc 1, the 16
    requests stay running and get no token, /v1/models answers. The live watch finds it (freeze_min 1 s, server
    scrapes every 0.25 s) and names it 'KV cache saturated' -- one critical finding with the usage, the running
    requests and the span, no 'engine wedged' and no window-level repeat of it -- soakd_kv_cache_saturated 1 during
    it and 0 after, and the verdict FAILs on it."""
    seen: list[tuple[float, float, float]] = []  # (loop time, soakd_kv_cache_saturated, soakd_engine_wedged)
    async with SimServer(SimConfig(**SIM)) as sim:
        soak = Soak(soak_config(sim, tmp_path / "run", windows=6, window=2.0, warmup=1.0,
                                analysis={"client": {"freeze_min": 1.0}, "drift": {"baseline_windows": 2},
                                          "kv_saturated": {"min_seconds": 0.5}}))
        tl = await soak.timeline()
        # 0.6 s into window 3: the silence begins at the last byte before the fault, which must be window 3's
        # however late a busy machine delivers it (at the window's very start it was once window 2's)
        at = at_window(sim, tl, 3, offset=0.6)
        sim.config.faults.kv_saturate_at, sim.config.faults.kv_saturate_duration = at, 4.0
        loop = asyncio.get_running_loop()
        while not soak.task.done():
            now = samples(soak.daemon)
            seen.append((loop.time(), value(now, "soakd_kv_cache_saturated") or 0.0,
                         value(now, "soakd_engine_wedged") or 0.0))
            await asyncio.sleep(0.1)
        await soak.finish(60)
        started = sim.model.started  # the simulator's uptime clock is time.monotonic, as the loop's
    d, final = soak.daemon, soak.final
    named = [f for f in d.analyzer.findings if f.diagnosis == "KV cache saturated"]
    assert len(named) == 1, d.analyzer.findings
    assert not [f for f in d.analyzer.findings if f.diagnosis in ("engine wedged", "server froze")]
    (f,) = named
    ev = f.evidence
    assert f.kind == "freeze" and f.severity == "critical" and f.window == 3, f
    assert ev["server_kv_cache_usage_ratio"] == 1.0 and ev["server_requests_running"] >= 1
    assert "KV cache is full" in f.message
    ups = [t for (t, v, _), (_, before, _) in zip(seen[1:], seen) if v == 1.0 and before == 0.0]
    assert len(ups) == 1 and seen[-1][1] == 0.0, seen
    delay = ups[0] - (started + at)  # from the fault's start to soakd_kv_cache_saturated 1
    assert 0.9 <= delay <= 4.0, delay
    assert any(r.startswith("freeze: KV cache saturated") for r in final["verdict"]["reasons"])
    assert final["verdict"]["result"] == "FAIL"
    # the report's troubleshooting table has its row, with what to check
    (row,) = [r for r in report_of(soak.state_dir, d.run_id)["troubleshooting"] if r["diagnosis"] == "KV cache saturated"]
    assert row["severity"] == "critical" and row["windows"] == [3] and "preemptions" in row["check"]
    print(f"\nKV cache saturated: {delay:.2f} s from the fault's start to soakd_kv_cache_saturated 1 (threshold "
          f"{ev['threshold_seconds']:.1f} s); sources {ev['sources']}; gauge 1 for "
          f"{sum(v for _, v, _ in seen) * 0.1:.1f} s")


@pytest.mark.timeout(120)
async def test_a_busy_server_near_a_full_kv_cache_that_keeps_generating_is_not_stuck(tmp_path: Path) -> None:
    """A KV cache of 30 blocks for 16 requests of 2 blocks each (prompt and output within 32 tokens): usage up to 1,
    pinned at or above 0.98 whenever 15 requests run (one waits; preemptions counted), but tokens flow at the usual
    rate. No 'KV cache saturated' (the window rule judges spans from ~0.33 s on), no wedge, the gauge 0 throughout.
    (Fewer blocks than the requests need, so the cache stays pinned even when a busy machine keeps soakd from
    having all 16 in flight at once: the spans the rule judges do not need an idle machine.)"""
    seen: list[float] = []
    async with SimServer(SimConfig(**SIM, kv_blocks_total=30)) as sim:
        soak = Soak(soak_config(sim, tmp_path / "run", windows=5, window=2.0, warmup=1.0,
                                analysis={"client": {"freeze_min": 1.0}, "drift": {"baseline_windows": 2},
                                          "kv_saturated": {"min_seconds": 0.25}}))
        while not soak.task.done():
            seen.append(value(samples(soak.daemon), "soakd_kv_cache_saturated") or 0.0)
            await asyncio.sleep(0.1)
        await soak.finish(60)
    d, final = soak.daemon, soak.final
    windows = [w for w in final["windows"] if not w["partial"]]
    kv_max = max(w["server"]["kv_cache_usage_ratio"]["max"] for w in windows)
    pinned = sum((w["server"].get("kv_saturated") or {}).get("seconds", 0.0) for w in windows)
    longest = max((w["server"].get("kv_saturated") or {}).get("longest_seconds", 0.0) for w in windows)
    # the rule had pinned spans past its threshold (0.25 s, 3x the baseline's e2e p99: ~0.33 s on an idle machine,
    # more on a busy one) to judge ...
    need = max(0.25, 3.0 * (d.analyzer.baseline.e2e_seconds.p99 or 0.0)) if d.analyzer.baseline is not None else 0.25
    assert kv_max >= 0.98 and longest >= need, (need, windows)
    assert not [f for f in d.analyzer.findings if f.kind == "freeze"], d.analyzer.findings  # ... none stuck
    assert set(seen) == {0.0}
    print(f"\nbusy near-full KV cache: max usage {kv_max:.3f}, pinned {pinned:.1f} s over the windows (longest "
          f"{longest:.2f} s), "
          f"server token rate {[round(w['server'].get('generation_tokens_per_second') or 0) for w in windows]}")

#!/usr/bin/env python3
"""Verdict quality: how often soakd fails a healthy server, and how often it misses a regression.

Each cell simulates whole soaks (by default 24 windows of 30 minutes, 3,000 requests per window)
on simulated time and sends them through soakd's real path: request records into the open
windows' sketches (``soakd.soak.windows.WindowSet``), telemetry snapshots and quiesce probes into
the same windows, each closed ``WindowSummary`` through the analysis engine
(``soakd.analysis.engine.Analyzer``) with the default configuration, and at the end the verdict.
Nothing in soakd knows the time is simulated: the window set reads a ``ManualClock``.

Per cell it prints the share of runs whose final verdict FAILs, the share with any live flag
(a window in which ``soakd_drift_detected``, ``soakd_memory_leak_suspected`` or
``soakd_throttle_detected`` was 1 — what alerts page on; the simulated node has one GPU, whose
``soakd_throttle_gpu_detected`` is the node's), which findings caused them, and for
detection cells the share that FAILed by the window the target names.

Noise models (per request, multiplicative on every latency):

- ``iid``: lognormal, sigma 0.5 (median 1 s end to end);
- ``ar``: the iid noise times a load factor ``exp(x)``, ``x`` an AR(1) process with the given
  standard deviation and memory (a correlation time in requests, or in seconds of simulated
  time): slowly varying load, as real servers see it;
- ``closed``: a closed loop of 16 workers on a server that slows down with the number of long
  requests in flight (a discrete-event simulation of the batch).

A/B cells soak a second target beside the first (``soakd.analysis.ab`` judges the pairs, as the
runtime wires it): every request goes to both; the candidate's latency shares the reference's load
factor and, with correlation 0.7, its noise (the same prompt), with the same spread, times
``1 + ab``.

Usage::

    python benchmarks/verdict_quality.py             # 200 runs per cell (long: tens of minutes on 2 cores)
    python benchmarks/verdict_quality.py --quick     # 20 runs per cell
    python benchmarks/verdict_quality.py --cells stationary-iid,step-10 --runs 50
    python benchmarks/verdict_quality.py --json out.json
    python benchmarks/verdict_quality.py --cells page-10-ar --record runs/    # measure, and keep each run's inputs
    python benchmarks/verdict_quality.py --cells page-10-ar --replay runs/    # the same runs through changed analysis

``--replay`` measures a change to the analysis on the very windows ``--record`` kept (a paired comparison:
the difference between two versions is theirs, not the seeds'), about five times faster than simulating.

Longer than 500 lines: a benchmark is one script a user runs as it is; its cells (every scenario the
README's table names, with their targets) and the simulators they need (noise models, the closed-loop
batch, memory, clocks and error bursts) stand beside the measurement loop they feed.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import heapq
import json
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from soakd.analysis.ab import AbJudge  # noqa: E402
from soakd.analysis.engine import Analyzer  # noqa: E402
from soakd.config import AnalysisConfig  # noqa: E402
from soakd.core.records import Outcome, RequestRecord  # noqa: E402
from soakd.core.series import Series  # noqa: E402
from soakd.core.summary import QuiesceProbe, WindowSummary  # noqa: E402
from soakd.core.timeline import ManualClock, Timeline  # noqa: E402
from soakd.core.tracked import THROUGHPUT  # noqa: E402
from soakd.analysis.engine import LEAK_SOURCES_BYTES  # noqa: E402
from soakd.soak.probe_schedule import ProbeSchedule  # noqa: E402
from soakd.soak.windows import WindowSet  # noqa: E402

MIB = 2**20
GIB = 2**30
SIGMA = 0.5
GAPS = 3  # inter-token gaps per request (enough for the ITL sketches, cheap to simulate)


# ---------------------------------------------------------------------------------------------
# what a cell simulates


@dataclass(frozen=True)
class Cell:
    name: str
    what: str  # the row's description
    target: str  # what must hold, in words
    noise: str = "iid"  # iid | ar | closed
    ar_sd: float = 0.0
    ar_memory: float = 0.0  # correlation time
    ar_unit: str = "requests"  # requests | seconds
    step_at: int | None = None  # window index of a latency step
    step: float = 0.0  # relative size of the step (0.10 = +10%)
    step_on: str = "all"  # all | p95 (the tail only)
    creep: float = 0.0  # relative change per window
    climb: tuple[float, ...] = ()  # latency x this curve (its value at each window's start, linear between), flat after
    memory: str = "flat"  # flat | ramp | step | sawtooth | leak
    leak_mb_per_hour: float = 0.0
    probe_noise_mib: float = 0.0
    power_cap: bool = False
    period_s: float | None = None  # 10%-deep throughput drops (latency x 1/0.9) a quarter of each period
    freeze_every_s: float | None = None  # the server stops for freeze_s every so often
    freeze_s: float = 10.0
    stall_every_s: float | None = None  # soakd's own loop stalls for stall_s every so often
    stall_s: float = 0.3
    restart_window: int | None = None  # the target is down for that whole window, then recovers
    ab: float | None = None  # A/B: a candidate target this much slower than the reference (0.0: A/A)
    requests: int = 3000
    windows: int = 24
    window_s: float = 1800.0
    expect: str = "pass"  # pass | fail_by | no_confident | trend | leak_by | periodic | freeze | inconclusive | restart
    by_window: int | None = None
    limit: float = 0.0  # the target share (upper bound for pass cells, lower bound otherwise)
    # issue 21 items 1, 2, 5: a blip in one window, a slow share of requests
    blip_window: int | None = None  # one window this much slower (a noisy pool window)
    blip: float = 0.0
    slow_share: float = 0.0  # from step_at (or window 0): this share of requests slow_factor x slower
    slow_factor: float = 1.0
    # sparse streams (issue 21 item 9): this many token events per request, the intervals between them (the first
    # from the send) Pareto-tailed with this index and mean interval_s (0: the default, GAPS + 1 events evenly)
    events: int = 0
    pareto: float = 0.0
    interval_s: float = 0.0
    # issue 21 items 3, 4: a wandering SM clock, thermal throttling, a garbage collector's sawtooth
    clock_wander_sd: float = 0.0  # the SM clock times exp(x), x AR(1) of this sd (power cap: the clock wanders)
    clock_wander_s: float = 900.0  # ... and this memory (seconds)
    latency_clock_exp: float = 0.0  # latency x (reference clock / clock) ** this (0: latency ignores the clock)
    throttle_at: int | None = None  # from this window hw_thermal is active and the SM clock drops by throttle_drop
    throttle_drop: float = 0.10
    gc_mib: float = 0.0  # a garbage collector's sawtooth on top of the memory pattern: this many MiB up, released
    gc_period_s: tuple[float, float] = (1500.0, 2100.0)  # its period, drawn per run in this range
    error_share: float = 0.0  # issue 21 item 6: this share of one window's requests fail fast (HTTP 429)
    error_window: int | None = None  # the window of those errors
    # a quiesce probe that holds the load this long (the drain of long generations; a closed loop only): no request
    # starts while it holds, the window's paused time and the probe's own duration say so, as soakd's probe does
    drain_s: float = 0.0


_CLIMB = tuple(v / 49.0 for v in (49, 64, 79, 90, 97.5, 105, 112.5, 120, 127.5, 135))

CELLS: tuple[Cell, ...] = (
    Cell("stationary-iid", "stationary, iid lognormal sigma 0.5", "false FAIL <= 1%", limit=0.01),
    Cell("ar-5-10req", "stationary, AR(1) load +-5%, memory 10 requests", "false FAIL <= 2%",
         noise="ar", ar_sd=0.05, ar_memory=10, limit=0.02),
    Cell("ar-10-10req", "stationary, AR(1) load +-10%, memory 10 requests", "false FAIL <= 2%",
         noise="ar", ar_sd=0.10, ar_memory=10, limit=0.02),
    Cell("ar-20-10req", "stationary, AR(1) load +-20%, memory 10 requests", "false FAIL <= 2%",
         noise="ar", ar_sd=0.20, ar_memory=10, limit=0.02),
    Cell("ar-5-1min", "stationary, AR(1) load +-5%, memory 1 minute", "false FAIL <= 2%",
         noise="ar", ar_sd=0.05, ar_memory=60, ar_unit="seconds", limit=0.02),
    Cell("ar-10-1min", "stationary, AR(1) load +-10%, memory 1 minute", "false FAIL <= 2%",
         noise="ar", ar_sd=0.10, ar_memory=60, ar_unit="seconds", limit=0.02),
    Cell("ar-20-1min", "stationary, AR(1) load +-20%, memory 1 minute", "false FAIL <= 2%",
         noise="ar", ar_sd=0.20, ar_memory=60, ar_unit="seconds", limit=0.02),
    Cell("ar-5-10min", "stationary, AR(1) load +-5%, memory 10 minutes", "false FAIL <= 5%",
         noise="ar", ar_sd=0.05, ar_memory=600, ar_unit="seconds", limit=0.05),
    Cell("closed-batch", "closed loop, latency follows the batch (long requests in flight)", "false FAIL <= 2%",
         noise="closed", limit=0.02),
    # the same closed loop in 60-s windows (10 sub-windows of 6 s; about 240 requests each), each idle probe holding
    # the load 8 s (a drain): the 1-2 sub-windows it pauses are left out of the throughput's waves, the rest still
    # show them (soakd.analysis.page.rate_extra), and a throughput fall still pages
    Cell("closed-60s-drain", "closed loop, 60-s windows, each idle probe holding the load 8 s",
         "throughput false page <= 1%", noise="closed", window_s=60.0, requests=600, drain_s=8.0,
         expect="no_tput_page", limit=0.01),
    Cell("closed-60s-fall-20-drain", "the same, every request 1/0.8 as long from window 12 (throughput -20%)",
         "(no target: throughput paged)", noise="closed", window_s=60.0, requests=600, drain_s=8.0, step_at=12,
         step=1 / 0.8 - 1, expect="tput_page_by", by_window=23, limit=0.0),
    Cell("mem-ramp", "device memory +600 MiB while warming up, then flat", "false leak <= 2%",
         memory="ramp", probe_noise_mib=50, limit=0.02),
    Cell("mem-step", "device memory one +512 MiB step at hour 2, flat after", "false leak <= 2%",
         memory="step", probe_noise_mib=50, limit=0.02),
    Cell("mem-sawtooth", "device memory 4 h sawtooth (1 GiB up, released)", "false leak <= 2%",
         memory="sawtooth", probe_noise_mib=50, limit=0.02),
    Cell("power-cap", "GPU power-capped at full load, clocks steady", "false throttle FAIL <= 1%",
         power_cap=True, limit=0.01),
    Cell("step-10", "+10% latency step at window 12", "FAIL by window 14 >= 95%",
         step_at=12, step=0.10, expect="fail_by", by_window=14, limit=0.95),
    Cell("step-8", "+8% latency step at window 12", "FAIL by window 14 >= 80%",
         step_at=12, step=0.08, expect="fail_by", by_window=14, limit=0.80),
    Cell("step-8-p95", "+8% step of the tail (p95) at window 12, 10,000 requests per window",
         "FAIL by window 14 >= 80%", step_at=12, step=0.08, step_on="p95", requests=10000, expect="fail_by",
         by_window=14, limit=0.80),
    Cell("step-4", "+4% latency step at window 12", "confident drift <= 5%", step_at=12, step=0.04,
         expect="no_confident", limit=0.05),
    Cell("creep", "latency creep +0.25% per window (+6% over the run)", "trend found by the end >= 90%",
         creep=0.0025, expect="trend", limit=0.90),
    Cell("leak-50", "50 MB/h device-memory leak, 50 MiB noise per idle probe", "leak finding by hour 8 >= 95%",
         memory="leak", leak_mb_per_hour=50, probe_noise_mib=50, expect="leak_by", by_window=16, limit=0.95),
    Cell("leak-50-noisy", "50 MB/h device-memory leak, 200 MiB noise per idle probe", "report the rate",
         memory="leak", leak_mb_per_hour=50, probe_noise_mib=200, expect="leak_by", by_window=24, limit=0.0),
    Cell("periodic-15m", "10%-deep drops a quarter of every 15 min", "periodic drops found >= 90%",
         period_s=900, expect="periodic", limit=0.90),
    Cell("periodic-40m", "10%-deep drops a quarter of every 40 min", "periodic drops found >= 90%",
         period_s=2400, expect="periodic", limit=0.90),
    Cell("periodic-2h", "10%-deep drops a quarter of every 2 h", "periodic drops found >= 90%",
         period_s=7200, expect="periodic", limit=0.90),
    Cell("freeze", "server freezes for 10 s every 10 min", "freeze finding >= 95%",
         freeze_every_s=600, expect="freeze", limit=0.95),
    Cell("client-stall", "soakd's own loop stalled 300 ms every 20 s", "PASS (judged, not INCONCLUSIVE) >= 99%",
         stall_every_s=20, expect="judged_pass", limit=0.99),
    Cell("restart", "server restarted once (window 10 lost), recovers", "no drift/leak FAIL, restart reported",
         restart_window=10, memory="ramp", probe_noise_mib=50, expect="restart", limit=1.0),
    # A/B: a candidate target under the same traffic (each request's latency shares the reference's load
    # and, in part, its noise: the same prompt), judged by soakd.analysis.ab
    Cell("ab-aa", "A/B, identical candidate (A/A), iid", "false ab FAIL <= 2%", ab=0.0, expect="ab_pass",
         limit=0.02),
    Cell("ab-aa-ar", "A/B, identical candidate (A/A), AR(1) load +-10%, memory 1 minute", "false ab FAIL <= 2%",
         ab=0.0, noise="ar", ar_sd=0.10, ar_memory=60, ar_unit="seconds", expect="ab_pass", limit=0.02),
    Cell("ab-8", "A/B, candidate 8% slower on every request", "ab FAIL >= 95%", ab=0.08, expect="ab_fail",
         limit=0.95),
    Cell("ab-4", "A/B, candidate 4% slower on every request", "confident ab <= 5%", ab=0.04,
         expect="ab_confident", limit=0.05),
    # the detection rows again under slowly varying load (printed, no target)
    Cell("step-10-ar", "+10% step at window 12 under AR +-10%/1 min", "(no target)", noise="ar", ar_sd=0.10,
         ar_memory=60, ar_unit="seconds", step_at=12, step=0.10, expect="fail_by", by_window=14, limit=0.0),
    Cell("step-8-ar", "+8% step at window 12 under AR +-10%/1 min", "(no target)", noise="ar", ar_sd=0.10,
         ar_memory=60, ar_unit="seconds", step_at=12, step=0.08, expect="fail_by", by_window=14, limit=0.0),
    Cell("step-4-ar", "+4% step at window 12 under AR +-10%/1 min", "(no target: confident drift)", noise="ar",
         ar_sd=0.10, ar_memory=60, ar_unit="seconds", step_at=12, step=0.04, expect="no_confident", limit=1.0),
    Cell("creep-ar", "creep +0.25% per window under AR +-10%/1 min", "(no target: trend found)", noise="ar",
         ar_sd=0.10, ar_memory=60, ar_unit="seconds", creep=0.0025, expect="trend", limit=0.0),
    # issue 21 items 1, 2, 5: a regression inside the baseline pool, a noisy pool, pages within k windows
    # ("paged": soakd_drift_detected went to 1 at a window <= by_window, i.e. within by_window - step_at + 1
    # windows of the step, its own included), the tail
    Cell("pool-step-1", "+10% latency from window 1 (inside the 4-window pool)", "FAIL >= 95%", step_at=1,
         step=0.10, expect="fail_by", by_window=23, limit=0.95),
    Cell("pool-step-2", "+10% latency from window 2 (inside the 4-window pool)", "FAIL >= 95%", step_at=2,
         step=0.10, expect="fail_by", by_window=23, limit=0.95),
    Cell("pool-blip-8", "+20% blip in pool window 2, then +8% from window 12", "FAIL >= 80%", blip_window=2,
         blip=0.20, step_at=12, step=0.08, expect="fail_by", by_window=23, limit=0.80),
    Cell("page-10", "+10% step at window 12, iid: paged within 2 windows", "paged by window 13 >= 90%",
         step_at=12, step=0.10, expect="page_by", by_window=13, limit=0.90),
    Cell("page-10-ar", "+10% step at window 12 under AR +-10%/1 min: paged within 2 windows",
         "paged by window 13 >= 80%", noise="ar", ar_sd=0.10, ar_memory=60, ar_unit="seconds", step_at=12,
         step=0.10, expect="page_by", by_window=13, limit=0.80),
    Cell("page-20", "+20% step at window 12, iid: paged within 1 window", "paged at window 12 >= 95%",
         step_at=12, step=0.20, expect="page_by", by_window=12, limit=0.95),
    Cell("page-20-ar", "+20% step at window 12 under AR +-10%/1 min: paged within 1 window",
         "paged at window 12 >= 95%", noise="ar", ar_sd=0.10, ar_memory=60, ar_unit="seconds", step_at=12,
         step=0.20, expect="page_by", by_window=12, limit=0.95),
    # a latency that climbs from window 0, through the pool (seen: llama-server's host prompt cache, e2e p50 49 -> 64
    # -> 79 -> 90 ms in the pool's windows, 135 ms by window 9): paged within two windows of the pool's close
    Cell("pool-climb", "latency climbing from window 0: x1.31, x1.61, x1.84 at pool windows 1-3, x2.76 from window 9",
         "paged by window 5 >= 90%", climb=_CLIMB, expect="page_by", by_window=5, limit=0.90),
    Cell("pool-climb-slow", "the same climb on a slow server: 300 requests per 90-s window",
         "(no target: paged by window 5)", climb=_CLIMB, requests=300, window_s=90.0, expect="page_by", by_window=5,
         limit=0.0),
    Cell("tail-1pct-8x", "1% of requests 8x slower from window 12 (p99 +60%, p95 +5%)", "FAIL >= 90%",
         step_at=12, slow_share=0.01, slow_factor=8.0, expect="fail_by", by_window=23, limit=0.90),
    # issue 21 item 9: sparse streams on a heavy-tailed server -- 3 token events per request, the intervals between
    # them (the first from the send) Pareto with tail index 2.5, a slow server (300 requests per window)
    Cell("sparse-pareto", "sparse streams: 3 token events per request, Pareto(2.5) intervals (mean 0.5 s), "
         "300 requests per window", "false freeze <= 1%", events=3, pareto=2.5, interval_s=0.5, requests=300,
         expect="no_freeze", limit=0.01),
    Cell("sparse-pareto-3k", "sparse streams: 3 token events per request, Pareto(2.5) intervals (mean 1 s), "
         "3,000 requests per window", "false freeze <= 1%", events=3, pareto=2.5, interval_s=1.0,
         expect="no_freeze", limit=0.01),
    # issue 21 item 8: a busy node is not INCONCLUSIVE: soakd's own stalls are charged to the requests they
    # overlap (left out of the latency), the window judged on the rest
    Cell("client-stall-step-10", "soakd stalled 300 ms every 20 s, and a +10% latency step at window 12",
         "FAIL by window 14 >= 95%", stall_every_s=20, step_at=12, step=0.10, expect="fail_by", by_window=14,
         limit=0.95),
    Cell("client-stall-ar", "soakd stalled 300 ms every 20 s under AR +-10%/1 min, no fault",
         "PASS (judged, not INCONCLUSIVE) >= 98%", stall_every_s=20, noise="ar", ar_sd=0.10, ar_memory=60,
         ar_unit="seconds", expect="judged_pass", limit=0.98),
    Cell("client-stall-busy", "a busy node: soakd stalled 150 ms every 10 s, no fault",
         "PASS (judged, not INCONCLUSIVE) >= 98%", stall_every_s=10, stall_s=0.15, expect="judged_pass",
         limit=0.98),
    # issue 21 items 3 and 4: a power cap whose clock wanders, thermal throttling that costs latency, a garbage
    # collector's sawtooth near the window length under the quiesce probes (their times from soakd's own schedule)
    Cell("power-cap-wander", "GPU at its power cap, SM clock wandering sd 2% (15-min memory), latency barely moving",
         "FAIL or throttle page <= 1%", power_cap=True, clock_wander_sd=0.02, clock_wander_s=900.0,
         latency_clock_exp=0.1, expect="quiet", limit=0.01),
    Cell("thermal-throttle", "hw_thermal from window 12: SM clock -10%, latency +11%", "FAIL by window 14 >= 95%",
         throttle_at=12, throttle_drop=0.10, latency_clock_exp=1.0, expect="fail_by", by_window=14, limit=0.95),
    Cell("gc-sawtooth", "GC sawtooth 300 MiB, period 25-35 min, no leak, 10 MiB probe noise",
         "live leak alert <= 2%", gc_mib=300.0, probe_noise_mib=10, expect="no_live_leak", limit=0.02),
    # a period just under the window: one probe per window at a fixed phase reads it as a climb over hours
    Cell("gc-sawtooth-29", "GC sawtooth 300 MiB, period 28.5-29.9 min, no leak, 10 MiB probe noise",
         "live leak alert <= 2%", gc_mib=300.0, gc_period_s=(1710.0, 1794.0), probe_noise_mib=10,
         expect="no_live_leak", limit=0.02),
    Cell("gc-sawtooth-leak", "50 MB/h leak under a GC sawtooth 300 MiB, period 25-35 min",
         "leak found by the end >= 90%", memory="leak", leak_mb_per_hour=50, gc_mib=300.0, probe_noise_mib=10,
         expect="leak_final", limit=0.90),
    Cell("gc-sawtooth-leak-29", "50 MB/h leak under a GC sawtooth 300 MiB, period 28.5-29.9 min",
         "leak found by the end >= 90%", memory="leak", leak_mb_per_hour=50, gc_mib=300.0,
         gc_period_s=(1710.0, 1794.0), probe_noise_mib=10, expect="leak_final", limit=0.90),
    Cell("mem-flat-noisy", "flat device memory, 50 MiB noise per idle probe", "live leak alert <= 2%",
         probe_noise_mib=50, expect="no_live_leak", limit=0.02),
    # issue 21 item 6: error bursts, one policy (a per-window and a run budget; the error rate is no drift metric).
    # "the same answer": the run's result and whether an error burst finding names the window, as in most runs
    Cell("errors-429-2pct", "fast 429s in 2% of one window (window 12; 0.08% of the run)",
         "the same answer >= 98% (an error burst finding, PASS)", error_share=0.02, error_window=12,
         expect="errors_same", limit=0.98),
    Cell("errors-429-3pct", "fast 429s in 3% of one window (window 12; 0.13% of the run)",
         "the same answer >= 98% (an error burst finding, PASS)", error_share=0.03, error_window=12,
         expect="errors_same", limit=0.98),
    Cell("errors-429-8pct", "fast 429s in 8% of one window (window 12; 0.33% of the run)",
         "the same answer >= 98% (beyond the 5% window budget: FAIL)", error_share=0.08, error_window=12,
         expect="errors_same", limit=0.98),
)


# ---------------------------------------------------------------------------------------------
# one simulated run


class LoadFactor:
    """exp(x), x an AR(1) process of standard deviation ``sd`` and correlation time ``memory``
    (in steps of ``dt``)."""

    def __init__(self, rng: random.Random, sd: float, memory: float) -> None:
        self.rng, self.sd, self.memory = rng, sd, max(memory, 1e-9)
        self.x = rng.gauss(0.0, sd) if sd > 0 else 0.0

    def step(self, dt: float = 1.0) -> float:
        if self.sd <= 0:
            return 1.0
        phi = math.exp(-dt / self.memory)
        self.x = phi * self.x + math.sqrt(max(0.0, 1 - phi * phi)) * self.sd * self.rng.gauss(0.0, 1.0)
        return math.exp(self.x)


class ClockPath:
    """The SM clock relative to its reference, per 30-s step: a wandering power cap (an AR(1) of the cell's
    sd and memory, from its own RNG so that the traffic's stream is the same as without it) times a
    thermal drop from ``throttle_at``."""

    def __init__(self, cell: Cell, seed: int) -> None:
        self.cell = cell
        self.lf = LoadFactor(random.Random(seed * 7919 + 13), cell.clock_wander_sd, cell.clock_wander_s)
        self.path: list[float] = []

    def at(self, t: float) -> float:
        i = max(0, int(t // 30.0))
        while len(self.path) <= i:
            self.path.append(self.lf.step(30.0))
        f = self.path[i]
        if self.cell.throttle_at is not None and t >= self.cell.throttle_at * self.cell.window_s:
            f *= 1.0 - self.cell.throttle_drop
        return f

    def latency(self, t: float) -> float:
        return (1.0 / self.at(t)) ** self.cell.latency_clock_exp if self.cell.latency_clock_exp else 1.0


def gc_sawtooth(cell: Cell, seed: int) -> Any:
    """The garbage collector's sawtooth (bytes at ``t``): a period drawn in the cell's range and a random
    phase, from the run's own RNG."""
    r = random.Random(seed * 104729 + 7)
    period = r.uniform(*cell.gc_period_s)
    phase = r.random()
    return lambda t: cell.gc_mib * MIB * ((t / period + phase) % 1.0)


def latency_scale(cell: Cell, window: int, t_in_run: float) -> float:
    s = 1.0
    if cell.step_at is not None and window >= cell.step_at and cell.step_on == "all" and not cell.slow_share:
        s *= 1.0 + cell.step
    if cell.creep:
        s *= 1.0 + cell.creep * (t_in_run / cell.window_s)
    if cell.climb:
        x = t_in_run / cell.window_s
        i = int(x)
        s *= cell.climb[-1] if i >= len(cell.climb) - 1 else \
            cell.climb[i] + (x - i) * (cell.climb[i + 1] - cell.climb[i])
    if cell.period_s and (t_in_run % cell.period_s) < cell.period_s / 4:
        s /= 0.9  # a 10%-deep throughput drop: every request 1/0.9 as long
    return s


def extra_scale(cell: Cell, window: int, rng: random.Random) -> float:
    """Issue 21's knobs: a blip window, a share of slow requests (from ``step_at``); draws nothing for a
    cell without them (the other cells' random streams stay as they were)."""
    s = 1.0
    if cell.blip_window is not None and window == cell.blip_window:
        s *= 1.0 + cell.blip
    if cell.slow_share and window >= (cell.step_at or 0) and rng.random() < cell.slow_share:
        s *= cell.slow_factor
    return s


def tail_scale(cell: Cell, window: int, z: float) -> float:
    """A step of the tail only: requests beyond the median (z > 0) slower in proportion to z."""
    if cell.step_at is None or window < cell.step_at or cell.step_on != "p95" or z <= 0:
        return 1.0
    return 1.0 + cell.step * min(1.0, z / 1.645)


def arrivals(cell: Cell, rng: random.Random, clock: ClockPath | None = None) -> Iterator[tuple[float, ...]]:
    """(send time, e2e seconds, ttft seconds, the load and scale part of both) of every request, in
    send order (open loop)."""
    rate = cell.requests / cell.window_s
    end = cell.windows * cell.window_s
    per_request = cell.ar_unit == "requests"
    lf = LoadFactor(rng, cell.ar_sd, cell.ar_memory)
    t = 0.0
    while True:
        dt = rng.expovariate(rate)
        t += dt
        if t >= end:
            return
        load = lf.step(1.0 if per_request else dt)
        w = int(t // cell.window_s)
        z = rng.gauss(0.0, 1.0)
        base = load * latency_scale(cell, w, t) * tail_scale(cell, w, z)
        if cell.blip_window is not None or cell.slow_share:
            base *= extra_scale(cell, w, rng)
        if clock is not None:
            base *= clock.latency(t)
        e2e = math.exp(SIGMA * z) * base
        ttft = 0.1 * math.exp(0.4 * rng.gauss(0.0, 1.0)) * base
        yield t, e2e, min(ttft, e2e * 0.9), base


def closed_loop(cell: Cell, rng: random.Random, workers: int = 16,
                pauses: list[tuple[float, float]] | None = None) -> Iterator[tuple[float, float, float]]:
    """A closed loop of ``workers`` on a server whose speed depends on the batch: each request is
    short (80%) or long (20%, 5x the tokens); a request's time is its tokens x a per-token time
    that grows with the long requests in flight (and the cell's latency scale: a step is a throughput fall). A
    request due inside one of ``pauses`` (start, end) starts at its end. Yields in send order."""
    pause_starts = [a for a, _ in pauses or ()]
    end = cell.windows * cell.window_s
    base = cell.window_s * workers / cell.requests  # mean request time that gives ~requests per window
    in_flight_long = 0
    events: list[tuple[float, int, bool]] = []  # (finish time, worker, long)
    pending: list[tuple[float, float, float]] = []

    def start(now: float, worker: int) -> None:
        nonlocal in_flight_long
        i = bisect.bisect_right(pause_starts, now) - 1
        if pauses and i >= 0 and now < pauses[i][1]:
            now = pauses[i][1]
        long = rng.random() < 0.2
        tokens = 5.0 if long else 1.0
        in_flight_long += long
        slow = 1.0 + 0.15 * in_flight_long  # the batch: long requests slow everyone down
        e2e = base / 1.8 * tokens * slow * math.exp(0.3 * rng.gauss(0.0, 1.0))
        e2e *= latency_scale(cell, int(now // cell.window_s), now)
        ttft = min(e2e * 0.9, 0.1 * slow * math.exp(0.4 * rng.gauss(0.0, 1.0)))
        heapq.heappush(events, (now + e2e, worker, long))
        pending.append((now, e2e, ttft))

    for w in range(workers):
        start(rng.uniform(0, base), w)
    while events:
        t, worker, long = heapq.heappop(events)
        in_flight_long -= long
        if t < end:
            start(t, worker)
    pending.sort()
    yield from pending


def memory_at(cell: Cell, t: float, rng: random.Random) -> float:
    """Idle device memory (bytes) at simulated time ``t`` (the quiesce probe's reading)."""
    base = 40 * GIB
    h = t / 3600.0
    if cell.restart_window is not None and t >= (cell.restart_window + 1) * cell.window_s:
        h = (t - (cell.restart_window + 1) * cell.window_s) / 3600.0  # the restarted server warms up again
    if cell.memory == "ramp":
        base += 600 * MIB * min(1.0, h / 1.5)  # warming up over the first 1.5 h
    elif cell.memory == "step":
        base += 512 * MIB if h >= 2.0 else 0.0
    elif cell.memory == "sawtooth":
        base += GIB * ((h % 4.0) / 4.0)
    elif cell.memory == "leak":
        base += cell.leak_mb_per_hour * 1e6 * h
    return base + rng.gauss(0.0, cell.probe_noise_mib * MIB) if cell.probe_noise_mib else base


@dataclass
class RunResult:
    failed: bool
    fail_window: int | None  # the earliest window a failing finding names
    live_flag: bool
    reasons: list[str] = field(default_factory=list)
    confident: bool = False
    trend: bool = False
    leak_window: int | None = None
    periodic: bool = False
    freeze: bool = False
    inconclusive: bool = False
    restart_reported: bool = False
    impaired_windows: int = 0
    impaired_share: float = 0.0  # of the run's requests, those a stall of soakd's own loop overlapped
    leak_rate: float | None = None  # MB/h, the last judgement of device memory
    ab_fail: bool = False  # the verdict fails on an ab finding
    ab_confident: bool = False  # a confident worse A/B difference (a window or the run)
    page_window: int | None = None  # the first window at which soakd_drift_detected went to 1 (any metric)
    tput_page_window: int | None = None  # ... for a throughput metric
    live_leak: bool = False  # soakd_memory_leak_suspected 1 (a byte source) after some window: the leak page
    live_throttle: bool = False  # soakd_throttle_detected 1 after some window: the throttling page (one GPU)
    final_leak: bool = False  # a leak suspected by the run's last judgement
    withdrawn: bool = False  # a 'leak page withdrawn' finding
    answer: str = ""  # issue 21 item 6: the result, and whether an errors finding named the error window


def _sparse_times(cell: Cell, t: float, rng: random.Random) -> list[float]:
    """A sparse stream: ``cell.events`` token events, each Pareto(``cell.pareto``) seconds after the one before (the
    first after the send), with mean ``cell.interval_s``."""
    a = cell.pareto
    scale = cell.interval_s * (a - 1.0) / a  # the Pareto minimum for that mean
    times, b = [], t
    for _ in range(cell.events):
        b += scale * rng.paretovariate(a)
        times.append(b)
    return times


def _byte_times(cell: Cell, t: float, e2e: float, ttft: float, rng: random.Random | None = None) -> list[float]:
    """When each token of a request sent at ``t`` arrives (seconds): evenly spaced after the first (or a sparse
    stream's, ``_sparse_times``), moved by the server's freezes (everything after a freeze's start waits for its
    end) and by soakd's own stalls (bytes that arrive during a stall are read at its end)."""
    if cell.events and rng is not None:
        times = _sparse_times(cell, t, rng)
    else:
        first = t + ttft
        step = (e2e - ttft) / GAPS
        times = [first + i * step for i in range(GAPS + 1)]
    if cell.freeze_every_s:
        every, dur = cell.freeze_every_s, cell.freeze_s
        k = math.floor(t / every)
        for f in (k * every + every / 2, (k + 1) * every + every / 2):  # freezes mid-period
            if t < f + dur and times[-1] > f:
                d = f + dur - max(t, f)
                times = [b + d if b > f else b for b in times]
    if cell.stall_every_s:
        every, dur = cell.stall_every_s, cell.stall_s
        times = [(math.floor(b / every) * every + dur) if (b % every) < dur else b for b in times]
    return times


def _beats(cell: Cell, t: float) -> list[tuple[float, float]]:
    """soakd's heartbeats from ``t - 5`` to ``t``: (time, lag): one at ``t`` on time, and one at the end of
    each of soakd's own stalls in between, as late as the stall was long."""
    out = []
    if cell.stall_every_s:
        every, dur = cell.stall_every_s, cell.stall_s
        k = math.floor((t - 5.0) / every) + 1
        while k * every + dur <= t:
            if k * every + dur > t - 5.0:
                out.append((k * every + dur, dur))
            k += 1
    out.append((t, 0.001))
    return out


def _record(t: float, times: list[float], window: int) -> RequestRecord:
    r = RequestRecord("short_chat")
    r.window = window
    r.t_start_ns = int(t * 1e9)
    r.token_times_ns = [int(b * 1e9) for b in times]
    r.t_end_ns = r.token_times_ns[-1]
    r.completion_tokens = len(times)
    r.prompt_tokens = 128
    r.usage_from_server = True
    return r


def _fast_429(rec: RequestRecord, rng: random.Random, share: float) -> bool:
    """With probability ``share``: the request is refused at once (HTTP 429, 5 ms, no token)."""
    if rng.random() >= share:
        return False
    rec.token_times_ns = []
    rec.t_end_ns = rec.t_start_ns + 5_000_000
    rec.http_status = 429
    rec.fail(Outcome.HTTP_ERROR, "http_429")
    return True


def _telemetry(cell: Cell, t: float, clock: ClockPath | None = None) -> list[Series]:
    shares = 1.0 if cell.power_cap else 0.0
    lab = (("gpu", "0"), ("uuid", "GPU-0"))
    f = clock.at(t) if clock is not None else 1.0
    thermal = cell.throttle_at is not None and t >= cell.throttle_at * cell.window_s
    out = [
        Series("soakd_gpu_power_watts", 650.0 if cell.power_cap else 450.0, lab),
        Series("soakd_gpu_sm_clock_hertz", (1.755e9 if cell.power_cap else 1.98e9) * f, lab),
        Series("soakd_gpu_sm_clock_max_hertz", 1.98e9, lab),
        Series("soakd_gpu_memory_used_bytes", 60 * GIB, lab),
        Series("soakd_gpu_memory_total_bytes", 80 * GIB, lab),
    ]
    for reason in ("sw_power_cap", "sw_thermal", "hw_slowdown", "hw_thermal", "hw_power_brake"):
        active = shares if reason == "sw_power_cap" else 0.0
        if reason == "hw_thermal" and thermal:
            active = 1.0
        out.append(Series("soakd_gpu_clocks_event_active", active, (*lab, ("reason", reason))))
    return out


class Analysis:
    """The analysis side of a simulated run: the analyzer (in an A/B cell also the candidate's and the A/B judge),
    everything the run sends it, in order, and the live flags it raised after each window. ``calls``: a list, every
    input is appended to it as its stored document (``--record``), so that ``replay`` can send the same inputs through
    another version of the analysis."""

    def __init__(self, cell: Cell, cfg: AnalysisConfig, calls: list[tuple[str, Any]] | None = None) -> None:
        self.cell = cell
        self.calls = calls
        ab_run = cell.ab is not None
        # A/B: the candidate's analysis, and the judge in the reference's analysis (as the runtime wires them)
        self.judge = AbJudge(cfg, "ref", ["cand"], cell.windows) if ab_run else None
        self.analyzer = Analyzer(cfg, planned_windows=cell.windows, candidates=1 if ab_run else 0, ab=self.judge)
        self.cand = Analyzer(cfg, planned_windows=cell.windows, candidates=1) if ab_run else None
        self.live = self.live_drift = self.live_leak = self.live_throttle = False
        self.page_window: int | None = None
        self.tput_page_window: int | None = None

    def candidate_window(self, w: WindowSummary) -> None:
        assert self.cand is not None
        if w.revision:
            return
        if self.calls is not None:
            self.calls.append(("c", w.dump()))
        self.cand.add_window(w)
        self.analyzer.add_target_window("cand", w)

    def window(self, w: WindowSummary) -> None:
        if w.revision:
            return
        if self.calls is not None:
            self.calls.append(("w", w.dump()))
        analyzer = self.analyzer
        analyzer.add_window(w)
        drift = any(analyzer.drift_active.values())
        self.live_drift = self.live_drift or drift
        if self.page_window is None and drift:
            self.page_window = w.window
        if self.tput_page_window is None and any(v for m, v in analyzer.drift_active.items() if m in THROUGHPUT):
            self.tput_page_window = w.window
        self.live_leak = self.live_leak or any(lk.suspected for s, lk in analyzer.leaks.items()
                                               if s in LEAK_SOURCES_BYTES)
        self.live_throttle = self.live_throttle or analyzer.throttle_detected
        if drift or analyzer.throttle_detected or any(lk.fails for lk in analyzer.leaks.values()):
            self.live = True

    def quiesce(self, probe: QuiesceProbe) -> None:
        if self.calls is not None:
            self.calls.append(("q", probe.model_dump(mode="json")))
        self.analyzer.add_quiesce(probe)

    def result(self) -> RunResult:
        """The verdict, and what the run is counted for."""
        analyzer, cell = self.analyzer, self.cell
        verdict = analyzer.verdict()
        failing = [f for f in analyzer.findings if f.severity != "info" and f.kind in ("drift", "throttle")
                   and (f.evidence.get("tier") in (None, "confident"))]
        windows_named = [f.window for f in failing if f.window is not None]
        windows_named += [int(r.split("window ")[-1].rstrip(")")) for r in verdict.reasons
                          if r.startswith(("drift", "throttle")) and r.rstrip(")").split("window ")[-1].isdigit()]
        fail_window = min(windows_named, default=None)
        leak = [f.window for f in analyzer.findings if f.kind == "leak" and f.diagnosis != "memory steps"]
        final_leak = any(lk.suspected for lk in analyzer.leaks.values())
        dm = analyzer.leaks.get("device_memory")
        return RunResult(
            failed=verdict.result == "FAIL", fail_window=fail_window if verdict.result == "FAIL" else None,
            live_flag=self.live, reasons=list(verdict.reasons),
            confident=self.live_drift or any(f.kind == "drift" and f.evidence.get("tier") == "confident"
                                             for f in analyzer.findings),
            trend=any(f.diagnosis == "creep" and f.evidence.get("direction") == "degraded" for f in analyzer.findings),
            leak_window=min(leak) if leak and final_leak else None,
            periodic=analyzer.periodic is not None,
            freeze=any(f.kind == "freeze" for f in analyzer.findings),
            inconclusive=verdict.inconclusive is not None,
            restart_reported=any(f.diagnosis == "target restarted" for f in analyzer.findings),
            impaired_windows=sum(1 for w in analyzer.history.full() if w.client and w.client.impaired),
            impaired_share=sum(w.client.requests_impaired for w in analyzer.history.closed if w.client)
            / max(1, sum(w.requests for w in analyzer.history.closed)),
            leak_rate=dm.growth_per_hour / 1e6 if dm is not None and dm.growth_per_hour is not None else None,
            ab_fail=any(r.startswith("ab:") for r in verdict.reasons),
            ab_confident=any(f.kind == "ab" and f.evidence.get("tier") == "confident"
                             and f.evidence.get("direction") == "worse" for f in analyzer.findings),
            page_window=self.page_window, tput_page_window=self.tput_page_window,
            live_leak=self.live_leak, live_throttle=self.live_throttle, final_leak=final_leak,
            withdrawn=any(f.diagnosis == "leak page withdrawn" for f in analyzer.findings),
            answer=_errors_answer(cell, verdict.result, analyzer.findings))


def simulate(cell: Cell, seed: int, config: AnalysisConfig | None = None,
             calls: list[tuple[str, Any]] | None = None) -> RunResult:
    """One seeded run of ``cell`` through the real path. ``calls``: a list, every input the analysis is sent is
    appended to it (``Analysis``)."""
    rng = random.Random(seed)
    clock = ManualClock(0.0)
    tl = Timeline(0.0, 0.0, cell.window_s, cell.windows * cell.window_s)
    windows = WindowSet(tl, confidence=0.95, patience=min(cell.window_s, 120.0), clock=clock)
    cfg = config or AnalysisConfig()
    analysis = Analysis(cell, cfg, calls)
    cand_windows = WindowSet(tl, confidence=0.95, patience=min(cell.window_s, 120.0), clock=clock) \
        if cell.ab is not None else None
    clock_path = ClockPath(cell, seed) if cell.clock_wander_sd or cell.throttle_at is not None else None
    gc = gc_sawtooth(cell, seed) if cell.gc_mib else None
    # the probes' times from soakd's own schedule (the runtime's: soakd.soak.quiesce.QuiesceProber.schedule)
    probe_list = list(ProbeSchedule.seeded(
        tl.first_window_start, cell.window_s, cfg.quiesce.jitter, seed, end=tl.end,
        min_remaining=min(cell.window_s / 2, 60.0),
        duration=min(cfg.quiesce.drain_timeout, cell.window_s / 4) + cfg.quiesce.settle).times(tl.end))
    if cell.drain_s and cell.noise != "closed":
        raise ValueError(f"{cell.name}: drain_s needs a closed loop (an open loop's arrivals do not wait)")
    pauses = [(p, p + cell.drain_s) for p in probe_list] if cell.drain_s else None
    source = closed_loop(cell, rng, pauses=pauses) if cell.noise == "closed" else arrivals(cell, rng, clock_path)
    next_sample = 15.0
    probe_times = iter(probe_list)
    next_probe = next(probe_times, math.inf)

    def close(now: float, final: bool = False) -> None:
        if cand_windows is not None:
            for w in cand_windows.close_due(now, final=final):
                analysis.candidate_window(w)
        for w in windows.close_due(now, final=final):
            analysis.window(w)

    next_beat = 1.0
    next_tick = 1.0  # soakd's scheduler tick (``policy.tick_seconds``): when windows close
    down = None
    if cell.restart_window is not None:
        down = (cell.restart_window * cell.window_s, (cell.restart_window + 1) * cell.window_s)
        windows.add_interval(*down, "target_down_seconds")
    for item in source:
        t, e2e, ttft = item[:3]
        while next_sample <= t:
            clock.now = next_sample
            windows.add_samples(_telemetry(cell, next_sample, clock_path), next_sample)
            next_sample += 30.0
        while next_beat <= t:  # soakd's heartbeat (one per 5 s here; a stall is reported by a beat at its end)
            for b, lag in _beats(cell, next_beat):
                windows.add_lag(b, lag, 0.01)
            next_beat += 5.0
        while next_probe <= t:
            w = tl.window_at(next_probe)
            if down is None or not down[0] <= next_probe < down[1]:
                mem = memory_at(cell, next_probe, rng) + (gc(next_probe) if gc is not None else 0.0)
                probe = QuiesceProbe(t_unix=clock.wall_offset + next_probe, window=w, drained=True,
                                     kv_cache_usage_ratio=0.0, memory_used_bytes=mem, seconds=cell.drain_s or 2.0)
                if cell.drain_s:  # the load held from the probe's start to its end (soakd.soak.quiesce)
                    windows.add_interval(next_probe, next_probe + cell.drain_s, "paused_seconds")
                windows.set_probe(probe)
                analysis.quiesce(probe)
            next_probe = next(probe_times, math.inf)
        clock.now = t
        if t >= next_tick:
            close(t)
            next_tick = math.floor(t) + 1.0
        w = tl.window_at(t)
        times = _byte_times(cell, t, e2e, ttft, rng)
        rec = _record(t, times, w)
        windows.started(rec)
        if down is not None and down[0] <= t < down[1]:
            rec.token_times_ns = []
            rec.t_end_ns = rec.t_start_ns + 1_000_000
            rec.fail(Outcome.CONNECTION_ERROR, "connect_refused")
            windows.finished(rec)
            continue
        if cell.error_share and w == cell.error_window and _fast_429(rec, rng, cell.error_share):
            windows.finished(rec)
            continue
        rec.outcome = Outcome.OK
        windows.finished(rec)
        if cand_windows is not None:  # the same request to the candidate: the same load, its noise
            # correlated with the reference's (the same prompt, rho 0.7), with the same spread
            base = item[3]
            rho = 0.7
            z = math.log(e2e / base) / SIGMA
            zc = rho * z + math.sqrt(1 - rho * rho) * rng.gauss(0.0, 1.0)
            c_e2e = math.exp(SIGMA * zc) * base * (1.0 + (cell.ab or 0.0))
            c_ttft = min(0.1 * math.exp(0.4 * rng.gauss(0.0, 1.0)) * base * (1.0 + (cell.ab or 0.0)), c_e2e * 0.9)
            crec = _record(t, _byte_times(cell, t, c_e2e, c_ttft), w)
            cand_windows.started(crec)
            crec.outcome = Outcome.OK
            cand_windows.finished(crec)
    close(tl.end + cell.window_s, final=True)
    return analysis.result()


def replay(cell: Cell, doc: dict[str, Any]) -> RunResult:
    """A recorded run (``--record``) through this version of the analysis: the same windows, candidate windows and
    probes, in the same order, into fresh analyzers with the run's configuration."""
    analysis = Analysis(cell, AnalysisConfig.model_validate(doc["config"]))
    for kind, x in doc["calls"]:
        if kind == "w":
            analysis.window(WindowSummary.load(x))
        elif kind == "c":
            analysis.candidate_window(WindowSummary.load(x))
        else:
            analysis.quiesce(QuiesceProbe.model_validate(x))
    return analysis.result()


def recorded(directory: Path, name: str, seed: int) -> Path:
    return directory / f"{name}-{seed}.json.gz"


def _errors_answer(cell: Cell, result: str, findings: list[Any]) -> str:
    """The run's answer to an error cell: its result, and whether a finding of kind errors names the window."""
    named = cell.error_window is not None and any(f.kind == "errors" and f.window is not None and f.window
                                                  <= cell.error_window <= (f.last_window or f.window)
                                                  for f in findings)
    return f"{result}{' + errors finding' if named else ''}"


# ---------------------------------------------------------------------------------------------
# the table


def _run(args: tuple[str, int, float | None, Path | None, Path | None]) -> dict[str, Any]:
    """One run: (cell name, seed, probe jitter, --record directory, --replay directory)."""
    name, seed, jitter, record, replayed = args
    cell = next(c for c in CELLS if c.name == name)
    if replayed is not None:
        r = replay(cell, json.loads(gzip.decompress(recorded(replayed, name, seed).read_bytes())))
    else:
        cfg = AnalysisConfig()
        if jitter is not None:  # --probe-jitter: the probes' spread within windows (0: the fixed mid-window phase)
            cfg = cfg.model_copy(update={"quiesce": cfg.quiesce.model_copy(update={"jitter": jitter})})
        calls: list[tuple[str, Any]] | None = [] if record is not None else None
        r = simulate(cell, seed, cfg, calls)
        if record is not None:
            doc = {"cell": name, "seed": seed, "config": cfg.model_dump(mode="json"), "calls": calls}
            recorded(record, name, seed).write_bytes(gzip.compress(json.dumps(doc).encode(), compresslevel=3))
    return {"failed": r.failed, "fail_window": r.fail_window, "live": r.live_flag, "reasons": r.reasons,
            "confident": r.confident, "trend": r.trend, "leak_window": r.leak_window, "periodic": r.periodic,
            "freeze": r.freeze, "inconclusive": r.inconclusive, "restart_reported": r.restart_reported,
            "impaired_windows": r.impaired_windows, "impaired_share": r.impaired_share, "leak_rate": r.leak_rate,
            "ab_fail": r.ab_fail, "ab_confident": r.ab_confident, "page_window": r.page_window,
            "tput_page_window": r.tput_page_window,
            "live_leak": r.live_leak, "live_throttle": r.live_throttle, "final_leak": r.final_leak,
            "withdrawn": r.withdrawn, "answer": r.answer}


# per expectation: what a run counts for, and whether the cell's limit is an upper bound (else a lower one)
_COUNTS: dict[str, tuple[Any, bool]] = {
    "pass": (lambda r, c: r["failed"], True),
    "fail_by": (lambda r, c: r["failed"] and r["fail_window"] is not None and r["fail_window"] <= c.by_window, False),
    "no_confident": (lambda r, c: r["confident"], True),
    "trend": (lambda r, c: r["trend"], False),
    "periodic": (lambda r, c: r["periodic"], False),
    "freeze": (lambda r, c: r["freeze"], False),
    "no_freeze": (lambda r, c: r["freeze"], True),
    "inconclusive": (lambda r, c: r["inconclusive"] and not r["failed"], False),
    "ab_pass": (lambda r, c: r["ab_fail"], True),
    "ab_fail": (lambda r, c: r["ab_fail"], False),
    "ab_confident": (lambda r, c: r["ab_confident"], True),
    "errors_same": (None, False),  # the share of runs that give the most common answer (measure())
    "restart": (lambda r, c: r["restart_reported"] and not any(x.startswith(("drift", "leak")) for x in r["reasons"]),
                False),
    "leak_by": (lambda r, c: r["leak_window"] is not None and r["leak_window"] <= c.by_window, False),
    "page_by": (lambda r, c: r.get("page_window") is not None and r["page_window"] <= c.by_window, False),
    "tput_page_by": (lambda r, c: r.get("tput_page_window") is not None and r["tput_page_window"] <= c.by_window,
                     False),
    "no_tput_page": (lambda r, c: r.get("tput_page_window") is not None, True),
    "judged_pass": (lambda r, c: not r["failed"] and not r["inconclusive"], False),
    "quiet": (lambda r, c: r["failed"] or r["live_throttle"], True),
    "no_live_leak": (lambda r, c: r["live_leak"], True),
    "leak_final": (lambda r, c: r["final_leak"], False),
}


def measure(cell: Cell, runs: int, seed0: int, pool: ProcessPoolExecutor | None,
            jitter: float | None = None, record: Path | None = None, replayed: Path | None = None) -> dict[str, Any]:
    jobs = [(cell.name, seed0 + i, jitter, record, replayed) for i in range(runs)]
    results = list(pool.map(_run, jobs)) if pool is not None else [_run(j) for j in jobs]
    n = len(results)
    fail = sum(r["failed"] for r in results) / n
    live = sum(r["live"] for r in results) / n
    kinds: dict[str, int] = {}
    for r in results:
        for reason in r["reasons"]:
            kind = reason.split(":")[0]
            kinds[kind] = kinds.get(kind, 0) + 1
    counted, at_most = _COUNTS[cell.expect]
    answers: dict[str, int] = {}
    for r in results:
        answers[r["answer"]] = answers.get(r["answer"], 0) + 1
    if counted is None:  # errors_same: the most common answer's share
        value = max(answers.values()) / n
    else:
        value = sum(bool(counted(r, cell)) for r in results) / n
    ok = value <= cell.limit if at_most else value >= cell.limit
    rates = sorted(r["leak_rate"] for r in results if r["leak_rate"] is not None)
    return {"cell": cell.name, "what": cell.what, "target": cell.target, "runs": n, "value": value, "ok": ok,
            "fail": fail, "live": live, "findings": kinds,
            "periodic": sum(r["periodic"] for r in results) / n,
            "page": sum(r.get("page_window") is not None for r in results) / n,
            "inconclusive": sum(r["inconclusive"] for r in results) / n,
            "impaired_share": sum(r.get("impaired_share", 0.0) for r in results) / n,
            "leak_rate_median": rates[len(rates) // 2] if rates else None,
            "live_leak": sum(r["live_leak"] for r in results) / n,
            "live_throttle": sum(r["live_throttle"] for r in results) / n,
            "withdrawn": sum(r["withdrawn"] for r in results) / n,
            "answers": dict(sorted(answers.items(), key=lambda kv: -kv[1]))}


MEASURE = {
    "pass": "false FAIL", "fail_by": "FAIL by window 14", "no_confident": "confident drift", "trend": "trend found",
    "leak_by": "leak finding by hour 8", "periodic": "periodic drops found", "freeze": "freeze finding",
    "inconclusive": "INCONCLUSIVE, not FAIL", "restart": "restart reported, no drift/leak FAIL",
    "no_freeze": "false freeze",
    "ab_pass": "false ab FAIL", "ab_fail": "ab FAIL", "ab_confident": "confident ab",
    "page_by": "paged in time", "tput_page_by": "throughput paged in time",
    "no_tput_page": "throughput false page",
    "judged_pass": "PASS (not INCONCLUSIVE)",
    "quiet": "FAIL or throttle page", "no_live_leak": "live leak page", "leak_final": "leak found by the end",
    "errors_same": "the same answer",
}


def source_commit() -> str | None:
    """The short commit of the soakd this benchmark runs (``-dirty`` with uncommitted changes), or None."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "") if head else None


def markdown(data: dict[str, Any]) -> str:
    """The measured table: one row per cell (with the commit that measured it where the file says)."""
    by_name = {c.name: c for c in CELLS}
    commits = any(r.get("commit") for r in data["rows"])
    lines = [f"| scenario | target | measured ({data['runs']} runs) | final FAIL | any live flag | drift page | "
             f"periodic drops found |{' commit |' if commits else ''}",
             f"|---|---|---|---|---|---|---|{'---|' if commits else ''}"]
    for r in data["rows"]:
        cell = by_name.get(r["cell"])
        what = MEASURE.get(cell.expect, "") if cell else ""
        if cell is not None and cell.expect == "leak_by" and cell.limit == 0.0:
            what = f"leak finding; median rate {r.get('leak_rate_median') or 0:.0f} MB/h"
        mark = "" if r["ok"] else " (missed)"
        lines.append(f"| {r['what']} | {r['target']} | {what}: {r['value']:.1%}{mark} | {r['fail']:.1%} | "
                     f"{r['live']:.1%} | {r.get('page', 0.0):.1%} | {r.get('periodic', 0.0):.1%} |"
                     + (f" {r.get('commit') or '-'} |" if commits else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="20 runs per cell")
    p.add_argument("--runs", type=int, help="runs per cell (default 200; --quick 20)")
    p.add_argument("--cells", help="comma list of cell names (default: all)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", type=Path, help="write the rows here (after every cell)")
    p.add_argument("--probe-jitter", type=float, default=None,
                   help="analysis.quiesce.jitter for every run (default soakd's; 0: one probe at the middle of "
                        "every window, as before issue 21)")
    p.add_argument("--resume", action="store_true",
                   help="keep the rows of the --json file that already have the runs asked for; measure the rest")
    p.add_argument("--record", type=Path, metavar="DIR",
                   help="also write each run's analysis inputs (every window, candidate window and probe the analysis "
                        "is sent, with its configuration) to DIR/<cell>-<seed>.json.gz")
    p.add_argument("--replay", type=Path, metavar="DIR",
                   help="do not simulate: send the runs --record wrote to DIR through this version of the analysis "
                        "(the same windows: a change to the analysis measured on the same runs, in a fraction of the "
                        "time)")
    p.add_argument("--markdown", type=Path, metavar="JSON",
                   help="print the table of an earlier --json file as Markdown (docs/verdict-quality.md's) and exit")
    a = p.parse_args(argv)
    if a.markdown:
        print(markdown(json.loads(a.markdown.read_text())))
        return 0
    runs = a.runs or (20 if a.quick else 200)
    cells = [c for c in CELLS if not a.cells or c.name in a.cells.split(",")]
    if a.record and a.replay:
        p.error("--record and --replay exclude each other")
    if a.record:
        a.record.mkdir(parents=True, exist_ok=True)
    if a.replay:
        missing = [recorded(a.replay, c.name, a.seed + i).name for c in cells for i in range(runs)
                   if not recorded(a.replay, c.name, a.seed + i).exists()]
        if missing:
            p.error(f"{len(missing)} of the runs asked for were not recorded in {a.replay} (first: {missing[0]}); "
                    f"record them with --record {a.replay} and the same --cells, --runs and --seed")
    t0 = time.monotonic()
    commit = source_commit()
    done: dict[str, dict[str, Any]] = {}
    if a.resume and a.json and a.json.exists():
        done = {r["cell"]: r for r in json.loads(a.json.read_text())["rows"] if r["runs"] >= runs}
    rows = []
    pool = ProcessPoolExecutor(a.workers) if a.workers > 1 else None
    try:
        for cell in cells:
            row = done.get(cell.name)
            if row is None:
                row = measure(cell, runs, a.seed, pool, a.probe_jitter, a.record, a.replay)
                row["commit"] = commit  # what measured it: a resumed table can span commits
            rows.append(row)
            if a.json:  # after every cell: a long measurement that is stopped keeps what it finished
                a.json.write_text(json.dumps({"runs": runs, "rows": rows}, indent=2))
            kinds = ", ".join(f"{k} {v}" for k, v in sorted(row["findings"].items())) or "-"
            extra = f", leak rate median {row['leak_rate_median']:.0f} MB/h" if row["leak_rate_median"] is not None \
                and cell.memory == "leak" else ""
            if cell.stall_every_s:
                extra += f", requests impaired {row.get('impaired_share', 0.0):.1%}"
            if cell.expect == "errors_same":
                extra += "; answers: " + ", ".join(f"{k} {v}" for k, v in row.get("answers", {}).items())
            print(f"{'PASS' if row['ok'] else 'MISS'}  {cell.name:<15} {row['value']:6.1%}  (final FAIL {row['fail']:6.1%}, "
                  f"live flag {row['live']:6.1%}, drift page {row.get('page', 0.0):6.1%}, periodic {row['periodic']:5.1%}, inconclusive "
                  f"{row['inconclusive']:5.1%}{extra}; live leak {row['live_leak']:5.1%}, live throttle "
                  f"{row['live_throttle']:5.1%}, leak withdrawn {row['withdrawn']:5.1%}; failing: {kinds})  "
                  f"target: {cell.target}", flush=True)
    finally:
        if pool is not None:
            pool.shutdown()
    print(f"({runs} runs per cell, {time.monotonic() - t0:.0f} s)")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

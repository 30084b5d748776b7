#!/usr/bin/env python3
"""Leak probes against a garbage collector's sawtooth (issue 21 item 4), fast: only the idle quiesce
probes, at the times soakd's own schedule gives (``soakd.soak.probe_schedule``), through soakd's leak
judgement (``soakd.analysis.leak.evaluate_memory``) after every window of a 12-hour run (24 windows)
and once at the end. "old" is one probe at the middle of every window and every window's judgement at
95%; "new" the defaults (jittered probes, the run-level live confidence). The full path (requests,
windows, the engine) is ``verdict_quality.py``'s gc-* cells; this one runs 200 seeds a row in minutes.

    python benchmarks/leak_probes.py --runs 200
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from soakd.analysis.leak import evaluate_memory  # noqa: E402
from soakd.analysis.leak_page import live_confidence  # noqa: E402
from soakd.config.analysis import LeakConfig, QuiesceConfig  # noqa: E402
from soakd.core.summary import WindowSummary  # noqa: E402
from soakd.soak.probe_schedule import ProbeSchedule  # noqa: E402

GIB, MIB, T0 = 2**30, 2**20, 1.7e9
ROWS = (  # name, GC period range (min), GC MiB, leak MiB/h, probe noise MiB
    ("GC sawtooth 25-35 min, no leak", (25, 35), 300, 0.0, 10),
    ("GC sawtooth 28.5-29.9 min, no leak", (28.5, 29.9), 300, 0.0, 10),
    ("50 MB/h under a GC sawtooth 25-35 min", (25, 35), 300, 50e6 / MIB, 10),
    ("50 MB/h under a GC sawtooth 28.5-29.9 min", (28.5, 29.9), 300, 50e6 / MIB, 10),
    ("flat memory, 50 MiB probe noise", (30, 30), 0, 0.0, 50),
    ("50 MB/h, 50 MiB probe noise", (30, 30), 0, 50e6 / MIB, 50),
)


def windows(pts: list[tuple[float, float]]) -> list[WindowSummary]:
    return [WindowSummary.load({
        "window": i, "start_unix": T0 + 1800 * i, "duration_seconds": 1800.0,
        "device": {"memory_used_bytes": {"min": 60 * GIB}, "memory_total_bytes": 80 * GIB},
        "quiesce": {"t_unix": T0 + t, "window": i, "drained": True, "memory_used_bytes": 40 * GIB + v * MIB},
    }) for i, (t, v) in enumerate(pts)]  # fmt: skip


def run(seed: int, new: bool, period: tuple[float, float], gc: float, leak: float, noise: float,
        n: int = 24) -> tuple[bool, bool]:
    """(a leak suspected after some window: the page, suspected by the last judgement)."""
    r = random.Random(seed * 7 + 1)
    p, phase = r.uniform(*period) * 60.0, r.random()
    q = QuiesceConfig()
    sched = ProbeSchedule.seeded(0.0, 1800.0, q.jitter if new else 0.0, seed,
                                 duration=min(q.drain_timeout, 450.0) + q.settle if new else 0.0)
    pts = [(t, gc * ((t / p + phase) % 1.0) + leak * t / 3600.0 + r.gauss(0.0, noise)) for t in sched.times(1800.0 * n)]
    ws, cfg = windows(pts), LeakConfig()
    live_cfg = cfg.model_copy(update={"confidence": live_confidence(cfg, n) if new else cfg.confidence})
    live = any(evaluate_memory(ws[:k], "device_memory", live_cfg).suspected for k in range(cfg.min_windows, n + 1))
    return live, evaluate_memory(ws, "device_memory", cfg).suspected


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=200)
    a = p.parse_args(argv)
    for name, period, gc, leak, noise in ROWS:
        for new in (False, True):
            res = [run(s, new, period, gc, leak, noise) for s in range(a.runs)]
            live, end = (sum(x[i] for x in res) / a.runs for i in (0, 1))
            print(f"{name:44s} {'new' if new else 'old'}  live page {live:6.1%}  suspected by the end {end:6.1%}  "
                  f"(N={a.runs})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

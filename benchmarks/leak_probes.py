#!/usr/bin/env python3
"""Leak probes against a garbage collector's sawtooth (issue 21 item 4), fast: only the idle quiesce
probes, at the times soakd's own schedule gives (``soakd.soak.probe_schedule``), through soakd's leak
judgement (``soakd.analysis.leak.evaluate_memory``) after every window of a 12-hour run (24 windows)
and once at the end. "old" is one probe at the middle of every window and every window's judgement at
95%; "new" the defaults (jittered probes, the run-level live confidence). The full path (requests,
windows, the engine) is ``verdict_quality.py``'s gc-* and leak-50 cells; this one runs 200 seeds a row
in minutes. "by w16" is the share paged by window 16 (hour 8: the leak-50 cell's measure).

``--sustained-from`` sets ``analysis.leak.sustained_from`` (where the judged part of the series starts,
a third by default): lower pages a leak sooner and a long warm-up more often (the warm-up rows).

    python benchmarks/leak_probes.py --runs 200
    python benchmarks/leak_probes.py --runs 200 --sustained-from 0.1667 --new-only
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
ROWS = (  # name, GC period range (min), GC MiB, leak MiB/h, probe noise MiB, warm-up (MiB, hours)
    ("GC sawtooth 25-35 min, no leak", (25, 35), 300, 0.0, 10, (0, 1)),
    ("GC sawtooth 28.5-29.9 min, no leak", (28.5, 29.9), 300, 0.0, 10, (0, 1)),
    ("50 MB/h under a GC sawtooth 25-35 min", (25, 35), 300, 50e6 / MIB, 10, (0, 1)),
    ("50 MB/h under a GC sawtooth 28.5-29.9 min", (28.5, 29.9), 300, 50e6 / MIB, 10, (0, 1)),
    ("flat memory, 50 MiB probe noise", (30, 30), 0, 0.0, 50, (0, 1)),
    ("50 MB/h, 50 MiB probe noise", (30, 30), 0, 50e6 / MIB, 50, (0, 1)),
    ("warm-up +600 MiB over 1.5 h, then flat", (30, 30), 0, 0.0, 50, (600, 1.5)),
    ("warm-up +1 GiB over 3 h, then flat", (30, 30), 0, 0.0, 50, (1024, 3.0)),
)


def windows(pts: list[tuple[float, float]]) -> list[WindowSummary]:
    return [WindowSummary.load({
        "window": i, "start_unix": T0 + 1800 * i, "duration_seconds": 1800.0,
        "device": {"memory_used_bytes": {"min": 60 * GIB}, "memory_total_bytes": 80 * GIB},
        "quiesce": {"t_unix": T0 + t, "window": i, "drained": True, "memory_used_bytes": 40 * GIB + v * MIB},
    }) for i, (t, v) in enumerate(pts)]  # fmt: skip


def run(seed: int, new: bool, period: tuple[float, float], gc: float, leak: float, noise: float,
        warmup: tuple[float, float] = (0, 1), n: int = 24, cfg: LeakConfig | None = None) -> tuple[int | None, bool]:
    """(the first window after which a leak was suspected: the page, suspected by the last judgement)."""
    r = random.Random(seed * 7 + 1)
    p, phase = r.uniform(*period) * 60.0, r.random()
    q = QuiesceConfig()
    sched = ProbeSchedule.seeded(0.0, 1800.0, q.jitter if new else 0.0, seed,
                                 duration=min(q.drain_timeout, 450.0) + q.settle if new else 0.0)
    pts = [(t, gc * ((t / p + phase) % 1.0) + leak * t / 3600.0 + warmup[0] * min(1.0, t / 3600.0 / warmup[1])
            + r.gauss(0.0, noise)) for t in sched.times(1800.0 * n)]  # fmt: skip
    ws, cfg = windows(pts), cfg or LeakConfig()
    live_cfg = cfg.model_copy(update={"confidence": live_confidence(cfg, n) if new else cfg.confidence})
    page = next((k - 1 for k in range(cfg.min_windows, n + 1)
                 if evaluate_memory(ws[:k], "device_memory", live_cfg, live=new).suspected), None)
    return page, evaluate_memory(ws, "device_memory", cfg).suspected


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--sustained-from", type=float, default=None, help="analysis.leak.sustained_from (default 1/3)")
    p.add_argument("--new-only", action="store_true", help="the defaults only, not the old schedule")
    a = p.parse_args(argv)
    cfg = LeakConfig() if a.sustained_from is None else LeakConfig(sustained_from=a.sustained_from)
    for name, period, gc, leak, noise, warmup in ROWS:
        for new in (True,) if a.new_only else (False, True):
            res = [run(s, new, period, gc, leak, noise, warmup, cfg=cfg) for s in range(a.runs)]
            live = sum(x[0] is not None for x in res) / a.runs
            by16 = sum(x[0] is not None and x[0] <= 16 for x in res) / a.runs
            end = sum(x[1] for x in res) / a.runs
            print(f"{name:44s} {'new' if new else 'old'}  live page {live:6.1%}  by w16 {by16:6.1%}  "
                  f"suspected by the end {end:6.1%}  (N={a.runs})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

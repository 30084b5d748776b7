#!/usr/bin/env python3
"""Compare quality: how often ``soakd compare`` calls a healthy B worse than a healthy A, and how
often it misses a step in B.

Each pair is two whole simulated soaks from ``verdict_quality.py``'s generator (by default 24
windows of 30 minutes, 3,000 requests per window, on simulated time): request records through
soakd's real window set (``soakd.soak.windows.WindowSet``) into window summaries, the summaries of
A and B through ``soakd.report.compare.compare_windows`` (what ``soakd compare`` runs on two
reports' windows) with the default configuration. A and B are separate runs (different seeds, no
shared load): B is *worse* when the comparison's ``worse`` list is not empty (``soakd compare``
exits 1).

Cells: for each noise model (iid lognormal; AR(1) load +-10% with a 1-minute memory; AR(1) load
+-5% with a 10-minute memory), a calm B (false "worse" rate) and a B whose latency steps +10% at
window 12, half-way (detection rate; the step runs reuse the calm B's seed, so the two differ only
by the step). Plus a +4% step, below the 5% threshold, whose "worse" share should stay small.

Usage::

    python benchmarks/compare_quality.py                  # 100 pairs per cell (tens of minutes on 2 cores)
    python benchmarks/compare_quality.py --pairs 20
    python benchmarks/compare_quality.py --cells calm-iid,step-10-iid --pairs 50 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from verdict_quality import Cell, _byte_times, _record, arrivals  # noqa: E402

from soakd.core.records import Outcome  # noqa: E402
from soakd.core.summary import WindowSummary  # noqa: E402
from soakd.core.timeline import ManualClock, Timeline  # noqa: E402
from soakd.report.compare import compare_windows  # noqa: E402
from soakd.soak.windows import WindowSet  # noqa: E402

IID = Cell("iid", "iid lognormal sigma 0.5", "")
AR = Cell("ar-10-1min", "AR(1) load +-10%, memory 1 minute", "", noise="ar", ar_sd=0.10, ar_memory=60,
          ar_unit="seconds")
AR_SLOW = Cell("ar-5-10min", "AR(1) load +-5%, memory 10 minutes", "", noise="ar", ar_sd=0.05, ar_memory=600,
               ar_unit="seconds")


@dataclass(frozen=True)
class CompareCell:
    name: str
    what: str
    noise: Cell  # A's simulation, and B's before the step
    step: float = 0.0  # B's latency step at ``step_at`` (0: a calm B)
    step_at: int = 12
    expect: str = "pass"  # pass: B never worse | worse: B worse
    limit: float = 0.0  # the target share (upper bound for pass cells, lower bound for worse cells)
    target: str = ""

    def b_cell(self) -> Cell:
        return replace(self.noise, step_at=self.step_at, step=self.step) if self.step else self.noise


CELLS: tuple[CompareCell, ...] = (
    CompareCell("calm-iid", "calm A vs calm B, iid", IID, limit=0.02, target="false worse <= 2%"),
    CompareCell("step-10-iid", "calm A vs B +10% from window 12, iid", IID, step=0.10, expect="worse", limit=0.90,
                target="worse >= 90%"),
    CompareCell("calm-ar", "calm A vs calm B, AR +-10%/1 min", AR, limit=0.02, target="false worse <= 2%"),
    CompareCell("step-10-ar", "calm A vs B +10% from window 12, AR +-10%/1 min", AR, step=0.10, expect="worse",
                limit=0.90, target="worse >= 90%"),
    CompareCell("calm-ar-slow", "calm A vs calm B, AR +-5%/10 min", AR_SLOW, limit=0.05, target="false worse <= 5%"),
    CompareCell("step-10-ar-slow", "calm A vs B +10% from window 12, AR +-5%/10 min", AR_SLOW, step=0.10,
                expect="worse", limit=0.0, target="(no target)"),
    CompareCell("step-4-iid", "calm A vs B +4% from window 12 (below the 5% threshold), iid", IID, step=0.04,
                limit=1.0, target="(no target: worse share)"),
)


def run_windows(cell: Cell, seed: int) -> list[WindowSummary]:
    """The closed window summaries of one simulated soak (the last revision of each window, as the
    store keeps it): ``verdict_quality``'s arrivals, soakd's window set, no analysis."""
    rng = random.Random(seed)
    clock = ManualClock(0.0)
    tl = Timeline(0.0, 0.0, cell.window_s, cell.windows * cell.window_s)
    windows = WindowSet(tl, confidence=0.95, patience=min(cell.window_s, 120.0), clock=clock)
    out: dict[int, WindowSummary] = {}

    def close(now: float, final: bool = False) -> None:
        for w in windows.close_due(now, final=final):
            out[w.window] = w

    next_beat = 1.0
    next_tick = 1.0
    for item in arrivals(cell, rng):
        t, e2e, ttft = item[:3]
        while next_beat <= t:  # soakd's heartbeat: an idle loop, never impaired
            windows.add_lag(next_beat, 0.001, 0.01)
            next_beat += 5.0
        clock.now = t
        if t >= next_tick:
            close(t)
            next_tick = math.floor(t) + 1.0
        rec = _record(t, _byte_times(cell, t, e2e, ttft), tl.window_at(t))
        windows.started(rec)
        rec.outcome = Outcome.OK
        windows.finished(rec)
    close(tl.end + cell.window_s, final=True)
    return [out[k] for k in sorted(out)]


def _summary(doc: dict[str, Any]) -> dict[str, Any]:
    return {"worse": doc["worse"], "run_worse": [x["metric"] for x in doc["worse"] if x["level"] == "run"],
            "segment_worse": [x["metric"] for x in doc["worse"] if x["level"] == "segment"],
            "first_windows": [x["first_window"] for x in doc["worse"] if x["level"] == "segment"],
            "not_compared": [m["metric"] for m in doc["metrics"] if not m["compared"]]}


def pair(cell: CompareCell, i: int, seed0: int = 1) -> dict[str, Any]:
    """Pair ``i`` of a cell: A from seed ``seed0 + 2i``, B from ``seed0 + 2i + 1``, compared."""
    return pairs_of([cell], i, seed0)[cell.name]


def pairs_of(cells: list[CompareCell], i: int, seed0: int = 1) -> dict[str, dict[str, Any]]:
    """Pair ``i`` of each of ``cells`` (one noise model): A simulated once, each distinct B once."""
    assert len({c.noise for c in cells}) == 1
    a = run_windows(cells[0].noise, seed0 + 2 * i)
    bs: dict[Cell, list[WindowSummary]] = {}
    out = {}
    for cell in cells:
        bc = cell.b_cell()
        if bc not in bs:
            bs[bc] = run_windows(bc, seed0 + 2 * i + 1)
        out[cell.name] = _summary(compare_windows(a, bs[bc], a_id=f"a{i}", b_id=f"b{i}"))
    return out


def _job(args: tuple[tuple[str, ...], int, int]) -> dict[str, dict[str, Any]]:
    names, i, seed0 = args
    return pairs_of([c for c in CELLS if c.name in names], i, seed0)


def row(cell: CompareCell, results: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(results)
    worse = sum(bool(r["worse"]) for r in results) / n
    ok = worse <= cell.limit if cell.expect == "pass" else worse >= cell.limit
    metrics: dict[str, int] = {}
    for r in results:
        for x in r["worse"]:
            key = f"{x['metric']} ({x['level']})"
            metrics[key] = metrics.get(key, 0) + 1
    firsts = sorted(k for r in results for k in r["first_windows"])
    return {"cell": cell.name, "what": cell.what, "target": cell.target, "pairs": n, "worse": worse, "ok": ok,
            "run_level": sum(bool(r["run_worse"]) for r in results) / n,
            "segment_level": sum(bool(r["segment_worse"]) for r in results) / n,
            "metrics": metrics, "segment_first_window_median": firsts[len(firsts) // 2] if firsts else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=100, help="pairs of runs per cell (default 100)")
    p.add_argument("--cells", help="comma list of cell names (default: all)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", type=Path, help="write the rows here (after every cell)")
    a = p.parse_args(argv)
    cells = [c for c in CELLS if not a.cells or c.name in a.cells.split(",")]
    t0 = time.monotonic()
    rows = []
    pool = ProcessPoolExecutor(a.workers) if a.workers > 1 else None
    try:
        for noise in dict.fromkeys(c.noise for c in cells):  # one noise model at a time: A and B shared
            group = [c for c in cells if c.noise == noise]
            jobs = [(tuple(c.name for c in group), i, a.seed) for i in range(a.pairs)]
            done = list(pool.map(_job, jobs)) if pool is not None else [_job(j) for j in jobs]
            for cell in group:
                r = row(cell, [d[cell.name] for d in done])
                rows.append(r)
                if a.json:
                    a.json.write_text(json.dumps({"pairs": a.pairs, "rows": rows}, indent=2))
                what = "false worse" if not cell.step else "worse"
                found = ", ".join(f"{k} {v}" for k, v in sorted(r["metrics"].items())) or "-"
                first = (f", segments from window {r['segment_first_window_median']} (median)"
                         if r["segment_first_window_median"] is not None else "")
                print(f"{'PASS' if r['ok'] else 'MISS'}  {cell.name:<16} {what} {r['worse']:6.1%}  (run level "
                      f"{r['run_level']:6.1%}, segment level {r['segment_level']:6.1%}{first}; {found})  "
                      f"target: {cell.target}", flush=True)
    finally:
        if pool is not None:
            pool.shutdown()
    print(f"({a.pairs} pairs per cell, {time.monotonic() - t0:.0f} s)")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

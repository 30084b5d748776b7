"""soakd's own bookkeeping per request, without the network: the recorder, the window set and the heartbeat's
settle of a request (histograms, sketches, sub-windows, the freeze detector's buckets) on synthetic records.

    python benchmarks/bookkeeping.py [--tokens 16] [--per-beat 46] [--repeats 5]

Prints microseconds per request (the minimum of the repeats: the machine's noise only ever adds) and the cost
of the loop that drives it with the bookkeeping left out. Figures are for comparing trees in one sitting, run
one after the other (the machine's speed drifts): ``--per-beat``: requests that end between two heartbeats (46 at 4,600 req/s
and the 10 ms heartbeat). Compare two trees with ``PYTHONPATH=<other tree> python benchmarks/bookkeeping.py``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from soakd.core.records import RequestRecord
from soakd.core.timeline import ManualClock, Timeline
from soakd.metrics import SoakMetrics
from soakd.soak.recorder import Recorder
from soakd.soak.windows import WindowSet

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps and the birds sing"


def records(n: int, tokens: int, seed: int = 1) -> list[RequestRecord]:
    rng = random.Random(seed)
    out = []
    t_ns = 1_000_000_000
    for _ in range(n):
        r = RequestRecord("short_chat")
        r.window = 0
        r.t_start_ns, r.t_headers_ns = t_ns, t_ns + 1000
        r.token_times_ns = [t_ns + 5_000_000 + k * rng.randint(900_000, 1_100_000) for k in range(tokens)]
        r.t_end_ns = r.token_times_ns[-1] + 1000
        r.prompt_tokens, r.completion_tokens, r.usage_from_server = 128, tokens, True
        r.text = TEXT
        out.append(r)
    return out


def run(recs: list[RequestRecord], per_beat: int, bookkeeping: bool = True) -> float:
    """Microseconds per request: each sent 15 ms before the clock's now, so that it ends after the last beat and
    waits for the next one, as in a run."""
    clock = ManualClock(0.0)
    ws = WindowSet(Timeline(0.0, 0.0, 1000.0, 2000.0), clock=clock)
    rec_ = Recorder(SoakMetrics(("short_chat",)), ws, clock)
    ws.add_lag(0.001, 0.0, 0.0)
    started, finished, beat = (rec_.started, rec_.finished, ws.add_lag) if bookkeeping else (_nop, _nop, _nop2)
    now = 1.0
    t0 = time.perf_counter()
    for i, r in enumerate(recs):
        clock.now = now - 0.015
        started(r)
        finished(r)
        if i % per_beat == per_beat - 1:
            now += 0.01
            beat(now, 0.0, 0.0)
    beat(now + 1.0, 0.0, 0.0)
    return (time.perf_counter() - t0) / len(recs) * 1e6


def _nop(_r: RequestRecord) -> None:
    return None


def _nop2(_t: float, _lag: float, _cpu: float) -> None:
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--per-beat", type=int, default=46)
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    best = base = float("inf")
    for _ in range(a.repeats):
        best = min(best, run(records(a.requests, a.tokens), a.per_beat))
        base = min(base, run(records(a.requests, a.tokens), a.per_beat, bookkeeping=False))
    print(f"{a.tokens}-token requests, {a.per_beat} a heartbeat: {best:.1f} us a request of bookkeeping "
          f"(the driving loop alone: {base:.2f} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""soakd's own garbage collector: how long one full collection stalls the event loop, with the startup heap
tracked (as before) and frozen during the load (``soakd.soak.selfwatch.frozen_startup_heap``).

The process imports what ``soakd run`` imports, then holds a load-like live heap (``--records`` request
records of 128 tokens each, what a busy run holds in flight and in its batches) and times ``gc.collect()`` (every
generation: what a full collection costs the loop) ``--repeat`` times each way, in the same process. A
stall of the loop is added to the latency of every request in flight (and beyond
``analysis.client.request_max_lag`` it impairs them). Ratios, not seconds, are what carries to another
machine.

    python benchmarks/own_gc.py [--records 2000] [--repeat 15]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=2000, help="request records held live (default 2,000)")
    p.add_argument("--repeat", type=int, default=15)
    a = p.parse_args(argv)
    import soakd.cli  # noqa: F401,PLC0415  (what `soakd run` imports)
    import soakd.runtime  # noqa: F401,PLC0415
    from soakd.core.records import RequestRecord  # noqa: PLC0415
    from soakd.soak.selfwatch import frozen_startup_heap  # noqa: PLC0415

    def timed() -> float:
        t = time.perf_counter()
        gc.collect()
        return 1000 * (time.perf_counter() - t)

    gc.collect()
    startup = len(gc.get_objects())
    live = []  # allocated during the load: walked either way
    with frozen_startup_heap():
        for i in range(a.records):
            r = RequestRecord("short_chat")
            r.token_times_ns = list(range(i, i + 128))
            live.append(r)
        frozen = [timed() for _ in range(a.repeat)]
        held = len(gc.get_objects())
    tracked = [timed() for _ in range(a.repeat)]
    f, t = statistics.median(frozen), statistics.median(tracked)
    print(f"objects tracked: {startup:,} at startup, {held:,} allocated during the load (and still live)")
    print(f"one full collection, median of {a.repeat}: startup heap tracked {t:.1f} ms, frozen {f:.1f} ms "
          f"(frozen / tracked = {f / t:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A timeout that counts only the time soakd's own event loop was on time (``within``).

``asyncio.wait_for(aw, t)`` counts wall time. When soakd itself is starved of CPU (a busy node, a
CPU limit that throttles it), its loop wakes late: the timeout's callback runs in the same iteration
as the answer that arrived while the loop slept, before the coroutines that would read it, and the
server is charged with soakd's stall. Seen: beside two CPU-bound processes and vLLM's own threads
soakd got 3% of a core, stalled 14 s of each 20-s window, and no 1-s scrape of vLLM's /metrics
completed for over 10 s after vLLM was back (``soakd_sampler_up`` 0); a 5-s ``GET /models`` probe
that soakd's stall outlasts would be a 'target hung' page (``soak/wedge.py``).

``within`` waits in slices and charges each slice at most its own length: a wake-up later than it
asked for is soakd's lag, the same lag the heartbeat records, and is not the server's time. A
server that does not answer while soakd is punctual still times out after ``timeout``; a starved
soakd waits longer, up to ``max_wall`` of wall time (by default 4x the timeout, and at least 10 s
more than it), whatever its loop does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

__all__ = ["within"]

T = TypeVar("T")


def _slice(timeout: float) -> float:
    return max(0.05, min(0.25, timeout / 8))


async def within(aw: Awaitable[T], timeout: float, *, max_wall: float | None = None) -> T:
    """``aw``'s result, or ``TimeoutError`` once ``timeout`` seconds of punctual loop time (or
    ``max_wall`` seconds of wall time) have passed without it; ``aw`` is cancelled then."""
    task = asyncio.ensure_future(aw)
    left = timeout
    step = _slice(timeout)
    give_up = time.perf_counter() + (max_wall if max_wall is not None else max(4 * timeout, timeout + 10))
    try:
        while True:
            ask = min(step, left)  # left > 0: checked below before each new slice
            t0 = time.perf_counter()
            done, _ = await asyncio.wait({task}, timeout=ask)
            if done:
                return task.result()
            now = time.perf_counter()
            left -= min(now - t0, ask)  # a late wake-up is soakd's own lag, not the server's time
            if left <= 1e-6 or now >= give_up:
                raise TimeoutError
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # its end (a cancellation of this wait itself still propagates)
        if not task.cancelled():  # done by now: returned, timed out or cancelled above
            task.exception()  # retrieved: raised above, or dropped with the timeout

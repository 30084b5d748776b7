"""Open-loop arrival processes: pure, seeded generators of absolute send times.

They never sleep; the driver does. That makes them testable without a clock, and a send that
leaves late (the cap on requests in flight was reached, or the process fell behind) is visible
as the difference between the scheduled time and the actual one.
"""

from __future__ import annotations

import random
from collections.abc import Iterator


def constant(rate: float, start: float) -> Iterator[float]:
    """Evenly spaced sends: start, start + 1/rate, ... (no drift: computed, not accumulated)."""
    gap = 1.0 / rate
    i = 0
    while True:
        yield start + i * gap
        i += 1


def poisson(rate: float, start: float, seed: int = 0) -> Iterator[float]:
    """Exponential gaps with mean 1/rate from a seeded generator."""
    rng = random.Random(f"arrivals-{seed}")
    t = start
    while True:
        t += rng.expovariate(rate)
        yield t


def arrivals(kind: str, rate: float, start: float, seed: int = 0) -> Iterator[float]:
    if kind == "constant":
        return constant(rate, start)
    if kind == "poisson":
        return poisson(rate, start, seed)
    raise ValueError(f"unknown arrival process {kind!r}; expected poisson or constant")

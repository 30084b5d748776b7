"""When the quiesce probes run: one per interval (a window by default), at a seeded random time
inside it, so that the probes cannot alias a cycle of the server's own memory (a garbage
collector's sawtooth with a period near the window length sampled at one fixed phase reads as a
slow trend). Pure: the times come from an injected RNG, on the timeline's monotonic clock; the
runtime's tick asks ``due`` (``soakd.soak.quiesce.QuiesceProber.maybe_probe``) and the verdict
benchmark takes its probe times from here too.

(derivation: docs/analysis.md#quiesce-probe-times)
"""

from __future__ import annotations

import random

__all__ = ["ProbeSchedule"]


class ProbeSchedule:
    """Probe ``k`` falls in the slot ``[first + k * interval, first + (k + 1) * interval)`` (``first``:
    the warm-up's end; with the default interval the slots are the windows), at
    ``slot start + span * (0.5 + jitter * (u_k - 0.5))``, ``u_k`` uniform from ``rng`` and ``span`` the
    interval less ``duration`` (the longest a probe takes: drain timeout and settle), so that a probe
    ends inside its slot: ``jitter`` 0 is the middle of the span (the fixed phase of earlier releases,
    with no duration), 1 anywhere in it. The draws are made in slot order and kept, so the times do not
    depend on when they are asked for."""

    def __init__(self, first_slot_start: float, interval: float, jitter: float, rng: random.Random,
                 end: float | None = None, min_remaining: float = 0.0, duration: float = 0.0) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be positive, got {interval}")
        if not 0.0 <= jitter <= 1.0:
            raise ValueError(f"jitter must be in [0, 1], got {jitter}")
        self.first = first_slot_start
        self.interval = interval
        self.jitter = jitter
        self.rng = rng
        self.end = end
        self.min_remaining = min_remaining
        self.span = max(interval - max(duration, 0.0), interval / 2)  # a probe longer than half a slot: the first half
        self._times: list[float] = []
        self._next = 0  # the first slot whose probe has not been taken (``due``)

    @classmethod
    def seeded(cls, first_slot_start: float, interval: float, jitter: float, seed: int, end: float | None = None,
               min_remaining: float = 0.0, duration: float = 0.0) -> ProbeSchedule:
        """The run's schedule: its own RNG from the run's seed (the traffic's stream is not touched)."""
        return cls(first_slot_start, interval, jitter, random.Random(f"quiesce:{seed}"), end, min_remaining, duration)

    def time(self, k: int) -> float:
        """Probe ``k``'s time."""
        while len(self._times) <= k:
            i = len(self._times)
            u = self.rng.random()
            self._times.append(self.first + i * self.interval + self.span * (0.5 + self.jitter * (u - 0.5)))
        return self._times[k]

    def slot(self, t: float) -> int:
        """The slot ``t`` falls in (-1 before the first)."""
        return -1 if t < self.first else int((t - self.first) // self.interval)

    def allowed(self, t: float) -> bool:
        """Not in the last ``min_remaining`` of the run (nothing would follow to compare)."""
        return self.end is None or self.end - t >= self.min_remaining

    def due(self, now: float) -> bool:
        """Whether a probe is due at ``now``: its slot's time has come and it was not taken; taking it
        (a True answer) moves on to the next slot. A slot whose time passed unnoticed (the loop was
        busy, a resumed run) is taken late within its slot, else skipped."""
        k = self.slot(now)
        if k < 0 or (self.end is not None and now >= self.end):
            return False
        self._next = max(self._next, k)  # slots gone by without their probe: skipped
        if self._next > k or now < self.time(k):
            return False
        self._next = k + 1
        return self.allowed(now)

    def times(self, until: float) -> list[float]:
        """Every probe time before ``until`` (what a simulation feeds its windows), in order."""
        out, k = [], 0
        while True:
            t = self.time(k)
            if t >= until:
                return out
            if self.allowed(t):
                out.append(t)
            k += 1

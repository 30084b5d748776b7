"""The stratified mix: every window carries the configured proportions exactly.

Smooth weighted round-robin (the nginx algorithm): after any number n of picks, scenario i has
been picked floor or ceil of n * w_i / W times — never more than one away from its exact share.
The sequence restarts at every window boundary, so each window, whatever its length, carries the
configured proportions to within one pick per scenario. A pick is one request, except for
batch_burst, where it is one burst of ``burst_size`` requests (a burst is never split across
windows), so the workload gives it the weight share / burst_size in picks. The seed rotates the starting
point so that two seeds do not send the same order.
"""

from __future__ import annotations

import random


class StratifiedMix:
    def __init__(self, weights: dict[str, float], seed: int | str = 0) -> None:
        items = [(name, float(w)) for name, w in weights.items() if w > 0]
        if not items:
            raise ValueError("the mix has no scenario with a positive weight")
        rng = random.Random(f"mix-{seed}")
        rng.shuffle(items)
        self.names = [n for n, _ in items]
        self.weights = [w for _, w in items]
        self.total = sum(self.weights)
        self._current = [0.0] * len(items)
        self._window: int | None = None
        self.counts: dict[str, int] = dict.fromkeys(self.names, 0)

    def reset(self) -> None:
        self._current = [0.0] * len(self.names)
        self.counts = dict.fromkeys(self.names, 0)

    def next(self, window: int = 0) -> str:
        if window != self._window:
            self._window = window
            self.reset()
        cur, weights = self._current, self.weights
        best = 0
        for i in range(len(cur)):
            cur[i] += weights[i]
            if cur[i] > cur[best]:
                best = i
        cur[best] -= self.total
        name = self.names[best]
        self.counts[name] += 1
        return name

    def share(self, name: str) -> float:
        return dict(zip(self.names, self.weights)).get(name, 0.0) / self.total

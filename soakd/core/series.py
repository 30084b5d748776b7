"""One sampled value of a catalogue metric: what every sampler returns and what the window
telemetry, the store and the snapshot collector read."""

from __future__ import annotations

from dataclasses import dataclass

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Series:
    """``name`` is the exposition name (counters keep their ``_total``); ``labels`` is a tuple of
    (name, value) pairs in catalogue label order."""

    name: str
    value: float
    labels: Labels = ()

    def label(self, key: str) -> str | None:
        for k, v in self.labels:
            if k == key:
                return v
        return None


def series(name: str, value: float, **labels: str) -> Series:
    return Series(name, float(value), tuple((k, str(v)) for k, v in labels.items()))

"""Sampler snapshots into their windows, and into the store's queue of samples.

Every successful sampler run calls ``TelemetryRouter.on_sample``. The snapshot goes to the
window it was taken in — not while a quiesce probe holds the load: idle samples would bias the
window's means — and the energy counter of one source (NVML when up, else dcgm-exporter) is
differenced into the window's energy. All snapshots (idle ones too) queue for the store's
per-minute samples (bounded: 10,000 snapshots between two checkpoints).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from soakd.core.series import Series
from soakd.samplers.base import SamplerRunner, Snapshot
from soakd.soak.windows import WindowSet

MAX_PENDING = 10_000
ENERGY_SERIES = "soakd_gpu_energy_joules_total"


class TelemetryRouter:
    def __init__(self, runners: Sequence[SamplerRunner], max_pending: int = MAX_PENDING) -> None:
        self.runners = runners
        self.max_pending = max_pending
        self.windows: WindowSet | None = None
        self._paused: Callable[[], bool] = lambda: False
        self._pending: list[tuple[float, list[Series]]] = []
        self._energy_reading: dict[str, tuple[float, float]] = {}
        for runner in runners:
            runner.listeners.append(self.on_sample)

    def attach(self, windows: WindowSet, paused: Callable[[], bool]) -> None:
        """Load has started: route snapshots to ``windows`` except while ``paused()``."""
        self.windows = windows
        self._paused = paused

    def energy_source(self) -> str:
        """One energy counter feeds J/token: NVML's when it is up, else dcgm-exporter's."""
        for name in ("nvml", "dcgm"):
            for r in self.runners:
                if r.name == name and r.up:
                    return name
        return "nvml"

    def on_sample(self, sampler: str, snap: Snapshot) -> None:
        if len(self._pending) < self.max_pending:
            self._pending.append((snap.wall, list(snap.series)))
        energy = [s.value for s in snap.series if s.name == ENERGY_SERIES]
        prev = self._energy_reading.get(sampler)
        if energy:
            self._energy_reading[sampler] = (snap.monotonic, sum(energy))
        windows = self.windows
        if windows is None or self._paused():
            return
        idx = windows.add_samples(list(snap.series), snap.monotonic)
        if idx is None:
            return
        if energy and prev is not None and sampler == self.energy_source():
            delta, dt = sum(energy) - prev[1], snap.monotonic - prev[0]
            if delta >= 0 and dt > 0:
                windows.add_energy(idx, delta, dt)

    def take_pending(self) -> list[tuple[float, list[Any]]]:
        pending, self._pending = self._pending, []
        return pending

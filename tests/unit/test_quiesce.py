"""The quiesce probe's idle KV reading survives a gauge that lags the drain.

vLLM publishes ``vllm:kv_cache_usage_perc`` with its engine steps: right after the last request
drained, its gauge may still count that request's blocks (seen in the vLLM e2e test: 4 of 127
blocks 1.9 s after the drain, 0 in every later probe). The probe reads again while the idle KV
is above 0 and keeps the lowest; a cache that is not released reads the same every time."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from soakd.config import QuiesceConfig
from soakd.core.series import Series
from soakd.samplers.base import Snapshot
from soakd.soak.quiesce import QuiesceProber


class _Runner:
    """A server sampler whose KV gauge reads the given values in turn (the last one repeats)."""

    def __init__(self, kv: list[float], mem: list[float] | None = None, name: str = "server") -> None:
        self.name, self.kv, self.mem, self.reads = name, kv, mem, 0
        self.snapshot: Snapshot | None = None

    async def run_once(self) -> bool:
        i = min(self.reads, len(self.kv) - 1)
        self.reads += 1
        series = [Series("soakd_server_kv_cache_usage_ratio", self.kv[i])]
        if self.mem:
            series.append(Series("soakd_gpu_memory_used_bytes", self.mem[min(i, len(self.mem) - 1)]))
        self.snapshot = Snapshot(series, 0.0, 0.0)
        return True


class _Driver:
    stopping = False

    def pause(self) -> None: ...
    def resume(self) -> None: ...

    async def wait_idle(self, timeout: float) -> bool:
        return True


class _Windows:
    def __init__(self) -> None:
        self.probes: list = []

    def hold(self, idx: int) -> int:
        return idx

    def release(self, held: int) -> None: ...
    def add_interval(self, t0: float, t1: float, key: str) -> None: ...

    def set_probe(self, probe) -> None:
        self.probes.append(probe)


class _Events:
    def __init__(self) -> None:
        self.emitted: list = []

    def emit(self, *args) -> None:
        self.emitted.append(args)

    async def flush(self) -> None: ...


def _prober(runner: _Runner, rereads: int = 3) -> tuple[QuiesceProber, list]:
    added: list = []
    policies = SimpleNamespace(quiesce_min_remaining=0.0, quiesce_drain_timeout=1.0, quiesce_interval=10.0,
                               quiesce_jitter=0.0, seed=1)
    timeline = SimpleNamespace(end=1e9, window_at=lambda t: 0, first_window_start=0.0)
    prober = QuiesceProber(QuiesceConfig(settle=0.0, rereads=rereads), policies, driver=_Driver(),  # type: ignore[arg-type]
                           timeline=timeline, windows=_Windows(), runners=[runner],  # type: ignore[arg-type]
                           analyzer=SimpleNamespace(add_quiesce=added.append), events=_Events(),  # type: ignore[arg-type]
                           canary=None, running=lambda: True)  # fmt: skip
    return prober, added


def test_a_lagging_gauge_reads_zero_once_it_catches_up() -> None:
    runner = _Runner([0.0315, 0.0315, 0.0])
    prober, added = _prober(runner)
    probe = asyncio.run(prober.probe())
    assert probe is not None and probe.kv_cache_usage_ratio == 0.0 and probe.drained
    assert runner.reads == 3 and added == [probe]


def test_a_residue_that_stays_is_kept_and_the_rereads_are_bounded() -> None:
    runner = _Runner([0.05, 0.04], mem=[9e9, 8e9])
    probe = asyncio.run(_prober(runner, rereads=2)[0].probe())
    assert probe is not None and probe.kv_cache_usage_ratio == 0.04 and probe.memory_used_bytes is None
    assert runner.reads == 3  # the first reading and two more


def test_an_idle_zero_is_read_once() -> None:
    runner = _Runner([0.0])
    probe = asyncio.run(_prober(runner)[0].probe())
    assert probe is not None and probe.kv_cache_usage_ratio == 0.0 and runner.reads == 1


def test_rereads_zero_keeps_the_first_reading() -> None:
    runner = _Runner([0.03, 0.0])
    probe = asyncio.run(_prober(runner, rereads=0)[0].probe())
    assert probe is not None and probe.kv_cache_usage_ratio == 0.03 and runner.reads == 1

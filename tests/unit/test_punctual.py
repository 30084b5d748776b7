"""A timeout that counts only the time soakd's loop was on time (soakd.core.punctual): a server that
answers while soakd itself is starved of CPU is not timed out (a sampler stays up, a GET /models probe is
no 'target hung'); a server that does not answer still is, after the timeout while soakd is punctual and
after ``max_wall`` however starved it is; errors and cancellation pass through as with wait_for.

soakd's starvation is a task that blocks the loop 0.3 s at a time (``time.sleep``: a stall whatever else
the machine runs; more load only makes the stalls longer, which are not charged either)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from soakd.analysis.engine import Analyzer
from soakd.config import AnalysisConfig
from soakd.core.punctual import within
from soakd.metrics import BY_NAME, Gauge
from soakd.samplers.base import SamplerRunner
from soakd.soak.wedge import WedgeWatch


class Hog:
    """soakd starved: the loop blocked 0.3 s in each of its iterations, ``blocks`` of them at most."""

    def __init__(self, blocks: int = 12) -> None:
        self.blocks = blocks
        self.done = 0
        self.task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        for _ in range(self.blocks):
            time.sleep(0.3)
            self.done += 1
            await asyncio.sleep(0)

    async def __aenter__(self) -> Hog:
        self.task = asyncio.create_task(self._run())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self.task is not None
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def answer(steps: int = 4) -> str:
    """A server's answer that takes a few loop iterations to read (connect, headers, body): 80 ms of them."""
    for _ in range(steps):
        await asyncio.sleep(0.02)
    return "answer"


async def test_an_answer_soakds_own_stalls_delay_is_not_timed_out() -> None:
    async with Hog():  # the control: wall time charges soakd's stalls to the server
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(answer(), 0.5)
    async with Hog():
        assert await within(answer(), 0.5, max_wall=30) == "answer"


async def test_a_server_that_does_not_answer_times_out_punctual_or_starved() -> None:
    ended: list[str] = []

    async def silent() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            ended.append("cancelled")

    t0 = time.perf_counter()
    with pytest.raises(TimeoutError):
        await within(silent(), 0.3)
    assert time.perf_counter() - t0 >= 0.3 and ended == ["cancelled"]  # never early; the request is cancelled
    # starved: the charged time grows by at most one 250-ms slice per 0.3-s stall, so 30 s would take over
    # 120 stalls; max_wall gives up after 1 s of wall time (and a few stalls to cancel the request)
    async with Hog(blocks=40) as hog:
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError):
            await within(silent(), 30.0, max_wall=1.0)
        assert time.perf_counter() - t0 >= 1.0 and hog.done < 20, hog.done
    assert ended == ["cancelled", "cancelled"]


async def test_errors_and_cancellation_pass_through() -> None:
    async def broken() -> None:
        await asyncio.sleep(0.01)
        raise ValueError("garbage from the server")

    with pytest.raises(ValueError, match="garbage"):
        await within(broken(), 1.0)
    ended = asyncio.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            ended.set()

    outer = asyncio.create_task(within(slow(), 30.0))
    await asyncio.sleep(0.05)
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert ended.is_set()  # the request was cancelled with its caller


class Answering:
    name = "server"

    async def sample(self) -> list[Any]:
        await answer()
        return []


async def test_a_sampler_stays_up_and_a_probe_answers_while_soakd_is_starved() -> None:
    runner = SamplerRunner(Answering(), interval=1.0, timeout=0.5)
    async with Hog():
        assert await runner.run_once() and runner.up and runner.errors == 0
    watch = WedgeWatch(SimpleRecorder(), answer, Analyzer(AnalysisConfig()), Gauge(BY_NAME["soakd_engine_wedged"]),
                       probe_interval=0.5)  # fmt: skip
    async with Hog():
        assert await watch._probe() is True  # answered: no 'target hung'


class SimpleRecorder:
    in_flight = 1

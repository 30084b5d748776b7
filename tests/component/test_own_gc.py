"""soakd's own garbage collector during a real run: the startup heap is out of the collector's reach while the
load runs, and given back when the run is over (soakd.soak.selfwatch.frozen_startup_heap)."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import pytest

from soakd.config import load_config
from soakd.runtime import Runtime
from helpers import QUICK_SIM, sim_server

pytestmark = pytest.mark.timeout(60)


async def test_the_startup_heap_is_frozen_while_the_load_runs(tmp_path: Path) -> None:
    async with sim_server(**QUICK_SIM) as sim:
        cfg = load_config(None, {
            "target": {"url": sim.base_url},
            "run": {"duration": 3.0, "window": 1.5, "warmup": 0, "state_dir": str(tmp_path)},
            "load": {"concurrency": 2, "mix": {"short_chat": 1}},
            "scenarios": {"short_chat": {"max_tokens": 8}},
            "metrics": {"host": "127.0.0.1", "port": 0},
        }, environ={})  # fmt: skip
        runtime = Runtime(cfg, progress=False, new_run=True)
        seen: list[tuple[str, int]] = []

        async def watch() -> None:
            while True:
                seen.append((runtime.status.phase, gc.get_freeze_count()))
                await asyncio.sleep(0.05)

        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait_for(runtime.run(), 30)
        finally:
            watcher.cancel()
    during = [n for phase, n in seen if phase in ("warmup", "running")]
    assert during and min(during) > 1000, seen[:5]  # every sample taken while the load ran
    assert gc.get_freeze_count() == 0  # given back

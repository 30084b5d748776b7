"""``soakd compare`` end to end: three recorded runs written into a real store (synthetic windows
from ``helpers.windows`` through the RunStore API), their JSON reports rendered by ``soakd report``,
and ``soakd compare A B`` run as a subprocess: a run whose latency steps +30% half-way is worse than
a calm one (exit 1, naming the metric and the windows), a second calm run is not (exit 0)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from soakd.config import load_config
from soakd.store import RunStore
from helpers import run_soakd
from helpers.windows import make_window

pytestmark = pytest.mark.timeout(120)

T0 = 1_700_000_000.0
WINDOW = 1800.0


async def record(state: Path, run_id: str, seed: int, *, step_at: int | None = None, step: float = 0.0,
                 n_windows: int = 12) -> None:  # fmt: skip
    cfg = load_config(None, {"target": {"url": "http://vllm:8000/v1", "model": "llama"},
                             "run": {"state_dir": str(state), "window": WINDOW}}, environ={})  # fmt: skip
    rng = random.Random(seed)
    store = await RunStore.open(state)
    try:
        await store.create_run(run_id, cfg.redacted(), target=cfg.target.url, model="llama", created_unix=T0)
        await store.start_segment(run_id, "start", t_unix=T0)
        for i in range(n_windows):
            last = i == n_windows - 1
            w = make_window(i, rng, 500 if last else 1000, duration=WINDOW / 2 if last else WINDOW, partial=last,
                            scale=1.0 + step if step_at is not None and i >= step_at else 1.0, start_unix=T0)
            await store.save_window(run_id, i, 0, w, w.partial)
        await store.finish_run(run_id, "duration", t_unix=T0 + n_windows * WINDOW)
    finally:
        await store.close()


async def test_compare_fails_a_step_and_passes_a_calm_run(tmp_path: Path) -> None:
    state = tmp_path / "state"
    await record(state, "calm-a", 1)
    await record(state, "calm-b", 2)
    await record(state, "step-b", 3, step_at=6, step=0.30)
    reports = {}
    for run_id in ("calm-a", "calm-b", "step-b"):
        reports[run_id] = tmp_path / f"{run_id}.json"
        rc, out, err = await run_soakd("report", "--state-dir", str(state), "--run", run_id, "--format", "json",
                                       "-o", str(reports[run_id]))
        assert rc == 0, out + err

    rc, out, err = await run_soakd("compare", str(reports["calm-a"]), str(reports["step-b"]))
    print("\n" + out)
    assert rc == 1, out + err
    tail = out.strip().splitlines()[-1]
    assert tail.startswith("B is confidently worse on e2e_p50 in windows 6..10 (+"), tail
    assert "window 11: A: partial; B: partial" in out  # the last window of each run, left out
    assert "e2e_p95" in tail and "  windows 6..10" in out
    rc, out, _ = await run_soakd("compare", str(reports["calm-a"]), str(reports["step-b"]), "--json")
    doc = json.loads(out)
    assert rc == 1
    worse = {(x["metric"], x["level"]) for x in doc["worse"]}
    assert ("e2e_p50", "segment") in worse and ("e2e_p95", "segment") in worse, doc["worse"]
    e2e = next(x for x in doc["worse"] if x["metric"] == "e2e_p50")
    assert e2e["windows"] == [6, 7, 8, 9, 10] and e2e["ci"][0] > 0.05
    assert doc["left_out"] == [{"window": 11, "reason": "A: partial; B: partial"}]
    assert [m["metric"] for m in doc["metrics"] if not m["compared"]] == ["energy_per_token"]
    rc, md, _ = await run_soakd("compare", str(reports["calm-a"]), str(reports["step-b"]), "--markdown")
    assert rc == 1 and "|   windows 6..10 |" in md and "**B is confidently worse on e2e_p50 in windows 6..10" in md

    rc, out, err = await run_soakd("compare", str(reports["calm-a"]), str(reports["calm-b"]))
    print(out)
    assert rc == 0, out + err
    assert out.strip().splitlines()[-1].startswith("B is not confidently worse than A on any tracked metric")

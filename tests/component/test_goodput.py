"""Goodput end to end: a soak of the simulator with SLOs, one that every request meets and one
that none can, through the runtime to /metrics, the stored windows and the report."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from soakd.config import load_config
from soakd.runtime import Runtime
from helpers import QUICK_SIM, report_of, sim_server

pytestmark = pytest.mark.timeout(60)


async def test_goodput_per_scenario_window_metrics_and_report(tmp_path: Path) -> None:
    async with sim_server(**QUICK_SIM) as sim:
        cfg = load_config(None, {
            "target": {"url": sim.base_url},
            "run": {"duration": 4.0, "window": 2.0, "warmup": 0, "state_dir": str(tmp_path)},
            "load": {"concurrency": 4, "mix": {"short_chat": 1, "code_completion": 1}},
            "scenarios": {
                "short_chat": {"max_tokens": 16, "slo": {"ttft": "5s", "itl": "1s", "e2e": "30s", "quantile": 0.9}},
                "code_completion": {"max_tokens": 8, "slo": {"e2e": "1ms"}},  # no request can meet it
            },
            "metrics": {"host": "127.0.0.1", "port": 0},
        }, environ={})  # fmt: skip
        runtime = Runtime(cfg, progress=False, new_run=True)
        await asyncio.wait_for(runtime.run(), 30)
        text = generate_latest(runtime.registry).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    good = {s.labels["scenario"]: s.value for s in fams["soakd_goodput_requests"].samples
            if s.name.endswith("_total")}
    total = {sc: sum(s.value for s in fams["soakd_requests"].samples
                     if s.name.endswith("_total") and s.labels["scenario"] == sc) for sc in good}
    assert good["short_chat"] == total["short_chat"] > 0
    assert good["code_completion"] == 0 and total["code_completion"] > 0
    objective = {s.labels["scenario"]: s.value for s in fams["soakd_slo_objective_ratio"].samples}
    assert objective == {"short_chat": 0.9, "code_completion": 0.95}

    report = report_of(tmp_path)
    full = [w for w in report["table"] if not w["partial"]]
    assert full, report["table"]
    for row in full:  # half the mix meets its SLO, half cannot
        assert 0.4 <= row["goodput_ratio"] <= 0.6, row
    assert "goodput_ratio" in report["series"]["windows"]["metrics"]
    md = (tmp_path / report["run"]["id"] / "report.md").read_text()
    assert "| goodput |" in md

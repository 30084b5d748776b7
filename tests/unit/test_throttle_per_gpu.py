"""Throttling on a node of several GPUs, through the analysis and the exporter: the page names the GPU whose clock
fell, never a GPU at its power cap beside it (``soakd_throttle_gpu_detected``, which SoakdGPUThrottling joins on
GPU and reason)."""

from __future__ import annotations

import random
from typing import Any

from helpers.windows import make_window

from soakd.analysis.engine import Analyzer
from soakd.config import AnalysisConfig
from soakd.core.reasons import CLOCKS_EVENT_REASON_NAMES
from soakd.soak.exporter import AnalysisExporter


def node(shares: dict[str, dict[str, float]], clocks: dict[str, float]) -> dict[str, Any]:
    by_gpu = {g: {r: s.get(r, 0.0) for r in CLOCKS_EVENT_REASON_NAMES} for g, s in shares.items()}
    mean = sum(clocks.values()) / len(clocks)
    return {
        "power_watts": {"mean": 1200.0, "max": 1300.0, "min": 1100.0, "stdev": 20.0, "count": 600},
        "temperature_celsius": {"mean": 70.0, "max": 80.0},
        "sm_clock_hertz": {"mean": mean, "min": mean * 0.9, "max": 1.98e9},
        "sm_clock_max_hertz": 1.98e9,
        "sm_clock_by_gpu": clocks,
        "throttle_share_by_gpu": by_gpu,
        "throttle_share": {r: max(s[r] for s in by_gpu.values()) for r in CLOCKS_EVENT_REASON_NAMES},
    }


def samples(an: Analyzer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in AnalysisExporter(an)() for s in fam.samples}


def test_the_gpu_that_throttled_is_paged_and_the_power_capped_one_beside_it_is_not() -> None:
    rng = random.Random(7)
    an = Analyzer(AnalysisConfig())
    capped = node({"0": {}, "1": {"sw_power_cap": 1.0}}, {"0": 1.9e9, "1": 1.75e9})
    hot = node({"0": {"hw_thermal": 0.9}, "1": {"sw_power_cap": 1.0}}, {"0": 1.9e9 * 0.7, "1": 1.75e9})
    findings = []
    for i in range(10):
        throttled = i >= 7
        findings += an.add_window(make_window(i, rng, n=3000, scale=1.3 if throttled else 1.0,
                                              device=hot if throttled else capped))
        got = samples(an)
        gpu0 = got[("soakd_throttle_gpu_detected", (("gpu", "0"), ("reason", "hw_thermal")))]
        gpu1 = got[("soakd_throttle_gpu_detected", (("gpu", "1"), ("reason", "sw_power_cap")))]
        node_detected = got[("soakd_throttle_detected", ())]
        assert gpu1 == 0.0, f"window {i}: the GPU at its power cap, its clock steady, is never charged"
        assert gpu0 == node_detected, f"window {i}: the node's throttling is GPU 0's"
        assert got[("soakd_throttle_gpu_detected", (("gpu", "1"), ("reason", "hw_thermal")))] == 0.0
    assert node_detected == 1.0 and gpu0 == 1.0
    (thr,) = [f for f in findings if f.diagnosis == "throttling"][:1]
    assert thr.severity == "critical" and "hw_thermal active 90% of window" in thr.message
    assert "on GPU 0" in thr.message and "sw_power_cap" not in thr.message and "power/" not in thr.message
    assert [list(t["gpus"]) for t in thr.evidence["throttle"]] == [["0"]]

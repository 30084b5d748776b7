"""Seeded cases of ``benchmarks/compare_quality.py`` that must hold: pairs of whole simulated 12-hour
runs (24 windows of 30 minutes, 3,000 requests each, ``verdict_quality``'s generator through soakd's
window set) compared as ``soakd compare`` compares two reports. A calm B is not worse than a calm A;
a B whose latency steps +10% at window 12 is, in the segment from window 12 on. The benchmark
measures both rates over hundreds of seeds; these pin a few pairs of each, iid and under slowly
varying load."""

from __future__ import annotations

from types import ModuleType

import pytest

from helpers import benchmark

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cq() -> ModuleType:
    return benchmark("compare_quality")


@pytest.mark.parametrize(("calm", "step", "i"), [("calm-iid", "step-10-iid", 0), ("calm-iid", "step-10-iid", 1),
                                                 ("calm-ar", "step-10-ar", 0)])
def test_calm_is_not_worse_and_a_step_is(cq: ModuleType, calm: str, step: str, i: int) -> None:
    cells = [c for c in cq.CELLS if c.name in (calm, step)]
    out = cq.pairs_of(cells, i)
    assert out[calm]["worse"] == [], out[calm]["worse"]
    assert out[calm]["not_compared"] == ["energy_per_token"]  # the simulation has no GPU
    worse = out[step]["worse"]
    e2e = [x for x in worse if x["metric"] == "e2e_p50"]
    assert e2e and e2e[0]["level"] == "segment" and 11 <= e2e[0]["first_window"] <= 13, worse
    assert e2e[0]["last_window"] == 23 and e2e[0]["ci"][0] > 0.05 and e2e[0]["ci"][0] < 0.10 < e2e[0]["ci"][1]
    assert not [x for x in worse if x["level"] == "run"]  # half the run at +10%: the run's mean is diluted

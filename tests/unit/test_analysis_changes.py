"""The run-level drift statistics (``soakd.analysis.levels`` and ``soakd.analysis.changes``) on
synthetic level series: the noise floor's estimate, the live rule's family-wise z and tiers, and the
end-of-run segments, trends and the choice between them."""

from __future__ import annotations

import math
import random

import pytest

from soakd.analysis.changes import _tier, compare_levels, judge_run, live_z
from soakd.analysis.levels import Level, between_variance
from soakd.config.analysis import DriftConfig
from soakd.core.summary import WindowSummary


def series(ys: list[float], var: float = 1e-4) -> list[Level]:
    return [Level(i, y, var, math.exp(y), 3000, 1.7e9 + 1800 * i) for i, y in enumerate(ys)]


def test_the_noise_floor_is_unbiased_and_a_step_does_not_inflate_it() -> None:
    rng = random.Random(1)
    tau, within = 0.03, 1e-4
    est = [between_variance(series([rng.gauss(0, math.sqrt(tau**2 + within)) for _ in range(24)], within))[0]
           for _ in range(2000)]
    assert sum(est) / len(est) == pytest.approx(tau**2, rel=0.08)  # winsorised, and corrected for it
    ys = [rng.gauss(0, 0.01) for _ in range(24)]
    stepped = [y + (0.10 if i >= 12 else 0.0) for i, y in enumerate(ys)]
    assert between_variance(series(stepped))[0] < 0.2 * 0.10**2  # the step's one difference is winsorised away


def test_live_z_is_bonferroni_over_the_run() -> None:
    cfg = DriftConfig()
    assert live_z(cfg, 24) == pytest.approx(3.88, abs=0.01)  # two-sided 0.05 over 10 metrics x 24 windows x 2 refs
    assert live_z(cfg, 48) > live_z(cfg, 24)


def test_tiers() -> None:
    thr = 0.05
    assert _tier("e2e_p50", math.log(1.10), 0.02, thr) == ("confident", 1)
    assert _tier("e2e_p50", math.log(1.06), 0.03, thr) == ("likely", 1)  # beyond 5%, interval reaches inside
    assert _tier("e2e_p50", math.log(1.04), 0.01, thr) == (None, 0)  # significant, but within the threshold
    assert _tier("requests_per_second", math.log(0.85), 0.02, thr) == ("confident", -1)
    r = compare_levels("e2e_p50", series([math.log(1.2)])[0], series([0.0, 0.0, 0.0, 0.0]), 0.0, 3.7, DriftConfig())
    assert r.status == "drift" and r.direction == "degraded" and r.tier == "confident"
    assert r.ratio == pytest.approx(0.2) and r.ratio_ci[0] > 0.05


def _windows(levels: list[float], n: int = 3000) -> list[WindowSummary]:
    """Window summaries whose e2e p50 is exp(level) with a tight interval."""
    out = []
    for i, y in enumerate(levels):
        v = math.exp(y)
        out.append(WindowSummary.load({
            "window": i, "start_unix": 1.7e9 + 1800 * i, "duration_seconds": 1800.0, "requests": n,
            "outcomes": {"ok": n}, "e2e_seconds": {"p50": v, "count": n, "p50_ci": [v * 0.99, v * 1.01]},
        }))  # fmt: skip
    return out


def test_a_step_is_located_and_a_creep_is_a_trend_not_steps() -> None:
    rng = random.Random(2)
    cfg = DriftConfig(metrics=["e2e_p50"])
    step = _windows([rng.gauss(0, 0.005) + (math.log(1.09) if i >= 12 else 0.0) for i in range(24)])
    rd = judge_run(step, [0, 1, 2, 3], cfg)
    (c,) = rd.changes
    assert c.window == 12 and c.tier == "confident" and c.ratio == pytest.approx(0.09, abs=0.01) and not rd.trends
    assert "e2e_p50 stepped +8." in c.message() and "from window 12" in c.message()
    creep = _windows([rng.gauss(0, 0.005) + 0.004 * i for i in range(24)])
    rd = judge_run(creep, [0, 1, 2, 3], cfg)
    (t,) = rd.trends
    assert t.direction == "degraded" and t.total_ratio == pytest.approx(math.expm1(0.004 * 23), abs=0.02)
    assert rd.changes == []  # one explanation: the line
    flat = _windows([rng.gauss(0, 0.005) for _ in range(24)])
    rd = judge_run(flat, [0, 1, 2, 3], cfg)
    assert rd.changes == [] and rd.trends == []

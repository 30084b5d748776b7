"""Theil–Sen with Sen's interval, memory-growth verdicts and the idle KV residue."""

from __future__ import annotations

import math
import random

import pytest
from pydantic import ValidationError
from scipy.stats import theilslopes

from soakd.analysis.leak import (
    evaluate,
    evaluate_memory,
    kv_residue,
    memory_series,
    quiesce_probes,
    theil_sen,
    theil_sen_blocked,
)
from soakd.config.analysis import LeakConfig
from soakd.core.summary import QuiesceProbe, WindowSummary
from soakd.core.units import GIB

MIB = 2**20


def test_theil_sen_exact_on_a_line() -> None:
    xs = [0.5 * i for i in range(12)]
    ys = [3.0 * x - 7.0 for x in xs]
    slope, lo, hi = theil_sen(xs, ys)
    assert slope == pytest.approx(3.0)
    assert lo == pytest.approx(3.0) and hi == pytest.approx(3.0)


def test_theil_sen_robust_to_outliers() -> None:
    rng = random.Random(1)
    xs = list(range(30))
    ys = [2.0 * x + rng.gauss(0, 0.5) for x in xs]
    for i in rng.sample(range(30), 7):  # 23% wild outliers
        ys[i] += rng.choice([-1, 1]) * 500.0
    slope, lo, hi = theil_sen(xs, ys)
    assert slope == pytest.approx(2.0, abs=0.3)
    assert lo < 2.0 < hi
    # least squares would be dragged far away by the same outliers
    mx, my = sum(xs) / 30, sum(ys) / 30
    ols = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    assert abs(ols - 2.0) > abs(slope - 2.0)


def test_theil_sen_interval_covers() -> None:
    rng = random.Random(2)
    trials, covered = 300, 0
    for _ in range(trials):
        xs = [i + rng.uniform(-0.2, 0.2) for i in range(15)]
        ys = [0.7 * x + rng.gauss(0, 1.0) for x in xs]
        _, lo, hi = theil_sen(xs, ys)
        covered += lo <= 0.7 <= hi
    assert covered / trials >= 0.92


def test_theil_sen_ties_few_points_and_subsampling() -> None:
    assert theil_sen([0, 1, 2, 3, 4, 5], [5.0] * 6) == (0.0, 0.0, 0.0)
    assert theil_sen([1.0], [1.0]) is None
    assert theil_sen([1.0, 1.0], [1.0, 2.0]) is None  # no distinct x
    slope, lo, hi = theil_sen([0, 1, 2, 3], [0.0, 1.1, 1.9, 3.2])
    assert lo == -math.inf and hi == math.inf  # 4 points: no finite 95% bounds
    _, lo6, hi6 = theil_sen(range(6), [0.0, 1.1, 1.9, 3.2, 4.1, 4.9])
    assert math.isfinite(lo6) and math.isfinite(hi6)
    n = 2000  # beyond 500 points: evenly subsampled, still exact on a line
    slope, lo, hi = theil_sen(range(n), [0.25 * i + 1 for i in range(n)])
    assert slope == pytest.approx(0.25) and lo == pytest.approx(0.25)


def test_theil_sen_is_scipys_theilslopes() -> None:
    """The plain form is ``scipy.stats.theilslopes`` (slope and interval, ties included); only where
    scipy clips a rank to the end of the slopes is the bound infinite here (below 5 points at 95%)."""
    rng = random.Random(4)
    for trial in range(200):
        n = rng.randint(5, 40)
        xs = [i + rng.uniform(-0.3, 0.3) for i in range(n)]
        ys = [0.3 * x + rng.gauss(0, 1.0) for x in xs]
        if trial % 3 == 0:
            ys = [float(round(y)) for y in ys]  # ties in y
        conf = (0.95, 0.9, 0.99)[trial % 3]
        ref = theilslopes(ys, xs, alpha=conf)
        slope, lo, hi = theil_sen(xs, ys, conf)
        if conf == 0.99 and n < 7 and (math.isinf(lo) or math.isinf(hi)):
            continue  # off the list at 99% with this few points: scipy's clipped bound is the extreme slope
        assert (slope, lo, hi) == (ref.slope, ref.low_slope, ref.high_slope)
        assert theil_sen_blocked([(xs, ys)], conf) == (slope, lo, hi)  # one block is the plain form
    # 5 points at 95%: the bounds are the extreme slopes (98.3% coverage); 4 points: no finite bounds
    ys = [0.0, 1.1, 1.9, 3.2, 4.1]
    slopes = sorted((ys[j] - ys[i]) / (j - i) for i in range(5) for j in range(i + 1, 5))
    assert theil_sen(range(5), ys)[1:] == (slopes[0], slopes[-1])
    assert theil_sen(range(4), ys[:4])[1:] == (-math.inf, math.inf)
    # every y tied: no spread of ranks, the interval is the (zero) slope itself, from 2 points on
    assert theil_sen([0, 1], [3.0, 3.0]) == (0.0, 0.0, 0.0) == theil_sen_blocked([([0, 1], [3.0, 3.0])])


def _mem_windows(per_hour: float, n: int, noise: float, seed: int, *, field: str = "memory_used_bytes",
                 section: str = "device", base: float = 40 * GIB, stat: str = "min") -> list[WindowSummary]:  # fmt: skip
    rng = random.Random(seed)
    out = []
    for i in range(n):
        v = base + per_hour * 0.5 * i + rng.gauss(0, noise)
        out.append(WindowSummary.load({
            "window": i, "start_unix": 1_700_000_000.0 + 1800 * i, "duration_seconds": 1800.0, "partial": False,
            section: {field: {stat: v, "max": v + 2 * GIB, "mean": v + GIB}},
        }))  # fmt: skip
    return out


def test_slow_linear_growth_projecting_beyond_budget_is_suspected() -> None:
    # 7 hours: the judged part (from a third of the series on) spans the 4 h min_span
    ws = _mem_windows(60 * MIB, 14, 8 * MIB, seed=3)  # 60 MiB/h -> 1.4 GiB per 24 h > 1 GiB (no total known)
    r = evaluate_memory(ws, "device_memory")
    assert r.status == "suspected" and r.suspected and r.significant and r.fails
    assert r.growth_per_hour == pytest.approx(60 * MIB, rel=0.25)
    assert r.ci[0] > 0 and r.projected > GIB
    assert r.n_windows == 14 and r.unit == "bytes"
    assert "MiB" in r.message() and "suspected" in r.message()


def test_significant_but_small_growth_is_not_suspected() -> None:
    ws = _mem_windows(10 * MIB, 14, 1 * MIB, seed=4)  # 240 MiB a day: real, a finding, within the budget
    r = evaluate_memory(ws, "device_memory")
    assert r.significant and r.suspected and r.pattern == "sustained climb" and not r.fails


def test_flat_with_noise_is_not_suspected() -> None:
    ws = _mem_windows(0.0, 24, 50 * MIB, seed=5)
    r = evaluate_memory(ws, "device_memory")
    assert r.status == "ok" and not r.suspected
    assert r.ci[0] <= 0 <= r.ci[1]


def test_few_windows_are_insufficient_and_missing_is_no_data() -> None:
    ws = _mem_windows(500 * MIB, 4, 1 * MIB, seed=6)
    r = evaluate_memory(ws, "device_memory")
    assert r.status == "insufficient" and not r.suspected and r.n_windows == 4
    assert evaluate_memory(ws, "target_rss").status == "no_data"


def test_partial_windows_are_left_out_and_other_sources() -> None:
    ws = _mem_windows(100 * MIB, 15, 1 * MIB, seed=7, field="target_rss_bytes", section="host")
    ws[-1].partial = True
    assert len(memory_series(ws, "target_rss")) == 14
    assert evaluate_memory(ws, "target_rss").suspected
    gpu = _mem_windows(100 * MIB, 14, 1 * MIB, seed=8, field="target_gpu_memory_bytes")
    assert evaluate_memory(gpu, "target_gpu_memory").suspected
    kv = _mem_windows(0.01, 12, 0.002, seed=9, field="kv_cache_usage_ratio", section="server", base=0.4,
                      stat="mean")  # fmt: skip
    r = evaluate_memory(kv, "kv_cache")  # +0.01/h -> 0.24 per day > 0.1
    assert r.suspected and r.unit == "ratio"
    with pytest.raises(KeyError):
        evaluate_memory(ws, "swap")


def _kv_windows(usage: list[float], running: list[float]) -> list[WindowSummary]:
    return [WindowSummary.load({
        "window": i, "start_unix": 1_700_000_000.0 + 1800 * i, "duration_seconds": 1800.0, "partial": False,
        "server": {"kv_cache_usage_ratio": {"min": u / 2, "max": min(1.0, 2 * u), "mean": u},
                   "requests_running": {"mean": r, "max": 2 * r}},
    }) for i, (u, r) in enumerate(zip(usage, running, strict=True))]  # fmt: skip


def test_kv_usage_that_follows_the_running_requests_is_not_a_leak() -> None:
    """A server that got slower (from the 7th of 14 windows) holds twice the requests at once at the
    same arrival rate, and twice the KV: per running request nothing grew. The raw mean would be a
    suspected leak (+0.2 of capacity in 7 hours)."""
    rng = random.Random(21)
    running = [12.0 + rng.gauss(0, 0.5) for _ in range(6)] + [25.0 + rng.gauss(0, 1.0) for _ in range(8)]
    usage = [0.0125 * r + rng.gauss(0, 0.004) for r in running]
    assert evaluate_memory(_kv_windows(usage, running), "kv_cache").suspected is False
    raw = _kv_windows(usage, running)
    for w in raw:
        w.server.requests_running = None  # a server without a running count: the raw mean, as before
    assert evaluate_memory(raw, "kv_cache").suspected is True


def test_kv_leak_under_changing_load_is_still_a_leak() -> None:
    """Blocks never released (+0.02 of capacity per hour) while the running count wanders 8-16: per
    running request at the median load the growth is still there, and still suspected."""
    rng = random.Random(22)
    running = [12.0 + 4.0 * math.sin(i / 2.0) for i in range(14)]
    usage = [0.0125 * r + 0.02 * 0.5 * i + rng.gauss(0, 0.003) for i, r in enumerate(running)]
    r = evaluate_memory(_kv_windows(usage, running), "kv_cache")
    assert r.suspected and r.growth_per_hour == pytest.approx(0.02, rel=0.35)


def test_a_kv_rise_shorter_than_min_span_is_no_trend() -> None:
    """Nine 20-s windows against a real vLLM (the e2e outage test): KV usage under load 0 in the first, about
    1% after, read as "+24 pts/h", +577 pts in 24 h, a critical FAIL of a healthy server. The trend is not
    projected over the horizon until its windows span ``min_span`` (4 h), as a memory series' judged part."""
    rng = random.Random(23)
    usage = [0.0] + [0.006 + 0.001 * i + rng.gauss(0, 0.001) for i in range(1, 9)]
    running = [1.0 + rng.gauss(0, 0.05) for _ in usage]
    short = [w.model_copy(update={"start_unix": 1_700_000_000.0 + 20.0 * w.window, "duration_seconds": 20.0})
             for w in _kv_windows(usage, running)]
    assert evaluate_memory(short, "kv_cache").status == "insufficient"
    r = evaluate_memory(short, "kv_cache", LeakConfig(min_span=0.0))  # what it was judged as before
    assert r.status == "suspected" and r.fails
    # the same rise over 30-min windows (4.5 h): within the budget, judged, no leak
    r = evaluate_memory(_kv_windows(usage, running), "kv_cache")
    assert r.status == "ok" and not r.suspected


def test_kv_residue_growing_from_probe_to_probe() -> None:
    rng = random.Random(10)
    probes = [(3600.0 * i, 0.02 + 0.012 * i + rng.gauss(0, 0.002)) for i in range(8)]
    r = kv_residue(probes)
    assert r.source == "kv_residue" and r.suspected
    assert r.residue == pytest.approx(probes[-1][1] - probes[0][1])
    assert r.projected > 0.05
    assert r.growth_per_hour == pytest.approx(0.012, rel=0.3)
    assert "idle KV residue" in r.message()


def test_kv_residue_returning_to_first_idle_value_or_small() -> None:
    rng = random.Random(11)
    flat = [(3600.0 * i, 0.02 + abs(rng.gauss(0, 0.003))) for i in range(10)]
    assert not kv_residue(flat).suspected
    small = [(3600.0 * i, 0.02 + 0.002 * i) for i in range(8)]  # grows, but 1.4 points < 5
    r = kv_residue(small)
    assert r.significant and not r.suspected
    assert kv_residue(small[:3]).status == "insufficient"
    assert kv_residue([]).status == "no_data"


def test_quiesce_probes_and_evaluate_all() -> None:
    ws = _mem_windows(0.0, 8, 1 * MIB, seed=12)
    for i, w in enumerate(ws):
        w.quiesce = QuiesceProbe(t_unix=w.start_unix + 1700, window=w.window, kv_cache_usage_ratio=0.01 + 0.015 * i,
                                 memory_used_bytes=None)  # fmt: skip
    ws[3].quiesce = None
    assert len(quiesce_probes(ws)) == 7
    res = {r.source: r for r in evaluate(ws)}
    assert set(res) == {"device_memory", "target_gpu_memory", "target_rss", "kv_cache", "kv_residue"}
    assert res["kv_residue"].suspected and not res["device_memory"].suspected


def test_leak_config() -> None:
    cfg = LeakConfig(device_memory_budget_bytes="512MiB", target_rss_budget_bytes="2GB")
    assert cfg.device_memory_budget_bytes == 512 * MIB
    assert cfg.target_rss_budget_bytes == 2e9
    assert cfg.budget_for("kv_residue") == 0.05
    with pytest.raises(ValidationError):
        LeakConfig(device_memory_budget_bytes="lots")
    with pytest.raises(ValidationError):
        LeakConfig(budget=1)
    for name, f in LeakConfig.model_fields.items():
        assert f.description, name


def _probes(values_mib: list[float], seed: int = 11, noise_mib: float = 20.0) -> list[WindowSummary]:
    """Windows of 30 minutes, each with an idle quiesce probe of device memory (40 GiB + values), on an
    80 GiB device."""
    rng = random.Random(seed)
    out = []
    for i, v in enumerate(values_mib):
        t = 1_700_000_000.0 + 1800 * i
        out.append(WindowSummary.load({
            "window": i, "start_unix": t, "duration_seconds": 1800.0,
            "device": {"memory_used_bytes": {"min": 60 * GIB}, "memory_total_bytes": 80 * GIB},
            "quiesce": {"t_unix": t + 900, "window": i, "drained": True,
                        "memory_used_bytes": 40 * GIB + (v + rng.gauss(0, noise_mib)) * MIB},
        }))  # fmt: skip
    return out


@pytest.mark.parametrize(("values", "pattern"), [
    ([600 * min(1.0, (i * 0.5 + 0.25) / 1.5) for i in range(24)], "ramp then flat"),
    ([512.0 if i >= 4 else 0.0 for i in range(24)], "one-off step"),
    ([1024 * (((i * 0.5 + 0.25) % 4.0) / 4.0) for i in range(24)], "sawtooth"),
    ([0.0] * 24, "flat"),
])
def test_warm_up_steps_and_sawtooths_are_no_leak(values: list[float], pattern: str) -> None:
    r = evaluate_memory(_probes(values), "device_memory")
    assert r.points == "probes" and r.pattern == pattern, r
    assert not r.suspected and not r.fails


def test_sustained_from_moves_where_the_judged_part_starts() -> None:
    """analysis.leak.sustained_from: a third by default (a 3-hour warm-up in 12 hours is left out, and the
    warm-up is named); from the start, the same warm-up is judged as a climb."""
    warm = [1024 * min(1.0, (i * 0.5 + 0.25) / 3.0) for i in range(24)]
    r = evaluate_memory(_probes(warm), "device_memory")
    assert r.pattern == "ramp then flat" and not r.suspected and r.sustained_from_hours == pytest.approx(4.0)
    every = evaluate_memory(_probes(warm), "device_memory", LeakConfig(sustained_from=0.0))
    assert every.suspected and every.sustained_from_hours == 0.0
    # 12 windows: a third starts at window 4 (not 3: the share is floored exactly, 12 x 1/3 is 4)
    twelve = evaluate_memory(_probes([0.0] * 12), "device_memory")
    assert twelve.sustained_from_hours == pytest.approx(2.0)
    with pytest.raises(ValidationError):
        LeakConfig(sustained_from=1.0)


def test_a_sustained_climb_is_a_leak_with_its_time_to_exhaustion() -> None:
    # 50 MB/h after a warm-up ramp; 40 GiB free on the device: ~36 days at this rate, inside no 7-day budget
    slow = [300 * min(1.0, i / 3) + 50e6 / MIB * 0.5 * i for i in range(24)]
    r = evaluate_memory(_probes(slow, noise_mib=50), "device_memory")
    assert r.pattern == "sustained climb" and r.suspected and not r.fails
    assert r.growth_per_hour == pytest.approx(50e6, rel=0.3) and 600 < r.hours_to_exhaustion < 1200
    assert "memory exhausted in" in r.message()
    fast = [1000.0 * 0.5 * i for i in range(24)]  # 1 GiB/h: 40 GiB in ~28 h, inside the 7 days
    f = evaluate_memory(_probes(fast), "device_memory")
    assert f.fails and f.hours_to_exhaustion < 40


# ---------------------------------------------------------------------------------------------
# staircases: memory in steps at flat KV usage (allocator growth, graph capture per new shape)

MB_PER_WINDOW = 1e6 / MIB * 0.5  # MiB per 30-minute window per MB/h


def _stairs(height: float, every: int, count: int | None, n: int = 24, leak_mb_per_hour: float = 0.0) -> list[float]:
    """``height`` MiB every ``every`` windows (``count`` of them, or forever), plus a linear leak."""
    return [height * min(count if count is not None else n, i // every) + leak_mb_per_hour * MB_PER_WINDOW * i
            for i in range(n)]


def test_theil_sen_blocked_sees_the_slope_within_blocks_only() -> None:
    flat = [([0.0, 1.0, 2.0], [5.0, 5.0, 5.0]), ([3.0, 4.0, 5.0, 6.0], [9.0, 9.0, 9.0, 9.0])]
    slope, lo, hi = theil_sen_blocked(flat)
    assert slope == 0.0 and lo == 0.0 and hi == 0.0  # the level shift between the blocks moves nothing
    assert theil_sen([x for b in flat for x in b[0]], [y for b in flat for y in b[1]])[0] > 0  # one block: it does
    rng = random.Random(3)
    climbing = [([float(x) for x in range(k * 8, k * 8 + 8)],
                 [100.0 * k + 2.0 * x + rng.gauss(0, 0.5) for x in range(k * 8, k * 8 + 8)]) for k in range(3)]
    slope, lo, hi = theil_sen_blocked(climbing)
    assert slope == pytest.approx(2.0, abs=0.2) and lo > 0
    assert theil_sen_blocked([([1.0], [1.0]), ([2.0], [5.0])]) is None


def test_a_staircase_that_stopped_is_named_steps_not_a_leak() -> None:
    # 3 steps of 256 MiB at windows 4, 8, 12 (2 h apart), then 6 hours flat; 20 MiB noise per probe
    for seed in range(5):
        r = evaluate_memory(_probes(_stairs(256, 4, 3), seed=seed), "device_memory")
        assert r.pattern == "staircase" and r.steps == 3 and not r.suspected and not r.fails, r.message()
        assert r.last_step_window == 12 and r.steps_ongoing is False
        assert r.steps_bytes == pytest.approx(768 * MIB, rel=0.1)
        assert r.memory_steps and r.ci is not None and r.ci[0] <= 0  # flat between and after the steps
        assert "grew in 3 steps" in r.message() and "last step at window 12" in r.message()
        assert "not a linear leak" in r.message()


def test_bumps_that_drift_back_are_not_steps() -> None:
    # two bumps of 80 MiB that come back down over three readings each (memory under load, no idle probe):
    # each rise is a jump, but the level after it is the level before: no staircase, nothing named
    ys = [1000.0] * 24
    for at in (7, 16):
        ys[at], ys[at + 1], ys[at + 2] = 1080.0, 1050.0, 1020.0
    r = evaluate_memory(_probes(ys, noise_mib=0.0), "device_memory")
    assert r.pattern not in ("staircase", "unbounded staircase") and not r.memory_steps and not r.suspected, r.message()
    # the same rises that stay up are a staircase
    stays = [1000.0 + 80.0 * ((i >= 7) + (i >= 16)) for i in range(24)]
    s = evaluate_memory(_probes(stays, noise_mib=0.0), "device_memory")
    assert s.pattern == "staircase" and s.steps == 2 and s.steps_bytes == pytest.approx(160 * MIB), s.message()


def test_steps_that_keep_coming_are_projected_against_the_exhaustion_budget() -> None:
    # 256 MiB every 2 h, forever: ~110 MiB/h on average, 40 GiB free: ~15 days, beyond the 7-day budget
    slow = evaluate_memory(_probes(_stairs(256, 4, None)), "device_memory")
    assert slow.pattern == "staircase" and slow.steps == 5 and slow.steps_ongoing and not slow.suspected
    assert slow.memory_steps and 300 < slow.hours_to_exhaustion < 400
    assert slow.growth_per_hour == pytest.approx(1280 * MIB / 11.5, rel=0.1)
    assert "steps still coming" in slow.message()
    # 2 GiB every 2 h, forever: memory runs out in ~1.5 days: an unbounded staircase is a leak
    fast = evaluate_memory(_probes(_stairs(2048, 4, None)), "device_memory")
    assert fast.pattern == "unbounded staircase" and fast.suspected and fast.fails and not fast.memory_steps
    assert fast.hours_to_exhaustion < 48 and "a leak" in fast.message()
    # the same steps that stopped (a long flat plateau after the last): named, not projected
    stopped = evaluate_memory(_probes(_stairs(2048, 4, 3)), "device_memory")
    assert stopped.pattern == "staircase" and not stopped.suspected and stopped.hours_to_exhaustion is None


def test_steps_on_a_linear_leak_are_a_leak() -> None:
    # 3 steps of 512 MiB and a 20 MB/h climb between them: the climb within the plateaus is the leak
    for seed in range(5):
        r = evaluate_memory(_probes(_stairs(512, 4, 3, leak_mb_per_hour=20), seed=seed), "device_memory")
        assert r.pattern == "steps on a sustained climb" and r.suspected and not r.memory_steps, r.message()
        assert r.steps == 3 and r.growth_per_hour == pytest.approx(20e6, rel=0.5) and r.ci[0] > 0
        assert "between the steps it still climbs" in r.message()


@pytest.mark.parametrize("seed", range(5))
def test_a_linear_leak_one_step_and_noise_are_judged_as_before(seed: int) -> None:
    linear = evaluate_memory(_probes(_stairs(0, 4, 0, leak_mb_per_hour=50), seed=seed, noise_mib=50),
                             "device_memory")
    assert linear.pattern == "sustained climb" and linear.suspected and linear.steps == 0
    one = evaluate_memory(_probes([512.0 if i >= 4 else 0.0 for i in range(24)], seed=seed), "device_memory")
    assert one.pattern == "one-off step" and not one.suspected and one.steps == 0 and not one.memory_steps
    noise = evaluate_memory(_probes([0.0] * 24, seed=seed, noise_mib=50), "device_memory")
    assert noise.pattern == "flat" and not noise.suspected and noise.steps == 0


def test_steps_with_growing_kv_usage_are_not_named_steps() -> None:
    windows = _probes(_stairs(256, 4, 3))
    assert [r for r in evaluate(windows) if r.source == "device_memory"][0].kv_flat is None  # KV not measured
    flat = [w.model_copy(update={"quiesce": w.quiesce.model_copy(update={"kv_cache_usage_ratio": 0.01})})
            for w in windows]
    dm = [r for r in evaluate(flat) if r.source == "device_memory"][0]
    assert dm.kv_flat is True and dm.memory_steps and "KV usage flat" in dm.message()
    growing = [w.model_copy(update={"quiesce": w.quiesce.model_copy(update={"kv_cache_usage_ratio": 0.01 * i})})
               for i, w in enumerate(windows)]
    res = {r.source: r for r in evaluate(growing)}
    assert res["kv_residue"].suspected
    assert res["device_memory"].pattern == "staircase" and res["device_memory"].kv_flat is False
    assert not res["device_memory"].memory_steps

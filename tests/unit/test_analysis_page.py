"""The checked baseline pool and the sequential live page (``soakd.analysis.page``), on seeded synthetic
level series and windows: a regression inside the pool is one, a blip in it is left out, a step pages
within two windows, stationary noise never pages."""

from __future__ import annotations

import math
import random

import pytest

from soakd.analysis.changes import judge_run
from soakd.analysis.levels import Level
from soakd.analysis.engine import Analyzer
from soakd.analysis.page import (
    check_pool,
    detectable,
    extra_of,
    grown_reference,
    long_run_extra,
    noise_floor,
    page_z,
    paused_subwindows,
    rate_extra,
    scan,
)
from soakd.config.analysis import AnalysisConfig, DriftConfig
from soakd.core.summary import QuiesceProbe, SubWindows, WindowSummary

VAR = 1.6e-4  # e2e p50's variance at 3,000 requests per window (sigma 0.5)


def levels(ys: list[float], var: float = VAR) -> list[Level]:
    return [Level(i, y, var, math.exp(y), 3000, 1.7e9 + 1800 * i) for i, y in enumerate(ys)]


def noisy(rng: random.Random, n: int, step_at: int | None = None, step: float = 0.0, blip_at: int | None = None,
          blip: float = 0.0, sd: float = math.sqrt(VAR)) -> list[float]:
    return [rng.gauss(0, sd) + (math.log1p(step) if step_at is not None and i >= step_at else 0.0)
            + (math.log1p(blip) if i == blip_at else 0.0) for i in range(n)]


def test_a_blip_in_the_pool_is_left_out_and_a_calm_pool_is_trusted() -> None:
    cfg = DriftConfig()
    for seed in range(20):
        rng = random.Random(seed)
        calm = check_pool("e2e_p50", levels(noisy(rng, 4)), cfg)
        assert calm.checked and calm.reference == (0, 1, 2, 3)
        blip = check_pool("e2e_p50", levels(noisy(rng, 4, blip_at=2, blip=0.20)), cfg)
        assert blip.dropped == (2,) and blip.reference == (0, 1, 3)
    # a faster window is no blip (a warm-up, or the windows before a regression): never dropped
    fast = check_pool("e2e_p50", levels([0.0, -0.2, 0.0, 0.0]), cfg, steps=False)
    assert fast.checked
    # throughputs are worse downwards
    assert check_pool("requests_per_second", levels([0.0, math.log(0.8), 0.0, 0.0]), cfg).dropped == (1,)


def test_a_step_inside_the_pool_moves_the_reference_to_the_windows_before_it() -> None:
    cfg = DriftConfig()
    for seed in range(20):
        rng = random.Random(seed)
        c = check_pool("e2e_p50", levels(noisy(rng, 4, step_at=1, step=0.10)), cfg)
        assert c.moved_from == 1 and c.reference == (0,)
        c = check_pool("e2e_p50", levels(noisy(rng, 4, step_at=2, step=0.10)), cfg)
        assert c.moved_from == 2 and c.reference == (0, 1)
    # within the threshold: the pool is trusted as it is
    assert check_pool("e2e_p50", levels([0.0, 0.04, 0.04, 0.04], var=1e-6), cfg).checked


def _windows(ys: list[float], n: int = 3000) -> list[WindowSummary]:
    out = []
    for i, y in enumerate(ys):
        v = math.exp(y)
        half = 1.96 * math.sqrt(VAR)
        out.append(WindowSummary.load({
            "window": i, "start_unix": 1.7e9 + 1800 * i, "duration_seconds": 1800.0, "requests": n,
            "outcomes": {"ok": n}, "e2e_seconds": {"p50": v, "count": n,
                                                   "p50_ci": [v * math.exp(-half), v * math.exp(half)]},
        }))  # fmt: skip
    return out


@pytest.mark.parametrize("at", [1, 2])
def test_a_regression_that_begins_inside_the_pool_fails_the_run(at: int) -> None:
    cfg = DriftConfig(metrics=["e2e_p50"])
    confident = 0
    for seed in range(10):
        rng = random.Random(100 + seed)
        rd = judge_run(_windows(noisy(rng, 24, step_at=at, step=0.10)), [0, 1, 2, 3], cfg)
        worse = [c for c in rd.changes if c.direction == "degraded"]  # against the windows before it
        for c in worse:
            assert c.window == at and c.ratio == pytest.approx(0.10, abs=0.035), rd.changes
        confident += any(c.tier == "confident" for c in worse)
    # with one window of reference (a step at window 1) its noise counts in full: not every run is confident
    assert confident >= (8 if at == 1 else 9)


def test_a_blip_in_the_pool_does_not_hide_a_later_step() -> None:
    cfg = DriftConfig(metrics=["e2e_p50"])
    for seed in range(5):
        rng = random.Random(200 + seed)
        rd = judge_run(_windows(noisy(rng, 24, step_at=12, step=0.08, blip_at=2, blip=0.20)), [0, 1, 2, 3], cfg)
        (c,) = [c for c in rd.changes if c.tier == "confident"]
        assert c.window == 12 and c.direction == "degraded" and c.ratio == pytest.approx(0.08, abs=0.02)


def _first_page(ys: list[float], cfg: DriftConfig, var: float = VAR, pool: int = 4) -> int | None:
    """The live rule over a series: the pool's reference, the scan at each later window."""
    series = levels(ys, var)
    z = page_z(cfg, len(ys))
    ref = series[:pool]
    for t in range(pool, len(series)):
        history = series[:t][:max(pool, t - 2)]
        sc = scan("e2e_p50", series[pool:t + 1], ref, noise_floor(history), 0.0, z, cfg)
        if sc is not None and sc.side:
            return t
    return None


def test_the_noise_floor_never_spans_the_windows_the_pool_check_dropped() -> None:
    """A +10% step from pool window 2: the live check (no step test) drops windows 2 and 3 as differing. The
    difference from window 1 to window 4 spans the step: paired across the dropped windows it made a noise floor
    of the step's own size, and the step was paged hours late (window 16 of 24 with seed 1 of the benchmark's
    pool-step-2 cell, never with seed 9; now windows 8-10)."""
    ys = [0.0, 0.0, *[math.log1p(0.10)] * 8]
    series = levels(ys)
    check = check_pool("e2e_p50", series[:4], DriftConfig(), steps=False)
    assert check.dropped == (2, 3)
    tau2 = noise_floor(series, dropped=frozenset(check.dropped))
    assert tau2 == pytest.approx(noise_floor(levels([0.0] * 7)))  # as flat as six equal pairs: the step is no noise
    assert noise_floor(series[:2] + series[4:]) > 5 * tau2  # the pairing across them: the step as noise


def test_a_step_pages_within_two_windows_and_stationary_noise_never_pages() -> None:
    cfg = DriftConfig()
    paged = [_first_page(noisy(random.Random(300 + s), 24, step_at=12, step=0.10), cfg) for s in range(40)]
    # one metric alone (the benchmark pages on any of them): measured 33 of 40
    assert sum(p is not None and 12 <= p <= 13 for p in paged) >= 30, paged
    paged = [_first_page(noisy(random.Random(400 + s), 24, step_at=12, step=0.20), cfg) for s in range(40)]
    assert sum(p == 12 for p in paged) >= 38, paged
    calm = [_first_page(noisy(random.Random(500 + s), 24), cfg) for s in range(100)]
    assert sum(p is not None for p in calm) <= 1, calm
    # below the threshold: a +4% step pages rarely
    small = [_first_page(noisy(random.Random(600 + s), 24, step_at=12, step=0.04), cfg) for s in range(40)]
    assert sum(p is not None for p in small) <= 2, small


def test_detectable_is_the_change_a_page_catches_about_half_the_time() -> None:
    cfg = DriftConfig()
    ref = levels([0.0] * 4)
    z = page_z(cfg, 24)
    # the noise floor a ten-window history gives (its 75% bound), on average
    tau2 = sum(noise_floor(levels(noisy(random.Random(800 + s), 10))) for s in range(200)) / 200
    two = detectable("e2e_p50", VAR, ref, tau2, 0.0, z, cfg, 2)
    one = detectable("e2e_p50", VAR, ref, tau2, 0.0, z, cfg, 1)
    assert 0.05 < two < one < 0.12
    # a throughput pages on a fall: the same log-scale change is a smaller fall than rise, and never beyond 100%
    fall = detectable("output_tokens_per_second", VAR, ref, tau2, 0.0, z, cfg, 2)
    assert fall == pytest.approx(1.0 - 1.0 / (1.0 + two)) and fall < two
    big = detectable("requests_per_second", 0.5, ref, tau2, 0.0, z, cfg, 2)
    assert 0.5 < big < 1.0 < big / (1.0 - big)  # written as the rise of the same log-scale change: beyond 100%
    paged = [_first_page(noisy(random.Random(700 + s), 14, step_at=12, step=two), cfg) for s in range(60)]
    share = sum(p is not None for p in paged) / len(paged)
    assert 0.35 <= share <= 0.95, share  # within two windows (a one-window page counts too)


def _sub_windows(rng: random.Random, sd_load: float, memory_min: float, minutes: int = 30) -> SubWindows:
    """Per-minute geometric means of 100 lognormal requests under an AR(1) load (memory in minutes)."""
    x = rng.gauss(0, sd_load) if sd_load else 0.0
    out = []
    for _ in range(minutes):
        if sd_load:
            phi = math.exp(-1.0 / memory_min)
            x = phi * x + math.sqrt(1 - phi * phi) * sd_load * rng.gauss(0, 1)
        out.append(math.exp(x + rng.gauss(0, 0.5 / math.sqrt(100))))
    return SubWindows(seconds=60.0, requests=[100] * minutes, ok=[100] * minutes, e2e=out)


def test_the_slow_wander_the_sub_windows_show() -> None:
    rng = random.Random(9)

    def windows(sd: float, memory: float) -> list[WindowSummary]:
        return [WindowSummary.load({"window": i, "requests": 3000, "subwindows": _sub_windows(rng, sd, memory).model_dump()})
                for i in range(8)]

    calm = long_run_extra(windows(0.0, 1.0), "e2e")
    wander = long_run_extra(windows(0.10, 3.0), "e2e")
    assert calm < 2e-5
    # a 3-minute memory at sd 10%: a 30-minute mean varies by about 2 * 3 / 30 * 0.01 = 2e-3, of which the
    # one-minute batches see part; the five-minute ones add most of the rest
    assert 3e-4 < wander < 2.5e-3, wander


def _poisson(rng: random.Random, mean: float) -> int:
    """A Poisson count (Knuth's product of uniforms, in chunks of mean 30 so that exp() stays representable)."""
    total = 0
    while mean > 0:
        part = min(mean, 30.0)
        mean -= part
        limit, k, p = math.exp(-part), 0, rng.random()
        while p > limit:
            k += 1
            p *= rng.random()
        total += k
    return total


def _count_windows(rng: random.Random, sd_load: float, memory_min: float, n: int = 8) -> list[WindowSummary]:
    """Windows of 30 per-minute counts of successful requests, Poisson with mean 100 times an AR(1) load (the waves
    of a closed loop whose speed follows the batch)."""
    out = []
    phi = math.exp(-1.0 / memory_min)
    for i in range(n):
        x = rng.gauss(0, sd_load)
        ok = []
        for _ in range(30):
            x = phi * x + math.sqrt(1 - phi * phi) * sd_load * rng.gauss(0, 1)
            ok.append(_poisson(rng, 100.0 * math.exp(x)))
        out.append(WindowSummary.load({"window": i, "requests": sum(ok), "subwindows": SubWindows(
            seconds=60.0, requests=ok, ok=ok).model_dump()}))
    return out


def test_the_waves_a_closed_loop_shows_in_its_throughput() -> None:
    """A throughput's level varies beyond its Poisson interval when requests complete in waves: the batch counts'
    dispersion says by how much (``rate_extra``); Poisson counts add nothing. The benchmark's closed-batch cell:
    windows varied 2.5 times their interval, and healthy runs paged on tokens/s (4 of 200)."""
    rng = random.Random(5)
    calm = rate_extra(_count_windows(rng, 0.0, 1.0))
    waves = rate_extra(_count_windows(rng, 0.15, 3.0))
    poisson = 1.0 / 3000
    assert calm < 0.6 * poisson, calm  # seeds 0-9: at most 0.36 x
    # the window count's variance beyond Poisson: 100^2 x 0.15^2 x 30 x (1 + phi) / (1 - phi) (phi = e^(-1/3)), about
    # 4.1e4, over 3000^2: 4.5e-3; five-minute batches see about half of a three-minute memory (seeds 0-9: 1.3e-3 to
    # 3.5e-3), the noise floor the rest
    assert 1e-3 < waves < 6e-3, waves
    # the tokens' rate takes the same, a latency its own (none from counts), the error rate none
    ws = _count_windows(rng, 0.15, 3.0)
    assert extra_of("output_tokens_per_second", ws) == extra_of("requests_per_second", ws) == rate_extra(ws) > 0
    assert extra_of("error_rate", ws) == 0.0


def _with_pause(ws: list[WindowSummary], probe: bool = True, paused: bool = True) -> list[WindowSummary]:
    """The windows with a quiesce probe's pause 10 minutes in, 90 s long: sub-windows 10 and 11 empty (no request is
    sent while the load is paused), the window's ``paused_seconds`` and probe as the runtime records them."""
    out = []
    for w in ws:
        d = w.dump()
        start = 1.7e9 + 1800.0 * w.window
        for key in ("ok", "requests"):
            d["subwindows"][key][10:12] = [0, 0]
        d.update(start_unix=start, paused_seconds=90.0 if paused else 0.0,
                 quiesce=QuiesceProbe(t_unix=start + 600.0, window=w.window, drained=True, seconds=90.0).model_dump()
                 if probe else None)
        out.append(WindowSummary.load(d))
    return out


def test_a_quiesce_probe_s_pause_is_no_wave() -> None:
    """Every window pauses its load once for the idle probe; the sub-windows of the pause count nothing, and read as
    waves they made the throughput's variance many times its interval (`make demo`, 20-second windows: the change a
    throughput page catches 220%). They are left out where the window's probe places them."""
    rng = random.Random(5)
    ws = _with_pause(_count_windows(rng, 0.0, 1.0))
    poisson = 1.0 / 3000
    assert paused_subwindows(ws[0]) == {10, 11}
    assert rate_extra(ws) < 0.6 * poisson  # Poisson counts and a pause: nothing extra
    # the same gaps with no pause recorded are read as waves (what the probe's pause did before)
    assert rate_extra(_with_pause(_count_windows(random.Random(5), 0.0, 1.0), paused=False)) > 3 * poisson
    # paused, and no probe of the window's own to place the pause: the window says nothing of waves
    unplaced = _with_pause(_count_windows(random.Random(5), 0.15, 3.0), probe=False)
    assert paused_subwindows(unplaced[0]) is None and rate_extra(unplaced) == 0.0
    # waves are still seen around a pause
    assert 1e-3 < rate_extra(_with_pause(_count_windows(random.Random(5), 0.15, 3.0))) < 6e-3


def test_a_short_window_s_pause_leaves_its_waves_seen() -> None:
    """A window shorter than 10 minutes has 10 sub-windows, and a probe's pause takes 1-2 of them: the rest still say
    how much the window's count waves (before: every window was left out, no wave was allowed, and in the benchmark's
    closed loop at 60-s windows with 8-s drains 3% of healthy runs paged tokens/s, 0.5% without drains)."""
    rng = random.Random(7)
    phi = math.exp(-1.0 / 3.0)
    plain, paused = [], []
    for i in range(12):
        x, ok = rng.gauss(0, 0.3), []
        for _ in range(10):
            x = phi * x + math.sqrt(1 - phi * phi) * 0.3 * rng.gauss(0, 1)
            ok.append(_poisson(rng, 25.0 * math.exp(x)))
        start = 1.7e9 + 60.0 * i
        d = {"window": i, "requests": sum(ok), "start_unix": start,
             "subwindows": SubWindows(seconds=6.0, requests=ok, ok=ok).model_dump()}
        plain.append(WindowSummary.load(d))
        gap = [v if j not in (4, 5) else 0 for j, v in enumerate(ok)]
        paused.append(WindowSummary.load({
            **d, "requests": sum(gap), "paused_seconds": 8.0,
            "subwindows": SubWindows(seconds=6.0, requests=gap, ok=gap).model_dump(),
            "quiesce": QuiesceProbe(t_unix=start + 25.0, window=i, drained=True, seconds=8.0).model_dump()}))
    assert paused_subwindows(paused[0]) == {4, 5}
    waves = rate_extra(plain)
    assert waves > 1.5 / 250  # a window of ~250 requests: its waves beyond its Poisson variance (1/250)
    assert 0.4 * waves < rate_extra(paused) < 2.5 * waves, (rate_extra(paused), waves)


def test_a_short_window_s_pause_leaves_its_latency_wander_seen() -> None:
    """The latency's slower wander, like the count's waves: a probe's pause empties 1-2 of a short window's 10
    sub-windows, and the rest still say how much the window's level wanders (before: a window with an empty
    sub-window was left out whole, and in a run whose every window paused no wander was allowed at all)."""
    rng = random.Random(11)
    phi = math.exp(-1.0 / 4.0)  # a wander of 4 sub-windows' memory, sd 10%
    plain, paused = [], []
    for i in range(16):
        x, e2e = rng.gauss(0, 0.1), []
        for _ in range(10):
            x = phi * x + math.sqrt(1 - phi * phi) * 0.1 * rng.gauss(0, 1)
            e2e.append(math.exp(x + rng.gauss(0, 0.02)))
        start = 1.7e9 + 60.0 * i
        ok = [25] * 10
        d = {"window": i, "requests": 250, "start_unix": start,
             "subwindows": SubWindows(seconds=6.0, requests=ok, ok=ok, e2e=e2e).model_dump()}
        plain.append(WindowSummary.load(d))
        gap = [v if j not in (4, 5) else 0 for j, v in enumerate(ok)]
        paused.append(WindowSummary.load({
            **d, "requests": sum(gap), "paused_seconds": 8.0,
            "subwindows": SubWindows(seconds=6.0, requests=gap, ok=gap,
                                     e2e=[v if j not in (4, 5) else None for j, v in enumerate(e2e)]).model_dump(),
            "quiesce": QuiesceProbe(t_unix=start + 25.0, window=i, drained=True, seconds=8.0).model_dump()}))
    wander = long_run_extra(plain, "e2e")
    # a window's mean varies by about 5e-3 under this wander; batches of two sub-windows show a part of it, and
    # independent sub-windows (sd 2%) would show about nothing
    assert wander > 1.5e-4, wander
    assert 0.4 * wander < long_run_extra(paused, "e2e") < 2.5 * wander, (long_run_extra(paused, "e2e"), wander)


def test_the_latency_wander_of_windows_whose_pauses_cut_other_batches_does_not_depend_on_their_order() -> None:
    """A 2.5-minute pause leaves a 30-minute window 27 sub-windows, batched by 4 where the others are batched by 5:
    each window's batch means are weighed by its own batch length (before: by the last window's)."""
    rng = random.Random(5)
    ws = []
    for i in range(8):
        start = 1.7e9 + 1800.0 * i
        sub = _sub_windows(rng, 0.10, 3.0)
        d = {"window": i, "requests": 3000, "start_unix": start, "subwindows": sub.model_dump()}
        if i % 2:
            e2e = [v if j not in (10, 11, 12) else None for j, v in enumerate(sub.e2e)]
            d = {**d, "paused_seconds": 150.0,
                 "subwindows": sub.model_copy(update={"e2e": e2e}).model_dump(),
                 "quiesce": QuiesceProbe(t_unix=start + 610.0, window=i, drained=True, seconds=150.0).model_dump()}
        ws.append(WindowSummary.load(d))
    assert paused_subwindows(ws[1]) == {10, 11, 12}
    forward, backward = long_run_extra(ws, "e2e"), long_run_extra(ws[::-1], "e2e")
    assert forward > 3e-4
    assert forward == pytest.approx(backward, rel=1e-9)


def test_the_reference_grows_with_the_windows_that_agree_with_the_pool() -> None:
    cfg = DriftConfig()
    pool = levels([0.0, 0.01, -0.01, 0.0])
    after = levels([0.0, 0.02, 0.06, -0.02, 0.04, 0.0, 0.10, 0.01])
    after = [Level(4 + i, lv.y, lv.var, lv.value, lv.n, lv.start_unix) for i, lv in enumerate(after)]
    grown = grown_reference("e2e_p50", pool, after, 0.0, 0.0, cfg)
    # +6.2% and +10.5% are beyond the 5% threshold: left out, and the windows after them still join
    assert [lv.window for lv in grown] == [0, 1, 2, 3, 4, 5, 7, 9, 11]
    # within the threshold but beyond 2 standard errors (sd 1.26% a window, the pool's 0.63%): +4.1% stays out
    assert 8 not in [lv.window for lv in grown]
    # a noisier run (the noise floor) lets the same +4.1% window agree
    assert 8 in [lv.window for lv in grown_reference("e2e_p50", pool, after, 4e-4, 0.0, cfg)]
    # nothing after the pool: the reference as it was
    assert grown_reference("e2e_p50", pool, [], 0.0, 0.0, cfg) == pool


def _live_reference_n(ys: list[float]) -> list[int]:
    """The requests behind each window's live e2e p50 reference, through the analysis engine."""
    cfg = AnalysisConfig(drift=DriftConfig(metrics=["e2e_p50"]))
    an = Analyzer(cfg, planned_windows=len(ys))
    out = []
    for w in _windows(ys):
        an.add_window(w)
        r = an.drift_detector.drift.get(("e2e_p50", "baseline"))
        out.append(r.reference_n if r is not None and r.window == w.window else 0)
    return out


def test_a_regression_after_the_pool_never_joins_the_reference() -> None:
    rng = random.Random(31)
    calm = _live_reference_n(noisy(rng, 16))
    # windows 0-3 the pool; at window w the windows 4..w-3 (older than the scan's three) join
    assert calm[4:7] == [4 * 3000] * 3 and calm[7:] == [3000 * (w - 2) for w in range(7, 16)], calm
    # +10% from window 5: no window of it agrees with the pool, the reference stays the pool and window 4 (a
    # +7% step's windows are within the threshold now and then: one in about fifteen at this noise joins)
    moved = _live_reference_n(noisy(rng, 16, step_at=5, step=0.10))
    assert moved[4:7] == [4 * 3000] * 3 and moved[7:] == [5 * 3000] * 9, moved


def test_only_a_degradation_pages() -> None:
    cfg = DriftConfig()
    z = page_z(cfg, 24)
    # one-sided over 11 metrics x 24 windows x 2 segments at 95% (two-sided it was 3.90)
    assert cfg.family == 11 and z == pytest.approx(3.73, abs=0.01)
    ref = levels([0.0] * 4)

    def side(metric: str, change: float) -> int:
        post = [Level(4, math.log1p(change), VAR, 1.0 + change, 3000, 1.7e9 + 1800 * 4)]
        sc = scan(metric, post, ref, 0.0, 0.0, z, cfg)
        assert sc is not None and sc.d1 == pytest.approx(math.log1p(change))
        return sc.side

    # latency: up pages, down (faster) never does, however far
    assert side("e2e_p50", 0.20) == 1 and side("e2e_p50", -0.20) == 0 and side("e2e_p50", -0.50) == 0
    # throughput: down pages, up never does
    assert side("requests_per_second", -0.20) == -1 and side("requests_per_second", 0.25) == 0
    # a two-window segment pages only while its last window is worse beyond the threshold too
    post = levels([0.0] * 4 + [0.15, -0.15])[4:]
    assert scan("e2e_p50", post, ref, 0.0, 0.0, z, cfg).side == 0


def test_a_faster_server_is_reported_never_paged() -> None:
    """Through the analysis engine: e2e p50 20% faster from window 8 is shown (the drift ratio, the run's
    end as an improvement that does not fail), never paged; 20% slower pages at its window."""
    cfg = AnalysisConfig(drift=DriftConfig(metrics=["e2e_p50"]))
    for step, pages in ((-0.20, False), (0.20, True)):
        rng = random.Random(41)
        an = Analyzer(cfg, planned_windows=16)
        active = []
        for w in _windows(noisy(rng, 16, step_at=8, step=step)):
            an.add_window(w)
            active.append(an.drift_detector.drift_active["e2e_p50"])
        r = an.drift_detector.drift[("e2e_p50", "baseline")]
        assert r.ratio == pytest.approx(step, abs=0.03)
        assert active[8] is pages and any(active) is pages, active
        v = an.verdict()
        assert v.result == ("FAIL" if pages else "PASS"), v.reasons
        moved = [c for c in v.drift["changes"] if c["metric"] == "e2e_p50" and c["tier"] == "confident"]
        assert [c["direction"] for c in moved] == ["degraded" if pages else "improved"], v.drift


def _late_run(ys: list[float], requests: list[int] | None = None) -> tuple[Analyzer, list[tuple[int, str]]]:
    """A run through the analysis engine: e2e p50's log levels ``ys``, the requests of each window (its
    requests per second), every baseline event."""
    events: list[tuple[int, str]] = []
    cfg = AnalysisConfig(drift=DriftConfig(metrics=["e2e_p50", "requests_per_second"]))
    an = Analyzer(cfg, on_event=lambda kind, sev, msg, data, w: events.append((w, msg)) if kind == "baseline"
                  else None, planned_windows=len(ys))
    for i, w in enumerate(_windows(ys)):
        if requests is not None:
            w = w.model_copy(update={"requests": requests[i], "outcomes": {"ok": requests[i]}})
        w = w.model_copy(update={"requests_per_second": w.requests / w.duration_seconds})
        an.add_window(w)
    return an, events


def test_a_regression_from_window_1_is_paged_live_once_the_windows_after_the_pool_give_a_noise_floor() -> None:
    """The blip check cannot see a step from window 1 (window 0 is the odd one, and faster); the pool's test for a
    step, live from the fourth window after the pool, moves the reference to window 0 and the run pages."""
    rng = random.Random(7)
    ys = [y + rng.gauss(0, 0.004) for y in [0.0, *[math.log1p(0.10)] * 11]]
    an, events = _late_run(ys)
    check = an.drift_detector.checks["e2e_p50"]
    assert check.moved_from == 1 and check.reference == (0,)
    # the smallest change a page catches is the new reference's (the mixed pool's noise floor held the step: 18.6%)
    assert an.drift_detector.detectable["e2e_p50"] < 0.12, an.drift_detector.detectable
    assert [w for w, msg in events if msg.startswith("baseline not stable") and "e2e_p50 moved from window 1" in msg
            and "found with the windows after the pool, at window 7" in msg] == [7]
    # against one window of reference and a floor from a few windows (its upper bound): paged a few windows later
    # (before the check, the mixed pool's +7% left every later window within the threshold: never paged)
    paged = [f.window for f in an.findings if f.diagnosis == "performance drift"]
    assert paged and 7 <= paged[0] <= 10, paged
    # before the fourth window after the pool, nothing is moved: four windows alone cannot tell a step from wander
    an, _ = _late_run(ys[:7])
    assert an.drift_detector.checks["e2e_p50"].checked


def test_a_throughput_that_settles_over_the_first_window_moves_nothing() -> None:
    """A closed loop whose first window ran 15% more requests (fewer long ones in flight yet), latency flat: not a
    regression from window 1 (the benchmark's closed-batch cell paged four of 200 healthy runs before)."""
    ys = [0.0] * 12
    an, events = _late_run(ys, [3450, *[3000] * 11])
    assert an.drift_detector.checks["requests_per_second"].moved_from is None
    assert not [msg for _, msg in events if msg.startswith("baseline not stable")]
    assert not [f for f in an.findings if f.kind == "drift"], an.findings


def _wandering_step(seed: int, n: int = 24) -> list[float]:
    """+10% from window 1, then load that wanders 3% a window on top (after the pool)."""
    rng = random.Random(seed)
    return [rng.gauss(0, math.sqrt(VAR)) + (math.log1p(0.10) if i >= 1 else 0.0) + (rng.gauss(0, 0.03) if i > 3 else 0)
            for i in range(n)]


def test_a_resumed_run_keeps_the_reference_the_live_run_moved() -> None:
    """A restart replays the pool's live checks window by window: the reference a live run moved at window 7 stays
    moved when the run resumes after window 8 (with the whole series at once, the later wander widened the floor
    and the resumed run went back to the mixed pool and never paged)."""
    ws = _windows(_wandering_step(8))
    for r in range(8, 24):
        live, _ = _late_run([], None)
        for w in ws[:r]:
            live.add_window(w)
        resumed, _ = _late_run([], None)
        resumed.restore(ws[:r], ws[0])
        a, b = live.drift_detector, resumed.drift_detector
        assert b.checks["e2e_p50"] == a.checks["e2e_p50"], r
        assert b.detectable["e2e_p50"] == pytest.approx(a.detectable["e2e_p50"]), r
    assert live.drift_detector.checks["e2e_p50"].moved_from == 1


def test_the_end_of_the_run_judges_against_the_reference_the_live_run_moved() -> None:
    """The live run paged against window 0; the end of the run names the same step, from window 1, degraded (its own
    pool test, with the whole run's wander, kept the mixed pool and named nothing)."""
    an, _ = _late_run(_wandering_step(8))
    assert an.drift_detector.checks["e2e_p50"].moved_from == 1
    assert [f.window for f in an.findings if f.diagnosis == "performance drift"][:1] == [8]
    an.verdict()
    changes = [c for c in an.drift_detector.run_drift.changes if c.metric == "e2e_p50"]
    assert [(c.window, c.direction) for c in changes] == [(1, "degraded")], changes


def test_the_live_step_check_of_the_pool_stops_after_its_last_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its change-point search grows with the series: live, it runs from the 4th to the 20th window after the pool
    (a run of 1-minute windows would otherwise search hundreds of windows at every close); the end of the run tests
    the whole run."""
    from soakd.analysis import changes, drift_watch

    calls: list[int] = []
    real = changes.change_points
    monkeypatch.setattr(changes, "change_points", lambda series: calls.append(len(series)) or real(series))
    _late_run(noisy(random.Random(5), 60))
    assert calls and max(calls) == 4 + drift_watch.LATE_LAST, calls
    assert len(calls) == drift_watch.LATE_LAST - drift_watch.LATE_WINDOWS + 1, calls


def test_a_climb_through_the_pool_is_found_at_its_close() -> None:
    """Every pool window worse than the one before it (1.5 standard errors of their difference), the last beyond the
    threshold from the first: a climb, the reference is window 0. A pool that rises in one window and not the next,
    or by less than the threshold in all, is no climb."""
    cfg = DriftConfig()
    for seed in range(20):
        rng = random.Random(300 + seed)
        c = check_pool("e2e_p50", levels([0.08 * i + rng.gauss(0, math.sqrt(VAR)) for i in range(4)]), cfg,
                       steps=False)
        assert c.climb and c.reference == (0,) and c.moved_from == 1, c
    # flat between windows 1 and 2 (a step's windows, or wander): not a climb; window 3 is the odd one (a blip)
    assert not check_pool("e2e_p50", levels([0.0, 0.06, 0.06, 0.2]), cfg, steps=False).climb
    # within the threshold from first to last: the pool is trusted as it is
    assert check_pool("e2e_p50", levels([0.0, 0.015, 0.03, 0.045], var=1e-6), cfg, steps=False).checked
    # a latency that falls through the pool (a warm-up) is no climb, nor a throughput that falls (a closed loop
    # settling, or the arrival rate)
    assert not check_pool("e2e_p50", levels([0.18, 0.12, 0.06, 0.0]), cfg, steps=False).climb
    assert not check_pool("requests_per_second", levels([0.18, 0.12, 0.06, 0.0]), cfg, steps=False).climb
    # each difference must pass CLIMB_Z (1.5 standard errors of the difference): at 1.6 a climb, at 1.4 none (the
    # benchmark's 1,900 stationary pools came no closer than 1.15)
    se = math.sqrt(2 * VAR)
    assert check_pool("e2e_p50", levels([1.6 * se * i for i in range(4)]), cfg, steps=False).climb
    assert check_pool("e2e_p50", levels([1.4 * se * i for i in range(4)]), cfg, steps=False).checked


def test_a_climbing_series_leaves_its_climb_out_of_the_noise_floor() -> None:
    """Successive differences of a climb hold the climb: taken out (their mean), the floor is the noise's."""
    rng = random.Random(11)
    ys = levels([0.05 * i + rng.gauss(0, 0.01) for i in range(10)], var=1e-4)
    plain, detrended = noise_floor(ys), noise_floor(ys, detrend=True)
    assert math.sqrt(plain) > 0.035 and math.sqrt(detrended) < 0.02, (plain, detrended)
    # a flat series: about the same floor either way
    flat = levels([rng.gauss(0, 0.01) for _ in range(10)], var=1e-4)
    assert noise_floor(flat, detrend=True) == pytest.approx(noise_floor(flat), abs=5e-5)
    # one difference has no mean to take out: the climb stays in it (the cautious answer)
    assert noise_floor(levels([0.0, 0.1]), detrend=True) == noise_floor(levels([0.0, 0.1])) > 0.0


def test_a_latency_that_climbs_through_the_pool_is_paged_at_the_first_window_after_it() -> None:
    """Seen on llama-server with its host prompt cache: e2e p50 49, 64, 79, 90 ms in the pool's windows, 135 ms by
    window 9. The pool held the climb, its successive differences made the noise floor, and the first live page came
    at window 9 (+97% over the pool's mean). Now the pool's close names the climb, the reference is window 0, and
    the first window after the pool pages."""
    curve = [49, 64, 79, 90, 97.5, 105, 112.5, 120, 127.5, 135, 135, 135]
    rng = random.Random(3)
    ys = [math.log(v / 49) + rng.gauss(0, math.sqrt(VAR)) for v in curve]
    an, events = _late_run(ys)
    check = an.drift_detector.checks["e2e_p50"]
    assert check.climb and check.reference == (0,) and check.moved_from == 1, check
    assert [w for w, msg in events
            if msg == "baseline not stable: e2e_p50 climbed in every pool window from window 0 (reference: windows [0])"
            ] == [3], events
    paged = [f.window for f in an.findings if f.diagnosis == "performance drift"]
    assert paged == list(range(4, 12)), paged  # and every window after: the climb stays in the floor's mean
    # a resumed run replays the same check and the same smallest detectable change
    live, _ = _late_run([])
    for w in _windows(ys):
        live.add_window(w)
    resumed, _ = _late_run([])
    resumed.restore(_windows(ys), _windows(ys)[0])
    assert resumed.drift_detector.checks["e2e_p50"] == live.drift_detector.checks["e2e_p50"] == check
    assert resumed.drift_detector.detectable["e2e_p50"] == pytest.approx(live.drift_detector.detectable["e2e_p50"])
    # the end of the run names it a creep from window 0, and fails
    v = an.verdict()
    assert v.result == "FAIL" and "drift: creep (windows 0-11: e2e_p50)" in v.reasons, v.reasons


def test_the_first_windows_of_a_climb_never_join_the_reference() -> None:
    """A climb's first windows may be within the threshold of window 0: they are the change, not the baseline. Grown
    back into the reference, the live rule judged +10% against windows 0 and 1 and never paged, while the end of the
    run (against window 0) failed the run from window 1 (found in review)."""
    an, events = _late_run([0.0, 0.035, 0.065, 0.095, *[0.095] * 10])
    assert an.drift_detector.checks["e2e_p50"].climb
    assert an.drift_detector.drift[("e2e_p50", "baseline")].reference_window == 0
    paged = [f.window for f in an.findings if f.diagnosis == "performance drift"]
    v = an.verdict()
    assert v.result == "FAIL" and paged, (paged, v.reasons)


def test_a_run_against_an_earlier_runs_baseline_says_the_smallest_change_a_page_catches_live() -> None:
    """With a baseline from an earlier run (``--baseline``) no pool closes: the smallest change a page catches was
    computed by a resumed run only, so the live run's report and ``soakd_drift_detectable_ratio`` had none. Now it
    follows the run's own windows, the same live and resumed."""
    rng = random.Random(11)
    ws = _windows([rng.gauss(0, math.sqrt(VAR)) for _ in range(10)])
    base = ws[0].model_copy(update={"window": -1})
    cfg = AnalysisConfig(drift=DriftConfig(metrics=["e2e_p50"]))
    live = Analyzer(cfg, baseline=base, planned_windows=10)
    seen = []
    for w in ws[1:]:
        live.add_window(w)
        seen.append(live.drift_detector.detectable.get("e2e_p50"))
    assert all(v is not None and 0 < v < 0.5 for v in seen), seen
    resumed = Analyzer(cfg, baseline=base, planned_windows=10)
    resumed.restore(ws[1:], base)
    assert resumed.drift_detector.detectable["e2e_p50"] == pytest.approx(seen[-1])
    assert live.verdict().judged.detectable["e2e_p50"] == pytest.approx(seen[-1])


@pytest.mark.parametrize("seed", [29, 144])
def test_a_step_the_late_pool_check_finds_is_confirmed_with_the_live_floors_bound(seed: int) -> None:
    """Window 0 is 6% faster and every window wanders 3% on top: the pool's late test for a step, with the floor
    the change-point search gives from a few windows, finds a step from window 1; confirmed with the live rule's
    own floor at its upper bound it is within the wander, and the reference stays the pool. Without the
    confirmation these seeds moved the reference to window 0 and paged the wander (windows 9; 8 and 9)."""
    rng = random.Random(seed)
    ys = [rng.gauss(0, math.sqrt(VAR)) + (-0.06 if i == 0 else 0.0) + rng.gauss(0, 0.03) for i in range(12)]
    an, events = _late_run(ys)
    assert an.drift_detector.checks["e2e_p50"].moved_from is None
    assert not [msg for _, msg in events if msg.startswith("baseline not stable")], events
    assert not [f.window for f in an.findings if f.diagnosis == "performance drift"]

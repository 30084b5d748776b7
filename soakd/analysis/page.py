"""The live page: a checked baseline pool (a change inside it is found before the pool is trusted) and a
sequential rule over the windows after it (the mean of the last one, two or three windows against the
pool's reference), with the noise of a window taken from what the run has: the window's own sampling
and batch-means variance, the slower wander its sub-windows show, and the between-window noise floor.

(derivation: docs/analysis.md#derivation-pagepy)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

from scipy import stats as sps

from soakd.analysis.levels import Level
from soakd.config.analysis import DriftConfig
from soakd.core.summary import WindowSummary
from soakd.core.tracked import METRICS, THROUGHPUT

__all__ = [
    "SCAN",
    "PoolCheck",
    "check_pool",
    "detectable",
    "extra_of",
    "grown_reference",
    "long_run_extra",
    "noise_floor",
    "page_z",
    "rate_extra",
    "scan",
    "with_extra",
]

SCAN = 3  # the sequential rule's segments: the last 1..SCAN windows
POOL_Z = 4.0  # a change inside the pool: this many standard errors, and beyond the threshold
EXCESS_Z = 2.33  # a page: the change beyond the threshold by this many standard errors (one-sided 99%)
TAU2_BOUND = 0.75  # the between-window noise floor's upper confidence bound in the live rule
AGREE_Z = 2.0  # a window after the pool joins the reference within the threshold and this many standard errors
CLIMB_Z = 1.5  # a climb through the pool: every window worse than the one before it by this many standard errors
_FAMILY = {"e2e_seconds": "e2e", "ttft_seconds": "ttft", "itl_seconds": "itl"}


def page_z(cfg: DriftConfig, planned_windows: int, references: int = 1) -> float:
    """The run-level significance of a page: one-sided (a page is a degradation: the verdict fails on nothing
    else), Bonferroni over metrics x planned windows x the scan's segments (three overlapping ones count as
    two) x references."""
    alpha = 1.0 - cfg.confidence
    family = cfg.family * max(1, planned_windows) * 2 * max(1, references)
    return NormalDist().inv_cdf(1.0 - alpha / family)


def family_of(metric: str) -> str | None:
    spec = METRICS[metric]
    return _FAMILY.get(spec.field or "") if spec.kind == "quantile" else None


def _batch_sums(x: list[float]) -> tuple[int, list[float]]:
    """A window's sub-window series cut into batches of ``b`` consecutive sub-windows, ``b`` about a sixth of the
    window (at least 2; a last, shorter batch left out): ``(b, the batches' sums)``."""
    b = max(2, round(len(x) / 6))
    return b, [sum(x[i * b:(i + 1) * b]) for i in range(len(x) // b)]


def long_run_extra(windows: list[WindowSummary], family: str) -> float:
    """The variance of a window's log-latency level beyond what its one-minute batch means show (they
    see load that wanders faster than a minute; slower wander moves whole batches together): from the
    windows' sub-window series, ``(b · Y_b - Y_1) / M`` with ``Y_b`` the pooled within-window variance of
    ``b``-sub-window batch means (``b`` about a sixth of the window) and ``M`` the sub-windows per window. The
    sub-windows a quiesce probe paused are left out, as in ``rate_extra``: they hold no request or the few sent
    around the pause (seen: 60-s windows with an 8-s drain, one window in two left out whole for its one empty
    sub-window)."""
    ss1 = ss_b = 0.0
    df1 = df_b = 0
    ms: list[int] = []
    for w in windows:
        sub = w.subwindows
        if sub is None:
            continue
        paused = paused_subwindows(w)
        if paused is None:
            continue
        vals = getattr(sub, family, None) or []
        x = [math.log(v) if v is not None and v > 0 else None for i, v in enumerate(vals) if i not in paused]
        m = len(x)
        # at least 10 sub-windows (every window shorter than 10 minutes has 10), 6 of them not paused (3 batches)
        if len(vals) < 10 or m < 6 or any(v is None for v in x):
            continue
        xs = [v for v in x if v is not None]
        mean = sum(xs) / m
        ss1 += sum((v - mean) ** 2 for v in xs)
        df1 += m - 1
        b, sums = _batch_sums(xs)
        k = len(sums)
        bm = [v / b for v in sums]
        bmean = sum(bm) / k
        # b x the batch means' squares, per window: a pause can give a window other batches than the rest
        ss_b += b * sum((v - bmean) ** 2 for v in bm)
        df_b += k - 1
        ms.append(m)
    if not ms or df1 <= 0 or df_b <= 0:
        return 0.0
    m_avg = sum(ms) / len(ms)
    return max(0.0, (ss_b / df_b - ss1 / df1) / m_avg)


def paused_subwindows(w: WindowSummary) -> set[int] | None:
    """The sub-windows of ``w`` its quiesce probe's pause touched (no request is sent while the load is paused and
    in-flight ones drain, so their counts fall to nothing): none where the window did not pause, None where it paused
    and no probe of its own places the pause (a probe of the window before whose drain ran into it, one abandoned)."""
    sub = w.subwindows
    if not w.paused_seconds:
        return set()
    q = w.quiesce
    if sub is None or q is None or q.seconds is None or not sub.seconds > 0:
        return None
    first = math.floor((q.t_unix - w.start_unix) / sub.seconds)
    last = math.floor((q.t_unix + q.seconds - w.start_unix) / sub.seconds)
    return set(range(max(0, first), last + 1))


def rate_extra(windows: list[WindowSummary]) -> float:
    """The variance of a window's log-throughput level beyond the Poisson count its interval assumes: from the
    windows' per-minute counts of successful requests, ``(D - 1) / N`` with ``D`` the pooled dispersion of
    ``b``-sub-window batch counts (their variance over their mean, ``b`` about a sixth of the window: the clustering
    a minute's count shows and the correlation between minutes) and ``N`` a window's mean count. A closed loop whose
    speed follows the batch completes requests in waves (seen: a window's level varying 2.5 times as much as its
    Poisson interval says, and pages from windows of healthy throughput); an open loop's Poisson arrivals give
    ``D`` near 1 and nothing extra. Token throughput takes the same: its interval is the requests' compound
    Poisson one, and the waves are of requests. The sub-windows a quiesce probe paused are left out
    (``paused_subwindows``; a window that paused where no probe of its own says when is left out whole): every window
    pauses once, and its gap is no wave (seen: `make demo`'s 20-second windows, two sub-windows of ten empty in each,
    put the change a throughput page catches at 220%; at 30-minute windows a drain of a minute doubles the
    throughput's standard error)."""
    ss = 0.0
    df = 0
    inv_n: list[float] = []
    for w in windows:
        sub = w.subwindows
        if sub is None:
            continue
        paused = paused_subwindows(w)
        if paused is None:
            continue
        c = [v for i, v in enumerate(sub.ok) if i not in paused]
        total = sum(c)
        # a window of at least 10 sub-windows (every window shorter than 10 minutes has 10), 6 of them not paused
        # (3 batches): the 1-2 a probe pauses in a short window must not leave the window out (seen: then every
        # window of a 60-s closed-loop run was left out, no wave was allowed, and 3% of healthy runs paged tokens/s)
        if len(sub.ok) < 10 or len(c) < 6 or total <= 0:
            continue
        _, batches = _batch_sums([float(v) for v in c])
        k = len(batches)
        mean = sum(batches) / k
        if mean <= 0:
            continue
        ss += sum((x - mean) ** 2 for x in batches) / mean  # (k - 1) x the batch counts' dispersion
        df += k - 1
        inv_n.append(1.0 / total)
    if df <= 0:
        return 0.0
    return max(0.0, ss / df - 1.0) * sum(inv_n) / len(inv_n)


def extra_of(metric: str, windows: list[WindowSummary]) -> float:
    """The variance beyond a window's own interval that the sub-windows show for ``metric``: a latency quantile's
    slower wander (``long_run_extra``), a throughput's waves (``rate_extra``); none for the others."""
    fam = family_of(metric)
    if fam is not None:
        return long_run_extra(windows, fam)
    if metric in THROUGHPUT:
        return rate_extra(windows)
    return 0.0


def with_extra(series: list[Level], extra: float) -> list[Level]:
    if extra <= 0:
        return series
    return [Level(lv.window, lv.y, lv.var + extra, lv.value, lv.n, lv.start_unix) for lv in series]


def noise_floor(series: list[Level], moved_from: int | None = None, dropped: frozenset[int] = frozenset(),
                bound: float = TAU2_BOUND, detrend: bool = False) -> float:
    """The between-window noise floor beyond every window's own variance (``series``' variances hold
    the sub-windows' slower wander already): the mean squared successive difference's ``bound`` upper
    confidence bound (chi-square at its degrees of freedom) less the windows' own variance. Nothing is
    winsorised (the live rule passes the windows before the segments it tests: a step it is about to
    page on is not in them, and load that wanders over hours is what the floor is for). The pool check's
    findings are left out: the windows it dropped and the differences across them (windows that differ from the
    pool's others may be a step's first windows: the difference from before them to after them holds the step),
    the difference across the change it found. ``detrend``: the differences' mean is taken out first (one degree of
    freedom less; not with a single difference): a series that climbs (the pool check found a climb) holds its climb in
    every difference, the one across ``moved_from`` (the climb's first) too."""
    series = [lv for lv in series if lv.window not in dropped]
    pairs = [(a, b) for a, b in zip(series, series[1:])
             if (moved_from is None or detrend or not a.window < moved_from <= b.window)
             and not any(a.window < d < b.window for d in dropped)]
    if not pairs:
        return 0.0
    df = len(pairs)
    diffs = [b.y - a.y for a, b in pairs]
    within = sum((a.var + b.var) / 2.0 for a, b in pairs) / df
    mean = 0.0
    if detrend and df >= 2:  # (one difference has no mean to take out: the climb stays in it, the cautious answer)
        mean = sum(diffs) / df
        df -= 1
    s = sum((x - mean) ** 2 for x in diffs) / (2.0 * df)
    return max(0.0, max(s, within) * df / float(sps.chi2.ppf(1.0 - bound, df)) - within)


@dataclass(frozen=True)
class PoolCheck:
    """What the pool's windows say of themselves, per metric."""

    reference: tuple[int, ...]  # the windows every comparison is made against
    moved_from: int | None = None  # a degradation began inside the pool at this window: the reference is before it
    dropped: tuple[int, ...] = ()  # pool windows worse than the rest (a blip): no reference, not judged live
    stat: float = 0.0  # the change's size in standard errors
    climb: bool = False  # the change is a climb: every pool window worse than the one before it (moved_from: window 1)

    @property
    def checked(self) -> bool:
        return self.moved_from is None and not self.dropped


def _worse(metric: str) -> float:
    return 1.0 if METRICS[metric].higher_is_worse else -1.0


def _delta0(metric: str, cfg: DriftConfig) -> float:
    thr = cfg.threshold_for(metric)
    return thr if METRICS[metric].absolute else math.log1p(thr)


def check_pool(metric: str, pool: list[Level], cfg: DriftConfig, extra: float = 0.0,
               z: float = POOL_Z, steps: bool = True) -> PoolCheck:
    """Test the pool before trusting it. A *step*: the pool windows from ``k`` on worse than the mean of
    those before it by ``z`` standard errors, each of them by more than the threshold -> the reference is
    the windows before ``k`` (a regression that began inside the pool is a regression). Else a *climb*: every window
    worse than the one before it (a latency) -> the reference is the first window. Else a *blip*: a
    window worse than the median of the others by the threshold and ``z`` standard errors -> dropped. Each window's variance is its own plus
    ``extra`` (the slower wander its sub-windows show, and at the end of the run the noise floor of the
    whole run). ``steps``: look for a step too (at the end of the run: live, four windows cannot tell a
    step from load that wanders over hours; the end of the run can)."""
    ws = tuple(lv.window for lv in pool)
    if len(pool) < 2:
        return PoolCheck(ws)
    sgn = _worse(metric)
    d0 = _delta0(metric, cfg)
    v = [lv.var + extra for lv in pool]
    y = [sgn * lv.y for lv in pool]  # worse is up
    best: tuple[float, int] | None = None
    for k in range(1, len(pool) if steps else 1):
        ref_y = sum(y[:k]) / k
        ref_v = sum(v[:k]) / k**2
        later = len(pool) - k
        t = (sum(y[k:]) / later - ref_y) / math.sqrt(sum(v[k:]) / later**2 + ref_v)
        if min(y[k:]) - ref_y > d0 and t > z and (best is None or t > best[0]):
            best = (t, k)
    if best is not None:
        t, k = best
        return PoolCheck(ws[:k], moved_from=pool[k].window, stat=t)
    # a *climb* of a latency (or J/token): every window worse than the one before it by CLIMB_Z standard errors of
    # their difference, the last worse than the first beyond the threshold and by ``z`` -> the reference is the first
    # window (a throughput that falls window by window is a closed loop settling, or the arrival rate; no blip: the last
    # windows of a climb are each worse than the median of the others; dropped, they left the climb's first
    # differences as the noise floor, at one or two degrees of freedom, and the page waited for windows after the pool)
    rise = y[-1] - y[0]
    t_rise = rise / math.sqrt(v[0] + v[-1])
    if (sgn > 0 and len(pool) >= 3 and rise > d0 and t_rise > z
            and all(y[i + 1] - y[i] > CLIMB_Z * math.sqrt(v[i] + v[i + 1]) for i in range(len(pool) - 1))):
        return PoolCheck(ws[:1], moved_from=pool[1].window, stat=t_rise, climb=True)
    dropped = []
    worst = 0.0
    for i in range(len(pool)):
        others = sorted(y[j] for j in range(len(pool)) if j != i)
        n = len(others)
        med = others[n // 2] if n % 2 else (others[n // 2 - 1] + others[n // 2]) / 2.0
        v_med = math.pi / 2.0 * sum(v[j] for j in range(len(pool)) if j != i) / n**2
        t = (y[i] - med) / math.sqrt(v[i] + v_med)
        if y[i] - med > d0 and t > z:
            dropped.append((t, i))
            worst = max(worst, t)
    if dropped and len(pool) - len(dropped) < 2:
        dropped = [max(dropped)]
    if len(pool) - len(dropped) < 2:
        dropped = []
    gone = {i for _, i in dropped}
    return PoolCheck(tuple(w for i, w in enumerate(ws) if i not in gone),
                     dropped=tuple(ws[i] for i in sorted(gone)), stat=worst)


def _reference_mean(reference: list[Level], extra: float, tau2: float) -> tuple[float, float]:
    """The reference's mean level and that mean's variance (each window's own, ``extra`` and ``tau2``)."""
    n = len(reference)
    return sum(lv.y for lv in reference) / n, sum(lv.var + extra + tau2 for lv in reference) / n**2


@dataclass(frozen=True)
class Scan:
    """The sequential rule's answer for one metric at one window."""

    side: int  # the paged change's sign on the analysis scale (+1: the level rose; worse for a latency), 0: no page
    windows: int  # the segment that paged (or 1)
    d: float  # the segment's mean level less the reference's (analysis scale)
    se: float
    d1: float  # the last window alone
    se1: float


def scan(metric: str, post: list[Level], reference: list[Level], tau2: float, extra: float, z: float,
         cfg: DriftConfig, excess_z: float = EXCESS_Z) -> Scan | None:
    """The last ``SCAN`` windows of ``post`` (the windows after the reference, the current one last): for
    each segment of the last ``L`` of them, its mean level against the reference's mean. A page when, for
    some ``L``, the change is *worse* (latency up, throughput down) beyond the threshold by ``excess_z``
    standard errors *and* beyond zero by ``z`` (the run-level significance, one-sided), and, for ``L`` > 1,
    the current window's own change is worse beyond the threshold too. An improvement never pages (the
    verdict fails on none: the end of the run reports it). None without a reference or a window."""
    if not post or not reference:
        return None
    d0 = _delta0(metric, cfg)
    sgn = _worse(metric)
    ref_y, ref_v = _reference_mean(reference, extra, tau2)
    first: tuple[float, float] | None = None
    hit: tuple[int, int, float, float] | None = None
    now = post[-1].y - ref_y  # the current window's own change
    for L in range(1, min(SCAN, len(post)) + 1):
        part = post[-L:]
        d = sum(lv.y for lv in part) / L - ref_y
        var = sum(lv.var + extra + tau2 for lv in part) / L**2 + ref_v
        se = math.sqrt(var)
        if first is None:
            first = (d, se)
        # a segment of several windows pages only while its last window is itself worse beyond the threshold:
        # a blip followed by a window back at the baseline is no change now (seen: a throttled window's +30%
        # paged again one window later as "drift: ttft_p50 -0.6%")
        if (hit is None and sgn * d - d0 > excess_z * se and sgn * d > z * se
                and (L == 1 or sgn * now > d0)):
            hit = (1 if d > 0 else -1, L, d, se)
    assert first is not None
    if hit is None:
        return Scan(0, 1, first[0], first[1], first[0], first[1])
    side, L, d, se = hit
    return Scan(side, L, d, se, first[0], first[1])


def grown_reference(metric: str, reference: list[Level], after: list[Level], tau2: float, extra: float,
                    cfg: DriftConfig, agree_z: float = AGREE_Z) -> list[Level]:
    """The reference and the windows of ``after`` that agree with it: each one's level within the threshold of
    the reference's mean *and* within ``agree_z`` standard errors of it (its own variance, ``extra``, ``tau2``
    and the reference's). ``after``: the windows after the reference that are older than the segments the scan
    tests. A window that disagrees is left out, not the windows after it (load that wandered comes back); a
    regression's windows disagree and never join, so it cannot hide in the reference. Each window is judged
    against the checked reference alone, not the grown one: the answer does not depend on the order."""
    if not reference or not after:
        return reference
    d0 = _delta0(metric, cfg)
    ref_y, ref_v = _reference_mean(reference, extra, tau2)
    out = list(reference)
    for lv in after:
        d = lv.y - ref_y
        if abs(d) <= d0 and abs(d) <= agree_z * math.sqrt(lv.var + extra + tau2 + ref_v):
            out.append(lv)
    return out


def detectable(metric: str, window_var: float, reference: list[Level], tau2: float, extra: float,
               z: float, cfg: DriftConfig, windows: int = 2, excess_z: float = EXCESS_Z) -> float:
    """The smallest change a page catches within ``windows`` windows about half the time (the segment of
    that many windows just reaching both bounds), on the metric's scale (relative, or absolute), in the direction
    a page is for: a latency's rise, a throughput's fall (``1 - e^-d`` of the log-scale ``d``: a fall is never
    beyond 100%; written as the rise ``e^d - 1`` it read 220% for `make demo`'s tokens/s)."""
    ref_v = _reference_mean(reference, extra, tau2)[1]
    se = math.sqrt((window_var + extra + tau2) / windows + ref_v)
    d = max(_delta0(metric, cfg) + excess_z * se, z * se)
    if METRICS[metric].absolute:
        return d
    return math.expm1(d) if METRICS[metric].higher_is_worse else -math.expm1(-d)

"""Leaks: a robust trend of memory-like quantities across windows, and the idle KV residue.

Method:

* One value per full window and source, at comparable load (the mix is stratified, so every
  window carries the same load):

  - ``device_memory``: ``device.memory_used_bytes.min``. Within a window, used memory rises
    and falls with the batch (activations, allocator caches); the window *minimum* is the floor
    the allocator came back to at the window's lightest moment. A leak raises that floor, a
    load spike only raises the maximum, so the minimum is the comparable value.
  - ``target_gpu_memory``: ``device.target_gpu_memory_bytes.min`` (the target process's own
    GPU memory), same reason.
  - ``target_rss``: the target's host memory: ``host.target_anon_bytes.min`` (anonymous resident memory
    plus swap, /proc in a shared PID namespace) where there is one, else ``host.target_rss_bytes.min``
    (its resident set from /proc, or the server's own ``process_resident_memory_bytes``), same reason.
  - ``kv_cache``: ``server.kv_cache_usage_ratio.mean`` per running request
    (``server.requests_running.mean``), scaled to the run's median running count
    (``kv_at_median_load``): KV usage at the same load, so that a slower server, which holds more
    requests at once, is not a KV leak; growth in ratio per hour, not bytes.

  Partial windows (the one cut at shutdown) are left out.
* Byte sources (device memory, the target's GPU memory and RSS) are classified by their
  pattern (``memory_pattern``): ramp then flat (warm-up), one-off step, sawtooth, sustained
  climb; only the *sustained* part is judged (from a third of the series on, after the last
  step, or the sawtooth's troughs), so a warm-up or a one-off allocation is never a leak, and a
  finding made early is revised as the run goes on (the verdict uses the last judgement). Device
  memory is read from the idle quiesce probes (load paused, requests drained) when there are
  enough of them: the cleanest reading of what the server keeps. A sustained climb is always a
  finding; it fails the run when memory runs out at that rate within
  ``exhaustion_budget_hours`` (default 7 days).
* The trend (KV usage, and each judged part) is the Theil–Sen slope (median of all pairwise slopes) against the window's mid
  time, in units per hour, with Sen's distribution-free confidence interval from Kendall's S
  (variance ``n(n-1)(2n+5)/18``, minus the usual correction for tied values). It ignores up to
  ~29% outliers (a window with a transient spike) and needs no normality.
* A source is ``significant`` when the whole interval is above 0, and ``suspected`` when it is
  significant **and** the growth projected over ``horizon_hours`` exceeds the source's budget:
  a real but harmless creep (a few MiB a day of allocator fragmentation) is reported, not
  accused. Fewer than ``min_windows`` windows is ``"insufficient"``.
* Idle KV residue (quiesce probes: load paused, in-flight drained): the residue is the idle KV
  usage minus the *first* idle value. Suspected when the residue grows significantly from probe
  to probe (Theil–Sen interval above 0) and its fitted value at the last probe exceeds
  ``kv_residue_budget_ratio``: the clearest sign of a KV cache that is not released.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Literal

from soakd.analysis.stats import as_float, z_value
from soakd.config.analysis import LeakConfig
from soakd.core.summary import WindowSummary

__all__ = [
    "LEAK_SOURCES",
    "MAX_POINTS",
    "LeakResult",
    "evaluate",
    "evaluate_memory",
    "kv_residue",
    "memory_series",
    "quiesce_probes",
    "theil_sen",
]

MAX_POINTS = 500  # Theil-Sen is O(n^2) pairs; longer series are subsampled evenly to this many points

LEAK_SOURCES: tuple[str, ...] = ("device_memory", "target_gpu_memory", "target_rss", "kv_cache")

Window = WindowSummary


# ---------------------------------------------------------------------------------------------
# Theil-Sen with Sen's interval


def theil_sen(
    xs: list[float], ys: list[float], confidence: float = 0.95
) -> tuple[float, float, float] | None:
    """``(slope, lo, hi)``: Theil–Sen slope and Sen's rank-based ``confidence`` interval.

    Pairs with equal x are skipped. Ties in y reduce Kendall's variance (the standard tie
    correction). The interval's ranks ``(N - C)/2`` and ``(N + C)/2 + 1`` among the ``N`` sorted
    pairwise slopes (``C = z sqrt(Var S)``) are rounded outwards; a bound whose rank falls off
    the list is infinite (with 95% confidence that happens below 6 points). Beyond ``MAX_POINTS``
    points, that many are taken evenly spaced in x order. None with fewer than two distinct x.
    """
    pts = sorted((float(x), float(y)) for x, y in zip(xs, ys) if x is not None and y is not None)
    pts = [(x, y) for x, y in pts if math.isfinite(x) and math.isfinite(y)]
    n = len(pts)
    if n > MAX_POINTS:
        pts = [pts[round(i * (n - 1) / (MAX_POINTS - 1))] for i in range(MAX_POINTS)]
        n = len(pts)
    slopes = []
    for i in range(n):
        xi, yi = pts[i]
        for j in range(i + 1, n):
            xj, yj = pts[j]
            if xj != xi:
                slopes.append((yj - yi) / (xj - xi))
    if not slopes:
        return None
    slopes.sort()
    big_n = len(slopes)
    slope = statistics.median(slopes)
    ties: dict[float, int] = {}
    for _, y in pts:
        ties[y] = ties.get(y, 0) + 1
    var = (n * (n - 1) * (2 * n + 5) - sum(t * (t - 1) * (2 * t + 5) for t in ties.values())) / 18.0
    c = z_value(confidence) * math.sqrt(max(0.0, var))
    m1 = math.floor((big_n - c) / 2.0 + 1e-9)  # 1-based rank of the lower bound
    m2 = math.ceil((big_n + c) / 2.0 - 1e-9) + 1  # 1-based rank of the upper bound
    lo = slopes[m1 - 1] if 1 <= m1 <= big_n else -math.inf
    hi = slopes[m2 - 1] if 1 <= m2 <= big_n else math.inf
    return slope, min(lo, slope), max(hi, slope)


def _intercept(xs: list[float], ys: list[float], slope: float) -> float:
    return statistics.median(y - slope * x for x, y in zip(xs, ys))


# ---------------------------------------------------------------------------------------------
# results


@dataclass(frozen=True)
class LeakResult:
    source: str  # device_memory | target_gpu_memory | target_rss | kv_cache | kv_residue
    status: Literal["ok", "suspected", "insufficient", "no_data"]
    growth_per_hour: float | None  # bytes/h, or ratio/h for kv_cache and kv_residue
    ci: tuple[float, float] | None
    significant: bool
    projected: float | None  # growth x horizon (kv_residue: fitted residue at the last probe)
    budget: float
    suspected: bool
    n_windows: int  # windows (or probes) used
    unit: Literal["bytes", "ratio"] = "bytes"
    horizon_hours: float = 24.0
    first: float | None = None
    last: float | None = None
    residue: float | None = None  # kv_residue: observed residue at the last probe
    pattern: str | None = None  # flat | ramp then flat | one-off step | sawtooth | sustained climb
    hours_to_exhaustion: float | None = None  # at the measured rate, from the last fitted value
    fails: bool = False  # suspected and within the budget: fails the run
    points: str = "windows"  # what was judged: window floors, or idle quiesce probes
    sustained_from_hours: float | None = None  # the start of the judged (sustained) part, hours into the series

    def message(self) -> str:
        if self.growth_per_hour is None:
            return f"{self.source}: {self.status} ({self.n_windows} windows)"
        if self.unit == "bytes":
            def f(v: float) -> str:
                return f"{v / 2**20:+.1f} MiB"
        else:
            def f(v: float) -> str:
                return f"{v * 100:+.2f} pts"
        ci = f" (CI {f(self.ci[0])}..{f(self.ci[1])})" if self.ci else ""
        if self.source == "kv_residue":
            return (
                f"idle KV residue {f(self.residue or 0.0)} at the last of {self.n_windows} probes, growing "
                f"{f(self.growth_per_hour)}/h{ci}, fitted {f(self.projected or 0.0)} vs budget "
                f"{f(self.budget)}: {self.status}"
            )
        if self.pattern is not None:
            what = f"{self.source} ({'idle, ' if self.points == 'probes' else ''}{self.n_windows} {self.points}): " \
                   f"{self.pattern}, sustained part grows {f(self.growth_per_hour)}/h{ci}"
            if self.hours_to_exhaustion is not None:
                what += f", memory exhausted in {self.hours_to_exhaustion:.0f} h at this rate"
            return f"{what}: {self.status}{' (within the budget: fails the run)' if self.fails else ''}"
        return (
            f"{self.source} grows {f(self.growth_per_hour)}/h{ci} over {self.n_windows} windows, "
            f"{f(self.projected or 0.0)} in {self.horizon_hours:g}h vs budget {f(self.budget)}: {self.status}"
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ci"] = list(self.ci) if self.ci else None
        return d


_num = as_float


# source -> (the window's statistic of it, the comparable value: the floor, or KV's mean)
_SOURCES: dict[str, tuple[Any, str]] = {
    "device_memory": (lambda w: w.device.memory_used_bytes, "min"),
    "target_gpu_memory": (lambda w: w.device.target_gpu_memory_bytes, "min"),
    # anonymous memory + swap where /proc shows it (a leak swapped out leaves RSS, not this), else RSS
    "target_rss": (lambda w: w.host.target_anon_bytes or w.host.target_rss_bytes, "min"),
    "kv_cache": (lambda w: w.server.kv_cache_usage_ratio, "mean"),
}


def _source_value(window: Window, source: str) -> float | None:
    if source not in _SOURCES:
        raise KeyError(f"unknown leak source {source!r}; known: {LEAK_SOURCES}")
    get, field = _SOURCES[source]
    stat = get(window)
    return _num(getattr(stat, field)) if stat is not None else None


def memory_series(windows: list[Window], source: str) -> list[tuple[float, float]]:
    """``(mid-window unix time, comparable value)`` of a source over the full windows."""
    out = []
    for w in sorted(windows, key=lambda w: w.window):
        if w.partial:
            continue
        v = _source_value(w, source)
        t = _num(w.start_unix)
        if v is None or t is None:
            continue
        out.append((t + w.duration_seconds / 2.0, v))
    return out


def kv_at_median_load(windows: list[Window]) -> list[tuple[float, float]]:
    """The ``kv_cache`` series at comparable load: each window's mean KV usage scaled to the run's
    median number of running requests, ``usage x median(running) / running``.

    Under load, KV usage is the blocks of the requests in flight: a server that got slower holds
    more requests at once at the same arrival rate (Little's law), and its KV usage rises with them
    without a block leaked; when the latency recovers, so does the usage. Per running request, the
    usage moves only with what a request holds (its context, and blocks that are never released).
    Windows without the server's running count (or with less than half a request running on
    average) are judged on the raw mean when no window has one, else left out."""
    raw = memory_series(windows, "kv_cache")
    running: dict[float, float] = {}
    for w in windows:
        r = w.server.requests_running
        t = _num(w.start_unix)
        if w.partial or r is None or t is None or _num(r.mean) is None:
            continue
        running[t + w.duration_seconds / 2.0] = float(r.mean)
    loaded = [(t, v, running[t]) for t, v in raw if running.get(t, 0.0) >= 0.5]
    if not loaded:
        return raw
    med = statistics.median(r for _, _, r in loaded)
    return [(t, v * med / r) for t, v, r in loaded]


def _trend(
    source: str, pts: list[tuple[float, float]], budget: float, unit: str, cfg: LeakConfig
) -> LeakResult:
    common = dict(source=source, budget=budget, unit=unit, horizon_hours=cfg.horizon_hours, n_windows=len(pts))
    if not pts:
        return LeakResult(status="no_data", growth_per_hour=None, ci=None, significant=False, projected=None,
                          suspected=False, **common)  # fmt: skip
    first, last = pts[0][1], pts[-1][1]
    t0 = pts[0][0]
    fit = theil_sen([(t - t0) / 3600.0 for t, _ in pts], [v for _, v in pts], cfg.confidence)
    if len(pts) < cfg.min_windows or fit is None:
        return LeakResult(
            status="insufficient", growth_per_hour=fit[0] if fit else None, ci=(fit[1], fit[2]) if fit else None,
            significant=False, projected=None, suspected=False, first=first, last=last, **common,
        )  # fmt: skip
    slope, lo, hi = fit
    significant = lo > 0
    projected = slope * cfg.horizon_hours
    suspected = significant and projected > budget
    return LeakResult(
        status="suspected" if suspected else "ok", growth_per_hour=slope, ci=(lo, hi), significant=significant,
        projected=projected, suspected=suspected, first=first, last=last, fails=suspected, **common,
    )  # fmt: skip


def evaluate_memory(windows: list[Window], source: str, cfg: LeakConfig | None = None) -> LeakResult:
    """One source over the run's full windows (see the module docstring): byte sources by their
    pattern (``memory_pattern``; device memory from the idle quiesce probes when there are enough),
    the KV usage by its trend."""
    cfg = cfg or LeakConfig()
    if source == "kv_cache":
        return _trend(source, kv_at_median_load(windows), cfg.budget_for(source), "ratio", cfg)
    pts, points = memory_series(windows, source), "windows"
    if source == "device_memory":
        probes = quiesce_probes(windows, "memory_used_bytes")
        if len(probes) >= cfg.min_windows or len(probes) >= len(pts):
            pts, points = probes, "probes"
    total = None
    if source in ("device_memory", "target_gpu_memory"):
        totals = [w.device.memory_total_bytes for w in windows if w.device.memory_total_bytes]
        total = max(totals) if totals else None
    return memory_pattern(source, pts, cfg, total=total, points=points)


def _mad_sigma(d: list[float]) -> float:
    """The spread of the successive differences themselves (median absolute deviation, normal scale):
    a jump is judged against what a difference of two noisy readings does."""
    med = statistics.median(d)
    return 1.4826 * statistics.median(abs(x - med) for x in d)


def memory_pattern(source: str, pts: list[tuple[float, float]], cfg: LeakConfig, *, total: float | None = None,
                   points: str = "windows") -> LeakResult:
    """Classify a memory series ``(t_unix, bytes)`` and judge its sustained part.

    * Noise ``sigma``: the successive differences' MAD (normal scale). A *jump* is a difference
      beyond ``max(5 sigma, step_bytes)``; consecutive jumps up are a ramp.
    * A jump down is a *release*: the series is a **sawtooth**; judged on its troughs (the first
      reading and each reading after a release), needing 3 of them.
    * Otherwise the judged part starts at a third of the series, or after the last isolated jump
      up (a **one-off step**: a jump while the typical difference is small), whichever is later;
      it needs ``min_windows`` readings spanning ``min_span`` (4 hours).
    * Sen's slope of the judged part with its interval: above 0 is a **sustained climb** (always a
      finding, ``suspected``); a climb before the judged part that has stopped is **ramp then flat**
      (warm-up); else **flat**.
    * A sustained climb fails the run (``fails``) when memory runs out at that rate within
      ``exhaustion_budget_hours`` (from ``total``, the device's memory), or, with no total known,
      when its growth over ``horizon_hours`` exceeds the source's budget.
    """
    budget = cfg.budget_for(source)
    pts = sorted(pts)
    n = len(pts)
    common = dict(source=source, budget=budget, unit="bytes", horizon_hours=cfg.horizon_hours, n_windows=n,
                  points=points)  # fmt: skip
    if not pts:
        return LeakResult(status="no_data", growth_per_hour=None, ci=None, significant=False, projected=None,
                          suspected=False, **common)  # fmt: skip
    t0 = pts[0][0]
    xs = [(t - t0) / 3600.0 for t, _ in pts]
    ys = [v for _, v in pts]
    first, last = ys[0], ys[-1]
    if n < cfg.min_windows:
        fit = theil_sen(xs, ys, cfg.confidence)  # the rate so far, reported, not judged
        return LeakResult(status="insufficient", growth_per_hour=fit[0] if fit else None,
                          ci=(fit[1], fit[2]) if fit else None, significant=False, projected=None, suspected=False,
                          first=first, last=last, **common)  # fmt: skip
    d = [b - a for a, b in zip(ys, ys[1:])]
    sigma = _mad_sigma(d)
    jump = max(5.0 * sigma, float(cfg.step_bytes))
    typical = statistics.median(abs(x) for x in d)
    releases = [i for i, x in enumerate(d) if x < -jump]
    ups = {i for i, x in enumerate(d) if x > jump}
    # a step is an isolated jump (consecutive jumps are a ramp) while the typical difference is small
    steps = sorted(i for i in ups if i - 1 not in ups and i + 1 not in ups and typical < jump / 4.0)
    if releases:
        pattern = "sawtooth"
        idx = [0, *(i + 1 for i in releases)]
        jx, jy = [xs[i] for i in idx], [ys[i] for i in idx]
        start = 0
        fit = theil_sen(jx, jy, cfg.confidence) if len(idx) >= 3 else None
    else:
        start = n // 3
        if steps:
            start = max(start, steps[-1] + 1)
        jx, jy = xs[start:], ys[start:]
        long_enough = len(jx) >= cfg.min_windows and (jx[-1] - jx[0]) * 3600.0 >= cfg.min_span - 1e-9
        fit = theil_sen(jx, jy, cfg.confidence) if long_enough else None
        pattern = "flat"
        if steps:
            pattern = "one-off step"
        elif start > 0:
            early = theil_sen(xs[: start + 1], ys[: start + 1], cfg.confidence)
            if early is not None and early[1] > 0 and (fit is None or fit[0] < early[0] / 4.0):
                pattern = "ramp then flat"
    if fit is None:
        fit = theil_sen(jx, jy, cfg.confidence) if len(jx) >= 2 else None
        return LeakResult(status="insufficient", growth_per_hour=fit[0] if fit else None,
                          ci=(fit[1], fit[2]) if fit else None, significant=False, projected=None,
                          suspected=False, first=first, last=last, pattern=pattern,
                          sustained_from_hours=jx[0] if jx else None, **common)  # fmt: skip
    slope, lo, hi = fit
    significant = lo > 0 and slope > 0
    if significant:
        pattern = "sawtooth with a rising floor" if releases else "sustained climb"
    fitted_last = _intercept(jx, jy, slope) + slope * xs[-1]
    hours = None
    if significant and total:
        hours = max(0.0, (total - max(fitted_last, last)) / slope)
    projected = slope * cfg.horizon_hours
    if hours is not None:
        fails = hours <= cfg.exhaustion_budget_hours
    else:
        fails = significant and projected > budget
    return LeakResult(
        status="suspected" if significant else "ok", growth_per_hour=slope, ci=(lo, hi), significant=significant,
        projected=projected, suspected=significant, first=first, last=last, pattern=pattern,
        hours_to_exhaustion=hours, fails=significant and fails, sustained_from_hours=jx[0], **common,
    )  # fmt: skip


def quiesce_probes(windows: list[Window], field: str = "kv_cache_usage_ratio") -> list[tuple[float, float]]:
    """``(t_unix, idle value)`` of every window's quiesce probe that measured ``field``."""
    out = []
    for w in sorted(windows, key=lambda w: w.window):
        q = w.quiesce
        if q is None:
            continue
        t, v = _num(q.t_unix), _num(getattr(q, field))
        if t is not None and v is not None:
            out.append((t, v))
    return out


def kv_residue(probes: list[tuple[float, float]], cfg: LeakConfig | None = None) -> LeakResult:
    """Idle KV residue across quiesce probes ``(t_seconds, idle KV usage ratio)``.

    Residue = idle usage - the first idle usage. ``growth_per_hour`` is its Theil–Sen slope,
    ``projected`` its fitted value at the last probe, ``residue`` the observed last one.
    Suspected when the growth is significant and the fitted residue exceeds
    ``kv_residue_budget_ratio``. Needs ``min_windows`` probes.
    """
    cfg = cfg or LeakConfig()
    pts = sorted((float(t), float(v)) for t, v in probes if t is not None and v is not None)
    budget = cfg.kv_residue_budget_ratio
    common = dict(source="kv_residue", budget=budget, unit="ratio", horizon_hours=cfg.horizon_hours,
                  n_windows=len(pts))  # fmt: skip
    if not pts:
        return LeakResult(status="no_data", growth_per_hour=None, ci=None, significant=False, projected=None,
                          suspected=False, **common)  # fmt: skip
    t0, r0 = pts[0]
    xs = [(t - t0) / 3600.0 for t, _ in pts]
    res = [v - r0 for _, v in pts]
    fit = theil_sen(xs, res, cfg.confidence)
    if len(pts) < cfg.min_windows or fit is None:
        return LeakResult(
            status="insufficient", growth_per_hour=fit[0] if fit else None, ci=(fit[1], fit[2]) if fit else None,
            significant=False, projected=None, suspected=False, first=r0, last=pts[-1][1], residue=res[-1],
            **common,
        )  # fmt: skip
    slope, lo, hi = fit
    fitted_last = _intercept(xs, res, slope) + slope * xs[-1]
    significant = lo > 0
    suspected = significant and fitted_last > budget
    return LeakResult(
        status="suspected" if suspected else "ok", growth_per_hour=slope, ci=(lo, hi), significant=significant,
        projected=fitted_last, suspected=suspected, first=r0, last=pts[-1][1], residue=res[-1], fails=suspected,
        **common,
    )  # fmt: skip


def evaluate(windows: list[Window], cfg: LeakConfig | None = None) -> list[LeakResult]:
    """Every source's trend, plus the idle KV residue from the windows' quiesce probes."""
    cfg = cfg or LeakConfig()
    out = [evaluate_memory(windows, s, cfg) for s in LEAK_SOURCES]
    out.append(kv_residue(quiesce_probes(windows), cfg))
    return out

"""The drift detector: the baseline pool, each window's live comparisons against it and against the
previous window, and at the end of the run the change points, trends and periodic drops — as one
``soakd.analysis.detector.Detector``. The statistics are ``soakd.analysis.changes`` and
``soakd.analysis.levels``; this is their bookkeeping over a run (derivation: docs/analysis.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from soakd.analysis import changes as changes_mod
from soakd.analysis import drift as drift_mod
from soakd.analysis import judged as judged_mod
from soakd.analysis import levels as levels_mod
from soakd.analysis import page as page_mod
from soakd.analysis.detector import RunContext, WindowContext, lagged, own_delay_span
from soakd.analysis.periodic import PeriodicDrops, periodic_drops
from soakd.config.analysis import AnalysisConfig
from soakd.core.findings import Finding
from soakd.core.summary import WindowSummary
from soakd.core.tracked import SERVER_MEANS

__all__ = ["DriftDetector", "DriftState"]

Window = WindowSummary
# the pool's test for a step is made live once this many windows after the pool give it a noise floor, up to the
# LATE_LAST-th (its cost grows with the series; the end of the run tests the whole run)
LATE_WINDOWS = 4
LATE_LAST = 20


def _unstable(ctx: WindowContext, w: Window, checks: dict[str, page_mod.PoolCheck], late: bool = False) -> None:
    """The ``baseline`` warning "baseline not stable" for the pool checks that moved the reference or dropped a
    window: at the pool's close, or (``late``) found later with the windows after the pool, at ``w``."""
    parts = [f"{m} climbed in every pool window from window {c.reference[0]} (reference: windows {list(c.reference)})"
             if c.climb else f"{m} moved from window {c.moved_from} (reference: windows {list(c.reference)})"
             if c.moved_from is not None else f"{m} differs in window(s) {list(c.dropped)} (left out of the reference)"
             for m, c in checks.items()]
    data: dict[str, Any] = {"checks": {m: {"reference": list(c.reference), "moved_from": c.moved_from,
                                           "dropped": list(c.dropped), "stat": c.stat, "climb": c.climb}
                                       for m, c in checks.items()}}
    text = "baseline not stable: " + "; ".join(parts)
    if late:
        text += f" (found with the windows after the pool, at window {w.window})"
        data["late"] = True
    ctx.emit("baseline", "warning", text, data, w.window)


@dataclass(frozen=True)
class DriftState:
    """What /metrics and /status show of drift: the baseline, the last comparisons, what is flagged."""

    baseline_window: int | None = None
    baseline_external: bool = False
    pool: tuple[int, ...] = ()
    drift: dict[tuple[str, str], drift_mod.DriftResult] = field(default_factory=dict)  # (metric, reference)
    active: dict[str, bool] = field(default_factory=dict)
    events: dict[str, int] = field(default_factory=dict)
    detectable: dict[str, float] = field(default_factory=dict)  # the smallest change a page catches in 2 windows
    checks: dict[str, page_mod.PoolCheck] = field(default_factory=dict)  # the pool's own test, per metric
    stability: dict[str, Any] = field(default_factory=dict)


class DriftDetector:
    name = "drift"
    partial = True  # a partial window joins no pool and has no live comparison; the run's stability follows it

    def __init__(self, cfg: AnalysisConfig, z_live: float, baseline: Window | None = None) -> None:
        self.cfg = cfg
        self.z_live = z_live
        self.pool: list[Window] = [baseline] if baseline is not None else []
        self.series: dict[str, list[levels_mod.Level]] = {m: [] for m in cfg.drift.metrics}
        self.detectable: dict[str, float] = {}
        self.baseline = baseline
        self.baseline_external = baseline is not None
        self.previous: Window | None = None
        self.drift: dict[tuple[str, str], drift_mod.DriftResult] = {}
        self.drift_events: dict[str, int] = dict.fromkeys(cfg.drift.metrics, 0)
        self.drift_active: dict[str, bool] = dict.fromkeys(cfg.drift.metrics, False)
        self.stability: dict[str, Any] = {}
        self.run_drift: changes_mod.RunDrift | None = None
        self.periodic: PeriodicDrops | None = None
        self.checks: dict[str, page_mod.PoolCheck] = {}  # set when the pool is complete (page.check_pool)
        self.judged: list[Window] = []  # the poolable windows so far (their sub-windows: the slow wander)

    # ---- the baseline pool and the level series
    def poolable(self, w: Window) -> bool:
        return judged_mod.not_judged_cause(w, self.cfg.drift.min_requests) is None

    @property
    def pool_complete(self) -> bool:
        return self.baseline_external or len(self.pool) >= self.cfg.drift.baseline_windows

    def _add_to_pool(self, w: Window) -> bool:
        if self.pool_complete or not self.poolable(w):
            return False
        self.pool.append(w)
        if self.baseline is None:
            self.baseline = w
        return True

    def _add_levels(self, w: Window) -> dict[str, levels_mod.Level]:
        out = {}
        for metric in self.cfg.drift.metrics:
            lv = levels_mod.level(w, metric, self.cfg.drift)
            if lv is not None:
                self.series[metric].append(lv)
                out[metric] = lv
        return out

    def _pool_levels(self, metric: str) -> list[levels_mod.Level]:
        out = []
        for p in self.pool:
            lv = levels_mod.level(p, metric, self.cfg.drift) if self.baseline_external else next(
                (x for x in self.series[metric] if x.window == p.window), None)
            if lv is not None:
                out.append(lv)
        return out

    def restore(self, windows: list[Window], baseline: Window | None = None) -> None:
        """Resume: the full windows of earlier segments, and the run's own baseline (the smallest change
        the pool can show, once it is complete)."""
        if baseline is not None and not self.baseline_external:
            self.baseline = baseline
        full = [w for w in windows if not w.partial]
        self.previous = full[-1] if full else None
        if not self.baseline_external:
            self.pool = []
        self.series = {m: [] for m in self.cfg.drift.metrics}
        self.judged = []
        for w in full:  # as the live run saw them: the pool's checks at its close, then window by window
            joined = self._add_to_pool(w)
            self._add_levels(w)
            if self.poolable(w):
                self.judged.append(w)
            if joined and self.pool_complete:
                self._check_pool()
                self._detectable()
            elif self.pool_complete and not joined:
                self._recheck_pool(w, None)  # said when the live run found it
        if self.baseline_external and full:
            self._detectable()
        self.stability = drift_mod.stability(full, self.cfg.drift)

    # ---- a window
    def _extra(self, metric: str, windows: list[Window] | None = None) -> float:
        """The variance beyond a window's interval that the sub-windows show (``page.extra_of``): a latency quantile's
        slower wander, a throughput's waves."""
        return page_mod.extra_of(metric, windows if windows is not None else self.judged)

    def _check_pool(self) -> None:
        """Test the pool before trusting it (``page.check_pool``), per metric."""
        self.checks = {}
        if self.baseline_external:
            return
        pool_windows = [p for p in self.pool]
        for metric in self.cfg.drift.metrics:
            pool = self._pool_levels(metric)
            if pool:
                self.checks[metric] = page_mod.check_pool(metric, pool, self.cfg.drift,
                                                          self._extra(metric, pool_windows), steps=False)

    def _recheck_pool(self, w: Window, ctx: WindowContext | None) -> None:
        """The pool's test for a step, live, once the windows after the pool give the noise floor it needs
        (``LATE_WINDOWS`` of them; then at every window up to the ``LATE_LAST``-th, as the end of the run tests
        it: ``check_pool`` with the noise floor of the series so far). A regression that began inside the pool
        moves the reference to the windows before it, and the windows since are paged against them; said as
        "baseline not stable"."""
        if self.baseline_external or not self.pool_complete:
            return
        last_pool = max(p.window for p in self.pool)
        moved = {}
        for metric in self.cfg.drift.metrics:
            check = self.checks.get(metric)
            if check is not None and not check.checked:  # moved already, or a blip left out of the reference
                continue
            if not changes_mod.METRICS[metric].higher_is_worse:
                # a latency only: a throughput that fell is a latency that rose in a closed loop (Little's law), and
                # an open loop's is its arrival rate; alone, it was a closed loop settling over its first window
                continue
            series = self.series[metric]
            if not LATE_WINDOWS <= sum(1 for lv in series if lv.window > last_pool) <= LATE_LAST:
                continue
            pool = self._pool_levels(metric)
            extra = self._extra(metric, list(self.pool))
            _, tau2, _ = changes_mod.change_points(series)
            c = page_mod.check_pool(metric, pool, self.cfg.drift, extra + tau2)
            if c.moved_from is not None:
                # confirmed with the live rule's own floor: its upper bound, every difference but the step's (a
                # floor from a few windows is often too small: a closed loop's throughput settling over the first
                # window moved the reference of a healthy run and paged)
                tau2 = page_mod.noise_floor(page_mod.with_extra(series, extra), moved_from=c.moved_from)
                c = page_mod.check_pool(metric, pool, self.cfg.drift, extra + tau2)
            if c.moved_from is not None:
                self.checks[metric] = c
                moved[metric] = c
        if moved:
            self._detectable()  # against the new reference
        if moved and ctx is not None:
            _unstable(ctx, w, moved, late=True)

    def _moved(self) -> dict[str, page_mod.PoolCheck]:
        """The pool checks that moved the reference live: the end of the run judges against the same windows
        (the live pages were made against them), the other metrics' pools are tested anew with the whole run."""
        return {m: c for m, c in self.checks.items() if c.moved_from is not None}

    def reference(self, metric: str) -> tuple[list[levels_mod.Level], int | None, frozenset[int]]:
        """The levels every live comparison of ``metric`` is made against, the first window after them
        that is judged live (None: after the pool), and the pool windows never judged (a blip)."""
        pool = self._pool_levels(metric)
        check = self.checks.get(metric)
        if check is None:
            return pool, None, frozenset()
        ref = [lv for lv in pool if lv.window in check.reference]
        return ref, check.moved_from, frozenset(check.dropped)

    def _climbed(self, metric: str) -> bool:
        """The pool check found a climb: the noise floor takes the climb out of the successive differences."""
        check = self.checks.get(metric)
        return check is not None and check.climb

    def _live(self, w: Window, current: dict[str, levels_mod.Level]) -> list[drift_mod.DriftResult]:
        """Every metric of ``w`` against its reference: the sequential rule of ``page.scan`` (the last
        one, two or three windows); against the previous window too, reported (never a page)."""
        cfg = self.cfg.drift
        out = []
        prev = self.previous
        last_pool = max((p.window for p in self.pool), default=-1)
        for metric in cfg.metrics:
            lv = current.get(metric)
            ref, moved_from, dropped = self.reference(metric)
            extra = self._extra(metric)
            # the noise floor from the windows before the segments the scan tests: a step must not hide itself
            history = self.series[metric][:-1] if lv is not None else self.series[metric]
            history = history[:max(len(self._pool_levels(metric)), len(history) - (page_mod.SCAN - 1))]
            tau2 = page_mod.noise_floor(page_mod.with_extra(history, extra), moved_from=moved_from, dropped=dropped,
                                        detrend=self._climbed(metric))
            if lv is None or not ref:
                r = drift_mod.compare(w, self.baseline, metric, cfg, reference_kind="baseline")
                out.append(replace(r, status="no_data" if r.status == "no_data" else "insufficient", direction=None))
            else:
                if self.baseline_external:
                    post = self.series[metric]
                else:
                    start = moved_from if moved_from is not None else last_pool + 1
                    post = [x for x in self.series[metric] if x.window >= start and x.window not in dropped]
                    # the windows after the pool that agree with it, older than the scan's segments, join the
                    # reference (a run's own baseline only: an external one is another run's); never the pool's
                    # own windows from the change on (a climb's first windows may be within the threshold)
                    ref = page_mod.grown_reference(metric, ref, [x for x in post[:-page_mod.SCAN]
                                                                 if x.window > last_pool], tau2, extra, cfg)
                r = self._scan_result(metric, lv, post, ref, tau2, extra)
                if metric in SERVER_MEANS and not lagged(w, self.cfg):  # soakd was punctual: its own latencies judge
                    r = replace(r, status="ok", direction=None, tier=None, windows=1, segment_ratio=None)
                out.append(r)
            if prev is None:
                continue
            p = next((x for x in reversed(self.series[metric]) if x.window == prev.window), None)
            if lv is None or p is None:
                r = drift_mod.compare(w, prev, metric, cfg, reference_kind="previous")
                out.append(replace(r, status="no_data" if r.status == "no_data" else "insufficient", direction=None))
                continue
            r = changes_mod.compare_levels(metric, lv, [p], tau2 + extra, self.z_live, cfg, reference_kind="previous")
            out.append(replace(r, status="ok", direction=None))
        return out

    def _scan_result(self, metric: str, lv: levels_mod.Level, post: list[levels_mod.Level],
                     ref: list[levels_mod.Level], tau2: float, extra: float) -> drift_mod.DriftResult:
        cfg = self.cfg.drift
        spec = changes_mod.METRICS[metric]
        thr = cfg.threshold_for(metric)
        sc = page_mod.scan(metric, post, ref, tau2, extra, self.z_live, cfg)
        assert sc is not None
        half = self.z_live * sc.se1
        ratio = changes_mod._ratio(metric, sc.d1)
        ci = (changes_mod._ratio(metric, sc.d1 - half), changes_mod._ratio(metric, sc.d1 + half))
        ref_y = sum(x.y for x in ref) / len(ref)
        direction = None
        tier = None
        if sc.side:
            direction = "degraded" if (sc.side > 0) == spec.higher_is_worse else "improved"
            tier = "confident"
        elif (ratio > thr and ci[0] > 0) or (ratio < -thr and ci[1] < 0):
            tier = "likely"
        return drift_mod.DriftResult(
            metric=metric, reference="baseline", value=lv.value, reference_value=ref_y if spec.absolute
            else math.exp(ref_y), ratio=ratio, ratio_ci=ci, status="drift" if sc.side else "ok",
            direction=direction, threshold=thr, n=lv.n, reference_n=sum(x.n for x in ref), window=lv.window,
            reference_window=ref[0].window if len(ref) == 1 else None, tier=tier,
            windows=sc.windows if sc.side else 1,
            segment_ratio=changes_mod._ratio(metric, sc.d) if sc.side else None)  # fmt: skip

    def _pool_done(self, w: Window, ctx: WindowContext) -> None:
        self._check_pool()
        mde = self._detectable()
        wins = [p.window for p in self.pool]
        text = ", ".join(f"{m} {changes_mod.format_change(m, v['within_2_windows'])[1:]}" for m, v in mde.items())
        ctx.emit("baseline", "info", f"windows {wins} are the baseline pool; smallest change a page catches within "
                 f"two windows: {text}", {"windows": wins, "detectable": mde}, w.window)
        moved = {m: c for m, c in self.checks.items() if not c.checked}
        if moved:
            _unstable(ctx, w, moved)

    def _detectable(self) -> dict[str, dict[str, float]]:
        """The smallest change a page catches within two windows (and within one), per metric."""
        cfg = self.cfg.drift
        mde = {}
        for metric in cfg.metrics:
            ref, moved_from, dropped = self.reference(metric)
            if not ref:
                continue
            extra = self._extra(metric)
            tau2 = page_mod.noise_floor(page_mod.with_extra(self.series[metric], extra), moved_from=moved_from,
                                        dropped=dropped, detrend=self._climbed(metric))
            var = sum(lv.var for lv in ref) / len(ref)
            two = page_mod.detectable(metric, var, ref, tau2, extra, self.z_live, cfg, 2)
            self.detectable[metric] = two
            mde[metric] = {"within_2_windows": two,
                           "one_window": page_mod.detectable(metric, var, ref, tau2, extra, self.z_live, cfg, 1)}
        return mde

    def add(self, w: Window, ctx: WindowContext) -> None:
        cfg = self.cfg
        joined = False if w.partial else self._add_to_pool(w)
        if joined and len(self.pool) == 1:
            ctx.emit("baseline", "info", f"window {w.window} is the baseline", {"window": w.window}, w.window)
        current = {} if w.partial else self._add_levels(w)
        if not w.partial and self.poolable(w):
            self.judged.append(w)
        results: list[drift_mod.DriftResult] = []
        if self.pool_complete and not joined and not w.partial:
            self._recheck_pool(w, ctx)
            if self.baseline_external:  # no pool closes: the floor grows with the run's own windows (as restore does)
                self._detectable()
            results = self._live(w, current)
        for r in results:
            self.drift[(r.metric, r.reference)] = r
        for metric in cfg.drift.metrics:
            flagged = [r for r in results if r.metric == metric and r.flagged]
            if flagged and own_delay_span([metric], w.window, w.window, ctx.full, self.pool, cfg) is not None:
                flagged = []  # soakd's own lag, the server's own histograms unmoved: no page (its finding says why)
            self.drift_active[metric] = bool(flagged)
            if flagged:
                self.drift_events[metric] = self.drift_events.get(metric, 0) + 1
        if joined and self.pool_complete:
            self._pool_done(w, ctx)
        ctx.drift = results
        ctx.baseline = self.baseline
        ctx.pool = list(self.pool) if self.pool_complete else []

    def close(self, w: Window, ctx: WindowContext) -> None:
        """The window's findings are made: it is the previous window now; the run's stability."""
        if not w.partial:
            self.previous = w
        self.stability = drift_mod.stability(ctx.full, self.cfg.drift)

    # ---- the end of the run
    def finish(self, ctx: RunContext) -> list[Finding]:
        """Change points, segment changes and trends over every full window (``changes.judge_run``),
        periodic drops; once."""
        if self.run_drift is not None:
            return []
        pool = [p.window for p in self.pool]
        rd = self._where_judged(changes_mod.judge_run(ctx.full, pool, self.cfg.drift, self._moved()), ctx.full)
        self.run_drift = rd
        out = self._span_findings(rd, ctx.full, pool)
        self.periodic = periodic_drops(ctx.full)
        if self.periodic is not None:
            pd = self.periodic
            out.append(Finding(kind="drift", diagnosis="periodic drops", severity="warning",
                               message=pd.message(), evidence={"fails": False, **pd.to_dict()}, window=None))
        for t in rd.trends:
            out.append(Finding(kind="drift", diagnosis="creep", severity="critical"
                               if t.tier == "confident" and t.direction == "degraded" else "info",
                               message=t.message(), evidence={"tier": t.tier, **t.to_dict()},
                               window=t.first_window, last_window=t.last_window))
        return out

    def _where_judged(self, rd: changes_mod.RunDrift, full: list[Window]) -> changes_mod.RunDrift:
        """The run's changes and trends less those of the server's own means over windows where soakd never
        lagged (there its own latencies are judged; the server's means are shown, not judged)."""
        late = {w.window for w in full if lagged(w, self.cfg)}

        def judged(metric: str, first: int, last: int) -> bool:
            return metric not in SERVER_MEANS or any(first <= i <= last for i in late)

        return replace(rd, changes=[c for c in rd.changes if judged(c.metric, c.window, c.end_window)],
                       trends=[t for t in rd.trends if judged(t.metric, t.first_window, t.last_window)])

    def _span_findings(self, rd: changes_mod.RunDrift, full: list[Window], pool: list[int]) -> list[Finding]:
        """The end-of-run change points as findings, one per span of windows: overlapping spans of the
        metrics' change points are one span (their union), and the finding names every tracked metric that
        moved in it (its own change point, or the span tested for it), so that a step from window 5 to 8 is
        one finding over 5-8 naming e2e, TTFT, tokens/s and requests/s alike. Whether it fails the run is
        its own change points' (a confident degradation among them): the metrics the span test adds are
        named, they never fail a run by themselves."""
        clusters: list[list[changes_mod.Change]] = []
        for c in sorted(rd.changes, key=lambda c: (c.window, c.end_window)):
            cl = next((cl for cl in clusters if c.tier == cl[0].tier == "confident" and c.window <= max(
                x.end_window for x in cl) and c.end_window >= min(x.window for x in cl)), None)
            if cl is None or c.tier != "confident":
                clusters.append([c])
            else:
                cl.append(c)
        spans = [(min(c.window for c in cl), max(c.end_window for c in cl)) for cl in clusters]
        confident = [sp for sp, cl in zip(spans, clusters, strict=True) if cl[0].tier == "confident"]
        skip = {(c.metric, a, b) for (a, b), cl in zip(spans, clusters, strict=True) for c in cl}
        skip |= {(t.metric, a, b) for t in rd.trends for a, b in confident}  # a creeping metric has its finding
        extra: dict[tuple[int, int], list[changes_mod.Change]] = {}
        for sp, c in changes_mod.span_changes(full, pool, self.cfg.drift, confident, skip, self._moved()):
            extra.setdefault(sp, []).append(c)
        order = {m: i for i, m in enumerate(self.cfg.drift.metrics)}
        out = []
        for (a, b), own in sorted(zip(spans, clusters, strict=True), key=lambda x: x[0]):
            seen = {c.metric for c in own}
            added = [c for c in extra.get((a, b), []) if c.metric not in seen]
            cs = sorted([*own, *added], key=lambda c: (c.tier != "confident", c.direction != "degraded",
                                                       order.get(c.metric, 99)))
            tier = "confident" if any(c.tier == "confident" for c in own) else "likely"
            fails = any(c.tier == "confident" and c.direction == "degraded" for c in own)
            worse = [c for c in cs if c.tier == "confident" and c.direction == "degraded"]
            message = cs[0].message() + "".join(
                f"; and {c.metric} {changes_mod.format_change(c.metric, c.ratio)} (CI "
                f"{changes_mod.format_change(c.metric, c.ci[0])}..{changes_mod.format_change(c.metric, c.ci[1])}, "
                f"{c.tier} {c.direction})" for c in cs[1:])
            out.append(Finding(
                kind="drift", diagnosis=f"{tier} drift", severity="critical" if fails else "info", message=message,
                evidence={"tier": tier, **cs[0].to_dict(), "changes": [c.to_dict() for c in cs]},
                window=a, last_window=b,
                metrics=[c.metric for c in (worse if fails else [c for c in cs if c.tier == tier])]))
        return out

    def state(self) -> DriftState:
        return DriftState(
            baseline_window=self.baseline.window if self.baseline is not None else None,
            baseline_external=self.baseline_external, pool=tuple(p.window for p in self.pool),
            drift=dict(self.drift), active=dict(self.drift_active), events=dict(self.drift_events),
            detectable=dict(self.detectable), checks=dict(self.checks), stability=self.stability)

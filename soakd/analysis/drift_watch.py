"""The drift detector: the baseline pool, each window's live comparisons against it and against the
previous window, and at the end of the run the change points, trends and periodic drops — as one
``soakd.analysis.detector.Detector``. The statistics are ``soakd.analysis.changes`` and
``soakd.analysis.levels``; this is their bookkeeping over a run (derivation: docs/analysis.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from soakd.analysis import changes as changes_mod
from soakd.analysis import drift as drift_mod
from soakd.analysis import judged as judged_mod
from soakd.analysis import levels as levels_mod
from soakd.analysis.detector import RunContext, WindowContext
from soakd.analysis.periodic import PeriodicDrops, periodic_drops
from soakd.config.analysis import AnalysisConfig
from soakd.core.findings import Finding
from soakd.core.summary import WindowSummary

__all__ = ["DriftDetector", "DriftState"]

Window = WindowSummary


@dataclass(frozen=True)
class DriftState:
    """What /metrics and /status show of drift: the baseline, the last comparisons, what is flagged."""

    baseline_window: int | None = None
    baseline_external: bool = False
    pool: tuple[int, ...] = ()
    drift: dict[tuple[str, str], drift_mod.DriftResult] = field(default_factory=dict)  # (metric, reference)
    active: dict[str, bool] = field(default_factory=dict)
    events: dict[str, int] = field(default_factory=dict)
    detectable: dict[str, float] = field(default_factory=dict)  # the smallest confident change of one window
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
        for w in full:
            self._add_to_pool(w)
            self._add_levels(w)
        if self.pool_complete and full:
            self._detectable()
        self.stability = drift_mod.stability(full, self.cfg.drift)

    # ---- a window
    def _live(self, w: Window, current: dict[str, levels_mod.Level]) -> list[drift_mod.DriftResult]:
        """Every metric of ``w`` against the pool and the previous window (changes.compare_levels)."""
        cfg = self.cfg.drift
        out = []
        prev = self.previous
        for metric in cfg.metrics:
            lv = current.get(metric)
            # the noise floor from the windows before this one: a step in it must not hide itself
            history = self.series[metric][:-1] if lv is not None else self.series[metric]
            tau2 = changes_mod.tau2_upper(history)
            refs: list[tuple[str, list[levels_mod.Level]]] = [("baseline", self._pool_levels(metric))]
            if prev is not None:
                p = next((x for x in reversed(self.series[metric]) if x.window == prev.window), None)
                refs.append(("previous", [p] if p is not None else []))
            for kind, ref in refs:
                if lv is None or not ref:
                    r = drift_mod.compare(w, self.baseline if kind == "baseline" else prev, metric, cfg,
                                          reference_kind=kind)  # type: ignore[arg-type]
                    out.append(replace(r, status="no_data" if r.status == "no_data" else "insufficient",
                                       direction=None))
                    continue
                out.append(changes_mod.compare_levels(metric, lv, ref, tau2, self.z_live, cfg,
                                                      reference_kind=kind))  # type: ignore[arg-type]
        return out

    def _pool_done(self, w: Window, ctx: WindowContext) -> None:
        mde = self._detectable()
        wins = [p.window for p in self.pool]
        text = ", ".join(f"{m} {changes_mod.format_change(m, v['one_window'])[1:]}" for m, v in mde.items())
        ctx.emit("baseline", "info", f"windows {wins} are the baseline pool; smallest change one window can "
                 f"show as confident drift: {text}", {"windows": wins, "detectable": mde}, w.window)

    def _detectable(self) -> dict[str, dict[str, float]]:
        """The smallest change one window (and twelve pooled) could show as confident drift, per metric."""
        cfg = self.cfg.drift
        mde = {}
        for metric in cfg.metrics:
            pool = self._pool_levels(metric)
            if not pool:
                continue
            tau2 = changes_mod.tau2_upper(self.series[metric])
            var = sum(lv.var for lv in pool) / len(pool)
            one = changes_mod.mde(metric, var, pool, tau2, self.z_live, cfg)
            self.detectable[metric] = one
            mde[metric] = {"one_window": one,
                           "pooled_12_windows": changes_mod.mde(metric, var, pool, tau2, self.z_live, cfg, 12)}
        return mde

    def add(self, w: Window, ctx: WindowContext) -> None:
        cfg = self.cfg
        joined = False if w.partial else self._add_to_pool(w)
        if joined and len(self.pool) == 1:
            ctx.emit("baseline", "info", f"window {w.window} is the baseline", {"window": w.window}, w.window)
        current = {} if w.partial else self._add_levels(w)
        results: list[drift_mod.DriftResult] = []
        if self.pool_complete and not joined and not w.partial:
            results = self._live(w, current)
        for r in results:
            self.drift[(r.metric, r.reference)] = r
        for metric in cfg.drift.metrics:
            flagged = [r for r in results if r.metric == metric and r.flagged]
            self.drift_active[metric] = bool(flagged)
            if flagged:
                self.drift_events[metric] = self.drift_events.get(metric, 0) + 1
        if joined and self.pool_complete:
            self._pool_done(w, ctx)
        ctx.drift = results
        ctx.baseline = self.baseline

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
        rd = changes_mod.judge_run(ctx.full, pool, self.cfg.drift)
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
        for sp, c in changes_mod.span_changes(full, pool, self.cfg.drift, confident, skip):
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
            detectable=dict(self.detectable), stability=self.stability)

"""A/B: each candidate target against the reference target, under the same traffic at the same
time (``targets:``; ``soakd compare`` does the same for two runs' reports).

Per window *k* and tracked metric, both targets' levels (``soakd.analysis.levels``: log scale, with
their within-window variance) give the difference ``d = y_cand - y_ref``; its variance is the
two windows' variances plus the noise floor *of the difference* — the part of the paired
series' successive differences their variances do not explain (``levels.between_variance``), at
its 90% upper bound (``changes.tau2_upper``) as in the live drift comparisons. Load that wanders
moves both targets alike and cancels in ``d``; what the pairing cannot cancel stays in the floor.

* **Per window**: the ratio ``exp(d) - 1`` (absolute for error rate and goodput) with its interval
  at the run's live z — Bonferroni over metrics × planned windows × (2 drift references + the
  candidates): one run-level family with drift. *Confident* (the whole interval beyond the
  threshold) and worse: a finding of kind ``ab``, failing the run by default; *likely*: info.
  ``soakd_ab_ratio{metric,target}`` is the last window's ratio (absent while the reference had
  no eligible window: a reference that is down gives no ratio).
* **The run**: the mean of the paired differences over every window both targets had eligible,
  with a Student-t interval from their spread (Bonferroni over metrics × candidates): the
  headline "mi300x e2e_p95 +9.8% (CI +7.1%..+12.6%) vs h100".
* **Segments** (``segment_results``; ``soakd compare`` fails on them): a difference that begins
  half-way through the run is diluted in the run's mean, and its step inflates the spread that
  mean's interval is built from. So the paired series of differences gets the change points of
  ``changes.judge_run`` (PELT on the standardised series, the noise floor from the successive
  differences that straddle no change point), and each segment's mean difference is compared with
  0 (A itself is the reference) with a Student-t interval at the Satterthwaite degrees of freedom
  (``changes.segment_difference``), Bonferroni over metrics × segments × candidates: a second
  run-level family beside the run's. A series without a change point has no segments: the run's
  row is its judgement.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from statistics import NormalDist
from typing import Any

from scipy.stats import t as student_t

from soakd.analysis.changes import _ratio, _tier, change_points, live_z, segment_difference, tau2_upper
from soakd.analysis.levels import Level, level
from soakd.config import AnalysisConfig
from soakd.core.summary import WindowSummary
from soakd.core.tracked import METRICS

__all__ = ["AbJudge", "AbResult", "AbSegment"]


@dataclass(frozen=True)
class AbResult:
    target: str  # the candidate
    reference: str
    metric: str
    window: int | None  # None: the whole run
    ratio: float
    ci: tuple[float, float]
    tier: str | None  # confident | likely | None
    direction: str  # worse | better | same
    threshold: float
    windows: int  # paired windows behind it
    value: float | None = None  # the candidate's (mean) value
    reference_value: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def message(self) -> str:
        absolute = METRICS[self.metric].absolute
        f = (lambda x: f"{x * 100:+.1f}pp") if absolute else (lambda x: f"{x * 100:+.1f}%")
        where = f"window {self.window}" if self.window is not None else f"{self.windows} paired windows"
        return (f"{self.target} {self.metric} {f(self.ratio)} (CI {f(self.ci[0])}..{f(self.ci[1])}) vs "
                f"{self.reference} over {where}: {self.tier or 'no'} {self.direction}, threshold "
                f"{f(self.threshold)[1:]}")


@dataclass(frozen=True)
class AbSegment:
    """A run of consecutive paired windows (between change points of the paired differences) whose
    mean difference, candidate against reference, is judged on its own."""

    target: str
    reference: str
    metric: str
    first_window: int
    last_window: int
    windows: int  # paired windows in it
    ratio: float
    ci: tuple[float, float]
    tier: str | None  # confident | likely | None
    direction: str  # worse | better | same
    threshold: float
    value: float  # the candidate's mean value over the segment
    reference_value: float

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ci": list(self.ci)}

    def message(self) -> str:
        absolute = METRICS[self.metric].absolute
        f = (lambda x: f"{x * 100:+.1f}pp") if absolute else (lambda x: f"{x * 100:+.1f}%")
        return (f"{self.target} {self.metric} {f(self.ratio)} (CI {f(self.ci[0])}..{f(self.ci[1])}) vs "
                f"{self.reference} in windows {self.first_window}..{self.last_window}: {self.tier or 'no'} "
                f"{self.direction}, threshold {f(self.threshold)[1:]}")


def _direction(metric: str, side: int) -> str:
    if side == 0:
        return "same"
    return "worse" if (side > 0) == METRICS[metric].higher_is_worse else "better"


@dataclass
class AbJudge:
    cfg: AnalysisConfig
    reference: str
    candidates: list[str]
    planned_windows: int = 48
    windows: dict[str, dict[int, WindowSummary]] = field(default_factory=dict)
    last: dict[tuple[str, str], AbResult] = field(default_factory=dict)  # (metric, candidate) -> newest window's
    results: list[AbResult] = field(default_factory=list)  # every per-window comparison, in order

    def __post_init__(self) -> None:
        self.z = live_z(self.cfg.drift, self.planned_windows, 2 + len(self.candidates))
        for name in (self.reference, *self.candidates):
            self.windows.setdefault(name, {})

    # ---- the pairs
    def _pairs(self, cand: str, metric: str, upto: int | None = None) -> list[tuple[Level, Level]]:
        ref, other = self.windows[self.reference], self.windows[cand]
        out = []
        for k in sorted(set(ref) & set(other)):
            if upto is not None and k > upto:
                break
            lr, lc = level(ref[k], metric, self.cfg.drift), level(other[k], metric, self.cfg.drift)
            if lr is not None and lc is not None:
                out.append((lr, lc))
        return out

    @staticmethod
    def _diffs(pairs: list[tuple[Level, Level]]) -> list[Level]:
        return [Level(lc.window, lc.y - lr.y, lr.var + lc.var, lc.value, min(lr.n, lc.n)) for lr, lc in pairs]

    # ---- per window
    def add(self, target: str, window: WindowSummary, *, final: bool = False) -> list[AbResult]:
        """A closed window of ``target``: the comparisons it completes (one per candidate and metric).
        A revision of a window already judged is ignored, unless ``final`` (offline, ``soakd compare``:
        a report holds each window's last revision, the complete one)."""
        if target not in self.windows or (window.revision and not final):
            return []
        self.windows[target][window.window] = window
        k = window.window
        cands = self.candidates if target == self.reference else [target]
        out: list[AbResult] = []
        for cand in cands:
            if k not in self.windows[cand] or k not in self.windows[self.reference]:
                continue
            for metric in self.cfg.drift.soakd_metrics:
                r = self._window_result(cand, metric, k)
                if r is None:
                    self.last.pop((metric, cand), None)  # no ratio: missing, not 0
                    continue
                self.last[(metric, cand)] = r
                self.results.append(r)
                out.append(r)
        return out

    def _window_result(self, cand: str, metric: str, k: int) -> AbResult | None:
        pairs = self._pairs(cand, metric, upto=k)
        if not pairs or pairs[-1][1].window != k:
            return None
        diffs = self._diffs(pairs)
        cur = diffs[-1]
        tau2 = tau2_upper(diffs)
        half = self.z * math.sqrt(cur.var + tau2)
        thr = self.cfg.drift.threshold_for(metric)
        tier, side = _tier(metric, cur.y, half, thr)
        lr, lc = pairs[-1]
        return AbResult(cand, self.reference, metric, k, _ratio(metric, cur.y),
                        (_ratio(metric, cur.y - half), _ratio(metric, cur.y + half)), tier, _direction(metric, side),
                        thr, 1, lc.value, lr.value)

    def paired(self, cand: str, metric: str) -> list[Level]:
        """The candidate's paired differences from the reference (``y_cand - y_ref``, variance the sum
        of both windows'), over every window both had eligible with ``metric``, in window order."""
        return self._diffs(self._pairs(cand, metric))

    # ---- the run
    def run_results(self) -> list[AbResult]:
        """Per candidate and metric: the mean paired difference over the run, with its interval."""
        out = []
        family = self.cfg.drift.family * max(1, len(self.candidates))
        p = 1.0 - (1.0 - self.cfg.drift.confidence) / (2.0 * family)
        for cand in self.candidates:
            for metric in self.cfg.drift.soakd_metrics:
                pairs = self._pairs(cand, metric)
                n = len(pairs)
                if n < 2:
                    continue
                diffs = self._diffs(pairs)
                mean = sum(d.y for d in diffs) / n
                sd2 = sum((d.y - mean) ** 2 for d in diffs) / (n - 1)
                # the spread of the paired differences holds their sampling noise and the floor; never
                # below what the windows' own variances say
                var = max(sd2, sum(d.var for d in diffs) / n) / n
                half = float(student_t.ppf(p, n - 1)) * math.sqrt(var) if n > 1 else NormalDist().inv_cdf(p)
                thr = self.cfg.drift.threshold_for(metric)
                tier, side = _tier(metric, mean, half, thr)
                spec = METRICS[metric]
                vals_c = [lc.y for _lr, lc in pairs]
                vals_r = [lr.y for lr, _lc in pairs]
                mc, mr = sum(vals_c) / n, sum(vals_r) / n
                out.append(AbResult(cand, self.reference, metric, None, _ratio(metric, mean),
                                    (_ratio(metric, mean - half), _ratio(metric, mean + half)), tier,
                                    _direction(metric, side), thr, n,
                                    mc if spec.absolute else math.exp(mc), mr if spec.absolute else math.exp(mr)))
        return out

    # ---- segments of the run
    def segment_results(self) -> tuple[list[AbSegment], dict[tuple[str, str], list[int]]]:
        """Per candidate and metric, the segments between change points of the paired differences,
        each judged against the reference (see the module docstring); and the change points, the
        first windows of the segments after the first, per (metric, candidate)."""
        out: list[AbSegment] = []
        points: dict[tuple[str, str], list[int]] = {}
        alpha = 1.0 - self.cfg.drift.confidence
        family = self.cfg.drift.family * max(1, len(self.candidates))
        for cand in self.candidates:
            for metric in self.cfg.drift.soakd_metrics:
                pairs = self._pairs(cand, metric)
                diffs = self._diffs(pairs)
                if len(diffs) < 4:
                    continue
                starts, tau2, df = change_points(diffs)
                points[(metric, cand)] = [diffs[i].window for i in starts]
                if not starts:
                    continue
                bounds = [0, *starts, len(diffs)]
                p = 1.0 - alpha / (2.0 * family * (len(bounds) - 1))
                thr = self.cfg.drift.threshold_for(metric)
                spec = METRICS[metric]
                for a, b in zip(bounds, bounds[1:]):
                    part = diffs[a:b]
                    d, half = segment_difference(part, 0.0, 0.0, 0, tau2, df, p)
                    tier, side = _tier(metric, d, half, thr)
                    mc = sum(lc.y for _lr, lc in pairs[a:b]) / len(part)
                    mr = sum(lr.y for lr, _lc in pairs[a:b]) / len(part)
                    out.append(AbSegment(cand, self.reference, metric, part[0].window, part[-1].window, len(part),
                                         _ratio(metric, d), (_ratio(metric, d - half), _ratio(metric, d + half)),
                                         tier, _direction(metric, side), thr,
                                         mc if spec.absolute else math.exp(mc),
                                         mr if spec.absolute else math.exp(mr)))
        return out, points

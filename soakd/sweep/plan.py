"""What a sweep step measured and where the knee is: pure functions of the steps' window
summaries (no I/O), so that the rule is tested on its own.

A step is one window (``WindowSummary``) at one load level, after a warm-up at that level.

* **Throughput** is the step's successful requests per second. Its standard error comes from
  batch means over the step's complete sub-windows (a tenth of ``sweep.step`` each, by send
  time): requests of one batch or under one slowly varying load are not independent, and a closed
  loop sends far more regularly than a Poisson process — the spread of the per-sub-window rates
  shows both (with fewer than 3 sub-windows, the Poisson error of the count stands in).
* **Rising** means the throughput exceeds the best step so far by more than ``min_gain`` *and*
  the log-ratio's interval (Student-t at ``confidence``, with the sub-windows' degrees of
  freedom) lies above 0. A step that does not rise is past
  the knee; the knee is the best step before it (the lowest level that reached the plateau).
* **Past the knee as well**: the step's error rate above the budget; an SLO broken (a scenario's
  goodput below its ``slo.quantile``); in open loop, a queue that grows within the step (the e2e
  latency of the sub-windows, by send time, rises significantly — Mann–Kendall — by more than
  ``queue_rise`` along Sen's slope). The knee is then the step before.
* The best goodput: the step with the most requests per second that met their SLOs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from statistics import NormalDist
from typing import Any

import pymannkendall
from scipy.stats import t as student_t
from scipy.stats import theilslopes

from soakd.config import SloConfig, SweepConfig
from soakd.core.summary import Quantiles, WindowSummary

__all__ = ["Decision", "Step", "decide", "step_of"]

STOP_REASONS = {
    "plateau": "throughput no longer rising beyond its uncertainty",
    "errors": "error rate above the budget",
    "slo": "an SLO broken",
    "queue": "a queue growing within the step (open loop)",
    "end": "no knee within the levels: throughput still rising at the last one",
    "stopped": "stopped before the knee was found",
}


def _q(d: Quantiles, q: str) -> dict[str, Any]:
    ci = d.ci(q)
    return {"value": d.get(q), "ci": list(ci) if ci is not None else None}


@dataclass
class Step:
    """One step of a sweep, as the table, the JSON and /metrics show it."""

    index: int
    level: float
    seconds: float
    requests: int
    requests_per_second: float
    requests_per_second_se: float
    requests_per_second_df: int  # degrees of freedom of the standard error (sub-windows - 1; 0: Poisson)
    output_tokens_per_second: float
    error_rate: float | None
    latency: dict[str, dict[str, Any]]  # e2e_p50 -> {value, ci}, ...
    goodput_ratio: float | None = None
    goodput_per_second: float | None = None
    slo_broken: list[str] = field(default_factory=list)  # scenarios whose goodput is below their objective
    queue_rise: float | None = None  # open loop: e2e rise within the step along Sen's slope
    queue_p: float | None = None
    queue_growing: bool = False
    status: str = ""  # rising | knee | past_knee | first | end
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _throughput_se(w: WindowSummary, seconds: float) -> tuple[float, int]:
    """(standard error, degrees of freedom) of the step's requests/s: batch means over its
    complete sub-windows, or Poisson (df 0) with fewer than 3."""
    poisson = math.sqrt(max(w.ok, 1)) / seconds
    sub = w.subwindows
    if sub is None or sub.seconds <= 0:
        return poisson, 0
    k = min(len(sub.ok), int(seconds / sub.seconds + 1e-9))  # complete sub-windows only
    if k < 3:
        return poisson, 0
    rates = [c / sub.seconds for c in sub.ok[:k]]
    mean = sum(rates) / k
    var = sum((r - mean) ** 2 for r in rates) / (k - 1)
    # a floor of one request per step: a perfectly regular closed loop is not known to infinite precision
    return max(math.sqrt(var / k), 1.0 / seconds), k - 1


def _queue(w: WindowSummary, seconds: float) -> tuple[float | None, float | None]:
    """(rise, p): e2e of the step's sub-windows by send time, Mann–Kendall p and Sen's relative rise."""
    sub = w.subwindows
    if sub is None or sub.seconds <= 0:
        return None, None
    k = min(len(sub.e2e), int(seconds / sub.seconds + 1e-9))
    ys = [math.log(v) for v in sub.e2e[:k] if v is not None and v > 0]
    if len(ys) < 4:
        return None, None
    p = float(pymannkendall.original_test(ys).p)
    slope = float(theilslopes(ys).slope)
    return math.expm1(slope * (len(ys) - 1)), p


def step_of(index: int, level: float, w: WindowSummary, slos: dict[str, SloConfig], *, open_loop: bool) -> Step:
    """The step's figures from its window summary."""
    seconds = max(1e-9, w.duration_seconds)
    lat = {f"{fam}_{q}": _q(getattr(w, f"{fam}_seconds"), q) for fam in ("e2e", "ttft", "itl") for q in ("p50", "p95")}
    se, df = _throughput_se(w, seconds)
    # requests cancelled at the end of the step (the drain's grace ran out) are the sweep's, not errors
    cancelled = int(w.outcomes.get("cancelled", 0))
    judged = w.requests - cancelled
    error_rate = (judged - w.ok) / judged if judged > 0 else None
    step = Step(index=index, level=level, seconds=seconds, requests=w.requests,
                requests_per_second=w.requests_per_second, requests_per_second_se=se, requests_per_second_df=df,
                output_tokens_per_second=w.output_tokens_per_second, error_rate=error_rate, latency=lat)
    if w.goodput is not None:
        step.goodput_ratio = w.goodput.ratio
        step.goodput_per_second = w.goodput.met / seconds
        for name, slo in sorted(slos.items()):
            g = w.scenarios.get(name)
            if g is not None and g.goodput is not None and g.goodput.ratio is not None \
                    and g.goodput.ratio < slo.quantile:
                step.slo_broken.append(name)
    if open_loop:
        step.queue_rise, step.queue_p = _queue(w, seconds)
    return step


@dataclass
class Decision:
    stop: bool
    reason: str | None = None  # a key of STOP_REASONS
    knee: int | None = None  # index of the knee step
    message: str = ""


def _rises(cur: Step, best: Step, cfg: SweepConfig) -> tuple[bool, float, tuple[float, float]]:
    """Whether ``cur`` rises above ``best``: (rising, ratio - 1, interval of ratio - 1)."""
    if best.requests_per_second <= 0:
        return cur.requests_per_second > 0, math.inf, (math.inf, math.inf)
    if cur.requests_per_second <= 0:
        return False, -1.0, (-1.0, -1.0)
    d = math.log(cur.requests_per_second / best.requests_per_second)
    se = math.hypot(cur.requests_per_second_se / cur.requests_per_second,
                    best.requests_per_second_se / best.requests_per_second)
    df = min(cur.requests_per_second_df, best.requests_per_second_df)
    p = 0.5 + cfg.confidence / 2
    z = float(student_t.ppf(p, df)) if df > 0 else NormalDist().inv_cdf(p)
    lo, hi = math.expm1(d - z * se), math.expm1(d + z * se)
    return (math.expm1(d) > cfg.min_gain and lo > 0), math.expm1(d), (lo, hi)


def _more_levels(cfg: SweepConfig) -> str:
    """What to do when the levels ended before the knee."""
    if cfg.levels is not None:
        return "add higher levels to --levels (sweep.levels) to find the knee"
    return f"raise sweep.stop (now {cfg.stop:g}) to find the knee"


def decide(steps: list[Step], cfg: SweepConfig, error_budget: float, *, last: bool) -> Decision:
    """After the newest step: go on, or stop with the reason and the knee (None: no knee within the
    levels, throughput still rising at the last one). Sets the steps' status."""
    cur = steps[-1]
    before = steps[:-1]
    prev = before[-1].index if before else None
    past: tuple[str, str] | None = None
    if cur.error_rate is not None and cur.error_rate > error_budget:
        past = ("errors", f"error rate {cur.error_rate:.2%} above the budget {error_budget:.2%}")
    elif cur.slo_broken:
        past = ("slo", f"goodput below the SLO objective for {', '.join(cur.slo_broken)}")
    elif cur.queue_rise is not None and cur.queue_p is not None and cur.queue_p < 1 - cfg.confidence \
            and cur.queue_rise > cfg.queue_rise:
        cur.queue_growing = True
        past = ("queue", f"e2e rose {cur.queue_rise:+.0%} within the step: the queue grows")
    if past is not None:
        cur.status, cur.note = "past_knee", past[1]
        if before:
            steps[-2].status = "knee"
        return Decision(True, past[0], prev, past[1] + ("" if before else "; the first level is already past "
                                                          "the knee: lower sweep.start"))
    if not before:
        cur.status = "first"
        if last:
            cur.status = "end"
            return Decision(True, "end", None, f"one level only: no knee can be told; {_more_levels(cfg)}")
        return Decision(False)
    best = max(before, key=lambda s: s.requests_per_second)
    rising, gain, (lo, hi) = _rises(cur, best, cfg)
    cur.note = f"{gain:+.1%} [{lo:+.1%}, {hi:+.1%}] vs level {best.level:g}"
    if rising:
        cur.status = "rising"
        if last:
            cur.status = "end"
            return Decision(True, "end", None, f"no knee within the levels: throughput still rising at the last "
                            f"level {cur.level:g} ({cur.note}); {_more_levels(cfg)}")
        return Decision(False)
    cur.status = "past_knee"
    best.status = "knee"
    return Decision(True, "plateau", best.index,
                    f"throughput {cur.note}: not beyond +{cfg.min_gain:.0%} with confidence")

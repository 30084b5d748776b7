"""Tumbling windows of request statistics.

A record belongs to the window in which it was *sent*. Quantiles come from DDSketches (1%
relative error), kept per scenario and merged for the overall figures, so nothing grows with
the number of requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from soakd.analysis.sketch import RELATIVE_ACCURACY, merged, new_sketch, quantile
from soakd.analysis.stats import quantile_ci
from soakd.client.records import OUTCOMES, Outcome, RequestRecord


class Timeline:
    """Where a monotonic time falls: warm-up (window -1), window k, or past the end.

    ``first_index`` continues the numbering of a resumed run: the first window of this segment
    is ``first_index``, not 0 (the gap between segments belongs to no window).
    """

    def __init__(self, start: float, warmup: float, window: float, duration: float, first_index: int = 0) -> None:
        self.start = start
        self.warmup = warmup
        self.window = window
        self.duration = duration
        self.first_index = first_index
        self.first_window_start = start + warmup

    def window_at(self, t: float) -> int:
        if t < self.first_window_start:
            return -1
        return self.first_index + int((t - self.first_window_start) // self.window)

    def window_bounds(self, k: int) -> tuple[float, float]:
        s = self.first_window_start + (k - self.first_index) * self.window
        return s, min(s + self.window, self.end)

    @property
    def end(self) -> float:
        return self.start + self.duration

    def elapsed(self, t: float) -> float:
        return max(0.0, t - self.start)

    def progress(self, t: float) -> float:
        return min(1.0, self.elapsed(t) / self.duration) if self.duration > 0 else 1.0


class ScenarioStats:
    __slots__ = ("count", "outcomes", "e2e", "ttft", "itl", "prompt_tokens", "completion_tokens",
                 "completion_tokens_sumsq", "streamed")

    def __init__(self) -> None:
        self.count = 0
        self.outcomes: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.e2e = new_sketch()
        self.ttft = new_sketch()
        self.itl = new_sketch()
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.completion_tokens_sumsq = 0.0
        self.streamed = 0  # successful streamed requests: the independent units behind the ITL gaps


def _q(sk, confidence: float = 0.95, n_effective: int | None = None) -> dict[str, Any]:  # noqa: ANN001
    """Quantiles with their distribution-free confidence intervals (soakd.analysis.stats)."""
    if sk.count == 0:
        return {"p50": None, "p95": None, "p99": None, "mean": None, "count": 0,
                "p50_ci": None, "p95_ci": None, "p99_ci": None}
    out: dict[str, Any] = {
        "p50": quantile(sk, 0.50),
        "p95": quantile(sk, 0.95),
        "p99": quantile(sk, 0.99),
        "mean": sk.avg,
        "count": int(sk.count),
    }
    for name, q in (("p50", 0.50), ("p95", 0.95), ("p99", 0.99)):
        ci = quantile_ci(sk, q, confidence, RELATIVE_ACCURACY, n_effective)
        out[name + "_ci"] = list(ci) if ci is not None else None
    return out


@dataclass
class WindowStats:
    index: int
    start: float  # monotonic
    end: float  # monotonic, planned
    wall_start: float
    scenarios: dict[str, ScenarioStats] = field(default_factory=dict)
    in_flight: int = 0
    late_records: int = 0
    closed: bool = False
    paused_seconds: float = 0.0  # quiesce probes: excluded from the window's load time
    target_down_seconds: float = 0.0

    def stats(self, scenario: str) -> ScenarioStats:
        s = self.scenarios.get(scenario)
        if s is None:
            s = self.scenarios[scenario] = ScenarioStats()
        return s

    def add(self, rec: RequestRecord, gaps: list[float] | None) -> None:
        s = self.stats(rec.scenario)
        s.count += 1
        s.outcomes[rec.outcome.value] += 1
        if rec.outcome is Outcome.OK:
            s.e2e.add(rec.e2e_seconds)
            if rec.stream and rec.token_times_ns:
                s.ttft.add((rec.token_times_ns[0] - rec.t_start_ns) / 1e9)
                if gaps:
                    add = s.itl.add
                    for g in gaps:
                        if g > 0:
                            add(g)
                s.streamed += 1
            s.prompt_tokens += rec.prompt_tokens
            ct = rec.completion_tokens
            s.completion_tokens += ct
            s.completion_tokens_sumsq += ct * ct

    def summary(self, actual_end: float | None = None, partial: bool = False,
                confidence: float = 0.95) -> dict[str, Any]:
        end = actual_end if actual_end is not None else self.end
        wall = max(1e-9, end - self.start)
        dur = max(1e-9, wall - min(self.paused_seconds, wall * 0.999))
        per: dict[str, Any] = {}
        total = 0
        ok = 0
        outcomes = dict.fromkeys(OUTCOMES, 0)
        ctoks = ptoks = 0
        sumsq = 0.0
        streamed = 0
        for name, s in sorted(self.scenarios.items()):
            total += s.count
            ok += s.outcomes["ok"]
            for k, v in s.outcomes.items():
                outcomes[k] += v
            ctoks += s.completion_tokens
            ptoks += s.prompt_tokens
            sumsq += s.completion_tokens_sumsq
            streamed += s.streamed
            per[name] = {
                "requests": s.count,
                "outcomes": dict(s.outcomes),
                "error_rate": (1 - s.outcomes["ok"] / s.count) if s.count else None,
                "e2e_seconds": _q(s.e2e, confidence),
                "ttft_seconds": _q(s.ttft, confidence),
                "itl_seconds": _q(s.itl, confidence, n_effective=s.streamed or None),
                "requests_per_second": s.count / dur,
                "output_tokens_per_second": s.completion_tokens / dur,
                "completion_tokens": s.completion_tokens,
                "completion_tokens_sumsq": s.completion_tokens_sumsq,
            }
        return {
            "window": self.index,
            "start_unix": self.wall_start,
            "duration_seconds": dur,
            "wall_duration_seconds": wall,
            "paused_seconds": self.paused_seconds,
            "target_down_seconds": self.target_down_seconds,
            "partial": partial,
            "requests": total,
            "outcomes": outcomes,
            "error_rate": (1 - ok / total) if total else None,
            "mix": {n: (v["requests"] / total if total else 0.0) for n, v in per.items()},
            "e2e_seconds": _q(merged(s.e2e for s in self.scenarios.values()), confidence),
            "ttft_seconds": _q(merged(s.ttft for s in self.scenarios.values()), confidence),
            "itl_seconds": _q(merged(s.itl for s in self.scenarios.values()), confidence, n_effective=streamed or None),
            "requests_per_second": total / dur,
            "output_tokens_per_second": ctoks / dur,
            "prompt_tokens": ptoks,
            "completion_tokens": ctoks,
            "completion_tokens_sumsq": sumsq,
            "late_records": self.late_records,
            "scenarios": per,
        }


def fmt_ms(v: float | None) -> str:
    return "-" if v is None or math.isnan(v) else f"{v * 1000:.1f}ms"

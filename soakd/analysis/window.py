"""One open window: everything a window collects until it closes, and the one place its
:class:`~soakd.core.summary.WindowSummary` is built.

A request belongs to the window in which it was *sent*; a telemetry sample to the window in
which it was taken. Latency quantiles come from DDSketches (``soakd.analysis.sketch``, 0.25%
relative error), kept per scenario and merged for the overall figures; telemetry from the
fixed-size aggregates of ``soakd.analysis.telemetry``. Nothing grows with the number of
requests or samples.
"""

from __future__ import annotations

import math
from typing import Any

from soakd.analysis.sketch import RELATIVE_ACCURACY, merged, new_sketch, quantile
from soakd.analysis.stats import quantile_ci
from soakd.analysis.telemetry import TelemetryStats
from soakd.core.records import OUTCOMES, Outcome, RequestRecord
from soakd.core.series import Series
from soakd.core.summary import Quantiles, QuiesceProbe, ScenarioSummary, WindowSummary


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


def quantiles(sk: Any, confidence: float = 0.95, n_effective: int | None = None) -> Quantiles:
    """Quantiles with their distribution-free confidence intervals (soakd.analysis.stats)."""
    if sk.count == 0:
        return Quantiles()
    cis = {}
    for name, q in (("p50", 0.50), ("p95", 0.95), ("p99", 0.99)):
        cis[name + "_ci"] = quantile_ci(sk, q, confidence, RELATIVE_ACCURACY, n_effective)
    return Quantiles(p50=quantile(sk, 0.50), p95=quantile(sk, 0.95), p99=quantile(sk, 0.99), mean=sk.avg,
                     count=int(sk.count), **cis)


class OpenWindow:
    """Window ``index`` from ``start`` to ``end`` (monotonic seconds; ``wall_start``: unix)."""

    __slots__ = ("index", "start", "end", "wall_start", "scenarios", "telemetry", "quiesce", "in_flight",
                 "late_records", "closed", "paused_seconds", "target_down_seconds")

    def __init__(self, index: int, start: float, end: float, wall_start: float) -> None:
        self.index = index
        self.start = start
        self.end = end
        self.wall_start = wall_start
        self.scenarios: dict[str, ScenarioStats] = {}
        self.telemetry: TelemetryStats | None = None  # created by the first sample
        self.quiesce: QuiesceProbe | None = None
        self.in_flight = 0  # requests sent in it and not finished (and a quiesce probe holding it)
        self.late_records = 0  # requests that finished after it closed
        self.closed = False
        self.paused_seconds = 0.0  # quiesce probes: excluded from the window's load time
        self.target_down_seconds = 0.0

    def stats(self, scenario: str) -> ScenarioStats:
        s = self.scenarios.get(scenario)
        if s is None:
            s = self.scenarios[scenario] = ScenarioStats()
        return s

    # ---- what a window collects
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

    def add_samples(self, series: list[Series], t: float) -> None:
        if self.telemetry is None:
            self.telemetry = TelemetryStats()
        self.telemetry.add(series, t)

    def add_energy(self, joules: float, seconds: float) -> None:
        if self.telemetry is None:
            self.telemetry = TelemetryStats()
        self.telemetry.add_energy(joules, seconds)

    # ---- the summary
    def summary(self, actual_end: float | None = None, partial: bool = False, confidence: float = 0.95,
                segment: int = 0) -> WindowSummary:
        end = actual_end if actual_end is not None else self.end
        wall = max(1e-9, end - self.start)
        dur = max(1e-9, wall - min(self.paused_seconds, wall * 0.999))
        per: dict[str, ScenarioSummary] = {}
        total = ok = 0
        outcomes = dict.fromkeys(OUTCOMES, 0)
        ctoks = ptoks = streamed = 0
        sumsq = 0.0
        for name, s in sorted(self.scenarios.items()):
            total += s.count
            ok += s.outcomes["ok"]
            for k, v in s.outcomes.items():
                outcomes[k] += v
            ctoks += s.completion_tokens
            ptoks += s.prompt_tokens
            sumsq += s.completion_tokens_sumsq
            streamed += s.streamed
            per[name] = ScenarioSummary(
                requests=s.count,
                outcomes=dict(s.outcomes),
                error_rate=(1 - s.outcomes["ok"] / s.count) if s.count else None,
                e2e_seconds=quantiles(s.e2e, confidence),
                ttft_seconds=quantiles(s.ttft, confidence),
                itl_seconds=quantiles(s.itl, confidence, n_effective=s.streamed or None),
                requests_per_second=s.count / dur,
                output_tokens_per_second=s.completion_tokens / dur,
                completion_tokens=s.completion_tokens,
                completion_tokens_sumsq=s.completion_tokens_sumsq,
            )
        sketches = self.scenarios.values()
        tel = self.telemetry
        return WindowSummary(
            window=self.index,
            segment=segment,
            start_unix=self.wall_start,
            duration_seconds=dur,
            wall_duration_seconds=wall,
            paused_seconds=self.paused_seconds,
            target_down_seconds=self.target_down_seconds,
            partial=partial,
            requests=total,
            outcomes=outcomes,
            error_rate=(1 - ok / total) if total else None,
            mix={n: (v.requests / total if total else 0.0) for n, v in per.items()},
            e2e_seconds=quantiles(merged(s.e2e for s in sketches), confidence),
            ttft_seconds=quantiles(merged(s.ttft for s in sketches), confidence),
            itl_seconds=quantiles(merged(s.itl for s in sketches), confidence, n_effective=streamed or None),
            requests_per_second=total / dur,
            output_tokens_per_second=ctoks / dur,
            prompt_tokens=ptoks,
            completion_tokens=ctoks,
            completion_tokens_sumsq=sumsq,
            late_records=self.late_records,
            scenarios=per,
            quiesce=self.quiesce,
            **({"device": tel.device(ctoks, dur), "server": tel.server(), "host": tel.host()}
               if tel is not None else {}),
        )


def fmt_ms(v: float | None) -> str:
    return "-" if v is None or math.isnan(v) else f"{v * 1000:.1f}ms"

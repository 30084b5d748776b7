"""One open window: everything a window collects until it closes, and the one place its
:class:`~soakd.core.summary.WindowSummary` is built. Requests go by send time, samples by sample
time, into sketches, fixed-size aggregates and one-minute sub-windows: nothing grows with the
number of requests or samples.

(derivation: docs/analysis.md#derivation-windowpy)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from soakd.analysis.settle import Settled, settle
from soakd.analysis.sketch import RELATIVE_ACCURACY, merged, new_sketch, quantile
from soakd.analysis.stats import quantile_ci
from soakd.analysis.telemetry import TelemetryStats
from soakd.config.analysis import ClientConfig
from soakd.core.records import OUTCOMES, RequestRecord
from soakd.core.series import Series
from soakd.core.summary import (
    ClientSummary,
    Goodput,
    Quantiles,
    QuiesceProbe,
    ScenarioSummary,
    SubWindows,
    WindowSummary,
)

FAMILIES = ("e2e", "ttft", "itl")
MIN_SUB_COUNT = 2  # requests a sub-window needs to enter the batch means


def sub_seconds(window_seconds: float) -> float:
    """The sub-window length: a minute, or a tenth of a window shorter than 10 minutes."""
    return min(60.0, window_seconds / 10.0)


class SubStats:
    """Per sub-window: requests, successes, and per family the count, sum and sum of squares of
    the log latency (bounded: a fixed number of sub-windows per window)."""

    __slots__ = ("k", "requests", "ok", "n", "s1", "s2")

    def __init__(self, k: int) -> None:
        self.k = k
        self.requests = [0] * k
        self.ok = [0] * k
        self.n = {f: [0] * k for f in FAMILIES}
        self.s1 = {f: [0.0] * k for f in FAMILIES}
        self.s2 = {f: [0.0] * k for f in FAMILIES}

    def add_many(self, family: str, j: np.ndarray, seconds: np.ndarray) -> None:
        """Latencies ``seconds`` of a family, each in sub-window ``j[i]`` (a batch of requests): the count, sum and
        sum of squares of their logs (a latency of 0 has none: left out)."""
        pos = seconds > 0
        if not pos.all():
            j, seconds = j[pos], seconds[pos]
        if not len(j):
            return
        x = np.log(seconds)
        k = self.k
        n = np.bincount(j, minlength=k).tolist()
        s1 = np.bincount(j, weights=x, minlength=k).tolist()
        s2 = np.bincount(j, weights=x * x, minlength=k).tolist()
        cn, c1, c2 = self.n[family], self.s1[family], self.s2[family]
        for i, c in enumerate(n):
            if c:
                cn[i] += c
                c1[i] += s1[i]
                c2[i] += s2[i]

    def summary(self, seconds: float) -> SubWindows:
        out = SubWindows(seconds=seconds, requests=list(self.requests), ok=list(self.ok))
        for f in FAMILIES:
            n, s1, s2 = self.n[f], self.s1[f], self.s2[f]
            setattr(out, f, [math.exp(a / c) if c else None for a, c in zip(s1, n)])
            extra = extra_variance(n, s1, s2)
            if extra is not None:
                out.extra_var[f], out.inflation[f] = extra
        return out


STALL_LAG = 0.02  # heartbeat lags beyond this count as stall time
BUCKET = 0.1  # seconds: the freeze detector's resolution
TAIL = 120.0  # seconds after the window's end that its requests are followed for


class ClientStats:
    """soakd's own health in one window (see ``ClientSummary``) and the activity buckets of the
    freeze detector: per 100 ms of the window (and up to 2 minutes after it), whether one of the
    window's requests was in flight and whether a token or the end of one arrived (bounded: one per bucket;
    headers are not progress)."""

    __slots__ = ("lag", "heartbeats", "lag_max", "stall", "cpu", "throttled", "periods", "flags", "start",
                 "inflight_delta", "starts", "request_stall", "impaired_requests", "_flags_np", "by_source")

    def __init__(self, start: float, seconds: float) -> None:
        self.lag = new_sketch()
        self.heartbeats = 0
        self.lag_max = 0.0
        self.stall = 0.0
        self.request_stall = 0.0  # the part of the window's time in loop lags beyond the request bound
        self.by_source: dict[int, list[float]] | None = None  # a load worker's stalls: [stall, request stall]
        self.impaired_requests = 0  # requests of the window that overlapped such a lag
        self.cpu: float | None = None
        self.throttled: float | None = None
        self.periods: int | None = None
        self.start = start
        # the window and a tail (its requests run on after its end: a freeze that begins late in the
        # window is measured whole, on them)
        n = max(1, math.ceil((seconds + min(seconds, TAIL)) / BUCKET))
        self.flags = bytearray(n)  # bit 0: a byte arrived in the bucket
        self._flags_np = np.frombuffer(self.flags, dtype=np.uint8)  # the same bytes, for numpy's writes
        self.inflight_delta = np.zeros(n + 1, dtype=np.int64)  # +1 where a request starts, -1 where it ends
        # requests that start in the bucket (the freeze's silent requests)
        self.starts = np.zeros(n + 1, dtype=np.int64)

    def add_request(self, t_start: float, t_end: float, byte_times: list[float]) -> None:
        """A request in flight from ``t_start`` to ``t_end`` (window clock), bytes at ``byte_times``."""
        self.add_request_ns(int(t_start * 1e9), int(t_end * 1e9), [int(t * 1e9) for t in byte_times], 0, 0.0)

    def add_request_ns(self, t0_ns: int, t_end_ns: int, token_ns: list[int], headers_ns: int,
                       offset: float) -> None:
        """The same in the record's own nanoseconds; ``offset``: window-clock seconds minus record seconds.
        Headers are not progress: a wedged front end sends them to every new stream, and no token after them."""
        self.add_requests(np.array([t0_ns], dtype=np.int64), np.array([t_end_ns], dtype=np.int64),
                          np.array([offset]), np.array(token_ns, dtype=np.int64),
                          np.array([len(token_ns)], dtype=np.int64), np.ones(1, dtype=bool))

    def add_requests(self, t0_ns: np.ndarray, end_ns: np.ndarray, offsets: np.ndarray, tokens_ns: np.ndarray,
                     lens: np.ndarray, rows: np.ndarray) -> None:
        """Requests (the rows where ``rows`` is set) in flight from ``t0_ns`` to ``end_ns``, in their records'
        nanoseconds, ``offsets`` (window-clock seconds minus record seconds) apart from the window's clock; their
        tokens at ``tokens_ns``, each row's ``lens`` of them in turn (a batch's tokens, all rows')."""
        last = len(self.flags) - 1
        base = (offsets - self.start) / BUCKET  # bucket = ns * k + base, truncated
        k = 1e-9 / BUCKET
        a = np.clip((t0_ns * k + base).astype(np.int64), 0, last)[rows]
        b = np.clip((end_ns * k + base).astype(np.int64), 0, last)[rows]
        np.add.at(self.inflight_delta, a, 1)
        np.add.at(self.starts, a, 1)
        np.add.at(self.inflight_delta, b + 1, -1)
        flags = self._flags_np
        flags[b] = 1  # the end of the body
        if len(tokens_ns):
            idx = (tokens_ns * k + np.repeat(base, lens)).astype(np.int64)
            idx = idx[np.repeat(rows, lens) & (idx >= 0) & (idx <= last)]
            if len(idx):
                flags[idx] = 1

    def add_beat(self, lag: float, cpu_seconds: float | None = None) -> None:
        """One heartbeat that woke in this window, ``lag`` late (and the CPU time since the last one)."""
        lag = max(0.0, lag)
        self.heartbeats += 1
        self.lag.add(lag)
        if cpu_seconds is not None:
            self.cpu = (self.cpu or 0.0) + cpu_seconds

    def add_stall(self, seconds: float, lag: float, beyond_bound: bool, source: int | None = None) -> None:
        """The part (``seconds``) of a loop lag of ``lag`` that fell in this window; ``beyond_bound``: the
        lag was long enough to impair the requests it overlapped (``request_max_lag``). ``source``: the load
        worker process whose loop it was (None: this process's): each process's stalls add up on their own, and
        the window's figures are the worst process's (two workers stalling at once are not twice the stall)."""
        self.lag_max = max(self.lag_max, lag)
        if source is not None:
            if self.by_source is None:
                self.by_source = {}
            acc = self.by_source.setdefault(source, [0.0, 0.0])
            if lag > STALL_LAG:
                acc[0] += seconds
            if beyond_bound:
                acc[1] += seconds
            return
        if lag > STALL_LAG:
            self.stall += seconds
        if beyond_bound:
            self.request_stall += seconds

    def worst_stalls(self) -> tuple[float, float]:
        """(stall, request stall) seconds of the process that stalled most in this window."""
        stall, request = self.stall, self.request_stall
        for a, b in (self.by_source or {}).values():
            stall, request = max(stall, a), max(request, b)
        return stall, request

    def add_lag(self, lag: float, cpu_seconds: float | None = None, bound: float | None = None) -> None:
        """A heartbeat and its whole lag charged to this window (``bound``: the request bound, default 0.1 s)."""
        self.add_beat(lag, cpu_seconds)
        lag = max(0.0, lag)
        self.add_stall(lag, lag, lag >= (bound if bound is not None else 0.1))

    def add_throttling(self, seconds: float, periods: int) -> None:
        self.throttled = (self.throttled or 0.0) + seconds
        self.periods = (self.periods or 0) + periods

    def freeze(self) -> tuple[float, float] | None:
        """(longest span of buckets with a request in flight and no byte, its start offset)."""
        best, best_at, run, run_at, level = 0, 0, 0, 0, 0
        delta = self.inflight_delta.tolist()
        for i, f in enumerate(self.flags):
            level += delta[i]
            if level > 0 and not f:
                if run == 0:
                    run_at = i
                run += 1
                if run > best:
                    best, best_at = run, run_at
            else:
                run = 0
        if best == 0:
            return None
        return best * BUCKET, best_at * BUCKET

    def silent_requests(self, at: int, n: int) -> int:
        """The requests silent through a silence of ``n`` buckets from bucket ``at``: those in flight at its start
        (no byte, no end, so silent throughout) and those that started in its first half (silent at least half)."""
        return int(self.inflight_delta[: at + 1].sum() + self.starts[at + 1: at + n // 2 + 1].sum())

    def summary(self, wall: float, cfg: ClientConfig | None, requests: int = 0,
                lag_bound: float | None = None) -> ClientSummary:
        """``requests``: the window's requests (the impaired share's denominator); ``lag_bound``: the stall
        bound in force (default ``cfg.request_max_lag``)."""
        stall, request_stall = self.worst_stalls()
        out = ClientSummary(heartbeats=self.heartbeats, stall_seconds=stall, cpu_seconds=self.cpu,
                            cgroup_throttled_seconds=self.throttled, cgroup_throttled_periods=self.periods,
                            requests_impaired=self.impaired_requests, request_stall_seconds=request_stall,
                            impaired_share=self.impaired_requests / requests if requests else None)
        if self.heartbeats:
            out.loop_lag_p50_seconds = quantile(self.lag, 0.5)
            out.loop_lag_p99_seconds = quantile(self.lag, 0.99)
        if self.heartbeats or self.lag_max:
            out.loop_lag_max_seconds = self.lag_max
        if self.cpu is not None and wall > 0:
            out.cpu_share = self.cpu / wall
        fr = self.freeze()
        if fr is not None:
            out.freeze_max_seconds, out.freeze_start_offset_seconds = fr
            out.freeze_requests = self.silent_requests(round(fr[1] / BUCKET), round(fr[0] / BUCKET))
        cfg = cfg or ClientConfig()
        bound = f"{(lag_bound or cfg.request_max_lag) * 1000:.0f} ms"
        why = []
        share = cfg.max_impaired_share
        if requests and self.impaired_requests > share * requests:
            why.append(f"{self.impaired_requests} of {requests} requests ({self.impaired_requests / requests:.1%}) "
                       f"overlapped a stall of soakd's event loop beyond {bound}")
        if wall > 0 and request_stall > share * wall:
            why.append(f"soakd's event loop stalled beyond {bound} for {request_stall:.2f} s "
                       f"({request_stall / wall:.1%} of the window)")
        if cfg.max_stall_share is not None and wall > 0 and stall > cfg.max_stall_share * wall:
            why.append(f"soakd's event loop stalled {stall:.2f} s ({stall / wall:.1%} of the window)")
        if cfg.max_lag is not None and self.lag_max > cfg.max_lag:
            why.append(f"one stall of {self.lag_max * 1000:.0f} ms")
        if (cfg.max_throttled_share is not None and self.throttled is not None and wall > 0
                and self.throttled > cfg.max_throttled_share * wall):
            why.append(f"soakd's cgroup was CPU-throttled {self.throttled:.2f} s ({self.throttled / wall:.1%})")
        if why:
            out.impaired, out.impaired_reason = True, "; ".join(why)
        return out


def extra_variance(n: list[int], s1: list[float], s2: list[float]) -> tuple[float, float] | None:
    """Batch means of the log latency over the sub-windows: ``(variance of the window's mean log
    latency beyond the independent-requests variance, batch-means / independent ratio)``; None with
    fewer than 5 sub-windows of ``MIN_SUB_COUNT`` requests."""
    rows = [(c, a / c) for c, a in zip(n, s1) if c >= MIN_SUB_COUNT]
    if len(rows) < 5:
        return None
    total = sum(c for c, _ in rows)
    mean = sum(c * m for c, m in rows) / total
    k = len(rows)
    var_bm = k / (k - 1) * sum((c / total) ** 2 * (m - mean) ** 2 for c, m in rows)
    count = sum(n)
    within = max(0.0, sum(s2) / count - (sum(s1) / count) ** 2)
    var_iid = within / count
    if var_iid <= 0:
        return None
    return max(0.0, var_bm - var_iid), var_bm / var_iid


class ScenarioStats:
    __slots__ = ("count", "outcomes", "e2e", "ttft", "itl", "prompt_tokens", "completion_tokens",
                 "completion_tokens_sumsq", "streamed", "slo_requests", "slo_met")

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
        self.slo_requests = 0  # requests under an SLO (RequestRecord.slo_met set)
        self.slo_met = 0


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
                 "late_records", "closed", "paused_seconds", "target_down_seconds", "sub_seconds", "sub",
                 "closed_as", "revision", "client", "kv_saturated_ratio", "failures", "pending", "on_flushed")

    def __init__(self, index: int, start: float, end: float, wall_start: float,
                 sub_length: float | None = None, kv_saturated_ratio: float = 0.98) -> None:
        self.index = index
        self.kv_saturated_ratio = kv_saturated_ratio
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
        self.sub_seconds = sub_length if sub_length is not None else sub_seconds(end - start)
        self.sub = SubStats(max(1, math.ceil((end - start) / self.sub_seconds - 1e-9)))
        self.closed_as: tuple[float | None, bool] = (None, False)  # (actual end, partial) when it closed
        self.client = ClientStats(start, end - start)
        self.revision = 0
        self.failures: dict[str, int] = {}  # failed requests by bounded reason (the error policy's evidence)
        self.pending: list[tuple[RequestRecord, bool]] = []  # added, not flushed yet
        # called with each flushed batch's latencies by scenario (the recorder's histograms)
        self.on_flushed: Callable[[dict[str, Settled]], None] | None = None

    def sub_index(self, t: float) -> int:
        """The sub-window of monotonic time ``t``."""
        return min(self.sub.k - 1, max(0, int((t - self.start) // self.sub_seconds)))

    def stats(self, scenario: str) -> ScenarioStats:
        s = self.scenarios.get(scenario)
        if s is None:
            s = self.scenarios[scenario] = ScenarioStats()
        return s

    # ---- what a window collects
    def add(self, rec: RequestRecord, impaired: bool = False) -> None:
        """A finished request; ``impaired``: it overlapped a stall of soakd's own loop (counted, its latency
        left out). It waits for ``flush()``, which settles the requests added since the last one in a batch (a
        heartbeat's worth: see ``soakd.analysis.settle``); ``summary()`` flushes first."""
        self.pending.append((rec, impaired))

    def flush(self) -> None:
        """The requests added since the last flush into the window's counts and sketches (and ``on_flushed``)."""
        if not self.pending:
            return
        batch, self.pending = self.pending, []
        settled = settle(self, batch)
        if self.on_flushed is not None:
            self.on_flushed(settled)

    def add_samples(self, series: list[Series], t: float) -> None:
        if self.telemetry is None:
            self.telemetry = TelemetryStats(self.kv_saturated_ratio)
        self.telemetry.add(series, t)

    def add_energy(self, joules: float, seconds: float) -> None:
        if self.telemetry is None:
            self.telemetry = TelemetryStats(self.kv_saturated_ratio)
        self.telemetry.add_energy(joules, seconds)

    # ---- the summary
    def summary(self, actual_end: float | None = None, partial: bool = False, confidence: float = 0.95,
                segment: int = 0, revision: int = 0, client_cfg: ClientConfig | None = None,
                lag_bound: float | None = None) -> WindowSummary:
        self.flush()
        end = actual_end if actual_end is not None else self.end
        wall = max(1e-9, end - self.start)
        dur = max(1e-9, wall - min(self.paused_seconds, wall * 0.999))
        per: dict[str, ScenarioSummary] = {}
        total = ok = 0
        outcomes = dict.fromkeys(OUTCOMES, 0)
        ctoks = ptoks = streamed = 0
        sumsq = 0.0
        slo_n = slo_met = 0
        for name, s in sorted(self.scenarios.items()):
            slo_n += s.slo_requests
            slo_met += s.slo_met
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
                requests_per_second=s.outcomes["ok"] / dur,
                output_tokens_per_second=s.completion_tokens / dur,
                completion_tokens=s.completion_tokens,
                completion_tokens_sumsq=s.completion_tokens_sumsq,
                goodput=Goodput(requests=s.slo_requests, met=s.slo_met) if s.slo_requests else None,
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
            failures=dict(sorted(self.failures.items())),
            error_rate=(1 - ok / total) if total else None,
            mix={n: (v.requests / total if total else 0.0) for n, v in per.items()},
            e2e_seconds=quantiles(merged(s.e2e for s in sketches), confidence),
            ttft_seconds=quantiles(merged(s.ttft for s in sketches), confidence),
            itl_seconds=quantiles(merged(s.itl for s in sketches), confidence, n_effective=streamed or None),
            requests_per_second=ok / dur,
            errors_per_second=(total - ok - outcomes.get("cancelled", 0)) / dur,
            output_tokens_per_second=ctoks / dur,
            prompt_tokens=ptoks,
            completion_tokens=ctoks,
            completion_tokens_sumsq=sumsq,
            late_records=self.late_records,
            revision=revision,
            subwindows=self.sub.summary(self.sub_seconds),
            client=self.client.summary(wall, client_cfg, total, lag_bound),
            scenarios=per,
            goodput=Goodput(requests=slo_n, met=slo_met) if slo_n else None,
            quiesce=self.quiesce,
            **({"device": tel.device(ctoks, dur), "server": tel.server(self.start), "host": tel.host()}
               if tel is not None else {}),
        )


def fmt_ms(v: float | None) -> str:
    return "-" if v is None or math.isnan(v) else f"{v * 1000:.1f}ms"

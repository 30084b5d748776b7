"""A window's finished requests settled in one batch: a heartbeat's worth of them (dozens at thousands of requests
a second). One pass over the records counts what is counted per request (outcomes, failures, SLO, tokens,
sub-window requests); the latencies, the inter-token gaps, the sub-windows' log-latency sums and the freeze
detector's activity buckets are computed over the whole batch at once, as numpy columns, not token by token.
What it gives is what settling the requests one by one gives: the same counts, buckets and sums (the sums still
added value by value, in order; ``tests/unit/test_settle.py`` holds it to the one-by-one rules).
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import numpy as np

from soakd.analysis.sketch import add_many
from soakd.core.records import Outcome, RequestRecord, bounded_reason

Settled = tuple[np.ndarray, np.ndarray, np.ndarray, int]
"""One scenario's part of a settled batch: its e2e, TTFT and inter-token gap seconds (measured requests: OK and
not impaired) and how many of its requests were impaired."""

_EMPTY = np.empty(0, dtype=np.float64)


def settle(w: Any, batch: list[tuple[RequestRecord, bool]]) -> dict[str, Settled]:
    """``batch``: (record, impaired) pairs, into ``w`` (a ``soakd.analysis.window.OpenWindow``). Returns each
    scenario's latencies (see ``Settled``)."""
    ok_, cancelled = Outcome.OK, Outcome.CANCELLED
    sub = w.sub
    kmax = sub.k - 1
    sub_requests, sub_ok = sub.requests, sub.ok
    failures = w.failures
    index: dict[str, int] = {}
    stats: list[Any] = []  # the scenarios' ScenarioStats, in the order first seen
    impaired_n: list[int] = []
    e_sc: list[int] = []  # the measured requests (OK, not impaired): scenario, sub-window, e2e
    e_j: list[int] = []
    e_v: list[float] = []
    r_tok: list[list[int]] = []  # rows with token times: a stream the freeze detector follows, or one measured
    r_t0: list[int] = []
    r_end: list[int] = []
    r_off: list[float] = []
    r_client: list[bool] = []
    r_lat: list[bool] = []
    r_sc: list[int] = []
    r_j: list[int] = []
    for rec, impaired in batch:
        name = rec.scenario
        i = index.get(name)
        if i is None:
            i = index[name] = len(stats)
            stats.append(w.stats(name))
            impaired_n.append(0)
        s = stats[i]
        s.count += 1
        outcome = rec.outcome
        s.outcomes[outcome._value_] += 1  # (the enum's .value property costs 5x the attribute)
        ok = outcome is ok_
        if not ok and outcome is not cancelled:
            why = bounded_reason(rec)
            failures[why] = failures.get(why, 0) + 1
        if rec.slo_met is not None:
            s.slo_requests += 1
            s.slo_met += rec.slo_met
        j = rec.sub
        j = 0 if j < 0 else (kmax if j > kmax else j)
        sub_requests[j] += 1
        t0 = rec.t_start_ns
        # a non-streamed body is silent until its end: only streams are followed for the freeze detector
        client = rec.t_sent is not None and bool(t0) and rec.stream
        lat = False
        if impaired:
            impaired_n[i] += 1
        if ok:
            sub_ok[j] += 1
            ct = rec.completion_tokens
            s.prompt_tokens += rec.prompt_tokens
            s.completion_tokens += ct
            s.completion_tokens_sumsq += ct * ct
            if not impaired:  # an impaired request's tokens count (throughput), its latency is soakd's as much
                e_sc.append(i)
                e_j.append(j)
                e_v.append((rec.t_end_ns - t0) / 1e9)
                if rec.stream and rec.token_times_ns:
                    lat = True
                    s.streamed += 1
        if client or lat:
            r_tok.append(rec.token_times_ns)
            r_t0.append(t0)
            r_end.append(rec.t_end_ns or t0)
            r_off.append(rec.t_sent - t0 / 1e9 if client else 0.0)  # type: ignore[operator]
            r_client.append(client)
            r_lat.append(lat)
            r_sc.append(i)
            r_j.append(j)
    e2e = np.array(e_v, dtype=np.float64)
    e2e_sc = np.array(e_sc, dtype=np.int64)
    if len(e2e):
        sub.add_many("e2e", np.array(e_j, dtype=np.int64), e2e)
    ttft, ttft_sc, itl, itl_sc = _EMPTY, e2e_sc[:0], _EMPTY, e2e_sc[:0]
    if r_tok:
        n = len(r_tok)
        lens = np.fromiter(map(len, r_tok), dtype=np.int64, count=n)
        flat = np.fromiter(chain.from_iterable(r_tok), dtype=np.int64, count=int(lens.sum()))
        t0s = np.array(r_t0, dtype=np.int64)
        client_rows = np.array(r_client, dtype=bool)
        if client_rows.any():
            w.client.add_requests(t0s, np.array(r_end, dtype=np.int64), np.array(r_off, dtype=np.float64),
                                  flat, lens, client_rows)
        lat_rows = np.array(r_lat, dtype=bool)
        if lat_rows.any():
            row_sc, row_j = np.array(r_sc, dtype=np.int64), np.array(r_j, dtype=np.int64)
            first_at = np.cumsum(lens) - lens
            has = lat_rows & (lens > 0)
            ttft = (flat[first_at[has]] - t0s[has]) / 1e9
            ttft_sc = row_sc[has]
            sub.add_many("ttft", row_j[has], ttft)
            long = lat_rows & (lens > 1)
            if long.any():
                row = np.repeat(np.arange(n), lens)
                keep = (row[1:] == row[:-1]) & long[row[1:]]
                itl = np.diff(flat)[keep] / 1e9
                itl_sc = row_sc[row[1:][keep]]
                span = flat[first_at[long] + lens[long] - 1] - flat[first_at[long]]
                sub.add_many("itl", row_j[long], span / 1e9 / (lens[long] - 1))  # each request's mean gap
    w.client.impaired_requests += sum(impaired_n)
    out: dict[str, Settled] = {}
    for name, i in index.items():
        s = stats[i]
        if len(stats) == 1:
            parts = (e2e, ttft, itl)
        else:
            parts = (e2e[e2e_sc == i], ttft[ttft_sc == i], itl[itl_sc == i])
        for sketch, values in zip((s.e2e, s.ttft, s.itl), parts, strict=True):
            if len(values):
                add_many(sketch, values)
        out[name] = (*parts, impaired_n[i])
    return out

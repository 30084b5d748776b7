"""A window's batch of finished requests settled at once (``soakd.analysis.settle``, numpy columns) against the
rules applied one request and one token at a time, written out here as the reference: the same counts, sketch
buckets, sub-window aggregates and freeze-detector buckets, sums to rounding, on seeded mixes of every kind of
record (failures, cancels, impaired, non-streamed, 0, 1 and 80 tokens, tokens before the window and past its
tail, a record the window set did not send)."""

from __future__ import annotations

import math
import random

import pytest

from soakd.analysis.sketch import new_sketch
from soakd.analysis.window import BUCKET, FAMILIES, OpenWindow
from soakd.core.records import Outcome, RequestRecord, bounded_reason

NAMES = ("short_chat", "long_context", "code_completion")


class Reference:
    """What a window held after each request was added alone (the rules before the batch)."""

    def __init__(self, w: OpenWindow) -> None:
        self.start, self.k = w.client.start, w.sub.k
        n = len(w.client.flags)
        self.flags, self.delta, self.starts = bytearray(n), [0] * (n + 1), [0] * (n + 1)
        self.impaired = 0
        self.sub_requests, self.sub_ok = [0] * self.k, [0] * self.k
        self.sub = {f: ([0] * self.k, [0.0] * self.k, [0.0] * self.k) for f in FAMILIES}
        self.failures: dict[str, int] = {}
        self.sc: dict[str, dict] = {}

    def _activity(self, t0_ns: int, end_ns: int, tokens: list[int], offset: float) -> None:
        last = len(self.flags) - 1
        base, k = (offset - self.start) / BUCKET, 1e-9 / BUCKET
        a = min(last, max(0, int(t0_ns * k + base)))
        b = min(last, max(0, int(end_ns * k + base)))
        self.delta[a] += 1
        self.starts[a] += 1
        self.delta[b + 1] -= 1
        self.flags[b] = 1
        for t in tokens:
            i = int(t * k + base)
            if 0 <= i <= last:
                self.flags[i] = 1

    def _sub(self, j: int, family: str, seconds: float) -> None:
        if seconds > 0:
            n, s1, s2 = self.sub[family]
            x = math.log(seconds)
            n[j] += 1
            s1[j] += x
            s2[j] += x * x

    def add(self, rec: RequestRecord, impaired: bool) -> None:
        s = self.sc.setdefault(rec.scenario, {"count": 0, "outcomes": {}, "slo": [0, 0], "tokens": [0, 0, 0.0],
                                              "streamed": 0, "e2e": new_sketch(), "ttft": new_sketch(),
                                              "itl": new_sketch(), "impaired": 0, "values": ([], [], [])})
        s["count"] += 1
        s["outcomes"][rec.outcome.value] = s["outcomes"].get(rec.outcome.value, 0) + 1
        if rec.outcome is not Outcome.OK and rec.outcome is not Outcome.CANCELLED:
            why = bounded_reason(rec)
            self.failures[why] = self.failures.get(why, 0) + 1
        if rec.slo_met is not None:
            s["slo"][0] += 1
            s["slo"][1] += rec.slo_met
        j = min(self.k - 1, max(0, rec.sub))
        t0 = rec.t_start_ns
        if rec.t_sent is not None and t0 and rec.stream:
            self._activity(t0, rec.t_end_ns or t0, rec.token_times_ns, rec.t_sent - t0 / 1e9)
        self.sub_requests[j] += 1
        if impaired:
            self.impaired += 1
            s["impaired"] += 1
        if rec.outcome is not Outcome.OK:
            return
        self.sub_ok[j] += 1
        ct = rec.completion_tokens
        s["tokens"][0] += rec.prompt_tokens
        s["tokens"][1] += ct
        s["tokens"][2] += ct * ct
        if impaired:
            return
        e2e = (rec.t_end_ns - t0) / 1e9
        s["values"][0].append(e2e)
        s["e2e"].add(max(e2e, 0.0))
        self._sub(j, "e2e", e2e)
        times = rec.token_times_ns
        if rec.stream and times:
            ttft = (times[0] - t0) / 1e9
            s["values"][1].append(ttft)
            s["ttft"].add(max(ttft, 0.0))
            self._sub(j, "ttft", ttft)
            gaps = [(b - a) / 1e9 for a, b in zip(times, times[1:])]
            s["values"][2].extend(gaps)
            for g in gaps:
                s["itl"].add(max(g, 0.0))
            if gaps:
                self._sub(j, "itl", sum(gaps) / len(gaps))
            s["streamed"] += 1


def _record(rng: random.Random, t0_window: float) -> tuple[RequestRecord, bool]:
    r = RequestRecord(rng.choice(NAMES), stream=rng.random() < 0.85)
    r.window = 0
    t_sent = t0_window + rng.uniform(-2.0, 64.0)  # a few sent just before or after the window's own 60 s
    # the record's own perf_counter_ns, anywhere (some where a record's clock, read as the window's, falls in it)
    clock_ns = rng.randint(10**12, 10**15) if rng.random() < 0.7 else rng.randint(10**11, 2 * 10**11)
    r.t_sent = None if rng.random() < 0.03 else t_sent
    r.t_start_ns = clock_ns
    r.sub = rng.randint(-1, 11)
    n = rng.choice((0, 1, 2, 16, 16, 80))
    t = clock_ns + rng.randint(1_000_000, 200_000_000)
    times = []
    for _ in range(n):
        times.append(t)
        t += rng.choice((0, rng.randint(1, 60_000_000)))  # some zero gaps
    r.token_times_ns = times
    r.t_end_ns = (times[-1] if times else clock_ns) + rng.randint(0, 2_000_000)
    r.prompt_tokens, r.completion_tokens = rng.randint(10, 900), n
    if rng.random() < 0.2:
        r.slo_met = rng.random() < 0.5
    u = rng.random()
    if u < 0.06:
        r.fail(Outcome.HTTP_ERROR, rng.choice(("http_500", "http_429")))
    elif u < 0.09:
        r.fail(Outcome.TIMEOUT, "first_token_timeout")
        r.t_end_ns = 0 if rng.random() < 0.5 else r.t_end_ns
    elif u < 0.11:
        r.fail(Outcome.CANCELLED, "cancelled")
    return r, rng.random() < 0.1


def _keys(sk) -> dict[int, float]:  # noqa: ANN001
    return {i + sk._store.offset: c for i, c in enumerate(sk._store.bins) if c}


def _same_sketch(a, b) -> None:  # noqa: ANN001
    assert _keys(a) == _keys(b)
    assert (a.count, a._zero_count, a._min, a._max) == (b.count, b._zero_count, b._min, b._max)
    assert math.isclose(a.sum, b.sum, rel_tol=1e-12, abs_tol=1e-15)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_a_batch_settles_as_the_requests_one_by_one(seed: int) -> None:
    rng = random.Random(seed)
    w = OpenWindow(0, 100.0, 160.0, 1.7e9)
    ref = Reference(w)
    got: dict[str, list] = {}
    pairs = [_record(rng, 100.0) for _ in range(900)]
    i = 0
    while i < len(pairs):  # batches of 1 to 120, as heartbeats at different rates give them
        batch = pairs[i:i + rng.choice((1, 2, 7, 46, 120))]
        i += len(batch)
        for rec, bad in batch:
            ref.add(rec, bad)
            w.add(rec, bad)
        w.on_flushed = lambda settled: [got.setdefault(k, []).append(v) for k, v in settled.items()]
        w.flush()
    assert w.pending == []
    assert sum(len(b) for v in got.values() for b in v) > 0
    c = w.client
    assert bytes(c.flags) == bytes(ref.flags) and sum(ref.flags) > 100
    assert c.inflight_delta.tolist() == ref.delta and c.starts.tolist() == ref.starts
    assert c.impaired_requests == ref.impaired > 0
    assert w.failures == ref.failures and len(ref.failures) >= 2
    assert w.sub.requests == ref.sub_requests and w.sub.ok == ref.sub_ok
    for f in FAMILIES:
        n, s1, s2 = ref.sub[f]
        assert w.sub.n[f] == n and sum(n) > 0
        for x, y in zip(w.sub.s1[f] + w.sub.s2[f], s1 + s2, strict=True):
            assert math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9)
    assert set(w.scenarios) == set(ref.sc) == set(NAMES)
    for name, s in w.scenarios.items():
        r = ref.sc[name]
        assert s.count == r["count"] and {k: v for k, v in s.outcomes.items() if v} == r["outcomes"]
        assert [s.slo_requests, s.slo_met] == r["slo"] and s.streamed == r["streamed"]
        assert [s.prompt_tokens, s.completion_tokens, s.completion_tokens_sumsq] == r["tokens"]
        for fam in ("e2e", "ttft", "itl"):
            _same_sketch(getattr(s, fam), r[fam])
        # what the recorder's histograms are handed: the same values, and the impaired requests counted
        handed = [sorted(x for b in got[name] for x in b[k].tolist()) for k in range(3)]
        for h, v in zip(handed, r["values"], strict=True):
            assert h == pytest.approx(sorted(v), rel=1e-12, abs=1e-15)
        assert len(handed[2]) > 1000
        assert sum(b[3] for b in got[name]) == r["impaired"]
    # the summary is built from what was settled (flush is idempotent: nothing is added twice)
    summ = w.summary()
    assert summ.requests == 900 and summ.client.requests_impaired == ref.impaired


"""The open windows of a soak (``soakd.soak.windows.WindowSet``) on a manual clock: closing on
time, waiting for stragglers up to the patience, late records, probe intervals, the end of the
run; and the run's window history (``soakd.analysis.engine.WindowHistory``)."""

from __future__ import annotations

from soakd.analysis.engine import WindowHistory
from soakd.config.analysis import ClientConfig
from soakd.core.records import Outcome, RequestRecord
from soakd.core.series import series
from soakd.core.summary import QuiesceProbe, WindowSummary
from soakd.core.timeline import ManualClock, Timeline
from soakd.soak.windows import WindowSet


def _record(window: int, t: float, ok: bool = True) -> RequestRecord:
    r = RequestRecord("short_chat")
    r.window, r.warmup = window, window < 0
    r.t_start_ns = int(t * 1e9)
    r.token_times_ns = [r.t_start_ns + 10_000_000, r.t_start_ns + 20_000_000]
    r.t_end_ns = r.t_start_ns + 30_000_000
    r.completion_tokens = 2
    if not ok:
        r.fail(Outcome.HTTP_ERROR, "http_500")
    return r


def _close(a: object, b: object, path: str = "") -> bool:
    """Equal documents, floats to a relative 1e-9 (a variance that is 0 one way: to 1e-12)."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), path
        return all(_close(a[k], b[k], f"{path}.{k}") for k in a)
    if isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), path
        return all(_close(x, y, f"{path}[{i}]") for i, (x, y) in enumerate(zip(a, b)))
    if isinstance(a, float) and isinstance(b, float):
        assert abs(a - b) <= max(1e-9 * max(abs(a), abs(b)), 1e-12), (path, a, b)
        return True
    assert a == b, (path, a, b)
    return True


def _set(clock: ManualClock, patience: float = 5.0) -> WindowSet:
    return WindowSet(Timeline(100.0, 10.0, 60.0, 250.0), patience=patience, clock=clock)


def test_a_window_closes_when_its_requests_finished_or_after_the_patience() -> None:
    clock = ManualClock(100.0)
    ws = _set(clock)
    early, slow = _record(0, 111.0), _record(0, 169.0)
    ws.started(early)
    ws.started(slow)
    ws.finished(early)
    assert ws.close_due(169.5) == []  # not over yet
    assert ws.close_due(171.0) == []  # over, one request still in flight: wait
    closed = ws.close_due(175.5)  # the patience ran out
    assert [w.window for w in closed] == [0] and closed[0].requests == 1 and not closed[0].partial
    ws.finished(slow)  # finished after its window closed: counted into it by a revision
    revised = ws.close_due(176.0)
    assert [(w.window, w.revision, w.late_records, w.requests) for w in revised] == [(0, 1, 1, 2)]
    assert revised[0].e2e_seconds.count == 2 and not revised[0].partial
    assert ws.close_due(177.0) == []  # revised once, then gone
    assert ws.closed_count == 1


def test_sub_windows_follow_the_send_time_and_zero_gaps_count() -> None:
    clock = ManualClock(100.0)
    ws = _set(clock)
    for t in (111.0, 112.0, 125.0):  # sub-windows of 6 s (a tenth of the 60 s window): 0, 0, 2
        clock.now = t
        r = _record(0, t)
        r.token_times_ns = [r.t_start_ns + 10_000_000] * 2 + [r.t_start_ns + 20_000_000]  # gaps 0 and 10 ms
        ws.started(r)
        ws.finished(r)
    bad = _record(0, 140.0, ok=False)
    clock.now = 140.0
    ws.started(bad)
    ws.finished(bad)
    (w,) = ws.close_due(171.0)
    sub = w.subwindows
    assert sub is not None and sub.seconds == 6.0 and len(sub.requests) == 10
    assert sub.requests[:6] == [2, 0, 1, 0, 0, 1] and sub.ok[:6] == [2, 0, 1, 0, 0, 0]
    assert sub.e2e[0] is not None and abs(sub.e2e[0] - 0.03) < 1e-9 and sub.e2e[1] is None
    assert w.itl_seconds.count == 6 and w.itl_seconds.p50 == 0.0  # the zero gaps stay in the sketch
    assert w.requests_per_second == 3 / 60.0 and w.errors_per_second == 1 / 60.0  # successes only


def test_intervals_samples_and_the_probe_go_to_their_window() -> None:
    clock = ManualClock(100.0)
    ws = _set(clock)
    ws.add_interval(120.0, 126.0, "paused_seconds")
    ws.add_interval(165.0, 175.0, "target_down_seconds")  # across windows 0 and 1
    assert ws.add_samples([series("soakd_gpu_power_watts", 300.0, gpu="0", uuid="u")], 121.0) == 0
    assert ws.add_samples([series("soakd_gpu_power_watts", 300.0, gpu="0", uuid="u")], 105.0) is None  # warm-up
    ws.set_probe(QuiesceProbe(t_unix=1.0, window=0, drained=True, kv_cache_usage_ratio=0.0))
    w0, w1 = ws.close_due(231.0)  # windows [110, 170) and [170, 230)
    assert w0.paused_seconds == 6.0 and w0.target_down_seconds == 5.0 and w1.target_down_seconds == 5.0
    assert w0.duration_seconds == 54.0  # the probe's pause is not load time
    assert w0.device.power_watts is not None and w0.device.power_watts.mean == 300.0
    assert w0.quiesce is not None and w0.quiesce.drained and w1.quiesce is None


def test_after_the_final_close_no_window_opens_or_closes() -> None:
    """A run stopped early (SIGTERM, max_requests) closes its open window as partial; a later
    tick must not close the windows the timeline still has ahead as empty full windows."""
    clock = ManualClock(100.0)
    ws = _set(clock)
    r = _record(0, 112.0)
    ws.started(r)
    ws.finished(r)
    (last,) = ws.close_due(130.0, final=True)
    assert last.window == 0 and last.partial and last.requests == 1
    assert ws.close_due(300.0) == [] and ws.close_due(400.0, final=True) == []
    assert ws.add_samples([series("soakd_gpu_power_watts", 1.0, gpu="0", uuid="u")], 200.0) is None


def test_the_history_keeps_the_run_error_rate_beyond_its_bound() -> None:
    h = WindowHistory(max_windows=3)
    for i in range(10):
        bad = 10 if i < 5 else 0  # the early windows had errors
        h.add(WindowSummary(window=i, requests=100, outcomes={"ok": 100 - bad, "http_error": bad}))
    h.add(WindowSummary(window=10, requests=50, partial=True, outcomes={"http_error": 50}))  # not judged
    assert len(h) == 3 and h.count == 11
    assert h.error_rate() == 50 / 1000
    assert [w.window for w in h.full()] == [8, 9]


def _beats(ws: WindowSet, t0: float, t1: float, period: float = 0.5, stalls: dict[float, float] | None = None) -> None:
    """The heartbeat from ``t0`` to ``t1``: a beat every ``period``, a beat ``lag`` late at each stall's end."""
    stalls = dict(stalls or {})
    t = t0
    while t <= t1:
        ws.add_lag(t, stalls.pop(t, 0.001))
        t = round(t + period, 6)


def test_a_request_that_overlapped_a_stall_is_impaired_and_left_out_of_the_latency() -> None:
    """A 300 ms stall at 130.0 (reported by the beat at 130.0): the request in flight across it is counted,
    impaired, its tokens in the throughput, its latency in no sketch; the one before and after are not."""
    clock = ManualClock(100.0)
    ws = _set(clock)
    settled: list[tuple[float, bool]] = []
    ws.on_settled = lambda rec, bad: settled.append((rec.t_start_ns / 1e9, bad))
    _beats(ws, 110.0, 125.0)
    recs = []
    for t in (126.0, 129.6, 129.9, 131.0):  # each lasts 30 ms
        clock.now = t
        r = _record(0, t)
        r.t_sent = t  # the window set's clock and the record's are the same here
        ws.started(r)
        r.t_sent = t
        recs.append(r)
    for r in recs:
        ws.finished(r)
    assert ws.pending == 4  # each ended after the last beat: it waits for the heartbeat
    _beats(ws, 125.5, 169.5, stalls={130.0: 0.3})
    assert ws.pending == 0 and settled == [(126.0, False), (129.6, False), (129.9, True), (131.0, False)]
    (w,) = ws.close_due(171.0)
    c = w.client
    assert w.requests == 4 and w.e2e_seconds.count == 3 and w.ttft_seconds.count == 3 and w.completion_tokens == 8
    assert c is not None and c.requests_impaired == 1 and c.impaired_share == 0.25
    assert abs(c.request_stall_seconds - 0.3) < 1e-9 and c.impaired  # 1 of 4 is more than a fifth
    assert "1 of 4 requests (25.0%) overlapped a stall" in (c.impaired_reason or "")


def test_a_stall_is_charged_to_the_windows_it_covered_not_to_the_next() -> None:
    """soakd stopped from 160 to 185 (SIGSTOP): the heartbeat's first beat after it, at 185, reports a
    25 s lag: 10 s of it fall in window 0 ([110, 170)), 15 s in window 1, none at all in window 2."""
    clock = ManualClock(100.0)
    ws = WindowSet(Timeline(100.0, 10.0, 60.0, 250.0), patience=5.0, clock=clock, heartbeat_period=0.5)
    _beats(ws, 110.0, 160.0)
    _beats(ws, 185.0, 245.0, stalls={185.0: 25.0})
    w0, w1 = ws.close_due(231.0)
    assert abs(w0.client.request_stall_seconds - 10.0) < 1e-6 and abs(w1.client.request_stall_seconds - 15.0) < 1e-6
    assert w0.client.loop_lag_max_seconds == 25.0 and not w0.client.impaired  # 10 s of 60: a sixth
    assert w1.client.impaired and "15.00 s (25.0% of the window)" in (w1.client.impaired_reason or "")
    (w2,) = ws.close_due(245.2, final=True)
    assert w2.client.request_stall_seconds == 0.0 and not w2.client.impaired


def test_a_close_right_after_soakd_was_stopped_charges_the_silence_it_sees() -> None:
    """The close runs before the heartbeat's first beat after a stop (the order of callbacks after a
    SIGCONT): the silence since the last beat is charged at once, to the window it covered; the beat's
    own report of it later adds nothing twice."""
    clock = ManualClock(100.0)
    ws = WindowSet(Timeline(100.0, 10.0, 60.0, 250.0), patience=5.0, clock=clock, heartbeat_period=0.5)
    _beats(ws, 110.0, 150.0)
    (w0,) = ws.close_due(171.0)  # stopped after the beat at 150 (due at 150.5) to 171: 19.5 s of window 0, 1 s of window 1
    assert w0.client.impaired and abs(w0.client.request_stall_seconds - 19.5) < 1e-6
    ws.add_lag(171.0, 20.99)  # the heartbeat's own report: already charged
    _beats(ws, 171.5, 231.0)
    (w1,) = ws.close_due(231.0)
    assert abs(w1.client.request_stall_seconds - 1.0) < 1e-6


def test_a_request_waits_for_the_heartbeat_but_never_for_long() -> None:
    """With the runtime's heartbeat (period 10 ms) a finished request waits for the next beat; should the
    heartbeat stop beating, a close still settles what ended more than a second ago (the silence charged)."""
    clock = ManualClock(100.0)
    ws = WindowSet(Timeline(100.0, 10.0, 60.0, 250.0), patience=5.0, clock=clock, heartbeat_period=0.01)
    ws.add_lag(120.0, 0.001)
    r = _record(0, 121.0)
    clock.now = 121.0
    ws.started(r)
    ws.finished(r)
    assert ws.pending == 1
    assert ws.close_due(121.5) == [] and ws.pending == 1  # half a second: still waiting for a beat
    ws.close_due(122.5)
    assert ws.pending == 0  # the heartbeat is silent: settled, as impaired (the silence overlapped it)
    (w,) = ws.close_due(171.0)
    assert w.requests == 1 and w.client.requests_impaired == 1 and w.e2e_seconds.count == 0


def test_a_lag_the_run_always_has_impairs_nothing_an_unusual_one_does() -> None:
    """With request_lag_relative 3 (optional): soakd on a busy core, every heartbeat 150 ms late, all run long
    (beyond request_max_lag, 100 ms): it moves every window alike, so the bound follows the run's own p90 (x3:
    450 ms) and no request is impaired; a 2 s stall in the middle is beyond it, and impairs the request it
    overlapped. By default (0) the bound stays at 100 ms."""
    assert WindowSet(Timeline(100.0, 10.0, 60.0, 250.0)).ledger.lag_relative == 0.0
    clock = ManualClock(100.0)
    ws = WindowSet(Timeline(100.0, 10.0, 60.0, 250.0), patience=5.0, clock=clock,
                   client=ClientConfig(request_lag_relative=3.0))
    t = 100.0
    while t < 130.0:  # warm-up and the first 20 s of window 0: a beat every 160 ms, 150 ms late
        t = round(t + 0.16, 6)
        ws.add_lag(t, 0.15)
    assert abs(ws.lag_bound - 0.45) < 0.01
    for start in (130.5, 133.0):
        clock.now = start
        r = _record(0, start)
        ws.started(r)
        r.t_sent = start
        ws.finished(r)
    ws.add_lag(131.0, 0.15)
    ws.add_lag(135.0, 2.0)  # soakd stopped 2 s: [133.0, 135.0]
    (w,) = ws.close_due(171.0)
    assert w.client.requests_impaired == 1 and w.e2e_seconds.count == 1


def test_a_heartbeats_batch_of_requests_settles_as_the_requests_one_by_one() -> None:
    """The heartbeat settles the requests that ended before it in one batch (their latencies into the sketches
    and histograms in one pass): the window and the /metrics histograms are those of settling them one by one."""
    import random

    from soakd.metrics import SoakMetrics
    from soakd.soak.recorder import Recorder

    rng = random.Random(3)
    plan = []
    for i in range(600):  # streams of 1 to 80 tokens (the long ones take the numpy path), a few failures
        t = 111.0 + i * 0.05
        n = rng.choice((1, 2, 16, 16, 16, 80))
        plan.append((t, [int(rng.lognormvariate(-4.5, 0.6) * 1e9) for _ in range(n)], rng.random() < 0.05))

    def run(beats: bool) -> tuple[WindowSummary, SoakMetrics]:
        clock = ManualClock(100.0)
        ws = _set(clock)
        metrics = SoakMetrics(("short_chat",))
        rec_ = Recorder(metrics, ws, clock)
        if beats:
            ws.add_lag(110.0, 0.0)
        for k, (t, gaps, failed) in enumerate(plan):
            clock.now = t
            r = RequestRecord("short_chat")
            r.window = 0
            rec_.started(r)
            r.t_start_ns = int(t * 1e9)
            times = [r.t_start_ns + 30_000_000]
            for g in gaps[1:]:
                times.append(times[-1] + g)
            r.token_times_ns, r.t_end_ns, r.completion_tokens = times, times[-1] + 1000, len(times)
            if failed:
                r.fail(Outcome.HTTP_ERROR, "http_500")
            rec_.finished(r)
            if beats and k % 37 == 36:
                ws.add_lag(t - 0.5, 0.0)  # what ended half a second ago settles: batches of dozens
        assert (ws.pending > 0) is beats
        (w,) = [c for c in ws.close_due(175.0, final=True) if c.window == 0]
        assert ws.pending == 0
        return w, metrics

    batched, m_batched = run(True)
    single, m_single = run(False)
    assert batched.requests == 600 and batched.itl_seconds.count > 10_000
    a, b = batched.dump(), single.dump()
    a.pop("client"), b.pop("client")  # the heartbeats themselves are the batched run's only
    # the same values, settled in the order they ended rather than finished: sums differ in the last bits
    assert _close(a, b)
    for name in ("e2e", "ttft", "itl"):
        ha, hb = getattr(m_batched, name).child("short_chat"), getattr(m_single, name).child("short_chat")
        assert ha.counts == hb.counts and ha.count > 0
        assert abs(ha.sum - hb.sum) <= 1e-9 * hb.sum  # summed a batch at a time: the last bit may differ

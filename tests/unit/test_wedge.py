"""The live engine-wedge watch (soakd.soak.wedge) on injected time: requests in flight and silent past
the freeze threshold while GET /models answers is a wedge, and so is a server whose generated-token counter
stands still while it runs requests; an idle server, a server that does not answer, a late check of soakd's
own, bytes or tokens that keep coming, or a restart are not. GET /models that times out with requests in flight
and none progressing is 'target hung' (soakd_target_up 0 until it answers), one probe in flight at most."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from soakd.analysis.engine import Analyzer
from soakd.config import AnalysisConfig
from soakd.core.records import Outcome, RequestRecord
from soakd.core.series import series
from soakd.metrics import Gauge
from soakd.metrics import BY_NAME
from soakd.soak.wedge import WedgeWatch

S = 1_000_000_000


class Clock:
    def __init__(self) -> None:
        self.ns = 100 * S

    def __call__(self) -> int:
        return self.ns


class Recorder:
    def __init__(self) -> None:
        self.active: set[RequestRecord] = set()

    @property
    def in_flight(self) -> int:
        return len(self.active)


def _rec(start_ns: int, tokens: list[int] = (), stream: bool = True) -> RequestRecord:
    r = RequestRecord("short_chat")
    r.stream = stream
    r.t_start_ns = start_ns
    r.token_times_ns = list(tokens)
    return r


def _watch(answers: bool = True) -> tuple[WedgeWatch, Clock, Recorder, Analyzer, Gauge, list[int]]:
    clock, recorder = Clock(), Recorder()
    analyzer = Analyzer(AnalysisConfig(client={"freeze_min": 2.0}))
    gauge = Gauge(BY_NAME["soakd_engine_wedged"])
    probes: list[int] = []

    async def probe() -> Any:
        probes.append(clock.ns)
        if not answers:
            raise ConnectionError("refused")
        return ["model"]

    w = WedgeWatch(recorder, probe, analyzer, gauge, now_ns=clock, wall=lambda: clock.ns / S, window_at=lambda ago: 3)
    return w, clock, recorder, analyzer, gauge, probes


async def _tick(w: WedgeWatch, clock: Clock, seconds: float = 1.0) -> None:
    clock.ns += int(seconds * S)
    await w.check()


async def test_a_silent_engine_whose_front_end_answers_is_wedged_until_its_next_byte() -> None:
    w, clock, rec, analyzer, gauge, probes = _watch()
    r = _rec(clock.ns, [clock.ns + S // 10])
    rec.active.add(r)
    for _ in range(2):  # 1.9 s of silence: below the 2 s threshold
        await _tick(w, clock)
    assert gauge.value == 0.0 and probes == [] and not analyzer.findings
    await _tick(w, clock)  # 2.9 s: probed, answered: wedged
    assert gauge.value == 1.0 and len(probes) == 1
    (f,) = analyzer.findings
    assert f.diagnosis == "engine wedged" and f.severity == "critical" and f.window == 3
    assert 2.0 < f.evidence["silence_seconds"] < 3.0 and f.evidence["in_flight"] == 1
    await _tick(w, clock)  # still silent: the same episode, no second probe or finding
    assert len(probes) == 1 and len(analyzer.findings) == 1
    r.token_times_ns.append(clock.ns)  # a byte: the episode ends
    await _tick(w, clock, 0.1)
    assert gauge.value == 0.0 and w.episodes == 1 and w.episode is None
    assert analyzer.verdict().reasons == ["freeze: engine wedged (window 3)"]
    assert 3 in analyzer.freeze.wedged_windows  # the window's own freeze finding is not made twice


async def test_idle_servers_dead_servers_and_late_checks_are_not_wedged() -> None:
    # idle: nothing in flight however long
    w, clock, rec, analyzer, gauge, probes = _watch()
    for _ in range(10):
        await _tick(w, clock)
    assert not analyzer.findings and probes == []
    # bytes keep coming: no wedge
    r = _rec(clock.ns)
    rec.active.add(r)
    for _ in range(10):
        r.token_times_ns.append(clock.ns)
        await _tick(w, clock)
    assert not analyzer.findings and probes == []
    # a non-streamed request is silent until its end: not counted
    rec.active = {_rec(clock.ns, stream=False)}
    for _ in range(10):
        await _tick(w, clock)
    assert not analyzer.findings
    # the server does not answer GET /models: an outage or a whole-server freeze, not a wedge
    w, clock, rec, analyzer, gauge, probes = _watch(answers=False)
    rec.active.add(_rec(clock.ns))
    for _ in range(5):
        await _tick(w, clock)
    assert probes and not analyzer.findings and gauge.value == 0.0
    # soakd's own check came 5 s late: its silence may be soakd's, not the server's; the next punctual one judges
    w, clock, rec, analyzer, gauge, probes = _watch()
    await w.check()
    rec.active.add(_rec(clock.ns))
    await _tick(w, clock, 5.0)
    assert probes == [] and not analyzer.findings
    await _tick(w, clock, 1.0)
    assert len(analyzer.findings) == 1


# ---- the server's side: its generated-token counter while it reports requests running


class Snap:
    def __init__(self, tokens: float | None, running: float, start: float = 1.7e9, kv: float | None = None,
                 waiting: float | None = None) -> None:
        self.series = [series("soakd_server_requests_running", running),
                       series("soakd_server_process_start_time_seconds", start)]
        if kv is not None:
            self.series.append(series("soakd_server_kv_cache_usage_ratio", kv))
        if waiting is not None:
            self.series.append(series("soakd_server_requests_waiting", waiting))
        if tokens is not None:
            self.series.append(series("soakd_server_generation_tokens_total", tokens))


def _counter_watch(answers: bool = True, per_step: bool = True) -> tuple[WedgeWatch, Clock, Recorder, Analyzer, Gauge,
                                                                          list[int]]:
    w, clock, rec, analyzer, gauge, probes = _watch(answers)
    w.scrape_interval = 1.0
    w.tokens_per_step = lambda: per_step
    return w, clock, rec, analyzer, gauge, probes


async def _scrape(w: WedgeWatch, clock: Clock, tokens: float | None, running: float, start: float = 1.7e9) -> None:
    """One second on: a scrape of the server, then the watch's check."""
    clock.ns += S
    w.on_server_sample("server", Snap(tokens, running, start))
    await w.check()


async def test_a_still_token_counter_with_requests_running_is_a_wedge_with_nothing_of_soakds_in_flight() -> None:
    """soakd has nothing streamed in flight (non-streamed requests, or other clients'): the server's own counter
    stands still over scrapes spanning the 2 s threshold while it runs 4 requests and answers GET /models."""
    w, clock, rec, analyzer, gauge, probes = _counter_watch()
    rec.active.add(_rec(clock.ns, stream=False))  # silent until its end: the streams cannot see it
    for tokens in (100, 150, 150):  # moved at the 2nd scrape, then 1 s flat: below the threshold
        await _scrape(w, clock, tokens, 4)
    assert probes == [] and not analyzer.findings and w.counter_flat(clock.ns) == 1.0
    await _scrape(w, clock, 150, 4)  # 2 s flat over three scrapes: probed, answered: wedged
    assert gauge.value == 1.0 and len(probes) == 1
    (f,) = analyzer.findings
    ev = f.evidence
    assert f.diagnosis == "engine wedged" and f.severity == "critical" and f.window == 3
    assert ev["sources"] == ["server_tokens"] and ev["silence_seconds"] is None
    assert ev["server_tokens_flat_seconds"] == 2.0 and ev["server_requests_running"] == 4
    assert ev["server_generation_tokens_total"] == 150 and "counter still at 150" in f.message
    await _scrape(w, clock, 150, 4)  # the same episode
    assert len(probes) == 1 and len(analyzer.findings) == 1
    await _scrape(w, clock, 151, 4)  # a token: the episode ends
    assert gauge.value == 0.0 and w.episode is None and w.episodes == 1


async def test_both_sources_are_named_when_they_both_see_it() -> None:
    w, clock, rec, analyzer, gauge, probes = _counter_watch()
    rec.active.add(_rec(clock.ns + S))  # streamed, silent from the first scrape on
    for tokens in (10, 10, 10):  # counter flat 2 s, streams silent 2 s: both at the same check
        await _scrape(w, clock, tokens, 2)
    (f,) = analyzer.findings
    assert f.evidence["sources"] == ["streams", "server_tokens"], f
    ended: list[dict] = []
    w.analyzer.wedge_ended = lambda ep, took: ended.append(ep)  # type: ignore[method-assign]
    rec.active.clear()
    await _scrape(w, clock, 11, 0)
    assert ended and ended[0]["sources_seen"] == ["streams", "server_tokens"]


async def test_idle_flat_counters_dead_servers_and_restarts_are_not_wedged() -> None:
    # idle: a flat counter with nothing running, however long
    w, clock, rec, analyzer, gauge, probes = _counter_watch()
    for _ in range(10):
        await _scrape(w, clock, 500, 0)
    assert probes == [] and not analyzer.findings
    # running, but the counter keeps moving (a busy, healthy server)
    for i in range(10):
        await _scrape(w, clock, 500 + i, 8)
    assert probes == [] and not analyzer.findings
    # a server without a token counter (TGI): nothing to judge
    for _ in range(10):
        await _scrape(w, clock, None, 8)
    assert probes == [] and not analyzer.findings
    # the scrapes stop (the server is gone): the last flat span stays below the threshold, then goes stale
    w, clock, rec, analyzer, gauge, probes = _counter_watch()
    for _ in range(2):
        await _scrape(w, clock, 70, 3)  # 1 s flat
    for _ in range(10):
        await _tick(w, clock)
    assert w.counter_flat(clock.ns) is None and probes == [] and not analyzer.findings
    # flat past the threshold, but GET /models does not answer: an outage, not a wedge
    w, clock, rec, analyzer, gauge, probes = _counter_watch(answers=False)
    for _ in range(6):
        await _scrape(w, clock, 70, 3)
    assert probes and not analyzer.findings and gauge.value == 0.0
    # a restart: a new process start time begins a new span (here the counter is 0 on both sides of it)
    w, clock, rec, analyzer, gauge, probes = _counter_watch()
    await _scrape(w, clock, 0, 2)
    await _scrape(w, clock, 0, 2)  # 1 s flat
    await _scrape(w, clock, 0, 2, start=1.7e9 + 60)  # restarted: from here
    await _scrape(w, clock, 0, 2, start=1.7e9 + 60)  # 1 s flat: 3 s had the restart been missed
    assert probes == [] and not analyzer.findings
    # a restart: the counter went down (reset), the span starts again
    await _scrape(w, clock, 900, 2)
    await _scrape(w, clock, 900, 2)
    await _scrape(w, clock, 5, 2)
    await _scrape(w, clock, 5, 2)
    assert probes == [] and not analyzer.findings


async def test_a_counter_counted_when_requests_end_must_stay_still_longer_than_a_request_takes() -> None:
    """SGLang, TensorRT-LLM and llama.cpp add a request's tokens when it ends: a working engine leaves the counter
    flat while its requests run. With a baseline e2e p99 of 2 s the span must pass 6 s, not the 2 s threshold."""
    w, clock, rec, analyzer, gauge, probes = _counter_watch(per_step=False)
    q = SimpleNamespace
    analyzer.drift_detector.baseline = q(e2e_seconds=q(p99=2.0), ttft_seconds=q(p95=0.1), itl_seconds=q(p99=0.02))  # type: ignore[assignment]
    assert w.counter_threshold(analyzer.freeze_threshold()) == 6.0
    for _ in range(6):  # 5 s flat: a long request, not a wedge
        await _scrape(w, clock, 40, 2)
    assert probes == [] and not analyzer.findings
    await _scrape(w, clock, 40, 2)  # 6 s
    (f,) = analyzer.findings
    assert f.evidence["server_tokens_threshold_seconds"] == 6.0 and f.evidence["sources"] == ["server_tokens"]


async def _kv_scrape(w: WedgeWatch, clock: Clock, tokens: float, running: float, kv: float) -> None:
    clock.ns += S
    w.on_server_sample("server", Snap(tokens, running, kv=kv, waiting=5))
    await w.check()


async def test_a_wedge_with_the_kv_cache_pinned_full_is_named_kv_cache_saturated_with_its_own_gauge() -> None:
    """The same wedge (counter still, 8 running, GET /models answers), the server's last scrape at 99.5% KV usage:
    out of KV blocks, not deadlocked. One finding, 'KV cache saturated', the usage, running and waiting requests as
    evidence; soakd_kv_cache_saturated 1 during it (its alert pages; SoakdEngineWedged stands aside), 0 after."""
    w, clock, rec, analyzer, gauge, probes = _counter_watch()
    kv_gauge = w.kv_gauge = Gauge(BY_NAME["soakd_kv_cache_saturated"])
    for _ in range(4):
        await _kv_scrape(w, clock, 300, 8, 0.995)
    (f,) = analyzer.findings
    ev = f.evidence
    assert f.diagnosis == "KV cache saturated" and f.kind == "freeze" and f.severity == "critical"
    assert ev["server_kv_cache_usage_ratio"] == 0.995 and ev["server_requests_running"] == 8
    assert ev["server_requests_waiting"] == 5 and "KV cache is full (99.5% used, 8 running, 5 waiting)" in f.message
    assert kv_gauge.value == 1.0 and gauge.value == 1.0
    await _kv_scrape(w, clock, 320, 8, 0.9)  # tokens again: over
    assert kv_gauge.value == 0.0 and gauge.value == 0.0 and w.episode is None
    assert analyzer.freeze.live_episodes and analyzer.freeze.live_episodes[-1][1] is not None


async def test_a_wedge_with_room_in_the_kv_cache_stays_engine_wedged() -> None:
    w, clock, rec, analyzer, gauge, probes = _counter_watch()
    kv_gauge = w.kv_gauge = Gauge(BY_NAME["soakd_kv_cache_saturated"])
    for _ in range(4):
        await _kv_scrape(w, clock, 300, 8, 0.6)
    (f,) = analyzer.findings
    assert f.diagnosis == "engine wedged" and f.evidence["server_kv_cache_usage_ratio"] == 0.6
    assert gauge.value == 1.0 and kv_gauge.value == 0.0


# ---- target hung: GET /models times out with requests in flight and none of them progressing


class MonoClock:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def monotonic(self) -> float:
        return self.clock.ns / S


class OutageRecorder(Recorder):
    """The recorder's side of an outage: soakd_target_up and the down time put into the windows."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = MonoClock(clock)
        self.up = True
        self.changes: list[tuple[float, bool]] = []
        self.down: list[tuple[float, float]] = []
        self.windows = SimpleNamespace(add_interval=lambda a, b, key: self.down.append((a, b)))
        self._down_since: float | None = None

    def set_target_up(self, up: bool) -> None:  # as soakd.soak.recorder.Recorder.set_target_up
        if up != self.up:
            self.up = up
            now = self.clock.monotonic()
            self.changes.append((now, up))
            if not up:
                self._down_since = now
            elif self._down_since is not None:
                self.down.append((self._down_since, now))


def _hung_watch(interval: float = 2.0) -> tuple[WedgeWatch, Clock, OutageRecorder, Analyzer, dict[str, Any],
                                                list[int]]:
    """A watch whose GET /models either answers at once or hangs until its timeout (the clock moves on by it)."""
    clock = Clock()
    recorder = OutageRecorder(clock)
    analyzer = Analyzer(AnalysisConfig(client={"freeze_min": 10.0, "probe_interval": interval}))
    server = {"hangs": True, "during": None}
    probes: list[int] = []

    async def probe() -> Any:
        probes.append(clock.ns)
        if server["during"] is not None:
            server["during"]()
        if server["hangs"]:
            clock.ns += int(interval * S)  # waited the whole timeout
            raise TimeoutError
        return ["model"]

    w = WedgeWatch(recorder, probe, analyzer, Gauge(BY_NAME["soakd_engine_wedged"]), now_ns=clock,
                   wall=lambda: clock.ns / S, window_at=lambda ago: 5)
    return w, clock, recorder, analyzer, server, probes


async def test_a_probe_that_times_out_with_requests_in_flight_is_target_hung_until_it_answers() -> None:
    """The server stops (SIGSTOP) right after a token: 1 s later (half the 2 s probe interval, the freeze
    threshold being 10 s) GET /models is probed and times out 2 s on, no request having progressed: 'target hung'
    (kind target, critical) within 2 probe intervals of the stop, soakd_target_up 0, probed again at each check,
    one finding; when a probe answers, up again, the down time counted from the last token to the answer."""
    w, clock, rec, analyzer, server, probes = _hung_watch()
    stop = clock.ns
    rec.active.add(_rec(stop - S, [stop]))
    await _tick(w, clock, 0.5)
    assert probes == [] and rec.up  # 0.5 s of silence: nothing yet
    await _tick(w, clock, 0.5)  # 1 s: probed; it times out at 3 s
    assert len(probes) == 1 and not rec.up
    (f,) = analyzer.findings
    assert f.kind == "target" and f.diagnosis == "target hung" and f.severity == "critical" and f.window == 5
    assert f.evidence["probe_timeout_seconds"] == 2.0 and f.evidence["in_flight"] == 1
    assert f.evidence["silence_seconds"] == 3.0 and (clock.ns - stop) / S <= 2 * w.probe_interval
    assert rec.down == [(stop / S, clock.ns / S)]  # from the last token to the moment it was named
    assert 5 in analyzer.freeze.wedged_windows  # the window's own freeze of the same span: not a second finding
    rec.active.add(_rec(clock.ns))  # more requests go in: still hung
    for _ in range(3):
        await _tick(w, clock)
    assert len(probes) == 4 and not rec.up and len(analyzer.findings) == 1 and w.hangs == 1
    server["hangs"] = False  # SIGCONT: the next probe answers
    await _tick(w, clock)
    assert rec.up and w.hung is None and len(probes) == 5
    assert rec.changes == [(stop / S + 3.0, False), (clock.ns / S, True)]
    assert sum(b - a for a, b in rec.down) == (clock.ns - stop) / S  # down from the last token to the answer
    assert analyzer.verdict().result != "FAIL"  # kind target is not in the default fail_on: down time, a finding


async def test_a_hang_ends_with_the_first_token_and_a_target_that_progressed_or_was_idle_did_not_hang() -> None:
    # ends with a token (the recorder's requests answering before the next probe does)
    w, clock, rec, analyzer, server, probes = _hung_watch()
    r = _rec(clock.ns, [clock.ns])
    rec.active.add(r)
    await _tick(w, clock)
    assert w.hung is not None and not rec.up
    r.token_times_ns.append(clock.ns + 1)
    await _tick(w, clock, 0.1)
    assert w.hung is None and rec.up and len(probes) == 1
    # idle: nothing in flight, however long: no probe, no hang
    w, clock, rec, analyzer, server, probes = _hung_watch()
    for _ in range(10):
        await _tick(w, clock)
    assert probes == [] and not analyzer.findings and rec.up
    # a probe that times out while a token arrives: a slow front end, the target progresses: not hung
    w, clock, rec, analyzer, server, probes = _hung_watch()
    r = _rec(clock.ns, [clock.ns])
    rec.active.add(r)
    server["during"] = lambda: r.token_times_ns.append(clock.ns + S)
    await _tick(w, clock)
    assert len(probes) == 1 and w.hung is None and rec.up and not analyzer.findings
    # a probe that times out with only a request that finished during it (progress, nothing streamed in flight)
    w, clock, rec, analyzer, server, probes = _hung_watch()
    done = _rec(clock.ns - S, [clock.ns])
    done.outcome, done.t_end_ns = Outcome.OK, clock.ns + S
    rec.active.add(_rec(clock.ns))
    server["during"] = lambda: w.on_finished(done)
    await _tick(w, clock)
    assert len(probes) == 1 and w.hung is None and not analyzer.findings
    # a refused connection: the recorder's outage (its connects fail), not a hang
    w, clock, rec, analyzer, server, probes = _hung_watch()
    rec.active.add(_rec(clock.ns, [clock.ns]))

    async def refused() -> Any:
        probes.append(clock.ns)
        raise ConnectionRefusedError

    w.probe = refused
    for _ in range(3):
        await _tick(w, clock)
    assert len(probes) == 3 and w.hung is None and not analyzer.findings and rec.up


async def test_at_most_one_probe_is_in_flight_and_the_scheduled_tick_never_waits_for_it() -> None:
    """GET /models that does not return (yet): the scheduler's second-by-second ``tick`` starts a check only when
    the last one is done, so one probe is in flight however many ticks come (no max_instances skips), and each
    tick returns at once."""
    clock, recorder = Clock(), Recorder()
    analyzer = Analyzer(AnalysisConfig(client={"freeze_min": 2.0, "probe_interval": 600.0}))
    release = asyncio.Event()
    probes: list[int] = []

    async def probe() -> Any:
        probes.append(clock.ns)
        await release.wait()
        return ["model"]

    gauge = Gauge(BY_NAME["soakd_engine_wedged"])
    w = WedgeWatch(recorder, probe, analyzer, gauge, now_ns=clock, wall=lambda: clock.ns / S, window_at=lambda ago: 1)
    recorder.active.add(_rec(clock.ns, [clock.ns]))
    for _ in range(8):
        clock.ns += S
        await asyncio.wait_for(w.tick(), timeout=1.0)  # never blocked by the pending probe
        for _ in range(5):
            await asyncio.sleep(0)
    assert len(probes) == 1 and w._probing and w.probes == 1
    release.set()
    for _ in range(5):
        await asyncio.sleep(0)
    assert not w._probing and gauge.value == 1.0  # it answered, silent 3 s past the threshold: wedged
    clock.ns += S
    await w.tick()
    await w.close()
    assert len(probes) == 1 and len(analyzer.findings) == 1


async def test_headers_without_tokens_are_a_wedge_whatever_arrives() -> None:
    """A wedged front end answers every new stream with its headers and sends no token (what vLLM and SGLang do):
    new requests keep starting and getting headers every half second; no token for 2 s is a wedge all the same."""
    w, clock, rec, analyzer, gauge, probes = _watch()
    last = clock.ns
    rec.active.add(_rec(last - S, [last]))
    for i in range(6):
        clock.ns += S // 2
        r = _rec(clock.ns)
        r.t_headers_ns = clock.ns + 1
        rec.active.add(r)
        await w.check()
    (f,) = analyzer.findings
    assert f.diagnosis == "engine wedged" and f.evidence["sources"] == ["streams"]
    assert f.evidence["silence_seconds"] == 2.0 and f.evidence["in_flight"] == 5  # at the threshold, 4 new streams

"""The live engine-wedge watch (soakd.soak.wedge) on injected time: requests in flight and silent past
the freeze threshold while GET /models answers is a wedge; an idle server, a server that does not
answer, a late check of soakd's own, or bytes that keep coming are not."""

from __future__ import annotations

from typing import Any

from soakd.analysis.engine import Analyzer
from soakd.config import AnalysisConfig
from soakd.core.records import RequestRecord
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
    assert f["diagnosis"] == "engine wedged" and f["severity"] == "critical" and f["window"] == 3
    assert 2.0 < f["evidence"]["silence_seconds"] < 3.0 and f["evidence"]["in_flight"] == 1
    await _tick(w, clock)  # still silent: the same episode, no second probe or finding
    assert len(probes) == 1 and len(analyzer.findings) == 1
    r.token_times_ns.append(clock.ns)  # a byte: the episode ends
    await _tick(w, clock, 0.1)
    assert gauge.value == 0.0 and w.episodes == 1 and w.episode is None
    assert analyzer.verdict().reasons == ["freeze: engine wedged (window 3)"]
    assert 3 in analyzer.wedged_windows  # the window's own freeze finding is not made twice


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

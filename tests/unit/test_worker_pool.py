"""``load.workers``: the pieces, without processes (tests/component/test_workers.py runs them end to end).

- a worker's share of the workload: draws of its own, the run's shared text, a trace's entries k, k+N, ...;
- a worker's share of the load: the closed loop's workers and the open loop's arrivals;
- the records round trip: a worker's forwarder -> a batch -> the parent's pool -> its recorder and windows,
  with the worker's own stalls deciding impairment, its late sends and stalls counted, and the windows
  closing only once every worker has reported past their end;
- the configurations that cannot have workers refused with the reason.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from soakd.config import ConfigError, load_config
from soakd.core.records import RequestRecord
from soakd.core.timeline import ManualClock, Timeline
from soakd.metrics import SoakMetrics
from soakd.soak.driver import LoadDriver
from soakd.soak.recorder import Recorder
from soakd.soak.windows import LagLedger, WindowSet
from soakd.soak.worker import Forwarder
from soakd.soak.workers import WorkerPool, _Worker
from soakd.workload.corpus import Corpus
from soakd.workload.scenarios import BUILTIN, resolve_all
from soakd.workload.workload import Workload

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]
CORPUS = Corpus(0, size=20_000)


def _wl(share: tuple[int, int], **updates: Any) -> Workload:
    sc = {"short_chat": replace(BUILTIN["short_chat"], **updates)}
    return Workload(sc, {"short_chat": 1}, "m", 7, corpus=CORPUS, share=share)


def _texts(wl: Workload, n: int = 50) -> list[str]:
    return [json.dumps(wl.next_unit(0)[0].body["messages"], sort_keys=True) for _ in range(n)]


def test_worker_zero_of_one_is_the_single_process_and_other_workers_draw_their_own() -> None:
    single = Workload({"short_chat": BUILTIN["short_chat"]}, {"short_chat": 1}, "m", 7, corpus=CORPUS)
    assert _texts(_wl((0, 1))) == _texts(single)
    a, b = _texts(_wl((0, 2))), _texts(_wl((1, 2)))
    assert not set(a) & set(b)  # two workers never send the same prompt


def test_shared_prefixes_are_the_same_text_in_every_worker() -> None:
    prefixes = []
    for k in (0, 1):
        wl = _wl((k, 2), shared_prefix=(2, 64, 1.0))
        prefixes.append({wl.next_unit(0)[0].body["messages"][0]["content"] for _ in range(40)})
    assert len(prefixes[0]) == 2 and prefixes[0] == prefixes[1]


def test_a_trace_in_the_closed_loop_gives_each_worker_every_nth_entry() -> None:
    cfg = load_config(None, {"target": {"url": "http://127.0.0.1:9/v1"}, "load": {"mix": {"replay": 1}},
                             "scenarios": {"replay": {"source": {"type": "trace", "format": "mooncake",
                                                                 "path": str(REPO / "examples/traces/mooncake.jsonl")}}}},
                    environ={})
    scenarios = resolve_all(cfg)
    seen = []
    for k in (0, 1):
        wl = Workload(scenarios, cfg.load.mix, "m", 0, share=(k, 2))
        assert wl.trace is not None
        n = len(wl.trace.entries)
        seen.append([wl._next_in_order(0).index for _ in range(n // 2)])
    assert seen[0] == list(range(0, n - n % 2, 2)) and seen[1] == list(range(1, n, 2))[: n // 2]


class _Client:
    """Answers every request at once (the driver's share is what is tested)."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def execute(self, rec: RequestRecord, body: dict[str, Any], check: Any = None) -> None:
        self.sent.append(body)
        rec.t_start_ns = rec.t_end_ns = 1
        await asyncio.sleep(0.001)


async def test_the_closed_loop_is_split_by_worker_index() -> None:
    loop = asyncio.get_running_loop()
    tl = Timeline(loop.time(), 0.0, 60.0, 60.0)  # ends by max_requests, however slow the machine
    started: dict[int, int] = {}
    for k in (0, 1, 2):
        cfg = load_config(None, {"target": {"url": "http://127.0.0.1:9/v1"},
                                 "load": {"concurrency": 7, "mix": {"short_chat": 1}}}, environ={}).load
        ws = WindowSet(tl)
        drv = LoadDriver(cfg, _Client(), _wl((k, 3)), Recorder(SoakMetrics(("short_chat",), "t"), ws), tl,  # type: ignore[arg-type]
                         max_requests=5, share=(k, 3))
        task = asyncio.ensure_future(drv.run(grace=1.0))
        await asyncio.sleep(0)
        started[k] = sum(1 for t in drv._tasks if not t.done())
        await task
        assert drv.issued == 5 and drv.stop_reason == "max_requests"
    assert started == {0: 3, 1: 2, 2: 2}  # workers 0,3,6 / 1,4 / 2,5 of 7


def _rec(window: int, t_sent: float, start_ns: int, tokens: list[int]) -> RequestRecord:
    r = RequestRecord("short_chat")
    r.window, r.t_sent = window, t_sent
    r.t_start_ns, r.token_times_ns, r.t_end_ns = start_ns, tokens, tokens[-1] + 1000
    r.request_id, r.completion_tokens, r.prompt_tokens, r.usage_from_server = "chatcmpl-1", len(tokens), 10, True
    return r


class _Driver:
    paused = False
    issued = 0


def test_records_round_trip_from_a_worker_to_the_parents_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's stall of 0.3 s impairs the request it overlapped and not the other; the parent's own stall
    impairs neither (the records were the worker's); late sends and the stall reach the parent's window."""
    now = [100.0]
    monkeypatch.setattr("soakd.soak.worker.SYSTEM_CLOCK", type("C", (), {"monotonic": lambda self: now[0]})())
    fwd = Forwarder(LagLedger(0.1, 0.0))
    fwd.ledger.beat(100.0, 0.0)
    a, b = _rec(0, 0, 0, [0]), _rec(0, 0, 0, [0])
    for r in (a, b):
        fwd.started(r)
    s = 100.0e9
    a.t_start_ns, a.token_times_ns, a.t_end_ns = int(s), [int(s + 0.05e9), int(s + 0.5e9)], int(s + 0.6e9)
    b.t_start_ns, b.token_times_ns, b.t_end_ns = int(s), [int(s + 0.01e9), int(s + 0.02e9)], int(s + 0.03e9)
    fwd.finished(b)  # ended at 100.03, after the last beat (100.0): waits for the next
    fwd.finished(a)
    assert len([e for e in fwd.events if e[0] == "f"]) == 0
    fwd.ledger.beat(100.05, 0.0)
    span = fwd.ledger.beat(100.45, 0.39)  # the worker's loop stalled from 100.06 to 100.45
    assert span is not None and span[2]
    fwd.stalls.append((*span, 0.39))
    fwd.release(100.45)
    fwd.ledger.beat(100.7, 0.0)
    fwd.release(100.7)
    fwd.metrics.late_sends.inc(())
    now[0] = 100.7
    batch = fwd.batch(_Driver(), True)
    assert batch is not None and fwd.batch(_Driver(), False) is None  # nothing new: nothing sent

    clock = ManualClock(100.0)
    tl = Timeline(99.0, 1.0, 10.0, 100.0)
    ws = WindowSet(tl, clock=clock)
    ws.add_lag(100.5, 0.45)  # the parent's own stall over both requests: not theirs
    metrics = SoakMetrics(("short_chat",), "t")
    recorder = Recorder(metrics, ws, clock)
    pool = WorkerPool(2, {}, None, clock=clock)
    pool.recorder = recorder
    wk = _Worker(0, None, None)  # type: ignore[arg-type]
    pool.workers = [wk, _Worker(1, None, None)]  # type: ignore[arg-type]
    pool._apply(wk, batch)
    assert recorder.sent == 2 and recorder.in_flight == 0 and metrics.late_sends.get() == 1
    w = ws.open[0]
    assert w.client.impaired_requests == 1  # a, by the worker's stall; b not, and the parent's stall touched none
    # the parent's stall and the worker's, each its process's: the window's figure is the worse one
    assert w.client.request_stall == pytest.approx(0.45) and w.client.by_source == {0: pytest.approx([0.39, 0.39])}
    assert w.client.worst_stalls() == pytest.approx((0.45, 0.45))
    assert wk.seen == 100.7
    assert pool.closing_time(110.0) == float("-inf")  # worker 1 has not reported: it holds every window
    pool.workers[1].seen = 105.0
    assert pool.closing_time(110.0) == 100.7  # the slower worker's report holds the windows
    pool.workers[1].done = "duration"
    assert pool.closing_time(110.0) == 100.7  # a worker done no longer holds them
    wk.done = "duration"
    assert pool.closing_time(110.0) == 110.0


def test_a_progress_report_reaches_the_wedge_watchs_view_of_a_request_in_flight() -> None:
    fwd = Forwarder(LagLedger(0.1, 0.0))
    r = _rec(0, 0, 0, [0])
    fwd.started(r)
    r.t_start_ns, r.token_times_ns = 5_000, [6_000, 9_000]
    batch = fwd.batch(_Driver(), True)
    clock = ManualClock(100.0)
    ws = WindowSet(Timeline(0.0, 0.0, 1000.0, 1000.0), clock=clock)
    recorder = Recorder(SoakMetrics(("short_chat",), "t"), ws, clock)
    pool = WorkerPool(1, {}, None, clock=clock)
    pool.recorder = recorder
    wk = _Worker(0, None, None)  # type: ignore[arg-type]
    pool.workers = [wk]
    pool._apply(wk, batch)
    (proxy,) = recorder.active
    assert proxy.t_start_ns == 5_000 and proxy.token_times_ns == [9_000] and proxy.stream
    assert recorder.in_flight == 1 and ws.open[0].in_flight == 1


def test_configurations_that_cannot_have_workers_are_refused() -> None:
    base = {"target": {"url": "http://127.0.0.1:9/v1"}}
    with pytest.raises(ConfigError, match="load.workers: 2 worker processes with 2 targets"):
        load_config(None, {"targets": [{"name": "a", "url": "http://127.0.0.1:9/v1"},
                                       {"name": "b", "url": "http://127.0.0.1:8/v1"}],
                           "load": {"workers": 2}}, environ={})
    with pytest.raises(ConfigError, match="3 workers for a concurrency of 2"):
        load_config(None, {**base, "load": {"concurrency": 2, "workers": 3}}, environ={})
    with pytest.raises(ConfigError, match="workers"):
        load_config(None, {**base, "load": {"workers": 0}}, environ={})
    with pytest.raises(ConfigError, match="3 workers for a max_in_flight of 2"):
        load_config(None, {**base, "load": {"rate": 5.0, "max_in_flight": 2, "workers": 3}}, environ={})
    assert load_config(None, {**base, "load": {"rate": 5.0, "workers": 4}}, environ={}).load.workers == 4


def test_a_request_reported_after_its_window_closed_opens_no_window_again() -> None:
    clock = ManualClock(0.0)
    ws = WindowSet(Timeline(0.0, 0.0, 10.0, 100.0), clock=clock)
    first = _rec(0, 1.0, 1, [2])
    ws.started(first)
    ws.finished(first)
    assert [w.window for w in ws.close_due(10.5)] == [0]
    late = _rec(0, 9.9, 1, [2])  # a worker's report of a request sent in window 0, read after it closed
    ws.started(late)
    ws.finished(late)
    assert ws.lost_records == 1 and 0 not in ws.open
    assert [w.window for w in ws.close_due(20.5)] == [1]  # window 0 never comes out a second time


def test_a_request_reported_in_a_window_past_the_runs_end_is_lost_not_a_crash() -> None:
    """A worker's report of a send at the very end of a 100 s run of 10 s windows, in window 10 (there are 0-9):
    counted lost, in no window (window 10 would have no length: the run died on a division by zero once)."""
    clock = ManualClock(0.0)
    tl = Timeline(0.0, 0.0, 10.0, 100.0)
    assert tl.last_index == 9 and Timeline(0.0, 5.0, 10.0, 100.0).last_index == 9
    assert Timeline(0.0, 0.0, 10.0, 95.0, first_index=3).last_index == 12
    # a resumed run with less time left than its warm-up has no window: a record of its first is lost too
    for left in (120.0, 100.0):
        short = WindowSet(Timeline(0.0, 120.0, 60.0, left, first_index=7), clock=clock)
        assert short.timeline.last_index == 6
        rec = _rec(7, 120.0, 1, [2])
        short.started(rec)
        short.finished(rec)
        assert short.lost_records == 1 and not short.open
    ws = WindowSet(tl, clock=clock)
    late = _rec(10, 100.0, 1, [2])
    ws.started(late)
    ws.finished(late)
    assert ws.lost_records == 1 and 10 not in ws.open
    last = _rec(9, 99.9, 1, [2])
    ws.started(last)
    assert ws.lost_records == 1 and ws.open[9].in_flight == 1


def test_requests_a_worker_reports_after_their_window_closed_are_counted_on_metrics_and_status() -> None:
    """Through the parent's pool: a worker's batch that starts two requests of a window that has closed since
    (the worker's earlier batch reported past the window's end) puts them in no window, and
    ``soakd_records_lost_total`` says 2, as does the ledger /status reads."""
    clock = ManualClock(0.0)
    ws = WindowSet(Timeline(0.0, 0.0, 10.0, 100.0), clock=clock)
    metrics = SoakMetrics(("short_chat",), "t")
    recorder = Recorder(metrics, ws, clock)
    assert [w.window for w in ws.close_due(10.5)] == [0]
    fwd = Forwarder(LagLedger(0.1, 0.0))
    for t in (1.0, 9.9):
        fwd.started(_rec(0, t, 1, [2]))
    batch = fwd.batch(_Driver(), True)
    pool = WorkerPool(1, {}, None, clock=clock)
    pool.recorder = recorder
    wk = _Worker(0, None, None)  # type: ignore[arg-type]
    pool.workers = [wk]
    pool._apply(wk, batch)
    assert metrics.records_lost.get() == 2 and ws.lost_records == 2 and 0 not in ws.open
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics.collector())
    assert 'soakd_records_lost_total{target="main"} 2.0' in generate_latest(registry).decode()


def test_a_request_that_starts_after_its_window_closed_is_counted_in_one_process_too() -> None:
    """The same race without workers: the open loop scheduled a send in window 0's last instant, window 0 closed
    before the request's task started it: in the run (sent), in no window, counted on /metrics."""
    clock = ManualClock(0.0)
    ws = WindowSet(Timeline(0.0, 0.0, 10.0, 100.0), clock=clock)
    metrics = SoakMetrics(("short_chat",), "t")
    recorder = Recorder(metrics, ws, clock)
    assert [w.window for w in ws.close_due(10.5)] == [0]
    rec = RequestRecord("short_chat")
    rec.window = 0
    recorder.started(rec)
    assert recorder.sent == 1 and metrics.records_lost.get() == 1 and ws.lost_records == 1 and 0 not in ws.open
    ok = RequestRecord("short_chat")
    ok.window = 1
    recorder.started(ok)
    assert metrics.records_lost.get() == 1 and ws.open[1].in_flight == 1


def test_the_pool_is_stopping_once_the_load_is_over() -> None:
    clock = ManualClock(0.0)
    pool = WorkerPool(2, {}, 10, clock=clock)
    pool.workers = [_Worker(0, None, None), _Worker(1, None, None)]  # type: ignore[arg-type]
    pool._end = 100.0
    assert not pool.stopping
    pool.workers[0].issued, pool.workers[1].issued = 5, 4
    assert not pool.stopping
    pool.workers[1].issued = 5  # every request of max_requests sent (as the single driver: stopping once sent)
    assert pool.stopping and not pool._stop.is_set()
    pool.max_requests = None
    assert not pool.stopping
    clock.now = 100.0  # the timeline's end: the workers stop by themselves
    assert pool.stopping


class _Held:
    """A worker's writer whose pipe is full until ``drained`` is set."""

    def __init__(self) -> None:
        self.buffered = 0
        self.drained = asyncio.Event()
        self.transport = self

    def write(self, data: bytes) -> None:
        self.buffered += len(data)

    def get_write_buffer_size(self) -> int:
        return self.buffered

    async def drain(self) -> None:
        await self.drained.wait()
        self.buffered = 0


class _Pausable:
    def __init__(self) -> None:
        self.paused = False

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def stop(self, reason: str) -> None:
        self.stopped = reason

    def cancel_all(self) -> None:
        self.cancelled = True


async def test_a_worker_holds_its_load_while_the_parent_does_not_read() -> None:
    from soakd.soak import worker

    fwd, drv, out = Forwarder(LagLedger(0.1, 0.0)), _Pausable(), _Held()
    await worker.send(fwd, drv, out, b"x" * 1000)  # a small backlog: nothing held
    assert not drv.paused and not fwd.held
    task = asyncio.ensure_future(worker.send(fwd, drv, out, b"x" * (worker.BACKLOG + 1)))
    await asyncio.sleep(0.01)
    assert drv.paused and fwd.held  # the parent is not reading: no new requests
    out.drained.set()
    await task
    assert not drv.paused and not fwd.held
    fwd.parent_paused = True  # a quiesce pause of the parent's outlasts the hold
    out.drained.clear()
    task = asyncio.ensure_future(worker.send(fwd, drv, out, b"x" * (worker.BACKLOG + 1)))
    await asyncio.sleep(0.01)
    out.drained.set()
    await task
    assert drv.paused


async def test_a_worker_task_that_dies_stops_the_load_and_says_why() -> None:
    from soakd.soak import worker

    async def boom() -> None:
        raise ValueError("boom")

    async def pipe() -> None:
        raise BrokenPipeError()

    fwd, drv = Forwarder(LagLedger(0.1, 0.0)), _Pausable()
    task = asyncio.ensure_future(boom())
    worker.supervise(task, "heartbeat", fwd, drv)
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)
    assert drv.stopped == "worker_failed" and drv.cancelled and "boom" in (fwd.failed or "")
    fwd, drv = Forwarder(LagLedger(0.1, 0.0)), _Pausable()
    task = asyncio.ensure_future(pipe())
    worker.supervise(task, "flusher", fwd, drv)
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)
    assert drv.stopped == "parent_gone" and fwd.parent_gone and fwd.failed is None

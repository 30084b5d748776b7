"""Where a finished request goes: the load-side metrics, its window, the run's counters and the
target's up state.

Runs on the event loop only; no locks. ``finished()`` is the hot path: a few counter and dictionary
updates; the latencies reach the histograms when the window set flushes a batch (``on_flush``: the
heartbeat's batch, numpy columns, ``soakd.analysis.settle``). Whoever wants every finished
record (a benchmark's trace, a test) registers a listener with ``add_listener``; it costs
nothing when there is none.
"""

from __future__ import annotations

from collections.abc import Callable

from soakd.analysis.settle import Settled
from soakd.core.records import OUTCOMES, Outcome, RequestRecord, bounded_reason
from soakd.core.timeline import SYSTEM_CLOCK, Clock
from soakd.metrics import SoakMetrics
from soakd.soak.windows import LOST, WindowSet

# soakd_target_up goes to 0 on a failed connect, on a response timeout without headers, and on any
# other connection error (server_disconnected, connection_reset, disconnected) only when the target
# has not answered a request in full for this long: a server that closes reused keep-alive
# connections while it answers everyone else (llama.cpp's llama-server does after every streamed
# response) is up, and a crash is still seen at once, by the connects that fail after it.
DROP_WHILE_UP_NS = 5_000_000_000

RecordListener = Callable[[RequestRecord], None]


class Recorder:
    def __init__(self, metrics: SoakMetrics, windows: WindowSet, clock: Clock = SYSTEM_CLOCK,
                 slos: dict[str, tuple[float | None, float | None, float | None]] | None = None) -> None:
        self.metrics = metrics
        self.slos = slos or {}  # scenario -> (ttft, itl, e2e) bounds in seconds
        self.windows = windows
        self.clock = clock
        self.in_flight = 0
        self.active: set[RequestRecord] = set()  # the records in flight (the wedge watch reads their bytes)
        self.sent = 0
        self.finished_count = 0
        self.outcomes: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.measured = 0
        self.completion_tokens = 0
        self.prompt_tokens = 0
        self.last_error: str = ""
        # when the target last answered a request in full (perf_counter_ns), for telling a dropped
        # connection from an unreachable target
        self._last_answer_ns: int | None = None
        self.connections_dropped_while_up = 0
        self._down_since: float | None = None
        self.prompt_token_error: list[float] = []  # (server prompt tokens / expected) - 1, bounded sample
        self._calib_n = 0
        self._hists: dict[str, tuple] = {}  # scenario -> (e2e, ttft, itl histogram children, (scenario,))
        self._listeners: list[RecordListener] = []
        self._on_target_change: list[Callable[[bool], None]] = []
        self._on_first_drop: list[Callable[[RequestRecord], None]] = []
        # the latency histograms take a request once the window set has settled it (not impaired by a
        # stall of soakd's own loop: those are counted in soakd_requests_impaired_total instead)
        windows.on_flush = self._flushed

    # ---- subscriptions
    def add_listener(self, listener: RecordListener) -> None:
        """Called with every finished record (after it is counted)."""
        self._listeners.append(listener)

    def on_target_change(self, callback: Callable[[bool], None]) -> None:
        """Called with the target's new state when soakd_target_up changes."""
        self._on_target_change.append(callback)

    def on_connection_dropped(self, callback: Callable[[RequestRecord], None]) -> None:
        """Called once per run, at the first connection dropped while the target answers others."""
        self._on_first_drop.append(callback)

    # ---- request lifecycle
    def started(self, rec: RequestRecord) -> None:
        self.active.add(rec)
        self.in_flight += 1
        self.sent += 1
        self.metrics.in_flight.value = self.in_flight
        self.windows.started(rec)
        if rec.window == LOST:  # its window had closed already: in the run, in no window
            self.metrics.records_lost.inc(())

    def finished(self, rec: RequestRecord, impaired: bool | None = None) -> None:
        """A finished request; ``impaired``: decided by the load worker that sent it (None: by the window set)."""
        m = self.metrics
        self.active.discard(rec)
        self.in_flight -= 1
        m.in_flight.value = self.in_flight
        self.finished_count += 1
        outcome = rec.outcome
        ov = outcome._value_  # (not the .value property: every request pays it)
        self.outcomes[ov] += 1
        if outcome is Outcome.CONNECTION_ERROR:
            if rec.reason == "connect_failed" or self._last_answer_ns is None or \
                    rec.t_end_ns - self._last_answer_ns > DROP_WHILE_UP_NS:
                self.set_target_up(False)
            else:
                self._connection_dropped(rec)
        elif outcome is Outcome.TIMEOUT and not rec.http_status:
            self.set_target_up(False)
        elif rec.http_status:
            if outcome is not Outcome.TIMEOUT:
                self._last_answer_ns = rec.t_end_ns
            if m.target_up.value != 1.0:
                self.set_target_up(True)
        if outcome is not Outcome.OK and outcome is not Outcome.CANCELLED:
            self.last_error = f"{rec.scenario}: {ov}/{rec.reason} {rec.error}"[:300]
        if rec.warmup:
            m.warmup_requests.inc((ov,))
        else:
            self.measured += 1
            sc = rec.scenario
            m.requests.inc((sc, ov))
            slo = self.slos.get(sc)
            if slo is not None:
                rec.slo_met = rec.meets(*slo)
                if rec.slo_met:
                    m.goodput.inc((sc,))
            if outcome is Outcome.OK:
                self._observe(rec, sc)
            else:
                m.failures.inc((sc, bounded_reason(rec)))
        self.windows.finished(rec, impaired)
        for listener in self._listeners:
            listener(rec)

    def _observe(self, rec: RequestRecord, sc: str) -> None:
        m = self.metrics
        key = self._hists_of(sc)[3]
        m.prompt_tokens.inc(key, rec.prompt_tokens)
        m.completion_tokens.inc(key, rec.completion_tokens)
        self.prompt_tokens += rec.prompt_tokens
        self.completion_tokens += rec.completion_tokens
        if not rec.usage_from_server:
            m.usage_missing.inc(key)
        elif rec.expected_prompt_tokens and self._calib_n < 4096:
            self._calib_n += 1
            self.prompt_token_error.append(rec.prompt_tokens / rec.expected_prompt_tokens - 1.0)

    def _flushed(self, settled: dict[str, Settled]) -> None:
        """A window's flushed batch (the window set's ``on_flush``): its measured latencies into the histograms,
        its impaired requests (they overlapped a stall of soakd's own event loop) counted."""
        for sc, (*values, impaired) in settled.items():
            if impaired:
                self.metrics.requests_impaired.inc((sc,), impaired)
            for hist, v in zip(self._hists_of(sc), values):
                if len(v):
                    hist.observe_many(v)

    def _hists_of(self, sc: str) -> tuple:
        """The scenario's (e2e, ttft, itl histogram children, (scenario,))."""
        hists = self._hists.get(sc)
        if hists is None:
            m = self.metrics
            hists = self._hists[sc] = (m.e2e.child(sc), m.ttft.child(sc), m.itl.child(sc), (sc,))
        return hists

    def _connection_dropped(self, rec: RequestRecord) -> None:
        """A connection error while the target answers other requests (it answered one in full
        within DROP_WHILE_UP_NS): a dropped connection — typically a reused keep-alive connection
        the server had closed — not an outage. Recorded as connection_error all the same; the
        target stays up."""
        self.connections_dropped_while_up += 1
        if self.connections_dropped_while_up == 1:
            for cb in self._on_first_drop:
                cb(rec)

    # ---- the target's state
    def set_target_up(self, up: bool) -> None:
        v = 1.0 if up else 0.0
        if self.metrics.target_up.value != v:
            self.metrics.target_up.value = v
            now = self.clock.monotonic()
            if not up:
                self._down_since = now
            elif self._down_since is not None:
                self.windows.add_interval(self._down_since, now, "target_down_seconds")
                self._down_since = None
            for cb in self._on_target_change:
                cb(up)

    @property
    def target_up(self) -> bool:
        return bool(self.metrics.target_up.value)

    def account_outage(self, now: float) -> None:
        """While the target is down: its down time so far into the windows (before they close)."""
        if self._down_since is not None and now > self._down_since:
            self.windows.add_interval(self._down_since, now, "target_down_seconds")
            self._down_since = now

    def prompt_length_accuracy(self) -> dict[str, float] | None:
        errs = sorted(self.prompt_token_error)
        if not errs:
            return None
        n = len(errs)
        return {
            "samples": n,
            "median": errs[n // 2],
            "p05": errs[int(n * 0.05)],
            "p95": errs[min(n - 1, int(n * 0.95))],
        }

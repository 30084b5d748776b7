"""The open windows of a soak and when they close.

``WindowSet`` keeps one :class:`~soakd.analysis.window.OpenWindow` per window that has
requests in flight, samples or a quiesce probe, adds intervals (probe pauses, the target being
down) to the windows they overlap, and closes a window once it has ended and its requests
have finished — or ``patience`` after its end (``RunPolicies.close_patience``). Closed windows
come out as :class:`~soakd.core.summary.WindowSummary`. A request still in flight when its
window closed is never dropped: when it finishes it is counted into the window it was sent in
(``late_records``), and once the window's last straggler has finished (or the run ends) the
window comes out again as a revision (``revision`` 1, 2, …) that replaces the stored summary.
Then its sketches are dropped (bounded memory).

soakd's own stalls (the heartbeat's lags, ``add_lag``) are charged to the time they covered: each
lag is the interval ``[t - lag, t]``, split over the windows it overlaps (a SIGSTOP of soakd is a gap
in the heartbeat's ticks, charged to the window it happened in, not to the next). A request is
settled once the heartbeat has beaten after its end (until then it waits, counted in flight, in a
small heap): if it overlapped a lag beyond the bound it is impaired: counted, its latency left out of
the window's statistics (``soakd.analysis.settle``). A beat's settled requests go into each window as one
batch, flushed at the beat (or at ``close_due``, or by ``flush()``). The bound is
``analysis.client.request_max_lag``, or ``request_lag_relative`` times the run's own p90 heartbeat lag when
that is more (a lag that recurs all run long moves every window alike). Without a heartbeat (simulations,
tests on a manual clock) a request settles at once.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from soakd.analysis.settle import Settled
from soakd.analysis.sketch import new_sketch, quantile
from soakd.analysis.window import STALL_LAG, OpenWindow
from soakd.config.analysis import ClientConfig
from soakd.core.records import RequestRecord
from soakd.core.series import Series
from soakd.core.summary import QuiesceProbe, WindowSummary
from soakd.core.timeline import SYSTEM_CLOCK, Clock, Timeline


FLUSH_AT = 4096  # settled requests a window holds unflushed at most when no one takes their latencies
LOST = -(1 << 62)  # the window of a request reported after its window was gone: no window's (finished() skips it)


class LagLedger:
    """soakd's own loop lags as one heartbeat saw them: the stalls beyond the request bound (for the requests they
    overlapped), the bound itself (``request_max_lag``, or ``lag_relative`` times the run's p90 lag when that is
    more) and the time up to which lags are charged. A window set keeps one for its process's heartbeat; a load
    worker process (``soakd.soak.worker``) keeps its own and marks its requests impaired with it."""

    def __init__(self, request_max_lag: float, lag_relative: float) -> None:
        self.request_max_lag = request_max_lag
        self.lag_relative = lag_relative
        self.lag_bound = request_max_lag
        self._lags = new_sketch()  # every heartbeat lag of the run, by the time it covered (its p90 raises the bound)
        self._beats = 0
        self.last_beat: float | None = None  # the time of the last heartbeat (None: none yet)
        self._covered = float("-inf")  # loop time up to which lags are charged
        self.stalls: deque[tuple[float, float]] = deque(maxlen=20_000)  # recent lags beyond the bound
        self._held: list[tuple[float, int, Any]] = []  # finished requests waiting for a beat after their end
        self._seq = itertools.count()

    def cover(self, start: float, end: float, lag: float) -> tuple[float, float, bool] | None:
        """A lag of ``lag`` covering ``[start, end]``: its part not covered yet, and whether it is beyond the
        request bound (then remembered for the requests it overlapped); None when nothing is new."""
        start = max(start, self._covered)
        if end <= start:
            return None
        self._covered = end
        long = lag >= self.lag_bound
        if long:
            self.stalls.append((start, end))
        return start, end, long

    def mark(self, t: float, lag: float) -> float:
        """A beat at ``t``: the weight of its lag (the time since the last beat: the run's p90 lag is the lag it
        had 90% of the time, whatever the beat rate; a stall is one beat however long)."""
        weight = t - self.last_beat if self.last_beat is not None and t > self.last_beat else lag + 0.01
        self.last_beat = t if self.last_beat is None else max(self.last_beat, t)
        return weight

    def learn(self, lag: float, weight: float) -> None:
        """The lag into the run's distribution; every 100 beats the bound follows the run's usual lag."""
        self._lags.add(lag, max(weight, 1e-6))
        self._beats += 1
        if self.lag_relative > 0 and self._beats % 100 == 0:
            self.lag_bound = max(self.request_max_lag, self.lag_relative * (quantile(self._lags, 0.9) or 0.0))

    def beat(self, t: float, lag: float) -> tuple[float, float, bool] | None:
        """A whole beat (``cover``, ``mark``, ``learn``) for a process that charges no window."""
        lag = max(0.0, lag)
        span = self.cover(t - lag, t, lag)
        self.learn(lag, self.mark(t, lag))
        return span

    def impaired(self, start: float, end: float) -> bool:
        """Whether ``[start, end]`` overlapped a loop lag beyond the request bound."""
        if not self.stalls:
            return False
        for a, b in reversed(self.stalls):
            if b < start:
                return False
            if a <= end:
                return True
        return False

    def hold(self, end: float, item: Any) -> bool:
        """Keep ``item`` (a request that ended at ``end``) until a heartbeat after its end has said whether a stall
        overlapped it; False when one has (or there is no heartbeat): decide it now."""
        if self.last_beat is None or end <= self.last_beat:
            return False
        heapq.heappush(self._held, (end, next(self._seq), item))
        return True

    def due(self, upto: float | None) -> Iterator[Any]:
        """The held items that ended by ``upto`` (None: all), in the order they ended."""
        h = self._held
        while h and (upto is None or h[0][0] <= upto):
            yield heapq.heappop(h)[2]

    @property
    def held(self) -> int:
        return len(self._held)


class WindowSet:
    def __init__(self, timeline: Timeline, *, confidence: float = 0.95, patience: float = 120.0,
                 clock: Clock = SYSTEM_CLOCK, client: ClientConfig | None = None,
                 sub_length: float | None = None, kv_saturated_ratio: float = 0.98,
                 heartbeat_period: float | None = None) -> None:
        self.timeline = timeline
        self.kv_saturated_ratio = kv_saturated_ratio  # KV usage that counts as pinned full (analysis.kv_saturated)
        self.sub_length = sub_length  # the sub-windows' length (default: a minute, or a tenth of a short window)
        self.client_cfg = client
        self.confidence = confidence
        self.patience = patience
        self.clock = clock
        self.segment = 0
        self.open: dict[int, OpenWindow] = {}
        self.last_closed = timeline.first_index - 2  # index of the last window closed
        self.closed_count = 0
        self.lost_records = 0  # requests that started after their window was closed and dropped
        self.ended = False  # the final close happened: no window opens or closes after it
        cc = client or ClientConfig()
        self.ledger = LagLedger(cc.request_max_lag, cc.request_lag_relative)
        # the heartbeat's period when the runtime's 10 ms heartbeat feeds add_lag: a silence of it longer
        # than this and the request bound, seen at a close, is a stall in progress (None: no such check)
        self.heartbeat_period = heartbeat_period
        # called with every settled record and whether it was impaired
        self.on_settled: Callable[[RequestRecord, bool], None] | None = None
        # called with each window's flushed batch: its latencies by scenario (the recorder's histograms)
        self.on_flush: Callable[[dict[str, Settled]], None] | None = None
        self._unflushed: list[OpenWindow] = []  # windows with requests settled and not flushed yet
        self.flushed_by_owner = False  # with no heartbeat, whoever owns the set calls flush() (a sweep's step)

    @property
    def lag_bound(self) -> float:
        """The request bound now: request_max_lag, or more on a run that always lags."""
        return self.ledger.lag_bound

    @property
    def last_beat(self) -> float | None:
        """The time of the last heartbeat (None: none yet: requests settle at once)."""
        return self.ledger.last_beat

    @property
    def stalls(self) -> deque[tuple[float, float]]:
        return self.ledger.stalls

    # ---- the windows
    def window_for(self, index: int) -> OpenWindow:
        w = self.open.get(index)
        if w is None:
            tl = self.timeline
            s, e = (tl.start, tl.first_window_start) if index < 0 else tl.window_bounds(index)
            w = self.open[index] = OpenWindow(index, s, e, self.clock.wall() - (self.clock.monotonic() - s),
                                              sub_length=self.sub_length, kv_saturated_ratio=self.kv_saturated_ratio)
            w.on_flushed = self._flushed
        return w

    def current(self, now: float) -> OpenWindow | None:
        """The window open at ``now`` (or the newest one)."""
        w = self.open.get(self.timeline.window_at(now))
        if w is None and self.open:
            w = self.open[max(self.open)]
        return w

    def accepts(self, index: int) -> bool:
        """Whether samples of window ``index`` are still taken (a window of this segment, not closed)."""
        return not self.ended and index >= self.timeline.first_index and index > self.last_closed

    # ---- what comes in
    def started(self, rec: RequestRecord) -> None:
        """A request sent now (or at its ``t_sent``, set by the load worker that sent it). One that starts after the
        window it was scheduled in closed and was dropped (the open loop picks the window when it schedules the
        send, the request starts in the task's first step: a close can come in between; with load workers, a
        worker's batch can report it past the window's end first) is counted in ``lost_records`` and in no window
        (the recorder counts it in ``soakd_records_lost_total``): a closed window is never opened again. So is one
        of a window past the run's last (a load worker's report of a send at the very end: seen, a 5-window run's
        window 5, of no length, crashed the run on a division by zero)."""
        tl = self.timeline
        if rec.window not in self.open and (tl.first_index <= rec.window <= self.last_closed
                                            or rec.window > tl.last_index):
            self.lost_records += 1
            rec.window = LOST
            return
        w = self.window_for(rec.window)
        w.in_flight += 1
        now = rec.t_sent
        if now is None:
            rec.t_sent = now = self.clock.monotonic()
        rec.sub = w.sub_index(now)

    def finished(self, rec: RequestRecord, impaired: bool | None = None) -> None:
        """A finished request: into its window (once the heartbeat has beaten after its end), or counted
        late when that closed already. ``impaired``: decided already (a load worker's request, by the worker's
        own heartbeat: this process's stalls did not touch it). One settled at once (decided already, or one
        that ended before the last beat) goes into the window's next batch: the next beat, the next ``close_due``,
        or ``flush()`` (the load-worker pool after each message); with no heartbeat it is flushed at once, unless
        the owner flushes (``flushed_by_owner``: a sweep's step watch, every 50 ms)."""
        w = self.open.get(rec.window)
        if w is None:
            return
        if rec.warmup:
            w.in_flight -= 1
            return
        start, end = rec.span()
        if impaired is None and self.ledger.hold(end, (rec, start, end)):
            return
        w = self._settle(rec, start, end, impaired)
        if w is None:
            return
        if w not in self._unflushed:  # into the next flush's batch
            self._unflushed.append(w)
        if impaired is None and self.ledger.last_beat is None and not self.flushed_by_owner:
            self.flush()  # no heartbeat and no one who flushes: now (a batch of one)

    def impaired(self, start: float, end: float) -> bool:
        """Whether ``[start, end]`` overlapped a loop lag beyond the request bound."""
        return self.ledger.impaired(start, end)

    def _settle(self, rec: RequestRecord, start: float, end: float, impaired: bool | None = None) -> OpenWindow | None:
        """Into its window (it waits there for the window's flush); the window, or None when it is gone."""
        w = self.open.get(rec.window)
        if w is None:
            return None
        w.in_flight -= 1
        bad = impaired if impaired is not None else self.ledger.impaired(start, end)
        if w.closed:
            w.late_records += 1
        w.add(rec, bad)
        if self.on_settled is not None:
            self.on_settled(rec, bad)
        return w

    def _release(self, upto: float | None) -> None:
        """Settle the waiting requests that ended by ``upto`` (None: all), and flush them with those settled at
        once since the last flush: a heartbeat's worth of them in one batch per window."""
        touched = self._unflushed
        for rec, a, b in self.ledger.due(upto):
            w = self._settle(rec, a, b)
            if w is not None and w not in touched:
                touched.append(w)
        self.flush()

    def flush(self) -> None:
        """Flush the windows that hold settled requests not flushed yet, a batch per window. With nobody to hand
        their latencies to (no ``on_flush``: a simulation), they wait in the window for its summary, or until
        ``FLUSH_AT`` wait: one batch instead of a few at every beat."""
        windows, self._unflushed = self._unflushed, []
        listening = self.on_flush is not None
        for w in windows:
            if listening or len(w.pending) >= FLUSH_AT:
                w.flush()

    def _flushed(self, settled: dict[str, Settled]) -> None:
        if self.on_flush is not None:
            self.on_flush(settled)

    @property
    def pending(self) -> int:
        """Finished requests waiting for the heartbeat to beat after their end."""
        return self.ledger.held

    def add_samples(self, series: list[Series], t: float) -> int | None:
        """A telemetry snapshot taken at ``t``: into its window; the window index, or None."""
        idx = self.timeline.window_at(t)
        if t >= self.timeline.end or not self.accepts(idx):
            return None
        self.window_for(idx).add_samples(series, t)
        return idx

    def add_energy(self, index: int, joules: float, seconds: float) -> None:
        if self.accepts(index):
            self.window_for(index).add_energy(joules, seconds)

    def add_lag(self, t: float, lag: float, cpu_seconds: float | None = None) -> None:
        """One heartbeat of soakd's event loop at ``t``: how late it woke (and the CPU time since the
        last). The beat counts in the window of ``t``; the lag, ``[t - lag, t]``, in the windows it covered;
        then the requests that ended by ``t`` settle."""
        lag = max(0.0, lag)
        idx = self.timeline.window_at(t)
        if t < self.timeline.end and self.accepts(idx):
            self.window_for(idx).client.add_beat(lag, cpu_seconds)
        self._charge(t - lag, t, lag)
        weight = self.ledger.mark(t, lag)
        self._release(t)
        self.ledger.learn(lag, weight)

    def _charge(self, start: float, end: float, lag: float) -> None:
        """A loop lag of ``lag`` covering ``[start, end]``: its part not charged yet, to the windows it
        overlaps; a lag beyond the request bound is remembered for the requests it overlapped."""
        span = self.ledger.cover(start, end, lag)
        if span is None:
            return
        self.charge_stall(*span, lag)

    def charge_stall(self, start: float, end: float, long: bool, lag: float, source: int | None = None) -> None:
        """A loop lag of ``lag`` over ``[start, end]`` into the windows' client health; ``source``: the load
        worker whose loop it was (``soakd.soak.worker``: its stalls impair its own requests, and count in the
        window's health as that process's), None for this process's."""
        if lag <= STALL_LAG and not long:
            idx = self.timeline.window_at(end)
            if end < self.timeline.end and self.accepts(idx):
                self.window_for(idx).client.add_stall(end - start, lag, False, source)
            return
        tl = self.timeline
        k0, k1 = tl.window_at(start), tl.window_at(min(end, tl.end - 1e-9))
        for k in range(max(k0, tl.first_index), k1 + 1):
            if not self.accepts(k):
                continue
            ws, we = tl.window_bounds(k)
            overlap = min(end, we) - max(start, ws)
            if overlap > 0:
                self.window_for(k).client.add_stall(overlap, lag, long, source)

    def check_gap(self, now: float) -> None:
        """A close while the heartbeat has been silent beyond its period and the request bound: the loop
        is just back from a stall (soakd stopped) that the heartbeat has not reported yet: charged now, to
        the time it covered."""
        if self.heartbeat_period is None or self.last_beat is None:
            return
        gap = now - self.last_beat - self.heartbeat_period
        if gap >= self.lag_bound:
            self._charge(now - gap, now, gap)

    def add_throttling(self, t: float, seconds: float, periods: int) -> None:
        """CFS throttling of soakd's cgroup since the last reading (``cpu.stat``)."""
        idx = self.timeline.window_at(t)
        if t < self.timeline.end and self.accepts(idx):
            self.window_for(idx).client.add_throttling(seconds, periods)

    def set_probe(self, probe: QuiesceProbe) -> None:
        if self.accepts(probe.window):
            self.window_for(probe.window).quiesce = probe

    def hold(self, index: int) -> OpenWindow:
        """Keep window ``index`` open (a quiesce probe in it) until ``release``."""
        w = self.window_for(index)
        w.in_flight += 1
        return w

    def release(self, w: OpenWindow) -> None:
        w.in_flight -= 1

    def add_interval(self, start: float, end: float, attr: str) -> None:
        """Add the part of [start, end) that falls in each open window to ``attr``
        (``paused_seconds``: quiesce probes; ``target_down_seconds``: the target unreachable)."""
        if end <= start:
            return
        tl = self.timeline
        k0, k1 = tl.window_at(start), tl.window_at(min(end, tl.end - 1e-9))
        for k in range(max(k0, tl.first_index, self.last_closed + 1), k1 + 1):
            ws, we = tl.window_bounds(k)
            overlap = min(end, we) - max(start, ws)
            if overlap <= 0:
                continue
            w = self.window_for(k)
            if not w.closed:
                setattr(w, attr, getattr(w, attr) + overlap)

    def _revise(self, w: OpenWindow) -> WindowSummary:
        w.revision += 1
        end, partial = w.closed_as
        return w.summary(actual_end=end, partial=partial, confidence=self.confidence, segment=self.segment,
                         revision=w.revision, client_cfg=self.client_cfg, lag_bound=self.lag_bound)

    # ---- closing
    def close_due(self, now: float, final: bool = False) -> list[WindowSummary]:
        """Close every window that has ended and drained (or waited ``patience``). ``final``: the
        run is over; close all, the unfinished one marked partial."""
        out: list[WindowSummary] = []
        if self.ended:
            return out
        self.check_gap(now)
        if final:
            self._release(None)
        elif self.heartbeat_period is not None:  # a heartbeat that stopped beating holds nothing for long
            self._release(now - max(1.0, 10 * self.heartbeat_period))
        else:
            self.flush()
        self.ended = final
        tl = self.timeline
        upto = tl.window_at(min(now, tl.end - 1e-9))
        for k in range(self.last_closed + 1, upto + 1):
            if k >= tl.first_index:
                self.window_for(k)
        for index in sorted(self.open):
            w = self.open[index]
            if w.closed or index < tl.first_index:
                continue
            short = (w.end - w.start) < tl.window - 1e-6  # cut by the end of the run
            if final:
                partial = short or now < w.end - 1e-6
                summary = w.summary(actual_end=min(now, w.end), partial=partial, confidence=self.confidence,
                                    segment=self.segment, client_cfg=self.client_cfg, lag_bound=self.lag_bound)
            else:
                if now < w.end:
                    break
                if w.in_flight > 0 and now < w.end + self.patience:
                    continue
                summary = w.summary(partial=short, confidence=self.confidence, segment=self.segment,
                                    client_cfg=self.client_cfg, lag_bound=self.lag_bound)
            w.closed_as = (min(now, w.end) if final else None, summary.partial)
            w.closed = True
            self.last_closed = max(self.last_closed, index)
            self.closed_count += 1
            out.append(summary)
        for index, w in sorted(self.open.items()):
            if w.closed and index >= tl.first_index and w.late_records and (w.in_flight <= 0 or final):
                out.append(self._revise(w))
        for index in [i for i, w in self.open.items() if w.closed and (w.in_flight <= 0 or final)]:
            del self.open[index]
        warm = self.open.get(-1)
        if warm is not None and (final or now >= tl.first_window_start) and warm.in_flight <= 0:
            del self.open[-1]
        return out

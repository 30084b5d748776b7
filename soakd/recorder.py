"""Where finished requests go: the exported metrics, the open windows and the run totals.

Runs on the event loop only; no locks. ``finished()`` is the hot path: a few dictionary
updates, two or three histogram bisects and the sketch adds.
"""

from __future__ import annotations

import os
import time
from collections import deque
from itertools import pairwise
from collections.abc import Callable
from typing import Any

from soakd.analysis.window import Timeline, WindowStats
from soakd.client.records import OUTCOMES, Outcome, RequestRecord
from soakd.metrics import SoakMetrics

_HTTP_REASONS = {400, 401, 403, 404, 408, 413, 422, 429, 500, 502, 503, 504}
# soakd_target_up goes to 0 on a failed connect, on a response timeout without headers, and on any
# other connection error (server_disconnected, connection_reset, disconnected) only when the target
# has not answered a request in full for this long: a server that closes reused keep-alive
# connections while it answers everyone else (llama.cpp's llama-server does after every streamed
# response) is up, and a crash is still seen at once, by the connects that fail after it.
DROP_WHILE_UP_NS = 5_000_000_000


def bounded_reason(rec: RequestRecord) -> str:
    """A label-safe reason: the client's reasons form a fixed set, HTTP statuses are folded."""
    r = rec.reason
    if r.startswith("http_"):
        status = rec.http_status
        if status in _HTTP_REASONS:
            return f"http_{status}"
        return "http_4xx" if 400 <= status < 500 else "http_5xx" if 500 <= status < 600 else "http_other"
    return r or rec.outcome.value


class Recorder:
    def __init__(
        self,
        metrics: SoakMetrics,
        timeline: Timeline,
        on_window_closed: Callable[[dict[str, Any]], None] | None = None,
        max_windows_kept: int = 2000,
        confidence: float = 0.95,
    ) -> None:
        self.confidence = confidence
        self.metrics = metrics
        self.timeline = timeline
        self.on_window_closed = on_window_closed
        self.windows: dict[int, WindowStats] = {}
        self.closed: deque[dict[str, Any]] = deque(maxlen=max_windows_kept)
        self.in_flight = 0
        self.sent = 0
        self.finished_count = 0
        self.outcomes: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.measured = 0
        self.completion_tokens = 0
        self.prompt_tokens = 0
        self.last_error: str = ""
        self._target_up_cb: Callable[[bool], None] | None = None
        # when the target last answered a request in full (perf_counter_ns), for telling a dropped
        # connection from an unreachable target; and what to call on the first such drop
        self._last_answer_ns: int | None = None
        self.connections_dropped_while_up = 0
        self.on_connection_dropped: Callable[[RequestRecord], None] | None = None
        self._last_closed_index = timeline.first_index - 2
        self._down_since: float | None = None
        self.prompt_token_error: list[float] = []  # (server prompt tokens / expected) - 1, bounded sample
        self._calib_n = 0
        self._hists: dict[str, tuple[Any, ...]] = {}  # scenario -> (e2e, ttft, itl histogram children, (scenario,))
        # Debug hook for benchmarks/client_capacity.py: SOAKD_TRACE_FILE=path appends one line per
        # finished request (request id, send / first token / end perf_counter_ns, outcome). Off: one
        # attribute test per request.
        path = os.environ.get("SOAKD_TRACE_FILE")
        self._trace: list[str] | None = [] if path else None
        self._trace_path = path

    # ---- request lifecycle
    def window_for(self, index: int, now: float) -> WindowStats:
        w = self.windows.get(index)
        if w is None:
            if index < 0:
                s, e = self.timeline.start, self.timeline.first_window_start
            else:
                s, e = self.timeline.window_bounds(index)
            w = self.windows[index] = WindowStats(index, s, e, time.time() - (now - s))
        return w

    def started(self, rec: RequestRecord, now: float) -> None:
        self.in_flight += 1
        self.sent += 1
        self.metrics.in_flight.value = self.in_flight
        w = self.window_for(rec.window, now)
        w.in_flight += 1

    def finished(self, rec: RequestRecord) -> None:
        m = self.metrics
        if self._trace is not None:
            self._trace_record(rec)
        self.in_flight -= 1
        m.in_flight.value = self.in_flight
        self.finished_count += 1
        outcome = rec.outcome
        ov = outcome.value
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
        w = self.windows.get(rec.window)
        if rec.warmup:
            m.warmup_requests.inc((ov,))
            if w is not None:
                w.in_flight -= 1
            return
        self.measured += 1
        sc = rec.scenario
        m.requests.inc((sc, ov))
        gaps = None
        if outcome is Outcome.OK:
            hists = self._hists.get(sc)
            if hists is None:
                hists = self._hists[sc] = (m.e2e.child(sc), m.ttft.child(sc), m.itl.child(sc), (sc,))
            e2e, ttft, itl, key = hists
            e2e.observe((rec.t_end_ns - rec.t_start_ns) / 1e9)
            times = rec.token_times_ns
            if rec.stream and times:
                ttft.observe((times[0] - rec.t_start_ns) / 1e9)
                if len(times) > 1:
                    gaps = [(b - a) / 1e9 for a, b in pairwise(times)]
                    itl.observe_many(gaps)
            m.prompt_tokens.inc(key, rec.prompt_tokens)
            m.completion_tokens.inc(key, rec.completion_tokens)
            self.prompt_tokens += rec.prompt_tokens
            self.completion_tokens += rec.completion_tokens
            if not rec.usage_from_server:
                m.usage_missing.inc(key)
            elif rec.expected_prompt_tokens and self._calib_n < 4096:
                self._calib_n += 1
                self.prompt_token_error.append(rec.prompt_tokens / rec.expected_prompt_tokens - 1.0)
        else:
            m.failures.inc((sc, bounded_reason(rec)))
        if w is None:
            return
        w.in_flight -= 1
        if w.closed:
            w.late_records += 1
            return
        w.add(rec, gaps)

    def _trace_record(self, rec: RequestRecord) -> None:
        t = rec.token_times_ns
        self._trace.append(f"{rec.request_id or '-'} {rec.t_start_ns} {t[0] if t else 0} {rec.t_end_ns} "  # type: ignore[union-attr]
                           f"{rec.outcome.value} {rec.scenario}\n")
        if len(self._trace) >= 4096:  # type: ignore[arg-type]
            self.flush_trace()

    def flush_trace(self) -> None:
        if self._trace and self._trace_path:
            try:
                with open(self._trace_path, "a", encoding="utf-8") as fh:
                    fh.writelines(self._trace)
            except OSError:
                pass
            self._trace.clear()

    def _connection_dropped(self, rec: RequestRecord) -> None:
        """A connection error while the target answers other requests (it answered one in full
        within DROP_WHILE_UP_NS): a dropped connection — typically a reused keep-alive connection
        the server had closed — not an outage. Recorded as connection_error all the same; the
        target stays up."""
        self.connections_dropped_while_up += 1
        if self.connections_dropped_while_up == 1 and self.on_connection_dropped is not None:
            self.on_connection_dropped(rec)

    def set_target_up(self, up: bool) -> None:
        v = 1.0 if up else 0.0
        if self.metrics.target_up.value != v:
            self.metrics.target_up.value = v
            now = self._now()
            if not up:
                self._down_since = now
            elif self._down_since is not None:
                self.add_interval(self._down_since, now, "target_down_seconds")
                self._down_since = None
            if self._target_up_cb is not None:
                self._target_up_cb(up)

    @staticmethod
    def _now() -> float:
        import asyncio

        try:
            return asyncio.get_running_loop().time()
        except RuntimeError:
            import time as _time

            return _time.monotonic()

    def add_interval(self, start: float, end: float, attr: str) -> None:
        """Add the part of [start, end) that falls in each open window to ``attr`` (paused_seconds:
        quiesce probes; target_down_seconds: the target unreachable)."""
        if end <= start:
            return
        tl = self.timeline
        k0, k1 = tl.window_at(start), tl.window_at(min(end, tl.end - 1e-9))
        for k in range(max(k0, tl.first_index, self._last_closed_index + 1), k1 + 1):
            ws, we = tl.window_bounds(k)
            overlap = min(end, we) - max(start, ws)
            if overlap <= 0:
                continue
            w = self.window_for(k, end)
            if not w.closed:
                setattr(w, attr, getattr(w, attr) + overlap)

    # ---- windows
    def close_due(self, now: float, final: bool = False) -> list[dict[str, Any]]:
        """Close every window that has ended and drained (or waited long enough).
        ``final``: the run is over; close all, the unfinished one marked partial."""
        out = []
        tl = self.timeline
        if self._down_since is not None and now > self._down_since:
            self.add_interval(self._down_since, now, "target_down_seconds")
            self._down_since = now
        upto = tl.window_at(min(now, tl.end - 1e-9))
        for k in range(self._last_closed_index + 1, upto + 1):
            if k >= tl.first_index:
                self.window_for(k, now)
        for index in sorted(self.windows):
            w = self.windows[index]
            if w.closed or index < tl.first_index:
                continue
            short = (w.end - w.start) < tl.window - 1e-6  # cut by the end of the run
            if final:
                partial = short or now < w.end - 1e-6
                summary = w.summary(actual_end=min(now, w.end), partial=partial, confidence=self.confidence)
            else:
                if now < w.end:
                    break
                patience = min(tl.window, 120.0)
                if w.in_flight > 0 and now < w.end + patience:
                    continue
                summary = w.summary(partial=short, confidence=self.confidence)
            w.closed = True
            self._last_closed_index = max(self._last_closed_index, index)
            out.append(summary)
            self.closed.append(summary)
            if self.on_window_closed is not None:
                self.on_window_closed(summary)
        # drop closed windows' sketches (bounded memory); keep the summaries
        for index in [i for i, w in self.windows.items() if w.closed and w.in_flight <= 0]:
            del self.windows[index]
        warm = self.windows.get(-1)
        if warm is not None and (final or now >= tl.first_window_start) and warm.in_flight <= 0:
            del self.windows[-1]
        if final and self._trace is not None:
            self.flush_trace()
        return out

    def current(self, now: float) -> WindowStats | None:
        idx = self.timeline.window_at(now)
        w = self.windows.get(idx)
        if w is None and self.windows:
            w = self.windows[max(self.windows)]
        return w

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

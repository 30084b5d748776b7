"""The raw per-request record. Derived values (TTFT, ITL, e2e) are plain properties of it."""

from __future__ import annotations

import enum


class Outcome(str, enum.Enum):
    """Bounded outcome classes; also the values of the ``outcome`` label."""

    OK = "ok"
    HTTP_ERROR = "http_error"
    TIMEOUT = "timeout"
    CONNECTION_ERROR = "connection_error"
    INVALID_RESPONSE = "invalid_response"
    CANCELLED = "cancelled"


OUTCOMES: tuple[str, ...] = tuple(o.value for o in Outcome)


class RequestRecord:
    """Everything measured about one request. Filled in place by the client.

    Times are ``perf_counter_ns`` values. ``token_times_ns`` holds the arrival time of every
    SSE event that carried content (the first one is the first token); inter-token gaps are
    the differences between consecutive entries.
    """

    __slots__ = (
        "scenario",
        "window",
        "warmup",
        "endpoint",
        "stream",
        "t_start_ns",
        "t_headers_ns",
        "t_end_ns",
        "token_times_ns",
        "prompt_tokens",
        "completion_tokens",
        "usage_from_server",
        "expected_prompt_tokens",
        "max_tokens",
        "finish_reason",
        "outcome",
        "reason",
        "http_status",
        "error",
        "text",
        "request_id",
        "wall_start",
        "sub",
        "t_sent",
        "slo_met",
    )

    def __init__(self, scenario: str, endpoint: str = "chat", stream: bool = True) -> None:
        self.scenario = scenario
        self.window = -1
        self.warmup = False
        self.endpoint = endpoint
        self.stream = stream
        self.t_start_ns = 0
        self.t_headers_ns = 0
        self.t_end_ns = 0
        self.token_times_ns: list[int] = []
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.usage_from_server = False
        self.expected_prompt_tokens = 0
        self.max_tokens = 0
        self.finish_reason: str | None = None
        self.outcome: Outcome = Outcome.OK
        self.reason: str = ""
        self.http_status = 0
        self.error: str = ""
        self.text: str = ""
        self.request_id = ""
        self.wall_start = 0.0
        self.sub = 0  # the sub-window of its window it was sent in (set by the window set)
        self.t_sent: float | None = None  # the window set's clock when it was sent
        self.slo_met: bool | None = None  # met every SLO of its scenario (None: the scenario has none)

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK

    @property
    def e2e_seconds(self) -> float:
        return (self.t_end_ns - self.t_start_ns) / 1e9

    def span(self) -> tuple[float, float]:
        """The request from its send to its end, on the clock of ``t_sent`` (the window set's)."""
        t0 = self.t_sent if self.t_sent is not None else 0.0
        if self.t_start_ns and self.t_end_ns:
            return t0, t0 + max(0.0, (self.t_end_ns - self.t_start_ns) / 1e9)
        return t0, t0

    @property
    def ttft_seconds(self) -> float | None:
        if not self.token_times_ns:
            return None
        return (self.token_times_ns[0] - self.t_start_ns) / 1e9

    def gaps_seconds(self) -> list[float]:
        t = self.token_times_ns
        return [(t[i] - t[i - 1]) / 1e9 for i in range(1, len(t))]

    def meets(self, ttft: float | None, itl: float | None, e2e: float | None) -> bool:
        """Whether this request met the bounds given (seconds; None: no bound): it succeeded, its
        time to first token (a non-streamed body's e2e), its mean inter-token gap (streamed
        requests with two tokens or more) and its e2e are within them."""
        if self.outcome is not Outcome.OK:
            return False
        total = self.e2e_seconds
        if e2e is not None and total > e2e:
            return False
        times = self.token_times_ns
        if ttft is not None:
            first = (times[0] - self.t_start_ns) / 1e9 if self.stream and times else total
            if first > ttft:
                return False
        if itl is not None and self.stream and len(times) > 1:
            if (times[-1] - times[0]) / 1e9 / (len(times) - 1) > itl:
                return False
        return True

    def fail(self, outcome: Outcome, reason: str, error: str = "") -> None:
        self.outcome = outcome
        self.reason = reason
        if error:
            self.error = error[:300]

    def __repr__(self) -> str:
        return (
            f"RequestRecord({self.scenario!r}, outcome={self.outcome.value}, reason={self.reason!r}, "
            f"status={self.http_status}, e2e={self.e2e_seconds:.4f}s, ttft={self.ttft_seconds}, "
            f"tokens={self.prompt_tokens}/{self.completion_tokens})"
        )


_HTTP_REASONS = {400, 401, 403, 404, 408, 413, 422, 429, 500, 502, 503, 504}


def bounded_reason(rec: RequestRecord) -> str:
    """A label-safe reason: the client's reasons form a fixed set, HTTP statuses are folded."""
    r = rec.reason
    if r.startswith("http_"):
        status = rec.http_status
        if status in _HTTP_REASONS:
            return f"http_{status}"
        return "http_4xx" if 400 <= status < 500 else "http_5xx" if 500 <= status < 600 else "http_other"
    return r or rec.outcome.value

"""The window summary: what every detector, the store, the report and the CLI consume.

Built in one place (``soakd.analysis.window.OpenWindow.summary``), read by attribute everywhere,
dumped once (``dump()``: JSON-ready, the same document for SQLite, the ``window_closed`` log line
and the JSON report) and loaded from any of them with ``WindowSummary.load``. The field names
are those of the JSON documents soakd has always written, so state dirs and reports of earlier
releases load as they are (unknown keys are ignored, missing ones take their defaults).

Latency statistics (:class:`Quantiles`) come from the window's quantile sketches with their
distribution-free confidence intervals; device, server and host statistics (the ``*Stat``
models) are aggregates of the samples taken while load ran. A device, server or host quantity
that was not sampled is ``None`` and left out of the dump.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_serializer

CI = tuple[float, float]

__all__ = [
    "CI",
    "ClientSummary",
    "DeviceSummary",
    "Goodput",
    "HostMemoryStat",
    "HostSummary",
    "KvSaturation",
    "MeanMax",
    "MemoryStat",
    "PowerStat",
    "Quantiles",
    "QuiesceProbe",
    "RangeStat",
    "ScenarioSummary",
    "ServerSummary",
    "SubWindows",
    "WindowSummary",
]


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=False)


class _Sparse(_Part):
    """Dumped without the quantities that were not sampled."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class Quantiles(_Part):
    """A latency distribution of a window: quantiles (seconds), their intervals, mean and count."""

    p50: float | None = None
    p95: float | None = None
    p99: float | None = None
    mean: float | None = None
    count: int = 0
    p50_ci: CI | None = None
    p95_ci: CI | None = None
    p99_ci: CI | None = None

    def get(self, q: str) -> float | None:
        return getattr(self, q)

    def ci(self, q: str) -> CI | None:
        return getattr(self, f"{q}_ci")


class MeanMax(_Part):
    mean: float | None = None
    max: float | None = None


class RangeStat(MeanMax):
    min: float | None = None


class PowerStat(RangeStat):
    stdev: float | None = None
    count: int = 0


class HostMemoryStat(RangeStat):
    """A memory-like quantity over the window: its floor (min) is what leak detection compares."""

    first: float | None = None
    last: float | None = None


class MemoryStat(HostMemoryStat):
    slope_per_hour: float | None = None


class DeviceSummary(_Sparse):
    """GPU telemetry of the window, reduced across GPUs (memory, power, energy summed; the hottest
    temperature; the mean SM clock; per clocks-event reason the largest share of any one GPU, so
    that reasons flickering on different GPUs do not add up)."""

    power_watts: PowerStat | None = None
    energy_joules: float | None = None
    energy_seconds: float | None = None
    energy_per_output_token_joules: float | None = None
    temperature_celsius: MeanMax | None = None
    memory_temperature_celsius: MeanMax | None = None
    sm_clock_hertz: RangeStat | None = None
    sm_clock_max_hertz: float | None = None
    sm_clock_by_gpu: dict[str, float] | None = None  # gpu -> the mean of its SM clock (with more than one GPU)
    utilization_ratio: MeanMax | None = None
    throttle_share: dict[str, float] | None = None  # per reason: the largest share of any one GPU
    throttle_share_by_gpu: dict[str, dict[str, float]] | None = None  # gpu -> reason -> share of its samples
    memory_used_bytes: MemoryStat | None = None
    memory_total_bytes: float | None = None
    target_gpu_memory_bytes: MemoryStat | None = None
    # per GPU (uuid): the last value in the window of xid_total (critical Xid events since soakd started),
    # last_xid (the code of the last one), ecc_uncorrected (volatile uncorrected ECC errors), and the
    # first value of each (``<name>_first``)
    gpu_errors: dict[str, dict[str, float]] | None = None


class KvSaturation(_Sparse):
    """The window's server scrapes with the KV cache pinned full (usage at or above
    ``analysis.kv_saturated.ratio``) and requests running: the intervals between two consecutive such
    scrapes (``seconds``) and the server's generated-token counter's increase over them (``tokens``;
    None without a counter), in all and for the longest unbroken run of them (``longest_*``; its start
    ``longest_start_offset_seconds`` into the window), with the KV usage, running and waiting requests
    seen in them (``soakd.analysis.kvsat`` judges them)."""

    seconds: float = 0.0
    tokens: float | None = None
    longest_seconds: float = 0.0
    longest_tokens: float | None = None
    longest_start_offset_seconds: float | None = None
    kv_cache_usage_min: float | None = None
    requests_running_max: float | None = None
    requests_waiting_max: float | None = None


SERVER_MEAN_MIN_INTERVALS = 4  # a server mean's standard error is trusted from this many scrape intervals in the window


class ServerSummary(_Sparse):
    kv_cache_usage_ratio: RangeStat | None = None
    requests_waiting: MeanMax | None = None
    requests_running: MeanMax | None = None
    ttft_mean_seconds: float | None = None  # the server's own, from its histogram's sum and count in the window
    itl_mean_seconds: float | None = None
    # those means' relative standard errors: the spread of the means over the scrape intervals of the window (a
    # ratio estimator over the intervals as clusters; None with fewer than 2), and how many intervals they rest on
    # (a level is judged from SERVER_MEAN_MIN_INTERVALS of them)
    ttft_mean_rel_se: float | None = None
    itl_mean_rel_se: float | None = None
    ttft_mean_intervals: int | None = None
    itl_mean_intervals: int | None = None
    # the server's prefix-cache hit rate in the window: its hits' increase over its queries' (0-1)
    prefix_cache_hit_ratio: float | None = None
    restarts_total: float | None = None  # server restarts soakd recognised since it started (last in the window)
    # the server's own generated tokens per second (its counter's increase over consecutive scrapes in the window)
    generation_tokens_per_second: float | None = None
    kv_saturated: KvSaturation | None = None  # spans pinned full with requests running (None: none)


class HostSummary(_Sparse):
    target_rss_bytes: HostMemoryStat | None = None  # /proc RSS, else the server's process_resident_memory_bytes
    target_anon_bytes: HostMemoryStat | None = None  # /proc RssAnon + VmSwap
    target_memory_source: str | None = None  # proc | server_metrics
    self_rss_bytes: HostMemoryStat | None = None


class QuiesceProbe(_Part):
    """Load paused, in-flight requests drained: KV-cache usage and device memory at idle."""

    t_unix: float
    window: int
    drained: bool = False
    kv_cache_usage_ratio: float | None = None
    memory_used_bytes: float | None = None
    seconds: float | None = None


class SubWindows(_Part):
    """The window cut into equal sub-windows (``seconds`` long, by send time): per sub-window the
    requests, the successful ones and the geometric mean of e2e, TTFT and each request's mean
    inter-token gap (None where a sub-window has none). The per-minute series of the run, and the
    batch means behind ``extra_var``: per latency family (``e2e``, ``ttft``, ``itl``) the variance
    of the window's log-latency level beyond what independent requests would give (batching, slowly
    varying load), added to every quantile's sampling variance of that family."""

    seconds: float
    requests: list[int] = Field(default_factory=list)
    ok: list[int] = Field(default_factory=list)
    e2e: list[float | None] = Field(default_factory=list)
    ttft: list[float | None] = Field(default_factory=list)
    itl: list[float | None] = Field(default_factory=list)
    extra_var: dict[str, float] = Field(default_factory=dict)
    inflation: dict[str, float] = Field(default_factory=dict)  # batch-means variance / independent variance


class ClientSummary(_Part):
    """soakd's own health in the window: its event loop's lag (a 10 ms heartbeat), its CPU time, the
    CFS throttling of its cgroup, and the longest freeze (requests in flight, no byte received from
    any). A request that overlapped a loop lag beyond ``analysis.client.request_max_lag`` is impaired
    (``requests_impaired``, ``impaired_share`` of the window's requests): counted, its latency left out.
    ``impaired``: too much of the window was (more than ``max_impaired_share`` of its requests or of its
    time); the window is shown, not judged on latency (``impaired_reason`` says why)."""

    heartbeats: int = 0
    loop_lag_p50_seconds: float | None = None
    loop_lag_p99_seconds: float | None = None
    loop_lag_max_seconds: float | None = None
    stall_seconds: float = 0.0  # the sum of heartbeat lags beyond 20 ms
    cpu_seconds: float | None = None
    cpu_share: float | None = None  # of one core, over the window's wall time
    cgroup_throttled_seconds: float | None = None
    cgroup_throttled_periods: int | None = None
    freeze_max_seconds: float | None = None
    freeze_start_offset_seconds: float | None = None  # where the longest freeze began, into the window
    freeze_requests: int | None = None  # the requests silent through it (in flight at its start) or half of it
    impaired: bool = False
    impaired_reason: str | None = None
    requests_impaired: int = 0  # requests that overlapped a loop lag beyond analysis.client.request_max_lag
    impaired_share: float | None = None  # of the window's requests (None: no request)
    request_stall_seconds: float = 0.0  # the window's time in loop lags beyond that bound


class Goodput(_Part):
    """Requests of the window under an SLO (their scenario has one) and those that met it."""

    requests: int = 0
    met: int = 0

    @property
    def ratio(self) -> float | None:
        return self.met / self.requests if self.requests else None


class _WithGoodput(_Part):
    """A summary whose ``goodput`` is dumped only where there is one (a run without SLOs keeps
    its documents as they were); a window's ``failures`` likewise only where a request failed."""

    goodput: Goodput | None = None

    @model_serializer(mode="wrap")
    def _drop_no_goodput(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if out.get("goodput", 0) is None:
            del out["goodput"]
        if out.get("failures", 0) == {}:
            del out["failures"]
        return out


class ScenarioSummary(_WithGoodput):
    requests: int = 0
    outcomes: dict[str, int] = Field(default_factory=dict)
    error_rate: float | None = None
    e2e_seconds: Quantiles = Field(default_factory=Quantiles)
    ttft_seconds: Quantiles = Field(default_factory=Quantiles)
    itl_seconds: Quantiles = Field(default_factory=Quantiles)
    requests_per_second: float = 0.0
    output_tokens_per_second: float = 0.0
    completion_tokens: int | None = None  # None: a document that lacks it (derived from the rate)
    completion_tokens_sumsq: float | None = None  # None: a document that lacks it (rate CIs assume mean counts)


class WindowSummary(_WithGoodput):
    """One closed window: requests (overall and per scenario) and the telemetry sampled in it.

    ``duration_seconds`` is the load time (wall time minus quiesce probes), the denominator of
    every rate; ``partial`` marks the window cut short by the end of the run (reported, not
    judged)."""

    window: int
    segment: int = 0
    start_unix: float | None = None
    duration_seconds: float = 0.0
    wall_duration_seconds: float | None = None
    paused_seconds: float = 0.0
    target_down_seconds: float = 0.0
    partial: bool = False
    requests: int = 0
    outcomes: dict[str, int] = Field(default_factory=dict)
    failures: dict[str, int] = Field(default_factory=dict)  # failed requests by bounded reason (http_429, ...)
    error_rate: float | None = None
    mix: dict[str, float] = Field(default_factory=dict)
    e2e_seconds: Quantiles = Field(default_factory=Quantiles)
    ttft_seconds: Quantiles = Field(default_factory=Quantiles)
    itl_seconds: Quantiles = Field(default_factory=Quantiles)
    requests_per_second: float = 0.0  # successful requests per second of load time
    errors_per_second: float = 0.0  # requests that did not succeed (cancelled ones aside), per second
    output_tokens_per_second: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int | None = None  # None: a document that lacks it (derived from the rate)
    completion_tokens_sumsq: float | None = None  # the sum of squared per-request token counts (rate CIs)
    late_records: int = 0  # requests that finished after the window closed (counted in by a revision)
    revision: int = 0  # 0: as closed on time; n: revised n times with requests that finished late
    subwindows: SubWindows | None = None
    client: ClientSummary | None = None
    scenarios: dict[str, ScenarioSummary] = Field(default_factory=dict)
    device: DeviceSummary = Field(default_factory=DeviceSummary)
    server: ServerSummary = Field(default_factory=ServerSummary)
    host: HostSummary = Field(default_factory=HostSummary)
    quiesce: QuiesceProbe | None = None

    @classmethod
    def load(cls, data: Any) -> WindowSummary:
        """From a stored or reported document (a dict, or a summary already)."""
        return data if isinstance(data, cls) else cls.model_validate(data)

    def dump(self) -> dict[str, Any]:
        """The JSON document (lists for intervals; NaN and infinities are the store's to clean)."""
        return self.model_dump(mode="json")

    @property
    def ok(self) -> int:
        return int(self.outcomes.get("ok", 0))

    def beside_server(self) -> list[tuple[str, float, float]]:
        """(``ttft`` or ``itl``, soakd's mean, the server's own mean from its histograms) where both are known."""
        pairs = (("ttft", self.ttft_seconds.mean, self.server.ttft_mean_seconds),
                 ("itl", self.itl_seconds.mean, self.server.itl_mean_seconds))
        return [(m, ours, theirs) for m, ours, theirs in pairs if ours is not None and theirs is not None]

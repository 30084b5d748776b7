"""Configuration of the analysis (``analysis:``): drift, leaks, throttling, diagnosis, quiesce
probes, the canary and the verdict. Models only: the analysis itself lives in ``soakd.analysis``.

Longer than 500 lines: every knob a user can set under ``analysis:``, each with the description that
``--print-config``, the docs and the config errors show; one section, one module."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from soakd.core.durations import Duration
from soakd.core.reasons import CLOCKS_EVENT_REASON_NAMES, PERFORMANCE_REASONS
from soakd.core.tracked import DEFAULT_METRICS, METRICS, SERVER_MEANS
from soakd.core.units import GIB, Bytes

__all__ = [
    "DEFAULT_CANARY_PROMPT",
    "AnalysisConfig",
    "CanaryConfig",
    "ClientConfig",
    "DiagnosisConfig",
    "DriftConfig",
    "ErrorsConfig",
    "KvSaturationConfig",
    "LeakConfig",
    "QuiesceConfig",
    "ThrottleConfig",
    "VerdictConfig",
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


DEFAULT_CANARY_PROMPT = (
    "List the first twelve prime numbers, separated by commas, and then name the planet "
    "closest to the sun."
)


NOT_DRIFT = frozenset({"error_rate"})
ERROR_RATE_THRESHOLD = 0.01  # the retired analysis.drift.error_rate_threshold's value
ERROR_RATE_NOT_DRIFT = (
    "error_rate is not a drift metric: errors are judged against their budgets, analysis.errors.window_budget "
    "(each window) and analysis.verdict.error_budget (the run); remove it from analysis.drift.metrics"
)


class DriftConfig(_Model):
    """Drift detection (``analysis.drift``)."""

    threshold: float = Field(
        0.05,
        gt=0,
        lt=1,
        description="Relative change (0.05 = 5%) against the baseline or previous window beyond which a "
        "metric has drifted, when the change is also statistically significant.",
    )
    goodput_threshold: float = Field(
        0.02,
        gt=0,
        lt=1,
        description="goodput_ratio (the share of requests meeting their SLOs) is compared in absolute "
        "terms too: 0.02 = two percentage points.",
    )
    per_metric: dict[str, float] = Field(
        default_factory=dict,
        description="Per-metric thresholds overriding threshold (and goodput_threshold), e.g. "
        "{e2e_p95: 0.08}. Keys are metric names.",
    )
    confidence: float = Field(
        0.95,
        gt=0.5,
        lt=1,
        description="Confidence of the intervals: at the end of the run a drift is flagged only when the whole "
        "interval of the change lies beyond the threshold (the live page has its own run-level rule: "
        "docs/analysis.md#drift-live). Also pass it to quantile_ci at window close.",
    )
    min_requests: int = Field(
        50,
        ge=1,
        description="A window (or reference) with fewer samples of a metric than this is 'insufficient', "
        "never flagged. 50 keeps the Poisson, Wilson and order-statistic approximations sound; "
        "quantiles need more (p95 needs 110 at 95%) and are insufficient below that anyway.",
    )
    baseline_windows: int = Field(
        4,
        ge=1,
        le=100,
        description="Eligible windows after warm-up (full, target up, enough requests) pooled into the baseline.",
    )
    metrics: list[str] = Field(
        default_factory=lambda: list(DEFAULT_METRICS),
        description="Tracked metrics: e2e/ttft/itl _p50/_p95/_p99, output_tokens_per_second, "
        "requests_per_second, energy_per_token, goodput_ratio (added by itself when a "
        "scenario has an slo). Not error_rate: errors are judged against their budgets (analysis.errors); a "
        "list that names it (an older print-config's) loads without it.",
    )

    @model_validator(mode="before")
    @classmethod
    def _retired(cls, data: Any) -> Any:
        """The error rate's drift test is retired. What an older print-config (or a stored run's configuration)
        wrote is dropped: error_rate from metrics, error_rate_threshold at its old default; any other
        error_rate_threshold is an error that says why (as error_rate in per_metric is)."""
        if isinstance(data, dict) and ("error_rate_threshold" in data or "error_rate" in (data.get("metrics") or ())):
            data = dict(data)
            if "error_rate_threshold" in data and data.pop("error_rate_threshold") != ERROR_RATE_THRESHOLD:
                raise ValueError(ERROR_RATE_NOT_DRIFT.replace("remove it from analysis.drift.metrics",
                                                              "remove analysis.drift.error_rate_threshold"))
            if isinstance(data.get("metrics"), list):
                data["metrics"] = [m for m in data["metrics"] if m not in NOT_DRIFT]
        return data

    @field_validator("metrics")
    @classmethod
    def _known_metrics(cls, v: list[str]) -> list[str]:
        bad = [m for m in v if m not in METRICS]
        if bad:
            raise ValueError(f"unknown metric(s) {bad}; known: {sorted(METRICS)}")
        if len(set(v)) != len(v):
            raise ValueError("metrics are listed more than once")
        return v

    @field_validator("per_metric")
    @classmethod
    def _known_overrides(cls, v: dict[str, float]) -> dict[str, float]:
        bad = [m for m in v if m not in METRICS]
        if bad:
            raise ValueError(f"unknown metric(s) {bad}; known: {sorted(METRICS)}")
        for m, t in v.items():
            if not 0 < t < 1:
                raise ValueError(f"threshold for {m} must be in (0, 1), got {t}")
        return v

    @model_validator(mode="after")
    def _non_empty(self) -> DriftConfig:
        if not self.metrics:
            raise ValueError("metrics must name at least one metric")
        if NOT_DRIFT & set(self.per_metric):
            raise ValueError(ERROR_RATE_NOT_DRIFT.replace("analysis.drift.metrics", "analysis.drift.per_metric"))
        return self

    @property
    def family(self) -> int:
        """The metrics a run-level significance counts (Bonferroni): all but the server's own means. Those are
        judged only in windows where soakd lagged, and there they stand in for soakd's own latencies: a drift of
        those over such windows does not fail while the server's means stay within the threshold
        (``soakd.analysis.detector.own_delay``), so no window is judged on more than these many."""
        return max(1, len(self.soakd_metrics))

    @property
    def soakd_metrics(self) -> list[str]:
        """The tracked metrics soakd measures itself (all but the server's own means): what an A/B run and
        ``soakd compare`` judge."""
        return [m for m in self.metrics if m not in SERVER_MEANS]

    def threshold_for(self, metric: str) -> float:
        if metric in self.per_metric:
            return self.per_metric[metric]
        if metric == "error_rate":  # soakd.analysis.drift.compare of an error rate (no drift metric any more)
            return ERROR_RATE_THRESHOLD
        return self.goodput_threshold if metric == "goodput_ratio" else self.threshold


class LeakConfig(_Model):
    """Leak detection (``analysis.leak``)."""

    min_windows: int = Field(
        6,
        ge=3,
        description="Windows needed before a trend is judged; fewer is 'insufficient'. 6 is the smallest "
        "count for which Sen's 95% interval has finite bounds (at 30-minute windows: 3 hours).",
    )
    horizon_hours: float = Field(
        24.0,
        gt=0,
        description="Projection horizon: growth per hour x horizon beyond the source's budget (with "
        "significant growth) makes a leak suspected.",
    )
    device_memory_budget_bytes: Bytes = Field(
        1 * GIB, gt=0, description="Device memory growth tolerated over the horizon (e.g. 1GiB)."
    )
    target_gpu_memory_budget_bytes: Bytes = Field(
        1 * GIB, gt=0, description="Growth of the target process's GPU memory tolerated over the horizon."
    )
    target_rss_budget_bytes: Bytes = Field(
        1 * GIB, gt=0, description="Growth of the target's host RSS tolerated over the horizon."
    )
    kv_cache_budget_ratio: float = Field(
        0.1,
        gt=0,
        le=1,
        description="Growth of the mean KV-cache usage ratio (at comparable load) tolerated over the "
        "horizon (0.1 = 10 points).",
    )
    kv_residue_budget_ratio: float = Field(
        0.05,
        gt=0,
        le=1,
        description="Idle KV-cache residue (idle usage minus the first idle value) tolerated at the last "
        "quiesce probe, when it grows significantly from probe to probe.",
    )
    confidence: float = Field(
        0.95, gt=0.5, lt=1,
        description="Confidence of the run's last leak judgement (Sen's slope interval); the judgement after each "
        "window uses live_confidence.",
    )
    live_confidence: float | None = Field(
        None,
        gt=0.5,
        lt=1,
        description="Confidence of the judgement after each window (what soakd_memory_leak_suspected and its page "
        "show): it is made at every window, so null (the default) spreads 1 - confidence over the run's planned "
        "judgements (Bonferroni: planned windows - min_windows + 1); the run's last judgement uses confidence. "
        "Where a dozen readings cannot give Sen's interval this confidence, a steady climb is judged by least "
        "squares' interval (docs/analysis.md#the-leak-page).",
    )
    exhaustion_budget_hours: float = Field(
        168.0,
        gt=0,
        description="A sustained memory climb fails the run when memory runs out at its rate within this many "
        "hours (default 7 days); a slower climb is a finding that does not fail.",
    )
    min_span: Duration = Field(
        4 * 3600.0,
        ge=0,
        description="The judged (sustained) part of a memory series, and a KV usage trend, must span this long: a "
        "climb shorter than a cycle of the server's own memory behaviour (a sawtooth's rise) is not yet a leak.",
    )
    sustained_from: float = Field(
        1 / 3,
        ge=0,
        lt=1,
        description="The judged (sustained) part of a memory series starts at this share of it (or after its last "
        "step): what comes before is taken for warm-up. Lower finds a leak sooner and takes a longer warm-up for a "
        "leak (with one 50 MiB-noisy probe a 30-min window, a 50 MB/h leak is paged by hour 8 in 90% at 1/3, 100% "
        "at 1/6; a 1 GiB warm-up over 3 h is paged in 3% and 95%: docs/verdict-quality.md).",
    )
    step_bytes: Bytes = Field(
        64 * 2**20,
        gt=0,
        description="The smallest jump between two readings that counts as a step or a release (and at least five "
        "times the spread of the differences between readings).",
    )

    def budget_for(self, source: str) -> float:
        return {
            "device_memory": self.device_memory_budget_bytes,
            "target_gpu_memory": self.target_gpu_memory_budget_bytes,
            "target_rss": self.target_rss_budget_bytes,
            "kv_cache": self.kv_cache_budget_ratio,
            "kv_residue": self.kv_residue_budget_ratio,
        }[source]


class ThrottleConfig(_Model):
    """Throttle detection (``analysis.throttle``)."""

    max_share: float = Field(
        0.1,
        ge=0,
        lt=1,
        description="A reason active in more than this share of one GPU's samples in a window is throttling, "
        "when it has an impact (the SM clock beyond its noise and latency or throughput drift in the window).",
    )
    clock_drop_ratio: float = Field(
        0.03,
        gt=0,
        lt=1,
        description="The least drop of the SM clock below the baseline pool's that can count as beyond its noise "
        "(the bound is the larger of this and the pool's noise bound): with latency or throughput moving, the "
        "impact that makes an active reason throttling; without both a power cap at full load is healthy.",
    )
    reasons: list[str] = Field(
        default_factory=lambda: list(PERFORMANCE_REASONS),
        description="Clocks-event reasons that count as throttling (default: sw_power_cap, hw_slowdown, "
        "sw_thermal, hw_thermal, hw_power_brake).",
    )
    consecutive: int = Field(
        2,
        ge=1,
        description="The SM clock must be below its reference beyond its noise (clock_confidence) in this many "
        "consecutive windows (or at once by clock_immediate_factor x the bound) before an active reason with "
        "latency or throughput moving is throttling.",
    )
    clock_confidence: float = Field(
        0.99,
        gt=0.5,
        lt=1,
        description="One-sided confidence of the bound on the SM clock's noise: the window means of the baseline "
        "pool give the reference and the spread, a t prediction bound with their degrees of freedom.",
    )
    clock_noise_floor: float = Field(
        0.005,
        ge=0,
        lt=1,
        description="The smallest relative spread of the window-mean SM clock assumed (a pool whose clocks agree "
        "by chance does not make every wander an impact).",
    )
    clock_immediate_factor: float = Field(
        2.0,
        ge=1,
        description="A clock this many times further below the reference than the noise bound counts at once, "
        "without waiting for consecutive windows.",
    )

    @field_validator("reasons")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        bad = [r for r in v if r not in CLOCKS_EVENT_REASON_NAMES]
        if bad:
            raise ValueError(f"unknown clocks-event reason(s) {bad}; known: {list(CLOCKS_EVENT_REASON_NAMES)}")
        return v


class DiagnosisConfig(_Model):
    """Diagnosis rules (``analysis.diagnosis``)."""

    long_scenario: str = Field(
        "long_context", description="Scenario compared with short_scenario for bandwidth or cache pressure."
    )
    short_scenario: str = Field("short_chat", description="The latency-sensitive reference scenario.")
    timeout_share: float = Field(
        0.01, ge=0, lt=1, description="Timeouts above this share of a window's requests (target up) are overload."
    )
    error_share: float = Field(
        0.01, ge=0, lt=1, description="HTTP and connection errors above this share (target up) are server errors."
    )
    invalid_share_critical: float = Field(
        0.01,
        ge=0,
        lt=1,
        description="Invalid responses above this share make garbled output critical (any is a warning).",
    )
    prefix_hit_drop: float = Field(
        0.1,
        gt=0,
        le=1,
        description="A window whose latency or throughput drifted with the server's prefix-cache hit rate this much "
        "below the baseline pool's (0.1 = 10 points, e.g. 60% -> 50%) is diagnosed 'prefix cache hit rate fell'.",
    )


class KvSaturationConfig(_Model):
    """KV cache saturated and stuck (``analysis.kv_saturated``; ``soakd.analysis.kvsat``): the server's KV-cache
    usage pinned near full while it runs requests and generates (almost) nothing."""

    ratio: float = Field(
        0.98,
        gt=0,
        le=1,
        description="KV-cache usage at or above this (0.98 = 98% of the blocks) counts as pinned full. A busy "
        "healthy server reaches it too: it is stuck only when the token rate collapses as well (max_rate_ratio).",
    )
    max_rate_ratio: float = Field(
        0.05,
        ge=0,
        lt=1,
        description="Stuck: the server's generated tokens per second while pinned (its own counter) at most this "
        "share of the baseline window's (0.05 = 5%); before there is a baseline, not a single token. Servers "
        "without a token counter (TGI): soakd's own output tokens per second of the window against the "
        "baseline's, with the window pinned for at least half its time.",
    )
    min_seconds: Duration = Field(
        60.0,
        gt=0,
        description="The pinned span (consecutive server scrapes, all pinned with requests running) must last "
        "this long, and at least 3x the baseline's e2e p99 (a counter that moves only when a request ends must "
        "have had the time to move).",
    )


class CanaryConfig(_Model):
    enabled: bool = Field(True, description="Send the canary and compare its output across the run.")
    interval: Duration = Field(
        300.0, gt=0, description="How often under load, when not tied to the quiesce probes."
    )
    with_quiesce: bool = Field(
        True,
        description="Send it during quiesce probes (idle server: batch of one, reproducible). "
        "When quiesce probes are off it runs on its interval under load.",
    )
    prompt: str = Field(DEFAULT_CANARY_PROMPT, min_length=1, description="The fixed prompt.")
    max_tokens: int = Field(32, ge=1, le=4096)
    seed: int = Field(1234, description="Sent as the request seed (servers that honour it).")
    endpoint: str = Field("chat", pattern="^(chat|completions)$")


class QuiesceConfig(_Model):
    enabled: bool = Field(
        True,
        description="Quiesce probes: stop sending, let in-flight requests drain, sample KV-cache usage and device "
        "memory at idle, then resume. Probe time is excluded from load statistics.",
    )
    interval: Duration | None = Field(
        None, gt=0, description="Time between probes; null = once per window (at a seeded random time in it: jitter)."
    )
    drain_timeout: Duration = Field(60.0, gt=0, description="Longest wait for in-flight requests to finish.")
    settle: Duration = Field(
        2.0, ge=0, description="Idle time before the idle sample (lets the server free blocks and update gauges)."
    )
    jitter: float = Field(
        0.9,
        ge=0,
        le=1,
        description="Where in its interval each probe runs: at a seeded random time spread over this share of the "
        "interval around its middle (0 = always the middle). A fixed phase aliases a cycle of the server's own "
        "memory near the interval (a garbage collector's sawtooth) into a false trend.",
    )
    rereads: int = Field(
        3,
        ge=0,
        le=20,
        description="While the idle KV reading is above 0, read it again up to this many times, `settle` apart "
        "(at least 50 ms), and keep the lowest: a server's gauge can lag the freeing of the last request's blocks (vLLM "
        "publishes it with its engine steps; seen: 4 blocks still counted 1.9 s after the drain, 0 a moment later). "
        "Idle, usage can only fall; a KV cache that is not released reads the same every time.",
    )


class ClientConfig(_Model):
    """When soakd itself was too stalled to measure (``analysis.client``): its own stalls are charged per
    request (a request that overlapped a loop lag beyond ``request_max_lag`` is impaired: counted, left
    out of the latency statistics); a window is client-impaired (shown, not judged) only when too much
    of it was."""

    max_stall_share: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Optional window rule: a window in which soakd's event loop lagged (heartbeat lags beyond 20 ms, "
        "summed) for more than this share of its time is client-impaired: shown, never judged. null (default): "
        "no such rule; stalls are charged to the requests they overlap (request_max_lag).",
    )
    max_lag: Duration | None = Field(
        None, gt=0, description="Optional window rule: a single heartbeat lag this long makes the window client-impaired "
        "too. null (default): a long lag impairs the requests it overlaps, not the window."
    )
    max_throttled_share: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Optional window rule: CFS throttling of soakd's own cgroup (cpu.stat) for more than this share of "
        "the window makes it client-impaired. null (default): throttling is recorded and shown; the loop lags it "
        "causes impair the requests they overlap.",
    )
    freeze_min: Duration = Field(
        5.0,
        gt=0,
        description="A span this long (and at least 3x the baseline's TTFT p95) with requests in flight and no "
        "byte received from any of them, while soakd's loop was punctual, is a server freeze.",
    )
    probe_interval: Duration = Field(
        5.0,
        gt=0,
        description="While soakd's streams in flight are silent (half this, or freeze_min), GET /models is probed "
        "on a connection of its own, at most one probe in flight, each within this timeout and at most one "
        "answered probe per interval: an answer with the silence past the freeze threshold is 'engine wedged'; "
        "a timeout with requests in flight and no progress during it is 'target hung' (soakd_target_up 0 until "
        "it answers).",
    )
    request_max_lag: Duration = Field(
        0.1,
        gt=0,
        description="A heartbeat lag of soakd's event loop this long that overlaps a request (from its send to its "
        "end) makes the request impaired: counted (soakd_requests_impaired_total, the window's client summary), "
        "left out of the latency statistics; the window is judged on the rest.",
    )
    request_lag_relative: float = Field(
        0.0,
        ge=0,
        description="Optional: ...and this many times the run's own p90 heartbeat lag so far (weighed by the time each lag covered): a lag that recurs all run long "
        "(soakd sharing a busy core, a CPU limit throttling it every period) moves every window alike and is no "
        "stall; only one beyond what the run usually sees impairs the requests it overlaps. 0 (default): "
        "request_max_lag alone (a soakd starved all run long is then INCONCLUSIVE; with e.g. 3 it is judged, "
        "and a starvation that changes mid-run can move e2e p95 enough to fail it: measured live, "
        "benchmarks/busy_node.py).",
    )
    timing_lag_p99: Duration | None = Field(
        0.02,
        gt=0,
        description="A judged window in which soakd's event loop lagged this long or longer at its p99 (soakd short "
        "of CPU all window long, e.g. at its cgroup limit, without a single stall beyond request_max_lag) gets an "
        "info finding, 'client lagging': its latencies carry up to that much of soakd's own delay and inter-token "
        "gaps shorter than it are not resolved (the server's own TTFT and ITL means shown beside soakd's where it "
        "exports them). Never fails a run, never leaves a window unjudged. null: no such finding.",
    )
    max_impaired_share: float = Field(
        0.2,
        ge=0,
        le=1,
        description="A window with more than this share of its requests impaired, or with soakd's loop stalled beyond "
        "request_max_lag for more than this share of its time (soakd stopped, e.g. SIGSTOP), is client-impaired: "
        "shown, not judged on latency (throttling, leaks and errors are still judged).",
    )


class VerdictConfig(_Model):
    # the kinds soakd.core.findings.KINDS lets fail_on name (a test keeps the two the same)
    fail_on: list[Literal["drift", "slo", "leak", "throttle", "errors", "canary", "freeze", "target", "ab", "gpu"]] = (
        Field(
            default_factory=lambda: ["drift", "slo", "leak", "throttle", "errors", "canary", "freeze", "ab", "gpu"],
            description="Finding kinds that fail the run (exit code 1). 'client' (soakd's own stalls) never does.",
        )
    )
    error_budget: float = Field(
        0.01, ge=0, le=1, description="Run-wide share of failed measured requests allowed before 'errors' fails it "
        "(the run budget; each window's is analysis.errors.window_budget)."
    )
    min_judged_share: float = Field(
        0.5,
        ge=0,
        le=1,
        description="A run in which fewer of its full windows could be judged (target up, enough requests; "
        "client-impaired windows are not judged either) ends INCONCLUSIVE (exit code 3), never PASS.",
    )


class ErrorsConfig(_Model):
    """The error policy (``analysis.errors``; ``soakd.analysis.errors``): each full window's failed requests
    against a per-window budget, the run's against ``analysis.verdict.error_budget``."""

    window_budget: float = Field(
        0.05,
        gt=0,
        le=1,
        description="The share of one window's measured requests that may fail (neither ok nor cancelled). A "
        "window beyond it (target up, at least analysis.drift.min_requests requests) is an error burst that fails "
        "the run (kind errors, when analysis.verdict.fail_on names it); a burst within it (more failures than the "
        "run budget's share, with confidence) is a warning that does not fail.",
    )
    confidence: float = Field(
        0.999,
        gt=0.5,
        lt=1,
        description="A window is an error burst only when its failures exceed the run budget's share of its "
        "requests with this confidence (a one-sided binomial test): a server failing steadily within the run "
        "budget makes none.",
    )


class AbConfig(_Model):
    """A/B runs (``targets:``): every candidate against the reference, window by window."""

    reference: str | None = Field(None, description="The reference target's name (default: the first of targets).")


class AnalysisConfig(_Model):
    drift: DriftConfig = Field(default_factory=DriftConfig)
    leak: LeakConfig = Field(default_factory=LeakConfig)
    throttle: ThrottleConfig = Field(default_factory=ThrottleConfig)
    diagnosis: DiagnosisConfig = Field(default_factory=DiagnosisConfig)
    quiesce: QuiesceConfig = Field(default_factory=QuiesceConfig)
    canary: CanaryConfig = Field(default_factory=CanaryConfig)
    client: ClientConfig = Field(default_factory=ClientConfig)
    kv_saturated: KvSaturationConfig = Field(default_factory=KvSaturationConfig)
    verdict: VerdictConfig = Field(default_factory=VerdictConfig)
    errors: ErrorsConfig = Field(default_factory=ErrorsConfig)
    ab: AbConfig = Field(default_factory=AbConfig)
    baseline: Path | None = Field(
        None, description="An earlier run's JSON report (or its windows) to use as the baseline instead of this "
        "run's own baseline pool (its first drift.baseline_windows eligible windows, checked for a change)."
    )

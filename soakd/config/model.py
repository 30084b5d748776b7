"""The configuration model of a soak (``SoakConfig`` and its sections).

Loaded by ``soakd.config.loading`` (YAML file < environment ``SOAKD_*`` < command-line flags). Every error names the field path, the bad value and what is expected, all at once, before
anything starts (``ConfigError``). Secrets (the API key) never live in the model: only where
to read them from (``api_key_env`` / ``api_key_file``). The credentials a configuration can hold
(header values that carry one, a URL's user and password, the simulator's key) are typed as such
(``soakd.config.secrets``) and masked by ``SoakConfig.redacted()``; nothing else is.

Longer than 500 lines: every section a user can write (target, run, load, scenarios and their
SLOs, samplers, sweep, batch, metrics, log) is declared here with its description, which the
example file and ``--print-config`` repeat; the cross-field checks live beside the fields.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from soakd.config.analysis import AnalysisConfig
from soakd.config.secrets import HeaderValue, Url, credential_header, mask_url, plain
from soakd.config.sim import SimConfig
from soakd.core.durations import Duration

BUILTIN_SCENARIOS = ("short_chat", "long_context", "batch_burst", "multi_turn", "code_completion")
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,39}$")


class ConfigError(Exception):
    """Configuration that cannot run. ``errors`` lists one human-readable line per problem."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {e}" for e in errors))


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Timeouts(_Model):
    connect: Duration = Field(10.0, gt=0, description="TCP connect (and TLS) timeout.")
    first_token: Duration = Field(
        300.0, gt=0, description="From sending the request to the first streamed token (or the whole non-streamed body)."
    )
    idle: Duration = Field(60.0, gt=0, description="Longest silence allowed between two streamed events.")
    total: Duration = Field(900.0, gt=0, description="Whole request, end to end.")


class Validation(_Model):
    non_empty: bool = Field(True, description="A response without any content is invalid_response (empty_output).")
    utf8: bool = Field(True, description="Invalid UTF-8 in the body is invalid_response (invalid_utf8).")
    replacement_chars: bool = Field(
        True,
        description="U+FFFD replacement characters in the output are invalid_response (garbled_output). "
        "Turn off for random-weight test models, which emit them legitimately.",
    )
    max_repeats: int = Field(
        16,
        ge=0,
        description="A response whose tail is one 1–8 word phrase repeated this many times is "
        "invalid_response (degenerate_repetition). 0 turns the check off.",
    )


class TargetConfig(_Model):
    url: Url = Field(
        "http://127.0.0.1:8000/v1", description="OpenAI base URL including /v1, e.g. http://127.0.0.1:8000/v1. "
        "A user and password in it are shown as *** (--print-config, logs, /status, the report).",
    )
    model: str | None = Field(None, description="Model name; default: the first entry of GET /v1/models.")
    api_key_env: str | None = Field(None, description="Name of the environment variable holding the API key.")
    api_key_file: Path | None = Field(None, description="File whose first line is the API key (e.g. a mounted Secret).")
    keep_alive: bool = Field(
        True, description="Reuse connections. Turn off for servers that drop reused connections under load."
    )
    max_connections: int | None = Field(
        None, ge=1, description="Connection pool size; default: sized to the load (max in flight)."
    )
    headers: dict[str, HeaderValue] = Field(
        default_factory=dict,
        description="Extra HTTP headers sent with every request. The values of headers that can carry a credential "
        "are secrets, shown as ********** (--print-config, logs, /status, the report): Proxy-Authorization, "
        "Cookie, X-Api-Key, api-key, and any name containing auth, cookie, token, key, secret, passw, credential, "
        "session or signature (any case). Authorization is not allowed here: the API key comes from api_key_env "
        "or api_key_file.",
    )
    timeouts: Timeouts = Field(default_factory=Timeouts)
    validation: Validation = Field(default_factory=Validation)

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        v = v.strip().rstrip("/")
        if not re.match(r"^https?://[^/\s]+", v):
            raise ValueError("expected an http:// or https:// base URL such as http://127.0.0.1:8000/v1")
        return v

    @field_validator("api_key_env")
    @classmethod
    def _api_key_env(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v):
            # perhaps the key itself: never echoed back (``format_validation_error``)
            raise ValueError("expected the name of the environment variable that holds the API key "
                             "(e.g. OPENAI_API_KEY), not the key itself")
        return v

    @field_validator("headers")
    @classmethod
    def _headers(cls, v: dict[str, HeaderValue]) -> dict[str, HeaderValue]:
        if any(k.lower() == "authorization" for k in v):
            raise ValueError("do not put Authorization in headers; use api_key_env or api_key_file")
        # a credential by its header's name: a SecretStr from here on (masked wherever it is shown)
        return {k: SecretStr(x) if isinstance(x, str) and credential_header(k) else x for k, x in v.items()}

    def header_values(self) -> dict[str, str]:
        """The extra headers as sent (credentials unwrapped)."""
        return plain(self.headers)

    @property
    def display_url(self) -> str:
        """The URL as logs, /status and the store show it: a user and password in it as ***."""
        return str(mask_url(self.url))


class NamedTargetConfig(TargetConfig):
    """One system of an A/B run (``targets:``): a target with the name its series carry."""

    name: str = Field(..., description="The target label of its series, e.g. h100 or mi300x (lower_snake_case).")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"target name {v!r} must be lower_snake_case (a Prometheus label value)")
        return v


class SourceConfig(_Model):
    type: Literal["synthetic", "jsonl", "sharegpt", "trace"] = Field(
        "synthetic",
        description="synthetic: deterministic prompts from the seed; jsonl: one OpenAI messages list per line; "
        "sharegpt: a ShareGPT JSON file (conversations of from/value); trace: replay a trace file (its requests, "
        "lengths and arrival times; the scenario must be the mix's only one).",
    )
    path: Path | None = Field(None, description="Dataset or trace file for jsonl/sharegpt/trace.")
    format: Literal["mooncake", "burstgpt", "conversations"] | None = Field(
        None, description="trace: mooncake (Mooncake/AIPerf JSONL: timestamp ms, input_length, output_length, "
        "hash_ids), burstgpt (BurstGPT CSV), conversations (JSONL of ShareGPT conversations or OpenAI messages, "
        "replayed turn by turn). Default: from the file (.csv: burstgpt; else the first line's fields).",
    )
    speedup: float = Field(
        1.0, gt=0, description="trace: replay the timestamps this many times faster (load.rate instead: the "
        "trace's shape at that mean rate; load.concurrency: closed loop in the trace's order).",
    )
    block_size: int = Field(
        512, ge=1, le=1_000_000, description="trace, mooncake: tokens per hash id (Mooncake and AIPerf use 512).",
    )

    @model_validator(mode="after")
    def _path(self) -> "SourceConfig":
        if self.type != "synthetic" and self.path is None:
            raise ValueError(f"source type {self.type!r} needs a path")
        return self


class SharedPrefixConfig(_Model):
    """Shared system prompts or documents: a share of the scenario's requests start with one of ``count``
    prefixes of ``tokens`` tokens each (the same ones all run long, as a deployment's system prompts are),
    followed by the scenario's own prompt. What a server's prefix cache is for."""

    count: int = Field(4, ge=1, le=10_000, description="How many distinct shared prefixes.")
    tokens: int = Field(1024, ge=1, le=1_000_000, description="Length of each shared prefix, in tokens.")
    share: float = Field(1.0, gt=0, le=1, description="The share of requests that start with one (picked at random).")


class SloConfig(_Model):
    """Service-level objectives of one scenario. A request meets them when it succeeded and each
    bound given holds: its time to first token, its mean inter-token gap (what ``vllm bench
    serve`` calls TPOT; streamed requests only) and its end-to-end latency. A non-streamed
    request's first token arrives with its body: its TTFT is its e2e."""

    ttft: Duration | None = Field(None, gt=0, description="Time to first token, e.g. 500ms.")
    itl: Duration | None = Field(None, gt=0, description="Mean gap between streamed tokens of a request, e.g. 50ms.")
    e2e: Duration | None = Field(None, gt=0, description="End to end, e.g. 10s.")
    quantile: float = Field(
        0.95, gt=0, lt=1,
        description="The share of requests that must meet every bound for the SLO to hold in a window "
        "(0.95: the bounds are p95 targets). Goodput below it breaks the SLO (the sweep's knee).",
    )

    @model_validator(mode="after")
    def _some_bound(self) -> SloConfig:
        if self.ttft is None and self.itl is None and self.e2e is None:
            raise ValueError("an slo needs at least one of ttft, itl, e2e (e.g. {ttft: 500ms})")
        return self


class ScenarioConfig(_Model):
    """One traffic class. Every field may be omitted for a built-in scenario (its defaults apply)."""

    endpoint: Literal["chat", "completions"] | None = Field(None, description="chat (/chat/completions) or completions.")
    stream: bool | None = Field(None, description="Stream the response (SSE). TTFT and inter-token gaps need it.")
    include_usage: bool | None = Field(
        None, description="Send stream_options.include_usage so the server reports token usage in the stream."
    )
    temperature: float | None = Field(None, ge=0, le=2)
    prompt_tokens: tuple[int, int] | None = Field(None, description="[min, max] target prompt length in tokens.")
    max_tokens: tuple[int, int] | None = Field(None, description="[min, max] output length (max_tokens) per request.")
    extra_body: dict[str, Any] | None = Field(
        None, description="Merged into every request body, e.g. {ignore_eos: true, min_tokens: 128} for vLLM."
    )
    burst_size: int | None = Field(None, ge=1, le=4096, description="batch_burst: requests released together.")
    turns: int | None = Field(None, ge=1, le=64, description="multi_turn: turns per conversation.")
    structure_check: Literal["none", "brackets", "fenced_block"] | None = Field(
        None, description="code_completion: check the output's structure (off by default; random weights fail it)."
    )
    source: SourceConfig | None = None
    shared_prefix: SharedPrefixConfig | None = Field(
        None, description="Shared prefixes: {count: 4, tokens: 1024, share: 1.0}: a share of requests start with "
        "one of count shared system prompts of that many tokens (chat: a system message; completions: the "
        "prompt's start); prompt_tokens is the rest. Not with a trace source (the trace says what is shared).",
    )
    slo: SloConfig | None = Field(
        None, description="Service-level objectives: {ttft: 500ms, itl: 50ms, e2e: 10s, quantile: 0.95}; "
        "per window the share of requests meeting all of them is the goodput (tracked as goodput_ratio).",
    )
    like: Literal["short_chat", "long_context", "batch_burst", "multi_turn", "code_completion"] | None = Field(
        None, description="For a custom scenario: the built-in one whose defaults it starts from."
    )

    @model_validator(mode="after")
    def _prefix_not_with_trace(self) -> ScenarioConfig:
        if self.shared_prefix is not None and self.source is not None and self.source.type == "trace":
            raise ValueError("shared_prefix does not apply to a trace source: the trace's hash_ids say what is shared")
        return self

    @field_validator("prompt_tokens", "max_tokens", mode="before")
    @classmethod
    def _range(cls, v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool):
            return (v, v)
        if isinstance(v, str) and re.fullmatch(r"\s*\d+\s*-\s*\d+\s*", v):
            a, b = v.split("-")
            return (int(a), int(b))
        return v

    @field_validator("prompt_tokens", "max_tokens")
    @classmethod
    def _range_ok(cls, v: tuple[int, int] | None) -> tuple[int, int] | None:
        if v is not None and not (1 <= v[0] <= v[1]):
            raise ValueError(f"expected [min, max] with 1 <= min <= max, got {list(v)}")
        return v


class LoadConfig(_Model):
    concurrency: int | None = Field(
        None, ge=1, le=100_000, description="Closed loop: this many requests always in flight. Default 8."
    )
    rate: float | None = Field(None, gt=0, description="Open loop: requests per second (instead of concurrency).")
    arrival: Literal["poisson", "constant", "trace"] = Field(
        "poisson", description="Open-loop arrival process; trace: the trace scenario's timestamps (the default "
        "when the mix replays a trace with timestamps and concurrency is not set; with rate: its shape at that "
        "mean rate).")
    max_in_flight: int = Field(
        1024, ge=1, description="Open loop: cap on requests in flight; sends beyond it are counted as late."
    )
    mix: dict[str, float] = Field(
        default_factory=lambda: {
            "short_chat": 4,
            "long_context": 1,
            "batch_burst": 1,
            "multi_turn": 2,
            "code_completion": 1,
        },
        description="Scenario name -> weight (proportion of requests).",
    )
    from_sweep: Path | None = Field(
        None, description="Take the load from a sweep (soakd sweep --json FILE): sweep_fraction of the knee's "
        "concurrency (closed loop) or rate (open loop). Replaces concurrency and rate. A sweep that found no knee "
        "is refused, unless sweep_fraction is given explicitly: then that share of its last level.",
    )
    sweep_fraction: float = Field(0.8, gt=0, le=1, description="With from_sweep: the share of the knee to soak at.")
    workers: int = Field(
        1, ge=1, le=64, description="Load worker processes, for a node that one process cannot drive: each sends a "
        "share of the load (the closed loop's concurrency, the open loop's arrivals and max_in_flight, "
        "max_requests) on the one timeline and seed, and sends its request records to soakd, which owns the "
        "windows, analysis, store and /metrics. 1 (the default): everything in one process. One worker drives about "
        "300k streamed tokens/s per core (docs/performance.md).")

    @model_validator(mode="before")
    @classmethod
    def _from_sweep(cls, data: Any) -> Any:
        """``from_sweep``: the knee of the sweep, read now (a file that cannot say is an error here)."""
        if not isinstance(data, dict) or not data.get("from_sweep"):
            return data
        path = Path(data["from_sweep"])
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"from_sweep: cannot read a sweep from {path}: {exc}") from None
        knee = doc.get("knee") if isinstance(doc, dict) else None
        mode = doc.get("mode") if isinstance(doc, dict) else None
        if mode not in ("concurrency", "rate"):
            raise ValueError(f"from_sweep: {path} is not the JSON of soakd sweep --json (expected 'mode' and "
                             "'knee': {'level': ...})")
        if isinstance(knee, dict) and isinstance(knee.get("level"), int | float):
            level = float(knee["level"])
        else:
            steps = [s for s in doc.get("steps") or [] if isinstance(s, dict) and isinstance(s.get("level"), int | float)]
            if "sweep_fraction" not in data or not steps:
                raise ValueError(
                    f"from_sweep: {path} found no knee ({doc.get('message') or doc.get('stop_reason') or 'no steps'}); "
                    "sweep further, or soak at a share of its last level by giving load.sweep_fraction "
                    "(--load-fraction) explicitly")
            level = float(steps[-1]["level"])  # told: a share of the last level
        fraction = float(data.get("sweep_fraction", 0.8))
        out = dict(data)
        if mode == "concurrency":
            out["concurrency"], out["rate"] = max(1, math.floor(level * fraction)), None
        else:
            out["rate"], out["concurrency"] = round(level * fraction, 6), None
        return out

    @model_validator(mode="after")
    def _one_mode(self) -> "LoadConfig":
        if self.concurrency is not None and self.rate is not None:
            raise ValueError(
                f"set either concurrency (closed loop) or rate (open loop), not both "
                f"(got concurrency={self.concurrency}, rate={self.rate})"
            )
        if self.workers > 1 and self.closed_loop and self.workers > self.effective_concurrency:
            raise ValueError(f"workers: {self.workers} workers for a concurrency of {self.effective_concurrency}: "
                             "each worker needs at least one of the closed loop's requests")
        if self.workers > 1 and not self.closed_loop and self.workers > self.max_in_flight:
            raise ValueError(f"workers: {self.workers} workers for a max_in_flight of {self.max_in_flight}: each "
                             "worker needs at least one of the open loop's requests in flight")
        if self.concurrency is not None and self.arrival == "trace":
            raise ValueError(f"arrival: trace replays the trace's timestamps (an open loop): leave concurrency "
                             f"unset (got concurrency={self.concurrency}), or drop arrival to replay the trace "
                             "in its order at that concurrency")
        return self

    @field_validator("mix")
    @classmethod
    def _mix(cls, v: dict[str, float]) -> dict[str, float]:
        if not v:
            raise ValueError("the mix needs at least one scenario with a positive weight")
        for name, w in v.items():
            if not _NAME.match(name):
                raise ValueError(f"scenario name {name!r} must be lower_snake_case (a Prometheus label value)")
            if w < 0:
                raise ValueError(f"weight of {name!r} must be >= 0, got {w}")
        if sum(v.values()) <= 0:
            raise ValueError("the mix needs at least one scenario with a positive weight")
        return v

    @property
    def closed_loop(self) -> bool:
        return self.rate is None and self.arrival != "trace"

    @property
    def effective_concurrency(self) -> int:
        return self.concurrency or 8


class RunConfig(_Model):
    duration: Duration = Field(43200.0, gt=0, description="Length of the soak (after which it ends): 45s, 30m, 12h.")
    warmup: Duration = Field(120.0, ge=0, description="Load before the first window; excluded from statistics.")
    window: Duration = Field(1800.0, gt=0, description="Tumbling analysis window (the method's 30 minutes).")
    max_requests: int | None = Field(None, ge=1, description="End the run after this many requests were sent.")
    grace: Duration = Field(30.0, ge=0, description="On shutdown, how long in-flight requests may take to drain.")
    wait_for_target: Duration = Field(
        900.0, gt=0, description="At start, how long to wait for the target to answer GET /models (a model "
        "loading); then the run exits 1 with the cause (nothing listening, a URL without /v1, an HTML page, "
        "HTTP 503) and a hint. Capped by the duration. Outages during the run are findings, not this.")
    seed: int = Field(0, description="Seeds prompts, arrivals and the mix: same seed, same traffic.")
    state_dir: Path = Field(Path("./soakd-state"), description="Where the run's state and reports go.")
    junit: Path | None = Field(None, description="Also write the verdict as JUnit XML to this file at the end of "
                               "the run (one test case per check; the run directory always has junit.xml).")


class MetricsConfig(_Model):
    host: str = Field("0.0.0.0", description="Listen address of /metrics, /healthz, /readyz, /status.")
    port: int = Field(9400, ge=0, le=65535, description="Listen port (0: any free port).")


class LogConfig(_Model):
    format: Literal["auto", "json", "console"] = Field(
        "auto", description="json lines, console, or auto (console on a terminal, json otherwise)."
    )
    level: Literal["debug", "info", "warning", "error"] = Field("info")
    progress: bool | None = Field(None, description="Live progress line; default: on when stderr is a terminal.")
    summary_interval: Duration = Field(60.0, gt=0, description="How often a summary line is logged.")


class NvmlSamplerConfig(_Model):
    mode: Literal["auto", "on", "off"] = Field(
        "auto",
        description="auto: try NVML and report it down (soakd_sampler_up 0) if unavailable; on: the same, "
        "but logged as an error; off: no NVML sampler.",
    )
    gpus: list[int | str] = Field(
        default_factory=list, description="GPU indices or UUIDs to watch; empty = all visible GPUs."
    )
    interval: Duration | None = Field(None, gt=0, description="Sampling interval; default samplers.interval.")

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_booleans(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare on/off as true/false
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v


class DcgmSamplerConfig(_Model):
    url: Url | None = Field(
        None, description="dcgm-exporter /metrics URL (e.g. http://127.0.0.1:9400/metrics); null = off."
    )
    interval: Duration | None = Field(None, gt=0, description="Scrape interval; default samplers.interval.")


class ServerSamplerConfig(_Model):
    url: Url = Field(
        "auto",
        description="The inference server's Prometheus /metrics URL; auto = the target's origin + /metrics; "
        "none = off.",
    )
    kind: Literal["auto", "vllm", "sglang", "tgi", "trtllm", "llamacpp"] = Field(
        "auto", description="Which metric-name table to use; auto-detected from the exposition."
    )
    interval: Duration | None = Field(None, gt=0, description="Scrape interval; default samplers.interval.")


class HostSamplerConfig(_Model):
    enabled: bool = Field(True, description="soakd's own RSS/CPU/fds, and the target's RSS/CPU when visible.")
    target_pid: int | None = Field(None, ge=1, description="PID of the target server process (same PID namespace).")
    target_process_name: str | None = Field(
        None, description="Or a substring of the target's command line (any case) to find its processes (e.g. "
        "vllm: the API server and its VLLM::EngineCore)."
    )
    interval: Duration | None = Field(None, gt=0, description="Sampling interval; default samplers.interval.")


class SamplersConfig(_Model):
    interval: Duration = Field(5.0, gt=0, description="Default sampling interval of every sampler.")
    nvml: NvmlSamplerConfig = Field(default_factory=NvmlSamplerConfig)
    dcgm: DcgmSamplerConfig = Field(default_factory=DcgmSamplerConfig)
    server: ServerSamplerConfig = Field(default_factory=ServerSamplerConfig)
    host: HostSamplerConfig = Field(default_factory=HostSamplerConfig)


@dataclass(frozen=True)
class RunPolicies:
    """What the window length decides for the rest of a soak, computed once
    (``SoakConfig.policies()``): the parts read these, never ``run.window`` itself."""

    tick_seconds: float  # how often progress advances and due windows close: window/10 in [0.1 s, 1 s]
    close_patience: float  # how long a window waits for its last requests: min(window, 120 s)
    quiesce: bool  # quiesce probes run: enabled, and the window at least 10x the settle time (0.1 s min)
    quiesce_skipped_reason: str | None  # why they do not, when enabled
    quiesce_interval: float  # analysis.quiesce.interval, or once per window
    quiesce_first_after: float  # first probe: warm-up plus half an interval
    quiesce_drain_timeout: float  # min(analysis.quiesce.drain_timeout, window / 4)
    quiesce_min_remaining: float  # no probe in the last min(window / 2, 60 s) of the run
    canary_own_schedule: bool  # the canary runs on its interval (not inside the probes)
    canary_first_after: float  # first canary on its own schedule: warm-up plus half min(interval, window)
    quiesce_jitter: float = 0.0  # analysis.quiesce.jitter: the share of its interval a probe's time spreads over
    seed: int = 0  # run.seed: the probe times' own RNG is seeded from it (soakd.soak.probe_schedule)


class SweepConfig(_Model):
    """``soakd sweep``: raise the load step by step until the knee (the validation method's step 6).
    Closed loop (load.concurrency) sweeps concurrency, open loop (load.rate) the rate."""

    levels: list[float] | None = Field(
        None, description="The load levels in order (concurrencies or req/s); null = start, start*factor, ... stop."
    )
    start: float = Field(1.0, gt=0, description="First level (without levels).")
    stop: float = Field(256.0, gt=0, description="Last level at most (without levels).")
    factor: float = Field(2.0, gt=1, le=16, description="Geometric step between levels (without levels).")
    step: Duration = Field(60.0, gt=0, description="Measured time per step (after its warm-up).")
    max_step: Duration | None = Field(
        None, gt=0, description="A step runs on past step until it has min_requests, up to this long (default 3x step).")
    warmup: Duration = Field(10.0, ge=0, description="Per step: load at the new level before measuring.")
    min_requests: int = Field(
        200, ge=20, description="Requests a step needs for its p50/p95 with their intervals (p95 needs 110 at 95%).")
    min_gain: float = Field(
        0.05, ge=0, lt=1, description="Throughput must rise by more than this (and beyond its uncertainty) from the "
        "best step so far, or the knee is reached.")
    queue_rise: float = Field(
        0.2, gt=0, description="Open loop: e2e latency rising by more than this within a step (a significant "
        "trend) means a growing queue: past the knee.")
    error_budget: float | None = Field(
        None, ge=0, lt=1, description="A step with more failed requests than this share is past the knee "
        "(default analysis.verdict.error_budget).")
    confidence: float = Field(0.95, gt=0.5, lt=1, description="Of the throughput and latency intervals.")
    linger: Duration = Field(
        0.0, ge=0, description="Keep /metrics up this long after the sweep ended, so that Prometheus scrapes its "
        "knee (e.g. twice the scrape interval when the sweep runs as a Kubernetes Job).")


class BatchConfig(_Model):
    """``soakd batch``: an OpenAI Batch API input file, sent with resumable accounting."""

    concurrency: int = Field(8, ge=1, le=10_000, description="Requests in flight at once.")
    max_tries: int = Field(
        3, ge=1, le=100, description="Tries per input before it is given up (retryable failures: HTTP 408/429/5xx, "
        "timeouts, connection errors, an output that fails validation).")
    backoff: Duration = Field(0.5, ge=0, description="First retry delay; doubled per try (with jitter), capped at 30s.")
    failure_budget: float = Field(
        0.0, ge=0, le=1, description="Share of inputs that may fail (bad lines included) before soakd batch exits 1.")


class SoakConfig(_Model):
    target: TargetConfig = Field(default_factory=TargetConfig)
    targets: list[NamedTargetConfig] = Field(
        default_factory=list, description="Several targets in one run (A/B: the same traffic to each at the same "
        "time); the first is the reference unless analysis.ab.reference names another. Replaces target.",
    )
    run: RunConfig = Field(default_factory=RunConfig)
    load: LoadConfig = Field(default_factory=LoadConfig)
    scenarios: dict[str, ScenarioConfig] = Field(
        default_factory=dict, description="Overrides of built-in scenarios and custom scenarios, by name."
    )
    samplers: SamplersConfig = Field(default_factory=SamplersConfig)
    analysis: AnalysisConfig = Field(default_factory=AnalysisConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    sim: SimConfig = Field(default_factory=SimConfig, description="The embedded simulator (soakd sim / soakd demo).")
    sweep: SweepConfig = Field(default_factory=SweepConfig, description="soakd sweep: the load steps to the knee.")
    batch: BatchConfig = Field(default_factory=BatchConfig, description="soakd batch: sending a batch input file.")

    @field_validator("scenarios")
    @classmethod
    def _names(cls, v: dict[str, ScenarioConfig]) -> dict[str, ScenarioConfig]:
        problems = []
        for name, sc in v.items():
            if not _NAME.match(name):
                problems.append(f"scenario name {name!r} must be lower_snake_case (a Prometheus label value)")
            elif name not in BUILTIN_SCENARIOS and sc.like is None and sc.source is None:
                problems.append(
                    f"scenarios.{name}: custom scenario {name!r} needs 'like: <built-in>' or a 'source' "
                    "(jsonl/sharegpt dataset)"
                )
        if problems:
            raise ValueError("\n".join(problems))
        return v

    @model_validator(mode="after")
    def _mix_known(self) -> "SoakConfig":
        # every cross-field problem at once, one line each, each starting with its field path
        problems = []
        unknown = [n for n in self.load.mix if n not in BUILTIN_SCENARIOS and n not in self.scenarios]
        if unknown:
            problems.append(
                f"load.mix: unknown scenario(s) {unknown}; built-in: {list(BUILTIN_SCENARIOS)}, "
                f"or define them under scenarios:"
            )
        if self.run.window < 1.0:
            problems.append(f"run.window: must be at least 1s (got {self.run.window:g}s)")
        if self.target.api_key_env and self.target.api_key_file:
            problems.append("target: set api_key_env or api_key_file, not both")
        problems += self._sweep_problems()
        problems += self._target_problems()
        if problems:
            raise ValueError("\n".join(problems))
        drift = self.analysis.drift
        if self.slos() and "goodput_ratio" not in drift.metrics and "metrics" not in drift.model_fields_set:
            drift.metrics = [*drift.metrics, "goodput_ratio"]  # an SLO is tracked like any metric
            drift.model_fields_set.discard("metrics")
        return self

    def _target_problems(self) -> list[str]:
        out = []
        seen: dict[str, int] = {}
        for i, t in enumerate(self.targets):
            if t.name in seen:
                out.append(f"targets[{i}].name: {t.name!r} is the name of targets[{seen[t.name]}] too: names must be unique")
            seen.setdefault(t.name, i)
        if self.targets and self.target.model_fields_set:
            out.append("target: set target (one system) or targets (several), not both")
        if len(self.targets) > 1 and self.load.workers > 1:
            out.append(f"load.workers: {self.load.workers} worker processes with {len(self.targets)} targets: an A/B "
                       "run sends the same requests to every target from one process (pairs stay paired); use one "
                       "worker")
        ref = self.analysis.ab.reference
        if ref is not None and ref not in {t.name for t in self.target_list()}:
            out.append(f"analysis.ab.reference: {ref!r} is not a target; targets: {[t.name for t in self.target_list()]}")
        return out

    def target_list(self) -> list[NamedTargetConfig]:
        """The run's targets, the reference first: ``targets``, or ``target`` named main."""
        if not self.targets:
            return [NamedTargetConfig(name="main", **self.target.model_dump())]
        ref = self.analysis.ab.reference or self.targets[0].name
        return sorted(self.targets, key=lambda t: t.name != ref)

    def _replays_trace(self) -> bool:
        """The mix replays a trace: with timestamps it is an open loop (``load.arrival: trace``), which only
        the file can say; ``workload.scenarios.with_trace_arrivals`` decides once it is read."""
        return any(sc.source is not None and sc.source.type == "trace" and self.load.mix.get(name, 0) > 0
                   for name, sc in self.scenarios.items())

    def _sweep_problems(self) -> list[str]:
        sw = self.sweep
        out = []
        if sw.levels is not None:
            if not sw.levels:
                out.append("sweep.levels: empty; give at least one level, e.g. [1, 2, 4, 8]")
            elif any(v <= 0 for v in sw.levels):
                out.append(f"sweep.levels: every level must be > 0, got {sw.levels}")
            elif any(b <= a for a, b in zip(sw.levels, sw.levels[1:])):
                out.append(f"sweep.levels: must rise strictly, got {sw.levels}")
            elif self.load.closed_loop and not self._replays_trace() and any(v != int(v) for v in sw.levels):
                out.append(f"sweep.levels: closed-loop levels are concurrencies (whole numbers), got {sw.levels}")
        elif sw.stop < sw.start:
            out.append(f"sweep.stop: {sw.stop:g} is below sweep.start {sw.start:g}: the sweep has no step")
        if sw.max_step is not None and sw.max_step < sw.step:
            out.append(f"sweep.max_step: {sw.max_step:g}s is shorter than sweep.step {sw.step:g}s")
        return out

    def sweep_levels(self) -> list[float]:
        """The sweep's load levels: concurrencies (closed loop, whole numbers) or req/s (open loop)."""
        sw = self.sweep
        if sw.levels is not None:
            return [int(v) if self.load.closed_loop else float(v) for v in sw.levels]
        out: list[float] = []
        v = sw.start
        while v <= sw.stop * (1 + 1e-9):
            level: float = max(1, round(v)) if self.load.closed_loop else round(v, 6)
            if not out or level > out[-1]:
                out.append(level)
            v *= sw.factor
        return out

    def slos(self) -> dict[str, SloConfig]:
        """The SLOs of the scenarios in the mix, by scenario."""
        return {name: sc.slo for name, sc in self.scenarios.items()
                if sc.slo is not None and self.load.mix.get(name, 0) > 0}

    # ---- secrets -----------------------------------------------------------------------
    def api_key(self, target: TargetConfig | None = None) -> str | None:
        """Read the API key (of ``target``, default the first target) from its env var or file.
        Raises ConfigError when it is configured but absent."""
        t = target if target is not None else self.target_list()[0]
        where = "target" if not self.targets else f"targets[{getattr(t, 'name', '?')}]"
        if t.api_key_env:
            key = os.environ.get(t.api_key_env)
            if not key:
                raise ConfigError([f"{where}.api_key_env: environment variable {t.api_key_env} is not set or empty"])
            return key.strip()
        if t.api_key_file:
            try:
                key = t.api_key_file.read_text(encoding="utf-8").strip().splitlines()[0].strip()
            except (OSError, IndexError) as exc:
                raise ConfigError([f"{where}.api_key_file: cannot read an API key from {t.api_key_file}: {exc}"]) from None
            if not key:
                raise ConfigError([f"{where}.api_key_file: {t.api_key_file} is empty"])
            return key
        return None

    def policies(self) -> RunPolicies:
        window, q, c = self.run.window, self.analysis.quiesce, self.analysis.canary
        fits = window >= 10 * max(q.settle, 0.1)
        quiesce = q.enabled and fits
        interval = q.interval or window
        return RunPolicies(
            tick_seconds=max(0.1, min(1.0, window / 10)),
            close_patience=min(window, 120.0),
            quiesce=quiesce,
            quiesce_skipped_reason=None if fits or not q.enabled else (
                f"window {window:g}s is shorter than 10x the probe's settle time ({max(q.settle, 0.1):g}s); "
                "lower analysis.quiesce.settle to probe"),
            quiesce_interval=interval,
            quiesce_first_after=self.run.warmup + interval / 2,
            quiesce_drain_timeout=min(q.drain_timeout, window / 4),
            quiesce_min_remaining=min(window / 2, 60.0),
            canary_own_schedule=c.enabled and not (quiesce and c.with_quiesce),
            canary_first_after=self.run.warmup + min(c.interval, window) / 2,
            quiesce_jitter=q.jitter,
            seed=self.run.seed,
        )

    def redacted(self) -> dict[str, Any]:
        """The effective configuration as plain data (durations as '30m'), every credential masked by
        its type (``soakd.config.secrets``: ``SecretStr`` values as **********, a URL's user and password
        as ***) and nothing else: what ``--print-config`` prints, the store keeps and the report shows."""
        return self.model_dump(mode="json")

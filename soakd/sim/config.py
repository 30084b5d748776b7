"""Configuration of the embedded simulated inference server (``soakd sim``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from soakd.durations import Duration

__all__ = ["SimConfig", "SimFaults"]

_PROBABILITY_FIELDS = (
    "error_rate_500",
    "error_rate_429",
    "stall_rate",
    "truncate_rate",
    "malformed_rate",
    "garbled_rate",
    "empty_rate",
)


class SimFaults(BaseModel):
    """Faults the simulator injects. Every rate is a per-request probability drawn from the
    server's seeded RNG, so a given seed and request order reproduce the same faults."""

    model_config = ConfigDict(extra="forbid")

    latency_drift_pct_per_hour: float = Field(
        0.0,
        description=(
            "Latency grows linearly with server uptime: every TTFT and per-token delay is "
            "multiplied by 1 + pct/100 * uptime_hours (e.g. 5 = 5%/h; 3600 = +1% per second for "
            "short tests). Negative values make the server faster (floored at 0.05x). Resets "
            "when the server restarts."
        ),
    )
    kv_leak_blocks_per_n_requests: int = Field(
        0,
        ge=0,
        description=(
            "KV-cache blocks leaked every kv_leak_every_n_requests finished requests. Leaked "
            "blocks stay held until the server restarts, so idle KV usage keeps growing."
        ),
    )
    kv_leak_every_n_requests: int = Field(
        100, ge=1, description="How many finished requests between two KV leaks."
    )
    error_rate_500: float = Field(
        0.0, description="Probability that a request is answered 500 (server_error)."
    )
    error_rate_429: float = Field(
        0.0,
        description="Probability that a request is answered 429 (rate limited) with Retry-After.",
    )
    stall_rate: float = Field(
        0.0,
        description=(
            "Probability that a response stalls: a stream stops sending mid-stream for "
            "stall_duration, then continues (a non-streaming response is delayed as much)."
        ),
    )
    stall_duration: Duration = Field(5.0, description="How long a stall lasts, e.g. '5s'.")
    truncate_rate: float = Field(
        0.0,
        description=(
            "Probability that a response is cut off: the connection is aborted mid-stream, "
            "without finish_reason, usage or [DONE]."
        ),
    )
    malformed_rate: float = Field(
        0.0,
        description="Probability that one SSE chunk (or a non-streaming body) is not valid JSON.",
    )
    garbled_rate: float = Field(
        0.0,
        description=(
            "Probability that the content is garbage: U+FFFD replacement characters and a "
            "degenerate repetition loop (what broken weights produce)."
        ),
    )
    empty_rate: float = Field(
        0.0,
        description="Probability that a response has no content tokens (finish_reason 'stop').",
    )
    restart_after: Duration | None = Field(
        None,
        description=(
            "After this much uptime the server goes down: the listening socket closes and "
            "in-flight connections are dropped; it comes back on the same port with fresh "
            "state after restart_downtime. Unset = never."
        ),
    )
    restart_downtime: Duration = Field(
        2.0, description="How long the server stays down during a restart, e.g. '2s'."
    )
    restart_repeat: bool = Field(
        False,
        description=("Restart again every restart_after of uptime (true), or only once (false)."),
    )

    @field_validator(*_PROBABILITY_FIELDS)
    @classmethod
    def _probability(cls, value: float) -> float:
        if not 0.0 <= value <= 1.0:
            raise ValueError(
                f"must be a probability between 0 and 1 (e.g. 0.01 for 1%), got {value!r}"
            )
        return value

    @field_validator("restart_after")
    @classmethod
    def _positive_restart(cls, value: float | None) -> float | None:
        if value is not None and value <= 0:
            raise ValueError("must be a positive duration like '10m', or unset to never restart")
        return value


class SimConfig(BaseModel):
    """The simulated vLLM-like server: address, latency model, KV-cache model and faults.

    Latency model (seconds; all multiplied by the drift factor and the jitter noise):

    * TTFT = time waiting for a running slot
      + ttft_base + ttft_per_prompt_token * prompt_tokens + ttft_per_queued * queue_length
    * each further token = tpot_base + tpot_per_batch * (running_requests - 1)
    """

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port; 0 picks a free one.")
    model: str = Field("soakd-sim", min_length=1, description="The served model name.")
    seed: int = Field(
        0, description="Seed of the server RNGs (faults, latency jitter, non-greedy output)."
    )
    api_key: SecretStr | None = Field(
        None,
        description=(
            "When set, /v1/* requires 'Authorization: Bearer <api_key>' (401 otherwise). "
            "/metrics and /health stay open, as in vLLM."
        ),
    )

    ttft_base: Duration = Field(
        0.05, description="Prefill time of an empty prompt at an idle server (seconds or '50ms')."
    )
    ttft_per_prompt_token: float = Field(
        0.00002, ge=0, description="Extra prefill seconds per prompt token."
    )
    ttft_per_queued: float = Field(
        0.0,
        ge=0,
        description=(
            "Extra prefill seconds per request already waiting beyond the running batch when "
            "this one arrives (scheduler contention), on top of the real queueing delay."
        ),
    )
    tpot_base: Duration = Field(
        0.005, description="Time per output token with one running request (seconds or '5ms')."
    )
    tpot_per_batch: float = Field(
        0.0002,
        ge=0,
        description="Extra seconds per output token for each other running request.",
    )
    jitter: float = Field(
        0.0,
        ge=0,
        le=1,
        description=(
            "Relative standard deviation of multiplicative Gaussian noise on every delay "
            "(0 = deterministic, 0.1 = 10%)."
        ),
    )
    max_batch: int = Field(
        64, ge=1, description="Running slots; further requests wait (vllm:num_requests_waiting)."
    )
    default_max_tokens: int = Field(
        128, ge=1, description="Output tokens when a request gives no max_tokens."
    )
    max_model_len: int = Field(
        32768,
        ge=2,
        description="Context length: prompt + max_tokens beyond it is rejected with 400.",
    )

    kv_blocks_total: int = Field(4096, ge=1, description="KV-cache blocks (capacity).")
    kv_block_size: int = Field(16, ge=1, description="Tokens per KV-cache block.")

    faults: SimFaults = Field(default_factory=SimFaults, description="Injected faults.")

    @model_validator(mode="after")
    def _check_lengths(self) -> SimConfig:
        if self.default_max_tokens >= self.max_model_len:
            raise ValueError(
                f"default_max_tokens ({self.default_max_tokens}) must be smaller than "
                f"max_model_len ({self.max_model_len})"
            )
        return self

"""Configuration of the embedded simulated inference server (``soakd sim``).

Longer than 500 lines: every knob of the simulator (latency, KV and prefix cache, the simulated GPU) and every
fault a test or a demo injects, each with the description that ``soakd sim --help``, the docs and
examples/soak.yaml show; split, the faults would lose their one place.
"""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

from soakd.core.durations import Duration

__all__ = ["SimConfig", "SimDeviceConfig", "SimFaults"]

_GiB = 1024**3
_MiB = 1024**2

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
    latency_step_at: Duration | None = Field(
        None,
        description=(
            "A latency step: from this server uptime on (e.g. '10m'), every TTFT and per-token "
            "delay is multiplied by 1 + latency_step_pct/100 (a slower build or driver swapped "
            "in mid-run; drift detection must flag it). Like the drift, it is taken when a "
            "request starts and resets when the server restarts. Unset = never."
        ),
    )
    latency_step_pct: float = Field(
        10.0,
        gt=-100,
        description=(
            "Size of the latency step in percent (10 = every delay 10% longer; negative = faster)."
        ),
    )
    latency_step_duration: Duration | None = Field(
        None,
        gt=0,
        description=(
            "How long the latency step lasts (e.g. '5m': a noisy neighbour that left, a rolled-back "
            "driver); the delays return to normal after it. Unset = the step stays."
        ),
    )
    output_change_at: Duration | None = Field(
        None,
        description=(
            "From this server uptime on (e.g. '10m'), deterministic outputs (temperature 0 or a "
            "request seed) change: the same prompt and seed are answered from another corpus "
            "offset, as after a silent numerical change (new weights, kernels or driver), so "
            "the output-consistency canary reports a mismatch. Resets when the server restarts. "
            "Unset = never."
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
    freeze_every: Duration | None = Field(
        None,
        gt=0,
        description="The whole engine freezes every so often (server uptime k x freeze_every, k >= 1): no request, "
        "streamed or not, gets a token for freeze_duration and /metrics' vllm:generation_tokens_total stands still "
        "with vllm:num_requests_running > 0, while /health and /v1/models still answer (a wedged engine).",
    )
    freeze_duration: Duration = Field(10.0, gt=0, description="How long each engine freeze lasts.")
    kv_saturate_at: Duration | None = Field(
        None,
        gt=0,
        description="From this server uptime on, for kv_saturate_duration, the KV cache is full and stuck (once): "
        "/metrics' vllm:kv_cache_usage_perc reads 1, the requests running stay running (vllm:num_requests_running "
        "> 0) and get no token, streamed or not (vllm:generation_tokens_total stands still), new ones wait "
        "(vllm:num_requests_waiting), while /health and /v1/models answer: an engine out of KV blocks. Unset = never.",
    )
    kv_saturate_duration: Duration = Field(
        10.0, gt=0, description="How long the KV cache stays saturated and stuck (kv_saturate_at)."
    )
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
    thermal_throttle_at: Duration | None = Field(
        None,
        description=(
            "Simulated GPU: a thermal-throttling episode starts this long after the simulator "
            "started (in soakd demo: after the soak's first request; simulated restarts do not reset it), e.g. '10m'. During it the cooling "
            "cannot keep up: the temperature climbs towards device.slowdown_celsius, the "
            "clocks-event reason sw_thermal is set (and hw_thermal when the clock ratio is 0.5 or "
            "less), the thermal violation counter runs, the SM clock drops to "
            "thermal_throttle_clock_ratio of its maximum and every latency of the server grows "
            "by 1/ratio. Unset = never."
        ),
    )
    thermal_throttle_duration: Duration = Field(
        60.0, gt=0, description="How long a thermal-throttling episode lasts, e.g. '60s'."
    )
    thermal_throttle_clock_ratio: float = Field(
        0.6,
        gt=0,
        le=1,
        description=(
            "SM clock during a thermal-throttling episode as a fraction of its maximum "
            "(0.6 = 60%: latencies are 1/0.6 = 1.67x as long)."
        ),
    )
    power_cap_at: Duration | None = Field(
        None,
        description=(
            "Simulated GPU: a power-capping episode starts this long after the simulator started "
            "(in soakd demo: after the soak's first request), e.g. '20m'. During it the enforced power limit is power_cap_watts (the configured "
            "management limit is unchanged, as when a rack power manager caps the GPU); whenever "
            "the load would draw more, the power is held at the cap, sw_power_cap is set, the "
            "power violation counter runs and the SM clock (and so the latency) scales down to "
            "fit. Unset = never."
        ),
    )
    power_cap_duration: Duration = Field(
        60.0, gt=0, description="How long a power-capping episode lasts, e.g. '60s'."
    )
    power_cap_watts: float = Field(
        300.0,
        gt=0,
        description=(
            "Enforced power limit during a power-capping episode, in watts; must lie between "
            "device.idle_power_watts and device.power_limit_watts."
        ),
    )
    host_memory_leak_bytes_per_hour: ByteSize = Field(
        ByteSize(0),
        description=(
            "The server process's host memory (its process_resident_memory_bytes in /metrics, as a "
            "Python server exports it) grows by this much per hour of uptime (bytes, or e.g. '10GiB'): "
            "a host-RAM cache that is never evicted. Released when the server restarts."
        ),
    )
    device_memory_leak_bytes_per_hour: ByteSize = Field(
        ByteSize(0),
        description=(
            "Simulated GPU: device memory the server leaks per hour of uptime, independent of the "
            "KV cache (bytes, or e.g. '2GiB'). Released when the server restarts; used memory "
            "never exceeds the device's capacity."
        ),
    )
    # device memory in steps (a staircase at flat KV usage: soakd names it 'memory steps', not a leak)
    device_memory_step_bytes: ByteSize = Field(
        ByteSize(0),
        description=(
            "Simulated GPU: device memory grows in steps of this size (bytes, or e.g. '512MiB'), one every "
            "device_memory_step_every of uptime, with flat plateaus between them and the KV cache untouched: "
            "what an allocator that grows its pool, or a server that captures a CUDA graph, for each new batch "
            "shape or sequence length does. At most device_memory_steps steps. Released when the server "
            "restarts; used memory never exceeds the device's capacity. 0 = no steps."
        ),
    )
    device_memory_step_every: Duration | None = Field(
        None,
        gt=0,
        description="Server uptime between two memory steps (k x this, k >= 1), e.g. '30m'; required with "
        "device_memory_step_bytes.",
    )
    device_memory_steps: int | None = Field(
        None,
        ge=1,
        description="How many memory steps there are before memory stays flat (a bounded set of shapes); unset "
        "= they keep coming (an unbounded staircase, which soakd projects like a leak).",
    )

    prefix_cache_shrink_at: Duration | None = Field(
        None,
        gt=0,
        description="From this server uptime on (e.g. '10m') the prefix cache keeps only prefix_cache_shrink_ratio "
        "of its blocks, the rest evicted at once: eviction under fragmentation, the hit rate falls and prefill "
        "grows. Unset = never.",
    )
    prefix_cache_shrink_ratio: float = Field(
        0.0,
        ge=0,
        le=1,
        description="The share of the prefix cache's blocks kept from prefix_cache_shrink_at on (0: none).",
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

    @model_validator(mode="after")
    def _memory_steps(self) -> SimFaults:
        if self.device_memory_step_bytes and self.device_memory_step_every is None:
            raise ValueError(
                "faults.device_memory_step_bytes needs faults.device_memory_step_every (the uptime between two "
                "steps, e.g. '30m')"
            )
        return self


class SimDeviceConfig(BaseModel):
    """The simulated GPU(s) behind the simulated server: an H100-like device whose telemetry
    follows the engine's load (``GET /dcgm/metrics`` in dcgm-exporter's format, and the fake NVML
    that ``soakd demo`` samples). Every GPU of a tensor-parallel group holds a shard of every KV
    block, so all of them follow the same load."""

    model_config = ConfigDict(extra="forbid")

    gpus: int = Field(1, ge=1, le=16, description="Number of simulated GPUs (one server, tensor parallel).")
    name: str = Field(
        "NVIDIA H100 80GB HBM3", min_length=1, description="Product name (NVML name, DCGM modelName)."
    )
    memory_total: ByteSize = Field(
        ByteSize(80 * _GiB), gt=0, description="Device memory per GPU, bytes or e.g. '80GiB'."
    )
    memory_reserved: ByteSize = Field(
        ByteSize(512 * _MiB),
        description="Memory the driver reserves per GPU (NVML 'reserved', DCGM FB_RESERVED).",
    )
    memory_base: ByteSize = Field(
        ByteSize(40 * _GiB),
        description=(
            "Memory the server holds per GPU with an empty KV cache: weights, activations, CUDA "
            "context (bytes or e.g. '40GiB')."
        ),
    )
    kv_block_bytes: ByteSize | None = Field(
        None,
        description=(
            "Device memory per KV-cache block per GPU. Used memory = memory_base + blocks in use "
            "x kv_block_bytes (+ leaked bytes). Unset: a full cache brings the GPU to 90% of "
            "memory_total, like vLLM's gpu_memory_utilization=0.9 (8 MiB per block with the "
            "defaults)."
        ),
    )
    idle_power_watts: float = Field(70.0, gt=0, description="Power draw with nothing running.")
    power_per_request_watts: float = Field(
        9.0,
        ge=0,
        description=(
            "Extra power per running request (the batch), before the power limit: the default "
            "keeps a full batch of 64 under the 700 W limit."
        ),
    )
    power_limit_watts: float = Field(
        700.0, gt=0, description="Power management limit (and enforced limit outside power-cap episodes)."
    )
    saturation_batch: int = Field(
        16, ge=1, description="Running requests at which GPU utilisation reaches 100%."
    )
    ambient_celsius: float = Field(
        28.0, description="Inlet temperature: the GPU temperature at zero power."
    )
    celsius_per_watt: float = Field(
        0.065,
        ge=0,
        description=(
            "Steady-state temperature rise per watt (0.065: about 33 C idle, 70 C at 650 W with "
            "the defaults); the HBM reads 7 C above the GPU."
        ),
    )
    thermal_time_constant: Duration = Field(
        30.0,
        gt=0,
        description=(
            "Time constant of the first-order thermal lag: after a load step the temperature "
            "covers 63% of the way to its new steady state in this time (e.g. '30s'; shorter "
            "compresses the thermal behaviour for short demos and tests)."
        ),
    )
    slowdown_celsius: float = Field(
        87.0,
        description="Temperature the GPU climbs towards during a thermal-throttling episode.",
    )
    sm_clock_max_mhz: int = Field(
        1980,
        ge=1,
        description=(
            "Maximum SM clock; the simulated GPU runs at it unless throttled (also while idle, "
            "so every dip is a throttle)."
        ),
    )
    memory_clock_mhz: int = Field(2619, ge=1, description="Memory clock (constant).")

    @model_validator(mode="after")
    def _check(self) -> SimDeviceConfig:
        if self.memory_reserved + self.memory_base >= self.memory_total:
            raise ValueError(
                f"memory_base ({self.memory_base.human_readable()}) + memory_reserved "
                f"({self.memory_reserved.human_readable()}) must be below memory_total "
                f"({self.memory_total.human_readable()})"
            )
        if self.kv_block_bytes is None and self.memory_base >= 0.9 * self.memory_total:
            raise ValueError(
                "memory_base leaves no room for the KV cache below 90% of memory_total; "
                "set kv_block_bytes explicitly or lower memory_base"
            )
        if self.idle_power_watts >= self.power_limit_watts:
            raise ValueError(
                f"idle_power_watts ({self.idle_power_watts}) must be below power_limit_watts "
                f"({self.power_limit_watts})"
            )
        return self

    def block_bytes(self, kv_blocks_total: int) -> int:
        """Bytes per KV block per GPU (``kv_block_bytes``, or the 90% rule)."""
        if self.kv_block_bytes is not None:
            return int(self.kv_block_bytes)
        return max(0, int((0.9 * self.memory_total - self.memory_base) / kv_blocks_total))


class SimConfig(BaseModel):
    """The simulated vLLM-like server: address, latency model, KV-cache model and faults.

    Latency model (seconds; all multiplied by the drift factor, the latency step, the simulated
    GPU's slowdown — 1/clock ratio while it is thermally throttled or power capped — and the
    jitter noise):

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
    prefix_caching: bool = Field(
        True,
        description="Automatic prefix caching, as vLLM's V1 engine does by default: a prompt's leading full blocks "
        "seen before are not prefilled again, counted in vllm:prefix_cache_queries/_hits (tokens; soakd.sim.prefix).",
    )
    prefix_cache_blocks: int | None = Field(
        None,
        ge=0,
        description="Blocks the prefix cache keeps (least recently used evicted beyond it); unset = kv_blocks_total.",
    )

    device: SimDeviceConfig = Field(
        default_factory=SimDeviceConfig,
        description="The simulated GPU(s): memory, power, temperature, clocks (see /dcgm/metrics).",
    )
    faults: SimFaults = Field(default_factory=SimFaults, description="Injected faults.")
    metric_names: Literal["vllm", "sglang", "tgi", "trtllm", "llamacpp", "none"] = Field(
        "vllm",
        description="Whose metric names /metrics uses: vLLM's (the default), SGLang's, TGI's, trtllm-serve's or "
        "llama.cpp's (the signals that server exports, under its names: soakd.sim.names), or none (/metrics "
        "answers 404, as a server without metrics).",
    )

    @model_validator(mode="after")
    def _check_lengths(self) -> SimConfig:
        if self.default_max_tokens >= self.max_model_len:
            raise ValueError(
                f"default_max_tokens ({self.default_max_tokens}) must be smaller than "
                f"max_model_len ({self.max_model_len})"
            )
        dev, faults = self.device, self.faults
        if dev.kv_block_bytes is not None:
            need = dev.memory_base + dev.memory_reserved + self.kv_blocks_total * dev.kv_block_bytes
            if need > dev.memory_total:
                raise ValueError(
                    f"the KV cache does not fit the simulated GPU: memory_base + memory_reserved + "
                    f"kv_blocks_total x kv_block_bytes = {ByteSize(need).human_readable()} > "
                    f"device.memory_total ({dev.memory_total.human_readable()}); lower "
                    "device.kv_block_bytes or kv_blocks_total"
                )
        if faults.power_cap_at is not None and not (
            dev.idle_power_watts < faults.power_cap_watts < dev.power_limit_watts
        ):
            raise ValueError(
                f"faults.power_cap_watts ({faults.power_cap_watts}) must lie between "
                f"device.idle_power_watts ({dev.idle_power_watts}) and device.power_limit_watts "
                f"({dev.power_limit_watts}) for the power-cap episode to cap anything"
            )
        return self

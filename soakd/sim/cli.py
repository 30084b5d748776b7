"""``soakd sim``'s flags: each maps onto a SimConfig field (flags > the config file's ``sim:``)."""

from __future__ import annotations

import argparse

from soakd.config.sim import SimConfig

# ---------------------------------------------------------------------------- CLI helpers

# flag dest -> (section, SimConfig field); section None = top level, "faults" = SimFaults.
_FLAG_FIELDS: dict[str, tuple[str | None, str]] = {
    "host": (None, "host"),
    "port": (None, "port"),
    "model": (None, "model"),
    "seed": (None, "seed"),
    "ttft": (None, "ttft_base"),
    "tpot": (None, "tpot_base"),
    "jitter": (None, "jitter"),
    "max_batch": (None, "max_batch"),
    "prefix_caching": (None, "prefix_caching"),
    "metric_names": (None, "metric_names"),
    "latency_drift_pct_per_hour": ("faults", "latency_drift_pct_per_hour"),
    "latency_step_at": ("faults", "latency_step_at"),
    "latency_step_pct": ("faults", "latency_step_pct"),
    "latency_step_duration": ("faults", "latency_step_duration"),
    "output_change_at": ("faults", "output_change_at"),
    "kv_leak_blocks": ("faults", "kv_leak_blocks_per_n_requests"),
    "kv_leak_every": ("faults", "kv_leak_every_n_requests"),
    "error_rate_500": ("faults", "error_rate_500"),
    "error_rate_429": ("faults", "error_rate_429"),
    "stall_rate": ("faults", "stall_rate"),
    "stall_duration": ("faults", "stall_duration"),
    "freeze_every": ("faults", "freeze_every"),
    "freeze_duration": ("faults", "freeze_duration"),
    "truncate_rate": ("faults", "truncate_rate"),
    "malformed_rate": ("faults", "malformed_rate"),
    "garbled_rate": ("faults", "garbled_rate"),
    "empty_rate": ("faults", "empty_rate"),
    "restart_after": ("faults", "restart_after"),
    "restart_downtime": ("faults", "restart_downtime"),
    "prefix_cache_blocks": (None, "prefix_cache_blocks"),
    "prefix_cache_shrink_at": ("faults", "prefix_cache_shrink_at"),
    "prefix_cache_shrink_ratio": ("faults", "prefix_cache_shrink_ratio"),
    "gpus": ("device", "gpus"),
    "thermal_time_constant": ("device", "thermal_time_constant"),
    "thermal_throttle_at": ("faults", "thermal_throttle_at"),
    "thermal_throttle_duration": ("faults", "thermal_throttle_duration"),
    "thermal_throttle_clock_ratio": ("faults", "thermal_throttle_clock_ratio"),
    "power_cap_at": ("faults", "power_cap_at"),
    "power_cap_duration": ("faults", "power_cap_duration"),
    "power_cap_watts": ("faults", "power_cap_watts"),
    "device_memory_leak_per_hour": ("faults", "device_memory_leak_bytes_per_hour"),
    "host_memory_leak_per_hour": ("faults", "host_memory_leak_bytes_per_hour"),
    "device_memory_step": ("faults", "device_memory_step_bytes"),
    "device_memory_step_every": ("faults", "device_memory_step_every"),
    "device_memory_steps": ("faults", "device_memory_steps"),
}


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``soakd sim`` flags (all default to None = keep the configured value)."""
    g = parser.add_argument_group("simulator")
    g.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    g.add_argument(
        "--port", type=int, default=None, help="listen port, 0 = any free (default 8000)"
    )
    g.add_argument("--model", default=None, help="served model name (default soakd-sim)")
    g.add_argument("--seed", type=int, default=None, help="RNG seed for faults, jitter and output")
    g.add_argument("--ttft", default=None, help="base time to first token, e.g. 50ms")
    g.add_argument("--tpot", default=None, help="time per output token at batch 1, e.g. 5ms")
    g.add_argument("--jitter", type=float, default=None, help="relative latency noise, e.g. 0.1")
    g.add_argument("--max-batch", type=int, default=None, help="running slots before queueing")
    g.add_argument("--metric-names", default=None, choices=("vllm", "sglang", "tgi", "trtllm", "llamacpp", "none"),
                   help="whose metric names /metrics uses (default vllm; none: /metrics answers 404)")
    g.add_argument(
        "--latency-drift-pct-per-hour", type=float, default=None, help="latency growth in %%/hour"
    )
    g.add_argument(
        "--latency-step-at",
        default=None,
        help="from this uptime on every delay is --latency-step-pct longer, e.g. 10m "
        "(default never)",
    )
    g.add_argument(
        "--latency-step-pct", type=float, default=None, help="size of that step in %% (default 10)"
    )
    g.add_argument(
        "--latency-step-duration",
        default=None,
        help="how long the latency step lasts, e.g. 5m (default: it stays)",
    )
    g.add_argument(
        "--output-change-at",
        default=None,
        help="from this uptime on deterministic outputs change (the canary sees a mismatch), "
        "e.g. 10m (default never)",
    )
    g.add_argument("--kv-leak-blocks", type=int, default=None, help="KV blocks leaked per leak")
    g.add_argument("--kv-leak-every", type=int, default=None, help="finished requests per leak")
    g.add_argument("--error-rate-500", type=float, default=None, help="probability of a 500")
    g.add_argument("--error-rate-429", type=float, default=None, help="probability of a 429")
    g.add_argument(
        "--stall-rate", type=float, default=None, help="probability of a mid-stream stall"
    )
    g.add_argument("--stall-duration", default=None, help="stall length, e.g. 5s")
    g.add_argument("--truncate-rate", type=float, default=None, help="probability of a cut stream")
    g.add_argument("--malformed-rate", type=float, default=None, help="probability of a bad chunk")
    g.add_argument("--garbled-rate", type=float, default=None, help="probability of garbage text")
    g.add_argument("--empty-rate", type=float, default=None, help="probability of an empty output")
    g.add_argument("--restart-after", default=None, help="restart the server after this uptime")
    g.add_argument("--restart-downtime", default=None, help="how long a restart keeps it down")
    g.add_argument("--prefix-cache-blocks", type=int, default=None,
                   help="blocks the prefix cache keeps (default: the KV cache's size)")
    g.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false", default=None,
                   help="no prefix cache (every prompt prefilled in full)")
    g.add_argument("--prefix-cache-shrink-at", default=None,
                   help="from this uptime the prefix cache keeps only --prefix-cache-shrink-ratio of its blocks, "
                   "e.g. 10m (eviction under fragmentation)")
    g.add_argument("--prefix-cache-shrink-ratio", type=float, default=None,
                   help="the share of its blocks kept from then on (default 0: none)")
    d = parser.add_argument_group("simulated GPU (GET /dcgm/metrics; the fake NVML of soakd demo)")
    d.add_argument("--gpus", type=int, default=None, help="number of simulated GPUs (default 1)")
    d.add_argument(
        "--thermal-time-constant", default=None, help="thermal lag of the GPU, e.g. 30s (default)"
    )
    d.add_argument(
        "--thermal-throttle-at",
        default=None,
        help="start a thermal-throttling episode at this uptime, e.g. 10m (default never)",
    )
    d.add_argument(
        "--thermal-throttle-duration", default=None, help="its length, e.g. 60s (default)"
    )
    d.add_argument(
        "--thermal-throttle-clock-ratio",
        type=float,
        default=None,
        help="SM clock during it as a fraction of max; latency grows by 1/ratio (default 0.6)",
    )
    d.add_argument(
        "--power-cap-at",
        default=None,
        help="start a power-capping episode at this uptime, e.g. 20m (default never)",
    )
    d.add_argument("--power-cap-duration", default=None, help="its length, e.g. 60s (default)")
    d.add_argument(
        "--power-cap-watts", type=float, default=None, help="enforced limit during it (default 300)"
    )
    d.add_argument(
        "--device-memory-leak-per-hour",
        default=None,
        help="device memory leaked per hour of uptime, e.g. 2GiB (default 0)",
    )
    d.add_argument(
        "--host-memory-leak-per-hour",
        default=None,
        help="the server process's host memory (process_resident_memory_bytes) growth per hour of uptime "
        "(default 0)",
    )
    d.add_argument(
        "--device-memory-step",
        default=None,
        help="device memory grows in steps of this size (graph capture / allocator growth per new shape), "
        "e.g. 512MiB (default 0) ...",
    )
    d.add_argument("--device-memory-step-every", default=None, help="... one every this much uptime, e.g. 30m ...")
    d.add_argument(
        "--device-memory-steps", type=int, default=None, help="... at most this many (default: they keep coming)"
    )


def sim_config_from_args(args: argparse.Namespace, base: SimConfig | None = None) -> SimConfig:
    """*base* (or defaults) with every non-None flag of *args* applied, validated again."""
    data = (base or SimConfig()).model_dump()
    if base is not None and base.api_key is not None:
        data["api_key"] = base.api_key.get_secret_value()
    for dest, (section, field) in _FLAG_FIELDS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if section is None:
            data[field] = value
        else:
            data[section][field] = value
    return SimConfig.model_validate(data)

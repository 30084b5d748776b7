"""The simulator's ``/metrics``: a :class:`~soakd.sim.model.SimModel` under vLLM's current (V1
engine) metric names."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from soakd.sim.histograms import Histogram
from soakd.sim.model import FINISH_REASONS, SimModel


HOST_RSS_BASE = 600 * 2**20  # the simulated server process's resident memory at start


class SimCollector:
    """Exposes a :class:`SimModel` with vLLM's current (V1 engine) metric names."""

    def __init__(self, get_model: Callable[[], SimModel], model_name: str) -> None:
        self._get_model = get_model
        self._labels = ["model_name", "engine"]
        self._values = [model_name, "0"]

    def collect(self) -> Iterator[Metric]:
        m = self._get_model()
        cfg = m.config
        labels, values = self._labels, self._values

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            fam = GaugeMetricFamily(name, doc, labels=labels)
            fam.add_metric(values, value)
            return fam

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            fam = CounterMetricFamily(name, doc, labels=labels)
            fam.add_metric(values, value)
            return fam

        def histogram(name: str, doc: str, h: Histogram) -> HistogramMetricFamily:
            fam = HistogramMetricFamily(name, doc, labels=labels)
            fam.add_metric(values, h.cumulative(), h.sum)
            return fam

        # prometheus_client's process collector, as a Python server (vLLM, SGLang) exports it: a new
        # start time per incarnation (a restart), and host memory that grows with the host-memory fault
        uptime = max(0.0, m.clock() - m.started)
        for name, doc, value in (
            ("process_start_time_seconds", "Start time of the process since unix epoch in seconds.", m.started_unix),
            ("process_resident_memory_bytes", "Resident memory size in bytes.",
             HOST_RSS_BASE + float(cfg.faults.host_memory_leak_bytes_per_hour) * uptime / 3600.0),
        ):
            fam = GaugeMetricFamily(name, doc)
            fam.add_metric([], value)
            yield fam
        yield gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", m.running
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            len(m.waiting),
        )
        yield gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", m.kv_usage
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "num_gpu_blocks", "engine"],
        )
        info.add_metric([str(cfg.kv_block_size), str(cfg.kv_blocks_total), "0"], 1.0)
        yield info
        yield counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            m.num_preemptions,
        )
        yield counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", m.prompt_tokens_total
        )
        # vLLM V1's prefix cache counters (in tokens: soakd.sim.prefix)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      m.prefix_cache.queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      m.prefix_cache.hits)
        yield counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            m.generation_tokens_total,
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*labels, "finished_reason"],
        )
        for reason in FINISH_REASONS:
            success.add_metric([*values, reason], m.request_success.get(reason, 0))
        yield success
        yield histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            m.ttft,
        )
        yield histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            m.itl,
        )
        yield histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            m.request_tpot,
        )
        yield histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            m.e2e,
        )
        yield histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            m.queue_time,
        )
        yield histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            m.request_prompt_tokens,
        )
        yield histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            m.request_generation_tokens,
        )

"""The simulator's ``/metrics`` under another server's names (``sim.metric_names``): SGLang, TGI,
TensorRT-LLM (trtllm-serve) or llama.cpp, the names soakd's server sampler reads for each
(``soakd.samplers.server``'s tables), or none at all (``/metrics`` answers 404). Only the signals a
real server of that family exports: TGI has no token counter and no Python process metrics; current
llama.cpp no KV gauge. Where the real server adds a request's tokens to its counter when the request
ends (SGLang, TensorRT-LLM, llama.cpp), so does this: the counter is the finished requests' tokens."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from soakd.sim.collector import HOST_RSS_BASE
from soakd.sim.histograms import Histogram
from soakd.sim.model import SimModel

__all__ = ["METRIC_NAMES", "NamedCollector"]

METRIC_NAMES = ("vllm", "sglang", "tgi", "trtllm", "llamacpp", "none")

# family: the prefix cache's counters (hits, then queries or misses: which the second one is, in the unit)
_PREFIX: dict[str, tuple[str, str, str, str]] = {
    "sglang": ("sglang:cached_tokens", "sglang:prompt_tokens", "queries", "tokens"),
    "trtllm": ("trtllm_kv_cache_reused_blocks", "trtllm_kv_cache_missed_blocks", "misses", "blocks"),
    "llamacpp": ("llamacpp:prompt_tokens_cached", "llamacpp:prompt_tokens", "misses", "tokens"),
}

# family: (running, waiting, kv 0-1 gauge, generated-token counter, TTFT histogram, ITL histogram, labels)
_NAMES: dict[str, tuple[str, str, str | None, str | None, str | None, str | None, bool]] = {
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
               "sglang:generation_tokens", "sglang:time_to_first_token_seconds",
               "sglang:inter_token_latency_seconds", True),
    "tgi": ("tgi_batch_current_size", "tgi_queue_size", None, None, None, None, False),
    "trtllm": ("trtllm_num_requests_running", "trtllm_num_requests_waiting", "trtllm_kv_cache_utilization",
               "trtllm_generation_tokens", None, None, True),
    "llamacpp": ("llamacpp:requests_processing", "llamacpp:requests_deferred", None, "llamacpp:tokens_predicted",
                 None, None, False),
}


class NamedCollector:
    """Exposes a :class:`SimModel` with another server's metric names (``kind``: a key of ``_NAMES``)."""

    def __init__(self, get_model: Callable[[], SimModel], model_name: str, kind: str) -> None:
        if kind not in _NAMES:
            raise ValueError(f"sim.metric_names: {kind!r} has no table here; use one of {', '.join(METRIC_NAMES)}")
        self._get_model = get_model
        self.kind = kind
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        m = self._get_model()
        running, waiting, kv, tokens, ttft, itl, labelled = _NAMES[self.kind]
        labels = ["model_name"] if labelled else []
        values = [self._model_name] if labelled else []

        def gauge(name: str, value: float) -> GaugeMetricFamily:
            fam = GaugeMetricFamily(name, f"{name} (soakd sim)", labels=labels)
            fam.add_metric(values, value)
            return fam

        def histogram(name: str, h: Histogram) -> HistogramMetricFamily:
            fam = HistogramMetricFamily(name, f"{name} (soakd sim)", labels=labels)
            fam.add_metric(values, h.cumulative(), h.sum)
            return fam

        if self.kind in ("sglang", "trtllm"):  # Python servers: prometheus_client's process collector
            fam = GaugeMetricFamily("process_start_time_seconds", "Start time of the process since unix epoch.")
            fam.add_metric([], m.started_unix)
            yield fam
            rss = GaugeMetricFamily("process_resident_memory_bytes", "Resident memory size in bytes.")
            uptime = max(0.0, m.clock() - m.started)
            rss.add_metric([], HOST_RSS_BASE + float(m.config.faults.host_memory_leak_bytes_per_hour) * uptime / 3600)
            yield rss
        yield gauge(running, m.running)
        yield gauge(waiting, len(m.waiting))
        if kv is not None:
            yield gauge(kv, m.kv_usage)
        elif self.kind == "tgi":  # the batch's token budget: tokens it may reach / the maximum
            total = float(m.config.kv_blocks_total * m.config.kv_block_size)
            yield gauge("tgi_batch_current_max_tokens", m.kv_usage * total)
            yield gauge("tgi_batch_max_total_tokens", total)
        if tokens is not None:  # added when a request ends, as these servers do
            fam = CounterMetricFamily(tokens, f"{tokens} (soakd sim)", labels=labels)
            fam.add_metric(values, m.request_generation_tokens.sum)
            yield fam
        prefix = _PREFIX.get(self.kind)
        if prefix is not None and m.config.prefix_caching:
            hits_name, other_name, other, unit = prefix
            hits, queries = float(m.prefix_cache.hits), float(m.prefix_cache.queries)
            if unit == "blocks":  # whole blocks: hits are block-aligned, a prompt's last partial block a miss
                hits, queries = hits // m.config.kv_block_size, float(m.prefix_cache.query_blocks)
            for name, value in ((hits_name, hits), (other_name, queries if other == "queries" else queries - hits)):
                fam = CounterMetricFamily(name, f"{name} (soakd sim)", labels=labels)
                fam.add_metric(values, value)
                yield fam
        if ttft is not None:
            yield histogram(ttft, m.ttft)
        if itl is not None:
            yield histogram(itl, m.itl)

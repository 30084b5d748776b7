"""Inference-server sampler: scrape the target's own ``/metrics`` and normalise it.

One table of metric names per server (inference-perf's approach), with fallbacks across versions,
auto-detected from the names present and overridable with ``samplers.server.kind``. Every name
below was read from the server's source (see each table's comment); the golden expositions in
``tests/fixtures/metrics/`` reproduce each server's output.

Normalised series (catalogue group "server"):

- ``soakd_server_kv_cache_usage_ratio`` (0-1). Every source gauge is already a 0-1 fraction
  (vLLM's ``kv_cache_usage_perc`` and the older ``gpu_cache_usage_perc`` — "1 means 100 percent" —,
  SGLang's ``token_usage``, TRT-LLM's ``kv_cache_utilization`` = used/max blocks, Triton's
  ``kv_cache_block_type="fraction"``, old llama.cpp's ``kv_cache_usage_ratio``). Where a server
  gives absolute numbers instead, the ratio is ``sum(used) / sum(capacity)`` (TGI's
  ``tgi_batch_current_max_tokens / tgi_batch_max_total_tokens``, a proxy: tokens the running batch
  may reach over the token budget; Triton's used/max blocks when ``fraction`` is missing).
  Across engines or models the fraction is the **mean**: data-parallel engines have identical
  pools, so the mean is the share of the total pool in use (the capacity-weighted ratio), which is
  what a leak shows up in. (A max would report the hottest engine; per-engine detail stays in
  the server's own series.) A server without any KV gauge (current llama.cpp, TGI before warm-up)
  is logged once at info and gets no series: nothing is invented.
- ``soakd_server_requests_running`` / ``_waiting``: **sum** across engines and models.
- ``soakd_server_preemptions_total``: sum of the server's cumulative counter (vLLM preemptions,
  SGLang retractions); it resets when the server restarts, which Prometheus' ``rate()`` handles.
- ``soakd_server_generation_tokens_total``: the server's cumulative count of generated tokens (vLLM
  ``generation_tokens_total``, SGLang ``generation_tokens_total``, trtllm-serve
  ``trtllm_generation_tokens_total``, llama.cpp ``tokens_predicted_total``), summed over engines;
  it resets with the server (a lower value: ``RestartDetector``). vLLM counts each engine step's
  tokens (``ServerTable.tokens_per_step``); SGLang, TensorRT-LLM and llama.cpp add a request's tokens
  when it finishes (SGLang ``observe_one_finished_request``, TensorRT-LLM's per-request metrics,
  llama.cpp ``on_prediction`` at the slot's end), so there a flat counter only means something over
  longer than a request takes (``soakd.soak.wedge``). TGI and Triton have no such counter
  (``tgi_request_generated_tokens`` is a per-request histogram): no series.
- ``soakd_server_prefix_cache_hit_ratio``: cumulative hits / queries since the server started
  (summed over engines before dividing; omitted while queries are 0). Servers that only give a
  cumulative hit-rate gauge (vLLM V0) use it.
- ``soakd_server_prefix_cache_hits_total`` / ``_queries_total``: the counters themselves (tokens; blocks
  for TensorRT-LLM; queries = hits + misses where the server counts misses), whose increases over a window
  give the window's own hit rate (``soakd_window_prefix_cache_hit_ratio``: the cumulative ratio of a
  server up for days hardly moves when its cache starts to evict).
- ``soakd_server_ttft_seconds_total`` / ``soakd_server_ttft_requests_total`` and
  ``soakd_server_itl_seconds_total`` / ``soakd_server_itl_tokens_total``: the sum and count of the
  server's own TTFT and inter-token histograms (vLLM, SGLang; TTFT only for trtllm-serve), summed over
  engines; for llama.cpp the inter-token pair is its generation-time and generated-token counters
  (``tokens_predicted_seconds_total``, ``tokens_predicted_total``: each slot's time from its first token to
  its last, added when the slot ends, so the mean is the gaps' mean times (n-1)/n). Per window their
  differences give the server's mean TTFT and ITL, which the window summary sets beside soakd's
  (``soakd_window_server_latency_difference_seconds``: what the network and the client add). Not read:
  TGI's ``tgi_request_mean_time_per_token_duration`` and trtllm-serve's ``time_per_output_token_seconds``
  hold each request's mean time per token (TGI's with the prefill in it), not the gaps', and TGI has no
  TTFT histogram.
- ``soakd_server_info{kind,version}``: the detected table's kind, and the server's version where it says one
  (``soakd.samplers.version``: asked in the background once scrapes answer, again after a restart; empty
  until it answers or where it says none).
- ``soakd_server_process_resident_memory_bytes`` / ``_process_start_time_seconds``: the server's own
  ``process_*`` series where it exports them (Python servers through prometheus_client): its host
  memory when soakd cannot see its processes, and its start time.
- ``soakd_server_restarts_total``: restarts recognised between scrapes (``RestartDetector``: a new
  process start time, or a cumulative counter that went down); rates over a restart never go
  negative (the window's server means are None across it, Prometheus' ``rate()`` handles resets).

Children that are copies of one scheduler's value are merged by max before aggregating (SGLang
``tp_rank``/``pp_rank`` with ``--enable-metrics-for-all-schedulers``; the ``pid`` label
prometheus_client's multiprocess mode adds to TRT-LLM's gauges).

The URL ``auto`` is the target's origin + ``/metrics`` (vLLM, SGLang, TGI, llama.cpp), then
``/prometheus/metrics`` (trtllm-serve, whose ``/metrics`` is JSON iteration stats). Triton serves
metrics on its own port (8002): set ``samplers.server.url``.

Longer than 500 lines: the tables of six servers' metric names and the normalisation that reads them
belong together (a name is added in one place, beside the code that reads it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog
from yarl import URL

from soakd.config import ServerSamplerConfig
from soakd.core.series import Series, series
from soakd.samplers.base import SamplerUnavailable
from soakd.samplers.promtext import (
    Child,
    Exposition,
    Ref,
    Scraper,
    ScrapeError,
    SessionFactory,
    collapse,
    mean,
    redact_url,
    ref,
    total,
)
from soakd.samplers.version import VersionAsker

log = structlog.get_logger("soakd.samplers.server")


@dataclass(frozen=True)
class PrefixSource:
    """Cumulative prefix-cache counters: hits with queries, or hits with misses (queries = both)."""

    hits: Ref
    queries: Ref | None = None
    misses: Ref | None = None


@dataclass(frozen=True)
class ServerTable:
    """Metric names of one server (family), in preference order within each signal."""

    kind: str  # soakd_server_info{kind}; the value of samplers.server.kind
    name: str  # the table (a kind may have several, e.g. trtllm-serve and Triton)
    kv: tuple[Ref, ...] = ()  # 0-1 gauges
    kv_ratio: tuple[tuple[Ref, Ref], ...] = ()  # (used, capacity) gauges
    running: tuple[Ref, ...] = ()
    waiting: tuple[Ref, ...] = ()
    preemptions: tuple[Ref, ...] = ()  # counters
    prefix: tuple[PrefixSource, ...] = ()  # counters
    prefix_ratio: tuple[Ref, ...] = ()  # cumulative 0-1 gauges (negative = disabled)
    ttft: tuple[Ref, ...] = ()  # the server's own TTFT histogram (base name: _sum and _count are read)
    itl: tuple[Ref, ...] = ()  # the server's own inter-token latency histogram
    # else (seconds, tokens) counters whose increases' ratio is the server's own mean time per generated token
    itl_counters: tuple[tuple[Ref, Ref], ...] = ()
    generation: tuple[Ref, ...] = ()  # counters: generated tokens
    tokens_per_step: bool = False  # the generation counter moves every engine step (else when a request ends)
    replica_labels: tuple[str, ...] = ()
    signals: tuple[Ref, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        sig = self.kv + tuple(pair[0] for pair in self.kv_ratio) + self.running + self.waiting
        object.__setattr__(self, "signals", sig)

    def score(self, expo: Exposition) -> int:
        """How many of this table's signal names the exposition has (0 = not this server)."""
        return sum(1 for r in self.signals if expo.has(r))


def _r(*names: str) -> tuple[Ref, ...]:
    return tuple(Ref(n) for n in names)


# vLLM: vllm/v1/metrics/loggers.py (PrometheusStatLogger; labels model_name, engine) and, for the V0
# engine, vllm/engine/metrics.py (labels model_name). kv_cache_usage_perc replaced
# gpu_cache_usage_perc in 0.9; prefix_cache_{queries,hits} replaced gpu_prefix_cache_* in 0.9; V0
# exported the gpu_prefix_cache_hit_rate gauge instead (-1 when prefix caching is off).
VLLM = ServerTable(
    kind="vllm",
    name="vllm",
    kv=_r("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    running=_r("vllm:num_requests_running"),
    waiting=_r("vllm:num_requests_waiting"),
    preemptions=_r("vllm:num_preemptions_total"),
    ttft=_r("vllm:time_to_first_token_seconds"),
    itl=_r("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    # V1: PrometheusStatLogger.record adds each iteration's num_generation_tokens (V0: each step's too)
    generation=_r("vllm:generation_tokens_total"),
    tokens_per_step=True,
    prefix=(
        PrefixSource(Ref("vllm:prefix_cache_hits_total"), queries=Ref("vllm:prefix_cache_queries_total")),
        PrefixSource(Ref("vllm:gpu_prefix_cache_hits_total"), queries=Ref("vllm:gpu_prefix_cache_queries_total")),
    ),
    prefix_ratio=_r("vllm:gpu_prefix_cache_hit_rate"),
)

# SGLang: python/sglang/srt/metrics/collector.py (SchedulerMetricsCollector: labels model_name,
# engine_type, tp_rank, pp_rank[, dp_rank]; TokenizerMetricsCollector: prompt_tokens_total,
# cached_tokens_total[cache_source]). sglang:num_retracted_reqs is a per-batch gauge, not a count:
# preemptions come from the num_retracted_requests_total counter only. sglang:cache_hit_rate is the
# last prefill batch's rate, so the cumulative ratio comes from the token counters.
SGLANG = ServerTable(
    kind="sglang",
    name="sglang",
    kv=_r("sglang:token_usage"),
    running=_r("sglang:num_running_reqs"),
    waiting=_r("sglang:num_queue_reqs"),
    preemptions=_r("sglang:num_retracted_requests_total"),
    ttft=_r("sglang:time_to_first_token_seconds"),
    itl=_r("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
    generation=_r("sglang:generation_tokens_total"),  # TokenizerMetricsCollector.observe_one_finished_request
    prefix=(PrefixSource(Ref("sglang:cached_tokens_total"), queries=Ref("sglang:prompt_tokens_total")),),
    replica_labels=("tp_rank", "pp_rank"),
)

# TGI: router/src/server.rs (describe_*), backends/v3/src/{backend.rs,lib.rs} (tgi_batch_current_*,
# tgi_batch_max_total_tokens); Rust metrics-exporter-prometheus, counters without _total.
TGI = ServerTable(
    kind="tgi",
    name="tgi",
    kv_ratio=((Ref("tgi_batch_current_max_tokens"), Ref("tgi_batch_max_total_tokens")),),
    running=_r("tgi_batch_current_size"),
    waiting=_r("tgi_queue_size"),
)

# trtllm-serve: tensorrt_llm/metrics/collector.py (MetricsCollector; labels model_name, engine_type),
# mounted at /prometheus/metrics by tensorrt_llm/serve/openai_server.py.
TRTLLM = ServerTable(
    kind="trtllm",
    name="trtllm",
    kv=_r("trtllm_kv_cache_utilization"),
    kv_ratio=((Ref("trtllm_kv_cache_used_blocks"), Ref("trtllm_kv_cache_max_blocks")),),
    running=_r("trtllm_num_requests_running"),
    waiting=_r("trtllm_num_requests_waiting"),
    prefix=(
        PrefixSource(Ref("trtllm_kv_cache_reused_blocks_total"), misses=Ref("trtllm_kv_cache_missed_blocks_total")),
    ),
    prefix_ratio=_r("trtllm_kv_cache_hit_rate"),
    generation=_r("trtllm_generation_tokens_total"),  # one of MetricsCollector's per-request metrics
    # per request, as vLLM's; its time_per_output_token_seconds is each request's mean, not the gaps': not read
    ttft=_r("trtllm_time_to_first_token_seconds"),
    replica_labels=("pid",),
)

# Triton + tensorrtllm_backend: the batch-manager families of the backend README ("Triton Metrics"),
# label-dispatched (kv_cache_block_type, request_type); labels model, version.
TRITON_TRTLLM = ServerTable(
    kind="trtllm",
    name="triton_trtllm",
    kv=(ref("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="fraction"),),
    kv_ratio=(
        (
            ref("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="used"),
            ref("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="max"),
        ),
    ),
    running=(ref("nv_trt_llm_request_metrics", request_type="active"),),
    waiting=(ref("nv_trt_llm_request_metrics", request_type="waiting"),),
)

# llama.cpp: tools/server/server-task.cpp / server.cpp (to_metrics(): llamacpp: prefix, no labels).
# kv_cache_usage_ratio existed in older builds and was removed; prompt_tokens_total excludes the
# tokens reused from the cache (prompt_tokens_cached_total), so those are the misses.
LLAMACPP = ServerTable(
    kind="llamacpp",
    name="llamacpp",
    kv=_r("llamacpp:kv_cache_usage_ratio"),
    running=_r("llamacpp:requests_processing"),
    waiting=_r("llamacpp:requests_deferred"),
    generation=_r("llamacpp:tokens_predicted_total"),  # server_metrics::on_prediction, at the slot's end
    # and the slots' generation time beside it (t_token_generation: first token to last), at the slot's end
    itl_counters=((Ref("llamacpp:tokens_predicted_seconds_total"), Ref("llamacpp:tokens_predicted_total")),),
    prefix=(
        PrefixSource(Ref("llamacpp:prompt_tokens_cached_total"), misses=Ref("llamacpp:prompt_tokens_total")),
    ),
)

TABLES: tuple[ServerTable, ...] = (VLLM, SGLANG, TGI, TRTLLM, TRITON_TRTLLM, LLAMACPP)
KINDS: tuple[str, ...] = ("vllm", "sglang", "tgi", "trtllm", "llamacpp")


def tables_for(kind: str) -> tuple[ServerTable, ...]:
    if kind == "auto":
        return TABLES
    found = tuple(t for t in TABLES if t.kind == kind)
    if not found:
        raise ValueError(f"samplers.server.kind: unknown kind {kind!r}; use auto or one of {', '.join(KINDS)}")
    return found


def metrics_urls(url: str, target_url: str) -> list[str]:
    """The URL(s) to try: ``auto`` = target origin + /metrics, then + /prometheus/metrics."""
    if url.strip().lower() == "none":
        raise ValueError("samplers.server.url is none: the server sampler is off (the caller must not build it)")
    if url.strip().lower() != "auto":
        return [url.strip()]
    target = URL(target_url)
    if not target.is_absolute() or target.scheme not in ("http", "https"):
        raise ValueError(f"target.url {redact_url(target_url)!r} is not an http(s) URL; set samplers.server.url")
    origin = target.origin()
    return [str(origin.with_path("/metrics")), str(origin.with_path("/prometheus/metrics"))]


def detect(expo: Exposition, tables: Sequence[ServerTable], current: ServerTable | None = None) -> ServerTable | None:
    """The table for this exposition: the current one while any of its signals is present (sticky),
    else the one with the most signals present (earlier tables win ties)."""
    if current is not None and current.score(expo) > 0:
        return current
    best: ServerTable | None = None
    best_score = 0
    for t in tables:
        s = t.score(expo)
        if s > best_score:
            best, best_score = t, s
    return best


# ---------------------------------------------------------------------------------------------
# Normalisation (pure)


def _gauge(expo: Exposition, refs: Sequence[Ref], replicas: Sequence[str]) -> list[Child] | None:
    found = expo.first(refs)
    if found is None:
        return None
    r, children = found
    return collapse(children, replicas, drop=[k for k, _ in r.match])


def _counter(expo: Exposition, r: Ref | None, replicas: Sequence[str]) -> float | None:
    if r is None:
        return None
    children = expo.children(r, counter=True)
    if children is None:
        return None
    return total(collapse(children, replicas, drop=[k for k, _ in r.match]))


def kv_usage(table: ServerTable, expo: Exposition) -> float | None:
    rep = table.replica_labels
    children = _gauge(expo, table.kv, rep)
    if children:
        return mean(children)
    for used_ref, cap_ref in table.kv_ratio:
        used = _gauge(expo, (used_ref,), rep)
        cap = _gauge(expo, (cap_ref,), rep)
        if used and cap:
            capacity = total(cap)
            if capacity > 0:
                return total(used) / capacity
    return None


def prefix_counters(table: ServerTable, expo: Exposition) -> tuple[float, float] | None:
    """The server's cumulative prefix-cache (hits, queries), summed over engines, in its unit (tokens; blocks for
    TensorRT-LLM), or None where it exports no such counters."""
    rep = table.replica_labels
    for src in table.prefix:
        hits = _counter(expo, src.hits, rep)
        if hits is None:
            continue
        queries = _counter(expo, src.queries, rep)
        if queries is None:
            misses = _counter(expo, src.misses, rep)
            if misses is None:
                continue
            queries = hits + misses
        return hits, queries
    return None


def prefix_hit_ratio(table: ServerTable, expo: Exposition) -> float | None:
    counters = prefix_counters(table, expo)
    if counters is not None:
        hits, queries = counters
        return hits / queries if queries > 0 else None
    children = _gauge(expo, table.prefix_ratio, table.replica_labels)
    if children:
        valid = [c for c in children if c.value >= 0]  # vLLM V0 reports -1 when prefix caching is off
        if valid:
            return mean(valid)
    return None


def normalise(table: ServerTable, expo: Exposition, version: str = "") -> tuple[list[Series], bool]:
    """The soakd_server_* series of one scrape, and whether a KV gauge was found."""
    rep = table.replica_labels
    out = [series("soakd_server_info", 1, kind=table.kind, version=version)]
    kv = kv_usage(table, expo)
    if kv is not None and not math.isnan(kv):
        out.append(series("soakd_server_kv_cache_usage_ratio", kv))
    for name, refs in (("soakd_server_requests_running", table.running),
                       ("soakd_server_requests_waiting", table.waiting)):  # fmt: skip
        children = _gauge(expo, refs, rep)
        if children:
            out.append(series(name, total(children)))
    for r in table.preemptions:
        value = _counter(expo, r, rep)
        if value is not None:
            out.append(series("soakd_server_preemptions_total", value))
            break
    for r in table.generation:
        value = _counter(expo, r, rep)
        if value is not None:
            out.append(series("soakd_server_generation_tokens_total", value))
            break
    ratio = prefix_hit_ratio(table, expo)
    if ratio is not None:
        out.append(series("soakd_server_prefix_cache_hit_ratio", ratio))
    counters = prefix_counters(table, expo)
    if counters is not None:
        out.append(series("soakd_server_prefix_cache_hits_total", counters[0]))
        out.append(series("soakd_server_prefix_cache_queries_total", counters[1]))
    for what, refs, pairs, unit in (("ttft", table.ttft, (), "requests"),
                                    ("itl", table.itl, table.itl_counters, "tokens")):
        for sec_ref, count_ref in (*((Ref(r.name + "_sum"), Ref(r.name + "_count")) for r in refs), *pairs):
            seconds, count = _counter(expo, sec_ref, rep), _counter(expo, count_ref, rep)
            if seconds is not None and count is not None:
                out.append(series(f"soakd_server_{what}_seconds_total", seconds))
                out.append(series(f"soakd_server_{what}_{unit}_total", count))
                break
    # prometheus_client's process collector (Python servers: vLLM, SGLang): the serving process's host
    # memory, and its start time (a new one: the server restarted)
    for source, name, how in (("process_resident_memory_bytes", "soakd_server_process_resident_memory_bytes", total),
                              ("process_start_time_seconds", "soakd_server_process_start_time_seconds",
                               lambda cs: max(c.value for c in cs))):  # fmt: skip
        children = _gauge(expo, (Ref(source),), ())
        if children:
            out.append(series(name, how(children)))
    return out, kv is not None


# cumulative series of one server process: lower than at the previous scrape, the server restarted
_CUMULATIVE = ("soakd_server_preemptions_total", "soakd_server_generation_tokens_total",
               "soakd_server_prefix_cache_queries_total",
               "soakd_server_ttft_seconds_total", "soakd_server_ttft_requests_total",
               "soakd_server_itl_seconds_total", "soakd_server_itl_tokens_total")


class RestartDetector:
    """Server restarts in successive scrapes: a new ``process_start_time_seconds``, or a cumulative
    counter below its previous value (servers without the process collector: TGI, llama.cpp,
    TensorRT-LLM). A scrape that fails in between (the server down) changes nothing: the next one
    that answers is compared with the last one that did."""

    def __init__(self) -> None:
        self.restarts = 0
        self._start: float | None = None
        self._prev: dict[str, float] = {}

    def update(self, out: list[Series]) -> str | None:
        """Why the server restarted since the previous scrape, or None."""
        values = {s.name: s.value for s in out}
        why = None
        start = values.get("soakd_server_process_start_time_seconds")
        if start is not None and self._start is not None and start > self._start + 0.5:
            why = f"process start time moved {start - self._start:.0f} s later"
        for name in _CUMULATIVE:
            v, before = values.get(name), self._prev.get(name)
            if why is None and v is not None and before is not None and v < before:
                why = f"{name.removeprefix('soakd_server_')} fell from {before:g} to {v:g}"
        if start is not None:
            self._start = start
        self._prev.update({k: values[k] for k in _CUMULATIVE if k in values})
        if why is not None:
            self.restarts += 1
        return why


# ---------------------------------------------------------------------------------------------


class ServerSampler:
    """Scrapes the inference server's /metrics into the soakd_server_* series."""

    name = "server"

    def __init__(
        self,
        config: ServerSamplerConfig,
        target_url: str,
        session_factory: SessionFactory | None = None,
    ) -> None:
        self.config = config
        self.urls = metrics_urls(config.url, target_url)
        self.tables = tables_for(config.kind)
        self.table: ServerTable | None = None
        self.url: str | None = None  # the URL that answered with known metrics (tried first)
        self._scraper = Scraper(session_factory)
        self._no_kv_logged: set[str] = set()
        self.restarts = RestartDetector()
        target = URL(target_url)
        origin = str(target.origin()) if target.is_absolute() and target.scheme in ("http", "https") else None
        self.versions = VersionAsker(origin)  # the server's own version, asked in the background

    @property
    def version(self) -> str | None:
        return self.versions.version

    async def sample(self) -> list[Series]:
        expo, url = await self._scrape()
        table = detect(expo, self.tables, self.table)
        assert table is not None  # _scrape only returns expositions a table matches
        if table is not self.table:
            log.info("server_kind_detected", kind=table.kind, table=table.name, url=redact_url(url),
                     previous=self.table.name if self.table else None)  # fmt: skip
            self.table = table
        self.url = url
        out, has_kv = normalise(table, expo, self.version or "")
        why = self.restarts.update(out)
        if why is not None:
            self.versions.restarted()
            log.warning("server_restart_detected", url=redact_url(url), restarts=self.restarts.restarts, why=why)
        out.append(series("soakd_server_restarts_total", self.restarts.restarts))
        if not has_kv and table.name not in self._no_kv_logged:
            self._no_kv_logged.add(table.name)
            log.info("server_no_kv_gauge", kind=table.kind, url=redact_url(url),
                     detail="no KV-cache gauge in this server's metrics; soakd_server_kv_cache_usage_ratio "
                            "is not exported")  # fmt: skip
        self.versions.poll(self._scraper.session)
        return out

    def sticky(self) -> list[Series]:
        """What stays exported while scrapes fail (``soakd.samplers.base``): soakd's own restart count."""
        return [series("soakd_server_restarts_total", self.restarts.restarts)]

    async def _scrape(self) -> tuple[Exposition, str]:
        order = list(self.urls)
        if self.url in order:
            order.remove(self.url)
            order.insert(0, self.url)
        errors: list[ScrapeError] = []
        unknown: list[str] = []
        for url in order:
            try:
                expo = await self._scraper.scrape(url)
            except ScrapeError as exc:
                errors.append(exc)
                continue
            if detect(expo, self.tables, self.table) is not None:
                return expo, url
            unknown.append(redact_url(url))
        if unknown:
            what = "inference-server" if self.config.kind == "auto" else f"{self.config.kind}"
            raise SamplerUnavailable(f"no known {what} metrics at {' or '.join(unknown)}; "
                                     "set samplers.server.kind or url")  # fmt: skip
        raise errors[0]

    async def aclose(self) -> None:
        await self.versions.aclose()
        await self._scraper.aclose()

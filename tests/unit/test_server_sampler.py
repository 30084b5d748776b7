"""Inference-server sampler: golden scrapes of every server table, fallbacks, aggregation, errors.

Real aiohttp servers on 127.0.0.1 port 0 serve the golden expositions in fixtures/metrics/; the
sampler scrapes them like a real target's /metrics.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from structlog.testing import capture_logs

from helpers import serving as app_serving
from soakd.config import ServerSamplerConfig
from soakd.metrics import BY_NAME
from soakd.core.series import Series
from soakd.samplers.base import SamplerRunner, SamplerUnavailable, SnapshotCollector
from soakd.samplers.promtext import Exposition, ScrapeError, counter_names, parse_exposition, redact_url, ref
from soakd.core.series import series
from soakd.samplers.server import TABLES, RestartDetector, ServerSampler, detect, metrics_urls, normalise
from soakd.samplers.version import VERSION_PATHS

pytestmark = pytest.mark.timeout(20)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"
PLAIN = "text/plain; version=0.0.4; charset=utf-8"


def fixture(name: str) -> str:
    return (FIXTURES / f"{name}.prom").read_text()


class MetricsServer:
    """A tiny server on 127.0.0.1 whose routes answer with a mutable body and status."""

    def __init__(self, routes: dict[str, tuple[int, str | bytes, str]], port: int = 0) -> None:
        self.routes = dict(routes)  # path -> (status, body (str or bytes), content type)
        self.port = port
        self.hits = 0
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        self.hits += 1
        found = self.routes.get(request.path)
        if found is None:
            return web.Response(status=404, text="404: Not Found")
        status, body, ctype = found
        raw = body if isinstance(body, bytes) else body.encode()
        return web.Response(status=status, body=raw, headers={"Content-Type": ctype})

    def serve(self, path: str, body: str | bytes, status: int = 200, ctype: str = PLAIN) -> None:
        self.routes[path] = (status, body, ctype)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def target_url(self) -> str:
        """What a user configures as target.url: the OpenAI base URL."""
        return self.origin + "/v1"


@asynccontextmanager
async def serving(body: str | bytes | None = None, path: str = "/metrics", status: int = 200,
                  ctype: str = PLAIN) -> AsyncIterator[MetricsServer]:  # fmt: skip
    server = MetricsServer({} if body is None else {path: (status, body, ctype)})
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def as_dict(items: list[Series]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for s in items:
        key = (s.name, s.labels)
        assert key not in out, f"duplicate series {key}"
        out[key] = s.value
    return out


def expected(kind: str, **values: float) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """What the sampler gives for one scrape (``soakd_server_restarts_total`` 0 unless ``restarts``)."""
    names = {"kv": "soakd_server_kv_cache_usage_ratio", "running": "soakd_server_requests_running",
             "waiting": "soakd_server_requests_waiting", "preemptions": "soakd_server_preemptions_total",
             "prefix": "soakd_server_prefix_cache_hit_ratio", "ttft_s": "soakd_server_ttft_seconds_total",
             "ttft_n": "soakd_server_ttft_requests_total", "itl_s": "soakd_server_itl_seconds_total",
             "itl_n": "soakd_server_itl_tokens_total", "rss": "soakd_server_process_resident_memory_bytes",
             "start": "soakd_server_process_start_time_seconds", "restarts": "soakd_server_restarts_total",
             "gen": "soakd_server_generation_tokens_total", "hits": "soakd_server_prefix_cache_hits_total",
             "queries": "soakd_server_prefix_cache_queries_total"}  # fmt: skip
    values.setdefault("restarts", 0)
    out = {("soakd_server_info", (("kind", kind), ("version", ""))): 1.0}  # no version path answers here
    for key, value in values.items():
        out[(names[key], ())] = value
    return out


def assert_series(got: list[Series], want: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> None:
    have = as_dict(got)
    assert set(have) == set(want), f"series differ:\n got  {sorted(have)}\n want {sorted(want)}"
    for key, value in want.items():
        assert have[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


def sampler_for(server: MetricsServer, **config: str) -> ServerSampler:
    return ServerSampler(ServerSamplerConfig(**config), server.target_url)


# ---------------------------------------------------------------------------------------------
# Golden scrapes: one per server table


GOLDEN = [
    # the server's own TTFT histogram: its sum and count, over both engines
    ("vllm_v1", "vllm", expected("vllm", kv=0.375, running=8, waiting=1, preemptions=3, prefix=0.4,
                                 hits=1600, queries=4000, ttft_s=6.917 + 7.204, ttft_n=199, rss=2.146762752e9, start=1.75923345618e9,
                                 gen=20480 + 19968)),
    ("vllm_v0", "vllm", expected("vllm", kv=0.6, running=4, waiting=2, preemptions=7, prefix=0.35,
                                 ttft_s=1.34, ttft_n=7, gen=40410)),
    ("sglang", "sglang", expected("sglang", kv=0.4, running=10, waiting=3, preemptions=5, prefix=0.3,
                                  hits=15000, queries=50000, ttft_s=1.71, ttft_n=5, gen=21873)),
    ("tgi", "tgi", expected("tgi", kv=30000 / 120000, running=12, waiting=4)),
    ("llamacpp", "llamacpp", expected("llamacpp", running=2, waiting=1, prefix=766 / 2000, hits=766, queries=2000, gen=8801,
                                          itl_s=97.4121, itl_n=8801)),  # its generation time and tokens
]


@pytest.mark.parametrize(("name", "table", "want"), GOLDEN, ids=[g[0] for g in GOLDEN])
async def test_golden_scrape_at_target_origin(name: str, table: str, want: dict) -> None:
    async with serving(fixture(name)) as server:
        sampler = sampler_for(server)
        try:
            got = await sampler.sample()
        finally:
            await sampler.aclose()
    assert sampler.table is not None and sampler.table.name == table
    assert sampler.url == server.origin + "/metrics"
    assert_series(got, want)


async def test_golden_trtllm_serve_found_at_prometheus_metrics() -> None:
    """trtllm-serve answers /metrics with JSON iteration stats; auto falls back to /prometheus/metrics."""
    async with serving('[{"gpuMemUsage": 1, "iter": 3}]', ctype="application/json") as server:
        server.serve("/prometheus/metrics", fixture("trtllm"))
        sampler = sampler_for(server)
        try:
            got = await sampler.sample()
            for _ in range(3):  # the version paths asked after the first three scrapes (none answers here)
                await sampler.versions.settled()
                await sampler.sample()
            await sampler.versions.settled()
            hits = server.hits
            await sampler.sample()  # sticky: the working URL is tried first
            assert server.hits == hits + 1
        finally:
            await sampler.aclose()
    assert sampler.table is not None and sampler.table.name == "trtllm"
    assert sampler.url == server.origin + "/prometheus/metrics"
    assert_series(got, expected("trtllm", kv=0.3125, running=7, waiting=2, prefix=0.3, hits=300, queries=1000,
                                  gen=41000, ttft_s=0.4, ttft_n=5))  # its TTFT histogram; per-request TPOT not read


async def test_golden_triton_trtllm_with_explicit_url() -> None:
    async with serving(fixture("triton_trtllm")) as server:
        sampler = ServerSampler(ServerSamplerConfig(url=server.origin + "/metrics"), "http://127.0.0.1:1/v1")
        try:
            got = await sampler.sample()
        finally:
            await sampler.aclose()
    assert sampler.table is not None and sampler.table.name == "triton_trtllm"
    assert_series(got, expected("trtllm", kv=0.25, running=7, waiting=3))


def test_every_series_is_in_the_catalogue_with_its_labels() -> None:
    for name, _, _ in GOLDEN + [("trtllm", "", {}), ("triton_trtllm", "", {})]:
        expo = parse_exposition(fixture(name))
        table = detect(expo, TABLES)
        assert table is not None, name
        for s in normalise(table, expo)[0]:
            spec = BY_NAME[s.name]
            assert spec.group == "server"
            assert tuple(k for k, _ in s.labels) == spec.labels


# ---------------------------------------------------------------------------------------------
# Fallbacks, counter naming, aggregation (pure: parse + normalise)


def _drop(text: str, *prefixes: str) -> str:
    return "\n".join(line for line in text.splitlines() if not any(p in line for p in prefixes)) + "\n"


def _norm(text: str, content_type: str = "") -> dict:
    expo = parse_exposition(text, content_type)
    table = detect(expo, TABLES)
    assert table is not None
    return as_dict(normalise(table, expo)[0])


def test_vllm_falls_back_to_the_pre_0_9_names() -> None:
    """Without kv_cache_usage_perc and prefix_cache_* (vLLM before 0.9), the gpu_* names are used."""
    text = _drop(fixture("vllm_v1"), "vllm:kv_cache_usage_perc", "vllm:prefix_cache_")
    assert "vllm:gpu_cache_usage_perc" in text and "vllm:prefix_cache_hits" not in text
    got = _norm(text)
    assert got[("soakd_server_kv_cache_usage_ratio", ())] == pytest.approx(0.375)
    assert got[("soakd_server_prefix_cache_hit_ratio", ())] == pytest.approx(0.4)


def test_vllm_without_prefix_caching_exports_no_ratio() -> None:
    text = _drop(fixture("vllm_v1"), "prefix_cache_")
    assert ("soakd_server_prefix_cache_hit_ratio", ()) not in _norm(text)
    # V0 reports -1 when prefix caching is off: not a ratio
    v0 = fixture("vllm_v0").replace('gpu_prefix_cache_hit_rate{model_name="mistralai/Mistral-7B-Instruct-v0.3"} 0.35',
                                    'gpu_prefix_cache_hit_rate{model_name="mistralai/Mistral-7B-Instruct-v0.3"} -1.0')
    assert ("soakd_server_prefix_cache_hit_ratio", ()) not in _norm(v0)


def test_prefix_ratio_guards_zero_queries() -> None:
    text = (
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
        "# TYPE vllm:prefix_cache_queries_total counter\nvllm:prefix_cache_queries_total 0\n"
        "# TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total 0\n"
    )
    got = _norm(text)
    assert ("soakd_server_prefix_cache_hit_ratio", ()) not in got
    assert got[("soakd_server_requests_running", ())] == 0


@pytest.mark.parametrize(
    "counter",
    [
        "# TYPE vllm:num_preemptions_total counter\nvllm:num_preemptions_total 5\n",  # the convention
        "# TYPE vllm:num_preemptions counter\nvllm:num_preemptions 5\n",  # typed, bare sample name
        "vllm:num_preemptions_total 5\n",  # untyped, with _total
        "vllm:num_preemptions 5\n",  # untyped, bare
    ],
    ids=["typed_total", "typed_bare", "untyped_total", "untyped_bare"],
)
def test_counters_match_with_or_without_total(counter: str) -> None:
    text = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n" + counter
    assert _norm(text)[("soakd_server_preemptions_total", ())] == 5


def test_counter_names_helper() -> None:
    assert counter_names("vllm:num_preemptions") == ("vllm:num_preemptions_total", "vllm:num_preemptions")
    assert counter_names("vllm:num_preemptions_total") == ("vllm:num_preemptions_total", "vllm:num_preemptions")
    assert str(ref("nv_trt_llm_request_metrics", request_type="active")) == (
        'nv_trt_llm_request_metrics{request_type="active"}')


def test_openmetrics_exposition_is_parsed() -> None:
    """A server that answers in OpenMetrics (counters as _total + _created, # EOF) reads the same."""
    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    running = Gauge("vllm:num_requests_running", "Running.", labels, registry=reg)
    kv = Gauge("vllm:kv_cache_usage_perc", "KV.", labels, registry=reg)
    pre = Counter("vllm:num_preemptions", "Preemptions.", labels, registry=reg)
    for engine, (r, k, p) in {"0": (2, 0.2, 1), "1": (4, 0.6, 2)}.items():
        running.labels("m", engine).set(r)
        kv.labels("m", engine).set(k)
        pre.labels("m", engine).inc(p)
    try:  # prometheus_client >= 0.25 escapes colons unless told otherwise
        text = generate_openmetrics(reg, escaping="allow-utf-8").decode()
    except TypeError:
        text = generate_openmetrics(reg).decode()
    assert text.rstrip().endswith("# EOF")
    got = _norm(text, "application/openmetrics-text; version=1.0.0; charset=utf-8")
    assert got[("soakd_server_requests_running", ())] == 6
    assert got[("soakd_server_kv_cache_usage_ratio", ())] == pytest.approx(0.4)
    assert got[("soakd_server_preemptions_total", ())] == 3


def test_engines_and_models_are_aggregated() -> None:
    """Two models x two engines: requests and preemptions add up; KV is the mean over the four pools."""
    lines = ["# TYPE vllm:num_requests_running gauge", "# TYPE vllm:num_requests_waiting gauge",
             "# TYPE vllm:kv_cache_usage_perc gauge", "# TYPE vllm:num_preemptions_total counter"]  # fmt: skip
    values = {("a", "0"): (1, 0, 0.1, 1), ("a", "1"): (2, 1, 0.2, 0), ("b", "0"): (3, 2, 0.3, 4), ("b", "1"): (4, 3, 0.8, 5)}
    for (model, engine), (r, w, k, p) in values.items():
        lab = f'{{engine="{engine}",model_name="{model}"}}'
        lines += [f"vllm:num_requests_running{lab} {r}", f"vllm:num_requests_waiting{lab} {w}",
                  f"vllm:kv_cache_usage_perc{lab} {k}", f"vllm:num_preemptions_total{lab} {p}"]  # fmt: skip
    got = _norm("\n".join(lines) + "\n")
    assert got[("soakd_server_requests_running", ())] == 10
    assert got[("soakd_server_requests_waiting", ())] == 6
    assert got[("soakd_server_kv_cache_usage_ratio", ())] == pytest.approx(0.35)
    assert got[("soakd_server_preemptions_total", ())] == 10


def test_sglang_rank_copies_are_not_double_counted() -> None:
    """With --enable-metrics-for-all-schedulers every TP rank reports its scheduler's numbers: one
    value per data-parallel rank, whatever the tensor-parallel size."""
    lines = ["# TYPE sglang:num_running_reqs gauge", "# TYPE sglang:token_usage gauge"]
    for dp, (running, usage) in {"0": (5, 0.5), "1": (3, 0.3)}.items():
        for tp in ("0", "1"):
            lab = f'{{dp_rank="{dp}",engine_type="unified",model_name="m",pp_rank="0",tp_rank="{tp}"}}'
            lines += [f"sglang:num_running_reqs{lab} {running}", f"sglang:token_usage{lab} {usage}"]
    got = _norm("\n".join(lines) + "\n")
    assert got[("soakd_server_requests_running", ())] == 8
    assert got[("soakd_server_kv_cache_usage_ratio", ())] == pytest.approx(0.4)


def test_sglang_retracted_gauge_is_not_a_preemption_count() -> None:
    text = _drop(fixture("sglang"), "num_retracted_requests_total")
    assert "sglang:num_retracted_reqs{" in text
    assert ("soakd_server_preemptions_total", ()) not in _norm(text)


def test_triton_falls_back_to_used_over_max_blocks() -> None:
    text = _drop(fixture("triton_trtllm"), 'kv_cache_block_type="fraction"')
    assert _norm(text)[("soakd_server_kv_cache_usage_ratio", ())] == pytest.approx(2000 / 8000)


def test_tgi_before_warmup_has_no_kv_proxy() -> None:
    text = _drop(fixture("tgi"), "tgi_batch_max_total_tokens")
    got = _norm(text)
    assert ("soakd_server_kv_cache_usage_ratio", ()) not in got
    assert got[("soakd_server_requests_running", ())] == 12


def test_old_llamacpp_kv_gauge_is_used() -> None:
    text = fixture("llamacpp") + (
        "# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.\n"
        "# TYPE llamacpp:kv_cache_usage_ratio gauge\nllamacpp:kv_cache_usage_ratio 0.125\n"
    )
    assert _norm(text)[("soakd_server_kv_cache_usage_ratio", ())] == pytest.approx(0.125)


# ---------------------------------------------------------------------------------------------
# Detection: kind override, stickiness, re-detection after a restart


async def test_llamacpp_says_once_that_it_has_no_kv_gauge() -> None:
    async with serving(fixture("llamacpp")) as server:
        sampler = sampler_for(server)
        try:
            with capture_logs() as logs:
                for _ in range(4):
                    got = as_dict(await sampler.sample())
                    assert ("soakd_server_kv_cache_usage_ratio", ()) not in got
        finally:
            await sampler.aclose()
    no_kv = [e for e in logs if e["event"] == "server_no_kv_gauge"]
    assert len(no_kv) == 1
    assert no_kv[0]["log_level"] == "info" and no_kv[0]["kind"] == "llamacpp"
    assert "no KV-cache gauge" in no_kv[0]["detail"]
    assert [e["kind"] for e in logs if e["event"] == "server_kind_detected"] == ["llamacpp"]


async def test_kind_override_restricts_the_tables() -> None:
    async with serving(fixture("vllm_v1")) as server:
        wrong = sampler_for(server, kind="sglang")
        right = sampler_for(server, kind="vllm")
        try:
            with pytest.raises(SamplerUnavailable, match=r"no known sglang metrics at .*/metrics"):
                await wrong.sample()
            assert_series(await right.sample(), GOLDEN[0][2])
        finally:
            await wrong.aclose()
            await right.aclose()


async def test_detection_is_sticky_and_follows_a_server_swap() -> None:
    async with serving(fixture("sglang")) as server:
        sampler = sampler_for(server)
        try:
            with capture_logs() as logs:
                await sampler.sample()
                assert sampler.table is not None and sampler.table.name == "sglang"
                # vLLM names appear as well (more signals than SGLang's): the detected table stays
                server.serve("/metrics", fixture("sglang") + fixture("vllm_v1"))
                got = as_dict(await sampler.sample())
                assert sampler.table.name == "sglang"
                assert got[("soakd_server_requests_running", ())] == 10
                # the target restarts as vLLM: re-detected
                server.serve("/metrics", fixture("vllm_v1"))
                got = as_dict(await sampler.sample())
                assert sampler.table.name == "vllm"
                assert got[("soakd_server_info", (("kind", "vllm"), ("version", "")))] == 1
        finally:
            await sampler.aclose()
    detected = [(e["kind"], e["previous"]) for e in logs if e["event"] == "server_kind_detected"]
    assert detected == [("sglang", None), ("vllm", "sglang")]


# ---------------------------------------------------------------------------------------------
# Errors: each a clear message; the runner records them and recovers


async def test_unknown_exposition_is_a_clear_error() -> None:
    node_exporter = ("# HELP node_load1 1m load average.\n# TYPE node_load1 gauge\nnode_load1 0.42\n"
                     "# TYPE go_goroutines gauge\ngo_goroutines 12\n")  # fmt: skip
    async with serving(node_exporter) as server:
        sampler = sampler_for(server)
        try:
            with pytest.raises(SamplerUnavailable) as err:
                await sampler.sample()
        finally:
            await sampler.aclose()
    msg = str(err.value)
    assert "no known inference-server metrics at" in msg
    assert server.origin + "/metrics" in msg
    assert "set samplers.server.kind or url" in msg


async def test_empty_exposition_is_unknown() -> None:
    async with serving("") as server:
        sampler = sampler_for(server, url=server.origin + "/metrics")
        try:
            with pytest.raises(SamplerUnavailable, match="no known inference-server metrics"):
                await sampler.sample()
        finally:
            await sampler.aclose()


@pytest.mark.parametrize(
    ("body", "ctype", "what"),
    [
        ("<!DOCTYPE html><html><body><h1>Welcome to nginx!</h1></body></html>", "text/html", "an HTML page"),
        ("<html><body>login</body></html>", PLAIN, "an HTML page"),
        ('{"detail": "Not Found"}', "application/json", "JSON"),
        ("\x00\x01\x02\x03binary", "application/octet-stream", "binary data"),
        ("this is not { prometheus\n", PLAIN, "not a Prometheus exposition"),
    ],
    ids=["html", "html_as_text", "json", "binary", "garbage"],
)
async def test_garbage_is_a_clear_error(body: str, ctype: str, what: str) -> None:
    async with serving(body, ctype=ctype) as server:
        sampler = sampler_for(server, url=server.origin + "/metrics")
        try:
            with pytest.raises(ScrapeError) as err:
                await sampler.sample()
        finally:
            await sampler.aclose()
    assert what in str(err.value)
    assert server.origin + "/metrics" in str(err.value)


async def test_invalid_utf8_is_binary() -> None:
    async with serving(b"\xff\xfe\xfa garbage\n") as server:
        sampler = sampler_for(server, url=server.origin + "/metrics")
        try:
            with pytest.raises(ScrapeError, match="binary data"):
                await sampler.sample()
        finally:
            await sampler.aclose()


async def test_http_500_is_a_clear_error() -> None:
    async with serving("Internal Server Error", status=500) as server:
        sampler = sampler_for(server)
        try:
            with pytest.raises(ScrapeError, match=r"GET http://127\.0\.0\.1:\d+/metrics returned HTTP 500"):
                await sampler.sample()
        finally:
            await sampler.aclose()


async def test_connection_refused_is_a_clear_error() -> None:
    port = free_port()
    sampler = ServerSampler(ServerSamplerConfig(), f"http://127.0.0.1:{port}/v1")
    try:
        with pytest.raises(ScrapeError, match=rf"cannot connect to http://127\.0\.0\.1:{port}/metrics"):
            await sampler.sample()
    finally:
        await sampler.aclose()


async def test_runner_marks_the_sampler_down_then_up_when_the_server_comes_back() -> None:
    port = free_port()
    sampler = ServerSampler(ServerSamplerConfig(), f"http://127.0.0.1:{port}/v1")
    runner = SamplerRunner(sampler, interval=2.0)
    server = MetricsServer({"/metrics": (200, fixture("vllm_v1"), PLAIN)}, port=port)
    try:
        with capture_logs() as logs:
            assert await runner.run_once() is False
            assert runner.up is False and runner.errors == 1
            assert "cannot connect" in runner.last_error
            assert await runner.run_once() is False  # still down: logged once
            await server.start()
            assert await runner.run_once() is True
            assert runner.up is True
            assert runner.snapshot is not None
            assert as_dict(list(runner.snapshot.series))[("soakd_server_requests_running", ())] == 8
            server.serve("/metrics", "oops", status=503)
            assert await runner.run_once() is False
            assert "HTTP 503" in runner.last_error
    finally:
        await server.stop()
        await sampler.aclose()
    events = [e["event"] for e in logs if e["event"].startswith("sampler_")]
    assert events == ["sampler_down", "sampler_up", "sampler_down"]


async def test_snapshot_collector_exports_the_catalogue_names() -> None:
    async with serving(fixture("sglang")) as server:
        sampler = sampler_for(server)
        runner = SamplerRunner(sampler, interval=5.0)
        try:
            assert await runner.run_once()
        finally:
            await sampler.aclose()
    collector = SnapshotCollector([runner])

    class _C:
        def collect(self):  # noqa: ANN202
            return collector()

    reg = CollectorRegistry()
    reg.register(_C())  # type: ignore[arg-type]
    assert reg.get_sample_value("soakd_server_info", {"kind": "sglang", "version": ""}) == 1.0
    assert reg.get_sample_value("soakd_server_kv_cache_usage_ratio") == pytest.approx(0.4)
    assert reg.get_sample_value("soakd_server_requests_waiting") == 3
    assert reg.get_sample_value("soakd_server_preemptions_total") == 5
    assert reg.get_sample_value("soakd_server_prefix_cache_hit_ratio") == pytest.approx(0.3)
    assert reg.get_sample_value("soakd_sampler_up", {"sampler": "server"}) == 1.0


# ---------------------------------------------------------------------------------------------
# URLs and sessions


def test_metrics_url_auto_is_the_target_origin() -> None:
    assert metrics_urls("auto", "http://vllm:8000/v1") == ["http://vllm:8000/metrics", "http://vllm:8000/prometheus/metrics"]
    assert metrics_urls("auto", "https://user:secret@gw.example:8443/openai/v1")[0] == "https://gw.example:8443/metrics"
    assert metrics_urls("http://triton:8002/metrics", "http://triton:9000/v1") == ["http://triton:8002/metrics"]
    with pytest.raises(ValueError, match="none"):
        metrics_urls("none", "http://vllm:8000/v1")
    with pytest.raises(ValueError, match="samplers.server.url"):
        metrics_urls("auto", "/v1")
    assert redact_url("http://user:secret@host:1/metrics") == "http://host:1/metrics"


async def test_credentials_never_appear_in_errors() -> None:
    port = free_port()
    sampler = ServerSampler(ServerSamplerConfig(url=f"http://admin:hunter2@127.0.0.1:{port}/metrics"), "http://x/v1")
    try:
        with pytest.raises(ScrapeError) as err:
            await sampler.sample()
    finally:
        await sampler.aclose()
    assert "hunter2" not in str(err.value) and "admin" not in str(err.value)


async def test_a_shared_session_is_used_and_not_closed() -> None:
    async with serving(fixture("tgi")) as server:
        async with aiohttp.ClientSession() as shared:
            calls = 0

            def factory() -> aiohttp.ClientSession:
                nonlocal calls
                calls += 1
                return shared

            sampler = ServerSampler(ServerSamplerConfig(), server.target_url, session_factory=factory)
            await sampler.sample()
            await sampler.versions.settled()
            await sampler.sample()
            await sampler.versions.settled()
            await sampler.aclose()
            # each scrape, and the version asked with each (its paths over one session): all on the shared one
            assert calls == 2 * 2
            assert not shared.closed


def test_exposition_selectors() -> None:
    expo = Exposition([])
    assert expo.first(["x"]) is None
    expo = parse_exposition(fixture("triton_trtllm"))
    found = expo.first([ref("nv_trt_llm_request_metrics", request_type="nope"),
                        ref("nv_trt_llm_request_metrics", request_type="active")])  # fmt: skip
    assert found is not None and [c.value for c in found[1]] == [7]


async def test_the_embedded_simulator_reads_as_vllm() -> None:
    from soakd import __version__
    from soakd.sim import SimConfig, SimServer

    async with SimServer(SimConfig(port=0, host="127.0.0.1")) as sim:
        sampler = ServerSampler(ServerSamplerConfig(), sim.base_url)
        try:
            await sampler.sample()
            await sampler.versions.settled()
            got = as_dict(await sampler.sample())
        finally:
            await sampler.aclose()
    assert got[("soakd_server_info", (("kind", "vllm"), ("version", f"soakd-sim {__version__}")))] == 1
    assert got[("soakd_server_requests_running", ())] == 0
    assert got[("soakd_server_requests_waiting", ())] == 0
    assert 0 <= got[("soakd_server_kv_cache_usage_ratio", ())] <= 1
    assert got[("soakd_server_preemptions_total", ())] == 0
    assert got[("soakd_server_generation_tokens_total", ())] == 0


def test_the_generation_counter_says_how_it_moves_and_a_lower_one_is_a_restart() -> None:
    """vLLM counts tokens every engine step; SGLang, TensorRT-LLM and llama.cpp when a request ends (the
    wedge watch needs to know); TGI has no counter. A generation counter that went down is a restart."""
    tables = {t.name: t for t in TABLES}
    assert tables["vllm"].tokens_per_step
    assert not any(tables[n].tokens_per_step for n in ("sglang", "trtllm", "llamacpp"))
    assert ("soakd_server_generation_tokens_total", ()) not in _norm(fixture("tgi"))
    det = RestartDetector()
    assert det.update([series("soakd_server_generation_tokens_total", 500.0)]) is None
    assert det.update([series("soakd_server_generation_tokens_total", 500.0)]) is None  # flat: no restart
    why = det.update([series("soakd_server_generation_tokens_total", 20.0)])
    assert why is not None and "generation_tokens_total fell from 500 to 20" in why and det.restarts == 1


async def test_overlapping_samples_are_applied_in_the_order_the_server_answered() -> None:
    """A quiesce probe samples the server while the scheduled sample may be in flight. The first scrape
    is read by the server (its counter at 100) and answered late; the second is read at 101 and answered
    at once. Applied in that order (the second first), the counter would fall from 101 to 100: a restart
    that never happened (seen: a stationary simulator paged SoakdServerRestarted on a busy machine). The
    runner takes one sample at a time."""
    import asyncio
    import re

    body = fixture("vllm_v1")
    reads = 0
    inside = asyncio.Event()

    async def metrics(_: web.Request) -> web.Response:
        nonlocal reads
        reads += 1
        n = reads
        text = re.sub(r"^(vllm:generation_tokens_total\{engine=\"0\".*\}) \S+$", rf"\g<1> {99 + n}", body,
                      flags=re.M)
        if n == 1:
            inside.set()
            await asyncio.sleep(0.5)  # the first answer comes late
        return web.Response(text=text, headers={"Content-Type": PLAIN})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    async with app_serving(app) as port:
        sampler = ServerSampler(ServerSamplerConfig(), f"http://127.0.0.1:{port}/v1")
        sampled = SamplerRunner(sampler, interval=2.0, timeout=10.0)
        try:
            first = asyncio.create_task(sampled.run_once())  # the scheduled sample
            await asyncio.wait_for(inside.wait(), 10)
            assert await sampled.run_once()  # the probe's, while the first is in flight
            assert await first
            assert reads == 2 and sampler.restarts.restarts == 0
            got = as_dict(list(sampled.snapshot.series))  # type: ignore[union-attr]
            assert got[("soakd_server_generation_tokens_total", ())] == 101 + 19968  # the later reading is kept
        finally:
            await sampler.aclose()


async def test_a_slow_server_times_out_with_a_clear_error() -> None:
    import asyncio

    from soakd.samplers.promtext import Scraper

    release = asyncio.Event()

    async def slow(_: web.Request) -> web.Response:
        await asyncio.wait_for(release.wait(), 5)
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/metrics", slow)
    async with app_serving(app) as port:
        scraper = Scraper(timeout=aiohttp.ClientTimeout(total=0.2))
        try:
            with pytest.raises(ScrapeError, match=r"GET http://127\.0\.0\.1:\d+/metrics timed out \(limit 0\.2s\)"):
                await scraper.scrape(f"http://127.0.0.1:{port}/metrics")
        finally:
            release.set()
            await scraper.aclose()


@pytest.mark.parametrize(("path", "body", "want"), [
    ("/version", '{"version": "0.11.0"}', "0.11.0"),  # vLLM
    ("/get_server_info", '{"version": "0.5.4", "tp_size": 1}', "0.5.4"),  # SGLang
    ("/info", '{"model_id": "m", "version": "3.3.6"}', "3.3.6"),  # TGI
    ("/props", '{"build_info": "b6450-1ee9d0b5", "total_slots": 4}', "b6450-1ee9d0b5"),  # llama.cpp
    ("/version", "<html>not json</html>", ""),
    ("/version", '{"version": ""}', ""),
    ("/elsewhere", '{"version": "9"}', ""),
])
async def test_the_servers_version_is_asked_once_it_answers(path: str, body: str, want: str) -> None:
    """soakd_server_info{version}: the first of /version, /get_server_info, /info, /props whose JSON says one;
    empty until it answered and where none does. Asked in the background after a scrape, three attempts at
    most where none answers (then never again), none after one did."""
    async with serving(fixture("vllm_v1")) as server:
        server.serve(path, body, ctype="application/json")
        sampler = sampler_for(server)
        try:
            got = []
            for _ in range(5):
                got.append(as_dict(await sampler.sample()))
                await sampler.versions.settled()
            hits = server.hits
            await sampler.sample()
            await sampler.versions.settled()
            after = server.hits
        finally:
            await sampler.aclose()
    assert got[0][("soakd_server_info", (("kind", "vllm"), ("version", "")))] == 1  # not asked yet
    for g in got[1:]:
        assert g[("soakd_server_info", (("kind", "vllm"), ("version", want)))] == 1
    # one scrape each; the version paths asked 3 times at most (4 each) where none answered, once where one did
    assert after - hits == 1
    assert hits == 5 + (1 + [p for p, _ in VERSION_PATHS].index(path) if want else 3 * len(VERSION_PATHS))


async def test_a_server_that_hangs_on_its_version_path_is_still_scraped_on_time(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The version is asked beside the scrapes, not inside them: a server whose /version does not answer (seen:
    a proxy that holds unknown paths open) is scraped as usual, one attempt in flight at a time. An attempt
    that answered nothing, failed, or ran out of time has finished; after three soakd stops asking."""
    import asyncio

    from soakd.samplers import version as version_mod

    answer: list[asyncio.Event] = []

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=fixture("vllm_v1"), headers={"Content-Type": PLAIN})

    async def hang(_: web.Request) -> web.Response:
        answer.append(asyncio.Event())
        await asyncio.wait_for(answer[-1].wait(), 30)
        return web.Response(text="[" * 100_000, content_type="application/json")  # deeper than json can parse

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", hang)
    async with app_serving(app) as port:
        sampler = ServerSampler(ServerSamplerConfig(), f"http://127.0.0.1:{port}/v1")
        runner = SamplerRunner(sampler, interval=1.0, timeout=10.0)
        try:
            for k in (1, 2):
                assert await runner.run_once()
                for _ in range(50):  # the attempt reaches /version
                    if len(answer) == k:
                        break
                    await asyncio.sleep(0.02)
                assert await runner.run_once()  # the scrape answers while the attempt hangs ...
                assert len(answer) == k and sampler.versions.attempts == k - 1  # ... and no second attempt
                answer[-1].set()
                await sampler.versions.settled()
                assert sampler.versions.attempts == k and sampler.version is None
            monkeypatch.setattr(version_mod, "LIMIT", 0.3)  # the third runs out of time
            assert await runner.run_once()
            await sampler.versions.settled()
            assert sampler.versions.attempts == 3 and sampler.version is None
            await runner.run_once()
            await sampler.versions.settled()
            assert len(answer) == 3  # no fourth attempt
        finally:
            for ev in answer:
                ev.set()
            await sampler.aclose()
        sampler.versions.poll(lambda: pytest.fail("a closed sampler opened a session"))  # type: ignore[arg-type,return-value]


async def test_an_attempt_in_flight_across_a_restart_is_the_old_processs() -> None:
    """A server slow on /version restarts while soakd asks it: the old process's answer is dropped and the new
    process is asked afresh (its version, not the old one's, is the label)."""
    import asyncio

    release = asyncio.Event()
    seen = 0
    body = fixture("vllm_v1")

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=body, headers={"Content-Type": PLAIN})

    async def version(_: web.Request) -> web.Response:
        nonlocal seen
        seen += 1
        if seen == 1:  # the old process, slow
            await asyncio.wait_for(release.wait(), 30)
            return web.json_response({"version": "0.10.2"})
        return web.json_response({"version": "0.11.0"})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)
    async with app_serving(app) as port:
        sampler = ServerSampler(ServerSamplerConfig(), f"http://127.0.0.1:{port}/v1")
        try:
            await sampler.sample()
            for _ in range(50):
                if seen:
                    break
                await asyncio.sleep(0.02)
            body = body.replace("1.75923345618e+09", "1.75923999e+09")  # a new process
            await sampler.sample()
            assert sampler.restarts.restarts == 1
            release.set()
            await sampler.versions.settled()
            assert sampler.version is None and sampler.versions.attempts == 0  # the old answer dropped
            await sampler.sample()
            await sampler.versions.settled()
            assert sampler.version == "0.11.0"
        finally:
            release.set()
            await sampler.aclose()


async def test_the_version_is_asked_again_after_the_server_restarts() -> None:
    """An upgrade restarts the server: soakd asks again, keeping the old version until the new one answers."""
    async with serving(fixture("vllm_v1")) as server:
        server.serve("/version", '{"version": "0.10.2"}', ctype="application/json")
        sampler = sampler_for(server)
        try:
            await sampler.sample()
            await sampler.versions.settled()
            assert sampler.version == "0.10.2"
            server.serve("/version", '{"version": "0.11.0"}', ctype="application/json")
            await sampler.sample()
            await sampler.versions.settled()
            assert sampler.version == "0.10.2"  # not asked again without a restart
            server.serve("/metrics", fixture("vllm_v1").replace("1.75923345618e+09", "1.75923999e+09"))
            got = as_dict(await sampler.sample())  # the restart seen: asked again after this scrape
            assert sampler.restarts.restarts == 1
            assert got[("soakd_server_info", (("kind", "vllm"), ("version", "0.10.2")))] == 1
            await sampler.versions.settled()
            assert sampler.version == "0.11.0"
        finally:
            await sampler.aclose()


class _Runner:
    """A sampler runner's latest snapshot (what ``TargetIdentity`` reads)."""

    def __init__(self, series_: list[Series]) -> None:
        self.series = series_

    def fresh(self, now: float, staleness: float) -> list[Series]:
        return self.series


def test_target_info_carries_what_a_fleets_peers_share() -> None:
    """soakd_target_info{model, server, server_version, gpu_model}: the resolved model, the server sampler's kind
    and version, the GPU sampler's product names ('+' between several); nothing before the model is known."""
    from soakd.soak.exporter import TargetIdentity

    server = _Runner([series("soakd_server_info", 1, kind="vllm", version="0.11.0")])
    gpus = _Runner([Series("soakd_gpu_info", 1.0, (("gpu", str(i)), ("uuid", f"GPU-{i}"), ("name", name)))
                    for i, name in enumerate(("NVIDIA H200", "NVIDIA H200", "NVIDIA H100 80GB HBM3"))])
    model: list[str | None] = [None]
    ident = TargetIdentity(lambda: model[0], [server, gpus])  # type: ignore[list-item]
    assert list(ident()) == []
    model[0] = "meta-llama/Llama-3.1-8B-Instruct"
    (fam,) = list(ident())
    (sample,) = fam.samples
    assert sample.name == "soakd_target_info" and sample.value == 1.0
    assert sample.labels == {"model": "meta-llama/Llama-3.1-8B-Instruct", "server": "vllm", "server_version": "0.11.0",
                             "gpu_model": "NVIDIA H100 80GB HBM3+NVIDIA H200"}
    # no GPU sampler, no server metrics: empty labels, still one series per target
    (fam,) = list(TargetIdentity(lambda: "m")())
    assert fam.samples[0].labels == {"model": "m", "server": "", "server_version": "", "gpu_model": ""}

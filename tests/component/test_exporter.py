"""The exporter: /metrics (the metric contract, pre-initialised labels, histograms, promtool),
/healthz, /readyz, /status, and the metric table of docs/metrics.md."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from soakd.core.timeline import Timeline
from soakd.core.records import OUTCOMES, Outcome, RequestRecord
from soakd.config import load_config
from soakd.runtime import Runtime
from soakd.metrics import BY_NAME, CATALOGUE, E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, SoakMetrics, catalogue_markdown
from soakd.soak.recorder import Recorder
from soakd.soak.windows import WindowSet
from soakd.workload.scenarios import BUILTIN
from helpers import PROMETHEUS_HINT, QUICK_SIM, REPO, free_port, http_get, sim_server, tool, wait_until

pytestmark = pytest.mark.timeout(60)

SCENARIOS = tuple(BUILTIN)

# DESIGN.md's load-side contract (and the run/self names the core slice exports).
CONTRACT_LOAD = {
    "soakd_requests_total": "counter",
    "soakd_requests_in_flight": "gauge",
    "soakd_request_duration_seconds": "histogram",
    "soakd_time_to_first_token_seconds": "histogram",
    "soakd_inter_token_latency_seconds": "histogram",
    "soakd_prompt_tokens_total": "counter",
    "soakd_completion_tokens_total": "counter",
    "soakd_target_up": "gauge",
}
CONTRACT_SELF = {
    "soakd_build_info": "gauge",  # an info metric is a gauge of value 1 in the text format
    "soakd_soak_elapsed_seconds": "gauge",
    "soakd_soak_progress_ratio": "gauge",
    "soakd_window_index": "gauge",
}
HISTOGRAMS = {
    "soakd_request_duration_seconds": E2E_BUCKETS,
    "soakd_time_to_first_token_seconds": TTFT_BUCKETS,
    "soakd_inter_token_latency_seconds": ITL_BUCKETS,
}


class Exposition:
    """A parsed /metrics text: samples by full sample name."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples: dict[str, list[Any]] = {}
        for fam in self.families.values():
            for s in fam.samples:
                self.samples.setdefault(s.name, []).append(s)

    def value(self, name: str, **labels: str) -> float:
        found = [s.value for s in self.samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
        assert len(found) == 1, (name, labels, found)
        return found[0]

    def family_of(self, exposed_name: str) -> Any:
        # the parser names counters and infos without their _total / _info suffix
        for candidate in (exposed_name, exposed_name.removesuffix("_total"), exposed_name.removesuffix("_info")):
            if candidate in self.families:
                return self.families[candidate]
        raise AssertionError(f"{exposed_name} is not exported; families: {sorted(self.families)}")


def check_contract(exp: Exposition, scenarios: tuple[str, ...]) -> None:
    for name, kind in {**CONTRACT_LOAD, **CONTRACT_SELF}.items():
        assert exp.family_of(name).type == kind, name
    # every scenario x outcome exists (pre-initialised), and nothing else
    got = {(s.labels["scenario"], s.labels["outcome"]) for s in exp.samples["soakd_requests_total"]}
    assert got == {(sc, o) for sc in scenarios for o in OUTCOMES}
    for name in ("soakd_prompt_tokens_total", "soakd_completion_tokens_total"):
        assert {s.labels["scenario"] for s in exp.samples[name]} == set(scenarios), name
    assert {s.labels["outcome"] for s in exp.samples["soakd_warmup_requests_total"]} == set(OUTCOMES)
    check_histograms(exp, scenarios)


def check_histograms(exp: Exposition, scenarios: tuple[str, ...]) -> None:
    for name, bounds in HISTOGRAMS.items():
        for sc in scenarios:
            buckets = [s for s in exp.samples[name + "_bucket"] if s.labels["scenario"] == sc]
            les = [s.labels["le"] for s in buckets]
            assert [float(le) for le in les[:-1]] == list(bounds) and les[-1] == "+Inf", (name, les)
            counts = [s.value for s in buckets]
            assert counts == sorted(counts), (name, sc, counts)  # cumulative
            count = exp.value(name + "_count", scenario=sc)
            assert counts[-1] == count
            total = exp.value(name + "_sum", scenario=sc)
            assert total >= 0 and (count > 0 or total == 0)


async def promtool_check(text: str) -> None:
    promtool = tool("promtool", PROMETHEUS_HINT)
    proc = await asyncio.create_subprocess_exec(
        promtool, "check", "metrics", stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(text.encode()), 30)
    assert proc.returncode == 0, (out.decode() + err.decode())[-3000:]


async def scrape(base: str, path: str = "/metrics") -> tuple[int, str]:
    return await http_get(base + path)


async def test_live_exporter_through_a_soak(tmp_path: Path) -> None:
    """One in-process soak whose target is down at first: pre-initialised exposition and /readyz
    503; then the simulator comes up on that port: /readyz 200, load flows, histograms fill,
    promtool accepts the live exposition, /status reports the run; the final counters agree."""
    port = free_port()
    cfg = load_config(None, {
        "target": {"url": f"http://127.0.0.1:{port}/v1"},
        "run": {"duration": 3.0, "window": 1.0, "warmup": 0.5, "grace": 5.0, "state_dir": str(tmp_path)},
        "load": {"concurrency": 4},
        "scenarios": {"long_context": {"max_tokens": 64}, "code_completion": {"max_tokens": 64}},
        "metrics": {"host": "127.0.0.1", "port": 0},
    }, environ={})  # fmt: skip
    runtime = Runtime(cfg, progress=False)
    task = asyncio.create_task(runtime.run())
    try:
        await wait_until(lambda: runtime.web.port != 0, what="the web server")
        base = runtime.web.url

        # -- before the target answered
        status, body = await scrape(base, "/readyz")
        assert status == 503 and json.loads(body)["ready"] is False
        status, body = await scrape(base, "/healthz")
        assert status == 200 and json.loads(body)["status"] == "ok"
        status, body = await scrape(base, "/status")
        assert status == 200
        early = json.loads(body)
        assert early["run_id"] == runtime.run_id and early["phase"] == "starting"
        status, text = await scrape(base)
        assert status == 200
        exp = Exposition(text)
        check_contract(exp, SCENARIOS)
        assert exp.value("soakd_target_up") == 0
        assert all(s.value == 0 for s in exp.samples["soakd_requests_total"])
        assert exp.value("soakd_build_info", version=__import__("soakd").__version__) == 1
        await promtool_check(text)

        # -- the target comes up
        async with sim_server(port=port, **QUICK_SIM):
            await wait_until(lambda: runtime.status.ready()[0], timeout=10, what="the target to be seen")
            status, _ = await scrape(base, "/readyz")
            assert status == 200

            def has_current_p95() -> bool:
                st = runtime.status.status()
                cur = st.get("current_window") or {}
                return st.get("windows_closed", 0) >= 1 and cur.get("e2e_p95") is not None

            await wait_until(has_current_p95, timeout=10, what="a closed window and a current p95")
            status, body = await scrape(base, "/status")
            st = json.loads(body)
            assert st["run_id"] == runtime.run_id and st["phase"] in ("running", "draining")
            assert 0 < st["elapsed_seconds"] <= 3.5 and 0 < st["progress_ratio"] <= 1
            assert set(st["per_scenario"]) == set(SCENARIOS)
            assert all(set(v) == set(OUTCOMES) for v in st["per_scenario"].values())
            assert sum(v["ok"] for v in st["per_scenario"].values()) > 0
            cur = st["current_window"]
            assert cur["e2e_p50"] is not None and cur["e2e_p50"] <= cur["e2e_p95"]
            assert cur["ttft_p50"] is not None and cur["ttft_p50"] <= cur["ttft_p95"]
            assert st["target_up"] is True

            status, text = await scrape(base)
            exp = Exposition(text)
            check_contract(exp, SCENARIOS)
            assert exp.value("soakd_target_up") == 1
            assert exp.value("soakd_window_index") >= 1
            assert 0 < exp.value("soakd_soak_progress_ratio") <= 1
            ok = sum(exp.value("soakd_requests_total", scenario=sc, outcome="ok") for sc in SCENARIOS)
            assert ok > 0
            assert exp.value("soakd_request_duration_seconds_count", scenario="short_chat") > 0
            assert exp.value("soakd_inter_token_latency_seconds_count", scenario="short_chat") > 0
            await promtool_check(text)
            final = dataclasses.asdict(await asyncio.wait_for(task, 20))
    finally:
        if not task.done():
            runtime.request_stop("test")
            await asyncio.wait_for(task, 20)

    assert final["stop_reason"] == "duration"
    per_outcome = {o: sum(runtime.metrics.requests.get(sc, o) for sc in SCENARIOS) for o in OUTCOMES}
    assert per_outcome == final["outcomes"]
    assert sum(per_outcome.values()) == final["requests_measured"]
    assert final["requests_sent"] == final["requests_measured"] + final["warmup_requests"]
    assert runtime.metrics.in_flight.value == 0


def test_recorder_feeds_the_exported_values() -> None:
    """The numbers behind /metrics, from hand-made records: measured vs warm-up, tokens, ttft and
    inter-token histograms, usage fallback, bounded failure reasons."""
    metrics = SoakMetrics(("a", "b"), "9.9")
    tl = Timeline(0.0, 10.0, 60.0, 600.0)
    rec_ = Recorder(metrics, WindowSet(tl))

    def record(scenario: str, window: int, outcome: Outcome = Outcome.OK, reason: str = "", status: int = 200,
               tokens_ms: tuple[int, ...] = (50, 55, 60, 65), usage: bool = True,
               impaired: bool | None = None) -> RequestRecord:
        r = RequestRecord(scenario)
        r.window, r.warmup = window, window < 0
        r.t_start_ns = 1_000_000_000
        r.token_times_ns = [r.t_start_ns + ms * 1_000_000 for ms in tokens_ms]
        r.t_end_ns = r.t_start_ns + 100_000_000
        r.http_status = status
        r.prompt_tokens, r.completion_tokens, r.usage_from_server = (10, 4, True) if usage else (0, 4, False)
        r.expected_prompt_tokens = 10
        if outcome is not Outcome.OK:
            r.fail(outcome, reason)
        rec_.started(r)
        rec_.finished(r, impaired)
        return r

    record("a", -1)  # warm-up: only the warm-up counter
    record("a", 0)
    record("a", 0, usage=False)
    record("b", 0, Outcome.HTTP_ERROR, "http_418", status=418)
    # three that overlapped a stall of soakd's own loop (as a load worker decides it): counted as impaired, the
    # two answered ones' latency left out of the histograms (the failed one has none), all three counted as requests
    record("b", 0, tokens_ms=(900, 950), impaired=True)
    record("b", 0, tokens_ms=(900, 950), impaired=True)
    record("b", 0, Outcome.HTTP_ERROR, "http_503", status=503, impaired=True)
    rec_.windows.flush()  # as the worker pool does after each message of records (WorkerPool._apply)
    record("b", 0, Outcome.TIMEOUT, "response_timeout", status=0, tokens_ms=())
    exp = Exposition(generate_latest(metrics.registry()).decode())
    assert exp.value("soakd_warmup_requests_total", outcome="ok") == 1
    assert exp.value("soakd_requests_total", scenario="a", outcome="ok") == 2
    assert exp.value("soakd_requests_total", scenario="b", outcome="http_error") == 2  # the 418 and the 503
    assert exp.value("soakd_requests_total", scenario="b", outcome="timeout") == 1
    assert exp.value("soakd_request_failures_total", scenario="b", reason="http_4xx") == 1  # 418 folded
    assert exp.value("soakd_request_failures_total", scenario="b", reason="response_timeout") == 1
    assert exp.value("soakd_prompt_tokens_total", scenario="a") == 10  # the fallback record reports none
    assert exp.value("soakd_completion_tokens_total", scenario="a") == 8
    assert exp.value("soakd_usage_missing_total", scenario="a") == 1
    assert exp.value("soakd_time_to_first_token_seconds_count", scenario="a") == 2
    assert exp.value("soakd_time_to_first_token_seconds_bucket", scenario="a", le="0.05") == 2  # 50 ms <= 0.05
    assert exp.value("soakd_time_to_first_token_seconds_bucket", scenario="a", le="0.03") == 0
    assert exp.value("soakd_inter_token_latency_seconds_count", scenario="a") == 6  # 3 gaps x 2
    assert exp.value("soakd_inter_token_latency_seconds_bucket", scenario="a", le="0.005") == 6
    assert exp.value("soakd_inter_token_latency_seconds_sum", scenario="a") == pytest.approx(0.030)
    assert exp.value("soakd_request_duration_seconds_count", scenario="b") == 0  # failures, impaired: no latency
    assert exp.value("soakd_time_to_first_token_seconds_count", scenario="b") == 0
    assert exp.value("soakd_requests_impaired_total", scenario="b") == 3
    assert exp.value("soakd_requests_impaired_total", scenario="a") == 0
    assert exp.value("soakd_requests_total", scenario="b", outcome="ok") == 2  # counted as requests all the same
    assert exp.value("soakd_target_up") == 0  # the timeout without a status said the target is gone
    assert exp.value("soakd_requests_in_flight") == 0
    assert exp.value("soakd_build_info", version="9.9") == 1
    assert rec_.measured == 7 and rec_.sent == 8


def test_every_catalogued_core_metric_is_exported() -> None:
    """Each load/run metric of the catalogue (the table of docs/metrics.md) is in a fresh exposition (of a
    run with an SLO: without one, the goodput families are not exported)."""
    exp = Exposition(generate_latest(SoakMetrics(SCENARIOS, slo_objectives={"short_chat": 0.95}).registry()).decode())
    bare = Exposition(generate_latest(SoakMetrics(SCENARIOS).registry()).decode())
    assert "soakd_goodput_requests" not in bare.families and "soakd_slo_objective_ratio" not in bare.families
    # (soakd_target_info once the target answered, with the samplers' kind, version and GPU:
    # tests/unit/test_server_sampler.py::test_target_info_carries_what_a_fleets_peers_share)
    core = [m for m in CATALOGUE if m.group in ("load", "run") and m.name != "soakd_target_info"]
    core.append(BY_NAME["soakd_build_info"])
    for spec in core:
        fam = exp.family_of(spec.name)
        assert fam.type == (spec.kind if spec.kind != "info" else "gauge"), spec.name
        assert fam.documentation == spec.help, spec.name


def test_catalogue_names_follow_prometheus_rules() -> None:
    for m in CATALOGUE:
        assert re.fullmatch(r"soakd_[a-z0-9_]+", m.name), m.name
        assert (m.kind == "counter") == m.name.endswith("_total"), m.name
        assert m.kind != "info" or m.name.endswith("_info"), m.name
        assert not m.name.endswith(("_milliseconds", "_ms", "_percent", "_kb", "_mb")), m.name
    assert len({m.name for m in CATALOGUE}) == len(CATALOGUE)


def test_docs_metric_table_matches_the_catalogue() -> None:
    """docs/metrics.md's table between the metrics-table markers is ``soakd metrics --markdown``."""
    text = (REPO / "docs" / "metrics.md").read_text(encoding="utf-8")
    start, end = "<!-- metrics-table:start -->", "<!-- metrics-table:end -->"
    assert start in text and end in text, "docs/metrics.md lost its metric-table markers"
    section = text.split(start, 1)[1].split(end, 1)[0]
    assert section.strip() == catalogue_markdown().strip(), "regenerate it with `make metrics-table`"


async def test_every_catalogue_metric_appears_in_a_live_scrape(tmp_path: Path) -> None:
    """Every name in the catalogue is exported by a running soak: the simulator with its GPU
    behind the fake NVML, the target's process visible (the simulator runs in this process),
    quiesce probes, the canary and some failed requests (5% HTTP 500). A name in the catalogue
    that nothing exports (soakd_windows_closed_total once was) fails here."""
    import os

    from soakd.sim import fake_pynvml

    async with sim_server(**QUICK_SIM, faults={"error_rate_500": 0.05}) as sim:
        fake_pynvml.bind(sim.device)
        cfg = load_config(None, {
            "target": {"url": sim.base_url},
            "run": {"duration": 4.0, "window": 1.0, "warmup": 0.5, "grace": 2.0, "state_dir": str(tmp_path)},
            "load": {"concurrency": 4, "mix": {"short_chat": 1}},
            "scenarios": {"short_chat": {"max_tokens": 8, "slo": {"e2e": "30s"}}},
            "samplers": {"interval": 0.2, "nvml": {"mode": "on"}, "host": {"target_pid": os.getpid()}},
            "analysis": {"quiesce": {"settle": 0.05}, "canary": {"max_tokens": 4},
                         # drift ratios from the second window on, whatever a busy machine leaves in the first: at
                         # 50 (the default) a loaded run's window 0 had 39 requests, was not judged, and the scrape
                         # after two windows found no drift ratio yet
                         "drift": {"baseline_windows": 1, "min_requests": 10},
                         # every 1 s window judged, however busy this machine keeps soakd
                         "client": {"max_stall_share": 1.0, "max_lag": 3600, "max_throttled_share": 1.0,
                                    "request_max_lag": 3600, "max_impaired_share": 1.0}},
            "metrics": {"host": "127.0.0.1", "port": 0}, "log": {"progress": False},
        }, environ={})  # fmt: skip
        runtime = Runtime(cfg, progress=False, nvml_module=fake_pynvml, new_run=True)
        task = asyncio.create_task(runtime.run())
        try:
            await wait_until(lambda: runtime.analyzer.probes.quiesce_probes >= 2 and len(runtime.analyzer.history) >= 2,
                             timeout=20, what="two windows and two quiesce probes")
            _, text = await scrape(runtime.web.url)
        finally:
            await asyncio.wait_for(task, 20)
    exp = Exposition(text)

    def exported(name: str) -> bool:
        try:
            return bool(exp.family_of(name).samples)
        except AssertionError:
            return False

    # the sweep's own series are a sweep's (tests/component/test_sweep.py scrapes them), the A/B ratio an
    # A/B run's (tests/component/test_ab.py)
    missing = [m.name for m in CATALOGUE if m.group not in ("sweep", "ab") and not exported(m.name)]
    assert not missing, f"catalogue entries with no series in a live scrape: {missing}"

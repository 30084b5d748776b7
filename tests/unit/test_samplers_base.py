"""The sampler wrapper isolates failures; the snapshot collector exports fresh snapshots only."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector
from structlog.testing import capture_logs

from soakd.config import HostSamplerConfig, ServerSamplerConfig
from soakd.core.series import series
from soakd.samplers.base import SamplerRunner, SamplerUnavailable, SnapshotCollector
from soakd.samplers.host import HostSampler, read_anon_swap, read_stat


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class GoodSampler:
    name = "good"

    def __init__(self) -> None:
        self.value = 1.0

    async def sample(self):
        return [series("soakd_gpu_power_watts", self.value, gpu="0", uuid="GPU-a")]

    async def aclose(self):
        return None


class BrokenSampler:
    name = "broken"

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc
        self.fail = True

    async def sample(self):
        if self.fail:
            raise self.exc
        return [series("soakd_server_requests_running", 3)]

    async def aclose(self):
        return None


class SlowSampler:
    name = "slow"

    async def sample(self):
        await asyncio.sleep(10)
        return []

    async def aclose(self):
        return None


def _registry(collector_fn) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)

    class C(Collector):
        def collect(self):
            yield from collector_fn()

    reg.register(C())
    return reg


async def test_broken_sampler_does_not_hide_others_and_logs_state_changes_once():
    good, broken = GoodSampler(), BrokenSampler(RuntimeError("scrape failed: HTTP 500"))
    runners = [SamplerRunner(good, 5.0), SamplerRunner(broken, 5.0)]
    reg = _registry(SnapshotCollector(runners))
    with capture_logs() as logs:
        for _ in range(4):
            for r in runners:
                assert await r.run_once() in (True, False)
    assert reg.get_sample_value("soakd_gpu_power_watts", {"gpu": "0", "uuid": "GPU-a"}) == 1.0
    assert reg.get_sample_value("soakd_sampler_up", {"sampler": "good"}) == 1.0
    assert reg.get_sample_value("soakd_sampler_up", {"sampler": "broken"}) == 0.0
    assert reg.get_sample_value("soakd_sampler_errors_total", {"sampler": "broken"}) == 4.0
    downs = [e for e in logs if e["event"] == "sampler_down"]
    assert len(downs) == 1 and downs[0]["sampler"] == "broken" and "HTTP 500" in downs[0]["error"]
    # recovery is logged once too, and its series appear
    broken.fail = False
    with capture_logs() as logs:
        await runners[1].run_once()
        await runners[1].run_once()
    assert [e["event"] for e in logs] == ["sampler_up"]
    assert reg.get_sample_value("soakd_sampler_up", {"sampler": "broken"}) == 1.0
    assert reg.get_sample_value("soakd_server_requests_running") == 3.0
    assert generate_latest(reg)  # the whole exposition renders


async def test_unavailable_source_is_one_warning():
    r = SamplerRunner(BrokenSampler(SamplerUnavailable("NVML library not found")), 1.0)
    with capture_logs() as logs:
        for _ in range(5):
            await r.run_once()
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1 and warnings[0]["event"] == "sampler_unavailable"
    assert "NVML library not found" in warnings[0]["reason"]
    assert r.errors == 5 and r.up is False


async def test_slow_sampler_times_out_instead_of_hanging():
    r = SamplerRunner(SlowSampler(), interval=0.2, timeout=0.05)
    assert await asyncio.wait_for(r.run_once(), 2.0) is False
    assert "timed out" in r.last_error


async def test_stale_series_drop_out():
    clock = FakeClock()
    good = GoodSampler()
    runner = SamplerRunner(good, 5.0, clock=clock)
    reg = _registry(SnapshotCollector([runner], clock=clock))
    await runner.run_once()
    assert reg.get_sample_value("soakd_gpu_power_watts", {"gpu": "0", "uuid": "GPU-a"}) == 1.0
    clock.t += 60  # no successful sample for 12 intervals
    assert reg.get_sample_value("soakd_gpu_power_watts", {"gpu": "0", "uuid": "GPU-a"}) is None
    assert reg.get_sample_value("soakd_sampler_up", {"sampler": "good"}) == 1.0


async def test_counts_soakd_keeps_itself_stay_while_the_source_is_away():
    """The server sampler's restart count is soakd's own counter: it stays on /metrics through an
    outage longer than the staleness limit (a counter that vanished and came back higher would hide
    the restart from increase()); the server's own series drop out."""
    from soakd.samplers.server import ServerSampler

    class Server(ServerSampler):
        def __init__(self) -> None:
            super().__init__(ServerSamplerConfig(), "http://127.0.0.1:9")

        async def sample(self):
            return [series("soakd_server_kv_cache_usage_ratio", 0.5),
                    series("soakd_server_restarts_total", self.restarts.restarts)]

    clock = FakeClock()
    server = Server()
    runner = SamplerRunner(server, 1.0, clock=clock)
    reg = _registry(SnapshotCollector([runner], clock=clock))
    assert reg.get_sample_value("soakd_server_restarts_total") is None  # nothing before the first scrape
    await runner.run_once()
    assert reg.get_sample_value("soakd_server_kv_cache_usage_ratio") == 0.5
    clock.t += 60
    assert reg.get_sample_value("soakd_server_kv_cache_usage_ratio") is None
    assert reg.get_sample_value("soakd_server_restarts_total") == 0.0
    server.restarts.restarts = 1  # as RestartDetector counts a new start time at the next scrape
    assert reg.get_sample_value("soakd_server_restarts_total") == 1.0


async def test_listener_errors_are_contained():
    seen = []

    def bad_listener(name, snap):
        raise ValueError("boom")

    r = SamplerRunner(GoodSampler(), 1.0, listeners=[bad_listener, lambda n, s: seen.append((n, len(s.series)))])
    assert await r.run_once() is True
    assert seen == [("good", 1)]


async def test_host_sampler_reads_self_and_target():
    cfg = HostSamplerConfig(target_pid=os.getpid())
    h = HostSampler(cfg)
    loop_thread = threading.get_ident()
    called_in = []
    orig = h._sample

    def spy():
        called_in.append(threading.get_ident())
        return orig()

    h._sample = spy
    out = {s.name: s.value for s in await h.sample()}
    assert called_in and called_in[0] != loop_thread  # /proc reads happen off the event loop
    cpu, rss = read_stat(os.getpid())
    assert out["soakd_self_resident_memory_bytes"] > 10 * 1024 * 1024
    assert abs(out["soakd_self_resident_memory_bytes"] - rss) < 64 * 1024 * 1024
    assert out["soakd_self_open_fds"] >= 3
    assert out["soakd_target_resident_memory_bytes"] == pytest.approx(out["soakd_self_resident_memory_bytes"],
                                                                     rel=0.2)
    # anonymous memory + swap (the heap): part of the resident set, from /proc/PID/status
    assert 0 < out["soakd_target_anon_memory_bytes"] <= out["soakd_target_resident_memory_bytes"] * 1.5


async def test_host_sampler_finds_target_by_name(tmp_path):
    proc = tmp_path / "proc"
    me = proc / str(os.getpid())
    me.mkdir(parents=True)
    (me / "fd").mkdir()
    stat_tail = " ".join(["0"] * 10 + ["100", "50"] + ["0"] * 8 + ["256"] + ["0"] * 20)  # utime, stime, rss
    (me / "stat").write_text(f"{os.getpid()} (python) S {stat_tail}")
    (me / "cmdline").write_bytes(b"soakd\0run")
    other = proc / "4242"
    other.mkdir()
    (other / "stat").write_text(f"4242 (vllm serve (x)) S {stat_tail}")
    (other / "cmdline").write_bytes(b"python\0-m\0vllm.entrypoints.openai.api_server")
    h = HostSampler(HostSamplerConfig(target_process_name="vllm.entrypoints"), proc=str(proc))
    out = {s.name: s.value for s in await h.sample()}
    assert out["soakd_target_resident_memory_bytes"] == 256 * os.sysconf("SC_PAGE_SIZE")
    assert out["soakd_target_cpu_seconds_total"] == pytest.approx(150 / os.sysconf("SC_CLK_TCK"))
    assert "soakd_target_anon_memory_bytes" not in out  # no /proc/PID/status here: RSS only
    # RssAnon + VmSwap: a leak the kernel swapped out still counts
    (other / "status").write_text("Name:\tvllm\nVmRSS:\t  900000 kB\nRssAnon:\t  700000 kB\n"
                                  "RssFile:\t  200000 kB\nVmSwap:\t  300000 kB\n")
    out = {s.name: s.value for s in await h.sample()}
    assert out["soakd_target_anon_memory_bytes"] == (700000 + 300000) * 1024
    assert read_anon_swap(4242, str(proc)) == 1_000_000 * 1024
    (other / "status").write_text("Name:\tvllm\nVmRSS:\t  900000 kB\n")  # a kernel before 4.5
    assert read_anon_swap(4242, str(proc)) is None


async def test_host_sampler_counts_the_load_workers_as_soakd(tmp_path):
    """load.workers: soakd's CPU and memory are its workers' too; a worker that has exited keeps the CPU it used
    (the counter never goes down), its memory is gone."""
    proc = tmp_path / "proc"

    def stat(pid: int, utime: int, rss: int) -> None:
        d = proc / str(pid)
        d.mkdir(parents=True, exist_ok=True)
        (d / "fd").mkdir(exist_ok=True)
        tail = " ".join(["0"] * 10 + [str(utime), "0"] + ["0"] * 8 + [str(rss)] + ["0"] * 20)
        (d / "stat").write_text(f"{pid} (python) S {tail}")

    stat(os.getpid(), 100, 1000)
    stat(5001, 300, 2000)
    stat(5002, 200, 3000)
    h = HostSampler(HostSamplerConfig(), proc=str(proc))
    pids = [5001, 5002]
    h.worker_pids = lambda: list(pids)
    tick, page = os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")
    out = {s.name: s.value for s in await h.sample()}
    assert out["soakd_self_cpu_seconds_total"] == pytest.approx(600 / tick)
    assert out["soakd_self_resident_memory_bytes"] == 6000 * page
    stat(5001, 400, 2000)
    shutil.rmtree(proc / "5002")  # worker 2 exited
    out = {s.name: s.value for s in await h.sample()}
    assert out["soakd_self_cpu_seconds_total"] == pytest.approx(700 / tick)  # 100 + 400 + 200 it had used
    assert out["soakd_self_resident_memory_bytes"] == 3000 * page


def test_restart_detector_start_time_counter_resets_and_scrapes_in_between() -> None:
    from soakd.core.series import series
    from soakd.samplers.server import RestartDetector

    d = RestartDetector()

    def scrape(start: float | None = None, **counters: float) -> str | None:
        out = [series(f"soakd_server_{k}", v) for k, v in counters.items()]
        if start is not None:
            out.append(series("soakd_server_process_start_time_seconds", start))
        return d.update(out)

    assert scrape(1000.0, ttft_requests_total=10) is None and d.restarts == 0
    assert scrape(1000.0, ttft_requests_total=50) is None
    assert "process start time moved 300 s later" in (scrape(1300.0, ttft_requests_total=2) or "")
    assert d.restarts == 1
    # a server without process metrics (TGI, llama.cpp): a counter that went down
    assert scrape(ttft_requests_total=40, preemptions_total=3) is None
    assert scrape(ttft_requests_total=1, preemptions_total=0) == "preemptions_total fell from 3 to 0"
    assert d.restarts == 2
    # scrapes that failed in between change nothing; the same process again is no restart
    assert scrape(ttft_requests_total=5) is None and scrape(ttft_requests_total=5) is None and d.restarts == 2

"""A hung target and a wedged engine, live, on every server (issue 21 item 7).

- A real simulator process (``python -m soakd sim``) stopped with SIGSTOP while soakd drives it: 'target hung'
  within two probe intervals (``analysis.client.probe_interval``), ``soakd_target_up`` 0 during it and 1 again
  after SIGCONT, the hang counted as down time. Bounded everywhere (the stop lasts at most 8 s, every wait has a
  deadline) and nothing asserted that only an idle machine gives: the bound is the rule's own (half an interval
  of silence, a check a second, one interval of timeout: 5.5 s of the 6 s).
- An engine wedge (the simulator's ``freeze_every``: headers for every new stream, no token, GET /v1/models
  answering) behind SGLang's metric names, TGI's, and no /metrics at all: 'engine wedged', seen by soakd's
  streams whatever the server exports.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from soakd.sim import SimConfig, SimServer
from test_detection import SIM, Soak, samples, soak_config, value

pytestmark = [pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _answers(url: str, deadline: float) -> None:
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=1.0)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError, OSError):
                pass
            assert loop.time() < deadline, "the simulator did not start"
            await asyncio.sleep(0.1)


class _Url:
    """What soak_config needs of a simulator: its base URL."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url


@pytest.mark.timeout(120)
async def test_a_sigstopped_simulator_is_target_hung_within_two_probe_intervals(tmp_path: Path) -> None:
    probe = 3.0
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    sim = subprocess.Popen([sys.executable, "-m", "soakd", "sim", "--host", "127.0.0.1", "--port", str(port),
                            "--ttft", "30ms", "--tpot", "30ms"], env=env, cwd=REPO,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stopped = False
    try:
        loop = asyncio.get_running_loop()
        base = f"http://127.0.0.1:{port}"
        await _answers(base, loop.time() + 30)
        soak = Soak(soak_config(_Url(base + "/v1"), tmp_path / "run", windows=8, window=2.0, warmup=1.0,
                                analysis={"client": {"probe_interval": probe}, "drift": {"baseline_windows": 2}}))
        tl = await soak.timeline()
        while loop.time() < tl.first_window_start + 1.0 and not soak.task.done():
            await asyncio.sleep(0.05)
        assert value(samples(soak.daemon), "soakd_target_up") == 1.0
        os.kill(sim.pid, signal.SIGSTOP)
        stopped, t_stop = True, loop.time()
        hung: list[Any] = []
        while not hung and loop.time() < t_stop + 8.0:
            await asyncio.sleep(0.05)
            hung = [f for f in soak.daemon.analyzer.findings if f.diagnosis == "target hung"]
        named = loop.time() - t_stop
        up_while_hung = value(samples(soak.daemon), "soakd_target_up")
        os.kill(sim.pid, signal.SIGCONT)
        stopped, t_cont = False, loop.time()
        assert hung, [f.diagnosis for f in soak.daemon.analyzer.findings]
        assert named <= 2 * probe, f"named {named:.2f} s after SIGSTOP (probe interval {probe} s)"
        assert up_while_hung == 0.0
        (f,) = hung
        assert f.kind == "target" and f.severity == "critical" and f.evidence["in_flight"] >= 1
        assert f.evidence["probe_timeout_seconds"] == probe
        while value(samples(soak.daemon), "soakd_target_up") != 1.0 and loop.time() < t_cont + 10.0:
            await asyncio.sleep(0.05)
        assert value(samples(soak.daemon), "soakd_target_up") == 1.0
        back = loop.time() - t_cont
        final = await soak.finish(60)
    finally:
        if stopped:
            os.kill(sim.pid, signal.SIGCONT)
        sim.terminate()
        try:
            sim.wait(timeout=10)
        except subprocess.TimeoutExpired:
            sim.kill()
            sim.wait(timeout=10)
    down = sum(w.get("target_down_seconds") or 0.0 for w in final["windows"])
    stop = t_cont - t_stop
    # down while soakd_target_up was 0 (from the hang's naming to the first answer after SIGCONT), and the span
    # before it back to the last progress where its windows were still open (2 s windows close during the stop)
    assert stop - named - 0.5 <= down <= stop + back + 1.0, (down, stop, named, back)
    assert soak.daemon.wedge is not None and soak.daemon.wedge.hangs == 1
    assert not [x for x in soak.daemon.analyzer.findings if x.diagnosis in ("server froze", "engine wedged")]
    print(f"\ntarget hung: named {named:.2f} s after SIGSTOP; up again {back:.2f} s after SIGCONT; down time "
          f"{down:.2f} s of a {stop:.2f} s stop")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("names", ["sglang", "tgi", "none"])
async def test_an_engine_wedge_is_named_whatever_metric_names_the_server_exports(tmp_path: Path, names: str) -> None:
    """From 8 s of uptime on, every 8 s, the simulated engine sends headers to every new stream and no token for
    4 s while GET /v1/models answers; its /metrics under SGLang's names (a token counter that moves when requests
    end), TGI's (no counter) or none at all (404). soakd's own streams name it 'engine wedged'."""
    faults = {"freeze_every": 8.0, "freeze_duration": 4.0}
    async with SimServer(SimConfig(**SIM, faults=faults, metric_names=names)) as sim:
        soak = Soak(soak_config(sim, tmp_path / "run", windows=6, window=2.0, warmup=1.0,
                                analysis={"client": {"freeze_min": 1.0}, "drift": {"baseline_windows": 2}}))
        await soak.finish(60)
    wedged = [f for f in soak.daemon.analyzer.findings if f.diagnosis == "engine wedged"]
    assert wedged, [(f.diagnosis, f.message[:80]) for f in soak.daemon.analyzer.findings]
    for f in wedged:
        assert "streams" in f.evidence["sources"] and f.evidence["in_flight"] >= 1, f.evidence
    if names != "sglang":
        assert all(f.evidence["sources"] == ["streams"] for f in wedged)
    assert any(r.startswith("freeze: engine wedged") for r in soak.final["verdict"]["reasons"])
    print(f"\n{names}: engine wedged {[(f.window, round(f.evidence['silence_seconds'], 2)) for f in wedged]}")


@pytest.mark.timeout(60)
async def test_the_simulator_presents_each_servers_metric_names_or_none() -> None:
    """``sim.metric_names``: soakd's server sampler detects each server's table from the simulator's /metrics and
    reads what that server exports (TGI no token counter and no prefix-cache counters, llama.cpp no KV gauge); none
    answers 404."""
    from soakd.config import ServerSamplerConfig
    from soakd.samplers.promtext import ScrapeError
    from soakd.samplers.server import ServerSampler

    expect = {"vllm": {"kv", "tokens", "prefix"}, "sglang": {"kv", "tokens", "prefix"}, "tgi": {"kv"},
              "trtllm": {"kv", "tokens", "prefix"}, "llamacpp": {"tokens", "prefix"}}
    for kind, signals in expect.items():
        async with SimServer(SimConfig(**SIM, metric_names=kind)) as sim:
            sampler = ServerSampler(ServerSamplerConfig(), sim.base_url)
            try:
                names = {s.name for s in await sampler.sample()}
            finally:
                await sampler.aclose()
        assert sampler.table is not None and sampler.table.kind == kind
        assert "soakd_server_requests_running" in names and "soakd_server_requests_waiting" in names
        assert ("soakd_server_kv_cache_usage_ratio" in names) == ("kv" in signals), (kind, names)
        assert ("soakd_server_generation_tokens_total" in names) == ("tokens" in signals), (kind, names)
        for counter in ("soakd_server_prefix_cache_hits_total", "soakd_server_prefix_cache_queries_total"):
            assert (counter in names) == ("prefix" in signals), (kind, counter, names)
    async with SimServer(SimConfig(**SIM, metric_names="none")) as sim:
        sampler = ServerSampler(ServerSamplerConfig(), sim.base_url)
        try:
            with pytest.raises(ScrapeError, match="404"):
                await sampler.sample()
        finally:
            await sampler.aclose()

"""The simulator's GPU: the device model (with an injected clock: no sleeping), its dcgm-exporter
exposition read by the real ``DcgmSampler``, the fake NVML bound to it read by the real
``NvmlSampler``, and ``soakd demo`` end to end with ``soakd_gpu_*`` and ``soakd_server_*`` series
that follow the simulator's load."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import threading
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from helpers import SoakdProcess, http_get, soakd_env
from soakd.cli import _demo_episodes
from soakd.config import DcgmSamplerConfig, NvmlSamplerConfig, load_config
from soakd.samplers.dcgm import DcgmSampler
from soakd.samplers.nvml import NvmlSampler
from soakd.core.reasons import decode_clocks_event_reasons
from soakd.sim import SimConfig, SimModel, SimServer, add_sim_arguments, fake_pynvml, sim_config_from_args
from soakd.sim.device import HW_THERMAL, IDLE, SW_POWER_CAP, SW_THERMAL, SimDevice, dcgm_exposition

pytestmark = pytest.mark.timeout(30)

GiB = 1024**3
MiB = 1024**2
BASE = 40 * GiB
BLOCK = 8 * MiB  # (0.9 * 80 GiB - 40 GiB) / 4096 blocks
IDLE_W = 70.0
PER_REQ_W = 9.0
IDLE_C = 28.0 + 0.065 * IDLE_W


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def rig(**config: Any) -> tuple[FakeClock, SimModel, SimDevice]:
    """A model and its device on one fake clock (the way SimState wires them)."""
    clock = FakeClock()
    cfg = SimConfig(**config)
    model = SimModel(cfg, clock=clock)
    device = SimDevice(cfg, lambda: model, clock=clock, hostname="node-1")
    model.device = device
    return clock, model, device


def start(model: SimModel, n: int, prompt: int = 160, generated: int = 0) -> list[Any]:
    reqs = []
    for i in range(n):
        req = model.new_request(f"r{len(model.waiting)}-{i}-{id(reqs)}", prompt, 512)
        assert model.try_admit(req)
        if generated:
            model.grow(req, generated)
        reqs.append(req)
    return reqs


def finish(model: SimModel, reqs: list[Any]) -> None:
    for req in reqs:
        model.finish(req, "length")


def steady_celsius(watts: float) -> float:
    return 28.0 + 0.065 * watts


# ---- the device model


def test_memory_follows_the_kv_cache() -> None:
    clock, model, device = rig()
    assert device.kv_block_bytes == BLOCK
    idle = device.reading(0)
    assert idle.memory_used == BASE and idle.memory_total == 80 * GiB and idle.memory_reserved == 512 * MiB
    assert idle.memory_free == 80 * GiB - 512 * MiB - BASE
    reqs = start(model, 8, prompt=160)  # 10 blocks each
    assert model.kv_held == 80
    assert device.reading(0).memory_used == BASE + 80 * BLOCK
    for req in reqs:
        model.grow(req, 16)  # 176 tokens: 11 blocks
    assert device.reading(0).memory_used == BASE + 88 * BLOCK
    finish(model, reqs)
    assert device.reading(0).memory_used == BASE
    # leaked KV blocks stay in device memory too
    clock2, leaky, leaky_device = rig(faults={"kv_leak_blocks_per_n_requests": 5, "kv_leak_every_n_requests": 1})
    finish(leaky, start(leaky, 3))
    assert leaky_device.reading(0).memory_used == BASE + 15 * BLOCK
    # an explicit block size; a cache that cannot fit is refused with the numbers
    _, m, d = rig(kv_blocks_total=100, device={"kv_block_bytes": "100MiB"})
    start(m, 1, prompt=32)
    assert d.reading(0).memory_used == BASE + 2 * 100 * MiB
    with pytest.raises(ValidationError, match="KV cache does not fit"):
        SimConfig(device={"kv_block_bytes": "16MiB"})  # 4096 x 16 MiB = 64 GiB + 40 GiB > 80 GiB


def test_power_utilisation_temperature_follow_the_batch_and_energy_integrates() -> None:
    clock, model, device = rig()
    r = device.reading(0)
    assert r.power_watts == IDLE_W and r.utilization == 0 and r.temperature_celsius == pytest.approx(IDLE_C)
    assert r.reasons == IDLE and r.sm_clock_mhz == r.sm_clock_max_mhz == 1980
    reqs = start(model, 10)
    clock.t += 10.0
    r = device.reading(0)
    loaded_w = IDLE_W + 10 * PER_REQ_W  # 160 W
    assert r.power_watts == pytest.approx(loaded_w, rel=1e-3)  # ~1 s average, settled after 10 s
    assert r.utilization == pytest.approx(100 * 10 / 16, rel=1e-3)
    assert r.memory_utilization == pytest.approx(0.7 * r.utilization)
    assert r.energy_mj == pytest.approx(loaded_w * 10 * 1000, abs=1)
    lag = math.exp(-10 / 30)  # first-order lag, 30 s time constant
    assert r.temperature_celsius == pytest.approx(steady_celsius(loaded_w) + (IDLE_C - steady_celsius(loaded_w)) * lag)
    assert r.memory_temperature_celsius == pytest.approx(r.temperature_celsius + 7)
    assert r.reasons == 0 and r.sm_clock_mhz == 1980 and r.power_limit_watts == 700
    # the batch halves for 5 s, then nothing runs for 5 s: one reading integrates it exactly
    finish(model, reqs[:5])
    clock.t += 5.0
    finish(model, reqs[5:])
    clock.t += 5.0
    r2 = device.reading(0)
    assert r2.energy_mj - r.energy_mj == pytest.approx((IDLE_W + 5 * PER_REQ_W) * 5e3 + IDLE_W * 5e3, abs=1)
    assert r2.reasons == IDLE
    # long after: back to idle power and temperature; a full batch stays under the power limit
    clock.t += 600
    r3 = device.reading(0)
    assert r3.power_watts == pytest.approx(IDLE_W) and r3.temperature_celsius == pytest.approx(IDLE_C, abs=0.01)
    start(model, 64)
    clock.t += 600
    r4 = device.reading(0)
    assert r4.power_watts == pytest.approx(IDLE_W + 64 * PER_REQ_W) and r4.power_watts < 700 and r4.reasons == 0
    assert r4.temperature_celsius == pytest.approx(steady_celsius(IDLE_W + 64 * PER_REQ_W), abs=0.01)
    assert r4.utilization == 100


def test_readings_are_independent_of_how_often_they_are_taken() -> None:
    """Energy and violation counters come from exact integrals, not from the sampling rate."""
    results = []
    for step in (0.5, 7.0, 70.0):
        clock, model, device = rig(faults={"thermal_throttle_at": 20, "thermal_throttle_duration": 30})
        reqs = start(model, 12)
        t_end = clock.t + 70.0
        while clock.t < t_end:
            clock.t = min(t_end, clock.t + step)
            device.reading(0)
        finish(model, reqs)
        r = device.reading(0)
        results.append((r.energy_mj, r.thermal_violation_ns))
    for energy, violation in results:
        assert energy == pytest.approx(results[0][0], abs=2) and violation == 30 * 10**9


def test_thermal_episode_sets_reasons_drops_the_clock_and_slows_the_server() -> None:
    clock, model, device = rig(
        faults={"thermal_throttle_at": "100s", "thermal_throttle_duration": "60s", "thermal_throttle_clock_ratio": 0.5},
    )
    start(model, 16)
    assert model.latency_multiplier() == 1.0
    before = model.prefill_seconds(1000, 0, model.latency_multiplier())
    clock.t += 99.0
    r = device.reading(0)
    assert r.reasons & (SW_THERMAL | HW_THERMAL) == 0 and r.sm_clock_mhz == 1980
    temp_before = r.temperature_celsius
    clock.t += 31.0  # 30 s into the episode
    r = device.reading(0)
    assert r.reasons & (SW_THERMAL | HW_THERMAL) == SW_THERMAL | HW_THERMAL
    assert decode_clocks_event_reasons(r.reasons)["sw_thermal"] and not r.reasons & IDLE
    assert r.sm_clock_mhz == 990 and r.thermal_violation_ns == 30 * 10**9
    assert r.temperature_celsius > temp_before + 10  # climbing towards the 87 C slowdown point
    assert r.power_watts == pytest.approx(IDLE_W + 16 * PER_REQ_W * 0.5)  # half the clock, half the dynamic power
    assert model.latency_multiplier() == pytest.approx(2.0)
    assert model.prefill_seconds(1000, 0, model.latency_multiplier()) == pytest.approx(2 * before)
    assert model.tpot_seconds(model.latency_multiplier()) == pytest.approx(2 * model.tpot_seconds(1.0))
    hottest = device.reading(0, clock.t + 29.9).temperature_celsius
    clock.t += 60.0  # the episode ended 30 s ago
    r = device.reading(0)
    assert r.reasons == 0 and r.sm_clock_mhz == 1980 and model.latency_multiplier() == 1.0
    assert r.thermal_violation_ns == 60 * 10**9  # counted for the episode only
    assert r.temperature_celsius < hottest
    # a milder episode: software slowdown only
    clock, model, device = rig(faults={"thermal_throttle_at": 0, "thermal_throttle_clock_ratio": 0.6})
    clock.t += 1
    r = device.reading(0)
    assert r.reasons == SW_THERMAL | IDLE and r.sm_clock_mhz == round(1980 * 0.6)
    assert model.latency_multiplier() == pytest.approx(1 / 0.6)


async def test_thermal_episode_raises_the_latency_a_client_sees() -> None:
    clock = FakeClock()
    cfg = SimConfig(
        port=0, ttft_base=0.08, tpot_base=0, tpot_per_batch=0, ttft_per_prompt_token=0,
        faults={"thermal_throttle_at": "1h", "thermal_throttle_clock_ratio": 0.5},
    )  # fmt: skip
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    loop = asyncio.get_running_loop()
    async with SimServer(cfg, clock=clock) as sim:
        async with aiohttp.ClientSession() as session:

            async def e2e() -> float:
                t0 = loop.time()
                async with session.post(sim.base_url + "/chat/completions", json=body) as resp:
                    assert resp.status == 200
                    await resp.read()
                return loop.time() - t0

            # the least of five: a busy machine only adds to a request's time (seen: 0.377 s for 0.08 s once,
            # under two other test runs), the simulator's delay is the floor
            cool = min([await e2e() for _ in range(5)])
            clock.t += 3600.0 + 1
            hot = min([await e2e() for _ in range(5)])
            metrics = (await (await session.get(sim.dcgm_metrics_url)).text())
    assert cool >= 0.08 and hot >= 0.16 and hot - cool > 0.04, (cool, hot)  # 1/0.5 = 2x: +0.08 s
    assert 'DCGM_FI_DEV_SM_CLOCK{gpu="0"' in metrics and " 990\n" in metrics


def test_power_cap_episode() -> None:
    clock, model, device = rig(faults={"power_cap_at": 50, "power_cap_duration": 30, "power_cap_watts": 200})
    reqs = start(model, 30)  # wants 70 + 270 = 340 W
    clock.t += 49.0
    r = device.reading(0)
    assert r.power_watts == pytest.approx(340) and r.power_limit_watts == 700 and r.reasons == 0
    assert model.latency_multiplier() == 1.0
    clock.t += 21.0  # 20 s into the cap
    r = device.reading(0)
    assert r.power_limit_watts == 200 and r.power_watts == pytest.approx(200, rel=1e-3)
    assert r.reasons == SW_POWER_CAP and r.power_violation_ns == 20 * 10**9
    ratio = (200 - IDLE_W) / (30 * PER_REQ_W)
    assert r.sm_clock_mhz == round(1980 * ratio)
    assert model.latency_multiplier() == pytest.approx(1 / ratio)
    finish(model, reqs)  # an idle GPU is not capped: no reason, no violation time
    clock.t += 5.0
    r = device.reading(0)
    assert r.reasons == IDLE and r.power_violation_ns == 20 * 10**9 and r.power_limit_watts == 200
    start(model, 30)
    clock.t += 100.0
    r = device.reading(0)
    assert r.power_limit_watts == 700 and r.reasons == 0 and r.power_violation_ns == 25 * 10**9
    assert r.power_management_limit_watts == 700
    with pytest.raises(ValidationError, match="power_cap_watts"):
        SimConfig(faults={"power_cap_at": 10, "power_cap_watts": 800})


def test_device_memory_leak() -> None:
    clock, model, device = rig(faults={"device_memory_leak_bytes_per_hour": "2GiB"})
    assert device.reading(0).memory_used == BASE
    clock.t += 1800.0
    assert device.reading(0).memory_used == BASE + GiB  # independent of the (empty) KV cache
    clock.t += 3600.0 * 1000
    assert device.reading(0).memory_used == 80 * GiB - 512 * MiB  # never beyond the capacity
    fresh = SimModel(model.config, clock=clock)  # a restarted server releases what it leaked
    device._get_model = lambda: fresh  # noqa: SLF001
    assert device.reading(0).memory_used == BASE


def test_device_memory_steps() -> None:
    """A staircase: +512 MiB every 10 minutes of uptime, three of them, with the KV cache untouched; the
    restarted server starts again from the base."""
    clock, model, device = rig(faults={"device_memory_step_bytes": "512MiB", "device_memory_step_every": "10m",
                                       "device_memory_steps": 3})
    seen = []
    for _ in range(8):
        seen.append((device.reading(0).memory_used - BASE) // MiB)
        clock.t += 300.0
    assert seen == [0, 0, 512, 512, 1024, 1024, 1536, 1536]  # flat plateaus, then no fourth step
    assert model.kv_held == 0
    fresh = SimModel(model.config, clock=clock)
    device._get_model = lambda: fresh  # noqa: SLF001
    assert device.reading(0).memory_used == BASE
    # steps that keep coming (no count) stop at the device's capacity
    fclock, _, forever = rig(faults={"device_memory_step_bytes": "1GiB", "device_memory_step_every": "1m"})
    fclock.t += 90.0
    assert forever.reading(0).memory_used == BASE + GiB
    fclock.t += 3600.0 * 1000
    assert forever.reading(0).memory_used == 80 * GiB - 512 * MiB
    with pytest.raises(ValidationError, match="device_memory_step_every"):
        SimConfig(faults={"device_memory_step_bytes": "512MiB"})
    with pytest.raises(ValidationError):
        SimConfig(faults={"device_memory_step_bytes": "512MiB", "device_memory_step_every": 60, "device_memory_steps": 0})


def test_several_gpus_and_seeded_identities() -> None:
    _, model, device = rig(device={"gpus": 4}, seed=3)
    readings = device.readings()
    assert [r.index for r in readings] == [0, 1, 2, 3]
    assert len({r.uuid for r in readings}) == 4 and all(r.uuid.startswith("GPU-") for r in readings)
    assert [r.temperature_celsius - readings[0].temperature_celsius for r in readings] == pytest.approx([0, 1, 2, 3])
    assert [r.uuid for r in rig(device={"gpus": 4}, seed=3)[2].readings()] == [r.uuid for r in readings]
    assert [r.uuid for r in rig(device={"gpus": 4}, seed=4)[2].readings()] != [r.uuid for r in readings]


def test_config_flags_and_validation() -> None:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    cfg = sim_config_from_args(parser.parse_args([
        "--gpus", "2", "--thermal-throttle-at", "10m", "--thermal-throttle-duration", "90s",
        "--thermal-throttle-clock-ratio", "0.7", "--power-cap-at", "20m", "--power-cap-duration", "1m",
        "--power-cap-watts", "350", "--device-memory-leak-per-hour", "1GiB", "--thermal-time-constant", "5s",
        "--device-memory-step", "256MiB", "--device-memory-step-every", "30m", "--device-memory-steps", "4",
    ]))  # fmt: skip
    f = cfg.faults
    assert cfg.device.gpus == 2 and cfg.device.thermal_time_constant == 5.0
    assert (f.thermal_throttle_at, f.thermal_throttle_duration, f.thermal_throttle_clock_ratio) == (600, 90, 0.7)
    assert (f.power_cap_at, f.power_cap_duration, f.power_cap_watts) == (1200, 60, 350)
    assert f.device_memory_leak_bytes_per_hour == GiB
    assert (f.device_memory_step_bytes, f.device_memory_step_every, f.device_memory_steps) == (256 * MiB, 1800, 4)
    assert sim_config_from_args(parser.parse_args([])) == SimConfig()
    for bad in (["--thermal-throttle-clock-ratio", "0"], ["--thermal-throttle-clock-ratio", "1.5"],
                ["--gpus", "0"], ["--thermal-throttle-duration", "0s"], ["--device-memory-leak-per-hour", "-1"]):
        with pytest.raises(ValidationError):
            sim_config_from_args(parser.parse_args(bad))
    with pytest.raises(ValidationError, match="memory_base"):
        SimConfig(device={"memory_base": "79.9GiB"})
    with pytest.raises(ValidationError, match="idle_power_watts"):
        SimConfig(device={"idle_power_watts": 800})


def test_demo_episodes_schedule_a_throttle_and_a_cap_that_binds() -> None:
    cfg = load_config(None, {"run": {"duration": 180}, "load": {"concurrency": 16}}, environ={})
    data = cfg.sim.model_dump()
    _demo_episodes(cfg, data)
    sim = SimConfig.model_validate(data)
    f = sim.faults
    assert (f.thermal_throttle_at, f.thermal_throttle_duration, f.thermal_throttle_clock_ratio) == (60, 30, 0.6)
    assert (f.power_cap_at, f.power_cap_duration) == (120, 18)
    assert IDLE_W < f.power_cap_watts < IDLE_W + 16 * PER_REQ_W  # binds under the demo's load
    # the demo's own layout (3 min, 20-s windows, 10 s of warm-up, a pool of 4): the thermal episode a
    # window after the pool, the cap a window after the episode, both inside the run
    cfg = load_config(None, {"run": {"duration": 180, "window": 20, "warmup": 10}}, environ={})
    data = cfg.sim.model_dump()
    _demo_episodes(cfg, data)
    f = SimConfig.model_validate(data).faults
    assert (f.thermal_throttle_at, f.thermal_throttle_duration) == (110, 30)  # pool: windows [10, 90)
    assert (f.power_cap_at, f.power_cap_duration) == (160, 18)
    # test_prometheus's demo (150 s, 10-s windows, 3 s of warm-up): the pool ends at 43 s, the episode at 53 s
    cfg = load_config(None, {"run": {"duration": 150, "window": 10, "warmup": 3}}, environ={})
    data = cfg.sim.model_dump()
    _demo_episodes(cfg, data)
    f = SimConfig.model_validate(data).faults
    assert (f.thermal_throttle_at, f.power_cap_at) == (53, 100)
    # a thermal episode of the user's: the cap comes a window after it ends
    cfg = load_config(None, {"run": {"duration": 180, "window": 20, "warmup": 10},
                             "sim": {"faults": {"thermal_throttle_at": "100s", "thermal_throttle_duration": "40s"}}},
                      environ={})  # fmt: skip
    data = cfg.sim.model_dump()
    _demo_episodes(cfg, data)
    assert SimConfig.model_validate(data).faults.power_cap_at == 160
    # what the user scheduled is kept
    cfg = load_config(None, {"sim": {"faults": {"thermal_throttle_at": "5s"}}}, environ={})
    data = cfg.sim.model_dump()
    _demo_episodes(cfg, data)
    assert SimConfig.model_validate(data).faults.thermal_throttle_at == 5


def test_the_demo_counts_its_episodes_from_the_first_request() -> None:
    """The first request record moves every simulated device's start to when that request was sent (the soak's
    timeline start), however long the soak took to start; later records move nothing."""
    import time

    from soakd.cli import _EpisodeAnchor
    from soakd.core.records import RequestRecord

    class Dev:
        def __init__(self) -> None:
            self.now, self.started = 100.0, 0.0
            self._lock = threading.Lock()

        def clock(self) -> float:
            return self.now

    devs = [Dev(), Dev()]
    anchor = _EpisodeAnchor(devs)  # type: ignore[arg-type]
    rec = RequestRecord("short_chat")
    rec.t_start_ns = time.perf_counter_ns() - 2_000_000_000  # sent 2 s ago
    before = (time.perf_counter_ns() - rec.t_start_ns) / 1e9
    anchor(rec)
    after = (time.perf_counter_ns() - rec.t_start_ns) / 1e9
    # the simulator came up at 0, its clock reads 100, the request went out 2 s (and a little) ago
    assert all(100.0 - after <= d.started <= 100.0 - before <= 98.0 for d in devs)
    first = [d.started for d in devs]
    for d in devs:
        d.now = 500.0
    anchor(rec)
    assert [d.started for d in devs] == first
    # a real simulated GPU: its thermal episode (20 s after its start, 30 s long) moves with it
    clock, _, device = rig(faults={"thermal_throttle_at": 20, "thermal_throttle_duration": 30})
    clock.t += 15.0  # the soak took 15 s to start
    assert device.thermal_throttled(clock.t + 10)  # unanchored: the episode would begin 5 s into the soak
    rec.t_start_ns = time.perf_counter_ns()
    _EpisodeAnchor([device])(rec)
    assert not device.thermal_throttled(clock.t + 10) and device.thermal_throttled(clock.t + 25)
    assert not device.thermal_throttled(clock.t + 51)

# ---- the exposition and the samplers


def by_name(out: list[Any], uuid: str) -> dict[tuple[str, str], float]:
    table = {}
    for s in out:
        if s.label("uuid") != uuid or s.name == "soakd_gpu_info":
            continue
        extra = s.label("reason") or s.label("sensor") or s.label("kind") or ""
        table[(s.name, extra)] = s.value
    return table


async def test_dcgm_and_nvml_samplers_read_the_device_alike() -> None:
    """/dcgm/metrics through the real DcgmSampler and the bound fake NVML through the real NvmlSampler
    give the same soakd_gpu_* values, and those are the device's (dcgm-exporter units: MiB, us)."""
    clock = FakeClock()
    cfg = SimConfig(port=0, device={"gpus": 2}, faults={"thermal_throttle_at": "30s", "thermal_throttle_duration": "1h"})
    async with SimServer(cfg, clock=clock) as sim:
        device = sim.device
        dcgm = DcgmSampler(DcgmSamplerConfig(url=sim.dcgm_metrics_url))
        fake_pynvml.bind(device)
        nvml = NvmlSampler(NvmlSamplerConfig(mode="on"), nvml_module=fake_pynvml)
        try:
            first_dcgm, first_nvml = await dcgm.sample(), await nvml.sample()
            reqs = start(sim.model, 20, prompt=1000, generated=200)
            clock.t += 40.0  # 10 s into the thermal episode
            out_dcgm, out_nvml = await dcgm.sample(), await nvml.sample()
            _, text = await http_get(sim.dcgm_metrics_url)
            readings = device.readings()  # the fake clock has not moved since the samples
            finish(sim.model, reqs)
        finally:
            await dcgm.aclose()
            await nvml.aclose()
            fake_pynvml.reset()
    # the exposition is dcgm-exporter's: names, label set, counters under their bare names
    families = {f.name: f for f in text_string_to_metric_families(text)}
    fb = families["DCGM_FI_DEV_FB_USED"].samples[0]
    assert set(fb.labels) == {"gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "DCGM_FI_DRIVER_VERSION"}
    assert fb.labels["modelName"] == "NVIDIA H100 80GB HBM3" and fb.labels["device"] == "nvidia0"
    assert "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter" in text and "(in us)" in text
    assert "_total{" not in text.replace("VOL_TOTAL{", "")
    assert len(families["DCGM_FI_DEV_GPU_TEMP"].samples) == 2

    for r in readings:
        d, n = by_name(out_dcgm, r.uuid), by_name(out_nvml, r.uuid)
        assert d[("soakd_gpu_memory_used_bytes", "")] == pytest.approx(r.memory_used, abs=MiB)
        # 1200 tokens = 75 blocks per request, all still held at sampling time
        assert n[("soakd_gpu_memory_used_bytes", "")] == r.memory_used == BASE + 20 * 75 * BLOCK
        assert d[("soakd_gpu_memory_total_bytes", "")] == n[("soakd_gpu_memory_total_bytes", "")] == 80 * GiB
        assert d[("soakd_gpu_memory_reserved_bytes", "")] == n[("soakd_gpu_memory_reserved_bytes", "")] == 512 * MiB
        assert d[("soakd_gpu_utilization_ratio", "")] == n[("soakd_gpu_utilization_ratio", "")] == 1.0
        power = IDLE_W + 20 * PER_REQ_W * 0.6  # throttled to 60%: dynamic power scaled too
        assert d[("soakd_gpu_power_watts", "")] == pytest.approx(power, rel=1e-3)
        assert n[("soakd_gpu_power_watts", "")] == pytest.approx(power, rel=1e-3)
        assert d[("soakd_gpu_power_limit_watts", "")] == n[("soakd_gpu_power_limit_watts", "")] == 700
        assert d[("soakd_gpu_energy_joules_total", "")] == pytest.approx(n[("soakd_gpu_energy_joules_total", "")],
                                                                        abs=0.002)
        assert d[("soakd_gpu_energy_joules_total", "")] == pytest.approx(r.energy_mj / 1000, abs=0.002)
        assert r.energy_mj > 0
        for sensor, value in (("gpu", r.temperature_celsius), ("memory", r.memory_temperature_celsius)):
            assert d[("soakd_gpu_temperature_celsius", sensor)] == n[("soakd_gpu_temperature_celsius", sensor)] == \
                round(value)
        assert d[("soakd_gpu_sm_clock_hertz", "")] == n[("soakd_gpu_sm_clock_hertz", "")] == round(1980 * 0.6) * 1e6
        assert d[("soakd_gpu_sm_clock_max_hertz", "")] == n[("soakd_gpu_sm_clock_max_hertz", "")] == 1980e6
        assert d[("soakd_gpu_memory_clock_hertz", "")] == n[("soakd_gpu_memory_clock_hertz", "")] == 2619e6
        for reason in ("sw_thermal", "idle", "sw_power_cap", "hw_thermal"):
            want = 1.0 if reason == "sw_thermal" else 0.0
            assert d[("soakd_gpu_clocks_event_active", reason)] == n[("soakd_gpu_clocks_event_active", reason)] == want
        assert d[("soakd_gpu_throttle_seconds_total", "thermal")] == n[("soakd_gpu_throttle_seconds_total", "thermal")]
        assert n[("soakd_gpu_throttle_seconds_total", "thermal")] == pytest.approx(10.0)
        assert d[("soakd_gpu_throttle_seconds_total", "power")] == n[("soakd_gpu_throttle_seconds_total", "power")] == 0
    # idle before the load: only the weights in memory, the idle bit, idle power
    for out in (first_dcgm, first_nvml):
        t = by_name(out, readings[0].uuid)
        assert t[("soakd_gpu_memory_used_bytes", "")] == BASE and t[("soakd_gpu_power_watts", "")] == IDLE_W
        assert t[("soakd_gpu_clocks_event_active", "idle")] == 1.0


def test_exposition_escapes_the_hostname() -> None:
    _, _, device = rig()
    device.hostname = 'odd"host\\name'
    text = dcgm_exposition(device)
    assert 'Hostname="odd\\"host\\\\name"' in text
    families = {f.name for f in text_string_to_metric_families(text)}
    assert "DCGM_FI_DEV_CLOCKS_EVENT_REASONS" in families


# ---- end to end


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def pick(table: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float | None:
    found = [v for (n, ls), v in table.items() if n == name and set(labels.items()) <= set(ls)]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_demo_exposes_gpu_and_server_series_that_follow_the_load(tmp_path) -> None:
    """``soakd demo`` compressed: its /metrics mid-run carries the simulated GPU (through the fake
    NVML) and the simulator's KV cache and batch, above their idle values."""
    proc = await SoakdProcess.start(
        "demo", "--duration", "8s", "--window", "2s", "--warmup", "1s", "--metrics-port", "0",
        "--sample-interval", "0.5s", "--no-progress", "--log-format", "json",
        cwd=tmp_path, env=soakd_env(SOAKD_SIM__DEVICE__THERMAL_TIME_CONSTANT="1s"),
    )  # fmt: skip
    try:
        # a bound on a hang only: a soakd that starts on a starved core takes its imports' CPU time first (15 s was
        # not enough at nice 10 beside three busy processes on 2 cores)
        started = await proc.json_event("soakd_started", timeout=45)
        url = started["metrics_url"]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 6.0
        table: dict[Any, float] = {}
        while loop.time() < deadline:
            await asyncio.sleep(0.5)
            status, text = await http_get(url)
            assert status == 200
            table = scrape(text)
            running = pick(table, "soakd_server_requests_running") or 0
            power = pick(table, "soakd_gpu_power_watts", gpu="0") or 0
            temp = pick(table, "soakd_gpu_temperature_celsius", gpu="0", sensor="gpu") or 0
            if running > 0 and power > 100 and temp > IDLE_C + 2:
                break
        up = {ls[0][1]: v for (n, ls), v in table.items() if n == "soakd_sampler_up"}
        assert up.get("nvml") == 1 and up.get("server") == 1, up
        memory = pick(table, "soakd_gpu_memory_used_bytes", gpu="0")
        power = pick(table, "soakd_gpu_power_watts", gpu="0")
        temp = pick(table, "soakd_gpu_temperature_celsius", gpu="0", sensor="gpu")
        kv = pick(table, "soakd_server_kv_cache_usage_ratio")
        running = pick(table, "soakd_server_requests_running")
        idle_bit = pick(table, "soakd_gpu_clocks_event_active", gpu="0", reason="idle")
        thermal_bit = pick(table, "soakd_gpu_clocks_event_active", gpu="0", reason="sw_thermal")
        summary = dict(memory=memory, power=power, temp=temp, kv=kv, running=running)
        assert None not in summary.values() and idle_bit is not None and thermal_bit == 0, summary
        assert memory > BASE and power > IDLE_W + 20 and temp > IDLE_C + 2, summary  # idle: 40 GiB, 70 W, 33 C
        assert 0 < kv < 1 and running > 0, summary
        assert memory - BASE < 4096 * BLOCK, summary  # the KV cache's share stays within its capacity
        assert pick(table, "soakd_gpu_clocks_event_active", gpu="0", reason="sw_power_cap") == 0  # a clean demo
        assert pick(table, "soakd_gpu_memory_total_bytes", gpu="0") == 80 * GiB
        assert pick(table, "soakd_gpu_utilization_ratio", gpu="0") > 0
        assert pick(table, "soakd_server_requests_waiting") is not None
        rc = await proc.finish(timeout=20)
    finally:
        await proc.kill()
    assert rc == 3, proc.output()[-3000:] + proc.stderr[-2000:]  # four 2 s windows: too few to judge
    finished = [json.loads(line) for line in proc.lines if '"soakd_finished"' in line]
    assert finished and finished[-1]["outcomes"].get("ok", 0) > 0

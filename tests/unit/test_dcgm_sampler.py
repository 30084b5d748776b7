"""dcgm-exporter sampler: golden scrape, unit conversions, reason decoding, counter resets, errors.

A real aiohttp server on 127.0.0.1 port 0 serves fixtures/metrics/dcgm_exporter.prom (and edits of
it); the sampler scrapes it like dcgm-exporter's :9400/metrics.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pynvml
import pytest
from aiohttp import web

from soakd.config import DcgmSamplerConfig
from soakd.metrics import BY_NAME
from soakd.core.series import Series
from soakd.samplers.base import SamplerRunner, SamplerUnavailable
from soakd.samplers.dcgm import DcgmSampler, MonotonicCounter, violation_units_per_second
from soakd.samplers.promtext import ScrapeError
from soakd.core.reasons import (
    CLOCKS_EVENT_REASON_NAMES,
    CLOCKS_EVENT_REASONS,
    VIOLATION_REASONS,
    decode_clocks_event_reasons,
)

pytestmark = pytest.mark.timeout(20)

FIXTURE = (Path(__file__).resolve().parents[1] / "fixtures" / "metrics" / "dcgm_exporter.prom").read_text()
PLAIN = "text/plain; version=0.0.4; charset=utf-8"
MIB = 1024 * 1024
UUID0 = "GPU-8f6d3b1e-52a4-7c0e-9d1b-3a6e2f4c8b70"
UUID1 = "GPU-2c7e9a40-1b3d-4f85-a6e2-9d0c7b1f3e58"


class Exporter:
    """A stand-in for dcgm-exporter: serves a mutable body at /metrics."""

    def __init__(self, body: str, status: int = 200, port: int = 0) -> None:
        self.body = body
        self.status = status
        self.port = port
        self._runner: web.AppRunner | None = None

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(status=self.status, body=self.body.encode(), headers={"Content-Type": PLAIN})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()
        self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"


@asynccontextmanager
async def exporter(body: str = FIXTURE, status: int = 200) -> AsyncIterator[tuple[Exporter, DcgmSampler]]:
    server = Exporter(body, status)
    await server.start()
    sampler = DcgmSampler(DcgmSamplerConfig(url=server.url))
    try:
        yield server, sampler
    finally:
        await sampler.aclose()
        await server.stop()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


Key = tuple[str, tuple[tuple[str, str], ...]]


def as_dict(items: list[Series]) -> dict[Key, float]:
    out: dict[Key, float] = {}
    for s in items:
        key = (s.name, s.labels)
        assert key not in out, f"duplicate series {key}"
        out[key] = s.value
    return out


def gpu_series(gpu: str, uuid: str, values: dict[str, float | dict[str, float]]) -> dict[Key, float]:
    """Expected series of one GPU: plain names, or {label value: v} for the labelled ones."""
    extra_label = {"soakd_gpu_temperature_celsius": "sensor", "soakd_gpu_clocks_event_active": "reason",
                   "soakd_gpu_throttle_seconds_total": "reason", "soakd_gpu_ecc_errors_total": "kind",
                   "soakd_gpu_remapped_rows": "kind"}  # fmt: skip
    out: dict[Key, float] = {}
    for name, v in values.items():
        if isinstance(v, dict):
            for lv, x in v.items():
                out[(name, (("gpu", gpu), ("uuid", uuid), (extra_label[name], lv)))] = x
        else:
            out[(name, (("gpu", gpu), ("uuid", uuid)))] = v
    out[("soakd_gpu_info", (("gpu", gpu), ("uuid", uuid), ("name", "NVIDIA H100 80GB HBM3")))] = 1.0
    return out


def reasons(*active: str) -> dict[str, float]:
    return {r: (1.0 if r in active else 0.0) for r in CLOCKS_EVENT_REASON_NAMES}


THROTTLE_ZERO = {"power": 0.0, "thermal": 0.0, "sync_boost": 0.0, "board_limit": 0.0, "low_utilization": 0.0,
                 "reliability": 0.0}  # fmt: skip

EXPECTED = {
    **gpu_series("0", UUID0, {
        "soakd_gpu_memory_used_bytes": 61440 * MIB,
        "soakd_gpu_memory_total_bytes": (61440 + 19632 + 487) * MIB,
        "soakd_gpu_memory_reserved_bytes": 487 * MIB,
        "soakd_gpu_utilization_ratio": 0.87,
        "soakd_gpu_memory_utilization_ratio": 0.41,
        "soakd_gpu_power_watts": 612.345,
        "soakd_gpu_power_limit_watts": 700.0,
        "soakd_gpu_energy_joules_total": 0.0,
        "soakd_gpu_temperature_celsius": {"gpu": 67.0, "memory": 74.0},
        "soakd_gpu_sm_clock_hertz": 1755e6,
        "soakd_gpu_memory_clock_hertz": 2619e6,
        "soakd_gpu_clocks_event_active": reasons("sw_power_cap", "sw_thermal"),  # mask 36 = 0x4 | 0x20
        "soakd_gpu_throttle_seconds_total": {**THROTTLE_ZERO, "power": 2.5, "thermal": 0.001},
        "soakd_gpu_ecc_errors_total": {"corrected": 3.0, "uncorrected": 0.0},
        "soakd_gpu_remapped_rows": {"correctable": 1.0, "uncorrectable": 0.0, "failure": 0.0},
        "soakd_gpu_last_xid": 0.0,
    }),
    **gpu_series("1", UUID1, {
        "soakd_gpu_memory_used_bytes": 519 * MIB,
        "soakd_gpu_memory_total_bytes": (519 + 80553 + 487) * MIB,
        "soakd_gpu_memory_reserved_bytes": 487 * MIB,
        "soakd_gpu_utilization_ratio": 0.0,
        "soakd_gpu_memory_utilization_ratio": 0.0,
        "soakd_gpu_power_watts": 71.5,
        "soakd_gpu_power_limit_watts": 600.0,  # the enforced limit wins over POWER_MGMT_LIMIT (700)
        "soakd_gpu_energy_joules_total": 0.0,
        "soakd_gpu_temperature_celsius": {"gpu": 31.0, "memory": 38.0},
        "soakd_gpu_sm_clock_hertz": 345e6,
        "soakd_gpu_memory_clock_hertz": 2619e6,
        "soakd_gpu_clocks_event_active": reasons("idle"),
        "soakd_gpu_throttle_seconds_total": THROTTLE_ZERO,
        "soakd_gpu_ecc_errors_total": {"corrected": 0.0, "uncorrected": 0.0},
        "soakd_gpu_remapped_rows": {"correctable": 0.0, "uncorrectable": 0.0, "failure": 0.0},
        "soakd_gpu_last_xid": 0.0,
    }),
}  # fmt: skip


def assert_series(got: list[Series], want: dict[Key, float]) -> None:
    have = as_dict(got)
    assert set(have) == set(want), (f"missing {sorted(set(want) - set(have))}\n"
                                    f"extra {sorted(set(have) - set(want))}")  # fmt: skip
    for key, value in want.items():
        assert have[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


async def test_golden_scrape_maps_every_field_with_unit_conversions() -> None:
    async with exporter() as (_, sampler):
        got = await sampler.sample()
    assert_series(got, EXPECTED)


def test_every_series_is_a_device_metric_of_the_catalogue() -> None:
    for (name, labels), _ in EXPECTED.items():
        spec = BY_NAME[name]
        assert spec.group == "device"
        assert tuple(k for k, _ in labels) == spec.labels, name


async def test_deprecated_clock_throttle_reasons_name_is_read() -> None:
    body = FIXTURE.replace("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS")
    assert "DCGM_FI_DEV_CLOCKS_EVENT_REASONS" not in body
    async with exporter(body) as (_, sampler):
        got = as_dict(await sampler.sample())
    for reason, value in reasons("sw_power_cap", "sw_thermal").items():
        assert got[("soakd_gpu_clocks_event_active", (("gpu", "0"), ("uuid", UUID0), ("reason", reason)))] == value


async def test_without_the_reasons_field_no_clock_event_series() -> None:
    body = "\n".join(line for line in FIXTURE.splitlines() if "CLOCKS_EVENT_REASONS" not in line) + "\n"
    async with exporter(body) as (_, sampler):
        names = {s.name for s in await sampler.sample()}
    assert "soakd_gpu_clocks_event_active" not in names
    assert "soakd_gpu_sm_clock_hertz" in names


def test_reason_bits_are_nvml_clocks_event_reasons() -> None:
    nvml = {
        "sw_power_cap": pynvml.nvmlClocksEventReasonSwPowerCap,
        "hw_slowdown": pynvml.nvmlClocksEventReasonHwSlowdown,
        "sw_thermal": pynvml.nvmlClocksEventReasonSwThermalSlowdown,
        "hw_thermal": pynvml.nvmlClocksEventReasonHwThermalSlowdown,
        "hw_power_brake": pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown,
        "sync_boost": pynvml.nvmlClocksEventReasonSyncBoost,
        "applications_clocks": pynvml.nvmlClocksEventReasonApplicationsClocksSetting,
        "display_clock": pynvml.nvmlClocksEventReasonDisplayClockSetting,
        "idle": pynvml.nvmlClocksEventReasonGpuIdle,
    }
    assert dict(CLOCKS_EVENT_REASONS) == nvml
    assert sum(nvml.values()) == pynvml.nvmlClocksEventReasonAll
    # the catalogue's help lists the same nine reasons in the same order
    assert ", ".join(CLOCKS_EVENT_REASON_NAMES) in BY_NAME["soakd_gpu_clocks_event_active"].help
    perf = {"power": pynvml.NVML_PERF_POLICY_POWER, "thermal": pynvml.NVML_PERF_POLICY_THERMAL,
            "sync_boost": pynvml.NVML_PERF_POLICY_SYNC_BOOST, "board_limit": pynvml.NVML_PERF_POLICY_BOARD_LIMIT,
            "low_utilization": pynvml.NVML_PERF_POLICY_LOW_UTILIZATION,
            "reliability": pynvml.NVML_PERF_POLICY_RELIABILITY,
            "app_clocks": pynvml.NVML_PERF_POLICY_TOTAL_APP_CLOCKS,
            "base_clocks": pynvml.NVML_PERF_POLICY_TOTAL_BASE_CLOCKS}  # fmt: skip
    assert {reason: policy for reason, policy, _ in VIOLATION_REASONS} == perf
    for reason in perf:
        assert reason in BY_NAME["soakd_gpu_throttle_seconds_total"].help


@pytest.mark.parametrize(
    ("mask", "active"),
    [
        (0, set()),
        (0x1, {"idle"}),
        (0x4 | 0x20, {"sw_power_cap", "sw_thermal"}),
        (0x8 | 0x40 | 0x80, {"hw_slowdown", "hw_thermal", "hw_power_brake"}),
        (0x2 | 0x10 | 0x100, {"applications_clocks", "sync_boost", "display_clock"}),
        (0x1FF, set(CLOCKS_EVENT_REASON_NAMES)),
        (0x200 | 0x400 | 0x4, {"sw_power_cap"}),  # board limit / reliability bits: not clocks-event reasons
        (36.0, {"sw_power_cap", "sw_thermal"}),  # as a float sample value
    ],
)
def test_decode_clocks_event_reasons(mask: float, active: set[str]) -> None:
    decoded = decode_clocks_event_reasons(mask)
    assert list(decoded) == list(CLOCKS_EVENT_REASON_NAMES)
    assert {r for r, on in decoded.items() if on} == active


def _with(body: str, field: str, gpu: str, value: str) -> str:
    """The body with ``field``'s sample for GPU ``gpu`` set to ``value``."""
    out = []
    for line in body.splitlines():
        if line.startswith(field + "{") and f'gpu="{gpu}"' in line:
            line = line.rsplit(" ", 1)[0] + " " + value
        out.append(line)
    return "\n".join(out) + "\n"


async def test_energy_counter_survives_resets() -> None:
    key = ("soakd_gpu_energy_joules_total", (("gpu", "0"), ("uuid", UUID0)))
    field = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"
    async with exporter() as (server, sampler):
        seen = [as_dict(await sampler.sample())[key]]
        for raw in ("123461789", "1000", "3000", "2500", "2600"):  # +5 J; reset; +2 J; reset; +0.1 J
            server.body = _with(FIXTURE, field, "0", raw)
            seen.append(as_dict(await sampler.sample())[key])
    assert seen == pytest.approx([0.0, 5.0, 6.0, 8.0, 10.5, 10.6])
    assert all(b >= a for a, b in zip(seen, seen[1:]))


async def test_throttle_and_ecc_counters_stay_monotonic() -> None:
    power = ("soakd_gpu_throttle_seconds_total", (("gpu", "0"), ("uuid", UUID0), ("reason", "power")))
    ecc = ("soakd_gpu_ecc_errors_total", (("gpu", "0"), ("uuid", UUID0), ("kind", "corrected")))
    async with exporter() as (server, sampler):
        first = as_dict(await sampler.sample())
        assert first[power] == 2.5 and first[ecc] == 3
        body = _with(FIXTURE, "DCGM_FI_DEV_POWER_VIOLATION", "0", "500000")  # driver reloaded
        server.body = _with(body, "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "0", "1")
        second = as_dict(await sampler.sample())
    assert second[power] == pytest.approx(3.0)
    assert second[ecc] == 4


async def test_violation_units_follow_the_help_text() -> None:
    body = FIXTURE.replace("Throttling duration due to power constraints (in us).",
                           "Throttling duration due to power constraints (in ns).")  # fmt: skip
    key = ("soakd_gpu_throttle_seconds_total", (("gpu", "0"), ("uuid", UUID0), ("reason", "power")))
    async with exporter(body) as (_, sampler):
        assert as_dict(await sampler.sample())[key] == pytest.approx(2500000 / 1e9)
    assert violation_units_per_second("Throttling duration due to power constraints (in us).") == 1e6
    assert violation_units_per_second("Power Violation time in ns (in ns)") == 1e9
    assert violation_units_per_second("no unit here") == 1e6


def test_monotonic_counter() -> None:
    energy = MonotonicCounter(from_zero=True)
    assert [energy.update("a", v) for v in (100, 150, 20, 30)] == [0, 50, 70, 80]
    errors = MonotonicCounter(from_zero=False)
    assert [errors.update("a", v) for v in (3, 3, 5, 0, 1)] == [3, 3, 5, 5, 6]
    assert errors.update("b", 7) == 7  # keys are independent


MINIMAL = """# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).
# TYPE DCGM_FI_DEV_FB_USED gauge
DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-a",device="nvidia0",modelName="NVIDIA A100-SXM4-80GB",Hostname="n1"} 1024
DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-a",device="nvidia0",modelName="NVIDIA A100-SXM4-80GB",GPU_I_PROFILE="3g.40gb",GPU_I_ID="1",Hostname="n1"} 512
# HELP DCGM_FI_DEV_FB_FREE Framebuffer memory free (in MiB).
# TYPE DCGM_FI_DEV_FB_FREE gauge
DCGM_FI_DEV_FB_FREE{gpu="0",UUID="GPU-a",device="nvidia0",modelName="NVIDIA A100-SXM4-80GB",Hostname="n1"} 80000
# TYPE DCGM_FI_DEV_MEMORY_TEMP gauge
DCGM_FI_DEV_MEMORY_TEMP{gpu="0",UUID="GPU-a",device="nvidia0",modelName="NVIDIA A100-SXM4-80GB",Hostname="n1"} 9.223372036854776e+18
# TYPE DCGM_FI_DEV_GPU_TEMP gauge
DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-a",device="nvidia0",modelName="NVIDIA A100-SXM4-80GB",Hostname="n1"} 44
# TYPE DCGM_FI_DEV_XID_ERRORS gauge
DCGM_FI_DEV_XID_ERRORS{gpu="0",UUID="GPU-a",device="nvidia0",modelName="NVIDIA A100-SXM4-80GB",Hostname="n1",err_code="79",err_msg="GPU has fallen off the bus"} 79
# TYPE DCGM_FI_DEV_ROW_REMAP_PENDING gauge
DCGM_FI_DEV_ROW_REMAP_PENDING{gpu="0",UUID="GPU-a",device="nvidia0",modelName="NVIDIA A100-SXM4-80GB",Hostname="n1"} 1
"""


async def test_mig_instances_and_blank_values_are_skipped() -> None:
    """Whole-GPU series only; DCGM's blank sentinel (field unsupported) is not a temperature;
    without FB_RESERVED the total is used + free."""
    async with exporter(MINIMAL) as (_, sampler):
        got = as_dict(await sampler.sample())
    ids = (("gpu", "0"), ("uuid", "GPU-a"))
    assert got == {
        ("soakd_gpu_info", ids + (("name", "NVIDIA A100-SXM4-80GB"),)): 1.0,
        ("soakd_gpu_memory_used_bytes", ids): 1024 * MIB,
        ("soakd_gpu_memory_total_bytes", ids): (1024 + 80000) * MIB,
        ("soakd_gpu_temperature_celsius", ids + (("sensor", "gpu"),)): 44.0,
        ("soakd_gpu_remapped_rows", ids + (("kind", "pending"),)): 1.0,
        ("soakd_gpu_last_xid", ids): 79.0,
    }


async def test_fb_total_is_preferred_and_pod_labels_do_not_duplicate() -> None:
    body = MINIMAL + (
        "# TYPE DCGM_FI_DEV_FB_TOTAL gauge\n"
        'DCGM_FI_DEV_FB_TOTAL{gpu="0",UUID="GPU-a",modelName="NVIDIA A100-SXM4-80GB",'
        'container="vllm",namespace="ml",pod="vllm-0"} 81920\n'
        'DCGM_FI_DEV_FB_TOTAL{gpu="0",UUID="GPU-a",modelName="NVIDIA A100-SXM4-80GB",'
        'container="sidecar",namespace="ml",pod="vllm-0"} 81920\n'
    )
    async with exporter(body) as (_, sampler):
        got = as_dict(await sampler.sample())
    assert got[("soakd_gpu_memory_total_bytes", (("gpu", "0"), ("uuid", "GPU-a")))] == 81920 * MIB


async def test_an_exposition_without_dcgm_fields_is_a_clear_error() -> None:
    async with exporter("# TYPE node_load1 gauge\nnode_load1 0.5\n") as (server, sampler):
        with pytest.raises(SamplerUnavailable, match=r"no DCGM_FI_DEV_\* metrics .* at http://127\.0\.0\.1:\d+/metrics"):
            await sampler.sample()
        assert server.url


async def test_http_error_and_refused_connection_are_clear_errors() -> None:
    async with exporter(status=500) as (_, sampler):
        with pytest.raises(ScrapeError, match="returned HTTP 500"):
            await sampler.sample()
    async with exporter("<html><body>Not here</body></html>") as (_, sampler):
        with pytest.raises(ScrapeError, match="an HTML page"):
            await sampler.sample()
    port = free_port()
    sampler = DcgmSampler(DcgmSamplerConfig(url=f"http://127.0.0.1:{port}/metrics"))
    try:
        with pytest.raises(ScrapeError, match="cannot connect"):
            await sampler.sample()
    finally:
        await sampler.aclose()


async def test_runner_goes_down_and_recovers_with_the_exporter() -> None:
    port = free_port()
    sampler = DcgmSampler(DcgmSamplerConfig(url=f"http://127.0.0.1:{port}/metrics"))
    runner = SamplerRunner(sampler, interval=5.0)
    server = Exporter(FIXTURE, port=port)
    try:
        assert await runner.run_once() is False and runner.up is False
        await server.start()
        assert await runner.run_once() is True and runner.up is True
        assert runner.snapshot is not None
        assert as_dict(list(runner.snapshot.series)) == pytest.approx(EXPECTED)
    finally:
        await server.stop()
        await sampler.aclose()


def test_no_url_is_a_caller_error() -> None:
    with pytest.raises(ValueError, match="samplers.dcgm.url"):
        DcgmSampler(DcgmSamplerConfig())


def test_reason_labels_match_the_nvml_sampler() -> None:
    """Both device sources feed the same series: the same reason label values, in the same order."""
    from soakd.samplers import nvml

    assert nvml.CLOCK_EVENT_REASON_LABELS == CLOCKS_EVENT_REASON_NAMES
    assert nvml.THROTTLE_REASON_LABELS == tuple(reason for reason, _, _ in VIOLATION_REASONS)

"""The NVML sampler against a fake ``pynvml`` that mirrors nvidia-ml-py, plus cross-checks of that
fake against the installed nvidia-ml-py (names, values, signatures, structures, exceptions)."""

from __future__ import annotations

import asyncio
import inspect
import re
import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from soakd.sim import fake_pynvml
from soakd.sim.fake_pynvml import FakeGpu
from soakd.config import NvmlSamplerConfig
from soakd.metrics import BY_NAME
from soakd.samplers import nvml as nvml_sampler
from soakd.core import reasons
from soakd.core.series import Series
from soakd.samplers.base import SamplerRunner, SamplerUnavailable, SnapshotCollector
from soakd.samplers.nvml import CLOCK_EVENT_REASON_LABELS, THROTTLE_REASON_LABELS, NvmlSampler

pytestmark = pytest.mark.timeout(10)

F = fake_pynvml
GiB = 1024**3
MiB = 1024**2
SAMPLER_SOURCE = Path(nvml_sampler.__file__).read_text()


# ---- helpers


@pytest.fixture
def fake():
    """The fake module with two healthy GPUs (reset again in tests that need others)."""
    F.reset([FakeGpu(uuid="GPU-aaaa"), FakeGpu(uuid="GPU-bbbb", name="NVIDIA H200")])
    return F


def make(gpus: list[int | str] | None = None, module: Any = F, **kwargs: Any) -> NvmlSampler:
    return NvmlSampler(NvmlSamplerConfig(gpus=gpus or []), nvml_module=module, **kwargs)


def by_key(out: list[Series]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    table = {}
    for s in out:
        key = (s.name, s.labels)
        assert key not in table, f"duplicate series {key}"
        table[key] = s.value
    return table


def value(out: list[Series], name: str, **labels: str) -> float | None:
    """The value of the one series with this name whose labels include ``labels``."""
    found = [s.value for s in out if s.name == name and all(s.label(k) == v for k, v in labels.items())]
    assert len(found) <= 1, f"{name}{labels} matches {len(found)} series"
    return found[0] if found else None


def gpus_in(out: list[Series]) -> set[str]:
    return {s.label("uuid") for s in out}


def events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == name]


def module_without(*names: str) -> types.ModuleType:
    """The fake as an older nvidia-ml-py that lacks ``names`` (same scenario underneath)."""
    mod = types.ModuleType("pynvml")
    mod.__dict__.update({k: v for k, v in F.__dict__.items() if k not in names and not k.startswith("__")})
    return mod


# ---- every field, in base units


async def test_every_field_exported_in_base_units(fake):
    gpu = FakeGpu(
        uuid="GPU-1111", name="NVIDIA H100 80GB HBM3", memory_total=80 * GiB, memory_used=30 * GiB,
        memory_reserved=700 * MiB, util_gpu=37, util_memory=12, power_mw=412_345, power_limit_mw=700_000,
        energy_mj=9_000_000, energy_step_mj=2_500, temp_gpu=63, temp_memory=71, sm_clock_mhz=1410,
        sm_clock_max_mhz=1980, mem_clock_mhz=1593, mem_clock_max_mhz=2619,
        reasons=F.nvmlClocksEventReasonSwPowerCap | F.nvmlClocksEventReasonGpuIdle,
        violation_ns={p: (i + 1) * 250_000_000 for i, p in enumerate(F.ALL_POLICIES)},
        ecc_corrected=3, ecc_uncorrected=1, remapped_rows=(2, 1, 0, 1),
    )
    F.reset([gpu])
    s = make()
    first = await s.sample()
    out = await s.sample()
    await s.aclose()
    L = {"gpu": "0", "uuid": "GPU-1111"}
    info = [x for x in out if x.name == "soakd_gpu_info"]
    assert [(x.labels, x.value) for x in info] == [
        ((("gpu", "0"), ("uuid", "GPU-1111"), ("name", "NVIDIA H100 80GB HBM3")), 1.0)
    ]
    assert value(out, "soakd_gpu_memory_used_bytes", **L) == 30 * GiB  # v2: allocated, without reserved
    assert value(out, "soakd_gpu_memory_reserved_bytes", **L) == 700 * MiB
    assert value(out, "soakd_gpu_memory_total_bytes", **L) == 80 * GiB
    assert value(out, "soakd_gpu_utilization_ratio", **L) == pytest.approx(0.37)
    assert value(out, "soakd_gpu_memory_utilization_ratio", **L) == pytest.approx(0.12)
    assert value(out, "soakd_gpu_power_watts", **L) == pytest.approx(412.345)
    assert value(out, "soakd_gpu_power_limit_watts", **L) == pytest.approx(700.0)
    # energy counts from soakd's first reading: 0, then one 2.5 J step
    assert value(first, "soakd_gpu_energy_joules_total", **L) == 0.0
    assert value(out, "soakd_gpu_energy_joules_total", **L) == pytest.approx(2.5)
    assert value(out, "soakd_gpu_temperature_celsius", sensor="gpu") == 63
    assert value(out, "soakd_gpu_temperature_celsius", sensor="memory") == 71
    assert value(out, "soakd_gpu_sm_clock_hertz", **L) == 1410e6
    assert value(out, "soakd_gpu_sm_clock_max_hertz", **L) == 1980e6
    assert value(out, "soakd_gpu_memory_clock_hertz", **L) == 1593e6
    assert value(out, "soakd_gpu_memory_clock_max_hertz", **L) == 2619e6
    active = {x.label("reason"): x.value for x in out if x.name == "soakd_gpu_clocks_event_active"}
    assert active == {r: (1.0 if r in ("sw_power_cap", "idle") else 0.0) for r in CLOCK_EVENT_REASON_LABELS}
    throttle = {x.label("reason"): x.value for x in out if x.name == "soakd_gpu_throttle_seconds_total"}
    assert throttle == {r: pytest.approx((i + 1) * 0.25) for i, r in enumerate(THROTTLE_REASON_LABELS)}  # ns -> s
    assert value(out, "soakd_gpu_ecc_errors_total", kind="corrected") == 3
    assert value(out, "soakd_gpu_ecc_errors_total", kind="uncorrected") == 1
    rows = {x.label("kind"): x.value for x in out if x.name == "soakd_gpu_remapped_rows"}
    assert rows == {"correctable": 2, "uncorrectable": 1, "pending": 0, "failure": 1}
    assert value(out, "soakd_gpu_xid_errors_total", **L) == 0
    assert value(out, "soakd_gpu_last_xid", **L) == 0
    assert value(out, "soakd_target_gpu_memory_used_bytes") is None  # no target_pids given


async def test_series_follow_the_catalogue(fake):
    s = make(target_pids=lambda: {7})
    F.scenario.gpus[0].processes = [(7, GiB)]
    out = await s.sample()
    await s.aclose()
    by_key(out)  # no duplicate series
    names = set()
    for x in out:
        spec = BY_NAME.get(x.name)
        assert spec is not None, f"{x.name} is not in the catalogue"
        assert spec.group == "device"
        assert tuple(k for k, _ in x.labels) == spec.labels, x
        assert (spec.kind == "counter") == x.name.endswith("_total")
        names.add(x.name)
    device = {m.name for m in BY_NAME.values() if m.group == "device"}
    assert names == device  # every device metric of the contract comes from NVML


async def test_exposition_through_the_snapshot_collector(fake):
    runner = SamplerRunner(make(), interval=1.0)
    assert await runner.run_once()
    registry = CollectorRegistry(auto_describe=False)

    class _C:
        def collect(self):
            return SnapshotCollector([runner])()

    registry.register(_C())
    get = registry.get_sample_value
    assert get("soakd_sampler_up", {"sampler": "nvml"}) == 1.0
    assert get("soakd_gpu_info", {"gpu": "1", "uuid": "GPU-bbbb", "name": "NVIDIA H200"}) == 1.0
    assert get("soakd_gpu_power_watts", {"gpu": "0", "uuid": "GPU-aaaa"}) == 300.0
    assert get("soakd_gpu_energy_joules_total", {"gpu": "1", "uuid": "GPU-bbbb"}) == 0.0
    assert get("soakd_gpu_clocks_event_active", {"gpu": "0", "uuid": "GPU-aaaa", "reason": "hw_thermal"}) == 0.0
    await runner.sampler.aclose()


# ---- clocks-event reasons


@pytest.mark.parametrize("label,constant", [(r[0], r[1]) for r in nvml_sampler.CLOCK_EVENT_REASONS])
async def test_each_reason_bit_decodes_to_its_label(fake, label, constant):
    F.scenario.gpus[0].reasons = getattr(F, constant)
    s = make(gpus=[0])
    out = await s.sample()
    await s.aclose()
    active = {x.label("reason"): x.value for x in out if x.name == "soakd_gpu_clocks_event_active"}
    assert set(active) == set(CLOCK_EVENT_REASON_LABELS)
    assert [r for r, v in active.items() if v == 1.0] == [label]


async def test_throttling_toggles_without_series_coming_and_going(fake):
    s = make(gpus=[0])
    gpu = F.scenario.gpus[0]
    seen = []
    for on in (False, True, True, False):
        gpu.throttle(on, seconds=2.0)
        out = await s.sample()
        active = {x.label("reason"): x.value for x in out if x.name == "soakd_gpu_clocks_event_active"}
        assert set(active) == set(CLOCK_EVENT_REASON_LABELS)
        seen.append((active["sw_power_cap"], active["hw_thermal"], value(out, "soakd_gpu_throttle_seconds_total",
                                                                         reason="power")))
    await s.aclose()
    assert seen == [(0.0, 0.0, 0.0), (1.0, 1.0, 2.0), (1.0, 1.0, 4.0), (0.0, 0.0, 4.0)]


async def test_reasons_fall_back_to_the_deprecated_throttle_call(fake):
    gpu = F.scenario.gpus[0]
    gpu.missing.add("nvmlDeviceGetCurrentClocksEventReasons")  # an older driver
    gpu.reasons = F.nvmlClocksThrottleReasonHwSlowdown
    s = make(gpus=[0])
    for _ in range(2):
        out = await s.sample()
        assert value(out, "soakd_gpu_clocks_event_active", reason="hw_slowdown") == 1.0
    await s.aclose()
    assert F.scenario.calls["nvmlDeviceGetCurrentClocksEventReasons"] == 1  # not retried
    assert F.scenario.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 2


async def test_an_older_nvidia_ml_py_without_the_new_names(fake):
    old = module_without("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetTemperatureV", "nvmlMemory_v2",
                         *[r[1] for r in nvml_sampler.CLOCK_EVENT_REASONS])
    F.scenario.gpus[0].reasons = F.nvmlClocksThrottleReasonSwThermalSlowdown
    s = make(gpus=[0], module=old)
    out = await s.sample()
    await s.aclose()
    assert value(out, "soakd_gpu_clocks_event_active", reason="sw_thermal") == 1.0
    assert value(out, "soakd_gpu_temperature_celsius", sensor="gpu") == 60
    gpu = F.scenario.gpus[0]
    assert value(out, "soakd_gpu_memory_used_bytes") == gpu.memory_used + gpu.memory_reserved  # v1 used
    assert value(out, "soakd_gpu_memory_reserved_bytes") is None


def test_reason_tables_agree_with_the_shared_reason_module():
    assert CLOCK_EVENT_REASON_LABELS == reasons.CLOCKS_EVENT_REASON_NAMES
    assert dict(reasons.CLOCKS_EVENT_REASONS) == {r[0]: getattr(F, r[1]) for r in nvml_sampler.CLOCK_EVENT_REASONS}
    assert {r[0]: getattr(F, r[1]) for r in nvml_sampler.CLOCK_EVENT_REASONS} == {
        r[0]: getattr(F, r[2]) for r in nvml_sampler.CLOCK_EVENT_REASONS}
    assert [(label, policy) for label, policy, _ in reasons.VIOLATION_REASONS] == [
        (label, getattr(F, constant)) for label, constant in nvml_sampler.THROTTLE_POLICIES]


# ---- fallbacks and per-field tolerance


async def test_memory_info_falls_back_to_v1(fake):
    gpu = F.scenario.gpus[0]
    gpu.missing.add("nvmlDeviceGetMemoryInfo_v2")
    s = make(gpus=[0])
    await s.sample()
    out = await s.sample()
    await s.aclose()
    assert value(out, "soakd_gpu_memory_used_bytes") == gpu.memory_used + gpu.memory_reserved
    assert value(out, "soakd_gpu_memory_total_bytes") == gpu.memory_total
    assert value(out, "soakd_gpu_memory_reserved_bytes") is None
    assert F.scenario.calls["nvmlDeviceGetMemoryInfo"] == 3  # v2 once, then v1 twice


async def test_memory_growth_is_visible_per_sample(fake):
    gpu = F.scenario.gpus[0]
    gpu.memory_growth = 64 * MiB
    s = make(gpus=[0])
    used = [value(await s.sample(), "soakd_gpu_memory_used_bytes") for _ in range(3)]
    await s.aclose()
    assert [b - a for a, b in zip(used, used[1:], strict=False)] == [64 * MiB, 64 * MiB]


async def test_temperature_falls_back_to_the_deprecated_call(fake):
    F.scenario.gpus[0].unsupported.add("nvmlDeviceGetTemperatureV")
    s = make(gpus=[0])
    for _ in range(3):
        assert value(await s.sample(), "soakd_gpu_temperature_celsius", sensor="gpu") == 60
    await s.aclose()
    assert F.scenario.calls["nvmlDeviceGetTemperatureV"] == 1
    assert F.scenario.calls["nvmlDeviceGetTemperature"] == 3


@pytest.mark.parametrize("value_type", [F.NVML_VALUE_TYPE_UNSIGNED_INT, F.NVML_VALUE_TYPE_SIGNED_INT,
                                        F.NVML_VALUE_TYPE_DOUBLE, F.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG])
async def test_memory_temperature_reads_the_union_member_of_its_type(fake, value_type):
    F.scenario.gpus[0].temp_memory = 84
    F.scenario.gpus[0].temp_memory_value_type = value_type
    s = make(gpus=[0])
    out = await s.sample()
    await s.aclose()
    assert value(out, "soakd_gpu_temperature_celsius", sensor="memory") == 84


async def test_memory_temperature_unsupported_is_asked_once(fake):
    F.scenario.gpus[0].temp_memory = None  # the field answers NVML_ERROR_NOT_SUPPORTED
    s = make(gpus=[0])
    for _ in range(3):
        out = await s.sample()
        assert value(out, "soakd_gpu_temperature_celsius", sensor="memory") is None
        assert value(out, "soakd_gpu_temperature_celsius", sensor="gpu") == 60
    await s.aclose()
    assert F.scenario.calls["nvmlDeviceGetFieldValues"] == 1


async def test_not_supported_fields_are_dropped_alone_and_logged_once(fake):
    gpu = F.scenario.gpus[0]
    gpu.unsupported |= {"nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRemappedRows"}
    gpu.missing.add("nvmlDeviceGetTotalEnergyConsumption")  # FunctionNotFound: an older driver
    gpu.violation_ns = {F.NVML_PERF_POLICY_POWER: 5_000_000_000}  # every other policy: NotSupported
    s = make(gpus=[0])
    with capture_logs() as logs:
        for _ in range(3):
            out = await s.sample()
    await s.aclose()
    names = {x.name for x in out}
    assert {"soakd_gpu_power_watts", "soakd_gpu_energy_joules_total", "soakd_gpu_ecc_errors_total",
            "soakd_gpu_remapped_rows"}.isdisjoint(names)
    assert value(out, "soakd_gpu_power_limit_watts") == 700.0
    assert value(out, "soakd_gpu_memory_used_bytes") == gpu.memory_used
    assert {x.label("reason"): x.value for x in out if x.name == "soakd_gpu_throttle_seconds_total"} == {"power": 5.0}
    for function in ("nvmlDeviceGetPowerUsage", "nvmlDeviceGetRemappedRows", "nvmlDeviceGetTotalEnergyConsumption"):
        assert F.scenario.calls[function] == 1, function
    assert F.scenario.calls["nvmlDeviceGetTotalEccErrors"] == 2  # corrected + uncorrected, once each
    assert F.scenario.calls["nvmlDeviceGetViolationStatus"] == 8 + 2  # every policy once, then power only
    logged = events(logs, "nvml_calls_unsupported")
    assert len(logged) == 1 and logged[0]["log_level"] == "info"
    assert "nvmlDeviceGetPowerUsage" in logged[0]["calls"]
    assert not [e for e in logs if e["log_level"] in ("warning", "error")]


async def test_other_errors_skip_the_field_for_one_run(fake):
    gpu = F.scenario.gpus[0]
    gpu.errors["nvmlDeviceGetPowerUsage"] = F.NVML_ERROR_TIMEOUT
    s = make(gpus=[0])
    out = await s.sample()
    assert value(out, "soakd_gpu_power_watts") is None
    assert value(out, "soakd_gpu_temperature_celsius", sensor="gpu") == 60
    del gpu.errors["nvmlDeviceGetPowerUsage"]
    assert value(await s.sample(), "soakd_gpu_power_watts") == 300.0
    await s.aclose()


# ---- energy


async def test_energy_counter_survives_a_driver_reload(fake):
    gpu = F.scenario.gpus[0]
    gpu.energy_mj = 1_000_000
    s = make(gpus=[0])
    readings = []
    for step in (0, 500_000, 250_000):
        gpu.energy_mj += step
        readings.append(value(await s.sample(), "soakd_gpu_energy_joules_total"))
    F.scenario.driver_reload()  # the raw counter restarts from zero
    gpu.energy_mj = 100_000
    readings.append(value(await s.sample(), "soakd_gpu_energy_joules_total"))
    gpu.energy_mj += 400_000
    readings.append(value(await s.sample(), "soakd_gpu_energy_joules_total"))
    await s.aclose()
    assert readings == [0.0, 500.0, 750.0, 850.0, 1250.0]
    assert readings == sorted(readings)


# ---- no NVML, no GPU


@pytest.mark.parametrize("code,needles", [
    (F.NVML_ERROR_LIBRARY_NOT_FOUND, ("libnvidia-ml.so.1", "NVIDIA_VISIBLE_DEVICES", "dcgm")),
    (F.NVML_ERROR_DRIVER_NOT_LOADED, ("kernel driver is not loaded", "dcgm")),
    (F.NVML_ERROR_NO_PERMISSION, ("/dev/nvidia", "permission")),
    (F.NVML_ERROR_LIB_RM_VERSION_MISMATCH, ("different versions",)),
    (F.NVML_ERROR_UNKNOWN, ("nvmlInit failed", "NVMLError_Unknown")),
])
async def test_init_failures_are_unavailable_with_advice(fake, code, needles):
    F.scenario.init_error = code
    s = make()
    with pytest.raises(SamplerUnavailable) as err:
        await s.sample()
    for needle in needles:
        assert needle in str(err.value)
    await s.aclose()


async def test_no_gpu_is_unavailable_and_nvml_is_released(fake):
    F.reset([])
    s = make()
    with pytest.raises(SamplerUnavailable, match="sees no GPU"):
        await s.sample()
    assert F.scenario.inits == 1 and F.scenario.refcount == 0  # nvmlShutdown balanced the nvmlInit
    await s.aclose()


async def test_import_failure_is_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    s = NvmlSampler(NvmlSamplerConfig())
    with pytest.raises(SamplerUnavailable, match="nvidia-ml-py is not installed"):
        await s.sample()
    await s.aclose()


async def test_imports_pynvml_lazily(fake, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", F)
    s = NvmlSampler(NvmlSamplerConfig())
    assert F.scenario.calls == {}  # nothing at construction
    out = await s.sample()
    assert gpus_in(out) == {"GPU-aaaa", "GPU-bbbb"}
    await s.aclose()


async def test_library_not_found_via_the_runner_warns_once_and_recovers(fake):
    F.scenario.init_error = F.NVML_ERROR_LIBRARY_NOT_FOUND
    runner = SamplerRunner(make(), interval=1.0)
    with capture_logs() as logs:
        results = [await runner.run_once() for _ in range(4)]
    assert results == [False] * 4
    assert runner.up is False and runner.errors == 4
    warnings = [e for e in logs if e["log_level"] in ("warning", "error")]
    assert len(warnings) == 1, warnings
    assert warnings[0]["event"] == "sampler_unavailable" and "libnvidia-ml.so.1" in warnings[0]["reason"]
    fams = {f.name: f for f in SnapshotCollector([runner])()}
    assert [(s.labels, s.value) for s in fams["soakd_sampler_up"].samples] == [({"sampler": "nvml"}, 0.0)]
    assert not [n for n in fams if n.startswith("soakd_gpu")]
    F.scenario.init_error = None  # the GPU shows up: init is retried every run
    with capture_logs() as logs:
        assert await runner.run_once()
    assert runner.up is True
    assert events(logs, "sampler_up")
    assert gpus_in(runner.snapshot.series) == {"GPU-aaaa", "GPU-bbbb"}
    await runner.sampler.aclose()


async def test_mode_on_logs_an_error_once(fake):
    F.scenario.init_error = F.NVML_ERROR_DRIVER_NOT_LOADED
    s = NvmlSampler(NvmlSamplerConfig(mode="on"), nvml_module=F)
    with capture_logs() as logs:
        for _ in range(3):
            with pytest.raises(SamplerUnavailable):
                await s.sample()
    assert len(events(logs, "nvml_required_but_unavailable")) == 1
    await s.aclose()


async def test_mode_off_never_touches_nvml(fake):
    s = NvmlSampler(NvmlSamplerConfig(mode="off"), nvml_module=F)
    with pytest.raises(SamplerUnavailable, match="off"):
        await s.sample()
    assert F.scenario.calls == {}


# ---- GPUs lost mid-run


async def test_gpu_lost_mid_run(fake):
    a, b = F.scenario.gpus
    a.energy_step_mj = b.energy_step_mj = 1000
    runner = SamplerRunner(make(), interval=1.0)
    with capture_logs() as logs:
        assert await runner.run_once()
        assert gpus_in(runner.snapshot.series) == {"GPU-aaaa", "GPU-bbbb"}

        b.lost = True  # one of two: the other is still sampled, the lost one's series disappear
        for _ in range(2):
            assert await runner.run_once()
            assert gpus_in(runner.snapshot.series) == {"GPU-aaaa"}
            assert not [s for s in runner.snapshot.series if s.label("gpu") == "1"]
        lost = events(logs, "nvml_gpu_lost")
        assert len(lost) == 1 and lost[0]["uuid"] == "GPU-bbbb" and lost[0]["log_level"] == "warning"

        a.lost = True  # the last one: the run fails, NVML is released for a fresh init
        assert not await runner.run_once()
        assert runner.up is False and "GpuIsLost" not in runner.last_error and "GPU is lost" in runner.last_error
        assert F.scenario.refcount == 0
        assert not await runner.run_once()  # still gone: still down (re-init finds no GPU)
        assert runner.up is False

        a.lost = b.lost = False  # back (after a reset)
        assert await runner.run_once()
        assert runner.up is True
        assert gpus_in(runner.snapshot.series) == {"GPU-aaaa", "GPU-bbbb"}
    assert len(events(logs, "nvml_gpu_lost")) == 2
    assert {e["uuid"] for e in events(logs, "nvml_gpu_back")} == {"GPU-aaaa", "GPU-bbbb"}
    assert len(events(logs, "sampler_down")) == 1 and len(events(logs, "sampler_up")) == 1
    assert F.scenario.inits == 3  # first start, a re-init that found no GPU yet, the recovery
    assert F.scenario.refcount == 1  # every failed init was shut down again
    # energy kept counting across the re-init (one step per successful read of a)
    energy = value(runner.snapshot.series, "soakd_gpu_energy_joules_total", uuid="GPU-aaaa")
    assert energy == pytest.approx(3.0)
    await runner.sampler.aclose()
    assert F.scenario.refcount == 0


@pytest.mark.parametrize("code", [F.NVML_ERROR_UNKNOWN, F.NVML_ERROR_RESET_REQUIRED])
async def test_other_lost_errors_drop_the_gpu(fake, code):
    F.scenario.gpus[1].errors["nvmlDeviceGetMemoryInfo"] = code
    s = make()
    out = await s.sample()
    assert gpus_in(out) == {"GPU-aaaa"}
    await s.aclose()


async def test_gpu_lost_at_start_is_picked_up_later(fake):
    F.scenario.gpus[1].lost = True
    s = make()
    with capture_logs() as logs:
        assert gpus_in(await s.sample()) == {"GPU-aaaa"}
        assert gpus_in(await s.sample()) == {"GPU-aaaa"}
        F.scenario.gpus[1].lost = False
        assert gpus_in(await s.sample()) == {"GPU-aaaa", "GPU-bbbb"}
    assert len(events(logs, "nvml_gpus_unavailable")) == 1
    await s.aclose()


# ---- Xid events


async def test_xid_events_are_counted_per_gpu(fake):
    a, b = F.scenario.gpus
    s = make()
    out = await s.sample()
    assert value(out, "soakd_gpu_xid_errors_total", uuid="GPU-aaaa") == 0
    a.xid(79)
    b.xid(48)
    b.xid(94)
    with capture_logs() as logs:
        out = await s.sample()
    assert value(out, "soakd_gpu_xid_errors_total", uuid="GPU-aaaa") == 1
    assert value(out, "soakd_gpu_last_xid", uuid="GPU-aaaa") == 79
    assert value(out, "soakd_gpu_xid_errors_total", uuid="GPU-bbbb") == 2
    assert value(out, "soakd_gpu_last_xid", uuid="GPU-bbbb") == 94
    assert sorted(e["xid"] for e in events(logs, "gpu_xid_error")) == [48, 79, 94]
    out = await s.sample()  # counters hold
    assert value(out, "soakd_gpu_xid_errors_total", uuid="GPU-bbbb") == 2
    await s.aclose()
    assert all(es.freed for es in F.scenario.event_sets)


async def test_xid_draining_is_bounded_per_run(fake):
    s = make(gpus=[0])
    for _ in range(nvml_sampler.MAX_XIDS_PER_SAMPLE + 6):
        F.scenario.gpus[0].xid(13)
    with capture_logs():
        first = value(await s.sample(), "soakd_gpu_xid_errors_total")
        second = value(await s.sample(), "soakd_gpu_xid_errors_total")
    assert (first, second) == (nvml_sampler.MAX_XIDS_PER_SAMPLE, nvml_sampler.MAX_XIDS_PER_SAMPLE + 6)
    await s.aclose()


async def test_xid_registration_unsupported_leaves_the_rest(fake):
    F.scenario.gpus[1].unsupported.add("nvmlDeviceRegisterEvents")
    s = make()
    out = await s.sample()
    await s.aclose()
    assert value(out, "soakd_gpu_xid_errors_total", uuid="GPU-aaaa") == 0
    assert value(out, "soakd_gpu_xid_errors_total", uuid="GPU-bbbb") is None
    assert value(out, "soakd_gpu_power_watts", uuid="GPU-bbbb") == 300.0


# ---- target processes


async def test_target_process_memory(fake):
    a, b = F.scenario.gpus
    a.processes = [(100, 3 * GiB), (101, GiB), (555, 7 * GiB)]  # 555 is someone else
    b.processes = [(100, None)]  # NVML_VALUE_NOT_AVAILABLE (e.g. in a container): nothing to report
    s = make(target_pids=lambda: {100, 101})
    out = await s.sample()
    await s.aclose()
    assert value(out, "soakd_target_gpu_memory_used_bytes", uuid="GPU-aaaa") == 4 * GiB
    assert value(out, "soakd_target_gpu_memory_used_bytes", uuid="GPU-bbbb") is None


async def test_target_process_memory_only_when_asked_and_matching(fake):
    F.scenario.gpus[0].processes = [(5, GiB)]
    s = make(gpus=[0])
    assert value(await s.sample(), "soakd_target_gpu_memory_used_bytes") is None
    assert F.scenario.calls["nvmlDeviceGetComputeRunningProcesses_v3"] == 0  # not even asked
    await s.aclose()
    s = make(gpus=[0], target_pids=lambda: {6})  # the target's PIDs are not NVML's (another PID namespace)
    assert value(await s.sample(), "soakd_target_gpu_memory_used_bytes") is None
    await s.aclose()


async def test_process_list_on_a_mismatched_driver_is_unsupported(fake):
    F.scenario.gpus[0].missing.add("nvmlDeviceGetComputeRunningProcesses_v3")  # -> NVMLLibraryMismatchError
    s = make(gpus=[0], target_pids=lambda: {5})
    out = await s.sample()
    await s.sample()
    await s.aclose()
    assert value(out, "soakd_gpu_power_watts") == 300.0
    assert F.scenario.calls["nvmlDeviceGetComputeRunningProcesses_v3"] == 1


# ---- GPU selection


@pytest.mark.parametrize("selection,expected", [
    ([1], {("1", "GPU-bbbb")}),
    (["1"], {("1", "GPU-bbbb")}),
    (["GPU-bbbb"], {("1", "GPU-bbbb")}),
    ([0, "GPU-aaaa"], {("0", "GPU-aaaa")}),  # the same GPU twice
    (["GPU-bbbb", 0], {("0", "GPU-aaaa"), ("1", "GPU-bbbb")}),
])
async def test_gpu_selection(fake, selection, expected):
    s = make(gpus=selection)
    out = await s.sample()
    await s.aclose()
    assert {(x.label("gpu"), x.label("uuid")) for x in out} == expected


async def test_a_missing_selected_gpu_is_warned_about(fake):
    s = make(gpus=[0, "GPU-nope"])
    with capture_logs() as logs:
        assert gpus_in(await s.sample()) == {"GPU-aaaa"}
        assert gpus_in(await s.sample()) == {"GPU-aaaa"}
    warned = events(logs, "nvml_gpus_unavailable")
    assert len(warned) == 1 and "UUID GPU-nope: Not Found" in warned[0]["problems"]
    await s.aclose()


async def test_no_selected_gpu_found_is_unavailable(fake):
    s = make(gpus=[5, "GPU-nope"])
    with pytest.raises(SamplerUnavailable, match=r"samplers.nvml.gpus.*NVML sees 2 GPU"):
        await s.sample()
    assert F.scenario.refcount == 0
    await s.aclose()


# ---- threads and lifecycle


async def test_nvml_is_called_off_the_event_loop(fake):
    loop_thread = threading.get_ident()
    s = make(target_pids=lambda: {1})
    F.scenario.gpus[0].xid(31)
    with capture_logs():
        await s.sample()
    await s.aclose()
    assert F.scenario.calls["nvmlInitWithFlags"] == 1 and F.scenario.calls["nvmlShutdown"] == 1
    assert F.scenario.calls["nvmlEventSetWait_v2"] >= 2
    assert F.scenario.threads and loop_thread not in F.scenario.threads


async def test_aclose_releases_nvml_and_stops_sampling(fake):
    s = make()
    await s.sample()
    await s.aclose()
    assert F.scenario.refcount == 0 and all(es.freed for es in F.scenario.event_sets)
    with pytest.raises(SamplerUnavailable, match="closed"):
        await s.sample()
    await s.aclose()  # twice is fine
    assert F.scenario.shutdowns == 1


async def test_a_hanging_call_does_not_stack_runs(fake, monkeypatch):
    release = threading.Event()
    real = F.nvmlDeviceGetPowerUsage

    def hanging(handle):
        release.wait(5.0)
        return real(handle)

    monkeypatch.setattr(F, "nvmlDeviceGetPowerUsage", hanging)
    runner = SamplerRunner(make(gpus=[0]), interval=1.0, timeout=0.2)
    assert not await runner.run_once()
    assert "timed out" in runner.last_error
    assert not await runner.run_once()
    assert "still going" in runner.last_error
    release.set()
    for _ in range(50):  # the stuck run finishes in its thread, then runs succeed again
        if await runner.run_once():
            break
        await asyncio.sleep(0.02)
    assert runner.up is True
    await runner.sampler.aclose()


# ---- the fake against the real nvidia-ml-py


@pytest.fixture
def real_pynvml():
    real = pytest.importorskip("pynvml")
    assert real is not F and hasattr(real, "_extractNVMLErrorsAsClasses")
    return real


NVML_NAME = re.compile(r"\b(nvml[A-Z]\w*|NVML_[A-Z0-9_]+|NVMLError\w*|NVMLLibraryMismatchError)\b")


STRUCT_FIELDS = {"nvmlReturn"}  # c_nvmlFieldValue_t.nvmlReturn: an attribute of a result, not of the module


def _names_in_sampler_source() -> set[str]:
    return set(NVML_NAME.findall(SAMPLER_SOURCE)) - STRUCT_FIELDS


def test_every_name_the_sampler_uses_exists_in_the_real_module_and_the_fake(real_pynvml):
    names = _names_in_sampler_source()
    assert {"nvmlDeviceGetViolationStatus", "NVML_FI_DEV_MEMORY_TEMP", "nvmlEventSetWait_v2"} <= names
    assert sorted(n for n in names if not hasattr(real_pynvml, n)) == []
    assert sorted(n for n in names if not hasattr(F, n)) == []
    for n in names:
        real, fake = getattr(real_pynvml, n), getattr(F, n)
        if isinstance(real, int):
            assert fake == real, n
        elif isinstance(real, type):
            assert isinstance(fake, type) and fake.__name__ == real.__name__, n
        else:
            assert callable(real) and callable(fake), n


def test_fake_functions_have_the_real_signatures(real_pynvml):
    functions = [n for n in dir(F) if n.startswith("nvml") and inspect.isfunction(getattr(F, n))]
    assert len(functions) > 25
    for n in functions:
        real = getattr(real_pynvml, n, None)
        assert real is not None, f"{n} is not in nvidia-ml-py"
        real_params = [(p.name, p.default) for p in inspect.signature(real).parameters.values()]
        fake_params = [(p.name, p.default) for p in inspect.signature(getattr(F, n)).parameters.values()]
        assert fake_params == real_params, n


def test_fake_constants_have_the_real_values(real_pynvml):
    constants = [n for n in dir(F) if re.match(r"(NVML_|nvml[A-Z])", n) and isinstance(getattr(F, n), int)]
    assert len(constants) > 60
    for n in constants:
        assert getattr(real_pynvml, n) == getattr(F, n), n
    for n in ("NVML_VALUE_NOT_AVAILABLE_ulonglong", "NVML_VALUE_NOT_AVAILABLE_uint"):
        assert getattr(F, n).value == getattr(real_pynvml, n).value, n


def test_fake_structures_have_the_real_fields(real_pynvml):
    structs = [n for n in dir(F) if n.startswith("c_nvml") and isinstance(getattr(F, n), type)]
    assert {"c_nvmlMemory_t", "c_nvmlMemory_v2_t", "c_nvmlFieldValue_t", "c_nvmlViolationTime_t",
            "c_nvmlEventData_t", "c_nvmlProcessInfo_v3_t", "c_nvmlUtilization_t", "c_nvmlValue_t"} <= set(structs)
    for n in structs:
        assert [f[0] for f in getattr(F, n)._fields_] == [f[0] for f in getattr(real_pynvml, n)._fields_], n


def test_fake_exceptions_mirror_the_real_hierarchy(real_pynvml):
    real_codes = {n: getattr(real_pynvml, n) for n in dir(real_pynvml) if n.startswith("NVML_ERROR_")}
    fake_codes = {n: getattr(F, n) for n in dir(F) if n.startswith("NVML_ERROR_")}
    assert fake_codes == real_codes
    for code in real_codes.values():
        real_exc, fake_exc = real_pynvml.NVMLError(code), F.NVMLError(code)
        assert type(fake_exc).__name__ == type(real_exc).__name__
        assert isinstance(fake_exc, F.NVMLError) and fake_exc.value == real_exc.value == code
        assert isinstance(fake_exc, getattr(F, type(real_exc).__name__))
        if code in real_pynvml.NVMLError._errcode_to_string:
            assert str(fake_exc) == str(real_exc)
    assert F.NVMLError_NotSupported().value == real_pynvml.NVMLError_NotSupported().value
    assert issubclass(F.NVMLError_GpuIsLost, F.NVMLError) and issubclass(F.NVMLError, Exception)
    assert not issubclass(real_pynvml.NVMLLibraryMismatchError, real_pynvml.NVMLError)
    assert not issubclass(F.NVMLLibraryMismatchError, F.NVMLError)


class _Recording(types.ModuleType):
    """The fake, recording every attribute the sampler reads from the module."""

    def __init__(self, target: types.ModuleType) -> None:
        super().__init__("pynvml")
        self.__dict__["_target"] = target
        self.__dict__["used"] = set()

    def __getattr__(self, name: str) -> Any:
        self.__dict__["used"].add(name)
        return getattr(self.__dict__["_target"], name)


async def test_names_used_at_run_time_exist_in_the_real_module(real_pynvml):
    F.reset([FakeGpu(uuid="GPU-aaaa", processes=[(9, GiB)]),
             FakeGpu(uuid="GPU-bbbb", temp_memory=None,
                     missing={"nvmlDeviceGetTemperatureV", "nvmlDeviceGetCurrentClocksEventReasons",
                              "nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetComputeRunningProcesses_v3"})])
    recording = _Recording(F)
    s = NvmlSampler(NvmlSamplerConfig(gpus=[0, "GPU-bbbb", "GPU-nope"]), nvml_module=recording,
                    target_pids=lambda: {9})
    with capture_logs():
        F.scenario.gpus[0].xid(79)
        await s.sample()
        F.scenario.gpus[1].errors["nvmlDeviceGetPowerUsage"] = F.NVML_ERROR_TIMEOUT
        await s.sample()
        F.scenario.gpus[0].lost = F.scenario.gpus[1].lost = True
        with pytest.raises(RuntimeError):
            await s.sample()
        F.scenario.gpus[0].lost = F.scenario.gpus[1].lost = False
        await s.sample()
    await s.aclose()
    used = recording.used
    assert {"nvmlInit", "nvmlShutdown", "nvmlDeviceGetTemperature", "nvmlEventSetFree",
            "nvmlDeviceGetCurrentClocksThrottleReasons", "NVMLError_Timeout"} <= used
    assert sorted(n for n in used if not hasattr(real_pynvml, n)) == []
    assert used <= _names_in_sampler_source()  # the static check above covers every name


async def test_the_real_nvidia_ml_py(real_pynvml):
    """On a machine without the NVIDIA driver: unavailable with advice; with one: real readings."""
    s = NvmlSampler(NvmlSamplerConfig(), nvml_module=real_pynvml)
    try:
        out = await s.sample()
    except SamplerUnavailable as exc:
        assert "NVML is not available" in str(exc) or "no GPU" in str(exc)
        return
    finally:
        await s.aclose()
    assert [x for x in out if x.name == "soakd_gpu_info"]
    assert all(v > 0 for v in (value(out, "soakd_gpu_memory_total_bytes", gpu=x.label("gpu"))
                               for x in out if x.name == "soakd_gpu_info"))
    for x in out:
        assert tuple(k for k, _ in x.labels) == BY_NAME[x.name].labels

"""The simulated GPU(s) behind the simulated server, driven by the engine's load.

One :class:`SimDevice` models ``device.gpus`` H100-like GPUs of one tensor-parallel server. Every
GPU holds a shard of every KV block, so all of them follow the same load; only the temperature
differs a little (1 C per index, as neighbouring GPUs in a chassis do).

Model (``config.device``, ``config.faults``; the load comes from the current
:class:`~soakd.sim.model.SimModel`):

* memory used = ``memory_base`` + KV blocks held x bytes per block (+ the device-memory leak,
  ``faults.device_memory_leak_bytes_per_hour`` x uptime, + the memory steps,
  ``faults.device_memory_step_bytes`` every ``faults.device_memory_step_every`` of uptime, at most
  ``faults.device_memory_steps`` of them: a staircase at flat KV usage; both released by a restart);
  never above ``memory_total`` - ``memory_reserved``. Leaked KV blocks (``faults.kv_leak_*``) show up here
  too. (A real vLLM pre-allocates its whole KV cache at start; the simulator lets memory follow
  the blocks in use so that KV growth and leaks are visible in the device series.)
* utilisation = running requests / ``saturation_batch`` (capped at 100%); the memory-copy
  utilisation is 70% of it.
* power demand = ``idle_power_watts`` + ``power_per_request_watts`` x running requests; above the
  enforced limit (``power_limit_watts``, or ``faults.power_cap_watts`` during a power-cap
  episode) the power is held at the limit, ``sw_power_cap`` is set, the power violation counter
  runs and the SM clock scales down so that the dynamic power fits: clock ratio =
  (limit - idle) / (demand - idle).
* temperature: a first-order lag (``thermal_time_constant``) towards ``ambient_celsius`` +
  ``celsius_per_watt`` x power; during a thermal-throttling episode towards at least
  ``slowdown_celsius``. Memory (HBM) temperature reads 7 C above.
* thermal-throttling episode (``faults.thermal_throttle_*``): ``sw_thermal`` set (and
  ``hw_thermal`` when the ratio is 0.5 or less), thermal violation counter running, SM clock at
  ``thermal_throttle_clock_ratio`` x max, and the dynamic power scaled by the same ratio.
* ``idle`` is set while nothing runs. The SM clock stays at its maximum otherwise (also idle), so
  every dip is a throttle.
* :meth:`SimDevice.slowdown` (1 / clock ratio) multiplies every latency of the simulated server,
  so a soak sees latency rise while the GPU is throttled.

Readings average like the real sources: power and utilisation over about 1 s (NVML's power
reading on Hopper is a 1 s average), from the engine's exact load integrals between two readings;
energy integrates power; violation counters integrate the time spent throttled. Everything is
computed lazily when read (``reading``/``readings``), from the injectable ``clock``, so tests
advance a fake clock instead of sleeping. Reads may come from another thread (the NVML sampler's
worker): a lock serialises them.
"""

from __future__ import annotations

import math
import random
import socket
import threading
import time
import uuid as uuidlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from soakd.config.sim import SimConfig
from soakd.core.reasons import CLOCKS_EVENT_REASONS


class Engine(Protocol):
    """What the device reads of the simulated engine (``soakd.sim.model.SimModel``)."""

    running: int
    kv_held: int
    started: float

    def load_integrals(self, now: float) -> tuple[float, float]: ...


__all__ = [
    "DRIVER_VERSION",
    "GpuReading",
    "SimDevice",
    "dcgm_exposition",
]

_BITS = dict(CLOCKS_EVENT_REASONS)
IDLE = _BITS["idle"]
SW_POWER_CAP = _BITS["sw_power_cap"]
SW_THERMAL = _BITS["sw_thermal"]
HW_THERMAL = _BITS["hw_thermal"]

DRIVER_VERSION = "580.95.05"  # what the fake NVML's nvmlSystemGetDriverVersion says too
AVERAGING_SECONDS = 1.0  # power and utilisation readings: ~1 s averages
MEMORY_TEMP_OFFSET = 7.0
MEMORY_UTIL_SHARE = 0.7
MIN_CLOCK_RATIO = 0.1  # a power cap never slows the clock below this
MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU's state at one instant, in plain units (bytes, %, W, mJ, C, MHz, ns)."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str
    memory_total: int
    memory_reserved: int
    memory_used: int  # allocated, without the reserved part (NVML v2 ``used``)
    utilization: float  # %
    memory_utilization: float  # %
    power_watts: float
    power_limit_watts: float  # enforced
    power_management_limit_watts: float
    energy_mj: int  # since the device was created ("driver load")
    temperature_celsius: float
    memory_temperature_celsius: float
    sm_clock_mhz: int
    sm_clock_max_mhz: int
    memory_clock_mhz: int
    reasons: int  # NVML clocks-event bitmask
    power_violation_ns: int
    thermal_violation_ns: int

    @property
    def memory_free(self) -> int:
        return max(0, self.memory_total - self.memory_reserved - self.memory_used)


@dataclass(frozen=True, slots=True)
class _Identity:
    index: int
    uuid: str
    pci_bus_id: str


class SimDevice:
    """The simulated GPU(s); ``model`` returns the server's current engine state (or None while
    there is none), so the device outlives simulated restarts."""

    def __init__(
        self,
        config: SimConfig,
        model: Callable[[], Engine | None],
        *,
        clock: Callable[[], float] = time.monotonic,
        hostname: str | None = None,
    ) -> None:
        self.config = config
        self.dev = config.device
        self.faults = config.faults
        self._get_model = model
        self.clock = clock
        self.started = clock()
        self.kv_block_bytes = self.dev.block_bytes(config.kv_blocks_total)
        self.hostname = hostname or socket.gethostname() or "soakd-sim"
        rng = random.Random(config.seed * 104729 + 17)
        self.gpus = [
            _Identity(
                i,
                "GPU-" + str(uuidlib.UUID(int=rng.getrandbits(128), version=4)),
                f"00000000:{0x18 + 0x11 * i:02X}:00.0",
            )
            for i in range(self.dev.gpus)
        ]
        self._lock = threading.Lock()
        self._t = self.started
        self._model_seen: Engine | None = None
        self._integrals = (0.0, 0.0)
        dev = self.dev
        self.power = dev.idle_power_watts  # ~1 s average
        self.utilization = 0.0  # 0-1, ~1 s average
        self.temperature = dev.ambient_celsius + dev.celsius_per_watt * dev.idle_power_watts
        self.energy_j = 0.0
        self.power_violation_s = 0.0
        self.thermal_violation_s = 0.0
        self._power_ratio = 1.0  # of the last interval

    # ---- episodes (times relative to the device's start)

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    def _episodes(self) -> list[tuple[float, float]]:
        f, out = self.faults, []
        if f.thermal_throttle_at is not None:
            out.append((f.thermal_throttle_at, f.thermal_throttle_at + f.thermal_throttle_duration))
        if f.power_cap_at is not None:
            out.append((f.power_cap_at, f.power_cap_at + f.power_cap_duration))
        return out

    def thermal_throttled(self, now: float) -> bool:
        f = self.faults
        if f.thermal_throttle_at is None:
            return False
        up = now - self.started
        return f.thermal_throttle_at <= up < f.thermal_throttle_at + f.thermal_throttle_duration

    def power_capped(self, now: float) -> bool:
        """Whether a power-cap episode is on (the enforced limit is lowered), binding or not."""
        f = self.faults
        if f.power_cap_at is None:
            return False
        up = now - self.started
        return f.power_cap_at <= up < f.power_cap_at + f.power_cap_duration

    def thermal_ratio(self, now: float) -> float:
        return self.faults.thermal_throttle_clock_ratio if self.thermal_throttled(now) else 1.0

    def enforced_limit(self, now: float) -> float:
        return self.faults.power_cap_watts if self.power_capped(now) else self.dev.power_limit_watts

    def _power_ratio_for(self, running: float, thermal: float, limit: float) -> float:
        """Clock ratio the power limit imposes on a batch of ``running`` (1.0 when it fits)."""
        dynamic = self.dev.power_per_request_watts * running * thermal
        headroom = limit - self.dev.idle_power_watts
        if dynamic <= 0 or dynamic <= headroom:
            return 1.0
        return max(MIN_CLOCK_RATIO, headroom / dynamic)

    def clock_ratio(self, now: float | None = None) -> float:
        """SM clock / max clock now, for the batch running now."""
        now = self.clock() if now is None else now
        model = self._get_model()
        running = model.running if model is not None else 0
        thermal = self.thermal_ratio(now)
        return thermal * self._power_ratio_for(running, thermal, self.enforced_limit(now))

    def slowdown(self) -> float:
        """Latency multiplier of the simulated server: 1 / clock ratio (1.0 when not throttled)."""
        return 1.0 / self.clock_ratio()

    # ---- integration

    def advance(self, now: float | None = None) -> None:
        """Integrate power, energy, temperature and violations up to ``now``."""
        now = self.clock() if now is None else now
        with self._lock:
            self._advance(now)

    def _advance(self, now: float) -> None:
        t0 = self._t
        dt = now - t0
        if dt <= 0:
            return
        model = self._get_model()
        if model is not self._model_seen:  # first reading, or a restarted server: fresh integrals
            self._model_seen = model
            self._integrals = (0.0, 0.0)
        if model is not None:
            request_seconds, busy_seconds = model.load_integrals(now)
        else:
            request_seconds, busy_seconds = self._integrals
        running = max(0.0, (request_seconds - self._integrals[0]) / dt)  # average batch
        self._integrals = (request_seconds, busy_seconds)
        cuts = sorted({t0, now} | {self.started + b for ep in self._episodes() for b in ep
                                   if t0 < self.started + b < now})
        for a, b in zip(cuts, cuts[1:], strict=False):
            self._step(a, b, running)
        self._t = now

    def _step(self, a: float, b: float, running: float) -> None:
        """One stretch with constant episodes and an average batch of ``running``."""
        dev = self.dev
        seg, mid = b - a, (a + b) / 2
        thermal_on = self.thermal_throttled(mid)
        thermal = self.thermal_ratio(mid)
        ratio = self._power_ratio_for(running, thermal, self.enforced_limit(mid))
        self._power_ratio = ratio
        power = dev.idle_power_watts + dev.power_per_request_watts * running * thermal * ratio
        self.energy_j += power * seg
        if ratio < 1.0:
            self.power_violation_s += seg
        if thermal_on:
            self.thermal_violation_s += seg
        k = -math.expm1(-seg / AVERAGING_SECONDS)
        self.power += (power - self.power) * k
        util = min(1.0, running / dev.saturation_batch)
        self.utilization += (util - self.utilization) * k
        target = dev.ambient_celsius + dev.celsius_per_watt * power
        if thermal_on:
            target = max(target, dev.slowdown_celsius)
        self.temperature += (target - self.temperature) * -math.expm1(-seg / dev.thermal_time_constant)

    # ---- readings

    def memory_used(self, now: float | None = None) -> int:
        """Allocated device memory per GPU (bytes, without the driver-reserved part)."""
        now = self.clock() if now is None else now
        dev = self.dev
        used = dev.memory_base
        model = self._get_model()
        if model is not None:
            used += model.kv_held * self.kv_block_bytes
            rate = self.faults.device_memory_leak_bytes_per_hour
            if rate:
                used += int(rate * max(0.0, now - model.started) / 3600.0)
            used += self.memory_steps(now, model.started) * int(self.faults.device_memory_step_bytes)
        return int(min(used, dev.memory_total - dev.memory_reserved))

    def memory_steps(self, now: float, started: float) -> int:
        """Memory steps taken by ``now`` by a server up since ``started`` (``faults.device_memory_step_*``)."""
        f = self.faults
        if not f.device_memory_step_bytes or not f.device_memory_step_every:
            return 0
        k = int(max(0.0, now - started) // f.device_memory_step_every)
        return min(k, f.device_memory_steps) if f.device_memory_steps is not None else k

    def reasons(self, now: float | None = None) -> int:
        """The NVML clocks-event bitmask now."""
        now = self.clock() if now is None else now
        model = self._get_model()
        bits = 0
        if model is None or model.running == 0:
            bits |= IDLE
        if self.thermal_throttled(now):
            bits |= SW_THERMAL
            if self.faults.thermal_throttle_clock_ratio <= 0.5:
                bits |= HW_THERMAL
        if self._power_ratio < 1.0:
            bits |= SW_POWER_CAP
        return bits

    def reading(self, index: int, now: float | None = None) -> GpuReading:
        """GPU ``index`` now (integrating up to now first)."""
        now = self.clock() if now is None else now
        with self._lock:
            self._advance(now)
            return self._reading(self.gpus[index], now)

    def readings(self, now: float | None = None) -> list[GpuReading]:
        """Every GPU now, from one consistent state."""
        now = self.clock() if now is None else now
        with self._lock:
            self._advance(now)
            return [self._reading(g, now) for g in self.gpus]

    def _reading(self, gpu: _Identity, now: float) -> GpuReading:
        dev = self.dev
        temp = self.temperature + gpu.index
        util = 100.0 * self.utilization
        ratio = self.thermal_ratio(now) * self._power_ratio
        return GpuReading(
            index=gpu.index,
            uuid=gpu.uuid,
            name=dev.name,
            pci_bus_id=gpu.pci_bus_id,
            memory_total=int(dev.memory_total),
            memory_reserved=int(dev.memory_reserved),
            memory_used=self.memory_used(now),
            utilization=util,
            memory_utilization=util * MEMORY_UTIL_SHARE,
            power_watts=self.power,
            power_limit_watts=self.enforced_limit(now),
            power_management_limit_watts=dev.power_limit_watts,
            energy_mj=int(self.energy_j * 1000),
            temperature_celsius=temp,
            memory_temperature_celsius=temp + MEMORY_TEMP_OFFSET,
            sm_clock_mhz=int(round(dev.sm_clock_max_mhz * ratio)),
            sm_clock_max_mhz=dev.sm_clock_max_mhz,
            memory_clock_mhz=dev.memory_clock_mhz,
            reasons=self.reasons(now),
            power_violation_ns=int(self.power_violation_s * 1e9),
            thermal_violation_ns=int(self.thermal_violation_s * 1e9),
        )


# ---- dcgm-exporter's exposition

# (field, type, HELP) in the order and wording of dcgm-exporter's etc/default-counters.csv (the
# violation, ECC and remapping rows enabled) plus the rows a custom CSV adds for soak tests.
_DCGM_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MAX_SM_CLOCK", "gauge", "Maximum SM clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MAX_MEM_CLOCK", "gauge", "Maximum memory clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C)."),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)."),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter", "Total energy consumption since boot (in mJ)."),
    ("DCGM_FI_DEV_POWER_MGMT_LIMIT", "gauge", "Power management limit (in W)."),
    ("DCGM_FI_DEV_ENFORCED_POWER_LIMIT", "gauge", "Effective power limit that the driver enforces (in W)."),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries."),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %)."),
    ("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %)."),
    ("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %)."),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered."),
    ("DCGM_FI_DEV_POWER_VIOLATION", "counter", "Throttling duration due to power constraints (in us)."),
    ("DCGM_FI_DEV_THERMAL_VIOLATION", "counter", "Throttling duration due to thermal constraints (in us)."),
    ("DCGM_FI_DEV_SYNC_BOOST_VIOLATION", "counter", "Throttling duration due to sync-boost constraints (in us)."),
    ("DCGM_FI_DEV_BOARD_LIMIT_VIOLATION", "counter", "Throttling duration due to board limit constraints (in us)."),
    ("DCGM_FI_DEV_LOW_UTIL_VIOLATION", "counter", "Throttling duration due to low utilization (in us)."),
    ("DCGM_FI_DEV_RELIABILITY_VIOLATION", "counter", "Throttling duration due to reliability constraints (in us)."),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB)."),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB)."),
    ("DCGM_FI_DEV_FB_RESERVED", "gauge", "Framebuffer memory reserved (in MiB)."),
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "counter", "Total number of single-bit volatile ECC errors."),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter", "Total number of double-bit volatile ECC errors."),
    ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter", "Number of remapped rows for uncorrectable errors"),
    ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter", "Number of remapped rows for correctable errors"),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed"),
    ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "gauge",
     "Current clock event reasons (bitmask of DCGM_CLOCKS_EVENT_REASON_*)."),
)


def _dcgm_values(r: GpuReading) -> dict[str, int | float]:
    fb_used = round(r.memory_used / MIB)
    fb_reserved = r.memory_reserved // MIB
    return {
        "DCGM_FI_DEV_SM_CLOCK": r.sm_clock_mhz,
        "DCGM_FI_DEV_MEM_CLOCK": r.memory_clock_mhz,
        "DCGM_FI_DEV_MAX_SM_CLOCK": r.sm_clock_max_mhz,
        "DCGM_FI_DEV_MAX_MEM_CLOCK": r.memory_clock_mhz,
        "DCGM_FI_DEV_MEMORY_TEMP": round(r.memory_temperature_celsius),
        "DCGM_FI_DEV_GPU_TEMP": round(r.temperature_celsius),
        "DCGM_FI_DEV_POWER_USAGE": float(r.power_watts),
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": r.energy_mj,
        "DCGM_FI_DEV_POWER_MGMT_LIMIT": float(r.power_management_limit_watts),
        "DCGM_FI_DEV_ENFORCED_POWER_LIMIT": float(r.power_limit_watts),
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": 0,
        "DCGM_FI_DEV_GPU_UTIL": round(r.utilization),
        "DCGM_FI_DEV_MEM_COPY_UTIL": round(r.memory_utilization),
        "DCGM_FI_DEV_ENC_UTIL": 0,
        "DCGM_FI_DEV_DEC_UTIL": 0,
        "DCGM_FI_DEV_XID_ERRORS": 0,
        "DCGM_FI_DEV_POWER_VIOLATION": r.power_violation_ns // 1000,
        "DCGM_FI_DEV_THERMAL_VIOLATION": r.thermal_violation_ns // 1000,
        "DCGM_FI_DEV_SYNC_BOOST_VIOLATION": 0,
        "DCGM_FI_DEV_BOARD_LIMIT_VIOLATION": 0,
        "DCGM_FI_DEV_LOW_UTIL_VIOLATION": 0,
        "DCGM_FI_DEV_RELIABILITY_VIOLATION": 0,
        "DCGM_FI_DEV_FB_FREE": r.memory_total // MIB - fb_used - fb_reserved,
        "DCGM_FI_DEV_FB_USED": fb_used,
        "DCGM_FI_DEV_FB_RESERVED": fb_reserved,
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": 0,
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": 0,
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": 0,
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": 0,
        "DCGM_FI_DEV_ROW_REMAP_FAILURE": 0,
        "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": r.reasons,
    }


def _label_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def dcgm_exposition(device: SimDevice, now: float | None = None) -> str:
    """The device as dcgm-exporter's ``/metrics`` shows it (text format 0.0.4): dcgm-exporter's
    field names, units, HELP texts and label set (``gpu``, ``UUID``, ``pci_bus_id``, ``device``,
    ``modelName``, ``Hostname``, ``DCGM_FI_DRIVER_VERSION``); counters keep their bare names."""
    readings = device.readings(now)
    host = _label_value(device.hostname)
    labels = [
        f'gpu="{r.index}",UUID="{r.uuid}",pci_bus_id="{r.pci_bus_id}",device="nvidia{r.index}",'
        f'modelName="{_label_value(r.name)}",Hostname="{host}",DCGM_FI_DRIVER_VERSION="{DRIVER_VERSION}"'
        for r in readings
    ]
    values = [_dcgm_values(r) for r in readings]
    lines: list[str] = []
    for name, kind, help_text in _DCGM_FIELDS:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        extra = ',err_code="0",err_msg="No Error"' if name == "DCGM_FI_DEV_XID_ERRORS" else ""
        for label, vals in zip(labels, values, strict=True):
            v = vals[name]
            text = f"{v:.6f}" if isinstance(v, float) else str(int(v))
            lines.append(f"{name}{{{label}{extra}}} {text}")
    return "\n".join(lines) + "\n"

"""dcgm-exporter sampler: scrape its ``/metrics`` and map ``DCGM_FI_DEV_*`` into the soakd_gpu_* series.

For clusters where the GPU belongs to the inference server's pod and NVIDIA's dcgm-exporter
already runs on the node: soakd reads the exporter instead of NVML and exports the same
normalised series as the NVML sampler, in base units (DESIGN.md, "Metric contract").

Timing: dcgm-exporter samples DCGM every 30 s by default (``-c/--collect-interval`` in ms, env
``DCGM_EXPORTER_INTERVAL``; the GPU Operator sets it through ``dcgmExporter.env``). Scraping it
every few seconds returns the same values until the next collection; for soak analysis lower it,
e.g. ``DCGM_EXPORTER_INTERVAL=5000``.

Field -> series (labels ``gpu`` from dcgm-exporter's ``gpu``, ``uuid`` from ``UUID``; fields as in
dcgm-exporter's ``etc/default-counters.csv`` / ``dcp-metrics-included.csv`` and DCGM's
``dcgm_fields.h``; the optional ones must be enabled in the exporter's CSV):

==========================================  =============================================  ==========
DCGM field                                  soakd series                                   conversion
==========================================  =============================================  ==========
FB_USED, FB_FREE, FB_RESERVED, FB_TOTAL     memory_used / _reserved / _total_bytes         MiB -> B
                                            (total = FB_TOTAL, else used + free + reserved)
GPU_UTIL, MEM_COPY_UTIL                     utilization_ratio, memory_utilization_ratio    % -> 0-1
POWER_USAGE                                 power_watts                                    W
ENFORCED_POWER_LIMIT, else POWER_MGMT_LIMIT power_limit_watts                              W
TOTAL_ENERGY_CONSUMPTION                    energy_joules_total (since soakd started;      mJ -> J
                                            monotonic across driver reloads)
GPU_TEMP, MEMORY_TEMP                       temperature_celsius{sensor=gpu|memory}         C
SM_CLOCK, MEM_CLOCK, MAX_SM_CLOCK,          sm_clock_hertz, memory_clock_hertz, *_max_hertz MHz -> Hz
MAX_MEM_CLOCK
CLOCKS_EVENT_REASONS (or the deprecated     clocks_event_active{reason} for the 9 NVML     bitmask
CLOCK_THROTTLE_REASONS)                     reasons (soakd.core.reasons)
*_VIOLATION (power, thermal, sync_boost,    throttle_seconds_total{reason}                 us -> s
board_limit, low_util, reliability,         (ns when the field's HELP says "(in ns)")
total_app_clocks, total_base_clocks)
ECC_SBE_VOL_TOTAL, ECC_DBE_VOL_TOTAL        ecc_errors_total{kind=corrected|uncorrected}
CORRECTABLE_/UNCORRECTABLE_REMAPPED_ROWS,   remapped_rows{kind=correctable|uncorrectable|
ROW_REMAP_PENDING, ROW_REMAP_FAILURE        pending|failure}
XID_ERRORS                                  last_xid (value of the last Xid)
modelName label                             soakd_gpu_info{gpu,uuid,name}
==========================================  =============================================  ==========

Counters (energy, violations, ECC) are kept monotonic across resets (driver reload, exporter
restart): a value lower than the previous one starts a new segment that is added on. Series of
MIG instances (a ``GPU_I_ID`` label) are skipped: soakd reports whole GPUs. DCGM's "blank"
sentinels (field not supported) are dropped rather than exported as huge numbers.
"""

from __future__ import annotations

import re
from collections.abc import Hashable

from soakd.config import DcgmSamplerConfig
from soakd.core.series import Series, series
from soakd.samplers.base import SamplerUnavailable
from soakd.samplers.promtext import Exposition, Scraper, SessionFactory, redact_url
from soakd.core.reasons import VIOLATION_REASONS, decode_clocks_event_reasons

MIB = 1024 * 1024
MHZ = 1_000_000.0

# DCGM blank sentinels (dcgm_structs.h): DCGM_FP64_BLANK = 2**47; DCGM_INT64_BLANK is above it;
# DCGM_INT32_BLANK = 0x7ffffff0 (int32 fields up to 0x7fffffff).
_FP64_BLANK = 140737488355328.0
_INT32_BLANK = float(0x7FFFFFF0)
_INT32_MAX = float(0x7FFFFFFF)

CLOCKS_EVENT_FIELDS = ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS")
# Counters: no int32 blank check (energy in mJ passes 2**31 within the hour).
_COUNTER_FIELDS = frozenset(
    {"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"}
    | {field for _, _, field in VIOLATION_REASONS}
)
_UNIT = re.compile(r"\(in (ns|us|µs|ms)\)", re.IGNORECASE)
_UNITS_PER_SECOND = {"ns": 1e9, "us": 1e6, "µs": 1e6, "ms": 1e3}


def violation_units_per_second(help_text: str) -> float:
    """Units per second of a DCGM violation counter. DCGM documented these fields in usec until 3.x
    and in ns since; dcgm-exporter's HELP text (from its CSV) says which: "(in us)" or "(in ns)".
    Without a unit in the HELP, microseconds (default-counters.csv)."""
    m = _UNIT.search(help_text or "")
    return _UNITS_PER_SECOND[m.group(1).lower()] if m else 1e6


def _blank(field: str, value: float) -> bool:
    if value >= _FP64_BLANK or value < 0:
        return True
    return field not in _COUNTER_FIELDS and _INT32_BLANK <= value <= _INT32_MAX


class MonotonicCounter:
    """A counter that survives resets of its source: deltas are summed; a drop starts a new segment.

    ``from_zero``: the first observation counts as 0 (energy "since soakd started watching");
    otherwise it starts at the source's value (errors since the driver loaded).
    """

    def __init__(self, from_zero: bool) -> None:
        self.from_zero = from_zero
        self._last: dict[Hashable, float] = {}
        self._total: dict[Hashable, float] = {}

    def update(self, key: Hashable, raw: float) -> float:
        last = self._last.get(key)
        if last is None:
            value = 0.0 if self.from_zero else raw
        elif raw >= last:
            value = self._total[key] + (raw - last)
        else:  # reset: the source restarted from 0
            value = self._total[key] + raw
        self._last[key] = raw
        self._total[key] = value
        return value


class _Gpu:
    __slots__ = ("gpu", "uuid", "name", "fields")

    def __init__(self, gpu: str, uuid: str) -> None:
        self.gpu = gpu
        self.uuid = uuid
        self.name = ""
        self.fields: dict[str, float] = {}

    def get(self, *names: str) -> float | None:
        for n in names:
            v = self.fields.get(n)
            if v is not None:
                return v
        return None


def _sort_key(gpu: _Gpu) -> tuple[int, str, str]:
    return (int(gpu.gpu) if gpu.gpu.isdigit() else 1 << 30, gpu.gpu, gpu.uuid)


def collect_gpus(expo: Exposition) -> list[_Gpu]:
    """Whole-GPU field values by (gpu, UUID), the first child of each field winning (pod labels can
    repeat a GPU's value); blank values dropped."""
    gpus: dict[tuple[str, str], _Gpu] = {}
    for name, children in expo.samples.items():
        if not name.startswith("DCGM_FI_DEV_"):
            continue
        field = name
        if expo.type.get(name) == "counter":  # the parser adds _total to counter samples
            field = name.removesuffix("_total")
        for c in children:
            labels = c.labels
            if labels.get("GPU_I_ID"):  # a MIG instance
                continue
            gpu = labels.get("gpu")
            if gpu is None:
                continue
            uuid = labels.get("UUID", labels.get("uuid", ""))
            dev = gpus.get((gpu, uuid))
            if dev is None:
                dev = gpus[(gpu, uuid)] = _Gpu(gpu, uuid)
            if not dev.name and labels.get("modelName"):
                dev.name = labels["modelName"]
            if field in dev.fields or _blank(field, c.value):
                continue
            dev.fields[field] = c.value
    return sorted(gpus.values(), key=_sort_key)


class DcgmSampler:
    """Scrapes dcgm-exporter's /metrics into the soakd_gpu_* series."""

    name = "dcgm"

    def __init__(self, config: DcgmSamplerConfig, session_factory: SessionFactory | None = None) -> None:
        if not config.url:
            raise ValueError("samplers.dcgm.url is not set: the dcgm sampler is off (the caller must not build it)")
        self.config = config
        self.url = config.url
        self._scraper = Scraper(session_factory)
        self._energy = MonotonicCounter(from_zero=True)
        self._counters = MonotonicCounter(from_zero=False)

    async def sample(self) -> list[Series]:
        expo = await self._scraper.scrape(self.url)
        gpus = collect_gpus(expo)
        if not gpus:
            raise SamplerUnavailable(
                f"no DCGM_FI_DEV_* metrics with a gpu label at {redact_url(self.url)}; "
                "is samplers.dcgm.url dcgm-exporter's /metrics?"
            )
        out: list[Series] = []
        for dev in gpus:
            out.extend(self._map(dev, expo))
        return out

    def _map(self, dev: _Gpu, expo: Exposition) -> list[Series]:
        ids = {"gpu": dev.gpu, "uuid": dev.uuid}
        key = dev.uuid or dev.gpu
        # Series() directly: series()'s first parameter is called name, like the label
        out = [Series("soakd_gpu_info", 1.0, (("gpu", dev.gpu), ("uuid", dev.uuid), ("name", dev.name)))]

        def add(name: str, value: float | None, mul: float = 1.0, div: float = 1.0, **extra: str) -> None:
            if value is not None:
                out.append(series(name, value * mul / div, **ids, **extra))

        used = dev.get("DCGM_FI_DEV_FB_USED")
        free = dev.get("DCGM_FI_DEV_FB_FREE")
        reserved = dev.get("DCGM_FI_DEV_FB_RESERVED")
        capacity = dev.get("DCGM_FI_DEV_FB_TOTAL")
        if capacity is None and used is not None and free is not None:
            capacity = used + free + (reserved or 0.0)
        add("soakd_gpu_memory_used_bytes", used, MIB)
        add("soakd_gpu_memory_total_bytes", capacity, MIB)
        add("soakd_gpu_memory_reserved_bytes", reserved, MIB)
        add("soakd_gpu_utilization_ratio", dev.get("DCGM_FI_DEV_GPU_UTIL"), div=100)
        add("soakd_gpu_memory_utilization_ratio", dev.get("DCGM_FI_DEV_MEM_COPY_UTIL"), div=100)
        add("soakd_gpu_power_watts", dev.get("DCGM_FI_DEV_POWER_USAGE"))
        add("soakd_gpu_power_limit_watts", dev.get("DCGM_FI_DEV_ENFORCED_POWER_LIMIT", "DCGM_FI_DEV_POWER_MGMT_LIMIT"))
        energy = dev.get("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION")
        if energy is not None:
            add("soakd_gpu_energy_joules_total", self._energy.update(key, energy), div=1000)
        add("soakd_gpu_temperature_celsius", dev.get("DCGM_FI_DEV_GPU_TEMP"), sensor="gpu")
        add("soakd_gpu_temperature_celsius", dev.get("DCGM_FI_DEV_MEMORY_TEMP"), sensor="memory")
        add("soakd_gpu_sm_clock_hertz", dev.get("DCGM_FI_DEV_SM_CLOCK"), MHZ)
        add("soakd_gpu_sm_clock_max_hertz", dev.get("DCGM_FI_DEV_MAX_SM_CLOCK"), MHZ)
        add("soakd_gpu_memory_clock_hertz", dev.get("DCGM_FI_DEV_MEM_CLOCK"), MHZ)
        add("soakd_gpu_memory_clock_max_hertz", dev.get("DCGM_FI_DEV_MAX_MEM_CLOCK"), MHZ)
        mask = dev.get(*CLOCKS_EVENT_FIELDS)
        if mask is not None:
            for reason, active in decode_clocks_event_reasons(mask).items():
                add("soakd_gpu_clocks_event_active", 1.0 if active else 0.0, reason=reason)
        for reason, _, field in VIOLATION_REASONS:
            raw = dev.get(field)
            if raw is not None:
                per_second = violation_units_per_second(expo.help_for(field))
                add("soakd_gpu_throttle_seconds_total", self._counters.update((key, field), raw), div=per_second,
                    reason=reason)  # fmt: skip
        for kind, field in (("corrected", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"),
                            ("uncorrected", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL")):  # fmt: skip
            raw = dev.get(field)
            if raw is not None:
                add("soakd_gpu_ecc_errors_total", self._counters.update((key, field), raw), kind=kind)
        for kind, field in (("correctable", "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"),
                            ("uncorrectable", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"),
                            ("pending", "DCGM_FI_DEV_ROW_REMAP_PENDING"),
                            ("failure", "DCGM_FI_DEV_ROW_REMAP_FAILURE")):  # fmt: skip
            add("soakd_gpu_remapped_rows", dev.get(field), kind=kind)
        add("soakd_gpu_last_xid", dev.get("DCGM_FI_DEV_XID_ERRORS"))
        return out

    async def aclose(self) -> None:
        await self._scraper.aclose()

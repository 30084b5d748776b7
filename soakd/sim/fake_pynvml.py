"""A fake ``pynvml`` (nvidia-ml-py) for tests and ``soakd demo``, driven by a scriptable ``scenario``.

It mirrors nvidia-ml-py 13.x (the single module ``pynvml.py``) for everything soakd's NVML
sampler touches: function names and parameter names, constants with their real values,
returned structures with their real field names, ``nvmlFriendlyObject`` for process lists,
and the exception hierarchy built exactly like the real ``_extractNVMLErrorsAsClasses``
(``NVMLError(code)`` returns the ``NVMLError_<Name>`` subclass; every instance has ``.value``).
``tests/unit/test_nvml.py`` cross-checks all of it against the installed package.

Longer than 500 lines: it stands in for one module (``pynvml.py``), so it is one module: code
that does ``import pynvml`` must find every name in it, as in the real one.

Use it as the sampler's ``nvml_module=`` or install it with
``monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml)``; call ``reset()`` first.

Scripting: ``scenario.gpus`` holds one ``FakeGpu`` per device. Per device you set the
readings (memory, utilisation, power, energy, temperatures, clocks, clocks-event bitmask,
violation times, ECC, remapped rows, processes), queue Xid events (``gpu.xid(79)``), lose it
(``gpu.lost = True``: every call with its handle raises ``NVMLError_GpuIsLost``), and make
single calls fail: ``gpu.unsupported`` (function names raising ``NVMLError_NotSupported``),
``gpu.missing`` (C symbols the driver lacks: ``NVMLError_FunctionNotFound``, e.g.
``nvmlDeviceGetMemoryInfo_v2``), ``gpu.errors`` (function name -> NVML error code raised on
every call). ``scenario.init_error`` makes ``nvmlInit`` fail (``NVML_ERROR_LIBRARY_NOT_FOUND``,
``NVML_ERROR_DRIVER_NOT_LOADED``, ...). ``scenario.calls`` counts calls by function name and
``scenario.threads`` records the threads they ran on.

Driven by a simulation: ``bind(device)`` replaces the scenario with one ``FakeGpu`` per GPU of a
simulated device (``soakd.sim.device.SimDevice``, or anything with ``gpu_count`` and
``reading(index)``) whose readings are refreshed from the device on every call that touches the
GPU — so ``NvmlSampler(nvml_module=fake_pynvml)`` sees the simulator's load. Any ``FakeGpu`` can
have such a ``source`` (a callable that updates the ``FakeGpu`` in place). One scenario per process:
the module is a singleton, like the real one.
"""

from __future__ import annotations

import os
import string
import sys
import threading
from collections import Counter, deque
from collections.abc import Callable
from ctypes import c_uint, c_ulonglong
from dataclasses import dataclass, field
from typing import Any

# ---- return codes (values as in nvidia-ml-py 13.x)
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
NVML_ERROR_FREQ_NOT_SUPPORTED = 24
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_DEPRECATED = 26
NVML_ERROR_NOT_READY = 27
NVML_ERROR_GPU_NOT_FOUND = 28
NVML_ERROR_INVALID_STATE = 29
NVML_ERROR_RESET_TYPE_NOT_SUPPORTED = 30
NVML_ERROR_UNKNOWN = 999

# ---- enums and defines
NVML_TEMPERATURE_GPU = 0
NVML_TEMPERATURE_GPU_MAX = 1
NVML_TEMPERATURE_COUNT = 2

NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_MEMORY_ERROR_TYPE_COUNT = 2

NVML_CLOCK_GRAPHICS = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2

NVML_VALUE_TYPE_DOUBLE = 0
NVML_VALUE_TYPE_UNSIGNED_INT = 1
NVML_VALUE_TYPE_UNSIGNED_LONG = 2
NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3
NVML_VALUE_TYPE_SIGNED_LONG_LONG = 4
NVML_VALUE_TYPE_SIGNED_INT = 5
NVML_VALUE_TYPE_UNSIGNED_SHORT = 6
NVML_VALUE_TYPE_COUNT = 7

NVML_PERF_POLICY_POWER = 0
NVML_PERF_POLICY_THERMAL = 1
NVML_PERF_POLICY_SYNC_BOOST = 2
NVML_PERF_POLICY_BOARD_LIMIT = 3
NVML_PERF_POLICY_LOW_UTILIZATION = 4
NVML_PERF_POLICY_RELIABILITY = 5
NVML_PERF_POLICY_TOTAL_APP_CLOCKS = 10
NVML_PERF_POLICY_TOTAL_BASE_CLOCKS = 11
NVML_PERF_POLICY_COUNT = 12

NVML_FI_DEV_MEMORY_TEMP = 82

nvmlMemory_v2 = 0x02000028
nvmlTemperature_v1 = 0x100000C

nvmlClocksEventReasonGpuIdle = 0x0000000000000001
nvmlClocksEventReasonApplicationsClocksSetting = 0x0000000000000002
nvmlClocksEventReasonUserDefinedClocks = nvmlClocksEventReasonApplicationsClocksSetting
nvmlClocksEventReasonSwPowerCap = 0x0000000000000004
nvmlClocksEventReasonHwSlowdown = 0x0000000000000008
nvmlClocksEventReasonSyncBoost = 0x0000000000000010
nvmlClocksEventReasonSwThermalSlowdown = 0x0000000000000020
nvmlClocksEventReasonHwThermalSlowdown = 0x0000000000000040
nvmlClocksEventReasonHwPowerBrakeSlowdown = 0x0000000000000080
nvmlClocksEventReasonDisplayClockSetting = 0x0000000000000100
nvmlClocksEventReasonNone = 0x0000000000000000

# deprecated names, same bits (plus two the event API dropped)
nvmlClocksThrottleReasonGpuIdle = 0x0000000000000001
nvmlClocksThrottleReasonApplicationsClocksSetting = 0x0000000000000002
nvmlClocksThrottleReasonUserDefinedClocks = nvmlClocksThrottleReasonApplicationsClocksSetting
nvmlClocksThrottleReasonSwPowerCap = 0x0000000000000004
nvmlClocksThrottleReasonHwSlowdown = 0x0000000000000008
nvmlClocksThrottleReasonSyncBoost = 0x0000000000000010
nvmlClocksThrottleReasonSwThermalSlowdown = 0x0000000000000020
nvmlClocksThrottleReasonHwThermalSlowdown = 0x0000000000000040
nvmlClocksThrottleReasonHwPowerBrakeSlowdown = 0x0000000000000080
nvmlClocksThrottleReasonDisplayClockSetting = 0x0000000000000100
nvmlClocksThrottleReasonBoardLimit = 0x0000000000000200
nvmlClocksThrottleReasonReliability = 0x0000000000000400
nvmlClocksThrottleReasonNone = 0x0000000000000000

nvmlEventTypeSingleBitEccError = 0x0000000000000001
nvmlEventTypeDoubleBitEccError = 0x0000000000000002
nvmlEventTypePState = 0x0000000000000004
nvmlEventTypeXidCriticalError = 0x0000000000000008
nvmlEventTypeClock = 0x0000000000000010
nvmlEventTypeNone = 0x0000000000000000

NVML_VALUE_NOT_AVAILABLE_ulonglong = c_ulonglong(-1)
NVML_VALUE_NOT_AVAILABLE_uint = c_uint(-1)


# ---- exceptions: the real module's construction, reproduced
class NVMLLibraryMismatchError(Exception):
    pass


class NVMLError(Exception):
    _valClassMapping: dict[int, type] = dict()
    _errcode_to_string = {
        NVML_ERROR_UNINITIALIZED: "Uninitialized",
        NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
        NVML_ERROR_NOT_SUPPORTED: "Not Supported",
        NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
        NVML_ERROR_ALREADY_INITIALIZED: "Already Initialized",
        NVML_ERROR_NOT_FOUND: "Not Found",
        NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size",
        NVML_ERROR_INSUFFICIENT_POWER: "Insufficient External Power",
        NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
        NVML_ERROR_TIMEOUT: "Timeout",
        NVML_ERROR_IRQ_ISSUE: "Interrupt Request Issue",
        NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
        NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
        NVML_ERROR_CORRUPTED_INFOROM: "Corrupted infoROM",
        NVML_ERROR_GPU_IS_LOST: "GPU is lost",
        NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
        NVML_ERROR_OPERATING_SYSTEM: "The operating system has blocked the request.",
        NVML_ERROR_LIB_RM_VERSION_MISMATCH: "RM has detected an NVML/RM version mismatch.",
        NVML_ERROR_MEMORY: "Insufficient Memory",
        NVML_ERROR_UNKNOWN: "Unknown Error",
    }

    def __new__(typ, value):
        if typ == NVMLError:
            typ = NVMLError._valClassMapping.get(value, typ)
        obj = Exception.__new__(typ)
        obj.value = value
        return obj

    def __str__(self):
        # the real module asks the library (nvmlErrorString) for unknown codes and falls back to this
        return NVMLError._errcode_to_string.get(self.value, f"NVML Error with code {self.value}")

    def __eq__(self, other):
        return self.value == other.value


def nvmlExceptionClass(nvmlErrorCode):
    if nvmlErrorCode not in NVMLError._valClassMapping:
        raise ValueError(f"nvmlErrorCode {nvmlErrorCode} is not valid")
    return NVMLError._valClassMapping[nvmlErrorCode]


def _extractNVMLErrorsAsClasses():
    this_module = sys.modules[__name__]
    for err_name in [x for x in dir(this_module) if x.startswith("NVML_ERROR_")]:
        class_name = "NVMLError_" + string.capwords(err_name.replace("NVML_ERROR_", ""), "_").replace("_", "")
        err_val = getattr(this_module, err_name)

        def gen_new(val):
            def new(typ, *args):
                return NVMLError.__new__(typ, val)

            return new

        new_error_class = type(class_name, (NVMLError,), {"__new__": gen_new(err_val)})
        new_error_class.__module__ = __name__
        setattr(this_module, class_name, new_error_class)
        NVMLError._valClassMapping[err_val] = new_error_class


_extractNVMLErrorsAsClasses()


# ---- structures: plain objects with the real ``_fields_`` names (handles don't fit in ctypes)
class _Struct:
    _fields_: list[tuple[str, str]] = []

    def __init__(self, **values):
        for name, _ctype in self._fields_:
            setattr(self, name, values.pop(name, 0))
        if values:
            raise TypeError(f"{type(self).__name__} has no fields {sorted(values)}")

    def __repr__(self):
        inner = ", ".join(f"{n}: {getattr(self, n)!r}" for n, _ in self._fields_)
        return f"{type(self).__name__}({inner})"


class c_nvmlMemory_t(_Struct):
    _fields_ = [("total", "c_ulonglong"), ("free", "c_ulonglong"), ("used", "c_ulonglong")]


class c_nvmlMemory_v2_t(_Struct):
    _fields_ = [("version", "c_uint"), ("total", "c_ulonglong"), ("reserved", "c_ulonglong"),
                ("free", "c_ulonglong"), ("used", "c_ulonglong")]


class c_nvmlUtilization_t(_Struct):
    _fields_ = [("gpu", "c_uint"), ("memory", "c_uint")]


class c_nvmlViolationTime_t(_Struct):
    _fields_ = [("referenceTime", "c_ulonglong"), ("violationTime", "c_ulonglong")]


class c_nvmlValue_t(_Struct):  # a Union in the real module
    _fields_ = [("dVal", "c_double"), ("uiVal", "c_uint"), ("ulVal", "c_ulong"), ("ullVal", "c_ulonglong"),
                ("sllVal", "c_longlong"), ("siVal", "c_int"), ("usVal", "c_ushort")]


class c_nvmlFieldValue_t(_Struct):
    _fields_ = [("fieldId", "c_uint32"), ("scopeId", "c_uint32"), ("timestamp", "c_int64"),
                ("latencyUsec", "c_int64"), ("valueType", "_nvmlValueType_t"), ("nvmlReturn", "_nvmlReturn_t"),
                ("value", "c_nvmlValue_t")]


class c_nvmlEventData_t(_Struct):
    _fields_ = [("device", "c_nvmlDevice_t"), ("eventType", "c_ulonglong"), ("eventData", "c_ulonglong"),
                ("gpuInstanceId", "c_uint"), ("computeInstanceId", "c_uint")]


class c_nvmlProcessInfo_v2_t(_Struct):
    _fields_ = [("pid", "c_uint"), ("usedGpuMemory", "c_ulonglong"), ("gpuInstanceId", "c_uint"),
                ("computeInstanceId", "c_uint")]


c_nvmlProcessInfo_v3_t = c_nvmlProcessInfo_v2_t


class nvmlFriendlyObject:
    def __init__(self, dictionary):
        for x in dictionary:
            setattr(self, x, dictionary[x])

    def __str__(self):
        return self.__dict__.__str__()


_VALUE_MEMBER = {
    NVML_VALUE_TYPE_DOUBLE: "dVal",
    NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}

# ---- the scriptable world

GiB = 1024**3
MiB = 1024**2
ALL_POLICIES = (NVML_PERF_POLICY_POWER, NVML_PERF_POLICY_THERMAL, NVML_PERF_POLICY_SYNC_BOOST,
                NVML_PERF_POLICY_BOARD_LIMIT, NVML_PERF_POLICY_LOW_UTILIZATION, NVML_PERF_POLICY_RELIABILITY,
                NVML_PERF_POLICY_TOTAL_APP_CLOCKS, NVML_PERF_POLICY_TOTAL_BASE_CLOCKS)


@dataclass
class FakeGpu:
    """One device. Units are NVML's: bytes, %, mW, mJ, degrees C, MHz, ns."""

    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    name: str = "NVIDIA H100 80GB HBM3"
    memory_total: int = 80 * GiB
    memory_used: int = 2 * GiB  # allocated (v2 ``used``); v1 ``used`` adds ``memory_reserved``
    memory_reserved: int = 512 * MiB
    memory_growth: int = 0  # bytes added to memory_used on every nvmlDeviceGetMemoryInfo call
    util_gpu: int = 50
    util_memory: int = 20
    power_mw: int = 300_000
    power_limit_mw: int = 700_000
    energy_mj: int = 5_000_000  # since driver load
    energy_step_mj: int = 0  # added on every nvmlDeviceGetTotalEnergyConsumption call
    temp_gpu: int = 60
    temp_memory: int | None = 70  # None: NVML_FI_DEV_MEMORY_TEMP answers NVML_ERROR_NOT_SUPPORTED
    temp_memory_value_type: int = NVML_VALUE_TYPE_UNSIGNED_INT
    sm_clock_mhz: int = 1980
    sm_clock_max_mhz: int = 1980
    mem_clock_mhz: int = 2619
    mem_clock_max_mhz: int = 2619
    reasons: int = 0  # clocks-event bitmask
    violation_ns: dict[int, int] = field(default_factory=lambda: {p: 0 for p in ALL_POLICIES})  # absent: NotSupported
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    remapped_rows: tuple[int, int, int, int] = (0, 0, 0, 0)  # correctable, uncorrectable, pending, failure
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, usedGpuMemory or None)
    xids: deque[int] = field(default_factory=deque)  # pending critical Xid events
    lost: bool = False
    unsupported: set[str] = field(default_factory=set)  # function names -> NVMLError_NotSupported
    missing: set[str] = field(default_factory=set)  # C symbols -> NVMLError_FunctionNotFound
    errors: dict[str, int] = field(default_factory=dict)  # function name -> error code, every call
    source: Callable[[FakeGpu], None] | None = None  # refreshes the readings before every call on this GPU

    def xid(self, code: int) -> None:
        self.xids.append(code)

    def throttle(self, on: bool = True, seconds: float = 1.0) -> None:
        """Power-capped and thermally slowed (or not); violation counters advance while on."""
        bits = nvmlClocksEventReasonSwPowerCap | nvmlClocksEventReasonHwThermalSlowdown
        if on:
            self.reasons |= bits
            for policy in (NVML_PERF_POLICY_POWER, NVML_PERF_POLICY_THERMAL):
                if policy in self.violation_ns:
                    self.violation_ns[policy] += int(seconds * 1e9)
        else:
            self.reasons &= ~bits


class FakeHandle:
    """Stands in for ``c_nvmlDevice_t`` (an opaque pointer)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"<FakeHandle {self.index}>"


class FakeEventSet:
    """Stands in for ``c_nvmlEventSet_t``."""

    def __init__(self) -> None:
        self.registered: list[tuple[FakeHandle, int]] = []
        self.freed = False


class Scenario:
    def __init__(self, gpus: list[FakeGpu] | None = None) -> None:
        self.gpus: list[FakeGpu] = list(gpus or [])
        self.init_error: int | None = None  # NVML error code nvmlInit raises
        self.refcount = 0
        self.inits = 0
        self.shutdowns = 0
        self.event_sets: list[FakeEventSet] = []
        self.calls: Counter[str] = Counter()
        self.threads: set[int] = set()
        self.lock = threading.Lock()

    def driver_reload(self) -> None:
        """The driver was reloaded: energy counters restart from zero."""
        for gpu in self.gpus:
            gpu.energy_mj = 0


scenario = Scenario()


def reset(gpus: list[FakeGpu] | None = None) -> Scenario:
    """A fresh scenario (call at the start of every test)."""
    global scenario
    scenario = Scenario(gpus)
    return scenario


def bind(device: Any) -> Scenario:
    """A fresh scenario driven by a simulated device: one ``FakeGpu`` per ``device.gpu_count``,
    refreshed from ``device.reading(index)`` on every call that touches it. ``reading`` returns an
    object with ``uuid``, ``name``, ``memory_total``/``_used``/``_reserved`` (bytes, ``used``
    without the reserved part), ``utilization``/``memory_utilization`` (%), ``power_watts``,
    ``power_limit_watts`` (enforced), ``energy_mj``, ``temperature_celsius``,
    ``memory_temperature_celsius``, ``sm_clock_mhz``, ``sm_clock_max_mhz``, ``memory_clock_mhz``,
    ``reasons`` (NVML clocks-event bitmask), ``power_violation_ns`` and ``thermal_violation_ns``."""
    gpus = []
    for index in range(int(device.gpu_count)):
        first = device.reading(index)
        gpu = FakeGpu(uuid=first.uuid, name=first.name, source=_refresher(device, index))
        gpu.source(gpu)
        gpus.append(gpu)
    return reset(gpus)


def _refresher(device: Any, index: int) -> Callable[[FakeGpu], None]:
    def refresh(gpu: FakeGpu) -> None:
        r = device.reading(index)
        gpu.memory_total = int(r.memory_total)
        gpu.memory_used = int(r.memory_used)
        gpu.memory_reserved = int(r.memory_reserved)
        gpu.util_gpu = int(round(r.utilization))
        gpu.util_memory = int(round(r.memory_utilization))
        gpu.power_mw = int(round(r.power_watts * 1000))
        gpu.power_limit_mw = int(round(r.power_limit_watts * 1000))
        gpu.energy_mj = int(r.energy_mj)
        gpu.temp_gpu = int(round(r.temperature_celsius))
        gpu.temp_memory = int(round(r.memory_temperature_celsius))
        gpu.sm_clock_mhz = int(r.sm_clock_mhz)
        gpu.sm_clock_max_mhz = int(r.sm_clock_max_mhz)
        gpu.mem_clock_mhz = gpu.mem_clock_max_mhz = int(r.memory_clock_mhz)
        gpu.reasons = int(r.reasons)
        # the simulated server, which runs in this process, holds the simulated GPU's memory
        gpu.processes = [(os.getpid(), int(r.memory_used))]
        if NVML_PERF_POLICY_POWER in gpu.violation_ns:
            gpu.violation_ns[NVML_PERF_POLICY_POWER] = int(r.power_violation_ns)
        if NVML_PERF_POLICY_THERMAL in gpu.violation_ns:
            gpu.violation_ns[NVML_PERF_POLICY_THERMAL] = int(r.thermal_violation_ns)

    return refresh


def _enter(name: str) -> None:
    with scenario.lock:
        scenario.calls[name] += 1
        scenario.threads.add(threading.get_ident())


def _initialized(name: str) -> None:
    _enter(name)
    if scenario.refcount <= 0:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)


def _device(handle, name: str, symbol: str | None = None) -> FakeGpu:
    """The GPU behind ``handle`` after the scripted failure checks for ``name``."""
    _initialized(name)
    if not isinstance(handle, FakeHandle) or not 0 <= handle.index < len(scenario.gpus):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    gpu = scenario.gpus[handle.index]
    if gpu.source is not None:
        gpu.source(gpu)
    if (symbol or name) in gpu.missing:
        raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
    if gpu.lost:
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)
    if name in gpu.unsupported:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    if name in gpu.errors:
        raise NVMLError(gpu.errors[name])
    return gpu


# ---- init / shutdown / enumeration


def nvmlInitWithFlags(flags):
    _enter("nvmlInitWithFlags")
    if scenario.init_error is not None:
        raise NVMLError(scenario.init_error)
    scenario.refcount += 1
    scenario.inits += 1
    return None


def nvmlInit():
    nvmlInitWithFlags(0)
    return None


def nvmlShutdown():
    _initialized("nvmlShutdown")
    scenario.refcount -= 1
    scenario.shutdowns += 1
    return None


def nvmlErrorString(result):
    return NVMLError._errcode_to_string.get(result, "Unknown Error")


def nvmlSystemGetDriverVersion():
    _initialized("nvmlSystemGetDriverVersion")
    return "580.95.05"


def nvmlDeviceGetCount():
    _initialized("nvmlDeviceGetCount")
    return len(scenario.gpus)


def nvmlDeviceGetHandleByIndex(index):
    _initialized("nvmlDeviceGetHandleByIndex")
    if not 0 <= index < len(scenario.gpus):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    if scenario.gpus[index].lost:
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)
    return FakeHandle(index)


def nvmlDeviceGetHandleByUUID(uuid):
    _initialized("nvmlDeviceGetHandleByUUID")
    if isinstance(uuid, bytes):
        uuid = uuid.decode()
    for i, gpu in enumerate(scenario.gpus):
        if gpu.uuid == uuid:
            if gpu.lost:
                raise NVMLError(NVML_ERROR_GPU_IS_LOST)
            return FakeHandle(i)
    raise NVMLError(NVML_ERROR_NOT_FOUND)


def nvmlDeviceGetUUID(handle):
    return _device(handle, "nvmlDeviceGetUUID").uuid


def nvmlDeviceGetName(handle):
    return _device(handle, "nvmlDeviceGetName").name


def nvmlDeviceGetIndex(handle):
    _device(handle, "nvmlDeviceGetIndex")
    return handle.index


# ---- readings


def nvmlDeviceGetMemoryInfo(handle, version=None):
    gpu = _device(handle, "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo_v2" if version else None)
    gpu.memory_used += gpu.memory_growth
    if not version:
        used = gpu.memory_used + gpu.memory_reserved
        return c_nvmlMemory_t(total=gpu.memory_total, free=gpu.memory_total - used, used=used)
    if version != nvmlMemory_v2:
        raise NVMLError(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
    return c_nvmlMemory_v2_t(version=version, total=gpu.memory_total, reserved=gpu.memory_reserved,
                             free=gpu.memory_total - gpu.memory_used - gpu.memory_reserved, used=gpu.memory_used)


def nvmlDeviceGetUtilizationRates(handle):
    gpu = _device(handle, "nvmlDeviceGetUtilizationRates")
    return c_nvmlUtilization_t(gpu=gpu.util_gpu, memory=gpu.util_memory)


def nvmlDeviceGetPowerUsage(handle):
    return _device(handle, "nvmlDeviceGetPowerUsage").power_mw


def nvmlDeviceGetEnforcedPowerLimit(handle):
    return _device(handle, "nvmlDeviceGetEnforcedPowerLimit").power_limit_mw


def nvmlDeviceGetTotalEnergyConsumption(handle):
    gpu = _device(handle, "nvmlDeviceGetTotalEnergyConsumption")
    gpu.energy_mj += gpu.energy_step_mj
    return gpu.energy_mj


def nvmlDeviceGetTemperatureV(handle, sensor, version=nvmlTemperature_v1):
    if version != nvmlTemperature_v1:
        raise NVMLError(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
    gpu = _device(handle, "nvmlDeviceGetTemperatureV")
    if sensor != NVML_TEMPERATURE_GPU:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return gpu.temp_gpu


def nvmlDeviceGetTemperature(handle, sensor):
    gpu = _device(handle, "nvmlDeviceGetTemperature")
    if sensor != NVML_TEMPERATURE_GPU:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return gpu.temp_gpu


def nvmlDeviceGetFieldValues(handle, fieldIds):
    gpu = _device(handle, "nvmlDeviceGetFieldValues")
    values = []
    for field_id in fieldIds:
        try:
            field_id, scope_id = field_id
        except TypeError:
            scope_id = 0
        value = c_nvmlValue_t()
        entry = c_nvmlFieldValue_t(fieldId=field_id, scopeId=scope_id, timestamp=0, latencyUsec=0,
                                   valueType=0, nvmlReturn=NVML_ERROR_NOT_SUPPORTED, value=value)
        if field_id == NVML_FI_DEV_MEMORY_TEMP and gpu.temp_memory is not None:
            entry.valueType = gpu.temp_memory_value_type
            entry.nvmlReturn = NVML_SUCCESS
            setattr(value, _VALUE_MEMBER[gpu.temp_memory_value_type], gpu.temp_memory)
        values.append(entry)
    return values


def nvmlDeviceGetClockInfo(handle, type):
    gpu = _device(handle, "nvmlDeviceGetClockInfo")
    return {NVML_CLOCK_GRAPHICS: gpu.sm_clock_mhz, NVML_CLOCK_SM: gpu.sm_clock_mhz,
            NVML_CLOCK_MEM: gpu.mem_clock_mhz}[type]


def nvmlDeviceGetMaxClockInfo(handle, type):
    gpu = _device(handle, "nvmlDeviceGetMaxClockInfo")
    return {NVML_CLOCK_GRAPHICS: gpu.sm_clock_max_mhz, NVML_CLOCK_SM: gpu.sm_clock_max_mhz,
            NVML_CLOCK_MEM: gpu.mem_clock_max_mhz}[type]


def nvmlDeviceGetCurrentClocksEventReasons(handle):
    return _device(handle, "nvmlDeviceGetCurrentClocksEventReasons").reasons


def nvmlDeviceGetCurrentClocksThrottleReasons(handle):
    return _device(handle, "nvmlDeviceGetCurrentClocksThrottleReasons").reasons


def nvmlDeviceGetViolationStatus(device, perfPolicyType):
    gpu = _device(device, "nvmlDeviceGetViolationStatus")
    if perfPolicyType not in gpu.violation_ns:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return c_nvmlViolationTime_t(referenceTime=0, violationTime=gpu.violation_ns[perfPolicyType])


def nvmlDeviceGetTotalEccErrors(handle, errorType, counterType):
    gpu = _device(handle, "nvmlDeviceGetTotalEccErrors")
    if counterType not in (NVML_VOLATILE_ECC, NVML_AGGREGATE_ECC):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return {NVML_MEMORY_ERROR_TYPE_CORRECTED: gpu.ecc_corrected,
            NVML_MEMORY_ERROR_TYPE_UNCORRECTED: gpu.ecc_uncorrected}[errorType]


def nvmlDeviceGetRemappedRows(device):
    return tuple(_device(device, "nvmlDeviceGetRemappedRows").remapped_rows)


def nvmlDeviceGetComputeRunningProcesses_v3(handle):
    gpu = _device(handle, "nvmlDeviceGetComputeRunningProcesses_v3")
    return [nvmlFriendlyObject({"pid": pid, "usedGpuMemory": used, "gpuInstanceId": 0xFFFFFFFF,
                                "computeInstanceId": 0xFFFFFFFF}) for pid, used in gpu.processes]


def nvmlDeviceGetComputeRunningProcesses(handle):
    # the real one is wrapped by throwOnVersionMismatch
    try:
        return nvmlDeviceGetComputeRunningProcesses_v3(handle)
    except NVMLError_FunctionNotFound:  # noqa: F821 - generated above, as in the real module
        raise NVMLLibraryMismatchError("Unversioned function called and the pyNVML version does not match the "
                                       "NVML lib version. Either use matching pyNVML and NVML lib versions or use "
                                       "a versioned function such as nvmlDeviceGetComputeRunningProcesses_v2") from None


# ---- events


def nvmlEventSetCreate():
    _initialized("nvmlEventSetCreate")
    event_set = FakeEventSet()
    scenario.event_sets.append(event_set)
    return event_set


def nvmlDeviceRegisterEvents(handle, eventTypes, eventSet):
    _device(handle, "nvmlDeviceRegisterEvents")
    eventSet.registered.append((handle, eventTypes))
    return None


def nvmlEventSetWait_v2(eventSet, timeoutms):
    _initialized("nvmlEventSetWait_v2")
    if eventSet.freed:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    for handle, types in eventSet.registered:
        gpu = scenario.gpus[handle.index]
        if types & nvmlEventTypeXidCriticalError and gpu.xids:
            return c_nvmlEventData_t(device=handle, eventType=nvmlEventTypeXidCriticalError,
                                     eventData=gpu.xids.popleft(), gpuInstanceId=0xFFFFFFFF,
                                     computeInstanceId=0xFFFFFFFF)
    raise NVMLError(NVML_ERROR_TIMEOUT)  # no waiting: tests never sleep


def nvmlEventSetWait(eventSet, timeoutms):
    return nvmlEventSetWait_v2(eventSet, timeoutms)


def nvmlEventSetFree(eventSet):
    _initialized("nvmlEventSetFree")
    eventSet.freed = True
    return None

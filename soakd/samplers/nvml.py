"""NVML sampler: per-GPU device state read through nvidia-ml-py (imported as ``pynvml``).

Per GPU (all visible, or those selected by index/UUID in ``samplers.nvml.gpus``): memory used,
total and driver-reserved; kernel and memory-controller utilisation; power draw and enforced
limit; an energy counter that keeps counting across driver reloads; GPU and memory temperature;
SM and memory clocks and their maxima; the clocks-event (throttle) reasons as one 0/1 series per
reason; violation (throttle-time) counters; volatile ECC errors; remapped rows; critical Xid
events; and the device memory of the target's processes when NVML shows them. Identity lives in
``soakd_gpu_info{gpu,uuid,name}``; every other series carries only ``gpu`` (index) and ``uuid``.

Longer than 500 lines: each of these fields is read on its own (a field the GPU does not support
is left out, a lost GPU does not stop the others), and the readers share the sampler's per-GPU
state (the energy counter across resets, the Xid event set, the unsupported-field memo); split
by field, every part would reach into that state.

Threading: every NVML call happens in ``_sample_blocking`` (or ``_close_blocking``), run with
``asyncio.to_thread``; nothing touches NVML on the event loop. A lock keeps a hung call from
overlapping the next run. Xid events are drained from an NVML event set inside the same call
(``nvmlEventSetWait_v2`` with a 0 ms timeout, at most ``MAX_XIDS_PER_SAMPLE`` per run); the
driver queues them between runs, so no extra thread has to be stopped or synchronised with
``nvmlShutdown``.

Failure domains:
- no nvidia-ml-py, no libnvidia-ml, no driver, no permission, no GPU: ``SamplerUnavailable``
  with what to do about it (the runner exports ``soakd_sampler_up 0`` and logs it once);
  ``nvmlInit`` is retried on every run, so a GPU that appears later is picked up.
- one call unsupported on one GPU (``NVMLError_NotSupported``, ``FunctionNotFound``, ...): that
  call is dropped for that GPU (logged once at info) and the rest is exported; fallbacks cover
  the deprecated APIs (temperature, throttle reasons, memory info v1).
- other errors of one call: the field is skipped this run.
- a GPU lost mid-run (``GpuIsLost``, ``Unknown``, ``ResetRequired``...): its series disappear,
  the other GPUs are still sampled (logged once per state change). When no GPU can be read,
  the run fails and NVML is shut down so that the next run re-initialises it (a reset GPU or a
  reloaded driver needs fresh handles).
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib
import inspect
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from soakd.config import NvmlSamplerConfig
from soakd.core.series import Series, series
from soakd.samplers.base import SamplerUnavailable

log = structlog.get_logger("soakd.samplers.nvml")

# (reason label, nvidia-ml-py constant, the deprecated constant with the same bit)
CLOCK_EVENT_REASONS: tuple[tuple[str, str, str], ...] = (
    ("sw_power_cap", "nvmlClocksEventReasonSwPowerCap", "nvmlClocksThrottleReasonSwPowerCap"),
    ("hw_slowdown", "nvmlClocksEventReasonHwSlowdown", "nvmlClocksThrottleReasonHwSlowdown"),
    ("sw_thermal", "nvmlClocksEventReasonSwThermalSlowdown", "nvmlClocksThrottleReasonSwThermalSlowdown"),
    ("hw_thermal", "nvmlClocksEventReasonHwThermalSlowdown", "nvmlClocksThrottleReasonHwThermalSlowdown"),
    ("hw_power_brake", "nvmlClocksEventReasonHwPowerBrakeSlowdown", "nvmlClocksThrottleReasonHwPowerBrakeSlowdown"),
    ("sync_boost", "nvmlClocksEventReasonSyncBoost", "nvmlClocksThrottleReasonSyncBoost"),
    ("applications_clocks", "nvmlClocksEventReasonApplicationsClocksSetting",
     "nvmlClocksThrottleReasonApplicationsClocksSetting"),
    ("display_clock", "nvmlClocksEventReasonDisplayClockSetting", "nvmlClocksThrottleReasonDisplayClockSetting"),
    ("idle", "nvmlClocksEventReasonGpuIdle", "nvmlClocksThrottleReasonGpuIdle"),
)
CLOCK_EVENT_REASON_LABELS: tuple[str, ...] = tuple(r[0] for r in CLOCK_EVENT_REASONS)

# (reason label, perf-policy constant) for nvmlDeviceGetViolationStatus
THROTTLE_POLICIES: tuple[tuple[str, str], ...] = (
    ("power", "NVML_PERF_POLICY_POWER"),
    ("thermal", "NVML_PERF_POLICY_THERMAL"),
    ("sync_boost", "NVML_PERF_POLICY_SYNC_BOOST"),
    ("board_limit", "NVML_PERF_POLICY_BOARD_LIMIT"),
    ("low_utilization", "NVML_PERF_POLICY_LOW_UTILIZATION"),
    ("reliability", "NVML_PERF_POLICY_RELIABILITY"),
    ("app_clocks", "NVML_PERF_POLICY_TOTAL_APP_CLOCKS"),
    ("base_clocks", "NVML_PERF_POLICY_TOTAL_BASE_CLOCKS"),
)
THROTTLE_REASON_LABELS: tuple[str, ...] = tuple(p[0] for p in THROTTLE_POLICIES)

_ECC_KINDS = (("corrected", "NVML_MEMORY_ERROR_TYPE_CORRECTED"), ("uncorrected", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED"))
_REMAPPED_KINDS = ("correctable", "uncorrectable", "pending", "failure")  # order of nvmlDeviceGetRemappedRows
_CLOCKS = (  # (metric stem, clock-type constant)
    ("soakd_gpu_sm_clock", "NVML_CLOCK_SM"),
    ("soakd_gpu_memory_clock", "NVML_CLOCK_MEM"),
)
# c_nvmlFieldValue_t.valueType -> the member of the c_nvmlValue_t union that holds the value
_VALUE_MEMBERS = (
    ("NVML_VALUE_TYPE_DOUBLE", "dVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_INT", "uiVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_LONG", "ulVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", "ullVal"),
    ("NVML_VALUE_TYPE_SIGNED_LONG_LONG", "sllVal"),
    ("NVML_VALUE_TYPE_SIGNED_INT", "siVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_SHORT", "usVal"),
)

# A call failing with one of these will fail the same way again: stop calling it for that GPU.
_UNSUPPORTED_ERRORS = (
    "NVMLError_NotSupported",
    "NVMLError_FunctionNotFound",  # the driver predates the call
    "NVMLError_ArgumentVersionMismatch",  # versioned struct the driver doesn't know
    "NVMLError_NoPermission",
    "NVMLError_Deprecated",
    "NVMLLibraryMismatchError",  # unversioned process-list call on a mismatched driver (not an NVMLError)
)
# The GPU (or the whole driver) is gone: drop the GPU's series this run.
_LOST_ERRORS = (
    "NVMLError_GpuIsLost",
    "NVMLError_Unknown",
    "NVMLError_ResetRequired",
    "NVMLError_GpuNotFound",
    "NVMLError_Uninitialized",
    "NVMLError_DriverNotLoaded",
    "NVMLError_LibRmVersionMismatch",
)

MAX_XIDS_PER_SAMPLE = 64
_NA_ULONGLONG = (1 << 64) - 1  # NVML_VALUE_NOT_AVAILABLE_ulonglong (nvidia-ml-py maps it to None already)
_HOW_TO_GET_A_GPU = (
    "Give the soakd container the GPUs it should watch (Kubernetes sidecar: env NVIDIA_VISIBLE_DEVICES=all, or "
    "the server's GPU UUIDs, with the NVIDIA container runtime; Docker: --gpus all), or set "
    "samplers.nvml.mode: off and scrape dcgm-exporter instead (samplers.dcgm.url)."
)


class _NotAvailable:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NA"


NA: Any = _NotAvailable()


class _GpuLost(Exception):
    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error) or type(error).__name__)
        self.error = error


class _Never(Exception):
    """Stands in for an exception class this nvidia-ml-py doesn't define (never raised)."""


def _classes(module: Any, names: Iterable[str]) -> tuple[type[BaseException], ...]:
    found = tuple(c for c in (getattr(module, n, None) for n in names) if isinstance(c, type))
    return found or (_Never,)


@dataclass(frozen=True)
class _Api:
    """What the sampler needs from one loaded nvidia-ml-py module, resolved once."""

    base: tuple[type[BaseException], ...]
    unsupported: tuple[type[BaseException], ...]
    lost: tuple[type[BaseException], ...]
    timeout: tuple[type[BaseException], ...]
    memory_v2: bool
    reason_masks: tuple[tuple[str, int], ...]
    value_members: dict[int, str]

    @classmethod
    def of(cls, nvml: Any) -> _Api:
        get_memory = getattr(nvml, "nvmlDeviceGetMemoryInfo", None)
        try:
            memory_v2 = hasattr(nvml, "nvmlMemory_v2") and "version" in inspect.signature(get_memory).parameters
        except (TypeError, ValueError):
            memory_v2 = False
        masks = []
        for label, new, old in CLOCK_EVENT_REASONS:
            bit = getattr(nvml, new, None)
            if bit is None:
                bit = getattr(nvml, old, None)
            if bit is not None:
                masks.append((label, int(bit)))
        members = {int(getattr(nvml, c)): m for c, m in _VALUE_MEMBERS if hasattr(nvml, c)}
        return cls(
            base=_classes(nvml, ("NVMLError",)),
            unsupported=_classes(nvml, _UNSUPPORTED_ERRORS),
            lost=_classes(nvml, _LOST_ERRORS),
            timeout=_classes(nvml, ("NVMLError_Timeout",)),
            memory_v2=memory_v2,
            reason_masks=tuple(masks),
            value_members=members,
        )


@dataclass(eq=False)
class _Gpu:
    index: int
    uuid: str
    name: str
    handle: Any
    unsupported: dict[str, str] = field(default_factory=dict)  # call key -> why
    logged: set[str] = field(default_factory=set)
    xid: bool = False  # registered for critical Xid events


class _MonotonicCounter:
    """A raw counter re-based to 0 at the first reading and continued across raw resets (a driver
    reload restarts NVML's energy counter from zero)."""

    __slots__ = ("base", "last", "carried")

    def __init__(self, raw: float) -> None:
        self.base = raw
        self.last = raw
        self.carried = 0.0

    def update(self, raw: float) -> float:
        if raw < self.last:  # the raw counter restarted: keep what was counted before
            self.carried += self.last - self.base
            self.base = 0.0
        self.last = raw
        return self.carried + raw - self.base


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _address(handle: Any) -> int | None:
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except Exception:  # noqa: BLE001 - not a ctypes pointer (a fake handle)
        return None


def _is_index(selector: int | str) -> bool:
    return isinstance(selector, int) or (isinstance(selector, str) and selector.strip().isdigit())


class NvmlSampler:
    """The ``nvml`` sampler (see the module docstring)."""

    name = "nvml"

    def __init__(
        self,
        config: NvmlSamplerConfig | None = None,
        nvml_module: Any = None,
        target_pids: Callable[[], Iterable[int]] | None = None,
    ) -> None:
        """``nvml_module``: an nvidia-ml-py compatible module; default ``import pynvml`` on the
        first run. ``target_pids``: the target server's PIDs as NVML reports them (NVML lists
        PIDs of the PID namespace the driver sees, so they match only when soakd shares it);
        called once per run in the sampler's worker thread (it may read /proc)."""
        self.config = config if config is not None else NvmlSamplerConfig()
        self._nvml = nvml_module
        self._api: _Api | None = _Api.of(nvml_module) if nvml_module is not None else None
        self._target_pids = target_pids
        self._lock = threading.Lock()
        self._closed = False
        self._initialized = False
        self._gpus: list[_Gpu] = []
        self._pending: list[int | str] = []  # selectors not resolved yet, retried every run
        self._event_set: Any = None
        self._driver = ""
        # per UUID, kept across NVML re-initialisations
        self._energy: dict[str, _MonotonicCounter] = {}
        self._xid_count: dict[str, int] = {}
        self._last_xid: dict[str, int] = {}
        self._lost: set[str] = set()
        self._enumeration_problems: frozenset[str] = frozenset()
        self._required_logged = False

    # ---- the Sampler protocol

    async def sample(self) -> Sequence[Series]:
        if self.config.mode == "off":
            raise SamplerUnavailable("the NVML sampler is off (samplers.nvml.mode: off)")
        try:
            result = await asyncio.to_thread(self._sample_blocking)
        except SamplerUnavailable as exc:
            if self.config.mode == "on" and not self._required_logged:
                self._required_logged = True
                log.error("nvml_required_but_unavailable", reason=str(exc))
            raise
        self._required_logged = False
        return result

    async def aclose(self) -> None:
        self._closed = True
        await asyncio.to_thread(self._close_blocking)

    # ---- everything below runs in a worker thread

    def _sample_blocking(self) -> list[Series]:
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("the previous NVML run is still going (an NVML call is hanging)")
        try:
            if self._closed:
                raise SamplerUnavailable("the NVML sampler is closed")
            nvml = self._module()
            if not self._initialized:
                self._init(nvml)
            return self._read(nvml, self._pids())
        finally:
            self._lock.release()

    def _close_blocking(self) -> None:
        if not self._lock.acquire(timeout=5.0):
            log.warning("nvml_shutdown_skipped", reason="an NVML call is still running")
            return
        try:
            if self._nvml is not None and self._initialized:
                self._teardown(self._nvml)
        finally:
            self._lock.release()

    def _module(self) -> Any:
        if self._nvml is None:
            try:
                self._nvml = importlib.import_module("pynvml")
            except Exception as exc:  # noqa: BLE001 - ImportError, or a broken installation
                raise SamplerUnavailable(
                    f"nvidia-ml-py is not installed (import pynvml: {exc}); install it (pip install nvidia-ml-py) "
                    "or set samplers.nvml.mode: off and scrape dcgm-exporter instead (samplers.dcgm.url)."
                ) from exc
            self._api = _Api.of(self._nvml)
        return self._nvml

    def _init(self, nvml: Any) -> None:
        api = self._api
        assert api is not None
        try:
            nvml.nvmlInit()
        except api.base as exc:
            raise SamplerUnavailable(_init_advice(nvml, exc)) from exc
        self._initialized = True
        try:
            count = int(nvml.nvmlDeviceGetCount())
            self._gpus = []
            self._pending = list(self.config.gpus) if self.config.gpus else list(range(count))
            self._resolve(nvml)
            if not self._gpus:
                raise SamplerUnavailable(self._no_gpu_message(count))
            self._setup_events(nvml)
            try:
                self._driver = _text(nvml.nvmlSystemGetDriverVersion())
            except api.base:
                self._driver = ""
        except SamplerUnavailable:
            self._teardown(nvml)
            raise
        except api.base as exc:
            self._teardown(nvml)
            raise SamplerUnavailable(f"NVML initialised but listing its GPUs failed: {exc}") from exc
        except BaseException:
            self._teardown(nvml)
            raise
        log.info("nvml_ready", driver=self._driver or None,
                 gpus=[f"{g.index} {g.uuid} {g.name}" for g in self._gpus],
                 waiting_for=[str(s) for s in self._pending] or None)

    def _no_gpu_message(self, count: int) -> str:
        if count == 0:
            return ("NVML initialised but sees no GPU in this container (NVIDIA_VISIBLE_DEVICES empty, none or "
                    "void?). " + _HOW_TO_GET_A_GPU)
        problems = "; ".join(sorted(self._enumeration_problems))
        if self.config.gpus:
            return (f"none of the GPUs in samplers.nvml.gpus={list(self.config.gpus)} could be opened ({problems}); "
                    f"NVML sees {count} GPU(s) here, indices 0-{count - 1}. Fix samplers.nvml.gpus (indices or "
                    "UUIDs as nvidia-smi -L shows them).")
        return f"NVML sees {count} GPU(s) but none could be opened: {problems}"

    def _teardown(self, nvml: Any) -> None:
        """Free the event set and shut NVML down; the next run initialises it again."""
        api = self._api
        assert api is not None
        if self._event_set is not None:
            try:
                nvml.nvmlEventSetFree(self._event_set)
            except api.base:
                pass
            self._event_set = None
        if self._initialized:
            try:
                nvml.nvmlShutdown()
            except api.base:
                pass
            self._initialized = False
        self._gpus = []
        self._pending = []

    def _resolve(self, nvml: Any) -> None:
        """Open the GPUs of the pending selectors; those that fail stay pending."""
        api = self._api
        assert api is not None
        still: list[int | str] = []
        problems: list[str] = []
        known = {g.uuid for g in self._gpus}
        for position, selector in enumerate(self._pending):
            try:
                gpu = self._open(nvml, selector, position)
            except api.base as exc:
                still.append(selector)
                what = f"index {int(selector)}" if _is_index(selector) else f"UUID {selector}"
                problems.append(f"{what}: {exc}")
                continue
            if gpu.uuid in known:  # selected twice (by index and by UUID)
                continue
            known.add(gpu.uuid)
            self._gpus.append(gpu)
            if self._event_set is not None:
                self._register_events(nvml, gpu)
        self._gpus.sort(key=lambda g: g.index)
        self._pending = still
        current = frozenset(problems)
        if current != self._enumeration_problems:
            self._enumeration_problems = current
            if current:
                log.warning("nvml_gpus_unavailable", problems=sorted(current))

    def _open(self, nvml: Any, selector: int | str, position: int) -> _Gpu:
        api = self._api
        assert api is not None
        index: int | None
        if _is_index(selector):
            index = int(selector)
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        else:
            index = None
            handle = nvml.nvmlDeviceGetHandleByUUID(str(selector).strip())
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        if index is None:
            try:
                index = int(nvml.nvmlDeviceGetIndex(handle))
            except api.base:  # e.g. a MIG device: no index of its own
                index = position
        try:
            name = _text(nvml.nvmlDeviceGetName(handle))
        except api.base:
            name = "unknown"
        return _Gpu(index=index, uuid=uuid, name=name, handle=handle)

    # ---- Xid events

    def _setup_events(self, nvml: Any) -> None:
        api = self._api
        assert api is not None
        if not hasattr(nvml, "nvmlEventTypeXidCriticalError") or not hasattr(nvml, "nvmlEventSetCreate"):
            return
        try:
            self._event_set = nvml.nvmlEventSetCreate()
        except api.base as exc:
            log.info("nvml_xid_events_unavailable", error=str(exc))
            return
        for gpu in self._gpus:
            self._register_events(nvml, gpu)

    def _register_events(self, nvml: Any, gpu: _Gpu) -> None:
        api = self._api
        assert api is not None
        try:
            nvml.nvmlDeviceRegisterEvents(gpu.handle, nvml.nvmlEventTypeXidCriticalError, self._event_set)
        except api.base as exc:
            gpu.xid = False
            log.info("nvml_xid_events_unsupported", gpu=gpu.index, uuid=gpu.uuid, error=str(exc))
            return
        gpu.xid = True
        self._xid_count.setdefault(gpu.uuid, 0)
        self._last_xid.setdefault(gpu.uuid, 0)

    def _drain_xids(self, nvml: Any) -> None:
        api = self._api
        assert api is not None
        if self._event_set is None:
            return
        wait = getattr(nvml, "nvmlEventSetWait_v2", None) or nvml.nvmlEventSetWait
        xid_type = int(nvml.nvmlEventTypeXidCriticalError)
        for _ in range(MAX_XIDS_PER_SAMPLE):
            try:
                data = wait(self._event_set, 0)
            except api.timeout:
                return  # nothing pending
            except api.base as exc:
                log.debug("nvml_event_wait_failed", error=str(exc))
                return
            if not int(data.eventType) & xid_type:
                continue
            gpu = self._gpu_of_event(nvml, data.device)
            if gpu is None:
                log.debug("nvml_xid_unattributed", xid=int(data.eventData))
                continue
            code = int(data.eventData)
            self._xid_count[gpu.uuid] = self._xid_count.get(gpu.uuid, 0) + 1
            self._last_xid[gpu.uuid] = code
            log.warning("gpu_xid_error", gpu=gpu.index, uuid=gpu.uuid, xid=code)

    def _gpu_of_event(self, nvml: Any, device: Any) -> _Gpu | None:
        api = self._api
        assert api is not None
        registered = [g for g in self._gpus if g.xid]
        address = _address(device)
        for g in registered:
            if g.handle is device or (address is not None and _address(g.handle) == address):
                return g
        try:
            uuid = _text(nvml.nvmlDeviceGetUUID(device))
        except api.base:
            uuid = None
        for g in registered:
            if g.uuid == uuid:
                return g
        return registered[0] if len(registered) == 1 else None

    # ---- reading

    def _read(self, nvml: Any, pids: set[int] | None) -> list[Series]:
        if self._pending:
            self._resolve(nvml)
        self._drain_xids(nvml)
        out: list[Series] = []
        failures: list[str] = []
        read = 0
        for gpu in list(self._gpus):
            try:
                out.extend(self._read_gpu(nvml, gpu, pids))
            except _GpuLost as lost:
                failures.append(f"GPU {gpu.index} ({gpu.uuid}): {lost}")
                if gpu.uuid not in self._lost:
                    self._lost.add(gpu.uuid)
                    log.warning("nvml_gpu_lost", gpu=gpu.index, uuid=gpu.uuid,
                                error=f"{type(lost.error).__name__}: {lost}")
                continue
            read += 1
            if gpu.uuid in self._lost:
                self._lost.discard(gpu.uuid)
                log.info("nvml_gpu_back", gpu=gpu.index, uuid=gpu.uuid)
            new = set(gpu.unsupported) - gpu.logged
            if new:
                gpu.logged |= new
                log.info("nvml_calls_unsupported", gpu=gpu.index, uuid=gpu.uuid,
                         calls={k: gpu.unsupported[k] for k in sorted(new)})
            if gpu.xid:
                labels = {"gpu": str(gpu.index), "uuid": gpu.uuid}
                out.append(series("soakd_gpu_xid_errors_total", self._xid_count.get(gpu.uuid, 0), **labels))
                out.append(series("soakd_gpu_last_xid", self._last_xid.get(gpu.uuid, 0), **labels))
        if read == 0:
            self._teardown(nvml)
            raise RuntimeError("NVML: no GPU could be read (" + "; ".join(failures) + "); NVML will be "
                               "re-initialised on the next run")
        return out

    def _call(self, gpu: _Gpu, key: str, function: str, *args: Any, **kwargs: Any) -> Any:
        """One NVML getter for one GPU, tolerated on its own: NA when unsupported (for good) or
        failing (this run); ``_GpuLost`` when the GPU is gone."""
        if key in gpu.unsupported:
            return NA
        api = self._api
        assert api is not None
        fn = getattr(self._nvml, function, None)
        if fn is None:
            gpu.unsupported[key] = f"{function} is not in this nvidia-ml-py"
            return NA
        try:
            return fn(*args, **kwargs)
        except api.unsupported as exc:
            gpu.unsupported[key] = f"{type(exc).__name__}: {exc}"
        except api.lost as exc:
            raise _GpuLost(exc) from exc
        except api.base as exc:
            log.debug("nvml_call_failed", gpu=gpu.index, call=key, error=f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - a binding that doesn't match this code: stop calling it
            gpu.unsupported[key] = f"{type(exc).__name__}: {exc}"
        return NA

    def _first(self, gpu: _Gpu, calls: Sequence[tuple[str, str, tuple[Any, ...]]]) -> Any:
        """The first of alternative calls (newest API first); falls back only when unsupported."""
        for key, function, args in calls:
            value = self._call(gpu, key, function, *args)
            if value is not NA or key not in gpu.unsupported:
                return value
        return NA

    def _read_gpu(self, nvml: Any, gpu: _Gpu, pids: set[int] | None) -> list[Series]:
        h = gpu.handle
        labels = {"gpu": str(gpu.index), "uuid": gpu.uuid}
        # built directly: series() can't take a label called "name"
        out = [Series("soakd_gpu_info", 1.0, (("gpu", labels["gpu"]), ("uuid", gpu.uuid), ("name", gpu.name)))]

        def put(name: str, value: float, **extra: str) -> None:
            out.append(series(name, value, **labels, **extra))

        api = self._api
        assert api is not None
        # memory: v2 separates the driver-reserved part; v1 counts it as used
        mem = NA
        if api.memory_v2:
            mem = self._call(gpu, "nvmlDeviceGetMemoryInfo(v2)", "nvmlDeviceGetMemoryInfo", h,
                             version=nvml.nvmlMemory_v2)
        if mem is NA and (not api.memory_v2 or "nvmlDeviceGetMemoryInfo(v2)" in gpu.unsupported):
            mem = self._call(gpu, "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo", h)
        if mem is not NA:
            put("soakd_gpu_memory_used_bytes", mem.used)
            put("soakd_gpu_memory_total_bytes", mem.total)
            reserved = getattr(mem, "reserved", None)
            if reserved is not None:
                put("soakd_gpu_memory_reserved_bytes", reserved)

        util = self._call(gpu, "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetUtilizationRates", h)
        if util is not NA:
            put("soakd_gpu_utilization_ratio", util.gpu / 100.0)
            put("soakd_gpu_memory_utilization_ratio", util.memory / 100.0)

        power = self._call(gpu, "nvmlDeviceGetPowerUsage", "nvmlDeviceGetPowerUsage", h)
        if power is not NA:
            put("soakd_gpu_power_watts", power / 1000.0)  # mW
        limit = self._call(gpu, "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetEnforcedPowerLimit", h)
        if limit is not NA:
            put("soakd_gpu_power_limit_watts", limit / 1000.0)  # mW
        energy = self._call(gpu, "nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetTotalEnergyConsumption", h)
        if energy is not NA:  # mJ since the driver loaded -> J since soakd started watching
            counter = self._energy.get(gpu.uuid)
            if counter is None:
                counter = self._energy[gpu.uuid] = _MonotonicCounter(float(energy))
            put("soakd_gpu_energy_joules_total", counter.update(float(energy)) / 1000.0)

        sensor = getattr(nvml, "NVML_TEMPERATURE_GPU", 0)
        temp = self._first(gpu, (("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperatureV", (h, sensor)),
                                 ("nvmlDeviceGetTemperature", "nvmlDeviceGetTemperature", (h, sensor))))
        if temp is not NA:
            put("soakd_gpu_temperature_celsius", temp, sensor="gpu")
        memory_temp = self._memory_temperature(nvml, gpu)
        if memory_temp is not None:
            put("soakd_gpu_temperature_celsius", memory_temp, sensor="memory")

        for stem, constant in _CLOCKS:
            clock_type = getattr(nvml, constant)
            current = self._call(gpu, f"nvmlDeviceGetClockInfo({constant})", "nvmlDeviceGetClockInfo", h, clock_type)
            if current is not NA:
                put(f"{stem}_hertz", current * 1e6)  # MHz
            top = self._call(gpu, f"nvmlDeviceGetMaxClockInfo({constant})", "nvmlDeviceGetMaxClockInfo", h,
                             clock_type)
            if top is not NA:
                put(f"{stem}_max_hertz", top * 1e6)

        reasons = self._first(gpu, (
            ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksEventReasons", (h,)),
            ("nvmlDeviceGetCurrentClocksThrottleReasons", "nvmlDeviceGetCurrentClocksThrottleReasons", (h,)),
        ))
        if reasons is not NA:
            bits = int(reasons)
            for label, mask in api.reason_masks:  # every label, 0 or 1: no series come and go
                put("soakd_gpu_clocks_event_active", 1 if bits & mask else 0, reason=label)

        for label, constant in THROTTLE_POLICIES:
            policy = getattr(nvml, constant, None)
            if policy is None:
                continue
            violation = self._call(gpu, f"nvmlDeviceGetViolationStatus({constant})", "nvmlDeviceGetViolationStatus",
                                   h, policy)
            if violation is not NA:
                put("soakd_gpu_throttle_seconds_total", violation.violationTime / 1e9, reason=label)  # ns

        for kind, constant in _ECC_KINDS:
            count = self._call(gpu, f"nvmlDeviceGetTotalEccErrors({constant})", "nvmlDeviceGetTotalEccErrors", h,
                               getattr(nvml, constant), nvml.NVML_VOLATILE_ECC)
            if count is not NA:
                put("soakd_gpu_ecc_errors_total", count, kind=kind)

        rows = self._call(gpu, "nvmlDeviceGetRemappedRows", "nvmlDeviceGetRemappedRows", h)
        if rows is not NA:
            for kind, value in zip(_REMAPPED_KINDS, rows, strict=False):
                put("soakd_gpu_remapped_rows", int(value), kind=kind)

        if pids:
            used = self._target_memory(gpu, pids)
            if used is not None:
                put("soakd_target_gpu_memory_used_bytes", used)
        return out

    def _memory_temperature(self, nvml: Any, gpu: _Gpu) -> float | None:
        key = "nvmlDeviceGetFieldValues(NVML_FI_DEV_MEMORY_TEMP)"
        field_id = getattr(nvml, "NVML_FI_DEV_MEMORY_TEMP", None)
        if field_id is None:
            gpu.unsupported.setdefault(key, "NVML_FI_DEV_MEMORY_TEMP is not in this nvidia-ml-py")
            return None
        values = self._call(gpu, key, "nvmlDeviceGetFieldValues", gpu.handle, [field_id])
        if values is NA or len(values) < 1:
            return None
        value = values[0]
        ret = int(value.nvmlReturn)
        if ret != nvml.NVML_SUCCESS:
            if ret in (getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", -1),
                       getattr(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", -1)):
                gpu.unsupported[key] = "field value not supported"
            return None
        assert self._api is not None
        member = self._api.value_members.get(int(value.valueType))
        if member is None:
            return None
        return float(getattr(value.value, member))

    def _target_memory(self, gpu: _Gpu, pids: set[int]) -> int | None:
        processes = self._call(gpu, "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses",
                               gpu.handle)
        if processes is NA:
            return None
        total, matched = 0, False
        for process in processes:
            if int(process.pid) not in pids:
                continue
            used = getattr(process, "usedGpuMemory", None)
            if used is None or int(used) >= _NA_ULONGLONG:  # not available (containers, WDDM)
                continue
            total += int(used)
            matched = True
        return total if matched else None

    def _pids(self) -> set[int] | None:
        if self._target_pids is None:
            return None
        try:
            return {int(p) for p in self._target_pids() or ()}
        except Exception as exc:  # noqa: BLE001 - the PID source is someone else's; never fatal here
            log.debug("nvml_target_pids_failed", error=repr(exc))
            return None


def _init_advice(nvml: Any, exc: BaseException) -> str:
    """A message for an nvmlInit failure that says what to do about it."""
    code = getattr(exc, "value", None)

    def is_(name: str) -> bool:
        return code is not None and code == getattr(nvml, name, object())

    detail = f"{type(exc).__name__}: {exc}"
    if is_("NVML_ERROR_LIBRARY_NOT_FOUND"):
        return ("NVML is not available: libnvidia-ml.so.1 was not found in this container, so the NVIDIA driver's "
                f"libraries are not mounted ({detail}). " + _HOW_TO_GET_A_GPU)
    if is_("NVML_ERROR_DRIVER_NOT_LOADED"):
        return ("NVML is not available: the NVIDIA kernel driver is not loaded on this node (nvidia-smi fails the "
                f"same way; {detail}). Check the node's driver, or " + _HOW_TO_GET_A_GPU[0].lower()
                + _HOW_TO_GET_A_GPU[1:])
    if is_("NVML_ERROR_NO_PERMISSION"):
        return ("NVML is not available: no permission to open the GPU device nodes /dev/nvidia* "
                f"({detail}). Run soakd with the same device access as the server. " + _HOW_TO_GET_A_GPU)
    if is_("NVML_ERROR_LIB_RM_VERSION_MISMATCH"):
        return ("NVML is not available: the NVML library and the kernel driver have different versions (driver "
                f"upgraded without a reboot, or a library baked into the image; {detail}). Restart the pod on a "
                "consistent node, or " + _HOW_TO_GET_A_GPU[0].lower() + _HOW_TO_GET_A_GPU[1:])
    return f"NVML is not available: nvmlInit failed ({detail}). " + _HOW_TO_GET_A_GPU

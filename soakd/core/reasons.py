"""Reason labels shared by the NVML and dcgm-exporter samplers (pure data and functions).

Clocks-event ("throttle") reasons are one bitmask in both sources: NVML's
``nvmlDeviceGetCurrentClocksEventReasons`` and DCGM's ``DCGM_FI_DEV_CLOCKS_EVENT_REASONS`` (formerly
``DCGM_FI_DEV_CLOCK_THROTTLE_REASONS``), whose ``DCGM_CLOCKS_EVENT_REASON_*`` masks are documented in
``dcgm_fields.h`` as "a 1:1 map to the NVML reasons". The bit values below are NVML's
``nvmlClocksEventReason*`` constants (nvidia-ml-py ``pynvml.py``); a test checks them against the
installed module. They become the bounded ``reason`` label of ``soakd_gpu_clocks_event_active``, in
the order the catalogue lists them.

Violation counters (time held below the requested clocks) come from NVML's
``nvmlDeviceGetViolationStatus(policy)`` or DCGM's ``DCGM_FI_DEV_*_VIOLATION`` fields; both map to the
``reason`` label of ``soakd_gpu_throttle_seconds_total``.
"""

from __future__ import annotations

# (reason label, NVML bit) in catalogue order.
CLOCKS_EVENT_REASONS: tuple[tuple[str, int], ...] = (
    ("sw_power_cap", 0x0000000000000004),  # nvmlClocksEventReasonSwPowerCap
    ("hw_slowdown", 0x0000000000000008),  # nvmlClocksEventReasonHwSlowdown
    ("sw_thermal", 0x0000000000000020),  # nvmlClocksEventReasonSwThermalSlowdown
    ("hw_thermal", 0x0000000000000040),  # nvmlClocksEventReasonHwThermalSlowdown
    ("hw_power_brake", 0x0000000000000080),  # nvmlClocksEventReasonHwPowerBrakeSlowdown
    ("sync_boost", 0x0000000000000010),  # nvmlClocksEventReasonSyncBoost
    ("applications_clocks", 0x0000000000000002),  # nvmlClocksEventReasonApplicationsClocksSetting
    ("display_clock", 0x0000000000000100),  # nvmlClocksEventReasonDisplayClockSetting
    ("idle", 0x0000000000000001),  # nvmlClocksEventReasonGpuIdle
)

CLOCKS_EVENT_REASON_NAMES: tuple[str, ...] = tuple(name for name, _ in CLOCKS_EVENT_REASONS)

# The reasons that cost performance (not idle, application clocks, sync boost or display clock).
PERFORMANCE_REASONS: tuple[str, ...] = ("sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake")
THERMAL_REASONS = frozenset({"sw_thermal", "hw_thermal", "hw_slowdown"})  # hw_slowdown: thermal or power
POWER_REASONS = frozenset({"sw_power_cap", "hw_power_brake", "hw_slowdown"})


def decode_clocks_event_reasons(mask: int | float) -> dict[str, bool]:
    """Every known reason -> whether its bit is set in ``mask`` (unknown bits are ignored).

    Floats are accepted because Prometheus expositions carry the mask as a float sample value.
    """
    bits = int(mask)
    return {name: bool(bits & bit) for name, bit in CLOCKS_EVENT_REASONS}


# (reason label, NVML perf policy id, DCGM field name) in catalogue order.
# NVML: NVML_PERF_POLICY_* in pynvml; DCGM: dcgm_fields.h (fields 240-247).
VIOLATION_REASONS: tuple[tuple[str, int, str], ...] = (
    ("power", 0, "DCGM_FI_DEV_POWER_VIOLATION"),
    ("thermal", 1, "DCGM_FI_DEV_THERMAL_VIOLATION"),
    ("sync_boost", 2, "DCGM_FI_DEV_SYNC_BOOST_VIOLATION"),
    ("board_limit", 3, "DCGM_FI_DEV_BOARD_LIMIT_VIOLATION"),
    ("low_utilization", 4, "DCGM_FI_DEV_LOW_UTIL_VIOLATION"),
    ("reliability", 5, "DCGM_FI_DEV_RELIABILITY_VIOLATION"),
    ("app_clocks", 10, "DCGM_FI_DEV_TOTAL_APP_CLOCKS_VIOLATION"),
    ("base_clocks", 11, "DCGM_FI_DEV_TOTAL_BASE_CLOCKS_VIOLATION"),
)

"""The NVIDIA Xid codes that matter in a soak, with what each means and what to do.

From NVIDIA's Xid catalog (docs.nvidia.com/deploy/xid-errors, Ampere and newer; the resolution
buckets RESTART_APP, RESET_GPU, RESTART_BM and CONTACT_SUPPORT are the catalog's). Any Xid the NVML
sampler sees (``nvmlEventTypeXidCriticalError``) fails the run: a GPU that reports one during a
qualification soak has not qualified, whatever the code; the table says where to look first. The
table in docs/analysis.md#gpu-errors is this one.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["XID", "Xid", "describe"]


class Xid(NamedTuple):
    name: str
    meaning: str
    action: str  # the first thing to do


XID: dict[int, Xid] = {
    8: Xid("GPU stopped processing", "a channel stopped making progress (idle timeout)",
           "restart the server; if it repeats, collect nvidia-bug-report and contact support"),
    13: Xid("Graphics Engine Exception", "an engine exception, usually an illegal instruction or address in a "
            "kernel", "restart the server; check the serving stack's kernels (CUDA/driver versions), then hardware"),
    31: Xid("GPU memory page fault", "an MMU fault: a kernel touched memory it does not own",
            "restart the server; an application or driver bug far more often than hardware"),
    43: Xid("GPU stopped processing", "the driver reset a channel after a fault of the application",
            "restart the server; look at the Xid before it"),
    45: Xid("Preemptive cleanup", "channels cleaned up after an earlier error (follows another Xid)",
            "look at the Xid before it"),
    48: Xid("Double-bit ECC error", "an uncorrectable (DBE) memory error",
            "reset the GPU; repeated DBEs: replace the GPU"),
    61: Xid("Internal micro-controller breakpoint", "the GPU's firmware hit a breakpoint or warning",
            "reset the GPU; collect nvidia-bug-report if it repeats"),
    62: Xid("Internal micro-controller halt", "the GPU's firmware halted", "reset the GPU"),
    63: Xid("Row remapping / page retirement event", "an ECC error was recorded for remapping or retirement",
            "reset the GPU to apply the remapping at a convenient time"),
    64: Xid("Row remapping / page retirement failure", "an ECC error could not be recorded for remapping",
            "contact support: the GPU likely needs replacement"),
    74: Xid("NVLink error", "an NVLink link failed or flapped", "reset the GPU; check the NVLink/NVSwitch fabric"),
    79: Xid("GPU has fallen off the bus", "the GPU stopped answering on PCIe",
            "reboot the node; check PCIe seating, risers, power delivery and temperature; repeated: hardware"),
    92: Xid("High single-bit ECC error rate", "corrected errors at a high rate", "watch the ECC counters; plan a "
            "replacement if it keeps rising"),
    94: Xid("Contained ECC error", "an uncorrectable ECC error contained to the applications that used the memory",
            "restart the server; reset the GPU to remap the row"),
    95: Xid("Uncontained ECC error", "an uncorrectable ECC error that may have corrupted other contexts",
            "reset the GPU"),
    109: Xid("Context switch timeout", "a context switch did not complete in time", "restart the server"),
    119: Xid("GSP RPC timeout", "the GPU System Processor did not answer the driver", "reset the GPU"),
    120: Xid("GSP error", "the GPU System Processor reported an error", "reset the GPU"),
    140: Xid("Unrecovered ECC error", "an ECC error that row remapping could not recover", "reset the GPU"),
    154: Xid("GPU recovery action changed", "the driver's recommended recovery action changed (the Xid before it "
             "says why)", "do the recovery action nvidia-smi -q reports (reset, reboot or drain)"),
}


def describe(code: int) -> str:
    """``Xid 79 (GPU has fallen off the bus: the GPU stopped answering on PCIe; reboot the node; ...)``."""
    x = XID.get(int(code))
    if x is None:
        return f"Xid {code} (see NVIDIA's Xid catalog, docs.nvidia.com/deploy/xid-errors)"
    return f"Xid {code} ({x.name}: {x.meaning}; {x.action})"

"""Critical GPU errors: new Xid events and new uncorrected ECC errors, per window and GPU.

A GPU that reports a critical Xid or an uncorrectable ECC error during a qualification soak has not
qualified, whatever the latency did: each is a critical finding of kind ``gpu`` in the window it was
seen in (partial windows included: the last minutes of a run count), failing the run by default
(``analysis.verdict.fail_on``), with the code and what it means (``soakd.core.xid``).

The counters come from the window summaries (``DeviceSummary.gpu_errors``, per GPU uuid):

- ``xid_total``: NVML's critical Xid events since soakd started (``soakd_gpu_xid_errors_total``); a
  value lower than the previous window's is a restarted soakd (a resumed run), counted from zero;
- ``last_xid``: the code of the last one; with DCGM, which gives only this, a change to a non-zero
  code is one new event;
- ``ecc_uncorrected``: the volatile uncorrected ECC count, since the driver loaded: errors from before
  the run (its first reading) are not this run's.
"""

from __future__ import annotations

from soakd.core.findings import Finding
from soakd.analysis.restarts import counter_increase
from soakd.core.summary import WindowSummary as Window
from soakd.core.xid import XID, describe

__all__ = ["GpuErrors"]


class GpuErrors:
    """The previous window's counters per GPU, and the findings of each new window."""

    def __init__(self) -> None:
        self.prev: dict[str, dict[str, float]] = {}

    def prime(self, w: Window) -> None:
        """A window of an earlier segment (a resumed run): its counters, no findings."""
        for gpu, cur in ((w.device.gpu_errors if w.device else None) or {}).items():
            self.prev[gpu] = {**self.prev.get(gpu, {}), **cur}

    def add(self, w: Window) -> list[Finding]:
        out: list[Finding] = []
        for gpu, cur in ((w.device.gpu_errors if w.device else None) or {}).items():
            prev = self.prev.get(gpu)
            code = int(cur.get("last_xid") or 0)
            new_xid = 0.0
            if "xid_total" in cur:
                new_xid = counter_increase(cur["xid_total"], prev.get("xid_total", 0.0) if prev else 0.0)
            elif code:
                before = prev.get("last_xid") if prev else cur.get("last_xid_first")
                new_xid = 1.0 if code != int(before or 0) else 0.0
            if new_xid > 0:
                x = XID.get(code)
                out.append(Finding(
                    kind="gpu", diagnosis="GPU Xid error", severity="critical",
                    message=f"GPU {gpu}: {int(new_xid)} critical Xid event(s) in window {w.window}; the last: "
                            f"{describe(code) if code else 'code not reported'}",
                    evidence={"gpu": gpu, "xid": code or None, "events": int(new_xid),
                              "name": x.name if x else None, "action": x.action if x else None},
                    window=w.window))
            if "ecc_uncorrected" in cur:
                before = prev.get("ecc_uncorrected") if prev and "ecc_uncorrected" in prev else \
                    cur.get("ecc_uncorrected_first", cur["ecc_uncorrected"])
                new_ecc = counter_increase(cur["ecc_uncorrected"], before)
                if new_ecc > 0:
                    out.append(Finding(
                        kind="gpu", diagnosis="uncorrectable ECC error", severity="critical",
                        message=f"GPU {gpu}: {int(new_ecc)} new uncorrected (double-bit) ECC error(s) in window "
                                f"{w.window} ({int(cur['ecc_uncorrected'])} since the driver loaded): reset the GPU; "
                                "repeated errors: replace it",
                        evidence={"gpu": gpu, "ecc_uncorrected": int(new_ecc), "total": int(cur["ecc_uncorrected"])},
                        window=w.window))
            self.prev[gpu] = {**(prev or {}), **cur}
        return out

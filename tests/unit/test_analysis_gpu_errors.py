"""Critical GPU errors (soakd.analysis.gpu_errors) through the analysis engine: a new Xid event or a new
uncorrected ECC error is a critical ``gpu`` finding of its window that fails the run, with the code's
meaning; counters from before the run, a restarted soakd and a healthy GPU are not."""

from __future__ import annotations

import random
from typing import Any

from soakd.analysis.engine import Analyzer
from soakd.config import AnalysisConfig
from soakd.core.xid import XID, describe
from helpers.windows import make_window


def _windows(errors: list[dict[str, dict[str, float]] | None], *, partial_last: bool = False) -> list[Any]:
    rng = random.Random(3)
    out = []
    for i, e in enumerate(errors):
        device = {"gpu_errors": e} if e is not None else {}
        out.append(make_window(i, rng, 1000, device=device, partial=partial_last and i == len(errors) - 1))
    return out


def _run(windows: list[Any], **cfg: Any) -> tuple[Analyzer, Any]:
    a = Analyzer(AnalysisConfig(**cfg))
    for w in windows:
        a.add_window(w)
    return a, a.verdict()


def _gpu(a: Analyzer) -> list[dict[str, Any]]:
    return [f for f in a.findings if f.kind == "gpu"]


def nvml(xid_total: float, last_xid: float = 0.0, ecc: float = 0.0, ecc_first: float | None = None) -> dict:
    return {"xid_total": xid_total, "xid_total_first": xid_total, "last_xid": last_xid, "last_xid_first": last_xid,
            "ecc_uncorrected": ecc, "ecc_uncorrected_first": ecc if ecc_first is None else ecc_first}


def test_a_new_xid_is_a_critical_finding_of_its_window_and_fails_the_run() -> None:
    a, v = _run(_windows([{"GPU-a": nvml(0)}] * 3 + [{"GPU-a": nvml(1, 79)}] + [{"GPU-a": nvml(1, 79)}] * 3))
    (f,) = _gpu(a)
    assert f.window == 3 and f.severity == "critical" and f.diagnosis == "GPU Xid error"
    assert f.evidence == {"gpu": "GPU-a", "xid": 79, "events": 1, "name": "GPU has fallen off the bus",
                             "action": XID[79].action}
    assert "Xid 79 (GPU has fallen off the bus" in f.message and "reboot the node" in f.message
    assert v.result == "FAIL" and "gpu: GPU Xid error (window 3)" in v.reasons


def test_new_uncorrected_ecc_errors_count_from_the_first_reading_of_the_run() -> None:
    # 5 uncorrected errors from before the run (since the driver loaded), 2 more in window 4
    errors = [{"GPU-a": nvml(0, ecc=5)}] * 4 + [{"GPU-a": nvml(0, ecc=7, ecc_first=5)}] + [{"GPU-a": nvml(0, ecc=7)}]
    a, v = _run(_windows(errors))
    (f,) = _gpu(a)
    assert f.window == 4 and f.diagnosis == "uncorrectable ECC error"
    assert f.evidence == {"gpu": "GPU-a", "ecc_uncorrected": 2, "total": 7}
    assert "gpu: uncorrectable ECC error (window 4)" in v.reasons
    # errors before the run alone: nothing
    a, v = _run(_windows([{"GPU-a": nvml(0, ecc=5)}] * 6))
    assert _gpu(a) == [] and (v.result != "FAIL")


def test_healthy_gpus_restarted_counters_and_dcgm_last_codes() -> None:
    # no event, two GPUs: nothing; the verdict keeps its other checks
    a, v = _run(_windows([{"GPU-a": nvml(0), "GPU-b": nvml(0)}] * 6))
    assert _gpu(a) == [] and (v.result != "FAIL")
    # a soakd restarted (a resumed run): its count starts again from 0; 0 -> 1 after 3 before is one event
    a, v = _run(_windows([{"GPU-a": nvml(3, 13)}] * 3 + [{"GPU-a": nvml(0, 13)}, {"GPU-a": nvml(1, 31)}]))
    assert [(f.window, f.evidence["xid"], f.evidence["events"]) for f in _gpu(a)] == [(0, 13, 3), (4, 31, 1)]
    # DCGM gives only the last code: a change to a non-zero code is a new event, an old code is not
    dcgm = [{"GPU-a": {"last_xid": 48.0, "last_xid_first": 48.0}}] * 3 + [{"GPU-a": {"last_xid": 94.0,
                                                                                       "last_xid_first": 48.0}}]
    a, v = _run(_windows(dcgm + [{"GPU-a": {"last_xid": 94.0, "last_xid_first": 94.0}}]))
    assert [(f.window, f.evidence["xid"]) for f in _gpu(a)] == [(3, 94)]
    assert "Contained ECC error" in _gpu(a)[0].message


def test_an_xid_in_the_partial_last_window_still_fails_the_run_and_fail_on_can_leave_it_out() -> None:
    windows = _windows([{"GPU-a": nvml(0)}] * 5 + [{"GPU-a": nvml(2, 48)}], partial_last=True)
    a, v = _run(windows)
    assert [(f.window, f.evidence["events"]) for f in _gpu(a)] == [(5, 2)] and v.result == "FAIL"
    a, v = _run(windows, verdict={"fail_on": ["drift", "leak"]})
    assert _gpu(a) and (v.result != "FAIL")  # reported, not failing


def test_resume_primes_the_counters_without_findings() -> None:
    earlier = _windows([{"GPU-a": nvml(0)}, {"GPU-a": nvml(1, 79)}])
    a = Analyzer(AnalysisConfig())
    a.restore(earlier, None)
    rng = random.Random(9)
    a.add_window(make_window(2, rng, 1000, device={"gpu_errors": {"GPU-a": nvml(1, 79)}}))
    assert _gpu(a) == []  # window 1's event was its segment's finding, not a new one


def test_describe_every_code_in_the_table_and_an_unknown_one() -> None:
    for code, x in XID.items():
        assert describe(code).startswith(f"Xid {code} ({x.name}: ") and x.action in describe(code)
    assert "NVIDIA's Xid catalog" in describe(999)


def test_a_finding_that_failed_an_earlier_segment_still_fails_the_resumed_run() -> None:
    """A resumed run (pod rescheduled after SIGTERM) is primed with the earlier segments' windows and the
    findings they made: a GPU Xid of segment 0 still fails the run at its end; the end-of-run judgements
    of the stop are made again, not carried over."""
    windows = _windows([{"GPU-a": nvml(0)}] * 3 + [{"GPU-a": nvml(1, 79)}] + [{"GPU-a": nvml(1, 79)}] * 6)
    first = Analyzer(AnalysisConfig())
    for w in windows[:6]:
        first.add_window(w)
    first.verdict()  # the interim verdict at the stop: end-of-run findings made
    forgetful = Analyzer(AnalysisConfig())  # primed with the windows only: the Xid is not seen again
    forgetful.restore(windows[:6], windows[0])
    for w in windows[6:]:
        forgetful.add_window(w)
    assert forgetful.verdict().result != "FAIL"
    resumed = Analyzer(AnalysisConfig())
    resumed.restore(windows[:6], windows[0], first.findings)
    for w in windows[6:]:
        resumed.add_window(w)
    v = resumed.verdict()
    assert v.result == "FAIL" and "gpu: GPU Xid error (window 3)" in v.reasons
    assert not [f for f in resumed.findings if f.spec.end_of_run and f in first.findings]

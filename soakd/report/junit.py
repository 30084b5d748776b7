"""The verdict as JUnit XML (the Jenkins/Ant dialect that GitLab, GitHub and Jenkins read), so that
a CI system shows a soak like a test run: ``soakd report --format junit`` and ``soakd run --junit
FILE``, rendered from the run's report like every other format.

One ``<testsuite>`` per run, one ``<testcase>`` per verdict check:

- ``soakd.verdict``: the run's verdict: failed on FAIL (its reasons), an ``<error>`` on INCONCLUSIVE
  or a run without a verdict (it has not finished), passed on PASS;
- ``soakd.drift``: each tracked metric: failed when a finding that fails the run names it (a drift
  over its whole span, or throttling whose drift it is), skipped when no window had the metric;
- ``soakd.leak``: each judged memory source (device memory, KV cache, its residue);
- one case for every other kind of the finding registry (``soakd.core.findings.KINDS``: ``soakd.gpu``,
  ``soakd.slo``, ``soakd.throttle``, ``soakd.canary``, ``soakd.errors``, ``soakd.freeze``,
  ``soakd.target``, ``soakd.client``), failed when a finding of it fails the run, skipped when there
  was nothing to judge (no device telemetry, the canary off, no SLO), its findings in system-out;
- ``soakd.ab``: each A/B comparison over the run (candidate x metric), and ``soakd.targets`` each
  other target's own verdict;
- ``soakd.windows``: each window: skipped when it was not judged (partial, client-impaired, the
  target down, fewer requests than needed), failed when a failing finding covers it;
- ``soakd.findings``: every finding with its evidence and runbook, failed when it fails the run.

Exit codes stay those of ``soakd run``; the file only describes them.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Any

from soakd.core.findings import KINDS
from soakd.report.format import FindingView, finding_views, verdict_lines
from soakd.report.model import RunReport, WindowRow

__all__ = ["render_junit"]

# characters XML 1.0 cannot carry (a garbled server answer quoted in a finding)
_NOT_XML = re.compile("[^\u0009\u000a\u000d\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _x(text: Any, limit: int | None = None) -> str:
    s = _NOT_XML.sub("\ufffd", str(text))
    return s[:limit] if limit is not None else s


@dataclass
class Case:
    classname: str
    name: str
    status: str = "passed"  # passed | failed | skipped | error
    message: str = ""
    text: str = ""
    out: list[str] = field(default_factory=list)  # system-out lines
    seconds: float = 0.0


def _failed(case: Case, reasons: list[str], message: str | None = None) -> None:
    case.status = "failed"
    case.message = message or reasons[0]
    case.text = "\n".join(reasons)


def _skipped(case: Case, why: str) -> None:
    case.status = "skipped"
    case.message = why


def _line(fv: FindingView) -> str:
    f = fv.finding
    out = f"[{f.severity}] {f.label} ({fv.where}, {fv.at}): {f.message}"
    if fv.evidence:
        out += f"\n  evidence: {fv.evidence_text}"
    out += f"\n  runbook: {f.runbook}"
    if fv.event.why:
        out += f"\n  {'fails the run' if fv.fails else 'does not fail the run'}: {fv.event.why}"
    return out


_CAUSE_SKIP = {
    "partial": "partial window (the run ended inside it): shown, not judged",
    "target_down": "the target was down for {down:.0f} s of it",
    "too_few_requests": "insufficient: {n} requests, a judged window needs {need}",
}


def _window_case(row: WindowRow, report: RunReport, failing: dict[int, list[FindingView]], seconds: float) -> Case:
    n = row.window
    case = Case("soakd.windows", f"window {n}", seconds=seconds)
    case.out.append(f"{row.start}: {row.requests} requests, e2e p50 {row.e2e_p50}, "
                    f"notes: {', '.join(row.notes) or '-'}")
    w = next((x for x in report.windows if x.window == n), None)
    judged = row.not_judged is None and not row.partial
    if n in failing and (judged or any(fv.finding.window == n for fv in failing[n])):
        # a finding of this window, or one whose span covers it and the window was judged
        reasons = list(dict.fromkeys(fv.event.why or fv.finding.reason for fv in failing[n]))
        _failed(case, reasons + [_line(fv) for fv in failing[n]], reasons[0])
    elif row.not_judged == "client_impaired" or (w is not None and w.client is not None and w.client.impaired):
        why = w.client.impaired_reason if w is not None and w.client is not None else None
        _skipped(case, f"client-impaired: {why or 'soakd itself stalled'}")
    elif row.partial:
        _skipped(case, _CAUSE_SKIP["partial"])
    elif (w is not None and w.target_down_seconds) or row.not_judged == "target_down":
        _skipped(case, _CAUSE_SKIP["target_down"].format(down=w.target_down_seconds if w is not None else 0.0))
    elif row.requests < report.min_requests or row.not_judged == "too_few_requests":
        _skipped(case, _CAUSE_SKIP["too_few_requests"].format(n=row.requests, need=report.min_requests))
    return case


def checks(report: RunReport) -> list[Case]:
    """The report's verdict as test cases (see the module docstring)."""
    v = report.verdict
    run = report.run
    views = finding_views(report.finding_events())
    failing = [fv for fv in views if fv.fails]
    covered = {fv.event.why for fv in failing}
    loose = [r for r in v.reasons if r not in covered]  # reasons no finding of the report carries
    config = run.config or {}
    analysis = config.get("analysis") or {}
    cases: list[Case] = []

    # the verdict
    top = Case("soakd.verdict", "verdict", seconds=float(run.observed_seconds or 0.0))
    lines = verdict_lines(report)
    if v.result == "FAIL":
        _failed(top, lines or list(v.reasons) or ["FAIL"], f"FAIL: {'; '.join(v.reasons)[:500]}")
    elif v.result == "INCONCLUSIVE":
        top.status = "error"
        top.message = f"INCONCLUSIVE: {v.inconclusive}"
        top.text = "\n".join([top.message, *lines])
    elif v.result != "PASS" or v.interim:
        top.status = "error"
        top.message = (f"no final verdict: the run {run.id} is {run.state or run.status}"
                       + ("; ".join([""] + list(v.reasons)) if v.reasons else ""))
        top.text = top.message
    else:
        top.out += lines
    cases.append(top)

    # each tracked metric: failed when a finding that fails the run names it (over its whole span)
    stability = v.stability
    # not the error rate: no drift metric, judged by its budgets (the soakd.errors case)
    metrics = [m for m in dict.fromkeys([*report.thresholds, *stability]) if m != "error_rate"]
    for m in metrics:
        case = Case("soakd.drift", m)
        st = stability.get(m)
        mine = [fv for fv in failing if fv.finding.kind != "ab" and m in fv.finding.metrics]
        if mine:
            reasons = list(dict.fromkeys(fv.event.why or fv.finding.reason for fv in mine))
            _failed(case, reasons + [_line(fv) for fv in mine], reasons[0])
        elif st is None or not st.windows:
            _skipped(case, f"no window had {m}")
        if st is not None:
            case.out.append(f"{m}: median {st.median}, spread {st.spread} over {st.windows} windows, "
                            f"threshold {st.threshold}")
        cases.append(case)

    # leaks: the run's last judgement of each source
    leak_reasons = [r for r in v.reasons if r.startswith("leak:")]
    for lk in v.leaks:
        case = Case("soakd.leak", lk.source)
        if lk.fails:
            mine = [r for r in leak_reasons if r.startswith(f"leak: {lk.source}")] or leak_reasons
            _failed(case, mine or [f"leak: {lk.source} {lk.status}"])
        case.out.append(f"{lk.source}: {lk.status}, {lk.pattern or 'no pattern'}, growth {lk.growth_per_hour} "
                        f"{lk.unit}/h over {lk.n_windows} points")
        cases.append(case)
    if not v.leaks:
        case = Case("soakd.leak", "memory")
        _skipped(case, "no memory series was judged (no device telemetry, no KV-cache gauge)")
        cases.append(case)

    # every other kind of the registry: one case each
    tel = report.series.telemetry
    canary_on = (analysis.get("canary") or {}).get("enabled", True) and bool(report.findings.get("canary"))
    for kind in KINDS.values():
        if kind.name in ("drift", "leak", "ab"):
            continue  # per metric, per source, per comparison above and below
        case = Case(f"soakd.{kind.name}", kind.name)
        mine = [fv for fv in failing if fv.finding.kind == kind.name]
        reasons = [r for r in v.reasons if r.startswith(f"{kind.name}:")]
        mine_reasons = list(dict.fromkeys([*(fv.event.why or fv.finding.reason for fv in mine), *reasons]))
        seen = [fv for fv in views if fv.finding.kind == kind.name]
        if mine_reasons:
            _failed(case, mine_reasons + [_line(fv) for fv in mine], mine_reasons[0])
        elif kind.name in ("throttle", "gpu") and not tel.device:
            _skipped(case, "no device telemetry (no GPU visible to soakd)")
        elif kind.name == "canary" and not canary_on:
            _skipped(case, "the canary did not run")
        elif kind.name == "slo" and "goodput_ratio" not in report.thresholds:
            _skipped(case, "no scenario has an SLO")
        case.out += [_line(fv) for fv in seen[:20]]
        cases.append(case)

    # A/B: each comparison over the run, and each other target's own verdict
    ab_fail = [fv for fv in failing if fv.finding.kind == "ab"]
    for r in v.ab or []:
        case = Case("soakd.ab", f"{r.target} {r.metric} vs {r.reference}")
        worse = r.tier == "confident" and r.direction == "worse"
        mine = [fv.event.why or fv.finding.reason for fv in ab_fail
                if fv.finding.evidence.get("metric") == r.metric and fv.finding.evidence.get("target") == r.target]
        if worse or mine:
            _failed(case, mine or [f"ab: {r.target} {r.metric} confidently worse"])
        case.out.append(f"{r.target} {r.metric} ratio {r.ratio} (CI {list(r.ci)}) over {r.windows} paired windows: "
                        f"{r.tier or 'no'} {r.direction}")
        cases.append(case)
    for name, tv in (v.targets or {}).items():
        case = Case("soakd.targets", str(name))
        if tv.result == "FAIL":
            _failed(case, list(tv.reasons or ["FAIL"]))
        cases.append(case)

    # each window: failed when a failing finding covers it, skipped (with the cause) when not judged
    failing_by_window: dict[int, list[FindingView]] = {}
    for fv in failing:
        for w in fv.finding.windows:
            failing_by_window.setdefault(w, []).append(fv)
    for row in report.table:
        w = next((x for x in report.windows if x.window == row.window), None)
        cases.append(_window_case(row, report, failing_by_window, float(w.duration_seconds if w else 0.0)))

    # each finding: failed when it fails the run; info findings pass, with what they said
    for fv in views:
        f = fv.finding
        where = f" ({fv.where})" if f.window is not None else ""
        case = Case("soakd.findings", f"#{fv.event.id} {f.kind}: {f.diagnosis}{where}")
        case.out.append(_line(fv))
        if fv.fails:
            _failed(case, [f.message, _line(fv)], fv.event.why or f.reason)
        cases.append(case)
    if loose:
        case = Case("soakd.findings", "other reasons")
        _failed(case, loose)
        cases.append(case)
    return cases


def render_junit(report: RunReport | dict[str, Any]) -> str:
    """The report as a JUnit XML document (``<testsuites>`` with one ``<testsuite>``)."""
    report = RunReport.load(report)
    run = report.run
    cases = checks(report)
    counts = {s: sum(c.status == s for c in cases) for s in ("failed", "skipped", "error")}
    attrs = {"tests": str(len(cases)), "failures": str(counts["failed"]), "errors": str(counts["error"]),
             "skipped": str(counts["skipped"]), "time": f"{float(run.observed_seconds or 0.0):.3f}"}
    root = ET.Element("testsuites", {"name": "soakd", **attrs})
    suite = ET.SubElement(root, "testsuite", {
        "name": f"soakd run {run.id}", **attrs,
        "timestamp": str(run.started_at or "").removesuffix("Z"), "hostname": "soakd"})
    props = ET.SubElement(suite, "properties")
    for k, v in (("run", run.id), ("target", run.target), ("model", run.model),
                 ("server_kind", run.server_kind), ("result", report.verdict.result),
                 ("exit_code", report.verdict.exit_code), ("stop_reason", run.stop_reason), ("window", run.window),
                 ("soakd_version", run.soakd_version)):
        if v is not None:
            ET.SubElement(props, "property", {"name": k, "value": _x(v)})
    for c in cases:
        el = ET.SubElement(suite, "testcase", {"classname": c.classname, "name": _x(c.name),
                                               "time": f"{c.seconds:.3f}"})
        if c.status == "failed":
            ET.SubElement(el, "failure", {"message": _x(c.message, 1000), "type": c.classname}).text = _x(c.text)
        elif c.status == "error":
            ET.SubElement(el, "error", {"message": _x(c.message, 1000), "type": "inconclusive"}).text = _x(c.text)
        elif c.status == "skipped":
            ET.SubElement(el, "skipped", {"message": _x(c.message, 1000)})
        if c.out:
            ET.SubElement(el, "system-out").text = _x("\n".join(c.out))
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"

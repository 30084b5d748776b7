"""The verdict as JUnit XML (the Jenkins/Ant dialect that GitLab, GitHub and Jenkins read), so that
a CI system shows a soak like a test run: ``soakd report --format junit`` and ``soakd run --junit
FILE``, rendered from the run's report like every other format.

One ``<testsuite>`` per run, one ``<testcase>`` per verdict check:

- ``soakd.verdict``: the run's verdict: failed on FAIL (its reasons), an ``<error>`` on INCONCLUSIVE
  or a run without a verdict (it has not finished), passed on PASS;
- ``soakd.drift``: each tracked metric: failed when a finding that fails the run names it (a drift,
  or throttling whose drift it is), skipped when no window had the metric;
- ``soakd.leak``: each judged memory source (device memory, KV cache, its residue);
- ``soakd.gpu`` (Xid and uncorrected ECC errors), ``soakd.throttle``, ``soakd.errors``, ``soakd.canary``,
  ``soakd.freeze``, ``soakd.target``: one case each, skipped when there was nothing to judge (no
  device telemetry, the canary off);
- ``soakd.ab``: each A/B comparison over the run (candidate x metric), and ``soakd.targets`` each
  other target's own verdict;
- ``soakd.windows``: each window: skipped when it was not judged (partial, client-impaired, the
  target down, fewer requests than needed), failed when a failing finding points at it;
- ``soakd.findings``: each warning or critical finding, failed when it fails the run.

Exit codes stay those of ``soakd run``; the file only describes them.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Any

from soakd.analysis.engine import failing_reason

__all__ = ["render_junit"]

_CHECK_KINDS = ("gpu", "throttle", "errors", "canary", "freeze", "target")
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


def _findings(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [ev for items in (report.get("findings") or {}).values() for ev in items if ev.get("diagnosis")]


def _reason(ev: dict[str, Any]) -> str:
    return failing_reason(ev["kind"], ev["diagnosis"], ev.get("window"))


def _metrics_of(ev: dict[str, Any]) -> set[str]:
    """The tracked metrics a drift (or A/B) finding is about: a live window's drifting comparisons,
    or the metric of an end-of-run change point, creep or A/B comparison."""
    evidence = ev.get("evidence") or {}
    out = {d["metric"] for d in evidence.get("drift") or [] if isinstance(d, dict) and d.get("metric")
           and d.get("status", "drift") == "drift"}
    if isinstance(evidence.get("metric"), str):
        out.add(evidence["metric"])
    return out


def _failed(case: Case, reasons: list[str], message: str | None = None) -> None:
    case.status = "failed"
    case.message = message or reasons[0]
    case.text = "\n".join(reasons)


def _skipped(case: Case, why: str) -> None:
    case.status = "skipped"
    case.message = why


def _window_case(row: dict[str, Any], window: dict[str, Any] | None, min_requests: int,
                 failing: dict[int, list[str]], seconds: float) -> Case:
    n = row["window"]
    case = Case("soakd.windows", f"window {n}", seconds=seconds)
    case.out.append(f"{row.get('start')}: {row.get('requests')} requests, e2e p50 {row.get('e2e_p50')}, "
                    f"notes: {', '.join(row.get('notes') or []) or '-'}")
    client = (window or {}).get("client") or {}
    if n in failing:
        _failed(case, failing[n])
    elif row.get("partial"):
        _skipped(case, "partial window (the run ended inside it): shown, not judged")
    elif client.get("impaired"):
        _skipped(case, f"client-impaired: {client.get('impaired_reason') or 'soakd itself stalled'}")
    elif (window or {}).get("target_down_seconds"):
        _skipped(case, f"the target was down for {window['target_down_seconds']:.0f} s of it")
    elif (row.get("requests") or 0) < min_requests:
        _skipped(case, f"insufficient: {row.get('requests')} requests, a judged window needs {min_requests}")
    return case


def checks(report: dict[str, Any]) -> list[Case]:
    """The report's verdict as test cases (see the module docstring)."""
    verdict = report.get("verdict") or {}
    run = report.get("run") or {}
    reasons: list[str] = list(verdict.get("reasons") or [])
    findings = _findings(report)
    # the findings that fail the run: by the verdict's reason for them, and the leak findings of a
    # source whose last judgement fails the run (leaks are judged on the run's last judgement)
    leaking = {lk.get("source") for lk in verdict.get("leaks") or [] if lk.get("fails")}
    failing_findings = [ev for ev in findings if _reason(ev) in reasons or (
        ev["kind"] == "leak" and ev.get("severity") == "critical" and (ev.get("evidence") or {}).get("source") in leaking)]
    config = run.get("config") or {}
    analysis = config.get("analysis") or {}
    cases: list[Case] = []

    # the verdict
    result = verdict.get("result")
    top = Case("soakd.verdict", "verdict", seconds=float(run.get("observed_seconds") or 0.0))
    if result == "FAIL":
        _failed(top, reasons or ["FAIL"], f"FAIL: {'; '.join(reasons)[:500]}")
    elif result == "INCONCLUSIVE":
        top.status, top.message = "error", f"INCONCLUSIVE: {verdict.get('inconclusive')}"
        top.text = top.message
    elif result != "PASS" or verdict.get("interim"):
        top.status = "error"
        top.message = (f"no final verdict: the run {run.get('id')} is {run.get('state') or run.get('status')}"
                       + ("; ".join([""] + list(reasons)) if reasons else ""))
        top.text = top.message
    cases.append(top)

    # each tracked metric
    stability = verdict.get("stability") or {}
    metrics = list(dict.fromkeys([*(report.get("thresholds") or {}), *stability]))
    for m in metrics:
        case = Case("soakd.drift", m)
        st = stability.get(m)
        # a drift finding, or another that drift is part of (throttling, a freeze: the metric moved)
        mine = [_reason(ev) for ev in failing_findings if ev["kind"] != "ab" and m in _metrics_of(ev)]
        if mine:
            _failed(case, list(dict.fromkeys(mine)))
        elif not st or not st.get("windows"):
            _skipped(case, f"no window had {m}")
        if st:
            case.out.append(f"{m}: median {st.get('median')}, spread {st.get('spread')} over {st.get('windows')} "
                            f"windows, threshold {st.get('threshold')}")
        cases.append(case)

    # leaks: the run's last judgement of each source
    leak_reasons = [r for r in reasons if r.startswith("leak:")]
    for lk in verdict.get("leaks") or []:
        case = Case("soakd.leak", str(lk.get("source")))
        if lk.get("fails"):
            mine = [r for r in leak_reasons if r.startswith(f"leak: {lk.get('source')}")] or leak_reasons
            _failed(case, mine or [f"leak: {lk.get('source')} {lk.get('status')}"])
        case.out.append(f"{lk.get('source')}: {lk.get('status')}, {lk.get('pattern') or 'no pattern'}, growth "
                        f"{lk.get('growth_per_hour')} {lk.get('unit')}/h over {lk.get('n_windows')} points")
        cases.append(case)
    if not verdict.get("leaks"):
        case = Case("soakd.leak", "memory")
        _skipped(case, "no memory series was judged (no device telemetry, no KV-cache gauge)")
        cases.append(case)

    # the other checks, one case per kind
    tel = (report.get("series") or {}).get("telemetry") or {}
    # the report groups canary events (its reference output, mismatches) under "canary"
    canary_on = (analysis.get("canary") or {}).get("enabled", True) and bool((report.get("findings") or {}).get("canary"))
    for kind in _CHECK_KINDS:
        case = Case(f"soakd.{kind}", kind)
        mine = [r for r in reasons if r.startswith(f"{kind}:")]
        if mine:
            _failed(case, mine)
        elif kind in ("throttle", "gpu") and not tel.get("device"):
            _skipped(case, "no device telemetry (no GPU visible to soakd)")
        elif kind == "canary" and not canary_on:
            _skipped(case, "the canary did not run")
        cases.append(case)

    # A/B: each comparison over the run, and each other target's own verdict
    ab_fail = [ev for ev in failing_findings if ev["kind"] == "ab"]
    for r in verdict.get("ab") or []:
        case = Case("soakd.ab", f"{r.get('target')} {r.get('metric')} vs {r.get('reference')}")
        worse = r.get("tier") == "confident" and r.get("direction") == "worse"
        mine = [_reason(ev) for ev in ab_fail if (ev.get("evidence") or {}).get("metric") == r.get("metric")
                and (ev.get("evidence") or {}).get("target") == r.get("target")]
        if worse or mine:
            _failed(case, mine or [f"ab: {r.get('target')} {r.get('metric')} confidently worse"])
        case.out.append(f"{r.get('target')} {r.get('metric')} ratio {r.get('ratio')} (CI {r.get('ci')}) over "
                        f"{r.get('windows')} paired windows: {r.get('tier') or 'no'} {r.get('direction')}")
        cases.append(case)
    for name, tv in (verdict.get("targets") or {}).items():
        case = Case("soakd.targets", str(name))
        if tv.get("result") == "FAIL":
            _failed(case, list(tv.get("reasons") or ["FAIL"]))
        cases.append(case)

    # each window
    failing_by_window: dict[int, list[str]] = {}
    for ev in failing_findings:
        if ev.get("window") is not None:
            failing_by_window.setdefault(ev["window"], []).append(_reason(ev))
    dumps = {w.get("window"): w for w in report.get("windows") or []}
    min_requests = int(report.get("min_requests") or 0)
    for row in report.get("table") or []:
        w = dumps.get(row["window"])
        cases.append(_window_case(row, w, min_requests, failing_by_window,
                                  float((w or {}).get("duration_seconds") or 0.0)))

    # each finding
    for ev in findings:
        if ev.get("severity") not in ("warning", "critical"):
            continue
        where = f" (window {ev['window']})" if ev.get("window") is not None else ""
        case = Case("soakd.findings", f"#{ev.get('id')} {ev['kind']}: {ev['diagnosis']}{where}")
        case.out.append(f"[{ev.get('severity')}] {ev.get('at')}: {ev.get('detail') or ev.get('message')}")
        if ev in failing_findings:
            _failed(case, [str(ev.get("detail") or ev.get("message") or _reason(ev))], _reason(ev))
        cases.append(case)
    return cases


def render_junit(report: dict[str, Any]) -> str:
    """The report as a JUnit XML document (``<testsuites>`` with one ``<testsuite>``)."""
    run = report.get("run") or {}
    cases = checks(report)
    counts = {s: sum(c.status == s for c in cases) for s in ("failed", "skipped", "error")}
    attrs = {"tests": str(len(cases)), "failures": str(counts["failed"]), "errors": str(counts["error"]),
             "skipped": str(counts["skipped"]), "time": f"{float(run.get('observed_seconds') or 0.0):.3f}"}
    root = ET.Element("testsuites", {"name": "soakd", **attrs})
    suite = ET.SubElement(root, "testsuite", {
        "name": f"soakd run {run.get('id')}", **attrs,
        "timestamp": str(run.get("started_at") or "").removesuffix("Z"), "hostname": "soakd"})
    props = ET.SubElement(suite, "properties")
    verdict = report.get("verdict") or {}
    for k, v in (("run", run.get("id")), ("target", run.get("target")), ("model", run.get("model")),
                 ("server_kind", run.get("server_kind")), ("result", verdict.get("result")),
                 ("stop_reason", run.get("stop_reason")), ("window", run.get("window")),
                 ("soakd_version", run.get("soakd_version"))):
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

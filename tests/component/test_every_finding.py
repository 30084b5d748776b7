"""Every kind of finding in every output.

The registry (``soakd.core.findings.DIAGNOSES``) is the one list of what soakd can find. A run with
one finding of every registered diagnosis is written into a store through the RunStore API, with a
verdict that fails the run on each that can fail it; then each output is checked for each finding:
its title and its evidence in the Markdown and HTML reports, the JUnit file, the terminal summary and
its ``finding`` log line; in JUnit, the case of its kind (and of each metric it names) fails when it
fails the run. ``EXAMPLES`` must name every registered diagnosis (and only those), and every diagnosis
the code writes as a literal must be registered: a kind cannot be added without its place in every
output.
"""

from __future__ import annotations

import ast
import asyncio
import io
import json
import random
import tempfile
from pathlib import Path
from typing import Any

import junitparser
import pytest
import structlog

from helpers import REPO
from helpers.windows import make_window
from soakd.core.findings import DIAGNOSES, KINDS, Finding
from soakd.core.verdict import VERDICT_SCHEMA_VERSION, Judged, RunVerdict
from soakd.report import build_report, render_html, render_junit, render_markdown
from soakd.report.summary import format_summary
from soakd.soak.events import EventLog
from soakd.store import RunStore, StoreReader

T0 = 1_700_000_000.0
WINDOW = 60.0

# diagnosis -> (evidence, the text of it every output must show)
EXAMPLES: dict[str, tuple[dict[str, Any], str]] = {
    "GPU Xid error": ({"gpu": "GPU-aaaa-79", "xid": 79, "events": 1, "name": "GPU has fallen off the bus"},
                      "GPU-aaaa-79"),
    "uncorrectable ECC error": ({"gpu": "GPU-bbbb-ecc", "ecc_uncorrected": 2, "total": 7}, "GPU-bbbb-ecc"),
    "throttling": ({"throttle": [{"reason": "sw_thermal", "share": 0.61, "sm_clock_drop_ratio": 0.3, "gpus": ["3"]}],
                    "drift": [{"metric": "e2e_p95", "ratio": 0.21, "ratio_ci": [0.1, 0.3], "reference": "baseline",
                               "status": "drift"}]}, "sw_thermal 61% of the window on GPU 3"),
    "power-capped, healthy": ({"throttle": [{"reason": "sw_power_cap", "share": 0.83}]}, "sw_power_cap 83%"),
    "KV cache not released": ({"source": "kv_residue", "growth_per_hour": 0.0123, "unit": "ratio"}, "kv_residue"),
    "memory leak": ({"source": "device_memory", "growth_per_hour": 52_000_000.0, "unit": "bytes"}, "+49.6 MiB/h"),
    "memory steps": ({"source": "target_gpu_memory", "steps": 3, "steps_bytes": 3221225472.0}, "3.00 GiB"),
    "leak page withdrawn": ({"source": "device_memory", "withdrawn_growth_per_hour": 77_000_000.0,
                             "growth_per_hour": 1_000_000.0, "paged_window": 11, "unit": "bytes", "fails": False},
                            "+73.4 MiB/h"),
    "engine wedged": ({"silence_seconds": 12.5, "in_flight": 7, "sources": ["streams", "server_tokens"]},
                      "silence_seconds 12.5"),
    "KV cache saturated": ({"server_kv_cache_usage_ratio": 0.9931, "server_requests_running": 31}, "0.9931"),
    "server froze": ({"freeze_seconds": 14.75, "threshold_seconds": 1.5}, "14.75"),
    "target restarted": ({"target_down_seconds": 21.0, "restarts": 1}, "target_down_seconds 21"),
    "target hung": ({"silence_seconds": 14.8, "in_flight": 16, "probe_timeout_seconds": 5.0}, "silence_seconds 14.8"),
    "overload": ({"timeout_share": 0.0712, "timeouts": 71, "requests": 1000}, "0.0712"),
    "garbled output": ({"invalid_share": 0.0033, "invalid_responses": 3}, "0.0033"),
    "output changed": ({"digest": "feedface01", "reference": "ab12ab12"}, "feedface01"),
    "server errors": ({"error_share": 0.0456, "requests": 1000}, "0.0456"),
    "error budget exceeded": ({"error_rate": 0.0234, "budget": 0.01, "failed": 23, "requests": 1000}, "0.0234"),
    "error burst": ({"share": 0.0813, "failed": 244, "requests": 3001, "failures": {"http_429": 244},
                     "outcomes": {"http_error": 244}, "window_budget": 0.05, "run_budget": 0.01,
                     "over_window_budget": True}, "http_429"),
    "prefix cache hit rate fell": ({"prefix_cache_hit_ratio": 0.0712, "reference_hit_ratio": 0.6234, "drop": 0.5522,
                                    "drift": [{"metric": "ttft_p50", "ratio": 0.31, "status": "drift",
                                               "reference": "baseline"}]}, "0.6234"),
    "bandwidth or cache pressure": ({"comparisons": [{"metric": "e2e_p95", "ratio": 0.17, "reference": "short"}]},
                                    "e2e_p95 +17.0%"),
    "SLO goodput dropped": ({"drift": [{"metric": "goodput_ratio", "ratio": -0.081, "status": "drift"}]},
                            "goodput_ratio -8.1pp"),
    "performance drift": ({"drift": [{"metric": "itl_p50", "ratio": 0.127, "ratio_ci": [0.06, 0.2],
                                      "status": "drift", "reference": "baseline"}]}, "itl_p50 +12.7%"),
    "confident drift": ({"tier": "confident", "metric": "e2e_p50", "ratio": 0.298, "ci": [0.2, 0.4], "windows": 3,
                         "changes": [{"metric": "e2e_p50", "ratio": 0.298, "ci": [0.2, 0.4]},
                                     {"metric": "output_tokens_per_second", "ratio": -0.33, "ci": [-0.4, -0.2]}]},
                        "output_tokens_per_second -33.0%"),
    "likely drift": ({"tier": "likely", "metric": "ttft_p95", "ratio": 0.066, "ci": [0.01, 0.12], "windows": 2},
                     "ttft_p95"),
    "creep": ({"tier": "confident", "metric": "itl_p95", "total_ratio": 0.1414, "p_value": 0.0001, "windows": 8},
              "0.1414"),
    "periodic drops": ({"fails": False, "period_seconds": 897.0, "depth_ratio": 0.11}, "period_seconds 897"),
    "confident A/B regression": ({"tier": "confident", "target": "cand-x", "metric": "e2e_p50", "ratio": 0.1},
                                 "cand-x"),
    "likely A/B regression": ({"tier": "likely", "target": "cand-y", "metric": "ttft_p50", "ratio": 0.06}, "cand-y"),
    "confident A/B difference": ({"tier": "confident", "target": "cand-z", "metric": "e2e_p50", "ratio": -0.2},
                                 "cand-z"),
    "likely A/B difference": ({"tier": "likely", "target": "cand-w", "metric": "ttft_p50", "ratio": -0.07},
                              "cand-w"),
    "client-impaired": ({"impaired_reason": "event-loop lag p99 412 ms", "loop_lag_max_seconds": 0.412},
                        "event-loop lag p99 412 ms"),
    "client lagging": ({"loop_lag_p99_seconds": 0.0641, "cpu_share": 0.5, "ttft_mean_seconds": 0.0466,
                        "server_ttft_mean_seconds": 0.0219}, "server_ttft_mean_seconds 0.0219"),
}


def _example(i: int, diagnosis: str) -> Finding:
    spec = DIAGNOSES[diagnosis]
    evidence, _ = EXAMPLES[diagnosis]
    window = None if diagnosis in ("error budget exceeded", "periodic drops", "leak page withdrawn") else i % 8
    if diagnosis == "confident drift":  # windows 5..7 of the 8 stored, wherever the registry lists it
        window = 5
    span = min(window + 2, 7) if diagnosis in ("confident drift", "creep") and window is not None else None
    return Finding(kind=spec.kind, diagnosis=diagnosis, severity=spec.severity, message=f"the {diagnosis} finding #{i}",
                   evidence=evidence, window=window, last_window=span)


def _fails(f: Finding) -> bool:
    return f.spec.fails and f.severity != "info" and f.evidence.get("tier") != "likely"


def test_examples_name_every_registered_diagnosis() -> None:
    assert set(EXAMPLES) == set(DIAGNOSES), (set(DIAGNOSES) ^ set(EXAMPLES))
    for d in DIAGNOSES.values():
        assert d.kind in KINDS, d
        assert d.seen and d.check and d.evidence, d


def test_every_diagnosis_the_code_names_is_registered() -> None:
    """Every ``Finding(..., diagnosis="...")`` and ``DIAGNOSIS = "..."`` literal under soakd/."""
    named: dict[str, str] = {}
    for path in sorted((REPO / "soakd").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if (isinstance(node, ast.keyword) and node.arg == "diagnosis" and isinstance(node.value, ast.Constant)
                    and node.value.value is not None):
                named[str(node.value.value)] = f"{path.relative_to(REPO)}:{node.value.lineno}"
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "DIAGNOSIS"
                                                    for t in node.targets) and isinstance(node.value, ast.Constant):
                named[str(node.value.value)] = f"{path.relative_to(REPO)}:{node.lineno}"
    assert len(named) >= 15, named
    missing = {d: where for d, where in named.items() if d not in DIAGNOSES}
    assert not missing, f"diagnoses the code names that soakd.core.findings.DIAGNOSES does not register: {missing}"
    # the tier-built ones (f"{tier} drift", f"{tier} A/B ...") are registered too
    for tier in ("confident", "likely"):
        assert f"{tier} drift" in DIAGNOSES
        for what in ("regression", "difference"):
            assert f"{tier} A/B {what}" in DIAGNOSES


def test_runbook_anchors_exist() -> None:
    import re

    text = (REPO / "docs" / "runbooks.md").read_text(encoding="utf-8")
    anchors = {re.sub(r"[^a-z0-9_-]", "", h.strip().lower().replace(" ", "-")) for h in re.findall(r"^#+ (.+)$", text,
                                                                                                   re.M)}
    for d in DIAGNOSES.values():
        assert d.runbook in anchors, (d.name, d.runbook)


BASELINE_NOT_STABLE = "baseline not stable: e2e_p50 moved from window 2 (reference: windows [0, 1])"
# a latency that climbed in every pool window (page.check_pool): the reference is window 0
BASELINE_CLIMB = "baseline not stable: e2e_p95 climbed in every pool window from window 0 (reference: windows [0])"
# found live with the windows after the pool (drift_watch._recheck_pool): its message says where
BASELINE_MOVED_LATE = ("baseline not stable: ttft_p50 moved from window 1 (reference: windows [0]) (found with the "
                       "windows after the pool, at window 7)")


async def _store(state: Path) -> tuple[list[Finding], RunVerdict]:
    rng = random.Random(3)
    findings = [_example(i, d) for i, d in enumerate(DIAGNOSES)]
    failing = [f.judged(True, f"{f.kind}: {f.diagnosis} (window {f.window})") for f in findings if _fails(f)]
    notes = [f.judged(False, None) for f in findings if f.diagnosis == "leak page withdrawn"]
    verdict = RunVerdict(schema_version=VERDICT_SCHEMA_VERSION, result="FAIL", passed=False,
                         reasons=[f.reason for f in failing], failing=failing, notes=notes,
                         judged=Judged(windows=8, full_windows=8, requests=8000, requests_measured=8000))
    store = await RunStore.open(state)
    try:
        await store.create_run("every", {"run": {"window": "1m"}, "analysis": {"verdict": {"fail_on": [
            k.name for k in KINDS.values() if k.fail_on]}}}, target="http://t/v1", model="m", created_unix=T0)
        await store.start_segment("every", t_unix=T0)
        for i in range(8):
            w = make_window(i, rng, 1000, duration=WINDOW, start_unix=T0 + i * WINDOW)
            await store.save_window("every", i, 0, w, False)
        await store.add_event("every", "baseline", "warning", BASELINE_NOT_STABLE, {"checks": {"e2e_p50": {
            "reference": [0, 1], "moved_from": 2, "dropped": [], "stat": 4.2}}}, 3, t_unix=T0 + 0.5)
        await store.add_event("every", "baseline", "warning", BASELINE_CLIMB, {"checks": {"e2e_p95": {
            "reference": [0], "moved_from": 1, "dropped": [], "stat": 9.1, "climb": True}}}, 3, t_unix=T0 + 0.55)
        await store.add_event("every", "baseline", "warning", BASELINE_MOVED_LATE, {"checks": {"ttft_p50": {
            "reference": [0], "moved_from": 1, "dropped": [], "stat": 4.6}}, "late": True}, 7, t_unix=T0 + 0.6)
        for i, f in enumerate(findings):
            data = f.judged(_fails(f), None).to_dict()
            if f.kind == "ab":
                data["target"] = None
            await store.add_event("every", f.kind, f.severity, f"{f.diagnosis}: {f.message}", data, f.window,
                                  t_unix=T0 + 1 + i)
        await store.set_verdict("every", verdict.dump())
        await store.end_segment("every", 0, "duration", t_unix=T0 + 8 * WINDOW)
        await store.finish_run("every", "duration", status="failed", t_unix=T0 + 8 * WINDOW)
    finally:
        await store.close()
    return findings, verdict


@pytest.fixture(scope="module")
def every(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Finding], Any]:
    state = tmp_path_factory.mktemp("every") / "state"
    findings, _ = asyncio.run(_store(state))
    with StoreReader(state) as rd:
        return findings, build_report(rd, "every")


def _compare(report: Any, markdown: bool = False) -> str:
    """``soakd compare`` of the report against itself: each run's own verdict and findings beside the pairing."""
    from soakd.report import render_json
    from soakd.report.compare import compare_reports, format_compare

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "report.json"
        path.write_text(render_json(report), encoding="utf-8")
        return format_compare(compare_reports(path, path), markdown=markdown)


OUTPUTS: dict[str, Any] = {"md": render_markdown, "html": render_html, "junit": render_junit, "summary": format_summary,
                           "compare": _compare, "compare-md": lambda r: _compare(r, markdown=True)}


@pytest.mark.parametrize("fmt", list(OUTPUTS))
def test_every_finding_appears_with_its_evidence(every: tuple[list[Finding], Any], fmt: str) -> None:
    findings, report = every
    text = OUTPUTS[fmt](report)
    if fmt in ("html", "junit"):
        import html

        text = html.unescape(text.replace("</dt><dd>", " "))  # the HTML's evidence: <dt>key</dt><dd>value</dd>
    for f in findings:
        _, shown = EXAMPLES[f.diagnosis]
        assert f.title in text, (fmt, f.diagnosis)
        assert shown in text, (fmt, f.diagnosis, shown)
        if fmt not in ("summary", "compare", "compare-md"):  # grouped by diagnosis: the words of the first
            assert f.message in text, (fmt, f.diagnosis)
    if fmt in ("md", "html"):
        assert text.count("fails the run") >= sum(_fails(f) for f in findings)


@pytest.mark.parametrize("fmt", list(OUTPUTS))
def test_the_verdicts_notes_are_said_in_every_output(every: tuple[list[Finding], Any], fmt: str) -> None:
    """A leak page withdrawn by the run's last judgement is in the verdict's lines, as not failing (issue 21)."""
    import html

    _, report = every
    text = html.unescape(OUTPUTS[fmt](report))
    (note,) = report.verdict.notes
    assert f"warning · Leak page withdrawn · run (not failing): {note.message}" in text, fmt


@pytest.mark.parametrize("fmt", list(OUTPUTS))
def test_a_baseline_that_was_not_stable_is_said_in_every_output(every: tuple[list[Finding], Any], fmt: str) -> None:
    """The pool's check found a change inside it (issue 21 item 1): what the drift comparisons were made against is
    part of what the verdict rests on, in every output (it used to be only an event of the Markdown and HTML)."""
    import html

    _, report = every
    text = html.unescape(OUTPUTS[fmt](report))
    assert f"{BASELINE_NOT_STABLE} (said as the pool closed, window 3)" in text, fmt
    assert f"{BASELINE_CLIMB} (said as the pool closed, window 3)" in text, fmt
    # a step found later, with the windows after the pool: said with its own window, not as the pool closed
    assert BASELINE_MOVED_LATE in text and f"{BASELINE_MOVED_LATE} (said as the pool closed" not in text, fmt


def test_junit_fails_the_case_of_each_failing_kind_and_metric(every: tuple[list[Finding], Any]) -> None:
    findings, report = every
    xml = junitparser.JUnitXml.fromstring(render_junit(report))
    suite = next(iter(xml))
    status = {(c.classname, c.name): (type(c.result[0]).__name__ if c.result else "passed") for c in suite}
    for kind in KINDS.values():
        if kind.name in ("drift", "leak", "ab"):
            continue
        failing = any(_fails(f) and f.kind == kind.name for f in findings)
        assert (status[(f"soakd.{kind.name}", kind.name)] == "Failure") == failing, kind
    # a change over windows 5..7 naming e2e_p50 and tokens/s fails both metrics' cases and all its windows
    assert status[("soakd.drift", "e2e_p50")] == "Failure"
    assert status[("soakd.drift", "output_tokens_per_second")] == "Failure"
    change = next(f for f in findings if f.diagnosis == "confident drift")
    for w in range(change.window, change.last_window + 1):
        assert status[("soakd.windows", f"window {w}")] == "Failure", w
    named = [n for (c, n) in status if c == "soakd.findings"]
    assert len(named) == len(findings)  # every finding, info ones too


def test_every_finding_has_its_log_line(every: tuple[list[Finding], Any]) -> None:
    findings, _ = every
    out = io.StringIO()
    structlog.configure(processors=[structlog.processors.JSONRenderer()],
                        logger_factory=structlog.PrintLoggerFactory(out), cache_logger_on_first_use=False)

    class NoStore:
        store = None

    try:
        events = EventLog(NoStore())  # type: ignore[arg-type]
        for f in findings:
            events.emit(f.kind, f.severity, f"{f.diagnosis}: {f.message}", f.to_dict(), f.window)
        asyncio.run(events.flush())
    finally:
        structlog.reset_defaults()
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == len(findings)
    for f, line in zip(findings, lines, strict=True):
        _, shown = EXAMPLES[f.diagnosis]
        assert line["event"] == "finding" and line["diagnosis"] == f.diagnosis and line["message"] == f.message
        assert shown in line["evidence"], (f.diagnosis, line["evidence"])
        assert line["runbook"].endswith("#" + f.spec.runbook) and line["where"] == f.where()

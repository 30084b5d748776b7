"""Every verdict names its cause, in every output: INCONCLUSIVE says how many windows were not judged
and why (client-impaired with soakd's own stall figure and what to do about it, too few requests, the
target down, partial), PASS says what was judged (windows, requests, the smallest change each metric
could show) — in the Markdown and HTML reports, JUnit, the terminal summary and the verdict's own lines (what the
``soakd_finished`` log line carries). Windows from the analysis tests' builder, judged by the real
analysis engine, written into a store through the RunStore API."""

from __future__ import annotations

import asyncio
import html
import random
from pathlib import Path

import junitparser

from helpers.windows import make_window
from soakd.analysis.engine import Analyzer
from soakd.config import AnalysisConfig
from soakd.core.summary import ClientSummary
from soakd.report import build_report, render_html, render_junit, render_markdown
from soakd.report.model import RunReport
from soakd.report.summary import format_summary
from soakd.store import RunStore, StoreReader

T0 = 1_700_000_000.0


def _run(state: Path, impaired: set[int], n_windows: int = 8, small: set[int] = frozenset(),
         partly: dict[int, int] | None = None) -> RunReport:
    rng = random.Random(11)
    analyzer = Analyzer(AnalysisConfig(), planned_windows=n_windows)
    events: list[tuple] = []
    analyzer.on_event = lambda *e: events.append(e)

    async def go() -> None:
        store = await RunStore.open(state)
        try:
            await store.create_run("r", {"run": {"window": "30m"}}, target="http://t/v1", model="m", created_unix=T0)
            await store.start_segment("r", t_unix=T0)
            for i in range(n_windows):
                w = make_window(i, rng, 20 if i in small else 1000, start_unix=T0)
                if i in impaired:  # soakd's own loop stalled 412 ms: shown, not judged
                    w.client = ClientSummary(heartbeats=100, loop_lag_max_seconds=0.412, stall_seconds=3.5,
                                             impaired=True, impaired_reason="event-loop lag p99 412 ms")
                if i in (partly or {}):  # some requests overlapped a stall of soakd's loop: counted, left out
                    n = (partly or {})[i]
                    w.client = ClientSummary(heartbeats=100, loop_lag_max_seconds=0.3, requests_impaired=n,
                                             impaired_share=n / w.requests)
                await store.save_window("r", i, 0, w, False)
                analyzer.add_window(w)
            verdict = analyzer.verdict()
            for k, (kind, sev, msg, data, window) in enumerate(events):
                await store.add_event("r", kind, sev, msg, data, window, t_unix=T0 + k)
            await store.set_verdict("r", verdict.dump())
            await store.finish_run("r", "duration", status="finished", t_unix=T0 + 1e5)
        finally:
            await store.close()

    asyncio.run(go())
    with StoreReader(state) as rd:
        return build_report(rd, "r")


def _outputs(report: RunReport) -> dict[str, str]:
    junit = junitparser.JUnitXml.fromstring(render_junit(report))
    case = next(c for c in next(iter(junit)) if c.classname == "soakd.verdict")
    return {"md": render_markdown(report), "html": html.unescape(render_html(report)),
            "junit": " ".join(f"{r.message} {r.text}" for r in case.result), "summary": format_summary(report),
            "log": " ".join(report.verdict.cause_lines())}


def test_inconclusive_names_the_client_impaired_windows_and_the_stall(tmp_path: Path) -> None:
    report = _run(tmp_path / "s", impaired={2, 4, 6})
    v = report.verdict
    assert v.result == "INCONCLUSIVE" and v.exit_code == 3
    (cause,) = [c for c in v.not_judged if c.cause == "client_impaired"]
    assert cause.windows == [2, 4, 6] and "412 ms" in cause.detail and "10.5 s stalled" in cause.detail
    assert "5 of 8 full windows could be judged" in v.inconclusive and "client-impaired" in v.inconclusive
    for name, text in _outputs(report).items():
        assert "client-impaired" in text and "412 ms" in text and "windows 2, 4, 6" in text, name
        # and what to do about it
        assert "give soakd CPU of its own" in text and "analysis.client.request_lag_relative: 3" in text, name
    # the window table says it too
    notes = {r.window: r.notes for r in report.table}
    assert all("not judged: client-impaired (soakd itself stalled)" in notes[i] for i in (2, 4, 6))


def test_too_few_requests_is_named_with_the_counts(tmp_path: Path) -> None:
    report = _run(tmp_path / "s", impaired=set(), small={1, 3, 5, 7})
    v = report.verdict
    assert v.result == "INCONCLUSIVE"
    (cause,) = [c for c in v.not_judged if c.cause == "too_few_requests"]
    assert cause.windows == [1, 3, 5, 7] and "fewer than 50 requests" in cause.detail
    for name, text in _outputs(report).items():
        assert "too few requests" in text and "windows 1, 3, 5, 7" in text, name


def test_pass_says_what_was_judged(tmp_path: Path) -> None:
    report = _run(tmp_path / "s", impaired=set())
    v = report.verdict
    assert v.result == "PASS" and v.exit_code == 0
    assert v.judged is not None and v.judged.windows == 8 and v.judged.requests > 7000
    assert set(v.judged.detectable) >= {"e2e_p50", "ttft_p95", "output_tokens_per_second"}
    for name, text in _outputs(report).items():
        if name == "junit":
            continue  # a passing case has no message
        assert "8 of 8 full windows judged" in text and "the smallest change a page catches within two windows" in text, name
        assert "e2e_p50" in text, name


def test_requests_impaired_by_soakd_are_counted_and_the_window_judged_on_the_rest(tmp_path: Path) -> None:
    """Windows with a few requests impaired by soakd's own stalls (under the share that would make them
    client-impaired) are judged: the run PASSes, the verdict says how many requests were impaired, and the
    window table notes them."""
    report = _run(tmp_path / "s", impaired=set(), partly={3: 40, 5: 90})
    v = report.verdict
    assert v.result == "PASS" and v.judged is not None and v.judged.requests_impaired == 130
    assert "130 of them" in v.judged.text() and "impaired by soakd's own stalls" in v.judged.text()
    notes = {r.window: r.notes for r in report.table}
    assert any("40 requests impaired by soakd's own stalls" in n for n in notes[3]), notes[3]
    for name, text in _outputs(report).items():
        if name != "junit":
            assert "impaired by soakd's own stalls" in text, name

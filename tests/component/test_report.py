"""The final report: a recorded run written straight into a store (RunStore API, windows from the
analysis tests' synthetic builder, findings from the real analysis engine), rendered as JSON,
Markdown and HTML; the SVG charts; ``soakd report`` on the command line; the HTML in headless
Chromium; and the reports a real (in-process) soak leaves in its run directory."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
import zlib
from pathlib import Path
from typing import Any

import junitparser
import pytest
import yaml

from soakd.analysis.diagnosis import TROUBLESHOOTING
from soakd.analysis.drift import baseline_from_report, compare
from soakd.analysis.engine import Analyzer
from soakd.soak.canary import CanaryResult
from soakd.config import AnalysisConfig, load_config
from soakd.core.summary import WindowSummary
from soakd.report import (
    REPORT_FILES,
    ReportError,
    build_report,
    charts,
    render_html,
    render_json,
    render_junit,
    render_markdown,
    write_reports,
)
from soakd.report.build import redact
from soakd.report.model import RunReport
from soakd.report.svg import Band, Series, Span, fmt_number, line_chart, nice_ticks
from soakd.store import RunStore, StoreReader
from helpers import run_soakd, soakd_env
from helpers.windows import make_window

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
T0 = 1_700_000_040.0  # a minute boundary
WINDOW = 600.0
WARMUP = 60.0
GAP = 900.0
SECRET = "sk-very-secret-header-value"
GIB = 2**30


# ---------------------------------------------------------------------------------------------
# a recorded run


def _device(i: int, *, throttled: bool = False) -> dict[str, Any]:
    mem = 40 * GIB + i * 0.5 * GIB  # the floor rises half a GiB per window: a leak
    clock = 1.386e9 if throttled else 1.98e9
    share = dict.fromkeys(("sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake"), 0.0)
    if throttled:
        share["sw_thermal"] = 0.6
    return {
        "power_watts": {"mean": 560.0 - (80 if throttled else 0), "max": 640.0, "min": 480.0, "stdev": 20.0,
                        "count": 120},
        "energy_joules": 330_000.0, "energy_seconds": WINDOW,
        "energy_per_output_token_joules": 2.2 + (0.3 if throttled else 0.0),
        "temperature_celsius": {"mean": 70.0 + i, "max": 74.0 + i + (12 if throttled else 0)},
        "memory_temperature_celsius": {"mean": 78.0, "max": 82.0},
        "sm_clock_hertz": {"mean": clock, "min": clock * 0.9, "max": 1.98e9},
        "sm_clock_max_hertz": 1.98e9,
        "utilization_ratio": {"mean": 0.97, "max": 1.0},
        "throttle_share": share,
        "memory_used_bytes": {"min": mem, "max": mem + 2 * GIB, "mean": mem + GIB, "first": mem, "last": mem + GIB,
                              "slope_per_hour": 3 * GIB},
    }  # fmt: skip


def _server(i: int) -> dict[str, Any]:
    return {"kv_cache_usage_ratio": {"mean": 0.31 + 0.005 * i, "max": 0.5, "min": 0.1},
            "requests_waiting": {"mean": 0.2, "max": 3.0}, "requests_running": {"mean": 30.0, "max": 32.0}}


def _window_start(i: int) -> float:
    start = T0 + WARMUP + i * WINDOW
    return start + GAP if i >= 4 else start  # segment 1 (windows 4..) began after a gap


def _canary(match: bool) -> CanaryResult:
    return CanaryResult(ok=True, match=match, digest="ab12" if match else "ff00", reference="ab12",
                        text="2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37. Mercury." if match else "2, 3, 5, 7, 9 ...",
                        idle=True)  # fmt: skip


async def record_run(state: Path, run_id: str = "run-gpu", *, telemetry: bool = True, partial: bool = True,
                     drift_at: int = 5, n_windows: int = 9) -> dict[str, Any]:
    """Write a finished 9-window run with two segments into ``state`` through the RunStore API."""
    cfg = load_config(None, {
        "target": {"url": "http://user:pw@vllm.internal:8000/v1", "model": "llama-3-8b",
                   "headers": {"X-Team-Key": SECRET}},
        "run": {"duration": 6000.0, "window": WINDOW, "warmup": WARMUP, "state_dir": str(state)},
        "load": {"concurrency": 32},
    }, environ={})  # fmt: skip
    rng = random.Random(7)
    analyzer_events: list[tuple[str, str, str, dict[str, Any], int | None]] = []
    # a 90-minute run: its memory climb is judged over what it has (the default min_span is 4 h)
    analyzer = Analyzer(AnalysisConfig(leak={"min_span": 0.0}), on_event=lambda *e: analyzer_events.append(e))
    store = await RunStore.open(state)
    try:
        await store.create_run(run_id, cfg.redacted(), target=cfg.target.url, model="llama-3-8b",
                               server_kind="vllm" if telemetry else None, created_unix=T0)
        await store.start_segment(run_id, "start", t_unix=T0)
        t_events: list[tuple[float, tuple[Any, ...]]] = []
        for i in range(n_windows):
            if i == 4:  # soakd restarted: the gap belongs to no window
                await store.end_segment(run_id, 0, "interrupted", t_unix=_window_start(3) + WINDOW)
                await store.start_segment(run_id, "resume", t_unix=_window_start(4) - WARMUP)
                await store.add_event(run_id, "segment", "info", "resumed (segment 1) after a gap; window numbering "
                                      "continues at 4", {"segment": 1}, t_unix=_window_start(4) - WARMUP)
            is_partial = partial and i == n_windows - 1
            throttled = telemetry and i == drift_at
            w = make_window(
                i, rng, 500 if is_partial else 1000, duration=WINDOW * (0.5 if is_partial else 1.0), partial=is_partial,
                scale=1.3 if i == drift_at else 1.4 if telemetry and i == 7 else 1.0, tokens=(100, 140),
                device=_device(i, throttled=throttled) if telemetry else {},
                server=_server(i) if telemetry else {},
                quiesce=({"t_unix": _window_start(i) + WINDOW / 2, "window": i, "drained": True,
                          "kv_cache_usage_ratio": 0.002, "memory_used_bytes": 40 * GIB + i * 0.5 * GIB,
                          "seconds": 4.2} if telemetry and not is_partial else None),
            )  # fmt: skip
            w.start_unix = _window_start(i)
            w.segment = 1 if i >= 4 else 0
            await store.save_window(run_id, i, w.segment, w, is_partial)
            before = len(analyzer_events)
            analyzer.add_window(w)
            if i == 0:
                await store.set_baseline(run_id, 0, w)
            if i == 6 and telemetry:
                analyzer.add_canary(_canary(True), i)
                analyzer.add_canary(_canary(False), i)
            t_end = _window_start(i) + w.duration_seconds
            if w.quiesce:  # the runtime records each probe as an event
                q = w.quiesce.model_dump()
                await store.add_event(run_id, "quiesce", "info", f"quiesce probe in window {i}: idle KV usage "
                                      f"{q['kv_cache_usage_ratio']:.4f}", q, i, t_unix=q["t_unix"])
            for ev in analyzer_events[before:]:
                t_events.append((t_end, ev))
            if telemetry:
                for k in range(int(w.duration_seconds // 60)):  # per-minute samples, two GPUs
                    t = _window_start(i) + 60 * k + 1
                    clock = 1.386e9 if throttled and 2 <= k <= 8 else 1.98e9
                    series = [("soakd_server_kv_cache_usage_ratio", None, 0.3 + 0.02 * (k % 5)),
                              ("soakd_server_info", {"kind": "vllm"}, 1.0)]
                    for g in ("0", "1"):
                        lab = {"gpu": g, "uuid": f"GPU-{g}"}
                        series += [
                            ("soakd_gpu_memory_used_bytes", lab, 20 * GIB + (i * 10 + k) * 0.025 * GIB),
                            ("soakd_gpu_power_watts", lab, 280.0 - (40 if clock < 1.9e9 else 0) + 5 * (k % 3)),
                            ("soakd_gpu_temperature_celsius", {**lab, "sensor": "gpu"},
                             70.0 + (14 if clock < 1.9e9 else 0) + int(g)),
                            ("soakd_gpu_temperature_celsius", {**lab, "sensor": "memory"}, 80.0),
                            ("soakd_gpu_sm_clock_hertz", lab, clock),
                            ("soakd_gpu_sm_clock_max_hertz", lab, 1.98e9),
                        ]  # fmt: skip
                    await store.add_samples(run_id, t, series)
        before = len(analyzer_events)
        verdict = analyzer.verdict()
        end = _window_start(n_windows - 1) + WINDOW
        t_events += [(end, ev) for ev in analyzer_events[before:]]  # the end-of-run findings
        for t, (kind, severity, message, data, window) in t_events:
            await store.add_event(run_id, kind, severity, message, data, window, t_unix=t)
        await store.set_verdict(run_id, verdict.dump())
        end = _window_start(n_windows - 1) + WINDOW
        await store.end_segment(run_id, 1, "duration", t_unix=end)
        await store.finish_run(run_id, "duration", status="failed" if verdict.result == "FAIL" else "finished",
                               t_unix=end)
    finally:
        await store.close()
    return verdict.dump()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A state dir with two runs: ``run-gpu`` (telemetry, drift + throttle + leak + canary) and the
    newer ``run-nogpu`` (no device or server telemetry, clean)."""
    state = tmp_path_factory.mktemp("report") / "state"

    async def go() -> None:
        await record_run(state, "run-gpu")
        await record_run(state, "run-nogpu", telemetry=False, drift_at=-1)

    asyncio.run(go())
    # the no-GPU run is the newest (created later)
    return state


@pytest.fixture(scope="module")
def report_model(recorded: Path) -> RunReport:
    with StoreReader(recorded) as rd:
        return build_report(rd, "run-gpu", generated_unix=T0 + 10_000)


@pytest.fixture(scope="module")
def report(report_model: RunReport) -> dict[str, Any]:
    """The report as its JSON document (what report.json holds); the renderers take it as it is."""
    return report_model.dump()


@pytest.fixture(scope="module")
def report_nogpu(recorded: Path) -> dict[str, Any]:
    with StoreReader(recorded) as rd:
        return build_report(rd, "run-nogpu", generated_unix=T0 + 10_000).dump()


# ---------------------------------------------------------------------------------------------
# the SVG renderer


def test_nice_ticks_cover_the_range_in_round_steps() -> None:
    lo, hi, ticks = nice_ticks(0.13, 0.87)
    assert lo <= 0.13 and hi >= 0.87 and ticks[0] == lo and abs(ticks[-1] - hi) < 1e-12
    steps = {round(b - a, 12) for a, b in zip(ticks, ticks[1:], strict=False)}
    assert steps == {0.2} and 4 <= len(ticks) <= 7
    _, _, ticks = nice_ticks(0, 7, 8, integer=True)
    assert all(float(t).is_integer() for t in ticks)
    assert fmt_number(0.2, 0.2) == "0.2" and fmt_number(1500.0, 500) == "1500" and fmt_number(-0.0, 1) == "0"
    assert fmt_number(2_500_000, 500_000) == "2.5M" and fmt_number(150_000, 50_000) == "150k"


def test_line_chart_band_series_gaps_legend_and_escaping() -> None:
    s1 = Series("p95 <script>", [0, 1, 2, 3, 4], [1.0, 1.1, None, 1.3, 1.2], hollow=frozenset({4.0}))
    s2 = Series("p50 & co", [0, 1, 2, 3, 4], [0.5, 0.52, 0.55, float("nan"), 0.5], dash=True)
    svg = line_chart([s1, s2], title='Latency "e2e"', y_label="s", x_label="window",
                     bands=[Band(0.95, 1.05, "baseline ±5%", center=1.0)], spans=[Span(1.5, 2.5, "finding")],
                     x_integer=True, chart_id="c1")  # fmt: skip
    root = ET.fromstring(svg)  # well-formed XML
    ns = "{http://www.w3.org/2000/svg}"
    assert root.tag == f"{ns}svg" and root.get("id") == "c1"
    bands = [e for e in root.iter(f"{ns}rect") if e.get("class") == "band"]
    assert len(bands) == 1 and float(bands[0].get("height")) > 0
    assert [e for e in root.iter(f"{ns}line") if e.get("class") == "band-center"]
    assert [e for e in root.iter(f"{ns}rect") if e.get("class") == "span"]
    groups = {g.get("data-series"): g for g in root.iter(f"{ns}g") if g.get("class") == "series"}
    assert set(groups) == {"p95 <script>", "p50 & co"}
    # the missing value splits each series into two lines (the second of s1 is 2 points, of s2 1 point)
    assert len(groups["p95 <script>"].findall(f"{ns}polyline")) == 2
    assert len(groups["p50 & co"].findall(f"{ns}polyline")) == 1
    assert groups["p50 & co"].find(f"{ns}polyline").get("stroke-dasharray")
    hollow = [c for c in groups["p95 <script>"].findall(f"{ns}circle") if c.get("fill") == "#ffffff"]
    assert len(hollow) == 1
    texts = [t.text for t in root.iter(f"{ns}text")]
    assert 'Latency "e2e"' in texts and "baseline ±5%" in texts and "window" in texts and "s" in texts
    assert "<script>" not in svg and "&lt;script&gt;" in svg
    # deterministic
    assert svg == line_chart([s1, s2], title='Latency "e2e"', y_label="s", x_label="window",
                             bands=[Band(0.95, 1.05, "baseline ±5%", center=1.0)],
                             spans=[Span(1.5, 2.5, "finding")], x_integer=True, chart_id="c1")  # fmt: skip


def test_line_chart_ticks_stay_inside_the_plot_and_include_the_band() -> None:
    svg = line_chart([Series("v", [0, 10, 20], [100.0, 101.0, 99.0])], title="t",
                     bands=[Band(90.0, 110.0, "band")])  # fmt: skip
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    plot = next(e for e in root.iter(f"{ns}rect") if e.get("class") == "plot")
    top, bottom = float(plot.get("y")), float(plot.get("y")) + float(plot.get("height"))
    band = next(e for e in root.iter(f"{ns}rect") if e.get("class") == "band")
    assert top <= float(band.get("y")) and float(band.get("y")) + float(band.get("height")) <= bottom + 0.1
    yticks = [float(t.text) for t in root.iter(f"{ns}text") if t.get("class") == "ytick"]
    assert min(yticks) <= 90 and max(yticks) >= 110
    for c in root.iter(f"{ns}circle"):
        assert top <= float(c.get("cy")) <= bottom


def test_a_nearly_flat_series_is_drawn_flat() -> None:
    """Memory that moves by a few bytes out of 74 GiB is a flat line, not a cliff with 6-decimal ticks."""
    svg = line_chart([Series("used", [0, 1, 2], [74.50582, 74.50583, 74.50584])], title="memory")
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    ticks = [t.text for t in root.iter(f"{ns}text") if t.get("class") == "ytick"]
    assert all(len(t.split(".")[-1]) <= 2 for t in ticks), ticks
    ys = [float(c.get("cy")) for c in root.iter(f"{ns}circle")]
    assert max(ys) - min(ys) < 1.0


def test_empty_and_single_point_charts() -> None:
    svg = line_chart([Series("v", [1, 2], [None, None])], title="Nothing", empty_text="no samples")
    ET.fromstring(svg)
    assert "no samples" in svg and "<polyline" not in svg
    one = line_chart([Series("v", [3], [5.0])], title="One", x_integer=True)
    ET.fromstring(one)
    assert one.count("<circle") == 1


# ---------------------------------------------------------------------------------------------
# building the report


def test_report_holds_the_run_verdict_windows_and_findings(report: dict[str, Any]) -> None:
    run = report["run"]
    assert run["id"] == "run-gpu" and run["model"] == "llama-3-8b" and run["server_kind"] == "vllm"
    assert run["status"] == "failed" and run["stop_reason"] == "duration"
    assert run["started_at"] == "2023-11-14T22:14:00Z"
    assert len(run["segments"]) == 2 and len(run["gaps"]) == 1 and run["gaps"][0]["seconds"] > 0
    assert run["load"]["concurrency"] == 32 and run["window"] == "10m"
    v = report["verdict"]
    assert v["result"] == "FAIL" and v["passed"] is False and not v["interim"]
    assert any(r.startswith("throttle:") for r in v["reasons"]) and any(r.startswith("leak:") for r in v["reasons"])
    assert any(r.startswith("canary:") for r in v["reasons"])
    assert v["stability"]["e2e_p95"]["stable"] is False
    assert [w["window"] for w in report["windows"]] == list(range(9)) and report["windows"][-1]["partial"] is True
    assert report["baseline_window"] == 0 and report["baseline"]["window"] == 0
    rows = report["table"]
    assert len(rows) == 9 and rows[0]["notes"][0] == "baseline" and rows[-1]["partial"]
    assert "throttling" in rows[5]["notes"]
    assert rows[5]["sm_clock_mhz"] == pytest.approx(1386) and rows[0]["memory_gib"] == pytest.approx(41.0)
    assert rows[0]["kv_cache_usage_ratio"] == pytest.approx(0.31) and rows[0]["joules_per_token"] == 2.2
    f = report["findings"]
    # window 5's +30% is the throttle's (explained there, and not paged again at window 6, back at the
    # baseline); window 7's +40% over 1,000 requests is beyond what a page catches within one window against
    # this pool (issue 21: the live page): a performance drift at window 7
    assert list(f)[:7] == ["drift", "leak", "throttle", "canary", "quiesce", "segment", "baseline"]
    assert [(e["window"], e["diagnosis"]) for e in f["drift"]] == [(7, "performance drift")]
    assert f["throttle"][0]["window"] == 5 and f["throttle"][0]["diagnosis"] == "throttling"
    assert f["throttle"][0]["severity"] == "critical" and f["throttle"][0]["evidence"]["throttle"]
    assert {e["diagnosis"] for e in f["leak"]} == {"memory leak", "KV cache not released"}
    assert any(e["diagnosis"] == "output changed" for e in f["canary"])
    diag = {r["diagnosis"]: r for r in report["troubleshooting"]}
    assert {"throttling", "memory leak"} <= set(diag)
    assert diag["throttling"]["check"] == TROUBLESHOOTING["throttling"][1] and diag["throttling"]["windows"] == [5]
    tel = report["series"]["telemetry"]
    assert tel["source"] == "samples" and tel["device"] and tel["server"] and tel["gpus"] == 2 and not tel["notes"]
    # two GPUs summed: 2 x 20 GiB and up
    mem = [v for v in tel["values"]["memory_used_bytes"] if v is not None]
    assert mem[0] == pytest.approx(40 * GIB) and mem[-1] > mem[0]
    assert None in tel["values"]["memory_used_bytes"]  # the gap between the segments breaks the line
    ws = report["series"]["windows"]
    assert ws["baseline"]["e2e_p95"] == report["windows"][0]["e2e_seconds"]["p95"]
    assert ws["relative"]["e2e_p95"][0] == 0.0 and ws["relative"]["e2e_p95"][5] > 0.2


def test_secrets_never_reach_the_report(report: dict[str, Any]) -> None:
    text = render_json(report) + render_markdown(report) + render_html(report)
    assert SECRET not in text and "user:pw" not in text
    assert report["run"]["config"]["target"]["headers"] == {"X-Team-Key": "**********"}
    assert report["run"]["target"] == "http://***@vllm.internal:8000/v1"  # the run row's URL, as given
    # defence in depth over a config stored by an older release (credential headers as given): they,
    # and credentials in URLs, are masked; keys that merely look secret keep their values
    stored = {"target": {"url": "http://u:p@h/v1", "headers": {"X-Api-Key": "k", "X-Source": "qa"},
                         "api_key_env": "KEY", "timeouts": {"first_token": "5m"}},
              "sim": {"api_key": "**********", "ttft_per_prompt_token": 2e-05}, "nested": [{"password": "p"}]}
    assert redact(stored) == {
        "target": {"url": "http://***@h/v1", "headers": {"X-Api-Key": "**********", "X-Source": "qa"},
                   "api_key_env": "KEY", "timeouts": {"first_token": "5m"}},
        "sim": {"api_key": "**********", "ttft_per_prompt_token": 2e-05}, "nested": [{"password": "p"}]}


async def test_report_configuration_is_print_configs(tmp_path: Path) -> None:
    """The report's effective configuration is what ``--print-config`` prints for the same file
    (credentials masked by their type in both, nothing else): the stored config as it is."""
    secrets = {"header": "hdr-Qx81SecretTeamKey", "cookie": "session=Zk30SecretCookie", "sim": "sk-sim-Wq7SecretKey",
               "key": "sk-run-Mn5SecretApiKey", "password": "pw-Tt9SecretUrlPass"}
    state = tmp_path / "state"
    path = tmp_path / "soak.yaml"
    path.write_text(
        f"target:\n  url: http://qa:{secrets['password']}@vllm.internal:8000/v1\n  model: llama-3-8b\n"
        f"  api_key_env: MY_LLM_KEY\n  timeouts: {{first_token: 2m}}\n"
        f"  headers: {{X-Api-Key: {secrets['header']}, Cookie: '{secrets['cookie']}', X-Request-Source: soak-qa}}\n"
        f"run: {{duration: 1h, window: 10m, state_dir: {state}}}\n"
        f"sim: {{api_key: {secrets['sim']}, ttft_per_prompt_token: 0.00003}}\n")  # fmt: skip
    cfg = load_config(path, environ={})
    store = await RunStore.open(state)
    try:  # what the run session stores
        await store.create_run("run-cfg", cfg.redacted(), target=cfg.target.display_url, model="llama-3-8b",
                               created_unix=T0)
        await store.start_segment("run-cfg", "start", t_unix=T0)
    finally:
        await store.close()
    with StoreReader(state) as rd:
        rep = build_report(rd, "run-cfg", generated_unix=T0 + 60).dump()
    rc, out, err = await run_soakd("run", "-c", str(path), "--print-config", env=soakd_env(MY_LLM_KEY=secrets["key"]))
    assert rc == 0, err
    printed = yaml.safe_load(out)
    assert rep["run"]["config"] == printed
    target = printed["target"]
    assert target["timeouts"]["first_token"] == "2m" and printed["sim"]["ttft_per_prompt_token"] == 3e-05
    assert target["headers"] == {"X-Api-Key": "**********", "Cookie": "**********", "X-Request-Source": "soak-qa"}
    assert target["url"] == rep["run"]["target"] == "http://***@vllm.internal:8000/v1"
    assert printed["sim"]["api_key"] == "**********" and target["api_key_env"] == "MY_LLM_KEY"
    text = out + err + render_json(rep) + render_markdown(rep) + render_html(rep)
    for name, secret in secrets.items():
        assert secret not in text, name


def test_latest_run_unknown_run_and_empty_store(recorded: Path, tmp_path: Path) -> None:
    with StoreReader(recorded) as rd:
        assert build_report(rd).run.id == "run-nogpu"
        with pytest.raises(ReportError, match="no run 'nope'.*run-nogpu"):
            build_report(rd, "nope")

    async def empty() -> None:
        await (await RunStore.open(tmp_path / "empty")).close()

    asyncio.run(empty())
    with StoreReader(tmp_path / "empty") as rd, pytest.raises(ReportError, match="holds no runs"):
        build_report(rd)


# ---------------------------------------------------------------------------------------------
# the three formats


def test_json_report_round_trips_and_is_a_baseline(report: dict[str, Any]) -> None:
    text = render_json(report)
    loaded = json.loads(text)
    assert loaded == report
    assert loaded["schema"] == "soakd-report/1"
    base = baseline_from_report(loaded)
    assert base is not None and base.window == 0 and base.dump() == report["windows"][0]
    only_windows = baseline_from_report({"windows": loaded["windows"]})
    assert only_windows is not None and only_windows.window == 0
    # a later run's window compared with it, as `soakd run --baseline report.json` does
    r = compare(WindowSummary.load(loaded["windows"][5]), base, "e2e_p95")
    assert r.ratio is not None and r.ratio > 0.2


def test_markdown_has_the_verdict_first_and_the_window_table(report: dict[str, Any]) -> None:
    md = render_markdown(report)
    lines = md.splitlines()
    assert lines[0] == "# soakd report — run run-gpu"
    assert lines[2] == "**Verdict: FAIL**"
    # the verdict's causes: each finding that failed the run, by its title and window, with its message
    assert any(line.startswith("- critical · Throttling · window 5: ") for line in lines[3:10])
    assert any(line.startswith("- judged: 8 of 8 full windows judged") for line in lines[3:14])
    head = next(i for i, line in enumerate(lines) if line.startswith("| window | start (UTC) |"))
    for col in ("e2e p50 / p95 ms", "TTFT p50 / p95 ms", "ITL p50 / p95 ms", "req/s", "tok/s", "errors",
                "power W", "temp °C", "SM MHz", "memory GiB", "KV %", "J/token"):
        assert col in lines[head]
    rows = lines[head + 2: head + 11]
    assert [r.split("|")[1].strip() for r in rows] == [str(i) for i in range(8)] + ["8*"]
    assert all(r.count("|") == lines[head].count("|") for r in rows)
    assert "| 1386 |" in rows[5] and "throttling" in rows[5] and "baseline" in rows[0]
    assert "## Stability" in md and "## Findings" in md and "### What to check" in md
    assert TROUBLESHOOTING["throttling"][1] in md and TROUBLESHOOTING["memory leak"][1] in md
    assert "### Memory (" in md and "### Errors and output (" in md and "## Quiesce probes" in md
    assert "## Memory" in md and "| device_memory |" in md  # the run's last leak judgement of each source
    assert "**fails the run**" in md and "runbook: [soakdgputhrottling]" in md
    assert "No device telemetry" not in md


def test_html_is_self_contained_with_the_charts(report: dict[str, Any]) -> None:
    html = render_html(report)
    assert html.startswith("<!DOCTYPE html>") and html.rstrip().endswith("</html>")
    low = html.lower()
    assert "<script" not in low and "<link" not in low and " src=" not in low and "@import" not in low
    assert "url(" not in low
    ids = [c["id"] for c in charts(RunReport.load(report))]
    assert ids == ["chart-drift", "chart-e2e", "chart-ttft", "chart-itl", "chart-requests_per_second",
                   "chart-output_tokens_per_second", "chart-energy_per_token", "chart-memory", "chart-kv",
                   "chart-power", "chart-temperature", "chart-clock"]
    assert html.count("<svg ") == len(ids)
    for c in charts(RunReport.load(report)):
        root = ET.fromstring(c["svg"])
        ns = "{http://www.w3.org/2000/svg}"
        series = [g.get("data-series") for g in root.iter(f"{ns}g") if g.get("class") == "series"]
        bands = [e for e in root.iter(f"{ns}rect") if e.get("class") == "band"]
        assert series, c["id"]
        if c["group"] == "windows":
            assert bands, f"{c['id']} has no baseline band"
        if c["id"] == "chart-e2e":
            assert series == ["p95", "p50"] and len(bands) == 2
            texts = [t.text for t in root.iter(f"{ns}text")]
            assert "p95 baseline ±5%" in texts and "window" in texts
        if c["id"] == "chart-temperature":
            assert series == ["GPU", "memory"]
        if c["id"] == "chart-drift":
            assert len(series) == 5 and "±5% band" in c["svg"]
    assert 'class="badge FAIL"' in html and "throttling" in html and "What to check" in html
    # the windows, stability, memory, what-to-check and quiesce tables, and nothing else
    # (the stability table: the default drift metrics, e2e and TTFT p99 among them; the error rate left them in
    # issue 21 item 6)
    assert html.count("<tr") == (1 + 9) + (1 + len(report["verdict"]["stability"])) + (1 + len(report["verdict"]["leaks"])) + (
        1 + len(report["troubleshooting"])) + (1 + 8)


# ---------------------------------------------------------------------------------------------
# JUnit XML, read by a real JUnit parser


def _junit_cases(report: dict[str, Any]) -> dict[tuple[str, str], tuple[str, str]]:
    """(classname, name) -> (Failure | Error | Skipped | passed, message), parsed by junitparser;
    the suite's counts checked against its cases."""
    xml = junitparser.JUnitXml.fromstring(render_junit(report))
    suites = list(xml)
    assert len(suites) == 1
    out = {}
    for case in suites[0]:
        res = case.result
        assert len(res) <= 1
        out[(case.classname, case.name)] = (type(res[0]).__name__, res[0].message or "") if res else ("passed", "")
    kinds = [v[0] for v in out.values()]
    suite = suites[0]
    assert (suite.tests, suite.failures, suite.errors, suite.skipped) == (
        len(kinds), kinds.count("Failure"), kinds.count("Error"), kinds.count("Skipped"))
    return out


def test_junit_has_a_case_per_check_and_fails_those_the_verdict_fails(report: dict[str, Any]) -> None:
    cases = _junit_cases(report)
    status = {k: v[0] for k, v in cases.items()}
    verdict = cases[("soakd.verdict", "verdict")]
    assert verdict[0] == "Failure" and verdict[1].startswith("FAIL: throttle: throttling (window 5)")
    # each tracked metric: those the throttling or window 7's jump moved fail, with the reasons that moved them
    assert status[("soakd.drift", "ttft_p50")] == "Failure"
    assert cases[("soakd.drift", "ttft_p50")][1] in ("throttle: throttling (window 5)", "drift: performance drift (window 7)")
    assert status[("soakd.drift", "e2e_p95")] == "Failure"
    assert cases[("soakd.drift", "e2e_p95")][1] == "drift: performance drift (window 7)"
    assert status[("soakd.drift", "output_tokens_per_second")] == "passed"
    # the error rate is no drift metric (issue 21 item 6): its case is soakd.errors'
    assert ("soakd.drift", "error_rate") not in cases
    assert {m for (c, m) in cases if c == "soakd.drift"} >= set(report["thresholds"]) - {"error_rate"}
    # leaks by their last judgement; the checks of one kind each
    assert status[("soakd.leak", "device_memory")] == "Failure" and status[("soakd.leak", "kv_residue")] == "passed"
    assert status[("soakd.throttle", "throttle")] == status[("soakd.canary", "canary")] == "Failure"
    assert status[("soakd.errors", "errors")] == status[("soakd.freeze", "freeze")] == "passed"
    # each window: the partial last one is skipped, those a failing finding points at fail
    windows = {n: st for (c, n), st in status.items() if c == "soakd.windows"}
    assert len(windows) == len(report["table"]) and windows["window 8"] == "Skipped"
    assert windows["window 5"] == windows["window 6"] == windows["window 7"] == "Failure" and windows["window 1"] == "passed"
    # each warning or critical finding, named by its id, kind, diagnosis and window
    findings = {n: st for (c, n), st in status.items() if c == "soakd.findings"}
    assert any(n.endswith("throttle: throttling (window 5)") and st == "Failure" for n, st in findings.items())
    assert not any("quiesce" in n or "baseline" in n for n in findings)


def test_junit_of_a_passing_run_and_the_checks_it_could_not_make(report_nogpu: dict[str, Any]) -> None:
    cases = _junit_cases(report_nogpu)
    assert report_nogpu["verdict"]["result"] == "PASS"
    assert not [k for k, v in cases.items() if v[0] in ("Failure", "Error")]
    assert cases[("soakd.throttle", "throttle")][0] == "Skipped" and "no device telemetry" in \
        cases[("soakd.throttle", "throttle")][1]
    assert cases[("soakd.leak", "memory")][0] == "Skipped"
    # INCONCLUSIVE is an error; a client-impaired or too small window is skipped, with the reason
    r = json.loads(json.dumps(report_nogpu))
    r["verdict"].update(result="INCONCLUSIVE", passed=False, inconclusive="3 of 9 full windows could be judged")
    r["windows"][2]["client"] = {**(r["windows"][2].get("client") or {}), "impaired": True,
                                 "impaired_reason": "event-loop lag p99 400 ms"}
    r["table"][3]["requests"] = 5
    cases = _junit_cases(r)
    assert cases[("soakd.verdict", "verdict")] == ("Error", "INCONCLUSIVE: 3 of 9 full windows could be judged")
    assert cases[("soakd.windows", "window 2")] == ("Skipped", "client-impaired: event-loop lag p99 400 ms")
    assert cases[("soakd.windows", "window 3")][0] == "Skipped" and "insufficient" in cases[("soakd.windows",
                                                                                              "window 3")][1]


def test_junit_survives_garbage_in_a_finding(report: dict[str, Any]) -> None:
    r = json.loads(json.dumps(report))
    ev = r["findings"]["canary"][-1]
    ev["detail"] = "output now: '\x00\x1b[31m<b>&amp; \ud800 ]]>'"  # a garbled server answer, quoted
    cases = _junit_cases(r)
    assert cases[("soakd.canary", "canary")][0] == "Failure"
    text = render_junit(r)
    assert "\x00" not in text and "\x1b" not in text and "\ud800" not in text
    assert "output now: '\ufffd\ufffd[31m&lt;b&gt;&amp;amp; \ufffd ]]&gt;'" in text  # replaced, escaped, kept
    ET.fromstring(text.split("\n", 1)[1])  # well-formed XML for the stdlib parser too


def test_a_run_without_telemetry_renders_without_device_charts(report_nogpu: dict[str, Any]) -> None:
    r = report_nogpu
    assert r["verdict"]["result"] == "PASS" and r["verdict"]["reasons"] == []
    tel = r["series"]["telemetry"]
    assert not tel["device"] and not tel["server"]
    assert any("No device telemetry" in n for n in tel["notes"])
    ids = {c["id"] for c in charts(RunReport.load(r))}
    assert ids == {"chart-drift", "chart-e2e", "chart-ttft", "chart-itl", "chart-requests_per_second",
                   "chart-output_tokens_per_second"}
    md, html = render_markdown(r), render_html(r)
    assert "**Verdict: PASS**" in md and "> No device telemetry was recorded" in md
    assert "No device telemetry was recorded" in html and "chart-memory" not in html and "chart-power" not in html
    assert "No finding: no drift, leak, throttle, canary, error, freeze, GPU or target finding." in md
    row = next(line for line in md.splitlines() if line.startswith("| 0 |"))
    assert [c.strip() for c in row.split("|")[10:16]] == ["-"] * 6  # power .. J/token: no data
    json.loads(render_json(r))


def test_an_unfinished_run_has_an_incomplete_verdict(tmp_path: Path) -> None:
    async def go() -> None:
        store = await RunStore.open(tmp_path)
        try:
            await store.create_run("r", {"run": {"window": "10m"}}, target="http://t/v1", model="m", created_unix=T0)
            await store.start_segment("r", t_unix=T0)
            await store.save_window("r", 0, 0, make_window(0, random.Random(1), 300, duration=600, start_unix=T0))
        finally:
            await store.close()

    asyncio.run(go())
    with StoreReader(tmp_path) as rd:
        r = build_report(rd).dump()
    assert r["verdict"]["result"] == "INCOMPLETE" and "no verdict" in r["verdict"]["reasons"][0]
    assert "interrupted" in r["run"]["state"] or "running" in r["run"]["state"]
    md = render_markdown(r)
    assert "**Verdict: INCOMPLETE**" in md
    assert 'class="badge INCOMPLETE"' in render_html(r)
    assert r["baseline"]["window"] == 0  # chosen the way a resumed run would (first full window)
    verdict = _junit_cases(r)[("soakd.verdict", "verdict")]
    assert verdict[0] == "Error" and "no final verdict" in verdict[1]


def test_write_reports_into_the_run_dir(recorded: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    shutil.copytree(recorded, state)
    paths = write_reports(state, "run-gpu")
    assert set(paths) == {"json", "md", "html", "junit"}
    for fmt, p in paths.items():
        assert p == state / "run-gpu" / REPORT_FILES[fmt] and p.stat().st_size > 1000
    assert sorted(x.name for x in (state / "run-gpu").iterdir()) == ["junit.xml", "report.html", "report.json",
                                                                     "report.md"]
    assert baseline_from_report(json.loads(paths["json"].read_text())).window == 0


# ---------------------------------------------------------------------------------------------
# the command line


def _soakd(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SOAKD_")}
    base.update(env or {})
    return subprocess.run([sys.executable, "-m", "soakd", "report", *args], capture_output=True, text=True,
                          cwd=str(cwd or REPO), env=base, timeout=60)  # fmt: skip


@pytest.mark.slow
def test_cli_report_formats_output_run_and_list(recorded: Path, tmp_path: Path) -> None:
    p = _soakd("--state-dir", str(recorded), "--run", "run-gpu")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("# soakd report — run run-gpu") and "**Verdict: FAIL**" in p.stdout
    p = _soakd("--state-dir", str(recorded))  # newest run
    assert p.returncode == 0 and "# soakd report — run run-nogpu" in p.stdout
    p = _soakd("--state-dir", str(recorded), "--run", "run-gpu", "--format", "json")
    assert p.returncode == 0 and json.loads(p.stdout)["run"]["id"] == "run-gpu"
    p = _soakd("--run", "run-gpu", "--format", "html", "-o", str(tmp_path / "r.out"),
               env={"SOAKD_RUN__STATE_DIR": str(recorded)})  # fmt: skip
    assert p.returncode == 0 and p.stdout == "" and "written to" in p.stderr
    assert (tmp_path / "r.out").read_text().startswith("<!DOCTYPE html>")
    p = _soakd("--state-dir", str(recorded), "--run", "run-gpu", "-o", str(tmp_path / "r.json"))  # format from suffix
    assert p.returncode == 0 and json.loads((tmp_path / "r.json").read_text())["verdict"]["result"] == "FAIL"
    p = _soakd("--state-dir", str(recorded), "--run", "run-gpu", "-o", str(tmp_path / "soak.xml"))  # .xml: JUnit
    assert p.returncode == 0 and "junit report" in p.stderr
    assert junitparser.JUnitXml.fromfile(str(tmp_path / "soak.xml")).failures >= 1
    p = _soakd("--state-dir", str(recorded), "--run", "run-nogpu", "--format", "junit")
    assert p.returncode == 0 and junitparser.JUnitXml.fromstring(p.stdout).failures == 0
    p = _soakd("--state-dir", str(recorded), "--list")
    assert p.returncode == 0
    lines = p.stdout.splitlines()
    assert lines[0].split()[:4] == ["run", "started", "(UTC)", "status"]
    assert lines[1].split()[0] == "run-nogpu" and "PASS" in lines[1] and "finished" in lines[1]
    assert lines[2].split()[0] == "run-gpu" and "FAIL" in lines[2] and "failed" in lines[2]


@pytest.mark.slow
def test_cli_report_exit_2_without_a_store_or_run(recorded: Path, tmp_path: Path) -> None:
    p = _soakd("--state-dir", str(tmp_path / "missing"))
    assert p.returncode == 2 and "no soakd state at" in p.stderr and "--state-dir" in p.stderr
    p = _soakd(cwd=tmp_path)  # default ./soakd-state
    assert p.returncode == 2 and "soakd-state" in p.stderr
    p = _soakd("--state-dir", str(recorded), "--run", "nope")
    assert p.returncode == 2 and "no run 'nope'" in p.stderr and p.stdout == ""
    p = _soakd("--state-dir", str(recorded), "--format", "pdf")
    assert p.returncode == 2 and "invalid choice" in p.stderr


# ---------------------------------------------------------------------------------------------
# the HTML in a real browser


def _png_rows(data: bytes, max_rows: int | None = None) -> tuple[int, int, int, list[bytes]]:
    """Decode an 8-bit RGB/RGBA PNG (stdlib only): (width, height, bytes per pixel, rows)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, [], 0
    height = bpp = 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        ctype = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        if ctype == b"IHDR":
            width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and color in (2, 6) and interlace == 0, (depth, color, interlace)
            bpp = 3 if color == 2 else 4
        elif ctype == b"IDAT":
            idat.append(body)
        pos += 12 + length
    raw = zlib.decompress(b"".join(idat))
    stride = width * bpp
    rows: list[bytes] = []
    prev = bytearray(stride)
    n = height if max_rows is None else min(height, max_rows)
    for y in range(n):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        if f == 1:
            for i in range(bpp, stride):
                line[i] = (line[i] + line[i - bpp]) & 0xFF
        elif f == 2:
            line = bytearray((a + b) & 0xFF for a, b in zip(line, prev, strict=True))
        elif f == 3:
            for i in range(stride):
                left = line[i - bpp] if i >= bpp else 0
                line[i] = (line[i] + ((left + prev[i]) >> 1)) & 0xFF
        elif f == 4:
            for i in range(stride):
                a = line[i - bpp] if i >= bpp else 0
                b = prev[i]
                c = prev[i - bpp] if i >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else b if pb <= pc else c
                line[i] = (line[i] + pred) & 0xFF
        rows.append(bytes(line))
        prev = line
    return width, height, bpp, rows


def _pixels(row: bytes, bpp: int) -> list[tuple[int, int, int]]:
    return [(row[i], row[i + 1], row[i + 2]) for i in range(0, len(row), bpp)]


def screenshot(html: Path, png: Path, profile: Path, size: str = "1280,2400") -> None:
    cmd = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", f"--screenshot={png}", f"--window-size={size}", html.as_uri()]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert png.is_file(), f"chromium wrote no screenshot (rc {p.returncode}): {p.stderr[-2000:]}"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_html_report_screenshot_shows_the_charts(recorded: Path, tmp_path: Path) -> None:
    assert CHROMIUM.exists(), "/usr/bin/chromium is absent: `make test` installs Debian's chromium"
    state = tmp_path / "state"
    shutil.copytree(recorded, state)
    html = write_reports(state, "run-gpu")["html"]
    png = tmp_path / "report.png"
    screenshot(html, png, tmp_path / "profile")
    data = png.read_bytes()
    assert len(data) > 50_000
    keep = os.environ.get("REPORT_SCREENSHOT")  # keep a copy (not SOAKD_*: conftest clears those)
    if keep:
        shutil.copyfile(png, keep)
    width, height, bpp, rows = _png_rows(data, max_rows=1500)
    assert (width, height) == (1280, 2400)
    # not blank: the chart region (below the facts card) has many colours, and the series colours
    colours: set[tuple[int, int, int]] = set()
    counts: dict[tuple[int, int, int], int] = {}
    for y in range(500, 1500, 3):
        for px in _pixels(rows[y], bpp):
            colours.add(px)
            counts[px] = counts.get(px, 0) + 1
    assert len(colours) > 200, len(colours)
    blue, vermillion, green = (0x00, 0x72, 0xB2), (0xD5, 0x5E, 0x00), (0x00, 0x9E, 0x73)
    assert counts.get(blue, 0) > 100 and counts.get(vermillion, 0) > 100 and counts.get(green, 0) > 20, (
        counts.get(blue), counts.get(vermillion), counts.get(green))
    # the FAIL badge near the top is red (#cf222e)
    assert any(_pixels(rows[y], bpp).count((0xCF, 0x22, 0x2E)) > 20 for y in range(60, 120))


# ---------------------------------------------------------------------------------------------
# end to end: a short in-process soak leaves its reports


def _daemon_config(sim_url: str, state: Path, duration: float) -> Any:
    return load_config(None, {
        "target": {"url": sim_url},
        "run": {"duration": duration, "window": 1.0, "warmup": 0.2, "grace": 5.0, "state_dir": str(state)},
        "load": {"concurrency": 4},
        "scenarios": {"long_context": {"max_tokens": 16}, "code_completion": {"max_tokens": 16}},
        "samplers": {"interval": 0.5},
        "metrics": {"host": "127.0.0.1", "port": 0},
        "log": {"progress": False},
    }, environ={})  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_a_soak_writes_its_reports(tmp_path: Path) -> None:
    from helpers import QUICK_SIM, sim_server
    from soakd.runtime import Runtime

    async with sim_server(**QUICK_SIM) as sim:
        cfg = _daemon_config(sim.base_url, tmp_path, 3.0)
        cfg.run.junit = tmp_path / "ci" / "soak.xml"  # what `soakd run --junit ci/soak.xml` sets
        runtime = Runtime(cfg, progress=False)
        final = await asyncio.wait_for(runtime.run(), 60)
    run_dir = tmp_path / final.run_id
    assert {p.name for p in run_dir.iterdir()} == {"report.json", "report.md", "report.html", "junit.xml"}
    rep = json.loads((run_dir / "report.json").read_text())
    assert rep["run"]["id"] == final.run_id and rep["run"]["stop_reason"] == "duration"
    assert final.verdict is not None
    assert rep["verdict"]["result"] == final.verdict.result and not rep["verdict"]["interim"]
    assert len(rep["windows"]) == final.windows >= 2
    assert "**Verdict: " in (run_dir / "report.md").read_text()
    assert "<svg " in (run_dir / "report.html").read_text()
    assert (tmp_path / "ci" / "soak.xml").read_text() == (run_dir / "junit.xml").read_text()
    suite = next(iter(junitparser.JUnitXml.fromfile(str(tmp_path / "ci" / "soak.xml"))))
    verdict = next(c for c in suite if c.classname == "soakd.verdict")
    expected = {"PASS": [], "FAIL": ["Failure"], "INCONCLUSIVE": ["Error"]}[final.verdict.result]
    assert [type(r).__name__ for r in verdict.result] == expected, final.verdict
    assert sum(c.classname == "soakd.windows" for c in suite) == len(rep["table"])


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_sigterm_still_writes_the_reports_and_a_report_failure_is_not_fatal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from helpers import QUICK_SIM, sim_server
    from soakd.runtime import Runtime

    async with sim_server(**QUICK_SIM) as sim:
        runtime = Runtime(_daemon_config(sim.base_url, tmp_path / "a", 60.0), progress=False)
        task = asyncio.create_task(runtime.run())
        await asyncio.sleep(2.0)
        runtime.request_stop("SIGTERM")
        final = await asyncio.wait_for(task, 30)
        run_dir = tmp_path / "a" / final.run_id
        rep = json.loads((run_dir / "report.json").read_text())
        assert final.stop_reason == "SIGTERM" and rep["run"]["status"] == "running"
        assert rep["verdict"]["interim"] is True and rep["run"]["stop_reason"] == "SIGTERM"
        assert "resumable" in rep["run"]["state"] and rep["windows"][-1]["partial"] is True
        assert "interim" in (run_dir / "report.md").read_text().splitlines()[2]

        import soakd.report

        def broken(*a: Any, **k: Any) -> Any:
            raise RuntimeError("renderer exploded")

        monkeypatch.setattr(soakd.report, "write_reports", broken)
        final = await asyncio.wait_for(Runtime(_daemon_config(sim.base_url, tmp_path / "b", 1.5),
                                               progress=False).run(), 30)
    assert final.stop_reason == "duration" and final.verdict is not None
    run_dir = tmp_path / "b" / final.run_id
    assert not (run_dir / "report.json").exists()
    # the record is in the store: `soakd report` renders it later
    with StoreReader(tmp_path / "b") as reader:
        assert build_report(reader, final.run_id).verdict.result == final.verdict.result

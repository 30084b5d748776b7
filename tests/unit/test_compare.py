"""``soakd compare`` on synthetic windows (``helpers.windows``): a step half-way through B is worse
in its segment even where the run's mean dilutes it; calm against calm is not worse; every
tracked metric is compared or says why not; windows that are not judged are listed with why."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from soakd.analysis.ab import AbJudge
from soakd.analysis.changes import segment_difference
from soakd.analysis.levels import Level
from soakd.config import AnalysisConfig
from soakd.core.summary import ClientSummary, Goodput, WindowSummary
from soakd.core.tracked import DEFAULT_METRICS
from soakd.report.compare import compare_reports, compare_windows, format_compare
from helpers.windows import make_window


def run(seed: int, n_windows: int = 12, requests: int = 1000, *, step_at: int | None = None,
        step: float = 0.0) -> list[WindowSummary]:  # fmt: skip
    rng = random.Random(seed)
    return [make_window(i, rng, requests, scale=1.0 + step if step_at is not None and i >= step_at else 1.0)
            for i in range(n_windows)]


def metric_row(doc: dict, metric: str) -> dict:
    return next(m for m in doc["metrics"] if m["metric"] == metric)


def test_a_step_in_the_second_half_is_worse_in_its_segment() -> None:
    # the user's case: the run's mean over 12 windows halves a +30% step of the last 6, and the step
    # widens the interval the mean is judged with; the segment after the change point is confident
    doc = compare_windows(run(1), run(2, step_at=6, step=0.30))
    e2e = next(r for r in doc["run"] if r["metric"] == "e2e_p50")
    assert e2e["tier"] != "confident", e2e  # diluted at run level
    seg = [s for s in doc["segments"] if s["metric"] == "e2e_p50"]
    assert [(s["first_window"], s["last_window"]) for s in seg] == [(0, 5), (6, 11)]
    assert seg[0]["tier"] is None and seg[1]["tier"] == "confident" and seg[1]["direction"] == "worse"
    assert seg[1]["ci"][0] < 0.30 < seg[1]["ci"][1]  # the truth inside its interval
    worse = {x["metric"]: x for x in doc["worse"]}
    assert {"e2e_p50", "e2e_p95", "ttft_p50", "itl_p50"} <= set(worse), doc["worse"]
    assert worse["e2e_p50"] == {**worse["e2e_p50"], "level": "segment", "first_window": 6, "last_window": 11,
                                "windows": [6, 7, 8, 9, 10, 11]}
    assert metric_row(doc, "e2e_p50")["change_points"] == [6]
    text = format_compare(doc)
    assert "  windows 6..11" in text and "confident worse" in text
    tail = text.strip().splitlines()[-1]
    assert tail.startswith("B is confidently worse on e2e_p50 in windows 6..11 (+")
    md = format_compare(doc, markdown=True)
    assert "|   windows 6..11 | 6 |" in md and "**B is confidently worse on e2e_p50 in windows 6..11" in md


def test_calm_against_calm_is_not_worse() -> None:
    for seed in (3, 5, 7):
        doc = compare_windows(run(seed), run(seed + 1))
        assert doc["worse"] == [], doc["worse"]
        assert not [s for s in doc["segments"] if s["tier"] == "confident"]
        assert format_compare(doc).strip().endswith(
            "B is not confidently worse than A on any tracked metric it could be compared on "
            "(energy_per_token: not compared)")


def test_a_difference_over_the_whole_run_is_worse_at_run_level() -> None:
    doc = compare_windows(run(1), run(2, step_at=0, step=0.15))
    levels = {(x["metric"], x["level"]) for x in doc["worse"]}
    assert ("e2e_p50", "run") in levels, doc["worse"]
    x = next(x for x in doc["worse"] if x["metric"] == "e2e_p50" and x["level"] == "run")
    assert x["windows"] == list(range(12)) and x["first_window"] == 0 and x["last_window"] == 11
    assert "e2e_p50 over the run (windows 0..11, +" in format_compare(doc)
    # B faster is better, never worse
    doc = compare_windows(run(1), run(2, step_at=6, step=-0.3))
    assert not [x for x in doc["worse"] if x["metric"].startswith(("e2e", "ttft", "itl"))], doc["worse"]
    assert any(s["direction"] == "better" and s["tier"] == "confident" for s in doc["segments"])


def test_every_tracked_metric_is_compared_or_says_why() -> None:
    # 80 requests a window: enough for p50 (50), too few for a p95 interval (110)
    doc = compare_windows(run(1, requests=80), run(2, requests=80))
    # soakd's own measurements: the server's own means are judged in each run (where soakd lagged), not compared
    assert [m["metric"] for m in doc["metrics"]] == [m for m in DEFAULT_METRICS if not m.startswith("server_")]
    p50, p95 = metric_row(doc, "e2e_p50"), metric_row(doc, "e2e_p95")
    assert p50["compared"] and len(p50["windows"]) == 12
    assert not p95["compared"] and p95["reason"].startswith(
        "too few requests per window for p95 (an interval needs 110; these had "), p95["reason"]
    assert "in windows 0..11" in p95["reason"]
    assert metric_row(doc, "itl_p95")["reason"].startswith("too few streamed requests per window for p95")
    assert metric_row(doc, "energy_per_token")["reason"] == "no data (no GPU energy readings) in windows 0..11"
    text = format_compare(doc)
    assert "e2e_p95" in text and "not compared: too few requests per window for p95" in text
    assert "not compared: too few requests per window for p95" in format_compare(doc, markdown=True)


def test_goodput_and_the_runs_own_metrics_are_compared() -> None:
    def with_goodput(ws: list[WindowSummary], met: float) -> list[WindowSummary]:
        return [w.model_copy(update={"goodput": Goodput(requests=w.requests, met=round(w.requests * met))})
                for w in ws]

    a, b = with_goodput(run(1), 0.99), with_goodput(run(2, step_at=6), 0.90)
    # (e2e_p99 is tracked by default since issue 21: the run's own metric here is itl_p99)
    doc = compare_windows(a, b, also_tracked=["itl_p99"])
    names = [m["metric"] for m in doc["metrics"]]
    assert names[-2:] == ["itl_p99", "goodput_ratio"]
    assert metric_row(doc, "goodput_ratio")["compared"] and metric_row(doc, "itl_p99")["compared"]
    assert any(x["metric"] == "goodput_ratio" and x["level"] == "run" for x in doc["worse"]), doc["worse"]
    # without goodput in both runs it is not added
    assert "goodput_ratio" not in [m["metric"] for m in compare_windows(a, run(2))["metrics"]]


def test_windows_left_out_are_listed_with_why() -> None:
    a = run(1, n_windows=10)
    b = run(2, n_windows=11)
    a[9] = a[9].model_copy(update={"partial": True})
    b[3] = b[3].model_copy(update={"target_down_seconds": 42.0})
    b[5] = b[5].model_copy(update={"client": ClientSummary(impaired=True, impaired_reason="loop stalled 9 s")})
    b[7] = make_window(7, random.Random(9), 30, poisson_n=False)
    doc = compare_windows(a, b)
    left = {x["window"]: x["reason"] for x in doc["left_out"]}
    assert left == {3: "B: target down 42 s", 5: "B: soakd impaired (loop stalled 9 s)",
                    7: "B: too few requests (30 < 50)", 9: "A: partial", 10: "only in B"}
    assert metric_row(doc, "e2e_p50")["windows"] == [0, 1, 2, 4, 6, 8]
    text = format_compare(doc)
    assert "windows left out:\n  window 3: B: target down 42 s\n" in text and "window 10: only in B" in text
    assert "- window 9: A: partial" in format_compare(doc, markdown=True)
    # a window one metric lacks is listed under that metric
    c = run(3)
    c[4] = c[4].model_copy(update={"ttft_seconds": c[4].ttft_seconds.model_copy(update={"p95_ci": None})})
    doc = compare_windows(run(4), c)
    row = metric_row(doc, "ttft_p95")
    assert row["compared"] and 4 not in row["windows"]
    assert row["left_out"] == [{"window": 4, "reason": "B: no p95 interval in the report"}]
    assert "left out of one metric:\n  ttft_p95 in window 4: B: no p95 interval in the report\n" in format_compare(doc)


def test_revised_windows_are_compared(tmp_path: Path) -> None:
    a, b = run(1), run(2, step_at=6, step=0.3)
    b = [w.model_copy(update={"revision": 1}) for w in b]  # a report holds each window's last revision
    doc = compare_windows(a, b)
    assert len(metric_row(doc, "e2e_p50")["windows"]) == 12 and doc["worse"]
    # and through the report files
    for name, ws in (("a", a), ("b", b)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"run": {"id": name, "target": "t", "model": "m"},
                                                           "windows": [w.dump() for w in ws]}))
    doc = compare_reports(tmp_path / "a.json", tmp_path / "b.json")
    assert doc["reference"]["report"].endswith("a.json") and doc["candidate"]["target"] == "t" and doc["worse"]


def test_ab_segments_need_change_points_and_control_the_family() -> None:
    cfg = AnalysisConfig()
    judge = AbJudge(cfg, "A", ["B"], planned_windows=12)
    for w in run(1):
        judge.add("A", w)
    for w in run(2):
        judge.add("B", w)
    segs, points = judge.segment_results()
    # calm: no change point, no segment (the run's row is the judgement)
    assert all(p == [] for p in points.values()) and segs == []
    # segment_difference against a fixed reference: the mean, and a t interval from the noise floor
    part = [Level(i, 0.1, 0.0004, 1.1, 1000) for i in range(6)]
    d, half = segment_difference(part, 0.0, 0.0, 0, 0.0, 0, 0.975)
    assert d == pytest.approx(0.1) and half == pytest.approx(1.959964 * math.sqrt(0.0004 / 6), rel=1e-5)
    d2, half2 = segment_difference(part, 0.0, 0.0, 0, 0.0004, 10, 0.975)
    assert d2 == pytest.approx(0.1) and half2 > half * math.sqrt(2)  # the floor, and t at few df

"""``soakd compare A/report.json B/report.json``: two runs' reports compared as an A/B run is,
offline (``soakd.analysis.ab``): window *k* of B against window *k* of A (the same time into
each run), per tracked metric, and over every window both had eligible. A is the reference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from soakd.analysis.ab import AbJudge
from soakd.config import AnalysisConfig
from soakd.core.summary import WindowSummary


class CompareError(Exception):
    """A report that cannot be compared (not a soakd JSON report, no windows)."""


def _load(path: Path) -> tuple[str, list[WindowSummary], dict[str, Any]]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CompareError(f"cannot read a soakd JSON report from {path}: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("windows"), list) or "run" not in doc:
        raise CompareError(f"{path} is not a soakd JSON report (soakd report --format json, or a run's report.json)")
    try:
        windows = [WindowSummary.load(w) for w in doc["windows"]]
    except ValueError as exc:
        raise CompareError(f"{path}: a window does not read as a window summary: {exc}") from None
    if not windows:
        raise CompareError(f"{path} holds no window to compare")
    return str(doc["run"].get("id") or path.parent.name), windows, doc


def compare_reports(a: Path, b: Path, config: AnalysisConfig | None = None) -> dict[str, Any]:
    """The comparison of B (candidate) against A (reference) as a JSON-able document."""
    cfg = config or AnalysisConfig()
    a_id, a_windows, a_doc = _load(a)
    b_id, b_windows, b_doc = _load(b)
    ref, cand = f"A:{a_id}", f"B:{b_id}"
    judge = AbJudge(cfg, ref, [cand], planned_windows=max(len(a_windows), len(b_windows)))
    per_window = []
    for w in a_windows:
        judge.add(ref, w)
    for w in b_windows:
        per_window += judge.add(cand, w)
    run = judge.run_results()
    return {
        "reference": {"run": a_id, "report": str(a), "target": a_doc["run"].get("target"),
                      "model": a_doc["run"].get("model"), "windows": len(a_windows)},
        "candidate": {"run": b_id, "report": str(b), "target": b_doc["run"].get("target"),
                      "model": b_doc["run"].get("model"), "windows": len(b_windows)},
        "run": [r.to_dict() for r in run],
        "windows": [r.to_dict() for r in per_window if r.tier is not None],
        "worse": [r.metric for r in run if r.tier == "confident" and r.direction == "worse"],
    }


def _pct(metric_absolute: bool, x: float) -> str:
    return f"{x * 100:+.1f}{'pp' if metric_absolute else '%'}"


def format_compare(doc: dict[str, Any], markdown: bool = False) -> str:
    from soakd.core.tracked import METRICS

    head = ["metric", "A", "B", "B vs A", "interval", "windows", "verdict"]
    rows = []
    for r in doc["run"]:
        ab = METRICS[r["metric"]].absolute
        verdict = f"{r['tier']} {r['direction']}" if r["tier"] else "no difference"
        rows.append([r["metric"], f"{r['reference_value']:.4g}", f"{r['value']:.4g}", _pct(ab, r["ratio"]),
                     f"{_pct(ab, r['ci'][0])}..{_pct(ab, r['ci'][1])}", str(r["windows"]), verdict])
    a, b = doc["reference"], doc["candidate"]
    title = (f"soakd compare: B {b['run']} ({b['target']}, {b['model']}) against A {a['run']} "
             f"({a['target']}, {a['model']})")
    tail = (f"B is confidently worse on {', '.join(doc['worse'])}" if doc["worse"]
            else "B is not confidently worse than A on any tracked metric")
    if markdown:
        lines = [f"# {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join([*lines, "", f"**{tail}.**", ""])
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *rows]]
    return title + "\n" + "\n".join(lines) + f"\n{tail}\n"

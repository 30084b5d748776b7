"""The HTML report: one self-contained file (inline CSS and SVG, no script, no external asset): the
Markdown report's content plus the charts, from the Jinja template ``templates/report.html.j2``
(autoescaped; the SVG charts, which ``soakd.report.svg`` escapes itself, are the only markup let
through)."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import jinja2

from soakd.report.format import (
    AB_HEAD,
    LEAK_HEAD,
    QUIESCE_HEAD,
    STABILITY_HEAD,
    ab_rows,
    charts,
    facts,
    fmt_duration,
    fmt_num,
    fmt_pct,
    leak_rows,
    quiesce_rows,
    sections,
    stability_rows,
    table_columns,
    verdict_lines,
)
from soakd.report.model import RunReport
from soakd.report.series import WINDOW_METRICS
from soakd.report.svg import empty_chart

__all__ = ["render_html"]


@cache
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.PackageLoader("soakd.report", "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["tojson_pretty"] = lambda v: json.dumps(v, indent=2, ensure_ascii=False, default=str)
    return env


def _row_class(notes: list[str], partial: bool) -> str:
    c = "partial" if partial else ""
    if "baseline" in notes:
        return "base"
    if [n for n in notes if n not in ("partial", "baseline")]:
        return (c + " flag").strip()
    return c


def render_html(report: RunReport | dict[str, Any]) -> str:
    report = RunReport.load(report)
    v = report.verdict
    ch = charts(report)
    cols = table_columns(report.table)
    drops = [{"metric": WINDOW_METRICS.get(m, m), "windows": d.get("dip_windows"),
              "period": fmt_num(d.get("period_windows"), "g"), "seconds": fmt_duration(d.get("period_seconds")),
              "depth": fmt_pct(d.get("depth")), "hint": d.get("hint") or ""}
             for m, d in (v.recurring_drops or {}).items()]
    context = {
        "report": report, "run": report.run, "v": v,
        "verdict_lines": verdict_lines(report),
        "facts": facts(report),
        "window_charts": [c for c in ch if c["group"] == "windows"],
        "telemetry_charts": [c for c in ch if c["group"] == "telemetry"],
        "telemetry_notes": report.series.telemetry.notes,
        "no_charts": empty_chart("No windows", "no window was closed") if not ch else "",
        "ab_head": AB_HEAD, "ab_rows": ab_rows(report),
        "ab_reference": v.ab[0].reference if v.ab else "",
        "table_head": [c[0] for c in cols],
        "table_rows": [[f(r) for _, f in cols] for r in report.table],
        "row_classes": [_row_class(r.notes, r.partial) for r in report.table],
        "any_partial": any(r.partial for r in report.table),
        "stability_head": STABILITY_HEAD, "stability": stability_rows(report),
        "drops": drops,
        "leak_head": LEAK_HEAD, "leaks": leak_rows(report),
        "sections": sections(report),
        "troubleshooting": [[f"{r.diagnosis} ({r.severity}, {r.count}x{', fails the run' if r.fails else ''})", r.seen,
                             r.check, ", ".join(str(w) for w in r.windows) or "-"] for r in report.troubleshooting],
        "quiesce_head": QUIESCE_HEAD, "quiesce": quiesce_rows(report),
        "segments": report.findings.get("segment", []),
        "other": report.other_events(),
    }
    return _environment().get_template("report.html.j2").render(**context)

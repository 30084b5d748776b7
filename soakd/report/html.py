"""The HTML report: one self-contained file (inline CSS and SVG, no script, no external asset): the
Markdown report's content plus the charts."""

from __future__ import annotations

import json
from collections.abc import Sequence
from html import escape
from typing import Any

from soakd.report.format import (
    AB_HEAD,
    ISSUE_KINDS,
    QUIESCE_HEAD,
    STABILITY_HEAD,
    ab_rows,
    charts,
    fmt_duration,
    fmt_num,
    fmt_pct,
    quiesce_rows,
    stability_rows,
    table_columns,
)
from soakd.report.markdown import facts
from soakd.report.series import WINDOW_METRICS
from soakd.report.svg import empty_chart

# ---------------------------------------------------------------------------------------------
# HTML

_CSS = """
*{box-sizing:border-box}
body{margin:0;padding:20px 24px;font:14px/1.45 system-ui,-apple-system,'Segoe UI',Roboto,'DejaVu Sans',sans-serif;
color:#1d1d1f;background:#f4f5f7}
h1{font-size:22px;margin:0 0 8px}
h2{font-size:18px;margin:28px 0 10px;border-bottom:1px solid #ddd;padding-bottom:4px}
h3{font-size:15px;margin:18px 0 6px}
.card{background:#fff;border:1px solid #e1e3e6;border-radius:8px;padding:14px 16px;margin:12px 0}
.verdict{display:flex;gap:16px;align-items:flex-start}
.badge{font-weight:700;font-size:20px;padding:6px 16px;border-radius:6px;color:#fff;white-space:nowrap}
.PASS{background:#1a7f37}.FAIL{background:#cf222e}.INCOMPLETE{background:#6e7781}.INCONCLUSIVE{background:#9a6700}
.interim{font-size:12px;color:#57606a;margin-top:4px}
.facts{display:grid;grid-template-columns:max-content 1fr;gap:2px 14px;margin:0}
.facts dt{font-weight:600;color:#57606a}.facts dd{margin:0;word-break:break-word}
.charts{display:grid;grid-template-columns:repeat(2,minmax(0,1fr));gap:12px}
.charts .wide{grid-column:1/-1}
.charts figure{margin:0;background:#fff;border:1px solid #e1e3e6;border-radius:8px;padding:6px}
.charts svg{width:100%;height:auto;display:block}
table{border-collapse:collapse;background:#fff;font-size:12.5px;width:100%}
th,td{border:1px solid #e1e3e6;padding:3px 6px;text-align:right;white-space:nowrap}
th{background:#f0f2f4;white-space:normal;vertical-align:bottom}
td.l,th.l{text-align:left;white-space:normal}
tr.partial td{color:#57606a;font-style:italic}
tr.flag td{background:#fff1f0}
tr.base td{background:#eef6ff}
.tablewrap{overflow-x:auto}
.sev-critical{color:#cf222e;font-weight:600}.sev-warning{color:#9a6700;font-weight:600}.sev-info{color:#57606a}
ul.findings{padding-left:18px;margin:4px 0}ul.findings li{margin:3px 0}
.note{background:#fff8c5;border:1px solid #e3d58b;border-radius:6px;padding:8px 12px;margin:8px 0}
details pre{background:#f6f8fa;padding:8px;overflow-x:auto;font-size:12px;white-space:pre-wrap}
footer{color:#6e7781;font-size:12px;margin-top:24px}
"""


def _h(s: Any) -> str:
    return escape(str(s), quote=True)


def _html_table(head: Sequence[str], rows: Sequence[Sequence[Any]], left: Sequence[int] = (0,),
                row_classes: Sequence[str] | None = None) -> str:
    out = ['<div class="tablewrap"><table><thead><tr>']
    out += [f'<th{" class=l" if i in left else ""}>{_h(c)}</th>' for i, c in enumerate(head)]
    out.append("</tr></thead><tbody>")
    for j, r in enumerate(rows):
        cls = f' class="{row_classes[j]}"' if row_classes and row_classes[j] else ""
        out.append(f"<tr{cls}>" + "".join(f'<td{" class=l" if i in left else ""}>{_h(c)}</td>'
                                          for i, c in enumerate(r)) + "</tr>")
    out.append("</tbody></table></div>")
    return "".join(out)


def render_html(report: dict[str, Any]) -> str:
    run, v = report["run"], report["verdict"]
    res = v["result"]
    P: list[str] = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>soakd report {_h(run['id'])} — {_h(res)}</title>", f"<style>{_CSS}</style></head><body>",
        f"<h1>soakd report — run {_h(run['id'])}</h1>",
        '<div class="card verdict">',
        f'<div><div class="badge {_h(res)}" id="verdict">{_h(res)}</div>'
        + ('<div class="interim">interim: run resumable</div>' if v.get("interim") and res != "INCOMPLETE" else "")
        + "</div><div>",
    ]  # fmt: skip
    if v["reasons"]:
        P.append("<ul class=findings>" + "".join(f"<li>{_h(r)}</li>" for r in v["reasons"]) + "</ul>")
    elif v.get("inconclusive"):
        P.append(f"<p>{_h(v['inconclusive'])}</p>")
    elif res == "PASS":
        P.append("<p>No finding failed the run: no drift beyond the thresholds with confidence; no leak, "
                 "throttle, canary or error-budget failure.</p>")
    P.append("</div></div>")
    P.append('<div class="card"><dl class="facts">' + "".join(f"<dt>{_h(k)}</dt><dd>{_h(val)}</dd>"
                                                              for k, val in facts(report)) + "</dl></div>")

    # charts
    ch = charts(report)
    P.append("<h2>Charts</h2>")
    if any(c["group"] == "windows" for c in ch):
        P.append('<div class="charts">')
        for c in ch:
            if c["group"] == "windows":
                wide = " class=wide" if c["id"] == "chart-drift" else ""
                P.append(f'<figure{wide} id="fig-{_h(c["id"])}">{c["svg"]}</figure>')
        P.append("</div>")
    for note in report["series"]["telemetry"].get("notes") or []:
        P.append(f'<p class="note">{_h(note)}</p>')
    tele = [c for c in ch if c["group"] == "telemetry"]
    if tele:
        P.append("<h3>Device and server over time</h3><div class=\"charts\">")
        P += [f'<figure id="fig-{_h(c["id"])}">{c["svg"]}</figure>' for c in tele]
        P.append("</div>")
    if not ch:
        P.append(empty_chart("No windows", "no window was closed"))

    # per-window table
    ab = ab_rows(report)
    if ab:
        P.append("<h2>A/B</h2>")
        P.append("<p>Each candidate against the reference <b>" + _h(report["verdict"]["ab"][0]["reference"])
                 + "</b> over every window both had eligible (paired differences, Student-t interval).</p>")
        P.append("<table><tr>" + "".join(f"<th>{_h(c)}</th>" for c in AB_HEAD) + "</tr>"
                 + "".join("<tr>" + "".join(f"<td>{_h(c)}</td>" for c in r) + "</tr>" for r in ab) + "</table>")
    P.append("<h2>Windows</h2>")
    cols = table_columns(report["table"])
    if report["table"]:
        classes = []
        for r in report["table"]:
            c = "partial" if r["partial"] else ""
            if "baseline" in r["notes"]:
                c = "base"
            elif [n for n in r["notes"] if n not in ("partial", "baseline")]:
                c = (c + " flag").strip()
            classes.append(c)
        P.append(_html_table([c[0] for c in cols], [[f(r) for _, f in cols] for r in report["table"]],
                             left=(15,), row_classes=classes))
        if any(r["partial"] for r in report["table"]):
            P.append("<p>* partial window: cut short by the end of the run; reported, not judged.</p>")
    else:
        P.append("<p>No window was closed (the run ended during warm-up, or never reached the target).</p>")

    stab = stability_rows(report)
    if stab:
        P.append("<h2>Stability</h2><p>Spread <code>(max − min) / median</code> over the full windows with enough "
                 "samples, against the method's limit (error rate: absolute, in percentage points). "
                 "“not significant”: the windows' confidence intervals overlap within the limit.</p>")
        P.append(_html_table(STABILITY_HEAD, stab, left=(0, 8)))
    drops = v.get("recurring_drops") or {}
    if drops:
        P.append("<h3>Recurring drops</h3><ul class=findings>")
        for metric, d in drops.items():
            P.append(f"<li><b>{_h(WINDOW_METRICS.get(metric, metric))}</b>: dips in windows {_h(d.get('dip_windows'))} "
                     f"every {_h(fmt_num(d.get('period_windows'), 'g'))} windows (~{_h(fmt_duration(d.get('period_seconds')))}), "
                     f"depth {_h(fmt_pct(d.get('depth')))}: {_h(d.get('hint') or '')}</li>")
        P.append("</ul>")

    # findings
    P.append("<h2>Findings</h2>")
    issues = [(k, report["findings"].get(k, [])) for k in ISSUE_KINDS]
    if not any(items for _, items in issues):
        P.append("<p>No drift, leak, throttle, canary, error or target finding.</p>")
    for kind, items in issues:
        if not items:
            continue
        P.append(f'<h3 id="findings-{_h(kind)}">{_h(kind)} ({len(items)})</h3><ul class=findings>')
        for ev in items:
            where = f"window {ev['window']}" if ev["window"] is not None else "run"
            evidence = ev.get("evidence")
            det = (f"<details><summary>evidence</summary><pre>{_h(json.dumps(evidence, indent=1, ensure_ascii=False))}"
                   "</pre></details>") if evidence else ""
            P.append(f'<li><span class="sev-{_h(ev["severity"])}">{_h(ev["severity"])}</span> · {_h(where)} · '
                     f"{_h(ev['at'])} — {_h(ev['message'])}{det}</li>")
        P.append("</ul>")
    ts = report["troubleshooting"]
    if ts:
        P.append("<h3>What to check</h3>")
        P.append(_html_table(["diagnosis", "seen", "what to check", "windows"],
                             [[f"{r['diagnosis']} ({r['severity']}, {r['count']}x)", r["seen"], r["check"],
                               ", ".join(str(w) for w in r["windows"]) or "-"] for r in ts], left=(0, 1, 2, 3)))
    q = quiesce_rows(report)
    if q:
        P.append("<h2>Quiesce probes</h2><p>Load paused, server drained: KV-cache usage and device memory at idle.</p>")
        P.append(_html_table(QUIESCE_HEAD, q))
    other = [(k, items) for k, items in report["findings"].items() if k not in ISSUE_KINDS and k != "quiesce"]
    if other:
        P.append("<h2>Other events</h2><ul class=findings>")
        for k, items in other:
            P += [f"<li>{_h(ev['at'])} · {_h(k)} — {_h(ev['message'])}</li>" for ev in items]
        P.append("</ul>")
    P.append("<h2>Configuration</h2><details><summary>effective configuration (secrets redacted)</summary><pre>"
             + _h(json.dumps(run["config"], indent=2, ensure_ascii=False)) + "</pre></details>")
    P.append(f"<footer>Generated by {_h(report['generated_by'])} at {_h(report['generated_at'])}. The JSON report "
             "of this run (report.json) is what <code>soakd run --baseline</code> reads.</footer>")
    P.append("</body></html>")
    return "\n".join(P) + "\n"

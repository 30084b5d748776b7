"""The Markdown report: readable in a terminal and on GitHub: the verdict first, run facts, the
per-window table, stability, findings with their diagnosis and what to check."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from soakd.report.format import (
    AB_HEAD,
    ISSUE_KINDS,
    QUIESCE_HEAD,
    STABILITY_HEAD,
    ab_rows,
    fmt_duration,
    fmt_num,
    fmt_pct,
    load_text,
    quiesce_rows,
    stability_rows,
    table_columns,
)
from soakd.report.series import WINDOW_METRICS

# ---------------------------------------------------------------------------------------------
# Markdown


def _md_cell(s: Any) -> str:
    return str(s).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ").replace("\r", " ")


def _md_table(head: Sequence[str], rows: Sequence[Sequence[Any]], align: Sequence[str] | None = None) -> list[str]:
    align = align or ["---"] * len(head)
    lines = ["| " + " | ".join(_md_cell(h) for h in head) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(_md_cell(c) for c in r) + " |" for r in rows]
    return lines


def _verdict_line(report: dict[str, Any]) -> str:
    v = report["verdict"]
    res = v["result"]
    tail = " (interim: the run is resumable and has not ended)" if v.get("interim") and res != "INCOMPLETE" else ""
    if res == "INCONCLUSIVE" and v.get("inconclusive"):
        tail += f" — {v['inconclusive']}"
    return f"{res}{tail}"


def facts(report: dict[str, Any]) -> list[tuple[str, str]]:
    run = report["run"]
    bi = report["baseline_info"]
    if bi["source"] == "external":
        base = f"external: window {bi['external_window']} of {bi['external_path']}"
    elif bi["window"] is not None:
        base = f"window {bi['window']} of this run"
    else:
        base = "none"
    if bi.get("note"):
        base += f" ({bi['note']})"
    gaps = run["gaps"]
    seg = f"{len(run['segments'])}" + (
        "; gaps not observed: " + ", ".join(f"{g['from']} → {g['to']} ({fmt_duration(g['seconds'])})" for g in gaps)
        if gaps else "")
    return [
        ("Run", run["id"]),
        ("Target", str(run["target"] or "-")),
        ("Model", str(run["model"] or "-")),
        ("Server", str(run["server_kind"] or "unknown")),
        ("soakd", str(run["soakd_version"])),
        ("Started", str(run["started_at"] or "-")),
        ("Ended", f"{run['ended_at'] or '-'} ({run['stop_reason'] or 'no stop reason'})"),
        ("Status", str(run["state"])),
        ("Length", f"{fmt_duration(run['wall_seconds'])} wall clock, {fmt_duration(run['observed_seconds'])} observed; planned "
                   f"{run['planned_duration'] or '-'}, windows of {run['window'] or '-'}, "
                   f"warm-up {run['warmup'] or '-'}"),
        ("Load", load_text(run["load"])),
        ("Segments", seg),
        ("Baseline", base),
        ("Windows", f"{len(report['table'])}" + (" (* partial: cut short by the end of the run, reported, not judged)"
                                                 if any(r["partial"] for r in report["table"]) else "")),
    ]  # fmt: skip


def render_markdown(report: dict[str, Any]) -> str:
    run, v = report["run"], report["verdict"]
    L: list[str] = [f"# soakd report — run {run['id']}", ""]
    L.append(f"**Verdict: {_verdict_line(report)}**")
    L.append("")
    if v["reasons"]:
        L += [f"- {r}" for r in v["reasons"]]
    elif v["result"] == "PASS":
        L.append("- no finding failed the run: no drift beyond the thresholds with confidence, no leak, "
                 "throttle, canary or error-budget failure")
    L.append("")
    L += _md_table(["", ""], [[f"**{k}**", val] for k, val in facts(report)])
    L.append("")

    ab = ab_rows(report)
    if ab:
        ref = report["verdict"]["ab"][0]["reference"]
        L += ["## A/B", "", f"Each candidate against the reference **{ref}** over every window both had eligible "
              "(paired differences, Student-t interval; soakd.analysis.ab).", ""]
        L += _md_table(AB_HEAD, ab)
        targets = report["verdict"].get("targets") or {}
        if targets:
            L += [""] + [f"- **{name}** against its own baseline: {t['result']}"
                         + (f" ({'; '.join(t['reasons'])})" if t["reasons"] else "") for name, t in targets.items()]
        L.append("")

    L += ["## Windows", ""]
    cols = table_columns(report["table"])
    if report["table"]:
        L += _md_table([c[0] for c in cols], [[f(r) for _, f in cols] for r in report["table"]],
                       ["--:"] * (len(cols) - 1) + ["---"])
        if any(r["partial"] for r in report["table"]):
            L += ["", "\\* partial window"]
    else:
        L.append("No window was closed (the run ended during warm-up, or never reached the target).")
    L.append("")
    for note in report["series"]["telemetry"].get("notes") or []:
        L += [f"> {note}", ""]

    stab = stability_rows(report)
    if stab:
        L += ["## Stability", "",
              "Spread `(max - min) / median` over the full windows with enough samples, against the method's limit "
              "(error rate: absolute, in percentage points). \"not significant\": the windows' confidence intervals "
              "overlap within the limit, so the spread may be sampling noise.", ""]
        L += _md_table(STABILITY_HEAD, stab, ["---"] + ["--:"] * 7 + ["---"])
        L.append("")
    drops = v.get("recurring_drops") or {}
    if drops:
        L += ["### Recurring drops", ""]
        for metric, d in drops.items():
            L.append(f"- **{WINDOW_METRICS.get(metric, metric)}**: dips in windows {d.get('dip_windows')} every "
                     f"{fmt_num(d.get('period_windows'), 'g')} windows (~{fmt_duration(d.get('period_seconds'))}), depth "
                     f"{fmt_pct(d.get('depth'))}: {d.get('hint') or ''}")
        L.append("")

    L += ["## Findings", ""]
    issues = [(k, report["findings"].get(k, [])) for k in ISSUE_KINDS]
    if not any(items for _, items in issues):
        L += ["No drift, leak, throttle, canary, error or target finding.", ""]
    for kind, items in issues:
        if not items:
            continue
        L += [f"### {kind} ({len(items)})", ""]
        for ev in items:
            where = f"window {ev['window']}" if ev["window"] is not None else "run"
            L.append(f"- **{ev['severity']}** · {where} · {ev['at']} — {ev['message']}")
        L.append("")
    ts = report["troubleshooting"]
    if ts:
        L += ["### What to check", ""]
        L += _md_table(["diagnosis", "seen", "what to check", "windows"],
                       [[f"**{r['diagnosis']}** ({r['severity']}, {r['count']}x)", r["seen"], r["check"],
                         ", ".join(str(w) for w in r["windows"]) or "-"] for r in ts])
        L.append("")
    canary = report["findings"].get("canary", [])
    ref = [e for e in canary if e["kind"] == "canary_reference"]
    if ref:
        L += [f"Canary reference output recorded at {ref[0]['at']}: {ref[0]['message']}.", ""]
    q = quiesce_rows(report)
    if q:
        L += ["## Quiesce probes", "", "Load paused, server drained: KV-cache usage and device memory at idle.", ""]
        L += _md_table(QUIESCE_HEAD, q)
        L.append("")
    seg = report["findings"].get("segment", [])
    if seg:
        L += ["## Segments", ""] + [f"- {e['at']}: {e['message']}" for e in seg] + [""]
    L += ["## Configuration", "", "<details><summary>effective configuration (secrets redacted)</summary>", "",
          "```json", json.dumps(run["config"], indent=2, ensure_ascii=False), "```", "", "</details>", ""]
    L.append(f"_Generated by {report['generated_by']} at {report['generated_at']}; the JSON report of this run is "
             "what `soakd run --baseline` reads._")
    return "\n".join(L) + "\n"

"""The Markdown report: readable in a terminal and on GitHub. The verdict first with what it rests
on, run facts, the per-window table, stability and memory, every finding by section (through the
finding registry: title, span, evidence, runbook, whether it fails the run), what to check."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from soakd.report.format import (
    AB_HEAD,
    LEAK_HEAD,
    QUIESCE_HEAD,
    STABILITY_HEAD,
    ab_rows,
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
    verdict_title,
)
from soakd.report.model import RunReport
from soakd.report.series import WINDOW_METRICS


def _md_cell(s: Any) -> str:
    return str(s).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ").replace("\r", " ")


def _md_inline(s: Any) -> str:
    return str(s).replace("\n", " ").replace("\r", " ")


def _md_table(head: Sequence[str], rows: Sequence[Sequence[Any]], align: Sequence[str] | None = None) -> list[str]:
    align = align or ["---"] * len(head)
    lines = ["| " + " | ".join(_md_cell(h) for h in head) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(_md_cell(c) for c in r) + " |" for r in rows]
    return lines


def render_markdown(report: RunReport) -> str:
    report = RunReport.load(report)
    run, v = report.run, report.verdict
    L: list[str] = [f"# soakd report — run {run.id}", ""]
    L.append(f"**Verdict: {verdict_title(report)}**")
    L.append("")
    L += [f"- {_md_inline(line)}" for line in verdict_lines(report)]
    L.append("")
    L += _md_table(["", ""], [[f"**{k}**", val] for k, val in facts(report)])
    L.append("")

    ab = ab_rows(report)
    if ab and v.ab:
        ref = v.ab[0].reference
        L += ["## A/B", "", f"Each candidate against the reference **{ref}** over every window both had eligible "
              "(paired differences, Student-t interval; soakd.analysis.ab).", ""]
        L += _md_table(AB_HEAD, ab)
        if v.targets:
            L += [""] + [f"- **{name}** against its own baseline: {t.result}"
                         + (f" ({'; '.join(t.reasons)})" if t.reasons else "") for name, t in v.targets.items()]
        L.append("")

    L += ["## Windows", ""]
    cols = table_columns(report.table)
    if report.table:
        L += _md_table([c[0] for c in cols], [[f(r) for _, f in cols] for r in report.table],
                       ["--:"] * (len(cols) - 1) + ["---"])
        if any(r.partial for r in report.table):
            L += ["", "\\* partial window"]
    else:
        L.append("No window was closed (the run ended during warm-up, or never reached the target).")
    L.append("")
    for note in report.series.telemetry.notes:
        L += [f"> {note}", ""]

    stab = stability_rows(report)
    if stab:
        L += ["## Stability", "",
              "Spread `(max - min) / median` over the full windows with enough samples, against the method's limit "
              "(error rate: absolute, in percentage points). \"not significant\": the windows' confidence intervals "
              "overlap within the limit, so the spread may be sampling noise.", ""]
        L += _md_table(STABILITY_HEAD, stab, ["---"] + ["--:"] * 7 + ["---"])
        L.append("")
    drops = v.recurring_drops or {}
    if drops:
        L += ["### Recurring drops", ""]
        for metric, d in drops.items():
            L.append(f"- **{WINDOW_METRICS.get(metric, metric)}**: dips in windows {d.get('dip_windows')} every "
                     f"{fmt_num(d.get('period_windows'), 'g')} windows (~{fmt_duration(d.get('period_seconds'))}), depth "
                     f"{fmt_pct(d.get('depth'))}: {d.get('hint') or ''}")
        L.append("")
    leaks = leak_rows(report)
    if leaks:
        L += ["## Memory", "", "The run's last leak judgement of each memory source (soakd.analysis.leak).", ""]
        L += _md_table(LEAK_HEAD, leaks)
        L.append("")

    L += ["## Findings", ""]
    secs = sections(report)
    if not secs:
        L += ["No finding: no drift, leak, throttle, canary, error, freeze, GPU or target finding.", ""]
    for _sid, title, items in secs:
        L += [f"### {title} ({len(items)})", ""]
        for fv in items:
            f = fv.finding
            tag = " · **fails the run**" if fv.fails else ""
            L.append(f"- **{f.severity}**{tag} · {fv.where} · {fv.at} — **{f.label}**: {_md_inline(f.message)}")
            if fv.evidence:
                L.append(f"  - evidence: {_md_inline(fv.evidence_text)}")
            L.append(f"  - runbook: [{f.spec.runbook}]({f.runbook})"
                     + (f"; {_md_inline(fv.event.why)}" if fv.event.why and not fv.fails else ""))
        L.append("")
    ts = report.troubleshooting
    if ts:
        L += ["### What to check", ""]
        L += _md_table(["diagnosis", "seen", "what to check", "windows"],
                       [[f"**{r.diagnosis}** ({r.severity}, {r.count}x{', fails the run' if r.fails else ''})", r.seen,
                         r.check, ", ".join(str(w) for w in r.windows) or "-"] for r in ts])
        L.append("")
    ref = [e for e in report.findings.get("canary", []) if e.kind == "canary_reference"]
    if ref:
        L += [f"Canary reference output recorded at {ref[0].at}: {ref[0].message}.", ""]
    q = quiesce_rows(report)
    if q:
        L += ["## Quiesce probes", "", "Load paused, server drained: KV-cache usage and device memory at idle.", ""]
        L += _md_table(QUIESCE_HEAD, q)
        L.append("")
    seg = report.findings.get("segment", [])
    if seg:
        L += ["## Segments", ""] + [f"- {e.at}: {e.message}" for e in seg] + [""]
    other = [e for e in report.other_events() if e.kind != "canary_reference"]
    if other:
        L += ["## Other events", ""] + [f"- {e.at} · {e.where()} · {e.kind} — {_md_inline(e.message)}"
                                        for e in other] + [""]
    L += ["## Configuration", "", "<details><summary>effective configuration (secrets redacted)</summary>", "",
          "```json", json.dumps(run.config, indent=2, ensure_ascii=False), "```", "", "</details>", ""]
    L.append(f"_Generated by {report.generated_by} at {report.generated_at}; the JSON report of this run is "
             "what `soakd run --baseline` reads._")
    return "\n".join(L) + "\n"

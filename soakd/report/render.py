"""Render a report dict (``soakd.report.build.build_report``) as JSON, Markdown or HTML, and write
all three into a run's directory.

- JSON: the dict itself (``--baseline`` of a later run reads it).
- Markdown: readable in a terminal and on GitHub: the verdict first, run facts, the per-window
  table, stability, findings with their diagnosis and what to check.
- HTML: one self-contained file (inline CSS and SVG, no script, no external asset): the same
  content plus the charts.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Sequence
from html import escape
from pathlib import Path
from typing import Any

from soakd.report.build import WINDOW_METRICS, build_report
from soakd.report.svg import PALETTE, Band, Series, Span, empty_chart, line_chart
from soakd.store import StoreReader

__all__ = ["FORMATS", "REPORT_FILES", "charts", "render", "render_html", "render_json", "render_markdown",
           "write_reports"]

FORMATS = ("json", "md", "html")
REPORT_FILES = {"json": "report.json", "md": "report.md", "html": "report.html"}
FINDING_COLOR = "#E15759"
GAP_COLOR = "#888888"


# ---------------------------------------------------------------------------------------------
# formatting


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    ms = v * 1000
    return f"{ms:.2f}" if ms < 10 else f"{ms:.1f}" if ms < 100 else f"{ms:.0f}"


def _n(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _pct(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else f"{format(v * 100, spec)}%"


def _signed_pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:+.1f}%"


def _dur(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(round(seconds))
    if s < 60:
        return f"{seconds:.0f}s" if seconds >= 1 else f"{seconds:.2f}s"
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s"


def _errors(row: dict[str, Any]) -> str:
    if not row["errors"]:
        return "0"
    return f"{row['errors']} ({_pct(row['error_rate'], '.2f')})"


def _load_text(load: dict[str, Any]) -> str:
    mix = load.get("mix") or {}
    mix_s = ", ".join(f"{k}={v:g}" if isinstance(v, int | float) else f"{k}={v}" for k, v in mix.items()) or "-"
    if load.get("concurrency") is not None:
        head = f"closed loop, concurrency {load['concurrency']}"
    elif load.get("rate") is None:
        return "-"
    else:
        head = f"open loop, {load.get('rate')} req/s ({load.get('arrival') or 'poisson'})"
    return f"{head}; mix {mix_s}"


def _table_columns() -> list[tuple[str, Callable[[dict[str, Any]], str]]]:
    return [
        ("window", lambda r: f"{r['window']}{'*' if r['partial'] else ''}"),
        ("start (UTC)", lambda r: (r["start"] or "-")[5:16].replace("T", " ")),
        ("requests", lambda r: str(r["requests"])),
        ("req/s", lambda r: _n(r["requests_per_second"], ".2f")),
        ("tok/s", lambda r: _n(r["output_tokens_per_second"], ".0f")),
        ("e2e p50 / p95 ms", lambda r: f"{_ms(r['e2e_p50'])} / {_ms(r['e2e_p95'])}"),
        ("TTFT p50 / p95 ms", lambda r: f"{_ms(r['ttft_p50'])} / {_ms(r['ttft_p95'])}"),
        ("ITL p50 / p95 ms", lambda r: f"{_ms(r['itl_p50'])} / {_ms(r['itl_p95'])}"),
        ("errors", _errors),
        ("power W", lambda r: _n(r["power_watts"], ".0f")),
        ("temp °C", lambda r: _n(r["temperature_celsius"], ".0f")),
        ("SM MHz", lambda r: _n(r["sm_clock_mhz"], ".0f")),
        ("memory GiB", lambda r: _n(r["memory_gib"], ".2f")),
        ("KV %", lambda r: _pct(r["kv_cache_usage_ratio"])),
        ("J/token", lambda r: _n(r["joules_per_token"], ".3f")),
        ("notes", lambda r: ", ".join(r["notes"])),
    ]


def _stability_rows(report: dict[str, Any]) -> list[list[str]]:
    stab = report["verdict"].get("stability") or {}
    base = report["series"]["windows"]["baseline"]
    rows = []
    for metric, st in stab.items():
        absolute = bool(st.get("absolute"))
        scale = _metric_formatter(metric)
        stable = st.get("stable")
        verdict = "yes" if stable else "no" if stable is False else "n/a"
        if stable is False and st.get("significant") is False:
            verdict = "no (not significant)"
        rows.append([
            WINDOW_METRICS.get(metric, metric),
            scale(base.get(metric)),
            scale(st.get("min")), scale(st.get("median")), scale(st.get("max")),
            (_pct(st.get("spread"), ".2f") if not absolute else f"{_n((st.get('spread') or 0) * 100, '.2f')} pp")
            if st.get("spread") is not None else "-",
            (_pct(st.get("threshold"), ".0f") if not absolute else f"{_n(st.get('threshold', 0) * 100, '.0f')} pp"),
            str(st.get("windows", "-")),
            verdict,
        ])  # fmt: skip
    return rows


STABILITY_HEAD = ["metric", "baseline", "min", "median", "max", "spread", "limit", "windows", "stable"]


def _metric_formatter(metric: str) -> Callable[[float | None], str]:
    if metric.endswith(("_p50", "_p95", "_p99")):
        return lambda v: "-" if v is None else f"{_ms(v)} ms"
    if metric == "error_rate":
        return lambda v: _pct(v, ".2f")
    if metric == "energy_per_token":
        return lambda v: _n(v, ".4f")
    return lambda v: _n(v, ".2f")


def _quiesce_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for ev in report["findings"].get("quiesce", []):
        d = ev.get("evidence") or {}
        mem = d.get("memory_used_bytes")
        rows.append([str(ev.get("window")), (ev.get("at") or "-").replace("T", " ").rstrip("Z"),
                     _pct(d.get("kv_cache_usage_ratio"), ".2f"),
                     _n(mem / 2**30 if isinstance(mem, int | float) else None, ".2f"),
                     "yes" if d.get("drained") else "no", _n(d.get("seconds"), ".1f")])
    return rows


QUIESCE_HEAD = ["window", "at (UTC)", "idle KV", "idle memory GiB", "drained", "seconds"]
ISSUE_KINDS = ("drift", "leak", "throttle", "canary", "errors", "target")


# ---------------------------------------------------------------------------------------------
# charts


def _time_axis(seconds: Sequence[float]) -> tuple[float, str]:
    end = max(seconds) if seconds else 0.0
    if end > 3 * 3600:
        return 3600.0, "elapsed since the run started (h)"
    if end > 180:
        return 60.0, "elapsed since the run started (min)"
    return 1.0, "elapsed since the run started (s)"


def _finding_windows(report: dict[str, Any]) -> list[int]:
    out: set[int] = set()
    for kind in ISSUE_KINDS:
        for ev in report["findings"].get(kind, []):
            if ev.get("window") is not None and ev.get("severity") in ("warning", "critical"):
                out.add(int(ev["window"]))
    return sorted(out)


def _band(base: float | None, thr: float, label: str, color: str, scale: float = 1.0) -> list[Band]:
    if base is None:
        return []
    return [Band(base * (1 - thr) * scale, base * (1 + thr) * scale, label, color, base * scale)]


def charts(report: dict[str, Any]) -> list[dict[str, str]]:
    """The report's charts: ``[{"id", "title", "group", "svg"}]`` (group: windows or telemetry)."""
    ws = report["series"]["windows"]
    xs = [float(x) if x is not None else None for x in ws["window"]]
    hollow = frozenset(float(x) for x, p in zip(ws["window"], ws["partial"], strict=False) if p and x is not None)
    base, thr, met = ws["baseline"], ws["threshold"], ws["metrics"]
    flagged = _finding_windows(report)
    win_spans = [Span(w - 0.5, w + 0.5, "window with a finding", FINDING_COLOR) for w in flagged]
    has_base = any(v is not None for v in base.values())
    out: list[dict[str, str]] = []
    note = "" if has_base else " (no baseline)"

    def add(cid: str, title: str, group: str, svg: str) -> None:
        out.append({"id": cid, "title": title, "group": group, "svg": svg})

    # relative change of the headline metrics vs the baseline, with the +-threshold band
    rel = ws["relative"]
    t0 = thr.get("e2e_p95", 0.05)
    series = [Series(WINDOW_METRICS[m], xs, [None if v is None else v * 100 for v in rel[m]], PALETTE[i],
                     hollow=hollow)
              for i, m in enumerate(("e2e_p95", "ttft_p95", "itl_p95", "output_tokens_per_second",
                                     "requests_per_second"))]  # fmt: skip
    add("chart-drift", "Change vs baseline", "windows", line_chart(
        series, title=f"Change vs baseline window{note}", y_label="% vs baseline", x_label="window",
        bands=[Band(-t0 * 100, t0 * 100, f"±{t0 * 100:g}% band", "#009E73", 0.0)] if has_base else [],
        spans=win_spans, x_integer=True, chart_id="chart-drift", width=1240, height=300,
        empty_text="no baseline window to compare with" if not has_base else "no windows"))

    for key, label in (("e2e", "End-to-end latency"), ("ttft", "Time to first token"),
                       ("itl", "Inter-token latency")):
        p50, p95 = met[f"{key}_p50"], met[f"{key}_p95"]
        vals = [v for v in p50 + p95 if v is not None]
        scale, unit = (1000.0, "ms") if not vals or max(vals) < 1.0 else (1.0, "s")
        bands = (_band(base[f"{key}_p95"], thr[f"{key}_p95"], f"p95 baseline ±{thr[f'{key}_p95'] * 100:g}%",
                       PALETTE[0], scale)
                 + _band(base[f"{key}_p50"], thr[f"{key}_p50"], f"p50 baseline ±{thr[f'{key}_p50'] * 100:g}%",
                         PALETTE[1], scale))  # fmt: skip
        add(f"chart-{key}", label, "windows", line_chart(
            [Series("p95", xs, [None if v is None else v * scale for v in p95], PALETTE[0], hollow=hollow),
             Series("p50", xs, [None if v is None else v * scale for v in p50], PALETTE[1], hollow=hollow)],
            title=f"{label} per window", y_label=unit, x_label="window", bands=bands, spans=win_spans,
            x_integer=True, chart_id=f"chart-{key}", y_zero=True))

    for metric, label, unit, color in (("requests_per_second", "Requests per second", "requests/s", PALETTE[4]),
                                       ("output_tokens_per_second", "Output tokens per second", "tokens/s",
                                        PALETTE[3]),
                                       ("energy_per_token", "Energy per output token", "J/token", PALETTE[5])):
        if metric == "energy_per_token" and all(v is None for v in met[metric]):
            continue  # no energy counter (no GPU telemetry): said in the telemetry note
        add(f"chart-{metric}", label, "windows", line_chart(
            [Series(unit, xs, met[metric], color, hollow=hollow)],
            title=f"{label} per window", y_label=unit, x_label="window",
            bands=_band(base[metric], thr[metric], f"baseline ±{thr[metric] * 100:g}%", color),
            spans=win_spans, x_integer=True, chart_id=f"chart-{metric}", y_zero=True))

    tel = report["series"]["telemetry"]
    t = tel["elapsed_seconds"]
    if not t:
        return out
    unit_s, x_label = _time_axis(t)
    tx = [v / unit_s for v in t]
    vals = tel["values"]
    run = report["run"]
    t_spans = [Span((g["from_unix"] - run["started_unix"]) / unit_s, (g["to_unix"] - run["started_unix"]) / unit_s,
                    "not observed (between segments)", GAP_COLOR) for g in run["gaps"]]
    for w in flagged:
        row = next((r for r in report["table"] if r["window"] == w), None)
        if row and row["start_unix"] is not None and row["duration_seconds"]:
            a = (row["start_unix"] - run["started_unix"]) / unit_s
            t_spans.append(Span(a, a + row["duration_seconds"] / unit_s, "window with a finding", FINDING_COLOR))
    per = "per minute" if tel["source"] == "samples" else "window means"
    gpus = tel.get("gpus")
    many = gpus is not None and gpus > 1

    def series(key: str, name: str, color: str, scale: float = 1.0, dash: bool = False) -> Series | None:
        v = vals.get(key)
        if not v or all(x is None for x in v):
            return None
        return Series(name, tx, [None if x is None else x * scale for x in v], color, dash=dash)

    def chart(cid: str, title: str, unit: str, items: list[Series | None], y_zero: bool = False) -> None:
        items_ = [s for s in items if s is not None]
        if items_:
            add(cid, title, "telemetry", line_chart(items_, title=f"{title} ({per})", y_label=unit, x_label=x_label,
                                                    spans=t_spans, chart_id=cid, y_zero=y_zero))

    if tel["device"]:
        chart("chart-memory", "Device memory used" + (f", sum of {gpus} GPUs" if many else ""), "GiB",
              [series("memory_used_bytes", "used", PALETTE[0], 1 / 2**30)])
    if tel["server"]:
        chart("chart-kv", "KV-cache usage", "%", [series("kv_cache_usage_ratio", "KV usage", PALETTE[5], 100.0)],
              y_zero=True)
    if tel["device"]:
        chart("chart-power", "Power" + (f", sum of {gpus} GPUs" if many else ""), "W",
              [series("power_watts", "power", PALETTE[1])])
        chart("chart-temperature", "Temperature" + (", hottest GPU" if many else ""), "°C",
              [series("temperature_celsius", "GPU", PALETTE[1]),
               series("memory_temperature_celsius", "memory", PALETTE[4], dash=True)])
        chart("chart-clock", "SM clock" + (", mean of GPUs" if many else ""), "MHz",
              [series("sm_clock_hertz", "SM clock", PALETTE[0], 1e-6),
               series("sm_clock_max_hertz", "max clock", "#777777", 1e-6, dash=True)])
    return out


# ---------------------------------------------------------------------------------------------
# JSON


def render_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2, ensure_ascii=False, allow_nan=False) + "\n"


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
    return f"{res}{tail}"


def _facts(report: dict[str, Any]) -> list[tuple[str, str]]:
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
        "; gaps not observed: " + ", ".join(f"{g['from']} → {g['to']} ({_dur(g['seconds'])})" for g in gaps)
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
        ("Length", f"{_dur(run['wall_seconds'])} wall clock, {_dur(run['observed_seconds'])} observed; planned "
                   f"{run['planned_duration'] or '-'}, windows of {run['window'] or '-'}, "
                   f"warm-up {run['warmup'] or '-'}"),
        ("Load", _load_text(run["load"])),
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
    L += _md_table(["", ""], [[f"**{k}**", val] for k, val in _facts(report)])
    L.append("")

    L += ["## Windows", ""]
    cols = _table_columns()
    if report["table"]:
        L += _md_table([c[0] for c in cols], [[f(r) for _, f in cols] for r in report["table"]],
                       ["--:"] * 15 + ["---"])
        if any(r["partial"] for r in report["table"]):
            L += ["", "\\* partial window"]
    else:
        L.append("No window was closed (the run ended during warm-up, or never reached the target).")
    L.append("")
    for note in report["series"]["telemetry"].get("notes") or []:
        L += [f"> {note}", ""]

    stab = _stability_rows(report)
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
                     f"{_n(d.get('period_windows'), 'g')} windows (~{_dur(d.get('period_seconds'))}), depth "
                     f"{_pct(d.get('depth'))}: {d.get('hint') or ''}")
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
    q = _quiesce_rows(report)
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
.PASS{background:#1a7f37}.FAIL{background:#cf222e}.INCOMPLETE{background:#6e7781}
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
    elif res == "PASS":
        P.append("<p>No finding failed the run: no drift beyond the thresholds with confidence; no leak, "
                 "throttle, canary or error-budget failure.</p>")
    P.append("</div></div>")
    P.append('<div class="card"><dl class="facts">' + "".join(f"<dt>{_h(k)}</dt><dd>{_h(val)}</dd>"
                                                              for k, val in _facts(report)) + "</dl></div>")

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
    P.append("<h2>Windows</h2>")
    cols = _table_columns()
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

    stab = _stability_rows(report)
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
                     f"every {_h(_n(d.get('period_windows'), 'g'))} windows (~{_h(_dur(d.get('period_seconds')))}), "
                     f"depth {_h(_pct(d.get('depth')))}: {_h(d.get('hint') or '')}</li>")
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
    q = _quiesce_rows(report)
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


# ---------------------------------------------------------------------------------------------

RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "json": render_json, "md": render_markdown, "html": render_html,
}


def render(report: dict[str, Any], fmt: str) -> str:
    try:
        return RENDERERS[fmt](report)
    except KeyError:
        raise ValueError(f"unknown report format {fmt!r}; use one of {', '.join(FORMATS)}") from None


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so a reader sees the old file or the new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_reports(state_dir: Path | str, run_id: str, reader: StoreReader | None = None) -> dict[str, Path]:
    """Build the report of ``run_id`` once and write report.json, report.md and report.html into
    ``<state_dir>/<run_id>/`` (each atomically). Returns {format: path}."""
    own = reader is None
    rd = StoreReader(state_dir) if reader is None else reader
    try:
        report = build_report(rd, run_id)
    finally:
        if own:
            rd.close()
    out_dir = Path(state_dir) / run_id
    paths: dict[str, Path] = {}
    for fmt in FORMATS:
        path = out_dir / REPORT_FILES[fmt]
        write_atomic(path, render(report, fmt))
        paths[fmt] = path
    return paths

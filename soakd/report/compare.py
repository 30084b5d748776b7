"""``soakd compare A/report.json B/report.json``: two runs' reports compared as an A/B run is,
offline (``soakd.analysis.ab``): window *k* of B against window *k* of A (the same time into
each run), per tracked metric. A is the reference.

B is *worse* when, on any tracked metric, it is confidently worse than A beyond the metric's
threshold

* over the run: the mean paired difference over every window both had eligible (``AbJudge.run_results``);
* or in a segment: the windows between change points of the paired differences
  (``AbJudge.segment_results``), so that a step half-way through B is not diluted by the windows
  before it.

Each is one run-level error family (Bonferroni over metrics, and over metrics × segments). The
per-window comparisons are in the JSON for evidence; they do not decide.

Every metric the configuration tracks (``analysis.drift.metrics``), every metric either run tracked
(its report's configuration) and ``goodput_ratio`` where both runs have it are compared; a metric
that cannot be (no data, too few samples per window for its quantile) is listed with why. Windows
that are not judged (partial, the target down, soakd itself impaired, too few requests, present in
one run only) are listed with why, as are windows one metric lacks.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from soakd.analysis.ab import AbJudge, AbResult
from soakd.analysis.drift import metric_value
from soakd.analysis.levels import level
from soakd.analysis.stats import QUANTILE_CI_MIN_COUNT, quantile_ci_min_count
from soakd.config import AnalysisConfig
from soakd.config.analysis import DriftConfig
from soakd.core.summary import WindowSummary
from soakd.core.tracked import METRICS, SERVER_MEANS
from soakd.report.format import finding_group_lines, finding_views, verdict_lines, verdict_title
from soakd.report.model import RunReport

__all__ = ["CompareError", "compare_reports", "compare_windows", "format_compare"]


class CompareError(Exception):
    """A report that cannot be compared (not a soakd JSON report, no windows)."""


def _load(path: Path) -> RunReport:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CompareError(f"cannot read a soakd JSON report from {path}: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("windows"), list) or not isinstance(doc.get("run"), dict):
        raise CompareError(f"{path} is not a soakd JSON report (soakd report --format json, or a run's report.json)")
    try:
        report = RunReport.load(doc)
    except ValueError as exc:
        raise CompareError(f"{path}: does not read as a soakd report: {exc}") from None
    if not report.windows:
        raise CompareError(f"{path} holds no window to compare")
    if not report.run.id:
        report.run.id = path.parent.name
    return report


def _tracked(report: RunReport) -> list[str]:
    """The metrics a report's own run tracked (its configuration's ``analysis.drift.metrics``)."""
    metrics = ((report.run.config.get("analysis") or {}).get("drift") or {}).get("metrics")
    return [m for m in metrics if isinstance(m, str) and m in METRICS] if isinstance(metrics, list) else []


def _has_goodput(windows: list[WindowSummary]) -> bool:
    return any(w.goodput is not None and w.goodput.requests for w in windows)


def compare_reports(a: Path, b: Path, config: AnalysisConfig | None = None) -> dict[str, Any]:
    """The comparison of B (candidate) against A (reference) as a JSON-able document."""
    ra, rb = _load(a), _load(b)
    doc = compare_windows(ra.windows, rb.windows, config, a_id=ra.run.id, b_id=rb.run.id,
                          also_tracked=[*_tracked(ra), *_tracked(rb)])
    doc["reference"].update({"report": str(a), "target": ra.run.target, "model": ra.run.model,
                             "verdict": _own_verdict(ra)})
    doc["candidate"].update({"report": str(b), "target": rb.run.target, "model": rb.run.model,
                             "verdict": _own_verdict(rb)})
    return doc


def _own_verdict(report: RunReport) -> dict[str, Any]:
    """A run's own verdict and findings, shown beside the paired comparison: a run can be no worse than the other
    on every tracked metric and still have failed on its own account (a hang, a leak, throttling, errors)."""
    views = finding_views(report.finding_events())
    return {
        "result": verdict_title(report),
        "exit_code": report.verdict.exit_code,
        "why": verdict_lines(report, brief=True),
        "findings": [{"kind": fv.finding.kind, "diagnosis": fv.finding.diagnosis, "severity": fv.finding.severity,
                      "fails": fv.fails, "where": fv.where, "message": fv.finding.message,
                      "evidence": fv.evidence_text} for fv in views],
        "lines": finding_group_lines(views, indent="  ") if views else [],
    }


# ---------------------------------------------------------------------------------------------
# why a window, or one metric of it, is not compared


def _window_reasons(w: WindowSummary, cfg: DriftConfig) -> list[str]:
    out = []
    if w.partial:
        out.append("partial")
    if w.target_down_seconds > 0:
        out.append(f"target down {w.target_down_seconds:.0f} s")
    if w.client is not None and w.client.impaired:
        why = getattr(w.client, "impaired_reason", None)
        out.append(f"soakd impaired ({why})" if why else "soakd impaired")
    if w.requests < cfg.min_requests:
        out.append(f"too few requests ({w.requests} < {cfg.min_requests})")
    return out


_NO_DATA = {
    "energy": "no data (no GPU energy readings)",
    "goodput": "no data (no scenario with an SLO)",
}


def _min_count(q: str, confidence: float) -> int:
    if abs(confidence - 0.95) < 1e-12:
        return QUANTILE_CI_MIN_COUNT[q]
    return quantile_ci_min_count({"p50": 0.5, "p95": 0.95, "p99": 0.99}[q], confidence)


def _metric_reason(w: WindowSummary, metric: str, cfg: DriftConfig) -> tuple[str, str | None, int | None] | None:
    """Why ``metric`` of a window that is judged at all has no level: (reason, what it needs, the
    window's sample count), or None when it has one."""
    if level(w, metric, cfg) is not None:
        return None
    spec = METRICS[metric]
    v, ci, n = metric_value(w, metric, confidence=cfg.confidence)
    if v is None:
        return _NO_DATA.get(spec.kind, "no data"), None, None
    if spec.kind == "quantile" and spec.q is not None and ci is None:
        need = _min_count(spec.q, cfg.confidence)
        if n >= need:
            return f"no {spec.q} interval in the report", None, None
        what = "streamed requests" if spec.field == "itl_seconds" else "requests"
        return f"too few {what} per window for {spec.q}", f"an interval needs {need}", n
    if n < cfg.min_requests:
        return "too few samples per window", f"at least {cfg.min_requests}", n
    if not spec.absolute and v <= 0:
        return "a value of 0", None, None
    return "no interval", None, None


def _why(reason: str, need: str | None, counts: list[int], one: bool) -> str:
    """``reason (need; it had n)``, or ``(need; these had lo..hi)`` for several windows."""
    bits = [need] if need else []
    if counts:
        lo, hi = min(counts), max(counts)
        bits.append(f"{'it' if one else 'these'} had {lo}" + (f"..{hi}" if hi != lo else ""))
    return reason + (f" ({'; '.join(bits)})" if bits else "")


def _in_windows(ks: list[int]) -> str:
    return f"in window{'s' if len(set(ks)) > 1 else ''} {_ranges(ks)}"


def _ranges(ks: list[int]) -> str:
    """0..3, 5, 7..9"""
    out: list[str] = []
    ks = sorted(set(ks))
    i = 0
    while i < len(ks):
        j = i
        while j + 1 < len(ks) and ks[j + 1] == ks[j] + 1:
            j += 1
        out.append(str(ks[i]) if i == j else f"{ks[i]}..{ks[j]}")
        i = j + 1
    return ", ".join(out)


# ---------------------------------------------------------------------------------------------
# the comparison


def compare_windows(a_windows: list[WindowSummary], b_windows: list[WindowSummary],
                    config: AnalysisConfig | None = None, *, a_id: str = "A", b_id: str = "B",
                    also_tracked: list[str] | None = None) -> dict[str, Any]:
    """B's windows against A's (see the module docstring); the document ``format_compare`` renders."""
    cfg = config or AnalysisConfig()
    metrics = list(cfg.drift.soakd_metrics)  # soakd's own measurements (the server's means: its runs' drift)
    for m in also_tracked or []:
        if m not in metrics and m not in SERVER_MEANS:
            metrics.append(m)
    if "goodput_ratio" not in metrics and _has_goodput(a_windows) and _has_goodput(b_windows):
        metrics.append("goodput_ratio")
    if metrics != list(cfg.drift.metrics):
        cfg = cfg.model_copy(update={"drift": cfg.drift.model_copy(update={"metrics": metrics})})
    dcfg = cfg.drift
    ref, cand = f"A:{a_id}", f"B:{b_id}"
    judge = AbJudge(cfg, ref, [cand], planned_windows=max(len(a_windows), len(b_windows)))
    per_window: list[AbResult] = []
    for w in a_windows:
        judge.add(ref, w, final=True)
    for w in b_windows:
        per_window += judge.add(cand, w, final=True)
    run = judge.run_results()
    segments, points = judge.segment_results()

    # windows judged for no metric, with why
    a_by = {w.window: w for w in a_windows}
    b_by = {w.window: w for w in b_windows}
    left_out: list[dict[str, Any]] = []
    both: list[int] = []
    for k in sorted(set(a_by) | set(b_by)):
        why = []
        if k not in a_by or k not in b_by:
            why.append(f"only in {'A' if k in a_by else 'B'}")
        else:
            for side, w in (("A", a_by[k]), ("B", b_by[k])):
                rs = _window_reasons(w, dcfg)
                if rs:
                    why.append(f"{side}: {', '.join(rs)}")
        if why:
            left_out.append({"window": k, "reason": "; ".join(why)})
        else:
            both.append(k)

    # per metric: the windows it rests on, those it lacks and why; a metric not compared says why
    run_by = {r.metric: r for r in run}
    rows: list[dict[str, Any]] = []
    for metric in metrics:
        paired = [d.window for d in judge.paired(cand, metric)]
        lacks: dict[tuple[str, str | None], list[tuple[int, int | None]]] = defaultdict(list)
        missing: list[dict[str, Any]] = []
        for k in both:
            if k in paired:
                continue
            why = []
            for side, w in (("A", a_by[k]), ("B", b_by[k])):
                r = _metric_reason(w, metric, dcfg)
                if r is not None:
                    why.append(f"{side}: " + _why(r[0], r[1], [r[2]] if r[2] is not None else [], True))
                    lacks[(r[0], r[1])].append((k, r[2]))
            missing.append({"window": k, "reason": "; ".join(why) or "no level"})
        reason = None
        if metric not in run_by:
            parts = []
            for (r, need), hits in sorted(lacks.items(), key=lambda kv: -len(kv[1])):
                counts = [n for _k, n in hits if n is not None]
                parts.append(f"{_why(r, need, counts, False)} {_in_windows([k for k, _n in hits])}")
            if not parts:
                parts.append("no window both runs had eligible" if not paired else
                             "only 1 window both runs had eligible (a comparison needs 2)")
                if left_out:
                    parts[-1] += f" ({len(left_out)} left out, listed below)"
            reason = "; ".join(parts)
        rows.append({"metric": metric, "label": METRICS[metric].label, "compared": metric in run_by,
                     "windows": paired, "change_points": points.get((metric, cand), []), "left_out": missing,
                     "reason": reason})

    worse: list[dict[str, Any]] = []
    for r in run:
        if r.tier == "confident" and r.direction == "worse":
            ws = next(x["windows"] for x in rows if x["metric"] == r.metric)
            worse.append({"metric": r.metric, "level": "run", "first_window": ws[0], "last_window": ws[-1],
                          "windows": ws, "ratio": r.ratio, "ci": list(r.ci), "threshold": r.threshold})
    for s in segments:
        if s.tier == "confident" and s.direction == "worse":
            ws = [k for k in next(x["windows"] for x in rows if x["metric"] == s.metric)
                  if s.first_window <= k <= s.last_window]
            worse.append({"metric": s.metric, "level": "segment", "first_window": s.first_window,
                          "last_window": s.last_window, "windows": ws, "ratio": s.ratio, "ci": list(s.ci),
                          "threshold": s.threshold})
    order = {m: i for i, m in enumerate(metrics)}
    worse.sort(key=lambda x: (order[x["metric"]], x["level"] != "run", x["first_window"]))
    return {
        "reference": {"run": a_id, "windows": len(a_windows)},
        "candidate": {"run": b_id, "windows": len(b_windows)},
        "metrics": rows,
        "run": [r.to_dict() for r in run],
        "segments": [s.to_dict() for s in segments],
        "windows": [r.to_dict() for r in per_window if r.tier is not None],
        "left_out": left_out,
        "worse": worse,
    }


# ---------------------------------------------------------------------------------------------
# text and Markdown


def _pct(absolute: bool, x: float) -> str:
    return f"{x * 100:+.1f}{'pp' if absolute else '%'}"


def _row(name: str, ws: str, r: dict[str, Any], absolute: bool) -> list[str]:
    verdict = f"{r['tier']} {r['direction']}" if r["tier"] else "no difference"
    return [name, ws, f"{r['reference_value']:.4g}", f"{r['value']:.4g}", _pct(absolute, r["ratio"]),
            f"{_pct(absolute, r['ci'][0])}..{_pct(absolute, r['ci'][1])}", verdict]


def _worse_text(doc: dict[str, Any]) -> str:
    if not doc["worse"]:
        lacking = [m["metric"] for m in doc["metrics"] if not m["compared"]]
        if len(lacking) == len(doc["metrics"]):
            return "B could not be compared with A on any tracked metric (why: above)"
        return "B is not confidently worse than A on any tracked metric" + (
            f" it could be compared on ({', '.join(lacking)}: not compared)" if lacking else "")
    parts = []
    for x in doc["worse"]:
        ab = METRICS[x["metric"]].absolute
        where = (f"over the run (windows {_ranges(x['windows'])}" if x["level"] == "run"
                 else f"in windows {x['first_window']}..{x['last_window']} (")
        parts.append(f"{x['metric']} {where}{', ' if x['level'] == 'run' else ''}{_pct(ab, x['ratio'])}, "
                     f"CI {_pct(ab, x['ci'][0])}..{_pct(ab, x['ci'][1])})")
    return "B is confidently worse on " + ", ".join(parts)


def format_compare(doc: dict[str, Any], markdown: bool = False) -> str:
    head = ["metric", "windows", "A", "B", "B vs A", "interval", "verdict"]
    run_by = {r["metric"]: r for r in doc["run"]}
    seg_by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in doc["segments"]:
        seg_by[s["metric"]].append(s)
    rows: list[list[str]] = []
    for m in doc["metrics"]:
        name = m["metric"]
        ab = METRICS[name].absolute
        if name not in run_by:
            rows.append([name, "0", "-", "-", "-", "-", f"not compared: {m['reason']}"])
            continue
        ws = m["windows"]
        rows.append(_row(name, f"{len(ws)} ({_ranges(ws)})", run_by[name], ab))
        for s in seg_by.get(name, []):
            n = sum(1 for k in ws if s["first_window"] <= k <= s["last_window"])
            rows.append(_row(f"  windows {s['first_window']}..{s['last_window']}", str(n), s, ab))
    a, b = doc["reference"], doc["candidate"]
    def who(x: dict[str, Any]) -> str:
        what = ", ".join(str(x[k]) for k in ("target", "model") if x.get(k))
        return f"{x['run']} ({what})" if what else str(x["run"])

    title = f"soakd compare: B {who(b)} against A {who(a)}"
    notes = [f"window {x['window']}: {x['reason']}" for x in doc["left_out"]]
    some = []
    for m in doc["metrics"]:
        if m["compared"] and m["left_out"]:
            by: dict[str, list[int]] = defaultdict(list)
            for x in m["left_out"]:
                by[x["reason"]].append(x["window"])
            some += [f"{m['metric']} {_in_windows(ks)}: {r}" for r, ks in by.items()]
    tail = _worse_text(doc)
    own = [(name, x["verdict"]) for name, x in (("A", a), ("B", b)) if x.get("verdict")]

    def own_head(name: str, v: dict[str, Any]) -> str:
        return f"{name}'s own verdict: {v['result']}" + (f" — {v['why'][0]}" if v["why"] else "") + \
            f" (exit code {v['exit_code']})"

    if markdown:
        lines = [f"# {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
        if notes:
            lines += ["", "Windows left out:", "", *[f"- {n}" for n in notes]]
        if some:
            lines += ["", "Left out of one metric:", "", *[f"- {n}" for n in some]]
        for name, v in own:
            lines += ["", f"## {own_head(name, v)}", "", *[f"- {w}" for w in v["why"][1:]]]
            if v["lines"]:
                lines += ["", "```", *v["lines"], "```"]
        return "\n".join([*lines, "", f"**{tail}.**", ""])
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *rows]]
    if notes:
        lines += ["windows left out:", *[f"  {n}" for n in notes]]
    if some:
        lines += ["left out of one metric:", *[f"  {n}" for n in some]]
    for name, v in own:
        lines += [own_head(name, v), *[f"   - {w}" for w in v["why"][1:]], *v["lines"]]
    return title + "\n" + "\n".join(lines) + f"\n{tail}\n"


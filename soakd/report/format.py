"""What the report's formats share, read from the typed ``RunReport``: number and duration formats,
the verdict's lines, the per-window table's columns, the stability, A/B and quiesce tables, each
finding as people read it, and the charts (inline SVG from ``soakd.report.svg``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from soakd.core.findings import Finding, evidence_pairs, fmt_bytes
from soakd.core.tracked import METRICS
from soakd.report.model import ReportEvent, ReportLoad, RunReport, WindowRow
from soakd.report.series import WINDOW_METRICS
from soakd.report.svg import PALETTE, Band, Series, Span, line_chart

FINDING_COLOR = "#E15759"
GAP_COLOR = "#888888"


# ---------------------------------------------------------------------------------------------
# formatting


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    ms = v * 1000
    return f"{ms:.2f}" if ms < 10 else f"{ms:.1f}" if ms < 100 else f"{ms:.0f}"


def fmt_num(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def fmt_pct(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else f"{format(v * 100, spec)}%"


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(round(seconds))
    if s < 60:
        return f"{seconds:.0f}s" if seconds >= 1 else f"{seconds:.2f}s"
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s"


def _errors(row: WindowRow) -> str:
    if not row.errors:
        return "0"
    return f"{row.errors} ({fmt_pct(row.error_rate, '.2f')})"


def load_text(load: ReportLoad) -> str:
    mix = load.mix or {}
    mix_s = ", ".join(f"{k}={v:g}" if isinstance(v, int | float) else f"{k}={v}" for k, v in mix.items()) or "-"
    if load.concurrency is not None:
        head = f"closed loop, concurrency {load.concurrency}"
    elif load.arrival == "trace":
        head = "trace replay, " + (f"its shape at {load.rate} req/s" if load.rate is not None else "its timestamps")
    elif load.rate is None:
        return "-"
    else:
        head = f"open loop, {load.rate} req/s ({load.arrival or 'poisson'})"
    return f"{head}; mix {mix_s}"


# ---------------------------------------------------------------------------------------------
# the verdict and the findings, as every format shows them


@dataclass(frozen=True)
class FindingView:
    """One finding as the formats show it (from the report's event of it)."""

    event: ReportEvent
    finding: Finding

    @property
    def fails(self) -> bool:
        return bool(self.event.fails)

    @property
    def where(self) -> str:
        return self.finding.where()

    @property
    def at(self) -> str:
        return self.event.at or "-"

    @property
    def evidence(self) -> list[tuple[str, str]]:
        return evidence_pairs(self.finding)

    @property
    def evidence_text(self) -> str:
        return "; ".join(f"{k} {v}" for k, v in self.evidence)

    @property
    def status(self) -> str:
        return "fails the run" if self.fails else "does not fail the run"

    @property
    def label(self) -> str:
        return self.finding.label


def finding_views(events: Sequence[ReportEvent]) -> list[FindingView]:
    out = []
    for e in events:
        f = e.finding
        if f is not None:
            out.append(FindingView(e, f))
    return out


def finding_group_lines(views: Sequence[FindingView], indent: str = " ") -> list[str]:
    """The findings in a few lines (the terminal summary, ``soakd compare``): a count, then one entry per
    diagnosis, failing first, then by severity: how often, where, the first one's words and evidence."""
    rank = {"critical": 2, "warning": 1}
    groups: dict[tuple[str, bool], list[FindingView]] = {}
    for fv in views:
        groups.setdefault((fv.finding.diagnosis, fv.fails), []).append(fv)
    order = sorted(groups.items(), key=lambda kv: (not kv[0][1], {"critical": 0, "warning": 1}.get(
        max((fv.finding.severity for fv in kv[1]), key=lambda s: rank.get(s, 0)), 2)))
    failing = sum(fv.fails for fv in views)
    lines = [f"{indent}findings ({len(views)}" + (f", {failing} failing the run" if failing else "") + "):"]
    for (_diag, fails), items in order:
        first = items[0]
        f = first.finding
        where = ", ".join(dict.fromkeys(fv.where for fv in items))
        count = f" x{len(items)}" if len(items) > 1 else ""
        lines.append(f"{indent} - [{f.severity}]{' FAILS' if fails else ''} {f.label}{count} ({where[:80]}): "
                     f"{f.message[:160]}")
        if first.evidence:
            lines.append(f"{indent}     evidence: {first.evidence_text[:200]}")
    return lines


def sections(report: RunReport) -> list[tuple[str, str, list[FindingView]]]:
    """(section id, title, its findings) in the registry's order; failing findings first."""
    return [(sid, title, finding_views(items)) for sid, title, items in report.by_section()]


def verdict_lines(report: RunReport, brief: bool = False) -> list[str]:
    """What the verdict rests on, one line each (below the verdict itself): FAIL lists the findings that
    failed the run (and any reason no finding of this report carries), INCONCLUSIVE the windows not
    judged and why, PASS what was judged. ``brief``: the failing findings without their messages."""
    v = report.verdict
    lines: list[str] = []
    if v.result == "INCOMPLETE":
        return list(v.reasons)
    failing = finding_views(report.failing())
    if v.result == "FAIL":
        covered = {fv.event.why for fv in failing}
        groups: dict[tuple[str, str], list[FindingView]] = {}
        rank = {"critical": 0, "warning": 1, "info": 2}
        failing.sort(key=lambda fv: rank.get(fv.finding.severity, 3))  # the worst first, then as they were made
        for fv in failing:  # one line per diagnosis (and target): where each of its findings was, the first one's words
            groups.setdefault((fv.finding.severity, fv.label), []).append(fv)
        for (severity, title), items in groups.items():
            wheres = list(dict.fromkeys(fv.where for fv in items))
            head = f"{severity} · {title}{f' x{len(items)}' if len(items) > 1 else ''} · {', '.join(wheres[:12])}" + (
                f", … (+{len(wheres) - 12})" if len(wheres) > 12 else "")
            lines.append(head if brief else f"{head}: {items[0].finding.message}")
        lines += [r for r in v.reasons if r not in covered]
    if v.result == "INCONCLUSIVE" and v.inconclusive:
        lines.append(v.inconclusive)
    lines += v.note_lines()
    # a baseline pool that moved or held a differing window: what the drift comparisons' reference is (issue 21)
    # (one found later, with the windows after the pool, says its window itself)
    unstable = [e for e in report.findings.get("baseline", [])
                if e.severity == "warning" and e.message.startswith("baseline not stable")]
    lines += [e.message if (e.evidence or {}).get("late") else f"{e.message} (said as the pool closed, window {e.window})"
              for e in unstable]
    lines += v.scope_lines()
    if v.result == "PASS" and not failing:
        lines.append("no finding failed the run")
        unjudged = [lk.source for lk in v.leaks if lk.status in ("insufficient", "no_data")]
        if unjudged:
            lines.append(f"memory not judged yet (too short a series for a leak judgement): {', '.join(unjudged)}")
    return lines


def verdict_title(report: RunReport) -> str:
    v = report.verdict
    tail = " (interim: the run is resumable and has not ended)" if v.interim and v.result != "INCOMPLETE" else ""
    return f"{v.result}{tail}"


AB_HEAD = ["candidate", "metric", "reference", "candidate value", "change", "interval", "windows", "verdict"]


def ab_rows(report: RunReport) -> list[list[str]]:
    """A/B runs: each candidate against the reference over the run (the verdict's ``ab``)."""
    out = []
    for r in report.verdict.ab or []:
        absolute = METRICS[r.metric].absolute if r.metric in METRICS else False
        pct = (lambda x: f"{x * 100:+.1f}pp") if absolute else (lambda x: f"{x * 100:+.1f}%")
        fmt = _metric_formatter(r.metric)
        out.append([r.target, r.metric, fmt(r.reference_value), fmt(r.value), pct(r.ratio),
                    f"{pct(r.ci[0]) if r.ci[0] is not None else '-inf'}..{pct(r.ci[1]) if r.ci[1] is not None else 'inf'}",
                    str(r.windows),
                    f"{r.tier} {r.direction}" if r.tier else "no difference"])
    return out


def table_columns(rows: Sequence[WindowRow] = ()) -> list[tuple[str, Callable[[WindowRow], str]]]:
    """The per-window table's columns (a goodput column where a window had requests under an SLO)."""
    cols: list[tuple[str, Callable[[WindowRow], str]]] = [
        ("window", lambda r: f"{r.window}{'*' if r.partial else ''}"),
        ("start (UTC)", lambda r: (r.start or "-")[5:16].replace("T", " ")),
        ("requests", lambda r: str(r.requests)),
        ("req/s", lambda r: fmt_num(r.requests_per_second, ".2f")),
        ("tok/s", lambda r: fmt_num(r.output_tokens_per_second, ".0f")),
        ("e2e p50 / p95 ms", lambda r: f"{_ms(r.e2e_p50)} / {_ms(r.e2e_p95)}"),
        ("TTFT p50 / p95 ms", lambda r: f"{_ms(r.ttft_p50)} / {_ms(r.ttft_p95)}"),
        ("ITL p50 / p95 ms", lambda r: f"{_ms(r.itl_p50)} / {_ms(r.itl_p95)}"),
        ("errors", _errors),
        ("goodput", lambda r: fmt_pct(r.goodput_ratio)),
        ("power W", lambda r: fmt_num(r.power_watts, ".0f")),
        ("temp °C", lambda r: fmt_num(r.temperature_celsius, ".0f")),
        ("SM MHz", lambda r: fmt_num(r.sm_clock_mhz, ".0f")),
        ("memory GiB", lambda r: fmt_num(r.memory_gib, ".2f")),
        ("KV %", lambda r: fmt_pct(r.kv_cache_usage_ratio)),
        ("prefix hit %", lambda r: fmt_pct(r.prefix_cache_hit_ratio)),
        ("J/token", lambda r: fmt_num(r.joules_per_token, ".3f")),
        ("notes", lambda r: ", ".join(r.notes)),
    ]
    if not any(r.goodput_ratio is not None for r in rows):
        cols = [c for c in cols if c[0] != "goodput"]
    if not any(r.prefix_cache_hit_ratio is not None for r in rows):  # a server without prefix-cache counters
        cols = [c for c in cols if c[0] != "prefix hit %"]
    return cols


def stability_rows(report: RunReport) -> list[list[str]]:
    base = report.series.windows.baseline
    rows = []
    for metric, st in report.verdict.stability.items():
        scale = _metric_formatter(metric)
        verdict = "yes" if st.stable else "no" if st.stable is False else "n/a"
        if st.stable is False and st.significant is False:
            verdict = "no (not significant)"
        elif st.stable is False and st.significant_by:
            verdict = f"no ({st.significant_by})"
        rows.append([
            WINDOW_METRICS.get(metric, METRICS[metric].label if metric in METRICS else metric),
            scale(base.get(metric)),
            scale(st.min), scale(st.median), scale(st.max),
            (fmt_pct(st.spread, ".2f") if not st.absolute else f"{fmt_num(st.spread * 100, '.2f')} pp")
            if st.spread is not None else "-",
            (fmt_pct(st.threshold, ".0f") if not st.absolute else f"{fmt_num(st.threshold * 100, '.0f')} pp"),
            str(st.windows),
            verdict,
        ])  # fmt: skip
    return rows


STABILITY_HEAD = ["metric", "baseline", "min", "median", "max", "spread", "limit", "windows", "stable"]


def _metric_formatter(metric: str) -> Callable[[float | None], str]:
    if metric.endswith(("_p50", "_p95", "_p99")):
        return lambda v: "-" if v is None else f"{_ms(v)} ms"
    if metric in ("error_rate", "goodput_ratio"):
        return lambda v: fmt_pct(v, ".2f")
    if metric == "energy_per_token":
        return lambda v: fmt_num(v, ".4f")
    return lambda v: fmt_num(v, ".2f")


def quiesce_rows(report: RunReport) -> list[list[str]]:
    rows = []
    for ev in report.findings.get("quiesce", []):
        d = ev.evidence or {}
        mem = d.get("memory_used_bytes")
        rows.append([str(ev.window), (ev.at or "-").replace("T", " ").rstrip("Z"),
                     fmt_pct(d.get("kv_cache_usage_ratio"), ".2f"),
                     fmt_num(mem / 2**30 if isinstance(mem, int | float) else None, ".2f"),
                     "yes" if d.get("drained") else "no", fmt_num(d.get("seconds"), ".1f")])
    return rows


QUIESCE_HEAD = ["window", "at (UTC)", "idle KV", "idle memory GiB", "drained", "seconds"]


def facts(report: RunReport) -> list[tuple[str, str]]:
    run = report.run
    bi = report.baseline_info
    if bi.source == "external":
        base = f"external: window {bi.external_window} of {bi.external_path}"
    elif bi.window is not None:
        base = f"window {bi.window} of this run"
    else:
        base = "none"
    if bi.note:
        base += f" ({bi.note})"
    seg = f"{len(run.segments)}" + (
        "; gaps not observed: " + ", ".join(f"{g.from_} → {g.to} ({fmt_duration(g.seconds)})" for g in run.gaps)
        if run.gaps else "")
    return [
        ("Run", run.id),
        ("Target", str(run.target or "-")),
        ("Model", str(run.model or "-")),
        ("Server", str(run.server_kind or "unknown")),
        ("soakd", str(run.soakd_version)),
        ("Started", str(run.started_at or "-")),
        ("Ended", f"{run.ended_at or '-'} ({run.stop_reason or 'no stop reason'})"),
        ("Status", str(run.state)),
        ("Length", f"{fmt_duration(run.wall_seconds)} wall clock, {fmt_duration(run.observed_seconds)} observed; planned "
                   f"{run.planned_duration or '-'}, windows of {run.window or '-'}, warm-up {run.warmup or '-'}"),
        ("Load", load_text(run.load)),
        ("Segments", seg),
        ("Baseline", base),
        ("Windows", f"{len(report.table)}" + (" (* partial: cut short by the end of the run, reported, not judged)"
                                              if any(r.partial for r in report.table) else "")),
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# charts


def _time_axis(seconds: Sequence[float]) -> tuple[float, str]:
    end = max(seconds) if seconds else 0.0
    if end > 3 * 3600:
        return 3600.0, "elapsed since the run started (h)"
    if end > 180:
        return 60.0, "elapsed since the run started (min)"
    return 1.0, "elapsed since the run started (s)"


def _band(base: float | None, thr: float, label: str, color: str, scale: float = 1.0) -> list[Band]:
    if base is None:
        return []
    return [Band(base * (1 - thr) * scale, base * (1 + thr) * scale, label, color, base * scale)]


def _spans(windows: list[int]) -> list[tuple[int, int]]:
    """Consecutive windows as (first, last) runs."""
    out: list[tuple[int, int]] = []
    for w in windows:
        if out and w == out[-1][1] + 1:
            out[-1] = (out[-1][0], w)
        else:
            out.append((w, w))
    return out


def charts(report: RunReport) -> list[dict[str, str]]:
    """The report's charts: ``[{"id", "title", "group", "svg"}]`` (group: windows or telemetry). Every
    window a warning or critical finding covers (its whole span) is shaded."""
    ws = report.series.windows
    xs = [float(x) if x is not None else None for x in ws.window]
    hollow = frozenset(float(x) for x, p in zip(ws.window, ws.partial, strict=False) if p and x is not None)
    base, thr, met = ws.baseline, ws.threshold, ws.metrics
    flagged = report.flagged_windows()
    win_spans = [Span(a - 0.5, b + 0.5, "window with a finding", FINDING_COLOR) for a, b in _spans(flagged)]
    has_base = any(v is not None for v in base.values())
    out: list[dict[str, str]] = []
    note = "" if has_base else " (no baseline)"

    def add(cid: str, title: str, group: str, svg: str) -> None:
        out.append({"id": cid, "title": title, "group": group, "svg": svg})

    # relative change of the headline metrics vs the baseline, with the +-threshold band
    rel = ws.relative
    t0 = thr.get("e2e_p95", 0.05)
    series = [Series(WINDOW_METRICS[m], xs, [None if v is None else v * 100 for v in rel.get(m, [])], PALETTE[i],
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

    tel = report.series.telemetry
    t = tel.elapsed_seconds
    if not t:
        return out
    unit_s, x_label = _time_axis(t)
    tx = [v / unit_s for v in t]
    vals = tel.values
    run = report.run
    t_spans = [Span((g.from_unix - run.started_unix) / unit_s, (g.to_unix - run.started_unix) / unit_s,
                    "not observed (between segments)", GAP_COLOR) for g in run.gaps]
    for a, b in _spans(flagged):
        first, last = report.row(a), report.row(b)
        if first is None or last is None or first.start_unix is None or last.start_unix is None:
            continue
        x0 = (first.start_unix - run.started_unix) / unit_s
        x1 = (last.start_unix + (last.duration_seconds or 0.0) - run.started_unix) / unit_s
        t_spans.append(Span(x0, x1, "window with a finding", FINDING_COLOR))
    per = "per minute" if tel.source == "samples" else "window means"
    gpus = tel.gpus
    many = gpus is not None and gpus > 1

    def series_of(key: str, name: str, color: str, scale: float = 1.0, dash: bool = False) -> Series | None:
        v = vals.get(key)
        if not v or all(x is None for x in v):
            return None
        return Series(name, tx, [None if x is None else x * scale for x in v], color, dash=dash)

    def chart(cid: str, title: str, unit: str, items: list[Series | None], y_zero: bool = False) -> None:
        items_ = [s for s in items if s is not None]
        if items_:
            add(cid, title, "telemetry", line_chart(items_, title=f"{title} ({per})", y_label=unit, x_label=x_label,
                                                    spans=t_spans, chart_id=cid, y_zero=y_zero))

    if tel.device:
        chart("chart-memory", "Device memory used" + (f", sum of {gpus} GPUs" if many else ""), "GiB",
              [series_of("memory_used_bytes", "used", PALETTE[0], 1 / 2**30)])
    if tel.server:
        chart("chart-kv", "KV-cache usage", "%", [series_of("kv_cache_usage_ratio", "KV usage", PALETTE[5], 100.0)],
              y_zero=True)
    if tel.device:
        chart("chart-power", "Power" + (f", sum of {gpus} GPUs" if many else ""), "W",
              [series_of("power_watts", "power", PALETTE[1])])
        chart("chart-temperature", "Temperature" + (", hottest GPU" if many else ""), "°C",
              [series_of("temperature_celsius", "GPU", PALETTE[1]),
               series_of("memory_temperature_celsius", "memory", PALETTE[4], dash=True)])
        chart("chart-clock", "SM clock" + (", mean of GPUs" if many else ""), "MHz",
              [series_of("sm_clock_hertz", "SM clock", PALETTE[0], 1e-6),
               series_of("sm_clock_max_hertz", "max clock", "#777777", 1e-6, dash=True)])
    return out


LEAK_HEAD = ["source", "judged on", "pattern", "growth per hour", "interval", "budget", "status"]


def leak_rows(report: RunReport) -> list[list[str]]:
    """The run's last leak judgement of each memory source (the verdict's ``leaks``): what grew, how
    fast, and whether it fails the run."""
    rows = []
    for lk in report.verdict.leaks:
        def f(v: float | None, sign: bool = True, unit: str = lk.unit) -> str:
            if v is None:
                return "-"
            if unit == "bytes":
                return fmt_bytes(v, sign) or "-"
            return f"{v * 100:{'+' if sign else ''}.2f} pts"

        status = lk.status
        if lk.fails:
            status += " (fails the run)"
        elif lk.pattern == "staircase" and not lk.suspected:
            status += " (memory steps, not a leak)"
        rows.append([lk.source, f"{lk.n_windows} {lk.points}", lk.pattern or "-",
                     f(lk.growth_per_hour) + "/h" if lk.growth_per_hour is not None else "-",
                     f"{f(lk.ci[0]) if lk.ci[0] is not None else '-inf'}..{f(lk.ci[1]) if lk.ci[1] is not None else 'inf'}"
                     "/h" if lk.ci else "-",
                     f(lk.budget, sign=False) + f" in {lk.horizon_hours:g} h", status])
    return rows

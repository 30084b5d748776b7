"""What the Markdown and HTML reports share: number and duration formats, the per-window table's
columns, the stability and quiesce tables, and the charts (inline SVG from ``soakd.report.svg``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

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


def _errors(row: dict[str, Any]) -> str:
    if not row["errors"]:
        return "0"
    return f"{row['errors']} ({fmt_pct(row['error_rate'], '.2f')})"


def load_text(load: dict[str, Any]) -> str:
    mix = load.get("mix") or {}
    mix_s = ", ".join(f"{k}={v:g}" if isinstance(v, int | float) else f"{k}={v}" for k, v in mix.items()) or "-"
    if load.get("concurrency") is not None:
        head = f"closed loop, concurrency {load['concurrency']}"
    elif load.get("rate") is None:
        return "-"
    else:
        head = f"open loop, {load.get('rate')} req/s ({load.get('arrival') or 'poisson'})"
    return f"{head}; mix {mix_s}"


AB_HEAD = ["candidate", "metric", "reference", "candidate value", "change", "interval", "windows", "verdict"]


def ab_rows(report: dict[str, Any]) -> list[list[str]]:
    """A/B runs: each candidate against the reference over the run (the verdict's ``ab``)."""
    from soakd.core.tracked import METRICS

    out = []
    for r in report["verdict"].get("ab") or []:
        absolute = METRICS[r["metric"]].absolute if r["metric"] in METRICS else False
        pct = (lambda x: f"{x * 100:+.1f}pp") if absolute else (lambda x: f"{x * 100:+.1f}%")
        fmt = _metric_formatter(r["metric"])
        out.append([r["target"], r["metric"], fmt(r.get("reference_value")), fmt(r.get("value")), pct(r["ratio"]),
                    f"{pct(r['ci'][0])}..{pct(r['ci'][1])}", str(r["windows"]),
                    f"{r['tier']} {r['direction']}" if r.get("tier") else "no difference"])
    return out


def table_columns(rows: Sequence[dict[str, Any]] = ()) -> list[tuple[str, Callable[[dict[str, Any]], str]]]:
    """The per-window table's columns (a goodput column where a window had requests under an SLO)."""
    cols = [
        ("window", lambda r: f"{r['window']}{'*' if r['partial'] else ''}"),
        ("start (UTC)", lambda r: (r["start"] or "-")[5:16].replace("T", " ")),
        ("requests", lambda r: str(r["requests"])),
        ("req/s", lambda r: fmt_num(r["requests_per_second"], ".2f")),
        ("tok/s", lambda r: fmt_num(r["output_tokens_per_second"], ".0f")),
        ("e2e p50 / p95 ms", lambda r: f"{_ms(r['e2e_p50'])} / {_ms(r['e2e_p95'])}"),
        ("TTFT p50 / p95 ms", lambda r: f"{_ms(r['ttft_p50'])} / {_ms(r['ttft_p95'])}"),
        ("ITL p50 / p95 ms", lambda r: f"{_ms(r['itl_p50'])} / {_ms(r['itl_p95'])}"),
        ("errors", _errors),
        ("goodput", lambda r: fmt_pct(r.get("goodput_ratio"))),
        ("power W", lambda r: fmt_num(r["power_watts"], ".0f")),
        ("temp °C", lambda r: fmt_num(r["temperature_celsius"], ".0f")),
        ("SM MHz", lambda r: fmt_num(r["sm_clock_mhz"], ".0f")),
        ("memory GiB", lambda r: fmt_num(r["memory_gib"], ".2f")),
        ("KV %", lambda r: fmt_pct(r["kv_cache_usage_ratio"])),
        ("J/token", lambda r: fmt_num(r["joules_per_token"], ".3f")),
        ("notes", lambda r: ", ".join(r["notes"])),
    ]
    if not any(r.get("goodput_ratio") is not None for r in rows):
        cols = [c for c in cols if c[0] != "goodput"]
    return cols


def stability_rows(report: dict[str, Any]) -> list[list[str]]:
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
            (fmt_pct(st.get("spread"), ".2f") if not absolute else f"{fmt_num((st.get('spread') or 0) * 100, '.2f')} pp")
            if st.get("spread") is not None else "-",
            (fmt_pct(st.get("threshold"), ".0f") if not absolute else f"{fmt_num(st.get('threshold', 0) * 100, '.0f')} pp"),
            str(st.get("windows", "-")),
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


def quiesce_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for ev in report["findings"].get("quiesce", []):
        d = ev.get("evidence") or {}
        mem = d.get("memory_used_bytes")
        rows.append([str(ev.get("window")), (ev.get("at") or "-").replace("T", " ").rstrip("Z"),
                     fmt_pct(d.get("kv_cache_usage_ratio"), ".2f"),
                     fmt_num(mem / 2**30 if isinstance(mem, int | float) else None, ".2f"),
                     "yes" if d.get("drained") else "no", fmt_num(d.get("seconds"), ".1f")])
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

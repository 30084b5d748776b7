"""A sweep's document (``SweepRunner.document``) as a terminal table, Markdown and HTML (the
HTML with charts: throughput and latency against the load level, like the run report's)."""

from __future__ import annotations

import html
import math
from typing import Any

from soakd.report.svg import PALETTE, Series, line_chart

HEAD = ["step", "level", "req/s", "±", "tok/s", "e2e p50 ms", "e2e p95 ms", "TTFT p95 ms", "ITL p95 ms",
        "errors", "goodput", "status"]


def _ms(q: dict[str, Any]) -> str:
    v = q.get("value")
    if v is None:
        return "-"
    ci = q.get("ci")
    text = f"{v * 1000:.1f}"
    return text + (f" [{ci[0] * 1000:.1f}, {ci[1] * 1000:.1f}]" if ci else "")


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f}%"


def rows(doc: dict[str, Any], *, intervals: bool = True) -> list[list[str]]:
    out = []
    for s in doc["steps"]:
        lat = s["latency"]
        ms = _ms if intervals else (lambda q: "-" if q.get("value") is None else f"{q['value'] * 1000:.1f}")
        status = s["status"] + (f" ({s['note']})" if s.get("note") else "")
        out.append([str(s["index"]), f"{s['level']:g}", f"{s['requests_per_second']:.2f}",
                    f"{1.96 * s['requests_per_second_se']:.2f}", f"{s['output_tokens_per_second']:.0f}",
                    ms(lat["e2e_p50"]), ms(lat["e2e_p95"]), ms(lat["ttft_p95"]), ms(lat["itl_p95"]),
                    _pct(s["error_rate"]), _pct(s.get("goodput_ratio")), status])
    return out


def headline(doc: dict[str, Any]) -> str:
    knee = doc.get("knee")
    unit = "concurrency" if doc["mode"] == "concurrency" else "req/s"
    if knee is None and doc.get("stop_reason") == "end":
        head = "no knee within the levels"
    elif knee is None:
        head = "no knee found"
    else:
        head = (f"knee at {unit} {knee['level']:g}: {knee['requests_per_second']:.2f} req/s, "
                f"{knee['output_tokens_per_second']:.0f} output tokens/s")
    why = doc.get("message") or doc.get("stop_reason_text") or ""
    best = doc.get("best_goodput")
    tail = (f"; best goodput at {unit} {best['level']:g}: {best['goodput_per_second']:.2f} req/s within the SLOs"
            if best else "")
    return f"{head} ({doc.get('stop_reason')}: {why}){tail}"


def terminal(doc: dict[str, Any]) -> str:
    table = [HEAD, *rows(doc, intervals=False)]
    widths = [max(len(r[i]) for r in table) for i in range(len(HEAD) - 1)]
    lines = []
    for r in table:
        lines.append("  ".join(c.rjust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    return (f"soakd sweep {doc['sweep']} of {doc.get('target')} ({doc.get('model')}), {doc['mode']}\n"
            + "\n".join(lines) + "\n" + headline(doc) + "\n")


def _md(c: str) -> str:
    return c.replace("|", "\\|")


def markdown(doc: dict[str, Any]) -> str:
    L = [f"# soakd sweep {doc['sweep']}", "", f"**{_md(headline(doc))}**", "",
         f"Target {doc.get('target')}, model {doc.get('model')}, {doc['mode']} levels "
         f"{', '.join(f'{v:g}' for v in doc['levels'])}; {doc.get('step_seconds', 0):g}s per step after "
         f"{doc.get('step_warmup_seconds', 0):g}s warm-up; mix "
         f"{', '.join(f'{k}={v:g}' for k, v in (doc.get('mix') or {}).items())}.", "",
         "| " + " | ".join(HEAD) + " |", "|" + "|".join(["--:"] * (len(HEAD) - 1) + ["---"]) + "|"]
    L += ["| " + " | ".join(_md(c) for c in r) + " |" for r in rows(doc)]
    L += ["", "± is the 95% interval of requests/s (batch means over each step's sub-windows); latency "
          "quantiles carry their 95% intervals in brackets.", ""]
    return "\n".join(L)


def geometric(levels: list[float]) -> bool:
    """Levels that grow by a factor (1, 2, 4, 8...: the sweep's default) rather than by a step: drawn
    on a logarithmic axis, where each step is as wide as the next."""
    if len(levels) < 3 or min(levels) <= 0:
        return False
    ratios = [b / a for a, b in zip(levels, levels[1:])]
    mean = sum(ratios) / len(ratios)
    return mean > 1.2 and all(abs(r / mean - 1) < 0.15 for r in ratios)


def charts(doc: dict[str, Any]) -> list[str]:
    levels = [float(s["level"]) for s in doc["steps"]]
    x_label = "concurrency" if doc["mode"] == "concurrency" else "offered req/s"
    axis: dict[str, Any] = {}
    xs: list[float] = levels
    if geometric(levels):  # log2 of the level, labelled with the level itself
        xs = [math.log2(v) for v in levels]
        axis = {"x_integer": True, "x_format": lambda v: f"{2 ** v:g}"}
        x_label += " (log scale)"
    tput = line_chart([Series("requests/s", xs, [s["requests_per_second"] for s in doc["steps"]], PALETTE[0])],
                      title="Throughput by load level", y_label="requests/s", x_label=x_label, y_zero=True,
                      chart_id="sweep-throughput", **axis)
    lat = line_chart([Series(label, xs, [s["latency"][key]["value"] * 1000 if s["latency"][key]["value"] is not None
                                         else None for s in doc["steps"]], PALETTE[i + 1])
                      for i, (key, label) in enumerate((("e2e_p50", "e2e p50"), ("e2e_p95", "e2e p95"),
                                                        ("ttft_p95", "TTFT p95")))],
                     title="Latency by load level", y_label="ms", x_label=x_label, y_zero=True,
                     chart_id="sweep-latency", **axis)
    return [tput, lat]


def html_page(doc: dict[str, Any]) -> str:
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in HEAD)
    body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows(doc))
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>soakd sweep {e(doc['sweep'])}</title>"
            "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}</style></head><body>"
            f"<h1>soakd sweep {e(doc['sweep'])}</h1><p><b>{e(headline(doc))}</b></p>"
            f"<p>Target {e(str(doc.get('target')))}, model {e(str(doc.get('model')))}, {e(doc['mode'])}.</p>"
            + "".join(charts(doc))
            + f"<table><tr>{head}</tr>{body}</table></body></html>\n")

